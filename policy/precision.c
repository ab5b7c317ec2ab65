/* precision.c — precision=auto: fp32 or bf16, whichever runs the model faster on this node, a clearly slower one pruned early. */
#include "policy.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { FP32 = HAPI_PRECISION_FP32, BF16 = HAPI_PRECISION_BF16 };

/* This machine's CPU model name, "" if /proc/cpuinfo does not say. */
static void cpu_model(char *buf, size_t size)
{
    char line[256];
    FILE *f = fopen("/proc/cpuinfo", "r");
    buf[0] = '\0';
    while (f && fgets(line, sizeof(line), f)) {
        char *colon = strchr(line, ':');
        if (strncmp(line, "model name", 10) == 0 && colon) {
            colon += 1 + (colon[1] == ' ');
            colon[strcspn(colon, "\n")] = '\0';
            snprintf(buf, size, "%s", colon);
            break;
        }
    }
    if (f)
        fclose(f);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(*v), cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

struct bench {
    hapi_model *m[2];
    int to, batch;
    const float *in;
    void *out;
    size_t out_size;
    double seconds[2];
};

/* One run of candidate p: its wall time per sample in *ms. */
static int run_once(struct bench *b, int p, double *ms, hapi_error *err)
{
    uint64_t t0 = hapi_now_ns();
    int rc = hapi_model_run(b->m[p], b->to, b->in, b->batch, HAPI_DTYPE_FP32, b->out,
                            b->out_size, err);
    double s = (double)(hapi_now_ns() - t0) / 1e9;
    b->seconds[p] += s;
    *ms = s * 1e3 / b->batch;
    return rc;
}

/* The candidate to prune, of two whose figures are a and b (by precision), at factor; -1. */
static int slower(const double v[2], double factor)
{
    if (v[BF16] > factor * v[FP32])
        return BF16;
    if (v[FP32] > factor * v[BF16])
        return FP32;
    return -1;
}

static void fill_check(hapi_model *bf16, int to, hapi_precision_choice *out)
{
    out->bf16_min_cosine = 1.0;
    for (int i = 0; i < to; i++) {
        hapi_stage_info info;
        if (hapi_model_stage(bf16, i, &info) < 0)
            continue;
        out->bf16_moved += info.precision == FP32;
        out->bf16_min_cosine = fmin(out->bf16_min_cosine, info.check_cosine);
    }
}

static int measure(struct bench *b, hapi_precision_choice *out, hapi_error *err)
{
    double times[2][HAPI_PRECISION_ROUNDS], best[2] = { INFINITY, INFINITY };
    int rc;
    for (int p = 0; p < 2; p++)
        if ((rc = run_once(b, p, &out->warmup_ms[p], err)) < 0)
            return rc;
    out->pruned = slower(out->warmup_ms, HAPI_PRECISION_PRUNE_WARMUP);
    for (int r = 0; r < HAPI_PRECISION_ROUNDS && out->pruned < 0; r++) {
        for (int k = 0; k < 2; k++) {
            int p = (r + k) % 2; /* turns: fp32 first, then bf16 first, ... */
            double ms;
            if ((rc = run_once(b, p, &ms, err)) < 0)
                return rc;
            times[p][out->runs[p]++] = ms;
            best[p] = fmin(best[p], ms);
        }
        out->pruned = slower(best, HAPI_PRECISION_PRUNE);
    }
    for (int p = 0; p < 2; p++)
        out->ms[p] = out->runs[p] ? median(times[p], out->runs[p]) : 0;
    return 0;
}

int hapi_precision_choose(hapi_model *fp32, hapi_model *bf16, int size, int to,
                          hapi_precision_choice *out, hapi_error *err)
{
    memset(out, 0, sizeof(*out));
    out->pruned = -1;
    out->to = to;
    out->batch = HAPI_PRECISION_BATCH;
    cpu_model(out->cpu, sizeof(out->cpu));
    hapi_stage_info last;
    if (!fp32 || !bf16 || size < 1 || to < 1 || to > hapi_model_num_stages(fp32) ||
        hapi_model_stage(fp32, to - 1, &last) < 0 || last.ndim == 0)
        return hapi_error_set(err, HAPI_EINVAL, "precision=auto: no probed model to time");
    fill_check(bf16, to, out);

    struct bench b = { .m = { [FP32] = fp32, [BF16] = bf16 }, .to = to, .batch = out->batch };
    size_t in_elems = (size_t)b.batch * 3 * (size_t)size * (size_t)size, out_elems = 1;
    for (int d = 0; d < last.ndim; d++)
        out_elems *= (size_t)last.shape[d];
    b.out_size = (size_t)b.batch * out_elems * sizeof(float);
    float *in = malloc(in_elems * sizeof(float));
    b.out = malloc(b.out_size);
    int rc = 0;
    if (!in || !b.out) {
        rc = hapi_error_set(err, -ENOMEM, "precision=auto: out of memory");
        goto out;
    }
    /* a normalized image's range; the values do not change the time of dense arithmetic */
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < in_elems; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        in[i] = (float)((double)(x >> 11) / 9007199254740992.0 * 4.0 - 2.0);
    }
    b.in = in;
    if ((rc = measure(&b, out, err)) < 0)
        goto out;
    out->seconds = b.seconds[FP32] + b.seconds[BF16];
    if (out->pruned >= 0) {
        out->pruned_seconds = b.seconds[out->pruned];
        out->precision = out->pruned == BF16 ? FP32 : BF16;
        const double *v = out->runs[out->pruned] ? out->ms : out->warmup_ms;
        snprintf(out->why, sizeof(out->why),
                 "%s pruned: %.3g ms a sample%s against %s's %.3g",
                 hapi_precision_name(out->pruned),
                 v[out->pruned], out->runs[out->pruned] ? "" : " at the warm-up",
                 hapi_precision_name(out->precision), v[out->precision]);
    } else {
        out->precision = out->ms[BF16] <= HAPI_PRECISION_MARGIN * out->ms[FP32] ? BF16 : FP32;
        snprintf(out->why, sizeof(out->why),
                 "bf16 %.3g ms a sample, fp32 %.3g: %s (bf16 needs %.0f%% of fp32's time or "
                 "less)", out->ms[BF16], out->ms[FP32],
                 out->precision == BF16 ? "bf16 is faster" : "fp32, the reference, is as fast",
                 100 * HAPI_PRECISION_MARGIN);
    }
out:
    free(in);
    free(b.out);
    return rc;
}

char *hapi_precision_choice_to_json(const hapi_precision_choice *c)
{
    json_t *j = json_pack(
        "{s:i, s:s, s:s, s:i, s:i, s:{s:f, s:f}, s:{s:f, s:f}, s:{s:i, s:i}, s:s?, s:f, s:f, "
        "s:i, s:f, s:s}",
        "version", 1, "cpu", c->cpu, "chosen", hapi_precision_name(c->precision), "batch",
        c->batch, "to", c->to,
        "ms", "fp32", c->ms[FP32], "bf16", c->ms[BF16],
        "warmup_ms", "fp32", c->warmup_ms[FP32], "bf16", c->warmup_ms[BF16],
        "runs", "fp32", c->runs[FP32], "bf16", c->runs[BF16],
        "pruned", c->pruned >= 0 ? hapi_precision_name(c->pruned) : NULL, "seconds", c->seconds,
        "pruned_seconds", c->pruned_seconds, "bf16_moved", c->bf16_moved, "bf16_min_cosine",
        c->bf16_min_cosine, "why", c->why);
    char *text = j ? json_dumps(j, JSON_INDENT(1) | JSON_SORT_KEYS) : NULL;
    json_decref(j);
    return text;
}

int hapi_precision_choice_load(const char *path, hapi_precision_choice *out, hapi_error *err)
{
    json_error_t jerr;
    memset(out, 0, sizeof(*out));
    if (access(path, F_OK) != 0)
        return hapi_error_set(err, -errno, "%s: %s", path, strerror(errno));
    json_t *j = json_load_file(path, 0, &jerr);
    if (!j)
        return hapi_error_set(err, HAPI_EINVAL, "%s: %s", path, jerr.text);
    const char *chosen = NULL, *pruned = NULL, *why = NULL, *cpu = NULL;
    json_t *pruned_j = NULL; /* a string, or null when neither was pruned */
    char here[sizeof(out->cpu)];
    cpu_model(here, sizeof(here));
    int version = 0;
    int rc = json_unpack_ex(
        j, &jerr, 0,
        "{s:i, s:s, s:s, s:i, s:i, s:{s:F, s:F}, s:{s:F, s:F}, s:{s:i, s:i}, s?o, s:F, s:F, "
        "s:i, s:F, s:s}",
        "version", &version, "cpu", &cpu, "chosen", &chosen, "batch", &out->batch, "to", &out->to,
        "ms", "fp32", &out->ms[FP32], "bf16", &out->ms[BF16],
        "warmup_ms", "fp32", &out->warmup_ms[FP32], "bf16", &out->warmup_ms[BF16],
        "runs", "fp32", &out->runs[FP32], "bf16", &out->runs[BF16],
        "pruned", &pruned_j, "seconds", &out->seconds, "pruned_seconds", &out->pruned_seconds,
        "bf16_moved", &out->bf16_moved, "bf16_min_cosine", &out->bf16_min_cosine, "why", &why);
    if (rc == 0 && (version != 1 || (strcmp(chosen, "fp32") != 0 && strcmp(chosen, "bf16") != 0)))
        rc = -1, snprintf(jerr.text, sizeof(jerr.text), "version %d, chosen %s", version, chosen);
    else if (rc == 0 && strcmp(cpu, here) != 0)
        rc = -1, snprintf(jerr.text, sizeof(jerr.text), "measured on another CPU (%s)", cpu);
    if (rc == 0) {
        pruned = json_string_value(pruned_j);
        out->precision = strcmp(chosen, "bf16") == 0 ? BF16 : FP32;
        out->pruned = !pruned ? -1 : strcmp(pruned, "bf16") == 0 ? BF16 : FP32;
        snprintf(out->why, sizeof(out->why), "%s", why);
        snprintf(out->cpu, sizeof(out->cpu), "%s", cpu);
        out->stored = 1;
    }
    json_decref(j);
    return rc == 0 ? 0 : hapi_error_set(err, HAPI_EINVAL, "%s: %s", path, jerr.text);
}

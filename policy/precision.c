/* precision.c — precision=auto: fp32, bf16 or int8, the fastest within the fidelity bound on this node, a clearly slower one pruned early. */
#include "policy.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

enum { N = HAPI_PRECISION_CANDIDATES };

static const char *state_name(int state)
{
    static const char *names[] = { "absent", "timed", "pruned", "below_bound" };
    return state >= 0 && state < 4 ? names[state] : "absent";
}

struct bench {
    hapi_model *const *m;
    int to, batch;
    const float *in;
    void *out;
    size_t out_size;
};

/* One run of candidate p: its wall time per sample in *ms. */
static int run_once(struct bench *b, hapi_precision_candidate *c, int p, double *ms,
                    hapi_error *err)
{
    uint64_t t0 = hapi_now_ns();
    int rc = hapi_model_run(b->m[p], b->to, b->in, b->batch, HAPI_DTYPE_FP32, b->out,
                            b->out_size, err);
    double s = (double)(hapi_now_ns() - t0) / 1e9;
    c->seconds += s;
    *ms = s * 1e3 / b->batch;
    return rc;
}

/* Prunes each candidate still timed whose v (by precision) is over factor times the least;
   returns how many are left. */
static int prune(hapi_precision_choice *out, const double v[N], double factor)
{
    double least = INFINITY;
    int left = 0;
    for (int p = 0; p < N; p++)
        if (out->c[p].state == HAPI_CANDIDATE_TIMED)
            least = fmin(least, v[p]);
    for (int p = 0; p < N; p++)
        if (out->c[p].state == HAPI_CANDIDATE_TIMED) {
            if (v[p] > factor * least)
                out->c[p].state = HAPI_CANDIDATE_PRUNED;
            else
                left++;
        }
    return left;
}

/* Each candidate's check: the stages of [0, to) in fp32, the lowest cosine and the freeze
   point's (a stage's 0 is fp32 on fp32's inputs: exact), and whether it is within the bound. */
static void fill_check(hapi_model *m, int p, int to, hapi_precision_choice *out)
{
    hapi_precision_candidate *c = &out->c[p];
    c->min_cosine = c->cosine = 1.0;
    c->state = HAPI_CANDIDATE_TIMED;
    for (int i = 0; p != HAPI_PRECISION_FP32 && i < to; i++) {
        hapi_stage_info info;
        if (hapi_model_stage(m, i, &info) < 0)
            continue;
        c->moved += info.precision == HAPI_PRECISION_FP32;
        if (info.check_cosine != 0.0)
            c->min_cosine = fmin(c->min_cosine, info.check_cosine);
        if (info.check_cosine != 0.0 && i == to - 1)
            c->cosine = info.check_cosine;
    }
    if (c->cosine < HAPI_PRECISION_MIN_COSINE)
        c->state = HAPI_CANDIDATE_BELOW;
}

static int measure(struct bench *b, hapi_precision_choice *out, hapi_error *err)
{
    double times[N][HAPI_PRECISION_ROUNDS], best[N], warm[N];
    int rc, order[N], n = 0;
    for (int p = 0; p < N; p++) {
        best[p] = warm[p] = INFINITY;
        if (out->c[p].state != HAPI_CANDIDATE_TIMED)
            continue;
        order[n++] = p;
        for (int w = 0; w < HAPI_PRECISION_WARMUPS; w++)
            if ((rc = run_once(b, &out->c[p], p, &out->c[p].warmup_ms, err)) < 0)
                return rc;
        warm[p] = out->c[p].warmup_ms;
    }
    int left = prune(out, warm, HAPI_PRECISION_PRUNE_WARMUP);
    for (int r = 0; r < HAPI_PRECISION_ROUNDS && left > 1; r++) {
        for (int k = 0; k < n; k++) {
            int p = order[(r + k) % n]; /* turns: each goes first in one round */
            hapi_precision_candidate *c = &out->c[p];
            double ms;
            if (c->state != HAPI_CANDIDATE_TIMED)
                continue;
            if ((rc = run_once(b, c, p, &ms, err)) < 0)
                return rc;
            times[p][c->runs++] = ms;
            best[p] = fmin(best[p], ms);
        }
        left = prune(out, best, HAPI_PRECISION_PRUNE);
    }
    for (int p = 0; p < N; p++)
        out->c[p].ms = out->c[p].runs ? median(times[p], out->c[p].runs) : 0;
    return 0;
}

/* A candidate's figure for the why: its median, or its warm-up where it has no timed run. */
static double figure(const hapi_precision_candidate *c)
{
    return c->runs ? c->ms : c->warmup_ms;
}

/* The choice among those left, and the sentence that says what became of each. */
static void choose(hapi_precision_choice *out)
{
    int pick = -1;
    for (int p = 0; p < N; p++) {
        const hapi_precision_candidate *c = &out->c[p];
        if (c->state == HAPI_CANDIDATE_TIMED &&
            (pick < 0 || figure(c) <= HAPI_PRECISION_MARGIN * figure(&out->c[pick])))
            pick = p;
    }
    out->precision = pick;
    size_t len = (size_t)snprintf(out->why, sizeof(out->why), "%s", hapi_precision_name(pick));
    const char *sep = ": ";
    for (int p = 0; p < N && len < sizeof(out->why); p++, sep = "; ") {
        const hapi_precision_candidate *c = &out->c[p];
        const char *name = hapi_precision_name(p);
        char *at = out->why + len;
        size_t room = sizeof(out->why) - len;
        if (c->state == HAPI_CANDIDATE_TIMED)
            len += (size_t)snprintf(at, room, "%s%s %.3g ms a sample%s", sep, name, figure(c),
                                    c->runs ? "" : " at the warm-up");
        else if (c->state == HAPI_CANDIDATE_PRUNED)
            len += (size_t)snprintf(at, room, "%s%s pruned, %.3g ms a sample%s", sep, name,
                                    figure(c), c->runs ? "" : " at the warm-up");
        else if (c->state == HAPI_CANDIDATE_BELOW)
            len += (size_t)snprintf(at, room, "%s%s not timed, cosine %.4f to fp32 under %g",
                                    sep, name, c->cosine, HAPI_PRECISION_MIN_COSINE);
        else
            len += (size_t)snprintf(at, room, "%s%s does not load", sep, name);
    }
    if (len < sizeof(out->why))
        snprintf(out->why + len, sizeof(out->why) - len,
                 " (a coarser one needs %.0f%% of a finer one's time or less)",
                 100 * HAPI_PRECISION_MARGIN);
}

int hapi_precision_choose(hapi_model *const m[HAPI_PRECISION_CANDIDATES],
                          const double *setup_seconds, int size, int to,
                          hapi_precision_choice *out, hapi_error *err)
{
    memset(out, 0, sizeof(*out));
    out->to = to;
    out->batch = HAPI_PRECISION_BATCH;
    cpu_model(out->cpu, sizeof(out->cpu));
    hapi_stage_info last;
    hapi_model *fp32 = m[HAPI_PRECISION_FP32];
    if (!fp32 || size < 1 || to < 1 || to > hapi_model_num_stages(fp32) ||
        hapi_model_stage(fp32, to - 1, &last) < 0 || last.ndim == 0)
        return hapi_error_set(err, HAPI_EINVAL, "precision=auto: no probed model to time");
    for (int p = 0; p < N; p++) {
        if (m[p])
            fill_check(m[p], p, to, out);
        out->c[p].setup_seconds = setup_seconds ? setup_seconds[p] : 0;
    }

    struct bench b = { .m = m, .to = to, .batch = out->batch };
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
    for (int p = 0; p < N; p++) {
        const hapi_precision_candidate *c = &out->c[p];
        out->seconds += c->seconds + c->setup_seconds;
        if (c->state == HAPI_CANDIDATE_PRUNED || c->state == HAPI_CANDIDATE_BELOW)
            out->pruned_seconds += c->seconds + c->setup_seconds;
    }
    choose(out);
out:
    free(in);
    free(b.out);
    return rc;
}

static json_t *candidate_to_json(const hapi_precision_candidate *c)
{
    return json_pack("{s:s, s:f, s:f, s:i, s:f, s:f, s:i, s:f, s:f}", "state",
                     state_name(c->state), "ms", c->ms, "warmup_ms", c->warmup_ms, "runs",
                     c->runs, "seconds", c->seconds, "setup_seconds", c->setup_seconds, "moved",
                     c->moved, "min_cosine", c->min_cosine, "cosine", c->cosine);
}

char *hapi_precision_choice_to_json(const hapi_precision_choice *c)
{
    json_t *cands = json_object();
    for (int p = 0; cands && p < N; p++)
        json_object_set_new(cands, hapi_precision_name(p), candidate_to_json(&c->c[p]));
    json_t *j = json_pack("{s:i, s:s, s:s, s:i, s:i, s:o, s:f, s:f, s:f, s:s}", "version", 2,
                          "cpu", c->cpu, "chosen", hapi_precision_name(c->precision), "batch",
                          c->batch, "to", c->to, "candidates", cands, "min_cosine",
                          HAPI_PRECISION_MIN_COSINE, "seconds", c->seconds, "pruned_seconds",
                          c->pruned_seconds, "why", c->why);
    char *text = j ? json_dumps(j, JSON_INDENT(1) | JSON_SORT_KEYS) : NULL;
    json_decref(j);
    return text;
}

/* The precision or state called name in names (n of them), or -1. */
static int lookup(const char *name, int n, const char *(*names)(int))
{
    for (int i = 0; name && i < n; i++)
        if (strcmp(name, names(i)) == 0)
            return i;
    return -1;
}

static int candidate_from_json(json_t *cands, int p, hapi_precision_candidate *c,
                               json_error_t *jerr)
{
    const char *state = NULL;
    if (json_unpack_ex(json_object_get(cands, hapi_precision_name(p)), jerr, 0,
                       "{s:s, s:F, s:F, s:i, s:F, s:F, s:i, s:F, s:F}", "state", &state, "ms",
                       &c->ms, "warmup_ms", &c->warmup_ms, "runs", &c->runs, "seconds",
                       &c->seconds, "setup_seconds", &c->setup_seconds, "moved", &c->moved,
                       "min_cosine", &c->min_cosine, "cosine", &c->cosine) < 0)
        return -1;
    if ((c->state = lookup(state, 4, state_name)) < 0) {
        snprintf(jerr->text, sizeof(jerr->text), "%s: state %s", hapi_precision_name(p), state);
        return -1;
    }
    return 0;
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
    const char *chosen = NULL, *why = NULL, *cpu = NULL;
    json_t *cands = NULL;
    char here[sizeof(out->cpu)];
    cpu_model(here, sizeof(here));
    int version = 0;
    int rc = json_unpack_ex(j, &jerr, 0, "{s:i}", "version", &version);
    if (rc == 0 && version != 2)
        rc = -1, snprintf(jerr.text, sizeof(jerr.text),
                          "version %d, from before int8 was a candidate", version);
    if (rc == 0)
        rc = json_unpack_ex(j, &jerr, 0, "{s:s, s:s, s:i, s:i, s:o, s:F, s:F, s:s}", "cpu",
                            &cpu, "chosen", &chosen, "batch", &out->batch, "to", &out->to,
                            "candidates", &cands, "seconds", &out->seconds, "pruned_seconds",
                            &out->pruned_seconds, "why", &why);
    for (int p = 0; rc == 0 && p < N; p++)
        rc = candidate_from_json(cands, p, &out->c[p], &jerr);
    if (rc == 0 && ((out->precision = lookup(chosen, N, hapi_precision_name)) < 0 ||
                    out->c[out->precision].state != HAPI_CANDIDATE_TIMED))
        rc = -1, snprintf(jerr.text, sizeof(jerr.text), "chosen %s, not a timed candidate",
                          chosen);
    else if (rc == 0 && strcmp(cpu, here) != 0)
        rc = -1, snprintf(jerr.text, sizeof(jerr.text), "measured on another CPU (%s)", cpu);
    if (rc == 0) {
        snprintf(out->why, sizeof(out->why), "%s", why);
        snprintf(out->cpu, sizeof(out->cpu), "%s", cpu);
        out->stored = 1;
    }
    json_decref(j);
    return rc == 0 ? 0 : hapi_error_set(err, HAPI_EINVAL, "%s: %s", path, jerr.text);
}

/* profile.c — measures what every stage of a model costs on this node; stores and reads the result. */
#include "policy.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <malloc.h>
#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ quota */

/* A cgroup directory's CPU quota in CPUs: v2 cpu.max, v1 cpu.cfs_quota_us over cpu.cfs_period_us;
   0 when it has none (or no such files). */
static double dir_quota(const char *dir)
{
    char path[PATH_MAX + 32], text[64];
    long long quota = -1, period = 0;
    snprintf(path, sizeof(path), "%s/cpu.max", dir);
    FILE *f = fopen(path, "r");
    if (f) {
        if (fgets(text, sizeof(text), f) && sscanf(text, "%lld %lld", &quota, &period) != 2)
            quota = -1; /* "max 100000": no quota */
        fclose(f);
    } else {
        snprintf(path, sizeof(path), "%s/cpu.cfs_quota_us", dir);
        if ((f = fopen(path, "r"))) {
            if (fscanf(f, "%lld", &quota) != 1)
                quota = -1;
            fclose(f);
        }
        snprintf(path, sizeof(path), "%s/cpu.cfs_period_us", dir);
        if ((f = fopen(path, "r"))) {
            if (fscanf(f, "%lld", &period) != 1)
                period = 0;
            fclose(f);
        }
    }
    return quota > 0 && period > 0 ? (double)quota / (double)period : 0;
}

double hapi_cpu_quota(const char *proc_cgroup, const char *root)
{
    FILE *f = fopen(proc_cgroup, "r");
    char line[PATH_MAX], rel[PATH_MAX] = "", dir[PATH_MAX];
    const char *sub = NULL;
    if (!f)
        return 0;
    while (fgets(line, sizeof(line), f)) {
        line[strcspn(line, "\n")] = 0;
        char *ctrl = strchr(line, ':'), *cpath = ctrl ? strchr(ctrl + 1, ':') : NULL;
        if (!cpath)
            continue;
        *cpath++ = 0;
        ctrl++;
        int cpu = 0;
        for (char *save = NULL, *c = strtok_r(ctrl, ",", &save); c; c = strtok_r(NULL, ",", &save))
            if (strcmp(c, "cpu") == 0)
                cpu = 1;
        if (cpu) { /* v1: the cpu hierarchy, which wins over v2's line */
            snprintf(rel, sizeof(rel), "%s", cpath);
            sub = "/cpu";
            break;
        }
        if (*ctrl == 0 && !sub) { /* v2: "0::/path" */
            snprintf(rel, sizeof(rel), "%s", cpath);
            sub = "";
        }
    }
    fclose(f);
    if (!sub)
        return 0;
    /* the least quota from the process's own group up to the hierarchy's root */
    double least = 0;
    for (;;) {
        snprintf(dir, sizeof(dir), "%s%s%s", root, sub, rel);
        double q = dir_quota(dir);
        if (q > 0 && (least == 0 || q < least))
            least = q;
        char *slash = strrchr(rel, '/');
        if (!slash || (slash == rel && rel[1] == 0))
            break;
        if (slash == rel)
            rel[1] = 0; /* up to "/" */
        else
            *slash = 0;
    }
    return least;
}

/* ---------------------------------------------------------------- memory */

/*
 * A stage's peak memory is read from the kernel: before the stage, free
 * memory goes back to the system (malloc_trim), the resident size is noted
 * and the high-water mark is reset to it (clear_refs 5); after it, the mark
 * minus the noted size is what the stage needed at its worst.
 */
struct mem_probe {
    int ok;
    uint64_t before;
    double peak[HAPI_PROFILE_MAX_STAGES];
};

static uint64_t resident_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long long size = 0, resident = 0;
    if (!f)
        return 0;
    if (fscanf(f, "%llu %llu", &size, &resident) != 2)
        resident = 0;
    fclose(f);
    return (uint64_t)resident * (uint64_t)sysconf(_SC_PAGESIZE);
}

static uint64_t high_water_bytes(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    unsigned long long kb = 0;
    if (!f)
        return 0;
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "VmHWM: %llu kB", &kb) == 1)
            break;
    fclose(f);
    return (uint64_t)kb * 1024;
}

static int reset_high_water(void)
{
    int fd = open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    ssize_t n = write(fd, "5", 1);
    int rc = n == 1 ? 0 : -errno;
    close(fd);
    return rc;
}

static void mem_hook(void *ctx, int stage, int after)
{
    struct mem_probe *mp = ctx;
    if (!mp->ok || stage >= HAPI_PROFILE_MAX_STAGES)
        return;
    if (!after) {
        malloc_trim(0);
        mp->before = resident_bytes();
        if (reset_high_water() < 0)
            mp->ok = 0;
    } else {
        uint64_t hwm = high_water_bytes();
        mp->peak[stage] = hwm > mp->before ? (double)(hwm - mp->before) : 0.0;
    }
}

/* --------------------------------------------------------------- measure */

/*
 * A stage's CPU time, read around it by hapi_model_measure()'s hook: the calling thread's with
 * one torch thread (the stage runs there), the process's with more (its intra-op workers).
 */
struct cpu_probe {
    int process; /* hapi_cpu_ns()'s argument */
    uint64_t start;
    uint64_t *ns; /* per stage, this run */
};

static void cpu_hook(void *ctx, int stage, int after)
{
    struct cpu_probe *cp = ctx;
    if (!after)
        cp->start = hapi_cpu_ns(cp->process);
    else
        cp->ns[stage] = hapi_cpu_ns(cp->process) - cp->start;
}

/* One run of every stage, unless asked to stop. */
static int measure_once(hapi_model *m, int batch, hapi_model_hook_fn hook, void *ctx,
                        uint64_t *ns, atomic_int *stop, hapi_error *err)
{
    if (stop && atomic_load(stop))
        return hapi_error_set(err, -ECANCELED, "profiling cancelled");
    return hapi_model_measure(m, batch, hook, ctx, ns, err);
}

/* A sweep that lowers some batch's sum over the stages by more than this calls for another. */
static const double SETTLED = 0.05;

int hapi_profile_sweep_again(int sweeps, int lowered, double elapsed_s, double sweep_s)
{
    if (sweeps >= HAPI_PROFILE_MAX_SWEEPS || !lowered)
        return 0;
    return sweeps < 2 || elapsed_s + sweep_s <= HAPI_PROFILE_BUDGET_S;
}

/*
 * Each batch is timed over at least REPS whole runs and WINDOW_NS of wall time (at most
 * MAX_REPS runs), and a stage's figure is its mean. A node under a CPU quota (a
 * throttled tier: CFS hands out its quota per 10-100 ms period) runs a short stage at
 * full speed and stalls wherever the quota runs out: a median of a few runs would miss
 * the stalls, a mean over several periods counts them where they fall.
 */
enum { REPS = 3, MAX_REPS = 40 };
static const uint64_t WINDOW_NS = 100000000;

/* The node's side of a profile: device, threads, the CPUs it may use and its quota. */
static void describe_node(hapi_profile *out, const uint8_t digest[16], const char *device,
                          int threads)
{
    out->version = HAPI_PROFILE_VERSION;
    hapi_hex(digest, 16, out->model_digest);
    snprintf(out->device, sizeof(out->device), "%s", device && *device ? device : "cpu");
    out->threads = threads;
    /* The CPUs this process may run on (a cpuset confines a tier to fewer than are online). */
    cpu_set_t allowed;
    long cores = sched_getaffinity(0, sizeof(allowed), &allowed) == 0
                     ? CPU_COUNT(&allowed) : sysconf(_SC_NPROCESSORS_ONLN);
    out->cores = cores > 0 ? (int)cores : 1;
    out->cpu_quota = hapi_cpu_quota("/proc/self/cgroup", "/sys/fs/cgroup");
}

/* Copies each stage's name, shape and parameters into `out`; returns the largest activation of
   one sample in bytes, fp32. */
static uint64_t describe_stages(hapi_model *m, hapi_profile *out)
{
    uint64_t widest = 0;
    for (int i = 0; i < out->nstages; i++) {
        hapi_stage_info info;
        hapi_model_stage(m, i, &info);
        hapi_profile_stage *s = &out->stage[i];
        memcpy(s->name, info.name, sizeof(s->name));
        s->ndim = info.ndim;
        s->out_elems = 1;
        for (int d = 0; d < info.ndim; d++) {
            s->shape[d] = info.shape[d];
            s->out_elems *= (uint64_t)info.shape[d];
        }
        s->param_bytes = info.param_bytes;
        if (s->out_elems * 4 > widest)
            widest = s->out_elems * 4;
    }
    return widest;
}

/* The batches to measure: 1, 4 and 16, each past the first only if it fits max_batch_bytes. */
static void choose_batches(hapi_profile *out, uint64_t widest, uint64_t max_batch_bytes)
{
    static const int wanted[] = { 1, 4, 16 };
    for (size_t k = 0; k < sizeof(wanted) / sizeof(*wanted); k++) {
        /* a batch is run whole: its widest activation (and a copy) must fit the cap */
        if (k > 0 && max_batch_bytes && (uint64_t)wanted[k] * widest * 2 > max_batch_bytes)
            break;
        out->batches[out->nbatches++] = wanted[k];
    }
}

/*
 * What the sweeps share: the model, the stop flag, when the profile began, how a stage is
 * timed, and the per-stage buffers hapi_model_measure() fills. timing_init() allocates the
 * buffers; timing_free() frees them, also those of a failed timing_init().
 */
struct timing {
    hapi_model *m;
    atomic_int *stop;
    uint64_t t0;   /* when the profile began */
    int n;         /* stages */
    int throttled; /* time each stage's CPU over the quota rather than its wall time */
    uint64_t *ns;  /* per stage, summed over the runs */
    uint64_t *one; /* wall time of one run, per stage */
    uint64_t *cpu; /* CPU time of one run, per stage */
    struct cpu_probe probe;
};

static void timing_free(struct timing *t)
{
    free(t->ns);
    free(t->one);
    free(t->cpu);
}

static int timing_init(struct timing *t, const hapi_profile *out, int threads, hapi_error *err)
{
    t->ns = calloc((size_t)t->n, sizeof(uint64_t));
    t->one = calloc((size_t)t->n, sizeof(uint64_t));
    t->cpu = calloc((size_t)t->n, sizeof(uint64_t));
    if (!t->ns || !t->one || !t->cpu)
        return hapi_error_set(err, -ENOMEM, "profile: out of memory");
    /*
     * Under a CFS quota of fewer CPUs than the torch threads, wall time is the wrong measure:
     * the quota's stalls land on whichever stage runs when it is spent (measured: one stage
     * at 26 ms per sample, the others at their unthrottled speed), and the least of the
     * sweeps keeps the stages they missed. There each stage's CPU time is timed instead and
     * divided by the quota: what the stage takes when the node is busy, as in an epoch.
     */
    t->throttled = out->cpu_quota > 0 && out->cpu_quota < (threads > 0 ? threads : 1);
    t->probe = (struct cpu_probe){ .process = threads > 1, .ns = t->cpu };
    return 0;
}

/*
 * A slow model (ViT-B/16 takes seconds per image on a small CPU) would keep .feat waiting for
 * minutes: larger batches are measured only while the whole profile stays within its time
 * budget. Whether measuring `batch` keeps it there, judged from batch 1's figures.
 */
static int batch_fits_budget(const struct timing *t, const hapi_profile *out, int batch)
{
    double per_sample_s = hapi_profile_ms(out, 0, t->n, 1) / 1e3;
    double elapsed_s = (double)(hapi_now_ns() - t->t0) / 1e9;
    return !(elapsed_s + fmax(per_sample_s * batch * (REPS + 2), 1e-9 * (double)WINDOW_NS) >
             HAPI_PROFILE_BUDGET_S);
}

/* Runs `batch` `warmups` times untimed, then enough times to time it, summing each stage's
   time into t->ns; returns the number of timed runs, or a negative code. */
static int time_batch(struct timing *t, int batch, int warmups, hapi_error *err)
{
    int rc;
    /* TorchScript's executor specialises on the first runs of a shape: warm it up */
    for (int w = 0; w < warmups; w++)
        if ((rc = measure_once(t->m, batch, NULL, NULL, t->one, t->stop, err)) < 0)
            return rc;
    memset(t->ns, 0, (size_t)t->n * sizeof(uint64_t));
    uint64_t start = hapi_now_ns();
    int runs = 0;
    while (runs < MAX_REPS && (runs < REPS || hapi_now_ns() - start < WINDOW_NS)) {
        if ((rc = measure_once(t->m, batch, t->throttled ? cpu_hook : NULL, &t->probe, t->one,
                               t->stop, err)) < 0)
            return rc;
        for (int i = 0; i < t->n; i++)
            t->ns[i] += t->throttled ? t->cpu[i] : t->one[i];
        runs++;
    }
    return runs;
}

/* Turns the timed runs of batch k into each stage's ms per sample, keeping the least of the
   sweeps in `out`; returns this sweep's sum over the stages. */
static double keep_least_means(const struct timing *t, hapi_profile *out, int sweep, int k,
                               int runs)
{
    int batch = out->batches[k];
    double sum = 0;
    for (int i = 0; i < t->n; i++) {
        double ms = (double)t->ns[i] / runs / 1e6 / batch;
        if (t->throttled)
            ms /= out->cpu_quota;
        if (sweep == 0 || ms < out->stage[i].ms[k])
            out->stage[i].ms[k] = ms;
        sum += ms;
    }
    return sum;
}

/* One sweep over every batch (the first one drops the batches the budget has no room for);
   returns 1 if it lowered some batch's sum by more than SETTLED, else 0, or a negative code. */
static int sweep_once(struct timing *t, hapi_profile *out, int sweep, double *prev_sum,
                      hapi_error *err)
{
    int lowered = 0;
    for (int k = 0; k < out->nbatches; k++) {
        int batch = out->batches[k];
        if (sweep == 0 && k > 0 && !batch_fits_budget(t, out, batch)) {
            out->nbatches = k;
            break;
        }
        int runs = time_batch(t, batch, sweep == 0 && k == 0 ? 2 : 1, err);
        if (runs < 0)
            return runs;
        double sum = keep_least_means(t, out, sweep, k, runs);
        if (sweep == 0 || sum < prev_sum[k] * (1 - SETTLED))
            lowered = 1;
        if (sweep == 0 || sum < prev_sum[k])
            prev_sum[k] = sum;
    }
    return lowered;
}

/*
 * Sweeps over every batch until the figures settle. A mount's first second is busy
 * beside the profile (measured: the first sweep at batch 1 3-4x too slow after a
 * daemonised start, the first two 2x in bench/hapifs-cluster while its ssh and sshfs
 * start), so each stage keeps the least of its sweeps' means, and sweeping ends once a
 * sweep lowers no batch's sum over the stages by more than SETTLED, after
 * HAPI_PROFILE_MAX_SWEEPS, or (from the second sweep on) when another would not fit
 * HAPI_PROFILE_BUDGET_S: hapi_profile_sweep_again().
 */
static int sweep_until_settled(struct timing *t, hapi_profile *out, hapi_error *err)
{
    double prev_sum[HAPI_PROFILE_MAX_BATCHES] = { 0 };
    for (int sweep = 0;; sweep++) {
        uint64_t sweep_t0 = hapi_now_ns();
        int lowered = sweep_once(t, out, sweep, prev_sum, err);
        if (lowered < 0)
            return lowered;
        out->sweeps = sweep + 1;
        double sweep_s = (double)(hapi_now_ns() - sweep_t0) / 1e9;
        double elapsed_s = (double)(hapi_now_ns() - t->t0) / 1e9;
        if (!hapi_profile_sweep_again(out->sweeps, lowered, elapsed_s, sweep_s))
            break;
    }
    return 0;
}

/* Each stage's fixed and per-sample memory from its peaks at batches b_lo and b_hi. */
static void fit_memory(hapi_profile *out, const struct mem_probe *lo, const struct mem_probe *hi,
                       int b_lo, int b_hi)
{
    for (int i = 0; i < out->nstages; i++) {
        hapi_profile_stage *s = &out->stage[i];
        if (out->mem_measured && b_hi > b_lo) {
            double slope = (hi->peak[i] - lo->peak[i]) / (double)(b_hi - b_lo);
            /* a sample needs at least its own output */
            if (slope < (double)s->out_elems * 4)
                slope = (double)s->out_elems * 4;
            double fixed = lo->peak[i] - slope * b_lo;
            s->mem_per_sample = slope;
            s->mem_fixed = fixed > 0 ? fixed : 0;
        } else {
            /* the output, an input-sized temporary and the allocator's slack */
            s->mem_per_sample = (double)s->out_elems * 4 * 3;
            s->mem_fixed = out->mem_measured ? lo->peak[i] - s->mem_per_sample : 0;
            if (s->mem_fixed < 0)
                s->mem_fixed = 0;
        }
    }
}

/* Memory: each stage's peak at the smallest and the largest batch gives fixed + per sample. */
static int measure_memory(struct timing *t, hapi_profile *out, hapi_error *err)
{
    struct mem_probe lo = { .ok = 1 }, hi = { .ok = 1 };
    int b_lo = out->batches[0], b_hi = out->batches[out->nbatches - 1];
    int rc;
    if ((rc = measure_once(t->m, b_lo, mem_hook, &lo, t->one, t->stop, err)) < 0)
        return rc;
    if (b_hi > b_lo && (rc = measure_once(t->m, b_hi, mem_hook, &hi, t->one, t->stop, err)) < 0)
        return rc;
    out->mem_measured = lo.ok && (b_hi == b_lo || hi.ok);
    fit_memory(out, &lo, &hi, b_lo, b_hi);
    return 0;
}

int hapi_profile_measure(hapi_model *m, const uint8_t digest[16], const char *device,
                         int threads, uint64_t max_batch_bytes, atomic_int *stop,
                         hapi_profile *out, hapi_error *err)
{
    uint64_t t0 = hapi_now_ns();
    int n = hapi_model_num_stages(m), rc;

    memset(out, 0, sizeof(*out));
    if (n < 1 || n > HAPI_PROFILE_MAX_STAGES)
        return hapi_error_set(err, HAPI_EINVAL, "profile: %d stages (at most %d)", n,
                              HAPI_PROFILE_MAX_STAGES);
    describe_node(out, digest, device, threads);
    out->nstages = n;
    uint64_t widest = describe_stages(m, out);
    choose_batches(out, widest, max_batch_bytes);

    struct timing t = { .m = m, .stop = stop, .t0 = t0, .n = n };
    if ((rc = timing_init(&t, out, threads, err)) < 0)
        goto out;
    out->runtime_bytes = resident_bytes();
    if ((rc = sweep_until_settled(&t, out, err)) < 0)
        goto out;
    if ((rc = measure_memory(&t, out, err)) < 0)
        goto out;
    out->seconds = (double)(hapi_now_ns() - t0) / 1e9;
    out->measured_at = (int64_t)time(NULL);
    rc = 0;
out:
    timing_free(&t);
    return rc;
}

/* ------------------------------------------------------------ estimates */

static double stage_ms(const hapi_profile *p, int i, int batch)
{
    const hapi_profile_stage *s = &p->stage[i];
    if (p->nbatches < 1)
        return 0;
    if (batch <= p->batches[0])
        return s->ms[0];
    for (int k = 1; k < p->nbatches; k++)
        if (batch <= p->batches[k]) {
            double f = (double)(batch - p->batches[k - 1]) /
                       (double)(p->batches[k] - p->batches[k - 1]);
            return s->ms[k - 1] + f * (s->ms[k] - s->ms[k - 1]);
        }
    return s->ms[p->nbatches - 1];
}

double hapi_profile_ms(const hapi_profile *p, int from, int to, int batch)
{
    double ms = 0;
    if (from < 0)
        from = 0;
    for (int i = from; i < to && i < p->nstages; i++)
        ms += stage_ms(p, i, batch);
    return ms;
}

double hapi_profile_memory(const hapi_profile *p, int split, int batch)
{
    double weights = 0, worst = 0;
    for (int i = 0; i < split && i < p->nstages; i++) {
        const hapi_profile_stage *s = &p->stage[i];
        weights += (double)s->param_bytes;
        double w = s->mem_fixed + s->mem_per_sample * batch;
        if (w > worst)
            worst = w;
    }
    return weights + worst;
}

/* ------------------------------------------------------------------ JSON */

char *hapi_profile_to_json(const hapi_profile *p)
{
    json_t *stages = json_array();
    json_t *batches = json_array();
    for (int k = 0; k < p->nbatches; k++)
        json_array_append_new(batches, json_integer(p->batches[k]));
    for (int i = 0; i < p->nstages; i++) {
        const hapi_profile_stage *s = &p->stage[i];
        json_t *shape = json_array(), *ms = json_array();
        for (int d = 0; d < s->ndim; d++)
            json_array_append_new(shape, json_integer(s->shape[d]));
        for (int k = 0; k < p->nbatches; k++)
            json_array_append_new(ms, json_real(s->ms[k]));
        json_array_append_new(
            stages,
            json_pack("{s:i, s:s, s:o, s:I, s:I, s:I, s:o, s:f, s:f}", "index", i, "name",
                      s->name, "shape", shape, "bytes_fp32", (json_int_t)(s->out_elems * 4),
                      "bytes_fp16", (json_int_t)(s->out_elems * 2), "param_bytes",
                      (json_int_t)s->param_bytes, "ms_per_sample", ms, "mem_fixed",
                      s->mem_fixed, "mem_per_sample", s->mem_per_sample));
    }
    json_t *root = json_pack(
        "{s:i, s:s, s:s, s:i, s:i, s:o, s:I, s:b, s:f, s:i, s:f, s:I, s:o}", "version", p->version,
        "model_digest", p->model_digest, "device", p->device, "threads", p->threads, "cores",
        p->cores, "batches", batches, "runtime_bytes", (json_int_t)p->runtime_bytes,
        "memory_measured", p->mem_measured, "seconds", p->seconds, "sweeps", p->sweeps,
        "cpu_quota", p->cpu_quota, "measured_at", (json_int_t)p->measured_at, "stages", stages);
    if (!root)
        return NULL;
    char *text = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(root);
    return text;
}

int hapi_profile_from_json(const char *text, hapi_profile *out, hapi_error *err)
{
    json_error_t je;
    json_t *root = json_loads(text, 0, &je), *batches = NULL, *stages = NULL;
    const char *digest = NULL, *device = NULL;
    json_int_t runtime = 0, at = 0;
    int measured = 0, rc = 0;

    memset(out, 0, sizeof(*out));
    if (!root)
        return hapi_error_set(err, HAPI_EINVAL, "not JSON: %s (line %d)", je.text, je.line);
    if (json_unpack_ex(root, &je, 0,
                       "{s:i, s:s, s:s, s:i, s:i, s:o, s:I, s:b, s:F, s:i, s:F, s:I, s:o}", "version",
                       &out->version, "model_digest", &digest, "device", &device, "threads",
                       &out->threads, "cores", &out->cores, "batches", &batches,
                       "runtime_bytes", &runtime, "memory_measured", &measured, "seconds",
                       &out->seconds, "sweeps", &out->sweeps, "cpu_quota", &out->cpu_quota,
                       "measured_at", &at, "stages",
                       &stages) < 0) {
        rc = hapi_error_set(err, HAPI_EINVAL, "profile: %s", je.text);
        goto out;
    }
    if (out->version != HAPI_PROFILE_VERSION) {
        rc = hapi_error_set(err, HAPI_EINVAL, "profile version %d, this build reads %d",
                            out->version, HAPI_PROFILE_VERSION);
        goto out;
    }
    snprintf(out->model_digest, sizeof(out->model_digest), "%s", digest);
    snprintf(out->device, sizeof(out->device), "%s", device);
    out->runtime_bytes = (uint64_t)runtime;
    out->mem_measured = measured;
    out->measured_at = at;
    if (!json_is_array(batches) || json_array_size(batches) < 1 ||
        json_array_size(batches) > HAPI_PROFILE_MAX_BATCHES || !json_is_array(stages) ||
        json_array_size(stages) < 1 || json_array_size(stages) > HAPI_PROFILE_MAX_STAGES) {
        rc = hapi_error_set(err, HAPI_EINVAL, "profile: bad batches or stages");
        goto out;
    }
    out->nbatches = (int)json_array_size(batches);
    for (int k = 0; k < out->nbatches; k++) {
        out->batches[k] = (int)json_integer_value(json_array_get(batches, (size_t)k));
        if (out->batches[k] < 1 || (k > 0 && out->batches[k] <= out->batches[k - 1])) {
            rc = hapi_error_set(err, HAPI_EINVAL, "profile: batches not ascending");
            goto out;
        }
    }
    out->nstages = (int)json_array_size(stages);
    for (int i = 0; i < out->nstages; i++) {
        hapi_profile_stage *s = &out->stage[i];
        const char *name = NULL;
        json_t *shape = NULL, *ms = NULL;
        json_int_t fp32 = 0, params = 0;
        if (json_unpack_ex(json_array_get(stages, (size_t)i), &je, 0,
                           "{s:s, s:o, s:I, s:I, s:o, s:F, s:F}", "name", &name, "shape", &shape,
                           "bytes_fp32", &fp32, "param_bytes", &params, "ms_per_sample", &ms,
                           "mem_fixed", &s->mem_fixed, "mem_per_sample", &s->mem_per_sample) < 0 ||
            !json_is_array(shape) || json_array_size(shape) > HAPI_MAX_DIMS ||
            !json_is_array(ms) || (int)json_array_size(ms) != out->nbatches) {
            rc = hapi_error_set(err, HAPI_EINVAL, "profile: stage %d: %s", i,
                                *je.text ? je.text : "bad shape or times");
            goto out;
        }
        snprintf(s->name, sizeof(s->name), "%s", name);
        s->ndim = (int)json_array_size(shape);
        s->out_elems = 1;
        for (int d = 0; d < s->ndim; d++) {
            s->shape[d] = json_integer_value(json_array_get(shape, (size_t)d));
            s->out_elems *= (uint64_t)s->shape[d];
        }
        s->param_bytes = (uint64_t)params;
        for (int k = 0; k < out->nbatches; k++)
            s->ms[k] = json_number_value(json_array_get(ms, (size_t)k));
        (void)fp32;
    }
out:
    json_decref(root);
    return rc;
}

void hapi_profile_file_name(const uint8_t digest[16], const char *device, int threads,
                            char *buf, size_t size)
{
    char hex[33], dev[32];
    hapi_hex(digest, 16, hex);
    snprintf(dev, sizeof(dev), "%s", device && *device ? device : "cpu");
    for (char *c = dev; *c; c++)
        if (*c == ':' || *c == '/')
            *c = '_';
    snprintf(buf, size, "profile-%s-%s-t%d.json", hex, dev, threads);
}

int hapi_profile_load(const char *path, hapi_profile *out, hapi_error *err)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return hapi_error_set(err, -errno, "%s: %s", path, strerror(errno));
    char *text = NULL;
    size_t cap = 0, len = 0;
    for (;;) {
        if (len + 4096 + 1 > cap) {
            char *t = realloc(text, cap = cap ? cap * 2 : 65536);
            if (!t) {
                free(text);
                fclose(f);
                return hapi_error_set(err, -ENOMEM, "out of memory");
            }
            text = t;
        }
        size_t n = fread(text + len, 1, cap - len - 1, f);
        len += n;
        if (n == 0)
            break;
    }
    fclose(f);
    text[len] = '\0';
    int rc = hapi_profile_from_json(text, out, err);
    free(text);
    return rc;
}

int hapi_profile_save(const char *path, const hapi_profile *p, hapi_error *err)
{
    char *text = hapi_profile_to_json(p);
    if (!text)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    int rc = hapi_policy_save_text(path, text, err);
    free(text);
    return rc;
}

int hapi_policy_save_text(const char *path, const char *text, hapi_error *err)
{
    char tmp[4096];
    snprintf(tmp, sizeof(tmp), "%s.%d.tmp", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    int rc = 0;
    if (!f || fputs(text, f) < 0 || fputc('\n', f) < 0 || fflush(f) != 0 || fsync(fileno(f)) < 0)
        rc = hapi_error_set(err, -errno, "%s: %s", tmp, strerror(errno));
    if (f && fclose(f) != 0 && rc == 0)
        rc = hapi_error_set(err, -errno, "%s: %s", tmp, strerror(errno));
    if (rc == 0 && rename(tmp, path) < 0)
        rc = hapi_error_set(err, -errno, "%s: %s", path, strerror(errno));
    if (rc < 0)
        unlink(tmp);
    return rc;
}

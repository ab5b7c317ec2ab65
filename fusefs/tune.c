/* tune.c — the mount's split and batch: the profile at mount, the policy's choice, live changes. */
#include "tune.h"
#include "background.h"
#include "cache.h"
#include "extractor.h"
#include "hapi.h"
#include "log.h"
#include "options.h"
#include "policy.h"
#include "serve.h"
#include "source.h"
#include "view.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Serving one cached .feat through FUSE, client side: 24–31 µs measured (cache issue). */
#define HIT_MS 0.03
/* Images whose decode and preprocessing are timed at mount. */
#define DECODE_SAMPLES 8

struct hapi_tune {
    hapi_tune_config cfg;
    pthread_mutex_t switch_lock; /* one split change at a time, held through it */
    pthread_mutex_t lock;        /* everything below but the atomics */
    pthread_t thread;            /* measures, counts, chooses at mount */
    int running;
    int state;                   /* 0 measuring, 1 ready, < 0 failed (code) */
    char error[HAPI_ERROR_MESSAGE_MAX];
    int reused;                  /* the profile was read from the cache directory */
    hapi_profile profile;
    hapi_policy_input in;        /* without profile, cached[], samples: filled per use */
    int split_by_operator;       /* the split was given (option or control command) */
    int compute_file_given;      /* in.compute_file_ms was given (option or control command) */
    int batch_auto;
    int batch;                   /* the batch set now */
    double decode_ms, source_bytes;
    int decode_samples;          /* images the decode cost was measured on */
    atomic_uint_fast64_t images; /* images in the tree, once counted */
    atomic_int counted;
    atomic_int stop;
    atomic_uint_fast64_t split_changes;
};

/* How long a profile waits for the mount to serve (wait_serving) before it starts anyway. */
#define TUNE_SERVING_WAIT_MS 10000

/*
 * Waits until the mount serves: measured while the daemon mounts and starts io_uring's
 * workers, a ResNet-18's profile summed 2.2-62.8 ms per sample at batch 1 and 3.8 ms at 16
 * (single stages 12-44 ms), measured 3 s later 2.8-4.4 and 1.9-2.1 ms, as probe-speed.py
 * measures the same stages.
 */
static void wait_serving(hapi_tune *t)
{
    for (int ms = 0; t->cfg.serving && ms < TUNE_SERVING_WAIT_MS &&
                     !t->cfg.serving(t->cfg.arg) && !atomic_load(&t->stop);
         ms += 10)
        usleep(10000);
}

/* ------------------------------------------------------- decode sample */

struct sample_walk {
    char *paths[DECODE_SAMPLES];
    int n;
};

static int sample_one(const hapi_source_entry *e, void *arg)
{
    struct sample_walk *w = arg;
    if (w->n == DECODE_SAMPLES)
        return -ECANCELED; /* enough */
    w->paths[w->n] = strdup(e->path);
    if (w->paths[w->n])
        w->n++;
    return 0;
}

/* Times decode + preprocessing of the first images of the tree; their mean size too. */
static void measure_decode(hapi_tune *t, double *ms, double *bytes, int *count)
{
    struct sample_walk w = { .n = 0 };
    hapi_source_walk(t->cfg.source, "", HAPI_WALK_RECURSE, &t->stop, sample_one, &w);
    const hapi_preprocess *pp = hapi_extractor_preprocess(t->cfg.ex);
    float *tensor = malloc(3 * (size_t)pp->crop * (size_t)pp->crop * sizeof(float));
    hapi_decoder *dec = NULL;
    double total_ms = 0, total_bytes = 0;
    int done = 0;
    /* Under a CFS quota below one CPU a decode's wall time is its CPU time or that and a
       stall of up to the quota's period (0.4 ms and 7.5 ms at 0.25 CPU): a few images'
       mean was 0.8-1.1x the epoch's. There its thread's CPU time over the quota instead,
       as the profile does for the stages. */
    double quota = hapi_cpu_quota("/proc/self/cgroup", "/sys/fs/cgroup");
    int throttled = quota > 0 && quota < 1;
    if (tensor && hapi_decoder_new(&dec) == 0) {
        for (int i = 0; i < w.n; i++) {
            void *data = NULL;
            size_t size = 0;
            hapi_error err = { 0 };
            if (hapi_source_load(t->cfg.source, w.paths[i], &data, &size, NULL, &err) == 0) {
                uint64_t t0 = throttled ? hapi_cpu_ns(0) : hapi_now_ns();
                if (hapi_image_load(dec, data, size, pp, tensor, &err) == 0) {
                    uint64_t t1 = throttled ? hapi_cpu_ns(0) : hapi_now_ns();
                    total_ms += (double)(t1 - t0) / 1e6 / (throttled ? quota : 1);
                    total_bytes += (double)size;
                    done++;
                }
            }
            free(data);
        }
    }
    hapi_decoder_free(dec);
    free(tensor);
    for (int i = 0; i < w.n; i++)
        free(w.paths[i]);
    *count = done;
    *ms = done ? total_ms / done : 0;
    *bytes = done ? total_bytes / done : 0;
}

static int count_image(const hapi_source_entry *e, void *arg)
{
    hapi_tune *t = arg;
    (void)e;
    atomic_fetch_add(&t->images, 1);
    return 0;
}

/* ------------------------------------------------------------- profile */

/* A stored profile is used only if it describes this very model. */
static int profile_matches(hapi_tune *t, const hapi_profile *p)
{
    hapi_model *m = hapi_extractor_model(t->cfg.ex);
    if (p->nstages != hapi_model_num_stages(m))
        return 0;
    for (int i = 0; i < p->nstages; i++) {
        hapi_stage_info info;
        hapi_model_stage(m, i, &info);
        if (strcmp(info.name, p->stage[i].name) != 0)
            return 0;
    }
    return 1;
}

static int get_profile(hapi_tune *t, hapi_profile *prof, int *reused, hapi_error *err)
{
    char name[256], path[PATH_MAX + 300];
    const uint8_t *digest = hapi_extractor_model_digest(t->cfg.ex);
    /*
     * A bf16 or int8 model is another machine as far as timing goes, and so is
     * another BLAS on a CPU (linear layers 22x apart): each has its own profile. So is
     * each set of stages such a model runs in fp32 (its check's, or its calibration's: an
     * int8 model calibrated on another source or with another bound may keep others), named
     * "-fN_M" after the precision.
     */
    char device[128], moved[64] = "";
    int cpu = strncmp(t->cfg.opt->device, "cuda", 4) != 0;
    int fp32 = t->cfg.opt->precision == HAPI_PRECISION_FP32;
    hapi_model *m = hapi_extractor_model(t->cfg.ex);
    for (int i = 0, n = hapi_model_num_stages(m); !fp32 && i < n; i++) {
        hapi_stage_info info;
        size_t len = strlen(moved);
        if (hapi_model_stage(m, i, &info) == 0 && info.precision == HAPI_PRECISION_FP32 &&
            info.check_cosine != 0.0 && len < sizeof(moved))
            snprintf(moved + len, sizeof(moved) - len, "%s%d", len ? "_" : "-f", i);
    }
    snprintf(device, sizeof(device), "%s%s%s%s%s%s", t->cfg.opt->device, fp32 ? "" : "-",
             fp32 ? "" : hapi_precision_name(t->cfg.opt->precision), moved, cpu ? "-" : "",
             cpu ? hapi_model_blas() : "");
    /* one inference worker's threads: what each batch runs with */
    int threads = hapi_batcher_worker_threads(t->cfg.opt->torch_threads,
                                              t->cfg.opt->inference_workers);
    hapi_profile_file_name(digest, device, threads, name, sizeof(name));
    snprintf(path, sizeof(path), "%s/%s", t->cfg.opt->cache_dir, name);
    *reused = 0;
    if (!t->cfg.opt->profile_redo) {
        hapi_error lerr = { 0 };
        int rc = hapi_profile_load(path, prof, &lerr);
        if (rc == 0 && profile_matches(t, prof)) {
            *reused = 1;
            hapi_log(HAPI_LOG_INFO, "profile read from %s", path);
            return 0;
        }
        if (rc != -ENOENT)
            hapi_log(HAPI_LOG_WARNING, "profile %s not used (%s); measuring again", path,
                     rc < 0 ? lerr.message : "another model's");
    }
    wait_serving(t);
    hapi_log(HAPI_LOG_INFO, "profiling the model (once per model, device and thread count)");
    /* every core of the node: the other mounts' inferences would skew the timings */
    int tokens = hapi_node_cores_take(t->cfg.node, INT_MAX, 1, &t->stop);
    if (tokens < 0)
        return hapi_error_set(err, -ECANCELED, "unmounting");
    int rc = hapi_profile_measure(hapi_extractor_model(t->cfg.ex), digest, device,
                                  threads, t->cfg.opt->mem_budget,
                                  &t->stop, prof, err);
    hapi_node_cores_give(t->cfg.node, tokens);
    if (rc < 0)
        return rc;
    hapi_error serr = { 0 };
    if (hapi_profile_save(path, prof, &serr) < 0)
        hapi_log(HAPI_LOG_WARNING, "profile not stored: %s", serr.message);
    hapi_log(HAPI_LOG_INFO, "profiled %d stages in %.1f s, stored in %s", prof->nstages,
             prof->seconds, path);
    return 0;
}

/* ----------------------------------------------------------- the thread */

/* The memory the model takes at split and batch, from the profile; 0 without one. */
static uint64_t model_bytes(hapi_tune *t, int split, int batch)
{
    pthread_mutex_lock(&t->lock);
    double m = t->state == 1 ? hapi_profile_memory(&t->profile, split, batch) : 0;
    pthread_mutex_unlock(&t->lock);
    return m > 0 ? (uint64_t)m : 0;
}

static void *tune_main(void *arg)
{
    hapi_tune *t = arg;
    pthread_setname_np(pthread_self(), "hapifs-policy");
    hapi_profile *prof = malloc(sizeof(*prof));
    hapi_error err = { 0 };
    int reused = 0, rc;

    rc = prof ? get_profile(t, prof, &reused, &err) : hapi_error_set(&err, -ENOMEM, "out of memory");
    double decode_ms = 0, source_bytes = 0;
    int decoded = 0;
    if (!atomic_load(&t->stop))
        measure_decode(t, &decode_ms, &source_bytes, &decoded);

    pthread_mutex_lock(&t->lock);
    if (rc == 0) {
        t->profile = *prof;
        t->reused = reused;
    } else {
        snprintf(t->error, sizeof(t->error), "%s", err.message);
    }
    t->decode_ms = decode_ms;
    t->source_bytes = source_bytes;
    t->decode_samples = decoded;
    t->state = rc == 0 ? 1 : (rc < 0 ? rc : -EIO);
    int by_operator = t->split_by_operator, batch = t->batch ? t->batch : 16;
    pthread_mutex_unlock(&t->lock);
    free(prof);
    if (rc < 0)
        hapi_log(HAPI_LOG_WARNING, "no profile (%s): the split is %s, the batch %d", err.message,
                 by_operator ? "the one given" : "the freeze index", batch);

    /* The first view: the operator's split or the policy's, and its batch. */
    int split = hapi_extractor_split(t->cfg.ex);
    hapi_policy_choice *choice = malloc(sizeof(*choice));
    hapi_error perr = { 0 };
    if (choice && rc == 0 &&
        hapi_tune_choose(t, by_operator ? split : 0, NULL, choice, &perr) == 0) {
        split = choice->split;
        batch = choice->batch;
        hapi_log(HAPI_LOG_INFO, "split %d (%s), batch %d: %s", split,
                 choice->cand[choice->index].name, batch, choice->why);
    } else if (rc == 0) {
        hapi_log(HAPI_LOG_WARNING, "policy: %s", choice ? perr.message : "out of memory");
    }
    free(choice);
    pthread_mutex_lock(&t->lock);
    t->batch = batch;
    pthread_mutex_unlock(&t->lock);

    hapi_view *v = NULL;
    if (!atomic_load(&t->stop) &&
        hapi_serve_view_new(t->cfg.serve, split, batch, model_bytes(t, split, batch), &v, &err) < 0)
        hapi_log(HAPI_LOG_ERROR, "cannot serve features: %s", err.message);
    if (v)
        hapi_log(HAPI_LOG_INFO, "serving split %d (%s), namespace %s", v->split, v->output.name,
                 v->ns_hex);
    hapi_view_put(hapi_views_swap(t->cfg.views, v)); /* v NULL: readers get an error */

    /* The size of the tree, for epoch times, the cache's share of it, and prefetch. */
    int counted = hapi_source_walk(t->cfg.source, "", HAPI_WALK_RECURSE, &t->stop, count_image,
                                   t) >= 0;
    atomic_store(&t->counted, counted);
    hapi_background_set_tree_size(t->cfg.background, atomic_load(&t->images), counted);
    return NULL;
}

int hapi_tune_start(const hapi_tune_config *cfg, hapi_tune **out, hapi_error *err)
{
    const hapi_fs_options *o = cfg->opt;
    const hapi_preprocess *pp = hapi_extractor_preprocess(cfg->ex);
    const hapi_stage_info *output = hapi_extractor_output(cfg->ex);
    char header[HAPI_NPY_HEADER_MAX];
    int header_len = hapi_npy_header(header, o->dtype, output->shape, output->ndim);
    *out = NULL;
    hapi_tune *t = calloc(1, sizeof(*t));
    if (!t)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    t->cfg = *cfg;
    pthread_mutex_init(&t->lock, NULL);
    pthread_mutex_init(&t->switch_lock, NULL);
    t->in = (hapi_policy_input){
        .link_bps = o->link_bps,
        .link_bytes = o->link_bytes > 0 ? o->link_bytes : 0, /* any: no bound */
        .rtt_s = o->rtt_s,
        .transport = o->transport,
        .client_speed = o->client_speed,
        .mem_budget = o->mem_budget,
        .freeze = hapi_extractor_freeze(cfg->ex),
        .epochs = o->epochs,
        .dtype = o->dtype,
        .decode_threads = o->decode_threads,
        .inference_workers = o->inference_workers,
        .header_bytes = header_len > 0 ? (size_t)header_len : 0,
        .input_bytes = 3 * (size_t)pp->crop * (size_t)pp->crop * sizeof(float),
        .hit_ms = HIT_MS,
        .cache_room = o->cache_size,
        .storage_file_ms = HAPI_POLICY_STORAGE_FILE_MS,
        .compute_file_ms = o->compute_file_ms >= 0 ? o->compute_file_ms
                                                   : HAPI_POLICY_COMPUTE_FILE_MS,
        .storage_serve_ms = HAPI_POLICY_STORAGE_SERVE_MS,
        .compute_byte_ns = HAPI_POLICY_COMPUTE_BYTE_NS,
        .compute_load_ns = HAPI_POLICY_COMPUTE_LOAD_NS,
        .request_ms = HAPI_POLICY_REQUEST_MS,
    };
    /* What one feature of each split costs in the store, for "does the tree fit". */
    for (int s = 1; s <= t->in.freeze && s <= HAPI_PROFILE_MAX_STAGES; s++)
        t->in.cache_entry_bytes[s] = (double)hapi_cache_entry_bytes(
            cfg->cache, HAPI_TYPICAL_PATH, hapi_extractor_split_bytes(cfg->ex, s));
    t->compute_file_given = o->compute_file_ms >= 0;
    t->split_by_operator = o->split && strcmp(o->split, "auto") != 0;
    t->batch_auto = o->batch == 0;
    t->batch = o->batch;
    int rc = pthread_create(&t->thread, NULL, tune_main, t);
    if (rc != 0) {
        hapi_tune_stop(t);
        return hapi_error_set(err, -rc, "cannot start the policy thread: %s", hapi_strerror(-rc));
    }
    t->running = 1;
    *out = t;
    return 0;
}

void hapi_tune_stop(hapi_tune *t)
{
    if (!t)
        return;
    atomic_store(&t->stop, 1);
    if (t->running)
        pthread_join(t->thread, NULL);
    pthread_mutex_destroy(&t->lock);
    pthread_mutex_destroy(&t->switch_lock);
    free(t);
}

/* ------------------------------------------------------------- choosing */

int hapi_tune_choose(hapi_tune *t, int split, hapi_policy_input *in_out,
                     hapi_policy_choice *choice, hapi_error *err)
{
    hapi_policy_input in;
    if (split < 0) {
        hapi_view *v = hapi_views_peek(t->cfg.views);
        split = v ? v->split : 0;
        hapi_view_put(v);
    }
    pthread_mutex_lock(&t->lock);
    int state = t->state;
    if (state <= 0) {
        pthread_mutex_unlock(&t->lock);
        if (state == 0)
            return hapi_error_set(err, -EAGAIN, "the model is still being profiled");
        return hapi_error_set(err, HAPI_EINVAL, "no profile: %s", t->error);
    }
    in = t->in;
    in.profile = &t->profile;
    in.decode_ms = t->decode_ms;
    in.source_bytes = t->source_bytes;
    in.samples = atomic_load(&t->counted) ? atomic_load(&t->images) : 0;
    in.batch = t->batch_auto ? 0 : t->batch;
    in.split = split;
    if (in.samples) {
        /* The cache's state: how much of each split's features is already there. */
        for (int s = 1; s <= in.freeze && s <= HAPI_PROFILE_MAX_STAGES; s++) {
            hapi_cache_namespace ns;
            hapi_cache_namespace_stats st;
            hapi_views_namespace(t->cfg.views, s, &ns);
            if (hapi_cache_namespace_stats_get(t->cfg.cache, &ns, &st) == 0)
                in.cached[s] = (double)st.entries / (double)in.samples;
        }
    }
    int rc = hapi_policy_choose(&in, choice, err);
    pthread_mutex_unlock(&t->lock);
    if (in_out)
        *in_out = in;
    return rc;
}

/* ------------------------------------------------------------ live change */

int hapi_tune_set_split(hapi_tune *t, int split, int by_operator, hapi_error *err)
{
    int freeze = hapi_extractor_freeze(t->cfg.ex);
    if (split < 1 || split > freeze) {
        hapi_stage_info info;
        hapi_model_stage(hapi_extractor_model(t->cfg.ex), freeze - 1, &info);
        return hapi_error_set(err, HAPI_EINVAL,
                              "split %d is past the freeze index: stages [0, %d) (through %s) "
                              "are frozen", split, freeze, info.name);
    }
    pthread_mutex_lock(&t->switch_lock);
    int rc = 0;
    hapi_view *cur = hapi_views_peek(t->cfg.views), *nv = NULL;
    if (!cur) {
        rc = hapi_error_set(err, -EAGAIN, "the policy is still choosing the first split");
        goto out;
    }
    pthread_mutex_lock(&t->lock);
    t->split_by_operator = by_operator;
    int batch = t->batch, batch_auto = t->batch_auto;
    pthread_mutex_unlock(&t->lock);
    if (cur->split == split)
        goto out;

    if (batch_auto) {
        hapi_policy_choice *c = malloc(sizeof(*c));
        hapi_error cerr = { 0 };
        if (c && hapi_tune_choose(t, split, NULL, c, &cerr) == 0)
            batch = c->batch;
        free(c);
    }
    if ((rc = hapi_serve_view_new(t->cfg.serve, split, batch, model_bytes(t, split, batch), &nv,
                                  err)) < 0)
        goto out;
    char *warming = hapi_warm_pause(t->cfg.background);
    hapi_view *old = hapi_views_swap(t->cfg.views, nv);
    pthread_mutex_lock(&t->lock);
    t->batch = batch;
    pthread_mutex_unlock(&t->lock);
    atomic_fetch_add(&t->split_changes, 1);
    /* Readers see the new size and contents at their next open. */
    if (t->cfg.on_split_change)
        t->cfg.on_split_change(t->cfg.arg);
    hapi_log(HAPI_LOG_INFO, "split %d (%s) -> %d (%s), batch %d, namespace %s%s", old->split,
             old->output.name, nv->split, nv->output.name, batch, nv->ns_hex,
             by_operator ? "" : " (policy)");
    if (warming) {
        int wrc = hapi_warm_start(t->cfg.background, warming);
        if (wrc < 0)
            hapi_log(HAPI_LOG_WARNING, "warm-up not resumed: %s", hapi_strerror(wrc));
        free(warming);
    }
    hapi_view_put(old);
out:
    hapi_view_put(cur);
    pthread_mutex_unlock(&t->switch_lock);
    return rc;
}

int hapi_tune_set_batch(hapi_tune *t, int batch, hapi_error *err)
{
    if (batch < 0 || batch > HAPI_BATCH_MAX)
        return hapi_error_set(err, HAPI_EINVAL, "batch %d: expected auto or 1..%d", batch,
                              HAPI_BATCH_MAX);
    hapi_view *v = hapi_views_peek(t->cfg.views);
    if (!v)
        return hapi_error_set(err, -EAGAIN, "the policy is still choosing the first split");
    int rc = 0, chosen = batch;
    if (batch == 0) {
        hapi_policy_choice *c = malloc(sizeof(*c));
        pthread_mutex_lock(&t->lock);
        int was_auto = t->batch_auto;
        t->batch_auto = 1; /* so that the policy chooses the batch */
        pthread_mutex_unlock(&t->lock);
        rc = c ? hapi_tune_choose(t, v->split, NULL, c, err)
               : hapi_error_set(err, -ENOMEM, "out of memory");
        if (rc == 0)
            chosen = c->batch;
        free(c);
        pthread_mutex_lock(&t->lock);
        t->batch_auto = was_auto;
        pthread_mutex_unlock(&t->lock);
    }
    if (rc == 0) {
        pthread_mutex_lock(&t->lock);
        t->batch_auto = batch == 0;
        t->batch = chosen;
        pthread_mutex_unlock(&t->lock);
        hapi_batcher_set_batch(v->batcher, chosen);
        hapi_log(HAPI_LOG_INFO, "batch %d%s", chosen, batch == 0 ? " (auto)" : "");
    }
    hapi_view_put(v);
    return rc;
}

void hapi_tune_set_input(hapi_tune *t, int which, double value)
{
    pthread_mutex_lock(&t->lock);
    if (which == HAPI_TUNE_LINK)
        t->in.link_bps = value;
    else if (which == HAPI_TUNE_CLIENT_SPEED)
        t->in.client_speed = value;
    else if (which == HAPI_TUNE_EPOCHS)
        t->in.epochs = (int)value;
    else if (which == HAPI_TUNE_RTT)
        t->in.rtt_s = value;
    else if (which == HAPI_TUNE_TRANSPORT)
        t->in.transport = (int)value;
    else if (which == HAPI_TUNE_COMPUTE_CACHE)
        t->in.compute_cache = value;
    else if (which == HAPI_TUNE_LINK_BYTES)
        t->in.link_bytes = value > 0 ? value : 0; /* any (-1): no bound */
    else if (which == HAPI_TUNE_READERS)
        t->in.readers = (int)value;
    else if (which == HAPI_TUNE_COMPUTE_FILE_MS) {
        t->in.compute_file_ms = value >= 0 ? value : HAPI_POLICY_COMPUTE_FILE_MS;
        t->compute_file_given = value >= 0;
    }
    pthread_mutex_unlock(&t->lock);
}

void hapi_tune_set_compute_stages(hapi_tune *t, int n, const double *ms)
{
    pthread_mutex_lock(&t->lock);
    t->in.compute_nstages = n;
    memcpy(t->in.compute_stage_ms, ms, (size_t)n * sizeof(*ms));
    pthread_mutex_unlock(&t->lock);
}

void hapi_tune_status_get(hapi_tune *t, hapi_tune_status *st)
{
    pthread_mutex_lock(&t->lock);
    *st = (hapi_tune_status){
        .split_by_operator = t->split_by_operator,
        .batch = t->batch,
        .batch_auto = t->batch_auto,
        .link_bps = t->in.link_bps,
        .link_bytes = t->in.link_bytes,
        .client_speed = t->in.client_speed,
        .compute_file_ms = t->in.compute_file_ms,
        .compute_file_given = t->compute_file_given,
        .rtt_s = t->in.rtt_s,
        .transport = t->in.transport,
        .epochs = t->in.epochs,
        .split_changes = atomic_load(&t->split_changes),
        .state = t->state,
        .reused = t->reused,
        .decode_ms = t->decode_ms,
        .source_bytes = t->source_bytes,
        .decode_samples = t->decode_samples,
        .compute_nstages = t->in.compute_nstages,
    };
    memcpy(st->compute_stage_ms, t->in.compute_stage_ms, sizeof(st->compute_stage_ms));
    memcpy(st->error, t->error, sizeof(st->error));
    pthread_mutex_unlock(&t->lock);
}

char *hapi_tune_profile_json(hapi_tune *t)
{
    pthread_mutex_lock(&t->lock);
    char *text = t->state == 1 ? hapi_profile_to_json(&t->profile) : NULL;
    pthread_mutex_unlock(&t->lock);
    return text;
}

/* tune.c — the mount's split and batch: the profile at mount, the policy's choice, live changes. */
#include "fusefs-int.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Serving one cached .feat through FUSE, client side: 24–31 µs measured (cache issue). */
#define HIT_MS 0.03
/* Images whose decode and preprocessing are timed at mount. */
#define DECODE_SAMPLES 8

/* ------------------------------------------------------- decode sample */

struct sample_walk {
    char *paths[DECODE_SAMPLES];
    int n;
};

static int sample_one(hapi_fs *fs, const char *path, void *arg)
{
    struct sample_walk *w = arg;
    (void)fs;
    if (w->n == DECODE_SAMPLES)
        return -ECANCELED; /* enough */
    w->paths[w->n] = strdup(path);
    if (w->paths[w->n])
        w->n++;
    return 0;
}

/* Times decode + preprocessing of the first images of the tree; their mean size too. */
static void measure_decode(hapi_fs *fs, double *ms, double *bytes, int *count)
{
    struct sample_walk w = { .n = 0 };
    hapi_feat_walk(fs, "", &fs->tune.stop, sample_one, &w);
    const hapi_preprocess *pp = hapi_extractor_preprocess(fs->ex);
    float *tensor = malloc(3 * (size_t)pp->crop * (size_t)pp->crop * sizeof(float));
    hapi_decoder *dec = NULL;
    double total_ms = 0, total_bytes = 0;
    int done = 0;
    if (tensor && hapi_decoder_new(&dec) == 0) {
        for (int i = 0; i < w.n; i++) {
            void *data = NULL;
            size_t size = 0;
            hapi_error err = { 0 };
            if (hapi_feat_load(fs, w.paths[i], &data, &size, NULL, &err) == 0) {
                uint64_t t0 = hapi_now_ns();
                if (hapi_image_load(dec, data, size, pp, tensor, &err) == 0) {
                    total_ms += (double)(hapi_now_ns() - t0) / 1e6;
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

static int count_image(hapi_fs *fs, const char *path, void *arg)
{
    (void)path, (void)arg;
    atomic_fetch_add(&fs->tune.images, 1);
    return 0;
}

/* ------------------------------------------------------------- profile */

/* A stored profile is used only if it describes this very model. */
static int profile_matches(hapi_fs *fs, const hapi_profile *p)
{
    hapi_model *m = hapi_extractor_model(fs->ex);
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

static int get_profile(hapi_fs *fs, hapi_profile *prof, int *reused, hapi_error *err)
{
    char name[256], path[PATH_MAX + 300];
    const uint8_t *digest = hapi_extractor_model_digest(fs->ex);
    /* A bf16 model is another machine as far as timing goes: its own profile. */
    char device[64];
    snprintf(device, sizeof(device), "%s%s", fs->opt->device,
             fs->opt->precision == HAPI_PRECISION_BF16 ? "-bf16" : "");
    hapi_profile_file_name(digest, device, fs->opt->torch_threads, name, sizeof(name));
    snprintf(path, sizeof(path), "%s/%s", fs->opt->cache_dir, name);
    *reused = 0;
    if (!fs->opt->profile_redo) {
        hapi_error lerr = { 0 };
        int rc = hapi_profile_load(path, prof, &lerr);
        if (rc == 0 && profile_matches(fs, prof)) {
            *reused = 1;
            hapi_log(HAPI_LOG_INFO, "profile read from %s", path);
            return 0;
        }
        if (rc != -ENOENT)
            hapi_log(HAPI_LOG_WARNING, "profile %s not used (%s); measuring again", path,
                     rc < 0 ? lerr.message : "another model's");
    }
    hapi_log(HAPI_LOG_INFO, "profiling the model (once per model, device and thread count)");
    int rc = hapi_profile_measure(hapi_extractor_model(fs->ex), digest, device,
                                  fs->opt->torch_threads, fs->opt->mem_budget,
                                  &fs->tune.stop, prof, err);
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

static void publish(hapi_fs *fs, hapi_view *v)
{
    pthread_mutex_lock(&fs->view_lock);
    hapi_view *old = fs->view;
    fs->view = v;
    if (!v)
        fs->view_stopping = 1; /* nothing to serve: readers get an error, not a wait */
    pthread_cond_broadcast(&fs->view_cond);
    pthread_mutex_unlock(&fs->view_lock);
    hapi_view_put(old);
}

static void *tune_main(void *arg)
{
    hapi_fs *fs = arg;
    hapi_profile *prof = malloc(sizeof(*prof));
    hapi_error err = { 0 };
    int reused = 0, rc;

    rc = prof ? get_profile(fs, prof, &reused, &err) : hapi_error_set(&err, -ENOMEM, "out of memory");
    double decode_ms = 0, source_bytes = 0;
    int decoded = 0;
    if (!atomic_load(&fs->tune.stop))
        measure_decode(fs, &decode_ms, &source_bytes, &decoded);

    pthread_mutex_lock(&fs->tune.lock);
    if (rc == 0) {
        fs->tune.profile = *prof;
        fs->tune.reused = reused;
    } else {
        snprintf(fs->tune.error, sizeof(fs->tune.error), "%s", err.message);
    }
    fs->tune.decode_ms = decode_ms;
    fs->tune.source_bytes = source_bytes;
    fs->tune.decode_samples = decoded;
    fs->tune.state = rc == 0 ? 1 : (rc < 0 ? rc : -EIO);
    pthread_mutex_unlock(&fs->tune.lock);
    free(prof);
    if (rc < 0)
        hapi_log(HAPI_LOG_WARNING, "no profile (%s): the split is %s, the batch %d", err.message,
                 fs->tune.split_by_operator ? "the one given" : "the freeze index",
                 fs->tune.batch ? fs->tune.batch : 16);

    /* The first view: the operator's split or the policy's, and its batch. */
    int split = hapi_extractor_split(fs->ex);
    int batch = fs->tune.batch ? fs->tune.batch : 16;
    hapi_policy_choice *choice = malloc(sizeof(*choice));
    hapi_error perr = { 0 };
    if (choice && rc == 0 &&
        hapi_tune_choose(fs, fs->tune.split_by_operator ? split : 0, NULL, choice, &perr) == 0) {
        split = choice->split;
        batch = choice->batch;
        hapi_log(HAPI_LOG_INFO, "split %d (%s), batch %d: %s", split,
                 choice->cand[choice->index].name, batch, choice->why);
    } else if (rc == 0) {
        hapi_log(HAPI_LOG_WARNING, "policy: %s", choice ? perr.message : "out of memory");
    }
    free(choice);
    pthread_mutex_lock(&fs->tune.lock);
    fs->tune.batch = batch;
    pthread_mutex_unlock(&fs->tune.lock);

    hapi_view *v = NULL;
    if (!atomic_load(&fs->tune.stop) && hapi_feat_view_new(fs, split, batch, &v, &err) < 0)
        hapi_log(HAPI_LOG_ERROR, "cannot serve features: %s", err.message);
    publish(fs, v);
    if (v)
        hapi_log(HAPI_LOG_INFO, "serving split %d (%s), namespace %s", v->split, v->output.name,
                 v->ns_hex);

    /* The size of the tree, for epoch times and the cache's share of it. */
    if (hapi_feat_walk(fs, "", &fs->tune.stop, count_image, NULL) >= 0)
        atomic_store(&fs->tune.counted, 1);
    return NULL;
}

int hapi_tune_start(hapi_fs *fs, hapi_error *err)
{
    const hapi_fs_options *o = fs->opt;
    const hapi_preprocess *pp = hapi_extractor_preprocess(fs->ex);
    pthread_mutex_init(&fs->tune.lock, NULL);
    pthread_mutex_init(&fs->tune.switch_lock, NULL);
    fs->tune.in = (hapi_policy_input){
        .link_bps = o->link_bps,
        .client_speed = o->client_speed,
        .mem_budget = o->mem_budget,
        .freeze = hapi_extractor_freeze(fs->ex),
        .epochs = o->epochs,
        .dtype = o->dtype,
        .decode_threads = o->decode_threads,
        .header_bytes = 128,
        .input_bytes = 3 * (size_t)pp->crop * (size_t)pp->crop * sizeof(float),
        .hit_ms = HIT_MS,
        .cache_room = o->cache_size,
        .cache_entry_overhead = HAPI_CACHE_ENTRY_OVERHEAD,
    };
    fs->tune.split_by_operator = o->split && strcmp(o->split, "auto") != 0;
    fs->tune.batch_auto = o->batch == 0;
    fs->tune.batch = o->batch;
    int rc = pthread_create(&fs->tune.thread, NULL, tune_main, fs);
    if (rc != 0)
        return hapi_error_set(err, -rc, "cannot start the policy thread: %s", hapi_strerror(-rc));
    fs->tune.running = 1;
    /* Warm-up counts the tree at once and computes once the split is chosen. */
    if (o->warm && (rc = hapi_warm_start(fs, "")) < 0)
        hapi_log(HAPI_LOG_WARNING, "cannot start the warm-up: %s", hapi_strerror(rc));
    return 0;
}

void hapi_tune_stop(hapi_fs *fs)
{
    atomic_store(&fs->tune.stop, 1);
    pthread_mutex_lock(&fs->view_lock);
    fs->view_stopping = 1;
    pthread_cond_broadcast(&fs->view_cond);
    pthread_mutex_unlock(&fs->view_lock);
    if (fs->tune.running) {
        pthread_join(fs->tune.thread, NULL);
        fs->tune.running = 0;
    }
}

/* ------------------------------------------------------------- choosing */

int hapi_tune_choose(hapi_fs *fs, int split, hapi_policy_input *in_out,
                     hapi_policy_choice *choice, hapi_error *err)
{
    hapi_policy_input in;
    pthread_mutex_lock(&fs->tune.lock);
    int state = fs->tune.state;
    if (state <= 0) {
        pthread_mutex_unlock(&fs->tune.lock);
        if (state == 0)
            return hapi_error_set(err, -EAGAIN, "the model is still being profiled");
        return hapi_error_set(err, HAPI_EINVAL, "no profile: %s", fs->tune.error);
    }
    in = fs->tune.in;
    in.profile = &fs->tune.profile;
    in.decode_ms = fs->tune.decode_ms;
    in.source_bytes = fs->tune.source_bytes;
    in.samples = atomic_load(&fs->tune.counted) ? atomic_load(&fs->tune.images) : 0;
    in.batch = fs->tune.batch_auto ? 0 : fs->tune.batch;
    if (split < 0) {
        hapi_view *v = hapi_view_peek(fs);
        split = v ? v->split : 0;
        hapi_view_put(v);
    }
    in.split = split;
    if (in.samples) {
        /* The cache's state: how much of each split's features is already there. */
        for (int s = 1; s <= in.freeze && s <= HAPI_PROFILE_MAX_STAGES; s++) {
            hapi_cache_namespace ns;
            hapi_cache_namespace_stats st;
            hapi_cache_namespace_make(hapi_extractor_model_digest(fs->ex), s, fs->opt->dtype,
                                      fs->ns_desc, &ns);
            if (hapi_cache_namespace_stats_get(fs->cache, &ns, &st) == 0)
                in.cached[s] = (double)st.entries / (double)in.samples;
        }
    }
    int rc = hapi_policy_choose(&in, choice, err);
    pthread_mutex_unlock(&fs->tune.lock);
    if (in_out)
        *in_out = in;
    return rc;
}

/* ------------------------------------------------------------ live change */

int hapi_tune_set_split(hapi_fs *fs, int split, int by_operator, hapi_error *err)
{
    int freeze = hapi_extractor_freeze(fs->ex);
    if (split < 1 || split > freeze) {
        hapi_stage_info info;
        hapi_model_stage(hapi_extractor_model(fs->ex), freeze - 1, &info);
        return hapi_error_set(err, HAPI_EINVAL,
                              "split %d is past the freeze index: stages [0, %d) (through %s) "
                              "are frozen", split, freeze, info.name);
    }
    pthread_mutex_lock(&fs->tune.switch_lock);
    int rc = 0;
    hapi_view *cur = hapi_view_peek(fs), *nv = NULL;
    if (!cur) {
        rc = hapi_error_set(err, -EAGAIN, "the policy is still choosing the first split");
        goto out;
    }
    pthread_mutex_lock(&fs->tune.lock);
    fs->tune.split_by_operator = by_operator;
    int batch = fs->tune.batch, batch_auto = fs->tune.batch_auto;
    pthread_mutex_unlock(&fs->tune.lock);
    if (cur->split == split)
        goto out;

    if (batch_auto) {
        hapi_policy_choice *c = malloc(sizeof(*c));
        hapi_error cerr = { 0 };
        if (c && hapi_tune_choose(fs, split, NULL, c, &cerr) == 0)
            batch = c->batch;
        free(c);
    }
    if ((rc = hapi_feat_view_new(fs, split, batch, &nv, err)) < 0)
        goto out;
    char *warming = hapi_warm_pause(fs);
    pthread_mutex_lock(&fs->view_lock);
    hapi_view *old = fs->view;
    fs->view = nv;
    pthread_mutex_unlock(&fs->view_lock);
    pthread_mutex_lock(&fs->tune.lock);
    fs->tune.batch = batch;
    pthread_mutex_unlock(&fs->tune.lock);
    atomic_fetch_add(&fs->tune.split_changes, 1);
    /* Readers see the new size and contents at their next open. */
    hapi_fs_invalidate_feats(fs);
    hapi_log(HAPI_LOG_INFO, "split %d (%s) -> %d (%s), batch %d, namespace %s%s", old->split,
             old->output.name, nv->split, nv->output.name, batch, nv->ns_hex,
             by_operator ? "" : " (policy)");
    if (warming) {
        int wrc = hapi_warm_start(fs, warming);
        if (wrc < 0)
            hapi_log(HAPI_LOG_WARNING, "warm-up not resumed: %s", hapi_strerror(wrc));
        free(warming);
    }
    hapi_view_put(old);
out:
    hapi_view_put(cur);
    pthread_mutex_unlock(&fs->tune.switch_lock);
    return rc;
}

int hapi_tune_set_batch(hapi_fs *fs, int batch, hapi_error *err)
{
    if (batch < 0 || batch > HAPI_BATCH_MAX)
        return hapi_error_set(err, HAPI_EINVAL, "batch %d: expected auto or 1..%d", batch,
                              HAPI_BATCH_MAX);
    hapi_view *v = hapi_view_peek(fs);
    if (!v)
        return hapi_error_set(err, -EAGAIN, "the policy is still choosing the first split");
    int rc = 0, chosen = batch;
    if (batch == 0) {
        hapi_policy_choice *c = malloc(sizeof(*c));
        pthread_mutex_lock(&fs->tune.lock);
        int was_auto = fs->tune.batch_auto;
        fs->tune.batch_auto = 1; /* so that the policy chooses the batch */
        pthread_mutex_unlock(&fs->tune.lock);
        rc = c ? hapi_tune_choose(fs, v->split, NULL, c, err)
               : hapi_error_set(err, -ENOMEM, "out of memory");
        if (rc == 0)
            chosen = c->batch;
        free(c);
        pthread_mutex_lock(&fs->tune.lock);
        fs->tune.batch_auto = was_auto;
        pthread_mutex_unlock(&fs->tune.lock);
    }
    if (rc == 0) {
        pthread_mutex_lock(&fs->tune.lock);
        fs->tune.batch_auto = batch == 0;
        fs->tune.batch = chosen;
        pthread_mutex_unlock(&fs->tune.lock);
        hapi_batcher_set_batch(v->batcher, chosen);
        hapi_log(HAPI_LOG_INFO, "batch %d%s", chosen, batch == 0 ? " (auto)" : "");
    }
    hapi_view_put(v);
    return rc;
}

/* fs.c — the mounted filesystem built and torn down, layer by layer. */
#include "fs.h"
#include "fs-int.h"

#include <fuse_lowlevel.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <malloc.h> /* malloc_trim() */
#include <linux/fuse.h> /* struct fuse_out_header: a notice libfuse 3.14 cannot send */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

/* ------------------------------------------------------------- set-up */

/*
 * A compute-side mount: the cache, the remote feature source over the
 * storage mounts, and the control files; no model, batcher or policy.
 */
static int init_remote(hapi_fs *fs, hapi_fs_options *opt, hapi_error *err)
{
    int rc;
    hapi_cache_options copt = { .max_bytes = opt->cache_size, .reset = opt->cache_reset };
    if ((rc = hapi_cache_open(opt->cache_dir, &copt, &fs->cache, err)) < 0)
        return rc;
    fs->nodes = node_table_new();
    fs->errors = hapi_error_ring_new();
    if (!fs->nodes || !fs->errors)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    hapi_remote_config rcfg = {
        .roots = (const char *const *)opt->roots, .nroots = opt->nroots, .cache = fs->cache,
        .errors = fs->errors, .refresh_ms = opt->refresh_ms,
        .fetch_threads = opt->fetch_threads, .on_change = invalidate_remote_feats, .arg = fs,
        .finish = opt->finish, .model_dir = opt->cache_dir, .precision = opt->precision,
        .torch_threads = opt->torch_threads,
    };
    if ((rc = notifier_start(fs)) < 0)
        return hapi_error_set(err, rc, "cannot start a thread: %s", strerror(-rc));
    if ((rc = hapi_remote_open(&rcfg, &fs->remote, err)) < 0)
        return rc;
    /* The storage side's model archive, for the training side's remaining stages. */
    rc = hapi_remote_open_storage_file(fs->remote, "model");
    fs->model_fd = rc >= 0 ? rc : -1;
    hapi_ctl_config ccfg = {
        .opt = opt, .requests = &fs->requests, .cache = fs->cache, .remote = fs->remote,
        .errors = fs->errors, .uring = &fs->uring,
        .started_ns = fs->started_ns,
    };
    if ((rc = hapi_ctl_new(&ccfg, &fs->ctl)) < 0)
        return hapi_error_set(err, rc, "out of memory");
    return 0;
}

/*
 * Joins the node's shared budget and cores. Until the policy has chosen a
 * split, the mount's share is its model file's size (about its weights).
 * Failing to join is a warning, and the mount runs alone, unless the operator
 * asked for the node with node=, node_mem= or node_cores=.
 */
static int join_node(hapi_fs *fs, const hapi_fs_options *opt, hapi_error *err)
{
    if (!opt->node_path)
        return 0;
    hapi_node_config ncfg = { .path = opt->node_path, .mem_total = opt->node_mem,
                              .cores = opt->node_cores, .name = opt->mountpoint };
    hapi_error nerr = { 0 };
    int rc = hapi_node_open(&ncfg, &fs->node_share, &nerr);
    if (rc < 0) {
        if (opt->node_required)
            return hapi_error_set(err, rc, "node=%s: %s", opt->node_path, nerr.message);
        hapi_log(HAPI_LOG_WARNING, "the node's shared budget is unavailable (%s): this mount "
                 "counts only its own mem=", nerr.message);
        return 0;
    }
    struct stat st;
    if (fs->model_fd >= 0 && fstat(fs->model_fd, &st) == 0)
        hapi_node_set_fixed(fs->node_share, (uint64_t)st.st_size);
    return 0;
}

/*
 * The names of m's stages that run in precision into `in`, of the others into `out` (", "
 * between them, each of size bytes), and the lowest cosine against fp32 of a stage's
 * features at the bf16 check or the int8 calibration (1 when none was measured).
 */
static double stages_in(hapi_model *m, int precision, char *in, char *out, size_t size)
{
    double lowest = 1.0;
    int n = hapi_model_num_stages(m);
    in[0] = out[0] = '\0';
    for (int i = 0; i < n; i++) {
        hapi_stage_info info;
        if (hapi_model_stage(m, i, &info) < 0)
            continue;
        char *list = info.precision == precision ? in : out;
        size_t len = strlen(list);
        if (len < size)
            snprintf(list + len, size - len, "%s%s", len ? ", " : "", info.name);
        if (info.check_cosine != 0.0 && info.check_cosine < lowest)
            lowest = info.check_cosine;
    }
    return lowest;
}

/* What a bf16 model's check at the probe found (HAPI_BF16_MIN_COSINE): the stages it moved
   to fp32, and how close to fp32 the model runs. */
static void log_bf16_check(hapi_model *m)
{
    char kept[512], moved[512];
    double lowest = stages_in(m, HAPI_PRECISION_BF16, kept, moved, sizeof(kept));
    if (moved[0])
        hapi_log(HAPI_LOG_INFO, "precision=bf16: stages %s run in fp32: in bf16 the features "
                 "fell below cosine %g of fp32's on the check's inputs; every stage's is %.6f "
                 "or more", moved, HAPI_BF16_MIN_COSINE, lowest);
    else
        hapi_log(HAPI_LOG_INFO, "precision=bf16: every stage in bf16, its features at cosine "
                 "%.6f or more of fp32's on the check's inputs", lowest);
}

/* How an int8 model was calibrated: on what, which stages run in int8,
   how close to fp32. */
static void log_int8_calibration(const hapi_extractor *ex, const char *source)
{
    const hapi_calibration *c = hapi_extractor_calibration(ex);
    char int8[512], fp32[512], on[PATH_MAX + 64];
    double lowest = stages_in(hapi_extractor_model(ex), HAPI_PRECISION_INT8, int8, fp32,
                              sizeof(int8));
    if (c->images > 0)
        snprintf(on, sizeof(on), "the first %d images of %s", c->images, source);
    else
        snprintf(on, sizeof(on), "%d seeded image-like samples (no image in %s)",
                 HAPI_INT8_CALIBRATION_IMAGES, source);
    hapi_log(HAPI_LOG_INFO, "precision=int8: calibrated on %s in %.1f s, a stage int8 while "
             "every stage stays within cosine %g of fp32 and the freeze point within %g; int8: "
             "%s; fp32: %s; features at cosine %.6f or more of fp32's there", on, c->seconds,
             HAPI_INT8_MIN_COSINE, c->min_cosine, int8[0] ? int8 : "none",
             fp32[0] ? fp32 : "none", lowest);
}

/* The model at precision, as the mount's options say; a bf16 one's check logged, an int8
   one calibrated on the source's first images, its stages kept int8 within int8_min_cosine
   of fp32 (0: HAPI_INT8_MIN_COSINE). */
static int open_extractor(const hapi_fs_options *opt, int precision, double int8_min_cosine,
                          hapi_extractor **out, hapi_error *err)
{
    hapi_extractor_config cfg = {
        .model_path = opt->model,
        .split = opt->split,
        .freeze = opt->freeze,
        .dtype = opt->dtype,
        .mode = opt->mode,
        .max_pixels = opt->max_pixels,
        .threads = opt->torch_threads,
        .device = opt->device,
        .precision = precision,
        .calibrate_dir = opt->source,
        .int8_min_cosine = int8_min_cosine,
    };
    int rc = hapi_extractor_open(&cfg, out, err);
    if (rc == 0 && precision == HAPI_PRECISION_BF16)
        log_bf16_check(hapi_extractor_model(*out));
    if (rc == 0 && precision == HAPI_PRECISION_INT8)
        log_int8_calibration(*out, opt->source);
    return rc;
}

/* Where precision=auto's choice for this model, BLAS and thread count is kept: path, of
   PATH_MAX + 300 bytes. */
static void choice_path(const hapi_fs_options *opt, const uint8_t digest[16], char *path)
{
    char hex[33];
    hapi_hex(digest, 16, hex);
    snprintf(path, PATH_MAX + 300, "%s/precision-%s-cpu-%s-t%d.json", opt->cache_dir, hex,
             hapi_model_blas(), opt->torch_threads);
}

/*
 * precision=auto (policy.h): the choice kept in the cache directory for this model if there
 * is one (and profile_redo does not ask again), else fp32, bf16 and int8 loaded (each with its
 * check; int8 calibrated on the source, its stages kept int8 while the freeze point's features
 * stay within auto's bound, HAPI_PRECISION_MIN_COSINE) and timed, the fastest kept. A
 * device other than the CPU runs fp32 (bf16 and int8 are the CPU's). Sets opt->precision to
 * the one chosen and fs->ex to its extractor.
 */
static int open_auto(hapi_fs *fs, hapi_fs_options *opt, hapi_error *err)
{
    hapi_precision_choice *c = &fs->precision_auto;
    int rc;
    uint8_t digest[16];
    char path[PATH_MAX + 300];
    opt->precision = HAPI_PRECISION_FP32;
    if (strcmp(opt->device, "cpu") != 0) {
        hapi_log(HAPI_LOG_INFO, "precision=auto on %s: fp32 (bf16 and int8 run on the CPU only)",
                 opt->device);
        return open_extractor(opt, HAPI_PRECISION_FP32, 0, &fs->ex, err);
    }
    if ((rc = hapi_file_digest(opt->model, digest, err)) < 0)
        return rc;
    choice_path(opt, digest, path);
    hapi_error lerr = { 0 };
    if (!opt->profile_redo && (rc = hapi_precision_choice_load(path, c, &lerr)) == 0) {
        opt->precision = c->precision;
        hapi_log(HAPI_LOG_INFO, "precision=auto: %s, as chosen before (%s): %s",
                 hapi_precision_name(c->precision), path, c->why);
        return open_extractor(opt, c->precision, HAPI_PRECISION_MIN_COSINE, &fs->ex, err);
    }
    if (!opt->profile_redo && rc != -ENOENT)
        hapi_log(HAPI_LOG_WARNING, "precision=auto: %s; choosing again", lerr.message);
    hapi_extractor *ex[HAPI_PRECISION_CANDIDATES] = { NULL };
    hapi_model *m[HAPI_PRECISION_CANDIDATES] = { NULL };
    double setup[HAPI_PRECISION_CANDIDATES] = { 0 };
    for (int p = 0; p < HAPI_PRECISION_CANDIDATES; p++) {
        uint64_t t0 = hapi_now_ns();
        rc = open_extractor(opt, p, HAPI_PRECISION_MIN_COSINE, &ex[p],
                            p == HAPI_PRECISION_FP32 ? err : &lerr);
        setup[p] = (double)(hapi_now_ns() - t0) / 1e9;
        if (rc < 0 && p == HAPI_PRECISION_FP32)
            return rc;
        if (rc < 0) /* libtorch without it here: not a candidate */
            hapi_log(HAPI_LOG_WARNING, "precision=auto: %s does not load: %s",
                     hapi_precision_name(p), lerr.message);
        m[p] = ex[p] ? hapi_extractor_model(ex[p]) : NULL;
    }
    rc = hapi_precision_choose(m, setup, hapi_extractor_meta(ex[0])->input_size,
                               hapi_extractor_freeze(ex[0]), c, err);
    for (int p = 0; p < HAPI_PRECISION_CANDIDATES; p++)
        if (ex[p] && (rc < 0 || p != c->precision))
            hapi_extractor_close(ex[p]);
    if (rc < 0)
        return rc;
    opt->precision = c->precision;
    fs->ex = ex[c->precision];
    /* the losers' memory back to the system, as after a calibration */
    malloc_trim(0);
    hapi_log(HAPI_LOG_INFO, "precision=auto: %s, measured in %.1f s (%.1f s on the pruned): %s",
             hapi_precision_name(c->precision), c->seconds, c->pruned_seconds, c->why);
    return 0;
}

/* Stores precision=auto's fresh choice beside the profiles, once the cache directory is. */
static void keep_choice(hapi_fs *fs, const hapi_fs_options *opt)
{
    hapi_precision_choice *c = &fs->precision_auto;
    char path[PATH_MAX + 300];
    hapi_error serr = { 0 };
    if (c->batch == 0 || c->stored)
        return;
    choice_path(opt, hapi_extractor_model_digest(fs->ex), path);
    char *text = hapi_precision_choice_to_json(c);
    if (!text || hapi_policy_save_text(path, text, &serr) < 0)
        hapi_log(HAPI_LOG_WARNING, "precision=auto: the choice is not kept: %s",
                 text ? serr.message : "out of memory");
    free(text);
}

/* A storage mount's lowest layers: the source, the node's share, the model, the cache. */
static int init_lower(hapi_fs *fs, hapi_fs_options *opt, hapi_error *err)
{
    int rc;
    if ((rc = hapi_source_open(opt->source, &fs->source, err)) < 0)
        return rc;
    if ((rc = join_node(fs, opt, err)) < 0)
        return rc;
    /* A batch's tensors reuse the last one's memory, up to the budget (extractor.h). */
    hapi_extractor_keep_heap(opt->mem_budget);
    rc = opt->precision == HAPI_PRECISION_AUTO
             ? open_auto(fs, opt, err)
             : open_extractor(opt, opt->precision, 0, &fs->ex, err);
    if (rc < 0)
        return rc;
    hapi_cache_options copt = { .max_bytes = opt->cache_size, .reset = opt->cache_reset };
    if ((rc = hapi_cache_open(opt->cache_dir, &copt, &fs->cache, err)) < 0)
        return rc;
    keep_choice(fs, opt);
    return 0;
}

/*
 * The node table with its root, the error ring, and with watch=1 the notices' watchdog and
 * the source's watch; then whether the kernel may read without opens.
 */
static int init_nodes(hapi_fs *fs, const hapi_fs_options *opt, hapi_error *err)
{
    int rc;
    fs->nodes = node_table_new();
    fs->errors = hapi_error_ring_new();
    if (!fs->nodes || !fs->errors)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    if (opt->watch) {
        if ((rc = watchdog_start(fs)) < 0)
            return hapi_error_set(err, rc, "cannot start the notices' watchdog: %s",
                                  strerror(-rc));
        if ((rc = hapi_watch_new(on_change, fs, &fs->watch, err)) < 0)
            return rc;
        fs->nodes->watch = fs->watch;
    }
    /* The root, in the table so that it has a watch like any directory; never forgotten. */
    if ((rc = node_ref(fs->nodes, FUSE_ROOT_ID, HAPI_NODE_DIR, "", NULL, 0, ENTRY_TIMEOUT)) < 0)
        return hapi_error_set(err, rc, "out of memory");
    if (rc == 1)
        watch_dir(fs, FUSE_ROOT_ID, "");
    /* Without opens, freshness rests on the watch: only over a watched source. */
    uint64_t changes;
    fs->no_open = opt->no_open && fs->watch &&
                  dir_timeout(fs, FUSE_ROOT_ID, &changes) == WATCHED_TIMEOUT;
    return 0;
}

/*
 * batch_wait is wall time at a whole CPU. Under a CFS quota below one CPU the next image
 * decodes 1/quota times slower, and a partial batch that waited only batch_wait runs alone:
 * measured under a quarter of a CPU, batches of 1.0 where the same reads made batches of 12
 * unthrottled, and a first epoch 2.5x as long at the late splits. So the wait stretches by
 * 1/quota (at most BATCH_WAIT_MAX_US). Returns the wait in microseconds.
 */
static int stretched_batch_wait(const hapi_fs_options *opt)
{
    int batch_wait_us = opt->batch_wait_us;
    double quota = hapi_cpu_quota("/proc/self/cgroup", "/sys/fs/cgroup");
    if (quota > 0 && quota < 1 && batch_wait_us > 0) {
        batch_wait_us = (int)fmin(batch_wait_us / quota, BATCH_WAIT_MAX_US);
        hapi_log(HAPI_LOG_INFO, "a CPU quota of %.3g CPUs: a partial batch waits %.1f ms for "
                 "more reads (batch_wait=%d at a whole CPU)", quota, batch_wait_us / 1e3,
                 opt->batch_wait_us / 1000);
    }
    return batch_wait_us;
}

/* The layers that serve, in the order they are built: views, serve, packs, background. */
static int init_serving(hapi_fs *fs, const hapi_fs_options *opt, hapi_error *err)
{
    int rc;
    if ((rc = hapi_views_new(fs->ex, opt->dtype, opt->precision, &fs->views, err)) < 0)
        return rc;
    hapi_serve_config scfg = {
        .source = fs->source, .ex = fs->ex, .cache = fs->cache, .views = fs->views,
        .errors = fs->errors, .batch_wait_us = stretched_batch_wait(opt),
        .decode_threads = opt->decode_threads, .mem_budget = opt->mem_budget,
        .node = fs->node_share, .torch_threads = opt->torch_threads,
        .inference_workers = opt->inference_workers,
    };
    if ((rc = hapi_serve_new(&scfg, &fs->serve, err)) < 0)
        return rc;
    if ((rc = hapi_packs_new(fs->source, fs->views, fs->serve, &fs->packs)) < 0)
        return hapi_error_set(err, rc, "out of memory");
    hapi_background_config bcfg = {
        .source = fs->source, .cache = fs->cache, .views = fs->views, .serve = fs->serve,
        .prefetch = opt->prefetch, .cache_size = opt->cache_size, .warm = opt->warm,
    };
    return hapi_background_start(&bcfg, &fs->background, err);
}

/* The layers above serving: the policy's thread (tune) and the control files. */
static int init_control(hapi_fs *fs, const hapi_fs_options *opt, hapi_error *err)
{
    int rc;
    /* The split and batch are chosen in the background; .feat operations wait for them. */
    hapi_tune_config tcfg = {
        .opt = opt, .source = fs->source, .ex = fs->ex, .cache = fs->cache, .views = fs->views,
        .serve = fs->serve, .background = fs->background, .node = fs->node_share,
        .on_split_change = invalidate_feats,
        .arg = fs, .serving = opt->serving_gate ? fs_serving : NULL,
    };
    if ((rc = hapi_tune_start(&tcfg, &fs->tune, err)) < 0)
        return rc;
    hapi_ctl_config ccfg = {
        .opt = opt, .requests = &fs->requests, .source = fs->source, .ex = fs->ex,
        .cache = fs->cache, .views = fs->views,
        .serve = fs->serve, .packs = fs->packs, .background = fs->background,
        .tune = fs->tune, .errors = fs->errors, .node = fs->node_share, .watch = fs->watch,
        .no_open = fs->no_open, .uring = &fs->uring, .epochs = &fs->epochs,
        .epoch_notices = &fs->epoch_notices,
        .started_ns = fs->started_ns,
        .precision_auto = fs->precision_auto.batch ? &fs->precision_auto : NULL,
    };
    if ((rc = hapi_ctl_new(&ccfg, &fs->ctl)) < 0)
        return hapi_error_set(err, rc, "out of memory");
    return 0;
}

/* Builds the layers from the bottom; on a failure hapi_fs_destroy() undoes what was built. */
int hapi_fs_init(hapi_fs *fs, hapi_fs_options *opt, hapi_error *err)
{
    int rc;

    memset(fs, 0, sizeof(*fs));
    pthread_mutex_init(&fs->handles_lock, NULL);
    fs->handles.next = fs->handles.prev = &fs->handles;
    fs->opt = opt;
    fs->src = opt->remote ? &featsrc_remote : &featsrc_local;
    /* The model file as loaded, for .hapifs/model, even if the path is replaced later. */
    fs->model_fd = opt->remote ? -1 : open(opt->model, O_RDONLY | O_CLOEXEC);
    fs->started_ns = hapi_now_ns();
    fs->started_realtime = time(NULL);
    if (opt->remote)
        rc = init_remote(fs, opt, err);
    else if ((rc = init_lower(fs, opt, err)) == 0 && (rc = init_nodes(fs, opt, err)) == 0 &&
             (rc = init_serving(fs, opt, err)) == 0)
        rc = init_control(fs, opt, err);
    if (rc < 0)
        hapi_fs_destroy(fs);
    return rc;
}

/*
 * From the top: the policy thread first (it makes views and tells the
 * background the tree's size), then no view may come any more (a warm-up
 * waiting for the first goes), the background threads, and the rest.
 */
void hapi_fs_stop_watching(hapi_fs *fs)
{
    hapi_watch_free(fs->watch);
    fs->watch = NULL;
    watchdog_stop(fs); /* after the watch thread, which uses it */
    notifier_stop(fs);
    change_batch_free(fs->changes);
    fs->changes = NULL;
    if (fs->nodes)
        fs->nodes->watch = NULL;
}

void hapi_fs_destroy(hapi_fs *fs)
{
    if (!fs->opt)
        return; /* never set up, or destroyed already */
    hapi_fs_stop_watching(fs);
    handles_free_all(fs); /* they hold views, packs, the remote's files */
    node_table_drop_packs(fs->nodes);
    hapi_ctl_free(fs->ctl);
    hapi_remote_close(fs->remote);
    notifier_free(fs); /* after the remote, which calls it */
    hapi_tune_stop(fs->tune);
    if (fs->views)
        hapi_views_stop(fs->views);
    hapi_background_stop(fs->background);
    hapi_views_free(fs->views); /* the batchers go with the views, before serve */
    hapi_packs_free(fs->packs);
    hapi_serve_free(fs->serve);
    node_table_free(fs->nodes);
    hapi_error_ring_free(fs->errors);
    hapi_cache_close(fs->cache);
    hapi_extractor_close(fs->ex);
    hapi_source_close(fs->source);
    hapi_node_close(fs->node_share);
    if (fs->model_fd >= 0)
        close(fs->model_fd);
    memset(fs, 0, sizeof(*fs));
    fs->model_fd = -1;
}

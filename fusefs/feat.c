/* feat.c — serving .feat reads: cache lookups, the batcher's load and sink, background warm-up. */
#include "fusefs-int.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------- source files */

static void identity_of(const struct stat *st, hapi_source_id *id)
{
    *id = (hapi_source_id){
        .size = (uint64_t)st->st_size,
        .mtime_ns = (int64_t)st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec,
        .ctime_ns = (int64_t)st->st_ctim.tv_sec * 1000000000 + st->st_ctim.tv_nsec,
        .ino = (uint64_t)st->st_ino,
    };
}

int hapi_feat_identity(hapi_fs *fs, const char *path, hapi_source_id *id)
{
    struct stat st;
    int rc = hapi_fs_stat_beneath(fs->source_fd, path, &st);
    if (rc == 0 && !S_ISREG(st.st_mode))
        rc = -EINVAL;
    if (rc == 0)
        identity_of(&st, id);
    return rc;
}

/*
 * Reads the whole file and the identity it had while being read. A file
 * replaced or rewritten during the read is read again, so the features
 * stored under an identity are those of exactly that content: a reader
 * gets the old or the new features, never a mix.
 */
int hapi_feat_load(hapi_fs *fs, const char *path, void **data, size_t *size, hapi_source_id *id,
                   hapi_error *err)
{
    int rc = 0;
    for (int attempt = 0; attempt < 3; attempt++) {
        struct stat before, after;
        int fd = hapi_fs_open_beneath(fs->source_fd, path, O_RDONLY);
        if (fd < 0)
            return hapi_error_set(err, fd, "cannot open the source: %s", hapi_strerror(fd));
        if (fstat(fd, &before) < 0) {
            rc = -errno;
            close(fd);
            return hapi_error_set(err, rc, "cannot stat the source: %s", hapi_strerror(rc));
        }
        size_t cap = (size_t)before.st_size + 1, used = 0;
        char *buf = malloc(cap);
        if (!buf) {
            close(fd);
            return hapi_error_set(err, -ENOMEM, "out of memory for %zu bytes", cap);
        }
        for (;;) {
            if (used == cap) {
                char *bigger = realloc(buf, cap * 2);
                if (!bigger) {
                    rc = -ENOMEM;
                    break;
                }
                buf = bigger;
                cap *= 2;
            }
            ssize_t r = pread(fd, buf + used, cap - used, (off_t)used);
            if (r < 0 && errno == EINTR)
                continue;
            if (r < 0) {
                rc = -errno;
                break;
            }
            if (r == 0)
                break;
            used += (size_t)r;
        }
        if (rc == 0 && fstat(fd, &after) < 0)
            rc = -errno;
        close(fd);
        if (rc < 0) {
            free(buf);
            return hapi_error_set(err, rc, "cannot read the source: %s", hapi_strerror(rc));
        }
        hapi_source_id a, b;
        identity_of(&before, &a);
        identity_of(&after, &b);
        if (memcmp(&a, &b, sizeof(a)) == 0 && used == a.size) {
            if (id)
                *id = a;
            *data = buf;
            *size = used;
            return 0;
        }
        free(buf); /* changed under us: read it again */
    }
    return hapi_error_set(err, -EAGAIN, "the source kept changing while being read");
}

/* The batcher's loader: the source's bytes, and its identity as the tag. */
static int load_source(void *ctx, const char *path, void **data, size_t *size, void *tag,
                       hapi_error *err)
{
    hapi_source_id id;
    int rc = hapi_feat_load(((hapi_view *)ctx)->fs, path, data, size, &id, err);
    if (rc == 0)
        memcpy(tag, &id, sizeof(id)); /* the tag buffer need not be aligned */
    return rc;
}

/* Stores a finished batch in one write transaction and records failures. */
static void store_results(void *ctx, const hapi_batch_result *results, size_t n)
{
    hapi_view *v = ctx;
    hapi_fs *fs = v->fs;
    hapi_cache_item stack_items[64];
    hapi_cache_item *items = n <= 64 ? stack_items : malloc(n * sizeof(*items));
    size_t ok = 0;

    for (size_t i = 0; i < n; i++) {
        const hapi_batch_result *r = &results[i];
        if (r->origin == HAPI_PRIORITY_WARM)
            atomic_fetch_add(&fs->warm.completed, 1);
        if (r->origin == HAPI_PRIORITY_PREFETCH && r->code >= 0)
            atomic_fetch_add(&fs->prefetch.computed, 1);
        if (r->code < 0 && r->origin == HAPI_PRIORITY_PREFETCH &&
            r->priority == HAPI_PRIORITY_PREFETCH)
            continue; /* nobody asked for it: an error when somebody reads the file */
        if (r->code < 0) {
            atomic_fetch_add(&fs->stats.errors, 1);
            hapi_error_ring_add(fs->errors, r->key, r->code, r->message);
            continue;
        }
        atomic_fetch_add(&fs->stats.computed, 1);
        if (items) {
            items[ok].path = r->key;
            memcpy(&items[ok].id, r->tag, sizeof(hapi_source_id));
            items[ok].data = r->features;
            items[ok].size = v->sample_bytes;
            ok++;
        }
    }
    if (ok) {
        hapi_error err = { 0 };
        if (hapi_cache_put(fs->cache, &v->ns, items, ok, &err) < 0) {
            atomic_fetch_add(&fs->stats.cache_put_failures, ok);
            hapi_log(HAPI_LOG_WARNING, "%zu features not cached: %s", ok, err.message);
        }
    }
    if (items != stack_items)
        free(items);
}

/* ----------------------------------------------------------------- reads */

/*
 * The part of the .feat's bytes [off, off + size) that lies in the data
 * (after the header), as offsets into the data: [*dpos, *dend).
 */
static void data_slice(const hapi_view *v, size_t size, off_t off, size_t *dpos, size_t *dend)
{
    size_t pos = (size_t)off, end = pos + size;
    if (end > v->feat_size)
        end = (size_t)v->feat_size;
    if (pos < v->npy_header_len)
        pos = v->npy_header_len;
    *dpos = pos - v->npy_header_len;
    *dend = end > pos ? end - v->npy_header_len : *dpos;
}

/*
 * Replies bytes [off, off + size) of the .feat made of header + data, where
 * slice holds the data's bytes from offset slice_off on (at least the part
 * data_slice() gives: what a hit copies out is exactly that).
 */
static void reply_feat(fuse_req_t req, hapi_view *v, const void *slice, size_t slice_off,
                       size_t size, off_t off)
{
    struct iovec iov[2];
    int n = 0;
    size_t pos = (size_t)off, hdr = v->npy_header_len, bytes = 0;
    if (pos < hdr && size > 0) {
        size_t stop = size < hdr - pos ? pos + size : hdr;
        iov[n++] = (struct iovec){ v->npy_header + pos, stop - pos };
        bytes += stop - pos;
    }
    size_t dpos, dend;
    data_slice(v, size, off, &dpos, &dend);
    if (dend > dpos) {
        iov[n++] = (struct iovec){ (char *)slice + (dpos - slice_off), dend - dpos };
        bytes += dend - dpos;
    }
    atomic_fetch_add(&v->fs->stats.feat_bytes, bytes);
    if (n == 0)
        fuse_reply_buf(req, NULL, 0);
    else
        fuse_reply_iov(req, iov, n);
}

/*
 * A hit's bytes are copied out of the store before the reply. Replying
 * straight from the map would hold the lookup's snapshot through the write
 * to /dev/fuse, and a reader thread descheduled there (2 busy cores) pins the
 * pages eviction frees: a full store then refused puts. A slice up to this
 * size goes through the stack; a larger one (a read of a big layer4 .feat)
 * through the heap, and from the map only if that allocation fails.
 */
#define HIT_STACK_COPY 16384

/* Looks the features up; on a hit replies with a copy of them (above) and returns 1. */
static int reply_from_cache(fuse_req_t req, hapi_view *v, const char *path,
                            const hapi_source_id *id, size_t size, off_t off)
{
    hapi_fs *fs = v->fs;
    hapi_cache_value val;
    uint64_t t0 = hapi_now_ns();
    int rc = hapi_cache_get(fs->cache, &v->ns, path, id, &val);
    if (rc == 1) {
        if (val.size == v->sample_bytes) {
            size_t dpos, dend;
            data_slice(v, size, off, &dpos, &dend);
            size_t len = dend - dpos;
            char stack_buf[HIT_STACK_COPY];
            char *buf = len <= sizeof(stack_buf) ? stack_buf : malloc(len);
            if (buf && len)
                memcpy(buf, (const char *)val.data + dpos, len);
            if (buf)
                hapi_cache_release(fs->cache, &val);
            /* Counted before the reply: a reader that got its bytes sees the hit in stats. */
            atomic_fetch_add(&fs->stats.hits, 1);
            atomic_fetch_add(&fs->stats.hit_ns, hapi_now_ns() - t0);
            if (buf) {
                reply_feat(req, v, buf, dpos, size, off);
                if (buf != stack_buf)
                    free(buf);
            } else {
                reply_feat(req, v, val.data, 0, size, off);
                hapi_cache_release(fs->cache, &val);
            }
            return 1;
        }
        hapi_cache_release(fs->cache, &val);
        atomic_fetch_add(&fs->stats.bad, 1);
        hapi_log(HAPI_LOG_WARNING, "%s: cached features have %zu bytes, expected %zu; recomputing",
                 path, val.size, v->sample_bytes);
    } else if (rc == 0 && val.miss == HAPI_CACHE_MISS_STALE) {
        atomic_fetch_add(&fs->stats.stale, 1); /* the source changed: recompute */
    } else if (rc == 0 && val.miss == HAPI_CACHE_MISS_BAD) {
        atomic_fetch_add(&fs->stats.bad, 1);
        hapi_log(HAPI_LOG_WARNING, "%s: cached features are damaged (length or checksum); "
                 "recomputing", path);
    } else if (rc < 0) {
        hapi_log(HAPI_LOG_WARNING, "%s: cache lookup failed: %s", path, hapi_strerror(rc));
    }
    return 0;
}

void hapi_feat_read(fuse_req_t req, hapi_view *v, const char *path, const hapi_source_id *id,
                    size_t size, off_t off)
{
    hapi_fs *fs = v->fs;
    atomic_fetch_add(&fs->stats.feat_reads, 1);
    if ((uint64_t)off >= v->feat_size) {
        fuse_reply_buf(req, NULL, 0);
        return;
    }
    if (reply_from_cache(req, v, path, id, size, off))
        return;

    /* A miss: the batcher computes it once, however many readers wait for it. */
    atomic_fetch_add(&fs->stats.misses, 1);
    hapi_ticket *t = NULL;
    hapi_error err = { 0 };
    const void *features;
    int rc = hapi_batcher_submit(v->batcher, path, HAPI_PRIORITY_DEMAND, &t);
    if (rc == 0)
        hapi_prefetch_note(fs, v, path); /* after the read's own request: it goes first */
    if (rc == 0)
        rc = hapi_ticket_wait(v->batcher, t, &features, NULL, &err);
    if (rc == 0)
        reply_feat(req, v, features, 0, size, off);
    else
        fuse_reply_err(req, hapi_fs_errno(rc)); /* the sink has logged why */
    hapi_ticket_release(v->batcher, t);
}

/* ---------------------------------------------------------------- warm-up */

static int walk(hapi_fs *fs, const char *dir, atomic_int *stop, int recurse,
                int (*fn)(hapi_fs *, const char *, void *), void *arg)
{
    int fd = hapi_fs_open_beneath(fs->source_fd, dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0)
        return fd == -ENOTDIR ? 0 : fd;
    DIR *d = fdopendir(fd);
    if (!d) {
        close(fd);
        return -errno;
    }
    int rc = 0;
    struct dirent *de;
    while (rc >= 0 && !(stop && atomic_load(stop)) && (de = readdir(d)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
            continue;
        char *child = NULL;
        if (asprintf(&child, "%s%s%s", dir, *dir ? "/" : "", de->d_name) < 0) {
            rc = -ENOMEM;
            break;
        }
        if (de->d_type == DT_DIR) {
            if (recurse)
                rc = walk(fs, child, stop, recurse, fn, arg);
        } else if ((de->d_type == DT_REG || de->d_type == DT_LNK || de->d_type == DT_UNKNOWN) &&
                   hapi_image_name_is_image(de->d_name)) {
            rc = fn(fs, child, arg);
        } else if (de->d_type == DT_LNK || de->d_type == DT_UNKNOWN) {
            struct stat st;
            if (recurse && hapi_fs_stat_beneath(fs->source_fd, child, &st) == 0 &&
                S_ISDIR(st.st_mode))
                rc = walk(fs, child, stop, recurse, fn, arg);
        }
        free(child);
    }
    closedir(d);
    return rc;
}

int hapi_feat_walk(hapi_fs *fs, const char *dir, atomic_int *stop,
                   int (*fn)(hapi_fs *, const char *, void *), void *arg)
{
    return walk(fs, dir, stop, 1, fn, arg);
}

int hapi_feat_list(hapi_fs *fs, const char *dir, atomic_int *stop,
                   int (*fn)(hapi_fs *, const char *, void *), void *arg)
{
    return walk(fs, dir, stop, 0, fn, arg);
}

int hapi_feat_queue(hapi_fs *fs, hapi_view *v, const char *path, int priority, atomic_int *stop)
{
    hapi_source_id id;
    hapi_cache_value val;
    if (hapi_feat_identity(fs, path, &id) < 0)
        return HAPI_QUEUE_SKIPPED;
    if (hapi_cache_get(fs->cache, &v->ns, path, &id, &val) == 1) {
        hapi_cache_release(fs->cache, &val);
        return HAPI_QUEUE_CACHED;
    }
    /* Feed the queue without flooding it: background work yields to every reader anyway. */
    hapi_batcher_stats bs;
    hapi_batcher_stats_get(v->batcher, &bs);
    int rc = hapi_batcher_throttle(v->batcher, priority, (size_t)bs.batch * 2);
    if (rc == 0 && stop && atomic_load(stop))
        rc = -ECANCELED;
    if (rc == 0)
        rc = hapi_batcher_submit(v->batcher, path, priority, NULL);
    return rc;
}

static int count_one(hapi_fs *fs, const char *path, void *arg)
{
    (void)path, (void)arg;
    atomic_fetch_add(&fs->warm.total, 1);
    return 0;
}

static int warm_one(hapi_fs *fs, const char *path, void *arg)
{
    (void)arg;
    int rc = hapi_feat_queue(fs, fs->warm.view, path, HAPI_PRIORITY_WARM, &fs->warm.stop);
    if (rc == HAPI_QUEUE_SKIPPED)
        atomic_fetch_add(&fs->warm.skipped, 1);
    else if (rc == HAPI_QUEUE_CACHED)
        atomic_fetch_add(&fs->warm.cached, 1);
    else if (rc == 0)
        atomic_fetch_add(&fs->warm.submitted, 1);
    return rc < 0 ? rc : 0;
}

static void *warm_main(void *arg)
{
    hapi_fs *fs = arg;
    const char *root = fs->warm.root;
    int rc = hapi_feat_walk(fs, root, &fs->warm.stop, count_one, NULL);
    atomic_store(&fs->warm.counted, 1);
    /* The walker works for the view current once counted (it waits for the first). */
    fs->warm.view = hapi_view_get(fs);
    if (!fs->warm.view) {
        atomic_store(&fs->warm.walked, 1);
        return NULL;
    }
    hapi_log(HAPI_LOG_INFO, "warm-up of '%s' started at split %d", root, fs->warm.view->split);
    if (rc >= 0)
        rc = hapi_feat_walk(fs, root, &fs->warm.stop, warm_one, NULL);
    atomic_store(&fs->warm.walked, 1);
    if (rc < 0 && rc != -ECANCELED)
        hapi_log(HAPI_LOG_WARNING, "warm-up of '%s' stopped: %s", root, hapi_strerror(rc));
    else
        hapi_log(HAPI_LOG_INFO, "warm-up of '%s' queued %llu images (%llu were cached)", root,
                 (unsigned long long)atomic_load(&fs->warm.submitted),
                 (unsigned long long)atomic_load(&fs->warm.cached));
    return NULL;
}

int hapi_warm_start(hapi_fs *fs, const char *path)
{
    pthread_mutex_lock(&fs->warm.lock);
    int rc = 0;
    if (fs->warm.running && !hapi_warm_finished(fs)) {
        rc = -EBUSY;
        goto out;
    }
    if (fs->warm.running) {
        pthread_join(fs->warm.thread, NULL);
        fs->warm.running = 0;
    }
    char *root = strdup(path);
    if (!root) {
        rc = -ENOMEM;
        goto out;
    }
    free(fs->warm.root);
    fs->warm.root = root;
    atomic_store(&fs->warm.total, 0);
    atomic_store(&fs->warm.cached, 0);
    atomic_store(&fs->warm.skipped, 0);
    atomic_store(&fs->warm.submitted, 0);
    atomic_store(&fs->warm.completed, 0);
    atomic_store(&fs->warm.counted, 0);
    atomic_store(&fs->warm.walked, 0);
    atomic_store(&fs->warm.stop, 0);
    hapi_view_put(fs->warm.view);
    fs->warm.view = NULL;
    fs->warm.started_ns = hapi_now_ns();
    if ((rc = pthread_create(&fs->warm.thread, NULL, warm_main, fs)) != 0) {
        rc = -rc;
        goto out;
    }
    fs->warm.running = 1;
out:
    pthread_mutex_unlock(&fs->warm.lock);
    return rc;
}

int hapi_warm_finished(hapi_fs *fs)
{
    return atomic_load(&fs->warm.walked) &&
           atomic_load(&fs->warm.completed) >= atomic_load(&fs->warm.submitted);
}

char *hapi_warm_pause(hapi_fs *fs)
{
    char *root = NULL;
    pthread_mutex_lock(&fs->warm.lock);
    if (fs->warm.running && !hapi_warm_finished(fs)) {
        root = strdup(fs->warm.root ? fs->warm.root : "");
        atomic_store(&fs->warm.stop, 1);
    }
    if (fs->warm.running) {
        /* A walker waiting for queue room goes once its batcher takes a batch. */
        pthread_join(fs->warm.thread, NULL);
        fs->warm.running = 0;
    }
    pthread_mutex_unlock(&fs->warm.lock);
    return root;
}

/* ---------------------------------------------------------------- eviction */

void hapi_feat_collect(hapi_fs *fs, const char *path)
{
    hapi_error err = { 0 };
    hapi_view *v = hapi_view_peek(fs);
    if (!v)
        return; /* nothing can have been cached before the first view */
    int rc = hapi_cache_evict_path(fs->cache, &v->ns, path, &err);
    hapi_view_put(v);
    if (rc == 1)
        atomic_fetch_add(&fs->stats.collected, 1);
    else if (rc < 0)
        hapi_log(HAPI_LOG_WARNING, "%s: cannot remove the features of a deleted source: %s",
                 path, err.message);
}

struct evict_walk {
    hapi_view *view;
    int count;
    int rc;
    hapi_error *err;
};

static int evict_one(hapi_fs *fs, const char *path, void *arg)
{
    struct evict_walk *w = arg;
    int rc = hapi_cache_evict_path(fs->cache, &w->view->ns, path, w->err);
    if (rc < 0)
        return w->rc = rc;
    w->count += rc;
    return 0;
}

int hapi_feat_evict(hapi_fs *fs, const char *path, hapi_error *err)
{
    hapi_view *v = hapi_view_get(fs);
    struct stat st;
    int rc;
    if (!v)
        return hapi_error_set(err, -ECANCELED, "unmounting");
    if (!*path) {
        rc = hapi_cache_evict_all(fs->cache, &v->ns, err);
    } else if ((rc = hapi_fs_stat_beneath(fs->source_fd, path, &st)) < 0) {
        rc = hapi_error_set(err, rc, "'%s': %s", path, hapi_strerror(rc));
    } else if (S_ISREG(st.st_mode)) {
        rc = hapi_cache_evict_path(fs->cache, &v->ns, path, err);
    } else {
        struct evict_walk w = { v, 0, 0, err };
        rc = hapi_feat_walk(fs, path, NULL, evict_one, &w);
        if (rc >= 0)
            rc = w.count;
    }
    hapi_view_put(v);
    return rc;
}

/*
 * The keeper applies the cache's access log (the hits since the last write)
 * to its LRU order once a second, so an epoch of pure hits still tells the
 * cache what is in use. Puts apply it too; this covers the time between.
 */
static void *keeper_main(void *arg)
{
    hapi_fs *fs = arg;
    pthread_mutex_lock(&fs->keeper_lock);
    while (!fs->keeper_stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += 1;
        pthread_cond_timedwait(&fs->keeper_cond, &fs->keeper_lock, &ts);
        if (fs->keeper_stop)
            break;
        pthread_mutex_unlock(&fs->keeper_lock);
        hapi_error err = { 0 };
        if (hapi_cache_flush_access(fs->cache, &err) < 0)
            hapi_log(HAPI_LOG_DEBUG, "cache access log: %s", err.message);
        pthread_mutex_lock(&fs->keeper_lock);
    }
    pthread_mutex_unlock(&fs->keeper_lock);
    return NULL;
}

/* ------------------------------------------------------------------ views */

int hapi_feat_view_new(hapi_fs *fs, int split, int batch, hapi_view **out, hapi_error *err)
{
    hapi_model *m = hapi_extractor_model(fs->ex);
    hapi_view *v = calloc(1, sizeof(*v));
    int rc;
    *out = NULL;
    if (!v)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    v->fs = fs;
    atomic_init(&v->refs, 1);
    v->serial = atomic_fetch_add(&fs->view_serial, 1) + 1;
    v->split = split;
    if (hapi_model_stage(m, split - 1, &v->output) < 0) {
        free(v);
        return hapi_error_set(err, HAPI_EINVAL, "no stage %d", split);
    }
    hapi_cache_namespace_make(hapi_extractor_model_digest(fs->ex), split, fs->opt->dtype,
                              fs->ns_desc, &v->ns);
    hapi_cache_namespace_hex(&v->ns, v->ns_hex);
    rc = hapi_npy_header(v->npy_header, fs->opt->dtype, v->output.shape, v->output.ndim);
    if (rc < 0) {
        free(v);
        return hapi_error_set(err, rc, "cannot describe the output of stage %s as .npy",
                              v->output.name);
    }
    v->npy_header_len = (size_t)rc;
    v->sample_bytes = hapi_extractor_split_bytes(fs->ex, split);
    v->feat_size = v->npy_header_len + v->sample_bytes;

    /*
     * The batcher's budget is what mem leaves once the model's own part (its
     * weights and the working memory of a batch, from the profile) is taken.
     */
    size_t crop = (size_t)hapi_extractor_preprocess(fs->ex)->crop;
    uint64_t floor = 2 * (uint64_t)batch * 3 * crop * crop * sizeof(float);
    uint64_t budget = fs->opt->mem_budget;
    pthread_mutex_lock(&fs->tune.lock);
    if (fs->tune.state == 1) {
        double model = hapi_profile_memory(&fs->tune.profile, split, batch);
        budget = model < (double)budget ? budget - (uint64_t)model : 0;
    }
    pthread_mutex_unlock(&fs->tune.lock);
    if (budget < floor)
        budget = floor;
    const char *fault = getenv("HAPIFS_FAULT_OOM_ABOVE");
    hapi_batcher_config cfg = {
        .batch = batch,
        .split = split,
        .max_wait_us = fs->opt->batch_wait_us,
        .decode_threads = fs->opt->decode_threads,
        .mem_budget = budget,
        .tag_size = sizeof(hapi_source_id),
        .load = load_source,
        .sink = store_results,
        .ctx = v,
        .fault_oom_above = fault ? atoi(fault) : 0,
    };
    if ((rc = hapi_batcher_new(fs->ex, &cfg, &v->batcher, err)) < 0) {
        free(v);
        return rc;
    }
    *out = v;
    return 0;
}

hapi_view *hapi_view_peek(hapi_fs *fs)
{
    pthread_mutex_lock(&fs->view_lock);
    hapi_view *v = fs->view;
    if (v)
        atomic_fetch_add(&v->refs, 1);
    pthread_mutex_unlock(&fs->view_lock);
    return v;
}

hapi_view *hapi_view_get(hapi_fs *fs)
{
    pthread_mutex_lock(&fs->view_lock);
    while (!fs->view && !fs->view_stopping)
        pthread_cond_wait(&fs->view_cond, &fs->view_lock);
    hapi_view *v = fs->view;
    if (v)
        atomic_fetch_add(&v->refs, 1);
    pthread_mutex_unlock(&fs->view_lock);
    return v;
}

void hapi_view_put(hapi_view *v)
{
    if (!v || atomic_fetch_sub(&v->refs, 1) != 1)
        return;
    hapi_batcher_free(v->batcher);
    free(v);
}

/* ------------------------------------------------------------- life cycle */

int hapi_feat_start(hapi_fs *fs, hapi_error *err)
{
    int rc;
    (void)err;
    pthread_mutex_init(&fs->warm.lock, NULL);
    fs->feat_started = 1;
    hapi_prefetch_start(fs);
    pthread_mutex_init(&fs->keeper_lock, NULL);
    pthread_cond_init(&fs->keeper_cond, NULL);
    if ((rc = pthread_create(&fs->keeper, NULL, keeper_main, fs)) != 0)
        hapi_log(HAPI_LOG_WARNING, "cannot start the cache keeper: %s", hapi_strerror(-rc));
    else
        fs->keeper_running = 1;
    return 0;
}

void hapi_feat_stop(hapi_fs *fs)
{
    if (!fs->feat_started)
        return;
    if (fs->keeper_running) {
        pthread_mutex_lock(&fs->keeper_lock);
        fs->keeper_stop = 1;
        pthread_cond_signal(&fs->keeper_cond);
        pthread_mutex_unlock(&fs->keeper_lock);
        pthread_join(fs->keeper, NULL);
        fs->keeper_running = 0;
        pthread_mutex_destroy(&fs->keeper_lock);
        pthread_cond_destroy(&fs->keeper_cond);
    }
    atomic_store(&fs->warm.stop, 1);
    atomic_store(&fs->prefetch.stop, 1);
    /* no view will come any more: wakes a warm-up waiting for the first */
    pthread_mutex_lock(&fs->view_lock);
    fs->view_stopping = 1;
    pthread_cond_broadcast(&fs->view_cond);
    hapi_view *v = fs->view;
    pthread_mutex_unlock(&fs->view_lock);
    if (v)
        hapi_batcher_stop(v->batcher); /* wakes a warm-up waiting for queue room */
    if (fs->warm.running)
        pthread_join(fs->warm.thread, NULL);
    fs->warm.running = 0;
    hapi_prefetch_stop(fs);
    hapi_view_put(fs->warm.view);
    fs->warm.view = NULL;
    fs->feat_started = 0;
    free(fs->warm.root);
    fs->warm.root = NULL;
    pthread_mutex_destroy(&fs->warm.lock);
}

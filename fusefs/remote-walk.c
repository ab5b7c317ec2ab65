/* remote-walk.c — the walks of a compute-side mount's directories: the warm-up (fetch every pack not cached) and the evict (remove their features from the cache). */
#include "remote-int.h"
#include "evict.h"
#include "log.h"
#include "view.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ----------------------------------------------------------------- warm */

/* The directory walk of a warm-up or an evict: one directory, then its subdirectories. */
struct dir_walk {
    hapi_remote *r;
    const char *dir;
    atomic_int *stop;
    int (*fn)(hapi_remote *r, const char *dir, void *arg);
    void *arg;
};

/*
 * Calls fn for dir, then depth first for every directory under it (the union
 * of the sources' listings): a directory's own files first, then its
 * children. Stops at fn's failure, or once *stop (if stop is not NULL) is
 * set. A directory gone meanwhile is not a failure. Returns 0 or < 0.
 */
static int walk_dirs(hapi_remote *r, const char *dir, atomic_int *stop,
                     int (*fn)(hapi_remote *r, const char *dir, void *arg), void *arg);

static int walk_entry(void *arg, const char *name, int kind, const struct stat *st)
{
    struct dir_walk *w = arg;
    (void)st;
    if (kind != HAPI_REMOTE_DIR || (w->stop && atomic_load(w->stop)))
        return 0;
    char *child = hapi_path_join(w->dir, name);
    if (!child)
        return -ENOMEM;
    int rc = walk_dirs(w->r, child, w->stop, w->fn, w->arg);
    free(child);
    return rc;
}

static int walk_dirs(hapi_remote *r, const char *dir, atomic_int *stop,
                     int (*fn)(hapi_remote *r, const char *dir, void *arg), void *arg)
{
    int rc = fn(r, dir, arg);
    if (rc < 0)
        return rc;
    struct dir_walk w = { r, dir, stop, fn, arg };
    rc = hapi_remote_list(r, dir, walk_entry, &w);
    return rc == -ENOENT ? 0 : rc;
}

/* Waits 50 ms on queue_cond (fetches finishing do not signal it). Under fetch_lock. */
static void wait_tick(hapi_remote *r)
{
    struct timespec ts;
    hapi_deadline_after_ns(&ts, 50 * 1000000u);
    pthread_cond_timedwait(&r->queue_cond, &r->fetch_lock, &ts);
}

static void warm_pack(hapi_remote *r, struct dir_index *x)
{
    size_t missing = 0;
    for (size_t i = 0; i < x->count; i++) {
        char *path = hapi_path_join(x->dir, x->entries[i].name);
        hapi_cache_value val;
        int hit = path && hapi_cache_get(r->cfg.cache, &x->ns, path, &x->entries[i].id, &val) == 1;
        if (hit)
            hapi_cache_release(r->cfg.cache, &val);
        missing += !hit;
        free(path);
    }
    hapi_warmup_add(r->warm, HAPI_WARMUP_TOTAL, x->count);
    hapi_warmup_add(r->warm, HAPI_WARMUP_CACHED, x->count - missing);
    hapi_warmup_add(r->warm, HAPI_WARMUP_DIRS, 1);
    if (!missing)
        return;
    pthread_mutex_lock(&r->fetch_lock);
    /* At most fetch_threads warm fetches waiting: the walk goes no faster than the link. */
    for (;;) {
        size_t queued = 0;
        for (struct fetch *f = r->fetches; f; f = f->next)
            queued += f->warm;
        if (queued < r->nthreads || r->stopping || hapi_warmup_stopping(r->warm))
            break;
        wait_tick(r);
    }
    if (!r->stopping && !hapi_warmup_stopping(r->warm))
        hapi_remote__fetch_new_locked(r, x, 1);
    pthread_mutex_unlock(&r->fetch_lock);
}

/*
 * walk_dirs()'s function for a warm-up: queues the fetch of every pack of dir
 * that has a row not cached, keeping at most fetch_threads fetches queued.
 */
static int warm_dir(hapi_remote *r, const char *dir, void *arg)
{
    (void)arg;
    for (size_t i = 0; i < r->nsources && !hapi_warmup_stopping(r->warm); i++) {
        struct dir_index *x = NULL;
        if (hapi_remote__index_get(r, (int)i, dir, &x) == 0)
            warm_pack(r, x);
        hapi_remote__index_put(x);
    }
    return 0;
}

/* The walk, on the warm-up's thread: queue the packs, then wait for their fetches. */
void hapi_remote__warm_run(void *arg, const char *root, atomic_int *stop)
{
    hapi_remote *r = arg;
    walk_dirs(r, root, stop, warm_dir, NULL);
    pthread_mutex_lock(&r->fetch_lock);
    for (;;) {
        int pending = 0;
        for (struct fetch *f = r->fetches; f; f = f->next)
            pending |= f->warm;
        if (!pending || r->stopping || atomic_load(stop))
            break;
        wait_tick(r);
    }
    pthread_mutex_unlock(&r->fetch_lock);
}

/* It may wait for queue room or for its fetches, 50 ms at a time. */
void hapi_remote__warm_wake(void *arg)
{
    hapi_remote *r = arg;
    pthread_mutex_lock(&r->fetch_lock);
    pthread_cond_broadcast(&r->queue_cond);
    pthread_mutex_unlock(&r->fetch_lock);
}

int hapi_remote_warm_stop(hapi_remote *r)
{
    int stopped = hapi_warmup_stop(r->warm, 1, NULL);
    if (stopped)
        hapi_log(HAPI_LOG_INFO, "remote warm-up stopped");
    return stopped;
}

int hapi_remote_warm_start(hapi_remote *r, const char *path)
{
    return hapi_warmup_start(r->warm, path);
}

/* ---------------------------------------------------------------- evict */

/* walk_dirs()'s function for an evict: removes the features of every row of dir's packs. */
static int evict_dir(hapi_remote *r, const char *dir, void *arg)
{
    hapi_evict_walk *w = arg;
    for (size_t i = 0; i < r->nsources; i++) {
        struct dir_index *x = NULL;
        if (hapi_remote__index_get(r, (int)i, dir, &x) < 0)
            continue;
        w->ns = &x->ns;
        for (size_t k = 0; k < x->count; k++) {
            char *path = hapi_path_join(dir, x->entries[k].name);
            int rc = path ? hapi_evict_walk_path(w, path) : -ENOMEM;
            free(path);
            if (rc < 0) {
                hapi_remote__index_put(x);
                return rc;
            }
        }
        hapi_remote__index_put(x);
    }
    return 0;
}

/* Adds ns to the n namespaces of set (room for one more) unless it is there; the new count. */
static size_t ns_add(hapi_cache_namespace *set, size_t n, const hapi_cache_namespace *ns)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(&set[i], ns, sizeof(*ns)) == 0)
            return n;
    set[n] = *ns;
    return n + 1;
}

int hapi_remote_evict(hapi_remote *r, const char *path, hapi_error *err)
{
    int count = 0, rc = 0;
    if (!*path) {
        /*
         * Every namespace the sources serve: each one's at its check and
         * those of the indexes kept (a split changed since has another).
         */
        size_t n = 0, cap = r->nsources + 16;
        hapi_cache_namespace *ns = malloc(cap * sizeof(*ns));
        if (!ns)
            return hapi_error_set(err, -ENOMEM, "out of memory");
        for (size_t i = 0; i < r->nsources; i++)
            if (atomic_load(&r->sources[i].checked))
                n = ns_add(ns, n, &r->sources[i].ns);
        for (int d = 0; r->finish && r->finish->code == 0 && d < 2; d++)
            n = ns_add(ns, n, &r->finish->ns[d]); /* features=freeze: every split's */
        pthread_mutex_lock(&r->index_lock);
        for (size_t b = 0; b < INDEX_BUCKETS; b++)
            for (struct index_slot *sl = r->slots[b]; sl; sl = sl->next) {
                if (sl->index && n == cap) {
                    hapi_cache_namespace *more = realloc(ns, 2 * cap * sizeof(*ns));
                    if (!more)
                        break;
                    ns = more;
                    cap *= 2;
                }
                if (sl->index && n < cap)
                    n = ns_add(ns, n, &sl->index->ns);
            }
        pthread_mutex_unlock(&r->index_lock);
        for (size_t i = 0; i < n; i++) {
            if ((rc = hapi_cache_evict_all(r->cfg.cache, &ns[i], err)) < 0)
                break;
            count += rc;
        }
        free(ns);
        return rc < 0 ? rc : count;
    }
    int kind = HAPI_REMOTE_FILE;
    struct stat st;
    if (hapi_remote_stat(r, path, &kind, &st) < 0)
        kind = HAPI_REMOTE_FILE; /* maybe an image's own name */
    if (kind != HAPI_REMOTE_DIR) {
        /* a file: PATH is the image or its .feat */
        const char *name;
        char *dir = hapi_remote__split_path(path, &name);
        size_t stem = hapi_feat_stem_len(name);
        char image[NAME_MAX + 1];
        snprintf(image, sizeof(image), "%.*s", (int)(stem ? stem : strlen(name)), name);
        struct dir_index *x = NULL;
        const struct index_entry *e = NULL;
        rc = dir ? hapi_remote__find_image(r, dir, image, &x, &e, NULL) : -ENOMEM;
        if (rc == -EIO)
            hapi_error_set(err, rc, "'%s': a source that may have it is down (see errors)", path);
        char *key = rc == 0 ? hapi_path_join(dir, image) : NULL;
        if (rc == 0)
            rc = key ? hapi_cache_evict_path(r->cfg.cache, &x->ns, key, err) : -ENOMEM;
        free(key);
        free(dir);
        hapi_remote__index_put(x);
        if (rc == -ENOENT)
            return hapi_error_set(err, rc, "'%s': no such file or directory", path);
        return rc;
    }
    hapi_evict_walk w = { r->cfg.cache, NULL, 0, err };
    rc = walk_dirs(r, path, NULL, evict_dir, &w);
    return rc < 0 ? rc : w.count;
}

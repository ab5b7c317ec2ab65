/* background.c — work below every read: the warm-up walker, directory prefetch, the cache keeper. */
#include "background.h"
#include "cache.h"
#include "extractor.h"
#include "hapi.h"
#include "log.h"
#include "serve.h"
#include "shared.h"
#include "source.h"
#include "view.h"
#include "warmup.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>

/*
 * Why prefetch: a training job's DataLoader workers each read one file at a
 * time, so with two workers the batcher sees batches of one, and the model
 * runs at its batch-1 speed with the decode idle in between. Files of one
 * directory are usually one class of one epoch: a miss there says the rest
 * will be read soon. Prefetch queues them at HAPI_PRIORITY_PREFETCH, below
 * every demand read (a read of a queued file joins it and raises it) and
 * above warm-up.
 *
 * One thread takes the directories in the order of their first misses (each
 * directory once per view), skips what is cached, and feeds the batcher
 * through its throttle, so the queue never holds more than two batches of
 * prefetch. It does nothing while the tree's features would take more than
 * half the cache: an epoch over a tree larger than the cache would evict
 * prefetched features before their reads came, and compute them twice.
 */

struct prefetch_dir {
    struct prefetch_dir *next;
    hapi_view *view;   /* a reference */
    char path[];       /* relative to the source root */
};

struct hapi_background {
    hapi_background_config cfg;

    struct {
        hapi_warmup *run;          /* the walker, its root, counters and times */
        pthread_mutex_t view_lock; /* leaf: view, for a stop that wakes the walker */
        hapi_view *view;           /* the walker's, while it walks */
        atomic_int counted;        /* the walk has counted the tree */
        atomic_uint_fast64_t completed_base; /* the serve layer's warm completions at the start */
    } warm;

    struct {
        pthread_mutex_t lock;      /* the queue, the set of directories seen, the tree size */
        pthread_cond_t cond;
        pthread_t thread;
        int running;
        atomic_int stop;           /* set under lock; read by the walker and its throttle */
        struct prefetch_dir *head, *tail;
        uint64_t *seen;            /* hashes of (directory, view) queued once */
        size_t seen_size, seen_count;
        int tree_state;            /* 0 not counted yet, 1 counted, -1 cannot be */
        uint64_t tree_images;
        int off_split;             /* split at which "prefetch is off" was logged */
        atomic_uint_fast64_t dirs;         /* directories walked */
        atomic_uint_fast64_t pending_dirs; /* waiting for the walker */
        atomic_uint_fast64_t submitted;    /* images handed to the batcher */
        atomic_uint_fast64_t cached;       /* images found cached */
        atomic_uint_fast64_t dropped;      /* directories not walked (cache too small, new view) */
    } prefetch;

    struct {
        pthread_mutex_t lock;
        pthread_cond_t cond;
        pthread_t thread;
        int running, stop;
    } keeper;
};

/* ----------------------------------------------------------------- warm-up */

static uint64_t warm_completed(hapi_background *bg)
{
    hapi_serve_stats st;
    hapi_serve_stats_get(bg->cfg.serve, &st);
    return st.completed[HAPI_PRIORITY_WARM] - atomic_load(&bg->warm.completed_base);
}

/* Once the walk is over: whether everything it submitted has finished. */
static int warm_finished(void *arg)
{
    hapi_background *bg = arg;
    return warm_completed(bg) >= hapi_warmup_count(bg->warm.run, HAPI_WARMUP_SUBMITTED);
}

static int count_one(const hapi_source_entry *e, void *arg)
{
    hapi_background *bg = arg;
    (void)e;
    hapi_warmup_add(bg->warm.run, HAPI_WARMUP_TOTAL, 1);
    return 0;
}

struct warm_walk {
    hapi_background *bg;
    hapi_view *view;
    atomic_int *stop;
};

static int warm_one(const hapi_source_entry *e, void *arg)
{
    struct warm_walk *w = arg;
    hapi_warmup *run = w->bg->warm.run;
    int rc = hapi_serve_queue(w->bg->cfg.serve, w->view, e->path, HAPI_PRIORITY_WARM, w->stop);
    if (rc == HAPI_QUEUE_SKIPPED)
        hapi_warmup_add(run, HAPI_WARMUP_SKIPPED, 1);
    else if (rc == HAPI_QUEUE_CACHED)
        hapi_warmup_add(run, HAPI_WARMUP_CACHED, 1);
    else if (rc == 0)
        hapi_warmup_add(run, HAPI_WARMUP_SUBMITTED, 1);
    return rc < 0 ? rc : 0;
}

/* The walk, on the warm-up's thread: count the tree, then queue what is not cached. */
static void warm_run(void *arg, const char *root, atomic_int *stop)
{
    hapi_background *bg = arg;
    int rc = hapi_source_walk(bg->cfg.source, root, HAPI_WALK_RECURSE, stop, count_one, bg);
    atomic_store(&bg->warm.counted, 1);
    /* The walker works for the view current once counted (it waits for the first). */
    struct warm_walk w = { bg, hapi_views_get(bg->cfg.views), stop };
    if (!w.view)
        return;
    pthread_mutex_lock(&bg->warm.view_lock);
    bg->warm.view = w.view; /* for warm_wake(), which wakes it where it waits for queue room */
    pthread_mutex_unlock(&bg->warm.view_lock);
    hapi_log(HAPI_LOG_INFO, "warm-up of '%s' started at split %d", root, w.view->split);
    if (rc >= 0)
        rc = hapi_source_walk(bg->cfg.source, root, HAPI_WALK_RECURSE, stop, warm_one, &w);
    if (rc < 0 && rc != -ECANCELED)
        hapi_log(HAPI_LOG_WARNING, "warm-up of '%s' stopped: %s", root, hapi_strerror(rc));
    else
        hapi_log(HAPI_LOG_INFO, "warm-up of '%s' queued %llu images (%llu were cached)", root,
                 (unsigned long long)hapi_warmup_count(bg->warm.run, HAPI_WARMUP_SUBMITTED),
                 (unsigned long long)hapi_warmup_count(bg->warm.run, HAPI_WARMUP_CACHED));
    pthread_mutex_lock(&bg->warm.view_lock);
    bg->warm.view = NULL;
    pthread_mutex_unlock(&bg->warm.view_lock);
    hapi_view_put(w.view);
}

/*
 * A walker waiting for queue room sees the stop flag now, not once a batch
 * is taken (seconds on a slow model). view_lock is a leaf: wake outside it,
 * through a reference.
 */
static void warm_wake(void *arg)
{
    hapi_background *bg = arg;
    pthread_mutex_lock(&bg->warm.view_lock);
    hapi_view *v = bg->warm.view;
    if (v)
        hapi_view_ref(v);
    pthread_mutex_unlock(&bg->warm.view_lock);
    if (v)
        hapi_batcher_wake(v->batcher);
    hapi_view_put(v);
}

static void warm_prepare(void *arg)
{
    hapi_background *bg = arg;
    hapi_serve_stats st;
    hapi_serve_stats_get(bg->cfg.serve, &st);
    atomic_store(&bg->warm.completed_base, st.completed[HAPI_PRIORITY_WARM]);
    atomic_store(&bg->warm.counted, 0);
}

int hapi_warm_start(hapi_background *bg, const char *path)
{
    return hapi_warmup_start(bg->warm.run, path);
}

char *hapi_warm_pause(hapi_background *bg)
{
    char *root = NULL;
    hapi_warmup_stop(bg->warm.run, 0, &root);
    return root;
}

int hapi_warm_stop(hapi_background *bg)
{
    char *root = NULL;
    int stopped = hapi_warmup_stop(bg->warm.run, 1, &root);
    if (stopped)
        hapi_log(HAPI_LOG_INFO, "warm-up of '%s' stopped after %llu images queued",
                 root ? root : "",
                 (unsigned long long)hapi_warmup_count(bg->warm.run, HAPI_WARMUP_SUBMITTED));
    free(root);
    return stopped;
}

int hapi_warm_status_get(hapi_background *bg, hapi_warm_status *ws)
{
    hapi_warmup_status st;
    int rc = hapi_warmup_status_get(bg->warm.run, &st);
    memset(ws, 0, sizeof(*ws));
    ws->path = st.root;
    if (!st.root)
        return rc;
    ws->total = st.count[HAPI_WARMUP_TOTAL];
    ws->cached = st.count[HAPI_WARMUP_CACHED];
    ws->skipped = st.count[HAPI_WARMUP_SKIPPED];
    ws->submitted = st.count[HAPI_WARMUP_SUBMITTED];
    ws->completed = warm_completed(bg);
    ws->elapsed_s = (double)((st.stopped_ns ? st.stopped_ns : hapi_now_ns()) - st.started_ns) /
                    1e9;
    ws->state = st.state == HAPI_WARM_RUNNING && !atomic_load(&bg->warm.counted)
                    ? HAPI_WARM_COUNTING
                    : st.state;
    return rc;
}

/* ---------------------------------------------------------------- prefetch */

#define SEEN_MIN 256

/* Adds h to the set of directories seen; returns 0 if it was there already, 1 if added. */
static int seen_add(hapi_background *bg, uint64_t h)
{
    h |= 1; /* 0 marks an empty slot */
    if (bg->prefetch.seen_count * 4 >= bg->prefetch.seen_size * 3) {
        size_t size = bg->prefetch.seen_size ? bg->prefetch.seen_size * 2 : SEEN_MIN;
        uint64_t *slots = calloc(size, sizeof(*slots));
        if (!slots)
            return 1; /* unrecorded: a later miss may queue the directory again, harmlessly */
        for (size_t i = 0; i < bg->prefetch.seen_size; i++) {
            uint64_t old = bg->prefetch.seen[i];
            if (!old)
                continue;
            size_t j = old & (size - 1);
            while (slots[j])
                j = (j + 1) & (size - 1);
            slots[j] = old;
        }
        free(bg->prefetch.seen);
        bg->prefetch.seen = slots;
        bg->prefetch.seen_size = size;
    }
    size_t mask = bg->prefetch.seen_size - 1, j = h & mask;
    while (bg->prefetch.seen[j]) {
        if (bg->prefetch.seen[j] == h)
            return 0;
        j = (j + 1) & mask;
    }
    bg->prefetch.seen[j] = h;
    bg->prefetch.seen_count++;
    return 1;
}

/* serve.c's miss hook: queue the rest of path's directory, once per directory and view. */
static void prefetch_note(void *arg, hapi_view *v, const char *path)
{
    hapi_background *bg = arg;
    const char *slash = strrchr(path, '/');
    size_t len = slash ? (size_t)(slash - path) : 0;
    /* The directory's name and the view: a split change makes every directory new again. */
    uint64_t h = XXH3_64bits_withSeed(path, len, v->serial);

    pthread_mutex_lock(&bg->prefetch.lock);
    if (atomic_load(&bg->prefetch.stop) || !seen_add(bg, h)) {
        pthread_mutex_unlock(&bg->prefetch.lock);
        return;
    }
    struct prefetch_dir *d = malloc(sizeof(*d) + len + 1);
    if (d) {
        memcpy(d->path, path, len);
        d->path[len] = '\0';
        d->next = NULL;
        d->view = v;
        hapi_view_ref(v);
        if (bg->prefetch.tail)
            bg->prefetch.tail->next = d;
        else
            bg->prefetch.head = d;
        bg->prefetch.tail = d;
        atomic_fetch_add(&bg->prefetch.pending_dirs, 1);
        pthread_cond_broadcast(&bg->prefetch.cond);
    }
    pthread_mutex_unlock(&bg->prefetch.lock);
}

void hapi_background_set_tree_size(hapi_background *bg, uint64_t images, int ok)
{
    pthread_mutex_lock(&bg->prefetch.lock);
    bg->prefetch.tree_images = images;
    bg->prefetch.tree_state = ok ? 1 : -1;
    pthread_cond_broadcast(&bg->prefetch.cond);
    pthread_mutex_unlock(&bg->prefetch.lock);
}

/*
 * Whether the tree's features at v fit half the cache; waits for the tree
 * count (0 if stopped). A tree that could not be counted is given the
 * benefit of the doubt: prefetch only reorders work that reads ask for.
 */
static int cache_has_room(hapi_background *bg, hapi_view *v)
{
    pthread_mutex_lock(&bg->prefetch.lock);
    while (!bg->prefetch.tree_state && !atomic_load(&bg->prefetch.stop))
        pthread_cond_wait(&bg->prefetch.cond, &bg->prefetch.lock);
    int state = bg->prefetch.tree_state;
    uint64_t images = bg->prefetch.tree_images;
    pthread_mutex_unlock(&bg->prefetch.lock);
    if (atomic_load(&bg->prefetch.stop))
        return 0;
    uint64_t need = images * hapi_cache_entry_bytes(bg->cfg.cache, HAPI_TYPICAL_PATH,
                                                    v->sample_bytes);
    uint64_t room = bg->cfg.cache_size / 2;
    if (state < 0 || bg->cfg.cache_size == 0 || need <= room)
        return 1;
    if (bg->prefetch.off_split != v->split) {
        bg->prefetch.off_split = v->split;
        hapi_log(HAPI_LOG_INFO,
                 "prefetch is off at split %d: the features of %llu images (~%llu MiB) would "
                 "take more than half the cache (cache_size=%llu MiB)", v->split,
                 (unsigned long long)images, (unsigned long long)(need >> 20),
                 (unsigned long long)(bg->cfg.cache_size >> 20));
    }
    return 0;
}

struct prefetch_walk {
    hapi_background *bg;
    hapi_view *view;
};

static int prefetch_one(const hapi_source_entry *e, void *arg)
{
    struct prefetch_walk *w = arg;
    hapi_background *bg = w->bg;
    if (atomic_load(&bg->prefetch.stop))
        return -ECANCELED;
    int rc = hapi_serve_queue(bg->cfg.serve, w->view, e->path, HAPI_PRIORITY_PREFETCH,
                              &bg->prefetch.stop);
    if (rc == HAPI_QUEUE_CACHED)
        atomic_fetch_add(&bg->prefetch.cached, 1);
    else if (rc == 0)
        atomic_fetch_add(&bg->prefetch.submitted, 1);
    return rc < 0 ? rc : 0;
}

static void *prefetch_main(void *arg)
{
    hapi_background *bg = arg;
    pthread_setname_np(pthread_self(), "hapifs-prefetch");
    for (;;) {
        pthread_mutex_lock(&bg->prefetch.lock);
        while (!atomic_load(&bg->prefetch.stop) && !bg->prefetch.head)
            pthread_cond_wait(&bg->prefetch.cond, &bg->prefetch.lock);
        struct prefetch_dir *d = atomic_load(&bg->prefetch.stop) ? NULL : bg->prefetch.head;
        if (d) {
            bg->prefetch.head = d->next;
            if (!bg->prefetch.head)
                bg->prefetch.tail = NULL;
        }
        pthread_mutex_unlock(&bg->prefetch.lock);
        if (!d)
            return NULL;
        atomic_fetch_sub(&bg->prefetch.pending_dirs, 1);

        /* A directory noted under a view that has since been replaced is not worth it. */
        hapi_view *now = hapi_views_peek(bg->cfg.views);
        if (now == d->view && cache_has_room(bg, d->view)) {
            atomic_fetch_add(&bg->prefetch.dirs, 1);
            struct prefetch_walk w = { bg, d->view };
            int rc = hapi_source_walk(bg->cfg.source, d->path, 0, &bg->prefetch.stop,
                                      prefetch_one, &w);
            if (rc < 0 && rc != -ECANCELED)
                hapi_log(HAPI_LOG_WARNING, "prefetch of '%s' stopped: %s", d->path,
                         hapi_strerror(rc));
        } else {
            atomic_fetch_add(&bg->prefetch.dropped, 1);
        }
        hapi_view_put(now);
        hapi_view_put(d->view);
        free(d);
    }
}

void hapi_prefetch_stats_get(hapi_background *bg, hapi_prefetch_stats *ps)
{
    hapi_serve_stats st;
    hapi_serve_stats_get(bg->cfg.serve, &st);
    *ps = (hapi_prefetch_stats){
        .mode = bg->cfg.prefetch,
        .dirs = atomic_load(&bg->prefetch.dirs),
        .pending_dirs = atomic_load(&bg->prefetch.pending_dirs),
        .submitted = atomic_load(&bg->prefetch.submitted),
        .cached = atomic_load(&bg->prefetch.cached),
        .computed = st.origin_computed[HAPI_PRIORITY_PREFETCH],
        .dropped = atomic_load(&bg->prefetch.dropped),
    };
}

/* ------------------------------------------------------------------ keeper */

/*
 * The keeper applies the cache's access log (the hits since the last write)
 * to its LRU order once a second, so an epoch of pure hits still tells the
 * cache what is in use. Puts apply it too; this covers the time between.
 */
static void *keeper_main(void *arg)
{
    hapi_background *bg = arg;
    pthread_setname_np(pthread_self(), "hapifs-keeper");
    pthread_mutex_lock(&bg->keeper.lock);
    while (!bg->keeper.stop) {
        struct timespec ts;
        hapi_deadline_after_ns(&ts, 1000000000u);
        pthread_cond_timedwait(&bg->keeper.cond, &bg->keeper.lock, &ts);
        if (bg->keeper.stop)
            break;
        pthread_mutex_unlock(&bg->keeper.lock);
        hapi_error err = { 0 };
        if (hapi_cache_flush_access(bg->cfg.cache, &err) < 0)
            hapi_log(HAPI_LOG_DEBUG, "cache access log: %s", err.message);
        pthread_mutex_lock(&bg->keeper.lock);
    }
    pthread_mutex_unlock(&bg->keeper.lock);
    return NULL;
}

/* -------------------------------------------------------------- life cycle */

int hapi_background_start(const hapi_background_config *cfg, hapi_background **out,
                          hapi_error *err)
{
    int rc;
    *out = NULL;
    hapi_background *bg = calloc(1, sizeof(*bg));
    if (!bg)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    bg->cfg = *cfg;
    static const hapi_warmup_ops warm_ops = {
        .thread_name = "hapifs-warm",
        .run = warm_run,
        .finished = warm_finished,
        .wake = warm_wake,
        .prepare = warm_prepare,
    };
    bg->warm.run = hapi_warmup_new(&warm_ops, bg);
    if (!bg->warm.run) {
        free(bg);
        return hapi_error_set(err, -ENOMEM, "out of memory");
    }
    pthread_mutex_init(&bg->warm.view_lock, NULL);
    pthread_mutex_init(&bg->prefetch.lock, NULL);
    pthread_cond_init(&bg->prefetch.cond, NULL);
    pthread_mutex_init(&bg->keeper.lock, NULL);
    hapi_cond_init_monotonic(&bg->keeper.cond);
    bg->prefetch.off_split = -1;

    if ((rc = pthread_create(&bg->keeper.thread, NULL, keeper_main, bg)) != 0)
        hapi_log(HAPI_LOG_WARNING, "cannot start the cache keeper: %s", hapi_strerror(-rc));
    else
        bg->keeper.running = 1;
    if (cfg->prefetch == HAPI_PREFETCH_DIR) {
        if ((rc = pthread_create(&bg->prefetch.thread, NULL, prefetch_main, bg)) != 0) {
            hapi_log(HAPI_LOG_WARNING, "prefetch is off: cannot start its thread: %s",
                     hapi_strerror(-rc));
        } else {
            bg->prefetch.running = 1;
            hapi_serve_on_miss(cfg->serve, prefetch_note, bg);
        }
    }
    /* Warm-up counts the tree at once and computes once the split is chosen. */
    if (cfg->warm && (rc = hapi_warm_start(bg, "")) < 0)
        hapi_log(HAPI_LOG_WARNING, "cannot start the warm-up: %s", hapi_strerror(rc));
    *out = bg;
    return 0;
}

void hapi_background_stop(hapi_background *bg)
{
    if (!bg)
        return;
    if (bg->keeper.running) {
        pthread_mutex_lock(&bg->keeper.lock);
        bg->keeper.stop = 1;
        pthread_cond_signal(&bg->keeper.cond);
        pthread_mutex_unlock(&bg->keeper.lock);
        pthread_join(bg->keeper.thread, NULL);
    }
    hapi_warmup_cancel(bg->warm.run);
    pthread_mutex_lock(&bg->prefetch.lock);
    atomic_store(&bg->prefetch.stop, 1); /* under the lock: the walker cannot miss it */
    pthread_cond_broadcast(&bg->prefetch.cond);
    pthread_mutex_unlock(&bg->prefetch.lock);
    /* Walkers waiting for queue room go when the batcher stops. */
    hapi_view *v = hapi_views_peek(bg->cfg.views);
    if (v)
        hapi_batcher_stop(v->batcher);
    hapi_view_put(v);
    hapi_warmup_free(bg->warm.run);
    if (bg->prefetch.running)
        pthread_join(bg->prefetch.thread, NULL);
    while (bg->prefetch.head) {
        struct prefetch_dir *d = bg->prefetch.head;
        bg->prefetch.head = d->next;
        hapi_view_put(d->view);
        free(d);
    }
    free(bg->prefetch.seen);
    pthread_mutex_destroy(&bg->warm.view_lock);
    pthread_mutex_destroy(&bg->prefetch.lock);
    pthread_cond_destroy(&bg->prefetch.cond);
    pthread_mutex_destroy(&bg->keeper.lock);
    pthread_cond_destroy(&bg->keeper.cond);
    free(bg);
}

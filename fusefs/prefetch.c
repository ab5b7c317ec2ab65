/* prefetch.c — prefetch=dir: a miss in a directory queues the rest of that directory, below every read. */
#include "fusefs-int.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

/*
 * Why: a training job's DataLoader workers each read one file at a time, so with two workers
 * the batcher sees batches of one, and the model runs at its batch-1 speed with the decode
 * idle in between. Files of one directory are usually one class of one epoch: a miss there says
 * the rest will be read soon. Prefetch queues them at HAPI_PRIORITY_PREFETCH, below every
 * demand read (a read of a queued file joins it and raises it) and above warm-up.
 *
 * One thread takes the directories in the order of their first misses (each directory once per
 * view), skips what is cached, and feeds the batcher through its throttle, so the queue never
 * holds more than two batches of prefetch. It does nothing while the tree's features would take
 * more than half the cache: an epoch over a tree larger than the cache would evict prefetched
 * features before their reads came, and compute them twice.
 */

struct prefetch_dir {
    struct prefetch_dir *next;
    hapi_view *view;   /* a reference */
    char path[];       /* relative to the source root */
};

#define SEEN_MIN 256

/* Adds h to the set of directories seen; returns 0 if it was there already, 1 if added. */
static int seen_add(hapi_fs *fs, uint64_t h)
{
    h |= 1; /* 0 marks an empty slot */
    if (fs->prefetch.seen_count * 4 >= fs->prefetch.seen_size * 3) {
        size_t size = fs->prefetch.seen_size ? fs->prefetch.seen_size * 2 : SEEN_MIN;
        uint64_t *slots = calloc(size, sizeof(*slots));
        if (!slots)
            return 1; /* unrecorded: a later miss may queue the directory again, harmlessly */
        for (size_t i = 0; i < fs->prefetch.seen_size; i++) {
            uint64_t old = fs->prefetch.seen[i];
            if (!old)
                continue;
            size_t j = old & (size - 1);
            while (slots[j])
                j = (j + 1) & (size - 1);
            slots[j] = old;
        }
        free(fs->prefetch.seen);
        fs->prefetch.seen = slots;
        fs->prefetch.seen_size = size;
    }
    size_t mask = fs->prefetch.seen_size - 1, j = h & mask;
    while (fs->prefetch.seen[j]) {
        if (fs->prefetch.seen[j] == h)
            return 0;
        j = (j + 1) & mask;
    }
    fs->prefetch.seen[j] = h;
    fs->prefetch.seen_count++;
    return 1;
}

void hapi_prefetch_note(hapi_fs *fs, hapi_view *v, const char *path)
{
    if (fs->opt->prefetch != HAPI_PREFETCH_DIR || !fs->prefetch.running)
        return;
    const char *slash = strrchr(path, '/');
    size_t len = slash ? (size_t)(slash - path) : 0;
    /* The directory's name and the view: a split change makes every directory new again. */
    uint64_t h = XXH3_64bits_withSeed(path, len, v->serial);

    pthread_mutex_lock(&fs->prefetch.lock);
    if (atomic_load(&fs->prefetch.stop) || !seen_add(fs, h)) {
        pthread_mutex_unlock(&fs->prefetch.lock);
        return;
    }
    struct prefetch_dir *d = malloc(sizeof(*d) + len + 1);
    if (d) {
        memcpy(d->path, path, len);
        d->path[len] = '\0';
        d->next = NULL;
        d->view = v;
        atomic_fetch_add(&v->refs, 1);
        if (fs->prefetch.tail)
            fs->prefetch.tail->next = d;
        else
            fs->prefetch.head = d;
        fs->prefetch.tail = d;
        atomic_fetch_add(&fs->prefetch.pending_dirs, 1);
        pthread_cond_signal(&fs->prefetch.cond);
    }
    pthread_mutex_unlock(&fs->prefetch.lock);
}

/* Whether the tree's features at v fit half the cache; waits for the tree count (0 if stopped). */
static int cache_has_room(hapi_fs *fs, hapi_view *v)
{
    while (!atomic_load(&fs->tune.counted)) {
        if (atomic_load(&fs->prefetch.stop))
            return 0;
        nanosleep(&(struct timespec){ .tv_nsec = 20 * 1000 * 1000 }, NULL);
    }
    uint64_t images = atomic_load(&fs->tune.images);
    uint64_t need = images * ((uint64_t)v->sample_bytes + HAPI_CACHE_ENTRY_OVERHEAD);
    uint64_t room = fs->opt->cache_size / 2;
    if (fs->opt->cache_size == 0 || need <= room)
        return 1;
    if (fs->prefetch.off_split != v->split) {
        fs->prefetch.off_split = v->split;
        hapi_log(HAPI_LOG_INFO,
                 "prefetch is off at split %d: the features of %llu images (~%llu MiB) would "
                 "take more than half the cache (cache_size=%llu MiB)", v->split,
                 (unsigned long long)images, (unsigned long long)(need >> 20),
                 (unsigned long long)(fs->opt->cache_size >> 20));
    }
    return 0;
}

static int prefetch_one(hapi_fs *fs, const char *path, void *arg)
{
    hapi_view *v = arg;
    if (atomic_load(&fs->prefetch.stop))
        return -ECANCELED;
    int rc = hapi_feat_queue(fs, v, path, HAPI_PRIORITY_PREFETCH, &fs->prefetch.stop);
    if (rc == HAPI_QUEUE_CACHED)
        atomic_fetch_add(&fs->prefetch.cached, 1);
    else if (rc == 0)
        atomic_fetch_add(&fs->prefetch.submitted, 1);
    return rc < 0 ? rc : 0;
}

static void *prefetch_main(void *arg)
{
    hapi_fs *fs = arg;
    for (;;) {
        pthread_mutex_lock(&fs->prefetch.lock);
        while (!atomic_load(&fs->prefetch.stop) && !fs->prefetch.head)
            pthread_cond_wait(&fs->prefetch.cond, &fs->prefetch.lock);
        struct prefetch_dir *d = atomic_load(&fs->prefetch.stop) ? NULL : fs->prefetch.head;
        if (d) {
            fs->prefetch.head = d->next;
            if (!fs->prefetch.head)
                fs->prefetch.tail = NULL;
        }
        pthread_mutex_unlock(&fs->prefetch.lock);
        if (!d)
            return NULL;
        atomic_fetch_sub(&fs->prefetch.pending_dirs, 1);

        /* A directory noted under a view that has since been replaced is not worth it. */
        hapi_view *now = hapi_view_peek(fs);
        int rc = -ECANCELED;
        if (now == d->view && cache_has_room(fs, d->view)) {
            atomic_fetch_add(&fs->prefetch.dirs, 1);
            rc = hapi_feat_list(fs, d->path, &fs->prefetch.stop, prefetch_one, d->view);
            if (rc < 0 && rc != -ECANCELED)
                hapi_log(HAPI_LOG_WARNING, "prefetch of '%s' stopped: %s", d->path,
                         hapi_strerror(rc));
        } else {
            atomic_fetch_add(&fs->prefetch.dropped, 1);
        }
        hapi_view_put(now);
        hapi_view_put(d->view);
        free(d);
    }
}

int hapi_prefetch_start(hapi_fs *fs)
{
    pthread_mutex_init(&fs->prefetch.lock, NULL);
    pthread_cond_init(&fs->prefetch.cond, NULL);
    fs->prefetch.ready = 1;
    fs->prefetch.off_split = -1;
    if (fs->opt->prefetch == HAPI_PREFETCH_OFF)
        return 0;
    int rc = pthread_create(&fs->prefetch.thread, NULL, prefetch_main, fs);
    if (rc != 0) {
        hapi_log(HAPI_LOG_WARNING, "prefetch is off: cannot start its thread: %s", strerror(rc));
        return 0;
    }
    fs->prefetch.running = 1;
    return 0;
}

void hapi_prefetch_stop(hapi_fs *fs)
{
    if (!fs->prefetch.ready)
        return;
    pthread_mutex_lock(&fs->prefetch.lock);
    atomic_store(&fs->prefetch.stop, 1); /* under the lock: the walker cannot miss it */
    pthread_cond_broadcast(&fs->prefetch.cond);
    pthread_mutex_unlock(&fs->prefetch.lock);
    if (fs->prefetch.running)
        pthread_join(fs->prefetch.thread, NULL); /* a throttled walker goes once a batch is taken */
    fs->prefetch.running = 0;
    while (fs->prefetch.head) {
        struct prefetch_dir *d = fs->prefetch.head;
        fs->prefetch.head = d->next;
        hapi_view_put(d->view);
        free(d);
    }
    fs->prefetch.tail = NULL;
    free(fs->prefetch.seen);
    fs->prefetch.seen = NULL;
    fs->prefetch.seen_size = fs->prefetch.seen_count = 0;
    pthread_mutex_destroy(&fs->prefetch.lock);
    pthread_cond_destroy(&fs->prefetch.cond);
    fs->prefetch.ready = 0;
}

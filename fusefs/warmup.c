/* warmup.c — one warm-up walker at a time: start, stop, pause and the status, for both sides. */
#include "warmup.h"
#include "hapi.h"
#include "shared.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

struct hapi_warmup {
    hapi_warmup_ops ops;
    void *arg;
    pthread_mutex_t control;      /* starting, stopping and joining the walker */
    pthread_mutex_t status_lock;  /* leaf: root and the times, for readers of the status */
    pthread_t thread;
    int running;                  /* a thread to join (under control) */
    char *root;                   /* what is being warmed; replaced only once joined */
    atomic_int stop;
    atomic_int walked;            /* the walk has returned */
    atomic_int stopped;           /* stopped for good: the status says so until a start */
    uint64_t started_ns, walked_ns, stopped_ns; /* under status_lock */
    atomic_uint_fast64_t count[HAPI_WARMUP_COUNTERS];
};

hapi_warmup *hapi_warmup_new(const hapi_warmup_ops *ops, void *arg)
{
    hapi_warmup *w = calloc(1, sizeof(*w));
    if (!w)
        return NULL;
    w->ops = *ops;
    w->arg = arg;
    pthread_mutex_init(&w->control, NULL);
    pthread_mutex_init(&w->status_lock, NULL);
    return w;
}

void hapi_warmup_cancel(hapi_warmup *w)
{
    atomic_store(&w->stop, 1);
}

void hapi_warmup_free(hapi_warmup *w)
{
    if (!w)
        return;
    atomic_store(&w->stop, 1);
    if (w->running)
        pthread_join(w->thread, NULL);
    free(w->root);
    pthread_mutex_destroy(&w->control);
    pthread_mutex_destroy(&w->status_lock);
    free(w);
}

int hapi_warmup_stopping(hapi_warmup *w)
{
    return atomic_load(&w->stop);
}

void hapi_warmup_add(hapi_warmup *w, enum hapi_warmup_counter c, uint64_t n)
{
    atomic_fetch_add(&w->count[c], n);
}

uint64_t hapi_warmup_count(hapi_warmup *w, enum hapi_warmup_counter c)
{
    return atomic_load(&w->count[c]);
}

/* True once the walk has returned and the owner says what it queued is over. */
static int finished(hapi_warmup *w)
{
    return atomic_load(&w->walked) && (!w->ops.finished || w->ops.finished(w->arg));
}

/* The walker. Its root does not change while it runs: a start joins it first. */
static void *warmup_main(void *arg)
{
    hapi_warmup *w = arg;
    pthread_setname_np(pthread_self(), w->ops.thread_name);
    w->ops.run(w->arg, w->root, &w->stop);
    pthread_mutex_lock(&w->status_lock);
    w->walked_ns = hapi_now_ns();
    pthread_mutex_unlock(&w->status_lock);
    atomic_store(&w->walked, 1);
    return NULL;
}

int hapi_warmup_start(hapi_warmup *w, const char *path)
{
    pthread_mutex_lock(&w->control);
    int rc = 0;
    if (w->running && !finished(w)) {
        rc = -EBUSY;
        goto out;
    }
    if (w->running) {
        pthread_join(w->thread, NULL);
        w->running = 0;
    }
    char *root = strdup(path);
    if (!root) {
        rc = -ENOMEM;
        goto out;
    }
    /* Readers of the status see the old run or the new one, never a freed path. */
    pthread_mutex_lock(&w->status_lock);
    free(w->root);
    w->root = root;
    for (int c = 0; c < HAPI_WARMUP_COUNTERS; c++)
        atomic_store(&w->count[c], 0);
    atomic_store(&w->walked, 0);
    atomic_store(&w->stop, 0);
    atomic_store(&w->stopped, 0);
    w->started_ns = hapi_now_ns();
    w->walked_ns = w->stopped_ns = 0;
    if (w->ops.prepare)
        w->ops.prepare(w->arg);
    if ((rc = pthread_create(&w->thread, NULL, warmup_main, w)) != 0) {
        /* nothing runs: the status says idle */
        free(w->root);
        w->root = NULL;
        rc = -rc;
    } else {
        w->running = 1;
    }
    pthread_mutex_unlock(&w->status_lock);
out:
    pthread_mutex_unlock(&w->control);
    return rc;
}

int hapi_warmup_stop(hapi_warmup *w, int for_good, char **root)
{
    if (root)
        *root = NULL;
    pthread_mutex_lock(&w->control);
    int unfinished = w->running && !finished(w);
    if (unfinished) {
        if (root)
            *root = strdup(w->root ? w->root : "");
        if (for_good) {
            /* before the walker can say done */
            pthread_mutex_lock(&w->status_lock);
            w->stopped_ns = hapi_now_ns();
            atomic_store(&w->stopped, 1);
            pthread_mutex_unlock(&w->status_lock);
        }
        atomic_store(&w->stop, 1);
        if (w->ops.wake)
            w->ops.wake(w->arg);
    }
    if (w->running) {
        pthread_join(w->thread, NULL);
        w->running = 0;
    }
    pthread_mutex_unlock(&w->control);
    return unfinished;
}

int hapi_warmup_status_get(hapi_warmup *w, hapi_warmup_status *st)
{
    memset(st, 0, sizeof(*st));
    pthread_mutex_lock(&w->status_lock);
    int rc = 0;
    if (w->root) {
        st->root = strdup(w->root);
        if (!st->root)
            rc = -ENOMEM;
        for (int c = 0; c < HAPI_WARMUP_COUNTERS; c++)
            st->count[c] = atomic_load(&w->count[c]);
        st->started_ns = w->started_ns;
        st->walked_ns = w->walked_ns;
        st->stopped_ns = w->stopped_ns;
        st->state = atomic_load(&w->stopped) ? HAPI_WARM_STOPPED
                    : finished(w)            ? HAPI_WARM_DONE
                                             : HAPI_WARM_RUNNING;
    }
    pthread_mutex_unlock(&w->status_lock);
    return rc;
}

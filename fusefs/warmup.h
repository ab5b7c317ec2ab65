/* warmup.h — the warm-up's state machine, shared by the storage side (background.c) and the remote side (remote-walk.c). */
#ifndef HAPI_WARMUP_H
#define HAPI_WARMUP_H

#include <stdatomic.h>
#include <stdint.h>

/*
 * A warm-up is one walker thread at a time over one root. This unit owns the
 * thread, the root, the stop flag, the counters and the times; the owner
 * gives the walk itself ("walk and queue this root") and says, if it needs
 * to, when the work the walk queued is over.
 *
 *   start:  joins a finished run, refuses -EBUSY while one is unfinished,
 *           resets the counters, the root and the times, spawns the walker;
 *   stop:   sets the stop flag, wakes the walker (the owner's wake), joins
 *           it, and says whether it had finished and what it was warming;
 *   status: a snapshot of the state, the root, the counters and the times.
 *
 * Locks: control, taken by start and stop and held through the join of the
 * walker (which never takes it); status_lock, a leaf, for the root and the
 * times. control's place in the daemon's lock order (layers.h) is its
 * owner's (background's and remote-walk.c's warm-up control locks); the
 * owner's run and wake are called with control held (run on the walker's
 * thread, which does not hold it), and prepare with control and status_lock
 * held: none may take a lock above its owner's control lock, and prepare
 * takes no lock but leaves.
 */

/* The counters; each side uses those it reports. */
enum hapi_warmup_counter {
    HAPI_WARMUP_TOTAL,      /* images found */
    HAPI_WARMUP_CACHED,     /* already in the cache */
    HAPI_WARMUP_SKIPPED,    /* vanished or unreadable during the walk */
    HAPI_WARMUP_SUBMITTED,  /* handed to the batcher */
    HAPI_WARMUP_FETCHED,    /* rows fetched (remote) */
    HAPI_WARMUP_FAILED,     /* rows not fetched (remote) */
    HAPI_WARMUP_DIRS,       /* directories walked (remote) */
    HAPI_WARMUP_COUNTERS
};

typedef struct hapi_warmup_ops {
    const char *thread_name;
    /* The walk of root, on the walker's thread; returns when done or *stop is set. */
    void (*run)(void *arg, const char *root, atomic_int *stop);
    /* Whether what the walk queued is over, once it has returned; NULL: at once. Any thread. */
    int (*finished)(void *arg);
    /* Wakes a walker that waits (for queue room, for its fetches) to see the stop flag; or NULL. */
    void (*wake)(void *arg);
    /* Resets the owner's own state of a run before it starts; or NULL. */
    void (*prepare)(void *arg);
} hapi_warmup_ops;

typedef struct hapi_warmup hapi_warmup;

/* Makes one (ops is copied; arg is borrowed for its life). Returns NULL when out of memory. */
hapi_warmup *hapi_warmup_new(const hapi_warmup_ops *ops, void *arg);
/*
 * Sets the stop flag and joins a walker still running without the control
 * lock (at shutdown, once nothing starts one), then frees it. Accepts NULL.
 * The owner wakes the walker itself between hapi_warmup_cancel() and this.
 */
void hapi_warmup_free(hapi_warmup *w);
/* Sets the stop flag only (shutdown, before the owner wakes what the walker waits on). */
void hapi_warmup_cancel(hapi_warmup *w);

/* Starts warming root (copied). Returns 0, -EBUSY (one unfinished), -ENOMEM or -errno. */
int hapi_warmup_start(hapi_warmup *w, const char *root);
/*
 * Stops an unfinished run and joins its walker. With for_good the status says
 * HAPI_WARM_STOPPED until the next start (else the run is paused: it looks
 * unfinished). Returns 1 if one was unfinished, with *root (if root is not
 * NULL) a malloc'd copy of its root (NULL if out of memory); 0 otherwise.
 */
int hapi_warmup_stop(hapi_warmup *w, int for_good, char **root);

/* Whether the walker has been told to stop. */
int hapi_warmup_stopping(hapi_warmup *w);
/* Adds n to a counter of the current run. Any thread. */
void hapi_warmup_add(hapi_warmup *w, enum hapi_warmup_counter c, uint64_t n);
/* A counter of the current run. */
uint64_t hapi_warmup_count(hapi_warmup *w, enum hapi_warmup_counter c);

typedef struct hapi_warmup_status {
    int state;              /* HAPI_WARM_IDLE, _RUNNING, _DONE or _STOPPED */
    char *root;             /* malloc'd copy (caller frees); NULL when idle */
    uint64_t count[HAPI_WARMUP_COUNTERS];
    uint64_t started_ns;    /* hapi_now_ns() of the start */
    uint64_t walked_ns;     /* when the walk returned, or 0 */
    uint64_t stopped_ns;    /* when stopped for good, or 0 */
} hapi_warmup_status;
/* A consistent snapshot (the root with the counters of its run). Returns 0 or -ENOMEM. */
int hapi_warmup_status_get(hapi_warmup *w, hapi_warmup_status *st);

#endif

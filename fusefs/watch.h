/* watch.h — inotify on the source's directories, told on a thread of its own. */
#ifndef HAPI_FUSEFS_WATCH_H
#define HAPI_FUSEFS_WATCH_H

#include <stdatomic.h>
#include <stdint.h>

#include "hapi.h"

/*
 * Watches directories of the source with inotify and calls fn on its own
 * thread for each change: (dir_id, name, mask) with dir_id the node id given
 * to hapi_watch_add, name "" for the directory itself; dir_id 0 and name NULL
 * when the kernel's queue overflowed (events were lost: anything may have
 * changed). IN_IGNORED (the directory gone) comes last for its dir_id. fn
 * must not call hapi_watch_free. The events of one read are merged per
 * (dir_id, name), masks ORed, and handed on together; then fn(arg, 0, "", 0)
 * ends the batch.
 */
typedef void (*hapi_watch_fn)(void *arg, uint64_t dir_id, const char *name, uint32_t mask);
typedef struct hapi_watch hapi_watch;
typedef struct hapi_watch_stats {
    atomic_uint_fast64_t dirs;      /* directories watched now */
    atomic_uint_fast64_t events;    /* events handled */
    atomic_uint_fast64_t overflows; /* times the kernel's queue overflowed */
    atomic_uint_fast64_t refused;   /* watches refused (fs.inotify.max_user_watches) */
    atomic_uint_fast64_t remote;    /* directories not watched: a network or FUSE filesystem */
} hapi_watch_stats;
/* Starts the thread. Returns 0 or -errno with err; *out is NULL on failure. */
int hapi_watch_new(hapi_watch_fn fn, void *arg, hapi_watch **out, hapi_error *err);
/* Stops the thread (no fn call runs after) and frees w. Accepts NULL. */
void hapi_watch_free(hapi_watch *w);
/*
 * Watches directory dirfd (any descriptor of it, borrowed; O_PATH will do)
 * as node dir_id. Returns the watch descriptor (>= 0), -EREMOTE for a
 * filesystem whose changes inotify cannot all see, or -errno (-ENOSPC: no
 * watches left). A directory already watched gets the new dir_id.
 */
int hapi_watch_add(hapi_watch *w, int dirfd, uint64_t dir_id);
/* Stops watching wd. Thread-safe; wd may be gone already. */
void hapi_watch_remove(hapi_watch *w, int wd);
/* A copy of the counters. */
void hapi_watch_stats_get(hapi_watch *w, hapi_watch_stats *out);

#endif

/* fs.h — the mounted filesystem: the layers built and torn down, the FUSE operations. */
#ifndef HAPI_FUSEFS_FS_H
#define HAPI_FUSEFS_FS_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "background.h"
#include "cache.h"
#include "ctl.h"
#include "extractor.h"
#include "hapi.h"
#include "log.h"
#include "options.h"
#include "pack.h"
#include "remote.h"
#include "serve.h"
#include "source.h"
#include "tune.h"
#include "uring.h"
#include "view.h"
#include "watch.h"

/* libfuse's types: fs.c speaks FUSE, the headers' readers need not. */
struct fuse_session;
struct fuse_lowlevel_ops;
struct feat_source;

/* The mounted filesystem: one per daemon, the userdata of every operation. */
/*
 * An open file or directory, linked into its hapi_fs from open until
 * release: a handle the kernel never released (the daemon is stopped or
 * unmounted lazily while a file is open) is freed at destroy, before the
 * layers it holds references into.
 */
struct hapi_fs_handle {
    struct hapi_fs_handle *prev, *next;
    int dir; /* a struct dir_handle, else a struct open_file */
};

typedef struct hapi_fs {
    hapi_fs_options *opt;
    int model_fd;                /* the model file loaded (read-only), -1 if unreadable */
    hapi_source *source;
    hapi_extractor *ex;
    hapi_precision_choice precision_auto; /* precision=auto's choice (its batch 0: none) */
    hapi_cache *cache;
    hapi_error_ring *errors;
    hapi_views *views;
    hapi_serve *serve;
    hapi_packs *packs;
    hapi_background *background;
    hapi_tune *tune;
    hapi_ctl *ctl;
    hapi_remote *remote;         /* -o remote: every layer above but ctl is NULL */
    const struct feat_source *src; /* where names and bytes come from (fs-int.h): local or remote */
    hapi_node *node_share;       /* the node's shared budget and cores; NULL: none */
    struct node_table *nodes;
    hapi_watch *watch;           /* inotify on the source (watch=1); NULL: none */
    struct change_batch *changes; /* what watch.c's batch changed (its thread alone); NULL: none */
    struct notice_watchdog *watchdog; /* ends late names by an epoch notice (watch=1); NULL: none */
    struct split_notifier *notifier; /* tells a remote mount's split changes (-o remote); NULL: none */
    hapi_fs_requests requests;
    pthread_mutex_t handles_lock;
    struct hapi_fs_handle handles; /* the list's head; next NULL before init */
    int no_open;                 /* opens answer ENOSYS: reads name their node, not a handle */
    /*
     * The kernel takes FUSE_NOTIFY_INC_EPOCH (Linux 6.16 and later): one notice,
     * which takes no lock, makes it look every name up again at its next use
     * (hapi_fs_probe_epochs). Set before requests come; 0: names are told one by
     * one, and a .feat's or pack's is trusted for 1 s without opens.
     */
    int epochs;
    atomic_uint_fast64_t epoch_notices; /* sent since the probe: split changes, late names, overflows */
    atomic_int serving;          /* hapi_fs_serving() was called */
    atomic_uint_fast64_t split_changes; /* split changes told to the kernel (invalidate_feats) */
    atomic_uint_fast64_t made_serial; /* no_open: control files and indexes made so far */
    struct fuse_session *se;     /* for invalidating the kernel's caches; NULL before mount */
    hapi_uring *uring;           /* FUSE over io_uring (uring=1, where the kernel has it); NULL: none */
    uint64_t started_ns;
    time_t started_realtime;
} hapi_fs;

/* The low-level operations, with userdata a hapi_fs. */
extern const struct fuse_lowlevel_ops hapi_fs_ops;

/*
 * Sets up fs from validated options, layer by layer from the bottom: opens
 * the source root, loads the model, opens the cache, starts serving, the
 * background work and the policy. Runs in the daemon (after the fork).
 * Returns 0 or a negative code with the message in err; on failure fs is
 * cleaned up.
 */
int hapi_fs_init(hapi_fs *fs, hapi_fs_options *opt, hapi_error *err);
/*
 * Stops telling the kernel of changes in the source (before the session is
 * unmounted: the watch thread notifies through it). Idempotent.
 */
void hapi_fs_stop_watching(hapi_fs *fs);
/*
 * Asks the kernel (once mounted, before serving) whether it takes epoch notices;
 * sets fs->epochs. Harmless: the kernel has no names yet.
 */
void hapi_fs_probe_epochs(hapi_fs *fs);
/*
 * The daemon is mounted and has started its workers: once io_uring's (if any)
 * have registered, the profile may be measured (hapi_tune_config.serving).
 */
void hapi_fs_serving(hapi_fs *fs);
/* Stops and frees the layers from the top. Accepts a zeroed or destroyed fs. */
void hapi_fs_destroy(hapi_fs *fs);

/* Maps a module code to the errno a FUSE reply carries (hapifs codes are EIO). */
int hapi_fs_errno(int code);

#endif

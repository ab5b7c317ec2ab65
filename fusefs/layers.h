/* layers.h — the map of the daemon (fusefs/): its layers, who calls whom, the lock order. No code. */
#ifndef HAPI_FUSEFS_LAYERS_H
#define HAPI_FUSEFS_LAYERS_H

/*
 * The daemon is built in layers. Each .c includes its own header first,
 * then the headers of the layers it uses, all of the same or a lower rank:
 * a layer never includes a higher one's header (tests/check-layers.py reads
 * the table below and fails the unit suite if one does).
 *
 *   rank  header        file          job
 *   10    -             main.c        main(): hapifs and mount.hapifs
 *   9     fusefs.h      daemon.c      the daemon's life: validate, fork, mount, serve, unmount
 *   8     fs.h          fs.c          the mounted filesystem built and torn down, layer by layer
 *   8     fs-int.h      -             the insides the fs.c family below shares (the node, its
 *                                     table, the handles, the functions that cross files)
 *   8     -             ops.c         the FUSE operations; with noopen.c the only files that
 *                                     reply to the kernel; maps codes to errno; asks
 *                                     fs->src for names and bytes (struct feat_source)
 *   8     -             featsrc-local.c  a storage mount's feature source: the source
 *                                     tree's names, .feat through serve.c, packs
 *   8     -             featsrc-remote.c a compute-side mount's feature source, through
 *                                     remote.c
 *   8     -             noopen.c      the read path without opens (no_open)
 *   8     -             attr.c        attribute synthesis: ids and attributes of every kind
 *   8     -             notify.c      telling the kernel what changed: forgets, epoch notices,
 *                                     the notice watchdog, split changes, watch batches
 *   8     -             nodes.c       node ids and the node table, timeouts, watches
 *   7     ctl.h         ctl.c         the .hapifs/ control files and the table of commands
 *   6     tune.h        tune.c        profile, policy, live split and batch changes
 *   5     background.h  background.c  warm-up walker, directory prefetch, cache keeper
 *   4     pack.h        pack.c        per-directory packs: a snapshot of a directory's
 *                                     images served as one .npy through serve.c, its index
 *                                     (written by packindex.c)
 *   3     serve.h       serve.c       the bytes of a .feat read: cache lookup or computation
 *                                     through the view's batcher; the batcher's load and sink
 *   3     remote.h      remote.c      a compute-side mount's feature source (-o remote): the
 *                                     union of storage mounts, packs fetched into the cache;
 *                                     it uses only source.c and view.c. remote.c: the union
 *                                     tree (stat, list, open), open/close, stats
 *   3     remote-int.h  -             the insides the remote family below shares (the remote,
 *                                     its sources, indexes and fetches, the functions that
 *                                     cross files)
 *   3     -             remote-source.c
 *                                     the sources: roots reopened, opens and reads beneath
 *                                     them, whether one serves, the check of its config
 *   3     -             remote-index.c
 *                                     a directory's index: read, parsed (packindex.c), kept
 *                                     per source in the slot cache, read again after refresh=
 *   3     -             remote-fetch.c
 *                                     the fetch queue and threads, pack reads, the spill of
 *                                     rows the cache refuses
 *   3     -             remote-feat.c the .feat opens and reads: cache, spill or a fetch
 *   3     -             remote-walk.c the walks of the union: warm-up and evict
 *   3     -             remote-finish.c features=freeze: the storage side's model,
 *                                     the stages [split, freeze) run on fetched rows
 *   2     view.h        view.c        what a .feat is at one split; the current view
 *   2     warmup.h      warmup.c      one warm-up walker at a time (start, stop, pause, status)
 *                                     for background.c and remote-walk.c, which give it their walk
 *   2     evict.h       evict.c       an evict walk's step: remove one path's cached features,
 *                                     counted (serve.c's and remote-walk.c's evict walks); the
 *                                     cache only
 *   1     source.h      source.c      the source tree: beneath-the-root opens, identities,
 *                                     whole-file loads, the one tree walker; who asks (creds)
 *   1     packindex.h   packindex.c   the pack index format (DIR/.hapifs-pack.json): its
 *                                     struct, written (pack.c) and parsed (remote-index.c)
 *   1     watch.h       watch.c       inotify on the source's directories the kernel holds,
 *                                     on a thread of its own
 *   1     uring.h       uring.c       FUSE over io_uring: requests served on their CPU
 *   1     options.h     options.c     the command line, parsed and validated
 *   1     metrics.h     metrics.c     .hapifs/metrics: the stats as Prometheus text
 *   0     log.h         log.c         the log and the ring of recent errors
 *   0     shared.h      -             constants several layers name (pack names, states)
 *   0     layers.h      -             this map
 *
 * FUSE-speaking files (the only ones that may include <fuse_lowlevel.h>):
 *   fs-int.h fs.c ops.c noopen.c attr.c notify.c nodes.c daemon.c uring.c
 *   featsrc-local.c featsrc-remote.c
 * options.c builds the mount's arguments with <fuse_opt.h> (options.h needs
 * its struct fuse_args) but never talks to the kernel; fs.h and uring.h
 * forward-declare libfuse's structs. FUSE_USE_VERSION is set once, in
 * fusefs/meson.build.
 *
 * Each layer owns its struct (opaque to the others), its locks and its
 * start/stop; it is given borrowed pointers to the layers below when made.
 *
 * Upward calls: callbacks the upper layer registers, and no others.
 *   serve -> background   hapi_serve_on_miss(): after a miss is submitted
 *                         (prefetch queues the rest of the directory)
 *   tune -> fs            hapi_tune_config.on_split_change: after a split
 *                         change, with tune.switch_lock held (kernel invalidation)
 *   tune -> fs            hapi_tune_config.serving: may the profile be measured
 *                         yet (the session and io_uring's workers are up)
 *   remote -> fs          hapi_remote_config.on_change: a directory's namespace
 *                         changed (kernel invalidation of remote .feat files)
 *   watch -> fs           hapi_watch_new()'s fn: what changed in a watched
 *                         directory, on watch.c's thread, no watch lock held
 *
 * Lock order (a thread holding one may take only those after it):
 *   tune.switch_lock      one split change at a time, held through it (and
 *                         through the on_split_change callback)
 *   background's warm-up control lock (warmup.h): starting, pausing, joining its walker
 *   tune.lock             the profile and the policy's inputs
 *   views.lock            the current view (leaf but for view refcounts)
 *   the remote's warm-up control lock (warmup.h; remote-walk.c's walk), held through the join
 *   remote-source.c's check_lock (one source's check at a time), then that source's lock
 *   the batcher's and the cache's own locks (extractor/, cache/)
 *   fs's node table lock (nodes.c), then watch.c's table lock (hapi_watch_add and
 *   hapi_watch_remove are called under it when a directory's node is
 *   watched or goes)
 *   leaves, never held while taking another but the two last ones below:
 *   background prefetch.lock, keeper.lock, warm.view_lock and each warm-up's
 *   status lock (warmup.h);
 *   remote-index.c's index_lock, remote-fetch.c's fetch_lock and spill_lock, and a
 *   remote source's lock (remote-source.c);
 *   a pack's lock, the packs' failure and partial-row locks; watch.c's table
 *   lock; fs's handles_lock (ops.c), its notice watchdog's lock and its split
 *   notifier's lock (notify.c) (each epoch notice goes out with neither held); a ctl
 *   handle's lock; uring.c's lock;
 *   then the error ring's lock, then the log's lock (the ring logs with its
 *   own lock released; the log's lock is the last of all).
 * Joining the warm-up walker is allowed while holding its control lock and, in a
 * split change, tune.switch_lock: the walker takes neither, nor any lock
 * above them. notify.c's on_split_change (invalidate_feats) takes only its node
 * table lock (and, under it, watch.c's); its remote on_change
 * (invalidate_remote_feats) only its split notifier's lock.
 */

#endif

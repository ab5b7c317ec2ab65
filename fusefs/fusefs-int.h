/* fusefs-int.h — the daemon's insides, shared by its files and its unit tests. */
#ifndef HAPI_FUSEFS_INT_H
#define HAPI_FUSEFS_INT_H

#define FUSE_USE_VERSION 314

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/stat.h>
#include <time.h>
#include <fuse_lowlevel.h>

#include "cache.h"
#include "extractor.h"
#include "fusefs.h"
#include "hapi.h"
#include "policy.h"

/* ----------------------------------------------------------------- options */

/* Everything the command line says, validated. Strings are owned (malloc). */
typedef struct hapi_fs_options {
    char *source;          /* absolute, resolved */
    char *mountpoint;      /* absolute, resolved */
    char *model;           /* absolute, resolved */
    char *split;           /* "auto", N or NAME */
    char *freeze;          /* NULL = the model's default */
    char *cache_dir;       /* absolute */
    char *log_path;        /* NULL = stderr in the foreground, syslog otherwise */
    char *device;          /* "cpu" or "cuda[:N]" */
    int dtype;             /* enum hapi_dtype */
    int mode;              /* enum hapi_preprocess_mode */
    int precision;         /* enum hapi_precision */
    uint64_t max_pixels;
    uint64_t cache_size;   /* bytes */
    int cache_reset;       /* replace a corrupt or foreign cache store */
    int threads;           /* FUSE worker threads (max) */
    int torch_threads;     /* libtorch intra-op threads */
    int batch;             /* storage-side batch; 0 = auto (the policy's) */
    int batch_wait_us;     /* how long a partial batch waits for more demand */
    int decode_threads;
    uint64_t mem_budget;   /* bytes of in-flight images and tensors */
    char *node_path;       /* the node file shared with the node's other mounts; NULL: none */
    int node_required;     /* node options were given: failing to join fails the mount */
    uint64_t node_mem;     /* node_mem=: the node's budget (0: keep the file's) */
    int node_cores;        /* node_cores=: the node's core tokens (0: keep the file's) */
    int warm;              /* warm the whole tree at mount */
    int prefetch;          /* enum hapi_prefetch_mode */
    double link_bps;       /* the link to the compute tier, bits/s */
    double rtt_s;          /* its round-trip time, seconds (0: not counted) */
    int transport;         /* enum hapi_policy_transport: how the compute tier reads */
    double client_speed;   /* the compute tier's speed relative to this node */
    double compute_file_ms; /* its training loop's CPU per file beside the stages, measured
                              there (< 0: not given, HAPI_POLICY_COMPUTE_FILE_MS) */
    int epochs;            /* epochs a job is expected to read */
    int profile_redo;      /* measure the model even if a profile is stored */
    int show_raw;
    int watch;             /* watch the source with inotify (watch.c) */
    int no_open;           /* let the kernel skip opens (with watch, on a storage mount) */
    int uring;             /* serve through io_uring where the kernel offers it */
    int foreground;
    int debug;
    int fake;              /* mount helper called with -f: do nothing */
    int show_help;
    int show_version;
    int remote;            /* -o remote: a compute-side mount over storage mounts */
    char **roots;          /* remote: the SOURCE directories (source split at ':'), resolved */
    size_t nroots;
    int refresh_ms;        /* remote: how long a directory's index is trusted */
    int fetch_threads;     /* remote: packs fetched at once */
    gid_t ctl_gid;         /* ctl_group=: its members may write .hapifs/ctl; -1: none */
    int serving_gate;      /* not an option: the daemon says when it serves (hapi_fs_serving) */
    int dead_mount;        /* not an option: mountpoint is our mount whose daemon died */
    struct fuse_args fuse_args; /* what goes to fuse_session_new() */
} hapi_fs_options;

/*
 * Parses and validates argv (hapifs SOURCE MOUNTPOINT [-o opts] [-f] [-d], or
 * the mount helper's SOURCE MOUNTPOINT [-sfnv] [-o opts]; helper is nonzero
 * when called as mount.hapifs). Checks that SOURCE and MOUNTPOINT are
 * directories and the model file is readable, but loads nothing.
 * Returns 0, or HAPI_EINVAL / -errno with a one-line message in err.
 * Free with hapi_fs_options_free() either way.
 */
int hapi_fs_options_parse(int argc, char **argv, int helper, hapi_fs_options *o,
                          hapi_error *err);

/* Frees what the options own. Accepts a zeroed struct. */
void hapi_fs_options_free(hapi_fs_options *o);

/*
 * Aborts the FUSE connection of the dead mount of ours at o->mountpoint
 * (o->dead_mount): readers still waiting on it end with ECONNABORTED. Logs
 * what it cannot do (it needs root).
 */
void hapi_fs_abort_dead_mount(const hapi_fs_options *o);

/*
 * Detaches the top mount at o->mountpoint, the dead mount of ours
 * (o->dead_mount), and says so on stderr and in the log. Returns 0 or -errno.
 */
int hapi_fs_detach_dead_mount(const hapi_fs_options *o);

/* Parses "123", "64K", "1.5G", "2GiB", "512MB" (powers of 1024) into bytes. Returns 0 or HAPI_EINVAL. */
int hapi_fs_parse_size(const char *text, uint64_t *out);

/* Parses "1ms", "500us", "0.002s", "1" (a bare number is ms) into seconds. Returns 0 or HAPI_EINVAL. */
int hapi_fs_parse_time(const char *text, double *seconds);

/* Prints the usage text. */
void hapi_fs_usage(const char *prog);

/* ---------------------------------------------------------------------- log */

enum hapi_log_level { HAPI_LOG_ERROR, HAPI_LOG_WARNING, HAPI_LOG_INFO, HAPI_LOG_DEBUG };

/* Sends the log to path (appending), or stderr when path is NULL and to_stderr, else syslog. */
int hapi_log_open(const char *path, int to_stderr, int debug);
void hapi_log_close(void);
void hapi_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The most recent errors, kept for .hapifs/errors. Thread-safe. */
#define HAPI_ERRORS_KEPT 256
typedef struct hapi_error_ring hapi_error_ring;
hapi_error_ring *hapi_error_ring_new(void);
void hapi_error_ring_free(hapi_error_ring *r);
/* Records that path failed with code and message, and logs it. */
void hapi_error_ring_add(hapi_error_ring *r, const char *path, int code, const char *message);
/*
 * A JSON text {"count": N, "errors": [...]} (malloc'd, caller frees), or
 * NULL. With shown, only the errors whose path it returns nonzero for are
 * listed, and "hidden" counts the others.
 */
char *hapi_error_ring_json(hapi_error_ring *r, int (*shown)(const char *path, void *arg),
                           void *arg);

/*
 * ------------------------------------------------------------------ layers
 *
 * The daemon is built in layers that call one way only, from the top down:
 *
 *   fs.c          FUSE operations and the node table; the only file that
 *                 replies to the kernel and maps codes to errno
 *   watch.c       inotify on the source's directories the kernel holds;
 *                 tells fs.c (a callback) what changed, on a thread of its own
 *   ctl.c         the .hapifs/ control files and the table of commands
 *   tune.c        profile, policy, live split and batch changes
 *   background.c  warm-up walker, directory prefetch, cache keeper
 *   remote.c      a compute-side mount's feature source (-o remote): the
 *                 union of storage mounts, packs fetched into the cache;
 *                 beside serve.c, it uses only source.c and view.c
 *   pack.c        per-directory packs: a snapshot of a directory's images
 *                 served as one .npy through serve.c, and its index
 *   serve.c       the bytes of a .feat read: cache lookup or computation
 *                 through the view's batcher; the batcher's load and sink
 *   view.c        what a .feat is at one split; the current view
 *   source.c      the source tree: beneath-the-root opens, identities,
 *                 whole-file loads, the one tree walker
 *
 * Each layer owns its struct (opaque to the others), its locks and its
 * start/stop; it is given borrowed pointers to the layers below when made and
 * never sees the ones above. Two calls go up, both through callbacks the
 * upper layer registers: serve tells background of a miss (prefetch), tune
 * tells fs of a split change (kernel invalidation).
 *
 * Lock order (a thread holding one may take only those after it):
 *   tune.switch_lock      one split change at a time, held through it
 *   background warm.lock  starting, pausing and joining the warm-up walker
 *   tune.lock             the profile and the policy's inputs
 *   views.lock            the current view (leaf but for view refcounts)
 *   remote.c's warm_control  starting and stopping its warm-up (held through the join)
 *   the batcher's and the cache's own locks (extractor/, cache/)
 *   fs's node table lock, then the watch table's lock (hapi_watch_remove
 *   is called when a directory's node goes)
 *   leaves, never held while taking another: background prefetch.lock,
 *   keeper.lock and warm.status_lock, remote.c's index_lock, fetch_lock, warm_lock and a remote
 *   source's lock, a pack's lock, the packs' failure and partial-row locks, fs's node
 *   table lock, a ctl handle's lock, the error ring's lock, the log's lock.
 * Joining the warm-up walker is allowed while holding warm.lock and, in a
 * split change, tune.switch_lock: the walker takes neither, nor any lock
 * above them. The split-change callback runs with tune.switch_lock held (and
 * no other tune lock); fs.c's takes only its node table lock.
 */

/* ------------------------------------------------------------ source.c */

/*
 * The source tree, opened once: every path is relative to its root ("" is
 * the root) and resolved beneath it (symlinks may not leave it, magic links
 * are refused). Immutable after open; every function is thread-safe.
 */
typedef struct hapi_source hapi_source;

/* Opens root (a directory). Returns 0, or -errno with err; *out is NULL on failure. */
int hapi_source_open(const char *root, hapi_source **out, hapi_error *err);
/* Closes it. Accepts NULL. */
void hapi_source_close(hapi_source *s);

/* The root's O_PATH descriptor (owned by s) and device. */
int hapi_source_root_fd(const hapi_source *s);
dev_t hapi_source_dev(const hapi_source *s);

/*
 * Opens path beneath the root with openat(2) flags. Returns an fd (the
 * caller closes it) or -errno; a path that would leave the root is -ENOENT.
 */
int hapi_source_open_beneath(const hapi_source *s, const char *path, int flags);

/* stat() of path beneath the root, following symlinks that stay beneath it. Returns 0 or -errno. */
int hapi_source_stat(const hapi_source *s, const char *path, struct stat *st);

/* The identity (size, times, inode) that st describes. */
void hapi_source_identity_of(const struct stat *st, hapi_source_id *id);

/*
 * Who asks: a request's user and groups, for what the kernel's mode checks
 * (default_permissions) cannot decide on their own: a pack's images, the
 * names in .hapifs/errors, .hapifs/ctl.
 */
#define HAPI_CRED_GROUPS 64
typedef struct hapi_cred {
    uid_t uid;
    gid_t gid;
    int ngroups;                    /* of groups; more than HAPI_CRED_GROUPS are not seen */
    gid_t groups[HAPI_CRED_GROUPS]; /* supplementary */
} hapi_cred;

/*
 * Reads the supplementary groups of process (or thread) pid from
 * /proc/PID/status into groups (at most max). Returns their count, which may
 * exceed max (the rest are not read), or -errno. (libfuse's
 * fuse_req_getgroups does the same, but reads past its buffer: AddressSanitizer
 * reported it in Debian 12's libfuse 3.14.)
 */
int hapi_cred_read_groups(pid_t pid, gid_t *groups, int max);

/* 1 when c is in group g (primary or supplementary), else 0. */
int hapi_cred_in_group(const hapi_cred *c, gid_t g);

/*
 * 1 when c may do mask (R_OK, X_OK, or both) on a file of attributes st by
 * its mode bits, as the kernel decides without ACLs (root may read and
 * search anything, and run what has an x bit), else 0. NULL c may.
 */
int hapi_cred_may(const hapi_cred *c, const struct stat *st, int mask);

/*
 * 1 when c could learn path's name from the source tree: search on every
 * directory from the root to path's parent and read on that parent (so
 * listing it shows the name), else 0 (also when path cannot be reached).
 * NULL c may. path "" (the root) is always seen.
 */
int hapi_source_may_see(const hapi_source *s, const hapi_cred *c, const char *path);

/* The identity of the regular file path. Returns 0, -EINVAL (not a regular file) or -errno. */
int hapi_source_identity(const hapi_source *s, const char *path, hapi_source_id *id);

/*
 * Reads the whole file path into *data (malloc'd, the caller frees; *size
 * bytes), with in *id (may be NULL) the identity it had throughout the read:
 * a file changed while being read is read again (three tries, then -EAGAIN).
 * Returns 0 or < 0 with err; *data is NULL on failure.
 */
int hapi_source_load(const hapi_source *s, const char *path, void **data, size_t *size,
                     hapi_source_id *id, hapi_error *err);

/* What hapi_source_walk() calls its function with; valid during the call only. */
typedef struct hapi_source_entry {
    const char *path;        /* relative to the root */
    const char *name;        /* the last component of path */
    int is_image;            /* an image name (hapi_image_name_is_image) */
    const struct stat *st;   /* with HAPI_WALK_STAT: what path leads to; else NULL */
} hapi_source_entry;

enum hapi_walk_flags {
    HAPI_WALK_RECURSE = 1,  /* descend into directories, depth first */
    HAPI_WALK_STAT = 2,     /* stat every entry; those that cannot be are skipped */
    HAPI_WALK_ALL = 4,      /* call fn for every directory and regular file, not only images */
};

/*
 * Calls fn for the entries of directory dir ("" = the root): without
 * HAPI_WALK_ALL only for images (by name and, with HAPI_WALK_STAT, a regular
 * file), with it for every directory and regular file too. Stops when fn
 * returns < 0 (that code is returned) or *stop (may be NULL) is set. Returns
 * 0 or < 0; a dir that is not a directory is empty (0).
 */
int hapi_source_walk(const hapi_source *s, const char *dir, int flags, atomic_int *stop,
                     int (*fn)(const hapi_source_entry *e, void *arg), void *arg);

/* dir/name ("" dir: name alone), malloc'd; NULL when out of memory. */
char *hapi_path_join(const char *dir, const char *name);

/* A path's length for estimates of the store's size ("train/n01440764/n01440764_10026.JPEG"). */
#define HAPI_TYPICAL_PATH 40

/* -------------------------------------------------------------- view.c */

/*
 * What the .feat files are at one split: the namespace, the .npy header,
 * the size, and the batcher that computes them. Every field is fixed before
 * the view is shared (the batcher is attached by serve.c, which made it);
 * only refs changes after. A read keeps the view it opened the file with,
 * so a live split change never mixes two shapes in one open file; the view
 * goes when its last user puts it.
 */
typedef struct hapi_view {
    atomic_int refs;
    int split;                   /* stages [0, split) */
    int dtype;                   /* enum hapi_dtype of the features */
    hapi_stage_info output;      /* of stage split - 1 */
    hapi_cache_namespace ns;
    char ns_hex[33];
    char npy_header[HAPI_NPY_HEADER_MAX];
    size_t npy_header_len;
    size_t sample_bytes;
    uint64_t feat_size;          /* header + data */
    uint64_t serial;             /* 1, 2, ... in order of creation */
    hapi_batcher *batcher;       /* freed with the view */
    void *batcher_ctx;           /* the batcher's context, freed (free()) after it */
} hapi_view;

/* The holder of the current view. Thread-safe. */
typedef struct hapi_views hapi_views;

/*
 * Makes the holder for features of ex's model in dtype (enum hapi_dtype),
 * computed in precision (enum hapi_precision), with no current view. Checks
 * that ex's split makes an .npy. Returns 0 or < 0 with err. ex must outlive it.
 */
int hapi_views_new(hapi_extractor *ex, int dtype, int precision, hapi_views **out,
                   hapi_error *err);
/* Frees the holder and puts the current view. Accepts NULL. */
void hapi_views_free(hapi_views *vs);

/*
 * The namespace of split: everything that changes the bytes of a feature
 * (model digest, split, dtype, preprocessing, precision).
 */
void hapi_views_namespace(const hapi_views *vs, int split, hapi_cache_namespace *ns);

/*
 * Describes the .feat files at split in a new view (one reference, no
 * batcher yet, not current). Returns 0 or HAPI_EINVAL / -ENOMEM with err.
 */
int hapi_view_new(hapi_views *vs, int split, hapi_view **out, hapi_error *err);

/* The current view with a reference, waiting while there is none yet; NULL once stopped. */
hapi_view *hapi_views_get(hapi_views *vs);
/* The current view with a reference, or NULL if there is none; never waits. */
hapi_view *hapi_views_peek(hapi_views *vs);
/*
 * Makes v current, taking over the caller's reference, and returns the
 * previous current view with its reference (NULL for the first). v NULL
 * means there will be nothing to serve: waiters get NULL, as after stop.
 */
hapi_view *hapi_views_swap(hapi_views *vs, hapi_view *v);
/* No view will come any more: wakes every hapi_views_get() waiter with NULL. */
void hapi_views_stop(hapi_views *vs);

/*
 * A read of bytes [off, off + size) of a .feat (an .npy header of header_len
 * bytes, then the features, feat_size bytes in all): copies the header's
 * part into buf and sets [*dpos, *dend), the part of the features that
 * follows it in buf. Returns the header bytes copied, or -1 at or past the end.
 */
ssize_t hapi_feat_split_read(const char *header, size_t header_len, uint64_t feat_size,
                             char *buf, size_t size, off_t off, size_t *dpos, size_t *dend);

/* If name is "<image>.feat" for an image name, the length of "<image>", else 0. */
size_t hapi_feat_stem_len(const char *name);

/*
 * The bytes of NaN in dtype (little-endian, as the .npy header says), *width
 * of them: a pack's row whose image could not be computed repeats them.
 */
const unsigned char *hapi_feat_nan(int dtype, size_t *width);

/* Adds a reference. */
void hapi_view_ref(hapi_view *v);
/* Drops one; the last frees the view and its batcher. Accepts NULL. */
void hapi_view_put(hapi_view *v);

/* ------------------------------------------------------------- serve.c */

/* Counters of the serving path; all cumulative since the mount. */
typedef struct hapi_serve_stats {
    uint64_t feat_reads;      /* read requests on .feat files */
    uint64_t feat_bytes;      /* bytes returned */
    uint64_t hits, misses;
    uint64_t computed;        /* samples computed and handed to the cache */
    uint64_t errors;          /* reads that failed (a kernel retry counts again) */
    uint64_t cache_put_failures;
    uint64_t hit_ns;          /* time in cache lookups that hit */
    uint64_t stale;           /* lookups that found an older version's features */
    uint64_t bad;             /* lookups that found damaged entries */
    uint64_t collected;       /* entries of deleted sources removed */
    uint64_t passthrough_bytes; /* asked of source files shown as they are */
    uint64_t completed[HAPI_PRIORITY_COUNT]; /* requests answered (computed or failed), by
                                                the priority they were made at */
    uint64_t origin_computed[HAPI_PRIORITY_COUNT]; /* computed, by who asked first */
} hapi_serve_stats;

/* What serving needs: borrowed, all must outlive it. */
typedef struct hapi_serve_config {
    hapi_source *source;
    hapi_extractor *ex;
    hapi_cache *cache;
    hapi_views *views;
    hapi_error_ring *errors;   /* failed samples are recorded here */
    int batch_wait_us;         /* how long a partial batch waits for more demand */
    int decode_threads;
    uint64_t mem_budget;       /* in-flight images and tensors, model included */
    hapi_node *node;           /* the node's budget and cores, which batchers draw from */
    int torch_threads;         /* core tokens an inference holds */
} hapi_serve_config;

typedef struct hapi_serve hapi_serve;

/* Makes the serving layer. Returns 0 or -ENOMEM with err. */
int hapi_serve_new(const hapi_serve_config *cfg, hapi_serve **out, hapi_error *err);
/* Frees it (every view made by it must be gone). Accepts NULL. */
void hapi_serve_free(hapi_serve *s);

/*
 * Makes a view of split with its batcher started (not yet current).
 * model_bytes is the memory the model itself takes at that split and batch
 * (from the profile; 0 if unknown): the batcher's budget is what the mount's
 * budget leaves. Returns 0 or < 0 with err.
 */
int hapi_serve_view_new(hapi_serve *s, int split, int batch, uint64_t model_bytes,
                        hapi_view **out, hapi_error *err);

/*
 * Registers fn, called after every miss has been submitted, with the view and
 * the image path (prefetch: the layer above queues the rest of the directory).
 * Set once, before the first read; fn runs on the reading thread.
 */
void hapi_serve_on_miss(hapi_serve *s, void (*fn)(void *arg, hapi_view *v, const char *path),
                        void *arg);

/*
 * Fills buf with bytes [off, off + size) of the .feat of image path, opened
 * with identity *id at view v: from the cache, or computed by v's batcher
 * (waiting; one computation however many readers wait); a view without a
 * batcher (an old split's, made for the read) reads the cache only, -ESTALE
 * on a miss. Returns the bytes written (0 at or past the end), or a negative
 * code: the image's failure
 * (HAPI_EDECODE, ...), recorded in the error ring, or -ECANCELED when
 * unmounting. Thread-safe.
 */
ssize_t hapi_serve_read(hapi_serve *s, hapi_view *v, const char *path, const hapi_source_id *id,
                        char *buf, size_t size, off_t off);

/*
 * One sample of a read of several (a pack): features bytes [from, to) of the
 * image path at identity id go to dst. A part with dst NULL is read-ahead:
 * asked for (unless cached) and not waited for.
 */
typedef struct hapi_serve_part {
    const char *path;
    const hapi_source_id *id;
    char *dst;
    size_t from, to;
    int code;            /* out: 0, or why this sample has no features */
} hapi_serve_part;

/*
 * Fills every part from the cache or by computing it at demand priority:
 * all misses are submitted before any is waited for, so that they share
 * batches. A sample's failure is its part's code (recorded in the error ring
 * by the sink), not the call's. Returns 0, -ENOMEM, or -ECANCELED when
 * unmounting. Thread-safe.
 */
int hapi_serve_read_parts(hapi_serve *s, hapi_view *v, hapi_serve_part *parts, size_t n);

/* 1 if the features of path at identity id are cached at v, else 0. Counts nothing. */
int hapi_serve_cached(hapi_serve *s, hapi_view *v, const char *path, const hapi_source_id *id);

#define HAPI_QUEUE_CACHED 1   /* hapi_serve_queue: already cached, nothing queued */
#define HAPI_QUEUE_SKIPPED 2  /* ... the source is gone or not a regular file */
/*
 * Queues the image path at v for background work at priority (prefetch or
 * warm-up), fire-and-forget, unless it is cached; waits while two batches of
 * that priority are queued. Returns 0 (queued), HAPI_QUEUE_CACHED,
 * HAPI_QUEUE_SKIPPED, or -ECANCELED (stop set, batcher stopping) / -ENOMEM.
 */
int hapi_serve_queue(hapi_serve *s, hapi_view *v, const char *path, int priority,
                     atomic_int *stop);

/* Counts bytes asked of a source file shown as it is (fs.c reads those itself). */
void hapi_serve_note_passthrough(hapi_serve *s, size_t bytes);

/* Removes the cached features of a source found deleted, at the current view. */
void hapi_serve_collect(hapi_serve *s, const char *path);

/*
 * Removes the current view's entries for path: an image, or every image
 * beneath a directory ("" = all). Returns the count, or < 0 with err.
 */
int hapi_serve_evict(hapi_serve *s, const char *path, hapi_error *err);

/* Fills *st. Thread-safe. */
void hapi_serve_stats_get(hapi_serve *s, hapi_serve_stats *st);

/* -------------------------------------------------------------- pack.c */

/*
 * Per-directory packs: DIR/.hapifs-pack.npy holds the features of every
 * image directly in DIR (those its listing shows as .feat), in the byte
 * order of their names, as one .npy array of shape (N, feature shape), so
 * that a reader fetches a directory's features with a few large sequential
 * reads instead of a lookup, an open, a read and a release per file.
 * DIR/.hapifs-pack.json is its index: the namespace, the shape, and per
 * image its name, source identity and status. Neither is listed.
 *
 * A pack is a snapshot taken when it is opened (the names and identities,
 * the view): its bytes stay those of that snapshot however the directory
 * changes. A sample that cannot be computed (an undecodable image) does not
 * fail the pack: its row is all NaN, the index says "failed", and its own
 * .feat stays an error.
 */
#define HAPI_PACK_NAME ".hapifs-pack.npy"
#define HAPI_PACK_INDEX_NAME ".hapifs-pack.json"
#define HAPI_PACK_FORMAT "hapifs-pack/1"

typedef struct hapi_packs hapi_packs;
typedef struct hapi_pack hapi_pack;

/* Makes the pack layer over borrowed layers. Returns 0 or -ENOMEM. */
int hapi_packs_new(hapi_source *source, hapi_views *views, hapi_serve *serve, hapi_packs **out);
void hapi_packs_free(hapi_packs *p);

/* What a directory's pack looks like now, without computing anything. */
typedef struct hapi_pack_info {
    uint64_t count;            /* images */
    uint64_t size;             /* bytes of the pack (header + count rows) */
    uint64_t index_bound;      /* the index is never longer than this */
    struct timespec mtime, ctime; /* the latest of the directory's and its images' */
    uint64_t key;              /* a hash of what its bytes are: namespace, names, identities */
} hapi_pack_info;

/*
 * Describes dir's pack at the current view (waiting for the first).
 * Returns 0, -ENOENT (no image directly in dir), -ENOTDIR, -ENODEV
 * (unmounting) or -errno.
 */
int hapi_pack_info_get(hapi_packs *p, const char *dir, hapi_pack_info *info);

/*
 * Opens dir's pack at the current view: a snapshot of its images. who (NULL:
 * anyone) must be able to read every one of them, or it is -EACCES: a pack
 * holds the features of each. Returns 0 or what hapi_pack_info_get()
 * returns; *out NULL on failure.
 */
int hapi_pack_open(hapi_packs *p, const char *dir, const hapi_cred *who, hapi_pack **out);
/* What an open pack is (as hapi_pack_info_get() told before it was opened). */
void hapi_pack_describe(const hapi_pack *k, hapi_pack_info *info);
/* The pack's size in bytes. */
uint64_t hapi_pack_size(const hapi_pack *k);
/*
 * The key of its snapshot (as hapi_pack_info's): two opens with one key read
 * the same bytes (but for rows of images that change while being read).
 */
uint64_t hapi_pack_key(const hapi_pack *k);
/*
 * Fills buf with bytes [off, off + size) of the pack, computing the rows it
 * covers (and asking for the next ones ahead). Waits only for the rows it
 * covers. Returns the bytes written (0 at the end), or -ECANCELED / -ENOMEM.
 * Thread-safe.
 */
ssize_t hapi_pack_read(hapi_pack *k, char *buf, size_t size, off_t off);
/* Closes it. Accepts NULL. */
void hapi_pack_close(hapi_pack *k);

/*
 * dir's index as JSON text (malloc'd, *len bytes, the caller frees), made
 * now. Returns 0 or what hapi_pack_info_get() returns.
 */
int hapi_pack_index(hapi_packs *p, const char *dir, char **text, size_t *len);

typedef struct hapi_pack_stats {
    uint64_t opens, reads, bytes, rows, rows_failed, index_reads;
    uint64_t rows_split;         /* rows a read covered in part, kept for the other parts */
    uint64_t rows_split_dropped; /* ... dropped (no room) before every part was read */
} hapi_pack_stats;
void hapi_pack_stats_get(hapi_packs *p, hapi_pack_stats *st);

/* ------------------------------------------------------------ remote.c */

/*
 * The compute-side feature source (-o remote): the union of SOURCE
 * directories where storage nodes' hapifs mounts are visible through any
 * network filesystem (sshfs, NFS, a mergerfs union). A .feat that misses the
 * local cache is fetched with its directory's pack (DIR/.hapifs-pack.npy,
 * checked against DIR/.hapifs-pack.json) and every row of it stored in the
 * local cache, so a directory costs a few large reads instead of a round
 * trip per file. Paths are the mount's, relative to its root ("" the root);
 * a .feat's cache key is its image's path with the storage side's namespace
 * and the image's identity from the index. Thread-safe.
 */
typedef struct hapi_remote hapi_remote;

typedef struct hapi_remote_config {
    const char *const *roots;   /* the SOURCE directories, absolute; borrowed during open */
    size_t nroots;
    hapi_cache *cache;          /* borrowed: outlives the remote */
    hapi_error_ring *errors;    /* borrowed */
    int refresh_ms;             /* a directory's index is read again when older than this */
    int fetch_threads;          /* packs fetched at once */
    void (*on_change)(void *arg); /* a directory's namespace changed (fs: kernel invalidation) */
    void *arg;
} hapi_remote_config;

/*
 * Checks every root's .hapifs/config (a storage mount's, with a namespace;
 * all roots the same namespace) and starts the fetch threads. A root that
 * fails the check is refused (one line in the log and the error ring) and
 * the others serve. Returns 0, or < 0 with err when no root is usable.
 */
int hapi_remote_open(const hapi_remote_config *cfg, hapi_remote **out, hapi_error *err);

/*
 * Parses and checks text as the pack index of directory dir, as a remote
 * mount does before it trusts one (format, namespace, shape, names beneath
 * dir, sizes), and frees it. Returns 0, HAPI_ECORRUPT or -ENOMEM with err.
 */
int hapi_remote_index_check(const char *text, size_t len, const char *dir, hapi_error *err);
/* Stops the fetches and the warm-up, joins, frees. Accepts NULL. */
void hapi_remote_close(hapi_remote *r);

enum hapi_remote_kind {
    HAPI_REMOTE_DIR,
    HAPI_REMOTE_FILE,       /* a regular file of a source, read through */
    HAPI_REMOTE_FEAT        /* a .feat in a directory's index: served from the cache or a pack
                               (a .feat no index lists is not served) */
};

/*
 * What path is (enum hapi_remote_kind) and its attributes: a .feat's from
 * its directory's index (exact size, the image's times; no request per
 * file; st_ino is a key of what its bytes are, its namespace and its
 * image's identity, which the caller names its node by), anything else the
 * first source's that has it (st_ino the source's). Returns 0, -ENOENT,
 * -EIO (a source that has it may be unreachable, or is not a storage mount
 * now: its daemon restarting) or -ENOMEM.
 */
int hapi_remote_stat(hapi_remote *r, const char *path, int *kind, struct stat *st);

/*
 * Calls fn for every entry of directory dir in the union of the sources (a
 * name in several: the first source's), with attributes as
 * hapi_remote_stat() gives them. Stops when fn returns < 0 (returned).
 * Returns 0, -ENOENT (no source has dir), -EIO or < 0.
 */
int hapi_remote_list(hapi_remote *r, const char *dir,
                     int (*fn)(void *arg, const char *name, int kind, const struct stat *st),
                     void *arg);

/*
 * Opens a regular file of the first source that has it for reading, with
 * O_DIRECT where the source allows it (a caller whose pread is refused with
 * EINVAL, unaligned on a local filesystem, clears it with fcntl). Returns an
 * fd or -errno.
 */
int hapi_remote_open_file(hapi_remote *r, const char *path);
/*
 * A directory's pack read through (its .hapifs-pack.npy, fd from
 * hapi_remote_open_file()): the size its header says, into *size. Returns 0,
 * or -EIO (with a line in the error ring) when fd has no whole pack header:
 * the storage daemon died or restarted under the open, and its network
 * filesystem shows an empty or cut file, which must not read as a pack.
 */
int hapi_remote_pack_file_size(hapi_remote *r, const char *path, int fd, uint64_t *size);
/*
 * A directory's index read through (its .hapifs-pack.json): reads fd (closed)
 * whole into *text (malloc'd) and checks that it is a whole index. Returns 0,
 * -ENOMEM, or -EIO (with a line in the error ring).
 */
int hapi_remote_read_pack_index(hapi_remote *r, const char *path, int fd, char **text,
                                size_t *len);
/* Opens the storage side's .hapifs/NAME (the model archive) for reading. Returns an fd or -errno. */
int hapi_remote_open_storage_file(hapi_remote *r, const char *name);
/* The storage side's .hapifs/NAME read now (malloc'd text, the caller frees). Returns 0 or -errno. */
int hapi_remote_read_storage_file(hapi_remote *r, const char *name, char **text, size_t *len);
/* The first usable source's .hapifs/config as read at open (owned by r), or NULL. */
const char *hapi_remote_storage_config(hapi_remote *r);

/* An open .feat: the index entry it had at open; its bytes never change while open. */
typedef struct hapi_remote_feat hapi_remote_feat;
/* Opens the .feat path. Returns 0, -ENOENT (no index lists it), -EIO or -ENOMEM. */
int hapi_remote_feat_open(hapi_remote *r, const char *path, hapi_remote_feat **out);
uint64_t hapi_remote_feat_size(const hapi_remote_feat *f);
/* The key of what its bytes are, as hapi_remote_stat() gives it in st_ino at its open. */
uint64_t hapi_remote_feat_key(const hapi_remote_feat *f);
/*
 * Fills buf with bytes [off, off + size) of f: from the cache, or from its
 * directory's pack (joining a fetch in progress; waiting only for the chunk
 * that holds its row). Returns the bytes (0 past the end), or -EIO (the
 * reason in the error ring) / -ENOMEM. Thread-safe.
 */
ssize_t hapi_remote_feat_read(hapi_remote *r, hapi_remote_feat *f, char *buf, size_t size,
                              off_t off);
/* Closes f. Accepts NULL. */
void hapi_remote_feat_close(hapi_remote_feat *f);

/* Starts fetching every pack under path ("" all) with a row not cached. Returns 0, -EBUSY, -errno. */
int hapi_remote_warm_start(hapi_remote *r, const char *path);
/*
 * Stops a running warm-up: its walker is told to stop and joined; fetches
 * already started or queued (fetch_threads at most) go on. Returns 1 if one
 * was stopped, 0 if none was running.
 */
int hapi_remote_warm_stop(hapi_remote *r);
/*
 * Removes the cached features under path (a directory, a .feat or its
 * image's name; "" every namespace the sources serve). Returns the count or
 * < 0 with err.
 */
int hapi_remote_evict(hapi_remote *r, const char *path, hapi_error *err);

typedef struct hapi_remote_stats {
    uint64_t reads, bytes, hits, misses, fetched_rows, waits, failed, stale;
    uint64_t cache_put_failures;     /* fetched features served but not cached (disk or map full) */
    uint64_t uncached_hits;          /* reads served from rows the cache refused, kept in memory */
    uint64_t fetches_running, fetches_queued;
    int warm_state;                  /* enum hapi_warm_state */
    char warm_path[1024];
    uint64_t warm_total, warm_cached, warm_fetched, warm_failed, warm_dirs;
    double warm_elapsed_s;
} hapi_remote_stats;
void hapi_remote_stats_get(hapi_remote *r, hapi_remote_stats *st);

typedef struct hapi_remote_source_stats {
    const char *path;                /* owned by r */
    int refused, reachable;
    int checked;                     /* its config was read (else down since the mount) */
    hapi_cache_namespace ns;         /* its features' namespace (from its config when checked) */
    char namespace_hex[33];
    uint64_t index_reads, index_checks, index_bytes, packs, pack_bytes, rows, rows_failed,
        fetch_failures, file_reads;
    char last_error[512];
} hapi_remote_source_stats;
size_t hapi_remote_source_count(const hapi_remote *r);
void hapi_remote_source_stats_get(hapi_remote *r, size_t i, hapi_remote_source_stats *st);

/* -------------------------------------------------------- background.c */

enum hapi_prefetch_mode { HAPI_PREFETCH_OFF = 0, HAPI_PREFETCH_DIR = 1 };

typedef struct hapi_background_config {
    hapi_source *source;
    hapi_cache *cache;
    hapi_views *views;
    hapi_serve *serve;         /* registers its miss hook there */
    int prefetch;              /* enum hapi_prefetch_mode */
    uint64_t cache_size;       /* the cache's bound (prefetch stays under half of it) */
    int warm;                  /* warm the whole tree at start */
} hapi_background_config;

typedef struct hapi_background hapi_background;

/*
 * Starts the cache keeper, the prefetch thread (prefetch=dir) and, with
 * warm, a warm-up of the whole tree (it counts at once and computes once the
 * first view exists). A thread that cannot start is logged and left out.
 * Returns 0 or -ENOMEM with err.
 */
int hapi_background_start(const hapi_background_config *cfg, hapi_background **out,
                          hapi_error *err);
/*
 * Stops and joins every thread and frees. The views must be stopped first
 * (hapi_views_stop) so that a walker waiting for the first view goes, and the
 * current view's batcher stopped so that one waiting for queue room goes.
 * Accepts NULL.
 */
void hapi_background_stop(hapi_background *bg);

/*
 * The number of images in the tree (found by the layer above), or ok 0 if
 * counting failed: prefetch waits for it to judge whether the tree fits half
 * the cache, and runs if it cannot know.
 */
void hapi_background_set_tree_size(hapi_background *bg, uint64_t images, int ok);

/* Starts warming path (relative; "" for all) in the background. Returns 0, -EBUSY, -errno. */
int hapi_warm_start(hapi_background *bg, const char *path);
/*
 * Stops an unfinished warm-up for good (ctl "warm stop"): the walker is told
 * to stop and joined; what it has queued already (two batches at most) is
 * still computed. Its status says HAPI_WARM_STOPPED until the next start.
 * Returns 1 if a warm-up was stopped, 0 if none was running.
 */
int hapi_warm_stop(hapi_background *bg);
/*
 * Stops an unfinished warm-up and returns what it was warming (malloc'd, to
 * hand to hapi_warm_start() again), or NULL if none was running.
 */
char *hapi_warm_pause(hapi_background *bg);

enum hapi_warm_state {
    HAPI_WARM_IDLE, HAPI_WARM_COUNTING, HAPI_WARM_RUNNING, HAPI_WARM_DONE,
    HAPI_WARM_STOPPED       /* by hapi_warm_stop() or hapi_remote_warm_stop() */
};

/* A warm-up's progress; path is a copy (malloc'd, NULL when idle): free it. */
typedef struct hapi_warm_status {
    int state;                 /* enum hapi_warm_state */
    char *path;
    uint64_t total, cached, skipped, submitted, completed;
    double elapsed_s;
} hapi_warm_status;
/* Fills *ws (a consistent path with the counters of its run). Returns 0 or -ENOMEM. */
int hapi_warm_status_get(hapi_background *bg, hapi_warm_status *ws);

typedef struct hapi_prefetch_stats {
    int mode;                                  /* enum hapi_prefetch_mode */
    uint64_t dirs, pending_dirs, submitted, cached, computed, dropped;
} hapi_prefetch_stats;
void hapi_prefetch_stats_get(hapi_background *bg, hapi_prefetch_stats *ps);

/* -------------------------------------------------------------- tune.c */

typedef struct hapi_tune_config {
    const hapi_fs_options *opt;
    hapi_source *source;
    hapi_extractor *ex;
    hapi_cache *cache;
    hapi_views *views;
    hapi_serve *serve;
    hapi_background *background;
    hapi_node *node;             /* the node's cores, all taken while profiling; NULL: none */
    /* Called after every split change, with only tune.switch_lock held (fs: kernel invalidation). */
    void (*on_split_change)(void *arg);
    void *arg;
    /*
     * If not NULL, a profile waits until serving(arg) returns 1 (at most
     * TUNE_SERVING_WAIT_MS): the mount's own start-up (the session, io_uring's
     * workers registering) would land in its timings.
     */
    int (*serving)(void *arg);
} hapi_tune_config;

typedef struct hapi_tune hapi_tune;

/*
 * Starts choosing in the background: the profile (stored or measured), the
 * decode cost, the policy's split and batch; then makes the first view
 * current and counts the tree. .feat operations wait for that view.
 * Returns 0 or < 0 with err.
 */
int hapi_tune_start(const hapi_tune_config *cfg, hapi_tune **out, hapi_error *err);
/*
 * Cancels a profile in progress, joins the thread and frees. Call it before
 * the views and the layers below go (it does not touch the current view).
 * Accepts NULL.
 */
void hapi_tune_stop(hapi_tune *t);

/*
 * Switches to split (1..freeze): a new view, the warm-up moved to it, the
 * callback called. by_operator says who asked. Returns 0, -EAGAIN (no first
 * view yet), HAPI_EINVAL or < 0 with err.
 */
int hapi_tune_set_split(hapi_tune *t, int split, int by_operator, hapi_error *err);
/* Sets the batch (0 = auto, else 1..HAPI_BATCH_MAX). Returns 0, -EAGAIN or HAPI_EINVAL. */
int hapi_tune_set_batch(hapi_tune *t, int batch, hapi_error *err);

enum hapi_tune_input {
    HAPI_TUNE_LINK, HAPI_TUNE_CLIENT_SPEED, HAPI_TUNE_EPOCHS,
    HAPI_TUNE_RTT,          /* seconds */
    HAPI_TUNE_TRANSPORT,    /* enum hapi_policy_transport */
    HAPI_TUNE_COMPUTE_CACHE, /* bytes */
    HAPI_TUNE_READERS,      /* concurrent per-file readers on the compute tier */
    HAPI_TUNE_COMPUTE_FILE_MS /* ms; < 0: back to HAPI_POLICY_COMPUTE_FILE_MS */
};
/* Sets one of the policy's inputs (bits/s, a ratio, a count); the caller validated it. */
void hapi_tune_set_input(hapi_tune *t, int which, double value);
/* Sets the compute tier's measured ms per sample of stages [0, n) (n 0: none, the profile over
   client_speed); the caller validated them (n <= HAPI_PROFILE_MAX_STAGES, each >= 0). */
void hapi_tune_set_compute_stages(hapi_tune *t, int n, const double *ms);

/*
 * Runs the policy on the current inputs and cache state. split 0 lets it
 * choose; a split > 0 is explained against every other (its batch chosen);
 * split -1 means the current view's. Fills *choice and, if in_out is not
 * NULL, the inputs used (in_out->profile points into t: valid until the next
 * profile, i.e. for the mount's life). Returns 0, -EAGAIN (still measuring)
 * or HAPI_EINVAL (no profile) with err.
 */
int hapi_tune_choose(hapi_tune *t, int split, hapi_policy_input *in_out,
                     hapi_policy_choice *choice, hapi_error *err);

/* What tune holds now, for the control files. */
typedef struct hapi_tune_status {
    int split_by_operator;
    int batch, batch_auto;
    double link_bps, client_speed, rtt_s;
    double compute_file_ms;    /* the policy's input */
    int compute_file_given;    /* ... measured and given (mount option, ctl), not the default */
    int epochs, transport;
    uint64_t split_changes;
    int state;                 /* 0 measuring, 1 ready, < 0 failed (code) */
    char error[256];           /* why, when failed */
    int reused;                /* the profile was read from the cache directory */
    double decode_ms, source_bytes;
    int decode_samples;
    int compute_nstages;       /* the compute tier's measured stages (0: none) */
    double compute_stage_ms[HAPI_PROFILE_MAX_STAGES];
} hapi_tune_status;
void hapi_tune_status_get(hapi_tune *t, hapi_tune_status *st);
/* The profile as JSON text (malloc'd, the caller frees), or NULL if there is none. */
char *hapi_tune_profile_json(hapi_tune *t);

/* ------------------------------------------------------------- watch.c */

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

/* ------------------------------------------------------------- uring.c */

/*
 * FUSE over io_uring: requests served on the CPU that made them, by worker
 * threads that each hold one ring entry of that CPU's queue (uring.c says why
 * and how). Requests the ring does not carry still come through /dev/fuse.
 */
typedef struct hapi_uring hapi_uring;
typedef struct hapi_uring_stats {
    int queues;        /* one per possible CPU */
    int workers;       /* threads, each with one entry */
    int registered;    /* entries the kernel holds now */
    int active;        /* every worker's entry is registered: the kernel uses the ring */
    uint64_t requests; /* requests served through the ring */
} hapi_uring_stats;
/* 1 if the kernel offers the transport (the fuse module's enable_uring is set). */
int hapi_uring_available(void);
/*
 * Installs the custom io on se (mounted; its /dev/fuse) and starts the
 * workers, threads per queue (at most 256 in all, at least two per queue);
 * they register once
 * hapi_uring_initialized is called. Returns 0 or -errno with err; *out is
 * NULL on failure, and se is then unchanged.
 */
int hapi_uring_start(struct fuse_session *se, int threads, hapi_uring **out, hapi_error *err);
/* Called from the INIT handler: the workers may register. Accepts NULL. */
void hapi_uring_initialized(hapi_uring *u);
/* A copy of the counters; zeros for NULL. */
void hapi_uring_stats_get(const hapi_uring *u, hapi_uring_stats *s);
/*
 * Stops the workers (each finishes the request it serves) and frees u; the
 * kernel's entries are cancelled. Call after unmounting and before the
 * session is destroyed. Accepts NULL.
 */
void hapi_uring_stop(hapi_uring *u);

/* --------------------------------------------------------------- ctl.c */

/* Names of the control files, NULL-terminated. */
extern const char *const hapi_ctl_files[];
#define HAPI_CTL_WRITABLE "ctl"  /* the one that takes commands */
#define HAPI_CTL_MODEL "model"   /* the model archive, read through */
#define HAPI_CTL_LINE_MAX 4096
/* The size a control file shows: its content (made at open) is never longer. */
#define HAPI_CTL_SIZE_MAX (4u << 20)

/* The FUSE requests a mount has answered, by type (stats: requests). */
enum hapi_fs_request {
    HAPI_REQ_LOOKUP, HAPI_REQ_FORGET, HAPI_REQ_GETATTR, HAPI_REQ_OPENDIR, HAPI_REQ_READDIR,
    HAPI_REQ_RELEASEDIR, HAPI_REQ_OPEN, HAPI_REQ_READ, HAPI_REQ_RELEASE, HAPI_REQ_STATFS,
    HAPI_REQ_OTHER, HAPI_REQ_COUNT
};
extern const char *const hapi_fs_request_names[HAPI_REQ_COUNT];
typedef struct hapi_fs_requests {
    atomic_uint_fast64_t n[HAPI_REQ_COUNT];
} hapi_fs_requests;

typedef struct hapi_ctl_config {
    const hapi_fs_options *opt;
    const hapi_fs_requests *requests;
    hapi_source *source;
    hapi_extractor *ex;
    hapi_cache *cache;
    hapi_views *views;
    hapi_serve *serve;
    hapi_packs *packs;
    hapi_background *background;
    hapi_tune *tune;
    hapi_remote *remote;       /* a compute-side mount: the layers above remote are NULL */
    hapi_error_ring *errors;
    hapi_node *node;             /* the node's shared budget and cores; NULL: none */
    hapi_watch *watch;           /* the source's watch; NULL: none (watch=0, remote) */
    int no_open;                 /* the kernel opens files without asking (in effect) */
    hapi_uring *const *uring;    /* the session's io_uring workers (*uring NULL: none) */
    const int *epochs;           /* the kernel forgets every name at one notice (hapi_fs.epochs) */
    const atomic_uint_fast64_t *epoch_notices; /* and how many it was sent */
    uint64_t started_ns;
} hapi_ctl_config;

/*
 * .hapifs/metrics: stats (the JSON of .hapifs/stats) in the Prometheus text
 * exposition format, every sample labelled with mountpoint (metrics.c says
 * how names are made). *text is malloc'd, NUL-terminated. Returns 0 or -ENOMEM.
 */
typedef struct json_t json_t;
int hapi_metrics_render(json_t *stats, const char *mountpoint, char **text);

typedef struct hapi_ctl hapi_ctl;
/* Makes the control layer over borrowed layers. Returns 0 or -ENOMEM. */
int hapi_ctl_new(const hapi_ctl_config *cfg, hapi_ctl **out);
void hapi_ctl_free(hapi_ctl *c);

/*
 * A control file's content, shared by reference: a reply may be written from
 * it while the handle that holds it is released.
 */
typedef struct hapi_ctl_text {
    atomic_int refs;
    size_t len;
    char data[];
} hapi_ctl_text;
/* Adds a reference; returns t. */
hapi_ctl_text *hapi_ctl_text_ref(hapi_ctl_text *t);
/* Drops one; the last frees. Accepts NULL. */
void hapi_ctl_text_put(hapi_ctl_text *t);
/* A text holding a copy of data. NULL on out-of-memory. */
hapi_ctl_text *hapi_ctl_text_new(const char *data, size_t len);

/*
 * The content of control file name ("config", "stats", ...) now (one
 * reference), or NULL, as who may see it: NULL is the mount's owner or root,
 * who see everything. Others see in errors only the errors of paths whose
 * names they could list in the source tree ("hidden" counts the rest; on a
 * remote mount, none), and in stats "(hidden)" for such a warm-up path and
 * for a remote source's last error.
 */
hapi_ctl_text *hapi_ctl_render(hapi_ctl *c, const char *name, const hapi_cred *who);

/*
 * Carries out the commands in text (one per line: "warm [PATH]", ...), once
 * every line has passed hapi_ctl_check(). Returns 0, or -EINVAL / -EBUSY /
 * -EAGAIN / -ENOENT / -EIO with a message in err; nothing is changed by the
 * command that fails (earlier lines stand: a path that does not exist or a
 * split the model does not have is found only when its line runs).
 */
int hapi_ctl_command(hapi_ctl *c, const char *text, size_t len, hapi_error *err);

/*
 * Checks text as commands of a mount (remote or not) without any layer: the
 * command names, their words, the values (sizes, rates, times, numbers) and
 * that paths stay beneath the mount. Returns 0 or -EINVAL with err. Pure.
 */
int hapi_ctl_check(const char *text, size_t len, int remote, hapi_error *err);

/* ---------------------------------------------------------------- fs.c */

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
    hapi_cache *cache;
    hapi_error_ring *errors;
    hapi_views *views;
    hapi_serve *serve;
    hapi_packs *packs;
    hapi_background *background;
    hapi_tune *tune;
    hapi_ctl *ctl;
    hapi_remote *remote;         /* -o remote: every layer above but ctl is NULL */
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

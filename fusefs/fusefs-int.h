/* fusefs-int.h — the daemon's insides, shared by its files and its unit tests. */
#ifndef HAPI_FUSEFS_INT_H
#define HAPI_FUSEFS_INT_H

#define FUSE_USE_VERSION 314

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/stat.h>
#include <time.h>
#include <fuse_lowlevel.h>

#include "cache.h"
#include "extractor.h"
#include "fusefs.h"
#include "hapi.h"
#include "policy.h"

/* ----------------------------------------------------------------- options */

enum hapi_prefetch_mode { HAPI_PREFETCH_OFF = 0, HAPI_PREFETCH_DIR = 1 };

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
    int warm;              /* warm the whole tree at mount */
    int prefetch;          /* enum hapi_prefetch_mode */
    double link_bps;       /* the link to the compute tier, bits/s */
    double client_speed;   /* the compute tier's speed relative to this node */
    int epochs;            /* epochs a job is expected to read */
    int profile_redo;      /* measure the model even if a profile is stored */
    int show_raw;
    int foreground;
    int debug;
    int fake;              /* mount helper called with -f: do nothing */
    int show_help;
    int show_version;
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

/* Parses "123", "64K", "1.5G", "2GiB", "512MB" (powers of 1024) into bytes. Returns 0 or HAPI_EINVAL. */
int hapi_fs_parse_size(const char *text, uint64_t *out);

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
/* A JSON text {"count": N, "errors": [...]} (malloc'd, caller frees), or NULL. */
char *hapi_error_ring_json(hapi_error_ring *r);

/* --------------------------------------------------------------- filesystem */

enum hapi_node_kind {
    HAPI_NODE_DIR,
    HAPI_NODE_FILE,     /* a regular source file passed through */
    HAPI_NODE_FEAT,     /* x.jpg.feat, computed */
    HAPI_NODE_CTL_DIR,  /* .hapifs */
    HAPI_NODE_CTL_FILE  /* .hapifs/<name> */
};

/* Counters for .hapifs/stats; all atomic. */
typedef struct hapi_fs_stats {
    atomic_uint_fast64_t feat_reads;      /* read requests on .feat files */
    atomic_uint_fast64_t feat_bytes;      /* bytes replied from .feat files */
    atomic_uint_fast64_t hits;            /* cache hits */
    atomic_uint_fast64_t misses;          /* cache misses */
    atomic_uint_fast64_t computed;        /* samples computed */
    atomic_uint_fast64_t errors;          /* .feat reads that failed (a kernel retry counts again) */
    atomic_uint_fast64_t cache_put_failures;
    atomic_uint_fast64_t hit_ns;          /* time in cache lookups that hit */
    atomic_uint_fast64_t passthrough_bytes;
    atomic_uint_fast64_t stale;           /* lookups that found an older version's features */
    atomic_uint_fast64_t bad;             /* lookups that found damaged entries */
    atomic_uint_fast64_t collected;       /* entries of deleted sources removed */
} hapi_fs_stats;

/*
 * What the .feat files are at one split: the namespace, the .npy header, the
 * size, and the batcher that computes them. A read keeps the view it opened
 * the file with, so a live split change never mixes two shapes in one open
 * file; the view goes when its last user puts it.
 */
typedef struct hapi_view {
    struct hapi_fs *fs;
    atomic_int refs;
    int split;                   /* stages [0, split) */
    hapi_stage_info output;      /* of stage split - 1 */
    hapi_cache_namespace ns;
    char ns_hex[33];
    char npy_header[HAPI_NPY_HEADER_MAX];
    size_t npy_header_len;
    size_t sample_bytes;
    uint64_t feat_size;          /* header + data */
    hapi_batcher *batcher;
    uint64_t serial;             /* 1, 2, ... in order of creation */
} hapi_view;

/* LMDB's cost of one cache entry beyond its features (keys, LRU records, page slack). */
#define HAPI_CACHE_ENTRY_OVERHEAD 2048

/* The mounted filesystem: one per daemon, passed to every handler as userdata. */
typedef struct hapi_fs {
    hapi_fs_options *opt;
    int source_fd;               /* O_PATH of the source root */
    int model_fd;                /* the model file loaded (read-only), -1 if unreadable */
    dev_t source_dev;
    hapi_extractor *ex;
    hapi_cache *cache;
    char ns_desc[256];           /* the preprocessing part of every namespace */
    struct fuse_session *se;     /* for invalidating the kernel's caches; NULL before mount */

    /* The current view: NULL until the policy has chosen the split. */
    pthread_mutex_t view_lock;
    pthread_cond_t view_cond;
    hapi_view *view;
    int view_stopping;

    /* The profile, the policy's inputs and its choice; guarded by tune.lock. */
    struct {
        pthread_mutex_t lock;
        pthread_mutex_t switch_lock; /* one split change at a time */
        pthread_t thread;         /* measures, counts, chooses at mount */
        int running;
        int state;                /* 0 measuring, 1 ready, < 0 failed (code) */
        char error[256];
        int reused;               /* the profile was read from the cache directory */
        hapi_profile profile;
        hapi_policy_input in;     /* without profile, cached[], samples: filled per use */
        int split_by_operator;    /* the split was given (option or control command) */
        int batch_auto;
        int batch;                /* the batch set now */
        double decode_ms, source_bytes;
        int decode_samples;       /* images the decode cost was measured on */
        atomic_uint_fast64_t images; /* images in the tree, once counted */
        atomic_int counted;
        atomic_int stop;
        atomic_uint_fast64_t split_changes;
    } tune;
    int feat_started;
    int view_ready_init;         /* view_lock and view_cond exist */
    pthread_t keeper;             /* applies the cache's access log now and then */
    int keeper_running;
    pthread_mutex_t keeper_lock;
    pthread_cond_t keeper_cond;
    int keeper_stop;
    struct {
        pthread_mutex_t lock;     /* starting and joining the walker */
        pthread_t thread;
        int running;
        char *root;               /* what is being warmed, relative to the source */
        hapi_view *view;          /* the view it warms (a reference), set by the walker */
        uint64_t started_ns;
        atomic_int stop, counted, walked;
        atomic_uint_fast64_t total;     /* images found (final once counted) */
        atomic_uint_fast64_t cached;    /* already in the cache */
        atomic_uint_fast64_t skipped;   /* vanished or unreadable during the walk */
        atomic_uint_fast64_t submitted; /* handed to the batcher */
        atomic_uint_fast64_t completed; /* finished by the batcher (computed or failed) */
    } warm;
    atomic_uint_fast64_t view_serial;
    struct {
        pthread_mutex_t lock;     /* the queue and the set of directories seen */
        pthread_cond_t cond;
        pthread_t thread;
        int ready, running;
        atomic_int stop;          /* set under lock; read by the walker and its throttle */
        struct prefetch_dir *head, *tail;
        uint64_t *seen;           /* hashes of (directory, view) queued once */
        size_t seen_size, seen_count;
        int off_split;            /* split at which "prefetch is off" was logged */
        atomic_uint_fast64_t dirs;         /* directories walked */
        atomic_uint_fast64_t pending_dirs; /* waiting for the walker */
        atomic_uint_fast64_t submitted;    /* images handed to the batcher */
        atomic_uint_fast64_t cached;       /* images found cached */
        atomic_uint_fast64_t computed;     /* computed because prefetch asked first */
        atomic_uint_fast64_t dropped;      /* directories not walked (cache too small, new view) */
    } prefetch;
    struct node_table *nodes;
    hapi_error_ring *errors;
    hapi_fs_stats stats;
    uint64_t started_ns;
    time_t started_realtime;
} hapi_fs;

/* The low-level operations, with userdata a hapi_fs. */
extern const struct fuse_lowlevel_ops hapi_fs_ops;

/*
 * Sets up fs from validated options: opens the source root, loads the model,
 * opens the cache, computes the namespace. Runs in the daemon (after the fork).
 * Returns 0 or a negative code with the message in err; on failure fs is
 * cleaned up.
 */
int hapi_fs_init(hapi_fs *fs, hapi_fs_options *opt, hapi_error *err);
void hapi_fs_destroy(hapi_fs *fs);

/*
 * The current view with a reference, waiting while the policy is still
 * choosing. NULL only when the filesystem is shutting down.
 */
hapi_view *hapi_view_get(hapi_fs *fs);
/* The current view with a reference, or NULL if there is none yet; never waits. */
hapi_view *hapi_view_peek(hapi_fs *fs);
/* Drops a reference; the last one stops and frees the view's batcher. Accepts NULL. */
void hapi_view_put(hapi_view *v);

/* Starts choosing (profile, policy) in the background; the first view appears when done. */
int hapi_tune_start(hapi_fs *fs, hapi_error *err);
/* Stops the chooser and drops the current view (after hapi_feat_stop's warm-up stop). */
void hapi_tune_stop(hapi_fs *fs);
/*
 * Switches to split (1..freeze): a new view, the warm-up moved to it, the
 * kernel's attributes and pages of every .feat it knows invalidated.
 * by_operator says who asked. Returns 0 or HAPI_EINVAL / -errno with err.
 */
int hapi_tune_set_split(hapi_fs *fs, int split, int by_operator, hapi_error *err);
/* Sets the batch (0 = auto). Returns 0 or HAPI_EINVAL. */
int hapi_tune_set_batch(hapi_fs *fs, int batch, hapi_error *err);
/*
 * Runs the policy on the current inputs and cache state; with split_auto the
 * split is chosen, else the current split is explained. Fills *choice and,
 * if in is not NULL, the inputs used. Returns 0, -EAGAIN (still measuring) or
 * HAPI_EINVAL.
 */
int hapi_tune_choose(hapi_fs *fs, int split_auto, hapi_policy_input *in,
                     hapi_policy_choice *choice, hapi_error *err);

/* Returns the content of control file name ("config", "stats", "errors", "profile", "policy", "ctl") as malloc'd text, or NULL. */
char *hapi_ctl_render(hapi_fs *fs, const char *name);

/* Names of the control files, NULL-terminated; the last, "ctl", is the writable one. */
extern const char *const hapi_ctl_files[];
#define HAPI_CTL_WRITABLE "ctl"
#define HAPI_CTL_MODEL "model"   /* the model archive, read through */
#define HAPI_CTL_LINE_MAX 4096

/*
 * Carries out the commands in text (one per line: "warm [PATH]", ...).
 * Returns 0, or -EINVAL / -EBUSY / -ENOENT with a message in err; nothing
 * is changed by a command that fails.
 */
int hapi_ctl_command(hapi_fs *fs, const char *text, size_t len, hapi_error *err);

/* ------------------------------------------------------------ .feat reads */

/* Starts the batcher; hapi_feat_stop() stops warm-up and the batcher. */
int hapi_feat_start(hapi_fs *fs, hapi_error *err);
void hapi_feat_stop(hapi_fs *fs);

/* Replies to a read of the .feat of source path, opened with identity *id at view v. */
void hapi_feat_read(fuse_req_t req, hapi_view *v, const char *path, const hapi_source_id *id,
                    size_t size, off_t off);

/* Makes a view of split (batcher started, not yet current). Returns 0 or < 0 with err. */
int hapi_feat_view_new(hapi_fs *fs, int split, int batch, hapi_view **out, hapi_error *err);

/* Calls fn for every image beneath dir (relative), depth first, until fn returns < 0 or *stop. */
int hapi_feat_walk(hapi_fs *fs, const char *dir, atomic_int *stop,
                   int (*fn)(hapi_fs *, const char *, void *), void *arg);

/* The same, for the images directly in dir only. */
int hapi_feat_list(hapi_fs *fs, const char *dir, atomic_int *stop,
                   int (*fn)(hapi_fs *, const char *, void *), void *arg);

#define HAPI_QUEUE_CACHED 1   /* hapi_feat_queue: already cached, nothing queued */
#define HAPI_QUEUE_SKIPPED 2  /* ... the source is gone or not a regular file */
/*
 * Queues the image path at v for background work at priority (prefetch or
 * warm-up), fire-and-forget, unless it is cached; waits while two batches of
 * that priority are queued. Returns 0 (queued), HAPI_QUEUE_CACHED,
 * HAPI_QUEUE_SKIPPED, or -ECANCELED (stop set, batcher stopping) / -ENOMEM.
 */
int hapi_feat_queue(hapi_fs *fs, hapi_view *v, const char *path, int priority, atomic_int *stop);

/* Starts the prefetch thread (prefetch=dir); hapi_prefetch_stop() joins it. */
int hapi_prefetch_start(hapi_fs *fs);
void hapi_prefetch_stop(hapi_fs *fs);
/* A read of path at v missed: queue the rest of its directory, once per directory and view. */
void hapi_prefetch_note(hapi_fs *fs, hapi_view *v, const char *path);

/* Removes the cached features of a source found deleted (path relative to the source). */
void hapi_feat_collect(hapi_fs *fs, const char *path);

/* Removes this namespace's entries for path: an image, or every image beneath a directory ("" = all). Returns the count or < 0. */
int hapi_feat_evict(hapi_fs *fs, const char *path, hapi_error *err);

/*
 * Reads the whole source file path into *data (malloc'd, *size bytes), with
 * the identity it had throughout the read in *id (may be NULL): a file
 * changed while being read is read again. Returns 0 or < 0 with err.
 */
int hapi_feat_load(hapi_fs *fs, const char *path, void **data, size_t *size, hapi_source_id *id,
                   hapi_error *err);

/* The identity of a regular source file. Returns 0 or -errno. */
int hapi_feat_identity(hapi_fs *fs, const char *path, hapi_source_id *id);

/* Starts warming path (relative; "" for all) in the background. Returns 0, -EBUSY, -errno. */
int hapi_warm_start(hapi_fs *fs, const char *path);
/* True once the walk is over and everything it submitted has finished. */
int hapi_warm_finished(hapi_fs *fs);
/*
 * Stops an unfinished warm-up and returns what it was warming (malloc'd, to
 * hand to hapi_warm_start() again), or NULL if none was running.
 */
char *hapi_warm_pause(hapi_fs *fs);

/* Tells the kernel to forget the attributes and pages of every .feat it may hold. */
void hapi_fs_invalidate_feats(hapi_fs *fs);

/* Maps a module code to the errno a FUSE reply carries (hapifs codes are EIO). */
int hapi_fs_errno(int code);

/*
 * Opens path (relative to the source root, "" for the root) beneath the root:
 * symlinks may not leave it, magic links are refused. flags as for openat.
 * Returns an fd or -errno (-EXDEV for an escaping path, mapped to -ENOENT).
 */
int hapi_fs_open_beneath(int root_fd, const char *path, int flags);

/* stat() of a path beneath the root, following symlinks that stay beneath it. Returns 0 or -errno. */
int hapi_fs_stat_beneath(int root_fd, const char *path, struct stat *st);

#endif

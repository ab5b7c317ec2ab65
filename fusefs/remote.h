/* remote.h — a compute-side mount's feature source (-o remote). */
#ifndef HAPI_FUSEFS_REMOTE_H
#define HAPI_FUSEFS_REMOTE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "cache.h"
#include "hapi.h"
#include "log.h"

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
    /*
     * features=freeze: a .feat is the output of the storage side's freeze
     * stage, whatever its split (its model is kept in model_dir and runs the
     * stages [split, freeze) on fetched rows); 0: the storage side's rows.
     */
    int finish;
    const char *model_dir;      /* borrowed during open */
    int precision;              /* enum hapi_precision: what the stages compute in here */
    int torch_threads;          /* libtorch intra-op threads; 0: libtorch's choice */
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
 * O_DIRECT where the source allows it (read it with hapi_remote_pread_all()).
 * Returns an fd or -errno.
 */
int hapi_remote_open_file(hapi_remote *r, const char *path);
/*
 * Reads len bytes of fd at off into buf: all of them unless the file ends
 * first. Where a direct read is refused for its alignment (EINVAL, a local
 * filesystem), clears O_DIRECT on fd and reads normally. Returns the bytes
 * read (fewer than len only at the end of the file) or -errno.
 */
ssize_t hapi_remote_pread_all(int fd, void *buf, size_t len, off_t off);
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

/* What a .feat is with features=freeze (see hapi_remote_config.finish). */
typedef struct hapi_remote_features {
    int finish;                      /* features=freeze */
    int usable;                      /* its config and model can be used: else why */
    int loaded;                      /* its model is loaded (at open, or by a split before
                                        the freeze point) */
    char why[512];
    int freeze;                      /* a .feat is the output of stages [0, freeze) */
    int ndim;
    int64_t shape[8];                /* of one .feat (HAPI_MAX_DIMS) */
    char ns_hex[2][33];              /* its namespace by dtype: fp32, fp16 */
    uint64_t feat_size[2];           /* a .feat's bytes by dtype, its .npy header with them */
    uint64_t rows;                   /* rows run through [split, freeze) here */
} hapi_remote_features;
void hapi_remote_features_get(hapi_remote *r, hapi_remote_features *out);

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

#endif

/* remote-int.h — the insides the remote family shares (remote.c, remote-source.c, remote-index.c, remote-fetch.c, remote-feat.c, remote-walk.c): the remote, its sources and indexes, the functions that cross files. */
#ifndef HAPI_FUSEFS_REMOTE_INT_H
#define HAPI_FUSEFS_REMOTE_INT_H

#include "remote.h"
#include "cache.h"
#include "extractor.h"
#include "hapi.h"
#include "source.h"
#include "warmup.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>

/*
 * What a compute-side mount does with a read of DIR/x.jpg.feat:
 *   1. the index of DIR on each source (DIR/.hapifs-pack.json, kept for
 *      refresh_ms) says which source has x.jpg, its identity and the
 *      storage side's namespace: the cache key is (namespace, DIR/x.jpg,
 *      identity), so a changed image or a new split is a miss, never old
 *      features served as new;
 *   2. a hit is copied from the local LMDB cache;
 *   3. a miss joins (or starts) the fetch of DIR's pack from that source: a
 *      fetch thread reads the pack with large sequential reads, checks its
 *      size and header against the index, hands each row to the readers
 *      waiting for it as soon as its chunk arrives, and stores every row in
 *      the cache. So a directory costs a few large reads instead of a
 *      lookup, an open, a read and a release per file, and the first file
 *      of a pack is answered as soon as its chunk has arrived.
 *
 * Locks (leaves in the daemon's order, never held together): index_lock
 * (the index slots), fetch_lock (fetches, their waiters, the queue), a
 * source's lock (its root handle), the warm-up's status lock. Above them the
 * warm-up's control lock (warmup.h), held by its start and stop through the
 * join of its walker (which never takes it), so that one walker is started or
 * joined at a time.
 */

/*
 * The files:
 *   remote.c         the union tree (stat, list, open), the remote opened and
 *                    closed, its stats
 *   remote-source.c  the sources: their roots, reopened; opens and reads beneath
 *                    them; whether one is serving; the check of its .hapifs/config
 *   remote-index.c   a directory's index: read, parsed (packindex.c, which holds
 *                    the format), kept per source in the slot cache and read
 *                    again after refresh=
 *   remote-fetch.c   the fetch queue and its threads, pack reads, the spill of
 *                    rows the cache refuses
 *   remote-feat.c    .feat opens and reads: the cache, the spill, or a fetch
 *   remote-walk.c    the walks of the union's directories: warm-up and evict
 *   remote-finish.c  features=freeze: the storage side's model kept and loaded
 *                    here, the stages [split, freeze) run on fetched rows
 */

#define INDEX_MAX (256u << 20)   /* an index longer than this is refused */

/* ------------------------------------------------------------ sources */

/* A source's root, reopened after the network filesystem under it died and came back. */
struct root {
    atomic_int refs;
    hapi_source *source;
    dev_t dev;                    /* what the source's path named when opened */
    ino_t ino;
    uint64_t gen;                 /* which of the source's roots, from 1: see hapi_remote__serving() */
};

struct remote_source {
    char *path;                   /* as given, absolute */
    pthread_mutex_t lock;
    struct root *root;            /* NULL while unreachable */
    /*
     * A storage mount of another model or preprocessing than the first
     * source's: never used. Set once, under check_lock.
     */
    atomic_int refused;
    /*
     * Its .hapifs/config was read (at mount, or since: see hapi_remote__source_usable());
     * ns, ns_hex and config are set before, immutable after.
     */
    atomic_int checked;
    atomic_uint_fast64_t check_ns; /* when it was last tried while not checked */
    pthread_mutex_t check_lock;   /* one check at a time */
    hapi_cache_namespace ns;      /* the namespace its config named when checked */
    char ns_hex[33];              /* ... in hex */
    char *config;                 /* its .hapifs/config when checked (JSON text) */
    struct {
        atomic_uint_fast64_t index_reads, index_checks, index_bytes, packs, pack_bytes, rows,
            rows_failed, fetch_failures, file_reads;
    } stats;
    int fetching;                 /* under the remote's fetch_lock: its packs being fetched */
    char last_error[512];         /* under lock */
    uint64_t root_gen;            /* under lock: the last root's gen */
    /* under lock: when it last showed its .hapifs/config, through which root (see hapi_remote__serving()) */
    uint64_t serving_ns, serving_gen;
    atomic_uint_fast64_t root_since_ns; /* when an open root was last replaced (0: never) */
};

/* ------------------------------------------------------------- indexes */

struct index_entry {
    char *name;                   /* the image's name in DIR */
    hapi_source_id id;
    int failed;                   /* the storage side could not compute it */
};

/* One directory's index on one source, immutable once made; shared by reference. */
struct dir_index {
    atomic_int refs;
    int src;
    char *dir;
    /*
     * What a .feat of it is: its namespace (the cache key's), dtype, shape,
     * header and bytes. The pack's rows, as the index gives them, unless
     * finish: then the output of the freeze stage (see remote-finish.c).
     */
    hapi_cache_namespace ns;
    char ns_hex[33];
    char version[17];             /* the storage side's version of it, "" if it names none */
    int dtype;
    int ndim;
    int64_t shape[HAPI_MAX_DIMS];
    char header[HAPI_NPY_HEADER_MAX]; /* of one sample: a .feat */
    size_t header_len;
    size_t row_bytes;
    /* the pack as the index describes it: the output of stage split - 1 */
    int split;                    /* the storage side's; -1 if the index names none */
    int finish;                   /* its rows are run through [split, freeze) here */
    int pack_ndim;
    int64_t pack_shape[HAPI_MAX_DIMS];
    size_t pack_row_bytes;
    size_t pack_header_len;
    uint64_t pack_size;
    size_t count;
    struct index_entry *entries;  /* in the pack's row order: the byte order of names */
    uid_t uid;                    /* the index file's owner, group and read bits as the */
    gid_t gid;                    /* source shows them: its directory's, which its .feat */
    mode_t mode;                  /* files show (the index carries no per-file modes) */
};

/* The latest index of (source, dir), or why there is none. */
struct index_slot {
    int src;
    char *dir;
    uint64_t hash;
    struct dir_index *index;      /* a reference, or NULL */
    int code;                     /* 0, or why there is no index (-ENOENT: no images) */
    uint64_t at_ns;               /* when the read that made it began: it is at least this old */
    uint64_t expired_ns;          /* when it was last expired */
    int loading;
    int expired;                  /* read again at the next use */
    struct index_slot *next;
};

#define INDEX_BUCKETS 4096

/* -------------------------------------------------------------- fetches */

struct fetch {
    int refs;                     /* under fetch_lock */
    struct dir_index *index;      /* a reference: the rows it fetches */
    int warm;                     /* asked by the warm-up, not a reader */
    int started, finished;
    int code;                     /* the fetch's failure, once finished */
    size_t done;                  /* rows before this one are delivered */
    struct waiter *waiters;
    pthread_cond_t cond;
    struct fetch *next;           /* in r->fetches */
    struct fetch *queue_next;     /* in the queue */
};

struct waiter;
struct spill;

/*
 * features=freeze: the storage side's model, loaded here, and what a .feat
 * is then (remote-finish.c). Set up at open from the first source's config,
 * immutable after but for the model: loaded at open when that source's split
 * is before the freeze point, else at the first index that needs it (lock).
 */
struct finish {
    hapi_remote *r;
    int code;                     /* < 0: the config could not be used (why) */
    char why[512];
    pthread_mutex_t lock;         /* guards the three below */
    hapi_model *model;            /* NULL: not loaded yet, or it failed (load_code) */
    int load_code;                /* < 0: the model could not be used (load_why) */
    char load_why[512];
    char digest[33];
    char *model_dir;              /* owned */
    int crop;
    int freeze;                   /* a .feat is the output of stages [0, freeze) */
    int ndim;
    int64_t shape[HAPI_MAX_DIMS]; /* of stage freeze - 1's output */
    /* a .feat by dtype (fp32, fp16): its namespace, .npy header and row bytes */
    hapi_cache_namespace ns[2];
    char ns_hex[2][33];
    char header[2][HAPI_NPY_HEADER_MAX];
    size_t header_len[2], row_bytes[2];
    atomic_uint_fast64_t rows;    /* rows finished here */
};

struct hapi_remote {
    hapi_remote_config cfg;
    size_t nsources;
    struct remote_source *sources;
    uint64_t started_ns;

    pthread_mutex_t index_lock;
    pthread_cond_t index_cond;
    struct index_slot *slots[INDEX_BUCKETS];

    pthread_mutex_t fetch_lock;
    pthread_cond_t queue_cond;
    struct fetch *fetches;        /* every fetch not yet finished */
    atomic_uint_fast64_t passes;  /* chunks stored and passed, by every fetch */
    struct fetch *queue_head, *queue_tail; /* not yet started; readers' before the warm-up's */
    int stopping;
    size_t nthreads;
    pthread_t *threads;

    hapi_warmup *warm;            /* the warm-up's walker, root, counters and times */

    struct {
        atomic_uint_fast64_t reads, bytes, hits, misses, fetched_rows, waits, failed,
            stale, passthrough, cache_put_failures, spill_hits;
    } stats;
    atomic_int put_failing; /* the last put failed: logged once until one succeeds */
    pthread_mutex_t spill_lock;
    struct spill *spills;         /* oldest first */
    size_t spill_bytes;
    atomic_uint_fast64_t spill_retry_ns; /* when a spilled row was last offered the cache */
    char *hold_miss;              /* test hook HAPIFS_TEST_HOLD_MISS, read once: see hapi_remote__serving() */
    struct finish *finish;        /* features=freeze, else NULL */
};

/* remote-source.c */
void hapi_remote__root_put(struct root *rt);
void hapi_remote__source_failed(hapi_remote *r, int src, const char *path, int rc,
                                const char *what);
int hapi_remote__source_open(hapi_remote *r, int src, const char *path, int flags, uint64_t *gen);
void hapi_remote__refresh_size(int fd);
int hapi_remote__source_stat(hapi_remote *r, int src, const char *path, struct stat *st,
                             uint64_t *gen);
int hapi_remote__source_open_direct(hapi_remote *r, int src, const char *path, uint64_t *gen);
int hapi_remote__read_text(int fd, size_t max, char **text, size_t *len);
ssize_t hapi_remote__source_read_head(hapi_remote *r, int src, const char *path, char *buf,
                                      size_t len, uint64_t *gen);
int hapi_remote__serving(hapi_remote *r, int src, uint64_t gen);
int hapi_remote__missing_or_down(hapi_remote *r);
int hapi_remote__source_check(hapi_remote *r, int src, hapi_error *err);
int hapi_remote__source_usable(hapi_remote *r, int src);

/* remote-index.c */
void hapi_remote__index_put(struct dir_index *x);
int hapi_remote__hex_to_ns(const char *hex, hapi_cache_namespace *ns);
const struct index_entry *hapi_remote__index_find(const struct dir_index *x, const char *name,
                                                  size_t *row);
int hapi_remote__index_unchanged(hapi_remote *r, int src, const char *dir,
                                 const struct dir_index *kept);
void hapi_remote__index_expire(hapi_remote *r, int src, const char *dir);
int hapi_remote__index_get(hapi_remote *r, int src, const char *dir, struct dir_index **out);

/* remote.c */
char *hapi_remote__split_path(const char *path, const char **name);
uint64_t hapi_remote__feat_key(const hapi_cache_namespace *ns, const hapi_source_id *id);
int hapi_remote__find_image(hapi_remote *r, const char *dir, const char *name,
                            struct dir_index **x, const struct index_entry **e, size_t *row);

/* remote-fetch.c */
void hapi_remote__fetch_put_locked(struct fetch *f);
struct fetch *hapi_remote__fetch_new_locked(hapi_remote *r, struct dir_index *x, int warm);
void *hapi_remote__fetch_thread(void *arg);
void hapi_remote__spill_drop_all(hapi_remote *r);
int hapi_remote__spill_copy(hapi_remote *r, const struct dir_index *x, size_t row, char *dst,
                            size_t from, size_t to);
void hapi_remote__spill_retry(hapi_remote *r, struct dir_index *x, size_t row, const char *path,
                              const hapi_source_id *id);
int hapi_remote__fetch_wait(hapi_remote *r, struct dir_index *x, size_t row, const char *name,
                            const hapi_source_id *id, char *dst, size_t from, size_t to,
                            uint64_t *passes);

/* remote-finish.c */
int hapi_remote__finish_open(hapi_remote *r, const char *model_dir);
void hapi_remote__finish_close(struct finish *fin);
int hapi_remote__finish_keep(struct finish *fin, struct dir_index *x, hapi_error *err);
int hapi_remote__finish_rows(hapi_remote *r, const struct dir_index *x, const char *in, size_t n,
                             char *out, hapi_error *err);

/* remote-walk.c: the warm-up's walk and its wake (hapi_warmup_ops) */
void hapi_remote__warm_run(void *arg, const char *root, atomic_int *stop);
void hapi_remote__warm_wake(void *arg);

#endif

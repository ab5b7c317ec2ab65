/* cache.h — the feature store (LMDB and slab files): features keyed by (namespace, source path), checked against the source's identity. */
#ifndef HAPI_CACHE_H
#define HAPI_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "hapi.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * A namespace separates the features of different configurations: a 16-byte
 * XXH3-128 digest of (model file digest, split, dtype, preprocessing mode
 * and parameters). Keys are the namespace followed by the file's path
 * relative to the source root.
 */
#define HAPI_CACHE_NAMESPACE_SIZE 16
/*
 * Paths up to this length are stored in the key as they are (LMDB's default
 * key limit is 511 bytes). Longer paths are accepted too: their key holds a
 * prefix and a digest of the path, and the value holds the full path, so a
 * digest collision is a miss, never a wrong answer.
 */
#define HAPI_CACHE_PATH_MAX 480

typedef struct hapi_cache_namespace {
    uint8_t bytes[HAPI_CACHE_NAMESPACE_SIZE];
} hapi_cache_namespace;

/*
 * Computes a namespace. model_digest is 16 bytes; preprocess describes the
 * preprocessing fully (mode, sizes, mean, std) as text (NULL counts as "").
 * Pure function of a versioned canonical encoding of its inputs: the same on
 * every host and every run, and different when any input differs.
 */
void hapi_cache_namespace_make(const uint8_t model_digest[16], int split, int dtype,
                               const char *preprocess, hapi_cache_namespace *out);

/* Writes the namespace as 32 lowercase hex digits and a NUL to hex[33]. */
void hapi_cache_namespace_hex(const hapi_cache_namespace *ns, char hex[33]);

/* The identity of a source file: a change in any field makes its entry stale. */
typedef struct hapi_source_id {
    uint64_t size;
    int64_t mtime_ns;
    int64_t ctime_ns;
    uint64_t ino;
} hapi_source_id;

typedef struct hapi_cache hapi_cache;

typedef struct hapi_cache_options {
    uint64_t max_bytes;   /* bound on the store's size (the LMDB map, which the slab files
                             share); 0 = 1 GiB */
    int max_readers;      /* concurrent read transactions; 0 = 512 */
    int reset;            /* 1: replace a corrupt or foreign store by a fresh one */
} hapi_cache_options;

/*
 * Opens (creating if needed) the store in directory dir, which must exist
 * and be writable: LMDB's data.mdb and lock.mdb, and the slab files in
 * dir/slabs/ (features of 512 bytes or more, in fixed-size slots of a file
 * per size; LMDB keeps their index). Clears reader slots left by dead
 * processes. Safe to open
 * from several processes at once (LMDB is multi-process); one handle per
 * process, never across fork(). Processes sharing a store should give it
 * the same max_bytes: the map size persisted in the store only grows, and a
 * process adopts a larger one once another writes beyond its own map.
 *
 * A store of an older format is upgraded in place. With opt->reset, a
 * directory whose data.mdb is corrupt, foreign or of a newer format gets a
 * fresh, empty store: data.mdb is renamed to data.mdb.reset (replacing an
 * older one; delete it to reclaim the space) and lock.mdb is removed; the
 * slab files, which only data.mdb makes sense of, are emptied (as they are
 * whenever a new data.mdb is made). No other file is touched, and a store
 * that another process has open is never reset.
 * hapi_cache_stats.reset_at_open tells that it happened.
 *
 * Returns 0, -errno (directory unusable: the message says why),
 * HAPI_ECORRUPT (without reset: the directory holds a corrupt, foreign or
 * newer store; the message names the file and says "use cache_reset=1"),
 * HAPI_ECACHE. *out is NULL on failure; close with hapi_cache_close().
 */
int hapi_cache_open(const char *dir, const hapi_cache_options *opt,
                    hapi_cache **out, hapi_error *err);

/* Flushes and closes the store. Accepts NULL. No values may be held. */
void hapi_cache_close(hapi_cache *c);

/*
 * A looked-up value: data stays valid until hapi_cache_release(); do not
 * write to it. It points into the store's memory map (a small feature, kept
 * in LMDB: while held, it pins a read transaction, so release it promptly) or
 * into a buffer the lookup read a slab slot into (freed by the release).
 */
typedef struct hapi_cache_value {
    const void *data;
    size_t size;
    int miss;     /* after a miss, why: one of HAPI_CACHE_MISS_* (0 after a hit or an error) */
    void *txn_;   /* internal */
    void *buf_;   /* internal */
} hapi_cache_value;

/* Why a lookup missed (hapi_cache_value.miss); each has its counter in hapi_cache_stats. */
enum {
    HAPI_CACHE_MISS_ABSENT = 1, /* no entry for the path (never stored, evicted, removed) */
    HAPI_CACHE_MISS_STALE = 2,  /* an entry for another identity of the source: it changed */
    HAPI_CACHE_MISS_BAD = 3,    /* an entry that does not verify (format, length, checksum):
                                   worth a log line; the next put of the path replaces it */
    HAPI_CACHE_MISS_BUSY = 4    /* the store is being remapped, or another process grew it
                                   beyond this process's map (the next put adopts it) */
};

/*
 * Looks up the features of path in ns. An entry whose stored identity differs
 * from *id (stale), or whose header, length or checksum does not verify (bad),
 * is a miss. A slab entry's bytes are read into a buffer and checked there:
 * when they do not verify (the slot was reused since the lookup's snapshot,
 * or a crash or damage left other bytes) the entry is looked up again in a
 * fresh snapshot, a few times, before it counts as bad. So is any lookup while another process has grown the store
 * beyond this process's map (the next hapi_cache_put() adopts the new size).
 * A hit is noted in an in-memory access log (no write transaction, no disk
 * write) that the next write applies to the store's LRU order; when the log
 * is full the access is dropped (counted), so a long run of lookups without
 * puts should be punctuated by hapi_cache_flush_access().
 * Returns 1 (found: val filled, release it), 0 (miss: val empty but for
 * val->miss, nothing to release), HAPI_EINVAL (a NULL argument), HAPI_ECACHE
 * or HAPI_ECORRUPT (the store is damaged, e.g. MDB_CORRUPTED or MDB_PANIC:
 * treat as a miss and log; val empty). Never takes a write lock; costs one
 * pooled read transaction, and for a slab entry a pread() and a buffer. Thread-safe; a thread may hold several values at
 * once, and may release a value from another thread than the one that looked
 * it up.
 */
int hapi_cache_get(hapi_cache *c, const hapi_cache_namespace *ns, const char *path,
                   const hapi_source_id *id, hapi_cache_value *val);

/* Ends a lookup's hold on the store and empties *val. Accepts an empty value. */
void hapi_cache_release(hapi_cache *c, hapi_cache_value *val);

/* One entry to store. */
typedef struct hapi_cache_item {
    const char *path;
    hapi_source_id id;
    const void *data;
    size_t size;
} hapi_cache_item;

/*
 * Stores n entries of namespace ns in one write transaction, replacing older
 * ones: all of them or, on failure, none. Items are copied; the caller keeps
 * ownership of paths and data. The entries become the most recently used,
 * and the access log is applied first.
 *
 * A full store never fails a put: when the store would pass ~95% of its map
 * (LMDB's pages in use, the slab files, a reserve for LMDB to grow), or LMDB
 * reports MDB_MAP_FULL (free space split into runs too short for a multi-page
 * value can cause it), or a slab file could not grow without data.mdb and the
 * slab files passing the map, the least recently used entries of all
 * namespaces are evicted in batched write transactions down to ~85%, and the
 * put is retried (a bounded number of times, evicting more each time).
 *
 * A slab feature is written to its slot before the transaction commits, and
 * the slots of the values it replaces are freed only after: a process that
 * dies before the commit leaves the committed entries and their bytes intact.
 *
 * Returns 0, HAPI_EINVAL (a NULL path, NULL data with a size, a value over
 * 4 GiB), HAPI_ECACHE (the message says why: "too large" when the batch could
 * never fit in the map even empty; "cache full" when eviction could not make
 * room, which takes lookups held for the whole put, here or in another
 * process, pinning the pages eviction freed), HAPI_ECORRUPT (the store is
 * damaged). Thread-safe (writers are serialized). A put that must adopt a map
 * size grown by another process waits (up to seconds) for this process's
 * held values: don't call it while holding one.
 */
int hapi_cache_put(hapi_cache *c, const hapi_cache_namespace *ns,
                   const hapi_cache_item *items, size_t n, hapi_error *err);

/*
 * The bytes the store spends on one entry of size bytes of features under a
 * path of path_len bytes, as a put and eviction count them: the key, the
 * value's header, the leaf node or the run of overflow pages (features under
 * 512 bytes) or the slab reference and slot, and the LRU records. A lower
 * bound (leaf pages are never full). Thread-safe.
 */
uint64_t hapi_cache_entry_bytes(const hapi_cache *c, size_t path_len, size_t size);

/*
 * Applies the access log (the hits noted since the last write) to the LRU
 * order in one write transaction. Call it now and then (e.g. every second)
 * from a thread that holds no value, so that reads between puts count.
 * Returns the number of accesses applied (>= 0), or HAPI_EINVAL, HAPI_ECACHE,
 * HAPI_ECORRUPT (err says why; the log is kept for the next write).
 * Thread-safe (serialized with puts).
 */
int hapi_cache_flush_access(hapi_cache *c, hapi_error *err);

/*
 * Removes the entry of path in ns, if any: for a source that was deleted or
 * renamed. Returns 1 (removed), 0 (there was none), HAPI_EINVAL, HAPI_ECACHE,
 * HAPI_ECORRUPT (err says why). Thread-safe (serialized with puts). Values
 * already held stay valid until released. A deletion needs free pages too: in
 * a map full of pages that held lookups pin, it waits for them (up to 500 ms,
 * as a put does) before it fails with HAPI_ECACHE.
 */
int hapi_cache_evict_path(hapi_cache *c, const hapi_cache_namespace *ns, const char *path,
                          hapi_error *err);

/*
 * Removes every entry of namespace ns, or of all namespaces when ns is NULL
 * (the store's format marker and counters stay). A namespace is removed in
 * batched write transactions: a failure midway leaves it partly removed,
 * never inconsistent. Returns the number of entries removed (>= 0, capped at
 * INT32_MAX), or HAPI_EINVAL, HAPI_ECACHE, HAPI_ECORRUPT (err says why).
 * Thread-safe (serialized with puts). Values already held stay valid until
 * released. Removals are not counted as evictions. A full map is waited for as
 * by hapi_cache_evict_path().
 */
int hapi_cache_evict_all(hapi_cache *c, const hapi_cache_namespace *ns, hapi_error *err);

/*
 * Counters and sizes of the store. Lookup counters and evictions are this
 * handle's since hapi_cache_open(); evictions_total is persisted in the store
 * and counts every process's.
 */
typedef struct hapi_cache_stats {
    uint64_t entries;       /* all namespaces */
    uint64_t bytes_used;    /* the store's size: LMDB's high-water mark ((last page + 1) *
                               page size) and the slab files' (slots * slot size), free
                               pages and slots kept for reuse included; less bytes_free,
                               bounded by map_size; at most twice map_size (LMDB's file,
                               which never shrinks, can reach map_size on its own) */
    uint64_t map_size;      /* current bound */
    uint64_t bytes_free;    /* of bytes_used, the pages on LMDB's free list (reusable once
                               no lookup older than their release is held) and the free
                               slab slots (reusable by features of their size) */
    uint64_t hits;          /* lookups that found verified bytes */
    uint64_t misses;        /* lookups without an entry (HAPI_CACHE_MISS_ABSENT) */
    uint64_t stale;         /* ... with an entry for another identity (MISS_STALE) */
    uint64_t bad;           /* ... with an entry that did not verify (MISS_BAD) */
    uint64_t busy;          /* ... while the map was being adopted (MISS_BUSY) */
    uint64_t errors;        /* lookups that failed (HAPI_ECACHE, HAPI_ECORRUPT) */
    double hit_mean_us;     /* mean time of hapi_cache_get() for hits, microseconds */
    uint64_t evictions;     /* entries evicted for room by this handle */
    uint64_t evictions_total; /* by every process, since the store was created */
    uint64_t accesses_dropped; /* hits not recorded in the LRU order: the log was full */
    int reset_at_open;      /* 1: hapi_cache_open() replaced a corrupt or foreign store */
} hapi_cache_stats;

/*
 * Fills *st. Returns 0, HAPI_EINVAL, HAPI_ECACHE (e.g. the map is being
 * adopted: try after the next put) or HAPI_ECORRUPT. Thread-safe; costs a
 * read transaction and a walk of LMDB's free list (short).
 */
int hapi_cache_stats_get(hapi_cache *c, hapi_cache_stats *st);

/* What one namespace holds. */
typedef struct hapi_cache_namespace_stats {
    uint64_t entries;
    uint64_t bytes;         /* features plus a 64-byte header each (plus the path, for
                               paths over HAPI_CACHE_PATH_MAX), wherever they are stored */
} hapi_cache_namespace_stats;

/*
 * Counts the entries of ns and their bytes, on demand: one read transaction
 * and a walk of the namespace's range of keys (leaf pages only, never the
 * feature bytes): about 1 ms per 100,000 entries, measured. Returns 0, HAPI_EINVAL,
 * HAPI_ECACHE (the map is being adopted: try again), HAPI_ECORRUPT; *st is
 * zero on failure. Thread-safe.
 */
int hapi_cache_namespace_stats_get(hapi_cache *c, const hapi_cache_namespace *ns,
                                   hapi_cache_namespace_stats *st);

#ifdef __cplusplus
}
#endif

#endif

/* cache.h — the LMDB feature store: features keyed by (namespace, source path), checked against the source's identity. */
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
    uint64_t max_bytes;   /* bound on the store's size (the LMDB map); 0 = 1 GiB */
    int max_readers;      /* concurrent read transactions; 0 = 512 */
} hapi_cache_options;

/*
 * Opens (creating if needed) the store in directory dir, which must exist
 * and be writable. Clears reader slots left by dead processes. Safe to open
 * from several processes at once (LMDB is multi-process); one handle per
 * process, never across fork().
 * Returns 0, -errno (directory unusable: the message says why),
 * HAPI_ECORRUPT (the directory holds a corrupt or foreign file), HAPI_ECACHE.
 * *out is NULL on failure; close with hapi_cache_close().
 */
int hapi_cache_open(const char *dir, const hapi_cache_options *opt,
                    hapi_cache **out, hapi_error *err);

/* Flushes and closes the store. Accepts NULL. No values may be held. */
void hapi_cache_close(hapi_cache *c);

/*
 * A looked-up value: data points into the store's memory map and stays valid
 * until hapi_cache_release(); do not write to it. While held, it pins a read
 * transaction: release it promptly.
 */
typedef struct hapi_cache_value {
    const void *data;
    size_t size;
    void *txn_;   /* internal */
} hapi_cache_value;

/*
 * Looks up the features of path in ns. An entry whose stored identity differs
 * from *id, or whose header, length or checksum does not verify, is a miss.
 * So is any lookup while another process has grown the store beyond this
 * process's map (the next hapi_cache_put() adopts the new size).
 * Returns 1 (found: val filled, release it), 0 (miss: val empty, nothing to
 * release), HAPI_EINVAL (a NULL argument), HAPI_ECACHE or HAPI_ECORRUPT (val
 * empty). Never takes a write lock; costs one pooled read transaction.
 * Thread-safe; a thread may hold several values at once, and may release a
 * value from another thread than the one that looked it up.
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
 * ownership of paths and data.
 * Returns 0, HAPI_EINVAL (a NULL path, NULL data with a size, a value over
 * 4 GiB), HAPI_ECACHE (the message says why: "cache full" when the store
 * reached max_bytes). Thread-safe (writers are serialized). A put that must
 * adopt a map size grown by another process waits (up to seconds) for this
 * process's held values: don't call it while holding one.
 */
int hapi_cache_put(hapi_cache *c, const hapi_cache_namespace *ns,
                   const hapi_cache_item *items, size_t n, hapi_error *err);

/* Counters and sizes of the store. */
typedef struct hapi_cache_stats {
    uint64_t entries;       /* all namespaces */
    uint64_t bytes_used;    /* the map's high-water mark: (last page + 1) * page size,
                               free pages kept for reuse included; bounded by map_size */
    uint64_t map_size;      /* current bound */
} hapi_cache_stats;

/* Fills *st. Returns 0, HAPI_EINVAL or HAPI_ECACHE. Thread-safe. */
int hapi_cache_stats_get(hapi_cache *c, hapi_cache_stats *st);

#ifdef __cplusplus
}
#endif

#endif

/* cache-int.h — internals of the feature store that tests and the benchmark reach into; not part of the API. */
#ifndef HAPI_CACHE_INT_H
#define HAPI_CACHE_INT_H

#include <lmdb.h>

#include "cache.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Stored value layout, all integers little-endian:
 *   0  u32 magic (HAPI_CACHE__MAGIC)     4  u16 format version   6  u16 flags
 *   8  u32 data length                  12  u32 stored path length (hashed keys only, else 0)
 *  16  u64 source size                  24  i64 source mtime_ns
 *  32  i64 source ctime_ns              40  u64 source inode
 *  48  u64 wall-clock time of the put (ns), for inspection (the LRU order lives
 *      in its own databases, see below)
 *  56  u64 checksum: XXH3-64 of the data, seeded with XXH3-64 of the header
 *      (checksum field zeroed) mixed with XXH3-64 of the stored path
 *  64  the full path (hashed keys only), zero-padded to a multiple of 16
 *  ..  the feature bytes (inline values), or a slab reference (flag SLAB):
 *      u32 slot size, u32 zero, u64 slot number, u64 the entry's LRU stamp
 *      (not in the checksum: each access that the LRU order applies changes it)
 *
 * A slab value's feature bytes are in the slab file of its slot size
 * (HAPI_CACHE__SLAB_DIR/<slot size> in the store's directory) at slot number
 * times slot size; its checksum, computed as for an inline value, is checked
 * after the read, so a slot that was freed and reused under a lookup, or that
 * a crash left unwritten, is a miss, never wrong bytes.
 */
#define HAPI_CACHE__MAGIC 0x46504148u /* "HAPF" in file order */
#define HAPI_CACHE__VERSION 1
#define HAPI_CACHE__HEADER_SIZE 64
#define HAPI_CACHE__FLAG_HASHED_KEY 0x1
#define HAPI_CACHE__FLAG_SLAB 0x2
#define HAPI_CACHE__SLAB_REF_SIZE 24
#define HAPI_CACHE__SLAB_DIR "slabs"
/* Features of at least this many bytes go to a slab; smaller ones cost less inline. */
#define HAPI_CACHE__SLAB_MIN_SIZE 512
/* Slot sizes are the feature size rounded up to this. */
#define HAPI_CACHE__SLOT_ALIGN 64

/*
 * Slot bookkeeping, in LMDB and so in the same write transactions as the
 * entries: "meta" holds per slot size a record "slab" + u32 big-endian slot
 * size -> u64 slots in the file (the high-water mark), u64 of them free;
 * "slots" maps u32 big-endian slot size + u64 big-endian slot number to
 * nothing, one record per free slot (lowest first is reused first).
 */

/*
 * Keys: the namespace, then the path when it is at most HAPI_CACHE_PATH_MAX
 * bytes; otherwise the namespace, the path's first HAPI_CACHE__PREFIX_SIZE
 * bytes, a NUL (never in a real path, so the two forms cannot collide) and the
 * XXH3-128 of the whole path. Both forms fit HAPI_CACHE__KEY_MAX bytes.
 */
#define HAPI_CACHE__PREFIX_SIZE (HAPI_CACHE_PATH_MAX - 1 - 16)
#define HAPI_CACHE__KEY_MAX (HAPI_CACHE_NAMESPACE_SIZE + HAPI_CACHE_PATH_MAX)

/*
 * The LRU order: "lru" maps an access stamp (u64 big-endian, so byte order is
 * numeric order) to a feature key. An entry's current stamp, which an access
 * needs to delete the entry's older "lru" record, is in its value for a slab
 * entry, and in "stamps" (feature key -> stamp) for an inline one, whose
 * value may span overflow pages that a rewrite would copy. Every entry of
 * "features" has exactly one "lru" record, and an inline one a "stamps"
 * record, written in the same transactions. Stamps grow: a write transaction
 * stamps from one more than the newest "lru" key.
 */
#define HAPI_CACHE__STAMP_SIZE 8

/* Builds the key of path in ns into key; returns its length. */
size_t hapi_cache__key_make(const hapi_cache_namespace *ns, const char *path,
                            uint8_t key[HAPI_CACHE__KEY_MAX]);

/* The store's environment and its features database, for tests to write raw values. */
MDB_env *hapi_cache__env(hapi_cache *c);
MDB_dbi hapi_cache__features_dbi(hapi_cache *c);

/* The number of reader slots of dead processes that hapi_cache_open() cleared. */
int hapi_cache__stale_readers_cleared(const hapi_cache *c);

/*
 * The slab slot of the entry of path in ns: returns 1 and fills *slot_size and
 * *slot for a slab entry, 0 for an inline or absent one, or an LMDB error.
 */
int hapi_cache__slot_of(hapi_cache *c, const hapi_cache_namespace *ns, const char *path,
                        uint32_t *slot_size, uint64_t *slot);

/*
 * With on, the next hapi_cache_put() of this handle ends the process with
 * _exit(86) after writing its slab bytes and index, just before the commit:
 * how tests crash a writer at the worst moment.
 */
void hapi_cache__crash_before_commit(hapi_cache *c, int on);

/* Time spent evicting (the batched eviction transactions) since open, in ns. */
uint64_t hapi_cache__evict_ns(hapi_cache *c);

/*
 * Checks that "features", "lru" and "stamps" agree (as many lru records as
 * entries, as many stamps as inline ones; each lru record's key has its
 * feature, whose stamp is the record's), and that the slots add up:
 * per slot size, the slab entries' slots (each below the high-water mark, none
 * free, none shared) and the free ones make up the high-water mark. Returns
 * the number of entries, or -1 with a description in msg.
 */
long hapi_cache__check_index(hapi_cache *c, char *msg, size_t msg_size);

#ifdef __cplusplus
}
#endif

#endif

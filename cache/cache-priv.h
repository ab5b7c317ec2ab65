/* cache-priv.h — what the files of cache/ share: the handle, on-disk constants, small helpers; not for users or tests. */
#ifndef HAPI_CACHE_PRIV_H
#define HAPI_CACHE_PRIV_H

#include "cache.h"
#include "cache-int.h"

#include <endian.h>
#include <lmdb.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>

/* The persisted count of evictions, a u64 in "meta". */
#define EVICTIONS_KEY "evictions"

/*
 * Named databases: "meta" (the format marker, the eviction count, the slab
 * high-water marks), "features" (the entries), "lru" and "stamps" (the LRU
 * order), "slots" (the free slab slots; see cache-int.h), and room for more.
 * A hit is noted in memory and the next write moves the entry's small "lru"
 * record to the newest stamp; an inline value is never rewritten for it
 * (that would copy its overflow pages), a slab entry's small one is.
 * Keys begin with the namespace, so the entries of one configuration are
 * contiguous and can be counted or dropped as a range.
 */
#define MAX_DBS 8

/*
 * Slab files: features of HAPI_CACHE__SLAB_MIN_SIZE bytes or more live in
 * fixed-size slots of a file per slot size, LMDB keeping only the entry's
 * header and slot. A value in LMDB pays a leaf node share or a run of whole
 * overflow pages (a 4,224-byte feature took two 4 KiB pages); a slot pays
 * nothing beyond rounding to HAPI_CACHE__SLOT_ALIGN. At most SLAB_CLASSES slot
 * sizes get a file; a feature of yet another size is stored inline.
 */
#define SLAB_CLASSES 32

/*
 * Eviction: a put that would take the store past HIGH_PERCENT of its map
 * first evicts the least recently used entries down to LOW_PERCENT, so that
 * a burst of puts pays for eviction once per ~10% of the map, and the
 * eviction transactions themselves (which need pages to copy the B-tree
 * pages they change) always find room. EVICT_BATCH entries per write
 * transaction keep each one short: lookups and other processes' puts
 * interleave.
 */
#define HIGH_PERCENT 95
#define LOW_PERCENT 85

/*
 * Pages freed by a write stay unusable while a lookup that began before it
 * (in any process) is held, and for the next write in any case. A store at
 * its limit can thus be full for an instant although eviction freed room:
 * writes then wait a little (1 ms more each time, up to 10 ms a wait) for
 * lookups to end, rather than fail, for up to FULL_WAIT_MS in all: a reader
 * thread descheduled on a loaded machine can hold its snapshot for tens of ms.
 */
#define FULL_WAIT_MS 500

/*
 * The access log: hits append (u16 key length, key) records under
 * access_lock, never touching LMDB; a writer swaps the buffer for its spare
 * and applies the records in its write transaction. 256 KiB holds ~4,000
 * typical keys between two writes; beyond that hits are dropped (counted).
 */
#define ACCESS_LOG_BYTES (256u * 1024)

struct hapi_cache {
    MDB_env *env;
    MDB_dbi meta_dbi;
    MDB_dbi features_dbi;
    MDB_dbi lru_dbi;
    MDB_dbi stamps_dbi;
    MDB_dbi slots_dbi;
    char *dir;
    int stale_readers_cleared;
    int reset_at_open;
    unsigned psize;    /* LMDB page size */
    unsigned node_max; /* the largest leaf node LMDB keeps in its page: larger values overflow */

    /*
     * Read-transaction pool and the count of lookups in flight, under
     * pool_lock. With MDB_NOTLS a reset transaction keeps its reader slot
     * and can be renewed by any thread, which saves a slot search and the
     * reader-table mutex on every lookup. `active` counts lookups whose
     * transaction may point into the map (from take to release): adopting a
     * new map size unmaps the old map, so it waits for `active` to reach zero
     * while `remapping` turns new lookups into misses.
     */
    pthread_mutex_t pool_lock;
    pthread_cond_t idle;
    MDB_txn **pool;
    int pool_count;
    int pool_max;
    int active;
    bool remapping;

    /*
     * Serializes writes in this process. LMDB serializes writers already;
     * this lock also makes sure no write transaction of ours is open while a
     * put adopts a new map size, and guards the drained access log.
     */
    pthread_mutex_t write_lock;

    /* The access log being filled by hits (under access_lock), and the one being applied (under write_lock). */
    pthread_mutex_t access_lock;
    uint8_t *log;
    size_t log_used;
    uint8_t *drain;
    size_t drain_used;
    size_t drain_off;  /* where the next write applies the drained log from */
    size_t drain_next; /* where it stops, once committed (drain_done) */

    /* Evictions not yet added to the persisted count (under write_lock): its write failed. */
    uint64_t evictions_unpersisted;

    /*
     * The slab files opened so far, one per slot size: appended under
     * slab_lock, read without it (slab_count is published with release order
     * once the entry is filled); closed only by hapi_cache_close().
     */
    pthread_mutex_t slab_lock;
    struct slab {
        uint32_t slot_size;
        int fd;
    } slabs[SLAB_CLASSES];
    _Atomic int slab_count;
    char *slab_dir;
    atomic_int crash_before_commit; /* tests: see hapi_cache__crash_before_commit() */
    bool trim_pending; /* a commit lowered a high-water mark: see slab_trim() (under write_lock) */
    uint64_t lmdb_free_pages; /* LMDB's free list as the current put began (under write_lock) */

    /* Counters of this handle, relaxed atomics: lookups update them from any thread. */
    _Atomic uint64_t hits, misses, stale, bad, busy, errors, hit_ns;
    _Atomic uint64_t evictions, accesses_dropped, evict_ns;
};

/* ---- little-endian encoding, counters ---- */

static inline void put_le16(uint8_t *p, uint16_t v) { v = htole16(v); memcpy(p, &v, 2); }
static inline void put_le32(uint8_t *p, uint32_t v) { v = htole32(v); memcpy(p, &v, 4); }
static inline void put_le64(uint8_t *p, uint64_t v) { v = htole64(v); memcpy(p, &v, 8); }
static inline uint16_t get_le16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return le16toh(v); }
static inline uint32_t get_le32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return le32toh(v); }
static inline uint64_t get_le64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return le64toh(v); }
/* Stamps are big-endian: LMDB compares keys as bytes, so byte order is numeric order. */
static inline void put_be64(uint8_t *p, uint64_t v) { v = htobe64(v); memcpy(p, &v, 8); }
static inline uint64_t get_be64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return be64toh(v); }

static inline void count(_Atomic uint64_t *counter, uint64_t n)
{
    atomic_fetch_add_explicit(counter, n, memory_order_relaxed);
}

static inline uint64_t counter_get(_Atomic uint64_t *counter)
{
    return atomic_load_explicit(counter, memory_order_relaxed);
}

/* ---- values and slabs ---- */

static inline size_t pad16(size_t n) { return (n + 15) & ~(size_t)15; }

/* How a stored value compares with a lookup; CHECK_SLAB: it verifies so far, its bytes are in a slab. */
enum check { CHECK_OK, CHECK_ABSENT, CHECK_STALE, CHECK_BAD, CHECK_SLAB };

/* Where a slab value's bytes are, and the entry's LRU stamp. */
struct slab_ref {
    uint32_t slot_size;
    uint64_t slot;
    uint64_t stamp;
};

/* The slot size of a feature of size bytes. */
static inline uint32_t slot_size_of(size_t size)
{
    return (uint32_t)((size + HAPI_CACHE__SLOT_ALIGN - 1) & ~(size_t)(HAPI_CACHE__SLOT_ALIGN - 1));
}

/* Whether a feature of size bytes belongs in a slab (if a slab of its slot size can be had). */
static inline bool slab_sized(size_t size)
{
    return size >= HAPI_CACHE__SLAB_MIN_SIZE && size <= UINT32_MAX - HAPI_CACHE__SLOT_ALIGN;
}

/* A slot size's record in "meta": its high-water mark and how many of those slots are free. */
struct slab_class {
    uint64_t high;
    uint64_t free;
};

/* The bytes of all slab files up to their high-water marks, and of their free slots. */
struct slab_totals {
    uint64_t bytes;
    uint64_t free_bytes;
};

/* ---- functions shared between the files ---- */

/* value.c: keys and stored values (see the comments there) */
uint64_t hapi_cache__value_checksum(const uint8_t header[HAPI_CACHE__HEADER_SIZE],
                                    const void *path, size_t path_len,
                                    const void *data, size_t data_len);
void hapi_cache__header_encode(uint8_t h[HAPI_CACHE__HEADER_SIZE], const hapi_source_id *id,
                               uint32_t data_len, uint32_t path_len, bool slab, uint64_t stored_ns);
bool hapi_cache__slab_ref_of(const MDB_val *v, struct slab_ref *ref);
enum check hapi_cache__value_check(const MDB_val *v, const hapi_source_id *id, const char *path,
                                   bool hashed, const void **data, size_t *size, struct slab_ref *ref);

/* txn.c: transactions (see the comments there) */
int hapi_cache__read_begin(hapi_cache *c, MDB_txn **out);
void hapi_cache__read_end(hapi_cache *c, MDB_txn *txn);
int hapi_cache__lmdb_to_code(int rc);
int hapi_cache__write_begin(hapi_cache *c, MDB_txn **txn, hapi_error *err);

/* sizes.c: sizes (see the comments there) */
uint64_t hapi_cache__entry_bytes(const hapi_cache *c, size_t key_len, size_t value_size,
                                 int lru_records);
int hapi_cache__count_free_pages(MDB_txn *rtxn, uint64_t *out);
void hapi_cache__lmdb_free_pages_update(hapi_cache *c);
uint64_t hapi_cache__lmdb_reserve(const hapi_cache *c, uint64_t map_bytes);

/* slab.c: slab files (see the comments there) */
int hapi_cache__slab_fd(hapi_cache *c, uint32_t slot_size, bool create);
int hapi_cache__slab_read(hapi_cache *c, const MDB_val *v, const struct slab_ref *ref, size_t size,
                          uint8_t **out);
int hapi_cache__write_full(int fd, const void *data, size_t size, off_t offset);
void hapi_cache__slab_trim(hapi_cache *c, MDB_txn *txn);
int hapi_cache__slab_files_empty(hapi_cache *c);

/* slots.c: slab slots (see the comments there) */
int hapi_cache__class_get(hapi_cache *c, MDB_txn *txn, uint32_t slot_size, struct slab_class *sc);
int hapi_cache__class_each(hapi_cache *c, MDB_txn *txn,
                           int (*fn)(uint32_t slot_size, const struct slab_class *sc, void *arg),
                           void *arg);
int hapi_cache__slab_totals(hapi_cache *c, MDB_txn *txn, struct slab_totals *t);
int hapi_cache__slot_alloc(hapi_cache *c, MDB_txn *txn, uint32_t slot_size, uint64_t *slot);
int hapi_cache__slot_free(hapi_cache *c, MDB_txn *txn, const struct slab_ref *ref);
int hapi_cache__slab_clear(hapi_cache *c, MDB_txn *txn);

/* lru.c: the LRU order (see the comments there) */
void hapi_cache__note_access(hapi_cache *c, const uint8_t *key, size_t len);
void hapi_cache__drain_take(hapi_cache *c);
int hapi_cache__lru_append(hapi_cache *c, MDB_txn *txn, MDB_val *k, uint64_t *stamp,
                           bool in_stamps);
int hapi_cache__stamp_first(hapi_cache *c, MDB_txn *txn, uint64_t *stamp);
int hapi_cache__touch(hapi_cache *c, MDB_txn *txn, const void *key, size_t key_len,
                      uint64_t *stamp, bool must_exist, uint64_t recent_from);
int hapi_cache__unlink_lru(hapi_cache *c, MDB_txn *txn, const void *key, size_t key_len,
                           const struct slab_ref *ref);
int hapi_cache__apply_accesses(hapi_cache *c, MDB_txn *txn, uint64_t *stamp, uint64_t *applied,
                               size_t max);
void hapi_cache__drain_done(hapi_cache *c);

/* format.c: the store's format (see the comments there) */
int hapi_cache__databases_init(hapi_cache *c, hapi_error *err);

/* evict.c: eviction (see the comments there) */
int hapi_cache__eviction_goal(hapi_cache *c, uint64_t need, uint64_t *goal);
int hapi_cache__persist_evictions(hapi_cache *c, bool *full, hapi_error *err);
void hapi_cache__full_wait(int attempt);
/* A write's attempts at a full map: whether it unlocked the last transaction's pages, its waits. */
struct full_state {
    bool unlocked;
    int waits;
    uint64_t from;
};
int hapi_cache__full_again(hapi_cache *c, struct full_state *f, hapi_error *err);
int hapi_cache__evict(hapi_cache *c, uint64_t goal, uint64_t *evicted, hapi_error *err);

#endif

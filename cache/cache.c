/* cache.c — the feature store: namespaces, keys, checked values in LMDB or slab files, pooled read transactions, batched puts, LRU eviction. */
#include "cache.h"
#include "cache-int.h"

#include <dirent.h>
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <lmdb.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define XXH_STATIC_LINKING_ONLY /* for XXH3_state_t on the stack: no allocation, no failure */
#include <xxhash.h>

/* Version of the namespace encoding: bump it when the encoding changes, so old entries become unreachable. */
#define NAMESPACE_ENCODING_VERSION 1

/* The store's own marker, in the "meta" database under the key "format". */
#define FORMAT_KEY "format"
#define FORMAT_MAGIC "hapifs-cache" /* 12 bytes, then a u32 format version */
#define FORMAT_MAGIC_SIZE 12
#define FORMAT_RECORD_SIZE (FORMAT_MAGIC_SIZE + 4)
/*
 * 2 added the "lru" and "stamps" databases; a version-1 store is indexed on
 * open. 3 added the slab files and the "slots" database; the inline values of
 * a version-2 store are still read as they are, and leave by eviction.
 */
#define FORMAT_VERSION 3

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
#define SLAB_KEY "slab" /* then the u32 big-endian slot size, in "meta" */
#define SLAB_KEY_SIZE 8
#define SLOT_KEY_SIZE 12
/*
 * A slab read whose checksum fails is looked up again in a fresh snapshot,
 * this many times: the entry was most likely replaced or evicted, and its
 * slot reused, between the index read and the slab read.
 */
#define SLAB_READ_RETRIES 3

#define DEFAULT_MAX_BYTES (UINT64_C(1) << 30)
#define DEFAULT_MAX_READERS 512

/* Pooled read transactions keep their reader slot; leave most slots to bursts and other processes. */
#define POOL_MAX 64

/* How long a put waits for outstanding lookups to end before it adopts another process's map size. */
#define REMAP_WAIT_NS (UINT64_C(5) * 1000000000u)

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
 * Pages kept free beyond the high mark whatever the map's size: eviction is
 * itself a write (copy-on-write of the touched leaf and branch pages, the
 * free list), and pages freed by the last two transactions are not reusable
 * yet. With 5% of a small map (13 pages of 1 MiB) a full store could not even
 * evict, and froze: every later put was refused.
 */
#define RESERVE_PAGES 64 /* or an eighth of a smaller map */

/* The high and low marks of a map of map pages, in pages. */
static void marks(uint64_t map, uint64_t *high, uint64_t *low)
{
    uint64_t h = map * HIGH_PERCENT / 100;
    uint64_t reserve = map / 8 < RESERVE_PAGES ? map / 8 : RESERVE_PAGES;
    if (map - h < reserve)
        h = map - reserve;
    uint64_t gap = map * (HIGH_PERCENT - LOW_PERCENT) / 100;
    *high = h;
    *low = h > gap ? h - gap : 0;
}
#define EVICT_BATCH 512
/* Attempts of a put after MDB_MAP_FULL, each after evicting more than the last. */
#define PUT_RETRIES 12
/*
 * Pages freed by a write stay unusable while a lookup that began before it
 * (in any process) is held, and for the next write in any case. A store at
 * its limit can thus be full for an instant although eviction freed room:
 * writes then wait a little (1 ms more each time, up to 10 ms a wait) for
 * lookups to end, rather than fail, for up to FULL_WAIT_MS in all: a reader
 * thread descheduled on a loaded machine can hold its snapshot for tens of ms.
 */
#define FULL_WAIT_MS 500
/* Entries removed per write transaction by hapi_cache_evict_all(). */
#define REMOVE_BATCH 4096

/*
 * The access log: hits append (u16 key length, key) records under
 * access_lock, never touching LMDB; a writer swaps the buffer for its spare
 * and applies the records in its write transaction. 256 KiB holds ~4,000
 * typical keys between two writes; beyond that hits are dropped (counted).
 */
#define ACCESS_LOG_BYTES (256u * 1024)
/*
 * Accesses applied per write transaction by hapi_cache_flush_access(). Each
 * access copies a leaf page or two of the LRU index, and pages a write frees
 * are reused only two writes later: the file grows by what about two writes
 * copy. Measured with 100,000 entries of 1,152 bytes and 400,000 random hits
 * flushed every 2,000: the store grew by 34 MB with the whole log in one
 * write, 14 MB with 256 accesses a write, 10.5 MB with 64.
 */
#define FLUSH_BATCH 64
/*
 * An access to an entry among the most recently used 1/RECENT_SHARE of the
 * store moves nothing: every stamp handed out since its own moved one entry
 * in front of it, so an entry stamped within the last entries/RECENT_SHARE
 * stamps is among that many newest, far from eviction (which takes the
 * oldest tenth), and its next access once it falls behind moves it
 * (memcached's bump interval, in stamps instead of seconds). Random hits
 * then rewrite half the LRU records and leaves: measured with 100,000
 * entries of 1,152 bytes and 400,000 random hits (tests/cache-bench), the
 * store grew by 5.6 MB instead of 10.7 (1.27x the features instead of 1.31x).
 */
#define RECENT_SHARE 2

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

/* ---- little-endian encoding ---- */

static void put_le16(uint8_t *p, uint16_t v) { v = htole16(v); memcpy(p, &v, 2); }
static void put_le32(uint8_t *p, uint32_t v) { v = htole32(v); memcpy(p, &v, 4); }
static void put_le64(uint8_t *p, uint64_t v) { v = htole64(v); memcpy(p, &v, 8); }
static uint16_t get_le16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return le16toh(v); }
static uint32_t get_le32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return le32toh(v); }
static uint64_t get_le64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return le64toh(v); }
/* Stamps are big-endian: LMDB compares keys as bytes, so byte order is numeric order. */
static void put_be64(uint8_t *p, uint64_t v) { v = htobe64(v); memcpy(p, &v, 8); }
static uint64_t get_be64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return be64toh(v); }

static void count(_Atomic uint64_t *counter, uint64_t n)
{
    atomic_fetch_add_explicit(counter, n, memory_order_relaxed);
}

static uint64_t counter_get(_Atomic uint64_t *counter)
{
    return atomic_load_explicit(counter, memory_order_relaxed);
}

/* ---- namespaces ---- */

/*
 * The digest covers a canonical byte string, so it does not depend on struct
 * layout or on how the caller spelled numbers: "hapifs-ns", the encoding
 * version, the 16 model-digest bytes, split and dtype as little-endian 32-bit
 * integers, the preprocess text's length (64-bit) and its bytes. The length
 * prefix keeps the text from running into any field added later.
 */
void hapi_cache_namespace_make(const uint8_t model_digest[16], int split, int dtype,
                               const char *preprocess, hapi_cache_namespace *out)
{
    static const uint8_t zero_digest[16];
    const char *text = preprocess ? preprocess : "";
    size_t text_len = strlen(text);
    uint8_t fixed[10 + 4 + 16 + 4 + 4 + 8];
    uint8_t *p = fixed;
    XXH3_state_t state;
    XXH128_hash_t h;
    XXH128_canonical_t canon;

    memcpy(p, "hapifs-ns", 10); /* with its NUL */
    p += 10;
    put_le32(p, NAMESPACE_ENCODING_VERSION);
    p += 4;
    memcpy(p, model_digest ? model_digest : zero_digest, 16);
    p += 16;
    put_le32(p, (uint32_t)split);
    p += 4;
    put_le32(p, (uint32_t)dtype);
    p += 4;
    put_le64(p, (uint64_t)text_len);

    /* A state on the stack needs no XXH3_createState(), which could fail in a void function. */
    XXH3_INITSTATE(&state);
    XXH3_128bits_reset(&state);
    XXH3_128bits_update(&state, fixed, sizeof(fixed));
    XXH3_128bits_update(&state, text, text_len);
    h = XXH3_128bits_digest(&state);
    /* The canonical (big-endian) form makes the bytes the same on every host. */
    XXH128_canonicalFromHash(&canon, h);
    memcpy(out->bytes, canon.digest, HAPI_CACHE_NAMESPACE_SIZE);
}

void hapi_cache_namespace_hex(const hapi_cache_namespace *ns, char hex[33])
{
    hapi_hex(ns->bytes, HAPI_CACHE_NAMESPACE_SIZE, hex);
}

/* ---- keys and values ---- */

size_t hapi_cache__key_make(const hapi_cache_namespace *ns, const char *path,
                            uint8_t key[HAPI_CACHE__KEY_MAX])
{
    size_t len = strlen(path);
    memcpy(key, ns->bytes, HAPI_CACHE_NAMESPACE_SIZE);
    if (len <= HAPI_CACHE_PATH_MAX) {
        memcpy(key + HAPI_CACHE_NAMESPACE_SIZE, path, len);
        return HAPI_CACHE_NAMESPACE_SIZE + len;
    }
    /*
     * Keep a long prefix readable and ordered like the path (entries of one
     * directory stay near each other), then the digest of the whole path. The
     * value stores the full path: a digest collision is then a miss, not a
     * wrong answer.
     */
    uint8_t *p = key + HAPI_CACHE_NAMESPACE_SIZE;
    XXH128_canonical_t canon;
    memcpy(p, path, HAPI_CACHE__PREFIX_SIZE);
    p += HAPI_CACHE__PREFIX_SIZE;
    *p++ = '\0';
    XXH128_canonicalFromHash(&canon, XXH3_128bits(path, len));
    memcpy(p, canon.digest, 16);
    return HAPI_CACHE__KEY_MAX;
}

static size_t pad16(size_t n) { return (n + 15) & ~(size_t)15; }

/* The checksum of a value: header (checksum field zero) and stored path seed the hash of the data. */
static uint64_t value_checksum(const uint8_t header[HAPI_CACHE__HEADER_SIZE],
                               const void *path, size_t path_len,
                               const void *data, size_t data_len)
{
    uint8_t h[HAPI_CACHE__HEADER_SIZE];
    memcpy(h, header, sizeof(h));
    memset(h + 56, 0, 8);
    uint64_t seed = XXH3_64bits(h, sizeof(h));
    if (path_len)
        seed ^= XXH3_64bits(path, path_len) * UINT64_C(0x9E3779B97F4A7C15);
    return XXH3_64bits_withSeed(data, data_len, seed);
}

static void header_encode(uint8_t h[HAPI_CACHE__HEADER_SIZE], const hapi_source_id *id,
                          uint32_t data_len, uint32_t path_len, bool slab, uint64_t stored_ns)
{
    put_le32(h + 0, HAPI_CACHE__MAGIC);
    put_le16(h + 4, HAPI_CACHE__VERSION);
    put_le16(h + 6, (uint16_t)((path_len ? HAPI_CACHE__FLAG_HASHED_KEY : 0) |
                               (slab ? HAPI_CACHE__FLAG_SLAB : 0)));
    put_le32(h + 8, data_len);
    put_le32(h + 12, path_len);
    put_le64(h + 16, id->size);
    put_le64(h + 24, (uint64_t)id->mtime_ns);
    put_le64(h + 32, (uint64_t)id->ctime_ns);
    put_le64(h + 40, id->ino);
    put_le64(h + 48, stored_ns);
    put_le64(h + 56, 0);
}

/* How a stored value compares with a lookup; CHECK_SLAB: it verifies so far, its bytes are in a slab. */
enum check { CHECK_OK, CHECK_ABSENT, CHECK_STALE, CHECK_BAD, CHECK_SLAB };

/* Where a slab value's bytes are, and the entry's LRU stamp. */
struct slab_ref {
    uint32_t slot_size;
    uint64_t slot;
    uint64_t stamp;
};

/* The slot size of a feature of size bytes. */
static uint32_t slot_size_of(size_t size)
{
    return (uint32_t)((size + HAPI_CACHE__SLOT_ALIGN - 1) & ~(size_t)(HAPI_CACHE__SLOT_ALIGN - 1));
}

/* Whether a feature of size bytes belongs in a slab (if a slab of its slot size can be had). */
static bool slab_sized(size_t size)
{
    return size >= HAPI_CACHE__SLAB_MIN_SIZE && size <= UINT32_MAX - HAPI_CACHE__SLOT_ALIGN;
}

/*
 * The slab reference of a stored value, copied out (v may point into a page
 * the caller is about to change). Returns false for an inline value or one
 * whose reference does not parse: such a value has no slot to free.
 */
static bool slab_ref_of(const MDB_val *v, struct slab_ref *ref)
{
    const uint8_t *p = v->mv_data;
    if (v->mv_size < HAPI_CACHE__HEADER_SIZE + HAPI_CACHE__SLAB_REF_SIZE ||
        get_le32(p) != HAPI_CACHE__MAGIC || !(get_le16(p + 6) & HAPI_CACHE__FLAG_SLAB))
        return false;
    const uint8_t *r = p + v->mv_size - HAPI_CACHE__SLAB_REF_SIZE;
    ref->slot_size = get_le32(r);
    ref->slot = get_le64(r + 8);
    ref->stamp = get_le64(r + 16);
    uint32_t data_len = get_le32(p + 8);
    return ref->slot_size != 0 && slab_sized(data_len) && ref->slot_size == slot_size_of(data_len) &&
           ref->slot <= (uint64_t)INT64_MAX / ref->slot_size - 1;
}

/*
 * Checks a stored value against the lookup: format, identity, the full path
 * for hashed keys, lengths, checksum. On success points *data and *size at the
 * feature bytes inside v; for a slab value, fills *ref and *size and returns
 * CHECK_SLAB, the checksum left to slab_read(). A value in our format for another identity of the
 * source is stale; one for another path (a digest collision of a hashed key)
 * is absent; anything that does not verify is bad. The caller treats all
 * three as misses, and the next put of the path replaces the entry.
 */
static enum check value_check(const MDB_val *v, const hapi_source_id *id, const char *path,
                              bool hashed, const void **data, size_t *size, struct slab_ref *ref)
{
    const uint8_t *p = v->mv_data;
    if (v->mv_size < HAPI_CACHE__HEADER_SIZE)
        return CHECK_BAD;
    if (get_le32(p + 0) != HAPI_CACHE__MAGIC || get_le16(p + 4) != HAPI_CACHE__VERSION)
        return CHECK_BAD;
    uint16_t flags = get_le16(p + 6);
    uint32_t data_len = get_le32(p + 8);
    uint32_t path_len = get_le32(p + 12);
    if (get_le64(p + 16) != id->size || (int64_t)get_le64(p + 24) != id->mtime_ns ||
        (int64_t)get_le64(p + 32) != id->ctime_ns || get_le64(p + 40) != id->ino)
        return CHECK_STALE;
    if (hashed != ((flags & HAPI_CACHE__FLAG_HASHED_KEY) != 0))
        return CHECK_BAD;
    if (hashed) {
        size_t len = strlen(path);
        if (v->mv_size < HAPI_CACHE__HEADER_SIZE + (size_t)path_len)
            return CHECK_BAD;
        if (path_len != len || memcmp(p + HAPI_CACHE__HEADER_SIZE, path, len) != 0)
            return CHECK_ABSENT;
    } else if (path_len != 0) {
        return CHECK_BAD;
    }
    size_t offset = HAPI_CACHE__HEADER_SIZE + pad16(path_len);
    if (flags & HAPI_CACHE__FLAG_SLAB) {
        /* The checksum can only be checked once the bytes are read from the slab. */
        if (v->mv_size != offset + HAPI_CACHE__SLAB_REF_SIZE || !slab_ref_of(v, ref))
            return CHECK_BAD;
        *size = data_len;
        return CHECK_SLAB;
    }
    if (v->mv_size != offset + (size_t)data_len)
        return CHECK_BAD;
    if (value_checksum(p, p + HAPI_CACHE__HEADER_SIZE, path_len, p + offset, data_len) !=
        get_le64(p + 56))
        return CHECK_BAD;
    *data = p + offset;
    *size = data_len;
    return CHECK_OK;
}

/* ---- read transactions ---- */

/*
 * Starts a lookup: counts it as active and gives it a read transaction,
 * renewed from the pool or begun afresh. Returns 0, 1 if the store is being
 * remapped or another process grew the map (the lookup is a miss), or an LMDB
 * error. On anything but 0, the lookup is no longer counted.
 */
static int read_begin(hapi_cache *c, MDB_txn **out)
{
    MDB_txn *txn = NULL;
    int rc;

    *out = NULL;
    pthread_mutex_lock(&c->pool_lock);
    if (c->remapping) {
        pthread_mutex_unlock(&c->pool_lock);
        return 1;
    }
    c->active++;
    if (c->pool_count > 0)
        txn = c->pool[--c->pool_count];
    pthread_mutex_unlock(&c->pool_lock);

    if (txn) {
        rc = mdb_txn_renew(txn);
        if (rc == 0) {
            *out = txn;
            return 0;
        }
        /* A renewal that failed ended the transaction; drop the handle and its slot, start a fresh one. */
        mdb_txn_abort(txn);
        txn = NULL;
    }
    rc = mdb_txn_begin(c->env, NULL, MDB_RDONLY, &txn);
    if (rc == MDB_READERS_FULL) {
        /* Slots held by crashed processes are the usual cause: clear them and try once more. */
        int dead = 0;
        mdb_reader_check(c->env, &dead);
        rc = mdb_txn_begin(c->env, NULL, MDB_RDONLY, &txn);
    }
    if (rc == 0) {
        *out = txn;
        return 0;
    }

    pthread_mutex_lock(&c->pool_lock);
    if (--c->active == 0 && c->remapping)
        pthread_cond_broadcast(&c->idle);
    pthread_mutex_unlock(&c->pool_lock);
    /* Another process wrote beyond our map: a miss now; the next put adopts the new size. */
    return rc == MDB_MAP_RESIZED ? 1 : rc;
}

/* Ends a lookup: resets its transaction and pools it (or frees it when the pool is full). */
static void read_end(hapi_cache *c, MDB_txn *txn)
{
    mdb_txn_reset(txn);
    pthread_mutex_lock(&c->pool_lock);
    if (c->pool_count < c->pool_max) {
        c->pool[c->pool_count++] = txn;
        txn = NULL;
    }
    if (--c->active == 0 && c->remapping)
        pthread_cond_broadcast(&c->idle);
    pthread_mutex_unlock(&c->pool_lock);
    if (txn)
        mdb_txn_abort(txn); /* frees its reader slot (MDB_NOTLS) */
}

/*
 * Adopts the map size another process persisted (MDB_MAP_RESIZED). LMDB
 * remaps in place, so no transaction of this process may use the old map:
 * called with write_lock held and no write transaction open; waits for the
 * lookups in flight, turning new ones into misses meanwhile. Gives up after
 * REMAP_WAIT_NS, for instance when the calling thread itself holds a value.
 */
static int remap(hapi_cache *c)
{
    struct timespec deadline;
    int rc = 0;

    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += (time_t)(REMAP_WAIT_NS / 1000000000u);

    pthread_mutex_lock(&c->pool_lock);
    c->remapping = true;
    while (c->active > 0 && rc == 0)
        rc = pthread_cond_timedwait(&c->idle, &c->pool_lock, &deadline);
    if (c->active == 0)
        rc = mdb_env_set_mapsize(c->env, 0);
    else
        rc = EBUSY;
    c->remapping = false;
    pthread_mutex_unlock(&c->pool_lock);
    return rc;
}

static int lmdb_to_code(int rc)
{
    switch (rc) {
    case MDB_INVALID:
    case MDB_VERSION_MISMATCH:
    case MDB_CORRUPTED:
    case MDB_PAGE_NOTFOUND:
    case MDB_INCOMPATIBLE:
    case MDB_PANIC:
        return HAPI_ECORRUPT;
    default:
        return HAPI_ECACHE;
    }
}

/* ---- sizes ---- */

/*
 * Bytes an entry occupies, estimated as LMDB lays it out: a value that does
 * not fit a leaf node goes to its own run of overflow pages ((15 + size) /
 * page + 1 of them), the leaf keeping the key and a page number; then the
 * entry's lru_records: its "lru" record, and an inline entry's "stamps"
 * record. Leaf pages are never full, so this is a lower bound, close enough
 * to size eviction.
 */
static uint64_t entry_bytes(const hapi_cache *c, size_t key_len, size_t value_size,
                            int lru_records)
{
    uint64_t node = 8 + (uint64_t)key_len + 2; /* node header, key, index slot */
    uint64_t bytes;
    if (8 + key_len + value_size > c->node_max)
        bytes = ((15 + (uint64_t)value_size) / c->psize + 1) * c->psize + node + 8;
    else
        bytes = node + value_size;
    return bytes + (uint64_t)lru_records * (node + HAPI_CACHE__STAMP_SIZE);
}

uint64_t hapi_cache_entry_bytes(const hapi_cache *c, size_t path_len, size_t size)
{
    /* A long path is cut in the key and kept whole in the value (see put). */
    size_t key_len = HAPI_CACHE_NAMESPACE_SIZE +
                     (path_len > HAPI_CACHE_PATH_MAX ? HAPI_CACHE_PATH_MAX : path_len);
    size_t value_size = HAPI_CACHE__HEADER_SIZE +
                        (path_len > HAPI_CACHE_PATH_MAX ? pad16(path_len) : 0);
    /* A slab entry: its index in LMDB and its slot. */
    if (slab_sized(size))
        return entry_bytes(c, key_len, value_size + HAPI_CACHE__SLAB_REF_SIZE, 1) +
               slot_size_of(size);
    return entry_bytes(c, key_len, value_size + size, 2);
}

/*
 * Pages on LMDB's free list: freed by past transactions, reusable by later
 * ones. Each record of the free database is an ID list whose first word is
 * its length. LMDB lets only read transactions open a cursor on it.
 */
static int count_free_pages(MDB_txn *rtxn, uint64_t *out)
{
    MDB_cursor *cur;
    MDB_val k, v;
    MDB_cursor_op op = MDB_FIRST;
    uint64_t n = 0;
    int rc;

    *out = 0;
    rc = mdb_cursor_open(rtxn, 0 /* FREE_DBI */, &cur);
    if (rc)
        return rc;
    while ((rc = mdb_cursor_get(cur, &k, &v, op)) == 0) {
        size_t ids;
        op = MDB_NEXT;
        if (v.mv_size < sizeof(ids))
            continue;
        memcpy(&ids, v.mv_data, sizeof(ids));
        n += ids;
    }
    mdb_cursor_close(cur);
    if (rc != MDB_NOTFOUND)
        return rc;
    *out = n;
    return 0;
}

/*
 * Sets c->lmdb_free_pages to the length of LMDB's free list, for slot_alloc()
 * (write_lock held, no write transaction open: the count needs a lookup's
 * snapshot). On failure, 0: slabs are then measured against the high-water mark.
 */
static void lmdb_free_pages_update(hapi_cache *c)
{
    MDB_txn *rtxn;
    c->lmdb_free_pages = 0;
    if (read_begin(c, &rtxn) != 0)
        return;
    if (count_free_pages(rtxn, &c->lmdb_free_pages) != 0)
        c->lmdb_free_pages = 0;
    read_end(c, rtxn);
}

/* ---- slab files ---- */

/*
 * The descriptor of the slab file of slot_size, opened (and with create,
 * created) on first use; -errno if it cannot be opened, -EMFILE when
 * SLAB_CLASSES sizes are open already. Lock-free once open: lookups call it.
 */
static int slab_fd(hapi_cache *c, uint32_t slot_size, bool create)
{
    int n = atomic_load_explicit(&c->slab_count, memory_order_acquire);
    for (int i = 0; i < n; i++)
        if (c->slabs[i].slot_size == slot_size)
            return c->slabs[i].fd;
    pthread_mutex_lock(&c->slab_lock);
    int fd;
    n = atomic_load_explicit(&c->slab_count, memory_order_relaxed);
    for (int i = 0; i < n; i++) {
        if (c->slabs[i].slot_size == slot_size) {
            fd = c->slabs[i].fd;
            goto out;
        }
    }
    if (n == SLAB_CLASSES) {
        fd = -EMFILE;
        goto out;
    }
    char path[PATH_MAX];
    if (snprintf(path, sizeof(path), "%s/%u", c->slab_dir, slot_size) >= (int)sizeof(path)) {
        fd = -ENAMETOOLONG;
        goto out;
    }
    fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW | (create ? O_CREAT : 0), 0644);
    if (fd < 0) {
        fd = -errno;
        goto out;
    }
    c->slabs[n] = (struct slab){ .slot_size = slot_size, .fd = fd };
    atomic_store_explicit(&c->slab_count, n + 1, memory_order_release);
out:
    pthread_mutex_unlock(&c->slab_lock);
    return fd;
}

/*
 * Reads the bytes of a slab value v (checked by value_check(): ref and size
 * filled) into a new buffer, and verifies them against v's checksum. Returns
 * CHECK_OK with *out (the caller frees it), CHECK_BAD (no such file, a short
 * read, a checksum that differs: the slot was reused, never written, or
 * damaged), or -ENOMEM.
 */
static int slab_read(hapi_cache *c, const MDB_val *v, const struct slab_ref *ref, size_t size,
                     uint8_t **out)
{
    const uint8_t *p = v->mv_data;
    uint32_t path_len = get_le32(p + 12);
    *out = NULL;
    int fd = slab_fd(c, ref->slot_size, false);
    if (fd < 0)
        return CHECK_BAD;
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf)
        return -ENOMEM;
    off_t offset = (off_t)(ref->slot * ref->slot_size);
    size_t done = 0;
    while (done < size) {
        ssize_t r = pread(fd, buf + done, size - done, offset + (off_t)done);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        done += (size_t)r;
    }
    if (done < size || value_checksum(p, p + HAPI_CACHE__HEADER_SIZE, path_len, buf, size) !=
                           get_le64(p + 56)) {
        free(buf);
        return CHECK_BAD;
    }
    *out = buf;
    return CHECK_OK;
}

/* Writes size bytes at offset of fd, whole. Returns 0 or an errno (positive, as LMDB's are). */
static int write_full(int fd, const void *data, size_t size, off_t offset)
{
    const uint8_t *p = data;
    while (size > 0) {
        ssize_t w = pwrite(fd, p, size, offset);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            return errno;
        if (w == 0)
            return EIO;
        p += w;
        size -= (size_t)w;
        offset += w;
    }
    return 0;
}

/*
 * Room left in the map for LMDB's file to grow into once the slabs stopped
 * growing: its index pages, and pages copied while the last transactions'
 * free pages are not reusable yet (a write of the access log copies a few
 * thousand). A sixteenth of the map and 64 pages, at most a quarter of it.
 */
static uint64_t lmdb_reserve(const hapi_cache *c, uint64_t map_bytes)
{
    uint64_t r = map_bytes / 16 + 64 * (uint64_t)c->psize;
    return r < map_bytes / 4 ? r : map_bytes / 4;
}

/* A slot size's record in "meta": its high-water mark and how many of those slots are free. */
struct slab_class {
    uint64_t high;
    uint64_t free;
};

static void class_key(uint8_t key[SLAB_KEY_SIZE], uint32_t slot_size)
{
    memcpy(key, SLAB_KEY, 4);
    uint32_t be = htobe32(slot_size);
    memcpy(key + 4, &be, 4);
}

static int class_get(hapi_cache *c, MDB_txn *txn, uint32_t slot_size, struct slab_class *sc)
{
    uint8_t key[SLAB_KEY_SIZE];
    class_key(key, slot_size);
    MDB_val k = { .mv_size = sizeof(key), .mv_data = key }, v;
    *sc = (struct slab_class){ 0 };
    int rc = mdb_get(txn, c->meta_dbi, &k, &v);
    if (rc == MDB_NOTFOUND)
        return 0;
    if (rc)
        return rc;
    if (v.mv_size != 16)
        return MDB_CORRUPTED;
    sc->high = get_le64(v.mv_data);
    sc->free = get_le64((const uint8_t *)v.mv_data + 8);
    return 0;
}

/* Writes a slot size's record; an empty slab has none, so that the sizes of old models do not pile up. */
static int class_put(hapi_cache *c, MDB_txn *txn, uint32_t slot_size, const struct slab_class *sc)
{
    uint8_t key[SLAB_KEY_SIZE], buf[16];
    class_key(key, slot_size);
    MDB_val k = { .mv_size = sizeof(key), .mv_data = key };
    if (sc->high == 0) {
        int rc = mdb_del(txn, c->meta_dbi, &k, NULL);
        return rc == MDB_NOTFOUND ? 0 : rc;
    }
    put_le64(buf, sc->high);
    put_le64(buf + 8, sc->free);
    MDB_val v = { .mv_size = sizeof(buf), .mv_data = buf };
    return mdb_put(txn, c->meta_dbi, &k, &v, 0);
}

/*
 * Calls fn on every slot size's record of txn, in order of slot size, with
 * arg. Stops at fn's first non-zero return and returns it, or 0, or an LMDB
 * error.
 */
static int class_each(hapi_cache *c, MDB_txn *txn,
                      int (*fn)(uint32_t slot_size, const struct slab_class *sc, void *arg),
                      void *arg)
{
    MDB_cursor *cur;
    MDB_val k = { .mv_size = 4, .mv_data = SLAB_KEY }, v;
    MDB_cursor_op op = MDB_SET_RANGE;
    int rc = mdb_cursor_open(txn, c->meta_dbi, &cur);
    if (rc)
        return rc;
    while ((rc = mdb_cursor_get(cur, &k, &v, op)) == 0) {
        op = MDB_NEXT;
        if (k.mv_size != SLAB_KEY_SIZE || memcmp(k.mv_data, SLAB_KEY, 4) != 0)
            break;
        if (v.mv_size != 16) {
            rc = MDB_CORRUPTED;
            break;
        }
        uint32_t be;
        memcpy(&be, (const uint8_t *)k.mv_data + 4, 4);
        struct slab_class sc = { get_le64(v.mv_data), get_le64((const uint8_t *)v.mv_data + 8) };
        if ((rc = fn(be32toh(be), &sc, arg)) != 0)
            break;
    }
    mdb_cursor_close(cur);
    return rc == MDB_NOTFOUND ? 0 : rc;
}

/* The bytes of all slab files up to their high-water marks, and of their free slots. */
struct slab_totals {
    uint64_t bytes;
    uint64_t free_bytes;
};

static int add_totals(uint32_t slot_size, const struct slab_class *sc, void *arg)
{
    struct slab_totals *t = arg;
    t->bytes += sc->high * slot_size;
    t->free_bytes += (sc->free < sc->high ? sc->free : sc->high) * slot_size;
    return 0;
}

static int slab_totals(hapi_cache *c, MDB_txn *txn, struct slab_totals *t)
{
    *t = (struct slab_totals){ 0 };
    return class_each(c, txn, add_totals, t);
}

static void slot_key(uint8_t key[SLOT_KEY_SIZE], uint32_t slot_size, uint64_t slot)
{
    uint32_t be = htobe32(slot_size);
    memcpy(key, &be, 4);
    put_be64(key + 4, slot);
}

/*
 * Takes a slot of slot_size in txn: the lowest free one, else a new one at the
 * end of the file, if the whole store (LMDB's file and every slab file) stays
 * within the map size; if not, MDB_MAP_FULL, which makes the put evict and
 * retry as for a full map. Returns 0 or an LMDB error.
 */
static int slot_alloc(hapi_cache *c, MDB_txn *txn, uint32_t slot_size, uint64_t *slot)
{
    struct slab_class sc;
    int rc = class_get(c, txn, slot_size, &sc);
    if (rc)
        return rc;
    if (sc.free > 0) {
        MDB_cursor *cur;
        uint8_t key[SLOT_KEY_SIZE];
        slot_key(key, slot_size, 0);
        MDB_val k = { .mv_size = sizeof(key), .mv_data = key }, v;
        if ((rc = mdb_cursor_open(txn, c->slots_dbi, &cur)) != 0)
            return rc;
        rc = mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE);
        if (rc == 0 && k.mv_size == SLOT_KEY_SIZE && memcmp(k.mv_data, key, 4) == 0) {
            *slot = get_be64((const uint8_t *)k.mv_data + 4);
            rc = mdb_cursor_del(cur, 0);
            mdb_cursor_close(cur);
            if (rc)
                return rc;
            sc.free--;
            return class_put(c, txn, slot_size, &sc);
        }
        mdb_cursor_close(cur);
        if (rc && rc != MDB_NOTFOUND)
            return rc;
        sc.free = 0; /* the count disagreed with the list: the list is what holds */
    }
    /*
     * LMDB's pages in use, not its high-water mark: its file never shrinks,
     * and pages copied while lookups pinned older ones (two processes sharing
     * the store grew a 4 MiB map's file to 1,019 pages with 8 in use) are
     * reused by LMDB before it grows again. Counting the high-water mark let
     * a store whose every entry was evicted refuse every slab put for good,
     * while eviction_goal(), which counts the free list, saw room.
     */
    MDB_envinfo info;
    struct slab_totals t;
    if ((rc = mdb_env_info(c->env, &info)) != 0 || (rc = slab_totals(c, txn, &t)) != 0)
        return rc;
    uint64_t pages = (uint64_t)info.me_last_pgno + 1;
    pages -= c->lmdb_free_pages < pages ? c->lmdb_free_pages : pages;
    if (pages * c->psize + t.bytes + slot_size + lmdb_reserve(c, info.me_mapsize) >
        (uint64_t)info.me_mapsize)
        return MDB_MAP_FULL;
    *slot = sc.high++;
    return class_put(c, txn, slot_size, &sc);
}

/*
 * Frees a slot in txn (write_lock held). Free slots at the end of the file
 * leave it: the high-water mark comes down, and the file is cut to it by the
 * next write transaction (slab_trim()), so that an evicted slot size gives
 * its disk back. Not here: if txn does not commit, the slots it freed still
 * hold committed entries' bytes. A slot beyond the high-water mark or free
 * already (a damaged reference) is left alone. Returns 0 or an LMDB error.
 */
static int slot_free(hapi_cache *c, MDB_txn *txn, const struct slab_ref *ref)
{
    struct slab_class sc;
    uint8_t key[SLOT_KEY_SIZE];
    int rc = class_get(c, txn, ref->slot_size, &sc);
    if (rc)
        return rc;
    if (ref->slot >= sc.high)
        return 0;
    slot_key(key, ref->slot_size, ref->slot);
    MDB_val k = { .mv_size = sizeof(key), .mv_data = key }, v = { .mv_size = 0, .mv_data = "" };
    rc = mdb_put(txn, c->slots_dbi, &k, &v, MDB_NOOVERWRITE);
    if (rc == MDB_KEYEXIST)
        return 0;
    if (rc)
        return rc;
    sc.free++;
    if (ref->slot + 1 == sc.high) {
        while (sc.high > 0) {
            slot_key(key, ref->slot_size, sc.high - 1);
            k = (MDB_val){ .mv_size = sizeof(key), .mv_data = key };
            rc = mdb_del(txn, c->slots_dbi, &k, NULL);
            if (rc == MDB_NOTFOUND)
                break;
            if (rc)
                return rc;
            sc.high--;
            sc.free = sc.free > 0 ? sc.free - 1 : 0;
        }
        /* slab_trim() cuts the files this process has open: open it now if it is not yet. */
        slab_fd(c, ref->slot_size, false);
        c->trim_pending = true;
    }
    return class_put(c, txn, ref->slot_size, &sc);
}

/*
 * Cuts the slab files this process has open to their high-water marks as
 * txn, a write transaction that has changed nothing yet, sees them: the
 * committed marks. LMDB's write lock keeps every other writer out, so no slot
 * past a mark is being written, and none is named by a committed entry.
 * A failed truncation leaves bytes past the mark, which later slots overwrite.
 */
static void slab_trim(hapi_cache *c, MDB_txn *txn)
{
    int n = atomic_load_explicit(&c->slab_count, memory_order_acquire);
    for (int i = 0; i < n; i++) {
        struct slab_class sc;
        struct stat st;
        off_t end;
        if (class_get(c, txn, c->slabs[i].slot_size, &sc) != 0)
            continue;
        end = (off_t)(sc.high * c->slabs[i].slot_size);
        if (fstat(c->slabs[i].fd, &st) == 0 && st.st_size > end)
            (void)!ftruncate(c->slabs[i].fd, end);
    }
    c->trim_pending = false;
}

/* Opens a slot size's file, for slab_trim(), which cuts the files open. */
static int open_class(uint32_t slot_size, const struct slab_class *sc, void *arg)
{
    (void)sc;
    slab_fd(arg, slot_size, false);
    return 0;
}

/*
 * Drops every slot record, in txn (write lock held, every entry gone in the
 * same transaction); the files are emptied by the next write's slab_trim().
 */
static int slab_clear(hapi_cache *c, MDB_txn *txn)
{
    int rc = class_each(c, txn, open_class, c);
    if (rc == 0)
        rc = mdb_drop(txn, c->slots_dbi, 0);
    c->trim_pending = true;
    while (rc == 0) {
        MDB_cursor *cur;
        MDB_val k = { .mv_size = 4, .mv_data = SLAB_KEY }, v;
        if ((rc = mdb_cursor_open(txn, c->meta_dbi, &cur)) != 0)
            break;
        rc = mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE);
        if (rc == 0 && k.mv_size == SLAB_KEY_SIZE && memcmp(k.mv_data, SLAB_KEY, 4) == 0)
            rc = mdb_cursor_del(cur, 0);
        else if (rc == 0)
            rc = MDB_NOTFOUND;
        mdb_cursor_close(cur);
    }
    return rc == MDB_NOTFOUND ? 0 : rc;
}

/*
 * Empties the slab files found in the slab directory: those of a store that
 * is gone (a new data.mdb, or a reset one). Called while creating a store, in
 * its first write transaction. Returns 0 or -errno.
 */
static int slab_files_empty(hapi_cache *c)
{
    DIR *d = opendir(c->slab_dir);
    struct dirent *e;
    if (!d)
        return -errno;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] < '1' || e->d_name[0] > '9')
            continue; /* ".", "..", and nothing of ours */
        int fd = openat(dirfd(d), e->d_name, O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0)
            continue;
        int rc = ftruncate(fd, 0);
        close(fd);
        if (rc != 0) {
            rc = -errno;
            closedir(d);
            return rc;
        }
    }
    closedir(d);
    return 0;
}

/* ---- the access log ---- */

/* Notes a hit on key. Called by lookups; never blocks on LMDB. */
static void note_access(hapi_cache *c, const uint8_t *key, size_t len)
{
    pthread_mutex_lock(&c->access_lock);
    if (c->log_used + 2 + len <= ACCESS_LOG_BYTES) {
        put_le16(c->log + c->log_used, (uint16_t)len);
        memcpy(c->log + c->log_used + 2, key, len);
        c->log_used += 2 + len;
        pthread_mutex_unlock(&c->access_lock);
        return;
    }
    pthread_mutex_unlock(&c->access_lock);
    count(&c->accesses_dropped, 1);
}

/*
 * Takes the hits noted so far for the next write transaction (write_lock
 * held). A log left over from a write that failed is kept and taken first:
 * the newer hits wait in the other buffer.
 */
static void drain_take(hapi_cache *c)
{
    if (c->drain_used)
        return;
    pthread_mutex_lock(&c->access_lock);
    uint8_t *t = c->drain;
    c->drain = c->log;
    c->drain_used = c->log_used;
    c->log = t;
    c->log_used = 0;
    pthread_mutex_unlock(&c->access_lock);
}

/* ---- the LRU index ---- */

/* Deletes the "lru" record of stamp. A record already gone is fine. */
static int drop_lru_stamp(hapi_cache *c, MDB_txn *txn, uint64_t stamp)
{
    uint8_t o[HAPI_CACHE__STAMP_SIZE];
    put_be64(o, stamp);
    MDB_val ok = { .mv_size = sizeof(o), .mv_data = o };
    int rc = mdb_del(txn, c->lru_dbi, &ok, NULL);
    return rc == MDB_NOTFOUND ? 0 : rc;
}

/*
 * Deletes the "lru" record that a "stamps" value names (decoded first: it
 * points into a page the deletion may change).
 */
static int drop_lru_record(hapi_cache *c, MDB_txn *txn, const MDB_val *stamp)
{
    if (stamp->mv_size != HAPI_CACHE__STAMP_SIZE)
        return MDB_CORRUPTED;
    return drop_lru_stamp(c, txn, get_be64(stamp->mv_data));
}

/* Adds key's "lru" record under *stamp (then advanced), and with in_stamps its "stamps" record. */
static int lru_append(hapi_cache *c, MDB_txn *txn, MDB_val *k, uint64_t *stamp, bool in_stamps)
{
    uint8_t s[HAPI_CACHE__STAMP_SIZE];
    put_be64(s, (*stamp)++);
    MDB_val sk = { .mv_size = sizeof(s), .mv_data = s };
    /* Stamps only grow within and across transactions: append at the tail, no search. */
    int rc = mdb_put(txn, c->lru_dbi, &sk, k, MDB_APPEND);
    if (rc == 0 && in_stamps)
        rc = mdb_put(txn, c->stamps_dbi, k, &sk, 0);
    return rc;
}

/* Rewrites slab value v of k with stamp: a copy of a few dozen bytes, in the leaf. */
static int value_stamp_set(hapi_cache *c, MDB_txn *txn, MDB_val *k, const MDB_val *v,
                           uint64_t stamp)
{
    uint8_t small[256];
    uint8_t *copy = v->mv_size <= sizeof(small) ? small : malloc(v->mv_size);
    if (!copy)
        return ENOMEM;
    memcpy(copy, v->mv_data, v->mv_size);
    put_le64(copy + v->mv_size - HAPI_CACHE__STAMP_SIZE, stamp);
    MDB_val nv = { .mv_size = v->mv_size, .mv_data = copy };
    int rc = mdb_put(txn, c->features_dbi, k, &nv, 0);
    if (copy != small)
        free(copy);
    return rc;
}

/* The first stamp a write transaction hands out: one more than the newest. */
static int stamp_first(hapi_cache *c, MDB_txn *txn, uint64_t *stamp)
{
    MDB_cursor *cur;
    MDB_val k, v;
    int rc = mdb_cursor_open(txn, c->lru_dbi, &cur);
    if (rc)
        return rc;
    rc = mdb_cursor_get(cur, &k, &v, MDB_LAST);
    mdb_cursor_close(cur);
    if (rc == MDB_NOTFOUND) {
        *stamp = 1;
        return 0;
    }
    if (rc)
        return rc;
    if (k.mv_size != HAPI_CACHE__STAMP_SIZE)
        return MDB_CORRUPTED;
    *stamp = get_be64(k.mv_data) + 1;
    return 0;
}

/*
 * Makes key the most recently used entry: stamps it with *stamp (then
 * advanced) and deletes its older "lru" record. A slab entry keeps its stamp
 * in its value (small, in its leaf: rewriting it costs what a "stamps"
 * record would, and saves that record); an inline one in "stamps" (its value
 * may span overflow pages, which a rewrite would copy). With must_exist, a
 * key without a stamp (evicted or removed since its access was noted) is
 * left alone and MDB_NOTFOUND returned. An entry stamped recent_from or
 * later is left where it is (see RECENT_SHARE).
 */
static int touch(hapi_cache *c, MDB_txn *txn, const void *key, size_t key_len,
                 uint64_t *stamp, bool must_exist, uint64_t recent_from)
{
    MDB_val k = { .mv_size = key_len, .mv_data = (void *)key }, v, old;
    struct slab_ref ref;
    int rc;

    rc = mdb_get(txn, c->features_dbi, &k, &v);
    if (rc == 0 && slab_ref_of(&v, &ref)) {
        if (recent_from && ref.stamp >= recent_from)
            return 0;
        if ((rc = drop_lru_stamp(c, txn, ref.stamp)) != 0 ||
            (rc = value_stamp_set(c, txn, &k, &v, *stamp)) != 0)
            return rc;
        return lru_append(c, txn, &k, stamp, false);
    }
    if (rc && rc != MDB_NOTFOUND)
        return rc;
    rc = mdb_get(txn, c->stamps_dbi, &k, &old);
    if (rc == MDB_NOTFOUND && must_exist)
        return rc;
    if (rc == 0) {
        if (recent_from && old.mv_size == HAPI_CACHE__STAMP_SIZE &&
            get_be64(old.mv_data) >= recent_from)
            return 0;
        if ((rc = drop_lru_record(c, txn, &old)) != 0)
            return rc;
    } else if (rc != MDB_NOTFOUND) {
        return rc;
    }
    return lru_append(c, txn, &k, stamp, true);
}

/*
 * Deletes the LRU records of key's entry, if any: its "lru" record, which
 * ref (a slab entry's reference, copied before the entry was deleted) or the
 * "stamps" record names, and that "stamps" record.
 */
static int unlink_lru(hapi_cache *c, MDB_txn *txn, const void *key, size_t key_len,
                      const struct slab_ref *ref)
{
    if (ref)
        return drop_lru_stamp(c, txn, ref->stamp);
    MDB_val k = { .mv_size = key_len, .mv_data = (void *)key }, old;
    int rc = mdb_get(txn, c->stamps_dbi, &k, &old);
    if (rc == MDB_NOTFOUND)
        return 0;
    if (rc)
        return rc;
    if ((rc = drop_lru_record(c, txn, &old)) != 0)
        return rc;
    return mdb_del(txn, c->stamps_dbi, &k, NULL);
}

/*
 * Applies up to max records of the drained access log in txn, from where the
 * last committed write left it; returns the number applied through *applied.
 * The log moves on only once txn commits (drain_done), so a failed write
 * leaves it for the next.
 */
static int apply_accesses(hapi_cache *c, MDB_txn *txn, uint64_t *stamp, uint64_t *applied,
                          size_t max)
{
    const uint8_t *p = c->drain + c->drain_off, *end = c->drain + c->drain_used;
    uint64_t n = 0;
    /* Entries stamped in the last 1/RECENT_SHARE of the store's stamps stay put. */
    MDB_stat st;
    uint64_t recent_from = 0;
    if (mdb_stat(txn, c->lru_dbi, &st) == 0 && *stamp > st.ms_entries / RECENT_SHARE)
        recent_from = *stamp - st.ms_entries / RECENT_SHARE;
    for (size_t records = 0; p + 2 <= end && records < max; records++) {
        size_t len = get_le16(p);
        const uint8_t *key = p + 2;
        p += 2 + len;
        int rc = touch(c, txn, key, len, stamp, true, recent_from);
        if (rc == MDB_NOTFOUND)
            continue;
        if (rc)
            return rc;
        n++;
    }
    c->drain_next = (size_t)(p - c->drain);
    if (applied)
        *applied = n;
    return 0;
}

static void drain_done(hapi_cache *c)
{
    c->drain_off = c->drain_next;
    if (c->drain_off >= c->drain_used)
        c->drain_used = c->drain_off = 0;
}

/* ---- write transactions ---- */

/* Begins a write transaction (write_lock held), adopting another process's map size if needed. */
static int write_begin(hapi_cache *c, MDB_txn **txn, hapi_error *err)
{
    int rc = mdb_txn_begin(c->env, NULL, 0, txn);
    if (rc == MDB_MAP_RESIZED) {
        /* Another process grew the store: adopt its map size, once. */
        rc = remap(c);
        if (rc) {
            *txn = NULL;
            return hapi_error_set(err, HAPI_ECACHE,
                                  "cache %s: cannot adopt the map size another process set: %s",
                                  c->dir, rc == EBUSY ? "lookups still held" : mdb_strerror(rc));
        }
        rc = mdb_txn_begin(c->env, NULL, 0, txn);
    }
    if (rc) {
        *txn = NULL;
        return hapi_error_set(err, lmdb_to_code(rc), "cache %s: cannot begin a write: %s",
                              c->dir, mdb_strerror(rc));
    }
    if (c->trim_pending)
        slab_trim(c, *txn);
    return 0;
}

/* ---- eviction ---- */

/*
 * How many bytes a write of need bytes should evict first: none while the
 * store stays under HIGH_PERCENT of the map, else down to LOW_PERCENT. The
 * high-water mark alone settles the common case; past it (a store that was
 * ever full stays there), the free list tells the pages actually in use.
 * Called with write_lock held, so the map cannot change under us.
 */
static int eviction_goal(hapi_cache *c, uint64_t need, uint64_t *goal)
{
    MDB_envinfo info;
    MDB_txn *rtxn;
    struct slab_totals slabs;
    uint64_t free_pages = 0;
    int rc;

    *goal = 0;
    rc = mdb_env_info(c->env, &info);
    if (rc)
        return rc;
    rc = read_begin(c, &rtxn);
    if (rc == 1)
        return 0; /* cannot happen under write_lock; no estimate is no eviction */
    if (rc)
        return rc;
    rc = slab_totals(c, rtxn, &slabs);
    if (rc) {
        read_end(c, rtxn);
        return rc;
    }
    /*
     * The slab files count as pages of the map, the bound being the whole
     * store's, and so does the reserve slot_alloc() leaves for LMDB to grow.
     */
    uint64_t map = (uint64_t)info.me_mapsize / c->psize;
    uint64_t reserve = slabs.bytes ? lmdb_reserve(c, info.me_mapsize) / c->psize : 0;
    uint64_t used = (uint64_t)info.me_last_pgno + 1 + slabs.bytes / c->psize + reserve;
    uint64_t need_pages = (need + c->psize - 1) / c->psize;
    uint64_t high, low;
    marks(map, &high, &low);
    if (used + need_pages <= high) {
        read_end(c, rtxn);
        return 0;
    }
    rc = count_free_pages(rtxn, &free_pages);
    read_end(c, rtxn);
    if (rc)
        return rc;
    /* Free pages and free slots are reused before the files grow. */
    free_pages += slabs.free_bytes / c->psize;
    used = free_pages < used ? used - free_pages : 0;
    if (used + need_pages <= high)
        return 0;
    *goal = (used + need_pages - (low < used + need_pages ? low : used + need_pages)) * c->psize;
    return 0;
}

/* Adds n to the persisted eviction count, in txn. */
static int count_evictions(hapi_cache *c, MDB_txn *txn, uint64_t n)
{
    MDB_val k = { .mv_size = strlen(EVICTIONS_KEY), .mv_data = EVICTIONS_KEY }, v;
    uint8_t buf[8];
    uint64_t total = 0;
    int rc = mdb_get(txn, c->meta_dbi, &k, &v);
    if (rc == 0 && v.mv_size == 8)
        total = get_le64(v.mv_data);
    else if (rc && rc != MDB_NOTFOUND)
        return rc;
    put_le64(buf, total + n);
    v = (MDB_val){ .mv_size = 8, .mv_data = buf };
    return mdb_put(txn, c->meta_dbi, &k, &v, 0);
}

/*
 * Writes the evictions not yet persisted (write_lock held), in a transaction
 * of its own: a small one, a few pages. Sets *full (if full is not NULL) when
 * the store had not even those. Returns 0 or a hapi code (err says why).
 */
static int persist_evictions(hapi_cache *c, bool *full, hapi_error *err)
{
    MDB_txn *txn;
    int rc = write_begin(c, &txn, err);
    if (full)
        *full = false;
    if (rc)
        return rc;
    rc = count_evictions(c, txn, c->evictions_unpersisted);
    if (rc == 0)
        rc = mdb_txn_commit(txn);
    else
        mdb_txn_abort(txn);
    if (rc == 0)
        c->evictions_unpersisted = 0;
    if (full)
        *full = rc == MDB_MAP_FULL;
    if (rc && rc != MDB_MAP_FULL)
        return hapi_error_set(err, lmdb_to_code(rc), "cache %s: eviction count: %s", c->dir,
                              mdb_strerror(rc));
    return 0;
}

/* Sleeps (attempt + 1) ms, at most 10: a store full for an instant, see FULL_WAIT_MS. */
static void full_wait(int attempt)
{
    struct timespec ts = { 0, (long)(attempt < 10 ? attempt + 1 : 10) * 1000000L };
    nanosleep(&ts, NULL);
}

/*
 * Evicts least recently used entries, of every namespace, until their
 * estimated footprint reaches goal bytes or none is left, in write
 * transactions of up to EVICT_BATCH entries (write_lock held). The first one
 * applies the access log, so that recent hits are not evicted. Reports the
 * number evicted through *evicted; returns 0 or a hapi code (err says why).
 *
 * A deletion copies the B-tree pages it changes, so an eviction transaction
 * needs free pages too: on MDB_MAP_FULL it retries with half the batch.
 */
static int evict(hapi_cache *c, uint64_t goal, uint64_t *evicted, hapi_error *err)
{
    uint64_t freed = 0, total = 0, stamp = 0, wait_from = 0;
    unsigned batch = EVICT_BATCH;
    int waits = 0;
    bool empty = false, skip_apply = false, unlocked = false;
    int rc = 0, fail = 0;

    *evicted = 0;
    uint64_t t0 = hapi_now_ns();
    while (freed < goal && !empty) {
        MDB_txn *txn;
        MDB_cursor *cur = NULL;
        uint64_t n = 0, gone = 0, batch_freed = 0;
        bool batch_empty = false;

        if ((rc = write_begin(c, &txn, err)) != 0) {
            fail = rc;
            break;
        }
        /*
         * The hits logged since the last write are applied first, so that
         * what was just read is not what goes. But after an epoch of hits
         * that is hundreds of index rewrites, and in a full store they alone
         * can overflow the map: then this batch goes without them (by the
         * slightly older order), and the next applies them in the room made.
         */
        bool applied = c->drain_used > 0 && !skip_apply;
        rc = stamp_first(c, txn, &stamp);
        if (rc == 0 && applied)
            rc = apply_accesses(c, txn, &stamp, NULL, SIZE_MAX);
        if (rc == 0)
            rc = mdb_cursor_open(txn, c->lru_dbi, &cur);
        while (rc == 0 && n < batch && freed + batch_freed < goal) {
            MDB_val k, v;
            uint8_t key[HAPI_CACHE__KEY_MAX];
            rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST);
            if (rc == MDB_NOTFOUND) {
                batch_empty = true;
                rc = 0;
                break;
            }
            if (rc)
                break;
            /* Copy the key: v points into a page that the deletions below change. */
            size_t len = v.mv_size <= sizeof(key) ? v.mv_size : 0;
            memcpy(key, v.mv_data, len);
            if ((rc = mdb_cursor_del(cur, 0)) != 0)
                break;
            if (len == 0)
                continue; /* not a key of ours: the record alone goes */
            MDB_val fk = { .mv_size = len, .mv_data = key }, fv;
            size_t value_size = 0;
            struct slab_ref ref;
            bool slab = false;
            rc = mdb_get(txn, c->features_dbi, &fk, &fv);
            if (rc == 0) {
                value_size = fv.mv_size;
                slab = slab_ref_of(&fv, &ref);
                rc = mdb_del(txn, c->features_dbi, &fk, NULL);
                gone += rc == 0;
                if (rc == 0 && slab)
                    rc = slot_free(c, txn, &ref);
            }
            if (rc == 0 || rc == MDB_NOTFOUND)
                rc = mdb_del(txn, c->stamps_dbi, &fk, NULL);
            if (rc == MDB_NOTFOUND)
                rc = 0;
            if (rc)
                break;
            batch_freed += entry_bytes(c, len, value_size, slab ? 1 : 2) +
                           (slab ? ref.slot_size : 0);
            n++;
        }
        if (cur)
            mdb_cursor_close(cur);
        if (rc == 0) {
            rc = mdb_txn_commit(txn);
        } else {
            mdb_txn_abort(txn);
        }
        if (rc == MDB_MAP_FULL && applied) {
            skip_apply = true;
            continue;
        }
        if (rc == MDB_MAP_FULL && batch > 1) {
            batch /= 2;
            continue;
        }
        /*
         * Even one deletion does not fit: the reusable pages are spent and
         * the last transaction's freed ones are locked until another commits.
         * A transaction of a few pages unlocks them, if those pages are left.
         */
        if (rc == MDB_MAP_FULL && !unlocked) {
            unlocked = true;
            bool full;
            if ((fail = persist_evictions(c, &full, err)) != 0)
                break;
            if (!full)
                continue;
        }
        if (rc == MDB_MAP_FULL) {
            if (waits == 0)
                wait_from = hapi_now_ns();
            if (hapi_now_ns() - wait_from < FULL_WAIT_MS * 1000000ULL) {
                full_wait(waits++);
                continue;
            }
            fail = hapi_error_set(err, HAPI_ECACHE,
                                  "cache %s: cache full: no room even to evict; lookups held "
                                  "for long pin the pages eviction frees", c->dir);
            break;
        }
        if (rc) {
            fail = hapi_error_set(err, lmdb_to_code(rc), "cache %s: eviction: %s", c->dir,
                                  mdb_strerror(rc));
            break;
        }
        if (applied)
            drain_done(c);
        skip_apply = false;
        unlocked = false;
        freed += batch_freed;
        total += gone;
        empty = batch_empty;
    }
    /*
     * What the committed batches removed counts even when a later batch failed: the entries are
     * gone (the counters must balance against the store's entries, as tests check).
     */
    if (total == 0)
        return fail;
    count(&c->evictions, total);
    count(&c->evict_ns, hapi_now_ns() - t0);
    *evicted = total;
    c->evictions_unpersisted += total;
    if (fail)
        return fail; /* the count is persisted with the next eviction */

    /*
     * Persist the count in a transaction of its own. It also matters to the
     * put that follows: LMDB reuses only pages freed at least two
     * transactions before (the previous one may still be some reader's
     * snapshot), so without it the last batch's pages would stay unusable
     * for the very put that evicted them. A store full to the last page can
     * refuse even this write: the count then waits for the next eviction.
     */
    return persist_evictions(c, NULL, err);
}

/* ---- open and close ---- */

/*
 * Indexes a version-1 store (entries without an LRU order) in txn: stamps in
 * key order, which keeps a directory's entries together.
 */
static int upgrade_v1(hapi_cache *c, MDB_txn *txn)
{
    MDB_cursor *cur;
    MDB_val k, v;
    MDB_cursor_op op = MDB_FIRST;
    uint64_t stamp = 1;
    int rc = mdb_cursor_open(txn, c->features_dbi, &cur);
    if (rc)
        return rc;
    while ((rc = mdb_cursor_get(cur, &k, &v, op)) == 0) {
        op = MDB_NEXT;
        if ((rc = touch(c, txn, k.mv_data, k.mv_size, &stamp, false, 0)) != 0)
            break;
    }
    mdb_cursor_close(cur);
    return rc == MDB_NOTFOUND ? 0 : rc;
}

/*
 * Opens the named databases in one write transaction, creating them in a new
 * store, and checks that an existing store is ours. A new LMDB file has an
 * empty main database; a foreign one has keys but no "meta" database or a
 * format record that is not ours.
 */
static int init_databases(hapi_cache *c, hapi_error *err)
{
    MDB_txn *txn = NULL;
    MDB_dbi main_dbi;
    MDB_stat st;
    MDB_val k, v;
    uint8_t record[FORMAT_RECORD_SIZE];
    uint32_t version = FORMAT_VERSION;
    int rc;

    memcpy(record, FORMAT_MAGIC, FORMAT_MAGIC_SIZE);
    put_le32(record + FORMAT_MAGIC_SIZE, FORMAT_VERSION);

    rc = mdb_txn_begin(c->env, NULL, 0, &txn);
    if (rc) {
        rc = hapi_error_set(err, lmdb_to_code(rc), "cache %s: cannot begin a transaction: %s",
                            c->dir, mdb_strerror(rc));
        goto fail_begin;
    }
    rc = mdb_dbi_open(txn, NULL, 0, &main_dbi);
    if (rc == 0)
        rc = mdb_stat(txn, main_dbi, &st);
    if (rc) {
        rc = hapi_error_set(err, lmdb_to_code(rc), "cache %s/data.mdb: %s", c->dir,
                            mdb_strerror(rc));
        goto fail_txn;
    }

    if (st.ms_entries == 0) {
        /* A new store: mark it as ours before anything else goes in. */
        rc = mdb_dbi_open(txn, "meta", MDB_CREATE, &c->meta_dbi);
        if (rc == 0) {
            k = (MDB_val){ .mv_size = strlen(FORMAT_KEY), .mv_data = FORMAT_KEY };
            v = (MDB_val){ .mv_size = sizeof(record), .mv_data = record };
            rc = mdb_put(txn, c->meta_dbi, &k, &v, 0);
        }
        if (rc) {
            rc = hapi_error_set(err, lmdb_to_code(rc), "cache %s: cannot initialize the store: %s",
                                c->dir, mdb_strerror(rc));
            goto fail_txn;
        }
        /*
         * Slab files left by a store that is gone (reset, or data.mdb deleted)
         * hold nothing this one names: empty them, under the write lock this
         * transaction holds, before any slot is handed out.
         */
        if ((rc = slab_files_empty(c)) != 0) {
            rc = hapi_error_set(err, rc, "cache %s/%s: cannot empty the slab files: %s", c->dir,
                                HAPI_CACHE__SLAB_DIR, strerror(-rc));
            goto fail_txn;
        }
    } else {
        rc = mdb_dbi_open(txn, "meta", 0, &c->meta_dbi);
        if (rc == MDB_NOTFOUND || rc == MDB_INCOMPATIBLE) {
            rc = hapi_error_set(err, HAPI_ECORRUPT,
                                "cache %s/data.mdb: an LMDB store that is not hapifs's", c->dir);
            goto fail_txn;
        }
        if (rc) {
            rc = hapi_error_set(err, lmdb_to_code(rc), "cache %s/data.mdb: %s", c->dir,
                                mdb_strerror(rc));
            goto fail_txn;
        }
        k = (MDB_val){ .mv_size = strlen(FORMAT_KEY), .mv_data = FORMAT_KEY };
        rc = mdb_get(txn, c->meta_dbi, &k, &v);
        if (rc && rc != MDB_NOTFOUND) {
            rc = hapi_error_set(err, lmdb_to_code(rc), "cache %s/data.mdb: %s", c->dir,
                                mdb_strerror(rc));
            goto fail_txn;
        }
        if (rc == MDB_NOTFOUND || v.mv_size != sizeof(record) ||
            memcmp(v.mv_data, FORMAT_MAGIC, FORMAT_MAGIC_SIZE) != 0) {
            rc = hapi_error_set(err, HAPI_ECORRUPT,
                                "cache %s/data.mdb: an LMDB store that is not hapifs's", c->dir);
            goto fail_txn;
        }
        version = get_le32((const uint8_t *)v.mv_data + FORMAT_MAGIC_SIZE);
        if (version != FORMAT_VERSION && version != 1 && version != 2) {
            rc = hapi_error_set(err, HAPI_ECORRUPT,
                                "cache %s/data.mdb: store format version %u, this hapifs reads %u",
                                c->dir, version, FORMAT_VERSION);
            goto fail_txn;
        }
    }

    if ((rc = mdb_dbi_open(txn, "features", MDB_CREATE, &c->features_dbi)) != 0 ||
        (rc = mdb_dbi_open(txn, "lru", MDB_CREATE, &c->lru_dbi)) != 0 ||
        (rc = mdb_dbi_open(txn, "stamps", MDB_CREATE, &c->stamps_dbi)) != 0 ||
        (rc = mdb_dbi_open(txn, "slots", MDB_CREATE, &c->slots_dbi)) != 0) {
        rc = hapi_error_set(err, lmdb_to_code(rc), "cache %s/data.mdb: databases: %s",
                            c->dir, mdb_strerror(rc));
        goto fail_txn;
    }
    /*
     * A version-2 store needs only the "slots" database, made above: its
     * inline values stay readable as they are.
     */
    if (version == 1)
        rc = upgrade_v1(c, txn);
    if (rc == 0 && version != FORMAT_VERSION) {
        k = (MDB_val){ .mv_size = strlen(FORMAT_KEY), .mv_data = FORMAT_KEY };
        v = (MDB_val){ .mv_size = sizeof(record), .mv_data = record };
        rc = mdb_put(txn, c->meta_dbi, &k, &v, 0);
    }
    if (rc) {
        rc = hapi_error_set(err, lmdb_to_code(rc), "cache %s: cannot upgrade a version-%u store: %s",
                            c->dir, version, mdb_strerror(rc));
        goto fail_txn;
    }
    /* Handles opened in a committed transaction stay valid for the environment's life. */
    rc = mdb_txn_commit(txn);
    if (rc) {
        rc = hapi_error_set(err, lmdb_to_code(rc), "cache %s: cannot commit: %s", c->dir,
                            mdb_strerror(rc));
        goto fail_begin;
    }
    return 0;

fail_txn:
    mdb_txn_abort(txn);
fail_begin:
    return rc;
}

/* Creates and opens c->env on c->dir; on failure c->env is NULL and err says why. */
static int env_open(hapi_cache *c, uint64_t max_bytes, int max_readers, hapi_error *err)
{
    const char *dir = c->dir;
    MDB_stat st;
    int rc;

    rc = mdb_env_create(&c->env);
    if (rc) {
        c->env = NULL;
        return hapi_error_set(err, HAPI_ECACHE, "cache %s: %s", dir, mdb_strerror(rc));
    }
    if ((rc = mdb_env_set_mapsize(c->env, (size_t)max_bytes)) != 0 ||
        (rc = mdb_env_set_maxreaders(c->env, (unsigned)max_readers)) != 0 ||
        (rc = mdb_env_set_maxdbs(c->env, MAX_DBS)) != 0) {
        rc = hapi_error_set(err, HAPI_ECACHE, "cache %s: %s", dir, mdb_strerror(rc));
        goto fail;
    }

    /*
     * MDB_NOTLS: FUSE serves lookups from a pool of worker threads and the
     *   value of a lookup is released after the reply, so reader slots must
     *   belong to transactions, not threads; it also lets us pool reset
     *   transactions and renew them from any thread.
     * MDB_NOSYNC: the store is a cache that can be rebuilt. Without a flush
     *   per commit a put costs no fsync. It costs no safety against a
     *   crash of the process (kill -9 at any moment): without MDB_WRITEMAP,
     *   LMDB writes a transaction's pages with write() to the file, then its
     *   meta page; whatever the kernel got is in the page cache, and a commit
     *   the process did not finish never reached the meta page, so a reopen
     *   sees the last finished commit, whole. Only a crash of the OS or the
     *   disk can lose recent commits (never integrity, since the meta page
     *   points only at pages LMDB does not reuse until two commits later);
     *   they are recomputed. close() flushes once.
     * MDB_NORDAHEAD: lookups come in the random order of shuffled epochs;
     *   readahead would fill the page cache with neighbouring entries no
     *   one asked for and push out the ones being read.
     */
    rc = mdb_env_open(c->env, dir, MDB_NOTLS | MDB_NOSYNC | MDB_NORDAHEAD, 0644);
    if (rc) {
        if (rc == MDB_INVALID || rc == MDB_VERSION_MISMATCH || rc == MDB_CORRUPTED)
            rc = hapi_error_set(err, HAPI_ECORRUPT, "cache %s/data.mdb: %s", dir,
                                mdb_strerror(rc));
        else if (rc > 0)
            rc = hapi_error_set(err, -rc, "cache %s: cannot open the LMDB store: %s", dir,
                                mdb_strerror(rc));
        else
            rc = hapi_error_set(err, HAPI_ECACHE, "cache %s: cannot open the LMDB store: %s",
                                dir, mdb_strerror(rc));
        goto fail;
    }
    /* A process that died inside a read leaves its slot taken, pinning old pages: free such slots. */
    rc = mdb_reader_check(c->env, &c->stale_readers_cleared);
    if (rc) {
        rc = hapi_error_set(err, HAPI_ECACHE, "cache %s: reader check: %s", dir,
                            mdb_strerror(rc));
        goto fail;
    }
    if (mdb_env_get_maxkeysize(c->env) < HAPI_CACHE__KEY_MAX) {
        rc = hapi_error_set(err, HAPI_ECACHE, "cache %s: LMDB keys limited to %d bytes, need %d",
                            dir, mdb_env_get_maxkeysize(c->env), HAPI_CACHE__KEY_MAX);
        goto fail;
    }
    mdb_env_stat(c->env, &st);
    c->psize = st.ms_psize;
    /* LMDB's me_nodemax: half a page's room, less an index slot, even. */
    c->node_max = (((c->psize - 16) / 2) & ~1u) - 2;
    rc = init_databases(c, err);
    if (rc)
        goto fail;
    return 0;

fail:
    mdb_env_close(c->env); /* also after a failed mdb_env_open, as LMDB requires */
    c->env = NULL;
    return rc;
}

/*
 * Replaces the store in dir by nothing, for a fresh one: data.mdb is kept
 * aside as data.mdb.reset, lock.mdb removed. LMDB holds a shared fcntl lock
 * on the first byte of lock.mdb in every process that has the store open:
 * if we cannot take it exclusively, the store is in use and stays.
 */
static int reset_store(const char *dir, hapi_error *err)
{
    char data[PATH_MAX], aside[PATH_MAX], lock[PATH_MAX];
    int fd, rc = 0;

    if (snprintf(data, sizeof(data), "%s/data.mdb", dir) >= (int)sizeof(data) ||
        snprintf(aside, sizeof(aside), "%s/data.mdb.reset", dir) >= (int)sizeof(aside) ||
        snprintf(lock, sizeof(lock), "%s/lock.mdb", dir) >= (int)sizeof(lock))
        return hapi_error_set(err, -ENAMETOOLONG, "cache %s: path too long", dir);
    fd = open(lock, O_RDWR | O_CLOEXEC);
    if (fd >= 0) {
        struct flock fl = { .l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1 };
        if (fcntl(fd, F_SETLK, &fl) != 0) {
            close(fd);
            return hapi_error_set(err, HAPI_ECORRUPT,
                                  "cache %s/data.mdb: cannot reset a store another process has open",
                                  dir);
        }
    }
    /* Removing files while holding the lock: no process can open the old store meanwhile. */
    if (rename(data, aside) != 0 && errno != ENOENT)
        rc = hapi_error_set(err, -errno, "cache %s: cannot move data.mdb aside: %s", dir,
                            strerror(errno));
    else if (unlink(lock) != 0 && errno != ENOENT)
        rc = hapi_error_set(err, -errno, "cache %s: cannot remove lock.mdb: %s", dir,
                            strerror(errno));
    if (fd >= 0)
        close(fd);
    return rc;
}

int hapi_cache_open(const char *dir, const hapi_cache_options *opt,
                    hapi_cache **out, hapi_error *err)
{
    hapi_cache *c = NULL;
    hapi_error e = { 0 };
    struct stat st;
    uint64_t max_bytes = opt && opt->max_bytes ? opt->max_bytes : DEFAULT_MAX_BYTES;
    int max_readers = opt && opt->max_readers > 0 ? opt->max_readers : DEFAULT_MAX_READERS;
    int rc;

    if (out)
        *out = NULL;
    if (!dir || !out)
        return hapi_error_set(err, HAPI_EINVAL, "cache: no directory given");

    /*
     * Check the directory ourselves first: LMDB would report a bare errno on
     * its lock file, and these are the mistakes an operator makes.
     */
    if (stat(dir, &st) != 0) {
        rc = -errno;
        return hapi_error_set(err, rc, "cache directory %s: %s", dir, strerror(-rc));
    }
    if (!S_ISDIR(st.st_mode))
        return hapi_error_set(err, -ENOTDIR, "cache directory %s: is not a directory", dir);
    if (access(dir, W_OK | X_OK) != 0) {
        rc = -errno;
        return hapi_error_set(err, rc, "cache directory %s: %s", dir, strerror(-rc));
    }

    c = calloc(1, sizeof(*c));
    if (!c) {
        rc = hapi_error_set(err, -ENOMEM, "cache %s: out of memory", dir);
        goto fail_alloc;
    }
    c->dir = strdup(dir);
    if (asprintf(&c->slab_dir, "%s/%s", dir, HAPI_CACHE__SLAB_DIR) < 0)
        c->slab_dir = NULL;
    c->pool_max = max_readers / 2 < POOL_MAX ? max_readers / 2 : POOL_MAX;
    c->pool = calloc((size_t)(c->pool_max > 0 ? c->pool_max : 1), sizeof(*c->pool));
    c->log = malloc(ACCESS_LOG_BYTES);
    c->drain = malloc(ACCESS_LOG_BYTES);
    if (!c->dir || !c->slab_dir || !c->pool || !c->log || !c->drain) {
        rc = hapi_error_set(err, -ENOMEM, "cache %s: out of memory", dir);
        goto fail_fields;
    }
    if (mkdir(c->slab_dir, 0755) != 0 && errno != EEXIST) {
        rc = -errno;
        hapi_error_set(err, rc, "cache directory %s: %s", c->slab_dir, strerror(-rc));
        goto fail_fields;
    }

    rc = hapi_cond_init_monotonic(&c->idle);
    if (rc) {
        rc = hapi_error_set(err, -rc, "cache %s: %s", dir, strerror(rc));
        goto fail_fields;
    }
    pthread_mutex_init(&c->pool_lock, NULL);
    pthread_mutex_init(&c->write_lock, NULL);
    pthread_mutex_init(&c->access_lock, NULL);
    pthread_mutex_init(&c->slab_lock, NULL);

    /* The map size is the store's bound; LMDB wants a multiple of the OS page size. */
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0)
        page = 4096;
    max_bytes = (max_bytes + (uint64_t)page - 1) / (uint64_t)page * (uint64_t)page;

    rc = env_open(c, max_bytes, max_readers, &e);
    if (rc == HAPI_ECORRUPT && opt && opt->reset) {
        rc = reset_store(dir, &e);
        if (rc == 0)
            rc = env_open(c, max_bytes, max_readers, &e);
        c->reset_at_open = rc == 0;
    }
    if (rc) {
        hapi_error_set(err, rc, "%s%s", e.message,
                       rc == HAPI_ECORRUPT ? "; use cache_reset=1 to replace it with an empty store"
                                           : "");
        goto fail_locks;
    }

    *out = c;
    return 0;

fail_locks:
    for (int i = 0; i < c->slab_count; i++)
        close(c->slabs[i].fd);
    pthread_mutex_destroy(&c->slab_lock);
    pthread_mutex_destroy(&c->access_lock);
    pthread_mutex_destroy(&c->write_lock);
    pthread_mutex_destroy(&c->pool_lock);
    pthread_cond_destroy(&c->idle);
fail_fields:
    free(c->drain);
    free(c->log);
    free(c->pool);
    free(c->slab_dir);
    free(c->dir);
    free(c);
fail_alloc:
    return rc;
}

void hapi_cache_close(hapi_cache *c)
{
    if (!c)
        return;
    /* Hits since the last write still count for the LRU order of the next run. */
    hapi_cache_flush_access(c, NULL);
    if (c->trim_pending) {
        /* The slab disk that the last evictions gave back: a write transaction that writes nothing. */
        MDB_txn *txn;
        if (write_begin(c, &txn, NULL) == 0)
            mdb_txn_abort(txn);
    }
    for (int i = 0; i < c->pool_count; i++)
        mdb_txn_abort(c->pool[i]);
    /* With MDB_NOSYNC nothing was flushed: a clean close makes the store durable. */
    mdb_env_sync(c->env, 1);
    mdb_env_close(c->env);
    /*
     * The slab files are not flushed: a slot that an OS crash loses fails its
     * checksum, a miss, as do LMDB's own lost commits.
     */
    for (int i = 0; i < c->slab_count; i++)
        close(c->slabs[i].fd);
    pthread_mutex_destroy(&c->slab_lock);
    pthread_mutex_destroy(&c->access_lock);
    pthread_mutex_destroy(&c->write_lock);
    pthread_mutex_destroy(&c->pool_lock);
    pthread_cond_destroy(&c->idle);
    free(c->drain);
    free(c->log);
    free(c->pool);
    free(c->slab_dir);
    free(c->dir);
    free(c);
}

/* ---- lookups ---- */

int hapi_cache_get(hapi_cache *c, const hapi_cache_namespace *ns, const char *path,
                   const hapi_source_id *id, hapi_cache_value *val)
{
    uint8_t keybuf[HAPI_CACHE__KEY_MAX];
    MDB_txn *txn;
    MDB_val k, v;
    enum check check = CHECK_ABSENT;
    int rc;

    if (val)
        *val = (hapi_cache_value){ 0 };
    if (!c || !ns || !path || !id || !val)
        return HAPI_EINVAL;

    uint64_t t0 = hapi_now_ns();
    k.mv_size = hapi_cache__key_make(ns, path, keybuf);
    k.mv_data = keybuf;
    bool hashed = strlen(path) > HAPI_CACHE_PATH_MAX;

    rc = read_begin(c, &txn);
    if (rc == 1) {
        val->miss = HAPI_CACHE_MISS_BUSY;
        count(&c->busy, 1);
        return 0;
    }
    if (rc) {
        count(&c->errors, 1);
        return lmdb_to_code(rc);
    }

    for (int attempt = 0;; attempt++) {
        struct slab_ref ref;
        uint8_t *buf = NULL;
        rc = mdb_get(txn, c->features_dbi, &k, &v);
        if (rc == 0)
            check = value_check(&v, id, path, hashed, &val->data, &val->size, &ref);
        if (rc == 0 && check == CHECK_OK) {
            /* The transaction pins the pages val->data points into until hapi_cache_release(). */
            val->txn_ = txn;
            note_access(c, keybuf, k.mv_size);
            count(&c->hits, 1);
            count(&c->hit_ns, hapi_now_ns() - t0);
            return 1;
        }
        if (rc != 0 || check != CHECK_SLAB)
            break;
        int r = slab_read(c, &v, &ref, val->size, &buf);
        if (r == CHECK_OK) {
            /* The bytes are ours: the snapshot can go now, the buffer until hapi_cache_release(). */
            read_end(c, txn);
            val->data = buf;
            val->buf_ = buf;
            note_access(c, keybuf, k.mv_size);
            count(&c->hits, 1);
            count(&c->hit_ns, hapi_now_ns() - t0);
            return 1;
        }
        if (r < 0) {
            read_end(c, txn);
            *val = (hapi_cache_value){ 0 };
            count(&c->errors, 1);
            return HAPI_ECACHE;
        }
        check = CHECK_BAD;
        if (attempt == SLAB_READ_RETRIES)
            break;
        /*
         * Most likely the entry was replaced or evicted and its slot reused
         * after this snapshot began: look again in a fresh one.
         */
        read_end(c, txn);
        rc = read_begin(c, &txn);
        if (rc == 1) {
            *val = (hapi_cache_value){ .miss = HAPI_CACHE_MISS_BUSY };
            count(&c->busy, 1);
            return 0;
        }
        if (rc) {
            *val = (hapi_cache_value){ 0 };
            count(&c->errors, 1);
            return lmdb_to_code(rc);
        }
        check = CHECK_ABSENT;
    }
    read_end(c, txn);
    val->data = NULL;
    val->size = 0;
    if (rc && rc != MDB_NOTFOUND) {
        /* MDB_CORRUPTED, MDB_PAGE_NOTFOUND, MDB_PANIC: HAPI_ECORRUPT, which the caller treats as a miss. */
        count(&c->errors, 1);
        return lmdb_to_code(rc);
    }
    switch (check) {
    case CHECK_STALE:
        val->miss = HAPI_CACHE_MISS_STALE;
        count(&c->stale, 1);
        break;
    case CHECK_BAD:
        val->miss = HAPI_CACHE_MISS_BAD;
        count(&c->bad, 1);
        break;
    default:
        val->miss = HAPI_CACHE_MISS_ABSENT;
        count(&c->misses, 1);
        break;
    }
    return 0;
}

void hapi_cache_release(hapi_cache *c, hapi_cache_value *val)
{
    if (!c || !val || (!val->txn_ && !val->buf_))
        return;
    if (val->txn_)
        read_end(c, val->txn_);
    free(val->buf_);
    *val = (hapi_cache_value){ 0 };
}

/* ---- puts ---- */

/*
 * Writes the items in txn and makes them the most recently used. A feature
 * of slab size is written to a slot taken in txn, before its index: a crash
 * before the commit leaves a slot that no committed entry names. The slots
 * of the values replaced are freed only after the batch took its own, so
 * that no slot a committed entry names is written before the commit. Returns
 * 0, an LMDB code, or an errno (the slab write's), with the index of the
 * failing item in *failed.
 */
static int put_items(hapi_cache *c, MDB_txn *txn, const hapi_cache_namespace *ns,
                     const hapi_cache_item *items, size_t n, uint64_t *stamp, size_t *failed)
{
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    uint64_t stored_ns = (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
    struct slab_ref *replaced = malloc(n * sizeof(*replaced));
    size_t n_replaced = 0;
    int rc = 0;

    if (!replaced)
        return ENOMEM;
    for (size_t i = 0; i < n; i++) {
        const hapi_cache_item *it = &items[i];
        uint8_t keybuf[HAPI_CACHE__KEY_MAX];
        size_t path_len = strlen(it->path);
        uint32_t stored_path_len = path_len > HAPI_CACHE_PATH_MAX ? (uint32_t)path_len : 0;
        size_t offset = HAPI_CACHE__HEADER_SIZE + pad16(stored_path_len);
        MDB_val k = { .mv_size = hapi_cache__key_make(ns, it->path, keybuf), .mv_data = keybuf };
        MDB_val old;
        struct slab_ref ref = { 0 };
        int fd = -1;

        *failed = i;
        /* The value replaced goes out of the LRU order; its slot, if any, is freed below. */
        rc = mdb_get(txn, c->features_dbi, &k, &old);
        if (rc == 0 && slab_ref_of(&old, &replaced[n_replaced]))
            rc = unlink_lru(c, txn, keybuf, k.mv_size, &replaced[n_replaced++]);
        else if (rc == 0 || rc == MDB_NOTFOUND)
            rc = unlink_lru(c, txn, keybuf, k.mv_size, NULL);
        if (rc)
            goto out;
        /* No slab file to be had (too many sizes, or it cannot be opened): inline, as small ones. */
        if (slab_sized(it->size)) {
            ref.slot_size = slot_size_of(it->size);
            fd = slab_fd(c, ref.slot_size, true);
        }
        if (fd >= 0) {
            if ((rc = slot_alloc(c, txn, ref.slot_size, &ref.slot)) != 0 ||
                (rc = write_full(fd, it->data, it->size,
                                 (off_t)(ref.slot * ref.slot_size))) != 0)
                goto out;
        }
        MDB_val v = { .mv_size = offset + (fd >= 0 ? HAPI_CACHE__SLAB_REF_SIZE : it->size),
                      .mv_data = NULL };
        /* MDB_RESERVE: build the value in place, in the page it will live in. */
        rc = mdb_put(txn, c->features_dbi, &k, &v, MDB_RESERVE);
        if (rc)
            goto out;
        uint8_t *p = v.mv_data;
        header_encode(p, &it->id, (uint32_t)it->size, stored_path_len, fd >= 0, stored_ns);
        /* Zero the padding too: reserved space is not initialized and would reach the file. */
        memset(p + HAPI_CACHE__HEADER_SIZE, 0, v.mv_size - HAPI_CACHE__HEADER_SIZE);
        memcpy(p + HAPI_CACHE__HEADER_SIZE, it->path, stored_path_len);
        if (fd >= 0) {
            put_le32(p + offset, ref.slot_size);
            put_le64(p + offset + 8, ref.slot);
            put_le64(p + offset + 16, *stamp); /* the stamp lru_append() gives it */
        } else if (it->size) {
            memcpy(p + offset, it->data, it->size);
        }
        put_le64(p + 56, value_checksum(p, p + HAPI_CACHE__HEADER_SIZE, stored_path_len,
                                        it->data, it->size));
        /* The newest entry: a slab entry's stamp is in its value, an inline one's in "stamps". */
        rc = lru_append(c, txn, &k, stamp, fd < 0);
        if (rc)
            goto out;
    }
    for (size_t i = 0; i < n_replaced && rc == 0; i++)
        rc = slot_free(c, txn, &replaced[i]);
out:
    free(replaced);
    return rc;
}

int hapi_cache_put(hapi_cache *c, const hapi_cache_namespace *ns,
                   const hapi_cache_item *items, size_t n, hapi_error *err)
{
    MDB_envinfo info;
    uint64_t need = 0, evicted = 0;
    size_t failed = 0;
    bool readers_checked = false, nothing_left = false;
    int rc;

    if (!c || !ns || (n && !items))
        return hapi_error_set(err, HAPI_EINVAL, "cache put: missing argument");
    /* Check every item before the transaction, so a bad one does not cost a half-written batch. */
    for (size_t i = 0; i < n; i++) {
        if (!items[i].path)
            return hapi_error_set(err, HAPI_EINVAL, "cache put: item %zu has no path", i);
        if (items[i].size && !items[i].data)
            return hapi_error_set(err, HAPI_EINVAL, "cache put: %s: no data", items[i].path);
        if (items[i].size > UINT32_MAX - 2 * HAPI_CACHE__HEADER_SIZE)
            return hapi_error_set(err, HAPI_EINVAL, "cache put: %s: %zu bytes is too large",
                                  items[i].path, items[i].size);
        size_t path_len = strlen(items[i].path);
        if (path_len > UINT32_MAX / 2)
            return hapi_error_set(err, HAPI_EINVAL, "cache put: path too long");
        need += hapi_cache_entry_bytes(c, path_len, items[i].size);
    }
    if (n == 0)
        return 0;

    pthread_mutex_lock(&c->write_lock);
    /* Beyond HIGH_PERCENT of the map no eviction makes room: the batch could never be stored. */
    mdb_env_info(c->env, &info);
    if (need > (uint64_t)info.me_mapsize / 100 * HIGH_PERCENT) {
        rc = hapi_error_set(err, HAPI_ECACHE,
                            "cache %s: too large: %zu entries (%llu bytes) can never fit a cache of "
                            "%llu bytes (cache_size)",
                            c->dir, n, (unsigned long long)need,
                            (unsigned long long)info.me_mapsize);
        goto out;
    }
    drain_take(c);

    /*
     * Evict first when the put would take the store past the high mark. The
     * same transaction applies the access log: each access rewrites about
     * three small LRU index records, pages that count as much as the values
     * (a full store after an epoch of hits jammed on exactly that).
     */
    uint64_t goal = 0;
    if (eviction_goal(c, need + 3 * (uint64_t)c->drain_used, &goal) == 0 && goal > 0) {
        if ((rc = evict(c, goal, &evicted, err)) != 0)
            goto out;
    }

    for (int attempt = 0;; attempt++) {
        MDB_txn *txn;
        uint64_t stamp = 0;
        bool applied = c->drain_used > 0;

        lmdb_free_pages_update(c);
        if ((rc = write_begin(c, &txn, err)) != 0)
            goto out;
        rc = stamp_first(c, txn, &stamp);
        if (rc == 0 && applied)
            rc = apply_accesses(c, txn, &stamp, NULL, SIZE_MAX);
        if (rc == 0)
            rc = put_items(c, txn, ns, items, n, &stamp, &failed);
        if (rc == 0 && atomic_load(&c->crash_before_commit))
            _exit(86);
        if (rc == 0) {
            rc = mdb_txn_commit(txn); /* a commit frees the transaction even when it fails */
        } else {
            /* MDB_MAP_FULL and other put errors leave the transaction unusable: drop the whole batch. */
            mdb_txn_abort(txn);
        }
        if (rc == 0) {
            if (applied)
                drain_done(c);
            break;
        }
        if (rc != MDB_MAP_FULL) {
            /* Errno values here are the disk's (ENOSPC, EIO): the store failed, the caller goes on uncached. */
            rc = hapi_error_set(err, rc > 0 ? HAPI_ECACHE : lmdb_to_code(rc),
                                "cache %s: put %s: %s", c->dir, items[failed].path,
                                mdb_strerror(rc));
            goto out;
        }
        /*
         * Full, though the estimate said there was room: the free pages are
         * in runs too short for a multi-page value, or pinned by a lookup
         * older than the eviction. Evict more each time and retry.
         */
        if (attempt >= PUT_RETRIES) {
            rc = hapi_error_set(err, HAPI_ECACHE,
                                "cache %s: cache full: no room for %zu entries (%llu bytes) after "
                                "evicting %s: lookups held for long pin the pages eviction frees, "
                                "or free space is split into runs shorter than a value (LMDB "
                                "does not compact; a value over ~half the map may not fit)",
                                c->dir, n, (unsigned long long)need,
                                nothing_left ? "every entry" : "repeatedly");
            goto out;
        }
        uint64_t more = (need << (attempt < 16 ? attempt : 16)) + info.me_mapsize / 32;
        if ((rc = evict(c, more, &evicted, err)) != 0)
            goto out;
        if (evicted == 0) {
            /* Nothing left to evict: wait for lookups to release pinned pages; clear dead readers' slots. */
            int dead = 0;
            nothing_left = true;
            if (!readers_checked) {
                mdb_reader_check(c->env, &dead);
                readers_checked = true;
            }
            full_wait(attempt);
        }
    }
    rc = 0;

out:
    pthread_mutex_unlock(&c->write_lock);
    return rc;
}

/* ---- maintenance ---- */

int hapi_cache_flush_access(hapi_cache *c, hapi_error *err)
{
    MDB_txn *txn;
    uint64_t stamp = 0, applied = 0, total = 0;
    int rc = 0;

    if (!c)
        return hapi_error_set(err, HAPI_EINVAL, "cache flush: missing argument");
    pthread_mutex_lock(&c->write_lock);
    drain_take(c);
    while (c->drain_used > 0) {
        if ((rc = write_begin(c, &txn, err)) != 0)
            goto out;
        rc = stamp_first(c, txn, &stamp);
        if (rc == 0)
            rc = apply_accesses(c, txn, &stamp, &applied, FLUSH_BATCH);
        if (rc == 0)
            rc = mdb_txn_commit(txn);
        else
            mdb_txn_abort(txn);
        if (rc) {
            rc = hapi_error_set(err, rc > 0 ? HAPI_ECACHE : lmdb_to_code(rc),
                                "cache %s: applying the access log: %s", c->dir,
                                mdb_strerror(rc));
            goto out;
        }
        drain_done(c);
        total += applied;
    }
    rc = total > INT32_MAX ? INT32_MAX : (int)total;
out:
    pthread_mutex_unlock(&c->write_lock);
    return rc;
}

/*
 * What a deletion the operator asked for does when it finds the map full
 * (write_lock held), as evict() does: the reusable pages are spent, the last
 * transaction's freed ones are locked until another commits, and lookups
 * held for long pin the rest. A write of a few pages unlocks the first
 * (once); then it waits for lookups to end, up to FULL_WAIT_MS in all.
 * Returns true to try again, false when there is no room even so.
 */
struct full_state {
    bool unlocked;
    int waits;
    uint64_t from;
};

static bool full_again(hapi_cache *c, struct full_state *f)
{
    if (!f->unlocked) {
        f->unlocked = true;
        bool full;
        hapi_error ignored = { 0 };
        if (persist_evictions(c, &full, &ignored) == 0 && !full)
            return true;
    }
    if (f->waits == 0)
        f->from = hapi_now_ns();
    if (hapi_now_ns() - f->from >= FULL_WAIT_MS * 1000000ULL)
        return false;
    full_wait(f->waits++);
    return true;
}

int hapi_cache_evict_path(hapi_cache *c, const hapi_cache_namespace *ns, const char *path,
                          hapi_error *err)
{
    uint8_t keybuf[HAPI_CACHE__KEY_MAX];
    MDB_txn *txn;
    struct full_state full = { 0 };
    int rc;

    if (!c || !ns || !path)
        return hapi_error_set(err, HAPI_EINVAL, "cache evict: missing argument");
    MDB_val k = { .mv_size = hapi_cache__key_make(ns, path, keybuf), .mv_data = keybuf };
    pthread_mutex_lock(&c->write_lock);
again:
    if ((rc = write_begin(c, &txn, err)) != 0)
        goto out;
    MDB_val v;
    struct slab_ref ref;
    bool slab = false;
    rc = mdb_get(txn, c->features_dbi, &k, &v);
    if (rc == 0) {
        slab = slab_ref_of(&v, &ref);
        rc = mdb_del(txn, c->features_dbi, &k, NULL);
    }
    if (rc == MDB_NOTFOUND) {
        mdb_txn_abort(txn);
        rc = 0;
        goto out;
    }
    if (rc == 0 && slab)
        rc = slot_free(c, txn, &ref);
    if (rc == 0)
        rc = unlink_lru(c, txn, keybuf, k.mv_size, slab ? &ref : NULL);
    if (rc == 0)
        rc = mdb_txn_commit(txn);
    else
        mdb_txn_abort(txn);
    if (rc == MDB_MAP_FULL && full_again(c, &full))
        goto again;
    if (rc) {
        rc = hapi_error_set(err, rc > 0 ? HAPI_ECACHE : lmdb_to_code(rc),
                            "cache %s: evict %s: %s", c->dir, path, mdb_strerror(rc));
        goto out;
    }
    rc = 1;
out:
    pthread_mutex_unlock(&c->write_lock);
    return rc;
}

/* Removes up to batch entries of ns in txn; *removed counts them, *done says the range is empty. */
static int remove_range(hapi_cache *c, MDB_txn *txn, const hapi_cache_namespace *ns,
                        unsigned batch, uint64_t *removed, bool *done)
{
    MDB_cursor *cur;
    MDB_val k, v;
    uint64_t n = 0;
    int rc = mdb_cursor_open(txn, c->features_dbi, &cur);
    if (rc)
        return rc;
    *done = false;
    while (n < batch) {
        uint8_t key[HAPI_CACHE__KEY_MAX];
        /* The namespace's first remaining entry: a fresh seek each time, simple and O(log n). */
        k = (MDB_val){ .mv_size = HAPI_CACHE_NAMESPACE_SIZE, .mv_data = (void *)ns->bytes };
        rc = mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE);
        if (rc)
            break;
        if (k.mv_size < HAPI_CACHE_NAMESPACE_SIZE || k.mv_size > sizeof(key) ||
            memcmp(k.mv_data, ns->bytes, HAPI_CACHE_NAMESPACE_SIZE) != 0) {
            rc = MDB_NOTFOUND;
            break;
        }
        size_t len = k.mv_size;
        memcpy(key, k.mv_data, len);
        struct slab_ref ref;
        bool slab = slab_ref_of(&v, &ref); /* copied before the deletion changes the page */
        if ((rc = mdb_cursor_del(cur, 0)) != 0 ||
            (rc = unlink_lru(c, txn, key, len, slab ? &ref : NULL)) != 0 ||
            (slab && (rc = slot_free(c, txn, &ref)) != 0))
            break;
        n++;
    }
    mdb_cursor_close(cur);
    *removed = n;
    if (rc == MDB_NOTFOUND) {
        *done = true;
        rc = 0;
    }
    return rc;
}

int hapi_cache_evict_all(hapi_cache *c, const hapi_cache_namespace *ns, hapi_error *err)
{
    MDB_txn *txn;
    uint64_t total = 0;
    bool done = false;
    unsigned batch = REMOVE_BATCH;
    struct full_state full = { 0 };
    int rc = 0;

    if (!c)
        return hapi_error_set(err, HAPI_EINVAL, "cache evict: missing argument");
    pthread_mutex_lock(&c->write_lock);
    while (!done) {
        uint64_t n = 0;
        if ((rc = write_begin(c, &txn, err)) != 0)
            goto out;
        if (!ns) {
            /* Everything: dropping whole databases frees their pages without walking the values. */
            MDB_stat st;
            rc = mdb_stat(txn, c->features_dbi, &st);
            n = rc == 0 ? st.ms_entries : 0;
            if (rc == 0)
                rc = mdb_drop(txn, c->features_dbi, 0);
            if (rc == 0)
                rc = mdb_drop(txn, c->lru_dbi, 0);
            if (rc == 0)
                rc = mdb_drop(txn, c->stamps_dbi, 0);
            if (rc == 0)
                rc = slab_clear(c, txn);
            done = true;
        } else {
            rc = remove_range(c, txn, ns, batch, &n, &done);
        }
        if (rc == 0)
            rc = mdb_txn_commit(txn);
        else
            mdb_txn_abort(txn);
        /* A full map: fewer deletions a transaction, then as hapi_cache_evict_path(). */
        if (rc == MDB_MAP_FULL && ns && batch > 1) {
            batch /= 2;
            done = false;
            continue;
        }
        if (rc == MDB_MAP_FULL && full_again(c, &full)) {
            done = false;
            continue;
        }
        if (rc) {
            rc = hapi_error_set(err, rc > 0 ? HAPI_ECACHE : lmdb_to_code(rc),
                                "cache %s: evicting %s: %s", c->dir,
                                ns ? "a namespace" : "everything", mdb_strerror(rc));
            goto out;
        }
        total += n;
        full = (struct full_state){ 0 };
    }
    rc = total > INT32_MAX ? INT32_MAX : (int)total;
out:
    pthread_mutex_unlock(&c->write_lock);
    return rc;
}

/* ---- statistics ---- */

int hapi_cache_stats_get(hapi_cache *c, hapi_cache_stats *st)
{
    MDB_txn *txn;
    MDB_stat ms, envst;
    MDB_envinfo info;
    MDB_val k, v;
    struct slab_totals slabs = { 0 };
    uint64_t free_pages = 0, total = 0;
    int rc;

    if (st)
        *st = (hapi_cache_stats){ 0 };
    if (!c || !st)
        return HAPI_EINVAL;
    rc = read_begin(c, &txn);
    if (rc == 1)
        return HAPI_ECACHE; /* the map is stale or being resized: try after the next put */
    if (rc)
        return lmdb_to_code(rc);
    /* All of these read the map: do it while the lookup keeps a remap away. */
    if ((rc = mdb_stat(txn, c->features_dbi, &ms)) == 0 &&
        (rc = mdb_env_info(c->env, &info)) == 0 &&
        (rc = mdb_env_stat(c->env, &envst)) == 0 &&
        (rc = slab_totals(c, txn, &slabs)) == 0)
        rc = count_free_pages(txn, &free_pages);
    if (rc == 0) {
        k = (MDB_val){ .mv_size = strlen(EVICTIONS_KEY), .mv_data = EVICTIONS_KEY };
        rc = mdb_get(txn, c->meta_dbi, &k, &v);
        if (rc == 0 && v.mv_size == 8)
            total = get_le64(v.mv_data);
        if (rc == MDB_NOTFOUND)
            rc = 0;
    }
    read_end(c, txn);
    if (rc)
        return lmdb_to_code(rc);
    st->entries = ms.ms_entries;
    st->bytes_used = ((uint64_t)info.me_last_pgno + 1) * envst.ms_psize + slabs.bytes;
    st->map_size = info.me_mapsize;
    st->bytes_free = free_pages * envst.ms_psize + slabs.free_bytes;
    st->hits = counter_get(&c->hits);
    st->misses = counter_get(&c->misses);
    st->stale = counter_get(&c->stale);
    st->bad = counter_get(&c->bad);
    st->busy = counter_get(&c->busy);
    st->errors = counter_get(&c->errors);
    st->hit_mean_us = st->hits ? (double)counter_get(&c->hit_ns) / (double)st->hits / 1000 : 0;
    st->evictions = counter_get(&c->evictions);
    st->evictions_total = total;
    st->accesses_dropped = counter_get(&c->accesses_dropped);
    st->reset_at_open = c->reset_at_open;
    return 0;
}

int hapi_cache_namespace_stats_get(hapi_cache *c, const hapi_cache_namespace *ns,
                                   hapi_cache_namespace_stats *st)
{
    MDB_txn *txn;
    MDB_cursor *cur;
    MDB_val k, v;
    hapi_cache_namespace_stats s = { 0 };
    int rc;

    if (st)
        *st = (hapi_cache_namespace_stats){ 0 };
    if (!c || !ns || !st)
        return HAPI_EINVAL;
    rc = read_begin(c, &txn);
    if (rc == 1)
        return HAPI_ECACHE;
    if (rc)
        return lmdb_to_code(rc);
    rc = mdb_cursor_open(txn, c->features_dbi, &cur);
    if (rc == 0) {
        /*
         * The leaf node holds a value's size: for values in overflow pages,
         * LMDB computes their address without reading them, so the walk
         * touches leaf pages only. A slab value is small, in its leaf: its
         * header says the feature's size.
         */
        k = (MDB_val){ .mv_size = HAPI_CACHE_NAMESPACE_SIZE, .mv_data = (void *)ns->bytes };
        MDB_cursor_op op = MDB_SET_RANGE;
        while ((rc = mdb_cursor_get(cur, &k, &v, op)) == 0) {
            op = MDB_NEXT;
            if (k.mv_size < HAPI_CACHE_NAMESPACE_SIZE ||
                memcmp(k.mv_data, ns->bytes, HAPI_CACHE_NAMESPACE_SIZE) != 0)
                break;
            s.entries++;
            struct slab_ref ref;
            if (slab_ref_of(&v, &ref))
                s.bytes += v.mv_size - HAPI_CACHE__SLAB_REF_SIZE +
                           get_le32((const uint8_t *)v.mv_data + 8);
            else
                s.bytes += v.mv_size;
        }
        mdb_cursor_close(cur);
        if (rc == MDB_NOTFOUND)
            rc = 0;
    }
    read_end(c, txn);
    if (rc)
        return lmdb_to_code(rc);
    *st = s;
    return 0;
}

/* ---- internals for tests ---- */

MDB_env *hapi_cache__env(hapi_cache *c) { return c->env; }
MDB_dbi hapi_cache__features_dbi(hapi_cache *c) { return c->features_dbi; }
int hapi_cache__stale_readers_cleared(const hapi_cache *c) { return c->stale_readers_cleared; }
uint64_t hapi_cache__evict_ns(hapi_cache *c) { return counter_get(&c->evict_ns); }
void hapi_cache__crash_before_commit(hapi_cache *c, int on) { atomic_store(&c->crash_before_commit, on); }

int hapi_cache__slot_of(hapi_cache *c, const hapi_cache_namespace *ns, const char *path,
                        uint32_t *slot_size, uint64_t *slot)
{
    uint8_t key[HAPI_CACHE__KEY_MAX];
    MDB_val k = { .mv_size = hapi_cache__key_make(ns, path, key), .mv_data = key }, v;
    MDB_txn *txn;
    struct slab_ref ref;
    int rc = read_begin(c, &txn);
    if (rc)
        return rc == 1 ? MDB_MAP_RESIZED : rc;
    rc = mdb_get(txn, c->features_dbi, &k, &v);
    if (rc == 0 && slab_ref_of(&v, &ref)) {
        *slot_size = ref.slot_size;
        *slot = ref.slot;
        rc = 1;
    } else if (rc == 0 || rc == MDB_NOTFOUND) {
        rc = 0;
    }
    read_end(c, txn);
    return rc;
}

/* check_index()'s walk of the slot sizes: every slot is free or named by exactly one entry. */
struct slot_check {
    hapi_cache *c;
    MDB_txn *txn;
    char *msg;
    size_t msg_size;
};

static int check_class(uint32_t slot_size, const struct slab_class *sc, void *arg)
{
    struct slot_check *k = arg;
    MDB_cursor *cur;
    MDB_val key, val;
    uint64_t n_free = 0, live = 0;
    uint8_t *seen = calloc(sc->high ? sc->high : 1, 1);
    int rc = seen ? mdb_cursor_open(k->txn, k->c->slots_dbi, &cur) : ENOMEM;
    if (rc) {
        free(seen);
        return rc;
    }
    for (rc = mdb_cursor_get(cur, &key, &val, MDB_FIRST); rc == 0;
         rc = mdb_cursor_get(cur, &key, &val, MDB_NEXT)) {
        uint32_t be;
        memcpy(&be, key.mv_data, 4);
        uint64_t slot = get_be64((const uint8_t *)key.mv_data + 4);
        if (be32toh(be) != slot_size)
            continue;
        if (slot >= sc->high) {
            snprintf(k->msg, k->msg_size, "slot size %u: free slot %llu past the end", slot_size,
                     (unsigned long long)slot);
            rc = -1;
            break;
        }
        seen[slot] = 1;
        n_free++;
    }
    mdb_cursor_close(cur);
    if (rc == MDB_NOTFOUND)
        rc = 0;
    if (rc == 0 && (rc = mdb_cursor_open(k->txn, k->c->features_dbi, &cur)) == 0) {
        for (rc = mdb_cursor_get(cur, &key, &val, MDB_FIRST); rc == 0;
             rc = mdb_cursor_get(cur, &key, &val, MDB_NEXT)) {
            struct slab_ref ref;
            if (!slab_ref_of(&val, &ref) || ref.slot_size != slot_size)
                continue;
            if (ref.slot >= sc->high || seen[ref.slot]) {
                snprintf(k->msg, k->msg_size, "slot size %u: slot %llu %s", slot_size,
                         (unsigned long long)ref.slot,
                         ref.slot >= sc->high ? "past the end" : "free or shared");
                rc = -1;
                break;
            }
            seen[ref.slot] = 1;
            live++;
        }
        mdb_cursor_close(cur);
        if (rc == MDB_NOTFOUND)
            rc = 0;
    }
    if (rc == 0 && (n_free != sc->free || n_free + live != sc->high)) {
        snprintf(k->msg, k->msg_size, "slot size %u: %llu slots, %llu live, %llu free (%llu said)",
                 slot_size, (unsigned long long)sc->high, (unsigned long long)live,
                 (unsigned long long)n_free, (unsigned long long)sc->free);
        rc = -1;
    }
    free(seen);
    return rc;
}

long hapi_cache__check_index(hapi_cache *c, char *msg, size_t msg_size)
{
    MDB_txn *txn;
    MDB_cursor *cur = NULL;
    MDB_stat f, l, s;
    MDB_val k, v, x;
    MDB_cursor_op op = MDB_FIRST;
    long result = -1;
    int rc;

    snprintf(msg, msg_size, "ok");
    if (read_begin(c, &txn) != 0) {
        snprintf(msg, msg_size, "cannot begin a read");
        return -1;
    }
    if ((rc = mdb_stat(txn, c->features_dbi, &f)) || (rc = mdb_stat(txn, c->lru_dbi, &l)) ||
        (rc = mdb_stat(txn, c->stamps_dbi, &s)) ||
        (rc = mdb_cursor_open(txn, c->lru_dbi, &cur))) {
        snprintf(msg, msg_size, "%s", mdb_strerror(rc));
        goto out;
    }
    if (f.ms_entries != l.ms_entries) {
        snprintf(msg, msg_size, "features %zu, lru %zu entries", f.ms_entries, l.ms_entries);
        goto out;
    }
    struct slot_check sk = { c, txn, msg, msg_size };
    if ((rc = class_each(c, txn, check_class, &sk)) != 0) {
        if (rc != -1)
            snprintf(msg, msg_size, "slots: %s", mdb_strerror(rc));
        goto out;
    }
    size_t inline_entries = 0;
    while ((rc = mdb_cursor_get(cur, &k, &v, op)) == 0) {
        struct slab_ref ref;
        op = MDB_NEXT;
        if (mdb_get(txn, c->features_dbi, &v, &x) != 0) {
            snprintf(msg, msg_size, "an lru record without its feature");
            goto out;
        }
        if (slab_ref_of(&x, &ref)) {
            if (k.mv_size != HAPI_CACHE__STAMP_SIZE || ref.stamp != get_be64(k.mv_data)) {
                snprintf(msg, msg_size, "an lru record whose slab entry has another stamp");
                goto out;
            }
            continue;
        }
        inline_entries++;
        if (mdb_get(txn, c->stamps_dbi, &v, &x) != 0 || x.mv_size != k.mv_size ||
            memcmp(x.mv_data, k.mv_data, k.mv_size) != 0) {
            snprintf(msg, msg_size, "an lru record whose stamp differs");
            goto out;
        }
    }
    if (s.ms_entries != inline_entries) {
        snprintf(msg, msg_size, "%zu stamps for %zu inline entries", s.ms_entries,
                 inline_entries);
        goto out;
    }
    result = (long)f.ms_entries;
out:
    if (cur)
        mdb_cursor_close(cur);
    read_end(c, txn);
    return result;
}

/* cache.c — the LMDB feature store: namespaces, keys, checked values, pooled read transactions, batched puts. */
#include "cache.h"
#include "cache-int.h"

#include <endian.h>
#include <errno.h>
#include <lmdb.h>
#include <pthread.h>
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
#define FORMAT_VERSION 1

/*
 * Named databases: "meta" (the format marker), "features" (the entries) and
 * room for two more, such as the "lru" index that eviction will add. Values
 * are never rewritten to record an access (that would copy their pages): an
 * LRU index lives in its own database, keyed by an access stamp and pointing
 * at feature keys, updated in batches by one writer; the put time in each
 * header gives it a starting order. Keys begin with the namespace, so the
 * entries of one configuration are contiguous and can be dropped as a range.
 */
#define MAX_DBS 4

#define DEFAULT_MAX_BYTES (UINT64_C(1) << 30)
#define DEFAULT_MAX_READERS 512

/* Pooled read transactions keep their reader slot; leave most slots to bursts and other processes. */
#define POOL_MAX 64

/* How long a put waits for outstanding lookups to end before it adopts another process's map size. */
#define REMAP_WAIT_NS (UINT64_C(5) * 1000000000u)

struct hapi_cache {
    MDB_env *env;
    MDB_dbi meta_dbi;
    MDB_dbi features_dbi;
    char *dir;
    int stale_readers_cleared;

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
     * Serializes puts in this process. LMDB serializes writers already; this
     * lock also makes sure no write transaction of ours is open while a put
     * adopts a new map size.
     */
    pthread_mutex_t write_lock;
};

/* ---- little-endian encoding ---- */

static void put_le16(uint8_t *p, uint16_t v) { v = htole16(v); memcpy(p, &v, 2); }
static void put_le32(uint8_t *p, uint32_t v) { v = htole32(v); memcpy(p, &v, 4); }
static void put_le64(uint8_t *p, uint64_t v) { v = htole64(v); memcpy(p, &v, 8); }
static uint16_t get_le16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return le16toh(v); }
static uint32_t get_le32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return le32toh(v); }
static uint64_t get_le64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return le64toh(v); }

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
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < HAPI_CACHE_NAMESPACE_SIZE; i++) {
        hex[2 * i] = digits[ns->bytes[i] >> 4];
        hex[2 * i + 1] = digits[ns->bytes[i] & 0xf];
    }
    hex[32] = '\0';
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
                          uint32_t data_len, uint32_t path_len, uint64_t stored_ns)
{
    put_le32(h + 0, HAPI_CACHE__MAGIC);
    put_le16(h + 4, HAPI_CACHE__VERSION);
    put_le16(h + 6, path_len ? HAPI_CACHE__FLAG_HASHED_KEY : 0);
    put_le32(h + 8, data_len);
    put_le32(h + 12, path_len);
    put_le64(h + 16, id->size);
    put_le64(h + 24, (uint64_t)id->mtime_ns);
    put_le64(h + 32, (uint64_t)id->ctime_ns);
    put_le64(h + 40, id->ino);
    put_le64(h + 48, stored_ns);
    put_le64(h + 56, 0);
}

/*
 * Checks a stored value against the lookup: format, identity, the full path
 * for hashed keys, lengths, checksum. On success points *data and *size at the
 * feature bytes inside v. Any mismatch is false: the caller treats it as a
 * miss, and the next put of the path replaces the entry.
 */
static bool value_check(const MDB_val *v, const hapi_source_id *id, const char *path,
                        bool hashed, const void **data, size_t *size)
{
    const uint8_t *p = v->mv_data;
    if (v->mv_size < HAPI_CACHE__HEADER_SIZE)
        return false;
    if (get_le32(p + 0) != HAPI_CACHE__MAGIC || get_le16(p + 4) != HAPI_CACHE__VERSION)
        return false;
    uint16_t flags = get_le16(p + 6);
    uint32_t data_len = get_le32(p + 8);
    uint32_t path_len = get_le32(p + 12);
    if (get_le64(p + 16) != id->size || (int64_t)get_le64(p + 24) != id->mtime_ns ||
        (int64_t)get_le64(p + 32) != id->ctime_ns || get_le64(p + 40) != id->ino)
        return false;
    if (hashed != ((flags & HAPI_CACHE__FLAG_HASHED_KEY) != 0))
        return false;
    if (hashed) {
        size_t len = strlen(path);
        if (path_len != len || v->mv_size < HAPI_CACHE__HEADER_SIZE + (size_t)path_len ||
            memcmp(p + HAPI_CACHE__HEADER_SIZE, path, len) != 0)
            return false;
    } else if (path_len != 0) {
        return false;
    }
    size_t offset = HAPI_CACHE__HEADER_SIZE + pad16(path_len);
    if (v->mv_size != offset + (size_t)data_len)
        return false;
    if (value_checksum(p, p + HAPI_CACHE__HEADER_SIZE, path_len, p + offset, data_len) !=
        get_le64(p + 56))
        return false;
    *data = p + offset;
    *size = data_len;
    return true;
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

/* ---- open and close ---- */

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
        uint32_t version = get_le32((const uint8_t *)v.mv_data + FORMAT_MAGIC_SIZE);
        if (version != FORMAT_VERSION) {
            rc = hapi_error_set(err, HAPI_ECORRUPT,
                                "cache %s/data.mdb: store format version %u, this hapifs reads %u",
                                c->dir, version, FORMAT_VERSION);
            goto fail_txn;
        }
    }

    rc = mdb_dbi_open(txn, "features", MDB_CREATE, &c->features_dbi);
    if (rc) {
        rc = hapi_error_set(err, lmdb_to_code(rc), "cache %s/data.mdb: features database: %s",
                            c->dir, mdb_strerror(rc));
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

int hapi_cache_open(const char *dir, const hapi_cache_options *opt,
                    hapi_cache **out, hapi_error *err)
{
    hapi_cache *c = NULL;
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
    c->pool_max = max_readers / 2 < POOL_MAX ? max_readers / 2 : POOL_MAX;
    c->pool = calloc((size_t)(c->pool_max > 0 ? c->pool_max : 1), sizeof(*c->pool));
    if (!c->dir || !c->pool) {
        rc = hapi_error_set(err, -ENOMEM, "cache %s: out of memory", dir);
        goto fail_fields;
    }

    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    rc = pthread_cond_init(&c->idle, &ca);
    pthread_condattr_destroy(&ca);
    if (rc) {
        rc = hapi_error_set(err, -rc, "cache %s: %s", dir, strerror(rc));
        goto fail_fields;
    }
    pthread_mutex_init(&c->pool_lock, NULL);
    pthread_mutex_init(&c->write_lock, NULL);

    rc = mdb_env_create(&c->env);
    if (rc) {
        rc = hapi_error_set(err, HAPI_ECACHE, "cache %s: %s", dir, mdb_strerror(rc));
        goto fail_locks;
    }
    /* The map size is the store's bound; LMDB wants a multiple of the OS page size. */
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0)
        page = 4096;
    max_bytes = (max_bytes + (uint64_t)page - 1) / (uint64_t)page * (uint64_t)page;
    if ((rc = mdb_env_set_mapsize(c->env, (size_t)max_bytes)) != 0 ||
        (rc = mdb_env_set_maxreaders(c->env, (unsigned)max_readers)) != 0 ||
        (rc = mdb_env_set_maxdbs(c->env, MAX_DBS)) != 0) {
        rc = hapi_error_set(err, HAPI_ECACHE, "cache %s: %s", dir, mdb_strerror(rc));
        goto fail_env;
    }

    /*
     * MDB_NOTLS: FUSE serves lookups from a pool of worker threads and the
     *   value of a lookup is released after the reply, so reader slots must
     *   belong to transactions, not threads; it also lets us pool reset
     *   transactions and renew them from any thread.
     * MDB_NOSYNC: the store is a cache that can be rebuilt. Without a flush
     *   per commit a put costs no fsync; LMDB (without MDB_WRITEMAP) keeps
     *   its integrity, and an OS crash can only lose recent entries, which
     *   are recomputed. close() flushes once.
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
        goto fail_env;
    }
    /* A process that died inside a read leaves its slot taken, pinning old pages: free such slots. */
    rc = mdb_reader_check(c->env, &c->stale_readers_cleared);
    if (rc) {
        rc = hapi_error_set(err, HAPI_ECACHE, "cache %s: reader check: %s", dir,
                            mdb_strerror(rc));
        goto fail_env;
    }
    if (mdb_env_get_maxkeysize(c->env) < HAPI_CACHE__KEY_MAX) {
        rc = hapi_error_set(err, HAPI_ECACHE, "cache %s: LMDB keys limited to %d bytes, need %d",
                            dir, mdb_env_get_maxkeysize(c->env), HAPI_CACHE__KEY_MAX);
        goto fail_env;
    }
    rc = init_databases(c, err);
    if (rc)
        goto fail_env;

    *out = c;
    return 0;

fail_env:
    mdb_env_close(c->env); /* also after a failed mdb_env_open, as LMDB requires */
fail_locks:
    pthread_mutex_destroy(&c->write_lock);
    pthread_mutex_destroy(&c->pool_lock);
    pthread_cond_destroy(&c->idle);
fail_fields:
    free(c->pool);
    free(c->dir);
    free(c);
fail_alloc:
    return rc;
}

void hapi_cache_close(hapi_cache *c)
{
    if (!c)
        return;
    for (int i = 0; i < c->pool_count; i++)
        mdb_txn_abort(c->pool[i]);
    /* With MDB_NOSYNC nothing was flushed: a clean close makes the store durable. */
    mdb_env_sync(c->env, 1);
    mdb_env_close(c->env);
    pthread_mutex_destroy(&c->write_lock);
    pthread_mutex_destroy(&c->pool_lock);
    pthread_cond_destroy(&c->idle);
    free(c->pool);
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
    int rc;

    if (val)
        *val = (hapi_cache_value){ 0 };
    if (!c || !ns || !path || !id || !val)
        return HAPI_EINVAL;

    k.mv_size = hapi_cache__key_make(ns, path, keybuf);
    k.mv_data = keybuf;
    bool hashed = strlen(path) > HAPI_CACHE_PATH_MAX;

    rc = read_begin(c, &txn);
    if (rc == 1)
        return 0;
    if (rc)
        return lmdb_to_code(rc);

    rc = mdb_get(txn, c->features_dbi, &k, &v);
    if (rc == 0 && value_check(&v, id, path, hashed, &val->data, &val->size)) {
        /* The transaction pins the pages val->data points into until hapi_cache_release(). */
        val->txn_ = txn;
        return 1;
    }
    read_end(c, txn);
    val->data = NULL;
    val->size = 0;
    if (rc == 0 || rc == MDB_NOTFOUND)
        return 0;
    return lmdb_to_code(rc);
}

void hapi_cache_release(hapi_cache *c, hapi_cache_value *val)
{
    if (!c || !val || !val->txn_)
        return;
    read_end(c, val->txn_);
    *val = (hapi_cache_value){ 0 };
}

/* ---- puts ---- */

static int put_items(hapi_cache *c, MDB_txn *txn, const hapi_cache_namespace *ns,
                     const hapi_cache_item *items, size_t n, hapi_error *err)
{
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    uint64_t stored_ns = (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;

    for (size_t i = 0; i < n; i++) {
        const hapi_cache_item *it = &items[i];
        uint8_t keybuf[HAPI_CACHE__KEY_MAX];
        size_t path_len = strlen(it->path);
        uint32_t stored_path_len = path_len > HAPI_CACHE_PATH_MAX ? (uint32_t)path_len : 0;
        size_t offset = HAPI_CACHE__HEADER_SIZE + pad16(stored_path_len);
        MDB_val k = { .mv_size = hapi_cache__key_make(ns, it->path, keybuf), .mv_data = keybuf };
        MDB_val v = { .mv_size = offset + it->size, .mv_data = NULL };
        int rc;

        /* MDB_RESERVE: build the value in place, in the page it will live in. */
        rc = mdb_put(txn, c->features_dbi, &k, &v, MDB_RESERVE);
        if (rc == MDB_MAP_FULL)
            return hapi_error_set(err, HAPI_ECACHE, "cache %s: cache full (%s)", c->dir,
                                  mdb_strerror(rc));
        if (rc)
            return hapi_error_set(err, lmdb_to_code(rc), "cache %s: put %s: %s", c->dir,
                                  it->path, mdb_strerror(rc));
        uint8_t *p = v.mv_data;
        header_encode(p, &it->id, (uint32_t)it->size, stored_path_len, stored_ns);
        /* Zero the padding too: reserved space is not initialized and would reach the file. */
        memset(p + HAPI_CACHE__HEADER_SIZE, 0, offset - HAPI_CACHE__HEADER_SIZE);
        memcpy(p + HAPI_CACHE__HEADER_SIZE, it->path, stored_path_len);
        if (it->size)
            memcpy(p + offset, it->data, it->size);
        put_le64(p + 56, value_checksum(p, p + HAPI_CACHE__HEADER_SIZE, stored_path_len,
                                        p + offset, it->size));
    }
    return 0;
}

int hapi_cache_put(hapi_cache *c, const hapi_cache_namespace *ns,
                   const hapi_cache_item *items, size_t n, hapi_error *err)
{
    MDB_txn *txn = NULL;
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
        if (strlen(items[i].path) > UINT32_MAX / 2)
            return hapi_error_set(err, HAPI_EINVAL, "cache put: path too long");
    }
    if (n == 0)
        return 0;

    pthread_mutex_lock(&c->write_lock);
    rc = mdb_txn_begin(c->env, NULL, 0, &txn);
    if (rc == MDB_MAP_RESIZED) {
        /* Another process grew the store: adopt its map size, once. */
        rc = remap(c);
        if (rc) {
            rc = hapi_error_set(err, HAPI_ECACHE,
                                "cache %s: cannot adopt the map size another process set: %s",
                                c->dir, rc == EBUSY ? "lookups still held" : mdb_strerror(rc));
            goto fail_begin;
        }
        rc = mdb_txn_begin(c->env, NULL, 0, &txn);
    }
    if (rc) {
        rc = hapi_error_set(err, lmdb_to_code(rc), "cache %s: cannot begin a write: %s",
                            c->dir, mdb_strerror(rc));
        goto fail_begin;
    }

    rc = put_items(c, txn, ns, items, n, err);
    if (rc)
        goto fail_txn;

    rc = mdb_txn_commit(txn);
    txn = NULL; /* a commit frees the transaction even when it fails */
    if (rc == MDB_MAP_FULL) {
        rc = hapi_error_set(err, HAPI_ECACHE, "cache %s: cache full (%s)", c->dir,
                            mdb_strerror(rc));
        goto fail_begin;
    }
    if (rc) {
        /* Errno values here are the disk's (ENOSPC, EIO): the store failed, the caller goes on uncached. */
        rc = hapi_error_set(err, rc > 0 ? HAPI_ECACHE : lmdb_to_code(rc), "cache %s: commit: %s",
                            c->dir, mdb_strerror(rc));
        goto fail_begin;
    }
    pthread_mutex_unlock(&c->write_lock);
    return 0;

fail_txn:
    /* MDB_MAP_FULL and other put errors leave the transaction unusable: drop the whole batch. */
    mdb_txn_abort(txn);
fail_begin:
    pthread_mutex_unlock(&c->write_lock);
    return rc;
}

/* ---- statistics ---- */

int hapi_cache_stats_get(hapi_cache *c, hapi_cache_stats *st)
{
    MDB_txn *txn;
    MDB_stat ms, envst;
    MDB_envinfo info;
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
    /* All three read the map: do it while the lookup keeps a remap away. */
    if ((rc = mdb_stat(txn, c->features_dbi, &ms)) == 0 &&
        (rc = mdb_env_info(c->env, &info)) == 0)
        rc = mdb_env_stat(c->env, &envst);
    read_end(c, txn);
    if (rc)
        return lmdb_to_code(rc);
    st->entries = ms.ms_entries;
    st->bytes_used = ((uint64_t)info.me_last_pgno + 1) * envst.ms_psize;
    st->map_size = info.me_mapsize;
    return 0;
}

/* ---- internals for tests ---- */

MDB_env *hapi_cache__env(hapi_cache *c) { return c->env; }
MDB_dbi hapi_cache__features_dbi(hapi_cache *c) { return c->features_dbi; }
int hapi_cache__stale_readers_cleared(const hapi_cache *c) { return c->stale_readers_cleared; }

/* get.c — lookups: hapi_cache_get() and hapi_cache_release(). */
#include "cache-priv.h"

#include <stdlib.h>
#include <string.h>

/*
 * A slab read whose checksum fails is looked up again in a fresh snapshot,
 * this many times: the entry was most likely replaced or evicted, and its
 * slot reused, between the index read and the slab read.
 */
#define SLAB_READ_RETRIES 3

/* Counts a hit on key, begun at t0 (ns), and notes it for the LRU order. */
static void hit(hapi_cache *c, const uint8_t *key, size_t key_len, uint64_t t0)
{
    hapi_cache__note_access(c, key, key_len);
    count(&c->hits, 1);
    count(&c->hit_ns, hapi_now_ns() - t0);
}

/* Counts a miss whose stored value compared as check; returns its kind. */
static int miss(hapi_cache *c, enum check check)
{
    switch (check) {
    case CHECK_STALE:
        count(&c->stale, 1);
        return HAPI_CACHE_MISS_STALE;
    case CHECK_BAD:
        count(&c->bad, 1);
        return HAPI_CACHE_MISS_BAD;
    default:
        count(&c->misses, 1);
        return HAPI_CACHE_MISS_ABSENT;
    }
}

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

    rc = hapi_cache__read_begin(c, &txn);
    if (rc == 1) {
        val->miss = HAPI_CACHE_MISS_BUSY;
        count(&c->busy, 1);
        return 0;
    }
    if (rc) {
        count(&c->errors, 1);
        return hapi_cache__lmdb_to_code(rc);
    }

    for (int attempt = 0;; attempt++) {
        struct slab_ref ref;
        uint8_t *buf = NULL;
        rc = mdb_get(txn, c->features_dbi, &k, &v);
        if (rc == 0)
            check = hapi_cache__value_check(&v, id, path, hashed, &val->data, &val->size, &ref);
        if (rc == 0 && check == CHECK_OK) {
            /* The transaction pins the pages val->data points into until hapi_cache_release(). */
            val->txn_ = txn;
            hit(c, keybuf, k.mv_size, t0);
            return 1;
        }
        if (rc != 0 || check != CHECK_SLAB)
            break;
        int r = hapi_cache__slab_read(c, &v, &ref, val->size, &buf);
        if (r == CHECK_OK) {
            /* The bytes are ours: the snapshot can go now, the buffer until hapi_cache_release(). */
            hapi_cache__read_end(c, txn);
            val->data = buf;
            val->buf_ = buf;
            hit(c, keybuf, k.mv_size, t0);
            return 1;
        }
        if (r < 0) {
            hapi_cache__read_end(c, txn);
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
        hapi_cache__read_end(c, txn);
        rc = hapi_cache__read_begin(c, &txn);
        if (rc == 1) {
            *val = (hapi_cache_value){ .miss = HAPI_CACHE_MISS_BUSY };
            count(&c->busy, 1);
            return 0;
        }
        if (rc) {
            *val = (hapi_cache_value){ 0 };
            count(&c->errors, 1);
            return hapi_cache__lmdb_to_code(rc);
        }
        check = CHECK_ABSENT;
    }
    hapi_cache__read_end(c, txn);
    val->data = NULL;
    val->size = 0;
    if (rc && rc != MDB_NOTFOUND) {
        /* MDB_CORRUPTED, MDB_PAGE_NOTFOUND, MDB_PANIC: HAPI_ECORRUPT, which the caller treats as a miss. */
        count(&c->errors, 1);
        return hapi_cache__lmdb_to_code(rc);
    }
    val->miss = miss(c, check);
    return 0;
}

void hapi_cache_release(hapi_cache *c, hapi_cache_value *val)
{
    if (!c || !val || (!val->txn_ && !val->buf_))
        return;
    if (val->txn_)
        hapi_cache__read_end(c, val->txn_);
    free(val->buf_);
    *val = (hapi_cache_value){ 0 };
}

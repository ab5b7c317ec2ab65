/* maintenance.c — maintenance: applying the access log, and the deletions an operator asks for (one path, a namespace, everything). */
#include "cache-priv.h"

#include <pthread.h>
#include <string.h>

/* Entries removed per write transaction by hapi_cache_evict_all(). */
#define REMOVE_BATCH 4096

/*
 * Accesses applied per write transaction by hapi_cache_flush_access(). Each
 * access copies a leaf page or two of the LRU index, and pages a write frees
 * are reused only two writes later: the file grows by what about two writes
 * copy. Measured with 100,000 entries of 1,152 bytes and 400,000 random hits
 * flushed every 2,000: the store grew by 34 MB with the whole log in one
 * write, 14 MB with 256 accesses a write, 10.5 MB with 64.
 */
#define FLUSH_BATCH 64

int hapi_cache_flush_access(hapi_cache *c, hapi_error *err)
{
    MDB_txn *txn;
    uint64_t stamp = 0, applied = 0, total = 0;
    int rc = 0;

    if (!c)
        return hapi_error_set(err, HAPI_EINVAL, "cache flush: missing argument");
    pthread_mutex_lock(&c->write_lock);
    hapi_cache__drain_take(c);
    while (c->drain_used > 0) {
        if ((rc = hapi_cache__write_begin(c, &txn, err)) != 0)
            goto out;
        rc = hapi_cache__stamp_first(c, txn, &stamp);
        if (rc == 0)
            rc = hapi_cache__apply_accesses(c, txn, &stamp, &applied, FLUSH_BATCH);
        if (rc == 0)
            rc = mdb_txn_commit(txn);
        else
            mdb_txn_abort(txn);
        if (rc) {
            rc = hapi_error_set(err, rc > 0 ? HAPI_ECACHE : hapi_cache__lmdb_to_code(rc),
                                "cache %s: applying the access log: %s", c->dir,
                                mdb_strerror(rc));
            goto out;
        }
        hapi_cache__drain_done(c);
        total += applied;
    }
    rc = total > INT32_MAX ? INT32_MAX : (int)total;
out:
    pthread_mutex_unlock(&c->write_lock);
    return rc;
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
    if ((rc = hapi_cache__write_begin(c, &txn, err)) != 0)
        goto out;
    MDB_val v;
    struct slab_ref ref;
    bool slab = false;
    rc = mdb_get(txn, c->features_dbi, &k, &v);
    if (rc == 0) {
        slab = hapi_cache__slab_ref_of(&v, &ref);
        rc = mdb_del(txn, c->features_dbi, &k, NULL);
    }
    if (rc == MDB_NOTFOUND) {
        mdb_txn_abort(txn);
        rc = 0;
        goto out;
    }
    if (rc == 0 && slab)
        rc = hapi_cache__slot_free(c, txn, &ref);
    if (rc == 0)
        rc = hapi_cache__unlink_lru(c, txn, keybuf, k.mv_size, slab ? &ref : NULL);
    if (rc == 0)
        rc = mdb_txn_commit(txn);
    else
        mdb_txn_abort(txn);
    /* The map full: as hapi_cache__evict() does (hapi_cache__full_again()). */
    if (rc == MDB_MAP_FULL) {
        int again = hapi_cache__full_again(c, &full, err);
        if (again > 0)
            goto again;
        if (again < 0) {
            rc = again;
            goto out;
        }
    }
    if (rc) {
        rc = hapi_error_set(err, rc > 0 ? HAPI_ECACHE : hapi_cache__lmdb_to_code(rc),
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
        /* Copied before the deletion changes the page. */
        bool slab = hapi_cache__slab_ref_of(&v, &ref);
        if ((rc = mdb_cursor_del(cur, 0)) != 0 ||
            (rc = hapi_cache__unlink_lru(c, txn, key, len, slab ? &ref : NULL)) != 0 ||
            (slab && (rc = hapi_cache__slot_free(c, txn, &ref)) != 0))
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
        if ((rc = hapi_cache__write_begin(c, &txn, err)) != 0)
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
                rc = hapi_cache__slab_clear(c, txn);
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
        if (rc == MDB_MAP_FULL) {
            int again = hapi_cache__full_again(c, &full, err);
            if (again < 0) {
                rc = again;
                goto out;
            }
            if (again > 0) {
                done = false;
                continue;
            }
        }
        if (rc) {
            rc = hapi_error_set(err, rc > 0 ? HAPI_ECACHE : hapi_cache__lmdb_to_code(rc),
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

/* lru.c — the LRU order: the access log that hits fill, and the "lru" and "stamps" index it is applied to. */
#include "cache-priv.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

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

/* ---- the access log ---- */

/* Notes a hit on key. Called by lookups; never blocks on LMDB. */
void hapi_cache__note_access(hapi_cache *c, const uint8_t *key, size_t len)
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
void hapi_cache__drain_take(hapi_cache *c)
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
int hapi_cache__lru_append(hapi_cache *c, MDB_txn *txn, MDB_val *k, uint64_t *stamp, bool in_stamps)
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
int hapi_cache__stamp_first(hapi_cache *c, MDB_txn *txn, uint64_t *stamp)
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
int hapi_cache__touch(hapi_cache *c, MDB_txn *txn, const void *key, size_t key_len,
                      uint64_t *stamp, bool must_exist, uint64_t recent_from)
{
    MDB_val k = { .mv_size = key_len, .mv_data = (void *)key }, v, old;
    struct slab_ref ref;
    int rc;

    rc = mdb_get(txn, c->features_dbi, &k, &v);
    if (rc == 0 && hapi_cache__slab_ref_of(&v, &ref)) {
        if (recent_from && ref.stamp >= recent_from)
            return 0;
        if ((rc = drop_lru_stamp(c, txn, ref.stamp)) != 0 ||
            (rc = value_stamp_set(c, txn, &k, &v, *stamp)) != 0)
            return rc;
        return hapi_cache__lru_append(c, txn, &k, stamp, false);
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
    return hapi_cache__lru_append(c, txn, &k, stamp, true);
}

/*
 * Deletes the LRU records of key's entry, if any: its "lru" record, which
 * ref (a slab entry's reference, copied before the entry was deleted) or the
 * "stamps" record names, and that "stamps" record.
 */
int hapi_cache__unlink_lru(hapi_cache *c, MDB_txn *txn, const void *key, size_t key_len,
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
 * The log moves on only once txn commits (hapi_cache__drain_done), so a failed write
 * leaves it for the next.
 */
int hapi_cache__apply_accesses(hapi_cache *c, MDB_txn *txn, uint64_t *stamp, uint64_t *applied,
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
        int rc = hapi_cache__touch(c, txn, key, len, stamp, true, recent_from);
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

void hapi_cache__drain_done(hapi_cache *c)
{
    c->drain_off = c->drain_next;
    if (c->drain_off >= c->drain_used)
        c->drain_used = c->drain_off = 0;
}

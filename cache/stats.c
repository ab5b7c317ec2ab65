/* stats.c — statistics: the store's and a namespace's. */
#include "cache-priv.h"

#include <string.h>

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
    rc = hapi_cache__read_begin(c, &txn);
    if (rc == 1)
        return HAPI_ECACHE; /* the map is stale or being resized: try after the next put */
    if (rc)
        return hapi_cache__lmdb_to_code(rc);
    /* All of these read the map: do it while the lookup keeps a remap away. */
    if ((rc = mdb_stat(txn, c->features_dbi, &ms)) == 0 &&
        (rc = mdb_env_info(c->env, &info)) == 0 &&
        (rc = mdb_env_stat(c->env, &envst)) == 0 &&
        (rc = hapi_cache__slab_totals(c, txn, &slabs)) == 0)
        rc = hapi_cache__count_free_pages(txn, &free_pages);
    if (rc == 0) {
        k = (MDB_val){ .mv_size = strlen(EVICTIONS_KEY), .mv_data = EVICTIONS_KEY };
        rc = mdb_get(txn, c->meta_dbi, &k, &v);
        if (rc == 0 && v.mv_size == 8)
            total = get_le64(v.mv_data);
        if (rc == MDB_NOTFOUND)
            rc = 0;
    }
    hapi_cache__read_end(c, txn);
    if (rc)
        return hapi_cache__lmdb_to_code(rc);
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
    rc = hapi_cache__read_begin(c, &txn);
    if (rc == 1)
        return HAPI_ECACHE;
    if (rc)
        return hapi_cache__lmdb_to_code(rc);
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
            if (hapi_cache__slab_ref_of(&v, &ref))
                s.bytes += v.mv_size - HAPI_CACHE__SLAB_REF_SIZE +
                           get_le32((const uint8_t *)v.mv_data + 8);
            else
                s.bytes += v.mv_size;
        }
        mdb_cursor_close(cur);
        if (rc == MDB_NOTFOUND)
            rc = 0;
    }
    hapi_cache__read_end(c, txn);
    if (rc)
        return hapi_cache__lmdb_to_code(rc);
    *st = s;
    return 0;
}

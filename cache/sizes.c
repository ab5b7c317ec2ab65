/* sizes.c — sizes: what an entry costs in the store, LMDB's free list, the room LMDB keeps beside the slabs. */
#include "cache-priv.h"

#include <string.h>

/*
 * Bytes an entry occupies, estimated as LMDB lays it out: a value that does
 * not fit a leaf node goes to its own run of overflow pages ((15 + size) /
 * page + 1 of them), the leaf keeping the key and a page number; then the
 * entry's lru_records: its "lru" record, and an inline entry's "stamps"
 * record. Leaf pages are never full, so this is a lower bound, close enough
 * to size eviction.
 */
uint64_t hapi_cache__entry_bytes(const hapi_cache *c, size_t key_len, size_t value_size,
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
        return hapi_cache__entry_bytes(c, key_len, value_size + HAPI_CACHE__SLAB_REF_SIZE, 1) +
               slot_size_of(size);
    return hapi_cache__entry_bytes(c, key_len, value_size + size, 2);
}

/*
 * Pages on LMDB's free list: freed by past transactions, reusable by later
 * ones. Each record of the free database is an ID list whose first word is
 * its length. LMDB lets only read transactions open a cursor on it.
 */
int hapi_cache__count_free_pages(MDB_txn *rtxn, uint64_t *out)
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
 * Sets c->lmdb_free_pages to the length of LMDB's free list, for hapi_cache__slot_alloc()
 * (write_lock held, no write transaction open: the count needs a lookup's
 * snapshot). On failure, 0: slabs are then measured against the high-water mark.
 */
void hapi_cache__lmdb_free_pages_update(hapi_cache *c)
{
    MDB_txn *rtxn;
    c->lmdb_free_pages = 0;
    if (hapi_cache__read_begin(c, &rtxn) != 0)
        return;
    if (hapi_cache__count_free_pages(rtxn, &c->lmdb_free_pages) != 0)
        c->lmdb_free_pages = 0;
    hapi_cache__read_end(c, rtxn);
}

/*
 * Room left in the map for LMDB's file to grow into once the slabs stopped
 * growing: its index pages, and pages copied while the last transactions'
 * free pages are not reusable yet (a write of the access log copies a few
 * thousand). A sixteenth of the map and 64 pages, at most a quarter of it.
 */
uint64_t hapi_cache__lmdb_reserve(const hapi_cache *c, uint64_t map_bytes)
{
    uint64_t r = map_bytes / 16 + 64 * (uint64_t)c->psize;
    return r < map_bytes / 4 ? r : map_bytes / 4;
}

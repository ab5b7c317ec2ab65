/* slots.c — slab slots: the per-size high-water marks and free lists in LMDB, taking and freeing a slot. */
#include "cache-priv.h"

#include <endian.h>
#include <string.h>

#define SLAB_KEY "slab" /* then the u32 big-endian slot size, in "meta" */
#define SLAB_KEY_SIZE 8
#define SLOT_KEY_SIZE 12

static void class_key(uint8_t key[SLAB_KEY_SIZE], uint32_t slot_size)
{
    memcpy(key, SLAB_KEY, 4);
    uint32_t be = htobe32(slot_size);
    memcpy(key + 4, &be, 4);
}

int hapi_cache__class_get(hapi_cache *c, MDB_txn *txn, uint32_t slot_size, struct slab_class *sc)
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
int hapi_cache__class_each(hapi_cache *c, MDB_txn *txn,
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

static int add_totals(uint32_t slot_size, const struct slab_class *sc, void *arg)
{
    struct slab_totals *t = arg;
    t->bytes += sc->high * slot_size;
    t->free_bytes += (sc->free < sc->high ? sc->free : sc->high) * slot_size;
    return 0;
}

int hapi_cache__slab_totals(hapi_cache *c, MDB_txn *txn, struct slab_totals *t)
{
    *t = (struct slab_totals){ 0 };
    return hapi_cache__class_each(c, txn, add_totals, t);
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
int hapi_cache__slot_alloc(hapi_cache *c, MDB_txn *txn, uint32_t slot_size, uint64_t *slot)
{
    struct slab_class sc;
    int rc = hapi_cache__class_get(c, txn, slot_size, &sc);
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
     * while hapi_cache__eviction_goal(), which counts the free list, saw room.
     */
    MDB_envinfo info;
    struct slab_totals t;
    if ((rc = mdb_env_info(c->env, &info)) != 0 || (rc = hapi_cache__slab_totals(c, txn, &t)) != 0)
        return rc;
    uint64_t pages = (uint64_t)info.me_last_pgno + 1;
    pages -= c->lmdb_free_pages < pages ? c->lmdb_free_pages : pages;
    if (pages * c->psize + t.bytes + slot_size + hapi_cache__lmdb_reserve(c, info.me_mapsize) >
        (uint64_t)info.me_mapsize)
        return MDB_MAP_FULL;
    *slot = sc.high++;
    return class_put(c, txn, slot_size, &sc);
}

/*
 * Frees a slot in txn (write_lock held). Free slots at the end of the file
 * leave it: the high-water mark comes down, and the file is cut to it by the
 * next write transaction (hapi_cache__slab_trim()), so that an evicted slot size gives
 * its disk back. Not here: if txn does not commit, the slots it freed still
 * hold committed entries' bytes. A slot beyond the high-water mark or free
 * already (a damaged reference) is left alone. Returns 0 or an LMDB error.
 */
int hapi_cache__slot_free(hapi_cache *c, MDB_txn *txn, const struct slab_ref *ref)
{
    struct slab_class sc;
    uint8_t key[SLOT_KEY_SIZE];
    int rc = hapi_cache__class_get(c, txn, ref->slot_size, &sc);
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
        /* hapi_cache__slab_trim() cuts the files this process has open: open it now if need be. */
        hapi_cache__slab_fd(c, ref->slot_size, false);
        c->trim_pending = true;
    }
    return class_put(c, txn, ref->slot_size, &sc);
}

/* Opens a slot size's file, for hapi_cache__slab_trim(), which cuts the files open. */
static int open_class(uint32_t slot_size, const struct slab_class *sc, void *arg)
{
    (void)sc;
    hapi_cache__slab_fd(arg, slot_size, false);
    return 0;
}

/*
 * Drops every slot record, in txn (write lock held, every entry gone in the
 * same transaction); the files are emptied by the next write's hapi_cache__slab_trim().
 */
int hapi_cache__slab_clear(hapi_cache *c, MDB_txn *txn)
{
    int rc = hapi_cache__class_each(c, txn, open_class, c);
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

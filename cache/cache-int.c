/* cache-int.c — what cache-int.h gives tests: accessors, the slot of a path, the check of the index. */
#include "cache-priv.h"

#include <endian.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    int rc = hapi_cache__read_begin(c, &txn);
    if (rc)
        return rc == 1 ? MDB_MAP_RESIZED : rc;
    rc = mdb_get(txn, c->features_dbi, &k, &v);
    if (rc == 0 && hapi_cache__slab_ref_of(&v, &ref)) {
        *slot_size = ref.slot_size;
        *slot = ref.slot;
        rc = 1;
    } else if (rc == 0 || rc == MDB_NOTFOUND) {
        rc = 0;
    }
    hapi_cache__read_end(c, txn);
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
            if (!hapi_cache__slab_ref_of(&val, &ref) || ref.slot_size != slot_size)
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
    if (hapi_cache__read_begin(c, &txn) != 0) {
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
    if ((rc = hapi_cache__class_each(c, txn, check_class, &sk)) != 0) {
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
        if (hapi_cache__slab_ref_of(&x, &ref)) {
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
    hapi_cache__read_end(c, txn);
    return result;
}

/* put.c — puts: hapi_cache_put(), a batch of entries in one write transaction, evicting first when the store is near its bound. */
#include "cache-priv.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Attempts of a put after MDB_MAP_FULL, each after evicting more than the last. */
#define PUT_RETRIES 12

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
        if (rc == 0 && hapi_cache__slab_ref_of(&old, &replaced[n_replaced]))
            rc = hapi_cache__unlink_lru(c, txn, keybuf, k.mv_size, &replaced[n_replaced++]);
        else if (rc == 0 || rc == MDB_NOTFOUND)
            rc = hapi_cache__unlink_lru(c, txn, keybuf, k.mv_size, NULL);
        if (rc)
            goto out;
        /* No slab file to be had (too many sizes, or it cannot be opened): inline, as small ones. */
        if (slab_sized(it->size)) {
            ref.slot_size = slot_size_of(it->size);
            fd = hapi_cache__slab_fd(c, ref.slot_size, true);
        }
        if (fd >= 0) {
            if ((rc = hapi_cache__slot_alloc(c, txn, ref.slot_size, &ref.slot)) != 0 ||
                (rc = hapi_cache__write_full(fd, it->data, it->size,
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
        hapi_cache__header_encode(p, &it->id, (uint32_t)it->size, stored_path_len, fd >= 0,
                                  stored_ns);
        /* Zero the padding too: reserved space is not initialized and would reach the file. */
        memset(p + HAPI_CACHE__HEADER_SIZE, 0, v.mv_size - HAPI_CACHE__HEADER_SIZE);
        memcpy(p + HAPI_CACHE__HEADER_SIZE, it->path, stored_path_len);
        if (fd >= 0) {
            put_le32(p + offset, ref.slot_size);
            put_le64(p + offset + 8, ref.slot);
            put_le64(p + offset + 16, *stamp); /* the stamp hapi_cache__lru_append() gives it */
        } else if (it->size) {
            memcpy(p + offset, it->data, it->size);
        }
        put_le64(p + 56, hapi_cache__value_checksum(p, p + HAPI_CACHE__HEADER_SIZE, stored_path_len,
                                                    it->data, it->size));
        /* The newest entry: a slab entry's stamp is in its value, an inline one's in "stamps". */
        rc = hapi_cache__lru_append(c, txn, &k, stamp, fd < 0);
        if (rc)
            goto out;
    }
    for (size_t i = 0; i < n_replaced && rc == 0; i++)
        rc = hapi_cache__slot_free(c, txn, &replaced[i]);
out:
    free(replaced);
    return rc;
}

/*
 * One attempt at writing the batch (write_lock held): a write transaction
 * that applies the access log, then writes the items. Returns 0 with the
 * transaction's result in *txn_rc (0 once committed, else an LMDB code or an
 * errno, the failing item's index in *failed), or the hapi code of a write
 * that could not begin (err says why).
 */
static int put_attempt(hapi_cache *c, const hapi_cache_namespace *ns,
                       const hapi_cache_item *items, size_t n, size_t *failed, int *txn_rc,
                       hapi_error *err)
{
    MDB_txn *txn;
    uint64_t stamp = 0;
    bool applied = c->drain_used > 0;
    int rc;

    hapi_cache__lmdb_free_pages_update(c);
    if ((rc = hapi_cache__write_begin(c, &txn, err)) != 0)
        return rc;
    rc = hapi_cache__stamp_first(c, txn, &stamp);
    if (rc == 0 && applied)
        rc = hapi_cache__apply_accesses(c, txn, &stamp, NULL, SIZE_MAX);
    if (rc == 0)
        rc = put_items(c, txn, ns, items, n, &stamp, failed);
    if (rc == 0 && atomic_load(&c->crash_before_commit))
        _exit(86);
    if (rc == 0) {
        rc = mdb_txn_commit(txn); /* a commit frees the transaction even when it fails */
    } else {
        /* MDB_MAP_FULL and other put errors leave the transaction unusable: drop the whole batch. */
        mdb_txn_abort(txn);
    }
    if (rc == 0 && applied)
        hapi_cache__drain_done(c);
    *txn_rc = rc;
    return 0;
}

/*
 * Checks every item before the transaction, so a bad one does not cost a
 * half-written batch, and adds up in *need the bytes they will take. Returns
 * 0 or HAPI_EINVAL (err says which item).
 */
static int items_check(const hapi_cache *c, const hapi_cache_item *items, size_t n,
                       uint64_t *need, hapi_error *err)
{
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
        *need += hapi_cache_entry_bytes(c, path_len, items[i].size);
    }
    return 0;
}

int hapi_cache_put(hapi_cache *c, const hapi_cache_namespace *ns,
                   const hapi_cache_item *items, size_t n, hapi_error *err)
{
    MDB_envinfo info;
    uint64_t need = 0, evicted = 0;
    size_t failed = 0;
    int txn_rc;
    bool readers_checked = false, nothing_left = false;
    int rc;

    if (!c || !ns || (n && !items))
        return hapi_error_set(err, HAPI_EINVAL, "cache put: missing argument");
    if ((rc = items_check(c, items, n, &need, err)) != 0)
        return rc;
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
    hapi_cache__drain_take(c);

    /*
     * Evict first when the put would take the store past the high mark. The
     * same transaction applies the access log: each access rewrites about
     * three small LRU index records, pages that count as much as the values
     * (a full store after an epoch of hits jammed on exactly that).
     */
    uint64_t goal = 0;
    if (hapi_cache__eviction_goal(c, need + 3 * (uint64_t)c->drain_used, &goal) == 0 && goal > 0) {
        if ((rc = hapi_cache__evict(c, goal, &evicted, err)) != 0)
            goto out;
    }

    for (int attempt = 0;; attempt++) {
        if ((rc = put_attempt(c, ns, items, n, &failed, &txn_rc, err)) != 0)
            goto out;
        if ((rc = txn_rc) == 0)
            break;
        if (rc != MDB_MAP_FULL) {
            /* Errno values here are the disk's (ENOSPC, EIO): the store failed, the caller goes on uncached. */
            rc = hapi_error_set(err, rc > 0 ? HAPI_ECACHE : hapi_cache__lmdb_to_code(rc),
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
        if ((rc = hapi_cache__evict(c, more, &evicted, err)) != 0)
            goto out;
        if (evicted == 0) {
            /* Nothing left to evict: wait for lookups to release pinned pages; clear dead readers' slots. */
            int dead = 0;
            nothing_left = true;
            if (!readers_checked) {
                mdb_reader_check(c->env, &dead);
                readers_checked = true;
            }
            hapi_cache__full_wait(attempt);
        }
    }
    rc = 0;

out:
    pthread_mutex_unlock(&c->write_lock);
    return rc;
}

/* txn.c — transactions: pooled read transactions, write transactions, adopting the map size another process set. */
#include "cache-priv.h"

#include <errno.h>
#include <pthread.h>
#include <time.h>

/* How long a put waits for outstanding lookups to end before it adopts another process's map size. */
#define REMAP_WAIT_NS (UINT64_C(5) * 1000000000u)

/* ---- read transactions ---- */

/*
 * Starts a lookup: counts it as active and gives it a read transaction,
 * renewed from the pool or begun afresh. Returns 0, 1 if the store is being
 * remapped or another process grew the map (the lookup is a miss), or an LMDB
 * error. On anything but 0, the lookup is no longer counted.
 */
int hapi_cache__read_begin(hapi_cache *c, MDB_txn **out)
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
void hapi_cache__read_end(hapi_cache *c, MDB_txn *txn)
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

    hapi_deadline_after_ns(&deadline, REMAP_WAIT_NS);

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

int hapi_cache__lmdb_to_code(int rc)
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

/* ---- write transactions ---- */

/* Begins a write transaction (write_lock held), adopting another process's map size if needed. */
int hapi_cache__write_begin(hapi_cache *c, MDB_txn **txn, hapi_error *err)
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
        return hapi_error_set(err, hapi_cache__lmdb_to_code(rc),
                              "cache %s: cannot begin a write: %s",
                              c->dir, mdb_strerror(rc));
    }
    if (c->trim_pending)
        hapi_cache__slab_trim(c, *txn);
    return 0;
}

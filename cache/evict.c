/* evict.c — eviction: how much a put must evict, evicting the least recently used entries, waiting out a full map. */
#include "cache-priv.h"

#include <string.h>
#include <time.h>

/*
 * Pages kept free beyond the high mark whatever the map's size: eviction is
 * itself a write (copy-on-write of the touched leaf and branch pages, the
 * free list), and pages freed by the last two transactions are not reusable
 * yet. With 5% of a small map (13 pages of 1 MiB) a full store could not even
 * evict, and froze: every later put was refused.
 */
#define RESERVE_PAGES 64 /* or an eighth of a smaller map */

/* The high and low marks of a map of map pages, in pages. */
static void marks(uint64_t map, uint64_t *high, uint64_t *low)
{
    uint64_t h = map * HIGH_PERCENT / 100;
    uint64_t reserve = map / 8 < RESERVE_PAGES ? map / 8 : RESERVE_PAGES;
    if (map - h < reserve)
        h = map - reserve;
    uint64_t gap = map * (HIGH_PERCENT - LOW_PERCENT) / 100;
    *high = h;
    *low = h > gap ? h - gap : 0;
}
#define EVICT_BATCH 512

/*
 * How many bytes a write of need bytes should evict first: none while the
 * store stays under HIGH_PERCENT of the map, else down to LOW_PERCENT. The
 * high-water mark alone settles the common case; past it (a store that was
 * ever full stays there), the free list tells the pages actually in use.
 * Called with write_lock held, so the map cannot change under us.
 */
int hapi_cache__eviction_goal(hapi_cache *c, uint64_t need, uint64_t *goal)
{
    MDB_envinfo info;
    MDB_txn *rtxn;
    struct slab_totals slabs;
    uint64_t free_pages = 0;
    int rc;

    *goal = 0;
    rc = mdb_env_info(c->env, &info);
    if (rc)
        return rc;
    rc = hapi_cache__read_begin(c, &rtxn);
    if (rc == 1)
        return 0; /* cannot happen under write_lock; no estimate is no eviction */
    if (rc)
        return rc;
    rc = hapi_cache__slab_totals(c, rtxn, &slabs);
    if (rc) {
        hapi_cache__read_end(c, rtxn);
        return rc;
    }
    /*
     * The slab files count as pages of the map, the bound being the whole
     * store's, and so does the reserve hapi_cache__slot_alloc() leaves for LMDB to grow.
     */
    uint64_t map = (uint64_t)info.me_mapsize / c->psize;
    uint64_t reserve = slabs.bytes ? hapi_cache__lmdb_reserve(c, info.me_mapsize) / c->psize : 0;
    uint64_t used = (uint64_t)info.me_last_pgno + 1 + slabs.bytes / c->psize + reserve;
    uint64_t need_pages = (need + c->psize - 1) / c->psize;
    uint64_t high, low;
    marks(map, &high, &low);
    if (used + need_pages <= high) {
        hapi_cache__read_end(c, rtxn);
        return 0;
    }
    rc = hapi_cache__count_free_pages(rtxn, &free_pages);
    hapi_cache__read_end(c, rtxn);
    if (rc)
        return rc;
    /* Free pages and free slots are reused before the files grow. */
    free_pages += slabs.free_bytes / c->psize;
    used = free_pages < used ? used - free_pages : 0;
    if (used + need_pages <= high)
        return 0;
    *goal = (used + need_pages - (low < used + need_pages ? low : used + need_pages)) * c->psize;
    return 0;
}

/* Adds n to the persisted eviction count, in txn. */
static int count_evictions(hapi_cache *c, MDB_txn *txn, uint64_t n)
{
    MDB_val k = { .mv_size = strlen(EVICTIONS_KEY), .mv_data = EVICTIONS_KEY }, v;
    uint8_t buf[8];
    uint64_t total = 0;
    int rc = mdb_get(txn, c->meta_dbi, &k, &v);
    if (rc == 0 && v.mv_size == 8)
        total = get_le64(v.mv_data);
    else if (rc && rc != MDB_NOTFOUND)
        return rc;
    put_le64(buf, total + n);
    v = (MDB_val){ .mv_size = 8, .mv_data = buf };
    return mdb_put(txn, c->meta_dbi, &k, &v, 0);
}

/*
 * Writes the evictions not yet persisted (write_lock held), in a transaction
 * of its own: a small one, a few pages. Sets *full (if full is not NULL) when
 * the store had not even those. Returns 0 or a hapi code (err says why).
 */
int hapi_cache__persist_evictions(hapi_cache *c, bool *full, hapi_error *err)
{
    MDB_txn *txn;
    int rc = hapi_cache__write_begin(c, &txn, err);
    if (full)
        *full = false;
    if (rc)
        return rc;
    rc = count_evictions(c, txn, c->evictions_unpersisted);
    if (rc == 0)
        rc = mdb_txn_commit(txn);
    else
        mdb_txn_abort(txn);
    if (rc == 0)
        c->evictions_unpersisted = 0;
    if (full)
        *full = rc == MDB_MAP_FULL;
    if (rc && rc != MDB_MAP_FULL)
        return hapi_error_set(err, hapi_cache__lmdb_to_code(rc),
                              "cache %s: eviction count: %s", c->dir,
                              mdb_strerror(rc));
    return 0;
}

/* Sleeps (attempt + 1) ms, at most 10: a store full for an instant, see FULL_WAIT_MS. */
void hapi_cache__full_wait(int attempt)
{
    struct timespec ts = { 0, (long)(attempt < 10 ? attempt + 1 : 10) * 1000000L };
    nanosleep(&ts, NULL);
}

/*
 * What a write that found the map full does before it tries again
 * (write_lock held). The reusable pages are spent, and what keeps the others
 * from reuse is, in turn:
 * - the reader slot of a process that died inside a lookup: it pins that
 *   snapshot, and every page freed since, until mdb_reader_check() frees it.
 *   hapi_cache_open() clears the slots of processes dead by then, not of one
 *   still exiting (a killed daemon, while its successor opens the store) or
 *   sharing the store, which dies later: its pages filled the map, and
 *   waiting for lookups never ended (the soak's "evict DIR" failed so). Checked
 *   every time: the process may die while we wait;
 * - the last transaction's freed pages, reused only once another commits: a
 *   write of a few pages (the eviction count) unlocks them, once, and again
 *   after dead slots were cleared (their pages may need it too);
 * - lookups held for long: waited for, up to FULL_WAIT_MS in all.
 * Returns 1 to try again, 0 when there is no room even so, or the hapi code
 * of an unlocking write that failed otherwise than full (err says why).
 */
int hapi_cache__full_again(hapi_cache *c, struct full_state *f, hapi_error *err)
{
    int dead = 0;
    if (mdb_reader_check(c->env, &dead) == 0 && dead > 0) {
        f->unlocked = false;
        return 1;
    }
    if (!f->unlocked) {
        bool full;
        f->unlocked = true;
        int rc = hapi_cache__persist_evictions(c, &full, err);
        if (rc || !full)
            return rc ? rc : 1;
    }
    if (f->waits == 0)
        f->from = hapi_now_ns();
    if (hapi_now_ns() - f->from >= FULL_WAIT_MS * 1000000ULL)
        return 0;
    hapi_cache__full_wait(f->waits++);
    return 1;
}

/* What one eviction transaction did: LRU records deleted, entries gone, bytes freed, whether none is left. */
struct evict_batch {
    uint64_t records;
    uint64_t gone;
    uint64_t freed;
    bool empty;
};

/*
 * Deletes the least recently used entries in txn, through cur (on "lru"):
 * up to batch records, or until their estimated footprint reaches room bytes.
 * Accumulates into *b; returns 0 or an LMDB error.
 */
static int evict_oldest(hapi_cache *c, MDB_txn *txn, MDB_cursor *cur, unsigned batch,
                        uint64_t room, struct evict_batch *b)
{
    int rc = 0;
    while (b->records < batch && b->freed < room) {
        MDB_val k, v;
        uint8_t key[HAPI_CACHE__KEY_MAX];
        rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST);
        if (rc == MDB_NOTFOUND) {
            b->empty = true;
            rc = 0;
            break;
        }
        if (rc)
            break;
        /* Copy the key: v points into a page that the deletions below change. */
        size_t len = v.mv_size <= sizeof(key) ? v.mv_size : 0;
        memcpy(key, v.mv_data, len);
        if ((rc = mdb_cursor_del(cur, 0)) != 0)
            break;
        if (len == 0)
            continue; /* not a key of ours: the record alone goes */
        MDB_val fk = { .mv_size = len, .mv_data = key }, fv;
        size_t value_size = 0;
        struct slab_ref ref;
        bool slab = false;
        rc = mdb_get(txn, c->features_dbi, &fk, &fv);
        if (rc == 0) {
            value_size = fv.mv_size;
            slab = hapi_cache__slab_ref_of(&fv, &ref);
            rc = mdb_del(txn, c->features_dbi, &fk, NULL);
            b->gone += rc == 0;
            if (rc == 0 && slab)
                rc = hapi_cache__slot_free(c, txn, &ref);
        }
        if (rc == 0 || rc == MDB_NOTFOUND)
            rc = mdb_del(txn, c->stamps_dbi, &fk, NULL);
        if (rc == MDB_NOTFOUND)
            rc = 0;
        if (rc)
            break;
        b->freed += hapi_cache__entry_bytes(c, len, value_size, slab ? 1 : 2) +
                    (slab ? ref.slot_size : 0);
        b->records++;
    }
    return rc;
}

/*
 * Counts the total entries that hapi_cache__evict(), begun at t0 (ns), removed, then
 * persists the count unless the eviction failed (fail, a hapi code or 0).
 * Returns fail, or 0 or the hapi code of the persisting write.
 */
static int evict_done(hapi_cache *c, uint64_t total, uint64_t t0, int fail, uint64_t *evicted,
                      hapi_error *err)
{
    /*
     * What the committed batches removed counts even when a later batch failed: the entries are
     * gone (the counters must balance against the store's entries, as tests check).
     */
    if (total == 0)
        return fail;
    count(&c->evictions, total);
    count(&c->evict_ns, hapi_now_ns() - t0);
    *evicted = total;
    c->evictions_unpersisted += total;
    if (fail)
        return fail; /* the count is persisted with the next eviction */

    /*
     * Persist the count in a transaction of its own. It also matters to the
     * put that follows: LMDB reuses only pages freed at least two
     * transactions before (the previous one may still be some reader's
     * snapshot), so without it the last batch's pages would stay unusable
     * for the very put that evicted them. A store full to the last page can
     * refuse even this write: the count then waits for the next eviction.
     */
    return hapi_cache__persist_evictions(c, NULL, err);
}

/*
 * Evicts least recently used entries, of every namespace, until their
 * estimated footprint reaches goal bytes or none is left, in write
 * transactions of up to EVICT_BATCH entries (write_lock held). The first one
 * applies the access log, so that recent hits are not evicted. Reports the
 * number evicted through *evicted; returns 0 or a hapi code (err says why).
 *
 * A deletion copies the B-tree pages it changes, so an eviction transaction
 * needs free pages too: on MDB_MAP_FULL it retries with half the batch.
 */
int hapi_cache__evict(hapi_cache *c, uint64_t goal, uint64_t *evicted, hapi_error *err)
{
    uint64_t freed = 0, total = 0, stamp = 0;
    unsigned batch = EVICT_BATCH;
    struct full_state full = { 0 };
    bool empty = false, skip_apply = false;
    int rc = 0, fail = 0;

    *evicted = 0;
    uint64_t t0 = hapi_now_ns();
    while (freed < goal && !empty) {
        MDB_txn *txn;
        MDB_cursor *cur = NULL;
        struct evict_batch b = { 0 };

        if ((rc = hapi_cache__write_begin(c, &txn, err)) != 0) {
            fail = rc;
            break;
        }
        /*
         * The hits logged since the last write are applied first, so that
         * what was just read is not what goes. But after an epoch of hits
         * that is hundreds of index rewrites, and in a full store they alone
         * can overflow the map: then this batch goes without them (by the
         * slightly older order), and the next applies them in the room made.
         */
        bool applied = c->drain_used > 0 && !skip_apply;
        rc = hapi_cache__stamp_first(c, txn, &stamp);
        if (rc == 0 && applied)
            rc = hapi_cache__apply_accesses(c, txn, &stamp, NULL, SIZE_MAX);
        if (rc == 0)
            rc = mdb_cursor_open(txn, c->lru_dbi, &cur);
        /* freed < goal here, so goal - freed is the room still to make. */
        if (rc == 0)
            rc = evict_oldest(c, txn, cur, batch, goal - freed, &b);
        if (cur)
            mdb_cursor_close(cur);
        if (rc == 0) {
            rc = mdb_txn_commit(txn);
        } else {
            mdb_txn_abort(txn);
        }
        if (rc == MDB_MAP_FULL && applied) {
            skip_apply = true;
            continue;
        }
        if (rc == MDB_MAP_FULL && batch > 1) {
            batch /= 2;
            continue;
        }
        /* Even one deletion does not fit: see hapi_cache__full_again(). */
        if (rc == MDB_MAP_FULL) {
            int again = hapi_cache__full_again(c, &full, err);
            if (again > 0)
                continue;
            fail = again < 0 ? again
                             : hapi_error_set(err, HAPI_ECACHE,
                                              "cache %s: cache full: no room even to evict; "
                                              "lookups held for long pin the pages eviction "
                                              "frees", c->dir);
            break;
        }
        if (rc) {
            fail = hapi_error_set(err, hapi_cache__lmdb_to_code(rc),
                                  "cache %s: eviction: %s", c->dir,
                                  mdb_strerror(rc));
            break;
        }
        if (applied)
            hapi_cache__drain_done(c);
        skip_apply = false;
        full.unlocked = false; /* the wait, FULL_WAIT_MS, is the whole eviction's */
        freed += b.freed;
        total += b.gone;
        empty = b.empty;
    }
    return evict_done(c, total, t0, fail, evicted, err);
}

/* remote-fetch.c — the fetches of a compute-side mount: the queue and its threads, pack reads handing rows to waiting readers and storing them in the cache, the spill of rows the cache refuses. */
#include "remote-int.h"
#include "log.h"
#include "shared.h"
#include "view.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FETCH_CHUNK (1u << 20)   /* bytes per read of a pack: large sequential reads */

struct waiter {
    const char *name;
    hapi_source_id id;
    char *dst;
    size_t from, to;
    int state;                    /* 0 waiting, 1 filled, < 0 failed */
    struct waiter *next;
};

/* -------------------------------------------------------------- fetches */

void hapi_remote__fetch_put_locked(struct fetch *f)
{
    if (--f->refs > 0)
        return;
    hapi_remote__index_put(f->index);
    pthread_cond_destroy(&f->cond);
    free(f);
}

/* A new fetch of x's pack, queued (the readers' ahead of the warm-up's). Under fetch_lock. */
struct fetch *hapi_remote__fetch_new_locked(hapi_remote *r, struct dir_index *x, int warm)
{
    struct fetch *f = calloc(1, sizeof(*f));
    if (!f)
        return NULL;
    f->refs = 1; /* the list's */
    atomic_fetch_add(&x->refs, 1);
    f->index = x;
    f->warm = warm;
    pthread_cond_init(&f->cond, NULL);
    f->next = r->fetches;
    r->fetches = f;
    if (!warm) {
        /* before every warm-up fetch, after the readers' */
        struct fetch **link = &r->queue_head, *prev = NULL;
        while (*link && !(*link)->warm) {
            prev = *link;
            link = &(*link)->queue_next;
        }
        f->queue_next = *link;
        *link = f;
        if (!f->queue_next)
            r->queue_tail = f;
        (void)prev;
    } else {
        if (r->queue_tail)
            r->queue_tail->queue_next = f;
        else
            r->queue_head = f;
        r->queue_tail = f;
    }
    pthread_cond_signal(&r->queue_cond);
    return f;
}

/* Takes f out of the list of unfinished fetches. Under fetch_lock. */
static void fetch_unlist_locked(hapi_remote *r, struct fetch *f)
{
    for (struct fetch **link = &r->fetches; *link; link = &(*link)->next)
        if (*link == f) {
            *link = f->next;
            return;
        }
}

/* A pack row is all NaN when the storage side could not compute it (its pack says so). */
static int row_failed(const struct dir_index *x, const char *row)
{
    size_t width;
    const unsigned char *nan = hapi_feat_nan(x->dtype, &width);
    for (size_t i = 0; i < x->pack_row_bytes; i++)
        if ((unsigned char)row[i] != nan[i % width])
            return 0;
    return 1;
}

/* Reads exactly len bytes at off, or fails: a short read is a torn pack. */
static int read_exact(int fd, char *buf, size_t len, off_t off)
{
    ssize_t n = hapi_remote_pread_all(fd, buf, len, off);
    return n < 0 ? (int)n : (size_t)n < len ? HAPI_ECORRUPT : 0;
}

/*
 * Hands rows [a, b) in buf to f's waiters. Called twice per chunk: before the
 * rows are stored in the cache (the waiters need not wait for the store) and
 * after it (passed: for readers that joined in between; a reader that comes
 * later finds the rows in the cache).
 */
static void deliver(hapi_remote *r, struct fetch *f, size_t a, size_t b, const char *buf,
                    const unsigned char *failed, int passed)
{
    const struct dir_index *x = f->index;
    pthread_mutex_lock(&r->fetch_lock);
    for (struct waiter *w = f->waiters; w; w = w->next) {
        size_t row;
        if (w->state != 0 || !hapi_remote__index_find(x, w->name, &row) || row < a || row >= b)
            continue;
        if (failed[row - a])
            w->state = HAPI_EDECODE;
        else {
            memcpy(w->dst, buf + (row - a) * x->row_bytes + w->from, w->to - w->from);
            w->state = 1;
        }
    }
    if (passed) {
        f->done = b;
        atomic_fetch_add(&r->passes, 1);
    }
    pthread_cond_broadcast(&f->cond);
    pthread_mutex_unlock(&r->fetch_lock);
}

/*
 * Rows the cache refused (its disk or its map full), kept in memory so that
 * the other files of their directory are served without fetching its pack
 * again: else each file of a directory of N images costs a pack, N packs for
 * the directory. Bounded by SPILL_BYTES, the oldest directory's rows dropped
 * first; all are dropped once the cache takes features again. Under
 * spill_lock, a leaf.
 */
#define SPILL_BYTES ((size_t)64 << 20)

struct spill {
    struct dir_index *index;      /* a reference: the rows are those of its pack */
    char *rows;                   /* index->count rows */
    unsigned char *have;          /* which rows are here */
    struct spill *next;           /* newer */
};

static void spill_free(struct spill *sp)
{
    hapi_remote__index_put(sp->index);
    free(sp->rows);
    free(sp->have);
    free(sp);
}

/* Drops every spilled row (the cache takes features again, or the mount ends). */
void hapi_remote__spill_drop_all(hapi_remote *r)
{
    pthread_mutex_lock(&r->spill_lock);
    struct spill *sp = r->spills;
    r->spills = NULL;
    r->spill_bytes = 0;
    pthread_mutex_unlock(&r->spill_lock);
    while (sp) {
        struct spill *next = sp->next;
        spill_free(sp);
        sp = next;
    }
}

/* Keeps rows [a, b) of x's pack (rows: their bytes; failed: rows not to keep) that the cache refused. */
static void spill_keep(hapi_remote *r, struct dir_index *x, size_t a, size_t b, const char *rows,
                       const unsigned char *failed)
{
    size_t need = x->count * x->row_bytes;
    if (need == 0 || need > SPILL_BYTES)
        return; /* a directory bigger than the bound is fetched again, as it would be */
    pthread_mutex_lock(&r->spill_lock);
    struct spill *sp = r->spills;
    while (sp && sp->index != x)
        sp = sp->next;
    if (!sp) {
        while (r->spills && r->spill_bytes + need > SPILL_BYTES) {
            struct spill *old = r->spills;
            r->spills = old->next;
            r->spill_bytes -= old->index->count * old->index->row_bytes;
            spill_free(old);
        }
        sp = calloc(1, sizeof(*sp));
        if (sp && (!(sp->rows = malloc(need)) || !(sp->have = calloc(x->count, 1)))) {
            free(sp->rows);
            free(sp);
            sp = NULL;
        }
        if (!sp)
            goto out;
        atomic_fetch_add(&x->refs, 1);
        sp->index = x;
        struct spill **tail = &r->spills;
        while (*tail)
            tail = &(*tail)->next;
        *tail = sp;
        r->spill_bytes += need;
    }
    for (size_t i = a; i < b; i++)
        if (!failed[i - a]) {
            memcpy(sp->rows + i * x->row_bytes, rows + (i - a) * x->row_bytes, x->row_bytes);
            sp->have[i] = 1;
        }
out:
    pthread_mutex_unlock(&r->spill_lock);
}

/* Copies bytes [from, to) of row `row` of x's pack if it is spilled: 1, else 0. */
int hapi_remote__spill_copy(hapi_remote *r, const struct dir_index *x, size_t row, char *dst,
                            size_t from, size_t to)
{
    int found = 0;
    pthread_mutex_lock(&r->spill_lock);
    for (struct spill *sp = r->spills; sp; sp = sp->next)
        if (sp->index == x) {
            if (row < x->count && sp->have[row]) {
                memcpy(dst, sp->rows + row * x->row_bytes + from, to - from);
                found = 1;
            }
            break;
        }
    pthread_mutex_unlock(&r->spill_lock);
    return found;
}

/* A put succeeded: if puts were failing, the cache has room again and the spill goes. */
static void cache_took(hapi_remote *r)
{
    if (atomic_exchange(&r->put_failing, 0)) {
        hapi_log(HAPI_LOG_INFO, "the cache takes fetched features again");
        hapi_remote__spill_drop_all(r);
    }
}

/*
 * At most once a second, offers the cache spilled row `row` of x's pack again
 * (for path, id); once it takes it, the cache has room: every spilled row is
 * dropped, and the rows are fetched and kept again at their next read.
 */
void hapi_remote__spill_retry(hapi_remote *r, struct dir_index *x, size_t row, const char *path,
                              const hapi_source_id *id)
{
    uint64_t now = hapi_now_ns(), last = atomic_load(&r->spill_retry_ns);
    if (now - last < 1000000000ull ||
        !atomic_compare_exchange_strong(&r->spill_retry_ns, &last, now))
        return;
    char *copy = malloc(x->row_bytes);
    if (!copy || !hapi_remote__spill_copy(r, x, row, copy, 0, x->row_bytes)) {
        free(copy);
        return;
    }
    hapi_cache_item item = { path, *id, copy, x->row_bytes };
    hapi_error err = { 0 };
    if (hapi_cache_put(r->cfg.cache, &x->ns, &item, 1, &err) == 0)
        cache_took(r);
    free(copy);
}

/*
 * Rows [a, b) of f's pack, read into rows: notes in failed those the storage
 * side could not compute, makes .feat rows of them (into finished, when the
 * index is finished here: see remote-finish.c), hands those to the waiting
 * readers and stores the others in the cache (items and paths_buf have room
 * for a chunk's rows and their paths). Returns 0, or < 0 (err) when the rows
 * could not be finished.
 */
static int fetch_chunk(hapi_remote *r, struct fetch *f, size_t a, size_t b, const char *rows,
                       char *finished, unsigned char *failed, hapi_cache_item *items,
                       char *paths_buf, hapi_error *err)
{
    const struct dir_index *x = f->index;
    struct remote_source *s = &r->sources[x->src];
    size_t dir_len = strlen(x->dir);
    size_t n = 0;
    for (size_t i = a; i < b; i++)
        failed[i - a] = (unsigned char)(x->entries[i].failed ||
                                        row_failed(x, rows + (i - a) * x->pack_row_bytes));
    if (x->finish) {
        int rc = hapi_remote__finish_rows(r, x, rows, b - a, finished, err);
        if (rc < 0)
            return rc;
        rows = finished;
    }
    for (size_t i = a; i < b; i++) {
        const char *row = rows + (i - a) * x->row_bytes;
        if (failed[i - a]) {
            atomic_fetch_add(&s->stats.rows_failed, 1);
            continue;
        }
        char *p = paths_buf + (i - a) * (dir_len + NAME_MAX + 2);
        snprintf(p, dir_len + NAME_MAX + 2, "%s%s%s", x->dir, *x->dir ? "/" : "",
                 x->entries[i].name);
        items[n++] = (hapi_cache_item){ p, x->entries[i].id, row, x->row_bytes };
    }
    deliver(r, f, a, b, rows, failed, 0);
    if (n) {
        hapi_error perr = { 0 };
        /* A full disk or map costs the cache, never the read: served all the same. */
        if (hapi_cache_put(r->cfg.cache, &x->ns, items, n, &perr) < 0) {
            atomic_fetch_add(&r->stats.cache_put_failures, n);
            spill_keep(r, f->index, a, b, rows, failed);
            if (!atomic_exchange(&r->put_failing, 1))
                hapi_log(HAPI_LOG_WARNING, "%zu fetched features not cached: %s (served "
                         "uncached; stats: cache_put_failures counts them until the cache "
                         "takes features again)", n, perr.message);
        } else {
            cache_took(r);
        }
    }
    deliver(r, f, a, b, rows, failed, 1);
    atomic_fetch_add(&s->stats.rows, b - a);
    atomic_fetch_add(&r->stats.fetched_rows, n);
    if (f->warm) {
        hapi_warmup_add(r->warm, HAPI_WARMUP_FETCHED, n);
        hapi_warmup_add(r->warm, HAPI_WARMUP_FAILED, (b - a) - n);
    }
    return 0;
}

/*
 * Fetches f's pack: checks its version and header against the index, then reads
 * it in chunks of about FETCH_CHUNK, handing each chunk's rows to the
 * waiting readers and storing them in the cache. Returns 0 or why not.
 */
static int fetch_run(hapi_remote *r, struct fetch *f, hapi_error *err)
{
    const struct dir_index *x = f->index;
    struct remote_source *s = &r->sources[x->src];
    char *path = hapi_path_join(x->dir, HAPI_PACK_NAME);
    char *buf = NULL, *paths_buf = NULL, *finished = NULL;
    char **paths = NULL;
    unsigned char *failed = NULL;
    hapi_cache_item *items = NULL;
    int rc, fd = -1;
    if (!path)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    /* Around the page cache too: a pack rewritten in place keeps its size (see index_load()). */
    fd = hapi_remote__source_open_direct(r, x->src, path, NULL);
    if (fd < 0) {
        rc = hapi_error_set(err, fd, "cannot open the pack: %s", hapi_strerror(fd));
        goto out;
    }
    hapi_remote__refresh_size(fd);
    /*
     * The pack is a snapshot taken by the storage side at this open, the index
     * one taken when it was read: the pack is the one the index describes
     * when the index still has its version now, after the open (the version
     * hashes every name and identity). Its size says nothing: the storage
     * side shows the directory's current pack size, and a network filesystem
     * may show an older one. The header (the row count) is checked below.
     */
    if (x->version[0] && !hapi_remote__index_unchanged(r, x->src, x->dir, x)) {
        rc = hapi_error_set(err, -ESTALE, "the directory changed since its index was read");
        goto out;
    }
    size_t rows_per_chunk = FETCH_CHUNK / x->pack_row_bytes ? FETCH_CHUNK / x->pack_row_bytes : 1;
    size_t chunk = rows_per_chunk * x->pack_row_bytes;
    size_t first = x->pack_header_len + chunk; /* the header and the first chunk: one read */
    buf = malloc(first);
    failed = malloc(rows_per_chunk);
    items = malloc(rows_per_chunk * sizeof(*items));
    paths = malloc(rows_per_chunk * sizeof(*paths));
    size_t dir_len = strlen(x->dir);
    paths_buf = malloc(rows_per_chunk * (dir_len + NAME_MAX + 2));
    if (x->finish)
        finished = malloc(rows_per_chunk * x->row_bytes);
    if (!buf || !failed || !items || !paths || !paths_buf || (x->finish && !finished)) {
        rc = hapi_error_set(err, -ENOMEM, "out of memory");
        goto out;
    }
    int64_t pack_shape[HAPI_MAX_DIMS];
    char expect[HAPI_NPY_HEADER_MAX];
    pack_shape[0] = (int64_t)x->count;
    memcpy(pack_shape + 1, x->pack_shape, (size_t)x->pack_ndim * sizeof(int64_t));
    hapi_npy_header(expect, x->dtype, pack_shape, x->pack_ndim + 1);

    uint64_t pos = 0;
    for (size_t a = 0; a < x->count || pos == 0;) {
        size_t b = a + rows_per_chunk < x->count ? a + rows_per_chunk : x->count;
        size_t want = (b - a) * x->pack_row_bytes + (pos == 0 ? x->pack_header_len : 0);
        rc = read_exact(fd, buf, want, (off_t)pos);
        if (rc < 0) {
            rc = rc == HAPI_ECORRUPT
                     ? hapi_error_set(err, rc, "the pack ended at %llu bytes of %llu (torn)",
                                      (unsigned long long)pos, (unsigned long long)x->pack_size)
                     : hapi_error_set(err, rc, "cannot read the pack: %s", hapi_strerror(rc));
            goto out;
        }
        const char *rows = buf;
        if (pos == 0) {
            if (memcmp(buf, expect, x->pack_header_len) != 0) {
                rc = hapi_error_set(err, -ESTALE, "the pack's header does not match its index "
                                    "(the directory changed while it was read)");
                goto out;
            }
            rows = buf + x->pack_header_len;
        }
        pos += want;
        atomic_fetch_add(&s->stats.pack_bytes, want);
        if ((rc = fetch_chunk(r, f, a, b, rows, finished, failed, items, paths_buf, err)) < 0)
            goto out;
        a = b;
        if (x->count == 0)
            break;
    }
    atomic_fetch_add(&s->stats.packs, 1);
    rc = 0;
out:
    if (fd >= 0)
        close(fd);
    free(path);
    free(buf);
    free(finished);
    free(failed);
    free(items);
    free(paths);
    free(paths_buf);
    return rc;
}

/*
 * The queued fetch to start, unlinked: of the readers' (or, when none is queued, the warm-up's),
 * the first in queue order from a source with the fewest packs being fetched. Several storage
 * nodes compute a directory's features each for its shard: taking the queue's head alone left
 * nodes idle while every thread fetched from others (4 nodes at a quarter of a CPU each used
 * 0.66 CPU of 1). Under fetch_lock; the queue is not empty.
 */
static struct fetch *queue_take_locked(hapi_remote *r)
{
    struct fetch **best = NULL, *best_prev = NULL, *prev = NULL;
    int least = INT_MAX;
    for (struct fetch **link = &r->queue_head; *link; prev = *link, link = &(*link)->queue_next) {
        struct fetch *f = *link;
        if (best && f->warm && !(*best)->warm)
            break; /* a reader's fetch before any of the warm-up's */
        int n = r->sources[f->index->src].fetching;
        if (n < least) {
            best = link, best_prev = prev, least = n;
            if (n == 0)
                break;
        }
    }
    struct fetch *f = *best;
    *best = f->queue_next;
    if (r->queue_tail == f)
        r->queue_tail = best_prev;
    f->queue_next = NULL;
    return f;
}

void *hapi_remote__fetch_thread(void *arg)
{
    hapi_remote *r = arg;
    pthread_setname_np(pthread_self(), "hapifs-fetch");
    pthread_mutex_lock(&r->fetch_lock);
    for (;;) {
        while (!r->queue_head && !r->stopping)
            pthread_cond_wait(&r->queue_cond, &r->fetch_lock);
        if (r->stopping)
            break;
        struct fetch *f = queue_take_locked(r);
        f->started = 1;
        f->refs++;
        r->sources[f->index->src].fetching++;
        pthread_mutex_unlock(&r->fetch_lock);

        hapi_error err = { 0 };
        int rc = fetch_run(r, f, &err);
        const struct dir_index *x = f->index;
        if (rc < 0) {
            atomic_fetch_add(&r->sources[x->src].stats.fetch_failures, 1);
            char *pack = hapi_path_join(x->dir, HAPI_PACK_NAME);
            char what[400];
            snprintf(what, sizeof(what), "pack %s", pack ? pack : x->dir);
            if (rc == -ESTALE || rc == HAPI_ECORRUPT) {
                /* refused, never cached; its directory is read again at the next use */
                hapi_remote__index_expire(r, x->src, x->dir);
                char msg[PATH_MAX + HAPI_ERROR_MESSAGE_MAX]; /* paths and a whole message */
                snprintf(msg, sizeof(msg), "source %s: %s refused: %s", r->sources[x->src].path,
                         pack ? pack : x->dir, err.message);
                hapi_error_ring_add(r->cfg.errors, pack ? pack : x->dir, rc, msg);
            } else {
                hapi_remote__source_failed(r, x->src, pack ? pack : x->dir, rc, what);
            }
            free(pack);
        }
        pthread_mutex_lock(&r->fetch_lock);
        r->sources[x->src].fetching--;
        f->finished = 1;
        f->code = rc;
        for (struct waiter *w = f->waiters; w; w = w->next)
            if (w->state == 0)
                w->state = rc < 0 ? rc : -EAGAIN; /* -EAGAIN: not in the pack after all */
        pthread_cond_broadcast(&f->cond);
        fetch_unlist_locked(r, f);
        f->refs--; /* the list's */
        hapi_remote__fetch_put_locked(f);
    }
    pthread_mutex_unlock(&r->fetch_lock);
    return NULL;
}

/*
 * Waits for the row of (name, id) of x to be fetched into dst (bytes [from,
 * to) of its features): joins an unfinished fetch of the same index that has
 * not passed the row, or starts one. Returns 1 (filled), 0 (look in the cache
 * again: a chunk was stored since *passes, which the caller read before its
 * miss), or < 0 (the fetch failed, or the row did). Pass passes NULL to start
 * a fetch regardless.
 */
int hapi_remote__fetch_wait(hapi_remote *r, struct dir_index *x, size_t row, const char *name,
                            const hapi_source_id *id, char *dst, size_t from, size_t to,
                            uint64_t *passes)
{
    pthread_mutex_lock(&r->fetch_lock);
    if (r->stopping) {
        pthread_mutex_unlock(&r->fetch_lock);
        return -ECANCELED;
    }
    struct fetch *f = r->fetches;
    while (f && !(f->index == x && !f->finished && f->done <= row))
        f = f->next;
    if (!f && passes && *passes != atomic_load(&r->passes)) {
        /* the miss may have raced the store of this row: never fetch a pack twice for it */
        pthread_mutex_unlock(&r->fetch_lock);
        return 0;
    }
    if (!f && !(f = hapi_remote__fetch_new_locked(r, x, 0))) {
        pthread_mutex_unlock(&r->fetch_lock);
        return -ENOMEM;
    }
    f->refs++;
    struct waiter w = { name, *id, dst, from, to, 0, f->waiters };
    f->waiters = &w;
    atomic_fetch_add(&r->stats.waits, 1);
    while (w.state == 0 && !r->stopping)
        pthread_cond_wait(&f->cond, &r->fetch_lock);
    for (struct waiter **link = &f->waiters; *link; link = &(*link)->next)
        if (*link == &w) {
            *link = w.next;
            break;
        }
    int state = w.state == 0 ? -ECANCELED : w.state;
    hapi_remote__fetch_put_locked(f);
    pthread_mutex_unlock(&r->fetch_lock);
    return state == 1 ? 1 : state;
}

/* serve.c — the bytes of a .feat read: a cache lookup or a computation through the view's batcher, into the caller's buffer. */
#include "serve.h"
#include "cache.h"
#include "evict.h"
#include "extractor.h"
#include "hapi.h"
#include "log.h"
#include "source.h"
#include "view.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/*
 * This layer never sees FUSE: it fills buffers and returns codes, and fs.c
 * replies. A second feature source (features fetched from elsewhere rather
 * than computed) plugs in here, behind hapi_serve_read().
 */
struct hapi_serve {
    hapi_serve_config cfg;
    int fault_oom_above;         /* test hook HAPIFS_FAULT_OOM_ABOVE, read once */
    char *hold_path;             /* test hook HAPIFS_TEST_HOLD, read once: see load_source() */
    void (*on_miss)(void *arg, hapi_view *v, const char *path);
    void *on_miss_arg;
    struct {
        atomic_uint_fast64_t feat_reads, feat_bytes, hits, misses, computed, errors,
            cache_put_failures, hit_ns, stale, bad, collected, passthrough_bytes;
        atomic_uint_fast64_t completed[HAPI_PRIORITY_COUNT];
        atomic_uint_fast64_t origin_computed[HAPI_PRIORITY_COUNT];
    } stats;
};

/* The batcher's context: which layer and which view its results belong to. */
struct batch_ctx {
    hapi_serve *serve;
    hapi_view *view; /* not a reference: the view owns the batcher and this */
};

int hapi_serve_new(const hapi_serve_config *cfg, hapi_serve **out, hapi_error *err)
{
    hapi_serve *s = calloc(1, sizeof(*s));
    *out = NULL;
    if (!s)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    s->cfg = *cfg;
    const char *fault = getenv("HAPIFS_FAULT_OOM_ABOVE");
    s->fault_oom_above = fault ? atoi(fault) : 0;
    const char *hold = getenv("HAPIFS_TEST_HOLD");
    if (hold && *hold && !(s->hold_path = strdup(hold))) {
        free(s);
        return hapi_error_set(err, -ENOMEM, "out of memory");
    }
    *out = s;
    return 0;
}

void hapi_serve_free(hapi_serve *s)
{
    if (s)
        free(s->hold_path);
    free(s);
}

void hapi_serve_on_miss(hapi_serve *s, void (*fn)(void *arg, hapi_view *v, const char *path),
                        void *arg)
{
    s->on_miss = fn;
    s->on_miss_arg = arg;
}

/* ------------------------------------------------------- batcher callbacks */

/* The batcher's loader: the source's bytes, and its identity as the tag. */
static int load_source(void *ctx, const char *path, void **data, size_t *size, void *tag,
                       hapi_error *err)
{
    struct batch_ctx *c = ctx;
    hapi_source_id id;
    /*
     * Test hook: while the file HAPIFS_TEST_HOLD names exists, no image is
     * loaded, so that work stays queued and in flight for as long as a test
     * needs it there, whatever the machine's speed.
     */
    while (c->serve->hold_path && access(c->serve->hold_path, F_OK) == 0)
        nanosleep(&(struct timespec){ .tv_nsec = 10000000L }, NULL);
    int rc = hapi_source_load(c->serve->cfg.source, path, data, size, &id, err);
    if (rc == 0)
        memcpy(tag, &id, sizeof(id)); /* the tag buffer need not be aligned */
    return rc;
}

/*
 * The batcher's sink, on its inference or a decode thread: stores a finished
 * batch in one write transaction and records failures.
 */
static void store_results(void *ctx, const hapi_batch_result *results, size_t n)
{
    struct batch_ctx *c = ctx;
    hapi_serve *s = c->serve;
    hapi_cache_item stack_items[64];
    hapi_cache_item *items = n <= 64 ? stack_items : malloc(n * sizeof(*items));
    size_t ok = 0;

    for (size_t i = 0; i < n; i++) {
        const hapi_batch_result *r = &results[i];
        for (int p = 0; p < HAPI_PRIORITY_COUNT; p++)
            if (r->requests[p])
                atomic_fetch_add(&s->stats.completed[p], r->requests[p]);
        if (r->code >= 0)
            atomic_fetch_add(&s->stats.origin_computed[r->origin], 1);
        if (r->code < 0 && r->origin == HAPI_PRIORITY_PREFETCH &&
            r->priority == HAPI_PRIORITY_PREFETCH)
            continue; /* nobody asked for it: an error when somebody reads the file */
        if (r->code < 0) {
            atomic_fetch_add(&s->stats.errors, 1);
            hapi_error_ring_add(s->cfg.errors, r->key, r->code, r->message);
            continue;
        }
        atomic_fetch_add(&s->stats.computed, 1);
        if (items) {
            items[ok].path = r->key;
            memcpy(&items[ok].id, r->tag, sizeof(hapi_source_id));
            items[ok].data = r->features;
            items[ok].size = c->view->sample_bytes;
            ok++;
        }
    }
    if (ok) {
        hapi_error err = { 0 };
        if (hapi_cache_put(s->cfg.cache, &c->view->ns, items, ok, &err) < 0) {
            atomic_fetch_add(&s->stats.cache_put_failures, ok);
            hapi_log(HAPI_LOG_WARNING, "%zu features not cached: %s", ok, err.message);
        }
    }
    if (items != stack_items)
        free(items);
}

int hapi_serve_view_new(hapi_serve *s, int split, int batch, uint64_t model_bytes,
                        hapi_view **out, hapi_error *err)
{
    hapi_view *v = NULL;
    int rc = hapi_view_new(s->cfg.views, split, &v, err);
    *out = NULL;
    if (rc < 0)
        return rc;
    struct batch_ctx *c = malloc(sizeof(*c));
    if (!c) {
        hapi_view_put(v);
        return hapi_error_set(err, -ENOMEM, "out of memory");
    }
    *c = (struct batch_ctx){ s, v };
    v->batcher_ctx = c;

    /*
     * The batcher's budget is what mem leaves once the model's own part (its
     * weights and the working memory of a batch) is taken, but never less
     * than two batches of input tensors.
     */
    size_t crop = (size_t)hapi_extractor_preprocess(s->cfg.ex)->crop;
    uint64_t floor = 2 * (uint64_t)batch * 3 * crop * crop * sizeof(float);
    uint64_t budget = s->cfg.mem_budget;
    budget = model_bytes < budget ? budget - model_bytes : 0;
    if (budget < floor)
        budget = floor;
    hapi_batcher_config cfg = {
        .batch = batch,
        .split = split,
        .max_wait_us = s->cfg.batch_wait_us,
        .decode_threads = s->cfg.decode_threads,
        .mem_budget = budget,
        .tag_size = sizeof(hapi_source_id),
        .load = load_source,
        .sink = store_results,
        .ctx = c,
        .fault_oom_above = s->fault_oom_above,
        .node = s->cfg.node,
        .node_cores = s->cfg.torch_threads,
        .workers = s->cfg.inference_workers,
    };
    if ((rc = hapi_batcher_new(s->cfg.ex, &cfg, &v->batcher, err)) < 0) {
        hapi_view_put(v);
        return rc;
    }
    /* the newest view's model share is what the mount holds of the node's budget */
    if (model_bytes)
        hapi_node_set_fixed(s->cfg.node, model_bytes);
    *out = v;
    return 0;
}

/* ------------------------------------------------------------------ reads */

/*
 * Looks the features up and, on a hit, copies data bytes [dpos, dend) into
 * dst before releasing the lookup (a reply written straight from the map
 * would pin the snapshot through the write to /dev/fuse, and eviction would
 * find no room). Returns 1 on a hit, 0 otherwise (a miss, a stale or damaged
 * entry, a failed lookup: all computed again).
 */
static int lookup(hapi_serve *s, hapi_view *v, const char *path, const hapi_source_id *id,
                  char *dst, size_t dpos, size_t dend)
{
    hapi_cache_value val;
    uint64_t t0 = hapi_now_ns();
    int rc = hapi_cache_get(s->cfg.cache, &v->ns, path, id, &val);
    if (rc == 1) {
        if (val.size == v->sample_bytes) {
            memcpy(dst, (const char *)val.data + dpos, dend - dpos);
            hapi_cache_release(s->cfg.cache, &val);
            atomic_fetch_add(&s->stats.hits, 1);
            atomic_fetch_add(&s->stats.hit_ns, hapi_now_ns() - t0);
            return 1;
        }
        hapi_cache_release(s->cfg.cache, &val);
        atomic_fetch_add(&s->stats.bad, 1);
        hapi_log(HAPI_LOG_WARNING, "%s: cached features have %zu bytes, expected %zu; recomputing",
                 path, val.size, v->sample_bytes);
    } else if (rc == 0 && val.miss == HAPI_CACHE_MISS_STALE) {
        atomic_fetch_add(&s->stats.stale, 1); /* the source changed: recompute */
    } else if (rc == 0 && val.miss == HAPI_CACHE_MISS_BAD) {
        atomic_fetch_add(&s->stats.bad, 1);
        hapi_log(HAPI_LOG_WARNING, "%s: cached features are damaged (length or checksum); "
                 "recomputing", path);
    } else if (rc < 0) {
        hapi_log(HAPI_LOG_WARNING, "%s: cache lookup failed: %s", path, hapi_strerror(rc));
    }
    return 0;
}

/* How many times a read asks again for a result loaded before it was opened. */
#define STALE_ROUNDS 3

/*
 * Whether a computed result (tag: the identity of the bytes it was computed
 * from; zero when they could not be read) may answer a read of path opened
 * at identity want: it is of want, or of what the source is now (it changed
 * after the open: the reader gets it as it is). Not when the read joined a
 * request whose bytes were read before the source changed to want: the
 * reader never saw that version, and its bytes would stay in the kernel's
 * pages of want's node (fs.c names a .feat by its identity).
 */
static int result_fits(hapi_serve *s, const char *path, const hapi_source_id *want,
                       const void *tag)
{
    static const hapi_source_id none;
    hapi_source_id got, now;
    memcpy(&got, tag, sizeof(got)); /* the tag buffer need not be aligned */
    if (memcmp(&got, want, sizeof(got)) == 0 || memcmp(&got, &none, sizeof(got)) == 0)
        return 1;
    return hapi_source_identity(s->cfg.source, path, &now) == 0 &&
           memcmp(&got, &now, sizeof(now)) == 0;
}

ssize_t hapi_serve_read(hapi_serve *s, hapi_view *v, const char *path, const hapi_source_id *id,
                        char *buf, size_t size, off_t off)
{
    atomic_fetch_add(&s->stats.feat_reads, 1);
    size_t dpos, dend;
    ssize_t head = hapi_feat_split_read(v->npy_header, v->npy_header_len, v->feat_size, buf,
                                        size, off, &dpos, &dend);
    if (head < 0)
        return 0;
    size_t n = (size_t)head;
    char *dst = buf + n;

    /* Even a read of the header alone looks the features up: it says an open file is read. */
    if (!lookup(s, v, path, id, dst, dpos, dend)) {
        /* A miss: the batcher computes it once, however many readers wait for it. */
        atomic_fetch_add(&s->stats.misses, 1);
        if (!v->batcher)
            return -ESTALE; /* a view of a split no longer served: from the cache only */
        int rc;
        for (int round = 1;; round++) {
            hapi_ticket *t = NULL;
            const void *features, *tag;
            rc = hapi_batcher_submit(v->batcher, path, HAPI_PRIORITY_DEMAND, &t);
            if (rc >= 0 && round == 1 && s->on_miss)
                s->on_miss(s->on_miss_arg, v, path); /* after the read's own request */
            if (rc >= 0) /* on failure, the sink logged why */
                rc = hapi_ticket_wait(v->batcher, t, &features, &tag, NULL);
            int fits = !t || result_fits(s, path, id, tag);
            if (rc == 0 && fits)
                memcpy(dst, (const char *)features + dpos, dend - dpos);
            hapi_ticket_release(v->batcher, t);
            if (fits)
                break;
            atomic_fetch_add(&s->stats.stale, 1); /* older than the open: ask again */
            if (round == STALE_ROUNDS) {
                hapi_log(HAPI_LOG_WARNING, "%s: kept changing while its features were computed",
                         path);
                rc = -EAGAIN;
                break;
            }
        }
        if (rc < 0)
            return rc;
    }
    n += dend - dpos;
    atomic_fetch_add(&s->stats.feat_bytes, n);
    return (ssize_t)n;
}

/* Whether the features of path at identity id are cached at v; counts nothing. */
static int probe(hapi_serve *s, hapi_view *v, const char *path, const hapi_source_id *id)
{
    hapi_cache_value val;
    if (hapi_cache_get(s->cfg.cache, &v->ns, path, id, &val) != 1)
        return 0;
    int ok = val.size == v->sample_bytes;
    hapi_cache_release(s->cfg.cache, &val);
    return ok;
}

int hapi_serve_cached(hapi_serve *s, hapi_view *v, const char *path, const hapi_source_id *id)
{
    return probe(s, v, path, id);
}

int hapi_serve_read_parts(hapi_serve *s, hapi_view *v, hapi_serve_part *parts, size_t n)
{
    hapi_ticket *stack[64] = { 0 };
    hapi_ticket **tickets = n <= 64 ? stack : calloc(n, sizeof(*tickets));
    int rc = 0;
    if (!tickets)
        return -ENOMEM;
    /* Hits are copied now; every miss is asked for before any is waited for: one batch. */
    for (size_t i = 0; i < n && rc == 0; i++) {
        hapi_serve_part *p = &parts[i];
        p->code = 0;
        if (p->dst) {
            if (lookup(s, v, p->path, p->id, p->dst, p->from, p->to))
                continue;
            atomic_fetch_add(&s->stats.misses, 1);
            p->code = hapi_batcher_submit(v->batcher, p->path, HAPI_PRIORITY_DEMAND, &tickets[i]);
        } else if (!probe(s, v, p->path, p->id)) {
            p->code = hapi_batcher_submit(v->batcher, p->path, HAPI_PRIORITY_DEMAND, NULL);
        }
        if (p->code == HAPI_BATCHER_DELIVERED)
            p->code = 0; /* its ticket is as good */
        if (p->code == -ECANCELED)
            rc = -ECANCELED;
    }
    /* A result loaded before the snapshot's identity (a request joined) is asked for again. */
    for (int round = 1, again = 1; again; round++) {
        again = 0;
        for (size_t i = 0; i < n; i++) {
            hapi_serve_part *p = &parts[i];
            if (!tickets[i])
                continue;
            const void *features, *tag;
            int fits = 1;
            if (rc == 0) {
                p->code = hapi_ticket_wait(v->batcher, tickets[i], &features, &tag, NULL);
                fits = result_fits(s, p->path, p->id, tag);
            }
            if (rc == 0 && p->code == 0 && fits)
                memcpy(p->dst, (const char *)features + p->from, p->to - p->from);
            hapi_ticket_release(v->batcher, tickets[i]);
            tickets[i] = NULL;
            if (fits)
                continue;
            atomic_fetch_add(&s->stats.stale, 1);
            p->code = round == STALE_ROUNDS
                          ? -EAGAIN
                          : hapi_batcher_submit(v->batcher, p->path, HAPI_PRIORITY_DEMAND,
                                                &tickets[i]);
            if (p->code == HAPI_BATCHER_DELIVERED)
                p->code = 0;
            again |= tickets[i] != NULL;
        }
    }
    if (tickets != stack)
        free(tickets);
    return rc;
}

int hapi_serve_queue(hapi_serve *s, hapi_view *v, const char *path, int priority,
                     atomic_int *stop)
{
    hapi_source_id id;
    hapi_cache_value val;
    if (hapi_source_identity(s->cfg.source, path, &id) < 0)
        return HAPI_QUEUE_SKIPPED;
    if (hapi_cache_get(s->cfg.cache, &v->ns, path, &id, &val) == 1) {
        hapi_cache_release(s->cfg.cache, &val);
        return HAPI_QUEUE_CACHED;
    }
    /* Feed the queue without flooding it: background work yields to every reader anyway. */
    hapi_batcher_stats bs;
    hapi_batcher_stats_get(v->batcher, &bs);
    int rc;
    do
        rc = hapi_batcher_throttle(v->batcher, priority, (size_t)bs.batch * 2);
    while (rc == -EINTR && !(stop && atomic_load(stop)));
    if (rc <= 0 && stop && atomic_load(stop))
        rc = -ECANCELED;
    if (rc == 0)
        rc = hapi_batcher_submit(v->batcher, path, priority, NULL);
    /* A result delivered already is in the cache, or its failure recorded. */
    return rc == HAPI_BATCHER_DELIVERED ? HAPI_QUEUE_CACHED : rc;
}

void hapi_serve_note_passthrough(hapi_serve *s, size_t bytes)
{
    atomic_fetch_add(&s->stats.passthrough_bytes, bytes);
}

/* -------------------------------------------------------------- eviction */

void hapi_serve_collect(hapi_serve *s, const char *path)
{
    hapi_error err = { 0 };
    hapi_view *v = hapi_views_peek(s->cfg.views);
    if (!v)
        return; /* nothing can have been cached before the first view */
    int rc = hapi_cache_evict_path(s->cfg.cache, &v->ns, path, &err);
    hapi_view_put(v);
    if (rc == 1)
        atomic_fetch_add(&s->stats.collected, 1);
    else if (rc < 0)
        hapi_log(HAPI_LOG_WARNING, "%s: cannot remove the features of a deleted source: %s",
                 path, err.message);
}

int hapi_serve_evict(hapi_serve *s, const char *path, hapi_error *err)
{
    hapi_view *v = hapi_views_get(s->cfg.views);
    struct stat st;
    int rc;
    if (!v)
        return hapi_error_set(err, -ECANCELED, "unmounting");
    if (!*path) {
        rc = hapi_cache_evict_all(s->cfg.cache, &v->ns, err);
    } else if ((rc = hapi_source_stat(s->cfg.source, path, &st)) < 0) {
        rc = hapi_error_set(err, rc, "'%s': %s", path, hapi_strerror(rc));
    } else if (S_ISREG(st.st_mode)) {
        rc = hapi_cache_evict_path(s->cfg.cache, &v->ns, path, err);
    } else {
        hapi_evict_walk w = { s->cfg.cache, &v->ns, 0, err };
        rc = hapi_source_walk(s->cfg.source, path, HAPI_WALK_RECURSE, NULL,
                              hapi_evict_walk_entry, &w);
        if (rc >= 0)
            rc = w.count;
    }
    hapi_view_put(v);
    return rc;
}

void hapi_serve_stats_get(hapi_serve *s, hapi_serve_stats *st)
{
    memset(st, 0, sizeof(*st));
    st->feat_reads = atomic_load(&s->stats.feat_reads);
    st->feat_bytes = atomic_load(&s->stats.feat_bytes);
    st->hits = atomic_load(&s->stats.hits);
    st->misses = atomic_load(&s->stats.misses);
    st->computed = atomic_load(&s->stats.computed);
    st->errors = atomic_load(&s->stats.errors);
    st->cache_put_failures = atomic_load(&s->stats.cache_put_failures);
    st->hit_ns = atomic_load(&s->stats.hit_ns);
    st->stale = atomic_load(&s->stats.stale);
    st->bad = atomic_load(&s->stats.bad);
    st->collected = atomic_load(&s->stats.collected);
    st->passthrough_bytes = atomic_load(&s->stats.passthrough_bytes);
    for (int p = 0; p < HAPI_PRIORITY_COUNT; p++) {
        st->completed[p] = atomic_load(&s->stats.completed[p]);
        st->origin_computed[p] = atomic_load(&s->stats.origin_computed[p]);
    }
}

/* pack.c — per-directory packs: the features of a directory's images as one .npy, and its index. */
#include "pack.h"
#include "cache.h"
#include "extractor.h"
#include "hapi.h"
#include "packindex.h"
#include "serve.h"
#include "shared.h"
#include "source.h"
#include "view.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

/*
 * Failures of pack rows, remembered so that the index can say "failed" and
 * why. Direct-mapped by the path's hash: bounded memory, and an entry
 * overwritten by a later failure only turns that row's status back to
 * "pending" (its row in a pack is NaN either way).
 */
#define PACK_FAILURES 4096

struct pack_failure {
    uint64_t hash;             /* of the path; 0 = empty */
    uint64_t view_serial;
    hapi_source_id id;
    int code;
};

/*
 * Rows that a read covered only in part, kept whole for the reads that cover
 * the rest. The kernel reads a pack in requests split at page boundaries,
 * which fall inside rows (and readers of one pack share its pages); if a
 * row's image changed between two requests, each part computed anew could
 * be of another version, and the row a mix of two. So a row computed for a
 * part is kept, keyed by the snapshot's key (hapi_pack_key) and its index;
 * every other part of it is copied from what is kept, and it goes once as
 * many bytes as the row has were read from it. Bounded in count and bytes
 * (the least recently used goes first, counted in rows_split_dropped: a
 * part read after that is computed anew), which forty readers of packs at
 * once do not reach. (A row whose pages the kernel evicts and reads again
 * is read again from here while kept, else computed again: then of the
 * image as it is.)
 */
#define PACK_PARTIAL_ROWS 1024
#define PACK_PARTIAL_BYTES (64u << 20)

struct partial_row {
    uint64_t key;              /* the snapshot's */
    size_t row;
    int code;                  /* 0, or why the row could not be computed (NaN) */
    char *data;                /* the row's bytes (NULL when failed) */
    size_t size;               /* bytes held (0 when failed) */
    size_t served;             /* bytes read from it so far: it goes at the row's size */
    uint64_t used;             /* a tick: the least recently used goes first; 0 = empty */
};

struct hapi_packs {
    hapi_source *source;
    char *hold_index;              /* test hook HAPIFS_TEST_HOLD_INDEX, read once: see hapi_pack_index() */
    hapi_views *views;
    hapi_serve *serve;
    pthread_mutex_t failure_lock;
    struct pack_failure failures[PACK_FAILURES];
    pthread_mutex_t partial_lock;  /* a leaf */
    struct partial_row partial[PACK_PARTIAL_ROWS];
    size_t partial_bytes;
    uint64_t partial_tick;
    struct {
        atomic_uint_fast64_t opens, reads, bytes, rows, rows_failed, index_reads;
        atomic_uint_fast64_t rows_split, rows_split_dropped;
    } stats;
};

/* The images of a directory at one moment, in the byte order of their names. */
struct snapshot {
    size_t count, cap;
    char **names;
    char **paths;
    hapi_source_id *ids;
    struct timespec mtime, ctime;
    uint64_t key;              /* of the view's namespace, the names and the identities */
    const hapi_cred *who;      /* NULL, or who must be able to read every image */
    int denied;                /* who cannot read one of them */
};

struct hapi_pack {
    hapi_packs *packs;
    hapi_view *view;           /* a reference: the split the pack was opened at */
    struct snapshot snap;
    char header[HAPI_NPY_HEADER_MAX];
    size_t header_len;
    uint64_t size;
    pthread_mutex_t lock;
    size_t ahead;              /* rows before this one have been asked for */
};

int hapi_packs_new(hapi_source *source, hapi_views *views, hapi_serve *serve, hapi_packs **out)
{
    hapi_packs *p = calloc(1, sizeof(*p));
    *out = NULL;
    if (!p)
        return -ENOMEM;
    p->source = source;
    p->views = views;
    p->serve = serve;
    const char *hold = getenv("HAPIFS_TEST_HOLD_INDEX");
    if (hold && *hold && !(p->hold_index = strdup(hold))) {
        free(p);
        return -ENOMEM;
    }
    pthread_mutex_init(&p->failure_lock, NULL);
    pthread_mutex_init(&p->partial_lock, NULL);
    *out = p;
    return 0;
}

void hapi_packs_free(hapi_packs *p)
{
    if (!p)
        return;
    for (size_t i = 0; i < PACK_PARTIAL_ROWS; i++)
        free(p->partial[i].data);
    pthread_mutex_destroy(&p->failure_lock);
    pthread_mutex_destroy(&p->partial_lock);
    free(p->hold_index);
    free(p);
}

/* ---------------------------------------------------------------- snapshot */

static void snapshot_free(struct snapshot *sn)
{
    for (size_t i = 0; i < sn->count; i++) {
        free(sn->names[i]);
        free(sn->paths[i]);
    }
    free(sn->names);
    free(sn->paths);
    free(sn->ids);
    memset(sn, 0, sizeof(*sn));
}

static void latest(struct timespec *t, const struct timespec *u)
{
    if (u->tv_sec > t->tv_sec || (u->tv_sec == t->tv_sec && u->tv_nsec > t->tv_nsec))
        *t = *u;
}

static int snapshot_add(const hapi_source_entry *e, void *arg)
{
    struct snapshot *sn = arg;
    if (sn->count == sn->cap) {
        size_t cap = sn->cap ? sn->cap * 2 : 64;
        char **names = realloc(sn->names, cap * sizeof(*names));
        if (names)
            sn->names = names;
        char **paths = realloc(sn->paths, cap * sizeof(*paths));
        if (paths)
            sn->paths = paths;
        hapi_source_id *ids = realloc(sn->ids, cap * sizeof(*ids));
        if (ids)
            sn->ids = ids;
        if (!names || !paths || !ids)
            return -ENOMEM;
        sn->cap = cap;
    }
    sn->names[sn->count] = strdup(e->name);
    sn->paths[sn->count] = strdup(e->path);
    if (!sn->names[sn->count] || !sn->paths[sn->count]) {
        free(sn->names[sn->count]);
        free(sn->paths[sn->count]);
        return -ENOMEM;
    }
    hapi_source_identity_of(e->st, &sn->ids[sn->count]);
    if (!hapi_cred_may(sn->who, e->st, R_OK))
        sn->denied = 1;
    latest(&sn->mtime, &e->st->st_mtim);
    latest(&sn->ctime, &e->st->st_ctim);
    sn->count++;
    return 0;
}

/* Sorts the three arrays together by name (byte order). */
static void snapshot_sort(struct snapshot *sn)
{
    /* Insertion into an order array, then a permutation: names are unique in a directory. */
    size_t n = sn->count;
    size_t *order = malloc(n * sizeof(*order));
    char **names = malloc(n * sizeof(*names)), **paths = malloc(n * sizeof(*paths));
    hapi_source_id *ids = malloc(n * sizeof(*ids));
    if (!order || !names || !paths || !ids) {
        free(order), free(names), free(paths), free(ids);
        return; /* callers check sortedness below */
    }
    for (size_t i = 0; i < n; i++)
        order[i] = i;
    /* A merge sort on indices: directories of 10^4 images must not cost n^2. */
    size_t *tmp = malloc(n * sizeof(*tmp));
    if (!tmp) {
        free(order), free(names), free(paths), free(ids);
        return;
    }
    for (size_t width = 1; width < n; width *= 2) {
        for (size_t lo = 0; lo < n; lo += 2 * width) {
            size_t mid = lo + width < n ? lo + width : n;
            size_t hi = lo + 2 * width < n ? lo + 2 * width : n;
            size_t a = lo, b = mid, k = lo;
            while (a < mid && b < hi)
                tmp[k++] = strcmp(sn->names[order[a]], sn->names[order[b]]) <= 0 ? order[a++]
                                                                                 : order[b++];
            while (a < mid)
                tmp[k++] = order[a++];
            while (b < hi)
                tmp[k++] = order[b++];
        }
        memcpy(order, tmp, n * sizeof(*order));
    }
    free(tmp);
    for (size_t i = 0; i < n; i++) {
        names[i] = sn->names[order[i]];
        paths[i] = sn->paths[order[i]];
        ids[i] = sn->ids[order[i]];
    }
    free(sn->names), free(sn->paths), free(sn->ids), free(order);
    sn->names = names;
    sn->paths = paths;
    sn->ids = ids;
    sn->cap = n;
}

/*
 * Takes the snapshot of dir's images. Returns 0, -ENOENT (none), -ENOTDIR,
 * -EACCES (who, when not NULL, cannot read one of them) or -errno.
 */
static int snapshot_take(hapi_packs *p, const char *dir, const hapi_cred *who,
                         struct snapshot *sn)
{
    struct stat st;
    memset(sn, 0, sizeof(*sn));
    sn->who = who;
    int rc = hapi_source_stat(p->source, dir, &st);
    if (rc == 0 && !S_ISDIR(st.st_mode))
        rc = -ENOTDIR;
    if (rc < 0)
        return rc;
    sn->mtime = st.st_mtim;
    sn->ctime = st.st_ctim;
    /* The images the listing shows as .feat: regular files with an image name. */
    rc = hapi_source_walk(p->source, dir, HAPI_WALK_STAT, NULL, snapshot_add, sn);
    if (rc == 0 && sn->count == 0)
        rc = -ENOENT;
    if (rc == 0 && sn->denied)
        rc = -EACCES;
    if (rc == 0) {
        snapshot_sort(sn);
        for (size_t i = 1; i < sn->count && rc == 0; i++)
            if (strcmp(sn->names[i - 1], sn->names[i]) >= 0)
                rc = -ENOMEM; /* the sort had no memory */
    }
    if (rc < 0)
        snapshot_free(sn);
    return rc;
}

/* The .npy header of count rows at v. Returns its length or < 0. */
static int pack_header(const hapi_view *v, uint64_t count, char *buf)
{
    int64_t shape[HAPI_MAX_DIMS + 1];
    shape[0] = (int64_t)count;
    for (int i = 0; i < v->output.ndim; i++)
        shape[i + 1] = v->output.shape[i];
    return hapi_npy_header(buf, v->dtype, shape, v->output.ndim + 1);
}

/* What the index of a snapshot can grow to: its fixed part and, per row, a bound. */
static uint64_t index_bound(const struct snapshot *sn)
{
    uint64_t bound = HAPI_PACKINDEX_HEAD_BOUND;
    for (size_t i = 0; i < sn->count; i++)
        bound += hapi_packindex_entry_bound(sn->names[i]);
    return bound;
}

/*
 * The current view (a reference in *v), the snapshot of dir and the header
 * of its pack: what every use of a pack starts with. Returns the header's
 * length, or < 0 with nothing held.
 */
static int take(hapi_packs *p, const char *dir, const hapi_cred *who, hapi_view **v,
                struct snapshot *sn, char *header)
{
    if (!(*v = hapi_views_get(p->views)))
        return -ENODEV;
    int rc = snapshot_take(p, dir, who, sn);
    if (rc == 0 && (rc = pack_header(*v, sn->count, header)) < 0)
        snapshot_free(sn);
    if (rc >= 0) {
        XXH3_state_t key;
        XXH3_64bits_reset(&key);
        XXH3_64bits_update(&key, &(*v)->ns, sizeof((*v)->ns));
        XXH3_64bits_update(&key, &sn->count, sizeof(sn->count));
        for (size_t i = 0; i < sn->count; i++) {
            XXH3_64bits_update(&key, sn->names[i], strlen(sn->names[i]) + 1);
            XXH3_64bits_update(&key, &sn->ids[i], sizeof(sn->ids[i]));
        }
        sn->key = XXH3_64bits_digest(&key);
    }
    if (rc < 0) {
        hapi_view_put(*v);
        *v = NULL;
    }
    return rc;
}

/* What a pack of snapshot sn, header_len bytes of header, at view v is. */
static void describe(const hapi_view *v, const struct snapshot *sn, size_t header_len,
                     hapi_pack_info *info)
{
    info->count = sn->count;
    info->size = header_len + sn->count * (uint64_t)v->sample_bytes;
    info->index_bound = index_bound(sn);
    info->mtime = sn->mtime;
    info->ctime = sn->ctime;
    info->key = sn->key;
}

int hapi_pack_info_get(hapi_packs *p, const char *dir, hapi_pack_info *info)
{
    struct snapshot sn;
    char header[HAPI_NPY_HEADER_MAX];
    hapi_view *v;
    int rc = take(p, dir, NULL, &v, &sn, header);
    if (rc < 0)
        return rc;
    describe(v, &sn, (size_t)rc, info);
    snapshot_free(&sn);
    hapi_view_put(v);
    return 0;
}

void hapi_pack_describe(const hapi_pack *k, hapi_pack_info *info)
{
    describe(k->view, &k->snap, k->header_len, info);
}

/* ------------------------------------------------------------------ reads */

int hapi_pack_open(hapi_packs *p, const char *dir, const hapi_cred *who, hapi_pack **out)
{
    *out = NULL;
    hapi_pack *k = calloc(1, sizeof(*k));
    if (!k)
        return -ENOMEM;
    k->packs = p;
    pthread_mutex_init(&k->lock, NULL);
    int rc = take(p, dir, who, &k->view, &k->snap, k->header);
    if (rc < 0) {
        hapi_pack_close(k);
        return rc;
    }
    k->header_len = (size_t)rc;
    k->size = k->header_len + k->snap.count * (uint64_t)k->view->sample_bytes;
    atomic_fetch_add(&p->stats.opens, 1);
    *out = k;
    return 0;
}

uint64_t hapi_pack_size(const hapi_pack *k)
{
    return k->size;
}

uint64_t hapi_pack_key(const hapi_pack *k)
{
    return k->snap.key;
}

void hapi_pack_close(hapi_pack *k)
{
    if (!k)
        return;
    snapshot_free(&k->snap);
    hapi_view_put(k->view);
    pthread_mutex_destroy(&k->lock);
    free(k);
}

static struct pack_failure *failure_slot(hapi_packs *p, uint64_t hash)
{
    return &p->failures[hash % PACK_FAILURES];
}

static void failure_note(hapi_packs *p, const hapi_view *v, const char *path,
                         const hapi_source_id *id, int code)
{
    uint64_t hash = XXH3_64bits(path, strlen(path)) | 1;
    pthread_mutex_lock(&p->failure_lock);
    *failure_slot(p, hash) = (struct pack_failure){ hash, v->serial, *id, code };
    pthread_mutex_unlock(&p->failure_lock);
}

/* The failure remembered for path at v and identity id, or 0. */
static int failure_find(hapi_packs *p, const hapi_view *v, const char *path,
                        const hapi_source_id *id)
{
    uint64_t hash = XXH3_64bits(path, strlen(path)) | 1;
    int code = 0;
    pthread_mutex_lock(&p->failure_lock);
    struct pack_failure *f = failure_slot(p, hash);
    if (f->hash == hash && f->view_serial == v->serial && memcmp(&f->id, id, sizeof(*id)) == 0)
        code = f->code;
    pthread_mutex_unlock(&p->failure_lock);
    return code;
}

/* Writes NaN over bytes [from, to) of a row of v's dtype (little-endian, as the header says). */
static void fill_nan(const hapi_view *v, char *dst, size_t from, size_t to)
{
    size_t width;
    const unsigned char *nan = hapi_feat_nan(v->dtype, &width);
    for (size_t i = from; i < to; i++)
        dst[i - from] = (char)nan[i % width];
}

/* ----------------------------------------------------------- partial rows */

/* The kept row (key, row), or NULL. Under partial_lock. */
static struct partial_row *partial_find(hapi_packs *p, uint64_t key, size_t row)
{
    for (size_t i = 0; i < PACK_PARTIAL_ROWS; i++)
        if (p->partial[i].used && p->partial[i].key == key && p->partial[i].row == row)
            return &p->partial[i];
    return NULL;
}

static void partial_drop(hapi_packs *p, struct partial_row *e)
{
    p->partial_bytes -= e->size;
    free(e->data);
    memset(e, 0, sizeof(*e));
}

/*
 * Copies bytes [from, to) of kept row e to dst (NaN for a failed row); drops
 * it once every byte of the row has been read. Under partial_lock.
 */
static void partial_copy_out(hapi_packs *p, const hapi_view *v, struct partial_row *e, char *dst,
                             size_t from, size_t to)
{
    e->used = ++p->partial_tick;
    if (e->code)
        fill_nan(v, dst, from, to);
    else
        memcpy(dst, e->data + from, to - from);
    e->served += to - from;
    if (e->served >= v->sample_bytes)
        partial_drop(p, e);
}

/* Copies bytes [from, to) of row (key, row) to dst if it is kept. Returns 1 if it was. */
static int partial_get(hapi_packs *p, const hapi_view *v, uint64_t key, size_t row, char *dst,
                       size_t from, size_t to)
{
    pthread_mutex_lock(&p->partial_lock);
    struct partial_row *e = partial_find(p, key, row);
    if (e)
        partial_copy_out(p, v, e, dst, from, to);
    pthread_mutex_unlock(&p->partial_lock);
    return e != NULL;
}

/*
 * Keeps row (key, row), computed whole into data (malloc'd, sample_bytes;
 * taken over) or failed with code, unless a read of another part kept it
 * first; then copies bytes [from, to) of what is kept to dst.
 */
static void partial_put(hapi_packs *p, const hapi_view *v, uint64_t key, size_t row, char *data,
                        int code, char *dst, size_t from, size_t to)
{
    size_t size = code ? 0 : v->sample_bytes;
    if (code) {
        free(data);
        data = NULL;
    }
    pthread_mutex_lock(&p->partial_lock);
    struct partial_row *e = partial_find(p, key, row);
    if (!e && size <= PACK_PARTIAL_BYTES) {
        /* Room: the least recently used go until the bytes fit, and a slot is free. */
        for (;;) {
            struct partial_row *oldest = NULL, *empty = NULL;
            for (size_t i = 0; i < PACK_PARTIAL_ROWS; i++) {
                struct partial_row *x = &p->partial[i];
                if (!x->used)
                    empty = empty ? empty : x;
                else if (!oldest || x->used < oldest->used)
                    oldest = x;
            }
            if (empty && p->partial_bytes + size <= PACK_PARTIAL_BYTES) {
                e = empty;
                break;
            }
            atomic_fetch_add(&p->stats.rows_split_dropped, 1);
            partial_drop(p, oldest);
        }
        *e = (struct partial_row){ key, row, code, data, size, 0, 0 };
        p->partial_bytes += size;
        data = NULL;
        atomic_fetch_add(&p->stats.rows_split, 1);
    }
    if (e) {
        partial_copy_out(p, v, e, dst, from, to);
    } else if (code) {
        fill_nan(v, dst, from, to);
    } else {
        memcpy(dst, data + from, to - from); /* too large to keep */
    }
    pthread_mutex_unlock(&p->partial_lock);
    free(data);
}

/* --------------------------------------------------------------- reading */

/*
 * One read's rows: the bytes [dpos, dend) of the pack's rows (offsets past
 * its header) go to dst, rows [r0, r1); rows [a0, a1) are asked for ahead.
 * parts[0, demand) are the rows the read covers that no kept partial row
 * served (part_row[i] is part i's row), parts[demand, nparts) those ahead.
 * A row covered in part (only the first or the last can be) is computed
 * whole into whole[0] (the first) or whole[1] (the last), then kept.
 */
struct rows_read {
    hapi_pack *k;
    char *dst;
    uint64_t dpos, dend;
    size_t r0, r1, a0, a1;
    hapi_serve_part *parts;
    size_t *part_row;
    size_t nparts, demand;
    char *whole[2];
};

/* The part [*from, *to) of row r that bytes [dpos, dend) of the rows cover. */
static void row_span(const struct rows_read *rr, size_t r, size_t *from, size_t *to)
{
    uint64_t sb = rr->k->view->sample_bytes, row = r * sb;
    *from = (size_t)(rr->dpos > row ? rr->dpos - row : 0);
    *to = (size_t)(rr->dend < row + sb ? rr->dend - row : sb);
}

/* Where the part of row r that the read covers goes in its buffer. */
static char *row_dst(const struct rows_read *rr, size_t r, size_t from)
{
    return rr->dst + (r * (uint64_t)rr->k->view->sample_bytes + from - rr->dpos);
}

/*
 * The rows to ask for ahead of a read that ends at row r1, so that batches
 * stay full: up to two batches past it, never a row asked for before.
 */
static void rows_ahead(hapi_pack *k, size_t r1, size_t *a0, size_t *a1)
{
    hapi_batcher_stats bs;
    hapi_batcher_stats_get(k->view->batcher, &bs);
    size_t window = 2 * (size_t)(bs.batch > 0 ? bs.batch : 1);
    pthread_mutex_lock(&k->lock);
    *a0 = k->ahead > r1 ? k->ahead : r1;
    *a1 = r1 + window < k->snap.count ? r1 + window : k->snap.count;
    if (*a1 < *a0)
        *a1 = *a0;
    if (*a1 > k->ahead)
        k->ahead = *a1;
    pthread_mutex_unlock(&k->lock);
}

/*
 * The parts to ask serve for: each row the read covers (a row it covers in
 * part comes from the partial rows if another read has kept it, else is
 * computed whole), then the rows ahead. Returns 0 or -ENOMEM.
 */
static int rows_plan(struct rows_read *rr)
{
    hapi_pack *k = rr->k;
    size_t sb = k->view->sample_bytes;
    rr->parts = calloc(rr->r1 - rr->r0 + (rr->a1 - rr->a0), sizeof(*rr->parts));
    rr->part_row = calloc(rr->r1 - rr->r0, sizeof(*rr->part_row));
    if (!rr->parts || !rr->part_row)
        return -ENOMEM;
    for (size_t r = rr->r0; r < rr->r1; r++) {
        size_t from, to;
        row_span(rr, r, &from, &to);
        char *dst = row_dst(rr, r, from);
        int in_part = from > 0 || to < sb;
        if (in_part && partial_get(k->packs, k->view, k->snap.key, r, dst, from, to))
            continue;
        hapi_serve_part *pt = &rr->parts[rr->nparts];
        rr->part_row[rr->nparts++] = r;
        *pt = (hapi_serve_part){ k->snap.paths[r], &k->snap.ids[r], dst, from, to, 0 };
        if (in_part) {
            char **w = &rr->whole[r == rr->r0 ? 0 : 1];
            if (!(*w = malloc(sb)))
                return -ENOMEM;
            pt->dst = *w;
            pt->from = 0;
            pt->to = sb;
        }
    }
    rr->demand = rr->nparts;
    for (size_t r = rr->a0; r < rr->a1; r++) {
        rr->parts[rr->nparts].path = k->snap.paths[r];
        rr->parts[rr->nparts++].id = &k->snap.ids[r];
    }
    return 0;
}

/*
 * After serve filled the parts: a failed row is noted for the index and is
 * NaN; a row computed whole is kept and its covered part copied out.
 */
static void rows_deliver(struct rows_read *rr)
{
    hapi_pack *k = rr->k;
    hapi_packs *p = k->packs;
    for (size_t i = 0; i < rr->demand; i++) {
        hapi_serve_part *pt = &rr->parts[i];
        size_t r = rr->part_row[i];
        if (pt->code) {
            /* The row of an image that cannot be computed is NaN; the index says why. */
            failure_note(p, k->view, pt->path, pt->id, pt->code);
            atomic_fetch_add(&p->stats.rows_failed, 1);
        }
        char **w = r == rr->r0 && rr->whole[0]       ? &rr->whole[0]
                   : r == rr->r1 - 1 && rr->whole[1] ? &rr->whole[1]
                                                     : NULL;
        if (w) {
            size_t from, to;
            row_span(rr, r, &from, &to);
            partial_put(p, k->view, k->snap.key, r, *w, pt->code, row_dst(rr, r, from), from, to);
            *w = NULL;
        } else if (pt->code) {
            fill_nan(k->view, pt->dst, pt->from, pt->to);
        }
    }
    atomic_fetch_add(&p->stats.rows, rr->r1 - rr->r0);
}

ssize_t hapi_pack_read(hapi_pack *k, char *buf, size_t size, off_t off)
{
    hapi_packs *p = k->packs;
    atomic_fetch_add(&p->stats.reads, 1);
    if (off < 0 || (uint64_t)off >= k->size)
        return 0;
    uint64_t pos = (uint64_t)off, hdr = k->header_len, sb = k->view->sample_bytes;
    uint64_t end = size < k->size - pos ? pos + size : k->size;
    size_t n = 0;
    if (pos < hdr) {
        uint64_t stop = end < hdr ? end : hdr;
        memcpy(buf, k->header + pos, stop - pos);
        n = stop - pos;
    }
    if (end <= hdr) {
        atomic_fetch_add(&p->stats.bytes, n);
        return (ssize_t)n;
    }
    struct rows_read rr = { .k = k, .dst = buf + n };
    rr.dpos = (pos > hdr ? pos : hdr) - hdr;
    rr.dend = end - hdr;
    rr.r0 = rr.dpos / sb;
    rr.r1 = (rr.dend + sb - 1) / sb;
    rows_ahead(k, rr.r1, &rr.a0, &rr.a1);
    int rc = rows_plan(&rr);
    if (rc == 0)
        rc = hapi_serve_read_parts(p->serve, k->view, rr.parts, rr.nparts);
    if (rc == 0)
        rows_deliver(&rr);
    free(rr.whole[0]);
    free(rr.whole[1]);
    free(rr.parts);
    free(rr.part_row);
    if (rc < 0)
        return rc;
    n += (size_t)(rr.dend - rr.dpos);
    atomic_fetch_add(&p->stats.bytes, n);
    return (ssize_t)n;
}

/* ------------------------------------------------------------------ index */

/* Entry i of sn's index at v: its status now (the format is packindex.c's). */
static void index_entry(hapi_packs *p, const hapi_view *v, const struct snapshot *sn, size_t i,
                        hapi_packindex_entry *e)
{
    const hapi_source_id *id = &sn->ids[i];
    int failed = failure_find(p, v, sn->paths[i], id);
    e->name = sn->names[i];
    e->id = *id;
    e->code = failed;
    e->status = failed ? HAPI_PACKINDEX_FAILED
                : hapi_serve_cached(p->serve, (hapi_view *)v, sn->paths[i], id)
                    ? HAPI_PACKINDEX_CACHED
                    : HAPI_PACKINDEX_PENDING;
}

/* Writes the index of snapshot sn at v (its pack's header header_len bytes) as text. */
static int index_write(hapi_packs *p, const char *dir, const hapi_view *v,
                       const struct snapshot *sn, size_t header_len, char **text, size_t *len)
{
    hapi_packindex x = {
        .dir = dir, .split = v->split, .stage = v->output.name, .dtype = v->dtype,
        .ndim = v->output.ndim, .header_bytes = header_len, .row_bytes = v->sample_bytes,
        .size = header_len + sn->count * (uint64_t)v->sample_bytes, .count = sn->count,
    };
    memcpy(x.ns_hex, v->ns_hex, sizeof(x.ns_hex));
    memcpy(x.shape, v->output.shape, sizeof(x.shape));
    if (!(x.entries = calloc(sn->count ? sn->count : 1, sizeof(*x.entries))))
        return -ENOMEM;
    for (size_t i = 0; i < sn->count; i++)
        index_entry(p, v, sn, i, &x.entries[i]);
    int rc = hapi_packindex_write(&x, text, len);
    free(x.entries);
    return rc;
}

int hapi_pack_index(hapi_packs *p, const char *dir, char **text, size_t *len)
{
    struct snapshot sn;
    char header[HAPI_NPY_HEADER_MAX];
    hapi_view *v;
    *text = NULL;
    /*
     * Test hook: while the file HAPIFS_TEST_HOLD_INDEX names exists, no index
     * is made, so that a compute side's read of one waits as through a dead
     * link, while the rest of the mount answers.
     */
    while (p->hold_index && access(p->hold_index, F_OK) == 0)
        nanosleep(&(struct timespec){ .tv_nsec = 10000000L }, NULL);
    int rc = take(p, dir, NULL, &v, &sn, header);
    if (rc < 0)
        return rc;
    rc = index_write(p, dir, v, &sn, (size_t)rc, text, len);
    if (rc == 0)
        atomic_fetch_add(&p->stats.index_reads, 1);
    snapshot_free(&sn);
    hapi_view_put(v);
    return rc;
}

void hapi_pack_stats_get(hapi_packs *p, hapi_pack_stats *st)
{
    st->opens = atomic_load(&p->stats.opens);
    st->reads = atomic_load(&p->stats.reads);
    st->bytes = atomic_load(&p->stats.bytes);
    st->rows = atomic_load(&p->stats.rows);
    st->rows_failed = atomic_load(&p->stats.rows_failed);
    st->index_reads = atomic_load(&p->stats.index_reads);
    st->rows_split = atomic_load(&p->stats.rows_split);
    st->rows_split_dropped = atomic_load(&p->stats.rows_split_dropped);
}

/* remote-index.c — a directory's index on a source (.hapifs-pack.json): parsed (packindex.c) and kept as a remote needs it, read around page caches, kept per (source, directory) in the slot cache and read again after refresh=. */
#include "remote-int.h"
#include "log.h"
#include "packindex.h"
#include "shared.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#define FAILED_INDEX_RETRY_NS (1000ull * 1000 * 1000) /* an unreachable source is tried again after 1 s */
/*
 * While one reader reads an index again, the others use the one it replaces
 * for at most this long past refresh=; then they wait for it. Unbounded, a
 * read that hung on a dead link served features of an image replaced 5 s
 * before (the two-tier soak, a link down 5 s, refresh=1).
 */
#define STALE_INDEX_GRACE_NS (2000ull * 1000 * 1000)
#define INDEX_HEAD 4096          /* bytes read to check a kept index's version */

void hapi_remote__index_put(struct dir_index *x)
{
    if (!x || atomic_fetch_sub(&x->refs, 1) != 1)
        return;
    for (size_t i = 0; i < x->count; i++)
        free(x->entries[i].name);
    free(x->entries);
    free(x->dir);
    free(x);
}

/* ----------------------------------------------------------- index text */

int hapi_remote__hex_to_ns(const char *hex, hapi_cache_namespace *ns)
{
    if (!hex || strlen(hex) != 2 * sizeof(ns->bytes))
        return -1;
    return hapi_unhex(hex, sizeof(ns->bytes), ns->bytes);
}

/*
 * What a remote mount keeps of parsed index pi: the namespace as bytes, the
 * header of a .feat, the entries (their names taken from pi); with fin
 * (features=freeze), what a .feat is made of its rows. Returns 0 or < 0 with
 * why in err.
 */
static int index_keep(hapi_packindex *pi, struct finish *fin, struct dir_index *x,
                      hapi_error *err)
{
    if (hapi_remote__hex_to_ns(pi->ns_hex, &x->ns) < 0)
        return hapi_error_set(err, HAPI_ECORRUPT, "bad namespace"); /* the parser checked it */
    memcpy(x->ns_hex, pi->ns_hex, sizeof(x->ns_hex));
    memcpy(x->version, pi->version, sizeof(x->version));
    x->dtype = pi->dtype;
    x->ndim = pi->ndim;
    memcpy(x->shape, pi->shape, sizeof(x->shape));
    int hl = hapi_npy_header(x->header, x->dtype, x->shape, x->ndim);
    if (hl < 0)
        return hapi_error_set(err, HAPI_ECORRUPT, "no .npy header for its row_shape");
    x->header_len = (size_t)hl;
    x->row_bytes = (size_t)pi->row_bytes;
    x->split = pi->split;
    x->pack_ndim = pi->ndim;
    memcpy(x->pack_shape, pi->shape, sizeof(x->pack_shape));
    x->pack_row_bytes = (size_t)pi->row_bytes;
    x->pack_header_len = (size_t)pi->header_bytes;
    x->pack_size = pi->size;
    int rc = fin ? hapi_remote__finish_keep(fin, x, err) : 0;
    if (rc < 0)
        return rc;
    if (!(x->entries = calloc(pi->count ? pi->count : 1, sizeof(*x->entries))))
        return hapi_error_set(err, -ENOMEM, "out of memory");
    x->count = pi->count;
    for (size_t i = 0; i < x->count; i++) {
        hapi_packindex_entry *e = &pi->entries[i];
        x->entries[i].name = (char *)e->name; /* taken over */
        e->name = NULL;
        x->entries[i].id = e->id;
        x->entries[i].failed = e->status == HAPI_PACKINDEX_FAILED;
    }
    return 0;
}

/*
 * Parses an index text of dir on src into *out (one reference): the format's
 * checks (packindex.c) refuse a corrupt or foreign index with why in err.
 */
static int index_parse(const char *text, size_t len, int src, const char *dir,
                       struct finish *fin, struct dir_index **out, hapi_error *err)
{
    hapi_packindex *pi = NULL;
    *out = NULL;
    int rc = hapi_packindex_parse(text, len, &pi, err);
    if (rc < 0)
        return rc;
    struct dir_index *x = calloc(1, sizeof(*x));
    if (!x || !(x->dir = strdup(dir))) {
        free(x);
        hapi_packindex_free(pi);
        return hapi_error_set(err, -ENOMEM, "out of memory");
    }
    atomic_init(&x->refs, 1);
    x->src = src;
    rc = index_keep(pi, fin, x, err);
    hapi_packindex_free(pi);
    if (rc < 0)
        hapi_remote__index_put(x);
    else
        *out = x;
    return rc;
}

/* The entry of name in x, or NULL (binary search: names are in byte order). */
const struct index_entry *hapi_remote__index_find(const struct dir_index *x, const char *name,
                                                  size_t *row)
{
    size_t lo = 0, hi = x->count;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(x->entries[mid].name, name);
        if (c == 0) {
            if (row)
                *row = mid;
            return &x->entries[mid];
        }
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

/* Reads and parses dir's index on src. Returns 0, -ENOENT (no images there), or < 0 (logged). */
int hapi_remote_index_check(const char *text, size_t len, const char *dir, hapi_error *err)
{
    struct dir_index *x = NULL;
    int rc = index_parse(text, len, 0, dir, NULL, &x, err);
    hapi_remote__index_put(x);
    return rc;
}

static int index_load(hapi_remote *r, int src, const char *dir, struct dir_index **out)
{
    struct remote_source *s = &r->sources[src];
    char *path = hapi_path_join(dir, HAPI_PACK_INDEX_NAME);
    char *text = NULL;
    size_t len = 0;
    *out = NULL;
    if (!path)
        return -ENOMEM;
    /*
     * O_DIRECT: the index changes while its size and times do not (a row's
     * status), so a network filesystem that keeps pages (sshfs kernel_cache,
     * NFS) would serve old pages, or old and new ones mixed (seen through
     * sshfs: 13,408 refused indexes in one run). FUSE and NFS read around
     * their page cache for O_DIRECT; where it is refused, read normally.
     */
    struct stat ist = { .st_uid = getuid(), .st_gid = getgid(), .st_mode = 0444 };
    uint64_t gen = 0;
    int fd = hapi_remote__source_open_direct(r, src, path, &gen);
    if (fd >= 0)
        hapi_remote__refresh_size(fd); /* an index that grew past a cached size reads whole */
    if (fd >= 0 && fstat(fd, &ist) < 0)
        ist.st_mode = 0444;
    int rc = hapi_remote__read_text(fd, INDEX_MAX, &text, &len);
    if (rc == 0) {
        atomic_fetch_add(&s->stats.index_reads, 1);
        atomic_fetch_add(&s->stats.index_bytes, len);
        hapi_error err = { 0 };
        if ((rc = index_parse(text, len, src, dir, r->finish, out, &err)) == 0) {
            (*out)->uid = ist.st_uid;
            (*out)->gid = ist.st_gid;
            (*out)->mode = ist.st_mode & 0444;
        } else {
            char msg[PATH_MAX + HAPI_ERROR_MESSAGE_MAX]; /* paths and a whole message */
            snprintf(msg, sizeof(msg), "source %s: %s: index refused: %s", s->path, path,
                     err.message);
            hapi_error_ring_add(r->cfg.errors, path, rc, msg);
        }
    } else if (rc != -ENOENT && rc != -ENOTDIR) {
        hapi_remote__source_failed(r, src, path, rc, "cannot read the index");
    } else if (!hapi_remote__serving(r, src, gen)) {
        /*
         * No index because no storage mount is there now (its daemon
         * restarting): a failure, kept FAILED_INDEX_RETRY_NS, not a directory
         * without images, which would be kept refresh= long after it is back.
         */
        rc = -EIO;
        hapi_remote__source_failed(r, src, path, rc,
                                   "not a storage mount now (its daemon restarting?)");
    }
    free(text);
    free(path);
    return rc == -ENOTDIR ? -ENOENT : rc;
}

/*
 * Whether dir's index on src still has the version of kept, read from its
 * first INDEX_HEAD bytes: one small read instead of the whole index (about
 * 130 bytes per image), so a kept index costs a few round trips per
 * refresh, not its size. Directly, like index_load, around page caches.
 * Returns 1 when it is unchanged, 0 when it changed or could not be read.
 */
int hapi_remote__index_unchanged(hapi_remote *r, int src, const char *dir,
                                 const struct dir_index *kept)
{
    char *path = hapi_path_join(dir, HAPI_PACK_INDEX_NAME);
    char *head = NULL;
    int same = 0;
    if (!path || posix_memalign((void **)&head, 4096, INDEX_HEAD + 1) != 0) {
        free(path);
        return 0;
    }
    ssize_t n = hapi_remote__source_read_head(r, src, path, head, INDEX_HEAD, NULL);
    if (n >= 0) {
        char version[17];
        head[n] = '\0';
        hapi_packindex_head_version(head, version);
        same = version[0] && strcmp(version, kept->version) == 0;
        atomic_fetch_add(&r->sources[src].stats.index_checks, 1);
        atomic_fetch_add(&r->sources[src].stats.index_bytes, (uint64_t)n);
    } /* else the full read that follows says why */
    free(head);
    free(path);
    return same;
}

static uint64_t slot_hash(int src, const char *dir)
{
    return XXH3_64bits_withSeed(dir, strlen(dir), (uint64_t)src + 1);
}

/* Remembers that something of dir on src looked changed: the next use reads its index again. */
void hapi_remote__index_expire(hapi_remote *r, int src, const char *dir)
{
    uint64_t h = slot_hash(src, dir);
    pthread_mutex_lock(&r->index_lock);
    for (struct index_slot *sl = r->slots[h % INDEX_BUCKETS]; sl; sl = sl->next)
        if (sl->hash == h && sl->src == src && strcmp(sl->dir, dir) == 0) {
            sl->expired = 1;
            sl->expired_ns = hapi_now_ns(); /* a read under way may have read it before */
        }
    pthread_mutex_unlock(&r->index_lock);
}

/*
 * The index of dir on src with a reference, read again when older than
 * refresh_ms (one reader reads it; the others wait for it). Returns 0,
 * -ENOENT (no images there, or no such directory) or < 0.
 */
int hapi_remote__index_get(hapi_remote *r, int src, const char *dir, struct dir_index **out)
{
    uint64_t h = slot_hash(src, dir);
    *out = NULL;
    if (!hapi_remote__source_usable(r, src))
        return atomic_load(&r->sources[src].refused) ? -ENOENT : -EIO;
    pthread_mutex_lock(&r->index_lock);
    struct index_slot *sl = r->slots[h % INDEX_BUCKETS];
    while (sl && !(sl->hash == h && sl->src == src && strcmp(sl->dir, dir) == 0))
        sl = sl->next;
    if (!sl) {
        sl = calloc(1, sizeof(*sl));
        if (!sl || !(sl->dir = strdup(dir))) {
            free(sl);
            pthread_mutex_unlock(&r->index_lock);
            return -ENOMEM;
        }
        sl->src = src;
        sl->hash = h;
        sl->expired = 1;
        sl->next = r->slots[h % INDEX_BUCKETS];
        r->slots[h % INDEX_BUCKETS] = sl;
    }
    /*
     * An index is as old as the start of the read that got it: through a
     * link that was down, a read can end 10 s after the storage side
     * answered it, with a split changed meanwhile (the two-tier soak served
     * features of a split 11 s gone). A read begun since we came is fresh
     * enough for us whatever its age, even with refresh=0; one begun before
     * is not, once older than refresh=: then we read again.
     */
    uint64_t came = hapi_now_ns();
    for (;;) {
        uint64_t now = hapi_now_ns();
        uint64_t life = sl->code < 0 && sl->code != -ENOENT ? FAILED_INDEX_RETRY_NS
                                                             : (uint64_t)r->cfg.refresh_ms * 1000000;
        int fresh = !sl->expired && (sl->at_ns >= came || now - sl->at_ns < life);
        /* While one reader reads it again, the others go on with the one it replaces. */
        int stale_ok = sl->loading && sl->index && !sl->expired &&
                       now - sl->at_ns < life + STALE_INDEX_GRACE_NS;
        if (fresh || sl->loading) {
            if (sl->loading && !stale_ok) {
                pthread_cond_wait(&r->index_cond, &r->index_lock);
                continue;
            }
            int rc = sl->code;
            if (sl->index) {
                atomic_fetch_add(&sl->index->refs, 1);
                *out = sl->index;
            }
            pthread_mutex_unlock(&r->index_lock);
            return rc;
        }
        sl->loading = 1;
        uint64_t began = now;
        /* an index that only aged is checked by its version; an expired one is read again */
        struct dir_index *kept = !sl->expired && sl->index && sl->index->version[0] ? sl->index
                                                                                  : NULL;
        if (kept)
            atomic_fetch_add(&kept->refs, 1);
        pthread_mutex_unlock(&r->index_lock);
        struct dir_index *x = NULL;
        int rc = 0;
        if (kept && hapi_remote__index_unchanged(r, src, dir, kept)) {
            x = kept; /* our reference becomes the slot's */
        } else {
            hapi_remote__index_put(kept);
            rc = index_load(r, src, dir, &x);
        }
        pthread_mutex_lock(&r->index_lock);
        struct dir_index *old = sl->index;
        int changed = old && x && memcmp(&old->ns, &x->ns, sizeof(x->ns)) != 0;
        sl->index = x;
        sl->code = rc;
        sl->at_ns = began;
        sl->expired = sl->expired_ns >= began; /* expired while we read: read again */
        sl->loading = 0;
        if (x)
            atomic_fetch_add(&x->refs, 1);
        *out = x;
        pthread_cond_broadcast(&r->index_cond);
        pthread_mutex_unlock(&r->index_lock);
        hapi_remote__index_put(old);
        if (changed) {
            hapi_log(HAPI_LOG_INFO, "source %s: '%s' now has features of namespace %.12s",
                     r->sources[src].path, dir, x->ns_hex);
            if (r->cfg.on_change)
                r->cfg.on_change(r->cfg.arg);
        }
        return rc;
    }
}

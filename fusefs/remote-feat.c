/* remote-feat.c — a compute-side mount's .feat opens and reads: the bytes from the cache, the spill, or a fetch of the directory's pack. */
#include "remote-int.h"
#include "log.h"
#include "view.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ----------------------------------------------------------- .feat reads */

struct hapi_remote_feat {
    struct dir_index *index;      /* as it was at open */
    char *path;                   /* the image's path in the union: the cache key */
    const char *name;             /* in path */
    hapi_source_id id;
    size_t row;
    uint64_t size;
};

int hapi_remote_feat_open(hapi_remote *r, const char *path, hapi_remote_feat **out)
{
    *out = NULL;
    size_t len = strlen(path), stem;
    const char *name;
    char *dir = hapi_remote__split_path(path, &name);
    if (!dir)
        return -ENOMEM;
    if (!(stem = hapi_feat_stem_len(name))) {
        free(dir);
        return -ENOENT;
    }
    hapi_remote_feat *f = calloc(1, sizeof(*f));
    if (!f || !(f->path = strndup(path, len - 5))) {
        free(f);
        free(dir);
        return -ENOMEM;
    }
    f->name = strrchr(f->path, '/') ? strrchr(f->path, '/') + 1 : f->path;
    const struct index_entry *e = NULL;
    int rc = hapi_remote__find_image(r, dir, f->name, &f->index, &e, &f->row);
    free(dir);
    if (rc < 0) {
        hapi_remote_feat_close(f);
        return rc;
    }
    f->id = e->id;
    f->size = f->index->header_len + f->index->row_bytes;
    *out = f;
    return 0;
}

uint64_t hapi_remote_feat_size(const hapi_remote_feat *f)
{
    return f->size;
}

uint64_t hapi_remote_feat_key(const hapi_remote_feat *f)
{
    return hapi_remote__feat_key(&f->index->ns, &f->id);
}

void hapi_remote_feat_close(hapi_remote_feat *f)
{
    if (!f)
        return;
    hapi_remote__index_put(f->index);
    free(f->path);
    free(f);
}

/* Copies bytes [from, to) of the cached features of f into dst. Returns 1 on a hit, else 0. */
static int cache_copy(hapi_remote *r, const struct dir_index *x, const char *path,
                      const hapi_source_id *id, char *dst, size_t from, size_t to)
{
    hapi_cache_value val;
    int rc = hapi_cache_get(r->cfg.cache, &x->ns, path, id, &val);
    if (rc == 1 && val.size == x->row_bytes) {
        memcpy(dst, (const char *)val.data + from, to - from);
        hapi_cache_release(r->cfg.cache, &val);
        return 1;
    }
    if (rc == 1)
        hapi_cache_release(r->cfg.cache, &val);
    else if (rc == 0 && val.miss == HAPI_CACHE_MISS_STALE)
        atomic_fetch_add(&r->stats.stale, 1);
    return 0;
}

/* Whether index x lists f's image as f's open saw it (identity, namespace); then *row is its row. */
static int lists_unchanged(const struct dir_index *x, const hapi_remote_feat *f, size_t *row)
{
    const struct index_entry *e = hapi_remote__index_find(x, f->name, row);
    return e && memcmp(&e->id, &f->id, sizeof(f->id)) == 0 &&
           memcmp(&x->ns, &f->index->ns, sizeof(x->ns)) == 0;
}

ssize_t hapi_remote_feat_read(hapi_remote *r, hapi_remote_feat *f, char *buf, size_t size,
                              off_t off)
{
    const struct dir_index *x = f->index;
    atomic_fetch_add(&r->stats.reads, 1);
    size_t dpos, dend;
    ssize_t head = hapi_feat_split_read(x->header, x->header_len, f->size, buf, size, off,
                                        &dpos, &dend);
    if (head < 0)
        return 0;
    size_t n = (size_t)head;
    char *dst = buf + n;
    uint64_t passes = atomic_load(&r->passes); /* before the lookup: see hapi_remote__fetch_wait */
    if (cache_copy(r, x, f->path, &f->id, dst, dpos, dend)) {
        atomic_fetch_add(&r->stats.hits, 1);
    } else {
        atomic_fetch_add(&r->stats.misses, 1);
        int rc = 0;
        /*
         * Join the fetch of the directory's current index when it still says
         * what the open file saw (readers that opened before a refresh share
         * the fetch of those after it); else fetch by the index of the open.
         */
        struct dir_index *cur = NULL, *use = f->index;
        size_t row = f->row, crow;
        if (hapi_remote__index_get(r, x->src, x->dir, &cur) == 0 && cur != f->index &&
            lists_unchanged(cur, f, &crow)) {
            use = cur;
            row = crow;
        }
        if (hapi_remote__spill_copy(r, use, row, dst, dpos, dend)) {
            atomic_fetch_add(&r->stats.spill_hits, 1);
            hapi_remote__spill_retry(r, use, row, f->path, &f->id);
            hapi_remote__index_put(cur);
            goto served;
        }
        /*
         * A row stored while we missed is looked up again (once; then a fetch
         * starts even if other directories' chunks keep passing); a fetch
         * is tried twice.
         */
        for (int attempt = 0; attempt < 4; attempt++) {
            rc = hapi_remote__fetch_wait(r, use, row, f->name, &f->id, dst, dpos, dend,
                                         attempt == 0 ? &passes : NULL);
            if (rc == 1 || (rc == 0 && (cache_copy(r, x, f->path, &f->id, dst, dpos, dend) ||
                                        hapi_remote__spill_copy(r, use, row, dst, dpos, dend)))) {
                rc = 1;
                break;
            }
            if (rc == -ESTALE || rc == HAPI_ECORRUPT) {
                /*
                 * The pack was refused: its directory changed since the index
                 * was read (the refusal expired it). The image's row is in
                 * the directory's new pack if the new index has it unchanged.
                 */
                hapi_remote__index_put(cur);
                cur = NULL;
                if (hapi_remote__index_get(r, x->src, x->dir, &cur) == 0 &&
                    lists_unchanged(cur, f, &crow)) {
                    use = cur;
                    row = crow;
                    continue;
                }
                if (cur && memcmp(&cur->ns, &x->ns, sizeof(x->ns)) != 0) {
                    char msg[300];
                    snprintf(msg, sizeof(msg), "the storage side's features changed namespace "
                             "(its split) since this file was opened (%.12s, now %.12s): the "
                             "file's are no longer served; open it again", x->ns_hex,
                             cur->ns_hex);
                    hapi_error_ring_add(r->cfg.errors, f->path, -EIO, msg);
                }
                break;
            }
            if (rc < 0 && rc != -EAGAIN)
                break;
        }
        hapi_remote__index_put(cur);
        if (rc != 1) {
            atomic_fetch_add(&r->stats.failed, 1);
            if (rc == HAPI_EDECODE) {
                char msg[300];
                snprintf(msg, sizeof(msg), "the storage side could not compute its features");
                hapi_error_ring_add(r->cfg.errors, f->path, rc, msg);
            }
            return rc == -ENOMEM ? rc : -EIO; /* the reason is in the error ring */
        }
    }
served:
    n += dend - dpos;
    atomic_fetch_add(&r->stats.bytes, n);
    return (ssize_t)n;
}

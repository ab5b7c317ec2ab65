/* remote.c — the compute-side feature source (-o remote): the union tree of the storage mounts seen through a network filesystem (stat, list, open), the remote opened and closed, its stats; remote-int.h says which file does the rest. */
#include "remote-int.h"
#include "log.h"
#include "shared.h"
#include "view.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

/* ------------------------------------------------------------- the tree */

/* Splits path into a malloc'd dir and a pointer to its last component. */
char *hapi_remote__split_path(const char *path, const char **name)
{
    const char *slash = strrchr(path, '/');
    *name = slash ? slash + 1 : path;
    return slash ? strndup(path, (size_t)(slash - path)) : strdup("");
}

/* What the bytes of a .feat are: its namespace (model, split) and its image's identity. */
uint64_t hapi_remote__feat_key(const hapi_cache_namespace *ns, const hapi_source_id *id)
{
    uint64_t key[(sizeof(*ns) + sizeof(*id) + 7) / 8] = { 0 };
    memcpy(key, ns, sizeof(*ns));
    memcpy((char *)key + sizeof(*ns), id, sizeof(*id));
    return XXH3_64bits(key, sizeof(key));
}

static void feat_attr(const struct dir_index *x, const struct index_entry *e, struct stat *st)
{
    memset(st, 0, sizeof(*st));
    st->st_ino = (ino_t)hapi_remote__feat_key(&x->ns, &e->id); /* see hapi_remote_stat() */
    st->st_mode = S_IFREG | x->mode;
    st->st_nlink = 1;
    st->st_uid = x->uid;
    st->st_gid = x->gid;
    st->st_size = (off_t)(x->header_len + x->row_bytes);
    st->st_blocks = (st->st_size + 511) / 512;
    st->st_blksize = 4096;
    st->st_mtim.tv_sec = e->id.mtime_ns / 1000000000;
    st->st_mtim.tv_nsec = e->id.mtime_ns % 1000000000;
    st->st_ctim.tv_sec = e->id.ctime_ns / 1000000000;
    st->st_ctim.tv_nsec = e->id.ctime_ns % 1000000000;
    st->st_atim = st->st_mtim;
}

/*
 * The source and index entry of image name in dir: the first source whose
 * index lists it. Returns 0 (with a reference in *x), -ENOENT, -ENOMEM or
 * -EIO (a source that could not say, when no other had it: whatever its
 * network filesystem answered, EPERM or ENOTCONN through sshfs, the image may
 * well exist, and a reader must not be told otherwise).
 */
int hapi_remote__find_image(hapi_remote *r, const char *dir, const char *name, struct dir_index **x,
                            const struct index_entry **e, size_t *row)
{
    int result = -ENOENT;
    for (size_t i = 0; i < r->nsources; i++) {
        struct dir_index *xi = NULL;
        int rc = hapi_remote__index_get(r, (int)i, dir, &xi);
        if (rc < 0) {
            if (rc != -ENOENT)
                result = rc == -ENOMEM ? rc : -EIO;
            continue;
        }
        const struct index_entry *ei = hapi_remote__index_find(xi, name, row);
        if (ei) {
            *x = xi;
            *e = ei;
            return 0;
        }
        hapi_remote__index_put(xi);
    }
    return result == -ENOENT ? hapi_remote__missing_or_down(r) : result;
}

int hapi_remote_stat(hapi_remote *r, const char *path, int *kind, struct stat *st)
{
    const char *name;
    char *dir = hapi_remote__split_path(path, &name);
    if (!dir)
        return -ENOMEM;
    int rc = -ENOENT, why = -ENOENT;
    size_t stem = *path ? hapi_feat_stem_len(name) : 0;
    if (stem) {
        char image[NAME_MAX + 1];
        memcpy(image, name, stem);
        image[stem] = '\0';
        struct dir_index *x = NULL;
        const struct index_entry *e = NULL;
        if ((rc = hapi_remote__find_image(r, dir, image, &x, &e, NULL)) == 0) {
            *kind = HAPI_REMOTE_FEAT;
            feat_attr(x, e, st);
            hapi_remote__index_put(x);
            free(dir);
            return 0;
        }
        /*
         * A .feat is what an index lists, never the storage mount's file of
         * that name read through: its network filesystem shows that file
         * from attributes cached before a failure (through sshfs, a size of
         * 0 for 600 s after the storage daemon restarted), and reads of it
         * then end at 0 bytes or fail with EPERM: 2,715 reads of 0 bytes of
         * 1,152 in 10 s, no error. An index that cannot be read is EIO (the
         * source is down); an image newer than its index is seen once the
         * index is read again (refresh=).
         */
        free(dir);
        return rc;
    }
    /*
     * Directories and other files: the first source that has it, as it shows
     * it. Missing everywhere: so only if every source that is not refused
     * is a storage mount now, where it was missed (see hapi_remote__serving()).
     */
    for (size_t i = 0; i < r->nsources; i++) {
        if (!hapi_remote__source_usable(r, (int)i)) {
            if (!atomic_load(&r->sources[i].refused))
                why = -EIO; /* down: it may have it */
            continue;
        }
        struct stat s;
        uint64_t gen = 0;
        rc = hapi_remote__source_stat(r, (int)i, path, &s, &gen);
        if (rc == 0 && (S_ISDIR(s.st_mode) || S_ISREG(s.st_mode))) {
            *kind = S_ISDIR(s.st_mode) ? HAPI_REMOTE_DIR : HAPI_REMOTE_FILE;
            *st = s;
            st->st_mode &= ~(mode_t)0222;
            free(dir);
            return 0;
        }
        if (rc < 0 && rc != -ENOENT && rc != -ENOTDIR) {
            hapi_remote__source_failed(r, (int)i, path, rc, "cannot stat");
            why = rc;
        } else if (rc < 0 && !hapi_remote__serving(r, (int)i, gen)) {
            why = -EIO;
        }
    }
    free(dir);
    return why == -ENOENT || why == -ENOTDIR ? -ENOENT : -EIO;
}

/* The names seen while listing, to merge the sources' listings: a hash set. */
struct seen {
    size_t count, cap;            /* cap: a power of two, or 0 */
    char **names;
};

static size_t seen_slot(const struct seen *s, const char *name)
{
    size_t i = (size_t)XXH3_64bits(name, strlen(name)) & (s->cap - 1);
    while (s->names[i] && strcmp(s->names[i], name) != 0)
        i = (i + 1) & (s->cap - 1);
    return i;
}

static int seen_has(const struct seen *s, const char *name)
{
    return s->cap && s->names[seen_slot(s, name)];
}

static int seen_add(struct seen *s, const char *name)
{
    if (2 * (s->count + 1) > s->cap) {
        struct seen bigger = { 0, s->cap ? s->cap * 2 : 256, NULL };
        if (!(bigger.names = calloc(bigger.cap, sizeof(char *))))
            return -ENOMEM;
        for (size_t i = 0; i < s->cap; i++)
            if (s->names[i])
                bigger.names[seen_slot(&bigger, s->names[i])] = s->names[i];
        bigger.count = s->count;
        free(s->names);
        *s = bigger;
    }
    size_t i = seen_slot(s, name);
    if (s->names[i])
        return 0;
    if (!(s->names[i] = strdup(name)))
        return -ENOMEM;
    s->count++;
    return 0;
}

static void seen_free(struct seen *s)
{
    for (size_t i = 0; i < s->cap; i++)
        free(s->names[i]);
    free(s->names);
}

/*
 * Lists one source's dir into fn, skipping names already seen. .feat
 * entries take their attributes from the index (no request per file); the
 * rest are stat'ed (a network filesystem answers those from the listing's
 * attributes it keeps).
 */
static int list_source(hapi_remote *r, int src, const char *dir, struct seen *seen,
                       int (*fn)(void *arg, const char *name, int kind, const struct stat *st),
                       void *arg, uint64_t *gen)
{
    int fd = hapi_remote__source_open(r, src, dir, O_RDONLY | O_DIRECTORY, gen);
    if (fd < 0)
        return fd == -ENOTDIR ? -ENOENT : fd;
    DIR *d = fdopendir(fd);
    if (!d) {
        close(fd);
        return -errno;
    }
    struct dir_index *x = NULL;
    int have_index = -1, rc = 0;
    struct dirent *de;
    /* With one source there is nothing to merge. */
    int check_seen = src > 0;
    while (rc >= 0 && (errno = 0, de = readdir(d))) {
        const char *name = de->d_name;
        if (strcmp(name, ".") == 0 || strcmp(name, "..") == 0)
            continue;
        if (!*dir && strcmp(name, ".hapifs") == 0)
            continue;
        if (check_seen && seen_has(seen, name))
            continue;
        struct stat st;
        size_t stem = hapi_feat_stem_len(name);
        int kind = -1;
        if (stem) {
            if (have_index < 0)
                have_index = hapi_remote__index_get(r, src, dir, &x) == 0;
            char image[NAME_MAX + 1];
            memcpy(image, name, stem);
            image[stem] = '\0';
            const struct index_entry *e =
                have_index ? hapi_remote__index_find(x, image, NULL) : NULL;
            if (!e)
                continue; /* not served: see hapi_remote_stat() */
            feat_attr(x, e, &st);
            kind = HAPI_REMOTE_FEAT;
        }
        if (kind < 0) {
            char *child = hapi_path_join(dir, name);
            if (!child) {
                rc = -ENOMEM;
                break;
            }
            int src_rc = hapi_remote__source_stat(r, src, child, &st, NULL);
            free(child);
            if (src_rc < 0 || !(S_ISDIR(st.st_mode) || S_ISREG(st.st_mode)))
                continue;
            kind = S_ISDIR(st.st_mode) ? HAPI_REMOTE_DIR : HAPI_REMOTE_FILE;
            st.st_mode &= ~(mode_t)0222;
        }
        if (r->nsources > 1 && (rc = seen_add(seen, name)) < 0)
            break;
        rc = fn(arg, name, kind, &st);
    }
    if (rc >= 0 && errno)
        rc = -errno;
    closedir(d);
    hapi_remote__index_put(x);
    return rc;
}

int hapi_remote_list(hapi_remote *r, const char *dir,
                     int (*fn)(void *arg, const char *name, int kind, const struct stat *st),
                     void *arg)
{
    struct seen seen = { 0 };
    int found = 0, rc = 0, failure = 0;
    for (size_t i = 0; i < r->nsources && rc >= 0; i++) {
        if (!hapi_remote__source_usable(r, (int)i)) {
            if (!atomic_load(&r->sources[i].refused))
                failure = -EIO; /* down: it may have dir */
            continue;
        }
        uint64_t gen = 0;
        int src_rc = list_source(r, (int)i, dir, &seen, fn, arg, &gen);
        if (src_rc >= 0) {
            found = 1;
        } else if (src_rc == -ENOMEM) {
            rc = src_rc;
        } else if (src_rc != -ENOENT) {
            hapi_remote__source_failed(r, (int)i, dir, src_rc, "cannot list");
            failure = src_rc;
        } else if (!hapi_remote__serving(r, (int)i, gen)) {
            failure = -EIO; /* missed where a storage mount is not now: see hapi_remote__serving() */
        }
    }
    seen_free(&seen);
    if (rc < 0)
        return rc;
    return found ? 0 : failure ? -EIO : -ENOENT;
}

int hapi_remote_open_file(hapi_remote *r, const char *path)
{
    int why = -ENOENT;
    for (size_t i = 0; i < r->nsources; i++) {
        if (!hapi_remote__source_usable(r, (int)i)) {
            if (!atomic_load(&r->sources[i].refused))
                why = -EIO;
            continue;
        }
        uint64_t gen = 0;
        int fd = hapi_remote__source_open_direct(r, (int)i, path, &gen);
        if (fd >= 0) {
            hapi_remote__refresh_size(fd);
            atomic_fetch_add(&r->sources[i].stats.file_reads, 1);
            return fd;
        }
        if (fd != -ENOENT && fd != -ENOTDIR) {
            hapi_remote__source_failed(r, (int)i, path, fd, "cannot open");
            why = -EIO;
        } else if (!hapi_remote__serving(r, (int)i, gen)) {
            why = -EIO; /* missed where a storage mount is not now: see hapi_remote__serving() */
        }
    }
    return why;
}

int hapi_remote_pack_file_size(hapi_remote *r, const char *path, int fd, uint64_t *size)
{
    char buf[HAPI_NPY_HEADER_MAX] __attribute__((aligned(4096)));
    int dtype, ndim, rc;
    int64_t shape[HAPI_MAX_DIMS];
    /* the fixed part, then the rest of the header: no byte of a row, which the storage side
     * would compute for it */
    ssize_t n = hapi_remote_pread_all(fd, buf, 10, 0);
    if (n >= 10 && (rc = hapi_npy_parse(buf, (size_t)n, &dtype, shape, &ndim)) == -EAGAIN) {
        size_t total = 10 + ((size_t)(unsigned char)buf[8] | (size_t)(unsigned char)buf[9] << 8);
        ssize_t m = hapi_remote_pread_all(fd, buf + 10, total - 10, 10);
        n = m < 0 ? m : 10 + m;
    }
    if (n >= 0 && (rc = hapi_npy_parse(buf, (size_t)n, &dtype, shape, &ndim)) > 0 && ndim >= 1) {
        uint64_t bytes = dtype == HAPI_DTYPE_FP16 ? 2 : 4;
        for (int i = 0; i < ndim && bytes; i++)
            bytes = shape[i] && bytes > UINT64_MAX / (uint64_t)shape[i] ? 0 : bytes * (uint64_t)shape[i];
        *size = (uint64_t)rc + bytes;
        return 0;
    }
    char msg[200];
    snprintf(msg, sizeof(msg), "the pack read through its source %s (the source is down or "
             "restarting)", n < 0 ? hapi_strerror((int)n) : n < 10 ? "ends before its header"
                                                                  : "has no pack header");
    hapi_error_ring_add(r->cfg.errors, path, -EIO, msg);
    return -EIO;
}

int hapi_remote_read_pack_index(hapi_remote *r, const char *path, int fd, char **text,
                                size_t *len)
{
    int rc = hapi_remote__read_text(fd, INDEX_MAX, text, len);
    hapi_error err = { 0 };
    const char *name;
    char *dir = rc == 0 ? hapi_remote__split_path(path, &name) : NULL;
    if (rc == 0 && !dir)
        rc = -ENOMEM;
    if (rc == 0 && (rc = hapi_remote_index_check(*text, *len, dir, &err)) < 0) {
        char msg[PATH_MAX + HAPI_ERROR_MESSAGE_MAX]; /* words, a path, a whole message */
        snprintf(msg, sizeof(msg), "the index read through its source is not whole (the source "
                 "is down or restarting): %s", err.message);
        hapi_error_ring_add(r->cfg.errors, path, -EIO, msg);
        rc = -EIO;
    }
    free(dir);
    if (rc < 0) {
        free(*text);
        *text = NULL;
    }
    return rc == -ENOMEM ? rc : rc < 0 ? -EIO : 0;
}

int hapi_remote_read_storage_file(hapi_remote *r, const char *name, char **text, size_t *len)
{
    return hapi_remote__read_text(hapi_remote_open_storage_file(r, name), HAPI_CTL_SIZE_MAX, text,
                                  len);
}

int hapi_remote_open_storage_file(hapi_remote *r, const char *name)
{
    char path[64];
    snprintf(path, sizeof(path), ".hapifs/%s", name);
    int rc = -ENOENT;
    for (size_t i = 0; i < r->nsources; i++) {
        if (!hapi_remote__source_usable(r, (int)i))
            continue;
        if ((rc = hapi_remote__source_open(r, (int)i, path, O_RDONLY, NULL)) >= 0)
            return rc;
        hapi_remote__source_failed(r, (int)i, path, rc, "cannot open");
    }
    return rc == -ENOENT ? rc : -EIO;
}

/* ----------------------------------------------------------- open/close */

int hapi_remote_open(const hapi_remote_config *cfg, hapi_remote **out, hapi_error *err)
{
    *out = NULL;
    hapi_remote *r = calloc(1, sizeof(*r));
    if (!r)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    r->cfg = *cfg;
    r->started_ns = hapi_now_ns();
    pthread_mutex_init(&r->index_lock, NULL);
    pthread_cond_init(&r->index_cond, NULL);
    pthread_mutex_init(&r->fetch_lock, NULL);
    pthread_mutex_init(&r->spill_lock, NULL);
    hapi_cond_init_monotonic(&r->queue_cond);
    static const hapi_warmup_ops warm_ops = {
        .thread_name = "hapifs-rwarm",
        .run = hapi_remote__warm_run,
        .wake = hapi_remote__warm_wake,
    };
    r->warm = hapi_warmup_new(&warm_ops, r);
    r->sources = calloc(cfg->nroots, sizeof(*r->sources));
    const char *hold = getenv("HAPIFS_TEST_HOLD_MISS");
    if (!r->sources || !r->warm || (hold && *hold && !(r->hold_miss = strdup(hold)))) {
        hapi_warmup_free(r->warm);
        free(r->sources);
        free(r);
        return hapi_error_set(err, -ENOMEM, "out of memory");
    }
    r->nsources = cfg->nroots;
    size_t usable = 0;
    int rc = 0;
    hapi_error first_err = { 0 };
    for (size_t i = 0; i < r->nsources; i++) {
        struct remote_source *s = &r->sources[i];
        pthread_mutex_init(&s->lock, NULL);
        pthread_mutex_init(&s->check_lock, NULL);
        if (!(s->path = strdup(cfg->roots[i]))) {
            rc = hapi_error_set(err, -ENOMEM, "out of memory");
            goto fail;
        }
    }
    for (size_t i = 0; i < r->nsources; i++) {
        struct remote_source *s = &r->sources[i];
        hapi_error e = { 0 };
        atomic_store(&s->check_ns, hapi_now_ns());
        if (hapi_remote__source_check(r, (int)i, &e) < 0) {
            /* one clear line, and the other sources keep serving */
            if (!atomic_load(&s->refused))
                hapi_log(HAPI_LOG_ERROR, "%s; this source is down: tried again at its next use",
                         e.message);
            if (!first_err.code)
                first_err = e;
            continue;
        }
        usable++;
    }
    if (!usable) {
        rc = hapi_error_set(err, first_err.code ? first_err.code : -ENOENT, "%s",
                            first_err.message);
        goto fail;
    }
    if (cfg->finish && (rc = hapi_remote__finish_open(r, cfg->model_dir)) < 0) {
        hapi_error_set(err, rc, "out of memory");
        goto fail;
    }
    size_t n = cfg->fetch_threads > 0 ? (size_t)cfg->fetch_threads : 4;
    r->threads = calloc(n, sizeof(*r->threads));
    if (!r->threads) {
        rc = hapi_error_set(err, -ENOMEM, "out of memory");
        goto fail;
    }
    for (size_t i = 0; i < n; i++) {
        if ((rc = -pthread_create(&r->threads[i], NULL, hapi_remote__fetch_thread, r)) < 0) {
            hapi_error_set(err, rc, "cannot start a fetch thread: %s", strerror(-rc));
            goto fail;
        }
        r->nthreads++;
    }
    *out = r;
    return 0;
fail:
    hapi_remote_close(r);
    return rc;
}

void hapi_remote_close(hapi_remote *r)
{
    if (!r)
        return;
    if (r->warm)
        hapi_warmup_cancel(r->warm);
    pthread_mutex_lock(&r->fetch_lock);
    r->stopping = 1;
    pthread_cond_broadcast(&r->queue_cond);
    for (struct fetch *f = r->fetches; f; f = f->next)
        pthread_cond_broadcast(&f->cond);
    pthread_mutex_unlock(&r->fetch_lock);
    for (size_t i = 0; i < r->nthreads; i++)
        pthread_join(r->threads[i], NULL);
    /* after the fetch threads: a warm-up's fetch counts into it until it ends */
    hapi_warmup_free(r->warm);
    /* fetches never started: nobody waits on them any more */
    while (r->fetches) {
        struct fetch *f = r->fetches;
        r->fetches = f->next;
        f->refs = 1;
        hapi_remote__fetch_put_locked(f);
    }
    for (size_t b = 0; b < INDEX_BUCKETS; b++)
        for (struct index_slot *sl = r->slots[b], *next; sl; sl = next) {
            next = sl->next;
            hapi_remote__index_put(sl->index);
            free(sl->dir);
            free(sl);
        }
    for (size_t i = 0; i < r->nsources; i++) {
        hapi_remote__root_put(r->sources[i].root);
        free(r->sources[i].path);
        free(r->sources[i].config);
        pthread_mutex_destroy(&r->sources[i].lock);
        pthread_mutex_destroy(&r->sources[i].check_lock);
    }
    free(r->sources);
    free(r->threads);
    pthread_mutex_destroy(&r->index_lock);
    pthread_cond_destroy(&r->index_cond);
    hapi_remote__spill_drop_all(r);
    pthread_mutex_destroy(&r->spill_lock);
    pthread_mutex_destroy(&r->fetch_lock);
    pthread_cond_destroy(&r->queue_cond);
    free(r->hold_miss);
    hapi_remote__finish_close(r->finish);
    free(r);
}

/* ---------------------------------------------------------------- stats */

const char *hapi_remote_storage_config(hapi_remote *r)
{
    for (size_t i = 0; i < r->nsources; i++)
        if (atomic_load(&r->sources[i].checked))
            return r->sources[i].config;
    return NULL;
}

void hapi_remote_stats_get(hapi_remote *r, hapi_remote_stats *st)
{
    memset(st, 0, sizeof(*st));
    st->reads = atomic_load(&r->stats.reads);
    st->bytes = atomic_load(&r->stats.bytes);
    st->hits = atomic_load(&r->stats.hits);
    st->misses = atomic_load(&r->stats.misses);
    st->fetched_rows = atomic_load(&r->stats.fetched_rows);
    st->waits = atomic_load(&r->stats.waits);
    st->failed = atomic_load(&r->stats.failed);
    st->stale = atomic_load(&r->stats.stale);
    st->cache_put_failures = atomic_load(&r->stats.cache_put_failures);
    st->uncached_hits = atomic_load(&r->stats.spill_hits);
    pthread_mutex_lock(&r->fetch_lock);
    for (struct fetch *f = r->fetches; f; f = f->next) {
        st->fetches_running += f->started;
        st->fetches_queued += !f->started;
    }
    pthread_mutex_unlock(&r->fetch_lock);
    hapi_warmup_status ws;
    hapi_warmup_status_get(r->warm, &ws);
    st->warm_state = ws.state;
    snprintf(st->warm_path, sizeof(st->warm_path), "%s", ws.root ? ws.root : "");
    st->warm_total = ws.count[HAPI_WARMUP_TOTAL];
    st->warm_cached = ws.count[HAPI_WARMUP_CACHED];
    st->warm_fetched = ws.count[HAPI_WARMUP_FETCHED];
    st->warm_failed = ws.count[HAPI_WARMUP_FAILED];
    st->warm_dirs = ws.count[HAPI_WARMUP_DIRS];
    uint64_t t1 = ws.stopped_ns ? ws.stopped_ns : ws.walked_ns ? ws.walked_ns : hapi_now_ns();
    st->warm_elapsed_s = ws.started_ns ? (double)(t1 - ws.started_ns) / 1e9 : 0;
    free(ws.root);
}

size_t hapi_remote_source_count(const hapi_remote *r)
{
    return r->nsources;
}

void hapi_remote_source_stats_get(hapi_remote *r, size_t i, hapi_remote_source_stats *st)
{
    struct remote_source *s = &r->sources[i];
    memset(st, 0, sizeof(*st));
    st->path = s->path;
    st->refused = atomic_load(&s->refused);
    st->checked = atomic_load(&s->checked);
    st->ns = s->ns;
    memcpy(st->namespace_hex, s->ns_hex, sizeof(st->namespace_hex));
    st->index_reads = atomic_load(&s->stats.index_reads);
    st->index_checks = atomic_load(&s->stats.index_checks);
    st->index_bytes = atomic_load(&s->stats.index_bytes);
    st->packs = atomic_load(&s->stats.packs);
    st->pack_bytes = atomic_load(&s->stats.pack_bytes);
    st->rows = atomic_load(&s->stats.rows);
    st->rows_failed = atomic_load(&s->stats.rows_failed);
    st->fetch_failures = atomic_load(&s->stats.fetch_failures);
    st->file_reads = atomic_load(&s->stats.file_reads);
    pthread_mutex_lock(&s->lock);
    st->reachable = s->root != NULL;
    memcpy(st->last_error, s->last_error, sizeof(st->last_error));
    pthread_mutex_unlock(&s->lock);
}

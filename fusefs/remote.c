/* remote.c — the compute-side feature source: the union of storage mounts seen through a network filesystem, features fetched in bulk as per-directory packs into the local cache. */
#include "remote.h"
#include "cache.h"
#include "evict.h"
#include "extractor.h"
#include "hapi.h"
#include "log.h"
#include "shared.h"
#include "source.h"
#include "view.h"
#include "warmup.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

/*
 * What a compute-side mount does with a read of DIR/x.jpg.feat:
 *   1. the index of DIR on each source (DIR/.hapifs-pack.json, kept for
 *      refresh_ms) says which source has x.jpg, its identity and the
 *      storage side's namespace: the cache key is (namespace, DIR/x.jpg,
 *      identity), so a changed image or a new split is a miss, never old
 *      features served as new;
 *   2. a hit is copied from the local LMDB cache;
 *   3. a miss joins (or starts) the fetch of DIR's pack from that source: a
 *      fetch thread reads the pack with large sequential reads, checks its
 *      size and header against the index, hands each row to the readers
 *      waiting for it as soon as its chunk arrives, and stores every row in
 *      the cache. So a directory costs a few large reads instead of a
 *      lookup, an open, a read and a release per file, and the first file
 *      of a pack is answered as soon as its chunk has arrived.
 *
 * Locks (leaves in the daemon's order, never held together): index_lock
 * (the index slots), fetch_lock (fetches, their waiters, the queue), a
 * source's lock (its root handle), the warm-up's status lock. Above them the
 * warm-up's control lock (warmup.h), held by its start and stop through the
 * join of its walker (which never takes it), so that one walker is started or
 * joined at a time.
 */

#define FETCH_CHUNK (1u << 20)   /* bytes per read of a pack: large sequential reads */
#define FAILED_INDEX_RETRY_NS (1000ull * 1000 * 1000) /* an unreachable source is tried again after 1 s */
/*
 * While one reader reads an index again, the others use the one it replaces
 * for at most this long past refresh=; then they wait for it. Unbounded, a
 * read that hung on a dead link served features of an image replaced 5 s
 * before (the two-tier soak, a link down 5 s, refresh=1).
 */
#define STALE_INDEX_GRACE_NS (2000ull * 1000 * 1000)
#define SERVING_CHECK_NS (200ull * 1000 * 1000) /* a source seen serving is believed for 0.2 s */
#define INDEX_MAX (256u << 20)   /* an index longer than this is refused */
#define INDEX_HEAD 4096          /* bytes read to check a kept index's version */

/* ------------------------------------------------------------ sources */

/* A source's root, reopened after the network filesystem under it died and came back. */
struct root {
    atomic_int refs;
    hapi_source *source;
    dev_t dev;                    /* what the source's path named when opened */
    ino_t ino;
};

struct remote_source {
    char *path;                   /* as given, absolute */
    pthread_mutex_t lock;
    struct root *root;            /* NULL while unreachable */
    /*
     * A storage mount of another model or preprocessing than the first
     * source's: never used. Set once, under check_lock.
     */
    atomic_int refused;
    /*
     * Its .hapifs/config was read (at mount, or since: see source_usable());
     * ns, ns_hex and config are set before, immutable after.
     */
    atomic_int checked;
    atomic_uint_fast64_t check_ns; /* when it was last tried while not checked */
    pthread_mutex_t check_lock;   /* one check at a time */
    hapi_cache_namespace ns;      /* the namespace its config named when checked */
    char ns_hex[33];              /* ... in hex */
    char *config;                 /* its .hapifs/config when checked (JSON text) */
    struct {
        atomic_uint_fast64_t index_reads, index_checks, index_bytes, packs, pack_bytes, rows,
            rows_failed, fetch_failures, file_reads;
    } stats;
    char last_error[512];         /* under lock */
    atomic_uint_fast64_t serving_ns; /* when it last showed its .hapifs/config: see serving() */
    atomic_uint_fast64_t root_since_ns; /* when an open root was last replaced (0: never) */
};

/* ------------------------------------------------------------- indexes */

struct index_entry {
    char *name;                   /* the image's name in DIR */
    hapi_source_id id;
    int failed;                   /* the storage side could not compute it */
};

/* One directory's index on one source, immutable once made; shared by reference. */
struct dir_index {
    atomic_int refs;
    int src;
    char *dir;
    hapi_cache_namespace ns;
    char ns_hex[33];
    char version[17];             /* the storage side's version of it, "" if it names none */
    int dtype;
    int ndim;
    int64_t shape[HAPI_MAX_DIMS];
    char header[HAPI_NPY_HEADER_MAX]; /* of one sample: a .feat */
    size_t header_len;
    size_t row_bytes;
    size_t pack_header_len;
    uint64_t pack_size;
    size_t count;
    struct index_entry *entries;  /* in the pack's row order: the byte order of names */
    uid_t uid;                    /* the index file's owner, group and read bits as the */
    gid_t gid;                    /* source shows them: its directory's, which its .feat */
    mode_t mode;                  /* files show (the index carries no per-file modes) */
};

/* The latest index of (source, dir), or why there is none. */
struct index_slot {
    int src;
    char *dir;
    uint64_t hash;
    struct dir_index *index;      /* a reference, or NULL */
    int code;                     /* 0, or why there is no index (-ENOENT: no images) */
    uint64_t at_ns;               /* when the read that made it began: it is at least this old */
    uint64_t expired_ns;          /* when it was last expired */
    int loading;
    int expired;                  /* read again at the next use */
    struct index_slot *next;
};

#define INDEX_BUCKETS 4096

/* -------------------------------------------------------------- fetches */

struct waiter {
    const char *name;
    hapi_source_id id;
    char *dst;
    size_t from, to;
    int state;                    /* 0 waiting, 1 filled, < 0 failed */
    struct waiter *next;
};

struct fetch {
    int refs;                     /* under fetch_lock */
    struct dir_index *index;      /* a reference: the rows it fetches */
    int warm;                     /* asked by the warm-up, not a reader */
    int started, finished;
    int code;                     /* the fetch's failure, once finished */
    size_t done;                  /* rows before this one are delivered */
    struct waiter *waiters;
    pthread_cond_t cond;
    struct fetch *next;           /* in r->fetches */
    struct fetch *queue_next;     /* in the queue */
};

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

struct hapi_remote {
    hapi_remote_config cfg;
    size_t nsources;
    struct remote_source *sources;
    uint64_t started_ns;

    pthread_mutex_t index_lock;
    pthread_cond_t index_cond;
    struct index_slot *slots[INDEX_BUCKETS];

    pthread_mutex_t fetch_lock;
    pthread_cond_t queue_cond;
    struct fetch *fetches;        /* every fetch not yet finished */
    atomic_uint_fast64_t passes;  /* chunks stored and passed, by every fetch */
    struct fetch *queue_head, *queue_tail; /* not yet started; readers' before the warm-up's */
    int stopping;
    size_t nthreads;
    pthread_t *threads;

    hapi_warmup *warm;            /* the warm-up's walker, root, counters and times */

    struct {
        atomic_uint_fast64_t reads, bytes, hits, misses, fetched_rows, waits, failed,
            stale, passthrough, cache_put_failures, spill_hits;
    } stats;
    atomic_int put_failing; /* the last put failed: logged once until one succeeds */
    pthread_mutex_t spill_lock;
    struct spill *spills;         /* oldest first */
    size_t spill_bytes;
    atomic_uint_fast64_t spill_retry_ns; /* when a spilled row was last offered the cache */
};

static void index_put(struct dir_index *x)
{
    if (!x || atomic_fetch_sub(&x->refs, 1) != 1)
        return;
    for (size_t i = 0; i < x->count; i++)
        free(x->entries[i].name);
    free(x->entries);
    free(x->dir);
    free(x);
}

static void root_put(struct root *rt)
{
    if (rt && atomic_fetch_sub(&rt->refs, 1) == 1) {
        hapi_source_close(rt->source);
        free(rt);
    }
}

/*
 * The source's root with a reference, opening it again if it was lost or if
 * its path now names another directory. NULL (-errno in *rc) if unreachable.
 *
 * The path is looked at each time: a storage mount restarted over the same
 * mountpoint (unmounted lazily, then mounted again) leaves the directory
 * under it in view meanwhile, and a root opened then would be that empty
 * directory for good (every name in it ENOENT, never a transport error).
 * One stat(2) of the mountpoint per use, which sshfs answers from its cache.
 */
static struct root *root_get(hapi_remote *r, int src, int *rc)
{
    struct remote_source *s = &r->sources[src];
    struct stat now;
    int seen = stat(s->path, &now) == 0;
    pthread_mutex_lock(&s->lock);
    struct root *rt = s->root, *old = NULL;
    if (rt && (!seen || now.st_dev != rt->dev || now.st_ino != rt->ino)) {
        old = rt; /* another directory now, or none: open it again (or fail) */
        s->root = rt = NULL;
    }
    if (!rt) {
        hapi_error err = { 0 };
        hapi_source *so = NULL;
        /*
         * What was believed of the old root is not of this one. A root that
         * was open and now is another directory's (a network filesystem
         * mounted again over the directory beneath, or gone from over it):
         * a name a reader just missed may have been missed there, so the
         * source is down for SERVING_CHECK_NS (see serving()). Not when
         * the last root was dropped or failed to open: a reader sees only
         * this one. (Every reopen counted as a change once: a root dropped
         * by a storage restart at the end of a run and opened 60 s later
         * by the next reader made that reader's missing names EIO.)
         */
        atomic_store(&s->serving_ns, 0);
        if (old)
            atomic_store(&s->root_since_ns, hapi_now_ns());
        *rc = hapi_source_open(s->path, &so, &err);
        if (*rc == 0 && !(rt = calloc(1, sizeof(*rt)))) {
            hapi_source_close(so);
            *rc = -ENOMEM;
        }
        if (rt) {
            struct stat st;
            atomic_init(&rt->refs, 1);
            rt->source = so;
            if (fstat(hapi_source_root_fd(so), &st) == 0) {
                rt->dev = st.st_dev;
                rt->ino = st.st_ino;
            }
            s->root = rt;
        }
    }
    if (rt)
        atomic_fetch_add(&rt->refs, 1);
    pthread_mutex_unlock(&s->lock);
    root_put(old);
    return rt;
}

/*
 * Codes that say the filesystem under a source is gone (a dead sshfs, a stale
 * NFS handle; ECANCELED: a FUSE daemon killed with io_uring, for the first
 * tens of ms). Not dropping the root on ECANCELED kept the dead mount's root
 * until the restarted one replaced it, which counted as a remount over a live
 * root: its first missing names were EIO.
 */
static int is_transport_error(int rc)
{
    return rc == -ENOTCONN || rc == -ECANCELED || rc == -ESTALE || rc == -EIO || rc == -ECONNABORTED ||
           rc == -ETIMEDOUT || rc == -EHOSTDOWN || rc == -EHOSTUNREACH || rc == -ENETDOWN ||
           rc == -ECONNRESET || rc == -ENXIO;
}

/* Notes that src failed with rc doing what: dropped root (reopened next time), the error ring. */
static void source_failed(hapi_remote *r, int src, const char *path, int rc, const char *what)
{
    struct remote_source *s = &r->sources[src];
    char msg[512];
    snprintf(msg, sizeof(msg), "source %s: %s: %s", s->path, what, hapi_strerror(rc));
    pthread_mutex_lock(&s->lock);
    struct root *old = NULL;
    if (is_transport_error(rc)) {
        old = s->root;
        s->root = NULL;
    }
    snprintf(s->last_error, sizeof(s->last_error), "%.500s", msg);
    pthread_mutex_unlock(&s->lock);
    root_put(old);
    hapi_error_ring_add(r->cfg.errors, path, rc, msg);
}

/*
 * Calls hapi_source_open_beneath on src's root; a transport error drops the
 * root and tries once more on a fresh one (the network filesystem may have
 * been mounted again). Returns an fd or -errno.
 */
static int source_open(hapi_remote *r, int src, const char *path, int flags)
{
    int rc = 0;
    for (int attempt = 0; attempt < 2; attempt++) {
        struct root *rt = root_get(r, src, &rc);
        if (!rt)
            return rc;
        rc = hapi_source_open_beneath(rt->source, path, flags);
        root_put(rt);
        if (rc >= 0 || !is_transport_error(rc))
            return rc;
        pthread_mutex_lock(&r->sources[src].lock);
        struct root *old = r->sources[src].root == rt ? rt : NULL;
        if (old)
            r->sources[src].root = NULL;
        pthread_mutex_unlock(&r->sources[src].lock);
        root_put(old);
    }
    return rc;
}

/*
 * Asks the filesystem of fd for the file's size now, past the kernel's
 * attribute cache. Through FUSE (sshfs, attr_timeout=600), a direct read at
 * or beyond the size the kernel cached returns 0 bytes, so a file that grew
 * since would read as torn.
 */
static void refresh_size(int fd)
{
    struct statx stx;
    (void)statx(fd, "", AT_EMPTY_PATH | AT_STATX_FORCE_SYNC, STATX_SIZE, &stx);
}

static int source_stat(hapi_remote *r, int src, const char *path, struct stat *st)
{
    int fd = source_open(r, src, path, O_PATH);
    if (fd < 0)
        return fd;
    int rc = fstat(fd, st) < 0 ? -errno : 0;
    close(fd);
    return rc;
}

/*
 * After a direct read of fd failed with EINVAL (a local filesystem wants
 * aligned buffers and lengths): whether fd now reads normally (retry).
 */
static int direct_off(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    return fl >= 0 && (fl & O_DIRECT) && fcntl(fd, F_SETFL, fl & ~O_DIRECT) == 0;
}

/* Reads fd to its end (at most max bytes) into *text (malloc'd, NUL-terminated); closes fd. */
static int read_text(int fd, size_t max, char **text, size_t *len)
{
    *text = NULL;
    if (fd < 0)
        return fd;
    size_t cap = 65536, used = 0;
    char *buf = malloc(cap + 1);
    int rc = buf ? 0 : -ENOMEM;
    while (rc == 0) {
        if (used == cap) {
            if (cap >= max) {
                rc = -EFBIG;
                break;
            }
            char *bigger = realloc(buf, cap * 2 + 1);
            if (!bigger) {
                rc = -ENOMEM;
                break;
            }
            buf = bigger;
            cap *= 2;
        }
        ssize_t n = read(fd, buf + used, cap - used);
        if (n < 0 && errno == EINVAL && direct_off(fd))
            continue;
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            rc = -errno;
        else if (n == 0)
            break;
        else
            used += (size_t)n;
    }
    close(fd);
    if (rc < 0) {
        free(buf);
        return rc;
    }
    buf[used] = '\0';
    *text = buf;
    if (len)
        *len = used;
    return 0;
}

/* Reads the file path of src whole (at most max bytes) into *text (malloc'd, NUL-terminated). */
static int source_read_text(hapi_remote *r, int src, const char *path, size_t max, char **text,
                            size_t *len)
{
    return read_text(source_open(r, src, path, O_RDONLY), max, text, len);
}

/*
 * Reads up to len bytes at the start of path on src into buf (aligned to 4096
 * bytes), around page caches: O_DIRECT, or a plain read where the filesystem
 * refuses it (a local one wants aligned lengths too). Returns the bytes read
 * or -errno.
 */
static ssize_t source_read_head(hapi_remote *r, int src, const char *path, char *buf, size_t len)
{
    ssize_t n = -EINVAL;
    for (int direct = 1; direct >= 0 && n == -EINVAL; direct--) {
        int fd = source_open(r, src, path, O_RDONLY | (direct ? O_DIRECT : 0));
        if (fd < 0) {
            n = fd;
            continue;
        }
        n = pread(fd, buf, len, 0);
        if (n == 0) {
            refresh_size(fd); /* a size of 0 cached: see refresh_size() */
            n = pread(fd, buf, len, 0);
        }
        n = n < 0 ? -errno : n;
        close(fd);
    }
    return n;
}

/*
 * Whether src is a storage mount now: its .hapifs/config can be read, around
 * page caches (O_DIRECT where allowed), at most once per SERVING_CHECK_NS
 * while it is. A storage daemon that is restarting leaves the directory under
 * its mountpoint in view, empty (or, through sshfs, with attributes cached
 * from before): every name in it is missing then, and a reader must hear that
 * the source is down (EIO), not that its files are gone (ENOENT).
 */
static int serving(hapi_remote *r, int src)
{
    struct remote_source *s = &r->sources[src];
    uint64_t now = hapi_now_ns(), seen = atomic_load(&s->serving_ns);
    /*
     * A root reopened less than SERVING_CHECK_NS ago (a network filesystem
     * mounted again over the empty directory): a name missing from what a
     * reader found may have been missing from the directory beneath, and
     * the check would speak for the new mount. Down, for so long.
     */
    uint64_t since = atomic_load(&s->root_since_ns);
    if (since && now - since < SERVING_CHECK_NS)
        return 0;
    if (seen && now - seen < SERVING_CHECK_NS)
        return 1;
    char buf[4096] __attribute__((aligned(4096)));
    int up = source_read_head(r, src, ".hapifs/config", buf, sizeof(buf)) > 0;
    since = atomic_load(&s->root_since_ns); /* the read may have reopened it */
    if (up && since && hapi_now_ns() - since < SERVING_CHECK_NS)
        return 0;
    atomic_store(&s->serving_ns, up ? now : 0);
    return up;
}

static int source_usable(hapi_remote *r, int src);

/* -ENOENT if every source that is not refused is serving, else -EIO: see serving(). */
static int missing_or_down(hapi_remote *r)
{
    for (size_t i = 0; i < r->nsources; i++)
        if (!atomic_load(&r->sources[i].refused) && !serving(r, (int)i))
            return -EIO;
    return -ENOENT;
}

/* ----------------------------------------------------------- index text */

/* A name from an index: one path component, not "." or "..", an image. */
static int name_ok(const char *name)
{
    size_t len = strlen(name);
    return len > 0 && len <= NAME_MAX - 5 && !strchr(name, '/') && strcmp(name, ".") != 0 &&
           strcmp(name, "..") != 0 && hapi_image_name_is_image(name);
}

static int hex_to_ns(const char *hex, hapi_cache_namespace *ns)
{
    if (!hex || strlen(hex) != 2 * sizeof(ns->bytes))
        return -1;
    for (size_t i = 0; i < sizeof(ns->bytes); i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1 || !strchr("0123456789abcdef", hex[2 * i]) ||
            !strchr("0123456789abcdef", hex[2 * i + 1]))
            return -1;
        ns->bytes[i] = (uint8_t)v;
    }
    return 0;
}

static int64_t json_int_of(json_t *o, const char *key, int *bad)
{
    json_t *v = json_object_get(o, key);
    if (!json_is_integer(v)) {
        *bad = 1;
        return 0;
    }
    return json_integer_value(v);
}

/*
 * Parses an index text of dir on src into *out (one reference). Every field
 * is checked against the others (sizes, header, order of the names), so a
 * corrupt or foreign index is refused with why in err.
 */
static int index_parse(const char *text, size_t len, int src, const char *dir,
                       struct dir_index **out, hapi_error *err)
{
    json_error_t je;
    *out = NULL;
    /*
     * The first JSON value only: through a network filesystem that kept an
     * older, longer size, a read past the new content's end returns the old
     * tail from the page cache (the kernel completes a short direct read with
     * cached pages up to the size it believes).
     */
    json_t *j = json_loadb(text, len, JSON_DISABLE_EOF_CHECK, &je);
    if (!j)
        return hapi_error_set(err, HAPI_ECORRUPT, "not JSON (%s, line %d)", je.text, je.line);
    int rc = HAPI_ECORRUPT, bad = 0;
    struct dir_index *x = calloc(1, sizeof(*x));
    if (!x) {
        json_decref(j);
        return hapi_error_set(err, -ENOMEM, "out of memory");
    }
    atomic_init(&x->refs, 1);
    x->src = src;
    json_t *format = json_object_get(j, "format"), *entries = json_object_get(j, "entries");
    json_t *shape = json_object_get(j, "row_shape");
    const char *dtype = json_string_value(json_object_get(j, "dtype"));
    const char *ns = json_string_value(json_object_get(j, "namespace"));
    if (!json_is_string(format) || strcmp(json_string_value(format), HAPI_PACK_FORMAT) != 0) {
        hapi_error_set(err, rc, "not a %s index", HAPI_PACK_FORMAT);
        goto out;
    }
    if (!ns || hex_to_ns(ns, &x->ns) < 0 || !dtype ||
        (strcmp(dtype, "<f2") != 0 && strcmp(dtype, "<f4") != 0) || !json_is_array(shape) ||
        json_array_size(shape) < 1 || json_array_size(shape) > HAPI_MAX_DIMS - 1 ||
        !json_is_array(entries)) {
        hapi_error_set(err, rc, "missing or malformed namespace, dtype, row_shape or entries");
        goto out;
    }
    memcpy(x->ns_hex, ns, 33);
    const char *version = json_string_value(json_object_get(j, "version"));
    if (version && strlen(version) == 16 && strspn(version, "0123456789abcdef") == 16)
        memcpy(x->version, version, 17);
    x->dtype = strcmp(dtype, "<f2") == 0 ? HAPI_DTYPE_FP16 : HAPI_DTYPE_FP32;
    x->ndim = (int)json_array_size(shape);
    uint64_t elems = 1;
    for (int i = 0; i < x->ndim; i++) {
        json_t *d = json_array_get(shape, (size_t)i);
        if (!json_is_integer(d) || json_integer_value(d) < 1 || json_integer_value(d) > (1 << 24)) {
            hapi_error_set(err, rc, "bad row_shape");
            goto out;
        }
        x->shape[i] = json_integer_value(d);
        elems *= (uint64_t)x->shape[i];
    }
    x->row_bytes = (size_t)(elems * (x->dtype == HAPI_DTYPE_FP16 ? 2 : 4));
    int64_t count = json_int_of(j, "count", &bad), row_bytes = json_int_of(j, "row_bytes", &bad);
    int64_t header_bytes = json_int_of(j, "header_bytes", &bad), size = json_int_of(j, "size", &bad);
    if (bad || elems > (1u << 28) || count < 0 || (size_t)count != json_array_size(entries) ||
        (uint64_t)row_bytes != x->row_bytes) {
        hapi_error_set(err, rc, "count, row_bytes or entries disagree");
        goto out;
    }
    int hl = hapi_npy_header(x->header, x->dtype, x->shape, x->ndim);
    int64_t pack_shape[HAPI_MAX_DIMS];
    char pack_header[HAPI_NPY_HEADER_MAX];
    pack_shape[0] = count;
    memcpy(pack_shape + 1, x->shape, (size_t)x->ndim * sizeof(int64_t));
    int phl = hapi_npy_header(pack_header, x->dtype, pack_shape, x->ndim + 1);
    if (hl < 0 || phl < 0 || header_bytes != phl ||
        (uint64_t)size != (uint64_t)phl + (uint64_t)count * x->row_bytes) {
        hapi_error_set(err, rc, "header_bytes or size disagree with the shape");
        goto out;
    }
    x->header_len = (size_t)hl;
    x->pack_header_len = (size_t)phl;
    x->pack_size = (uint64_t)size;
    x->count = (size_t)count;
    x->entries = calloc(x->count ? x->count : 1, sizeof(*x->entries));
    if (!x->entries || !(x->dir = strdup(dir))) {
        rc = hapi_error_set(err, -ENOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < x->count; i++) {
        json_t *e = json_array_get(entries, i);
        const char *name = json_string_value(json_object_get(e, "name"));
        const char *status = json_string_value(json_object_get(e, "status"));
        struct index_entry *ie = &x->entries[i];
        ie->id.size = (uint64_t)json_int_of(e, "size", &bad);
        ie->id.mtime_ns = json_int_of(e, "mtime_ns", &bad);
        ie->id.ctime_ns = json_int_of(e, "ctime_ns", &bad);
        ie->id.ino = (uint64_t)json_int_of(e, "ino", &bad);
        if (bad || !name || !name_ok(name) || !status) {
            hapi_error_set(err, rc, "entry %zu: bad name, identity or status", i);
            goto out;
        }
        /* The pack's rows are in the byte order of the names: the index must say so too. */
        if (i > 0 && strcmp(x->entries[i - 1].name, name) >= 0) {
            hapi_error_set(err, rc, "entry %zu: names out of order", i);
            goto out;
        }
        ie->failed = strcmp(status, "failed") == 0;
        if (!(ie->name = strdup(name))) {
            rc = hapi_error_set(err, -ENOMEM, "out of memory");
            goto out;
        }
    }
    rc = 0;
    *out = x;
    x = NULL;
out:
    json_decref(j);
    if (x)
        index_put(x);
    return rc;
}

/* The entry of name in x, or NULL (binary search: names are in byte order). */
static const struct index_entry *index_find(const struct dir_index *x, const char *name,
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
    int rc = index_parse(text, len, 0, dir, &x, err);
    index_put(x);
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
    int rc = -EINVAL;
    for (int direct = 1; rc == -EINVAL && direct >= 0; direct--) {
        /* a local filesystem wants aligned buffers for O_DIRECT: then read normally */
        int fd = source_open(r, src, path, O_RDONLY | (direct ? O_DIRECT : 0));
        if (fd >= 0)
            refresh_size(fd); /* an index that grew past a cached size reads whole */
        if (fd >= 0 && fstat(fd, &ist) < 0)
            ist.st_mode = 0444;
        rc = read_text(fd, INDEX_MAX, &text, &len);
    }
    if (rc == 0) {
        atomic_fetch_add(&s->stats.index_reads, 1);
        atomic_fetch_add(&s->stats.index_bytes, len);
        hapi_error err = { 0 };
        if ((rc = index_parse(text, len, src, dir, out, &err)) == 0) {
            (*out)->uid = ist.st_uid;
            (*out)->gid = ist.st_gid;
            (*out)->mode = ist.st_mode & 0444;
        } else {
            char msg[600];
            snprintf(msg, sizeof(msg), "source %s: %s: index refused: %s", s->path, path,
                     err.message);
            hapi_error_ring_add(r->cfg.errors, path, rc, msg);
        }
    } else if (rc != -ENOENT && rc != -ENOTDIR) {
        source_failed(r, src, path, rc, "cannot read the index");
    } else if (!serving(r, src)) {
        /*
         * No index because no storage mount is there now (its daemon
         * restarting): a failure, kept FAILED_INDEX_RETRY_NS, not a directory
         * without images, which would be kept refresh= long after it is back.
         */
        rc = -EIO;
        source_failed(r, src, path, rc, "not a storage mount now (its daemon restarting?)");
    }
    free(text);
    free(path);
    return rc == -ENOTDIR ? -ENOENT : rc;
}

/* The version named at the head of a hapifs-pack index ("" when it names none). */
static void head_version(const char *head, char version[17])
{
    static const char prefix[] = "{\"format\":\"" HAPI_PACK_FORMAT "\",\"version\":\"";
    version[0] = '\0';
    if (strncmp(head, prefix, sizeof(prefix) - 1) != 0)
        return;
    head += sizeof(prefix) - 1;
    if (strspn(head, "0123456789abcdef") != 16 || head[16] != '"')
        return;
    memcpy(version, head, 16);
    version[16] = '\0';
}

/*
 * Whether dir's index on src still has the version of kept, read from its
 * first INDEX_HEAD bytes: one small read instead of the whole index (about
 * 130 bytes per image), so a kept index costs a few round trips per
 * refresh, not its size. Directly, like index_load, around page caches.
 * Returns 1 when it is unchanged, 0 when it changed or could not be read.
 */
static int index_unchanged(hapi_remote *r, int src, const char *dir, const struct dir_index *kept)
{
    char *path = hapi_path_join(dir, HAPI_PACK_INDEX_NAME);
    char *head = NULL;
    int same = 0;
    if (!path || posix_memalign((void **)&head, 4096, INDEX_HEAD + 1) != 0) {
        free(path);
        return 0;
    }
    ssize_t n = source_read_head(r, src, path, head, INDEX_HEAD);
    if (n >= 0) {
        char version[17];
        head[n] = '\0';
        head_version(head, version);
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
static void index_expire(hapi_remote *r, int src, const char *dir)
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
static int index_get(hapi_remote *r, int src, const char *dir, struct dir_index **out)
{
    uint64_t h = slot_hash(src, dir);
    *out = NULL;
    if (!source_usable(r, src))
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
        if (kept && index_unchanged(r, src, dir, kept)) {
            x = kept; /* our reference becomes the slot's */
        } else {
            index_put(kept);
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
        index_put(old);
        if (changed) {
            hapi_log(HAPI_LOG_INFO, "source %s: '%s' now has features of namespace %.12s",
                     r->sources[src].path, dir, x->ns_hex);
            if (r->cfg.on_change)
                r->cfg.on_change(r->cfg.arg);
        }
        return rc;
    }
}

/* ------------------------------------------------------------- the tree */

/* Splits path into a malloc'd dir and a pointer to its last component. */
static char *split_path(const char *path, const char **name)
{
    const char *slash = strrchr(path, '/');
    *name = slash ? slash + 1 : path;
    return slash ? strndup(path, (size_t)(slash - path)) : strdup("");
}

/* What the bytes of a .feat are: its namespace (model, split) and its image's identity. */
static uint64_t feat_key(const hapi_cache_namespace *ns, const hapi_source_id *id)
{
    uint64_t key[(sizeof(*ns) + sizeof(*id) + 7) / 8] = { 0 };
    memcpy(key, ns, sizeof(*ns));
    memcpy((char *)key + sizeof(*ns), id, sizeof(*id));
    return XXH3_64bits(key, sizeof(key));
}

static void feat_attr(const struct dir_index *x, const struct index_entry *e, struct stat *st)
{
    memset(st, 0, sizeof(*st));
    st->st_ino = (ino_t)feat_key(&x->ns, &e->id); /* see hapi_remote_stat() */
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
static int find_image(hapi_remote *r, const char *dir, const char *name, struct dir_index **x,
                      const struct index_entry **e, size_t *row)
{
    int result = -ENOENT;
    for (size_t i = 0; i < r->nsources; i++) {
        struct dir_index *xi = NULL;
        int rc = index_get(r, (int)i, dir, &xi);
        if (rc < 0) {
            if (rc != -ENOENT)
                result = rc == -ENOMEM ? rc : -EIO;
            continue;
        }
        const struct index_entry *ei = index_find(xi, name, row);
        if (ei) {
            *x = xi;
            *e = ei;
            return 0;
        }
        index_put(xi);
    }
    return result == -ENOENT ? missing_or_down(r) : result;
}

int hapi_remote_stat(hapi_remote *r, const char *path, int *kind, struct stat *st)
{
    const char *name;
    char *dir = split_path(path, &name);
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
        if ((rc = find_image(r, dir, image, &x, &e, NULL)) == 0) {
            *kind = HAPI_REMOTE_FEAT;
            feat_attr(x, e, st);
            index_put(x);
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
    /* Directories and other files: the first source that has it, as it shows it. */
    for (size_t i = 0; i < r->nsources; i++) {
        if (!source_usable(r, (int)i))
            continue; /* one down: missing_or_down() below */
        struct stat s;
        rc = source_stat(r, (int)i, path, &s);
        if (rc == 0 && (S_ISDIR(s.st_mode) || S_ISREG(s.st_mode))) {
            *kind = S_ISDIR(s.st_mode) ? HAPI_REMOTE_DIR : HAPI_REMOTE_FILE;
            *st = s;
            st->st_mode &= ~(mode_t)0222;
            free(dir);
            return 0;
        }
        if (rc < 0 && rc != -ENOENT && rc != -ENOTDIR) {
            source_failed(r, (int)i, path, rc, "cannot stat");
            why = rc;
        }
    }
    free(dir);
    return why == -ENOENT || why == -ENOTDIR ? missing_or_down(r) : -EIO;
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
                       void *arg)
{
    int fd = source_open(r, src, dir, O_RDONLY | O_DIRECTORY);
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
                have_index = index_get(r, src, dir, &x) == 0;
            char image[NAME_MAX + 1];
            memcpy(image, name, stem);
            image[stem] = '\0';
            const struct index_entry *e = have_index ? index_find(x, image, NULL) : NULL;
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
            int src_rc = source_stat(r, src, child, &st);
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
    index_put(x);
    return rc;
}

int hapi_remote_list(hapi_remote *r, const char *dir,
                     int (*fn)(void *arg, const char *name, int kind, const struct stat *st),
                     void *arg)
{
    struct seen seen = { 0 };
    int found = 0, rc = 0, failure = 0;
    for (size_t i = 0; i < r->nsources && rc >= 0; i++) {
        if (!source_usable(r, (int)i)) {
            if (!atomic_load(&r->sources[i].refused))
                failure = -EIO; /* down: it may have dir */
            continue;
        }
        int src_rc = list_source(r, (int)i, dir, &seen, fn, arg);
        if (src_rc >= 0) {
            found = 1;
        } else if (src_rc == -ENOMEM) {
            rc = src_rc;
        } else if (src_rc != -ENOENT) {
            source_failed(r, (int)i, dir, src_rc, "cannot list");
            failure = src_rc;
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
        if (!source_usable(r, (int)i)) {
            if (!atomic_load(&r->sources[i].refused))
                why = -EIO;
            continue;
        }
        /* around page caches: a network filesystem's may hold what the file was */
        int fd = source_open(r, (int)i, path, O_RDONLY | O_DIRECT);
        if (fd == -EINVAL)
            fd = source_open(r, (int)i, path, O_RDONLY);
        if (fd >= 0) {
            refresh_size(fd);
            atomic_fetch_add(&r->sources[i].stats.file_reads, 1);
            return fd;
        }
        if (fd != -ENOENT && fd != -ENOTDIR) {
            source_failed(r, (int)i, path, fd, "cannot open");
            why = -EIO;
        }
    }
    /* missing everywhere: so only if every source is a storage mount now (see serving()) */
    return why == -ENOENT ? missing_or_down(r) : why;
}

/* pread of len bytes at off, all of them unless the file ends; around page caches as fd is. */
static ssize_t read_through(int fd, char *buf, size_t len, off_t off)
{
    size_t got = 0;
    while (got < len) {
        ssize_t n = pread(fd, buf + got, len - got, off + (off_t)got);
        if (n < 0 && errno == EINVAL && direct_off(fd))
            continue;
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return -errno;
        if (n == 0)
            break;
        got += (size_t)n;
    }
    return (ssize_t)got;
}

int hapi_remote_pack_file_size(hapi_remote *r, const char *path, int fd, uint64_t *size)
{
    char buf[HAPI_NPY_HEADER_MAX] __attribute__((aligned(4096)));
    int dtype, ndim, rc;
    int64_t shape[HAPI_MAX_DIMS];
    /* the fixed part, then the rest of the header: no byte of a row, which the storage side
     * would compute for it */
    ssize_t n = read_through(fd, buf, 10, 0);
    if (n >= 10 && (rc = hapi_npy_parse(buf, (size_t)n, &dtype, shape, &ndim)) == -EAGAIN) {
        size_t total = 10 + ((size_t)(unsigned char)buf[8] | (size_t)(unsigned char)buf[9] << 8);
        ssize_t m = read_through(fd, buf + 10, total - 10, 10);
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
    int rc = read_text(fd, INDEX_MAX, text, len);
    hapi_error err = { 0 };
    const char *name;
    char *dir = rc == 0 ? split_path(path, &name) : NULL;
    if (rc == 0 && !dir)
        rc = -ENOMEM;
    if (rc == 0 && (rc = hapi_remote_index_check(*text, *len, dir, &err)) < 0) {
        char msg[600];
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
    return read_text(hapi_remote_open_storage_file(r, name), HAPI_CTL_SIZE_MAX, text, len);
}

int hapi_remote_open_storage_file(hapi_remote *r, const char *name)
{
    char path[64];
    snprintf(path, sizeof(path), ".hapifs/%s", name);
    int rc = -ENOENT;
    for (size_t i = 0; i < r->nsources; i++) {
        if (!source_usable(r, (int)i))
            continue;
        if ((rc = source_open(r, (int)i, path, O_RDONLY)) >= 0)
            return rc;
        source_failed(r, (int)i, path, rc, "cannot open");
    }
    return rc == -ENOENT ? rc : -EIO;
}

/* -------------------------------------------------------------- fetches */

static void fetch_put_locked(struct fetch *f)
{
    if (--f->refs > 0)
        return;
    index_put(f->index);
    pthread_cond_destroy(&f->cond);
    free(f);
}

/* A new fetch of x's pack, queued (the readers' ahead of the warm-up's). Under fetch_lock. */
static struct fetch *fetch_new_locked(hapi_remote *r, struct dir_index *x, int warm)
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

/* A row is all NaN when the storage side could not compute it (its pack says so). */
static int row_failed(const struct dir_index *x, const char *row)
{
    size_t width;
    const unsigned char *nan = hapi_feat_nan(x->dtype, &width);
    for (size_t i = 0; i < x->row_bytes; i++)
        if ((unsigned char)row[i] != nan[i % width])
            return 0;
    return 1;
}

/* Reads exactly len bytes at off, or fails: a short read is a torn pack. */
static int read_exact(int fd, char *buf, size_t len, off_t off)
{
    size_t got = 0;
    while (got < len) {
        ssize_t n = pread(fd, buf + got, len - got, off + (off_t)got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return -errno;
        if (n == 0)
            return HAPI_ECORRUPT;
        got += (size_t)n;
    }
    return 0;
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
        if (w->state != 0 || !index_find(x, w->name, &row) || row < a || row >= b)
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

static void spill_free(struct spill *sp)
{
    index_put(sp->index);
    free(sp->rows);
    free(sp->have);
    free(sp);
}

/* Drops every spilled row (the cache takes features again, or the mount ends). */
static void spill_drop_all(hapi_remote *r)
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
static int spill_copy(hapi_remote *r, const struct dir_index *x, size_t row, char *dst,
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
        spill_drop_all(r);
    }
}

/*
 * At most once a second, offers the cache spilled row `row` of x's pack again
 * (for path, id); once it takes it, the cache has room: every spilled row is
 * dropped, and the rows are fetched and kept again at their next read.
 */
static void spill_retry(hapi_remote *r, struct dir_index *x, size_t row, const char *path,
                        const hapi_source_id *id)
{
    uint64_t now = hapi_now_ns(), last = atomic_load(&r->spill_retry_ns);
    if (now - last < 1000000000ull ||
        !atomic_compare_exchange_strong(&r->spill_retry_ns, &last, now))
        return;
    char *copy = malloc(x->row_bytes);
    if (!copy || !spill_copy(r, x, row, copy, 0, x->row_bytes)) {
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
 * Fetches f's pack: checks its version and header against the index, then reads
 * it in chunks of about FETCH_CHUNK, handing each chunk's rows to the
 * waiting readers and storing them in the cache. Returns 0 or why not.
 */
static int fetch_run(hapi_remote *r, struct fetch *f, hapi_error *err)
{
    const struct dir_index *x = f->index;
    struct remote_source *s = &r->sources[x->src];
    char *path = hapi_path_join(x->dir, HAPI_PACK_NAME);
    char *buf = NULL, *paths_buf = NULL;
    char **paths = NULL;
    unsigned char *failed = NULL;
    hapi_cache_item *items = NULL;
    int rc, fd = -1;
    if (!path)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    /* Around the page cache too: a pack rewritten in place keeps its size (see index_load). */
    int direct = O_DIRECT;
    fd = source_open(r, x->src, path, O_RDONLY | direct);
    if (fd == -EINVAL)
        fd = source_open(r, x->src, path, O_RDONLY | (direct = 0));
    if (fd < 0) {
        rc = hapi_error_set(err, fd, "cannot open the pack: %s", hapi_strerror(fd));
        goto out;
    }
    refresh_size(fd);
    /*
     * The pack is a snapshot taken by the storage side at this open, the index
     * one taken when it was read: the pack is the one the index describes
     * when the index still has its version now, after the open (the version
     * hashes every name and identity). Its size says nothing: the storage
     * side shows the directory's current pack size, and a network filesystem
     * may show an older one. The header (the row count) is checked below.
     */
    if (x->version[0] && !index_unchanged(r, x->src, x->dir, x)) {
        rc = hapi_error_set(err, -ESTALE, "the directory changed since its index was read");
        goto out;
    }
    size_t rows_per_chunk = FETCH_CHUNK / x->row_bytes ? FETCH_CHUNK / x->row_bytes : 1;
    size_t chunk = rows_per_chunk * x->row_bytes;
    size_t first = x->pack_header_len + chunk; /* the header and the first chunk: one read */
    buf = malloc(first);
    failed = malloc(rows_per_chunk);
    items = malloc(rows_per_chunk * sizeof(*items));
    paths = malloc(rows_per_chunk * sizeof(*paths));
    size_t dir_len = strlen(x->dir);
    paths_buf = malloc(rows_per_chunk * (dir_len + NAME_MAX + 2));
    if (!buf || !failed || !items || !paths || !paths_buf) {
        rc = hapi_error_set(err, -ENOMEM, "out of memory");
        goto out;
    }
    int64_t pack_shape[HAPI_MAX_DIMS];
    char expect[HAPI_NPY_HEADER_MAX];
    pack_shape[0] = (int64_t)x->count;
    memcpy(pack_shape + 1, x->shape, (size_t)x->ndim * sizeof(int64_t));
    hapi_npy_header(expect, x->dtype, pack_shape, x->ndim + 1);

    uint64_t pos = 0;
    for (size_t a = 0; a < x->count || pos == 0;) {
        size_t b = a + rows_per_chunk < x->count ? a + rows_per_chunk : x->count;
        size_t want = (b - a) * x->row_bytes + (pos == 0 ? x->pack_header_len : 0);
        rc = read_exact(fd, buf, want, (off_t)pos);
        if (rc == -EINVAL && direct) {
            /* a local filesystem wants aligned buffers for O_DIRECT: read normally */
            close(fd);
            fd = source_open(r, x->src, path, O_RDONLY | (direct = 0));
            rc = fd < 0 ? fd : read_exact(fd, buf, want, (off_t)pos);
        }
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
        size_t n = 0;
        for (size_t i = a; i < b; i++) {
            const char *row = rows + (i - a) * x->row_bytes;
            failed[i - a] = (unsigned char)(x->entries[i].failed || row_failed(x, row));
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
    free(failed);
    free(items);
    free(paths);
    free(paths_buf);
    return rc;
}

static void *fetch_thread(void *arg)
{
    hapi_remote *r = arg;
    pthread_setname_np(pthread_self(), "hapifs-fetch");
    pthread_mutex_lock(&r->fetch_lock);
    for (;;) {
        while (!r->queue_head && !r->stopping)
            pthread_cond_wait(&r->queue_cond, &r->fetch_lock);
        if (r->stopping)
            break;
        struct fetch *f = r->queue_head;
        r->queue_head = f->queue_next;
        if (!r->queue_head)
            r->queue_tail = NULL;
        f->started = 1;
        f->refs++;
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
                index_expire(r, x->src, x->dir);
                char msg[800];
                snprintf(msg, sizeof(msg), "source %s: %s refused: %s", r->sources[x->src].path,
                         pack ? pack : x->dir, err.message);
                hapi_error_ring_add(r->cfg.errors, pack ? pack : x->dir, rc, msg);
            } else {
                source_failed(r, x->src, pack ? pack : x->dir, rc, what);
            }
            free(pack);
        }
        pthread_mutex_lock(&r->fetch_lock);
        f->finished = 1;
        f->code = rc;
        for (struct waiter *w = f->waiters; w; w = w->next)
            if (w->state == 0)
                w->state = rc < 0 ? rc : -EAGAIN; /* -EAGAIN: not in the pack after all */
        pthread_cond_broadcast(&f->cond);
        fetch_unlist_locked(r, f);
        f->refs--; /* the list's */
        fetch_put_locked(f);
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
static int fetch_wait(hapi_remote *r, struct dir_index *x, size_t row, const char *name,
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
    if (!f && !(f = fetch_new_locked(r, x, 0))) {
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
    fetch_put_locked(f);
    pthread_mutex_unlock(&r->fetch_lock);
    return state == 1 ? 1 : state;
}

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
    char *dir = split_path(path, &name);
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
    int rc = find_image(r, dir, f->name, &f->index, &e, &f->row);
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
    return feat_key(&f->index->ns, &f->id);
}

void hapi_remote_feat_close(hapi_remote_feat *f)
{
    if (!f)
        return;
    index_put(f->index);
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
    const struct index_entry *e = index_find(x, f->name, row);
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
    uint64_t passes = atomic_load(&r->passes); /* before the lookup: see fetch_wait */
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
        if (index_get(r, x->src, x->dir, &cur) == 0 && cur != f->index &&
            lists_unchanged(cur, f, &crow)) {
            use = cur;
            row = crow;
        }
        if (spill_copy(r, use, row, dst, dpos, dend)) {
            atomic_fetch_add(&r->stats.spill_hits, 1);
            spill_retry(r, use, row, f->path, &f->id);
            index_put(cur);
            goto served;
        }
        /*
         * A row stored while we missed is looked up again (once; then a fetch
         * starts even if other directories' chunks keep passing); a fetch
         * is tried twice.
         */
        for (int attempt = 0; attempt < 4; attempt++) {
            rc = fetch_wait(r, use, row, f->name, &f->id, dst, dpos, dend,
                            attempt == 0 ? &passes : NULL);
            if (rc == 1 || (rc == 0 && (cache_copy(r, x, f->path, &f->id, dst, dpos, dend) ||
                                        spill_copy(r, use, row, dst, dpos, dend)))) {
                rc = 1;
                break;
            }
            if (rc == -ESTALE || rc == HAPI_ECORRUPT) {
                /*
                 * The pack was refused: its directory changed since the index
                 * was read (the refusal expired it). The image's row is in
                 * the directory's new pack if the new index has it unchanged.
                 */
                index_put(cur);
                cur = NULL;
                if (index_get(r, x->src, x->dir, &cur) == 0 && lists_unchanged(cur, f, &crow)) {
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
        index_put(cur);
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

/* ----------------------------------------------------------------- warm */

/* The directory walk of a warm-up or an evict: one directory, then its subdirectories. */
struct dir_walk {
    hapi_remote *r;
    const char *dir;
    atomic_int *stop;
    int (*fn)(hapi_remote *r, const char *dir, void *arg);
    void *arg;
};

/*
 * Calls fn for dir, then depth first for every directory under it (the union
 * of the sources' listings): a directory's own files first, then its
 * children. Stops at fn's failure, or once *stop (if stop is not NULL) is
 * set. A directory gone meanwhile is not a failure. Returns 0 or < 0.
 */
static int walk_dirs(hapi_remote *r, const char *dir, atomic_int *stop,
                     int (*fn)(hapi_remote *r, const char *dir, void *arg), void *arg);

static int walk_entry(void *arg, const char *name, int kind, const struct stat *st)
{
    struct dir_walk *w = arg;
    (void)st;
    if (kind != HAPI_REMOTE_DIR || (w->stop && atomic_load(w->stop)))
        return 0;
    char *child = hapi_path_join(w->dir, name);
    if (!child)
        return -ENOMEM;
    int rc = walk_dirs(w->r, child, w->stop, w->fn, w->arg);
    free(child);
    return rc;
}

static int walk_dirs(hapi_remote *r, const char *dir, atomic_int *stop,
                     int (*fn)(hapi_remote *r, const char *dir, void *arg), void *arg)
{
    int rc = fn(r, dir, arg);
    if (rc < 0)
        return rc;
    struct dir_walk w = { r, dir, stop, fn, arg };
    rc = hapi_remote_list(r, dir, walk_entry, &w);
    return rc == -ENOENT ? 0 : rc;
}

/* Waits 50 ms on queue_cond (fetches finishing do not signal it). Under fetch_lock. */
static void wait_tick(hapi_remote *r)
{
    struct timespec ts;
    hapi_deadline_after_ns(&ts, 50 * 1000000u);
    pthread_cond_timedwait(&r->queue_cond, &r->fetch_lock, &ts);
}

static void warm_pack(hapi_remote *r, struct dir_index *x)
{
    size_t missing = 0;
    for (size_t i = 0; i < x->count; i++) {
        char *path = hapi_path_join(x->dir, x->entries[i].name);
        hapi_cache_value val;
        int hit = path && hapi_cache_get(r->cfg.cache, &x->ns, path, &x->entries[i].id, &val) == 1;
        if (hit)
            hapi_cache_release(r->cfg.cache, &val);
        missing += !hit;
        free(path);
    }
    hapi_warmup_add(r->warm, HAPI_WARMUP_TOTAL, x->count);
    hapi_warmup_add(r->warm, HAPI_WARMUP_CACHED, x->count - missing);
    hapi_warmup_add(r->warm, HAPI_WARMUP_DIRS, 1);
    if (!missing)
        return;
    pthread_mutex_lock(&r->fetch_lock);
    /* At most fetch_threads warm fetches waiting: the walk goes no faster than the link. */
    for (;;) {
        size_t queued = 0;
        for (struct fetch *f = r->fetches; f; f = f->next)
            queued += f->warm;
        if (queued < r->nthreads || r->stopping || hapi_warmup_stopping(r->warm))
            break;
        wait_tick(r);
    }
    if (!r->stopping && !hapi_warmup_stopping(r->warm))
        fetch_new_locked(r, x, 1);
    pthread_mutex_unlock(&r->fetch_lock);
}

/*
 * walk_dirs()'s function for a warm-up: queues the fetch of every pack of dir
 * that has a row not cached, keeping at most fetch_threads fetches queued.
 */
static int warm_dir(hapi_remote *r, const char *dir, void *arg)
{
    (void)arg;
    for (size_t i = 0; i < r->nsources && !hapi_warmup_stopping(r->warm); i++) {
        struct dir_index *x = NULL;
        if (index_get(r, (int)i, dir, &x) == 0)
            warm_pack(r, x);
        index_put(x);
    }
    return 0;
}

/* The walk, on the warm-up's thread: queue the packs, then wait for their fetches. */
static void warm_run(void *arg, const char *root, atomic_int *stop)
{
    hapi_remote *r = arg;
    walk_dirs(r, root, stop, warm_dir, NULL);
    pthread_mutex_lock(&r->fetch_lock);
    for (;;) {
        int pending = 0;
        for (struct fetch *f = r->fetches; f; f = f->next)
            pending |= f->warm;
        if (!pending || r->stopping || atomic_load(stop))
            break;
        wait_tick(r);
    }
    pthread_mutex_unlock(&r->fetch_lock);
}

/* It may wait for queue room or for its fetches, 50 ms at a time. */
static void warm_wake(void *arg)
{
    hapi_remote *r = arg;
    pthread_mutex_lock(&r->fetch_lock);
    pthread_cond_broadcast(&r->queue_cond);
    pthread_mutex_unlock(&r->fetch_lock);
}

int hapi_remote_warm_stop(hapi_remote *r)
{
    int stopped = hapi_warmup_stop(r->warm, 1, NULL);
    if (stopped)
        hapi_log(HAPI_LOG_INFO, "remote warm-up stopped");
    return stopped;
}

int hapi_remote_warm_start(hapi_remote *r, const char *path)
{
    return hapi_warmup_start(r->warm, path);
}

/* ---------------------------------------------------------------- evict */

/* walk_dirs()'s function for an evict: removes the features of every row of dir's packs. */
static int evict_dir(hapi_remote *r, const char *dir, void *arg)
{
    hapi_evict_walk *w = arg;
    for (size_t i = 0; i < r->nsources; i++) {
        struct dir_index *x = NULL;
        if (index_get(r, (int)i, dir, &x) < 0)
            continue;
        w->ns = &x->ns;
        for (size_t k = 0; k < x->count; k++) {
            char *path = hapi_path_join(dir, x->entries[k].name);
            int rc = path ? hapi_evict_walk_path(w, path) : -ENOMEM;
            free(path);
            if (rc < 0) {
                index_put(x);
                return rc;
            }
        }
        index_put(x);
    }
    return 0;
}

/* Adds ns to the n namespaces of set (room for one more) unless it is there; the new count. */
static size_t ns_add(hapi_cache_namespace *set, size_t n, const hapi_cache_namespace *ns)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(&set[i], ns, sizeof(*ns)) == 0)
            return n;
    set[n] = *ns;
    return n + 1;
}

int hapi_remote_evict(hapi_remote *r, const char *path, hapi_error *err)
{
    int count = 0, rc = 0;
    if (!*path) {
        /*
         * Every namespace the sources serve: each one's at its check and
         * those of the indexes kept (a split changed since has another).
         */
        size_t n = 0, cap = r->nsources + 16;
        hapi_cache_namespace *ns = malloc(cap * sizeof(*ns));
        if (!ns)
            return hapi_error_set(err, -ENOMEM, "out of memory");
        for (size_t i = 0; i < r->nsources; i++)
            if (atomic_load(&r->sources[i].checked))
                n = ns_add(ns, n, &r->sources[i].ns);
        pthread_mutex_lock(&r->index_lock);
        for (size_t b = 0; b < INDEX_BUCKETS; b++)
            for (struct index_slot *sl = r->slots[b]; sl; sl = sl->next) {
                if (sl->index && n == cap) {
                    hapi_cache_namespace *more = realloc(ns, 2 * cap * sizeof(*ns));
                    if (!more)
                        break;
                    ns = more;
                    cap *= 2;
                }
                if (sl->index && n < cap)
                    n = ns_add(ns, n, &sl->index->ns);
            }
        pthread_mutex_unlock(&r->index_lock);
        for (size_t i = 0; i < n; i++) {
            if ((rc = hapi_cache_evict_all(r->cfg.cache, &ns[i], err)) < 0)
                break;
            count += rc;
        }
        free(ns);
        return rc < 0 ? rc : count;
    }
    int kind = HAPI_REMOTE_FILE;
    struct stat st;
    if (hapi_remote_stat(r, path, &kind, &st) < 0)
        kind = HAPI_REMOTE_FILE; /* maybe an image's own name */
    if (kind != HAPI_REMOTE_DIR) {
        /* a file: PATH is the image or its .feat */
        const char *name;
        char *dir = split_path(path, &name);
        size_t stem = hapi_feat_stem_len(name);
        char image[NAME_MAX + 1];
        snprintf(image, sizeof(image), "%.*s", (int)(stem ? stem : strlen(name)), name);
        struct dir_index *x = NULL;
        const struct index_entry *e = NULL;
        rc = dir ? find_image(r, dir, image, &x, &e, NULL) : -ENOMEM;
        if (rc == -EIO)
            hapi_error_set(err, rc, "'%s': a source that may have it is down (see errors)", path);
        char *key = rc == 0 ? hapi_path_join(dir, image) : NULL;
        if (rc == 0)
            rc = key ? hapi_cache_evict_path(r->cfg.cache, &x->ns, key, err) : -ENOMEM;
        free(key);
        free(dir);
        index_put(x);
        if (rc == -ENOENT)
            return hapi_error_set(err, rc, "'%s': no such file or directory", path);
        return rc;
    }
    hapi_evict_walk w = { r->cfg.cache, NULL, 0, err };
    rc = walk_dirs(r, path, NULL, evict_dir, &w);
    return rc < 0 ? rc : w.count;
}

/* ----------------------------------------------------------- open/close */

/* Reads a source's .hapifs/config: a storage mount must have one, with a namespace. */
static int check_source(hapi_remote *r, int src, hapi_error *err)
{
    struct remote_source *s = &r->sources[src];
    char *text = NULL;
    size_t len = 0;
    int rc = source_read_text(r, src, ".hapifs/config", HAPI_CTL_SIZE_MAX, &text, &len);
    if (rc < 0)
        return hapi_error_set(err, rc, "source %s: not a hapifs storage mount (.hapifs/config: "
                              "%s)", s->path, hapi_strerror(rc));
    json_error_t je;
    json_t *j = json_loadb(text, len, 0, &je);
    const char *ns = j ? json_string_value(json_object_get(json_object_get(j, "split"),
                                                           "namespace"))
                       : NULL;
    if (!j || !ns || hex_to_ns(ns, &s->ns) < 0) {
        json_decref(j);
        free(text);
        return hapi_error_set(err, HAPI_ECORRUPT, "source %s: .hapifs/config is not a hapifs "
                              "storage mount's (%s)", s->path,
                              j ? "no split.namespace" : "not JSON");
    }
    memcpy(s->ns_hex, ns, 33);
    s->config = text;
    json_decref(j);
    return 0;
}

/* The first source checked other than src, or -1. */
static int reference_source(hapi_remote *r, int src)
{
    for (size_t i = 0; i < r->nsources; i++)
        if ((int)i != src && atomic_load(&r->sources[i].checked))
            return (int)i;
    return -1;
}

/*
 * Whether src's features are of the model of the sources checked before it:
 * the same model digest, precision and preprocessing (its split may differ,
 * as it may after a split change on one node: each directory's index names
 * its namespace). Returns 0, or HAPI_EINVAL with err.
 */
static int same_model(hapi_remote *r, int src, hapi_error *err)
{
    int ref = reference_source(r, src);
    if (ref < 0)
        return 0;
    json_t *a = json_loads(r->sources[src].config, 0, NULL);
    json_t *b = json_loads(r->sources[ref].config, 0, NULL);
    static const char *keys[][2] = { { "model", "digest" }, { "model", "precision" },
                                     { "preprocess", NULL } };
    int rc = 0;
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]) && rc == 0; i++) {
        json_t *va = json_object_get(a, keys[i][0]), *vb = json_object_get(b, keys[i][0]);
        if (keys[i][1]) {
            va = json_object_get(va, keys[i][1]);
            vb = json_object_get(vb, keys[i][1]);
        } else if (json_is_object(va) && json_is_object(vb)) {
            /* what the features are computed with: a refusal bound is not */
            json_object_del(va, "max_pixels");
            json_object_del(vb, "max_pixels");
        }
        if (!va || !vb || !json_equal(va, vb))
            rc = hapi_error_set(err, HAPI_EINVAL, "source %s: features of another %s%s%s than "
                                "%s's (namespace %.12s, not %.12s)", r->sources[src].path,
                                keys[i][0], keys[i][1] ? " " : "", keys[i][1] ? keys[i][1] : "",
                                r->sources[ref].path, r->sources[src].ns_hex,
                                r->sources[ref].ns_hex);
    }
    json_decref(a);
    json_decref(b);
    return rc;
}

/*
 * Reads src's .hapifs/config and checks its model against the others'. A
 * source of another model is refused for good; one that cannot be read (its
 * storage daemon restarting, its network filesystem not mounted yet) is
 * down, tried again at its next use. Under check_lock. Returns 0 or < 0
 * with err.
 */
static int source_check(hapi_remote *r, int src, hapi_error *err)
{
    struct remote_source *s = &r->sources[src];
    int rc = check_source(r, src, err);
    if (rc == 0 && (rc = same_model(r, src, err)) < 0) {
        atomic_store(&s->refused, 1);
        hapi_log(HAPI_LOG_ERROR, "%s; this source is refused", err->message);
    } else if (rc == 0) {
        atomic_store(&s->checked, 1);
    }
    if (rc < 0) {
        pthread_mutex_lock(&s->lock);
        snprintf(s->last_error, sizeof(s->last_error), "%s%.400s",
                 atomic_load(&s->refused) ? "refused: " : "", err->message);
        pthread_mutex_unlock(&s->lock);
        hapi_error_ring_add(r->cfg.errors, s->path, rc, err->message);
    }
    return rc;
}

/*
 * Whether src can be used: checked (at the mount, or since). One down at the
 * mount is checked again at most once per SERVING_CHECK_NS, so that it
 * serves once it is back (refused for good, its part of the tree was
 * missing for the life of the mount, after a restart of the compute side
 * while a storage node was down).
 */
static int source_usable(hapi_remote *r, int src)
{
    struct remote_source *s = &r->sources[src];
    if (atomic_load(&s->checked))
        return 1;
    uint64_t now = hapi_now_ns(), last = atomic_load(&s->check_ns);
    if (atomic_load(&s->refused) || (last && now - last < SERVING_CHECK_NS))
        return 0;
    pthread_mutex_lock(&s->check_lock);
    last = atomic_load(&s->check_ns);
    if (!atomic_load(&s->checked) && !atomic_load(&s->refused) &&
        !(last && now - last < SERVING_CHECK_NS)) {
        atomic_store(&s->check_ns, now);
        hapi_error e = { 0 };
        if (source_check(r, src, &e) == 0)
            hapi_log(HAPI_LOG_INFO, "source %s: a storage mount now (namespace %.12s): served",
                     s->path, s->ns_hex);
    }
    pthread_mutex_unlock(&s->check_lock);
    return atomic_load(&s->checked);
}

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
        .run = warm_run,
        .wake = warm_wake,
    };
    r->warm = hapi_warmup_new(&warm_ops, r);
    r->sources = calloc(cfg->nroots, sizeof(*r->sources));
    if (!r->sources || !r->warm) {
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
        if (source_check(r, (int)i, &e) < 0) {
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
    size_t n = cfg->fetch_threads > 0 ? (size_t)cfg->fetch_threads : 4;
    r->threads = calloc(n, sizeof(*r->threads));
    if (!r->threads) {
        rc = hapi_error_set(err, -ENOMEM, "out of memory");
        goto fail;
    }
    for (size_t i = 0; i < n; i++) {
        if ((rc = -pthread_create(&r->threads[i], NULL, fetch_thread, r)) < 0) {
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
        fetch_put_locked(f);
    }
    for (size_t b = 0; b < INDEX_BUCKETS; b++)
        for (struct index_slot *sl = r->slots[b], *next; sl; sl = next) {
            next = sl->next;
            index_put(sl->index);
            free(sl->dir);
            free(sl);
        }
    for (size_t i = 0; i < r->nsources; i++) {
        root_put(r->sources[i].root);
        free(r->sources[i].path);
        free(r->sources[i].config);
        pthread_mutex_destroy(&r->sources[i].lock);
        pthread_mutex_destroy(&r->sources[i].check_lock);
    }
    free(r->sources);
    free(r->threads);
    pthread_mutex_destroy(&r->index_lock);
    pthread_cond_destroy(&r->index_cond);
    spill_drop_all(r);
    pthread_mutex_destroy(&r->spill_lock);
    pthread_mutex_destroy(&r->fetch_lock);
    pthread_cond_destroy(&r->queue_cond);
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

/* remote-source.c — the sources of a compute-side mount: their roots (reopened when the network filesystem under one comes back), opens and reads beneath them, whether one is serving, the check of its .hapifs/config. */
#include "remote-int.h"
#include "log.h"
#include "shared.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define SERVING_CHECK_NS (200ull * 1000 * 1000) /* a source seen serving is believed for 0.2 s */

void hapi_remote__root_put(struct root *rt)
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
         * source is down for SERVING_CHECK_NS (see hapi_remote__serving()). Not when
         * the last root was dropped or failed to open: a reader sees only
         * this one. (Every reopen counted as a change once: a root dropped
         * by a storage restart at the end of a run and opened 60 s later
         * by the next reader made that reader's missing names EIO.)
         */
        s->serving_ns = 0;
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
            rt->gen = ++s->root_gen;
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
    hapi_remote__root_put(old);
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
void hapi_remote__source_failed(hapi_remote *r, int src, const char *path, int rc, const char *what)
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
    hapi_remote__root_put(old);
    hapi_error_ring_add(r->cfg.errors, path, rc, msg);
}

/*
 * Calls hapi_source_open_beneath on src's root; a transport error drops the
 * root and tries once more on a fresh one (the network filesystem may have
 * been mounted again). Returns an fd or -errno; *gen (if not NULL) is the gen
 * of the root it was opened or missed on (0: none could be opened), which
 * hapi_remote__serving() takes to judge a miss.
 */
int hapi_remote__source_open(hapi_remote *r, int src, const char *path, int flags, uint64_t *gen)
{
    int rc = 0;
    if (gen)
        *gen = 0;
    for (int attempt = 0; attempt < 2; attempt++) {
        struct root *rt = root_get(r, src, &rc);
        if (!rt)
            return rc;
        if (gen)
            *gen = rt->gen;
        rc = hapi_source_open_beneath(rt->source, path, flags);
        hapi_remote__root_put(rt);
        if (rc >= 0 || !is_transport_error(rc))
            return rc;
        pthread_mutex_lock(&r->sources[src].lock);
        struct root *old = r->sources[src].root == rt ? rt : NULL;
        if (old)
            r->sources[src].root = NULL;
        pthread_mutex_unlock(&r->sources[src].lock);
        hapi_remote__root_put(old);
    }
    return rc;
}

/*
 * Asks the filesystem of fd for the file's size now, past the kernel's
 * attribute cache. Through FUSE (sshfs, attr_timeout=600), a direct read at
 * or beyond the size the kernel cached returns 0 bytes, so a file that grew
 * since would read as torn.
 */
void hapi_remote__refresh_size(int fd)
{
    struct statx stx;
    (void)statx(fd, "", AT_EMPTY_PATH | AT_STATX_FORCE_SYNC, STATX_SIZE, &stx);
}

int hapi_remote__source_stat(hapi_remote *r, int src, const char *path, struct stat *st,
                             uint64_t *gen)
{
    int fd = hapi_remote__source_open(r, src, path, O_PATH, gen);
    if (fd < 0)
        return fd;
    int rc = fstat(fd, st) < 0 ? -errno : 0;
    close(fd);
    return rc;
}

/*
 * Opens path on src for reading around page caches (O_DIRECT: a network
 * filesystem's may hold what the file was), or plainly where the filesystem
 * refuses O_DIRECT at the open (tmpfs). Read it with hapi_remote_pread_all().
 */
int hapi_remote__source_open_direct(hapi_remote *r, int src, const char *path, uint64_t *gen)
{
    int fd = hapi_remote__source_open(r, src, path, O_RDONLY | O_DIRECT, gen);
    return fd == -EINVAL ? hapi_remote__source_open(r, src, path, O_RDONLY, gen) : fd;
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

ssize_t hapi_remote_pread_all(int fd, void *buf, size_t len, off_t off)
{
    size_t got = 0;
    while (got < len) {
        ssize_t n = pread(fd, (char *)buf + got, len - got, off + (off_t)got);
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

/* Reads fd to its end (at most max bytes) into *text (malloc'd, NUL-terminated); closes fd. */
int hapi_remote__read_text(int fd, size_t max, char **text, size_t *len)
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
        ssize_t n = hapi_remote_pread_all(fd, buf + used, cap - used, (off_t)used);
        if (n < 0)
            rc = (int)n;
        else if ((used += (size_t)n) < cap)
            break; /* the end */
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
    return hapi_remote__read_text(hapi_remote__source_open(r, src, path, O_RDONLY, NULL), max, text,
                                  len);
}

/*
 * Reads up to len bytes at the start of path on src into buf (aligned to 4096
 * bytes), around page caches: O_DIRECT, or a plain read where the filesystem
 * refuses it (a local one wants aligned lengths too). Returns the bytes read
 * or -errno.
 */
ssize_t hapi_remote__source_read_head(hapi_remote *r, int src, const char *path, char *buf,
                                      size_t len, uint64_t *gen)
{
    int fd = hapi_remote__source_open_direct(r, src, path, gen);
    if (fd < 0)
        return fd;
    ssize_t n = hapi_remote_pread_all(fd, buf, len, 0);
    if (n == 0) {
        hapi_remote__refresh_size(fd); /* a size of 0 cached: see hapi_remote__refresh_size() */
        n = hapi_remote_pread_all(fd, buf, len, 0);
    }
    close(fd);
    return n;
}

/*
 * Whether src is a storage mount now: its .hapifs/config can be read, around
 * page caches (O_DIRECT where allowed), at most once per SERVING_CHECK_NS
 * while it is. A storage daemon that is restarting leaves the directory under
 * its mountpoint in view, empty (or, through sshfs, with attributes cached
 * from before): every name in it is missing then, and a reader must hear that
 * the source is down (EIO), not that its files are gone (ENOENT).
 *
 * gen is the root a name was missed on (hapi_remote__source_open()'s *gen):
 * the answer is then of that root only, so that a miss in the directory
 * beneath a mount is never judged by a check of the mount that came over it
 * since. (A reader held up between its miss and the check read existing
 * images as ENOENT in the two-tier soak, at the end of sshfs remounts.) 0:
 * a miss in an index read before, of whichever root.
 */
int hapi_remote__serving(hapi_remote *r, int src, uint64_t gen)
{
    struct remote_source *s = &r->sources[src];
    /*
     * Test hook: while the file HAPIFS_TEST_HOLD_MISS names exists, a miss
     * waits here before it is judged, as a reader held up on a busy node;
     * the file's name with ".held" appended is made when one waits.
     */
    if (r->hold_miss && access(r->hold_miss, F_OK) == 0) {
        char held[PATH_MAX];
        snprintf(held, sizeof(held), "%s.held", r->hold_miss);
        int fd = open(held, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
        if (fd >= 0)
            close(fd);
        while (access(r->hold_miss, F_OK) == 0)
            nanosleep(&(struct timespec){ .tv_nsec = 10000000L }, NULL);
    }
    uint64_t now = hapi_now_ns();
    /*
     * A miss of no known root, and a root reopened less than
     * SERVING_CHECK_NS ago (a network filesystem mounted again over the
     * empty directory): the name may have been missing from the directory
     * beneath, and the check would speak for the new mount. Down, for so long.
     */
    uint64_t since = atomic_load(&s->root_since_ns);
    if (!gen && since && now - since < SERVING_CHECK_NS)
        return 0;
    pthread_mutex_lock(&s->lock);
    int known = s->serving_ns && now - s->serving_ns < SERVING_CHECK_NS &&
                (!gen || gen == s->serving_gen);
    pthread_mutex_unlock(&s->lock);
    if (known)
        return 1;
    char buf[4096] __attribute__((aligned(4096)));
    uint64_t on = 0;
    int up = hapi_remote__source_read_head(r, src, ".hapifs/config", buf, sizeof(buf), &on) > 0;
    since = atomic_load(&s->root_since_ns); /* the read may have reopened it */
    if (up && !gen && since && hapi_now_ns() - since < SERVING_CHECK_NS)
        return 0;
    pthread_mutex_lock(&s->lock);
    s->serving_ns = up ? now : 0;
    s->serving_gen = on;
    pthread_mutex_unlock(&s->lock);
    return up && (!gen || on == gen);
}

/*
 * For a name no source's index lists: -ENOENT if every source that is not
 * refused is serving, else -EIO. See hapi_remote__serving().
 */
int hapi_remote__missing_or_down(hapi_remote *r)
{
    for (size_t i = 0; i < r->nsources; i++)
        if (!atomic_load(&r->sources[i].refused) && !hapi_remote__serving(r, (int)i, 0))
            return -EIO;
    return -ENOENT;
}

/* ------------------------------------------------------------- checks */

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
    if (!j || !ns || hapi_remote__hex_to_ns(ns, &s->ns) < 0) {
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
int hapi_remote__source_check(hapi_remote *r, int src, hapi_error *err)
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
int hapi_remote__source_usable(hapi_remote *r, int src)
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
        if (hapi_remote__source_check(r, src, &e) == 0)
            hapi_log(HAPI_LOG_INFO, "source %s: a storage mount now (namespace %.12s): served",
                     s->path, s->ns_hex);
    }
    pthread_mutex_unlock(&s->check_lock);
    return atomic_load(&s->checked);
}

/* watch.c — changes in the source's directories, from inotify, told to fs.c so that the kernel forgets what changed. */
#include "watch.h"
#include "hapi.h"
#include "log.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

/*
 * Everything that changes what a directory's names stand for: a name made,
 * removed or moved in or out, a file written or closed after writing, a
 * mode, owner or time changed; and the directory itself removed or moved.
 * IN_EXCL_UNLINK: a file unlinked while open elsewhere is no longer ours. Not
 * IN_DONT_FOLLOW: the path given is /proc/self/fd/N, a link to follow.
 */
#define WATCH_MASK                                                                         \
    (IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_MODIFY | IN_CLOSE_WRITE |    \
     IN_ATTRIB | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR | IN_EXCL_UNLINK)

#define WATCH_BUCKETS 4096
/* Names merged per batch (each event searches the batch: a bound). */
#define MAX_PENDING 256

/* One watched directory: inotify's descriptor and the node the kernel knows it by. */
struct watched {
    int wd;
    uint64_t dir_id;
    struct watched *next;
};

struct hapi_watch {
    int fd;        /* inotify */
    int stop_fd;   /* eventfd: the thread returns when it is written */
    hapi_watch_fn fn;
    void *arg;
    pthread_t thread;
    int started;
    pthread_mutex_t lock; /* the table below; a leaf */
    struct watched *buckets[WATCH_BUCKETS];
    hapi_watch_stats stats;
};

/*
 * Filesystems where inotify sees only this host's changes, or none: a network
 * or FUSE filesystem changed by another host would never be told. Directories
 * on them are not watched, and their names keep the short timeout.
 */
static int fs_type_is_remote(long type)
{
    static const unsigned long remote[] = {
        0x6969,     /* NFS */
        0x517B,     /* SMB */
        0xFE534D42, /* SMB2 */
        0xFF534D42, /* CIFS */
        0x65735546, /* FUSE (sshfs, another hapifs, ...) */
        0x00C36400, /* Ceph */
        0x01021997, /* 9P */
        0x5346414F, /* AFS */
        0x6B414653, /* kAFS */
        0x0BD00BD0, /* Lustre */
        0x47504653, /* GPFS */
        0x19830326, /* BeeGFS */
        0x01161970, /* GFS2 */
        0x7461636f, /* OCFS2 */
    };
    for (size_t i = 0; i < sizeof(remote) / sizeof(remote[0]); i++)
        if ((unsigned long)type == remote[i])
            return 1;
    return 0;
}

static void *watch_main(void *arg);

int hapi_watch_new(hapi_watch_fn fn, void *arg, hapi_watch **out, hapi_error *err)
{
    *out = NULL;
    hapi_watch *w = calloc(1, sizeof(*w));
    if (!w)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    w->fn = fn;
    w->arg = arg;
    w->stop_fd = -1;
    pthread_mutex_init(&w->lock, NULL);
    int rc;
    if ((w->fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC)) < 0) {
        rc = hapi_error_set(err, -errno, "inotify_init1: %s", strerror(errno));
        goto fail;
    }
    if ((w->stop_fd = eventfd(0, EFD_CLOEXEC)) < 0) {
        rc = hapi_error_set(err, -errno, "eventfd: %s", strerror(errno));
        goto fail;
    }
    if ((rc = pthread_create(&w->thread, NULL, watch_main, w)) != 0) {
        rc = hapi_error_set(err, -rc, "cannot start the watch thread: %s", strerror(rc));
        goto fail;
    }
    w->started = 1;
    *out = w;
    return 0;
fail:
    hapi_watch_free(w);
    return rc;
}

void hapi_watch_free(hapi_watch *w)
{
    if (!w)
        return;
    if (w->started) {
        uint64_t one = 1;
        if (write(w->stop_fd, &one, sizeof(one)) != sizeof(one))
            hapi_log(HAPI_LOG_ERROR, "watch: cannot stop its thread: %s", strerror(errno));
        else
            pthread_join(w->thread, NULL);
    }
    for (size_t i = 0; i < WATCH_BUCKETS; i++)
        for (struct watched *x = w->buckets[i], *next; x; x = next) {
            next = x->next;
            free(x);
        }
    if (w->fd >= 0)
        close(w->fd);
    if (w->stop_fd >= 0)
        close(w->stop_fd);
    pthread_mutex_destroy(&w->lock);
    free(w);
}

/* The entry of wd (under w->lock), or NULL; *link is where it hangs. */
static struct watched *find(hapi_watch *w, int wd, struct watched ***link)
{
    struct watched **l = &w->buckets[(unsigned)wd % WATCH_BUCKETS];
    while (*l && (*l)->wd != wd)
        l = &(*l)->next;
    if (link)
        *link = l;
    return *l;
}

/* Takes the entry at *link out of the table (under w->lock). */
static void unlink_entry(hapi_watch *w, struct watched **link)
{
    struct watched *x = *link;
    *link = x->next;
    free(x);
    atomic_fetch_sub(&w->stats.dirs, 1);
}

int hapi_watch_add(hapi_watch *w, int dirfd, uint64_t dir_id)
{
    struct statfs sf;
    if (fstatfs(dirfd, &sf) < 0)
        return -errno;
    if (fs_type_is_remote((long)sf.f_type)) {
        atomic_fetch_add(&w->stats.remote, 1);
        return -EREMOTE;
    }
    /* inotify takes a path: the descriptor's, so that the directory is the one opened beneath. */
    char self[64];
    snprintf(self, sizeof(self), "/proc/self/fd/%d", dirfd);
    int wd = inotify_add_watch(w->fd, self, WATCH_MASK);
    if (wd < 0) {
        int e = errno;
        if (e == ENOSPC && atomic_fetch_add(&w->stats.refused, 1) == 0)
            hapi_log(HAPI_LOG_ERROR,
                     "watch: no more inotify watches (fs.inotify.max_user_watches): names in "
                     "directories not watched are trusted for 1 s only");
        return -e;
    }
    pthread_mutex_lock(&w->lock);
    struct watched *x = find(w, wd, NULL);
    if (!x && (x = calloc(1, sizeof(*x)))) {
        x->wd = wd;
        struct watched **head = &w->buckets[(unsigned)wd % WATCH_BUCKETS];
        x->next = *head;
        *head = x;
        atomic_fetch_add(&w->stats.dirs, 1);
    }
    if (x)
        x->dir_id = dir_id;
    pthread_mutex_unlock(&w->lock);
    if (!x) {
        inotify_rm_watch(w->fd, wd);
        return -ENOMEM;
    }
    return wd;
}

void hapi_watch_remove(hapi_watch *w, int wd)
{
    struct watched **link;
    pthread_mutex_lock(&w->lock);
    struct watched *x = find(w, wd, &link);
    if (x)
        unlink_entry(w, link);
    pthread_mutex_unlock(&w->lock);
    /* A directory removed has lost its watch already (EINVAL): nothing to undo. */
    if (x)
        inotify_rm_watch(w->fd, wd);
}

void hapi_watch_stats_get(hapi_watch *w, hapi_watch_stats *out)
{
    out->dirs = atomic_load(&w->stats.dirs);
    out->events = atomic_load(&w->stats.events);
    out->overflows = atomic_load(&w->stats.overflows);
    out->refused = atomic_load(&w->stats.refused);
    out->remote = atomic_load(&w->stats.remote);
}

/*
 * The events of one read, merged by (directory, name): what fs.c does for a
 * name is the same whatever happened to it, and each notice it sends the
 * kernel waits for the lookups in flight in that directory (hundreds of ms on
 * a loaded node). A file replaced by a temporary one renamed over it makes
 * five events of two names; a file written makes runs of IN_MODIFY.
 */
struct pending {
    uint64_t dir_id;
    uint32_t mask;      /* the events' masks, ORed */
    uint32_t name_len;  /* 0: the directory itself */
    const char *name;   /* in the read buffer */
};

/* Hands the batch to fs.c, then ends it (dir_id 0, name ""); empties it. */
static void flush(hapi_watch *w, struct pending *p, size_t *n)
{
    for (size_t i = 0; i < *n; i++)
        w->fn(w->arg, p[i].dir_id, p[i].name_len ? p[i].name : "", p[i].mask);
    if (*n)
        w->fn(w->arg, 0, "", 0);
    *n = 0;
}

/* Adds one event to the batch; an event of a watch gone meanwhile is dropped. */
static void add(hapi_watch *w, const struct inotify_event *ev, struct pending *p, size_t *n)
{
    atomic_fetch_add_explicit(&w->stats.events, 1, memory_order_relaxed);
    if (ev->mask & IN_Q_OVERFLOW) {
        flush(w, p, n);
        atomic_fetch_add(&w->stats.overflows, 1);
        hapi_log(HAPI_LOG_INFO, "watch: the kernel's event queue overflowed: forgetting every name");
        w->fn(w->arg, 0, NULL, ev->mask);
        return;
    }
    struct watched **link;
    pthread_mutex_lock(&w->lock);
    struct watched *x = find(w, ev->wd, &link);
    uint64_t dir_id = x ? x->dir_id : 0;
    if (x && (ev->mask & IN_IGNORED))
        unlink_entry(w, link); /* the directory is gone, or its filesystem: so is the watch */
    pthread_mutex_unlock(&w->lock);
    if (!x)
        return;
    uint32_t len = ev->len ? (uint32_t)strlen(ev->name) : 0;
    for (size_t i = *n; i-- > 0;)
        if (p[i].dir_id == dir_id && p[i].name_len == len &&
            (len == 0 || memcmp(p[i].name, ev->name, len) == 0)) {
            p[i].mask |= ev->mask;
            return;
        }
    if (*n == MAX_PENDING)
        flush(w, p, n);
    p[(*n)++] = (struct pending){ dir_id, ev->mask, len, ev->name };
}

static void *watch_main(void *arg)
{
    hapi_watch *w = arg;
    pthread_setname_np(pthread_self(), "hapifs-watch");
    /* Aligned for struct inotify_event; one read returns as many events as fit. */
    char buf[64 * 1024] __attribute__((aligned(__alignof__(struct inotify_event))));
    struct pending pending[MAX_PENDING];
    struct pollfd p[2] = { { .fd = w->fd, .events = POLLIN }, { .fd = w->stop_fd, .events = POLLIN } };
    for (;;) {
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            hapi_log(HAPI_LOG_ERROR, "watch: poll: %s; changes are no longer seen", strerror(errno));
            return NULL;
        }
        if (p[1].revents)
            return NULL;
        ssize_t n = read(w->fd, buf, sizeof(buf));
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR)
                continue;
            hapi_log(HAPI_LOG_ERROR, "watch: read: %s; changes are no longer seen", strerror(errno));
            return NULL;
        }
        size_t np = 0;
        for (char *q = buf; q < buf + n;) {
            const struct inotify_event *ev = (const struct inotify_event *)q;
            q += sizeof(*ev) + ev->len;
            add(w, ev, pending, &np);
        }
        flush(w, pending, &np);
    }
}

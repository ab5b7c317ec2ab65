/* notify.c — telling the kernel what changed: forgetting names and inodes, epoch notices, the notice watchdog, split changes, the watch batches. */
#include "fs-int.h"

#include <fuse_lowlevel.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h> /* struct fuse_out_header: a notice libfuse 3.14 cannot send */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

/*
 * Tells the kernel to forget, of every node, what how() says (how runs under
 * the table's lock and may change the node): its name in its parent, or its
 * inode. A node whose name cannot be made (out of memory) is left out. The
 * notices go outside the lock: the kernel may look things up again meanwhile.
 */
static void forget_nodes(hapi_fs *fs, enum forget_how (*how)(struct node *nd))
{
    struct node_table *t = fs->nodes;
    struct stale *todo = NULL;
    size_t n = 0, cap = 0;
    pthread_mutex_lock(&t->lock);
    for (size_t i = 0; i < t->nbuckets; i++)
        for (struct node *nd = t->buckets[i]; nd; nd = nd->next) {
            enum forget_how h = how(nd);
            if (h == FORGET_NOTHING)
                continue;
            if (n == cap) {
                struct stale *bigger = realloc(todo, (cap = cap ? cap * 2 : 256) * sizeof(*todo));
                if (!bigger)
                    break;
                todo = bigger;
            }
            todo[n] = (struct stale){ nd->id, nd->parent, NULL };
            if (h == FORGET_NAME && !(todo[n].name = node_entry_name(nd)))
                continue;
            n++;
        }
    pthread_mutex_unlock(&t->lock);
    size_t failed = 0;
    for (size_t i = 0; i < n; i++) {
        int rc = todo[i].name ? fuse_lowlevel_notify_inval_entry(fs->se, todo[i].parent,
                                                                 todo[i].name,
                                                                 strlen(todo[i].name))
                              : fuse_lowlevel_notify_inval_inode(fs->se, todo[i].id, 0, 0);
        failed += rc < 0;
        free(todo[i].name);
    }
    if (failed)
        hapi_log(HAPI_LOG_DEBUG, "%zu of %zu names or inodes were not in the kernel's cache",
                 failed, n);
    free(todo);
}

/* A split change: .feat and pack names; listings, remote .feat and indexes by inode. */
static enum forget_how split_change_how(struct node *nd)
{
    if (nd->kind == HAPI_NODE_FEAT || nd->kind == HAPI_NODE_PACK)
        return FORGET_NAME;
    /* a listing the kernel keeps (a watched directory) has the .feat's old ids */
    if ((nd->kind == HAPI_NODE_DIR && nd->wd >= 0) || nd->kind == HAPI_NODE_PACK_INDEX ||
        nd->kind == HAPI_NODE_REMOTE_FEAT)
        return FORGET_INODE;
    return FORGET_NOTHING;
}

/* The same with an epoch notice sent: the inodes alone. */
static enum forget_how split_change_inodes_how(struct node *nd)
{
    enum forget_how h = split_change_how(nd);
    return h == FORGET_NAME ? FORGET_NOTHING : h;
}

/*
 * Tells the kernel to look every name up again at its next use: one notice,
 * which takes no lock (see hapi_fs.epochs). Returns 0 or -errno.
 */
static int notify_epoch(hapi_fs *fs)
{
    struct fuse_out_header oh = { .len = sizeof(oh), .error = NOTIFY_INC_EPOCH, .unique = 0 };
    if (!fs->se)
        return -ENOTCONN;
    ssize_t n = write(fuse_session_fd(fs->se), &oh, sizeof(oh));
    if (n == (ssize_t)sizeof(oh))
        atomic_fetch_add(&fs->epoch_notices, 1);
    return n == (ssize_t)sizeof(oh) ? 0 : n < 0 ? -errno : -EIO;
}

void hapi_fs_serving(hapi_fs *fs)
{
    atomic_store(&fs->serving, 1);
}

/* tune.c's gate (hapi_tune_config.serving): mounted, and io_uring's workers all registered. */
int fs_serving(void *arg)
{
    hapi_fs *fs = arg;
    if (!atomic_load(&fs->serving))
        return 0;
    hapi_uring_stats u;
    hapi_uring_stats_get(fs->uring, &u);
    return !fs->uring || u.active;
}

void hapi_fs_probe_epochs(hapi_fs *fs)
{
    int rc = notify_epoch(fs);
    fs->epochs = rc == 0;
    atomic_store(&fs->epoch_notices, 0); /* the probe is not one */
    if (rc == 0)
        hapi_log(HAPI_LOG_DEBUG, "the kernel takes epoch notices: late names are ended at once");
    else if (fs->watch)
        hapi_log(HAPI_LOG_INFO, "the kernel takes no epoch notices (%s): changes are told name "
                                "by name%s", strerror(-rc),
                 fs->no_open ? ", and .feat and pack names are trusted for 1 s" : "");
}

static void *watchdog_main(void *arg)
{
    hapi_fs *fs = arg;
    pthread_setname_np(pthread_self(), "hapifs-watchdog");
    struct notice_watchdog *w = fs->watchdog;
    pthread_mutex_lock(&w->lock);
    while (!w->stop) {
        if (!w->since_ns) {
            pthread_cond_wait(&w->cond, &w->lock);
            continue;
        }
        uint64_t due = w->since_ns + NOTICE_DEADLINE_NS, now = hapi_now_ns();
        if (now < due) {
            struct timespec ts;
            hapi_deadline_after_ns(&ts, due - now);
            pthread_cond_timedwait(&w->cond, &w->lock, &ts);
            continue;
        }
        w->since_ns = now;
        pthread_mutex_unlock(&w->lock);
        int rc = notify_epoch(fs);
        pthread_mutex_lock(&w->lock);
        if (rc == 0)
            w->epochs++;
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

int watchdog_start(hapi_fs *fs)
{
    struct notice_watchdog *w = calloc(1, sizeof(*w));
    if (!w)
        return -ENOMEM;
    hapi_cond_init_monotonic(&w->cond);
    pthread_mutex_init(&w->lock, NULL);
    fs->watchdog = w;
    int rc = pthread_create(&w->thread, NULL, watchdog_main, fs);
    w->started = rc == 0;
    return -rc;
}

void watchdog_stop(hapi_fs *fs)
{
    struct notice_watchdog *w = fs->watchdog;
    if (!w)
        return;
    if (w->started) {
        pthread_mutex_lock(&w->lock);
        w->stop = 1;
        pthread_cond_signal(&w->cond);
        pthread_mutex_unlock(&w->lock);
        pthread_join(w->thread, NULL);
    }
    pthread_cond_destroy(&w->cond);
    pthread_mutex_destroy(&w->lock);
    free(w);
    fs->watchdog = NULL;
}

/* A batch's names are being told from now on; returns the epochs sent so far. */
static uint64_t watchdog_begin(struct notice_watchdog *w)
{
    pthread_mutex_lock(&w->lock);
    uint64_t e = w->epochs;
    w->since_ns = hapi_now_ns();
    pthread_cond_signal(&w->cond);
    pthread_mutex_unlock(&w->lock);
    return e;
}

/* Whether an epoch notice was sent since watchdog_begin() returned e. */
static int watchdog_covered(struct notice_watchdog *w, uint64_t e)
{
    pthread_mutex_lock(&w->lock);
    int covered = w->epochs != e;
    pthread_mutex_unlock(&w->lock);
    return covered;
}

static void watchdog_end(struct notice_watchdog *w)
{
    pthread_mutex_lock(&w->lock);
    w->since_ns = 0;
    pthread_mutex_unlock(&w->lock);
}

/*
 * tune.c's (and remote-index.c's) split-change callback, so that the next open
 * sees the new size and contents. A .feat and a pack are named by their
 * bytes: the kernel is told to forget their names (the next lookup finds the
 * new node; their pages stay right for the nodes they belong to, and files
 * open on them keep reading them), all at once by an epoch notice where it
 * can be. A remote .feat and a pack index are named by their place: the
 * kernel forgets their attributes and pages.
 */
void invalidate_feats(void *arg)
{
    hapi_fs *fs = arg;
    /* first: a lookup under way may have made a node of the old split (see op_lookup) */
    atomic_fetch_add(&fs->split_changes, 1);
    if (!fs->se)
        return;
    if (fs->epochs && notify_epoch(fs) == 0)
        forget_nodes(fs, split_change_inodes_how);
    else
        forget_nodes(fs, split_change_how);
}

static void *notifier_main(void *arg)
{
    hapi_fs *fs = arg;
    pthread_setname_np(pthread_self(), "hapifs-notify");
    struct split_notifier *n = fs->notifier;
    pthread_mutex_lock(&n->lock);
    while (!n->stop) {
        if (!n->pending) {
            pthread_cond_wait(&n->cond, &n->lock);
            continue;
        }
        int names = n->pending == 2;
        n->pending = 0; /* changes from now on are told again */
        pthread_mutex_unlock(&n->lock);
        forget_nodes(fs, names ? split_change_how : split_change_inodes_how);
        pthread_mutex_lock(&n->lock);
    }
    pthread_mutex_unlock(&n->lock);
    return NULL;
}

int notifier_start(hapi_fs *fs)
{
    struct split_notifier *n = calloc(1, sizeof(*n));
    if (!n)
        return -ENOMEM;
    pthread_cond_init(&n->cond, NULL);
    pthread_mutex_init(&n->lock, NULL);
    fs->notifier = n;
    int rc = pthread_create(&n->thread, NULL, notifier_main, fs);
    n->started = rc == 0;
    return -rc;
}

/* Joins the thread; later changes are counted, not told. The struct stays for them. */
void notifier_stop(hapi_fs *fs)
{
    struct split_notifier *n = fs->notifier;
    if (!n || !n->started)
        return;
    pthread_mutex_lock(&n->lock);
    n->stop = 1;
    pthread_cond_signal(&n->cond);
    pthread_mutex_unlock(&n->lock);
    pthread_join(n->thread, NULL);
    n->started = 0;
}

void notifier_free(hapi_fs *fs)
{
    struct split_notifier *n = fs->notifier;
    if (!n)
        return;
    notifier_stop(fs);
    pthread_cond_destroy(&n->cond);
    pthread_mutex_destroy(&n->lock);
    free(n);
    fs->notifier = NULL;
}

/* remote-index.c's callback: see struct split_notifier. */
void invalidate_remote_feats(void *arg)
{
    hapi_fs *fs = arg;
    atomic_fetch_add(&fs->split_changes, 1);
    struct split_notifier *n = fs->notifier;
    if (!fs->se || !n)
        return;
    int names = !(fs->epochs && notify_epoch(fs) == 0);
    pthread_mutex_lock(&n->lock);
    if (n->started && !n->stop) {
        n->pending = n->pending > 1 + names ? n->pending : 1 + names;
        pthread_cond_signal(&n->cond);
    }
    pthread_mutex_unlock(&n->lock);
}

/* Events were lost: every name (the root: its inode), and every directory counts a change. */
static enum forget_how everything_how(struct node *nd)
{
    if (nd->kind == HAPI_NODE_DIR)
        nd->changes++;
    return nd->parent ? FORGET_NAME : FORGET_INODE;
}

/* The same with an epoch notice sent (the names are forgotten): every inode. */
static enum forget_how every_inode_how(struct node *nd)
{
    if (nd->kind == HAPI_NODE_DIR)
        nd->changes++;
    return FORGET_INODE;
}

static void forget_name(hapi_fs *fs, uint64_t dir, const char *name)
{
    fuse_lowlevel_notify_inval_entry(fs->se, dir, name, strlen(name));
}

static int grow(void **array, size_t *cap, size_t n, size_t each)
{
    if (n < *cap)
        return 0;
    size_t c = *cap ? *cap * 2 : 16;
    void *a = realloc(*array, c * each);
    if (!a)
        return -ENOMEM;
    *array = a;
    *cap = c;
    return 0;
}

static void batch_dir(struct change_batch *b, uint64_t dir, int members)
{
    for (size_t i = 0; i < b->ndirs; i++)
        if (b->dirs[i].dir == dir) {
            b->dirs[i].members |= members;
            return;
        }
    if (grow((void **)&b->dirs, &b->capdirs, b->ndirs, sizeof(*b->dirs)) == 0)
        b->dirs[b->ndirs++] = (struct changed_dir){ dir, members };
}

/* A directory whose name was changed inside it: names are not forgotten in place. */
static int forgets_name(uint32_t mask)
{
    return !(mask & IN_ISDIR) || (mask & (IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO));
}

/* Tells the kernel to forget name in dir, unless an epoch notice has ended it (see batch_tell). */
static void tell_name(hapi_fs *fs, struct notice_watchdog *w, uint64_t e, uint64_t dir,
                      const char *name)
{
    if (!w || !watchdog_covered(w, e))
        forget_name(fs, dir, name);
}

/* Tells the kernel what the batch changed (see struct change_batch), and empties it. */
static void batch_tell(hapi_fs *fs, struct change_batch *b)
{
    for (size_t i = 0; i < b->ninodes; i++)
        fuse_lowlevel_notify_inval_inode(fs->se, b->inodes[i], 0, 0);
    struct notice_watchdog *w = fs->epochs ? fs->watchdog : NULL;
    uint64_t e = w ? watchdog_begin(w) : 0;
    char *feat = NULL;
    for (size_t i = 0; i < b->n; i++)
        if (!(b->names[i].mask & IN_ISDIR) && asprintf(&feat, "%s.feat", b->names[i].name) >= 0) {
            tell_name(fs, w, e, b->names[i].dir, feat);
            free(feat);
        }
    for (size_t i = 0; i < b->ndirs; i++)
        if (b->dirs[i].members)
            tell_name(fs, w, e, b->dirs[i].dir, HAPI_PACK_NAME);
    for (size_t i = 0; i < b->n; i++)
        if (forgets_name(b->names[i].mask))
            tell_name(fs, w, e, b->names[i].dir, b->names[i].name);
    for (size_t i = 0; i < b->ndirs; i++)
        if (b->dirs[i].members)
            tell_name(fs, w, e, b->dirs[i].dir, HAPI_PACK_INDEX_NAME);
    if (w)
        watchdog_end(w);
    for (size_t i = 0; i < b->ndirs; i++)
        fuse_lowlevel_notify_inval_inode(fs->se, b->dirs[i].dir, 0, 0);
    for (size_t i = 0; i < b->n; i++)
        free(b->names[i].name);
    b->n = b->ninodes = b->ndirs = 0;
}

/*
 * watch.c's callback: name changed in directory dir (see hapi_watch_fn). The
 * kernel forgets the name, its .feat, the directory's pack and index (their
 * next lookups find the new nodes: see "Node ids"), the attributes and pages
 * of a file or directory changed in place, and the directory's attributes and
 * listing, at the end of the batch (struct change_batch). Runs on watch.c's
 * thread, never in a request, so the kernel may send requests meanwhile. A
 * notice for what the kernel does not hold fails (ENOENT), and is ignored.
 */
void on_change(void *arg, uint64_t dir, const char *name, uint32_t mask)
{
    hapi_fs *fs = arg;
    struct node_table *t = fs->nodes;
    if (!name) {
        /* the kernel's queue overflowed: everything is looked up again */
        if (fs->se)
            forget_nodes(fs, fs->epochs && notify_epoch(fs) == 0 ? every_inode_how
                                                                 : everything_how);
        return;
    }
    if (!fs->changes && !(fs->changes = calloc(1, sizeof(*fs->changes))))
        return; /* out of memory: the names keep their timeout */
    struct change_batch *b = fs->changes;
    if (!dir) {
        if (fs->se)
            batch_tell(fs, b);
        return;
    }
    char *dir_path = NULL;
    pthread_mutex_lock(&t->lock);
    struct node *n = node_find(t, dir);
    if (n) {
        n->changes++;
        if (mask & IN_IGNORED)
            n->wd = NO_WATCH; /* gone; a directory made again there is watched anew */
        dir_path = strdup(n->path);
    }
    pthread_mutex_unlock(&t->lock);
    batch_dir(b, dir, *name != 0);
    if (*name && grow((void **)&b->names, &b->cap, b->n, sizeof(*b->names)) == 0 &&
        (b->names[b->n].name = strdup(name)) != NULL) {
        b->names[b->n].dir = dir;
        b->names[b->n++].mask = mask;
    }
    struct stat st;
    char *path = dir_path && *name ? hapi_path_join(dir_path, name) : NULL;
    if ((mask & (IN_MODIFY | IN_CLOSE_WRITE | IN_ATTRIB)) && path &&
        hapi_source_stat(fs->source, path, &st) == 0 &&
        grow((void **)&b->inodes, &b->capinodes, b->ninodes, sizeof(*b->inodes)) == 0)
        b->inodes[b->ninodes++] = node_id_for(fs, &st);
    free(path);
    free(dir_path);
}

void change_batch_free(struct change_batch *b)
{
    if (!b)
        return;
    for (size_t i = 0; i < b->n; i++)
        free(b->names[i].name);
    free(b->names);
    free(b->inodes);
    free(b->dirs);
    free(b);
}

/* fs.c — the FUSE low-level operations: the mirrored source tree, .feat files, passthrough files, the control directory. */
#include "fs.h"
#include "background.h"
#include "cache.h"
#include "ctl.h"
#include "extractor.h"
#include "hapi.h"
#include "log.h"
#include "options.h"
#include "pack.h"
#include "remote.h"
#include "serve.h"
#include "shared.h"
#include "source.h"
#include "tune.h"
#include "uring.h"
#include "view.h"
#include "watch.h"

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
 * Node ids. The kernel names every file by a 64-bit id we choose. Ids are
 * derived from the source's inode so that they are stable across remounts
 * (an NFS re-export needs that), in three disjoint ranges:
 *   1                      the root (FUSE_ROOT_ID)
 *   ino << 1               a source file or directory on the root's device, ino < 2^61
 *   2^62 | hash << 1 | f   anything else (another device, a huge inode number), a .feat
 *                          (f = 1), a directory's pack and index
 *   2^63 | n               the control directory and its files
 *
 * A .feat and a pack are named by their bytes, not only by their place: a
 * .feat's id is a hash of its image's inode, identity (size, times) and the
 * split; a pack's of its directory's inode and its snapshot's key (names,
 * identities, namespace). The kernel keeps a file's pages and size per node
 * (keep_cache for a .feat), and an open file keeps the bytes it was opened
 * with, so one node must never stand for two contents: then a reader that
 * still reads an old split, or an old snapshot, fills pages that a new open
 * would read, and a size the kernel holds from one snapshot truncates the
 * reads of another. So a changed image or split is a new node at the next
 * lookup; an open through a name the kernel has not looked up again (its
 * entry is trusted for ENTRY_TIMEOUT) finds the node's bytes are no longer
 * the source's and fails with ESTALE, which the kernel's open(2) answers by
 * looking the name up again and opening what it finds (LOOKUP_REVAL) — once.
 * If the thread that looked the node up opens it and it has changed already
 * (the source changes between a lookup and its open), the open is served
 * with direct_io: the bytes of now, and the node's pages left alone.
 */
#define CTL_BASE (1ull << 63)
#define CTL_DIR_ID (CTL_BASE | 1)
#define CTL_FILE_ID(i) (CTL_BASE | (2 + (uint64_t)(i)))
/*
 * A control file made for one lookup: node id CTL_BASE | serial << 8 | 2 + i,
 * serial unique (made_serial), so that every open(2), which looks the name up
 * (no timeout), has a node, pages and content of its own, as an open file had.
 * serial 0 is the control file as listed, and the model.
 */
#define CTL_MADE_ID(serial, i) (CTL_BASE | (uint64_t)(serial) << 8 | (2 + (uint64_t)(i)))
#define CTL_SERIAL(ino) (((ino) & ~CTL_BASE) >> 8)
#define HASHED_BASE (1ull << 62)

/*
 * How long the kernel may trust names and attributes we return. In a
 * directory that watch.c watches, a change is told to the kernel as it
 * happens (on_change), so names and attributes there are trusted for
 * WATCHED_TIMEOUT: a bound for a change inotify does not report (a write
 * through mmap, or through a hard link in a directory not watched). Elsewhere
 * (a network filesystem, watch=0, no inotify watches left, a remote mount):
 * 1 s.
 */
#define ENTRY_TIMEOUT 1.0
#define ATTR_TIMEOUT 1.0
#define WATCHED_TIMEOUT 300.0
/*
 * Without opens, and where the kernel takes no epoch notices (before Linux
 * 6.16), the names of a .feat and a pack are trusted for this long even where
 * watched: nothing else checks them, and a notice of a name can be late by
 * seconds (it waits for the lookups in flight in its directory, which wait
 * for workers busy computing features), so this is the bound. Looking such a
 * name up again finds the same node while its bytes are the same: the kernel
 * keeps its pages, and the warm epoch pays one lookup. With epochs, one
 * notice that takes no lock ends every name at once (batch_tell), and they
 * keep their directory's timeout.
 */
#define DATA_NAME_TIMEOUT 1.0
/* FUSE_NOTIFY_INC_EPOCH (protocol 7.44), which libfuse 3.14 does not know. */
#define NOTIFY_INC_EPOCH 8
#define BATCH_WAIT_MAX_US 100000.0 /* a partial batch under a CPU quota waits at most 100 ms */

/* What a node id names. */
enum hapi_node_kind {
    HAPI_NODE_DIR,
    HAPI_NODE_FILE,     /* a regular source file passed through */
    HAPI_NODE_FEAT,     /* x.jpg.feat, computed */
    HAPI_NODE_CTL_DIR,  /* .hapifs */
    HAPI_NODE_CTL_FILE, /* .hapifs/<name> */
    HAPI_NODE_PACK,     /* DIR/.hapifs-pack.npy; its path is DIR's */
    HAPI_NODE_PACK_INDEX, /* DIR/.hapifs-pack.json */
    HAPI_NODE_REMOTE_FEAT /* a remote mount's .feat; its path is the mount's */
};

/* The entry timeout of a name of kind that would get timeout (see DATA_NAME_TIMEOUT). */
static double name_timeout(const hapi_fs *fs, int kind, double timeout)
{
    if (fs->no_open && !fs->epochs && (kind == HAPI_NODE_FEAT || kind == HAPI_NODE_PACK) &&
        timeout > DATA_NAME_TIMEOUT)
        return DATA_NAME_TIMEOUT;
    return timeout;
}

/* ------------------------------------------------------------ node table */

/*
 * What the kernel has looked up and not yet forgotten: id -> (kind, path).
 * The path is the latest one the id was looked up by (a rename in the
 * source, or a hard link, changes it); for a .feat node it is the source
 * image's path. Paths are relative to the source root, "" for the root.
 */
/*
 * What a .feat or pack node's bytes are (see "Node ids"), as the lookup or
 * listing that returned it saw them; open compares it with the source now.
 */
struct node_content {
    int split;                 /* FEAT: the split */
    hapi_source_id id;         /* FEAT: the image's identity */
    uint64_t pack_key;         /* PACK: the snapshot's key (hapi_pack_info) */
    struct stat attr;          /* the attributes the kernel was given */
    uint64_t parent;           /* the directory's node id the kernel has it in */
    /*
     * The threads of the latest lookups that returned it, the last first (0:
     * none, or a listing). Several: two readers that look it up at once must
     * not take each other's place (the second's open then failed ESTALE).
     */
    pid_t looked_up_by[4];
    /*
     * FEAT with no_open: the view of its split. In a node, a reference of its
     * own (a file read after a split change keeps computing at its split); in
     * a copy from node_get(), NULL.
     */
    hapi_view *view;
    /*
     * PACK with no_open, from resolve() to node_ref() only: the snapshot the
     * lookup took, which the node keeps (its reads are of what the lookup saw).
     */
    hapi_pack *snapshot;
};

struct node {
    uint64_t id;
    uint64_t nlookup;
    int kind;
    char *path;
    struct node_content content; /* FEAT and PACK */
    uint64_t parent;             /* the directory's node id the kernel has it in (0: none) */
    double timeout;              /* the entry and attribute timeout it was given last */
    int wd;                      /* DIR: its inotify watch, NO_WATCH or CANNOT_WATCH */
    uint64_t changes;            /* DIR: changes seen in it (on_change) */
    struct node_pack *pack;      /* PACK, no_open: its snapshot, opened at the first read */
    hapi_ctl_text *text;         /* PACK_INDEX, no_open: made at its last lookup */
    uint64_t serial;             /* and which one it is (its mtime) */
    struct node *next;
};

/* A node's pack snapshot, shared by the reads under way (no_open). */
struct node_pack {
    atomic_int refs;
    hapi_pack *pack;
};

static void node_pack_put(struct node_pack *p)
{
    if (p && atomic_fetch_sub(&p->refs, 1) == 1) {
        hapi_pack_close(p->pack);
        free(p);
    }
}

/* Frees a node out of the table (its pack and text may take other locks: not under t->lock). */
static void node_free(struct node *n)
{
    hapi_view_put(n->content.view);
    node_pack_put(n->pack);
    hapi_ctl_text_put(n->text);
    free(n->path);
    free(n);
}
#define NO_WATCH (-1)      /* not watched yet (or any more): the next lookup tries */
#define CANNOT_WATCH (-2)  /* a network filesystem, or no watches left */

struct node_table {
    pthread_mutex_t lock;
    struct node **buckets;
    size_t nbuckets;
    size_t count;
    hapi_watch *watch;  /* where a directory node's watch goes when it does; NULL: none */
};

static struct node_table *node_table_new(void)
{
    struct node_table *t = calloc(1, sizeof(*t));
    if (!t)
        return NULL;
    t->nbuckets = 256; /* grows with the nodes: node_table_grow() */
    t->buckets = calloc(t->nbuckets, sizeof(*t->buckets));
    if (!t->buckets) {
        free(t);
        return NULL;
    }
    pthread_mutex_init(&t->lock, NULL);
    return t;
}

/* Closes the packs and puts the views nodes hold (before those layers go). */
static void node_table_drop_packs(struct node_table *t)
{
    if (!t)
        return;
    for (size_t i = 0; i < t->nbuckets; i++)
        for (struct node *n = t->buckets[i]; n; n = n->next) {
            node_pack_put(n->pack);
            n->pack = NULL;
            hapi_view_put(n->content.view);
            n->content.view = NULL;
        }
}

static void node_table_free(struct node_table *t)
{
    if (!t)
        return;
    for (size_t i = 0; i < t->nbuckets; i++) {
        for (struct node *n = t->buckets[i], *next; n; n = next) {
            next = n->next;
            node_free(n);
        }
    }
    pthread_mutex_destroy(&t->lock);
    free(t->buckets);
    free(t);
}

/* The name the kernel knows a .feat or pack node by, in its directory. */
static char *node_name(const struct node *nd)
{
    if (nd->kind == HAPI_NODE_PACK)
        return strdup(HAPI_PACK_NAME);
    const char *slash = strrchr(nd->path, '/');
    char *name = NULL;
    return asprintf(&name, "%s.feat", slash ? slash + 1 : nd->path) < 0 ? NULL : name;
}

/* The name the kernel knows node nd by in its parent, or NULL (malloc'd). */
static char *node_entry_name(const struct node *nd)
{
    if (nd->kind == HAPI_NODE_FEAT || nd->kind == HAPI_NODE_PACK)
        return node_name(nd);
    if (nd->kind == HAPI_NODE_PACK_INDEX)
        return strdup(HAPI_PACK_INDEX_NAME);
    const char *slash = strrchr(nd->path, '/');
    return *nd->path ? strdup(slash ? slash + 1 : nd->path) : NULL;
}

/* What forget_nodes() tells the kernel to forget of a node. */
enum forget_how { FORGET_NOTHING, FORGET_NAME, FORGET_INODE };

struct stale {
    uint64_t id, parent;
    char *name;  /* NULL: the inode (its attributes, pages, listing) */
};

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
static int fs_serving(void *arg)
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

/*
 * The watchdog of the name notices (with epochs): while watch.c's thread has
 * been telling one batch's names for NOTICE_DEADLINE, each waiting for the
 * lookups in flight in its directory, it sends an epoch notice, which ends
 * every name at once, then another each NOTICE_DEADLINE while the thread is
 * still at it; the thread skips the names an epoch has ended. Events that came
 * meanwhile are covered too: whatever changed before an epoch notice is looked
 * up again after it. So a name is ended within NOTICE_DEADLINE of its batch,
 * and where notices are quick (no lookups in flight: a warm epoch, whose
 * names the kernel keeps) the other names keep their nodes and pages.
 */
#define NOTICE_DEADLINE_NS 250000000ull
struct notice_watchdog {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    pthread_t thread;
    int started, stop;
    uint64_t since_ns;  /* when the batch being told began; 0: none */
    uint64_t epochs;    /* epoch notices it has sent */
};

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
            struct timespec ts = { (time_t)(due / 1000000000u), (long)(due % 1000000000u) };
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

static int watchdog_start(hapi_fs *fs)
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

static void watchdog_stop(hapi_fs *fs)
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
 * tune.c's (and remote.c's) split-change callback, so that the next open
 * sees the new size and contents. A .feat and a pack are named by their
 * bytes: the kernel is told to forget their names (the next lookup finds the
 * new node; their pages stay right for the nodes they belong to, and files
 * open on them keep reading them), all at once by an epoch notice where it
 * can be. A remote .feat and a pack index are named by their place: the
 * kernel forgets their attributes and pages.
 */
static void invalidate_feats(void *arg)
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

/*
 * A remote mount's split change, told from a thread of its own. remote.c
 * notices the storage side's new split when it reads a directory's index,
 * which a read of a .feat may do (a miss reads the index again); the kernel
 * holds that file's page locked until the read is answered, and forgetting
 * the inode waits for that lock: told from within the read, the daemon
 * waited for itself. The counter and an epoch notice (which takes no lock)
 * go at once; the inodes are forgotten by the notifier, after the reads in
 * flight on them are answered.
 */
struct split_notifier {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    pthread_t thread;
    int started, stop;
    int pending;        /* a change to tell; 2: names too (no epoch notice went) */
};

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

static int notifier_start(hapi_fs *fs)
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
static void notifier_stop(hapi_fs *fs)
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

static void notifier_free(hapi_fs *fs)
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

/* remote.c's callback: see struct split_notifier. */
static void invalidate_remote_feats(void *arg)
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

static size_t node_bucket(const struct node_table *t, uint64_t id)
{
    return (size_t)(XXH3_64bits(&id, sizeof(id)) & (t->nbuckets - 1));
}

/* The node of id, or NULL; under t->lock. */
static struct node *node_find(struct node_table *t, uint64_t id)
{
    struct node *n = t->buckets[node_bucket(t, id)];
    while (n && n->id != id)
        n = n->next;
    return n;
}

/*
 * Four times the buckets once there are two nodes a bucket (under t->lock): a
 * tree of 10^6 files the kernel keeps in its cache is 10^6 nodes, and chains
 * of 15 would make every lookup and read walk them. Stays as it is when out
 * of memory (only slower).
 */
static void node_table_grow(struct node_table *t)
{
    if (t->count <= 2 * t->nbuckets || t->nbuckets > (SIZE_MAX >> 3) / sizeof(*t->buckets))
        return;
    size_t old_n = t->nbuckets;
    struct node **old = t->buckets, **fresh = calloc(old_n * 4, sizeof(*fresh));
    if (!fresh)
        return;
    t->buckets = fresh;
    t->nbuckets = old_n * 4;
    for (size_t i = 0; i < old_n; i++)
        for (struct node *n = old[i], *next; n; n = next) {
            next = n->next;
            size_t b = node_bucket(t, n->id);
            n->next = fresh[b];
            fresh[b] = n;
        }
    free(old);
}

/*
 * Counts one more lookup of id in directory parent, with the timeout the
 * kernel is given, creating the node or updating its path and, for a .feat or
 * pack, what it was looked up as (content). Returns 1 for a directory that
 * has no watch yet (the caller tries watch_dir()), 0, or -ENOMEM.
 */
static int node_ref(struct node_table *t, uint64_t id, int kind, const char *path,
                    const struct node_content *content, uint64_t parent, double timeout)
{
    hapi_pack *snapshot = content ? content->snapshot : NULL; /* always taken */
    struct node_pack *np = NULL;
    char *copy = strdup(path);
    if (snapshot && (np = calloc(1, sizeof(*np)))) {
        atomic_init(&np->refs, 1);
        np->pack = snapshot;
        snapshot = NULL;
    }
    if (!copy || snapshot) {
        free(copy);
        hapi_pack_close(snapshot);
        node_pack_put(np);
        return -ENOMEM;
    }
    pthread_mutex_lock(&t->lock);
    struct node *n = node_find(t, id);
    if (!n) {
        n = calloc(1, sizeof(*n));
        if (!n) {
            pthread_mutex_unlock(&t->lock);
            free(copy);
            node_pack_put(np);
            return -ENOMEM;
        }
        n->id = id;
        n->wd = NO_WATCH;
        size_t b = node_bucket(t, id);
        n->next = t->buckets[b];
        t->buckets[b] = n;
        t->count++;
        node_table_grow(t);
    }
    n->nlookup++;
    n->kind = kind;
    free(n->path);
    n->path = copy;
    hapi_view *old_view = NULL;
    if (content) {
        old_view = n->content.view;
        pid_t seen[sizeof(n->content.looked_up_by) / sizeof(pid_t)];
        memcpy(seen, n->content.looked_up_by, sizeof(seen));
        n->content = *content;
        /* this lookup's thread first, then the others that looked it up lately */
        size_t k = 1, nk = sizeof(seen) / sizeof(seen[0]);
        for (size_t i = 0; i < nk && k < nk; i++)
            if (seen[i] && seen[i] != n->content.looked_up_by[0])
                n->content.looked_up_by[k++] = seen[i];
        n->content.snapshot = NULL;
        if (n->content.view)
            hapi_view_ref(n->content.view);
    }
    if (np && !n->pack) { /* a node named by its key: one it has already is the same */
        n->pack = np;
        np = NULL;
    }
    n->parent = parent;
    n->timeout = timeout;
    int unwatched = kind == HAPI_NODE_DIR && t->watch && n->wd == NO_WATCH;
    pthread_mutex_unlock(&t->lock);
    hapi_view_put(old_view); /* the last reference frees a batcher: not under the lock */
    node_pack_put(np);
    return unwatched;
}

static void node_unref(struct node_table *t, uint64_t id, uint64_t count)
{
    pthread_mutex_lock(&t->lock);
    struct node **link = &t->buckets[node_bucket(t, id)];
    while (*link && (*link)->id != id)
        link = &(*link)->next;
    struct node *n = *link, *gone = NULL;
    if (n) {
        n->nlookup = n->nlookup > count ? n->nlookup - count : 0;
        if (n->nlookup == 0) {
            *link = n->next;
            t->count--;
            if (n->wd >= 0 && t->watch)
                hapi_watch_remove(t->watch, n->wd);
            gone = n;
        }
    }
    pthread_mutex_unlock(&t->lock);
    if (gone)
        node_free(gone);
}

/*
 * Copies id's kind and path (malloc'd into *path) and, if content is not
 * NULL, what a .feat or pack node is. Returns 0, -ENOENT (stale id) or -ENOMEM.
 */
static int node_get(hapi_fs *fs, uint64_t id, int *kind, char **path,
                    struct node_content *content)
{
    if (id == FUSE_ROOT_ID) {
        *kind = HAPI_NODE_DIR;
        *path = strdup("");
        return *path ? 0 : -ENOMEM;
    }
    struct node_table *t = fs->nodes;
    int rc = -ENOENT;
    pthread_mutex_lock(&t->lock);
    struct node *n = node_find(t, id);
    if (n) {
        *kind = n->kind;
        *path = strdup(n->path);
        if (content) {
            *content = n->content;
            content->view = NULL; /* the node's own: see node_view() */
            content->snapshot = NULL;
        }
        rc = *path ? 0 : -ENOMEM;
    }
    pthread_mutex_unlock(&t->lock);
    return rc;
}

static uint64_t node_id_for(const hapi_fs *fs, const struct stat *st);

/*
 * The timeout for names and attributes in directory dir: WATCHED_TIMEOUT if
 * watch.c watches it, else ENTRY_TIMEOUT; *changes is how many changes have
 * been seen in it, so that a lookup can tell whether one came while it looked
 * (watched_timeout()).
 */
static double dir_timeout(hapi_fs *fs, uint64_t dir, uint64_t *changes)
{
    struct node_table *t = fs->nodes;
    double timeout = ENTRY_TIMEOUT;
    *changes = 0;
    pthread_mutex_lock(&t->lock);
    struct node *n = node_find(t, dir);
    if (n) {
        if (n->wd >= 0)
            timeout = WATCHED_TIMEOUT;
        *changes = n->changes;
    }
    pthread_mutex_unlock(&t->lock);
    return timeout;
}

/* The timeout node id was given at its last lookup (ATTR_TIMEOUT if unknown). */
static double node_timeout(hapi_fs *fs, uint64_t id)
{
    struct node_table *t = fs->nodes;
    double timeout = ATTR_TIMEOUT;
    pthread_mutex_lock(&t->lock);
    struct node *n = node_find(t, id);
    if (n && n->timeout > 0)
        timeout = n->timeout;
    pthread_mutex_unlock(&t->lock);
    return timeout;
}

/*
 * The timeout for what a lookup or listing in dir found, given dir_timeout()'s
 * before it looked: none if a change was seen in dir meanwhile (its notice to
 * the kernel may have come before our reply, which would then be trusted with
 * what it found before the change: the next open looks it up again), and
 * ENTRY_TIMEOUT if dir is no longer watched.
 */
static double watched_timeout(hapi_fs *fs, uint64_t dir, double timeout, uint64_t changes)
{
    uint64_t now;
    double t2 = dir_timeout(fs, dir, &now);
    if (timeout != WATCHED_TIMEOUT || t2 != WATCHED_TIMEOUT)
        return ENTRY_TIMEOUT;
    return now == changes ? timeout : 0;
}

/*
 * Watches directory node id (source path path), if it is not watched yet and
 * can be. The watch is added under the table's lock, as node_unref() removes
 * it: inotify gives a directory watched twice the same watch, so one added
 * outside it could be removed by the forget of an older node of the directory
 * while a newer one took it as its own, and nothing would tell it of changes.
 */
static void watch_dir(hapi_fs *fs, uint64_t id, const char *path)
{
    struct node_table *t = fs->nodes;
    int fd = hapi_source_open_beneath(fs->source, path, O_PATH | O_DIRECTORY);
    int wd = fd;
    pthread_mutex_lock(&t->lock);
    struct node *n = node_find(t, id);
    if (n && n->wd == NO_WATCH) {
        if (fd >= 0)
            wd = hapi_watch_add(t->watch, fd, id);
        n->wd = wd >= 0 ? wd : CANNOT_WATCH;
    }
    pthread_mutex_unlock(&t->lock);
    if (fd >= 0)
        close(fd);
    if (wd < 0 && wd != -EREMOTE && wd != -ENOSPC && wd != -ENOENT)
        hapi_log(HAPI_LOG_DEBUG, "watch: %s: %s", *path ? path : ".", strerror(-wd));
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

/*
 * What one batch of watch.c's events changed, told to the kernel at its end
 * (on_change). Every notice of a name waits for the lookups in flight in its
 * directory (the kernel takes the directory's lock), hundreds of ms each on a
 * node busy computing features; so a batch is told once, and in the order
 * that ends wrong reads soonest: the pages of files changed in place (no
 * lock), then the .feat names, the packs, the names themselves, the pack
 * indexes, and last the directories' attributes and listings. Where the
 * kernel takes epoch notices, the watchdog (struct notice_watchdog) ends
 * every name at once when the names are late.
 */
struct changed_name {
    uint64_t dir;
    char *name;
    uint32_t mask;
};
struct change_batch {
    struct changed_name *names;
    size_t n, cap;
    uint64_t *inodes; /* files changed in place, by node id */
    size_t ninodes, capinodes;
    struct changed_dir { uint64_t dir; int members; } *dirs;
    size_t ndirs, capdirs;
};

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
static void on_change(void *arg, uint64_t dir, const char *name, uint32_t mask)
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

static void change_batch_free(struct change_batch *b)
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

/* ------------------------------------------------------- the source tree */

/* The id of a source file or directory. */
static uint64_t node_id_for(const hapi_fs *fs, const struct stat *st)
{
    if (st->st_dev == hapi_source_dev(fs->source) && st->st_ino < (1ull << 61))
        return (uint64_t)st->st_ino << 1;
    uint64_t key[2] = { (uint64_t)st->st_dev, (uint64_t)st->st_ino };
    uint64_t h = XXH3_64bits(key, sizeof(key)) & ((1ull << 61) - 1);
    return HASHED_BASE | h << 1;
}

/* The id of the .feat of image src at split: named by its bytes (see "Node ids"). */
static uint64_t feat_node_id(const struct stat *src, int split)
{
    hapi_source_id id;
    hapi_source_identity_of(src, &id);
    uint64_t key[6] = { (uint64_t)src->st_dev, id.ino,          id.size,
                        (uint64_t)id.mtime_ns, (uint64_t)id.ctime_ns, (uint64_t)split };
    uint64_t h = XXH3_64bits(key, sizeof(key)) & ((1ull << 61) - 1);
    return HASHED_BASE | h << 1 | 1;
}

/*
 * The id of directory st's pack (kind HAPI_NODE_PACK, named by its
 * snapshot's key) or index (HAPI_NODE_PACK_INDEX, key 0: read with
 * direct_io, made at each open).
 */
static uint64_t pack_node_id(const struct stat *st, int kind, uint64_t pack_key)
{
    uint64_t key[4] = { (uint64_t)st->st_dev, (uint64_t)st->st_ino, (uint64_t)kind, pack_key };
    uint64_t h = XXH3_64bits(key, sizeof(key)) & ((1ull << 61) - 1);
    return HASHED_BASE | h << 1;
}

/* Attributes the mount shows for a source file or directory: the source's, read-only. */
static void source_attr(const hapi_fs *fs, const struct stat *src, uint64_t id, struct stat *st)
{
    (void)fs;
    *st = *src;
    st->st_ino = id;
    st->st_mode &= ~(mode_t)0222;
}

/* ------------------------------------------------------- a remote mount */

/*
 * A compute-side mount (-o remote) names nodes by a hash of their path (the
 * sources' inode numbers are another machine's, and a network filesystem
 * may not keep them); the path is the mount's, .feat included. A .feat's id
 * also has the key of what its bytes are (hapi_remote_stat()): features of
 * another split or image version are another node, whose size and pages the
 * kernel keeps apart (one node by name alone showed one split's size with
 * another's bytes, the kernel's pages and size being those of before).
 */
static uint64_t remote_node_id(const char *path, int kind, uint64_t key)
{
    uint64_t h = XXH3_64bits_withSeed(path, strlen(path),
                                      kind == HAPI_NODE_REMOTE_FEAT ? key : 0) &
                 ((1ull << 61) - 1);
    return HASHED_BASE | h << 1 | (uint64_t)(kind == HAPI_NODE_REMOTE_FEAT);
}

static int remote_node_kind(int remote_kind)
{
    return remote_kind == HAPI_REMOTE_DIR    ? HAPI_NODE_DIR
           : remote_kind == HAPI_REMOTE_FEAT ? HAPI_NODE_REMOTE_FEAT
                                             : HAPI_NODE_FILE;
}

/* Attributes of path on a remote mount, its node kind and id. Returns 0 or a negative errno. */
static int remote_attr(hapi_fs *fs, const char *path, int *kind, struct stat *st)
{
    int rkind;
    int rc = hapi_remote_stat(fs->remote, path, &rkind, st);
    if (rc < 0)
        return rc;
    *kind = remote_node_kind(rkind);
    st->st_ino = remote_node_id(path, *kind, (uint64_t)st->st_ino);
    return 0;
}

/* What a remote .feat node is, for open and getattr to compare with (see "Node ids"). */
static void remote_feat_content(const struct stat *st, uint64_t parent, pid_t by,
                                struct node_content *c)
{
    memset(c, 0, sizeof(*c));
    c->attr = *st;
    c->parent = parent;
    c->looked_up_by[0] = by;
}

/*
 * The node of image src's .feat at view v: its id, its attributes (exact
 * size without computing anything, times of the source) and what it is.
 */
static void feat_node(const hapi_view *v, const struct stat *src, uint64_t parent, pid_t by,
                      struct stat *st, struct node_content *c)
{
    *st = *src;
    st->st_ino = feat_node_id(src, v->split);
    st->st_mode = S_IFREG | (src->st_mode & 0444);
    st->st_nlink = 1;
    st->st_size = (off_t)v->feat_size;
    st->st_blocks = (blkcnt_t)((v->feat_size + 511) / 512);
    memset(c, 0, sizeof(*c));
    c->split = v->split;
    hapi_source_identity_of(src, &c->id);
    c->attr = *st;
    c->parent = parent;
    c->looked_up_by[0] = by;
}

/*
 * Attributes of a directory's pack or index: exact size of the pack (no
 * computation; the index shows a bound, and is read with direct I/O like
 * a control file), readable as the directory is, times of the latest image;
 * its id (st_ino) and what it is (c, for a pack). With keep, a pack's
 * snapshot is taken and kept in c->snapshot (the caller's), as it is named.
 */
static int pack_attr(hapi_fs *fs, const char *dir, const struct stat *dir_st, int kind,
                     uint64_t parent, pid_t by, int keep, struct stat *st,
                     struct node_content *c)
{
    hapi_pack_info info;
    hapi_pack *snapshot = NULL;
    int rc = keep && kind == HAPI_NODE_PACK ? hapi_pack_open(fs->packs, dir, NULL, &snapshot)
                                            : hapi_pack_info_get(fs->packs, dir, &info);
    if (rc < 0)
        return rc;
    if (snapshot)
        hapi_pack_describe(snapshot, &info);
    *st = *dir_st;
    st->st_ino = pack_node_id(dir_st, kind, kind == HAPI_NODE_PACK ? info.key : 0);
    st->st_mode = S_IFREG | (dir_st->st_mode & 0444);
    st->st_nlink = 1;
    st->st_size = (off_t)(kind == HAPI_NODE_PACK ? info.size : info.index_bound);
    st->st_blocks = (blkcnt_t)((st->st_size + 511) / 512);
    st->st_mtim = info.mtime;
    st->st_ctim = info.ctime;
    memset(c, 0, sizeof(*c));
    c->pack_key = info.key;
    c->attr = *st;
    c->parent = parent;
    c->looked_up_by[0] = by;
    c->snapshot = snapshot;
    return 0;
}

static void ctl_dir_attr(const hapi_fs *fs, struct stat *st)
{
    memset(st, 0, sizeof(*st));
    st->st_ino = CTL_DIR_ID;
    st->st_mode = S_IFDIR | 0555;
    st->st_nlink = 2;
    st->st_mtim.tv_sec = (time_t)(fs->started_realtime);
    st->st_ctim = st->st_atim = st->st_mtim;
}

static int ctl_index(const char *name)
{
    for (int i = 0; hapi_ctl_files[i]; i++)
        if (strcmp(name, hapi_ctl_files[i]) == 0)
            return i;
    return -1;
}

/* The index in hapi_ctl_files of a control file's node id, or -1. */
static int ctl_file_index(fuse_ino_t ino)
{
    uint64_t i = (ino & 0xffu) - 2; /* the bits above are a made file's serial (no_open) */
    if (ino == CTL_DIR_ID || (ino & 0xffu) < 2)
        return -1;
    for (uint64_t k = 0; hapi_ctl_files[k]; k++)
        if (k == i)
            return (int)i;
    return -1;
}

/*
 * A control file's content is made when it is opened and read with direct
 * I/O, so a stat must not render it (a policy) or wait for it (a profile).
 * Its size is the bound HAPI_CTL_SIZE_MAX, not 0 as in procfs: a reader
 * through sshfs or NFS trusts the size and would read nothing. Reads end at
 * the content's end; the kernel then takes that as the size.
 */
static void ctl_file_attr(hapi_fs *fs, int index, struct stat *st)
{
    if (strcmp(hapi_ctl_files[index], HAPI_CTL_MODEL) == 0) {
        /* the model archive itself, for the compute tier's remaining stages: readable as
           the model file is (its owner, group and read bits) */
        struct stat m;
        memset(st, 0, sizeof(*st));
        st->st_mode = 0444;
        if (fs->model_fd >= 0 && fstat(fs->model_fd, &m) == 0)
            *st = m;
        st->st_ino = CTL_FILE_ID(index);
        st->st_mode = S_IFREG | (st->st_mode & 0444);
        st->st_nlink = 1;
        return;
    }
    /* owned by the mount's owner; ctl writable by it and by ctl_group */
    memset(st, 0, sizeof(*st));
    st->st_ino = CTL_FILE_ID(index);
    st->st_uid = getuid();
    st->st_gid = fs->opt->ctl_gid != (gid_t)-1 ? fs->opt->ctl_gid : getgid();
    st->st_mode = S_IFREG | (strcmp(hapi_ctl_files[index], HAPI_CTL_WRITABLE) != 0 ? 0444
                             : fs->opt->ctl_gid != (gid_t)-1                       ? 0664
                                                                                    : 0644);
    st->st_nlink = 1;
    st->st_size = HAPI_CTL_SIZE_MAX;
    st->st_mtim.tv_sec = time(NULL);
    st->st_ctim = st->st_atim = st->st_mtim;
}

/*
 * Maps a module code to the errno the kernel gets; only this file does that.
 * Every hapifs code (an undecodable image, a model failure, even running out
 * of memory inside the model) is EIO on the file: the log says the rest.
 */
int hapi_fs_errno(int code)
{
    if (code >= 0)
        return 0;
    if (code > HAPI_ERRNO_BASE)
        return -code;
    return EIO;
}

/* ----------------------------------------------------------- operations */

/* Without opens (no_open): see that section, below the opens. */
static void ctl_lookup_no_open(fuse_req_t req, hapi_fs *fs, int i);
static int ctl_attr_no_open(hapi_fs *fs, fuse_ino_t ino, struct stat *st);
static int node_set_text(hapi_fs *fs, uint64_t id, hapi_ctl_text *text, uint64_t *serial);
static hapi_ctl_text *node_text(hapi_fs *fs, uint64_t id, uint64_t *serial);
static void made_attr(const hapi_fs *fs, struct stat *st, size_t len, uint64_t version);
static void read_node(fuse_req_t req, hapi_fs *fs, fuse_ino_t ino, size_t size, off_t off);

const char *const hapi_fs_request_names[HAPI_REQ_COUNT] = {
    "lookup", "forget", "getattr", "opendir", "readdir", "releasedir", "open", "read",
    "release", "statfs", "other",
};

/* Counts a request of type t (stats: requests). */
#define COUNT(req, t) \
    atomic_fetch_add_explicit(&((hapi_fs *)fuse_req_userdata(req))->requests.n[t], 1, \
                              memory_order_relaxed)

static void op_init(void *userdata, struct fuse_conn_info *conn)
{
    hapi_fs *fs = userdata;
    /* The kernel drops cached pages of a file whose size or mtime changed. */
    if (conn->capable & FUSE_CAP_AUTO_INVAL_DATA)
        conn->want |= FUSE_CAP_AUTO_INVAL_DATA;
    /*
     * Not with io_uring: libfuse 3.14 splices a reply straight to /dev/fuse
     * whatever the custom io, and a ring request's reply must go to its entry.
     */
    if ((conn->capable & FUSE_CAP_SPLICE_WRITE) && !fs->uring)
        conn->want |= FUSE_CAP_SPLICE_WRITE;
    else
        conn->want &= ~(unsigned)(FUSE_CAP_SPLICE_WRITE | FUSE_CAP_SPLICE_MOVE);
    /* Many DataLoader workers read at once: let the kernel keep many requests in flight. */
    conn->max_background = 256;
    conn->congestion_threshold = 192;
    /*
     * Not without opens: the kernel would then truncate a .feat's pages and size on
     * open(O_TRUNC) by root without asking; instead a truncation comes as a setattr, refused.
     */
    if ((conn->capable & FUSE_CAP_ATOMIC_O_TRUNC) && !fs->no_open)
        conn->want |= FUSE_CAP_ATOMIC_O_TRUNC;
    if ((conn->capable & FUSE_CAP_NO_OPEN_SUPPORT) && fs->no_open)
        conn->want |= FUSE_CAP_NO_OPEN_SUPPORT;
    hapi_uring_initialized(fs->uring);
    if (fs->remote)
        hapi_log(HAPI_LOG_INFO, "mounted %s on %s (remote)", fs->opt->source,
                 fs->opt->mountpoint);
    else
        hapi_log(HAPI_LOG_INFO, "mounted %s on %s (model %s)%s", fs->opt->source,
                 fs->opt->mountpoint, fs->opt->model,
                 fs->no_open ? "; the kernel opens files without asking (no_open)" : "");
}

/*
 * Resolves name in directory parent_path for thread by; fills e, and c for a
 * .feat or pack (*has_content set); returns 0 or a negative errno.
 */
static int resolve(hapi_fs *fs, uint64_t parent, const char *parent_path, const char *name,
                   pid_t by, struct fuse_entry_param *e, int *kind, char **path,
                   struct node_content *c, int *has_content)
{
    struct stat src;
    int rc;

    memset(e, 0, sizeof(*e));
    e->attr_timeout = ATTR_TIMEOUT;
    e->entry_timeout = ENTRY_TIMEOUT;
    *path = NULL;
    *has_content = 0;

    if (parent == FUSE_ROOT_ID && strcmp(name, ".hapifs") == 0) {
        *kind = HAPI_NODE_CTL_DIR;
        e->ino = CTL_DIR_ID;
        ctl_dir_attr(fs, &e->attr);
        return 0;
    }
    if (strlen(name) > NAME_MAX)
        return -ENAMETOOLONG;
    if (fs->remote) {
        char *child = hapi_path_join(parent_path, name);
        if (!child)
            return -ENOMEM;
        if ((rc = remote_attr(fs, child, kind, &e->attr)) < 0) {
            free(child);
            return rc;
        }
        e->ino = e->attr.st_ino;
        *path = child;
        if (*kind == HAPI_NODE_REMOTE_FEAT) {
            remote_feat_content(&e->attr, parent, by, c);
            *has_content = 1;
        }
        return 0;
    }
    int pack = strcmp(name, HAPI_PACK_NAME) == 0 ? HAPI_NODE_PACK
               : strcmp(name, HAPI_PACK_INDEX_NAME) == 0 ? HAPI_NODE_PACK_INDEX : 0;
    if (pack) {
        /* Not listed, reachable by name; it shadows a source file of that name. */
        if ((rc = hapi_source_stat(fs->source, parent_path, &src)) < 0)
            return rc;
        /* without opens, what the lookup names is what its reads get (see "without opens") */
        if ((rc = pack_attr(fs, parent_path, &src, pack, parent, by, fs->no_open, &e->attr,
                            c)) < 0)
            return rc;
        e->ino = e->attr.st_ino;
        *kind = pack;
        *has_content = pack == HAPI_NODE_PACK;
        if ((*path = strdup(parent_path)))
            return 0;
        hapi_pack_close(c->snapshot);
        c->snapshot = NULL;
        return -ENOMEM;
    }

    size_t stem = hapi_feat_stem_len(name);
    if (stem) {
        char *image_name = strndup(name, stem);
        char *image = image_name ? hapi_path_join(parent_path, image_name) : NULL;
        free(image_name);
        if (!image)
            return -ENOMEM;
        rc = hapi_source_stat(fs->source, image, &src);
        if (rc == 0 && S_ISREG(src.st_mode)) {
            /* The current split's size (waits while the policy is still choosing it). */
            hapi_view *v = hapi_views_get(fs->views);
            if (!v) {
                free(image);
                return -ENODEV;
            }
            *kind = HAPI_NODE_FEAT;
            feat_node(v, &src, parent, by, &e->attr, c);
            c->view = v; /* the caller's reference */
            e->ino = e->attr.st_ino;
            *has_content = 1;
            *path = image;
            return 0;
        }
        if (rc == -ENOENT)
            hapi_serve_collect(fs->serve, image); /* deleted: its features go too */
        free(image);
        /* Not a feature of an image: maybe a real file of that name. */
    }

    char *child = hapi_path_join(parent_path, name);
    if (!child)
        return -ENOMEM;
    rc = hapi_source_stat(fs->source, child, &src);
    if (rc < 0)
        goto fail;
    if (S_ISDIR(src.st_mode)) {
        *kind = HAPI_NODE_DIR;
    } else if (S_ISREG(src.st_mode) && (fs->opt->show_raw || !hapi_image_name_is_image(name))) {
        *kind = HAPI_NODE_FILE;
    } else {
        rc = -ENOENT; /* hidden images, devices, sockets, fifos */
        goto fail;
    }
    e->ino = node_id_for(fs, &src);
    source_attr(fs, &src, e->ino, &e->attr);
    *path = child;
    return 0;
fail:
    free(child);
    return rc;
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    COUNT(req, HAPI_REQ_LOOKUP);
    hapi_fs *fs = fuse_req_userdata(req);
    struct fuse_entry_param e;
    struct node_content c = { 0 };
    char *parent_path = NULL, *path = NULL;
    int kind, rc;

    if (parent == CTL_DIR_ID) {
        int i = ctl_index(name);
        if (i < 0) {
            fuse_reply_err(req, ENOENT);
            return;
        }
        if (fs->no_open) {
            ctl_lookup_no_open(req, fs, i);
            return;
        }
        memset(&e, 0, sizeof(e));
        e.ino = CTL_FILE_ID(i);
        ctl_file_attr(fs, i, &e.attr);
        fuse_reply_entry(req, &e);
        return;
    }
    if ((rc = node_get(fs, parent, &kind, &parent_path, NULL)) < 0)
        goto out;
    if (kind != HAPI_NODE_DIR) {
        rc = -ENOTDIR;
        goto out;
    }
    int has_content;
    uint64_t changes, splits = atomic_load(&fs->split_changes);
    double timeout = fs->nodes->watch ? dir_timeout(fs, parent, &changes) : ENTRY_TIMEOUT;
    if ((rc = resolve(fs, parent, parent_path, name, fuse_req_ctx(req)->pid, &e, &kind, &path,
                      &c, &has_content)) < 0)
        goto out;
    if (path && timeout == WATCHED_TIMEOUT)
        e.entry_timeout = e.attr_timeout = watched_timeout(fs, parent, timeout, changes);
    e.entry_timeout = name_timeout(fs, kind, e.entry_timeout);
    /*
     * A split change while it looked: its node may be of the old split, and the kernel may
     * have been told to forget names before this one reached it. Without opens nothing
     * else would catch that: it is looked up again at its next open.
     */
    if (has_content && atomic_load(&fs->split_changes) != splits)
        e.entry_timeout = e.attr_timeout = 0;
    if (!fs->no_open) { /* an open file holds its view: the node need not */
        hapi_view_put(c.view);
        c.view = NULL;
    }
    if (path && (rc = node_ref(fs->nodes, e.ino, kind, path, has_content ? &c : NULL, parent,
                               e.attr_timeout)) < 0)
        goto out;
    if (rc == 1)
        watch_dir(fs, e.ino, path);
    rc = 0;
    if (kind == HAPI_NODE_PACK_INDEX && fs->no_open) {
        /* made now, a node of its own (see "without opens"): not the one node_ref made */
        node_unref(fs->nodes, e.ino, 1);
        uint64_t key[2] = { e.ino, atomic_fetch_add(&fs->made_serial, 1) + 1 };
        e.ino = HASHED_BASE | (XXH3_64bits(key, sizeof(key)) & ((1ull << 61) - 1)) << 1;
        if ((rc = node_ref(fs->nodes, e.ino, kind, path, NULL, parent, 0)) < 0)
            goto out;
        rc = 0;
        char *text = NULL;
        size_t len = 0;
        uint64_t serial = 0;
        hapi_ctl_text *t = NULL;
        if ((rc = hapi_pack_index(fs->packs, path, &text, &len)) == 0 &&
            !(t = hapi_ctl_text_new(text, len)))
            rc = -ENOMEM;
        free(text);
        if (rc == 0)
            rc = node_set_text(fs, e.ino, t, &serial);
        if (rc < 0) {
            node_unref(fs->nodes, e.ino, 1);
            goto out;
        }
        made_attr(fs, &e.attr, len, serial);
        e.entry_timeout = e.attr_timeout = 0;
    }
    fuse_reply_entry(req, &e);
out:
    hapi_view_put(c.view);
    if (rc < 0)
        fuse_reply_err(req, -rc);
    free(parent_path);
    free(path);
}

static void op_forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup)
{
    COUNT(req, HAPI_REQ_FORGET);
    hapi_fs *fs = fuse_req_userdata(req);
    if (ino != FUSE_ROOT_ID && !(ino & CTL_BASE))
        node_unref(fs->nodes, ino, nlookup);
    else if ((ino & CTL_BASE) && CTL_SERIAL(ino) != 0)
        node_unref(fs->nodes, ino, nlookup); /* a made control file (no_open) */
    fuse_reply_none(req);
}

static void op_forget_multi(fuse_req_t req, size_t count, struct fuse_forget_data *forgets)
{
    COUNT(req, HAPI_REQ_FORGET);
    hapi_fs *fs = fuse_req_userdata(req);
    for (size_t i = 0; i < count; i++)
        if (forgets[i].ino != FUSE_ROOT_ID && !(forgets[i].ino & CTL_BASE))
            node_unref(fs->nodes, forgets[i].ino, forgets[i].nlookup);
        else if ((forgets[i].ino & CTL_BASE) && CTL_SERIAL(forgets[i].ino) != 0)
            node_unref(fs->nodes, forgets[i].ino, forgets[i].nlookup);
    fuse_reply_none(req);
}

/*
 * Attributes of a .feat or pack node: its size and times are those of its
 * bytes, as the lookup that made the node gave them (they never change); its
 * owner and mode are its source's now (src: the image, or the pack's
 * directory), so that a chmod applies within ATTR_TIMEOUT.
 */
static void content_attr(const struct node_content *c, const struct stat *src, struct stat *st)
{
    *st = c->attr;
    st->st_mode = S_IFREG | (src->st_mode & 0444);
    st->st_uid = src->st_uid;
    st->st_gid = src->st_gid;
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    COUNT(req, HAPI_REQ_GETATTR);
    hapi_fs *fs = fuse_req_userdata(req);
    struct stat st, src;
    char *path = NULL;
    int kind, rc;
    (void)fi;

    if (ino == CTL_DIR_ID) {
        ctl_dir_attr(fs, &st);
        fuse_reply_attr(req, &st, ATTR_TIMEOUT);
        return;
    }
    if (ino & CTL_BASE) {
        int i = ctl_file_index(ino);
        if (i < 0) {
            fuse_reply_err(req, ENOENT);
            return;
        }
        if (fs->no_open) {
            if ((rc = ctl_attr_no_open(fs, ino, &st)) < 0)
                fuse_reply_err(req, -rc);
            else
                fuse_reply_attr(req, &st, 0);
            return;
        }
        ctl_file_attr(fs, i, &st);
        fuse_reply_attr(req, &st, 0);
        return;
    }
    if (fs->remote) {
        struct node_content c;
        if ((rc = node_get(fs, ino, &kind, &path, &c)) == 0 &&
            (rc = remote_attr(fs, path, &kind, &st)) == 0 && st.st_ino != ino &&
            kind == HAPI_NODE_REMOTE_FEAT)
            st = c.attr; /* the node is of other bytes than the name's now: its own size */
        st.st_ino = ino;
        if (rc < 0)
            fuse_reply_err(req, -rc);
        else
            fuse_reply_attr(req, &st, ATTR_TIMEOUT);
        free(path);
        return;
    }
    struct node_content c;
    if ((rc = node_get(fs, ino, &kind, &path, &c)) < 0 ||
        (rc = hapi_source_stat(fs->source, path, &src)) < 0) {
        if (rc == -ENOENT && path && kind == HAPI_NODE_FEAT)
            hapi_serve_collect(fs->serve, path);
        fuse_reply_err(req, -rc);
        free(path);
        return;
    }
    if (kind == HAPI_NODE_FEAT || kind == HAPI_NODE_PACK) {
        content_attr(&c, &src, &st);
    } else if (kind == HAPI_NODE_PACK_INDEX) {
        rc = pack_attr(fs, path, &src, kind, 0, 0, 0, &st, &c);
        uint64_t serial;
        hapi_ctl_text *t = fs->no_open && rc == 0 ? node_text(fs, ino, &serial) : NULL;
        if (t) { /* what its lookup made (no_open) */
            made_attr(fs, &st, t->len, serial);
            st.st_ino = ino;
        }
        hapi_ctl_text_put(t);
    } else
        source_attr(fs, &src, ino, &st);
    if (rc < 0)
        fuse_reply_err(req, -rc);
    else
        fuse_reply_attr(req, &st, kind != HAPI_NODE_PACK_INDEX ? node_timeout(fs, ino)
                                  : fs->no_open                 ? 0
                                                                : ATTR_TIMEOUT);
    free(path);
}

/* A directory listing, read whole at opendir so offsets stay valid across readdir calls. */
struct dir_entry {
    char *name;
    int kind;           /* enum hapi_node_kind */
    char *path;         /* the node's source path; NULL for "." and ".." */
    struct stat attr;   /* as the mount shows it; st_ino is the node id */
    int split;          /* a .feat's: what its node is (struct node_content) */
    hapi_source_id id;
};

/* Links a handle the kernel is about to hold into fs (see struct hapi_fs_handle). */
static void handle_link(hapi_fs *fs, struct hapi_fs_handle *l, int dir)
{
    l->dir = dir;
    pthread_mutex_lock(&fs->handles_lock);
    l->next = fs->handles.next;
    l->prev = &fs->handles;
    l->next->prev = l;
    fs->handles.next = l;
    pthread_mutex_unlock(&fs->handles_lock);
}

static void handle_unlink(hapi_fs *fs, struct hapi_fs_handle *l)
{
    pthread_mutex_lock(&fs->handles_lock);
    l->prev->next = l->next;
    l->next->prev = l->prev;
    l->prev = l->next = NULL;
    pthread_mutex_unlock(&fs->handles_lock);
}

struct dir_handle {
    struct hapi_fs_handle link; /* first: see handle_link() */
    size_t count, cap;
    uint64_t self;      /* the directory's node id */
    struct dir_entry *entries;
    char *path;         /* a source directory not listed yet (at its first readdir) */
    double timeout;     /* dir_timeout() before the listing, and its changes */
    uint64_t changes;
    uint64_t splits;    /* split_changes before the listing: its .feat's split is old if not */
    hapi_view *view;    /* the view the listing's .feat are of (a reference), or NULL */
};

/* Adds name + suffix; path (may be NULL) is copied; c (may be NULL) is a .feat's content. */
static int dir_add(struct dir_handle *d, const char *name, const char *suffix, int kind,
                   const char *path, const struct stat *attr, const struct node_content *c)
{
    if (d->count == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 64;
        struct dir_entry *e = realloc(d->entries, cap * sizeof(*e));
        if (!e)
            return -ENOMEM;
        d->entries = e;
        d->cap = cap;
    }
    char *n = NULL, *p = NULL;
    if (asprintf(&n, "%s%s", name, suffix) < 0)
        return -ENOMEM;
    if (path && !(p = strdup(path))) {
        free(n);
        return -ENOMEM;
    }
    d->entries[d->count++] = (struct dir_entry){ n, kind, p, *attr, c ? c->split : 0,
                                                 c ? c->id : (hapi_source_id){ 0 } };
    return 0;
}

/* An entry for "." / ".." or a control file: only its id and type matter. */
static int dir_add_bare(struct dir_handle *d, const char *name, uint64_t ino, mode_t type)
{
    struct stat st = { .st_ino = ino, .st_mode = type };
    return dir_add(d, name, "", -1, NULL, &st, NULL);
}

static void dir_free(struct dir_handle *d)
{
    if (!d)
        return;
    for (size_t i = 0; i < d->count; i++) {
        free(d->entries[i].name);
        free(d->entries[i].path);
    }
    free(d->entries);
    free(d->path);
    hapi_view_put(d->view);
    free(d);
}

struct list_walk {
    hapi_fs *fs;
    struct dir_handle *d;
    hapi_view *view;    /* the split the listing's .feat are of: taken at the first image */
};

/* One entry of a source directory as the mount shows it (a symlink as what it leads to). */
static int list_one(const hapi_source_entry *e, void *arg)
{
    struct list_walk *w = arg;
    hapi_fs *fs = w->fs;
    struct stat st;
    if (!strchr(e->path, '/') && strcmp(e->name, ".hapifs") == 0)
        return 0; /* shadowed by the control directory */
    if (S_ISDIR(e->st->st_mode)) {
        source_attr(fs, e->st, node_id_for(fs, e->st), &st);
        return dir_add(w->d, e->name, "", HAPI_NODE_DIR, e->path, &st, NULL);
    }
    if (!e->is_image) {
        source_attr(fs, e->st, node_id_for(fs, e->st), &st);
        return dir_add(w->d, e->name, "", HAPI_NODE_FILE, e->path, &st, NULL);
    }
    /* Every .feat of one listing at one split (waits while the policy is still choosing it). */
    if (!w->view && !(w->view = hapi_views_get(fs->views)))
        return -ENODEV;
    struct node_content c;
    feat_node(w->view, e->st, w->d->self, 0, &st, &c);
    int rc = dir_add(w->d, e->name, ".feat", HAPI_NODE_FEAT, e->path, &st, &c);
    if (rc == 0 && fs->opt->show_raw) {
        source_attr(fs, e->st, node_id_for(fs, e->st), &st);
        rc = dir_add(w->d, e->name, "", HAPI_NODE_FILE, e->path, &st, NULL);
    }
    return rc;
}

struct remote_list {
    struct dir_handle *d;
    const char *dir;
};

/* One entry of a remote mount's directory. */
static int remote_list_one(void *arg, const char *name, int kind, const struct stat *st)
{
    struct remote_list *w = arg;
    char *path = hapi_path_join(w->dir, name);
    if (!path)
        return -ENOMEM;
    struct stat attr = *st;
    int node_kind = remote_node_kind(kind);
    attr.st_ino = remote_node_id(path, node_kind, (uint64_t)st->st_ino);
    struct node_content c;
    if (node_kind == HAPI_NODE_REMOTE_FEAT)
        remote_feat_content(&attr, w->d->self, 0, &c);
    int rc = dir_add(w->d, name, "", node_kind, path, &attr,
                     node_kind == HAPI_NODE_REMOTE_FEAT ? &c : NULL);
    free(path);
    return rc;
}

/* Lists the source directory path as the mount shows it. */
static int list_source_dir(hapi_fs *fs, const char *path, uint64_t self, struct dir_handle *d)
{
    struct stat st;
    d->self = self;
    if (fs->remote) {
        struct remote_list w = { d, path };
        int rc = dir_add_bare(d, ".", self, S_IFDIR);
        if (rc == 0)
            rc = dir_add_bare(d, "..", FUSE_ROOT_ID, S_IFDIR);
        return rc == 0 ? hapi_remote_list(fs->remote, path, remote_list_one, &w) : rc;
    }
    int rc = hapi_source_stat(fs->source, path, &st);
    if (rc == 0 && !S_ISDIR(st.st_mode))
        rc = -ENOTDIR;
    if (rc == 0)
        rc = dir_add_bare(d, ".", self, S_IFDIR);
    if (rc == 0)
        rc = dir_add_bare(d, "..", FUSE_ROOT_ID, S_IFDIR);
    struct list_walk w = { fs, d, NULL };
    if (rc == 0)
        rc = hapi_source_walk(fs->source, path, HAPI_WALK_STAT | HAPI_WALK_ALL, NULL, list_one,
                              &w);
    d->view = w.view; /* the listing's .feat are of its split (no_open: their nodes keep it) */
    return rc;
}

static void op_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    COUNT(req, HAPI_REQ_OPENDIR);
    hapi_fs *fs = fuse_req_userdata(req);
    struct dir_handle *d = calloc(1, sizeof(*d));
    char *path = NULL;
    int kind, rc;

    if (!d) {
        rc = -ENOMEM;
        goto fail;
    }
    if (ino == CTL_DIR_ID) {
        rc = dir_add_bare(d, ".", CTL_DIR_ID, S_IFDIR);
        if (rc == 0)
            rc = dir_add_bare(d, "..", FUSE_ROOT_ID, S_IFDIR);
        for (int i = 0; rc == 0 && hapi_ctl_files[i]; i++) {
            struct stat st;
            ctl_file_attr(fs, i, &st);
            rc = dir_add(d, hapi_ctl_files[i], "", HAPI_NODE_CTL_FILE, NULL, &st, NULL);
        }
        if (rc < 0)
            goto fail;
    } else {
        if ((rc = node_get(fs, ino, &kind, &path, NULL)) < 0)
            goto fail;
        if (kind != HAPI_NODE_DIR) {
            rc = -ENOTDIR;
            goto fail;
        }
        d->self = ino;
        d->splits = atomic_load(&fs->split_changes);
        d->timeout = fs->nodes->watch ? dir_timeout(fs, ino, &d->changes) : ENTRY_TIMEOUT;
        if (d->timeout == WATCHED_TIMEOUT) {
            /*
             * The kernel keeps the listing (on_change tells it when to forget it): listed at the
             * first readdir, which does not come while the kernel's copy is whole.
             */
            fi->cache_readdir = 1;
            fi->keep_cache = 1;
            d->path = path;
            path = NULL;
        } else if ((rc = list_source_dir(fs, path, ino, d)) < 0) {
            goto fail;
        }
    }
    free(path);
    handle_link(fs, &d->link, 1);
    fi->fh = (uint64_t)(uintptr_t)d;
    fuse_reply_open(req, fi);
    return;
fail:
    free(path);
    dir_free(d);
    fuse_reply_err(req, -rc);
}

/*
 * readdir and readdirplus. With plus, names come with their attributes, so a
 * listing is not followed by a lookup per file; each entry returned (but "."
 * and "..") then counts as a lookup, so it is entered in the node table
 * first, and taken out again if it does not fit in the reply.
 */
static void do_readdir(fuse_req_t req, size_t size, off_t off, struct fuse_file_info *fi,
                       int plus)
{
    hapi_fs *fs = fuse_req_userdata(req);
    struct dir_handle *d = (struct dir_handle *)(uintptr_t)fi->fh;
    /* The kernel sends one readdir of a handle at a time (its file position lock). */
    if (d->path) {
        int rc = list_source_dir(fs, d->path, d->self, d);
        free(d->path);
        d->path = NULL;
        if (rc < 0) {
            fuse_reply_err(req, -rc);
            return;
        }
    }
    double timeout = d->timeout == WATCHED_TIMEOUT
                         ? watched_timeout(fs, d->self, d->timeout, d->changes)
                         : ENTRY_TIMEOUT;
    int old_split = atomic_load(&fs->split_changes) != d->splits; /* see op_lookup */
    char *buf = malloc(size);
    if (!buf) {
        fuse_reply_err(req, ENOMEM);
        return;
    }
    size_t used = 0;
    for (size_t i = (size_t)off; i < d->count; i++) {
        struct dir_entry *de = &d->entries[i];
        size_t need;
        if (!plus) {
            need = fuse_add_direntry(req, buf + used, size - used, de->name, &de->attr,
                                     (off_t)(i + 1));
            if (need > size - used)
                break;
            used += need;
            continue;
        }
        struct fuse_entry_param e = { 0 };
        e.attr = de->attr;
        int counted = 0;
        /* no_open: a control file's node is made by its lookup (see "without opens") */
        if (de->kind >= 0 && !(de->kind == HAPI_NODE_CTL_FILE && fs->no_open)) {
            e.ino = de->attr.st_ino;
            int none = de->kind == HAPI_NODE_CTL_FILE || (de->kind == HAPI_NODE_FEAT && old_split);
            e.attr_timeout = e.entry_timeout = none ? 0 : timeout;
            e.entry_timeout = name_timeout(fs, de->kind, e.entry_timeout);
            if (de->path) {
                struct node_content c = {
                    .split = de->split, .id = de->id, .attr = de->attr, .parent = d->self,
                    .looked_up_by = { fuse_req_ctx(req)->pid },
                    .view = fs->no_open ? d->view : NULL, /* node_ref takes its own */
                };
                int rc = node_ref(fs->nodes, e.ino, de->kind, de->path,
                                  de->kind == HAPI_NODE_FEAT ? &c : NULL, d->self, timeout);
                if (rc < 0)
                    break;
                if (rc == 1)
                    watch_dir(fs, e.ino, de->path);
                counted = 1;
            }
        }
        need = fuse_add_direntry_plus(req, buf + used, size - used, de->name, &e, (off_t)(i + 1));
        if (need > size - used) {
            if (counted)
                node_unref(fs->nodes, e.ino, 1);
            break;
        }
        used += need;
    }
    fuse_reply_buf(req, buf, used);
    free(buf);
}

static void op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                       struct fuse_file_info *fi)
{
    COUNT(req, HAPI_REQ_READDIR);
    (void)ino;
    do_readdir(req, size, off, fi, 0);
}

static void op_readdirplus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                           struct fuse_file_info *fi)
{
    COUNT(req, HAPI_REQ_READDIR);
    (void)ino;
    do_readdir(req, size, off, fi, 1);
}

static void op_releasedir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    COUNT(req, HAPI_REQ_RELEASEDIR);
    struct dir_handle *d = (struct dir_handle *)(uintptr_t)fi->fh;
    (void)ino;
    handle_unlink(fuse_req_userdata(req), &d->link);
    dir_free(d);
    fuse_reply_err(req, 0);
}

/* An open file: a passthrough fd, a .feat's source, a pack, or a control file's content. */
struct open_file {
    struct hapi_fs_handle link; /* first: see handle_link() */
    int kind;
    int fd;
    hapi_pack *pack;       /* PACK: the directory's snapshot */
    char *path;            /* the source image (FEAT) */
    hapi_source_id id;     /* its identity when opened */
    hapi_view *view;       /* the split it was opened at (FEAT) */
    hapi_remote_feat *remote_feat; /* a remote mount's .feat, as its index was at open */
    off_t remote_size;     /* a remote mount's other file: its size at open (see read_remote) */
    /*
     * A control file's content, made at open; for ctl, replaced by the
     * outcome of each write ("ok" or "error: REASON"), so that the writer
     * reads why its command was refused. Under lock: a read takes a
     * reference and replies from it, even if the handle is released meanwhile.
     */
    pthread_mutex_t lock;
    hapi_ctl_text *text;
};

static void open_file_free(struct open_file *h)
{
    if (!h)
        return;
    if (h->fd >= 0)
        close(h->fd);
    free(h->path);
    hapi_ctl_text_put(h->text);
    hapi_view_put(h->view);
    hapi_pack_close(h->pack);
    hapi_remote_feat_close(h->remote_feat);
    pthread_mutex_destroy(&h->lock);
    free(h);
}

/* Frees the handles the kernel never released; no request runs any more. */
static void handles_free_all(hapi_fs *fs)
{
    size_t files = 0, dirs = 0;
    if (!fs->handles.next)
        return;
    while (fs->handles.next != &fs->handles) {
        struct hapi_fs_handle *l = fs->handles.next;
        handle_unlink(fs, l);
        if (l->dir) {
            dir_free((struct dir_handle *)l);
            dirs++;
        } else {
            open_file_free((struct open_file *)l);
            files++;
        }
    }
    if (files || dirs)
        hapi_log(HAPI_LOG_INFO, "stopped with %zu files and %zu directories still open", files,
                 dirs);
    pthread_mutex_destroy(&fs->handles_lock);
    fs->handles.next = fs->handles.prev = NULL;
}

/*
 * Who sent req, in *c; returns c, or NULL for root and the mount's owner, who
 * may do anything the mount does. The kernel has already checked the modes
 * that the attributes show (allow_other turns on default_permissions); this
 * is for what they cannot say. A caller whose groups cannot be read is taken
 * with its primary group only.
 */
static const hapi_cred *req_who(fuse_req_t req, hapi_cred *c)
{
    const struct fuse_ctx *ctx = fuse_req_ctx(req);
    if (ctx->uid == 0 || ctx->uid == getuid())
        return NULL;
    c->uid = ctx->uid;
    c->gid = ctx->gid;
    int n = hapi_cred_read_groups(ctx->pid, c->groups, HAPI_CRED_GROUPS);
    c->ngroups = n < 0 ? 0 : n > HAPI_CRED_GROUPS ? HAPI_CRED_GROUPS : n;
    return c;
}

/*
 * An open of a .feat or pack node whose bytes are no longer what the source
 * has (c: what the node is; see "Node ids"). Returns -ESTALE, so that
 * open(2) looks the name up again and opens the new node; or, for the
 * thread whose lookup returned this node (the source changed between its
 * lookup and its open, or again before open(2) tried once more), 0 with
 * direct_io set: the bytes of now, read past the kernel's pages and size of
 * this node, which stay right for it.
 */
static int other_bytes(fuse_req_t req, const struct node_content *c, struct fuse_file_info *fi)
{
    pid_t me = fuse_req_ctx(req)->pid;
    size_t i = 0;
    while (i < sizeof(c->looked_up_by) / sizeof(c->looked_up_by[0]) && c->looked_up_by[i] != me)
        i++;
    if (i == sizeof(c->looked_up_by) / sizeof(c->looked_up_by[0]))
        return -ESTALE;
    fi->direct_io = 1;
    fi->keep_cache = 0;
    return 0;
}

/* ---------------------------------------------------------- without opens */

/*
 * With no_open, every open answers ENOSYS: the kernel then opens every
 * regular file of the mount without asking (FUSE_CAP_NO_OPEN_SUPPORT), keeps
 * its pages (keep_cache), and sends no release; reads and writes come with
 * fh 0 and name the node. So what an open used to fix is fixed by the node:
 *   - a .feat: its split and its image's identity (struct node_content), and
 *     the view of its split, which the node keeps: a file read after a split
 *     change is still computed at its split;
 *   - a pack: its snapshot, opened at the node's first read (its key must be
 *     the node's); for a user other than root and the owner a snapshot is
 *     taken for each read, with that user's check;
 *   - a pack's index and the control files: made at each lookup, which the
 *     kernel sends at each open(2) since they are given no timeout, as a node
 *     of its own (a unique id): so every open(2) has its own content, made
 *     for its user, and pages, as with an open file; the kernel forgets such
 *     a node once its name is looked up again and no file holds it;
 *   - a write to ctl: its outcome replaces what that node shows (the writer's
 *     open file reads it back);
 *   - a plain file: opened for each read.
 * Freshness comes from watch.c: a name whose bytes changed is forgotten by
 * the kernel as the change is seen, so the next open(2) looks it up again.
 */

/* Attributes of made content: its size, and an mtime per version (the kernel drops older pages). */
static void made_attr(const hapi_fs *fs, struct stat *st, size_t len, uint64_t version)
{
    st->st_size = (off_t)len;
    st->st_blocks = (blkcnt_t)((len + 511) / 512);
    st->st_mtim.tv_sec = fs->started_realtime + (time_t)(version / 1000000000u);
    st->st_mtim.tv_nsec = (long)(version % 1000000000u);
    st->st_ctim = st->st_mtim;
}

/* Looks up control file i for the caller (no_open): a node of its own, made now, for who it is. */
static void ctl_lookup_no_open(fuse_req_t req, hapi_fs *fs, int i)
{
    hapi_cred cred;
    const hapi_cred *who = req_who(req, &cred);
    struct fuse_entry_param e = { 0 };
    ctl_file_attr(fs, i, &e.attr);
    e.ino = CTL_FILE_ID(i);
    if (strcmp(hapi_ctl_files[i], HAPI_CTL_MODEL) != 0) {
        uint64_t version = 0;
        hapi_ctl_text *text = hapi_ctl_render(fs->ctl, hapi_ctl_files[i], who);
        if (!text) {
            fuse_reply_err(req, ENOMEM);
            return;
        }
        size_t len = text->len;
        e.ino = CTL_MADE_ID(atomic_fetch_add(&fs->made_serial, 1) + 1, i);
        if (node_ref(fs->nodes, e.ino, HAPI_NODE_CTL_FILE, "", NULL, CTL_DIR_ID, 0) < 0) {
            hapi_ctl_text_put(text);
            fuse_reply_err(req, ENOMEM);
            return;
        }
        node_set_text(fs, e.ino, text, &version); /* the node is there: it takes text */
        made_attr(fs, &e.attr, len, version);
    }
    e.attr.st_ino = e.ino;
    if (fuse_reply_entry(req, &e) < 0 && e.ino != CTL_FILE_ID(i))
        node_unref(fs->nodes, e.ino, 1);
}

/* Attributes of a control file's node (no_open): what its lookup made, or its last write. */
static int ctl_attr_no_open(hapi_fs *fs, fuse_ino_t ino, struct stat *st)
{
    int i = ctl_file_index(ino);
    if (i < 0)
        return -ENOENT;
    ctl_file_attr(fs, i, st);
    st->st_ino = ino;
    if (CTL_SERIAL(ino) == 0)
        return 0; /* the model, or a name as listed */
    uint64_t version;
    hapi_ctl_text *t = node_text(fs, ino, &version);
    if (!t)
        return -ENOENT;
    made_attr(fs, st, t->len, version);
    hapi_ctl_text_put(t);
    return 0;
}

static void reply_text(fuse_req_t req, const hapi_ctl_text *text, size_t size, off_t off)
{
    if ((size_t)off >= text->len)
        fuse_reply_buf(req, NULL, 0);
    else
        fuse_reply_buf(req, text->data + off,
                       text->len - (size_t)off < size ? text->len - (size_t)off : size);
}

/* Replies with bytes [off, off + size) of file descriptor fd (borrowed). */
static void reply_fd(fuse_req_t req, int fd, size_t size, off_t off)
{
    struct fuse_bufvec buf = FUSE_BUFVEC_INIT(size);
    buf.buf[0].flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK;
    buf.buf[0].fd = fd;
    buf.buf[0].pos = off;
    fuse_reply_data(req, &buf, FUSE_BUF_SPLICE_MOVE);
}

/*
 * A snapshot of directory dir now, for who (NULL: anyone), which must be the
 * one a node's key names: -ESTALE if the directory changed since the kernel
 * looked it up (no_open: no open(2) is there to look it up again). *out NULL
 * on failure.
 */
static int pack_open_keyed(hapi_fs *fs, const char *dir, const hapi_cred *who, uint64_t key,
                           hapi_pack **out)
{
    int rc = hapi_pack_open(fs->packs, dir, who, out);
    if (rc == 0 && hapi_pack_key(*out) != key) {
        hapi_pack_close(*out);
        *out = NULL;
        rc = -ESTALE;
    }
    return rc;
}

/*
 * The pack snapshot node id stands for (a reference): the one its lookup took
 * (node_ref()), or one opened now, which must have the node's key (-ESTALE if
 * not); or a code.
 */
static int node_pack_get(hapi_fs *fs, uint64_t id, const char *path, uint64_t key,
                         struct node_pack **out)
{
    struct node_table *t = fs->nodes;
    struct node *n;
    *out = NULL;
    pthread_mutex_lock(&t->lock);
    n = node_find(t, id);
    if (n && n->pack) {
        atomic_fetch_add(&n->pack->refs, 1);
        *out = n->pack;
    }
    pthread_mutex_unlock(&t->lock);
    if (*out)
        return 0;
    struct node_pack *p = calloc(1, sizeof(*p));
    if (!p)
        return -ENOMEM;
    atomic_init(&p->refs, 1);
    int rc = pack_open_keyed(fs, path, NULL, key, &p->pack);
    if (rc < 0) {
        node_pack_put(p);
        return rc;
    }
    pthread_mutex_lock(&t->lock);
    n = node_find(t, id);
    if (n && !n->pack) {
        atomic_fetch_add(&p->refs, 1);
        n->pack = p;
    } else if (n) {
        /* another read opened it meanwhile: use that one */
        node_pack_put(p);
        atomic_fetch_add(&n->pack->refs, 1);
        p = n->pack;
    }
    pthread_mutex_unlock(&t->lock);
    *out = p;
    return 0;
}

/*
 * What a made node (a control file or pack index, no_open) shows now: takes
 * text (put if the node is gone); *serial is its new version. Returns 0 or -ENOENT.
 */
static int node_set_text(hapi_fs *fs, uint64_t id, hapi_ctl_text *text, uint64_t *serial)
{
    struct node_table *t = fs->nodes;
    struct node *n;
    hapi_ctl_text *old = text;
    pthread_mutex_lock(&t->lock);
    n = node_find(t, id);
    if (n) {
        old = n->text;
        n->text = text;
        *serial = ++n->serial;
    }
    pthread_mutex_unlock(&t->lock);
    hapi_ctl_text_put(old);
    return n ? 0 : -ENOENT;
}

/* The view a .feat node keeps (a reference), or NULL. */
static hapi_view *node_view(hapi_fs *fs, uint64_t id)
{
    struct node_table *t = fs->nodes;
    struct node *n;
    hapi_view *v = NULL;
    pthread_mutex_lock(&t->lock);
    n = node_find(t, id);
    if (n && n->content.view) {
        v = n->content.view;
        hapi_view_ref(v);
    }
    pthread_mutex_unlock(&t->lock);
    return v;
}

static hapi_ctl_text *node_text(hapi_fs *fs, uint64_t id, uint64_t *serial)
{
    struct node_table *t = fs->nodes;
    struct node *n;
    hapi_ctl_text *text = NULL;
    pthread_mutex_lock(&t->lock);
    n = node_find(t, id);
    if (n && n->text) {
        text = hapi_ctl_text_ref(n->text);
        *serial = n->serial;
    }
    pthread_mutex_unlock(&t->lock);
    return text;
}

static void read_feat(fuse_req_t req, hapi_fs *fs, struct open_file *h, size_t size, off_t off);
static void read_pack(fuse_req_t req, struct open_file *h, size_t size, off_t off);

/* A read with no handle (no_open): what node ino is, as the lookup that made it fixed it. */
static void read_node(fuse_req_t req, hapi_fs *fs, fuse_ino_t ino, size_t size, off_t off)
{
    if (ino & CTL_BASE) {
        int i = ctl_file_index(ino);
        if (i >= 0 && strcmp(hapi_ctl_files[i], HAPI_CTL_MODEL) == 0) {
            if (fs->model_fd < 0)
                fuse_reply_err(req, ENOENT);
            else
                reply_fd(req, fs->model_fd, size, off);
            return;
        }
        uint64_t version;
        hapi_ctl_text *t = node_text(fs, ino, &version);
        if (!t) {
            fuse_reply_err(req, ENOENT);
            return;
        }
        reply_text(req, t, size, off);
        hapi_ctl_text_put(t);
        return;
    }
    struct node_content c;
    char *path = NULL;
    int kind, rc;
    if ((rc = node_get(fs, ino, &kind, &path, &c)) < 0) {
        fuse_reply_err(req, -rc);
        return;
    }
    struct open_file h = { .kind = kind, .fd = -1, .path = path, .id = c.id };
    hapi_cred cred;
    const hapi_cred *who;
    uint64_t serial;
    struct node_pack *np = NULL;
    switch (kind) {
    case HAPI_NODE_FEAT:
        /*
         * the view of the node's split: its own (kept since its lookup, so a file read
         * after a split change is still computed at its split), the current one, or one
         * made for the cache alone
         */
        h.view = node_view(fs, ino);
        if (!h.view)
            h.view = hapi_views_peek(fs->views);
        if (h.view && h.view->split != c.split) {
            hapi_view_put(h.view);
            h.view = NULL;
        }
        if (!h.view) {
            hapi_error err = { 0 };
            if ((rc = hapi_view_new(fs->views, c.split, &h.view, &err)) < 0)
                break;
        }
        /*
         * The image changed after the kernel looked the .feat up (watch.c had not seen it
         * yet, or the file was found before and read after): its old features if they are
         * cached; else the new ones if this read is the whole file (the kernel reads a
         * .feat in one request; same split, same size), so that no page of one version
         * meets one of another; else ESTALE (ENOENT if it was deleted).
         */
        hapi_source_id now;
        if (((rc = hapi_source_identity(fs->source, path, &now)) < 0 ||
             memcmp(&now, &c.id, sizeof(now)) != 0) &&
            !hapi_serve_cached(fs->serve, h.view, path, &c.id)) {
            if (rc == 0 && off == 0 && size >= (size_t)c.attr.st_size) {
                h.id = now;
            } else {
                hapi_view_put(h.view);
                rc = rc < 0 ? rc : -ESTALE;
                break;
            }
        }
        read_feat(req, fs, &h, size, off);
        hapi_view_put(h.view);
        free(path);
        return;
    case HAPI_NODE_PACK:
        if ((who = req_who(req, &cred))) {
            /* another user: a snapshot of now with its check, which must be the node's */
            if ((rc = pack_open_keyed(fs, path, who, c.pack_key, &h.pack)) < 0)
                break;
            read_pack(req, &h, size, off);
            hapi_pack_close(h.pack);
        } else {
            if ((rc = node_pack_get(fs, ino, path, c.pack_key, &np)) < 0)
                break;
            h.pack = np->pack;
            read_pack(req, &h, size, off);
            node_pack_put(np);
        }
        free(path);
        return;
    case HAPI_NODE_PACK_INDEX: {
        hapi_ctl_text *t = node_text(fs, ino, &serial);
        if (!t) {
            rc = -ENOENT;
            break;
        }
        reply_text(req, t, size, off);
        hapi_ctl_text_put(t);
        free(path);
        return;
    }
    case HAPI_NODE_FILE:
        if ((rc = hapi_source_open_beneath(fs->source, path, O_RDONLY)) < 0)
            break;
        if (fs->serve)
            hapi_serve_note_passthrough(fs->serve, size);
        reply_fd(req, rc, size, off);
        close(rc);
        free(path);
        return;
    default:
        rc = -EISDIR;
        break;
    }
    free(path);
    fuse_reply_err(req, hapi_fs_errno(rc));
}

static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    COUNT(req, HAPI_REQ_OPEN);
    hapi_fs *fs = fuse_req_userdata(req);
    if (fs->no_open) {
        /* from now on the kernel opens without asking (see "without opens") */
        fuse_reply_err(req, ENOSYS);
        return;
    }
    struct open_file *h = NULL;
    char *path = NULL;
    int kind, rc;
    int writing = (fi->flags & O_ACCMODE) != O_RDONLY || (fi->flags & O_TRUNC);
    hapi_cred cred; /* read only for what the kernel's mode checks cannot decide */

    h = calloc(1, sizeof(*h));
    if (!h) {
        rc = -ENOMEM;
        goto fail;
    }
    h->fd = -1;
    pthread_mutex_init(&h->lock, NULL);
    if (ino & CTL_BASE) {
        int i = ctl_file_index(ino);
        if (ino == CTL_DIR_ID) {
            rc = -EISDIR;
            goto fail;
        }
        if (i < 0) {
            rc = -ENOENT;
            goto fail;
        }
        /* Only .hapifs/ctl takes writes: one command per line. */
        if (writing && strcmp(hapi_ctl_files[i], HAPI_CTL_WRITABLE) != 0) {
            rc = -EROFS;
            goto fail;
        }
        const hapi_cred *who = req_who(req, &cred);
        /* Commands change what every user of the mount sees: its owner's, and ctl_group's. */
        if (writing && who &&
            !(fs->opt->ctl_gid != (gid_t)-1 && hapi_cred_in_group(who, fs->opt->ctl_gid))) {
            rc = -EACCES;
            goto fail;
        }
        if (strcmp(hapi_ctl_files[i], HAPI_CTL_MODEL) == 0) {
            char self[64];
            snprintf(self, sizeof(self), "/proc/self/fd/%d", fs->model_fd);
            h->fd = fs->model_fd >= 0 ? open(self, O_RDONLY | O_CLOEXEC) : -1;
            if (h->fd < 0) {
                rc = fs->model_fd >= 0 ? -errno : -ENOENT;
                goto fail;
            }
            h->kind = HAPI_NODE_FILE; /* read like a passthrough file */
            fi->keep_cache = 1;
            goto done;
        }
        h->kind = HAPI_NODE_CTL_FILE;
        h->text = hapi_ctl_render(fs->ctl, hapi_ctl_files[i], who);
        if (!h->text) {
            rc = -ENOMEM;
            goto fail;
        }
        fi->direct_io = 1; /* the content is made at open; its size is not known before */
        goto done;
    }
    if (writing) {
        rc = -EROFS;
        goto fail;
    }
    struct node_content c;
    if ((rc = node_get(fs, ino, &kind, &path, &c)) < 0)
        goto fail;
    if (kind == HAPI_NODE_DIR) {
        rc = -EISDIR;
        goto fail;
    }
    h->kind = kind;
    if (kind == HAPI_NODE_REMOTE_FEAT) {
        /* The index entry of now: the bytes of this open file never change. */
        if ((rc = hapi_remote_feat_open(fs->remote, path, &h->remote_feat)) < 0)
            goto fail;
        if (remote_node_id(path, kind, hapi_remote_feat_key(h->remote_feat)) == ino)
            fi->keep_cache = 1; /* the node's pages are of these bytes */
        else if ((rc = other_bytes(req, &c, fi)) < 0)
            goto fail;
    } else if (fs->remote) {
        if ((rc = hapi_remote_open_file(fs->remote, path)) < 0)
            goto fail;
        h->fd = rc;
        struct stat st;
        h->remote_size = fstat(h->fd, &st) == 0 ? st.st_size : 0;
        const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
        if (strcmp(base, HAPI_PACK_NAME) == 0) {
            /*
             * A storage mount's pack is a snapshot taken at its open, whose
             * size the attributes do not tell (they show the directory's
             * pack now): read to the end its header says, whatever the
             * kernel was told; a read that ends before it is EIO.
             */
            uint64_t size;
            if ((rc = hapi_remote_pack_file_size(fs->remote, path, h->fd, &size)) < 0)
                goto fail;
            h->remote_size = (off_t)size;
            fi->direct_io = 1;
        } else if (strcmp(base, HAPI_PACK_INDEX_NAME) == 0) {
            /* made at the storage side's open; read whole now, and refused if cut short */
            char *text = NULL;
            size_t len = 0;
            rc = hapi_remote_read_pack_index(fs->remote, path, h->fd, &text, &len);
            h->fd = -1;
            if (rc < 0)
                goto fail;
            h->kind = HAPI_NODE_CTL_FILE; /* read like a control file */
            h->text = hapi_ctl_text_new(text, len);
            free(text);
            if (!h->text) {
                rc = -ENOMEM;
                goto fail;
            }
            fi->direct_io = 1;
        }
        h->path = path; /* for the error a short read records */
        path = NULL;
    } else if (kind == HAPI_NODE_FEAT) {
        /* The source is read when the features are computed; here it must only exist. */
        if ((rc = hapi_source_identity(fs->source, path, &h->id)) < 0) {
            if (rc == -ENOENT)
                hapi_serve_collect(fs->serve, path);
            goto fail;
        }
        /* The file keeps this split until it is closed, whatever happens meanwhile. */
        if (!(h->view = hapi_views_get(fs->views))) {
            rc = -ENODEV;
            goto fail;
        }
        h->path = path;
        path = NULL;
        if (c.split == h->view->split && memcmp(&c.id, &h->id, sizeof(h->id)) == 0) {
            /* Features are immutable for a given source identity and namespace. */
            fi->keep_cache = 1;
        } else if ((rc = other_bytes(req, &c, fi)) < 0) {
            goto fail;
        }
    } else if (kind == HAPI_NODE_PACK) {
        /* A snapshot of the directory now. */
        if ((rc = hapi_pack_open(fs->packs, path, req_who(req, &cred), &h->pack)) < 0)
            goto fail;
        if (hapi_pack_key(h->pack) == c.pack_key) {
            /*
             * keep_cache: the pages the kernel has of this node are its snapshot's rows, and
             * they must stay: a row whose image changed since may be computed again of the
             * new version, and dropping pages at each open would let another reader of this
             * node get half a row from before and half from after.
             */
            fi->keep_cache = 1;
        } else if ((rc = other_bytes(req, &c, fi)) < 0) {
            goto fail;
        }
    } else if (kind == HAPI_NODE_PACK_INDEX) {
        char *text = NULL;
        size_t len = 0;
        if ((rc = hapi_pack_index(fs->packs, path, &text, &len)) < 0)
            goto fail;
        h->kind = HAPI_NODE_CTL_FILE; /* read like a control file: made now, direct I/O */
        h->text = hapi_ctl_text_new(text, len);
        free(text);
        if (!h->text) {
            rc = -ENOMEM;
            goto fail;
        }
        fi->direct_io = 1;
    } else {
        rc = hapi_source_open_beneath(fs->source, path, O_RDONLY);
        if (rc < 0)
            goto fail;
        h->fd = rc;
    }
done:
    free(path);
    handle_link(fs, &h->link, 0);
    fi->fh = (uint64_t)(uintptr_t)h;
    fuse_reply_open(req, fi);
    return;
fail:
    free(path);
    open_file_free(h);
    fuse_reply_err(req, -rc);
}

/* A .feat read: the bytes come from serve.c into a buffer of ours, then the reply. */
#define FEAT_STACK_BUF 16384

static void read_feat(fuse_req_t req, hapi_fs *fs, struct open_file *h, size_t size, off_t off)
{
    char stack_buf[FEAT_STACK_BUF];
    char *buf = size <= sizeof(stack_buf) ? stack_buf : malloc(size);
    if (!buf) {
        fuse_reply_err(req, ENOMEM);
        return;
    }
    /* a remote mount's from its cache or its directory's pack; else from serve.c */
    ssize_t n = h->remote_feat
                    ? hapi_remote_feat_read(fs->remote, h->remote_feat, buf, size, off)
                    : hapi_serve_read(fs->serve, h->view, h->path, &h->id, buf, size, off);
    if (n < 0)
        fuse_reply_err(req, hapi_fs_errno((int)n)); /* the layer has recorded why */
    else
        fuse_reply_buf(req, buf, (size_t)n);
    if (buf != stack_buf)
        free(buf);
}

/*
 * A remote mount's file other than a .feat it fetches: read from its source
 * into a buffer, not spliced, so that a read that ends before the size the
 * file had at open is an error, not a short reply. A network filesystem whose
 * server lost the file (sshfs, while a storage daemon restarts) answers such
 * reads with 0 bytes, which a reader would take for the whole file.
 */
static void read_remote(fuse_req_t req, hapi_fs *fs, struct open_file *h, size_t size, off_t off)
{
    char *buf = malloc(size ? size : 1);
    size_t got = 0;
    if (!buf) {
        fuse_reply_err(req, ENOMEM);
        return;
    }
    while (got < size) {
        ssize_t n = pread(h->fd, buf + got, size - got, off + (off_t)got);
        if (n < 0 && errno == EINTR)
            continue;
        int fl;
        if (n < 0 && errno == EINVAL && (fl = fcntl(h->fd, F_GETFL)) >= 0 && (fl & O_DIRECT) &&
            fcntl(h->fd, F_SETFL, fl & ~O_DIRECT) == 0)
            continue; /* a local filesystem wants aligned direct reads: read normally */
        if (n < 0) {
            int e = errno;
            free(buf);
            fuse_reply_err(req, e == ENOMEM ? ENOMEM : EIO);
            return;
        }
        if (n == 0)
            break;
        got += (size_t)n;
    }
    if (got < size && off + (off_t)got < h->remote_size) {
        char msg[200];
        snprintf(msg, sizeof(msg), "the file ended at %lld bytes of %lld read through its source "
                 "(the source is down or the file changed)", (long long)(off + (off_t)got),
                 (long long)h->remote_size);
        hapi_error_ring_add(fs->errors, h->path ? h->path : "", -EIO, msg);
        free(buf);
        fuse_reply_err(req, EIO);
        return;
    }
    fuse_reply_buf(req, buf, got);
    free(buf);
}

/* A pack read: rows computed or looked up by pack.c into a buffer of ours. */
static void read_pack(fuse_req_t req, struct open_file *h, size_t size, off_t off)
{
    char *buf = malloc(size ? size : 1);
    if (!buf) {
        fuse_reply_err(req, ENOMEM);
        return;
    }
    ssize_t n = hapi_pack_read(h->pack, buf, size, off);
    if (n < 0)
        fuse_reply_err(req, hapi_fs_errno((int)n));
    else
        fuse_reply_buf(req, buf, (size_t)n);
    free(buf);
}

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                    struct fuse_file_info *fi)
{
    COUNT(req, HAPI_REQ_READ);
    hapi_fs *fs = fuse_req_userdata(req);
    struct open_file *h = (struct open_file *)(uintptr_t)fi->fh;
    if (!h) {
        read_node(req, fs, ino, size, off); /* opened by the kernel alone (no_open) */
        return;
    }

    switch (h->kind) {
    case HAPI_NODE_FEAT:
        read_feat(req, fs, h, size, off);
        return;
    case HAPI_NODE_PACK:
        read_pack(req, h, size, off);
        return;
    case HAPI_NODE_REMOTE_FEAT:
        read_feat(req, fs, h, size, off);
        return;
    case HAPI_NODE_CTL_FILE: {
        /* The reply is written from a reference of our own: the handle may go meanwhile. */
        pthread_mutex_lock(&h->lock);
        hapi_ctl_text *text = hapi_ctl_text_ref(h->text);
        pthread_mutex_unlock(&h->lock);
        if ((size_t)off >= text->len)
            fuse_reply_buf(req, NULL, 0);
        else
            fuse_reply_buf(req, text->data + off,
                           text->len - (size_t)off < size ? text->len - (size_t)off : size);
        hapi_ctl_text_put(text);
        return;
    }
    default: {
        if (fs->remote) {
            read_remote(req, fs, h, size, off);
            return;
        }
        /* Passthrough: let the kernel splice from the source file where it can. */
        struct fuse_bufvec buf = FUSE_BUFVEC_INIT(size);
        buf.buf[0].flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK;
        buf.buf[0].fd = h->fd;
        buf.buf[0].pos = off;
        if (fs->serve)
            hapi_serve_note_passthrough(fs->serve, size);
        fuse_reply_data(req, &buf, FUSE_BUF_SPLICE_MOVE);
        return;
    }
    }
}

static void op_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    COUNT(req, HAPI_REQ_RELEASE);
    struct open_file *h = (struct open_file *)(uintptr_t)fi->fh;
    (void)ino;
    if (!h) {
        fuse_reply_err(req, 0);
        return;
    }
    handle_unlink(fuse_req_userdata(req), &h->link);
    open_file_free(h);
    fuse_reply_err(req, 0);
}

static void op_statfs(fuse_req_t req, fuse_ino_t ino)
{
    COUNT(req, HAPI_REQ_STATFS);
    hapi_fs *fs = fuse_req_userdata(req);
    struct statvfs sv;
    (void)ino;
    /* A remote mount reports its cache's filesystem: a dead source must not hang df. */
    if (fs->remote ? statvfs(fs->opt->cache_dir, &sv) < 0
                   : fstatvfs(hapi_source_root_fd(fs->source), &sv) < 0) {
        fuse_reply_err(req, errno);
        return;
    }
    sv.f_flag |= ST_RDONLY;
    fuse_reply_statfs(req, &sv);
}

/*
 * The mount is read-only but for .hapifs/ctl, so it is not mounted MS_RDONLY
 * (the kernel would refuse the control file too): every operation that
 * changes something answers EROFS here.
 */
static void op_setattr(fuse_req_t req, fuse_ino_t ino, struct stat *attr, int to_set,
                       struct fuse_file_info *fi)
{
    COUNT(req, HAPI_REQ_OTHER);
    hapi_fs *fs = fuse_req_userdata(req);
    (void)attr, (void)fi;
    int i = (ino & CTL_BASE) ? ctl_file_index(ino) : -1;
    /* `echo cmd > ctl` truncates first: a no-op on a command file. */
    if (i >= 0 && strcmp(hapi_ctl_files[i], HAPI_CTL_WRITABLE) == 0 &&
        (to_set & ~(FUSE_SET_ATTR_SIZE | FUSE_SET_ATTR_MTIME | FUSE_SET_ATTR_MTIME_NOW |
                    FUSE_SET_ATTR_CTIME)) == 0) {
        struct stat st;
        ctl_file_attr(fs, i, &st);
        if (fs->no_open && ctl_attr_no_open(fs, ino, &st) < 0)
            ctl_file_attr(fs, i, &st);
        fuse_reply_attr(req, &st, 0);
        return;
    }
    fuse_reply_err(req, EROFS);
}

/* What a read of ctl returns after a write: "ok" or "error: REASON" (NULL: out of memory). */
static hapi_ctl_text *outcome(int rc, const char *reason)
{
    char line[512];
    int len = rc < 0 ? snprintf(line, sizeof(line), "error: %s\n", reason)
                     : snprintf(line, sizeof(line), "ok\n");
    return hapi_ctl_text_new(line, len < (int)sizeof(line) ? (size_t)len : sizeof(line) - 1);
}

/* Sets what a read of the ctl handle h returns now: the outcome of its last write. */
static void set_outcome(struct open_file *h, int rc, const char *reason)
{
    hapi_ctl_text *text = outcome(rc, reason);
    if (!text)
        return; /* the write's own result still says it failed */
    pthread_mutex_lock(&h->lock);
    hapi_ctl_text *old = h->text;
    h->text = text;
    pthread_mutex_unlock(&h->lock);
    hapi_ctl_text_put(old);
}

static void op_write(fuse_req_t req, fuse_ino_t ino, const char *buf, size_t size, off_t off,
                     struct fuse_file_info *fi)
{
    COUNT(req, HAPI_REQ_OTHER);
    hapi_fs *fs = fuse_req_userdata(req);
    struct open_file *h = (struct open_file *)(uintptr_t)fi->fh;
    hapi_error err = { 0 };
    (void)off;
    int i = (ino & CTL_BASE) ? ctl_file_index(ino) : -1;
    if (!h && fs->no_open && i >= 0 && strcmp(hapi_ctl_files[i], HAPI_CTL_WRITABLE) == 0) {
        /* no open checked who writes: the write does (root, the owner, ctl_group) */
        hapi_cred cred;
        const hapi_cred *who = req_who(req, &cred);
        if (who && !(fs->opt->ctl_gid != (gid_t)-1 && hapi_cred_in_group(who, fs->opt->ctl_gid))) {
            fuse_reply_err(req, EACCES);
            return;
        }
    } else if (!h || h->kind != HAPI_NODE_CTL_FILE) {
        fuse_reply_err(req, EROFS);
        return;
    }
    /* Each write carries whole command lines; a failed one changes nothing. */
    int rc = hapi_ctl_command(fs->ctl, buf, size, &err);
    if (h) {
        set_outcome(h, rc, err.message);
    } else {
        /* what this user's ctl shows now (its size and mtime tell the kernel) */
        hapi_ctl_text *text = outcome(rc, err.message);
        uint64_t version;
        if (text)
            node_set_text(fs, ino, text, &version); /* takes text, even if the node is gone */
    }
    if (rc < 0) {
        /* logged, and kept in .hapifs/errors */
        hapi_error_ring_add(fs->errors, ".hapifs/ctl", rc, err.message);
        fuse_reply_err(req, hapi_fs_errno(rc));
        return;
    }
    fuse_reply_write(req, size);
}

static void op_create(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode,
                      struct fuse_file_info *fi)
{
    COUNT(req, HAPI_REQ_OTHER);
    (void)parent, (void)name, (void)mode, (void)fi;
    fuse_reply_err(req, EROFS);
}

static void op_mknod(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode, dev_t rdev)
{
    COUNT(req, HAPI_REQ_OTHER);
    (void)parent, (void)name, (void)mode, (void)rdev;
    fuse_reply_err(req, EROFS);
}

static void op_mkdir(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode)
{
    COUNT(req, HAPI_REQ_OTHER);
    (void)parent, (void)name, (void)mode;
    fuse_reply_err(req, EROFS);
}

static void op_remove(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    COUNT(req, HAPI_REQ_OTHER);
    (void)parent, (void)name;
    fuse_reply_err(req, EROFS);
}

static void op_symlink(fuse_req_t req, const char *link, fuse_ino_t parent, const char *name)
{
    COUNT(req, HAPI_REQ_OTHER);
    (void)link, (void)parent, (void)name;
    fuse_reply_err(req, EROFS);
}

static void op_rename(fuse_req_t req, fuse_ino_t parent, const char *name, fuse_ino_t newparent,
                      const char *newname, unsigned int flags)
{
    COUNT(req, HAPI_REQ_OTHER);
    (void)parent, (void)name, (void)newparent, (void)newname, (void)flags;
    fuse_reply_err(req, EROFS);
}

static void op_link(fuse_req_t req, fuse_ino_t ino, fuse_ino_t newparent, const char *newname)
{
    COUNT(req, HAPI_REQ_OTHER);
    (void)ino, (void)newparent, (void)newname;
    fuse_reply_err(req, EROFS);
}

static void op_setxattr(fuse_req_t req, fuse_ino_t ino, const char *name, const char *value,
                        size_t size, int flags)
{
    COUNT(req, HAPI_REQ_OTHER);
    (void)ino, (void)name, (void)value, (void)size, (void)flags;
    fuse_reply_err(req, EROFS);
}

static void op_removexattr(fuse_req_t req, fuse_ino_t ino, const char *name)
{
    COUNT(req, HAPI_REQ_OTHER);
    (void)ino, (void)name;
    fuse_reply_err(req, EROFS);
}

static void op_fallocate(fuse_req_t req, fuse_ino_t ino, int mode, off_t offset, off_t length,
                         struct fuse_file_info *fi)
{
    COUNT(req, HAPI_REQ_OTHER);
    (void)ino, (void)mode, (void)offset, (void)length, (void)fi;
    fuse_reply_err(req, EROFS);
}

const struct fuse_lowlevel_ops hapi_fs_ops = {
    .init = op_init,
    .lookup = op_lookup,
    .forget = op_forget,
    .forget_multi = op_forget_multi,
    .getattr = op_getattr,
    .setattr = op_setattr,
    .opendir = op_opendir,
    .readdir = op_readdir,
    .readdirplus = op_readdirplus,
    .releasedir = op_releasedir,
    .open = op_open,
    .read = op_read,
    .write = op_write,
    .create = op_create,
    .mknod = op_mknod,
    .mkdir = op_mkdir,
    .unlink = op_remove,
    .rmdir = op_remove,
    .symlink = op_symlink,
    .rename = op_rename,
    .link = op_link,
    .setxattr = op_setxattr,
    .removexattr = op_removexattr,
    .fallocate = op_fallocate,
    .release = op_release,
    .statfs = op_statfs,
};

/* ------------------------------------------------------------- set-up */

/*
 * A compute-side mount: the cache, the remote feature source over the
 * storage mounts, and the control files; no model, batcher or policy.
 */
static int init_remote(hapi_fs *fs, hapi_fs_options *opt, hapi_error *err)
{
    int rc;
    hapi_cache_options copt = { .max_bytes = opt->cache_size, .reset = opt->cache_reset };
    if ((rc = hapi_cache_open(opt->cache_dir, &copt, &fs->cache, err)) < 0)
        return rc;
    fs->nodes = node_table_new();
    fs->errors = hapi_error_ring_new();
    if (!fs->nodes || !fs->errors)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    hapi_remote_config rcfg = {
        .roots = (const char *const *)opt->roots, .nroots = opt->nroots, .cache = fs->cache,
        .errors = fs->errors, .refresh_ms = opt->refresh_ms,
        .fetch_threads = opt->fetch_threads, .on_change = invalidate_remote_feats, .arg = fs,
    };
    if ((rc = notifier_start(fs)) < 0)
        return hapi_error_set(err, rc, "cannot start a thread: %s", strerror(-rc));
    if ((rc = hapi_remote_open(&rcfg, &fs->remote, err)) < 0)
        return rc;
    /* The storage side's model archive, for the training side's remaining stages. */
    rc = hapi_remote_open_storage_file(fs->remote, "model");
    fs->model_fd = rc >= 0 ? rc : -1;
    hapi_ctl_config ccfg = {
        .opt = opt, .requests = &fs->requests, .cache = fs->cache, .remote = fs->remote,
        .errors = fs->errors, .uring = &fs->uring,
        .started_ns = fs->started_ns,
    };
    if ((rc = hapi_ctl_new(&ccfg, &fs->ctl)) < 0)
        return hapi_error_set(err, rc, "out of memory");
    return 0;
}

/*
 * Joins the node's shared budget and cores. Until the policy has chosen a
 * split, the mount's share is its model file's size (about its weights).
 * Failing to join is a warning, and the mount runs alone, unless the operator
 * asked for the node with node=, node_mem= or node_cores=.
 */
static int join_node(hapi_fs *fs, const hapi_fs_options *opt, hapi_error *err)
{
    if (!opt->node_path)
        return 0;
    hapi_node_config ncfg = { .path = opt->node_path, .mem_total = opt->node_mem,
                              .cores = opt->node_cores, .name = opt->mountpoint };
    hapi_error nerr = { 0 };
    int rc = hapi_node_open(&ncfg, &fs->node_share, &nerr);
    if (rc < 0) {
        if (opt->node_required)
            return hapi_error_set(err, rc, "node=%s: %s", opt->node_path, nerr.message);
        hapi_log(HAPI_LOG_WARNING, "the node's shared budget is unavailable (%s): this mount "
                 "counts only its own mem=", nerr.message);
        return 0;
    }
    struct stat st;
    if (fs->model_fd >= 0 && fstat(fs->model_fd, &st) == 0)
        hapi_node_set_fixed(fs->node_share, (uint64_t)st.st_size);
    return 0;
}

int hapi_fs_init(hapi_fs *fs, hapi_fs_options *opt, hapi_error *err)
{
    int rc;

    memset(fs, 0, sizeof(*fs));
    pthread_mutex_init(&fs->handles_lock, NULL);
    fs->handles.next = fs->handles.prev = &fs->handles;
    if (opt->remote) {
        fs->opt = opt;
        fs->model_fd = -1;
        fs->started_ns = hapi_now_ns();
        fs->started_realtime = time(NULL);
        if ((rc = init_remote(fs, opt, err)) < 0)
            hapi_fs_destroy(fs);
        return rc;
    }
    fs->opt = opt;
    /* The model file as loaded, for .hapifs/model, even if the path is replaced later. */
    fs->model_fd = open(opt->model, O_RDONLY | O_CLOEXEC);
    fs->started_ns = hapi_now_ns();
    fs->started_realtime = time(NULL);

    if ((rc = hapi_source_open(opt->source, &fs->source, err)) < 0)
        goto fail;
    if ((rc = join_node(fs, opt, err)) < 0)
        goto fail;
    hapi_extractor_config cfg = {
        .model_path = opt->model,
        .split = opt->split,
        .freeze = opt->freeze,
        .dtype = opt->dtype,
        .mode = opt->mode,
        .max_pixels = opt->max_pixels,
        .threads = opt->torch_threads,
        .device = opt->device,
        .precision = opt->precision,
    };
    /* A batch's tensors reuse the last one's memory, up to the budget (extractor.h). */
    hapi_extractor_keep_heap(opt->mem_budget);
    if ((rc = hapi_extractor_open(&cfg, &fs->ex, err)) < 0)
        goto fail;
    hapi_cache_options copt = { .max_bytes = opt->cache_size, .reset = opt->cache_reset };
    if ((rc = hapi_cache_open(opt->cache_dir, &copt, &fs->cache, err)) < 0)
        goto fail;
    fs->nodes = node_table_new();
    fs->errors = hapi_error_ring_new();
    if (!fs->nodes || !fs->errors) {
        rc = hapi_error_set(err, -ENOMEM, "out of memory");
        goto fail;
    }
    if (opt->watch) {
        if ((rc = watchdog_start(fs)) < 0) {
            hapi_error_set(err, rc, "cannot start the notices' watchdog: %s", strerror(-rc));
            goto fail;
        }
        if ((rc = hapi_watch_new(on_change, fs, &fs->watch, err)) < 0)
            goto fail;
        fs->nodes->watch = fs->watch;
    }
    /* The root, in the table so that it has a watch like any directory; never forgotten. */
    if ((rc = node_ref(fs->nodes, FUSE_ROOT_ID, HAPI_NODE_DIR, "", NULL, 0, ENTRY_TIMEOUT)) < 0) {
        rc = hapi_error_set(err, rc, "out of memory");
        goto fail;
    }
    if (rc == 1)
        watch_dir(fs, FUSE_ROOT_ID, "");
    /* Without opens, freshness rests on the watch: only over a watched source. */
    uint64_t changes;
    fs->no_open = opt->no_open && fs->watch &&
                  dir_timeout(fs, FUSE_ROOT_ID, &changes) == WATCHED_TIMEOUT;

    if ((rc = hapi_views_new(fs->ex, opt->dtype, opt->precision, &fs->views, err)) < 0)
        goto fail;
    /*
     * batch_wait is wall time at a whole CPU. Under a CFS quota below one CPU the next
     * image decodes 1/quota times slower, and a partial batch that waited only batch_wait
     * runs alone: measured under a quarter of a CPU, batches of 1.0 where the same reads
     * made batches of 12 unthrottled, and a first epoch 2.5x as long at the late splits. So
     * the wait stretches by 1/quota (at most BATCH_WAIT_MAX_US).
     */
    int batch_wait_us = opt->batch_wait_us;
    double quota = hapi_cpu_quota("/proc/self/cgroup", "/sys/fs/cgroup");
    if (quota > 0 && quota < 1 && batch_wait_us > 0) {
        batch_wait_us = (int)fmin(batch_wait_us / quota, BATCH_WAIT_MAX_US);
        hapi_log(HAPI_LOG_INFO, "a CPU quota of %.3g CPUs: a partial batch waits %.1f ms for "
                 "more reads (batch_wait=%d at a whole CPU)", quota, batch_wait_us / 1e3,
                 opt->batch_wait_us / 1000);
    }
    hapi_serve_config scfg = {
        .source = fs->source, .ex = fs->ex, .cache = fs->cache, .views = fs->views,
        .errors = fs->errors, .batch_wait_us = batch_wait_us,
        .decode_threads = opt->decode_threads, .mem_budget = opt->mem_budget,
        .node = fs->node_share, .torch_threads = opt->torch_threads,
    };
    if ((rc = hapi_serve_new(&scfg, &fs->serve, err)) < 0)
        goto fail;
    if ((rc = hapi_packs_new(fs->source, fs->views, fs->serve, &fs->packs)) < 0) {
        hapi_error_set(err, rc, "out of memory");
        goto fail;
    }
    hapi_background_config bcfg = {
        .source = fs->source, .cache = fs->cache, .views = fs->views, .serve = fs->serve,
        .prefetch = opt->prefetch, .cache_size = opt->cache_size, .warm = opt->warm,
    };
    if ((rc = hapi_background_start(&bcfg, &fs->background, err)) < 0)
        goto fail;
    /* The split and batch are chosen in the background; .feat operations wait for them. */
    hapi_tune_config tcfg = {
        .opt = opt, .source = fs->source, .ex = fs->ex, .cache = fs->cache, .views = fs->views,
        .serve = fs->serve, .background = fs->background, .node = fs->node_share,
        .on_split_change = invalidate_feats,
        .arg = fs, .serving = opt->serving_gate ? fs_serving : NULL,
    };
    if ((rc = hapi_tune_start(&tcfg, &fs->tune, err)) < 0)
        goto fail;
    hapi_ctl_config ccfg = {
        .opt = opt, .requests = &fs->requests, .source = fs->source, .ex = fs->ex,
        .cache = fs->cache, .views = fs->views,
        .serve = fs->serve, .packs = fs->packs, .background = fs->background,
        .tune = fs->tune, .errors = fs->errors, .node = fs->node_share, .watch = fs->watch,
        .no_open = fs->no_open, .uring = &fs->uring, .epochs = &fs->epochs,
        .epoch_notices = &fs->epoch_notices,
        .started_ns = fs->started_ns,
    };
    if ((rc = hapi_ctl_new(&ccfg, &fs->ctl)) < 0) {
        hapi_error_set(err, rc, "out of memory");
        goto fail;
    }
    return 0;
fail:
    hapi_fs_destroy(fs);
    return rc;
}

/*
 * From the top: the policy thread first (it makes views and tells the
 * background the tree's size), then no view may come any more (a warm-up
 * waiting for the first goes), the background threads, and the rest.
 */
void hapi_fs_stop_watching(hapi_fs *fs)
{
    hapi_watch_free(fs->watch);
    fs->watch = NULL;
    watchdog_stop(fs); /* after the watch thread, which uses it */
    notifier_stop(fs);
    change_batch_free(fs->changes);
    fs->changes = NULL;
    if (fs->nodes)
        fs->nodes->watch = NULL;
}

void hapi_fs_destroy(hapi_fs *fs)
{
    if (!fs->opt)
        return; /* never set up, or destroyed already */
    hapi_fs_stop_watching(fs);
    handles_free_all(fs); /* they hold views, packs, the remote's files */
    node_table_drop_packs(fs->nodes);
    hapi_ctl_free(fs->ctl);
    hapi_remote_close(fs->remote);
    notifier_free(fs); /* after the remote, which calls it */
    hapi_tune_stop(fs->tune);
    if (fs->views)
        hapi_views_stop(fs->views);
    hapi_background_stop(fs->background);
    hapi_views_free(fs->views); /* the batchers go with the views, before serve */
    hapi_packs_free(fs->packs);
    hapi_serve_free(fs->serve);
    node_table_free(fs->nodes);
    hapi_error_ring_free(fs->errors);
    hapi_cache_close(fs->cache);
    hapi_extractor_close(fs->ex);
    hapi_source_close(fs->source);
    hapi_node_close(fs->node_share);
    if (fs->model_fd >= 0)
        close(fs->model_fd);
    memset(fs, 0, sizeof(*fs));
    fs->model_fd = -1;
}

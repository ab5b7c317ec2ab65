/* fs-int.h — the insides the fs.c family shares (nodes.c, notify.c, attr.c, noopen.c, ops.c, fs.c): the node, its table, the handles, the functions that cross files. */
#ifndef HAPI_FUSEFS_FS_INT_H
#define HAPI_FUSEFS_FS_INT_H

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

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <time.h>

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

#define NO_WATCH (-1)      /* not watched yet (or any more): the next lookup tries */

#define CANNOT_WATCH (-2)  /* a network filesystem, or no watches left */

struct node_table {
    pthread_mutex_t lock;
    struct node **buckets;
    size_t nbuckets;
    size_t count;
    hapi_watch *watch;  /* where a directory node's watch goes when it does; NULL: none */
};

/* What forget_nodes() tells the kernel to forget of a node. */
enum forget_how { FORGET_NOTHING, FORGET_NAME, FORGET_INODE };

struct stale {
    uint64_t id, parent;
    char *name;  /* NULL: the inode (its attributes, pages, listing) */
};

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

/*
 * A remote mount's split change, told from a thread of its own. remote-index.c
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

/* Counts a request of type t (stats: requests). */
#define COUNT(req, t) \
    atomic_fetch_add_explicit(&((hapi_fs *)fuse_req_userdata(req))->requests.n[t], 1, \
                              memory_order_relaxed)

/* A directory listing, read whole at opendir so offsets stay valid across readdir calls. */
struct dir_entry {
    char *name;
    int kind;           /* enum hapi_node_kind */
    char *path;         /* the node's source path; NULL for "." and ".." */
    struct stat attr;   /* as the mount shows it; st_ino is the node id */
    int split;          /* a .feat's: what its node is (struct node_content) */
    hapi_source_id id;
};

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

struct list_walk {
    hapi_fs *fs;
    struct dir_handle *d;
    hapi_view *view;    /* the split the listing's .feat are of: taken at the first image */
};

struct remote_list {
    struct dir_handle *d;
    const char *dir;
};

/*
 * A mount's feature source: where its names, attributes and bytes come from.
 * featsrc-local.c is a storage mount's (the source tree; .feat computed
 * through serve.c, packs through pack.c), featsrc-remote.c a compute-side
 * mount's (the storage mounts it reads through remote.c). ops.c asks
 * fs->src, set once at init, and never which one it is; the control
 * directory is ops.c's own. Each returns 0 or a negative code unless it
 * says otherwise.
 */
struct open_file;
struct feat_source {
    /* name in directory parent (parent_path): see resolve() in ops.c */
    int (*lookup)(hapi_fs *fs, uint64_t parent, const char *parent_path, const char *name,
                  pid_t by, struct fuse_entry_param *e, int *kind, char **path,
                  struct node_content *c, int *has_content);
    /* node ino's attributes now, and how long the kernel may keep them */
    int (*getattr)(hapi_fs *fs, fuse_ino_t ino, struct stat *st, double *timeout);
    /* directory path (node self) listed into d, "." and ".." first */
    int (*list)(hapi_fs *fs, const char *path, uint64_t self, struct dir_handle *d);
    /*
     * Opens node ino (kind, *path, what its lookup found in c) into h and sets
     * fi's cache flags; takes *path (sets it NULL) when h keeps it.
     */
    int (*open)(fuse_req_t req, hapi_fs *fs, fuse_ino_t ino, int kind, char **path,
                const struct node_content *c, struct open_file *h, struct fuse_file_info *fi);
    /* bytes [off, off + size) of an open .feat into buf: how many, or < 0 (recorded) */
    ssize_t (*read_feat)(hapi_fs *fs, struct open_file *h, char *buf, size_t size, off_t off);
    /* replies to a read of another open file of the source (h->fd) */
    void (*read_file)(fuse_req_t req, hapi_fs *fs, struct open_file *h, size_t size, off_t off);
    /* what statfs(2) on the mount reports */
    int (*statfs)(hapi_fs *fs, struct statvfs *sv);
};

extern const struct feat_source featsrc_local, featsrc_remote;

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

/* A .feat read: the bytes come from serve.c into a buffer of ours, then the reply. */
#define FEAT_STACK_BUF 16384

/* nodes.c */
double name_timeout(const hapi_fs *fs, int kind, double timeout);
void node_pack_put(struct node_pack *p);
struct node_table *node_table_new(void);
void node_table_drop_packs(struct node_table *t);
void node_table_free(struct node_table *t);
char *node_entry_name(const struct node *nd);
struct node *node_find(struct node_table *t, uint64_t id);
int node_ref(struct node_table *t, uint64_t id, int kind, const char *path,
             const struct node_content *content, uint64_t parent, double timeout);
void node_unref(struct node_table *t, uint64_t id, uint64_t count);
int node_get(hapi_fs *fs, uint64_t id, int *kind, char **path,
             struct node_content *content);
double dir_timeout(hapi_fs *fs, uint64_t dir, uint64_t *changes);
double node_timeout(hapi_fs *fs, uint64_t id);
double watched_timeout(hapi_fs *fs, uint64_t dir, double timeout, uint64_t changes);
void watch_dir(hapi_fs *fs, uint64_t id, const char *path);

/* notify.c */
int fs_serving(void *arg);
int watchdog_start(hapi_fs *fs);
void watchdog_stop(hapi_fs *fs);
void invalidate_feats(void *arg);
int notifier_start(hapi_fs *fs);
void notifier_stop(hapi_fs *fs);
void notifier_free(hapi_fs *fs);
void invalidate_remote_feats(void *arg);
void on_change(void *arg, uint64_t dir, const char *name, uint32_t mask);
void change_batch_free(struct change_batch *b);

/* attr.c */
uint64_t node_id_for(const hapi_fs *fs, const struct stat *st);
void source_attr(const hapi_fs *fs, const struct stat *src, uint64_t id, struct stat *st);
uint64_t remote_node_id(const char *path, int kind, uint64_t key);
int remote_node_kind(int remote_kind);
int remote_attr(hapi_fs *fs, const char *path, int *kind, struct stat *st);
void remote_feat_content(const struct stat *st, uint64_t parent, pid_t by,
                         struct node_content *c);
void feat_node(const hapi_view *v, const struct stat *src, uint64_t parent, pid_t by,
               struct stat *st, struct node_content *c);
int pack_attr(hapi_fs *fs, const char *dir, const struct stat *dir_st, int kind,
              uint64_t parent, pid_t by, int keep, struct stat *st,
              struct node_content *c);
void ctl_dir_attr(const hapi_fs *fs, struct stat *st);
int ctl_index(const char *name);
int ctl_file_index(fuse_ino_t ino);
void ctl_file_attr(hapi_fs *fs, int index, struct stat *st);

/* noopen.c */
void made_attr(const hapi_fs *fs, struct stat *st, size_t len, uint64_t version);
void ctl_lookup_no_open(fuse_req_t req, hapi_fs *fs, int i);
int ctl_attr_no_open(hapi_fs *fs, fuse_ino_t ino, struct stat *st);
int node_set_text(hapi_fs *fs, uint64_t id, hapi_ctl_text *text, uint64_t *serial);
hapi_view *node_view(hapi_fs *fs, uint64_t id);
hapi_ctl_text *node_text(hapi_fs *fs, uint64_t id, uint64_t *serial);
void read_node(fuse_req_t req, hapi_fs *fs, fuse_ino_t ino, size_t size, off_t off);

/* ops.c */
void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name);
int dir_add(struct dir_handle *d, const char *name, const char *suffix, int kind,
            const char *path, const struct stat *attr, const struct node_content *c);
int dir_add_bare(struct dir_handle *d, const char *name, uint64_t ino, mode_t type);
int other_bytes(fuse_req_t req, const struct node_content *c, struct fuse_file_info *fi);
void handles_free_all(hapi_fs *fs);
const hapi_cred *req_who(fuse_req_t req, hapi_cred *c);
void read_feat(fuse_req_t req, hapi_fs *fs, struct open_file *h, size_t size, off_t off);
void read_pack(fuse_req_t req, struct open_file *h, size_t size, off_t off);

#endif

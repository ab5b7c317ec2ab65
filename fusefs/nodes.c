/* nodes.c — node ids and the node table: what each id the kernel holds names, its references, timeouts and watches. */
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

/* The entry timeout of a name of kind that would get timeout (see DATA_NAME_TIMEOUT). */
double name_timeout(const hapi_fs *fs, int kind, double timeout)
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

void node_pack_put(struct node_pack *p)
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

struct node_table *node_table_new(void)
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
void node_table_drop_packs(struct node_table *t)
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

void node_table_free(struct node_table *t)
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
char *node_entry_name(const struct node *nd)
{
    if (nd->kind == HAPI_NODE_FEAT || nd->kind == HAPI_NODE_PACK)
        return node_name(nd);
    if (nd->kind == HAPI_NODE_PACK_INDEX)
        return strdup(HAPI_PACK_INDEX_NAME);
    const char *slash = strrchr(nd->path, '/');
    return *nd->path ? strdup(slash ? slash + 1 : nd->path) : NULL;
}

static size_t node_bucket(const struct node_table *t, uint64_t id)
{
    return (size_t)(XXH3_64bits(&id, sizeof(id)) & (t->nbuckets - 1));
}

/* The node of id, or NULL; under t->lock. */
struct node *node_find(struct node_table *t, uint64_t id)
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
int node_ref(struct node_table *t, uint64_t id, int kind, const char *path,
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

void node_unref(struct node_table *t, uint64_t id, uint64_t count)
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
int node_get(hapi_fs *fs, uint64_t id, int *kind, char **path,
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

/*
 * The timeout for names and attributes in directory dir: WATCHED_TIMEOUT if
 * watch.c watches it, else ENTRY_TIMEOUT; *changes is how many changes have
 * been seen in it, so that a lookup can tell whether one came while it looked
 * (watched_timeout()).
 */
double dir_timeout(hapi_fs *fs, uint64_t dir, uint64_t *changes)
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
double node_timeout(hapi_fs *fs, uint64_t id)
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
double watched_timeout(hapi_fs *fs, uint64_t dir, double timeout, uint64_t changes)
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
void watch_dir(hapi_fs *fs, uint64_t id, const char *path)
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

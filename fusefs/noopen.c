/* noopen.c — the read path without opens (no_open): a read names its node, whose kind and bytes its lookup fixed. */
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
void made_attr(const hapi_fs *fs, struct stat *st, size_t len, uint64_t version)
{
    st->st_size = (off_t)len;
    st->st_blocks = (blkcnt_t)((len + 511) / 512);
    st->st_mtim.tv_sec = fs->started_realtime + (time_t)(version / 1000000000u);
    st->st_mtim.tv_nsec = (long)(version % 1000000000u);
    st->st_ctim = st->st_mtim;
}

/* Looks up control file i for the caller (no_open): a node of its own, made now, for who it is. */
void ctl_lookup_no_open(fuse_req_t req, hapi_fs *fs, int i)
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
int ctl_attr_no_open(hapi_fs *fs, fuse_ino_t ino, struct stat *st)
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
int node_set_text(hapi_fs *fs, uint64_t id, hapi_ctl_text *text, uint64_t *serial)
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
hapi_view *node_view(hapi_fs *fs, uint64_t id)
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

hapi_ctl_text *node_text(hapi_fs *fs, uint64_t id, uint64_t *serial)
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

/* Replies with what made node ino shows (node_text()). Returns 0, or -ENOENT unreplied. */
static int reply_node_text(fuse_req_t req, hapi_fs *fs, fuse_ino_t ino, size_t size, off_t off)
{
    uint64_t serial;
    hapi_ctl_text *t = node_text(fs, ino, &serial);
    if (!t)
        return -ENOENT;
    reply_text(req, t, size, off);
    hapi_ctl_text_put(t);
    return 0;
}

/* A read of a control file with no handle: .hapifs/model's bytes, or the node's text. */
static void read_ctl_node(fuse_req_t req, hapi_fs *fs, fuse_ino_t ino, size_t size, off_t off)
{
    int i = ctl_file_index(ino);
    if (i >= 0 && strcmp(hapi_ctl_files[i], HAPI_CTL_MODEL) == 0) {
        if (fs->model_fd < 0)
            fuse_reply_err(req, ENOENT);
        else
            reply_fd(req, fs->model_fd, size, off);
        return;
    }
    if (reply_node_text(req, fs, ino, size, off) < 0)
        fuse_reply_err(req, ENOENT);
}

/*
 * A .feat read with no handle, as op_open() and read_feat() would serve it (h: the node's
 * kind, path and identity). Returns 0 once replied, or < 0 unreplied (the caller replies).
 */
static int read_feat_node(fuse_req_t req, hapi_fs *fs, fuse_ino_t ino, struct open_file *h,
                          const struct node_content *c, size_t size, off_t off)
{
    int rc;
    /*
     * the view of the node's split: its own (kept since its lookup, so a file read
     * after a split change is still computed at its split), the current one, or one
     * made for the cache alone
     */
    h->view = node_view(fs, ino);
    if (!h->view)
        h->view = hapi_views_peek(fs->views);
    if (h->view && h->view->split != c->split) {
        hapi_view_put(h->view);
        h->view = NULL;
    }
    if (!h->view && (rc = hapi_view_new(fs->views, c->split, &h->view, NULL)) < 0)
        return rc;
    /*
     * The image changed after the kernel looked the .feat up (watch.c had not seen it
     * yet, or the file was found before and read after): its old features if they are
     * cached; else the new ones if this read is the whole file (the kernel reads a
     * .feat in one request; same split, same size), so that no page of one version
     * meets one of another; else ESTALE (ENOENT if it was deleted).
     */
    hapi_source_id now;
    if (((rc = hapi_source_identity(fs->source, h->path, &now)) < 0 ||
         memcmp(&now, &c->id, sizeof(now)) != 0) &&
        !hapi_serve_cached(fs->serve, h->view, h->path, &c->id)) {
        if (rc == 0 && off == 0 && size >= (size_t)c->attr.st_size) {
            h->id = now;
        } else {
            hapi_view_put(h->view);
            return rc < 0 ? rc : -ESTALE;
        }
    }
    read_feat(req, fs, h, size, off);
    hapi_view_put(h->view);
    return 0;
}

/*
 * A pack read with no handle: the node's pack, or for another user a snapshot of now whose
 * check must be the node's. Returns 0 once replied, or < 0 unreplied (the caller replies).
 */
static int read_pack_node(fuse_req_t req, hapi_fs *fs, fuse_ino_t ino, struct open_file *h,
                          const struct node_content *c, size_t size, off_t off)
{
    hapi_cred cred;
    const hapi_cred *who;
    struct node_pack *np = NULL;
    int rc;
    if ((who = req_who(req, &cred))) {
        if ((rc = pack_open_keyed(fs, h->path, who, c->pack_key, &h->pack)) < 0)
            return rc;
        read_pack(req, h, size, off);
        hapi_pack_close(h->pack);
        return 0;
    }
    if ((rc = node_pack_get(fs, ino, h->path, c->pack_key, &np)) < 0)
        return rc;
    h->pack = np->pack;
    read_pack(req, h, size, off);
    node_pack_put(np);
    return 0;
}

/*
 * A read with no handle (no_open): what node ino is, as the lookup that made it fixed it;
 * each kind served as op_open() and its read would serve it together.
 */
void read_node(fuse_req_t req, hapi_fs *fs, fuse_ino_t ino, size_t size, off_t off)
{
    if (ino & CTL_BASE) {
        read_ctl_node(req, fs, ino, size, off);
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
    switch (kind) {
    case HAPI_NODE_FEAT:
        rc = read_feat_node(req, fs, ino, &h, &c, size, off);
        break;
    case HAPI_NODE_PACK:
        rc = read_pack_node(req, fs, ino, &h, &c, size, off);
        break;
    case HAPI_NODE_PACK_INDEX:
        rc = reply_node_text(req, fs, ino, size, off);
        break;
    case HAPI_NODE_FILE:
        if ((rc = hapi_source_open_beneath(fs->source, path, O_RDONLY)) < 0)
            break;
        if (fs->serve)
            hapi_serve_note_passthrough(fs->serve, size);
        reply_fd(req, rc, size, off);
        close(rc);
        rc = 0;
        break;
    default:
        rc = -EISDIR;
        break;
    }
    free(path);
    if (rc < 0)
        fuse_reply_err(req, hapi_fs_errno(rc));
}

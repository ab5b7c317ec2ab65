/* featsrc-local.c — a storage mount's feature source: the source tree's names, .feat computed through serve.c, packs through pack.c. */
#include "fs-int.h"

#include <fuse_lowlevel.h>

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

/* name in parent_path: a pack or its index, a .feat, a directory or a file of the source */
static int local_lookup(hapi_fs *fs, uint64_t parent, const char *parent_path, const char *name,
                        pid_t by, struct fuse_entry_param *e, int *kind, char **path,
                        struct node_content *c, int *has_content)
{
    struct stat src;
    int rc;

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

static int local_getattr(hapi_fs *fs, fuse_ino_t ino, struct stat *st, double *timeout)
{
    struct stat src;
    char *path = NULL;
    int kind, rc;

    struct node_content c;
    if ((rc = node_get(fs, ino, &kind, &path, &c)) < 0 ||
        (rc = hapi_source_stat(fs->source, path, &src)) < 0) {
        if (rc == -ENOENT && path && kind == HAPI_NODE_FEAT)
            hapi_serve_collect(fs->serve, path);
        free(path);
        return rc;
    }
    if (kind == HAPI_NODE_FEAT || kind == HAPI_NODE_PACK) {
        content_attr(&c, &src, st);
    } else if (kind == HAPI_NODE_PACK_INDEX) {
        rc = pack_attr(fs, path, &src, kind, 0, 0, 0, st, &c);
        uint64_t serial;
        hapi_ctl_text *t = fs->no_open && rc == 0 ? node_text(fs, ino, &serial) : NULL;
        if (t) { /* what its lookup made (no_open) */
            made_attr(fs, st, t->len, serial);
            st->st_ino = ino;
        }
        hapi_ctl_text_put(t);
    } else
        source_attr(fs, &src, ino, st);
    *timeout = kind != HAPI_NODE_PACK_INDEX ? node_timeout(fs, ino) : fs->no_open ? 0 : ATTR_TIMEOUT;
    free(path);
    return rc;
}

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

static int local_list(hapi_fs *fs, const char *path, uint64_t self, struct dir_handle *d)
{
    struct stat st;
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

/* A .feat (its split and identity kept), a pack (a snapshot), an index (made now), a file. */
static int local_open(fuse_req_t req, hapi_fs *fs, fuse_ino_t ino, int kind, char **path,
                      const struct node_content *c, struct open_file *h, struct fuse_file_info *fi)
{
    int rc;
    hapi_cred cred; /* read only for what the kernel's mode checks cannot decide */
    (void)ino;
    if (kind == HAPI_NODE_FEAT) {
        /* The source is read when the features are computed; here it must only exist. */
        if ((rc = hapi_source_identity(fs->source, *path, &h->id)) < 0) {
            if (rc == -ENOENT)
                hapi_serve_collect(fs->serve, *path);
            return rc;
        }
        /* The file keeps this split until it is closed, whatever happens meanwhile. */
        if (!(h->view = hapi_views_get(fs->views)))
            return -ENODEV;
        h->path = *path;
        *path = NULL;
        if (c->split == h->view->split && memcmp(&c->id, &h->id, sizeof(h->id)) == 0) {
            /* Features are immutable for a given source identity and namespace. */
            fi->keep_cache = 1;
        } else if ((rc = other_bytes(req, c, fi)) < 0) {
            return rc;
        }
    } else if (kind == HAPI_NODE_PACK) {
        /* A snapshot of the directory now. */
        if ((rc = hapi_pack_open(fs->packs, *path, req_who(req, &cred), &h->pack)) < 0)
            return rc;
        if (hapi_pack_key(h->pack) == c->pack_key) {
            /*
             * keep_cache: the pages the kernel has of this node are its snapshot's rows, and
             * they must stay: a row whose image changed since may be computed again of the
             * new version, and dropping pages at each open would let another reader of this
             * node get half a row from before and half from after.
             */
            fi->keep_cache = 1;
        } else if ((rc = other_bytes(req, c, fi)) < 0) {
            return rc;
        }
    } else if (kind == HAPI_NODE_PACK_INDEX) {
        char *text = NULL;
        size_t len = 0;
        if ((rc = hapi_pack_index(fs->packs, *path, &text, &len)) < 0)
            return rc;
        h->kind = HAPI_NODE_CTL_FILE; /* read like a control file: made now, direct I/O */
        h->text = hapi_ctl_text_new(text, len);
        free(text);
        if (!h->text)
            return -ENOMEM;
        fi->direct_io = 1;
    } else {
        rc = hapi_source_open_beneath(fs->source, *path, O_RDONLY);
        if (rc < 0)
            return rc;
        h->fd = rc;
    }
    return 0;
}

static ssize_t local_read_feat(hapi_fs *fs, struct open_file *h, char *buf, size_t size,
                               off_t off)
{
    return hapi_serve_read(fs->serve, h->view, h->path, &h->id, buf, size, off);
}

/* Passthrough: the kernel splices from the source file where it can. */
static void local_read_file(fuse_req_t req, hapi_fs *fs, struct open_file *h, size_t size,
                            off_t off)
{
    struct fuse_bufvec buf = FUSE_BUFVEC_INIT(size);
    buf.buf[0].flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK;
    buf.buf[0].fd = h->fd;
    buf.buf[0].pos = off;
    if (fs->serve)
        hapi_serve_note_passthrough(fs->serve, size);
    fuse_reply_data(req, &buf, FUSE_BUF_SPLICE_MOVE);
}

static int local_statfs(hapi_fs *fs, struct statvfs *sv)
{
    return fstatvfs(hapi_source_root_fd(fs->source), sv) < 0 ? -errno : 0;
}

const struct feat_source featsrc_local = {
    .lookup = local_lookup,
    .getattr = local_getattr,
    .list = local_list,
    .open = local_open,
    .read_feat = local_read_feat,
    .read_file = local_read_file,
    .statfs = local_statfs,
};

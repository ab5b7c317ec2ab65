/* featsrc-remote.c — a compute-side mount's feature source (-o remote): names, attributes and bytes through remote.c. */
#include "fs-int.h"

#include <fuse_lowlevel.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

/* name in parent_path: whatever the union of the storage mounts has there */
static int remote_lookup(hapi_fs *fs, uint64_t parent, const char *parent_path,
                         const char *name, pid_t by, struct fuse_entry_param *e, int *kind,
                         char **path, struct node_content *c, int *has_content)
{
    int rc;
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

static int remote_getattr(hapi_fs *fs, fuse_ino_t ino, struct stat *st, double *timeout)
{
    struct node_content c;
    char *path = NULL;
    int kind, rc;
    if ((rc = node_get(fs, ino, &kind, &path, &c)) == 0 &&
        (rc = remote_attr(fs, path, &kind, st)) == 0 && st->st_ino != ino &&
        kind == HAPI_NODE_REMOTE_FEAT)
        *st = c.attr; /* the node is of other bytes than the name's now: its own size */
    st->st_ino = ino;
    *timeout = ATTR_TIMEOUT;
    free(path);
    return rc;
}

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

static int remote_list(hapi_fs *fs, const char *path, uint64_t self, struct dir_handle *d)
{
    struct remote_list w = { d, path };
    int rc = dir_add_bare(d, ".", self, S_IFDIR);
    if (rc == 0)
        rc = dir_add_bare(d, "..", FUSE_ROOT_ID, S_IFDIR);
    return rc == 0 ? hapi_remote_list(fs->remote, path, remote_list_one, &w) : rc;
}

/* A .feat (its index entry of now kept), or a storage mount's other file read through. */
static int remote_open(fuse_req_t req, hapi_fs *fs, fuse_ino_t ino, int kind, char **path,
                       const struct node_content *c, struct open_file *h,
                       struct fuse_file_info *fi)
{
    int rc;
    if (kind == HAPI_NODE_REMOTE_FEAT) {
        /* The index entry of now: the bytes of this open file never change. */
        if ((rc = hapi_remote_feat_open(fs->remote, *path, &h->remote_feat)) < 0)
            return rc;
        if (remote_node_id(*path, kind, hapi_remote_feat_key(h->remote_feat)) == ino)
            fi->keep_cache = 1; /* the node's pages are of these bytes */
        else if ((rc = other_bytes(req, c, fi)) < 0)
            return rc;
    } else {
        if ((rc = hapi_remote_open_file(fs->remote, *path)) < 0)
            return rc;
        h->fd = rc;
        struct stat st;
        h->remote_size = fstat(h->fd, &st) == 0 ? st.st_size : 0;
        const char *base = strrchr(*path, '/') ? strrchr(*path, '/') + 1 : *path;
        if (strcmp(base, HAPI_PACK_NAME) == 0) {
            /*
             * A storage mount's pack is a snapshot taken at its open, whose
             * size the attributes do not tell (they show the directory's
             * pack now): read to the end its header says, whatever the
             * kernel was told; a read that ends before it is EIO.
             */
            uint64_t size;
            if ((rc = hapi_remote_pack_file_size(fs->remote, *path, h->fd, &size)) < 0)
                return rc;
            h->remote_size = (off_t)size;
            fi->direct_io = 1;
        } else if (strcmp(base, HAPI_PACK_INDEX_NAME) == 0) {
            /* made at the storage side's open; read whole now, and refused if cut short */
            char *text = NULL;
            size_t len = 0;
            rc = hapi_remote_read_pack_index(fs->remote, *path, h->fd, &text, &len);
            h->fd = -1;
            if (rc < 0)
                return rc;
            h->kind = HAPI_NODE_CTL_FILE; /* read like a control file */
            h->text = hapi_ctl_text_new(text, len);
            free(text);
            if (!h->text)
                return -ENOMEM;
            fi->direct_io = 1;
        }
        h->path = *path; /* for the error a short read records */
        *path = NULL;
    }
    return 0;
}

/* From the cache or the directory's pack. */
static ssize_t remote_read_feat(hapi_fs *fs, struct open_file *h, char *buf, size_t size,
                                off_t off)
{
    return hapi_remote_feat_read(fs->remote, h->remote_feat, buf, size, off);
}

/*
 * A remote mount's file other than a .feat it fetches: read from its source
 * into a buffer, not spliced, so that a read that ends before the size the
 * file had at open is an error, not a short reply. A network filesystem whose
 * server lost the file (sshfs, while a storage daemon restarts) answers such
 * reads with 0 bytes, which a reader would take for the whole file.
 */
static void remote_read_file(fuse_req_t req, hapi_fs *fs, struct open_file *h, size_t size,
                             off_t off)
{
    char *buf = malloc(size ? size : 1);
    size_t got = 0;
    if (!buf) {
        fuse_reply_err(req, ENOMEM);
        return;
    }
    ssize_t n = hapi_remote_pread_all(h->fd, buf, size, off);
    if (n < 0) {
        free(buf);
        fuse_reply_err(req, n == -ENOMEM ? ENOMEM : EIO);
        return;
    }
    got = (size_t)n;
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

/* The cache's filesystem: a dead source must not hang df. */
static int remote_statfs(hapi_fs *fs, struct statvfs *sv)
{
    return statvfs(fs->opt->cache_dir, sv) < 0 ? -errno : 0;
}

const struct feat_source featsrc_remote = {
    .lookup = remote_lookup,
    .getattr = remote_getattr,
    .list = remote_list,
    .open = remote_open,
    .read_feat = remote_read_feat,
    .read_file = remote_read_file,
    .statfs = remote_statfs,
};

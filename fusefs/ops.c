/* ops.c — the FUSE low-level operations: lookups, attributes, listings, opens, reads, releases, refusals; codes mapped to errno. */
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

const char *const hapi_fs_request_names[HAPI_REQ_COUNT] = {
    "lookup", "forget", "getattr", "opendir", "readdir", "releasedir", "open", "read",
    "release", "statfs", "other",
};

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
    if (fs->opt->remote)
        hapi_log(HAPI_LOG_INFO, "mounted %s on %s (remote)", fs->opt->source,
                 fs->opt->mountpoint);
    else
        hapi_log(HAPI_LOG_INFO, "mounted %s on %s (model %s)%s", fs->opt->source,
                 fs->opt->mountpoint, fs->opt->model,
                 fs->no_open ? "; the kernel opens files without asking (no_open)" : "");
}

/*
 * Resolves name in directory parent_path for thread by; fills e, and c for a
 * .feat or pack (*has_content set); returns 0 or a negative errno. Just over 100 lines:
 * one path per kind of name (control, pack, index, .feat, remote, source), in lookup order.
 */
static int resolve(hapi_fs *fs, uint64_t parent, const char *parent_path, const char *name,
                   pid_t by, struct fuse_entry_param *e, int *kind, char **path,
                   struct node_content *c, int *has_content)
{
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
    return fs->src->lookup(fs, parent, parent_path, name, by, e, kind, path, c, has_content);
}

void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
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

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    COUNT(req, HAPI_REQ_GETATTR);
    hapi_fs *fs = fuse_req_userdata(req);
    struct stat st;
    int rc;
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
    double timeout;
    if ((rc = fs->src->getattr(fs, ino, &st, &timeout)) < 0)
        fuse_reply_err(req, -rc);
    else
        fuse_reply_attr(req, &st, timeout);
}

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

/* Adds name + suffix; path (may be NULL) is copied; c (may be NULL) is a .feat's content. */
int dir_add(struct dir_handle *d, const char *name, const char *suffix, int kind,
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
int dir_add_bare(struct dir_handle *d, const char *name, uint64_t ino, mode_t type)
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

/* Lists the source directory path as the mount shows it. */
static int list_source_dir(hapi_fs *fs, const char *path, uint64_t self, struct dir_handle *d)
{
    d->self = self;
    return fs->src->list(fs, path, self, d);
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
void handles_free_all(hapi_fs *fs)
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
const hapi_cred *req_who(fuse_req_t req, hapi_cred *c)
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
int other_bytes(fuse_req_t req, const struct node_content *c, struct fuse_file_info *fi)
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

/*
 * Opens ino: a control file here, anything else by the feature source (fs->src),
 * which checks the node's bytes against the source's (ESTALE, direct_io).
 */
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
    if ((rc = fs->src->open(req, fs, ino, kind, &path, &c, h, fi)) < 0)
        goto fail;
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

void read_feat(fuse_req_t req, hapi_fs *fs, struct open_file *h, size_t size, off_t off)
{
    char stack_buf[FEAT_STACK_BUF];
    char *buf = size <= sizeof(stack_buf) ? stack_buf : malloc(size);
    if (!buf) {
        fuse_reply_err(req, ENOMEM);
        return;
    }
    /* a remote mount's from its cache or its directory's pack; else from serve.c */
    ssize_t n = fs->src->read_feat(fs, h, buf, size, off);
    if (n < 0)
        fuse_reply_err(req, hapi_fs_errno((int)n)); /* the layer has recorded why */
    else
        fuse_reply_buf(req, buf, (size_t)n);
    if (buf != stack_buf)
        free(buf);
}

/* A pack read: rows computed or looked up by pack.c into a buffer of ours. */
void read_pack(fuse_req_t req, struct open_file *h, size_t size, off_t off)
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
    default:
        fs->src->read_file(req, fs, h, size, off); /* a file of the source */
        return;
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
    int rc;
    (void)ino;
    if ((rc = fs->src->statfs(fs, &sv)) < 0) {
        fuse_reply_err(req, -rc);
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

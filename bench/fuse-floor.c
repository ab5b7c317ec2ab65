/*
 * fuse-floor.c — the floor under any FUSE filesystem on this machine, for bench/bench.
 *
 *   fuse-floor SOURCE MOUNTPOINT [-f] [--no-open] [--timeout S]
 *
 * Reads the tree under SOURCE into memory at start, then serves it read-only through the
 * low-level FUSE API doing nothing else per request: lookup, getattr, open, read and release
 * answer from memory. It uses hapifs's FUSE settings (the multithreaded loop with up to 32
 * workers, keep_cache, 1 s entry and attribute timeouts, max_background 256), so reading it
 * with the readers that read hapifs tells how fast a FUSE filesystem can serve small files
 * here at all: the part of a warm epoch that no daemon work can remove.
 * Unmount with fusermount3 -u MOUNTPOINT. Not installed; a measuring tool, not a product.
 */
#define FUSE_USE_VERSION 314
#include <fuse_lowlevel.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static double timeout = 1.0; /* entry and attribute timeouts (--timeout) */
static int no_open;           /* --no-open: open answers ENOSYS, FUSE_CAP_NO_OPEN_SUPPORT */

/* One file or directory; ino is its index + 1 (FUSE_ROOT_ID is the root). */
struct node {
    char *name;
    size_t parent;      /* index of the parent */
    int is_dir;
    char *data;         /* file contents */
    size_t size;
    size_t *children;   /* indices, for a directory */
    size_t nchildren;
};

static struct node *nodes;
static size_t nnodes, cap;

static size_t add_node(const char *name, size_t parent, int is_dir)
{
    if (nnodes == cap) {
        cap = cap ? cap * 2 : 1024;
        nodes = realloc(nodes, cap * sizeof(*nodes));
        if (!nodes) {
            perror("fuse-floor");
            exit(1);
        }
    }
    nodes[nnodes] = (struct node){.name = strdup(name), .parent = parent, .is_dir = is_dir};
    if (nnodes > 0) {
        struct node *p = &nodes[parent];
        p->children = realloc(p->children, (p->nchildren + 1) * sizeof(size_t));
        if (!p->children) {
            perror("fuse-floor");
            exit(1);
        }
        p->children[p->nchildren++] = nnodes;
    }
    return nnodes++;
}

static int load_file(const char *path, struct node *n)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0)
        return -1;
    n->data = malloc(st.st_size ? (size_t)st.st_size : 1);
    size_t got = 0;
    while (n->data && got < (size_t)st.st_size) {
        ssize_t r = read(fd, n->data + got, (size_t)st.st_size - got);
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    close(fd);
    n->size = got;
    return n->data && got == (size_t)st.st_size ? 0 : -1;
}

static int load_tree(const char *path, size_t self)
{
    DIR *d = opendir(path);
    if (!d)
        return -1;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        char sub[PATH_MAX];
        struct stat st;
        snprintf(sub, sizeof(sub), "%s/%s", path, de->d_name);
        if (lstat(sub, &st) < 0)
            continue;
        if (S_ISDIR(st.st_mode)) {
            size_t k = add_node(de->d_name, self, 1);
            if (load_tree(sub, k) < 0) {
                closedir(d);
                return -1;
            }
        } else if (S_ISREG(st.st_mode)) {
            size_t k = add_node(de->d_name, self, 0);
            if (load_file(sub, &nodes[k]) < 0) {
                fprintf(stderr, "fuse-floor: cannot read %s\n", sub);
                closedir(d);
                return -1;
            }
        }
    }
    closedir(d);
    return 0;
}

static struct node *node_of(fuse_ino_t ino)
{
    return ino >= 1 && ino <= nnodes ? &nodes[ino - 1] : NULL;
}

static void fill_stat(fuse_ino_t ino, struct stat *st)
{
    const struct node *n = &nodes[ino - 1];
    memset(st, 0, sizeof(*st));
    st->st_ino = ino;
    st->st_mode = n->is_dir ? S_IFDIR | 0555 : S_IFREG | 0444;
    st->st_nlink = n->is_dir ? 2 : 1;
    st->st_size = (off_t)n->size;
    st->st_blksize = 4096;
    st->st_blocks = (blkcnt_t)((n->size + 511) / 512);
}

static void op_init(void *userdata, struct fuse_conn_info *conn)
{
    (void)userdata;
    conn->max_background = 256;
    conn->congestion_threshold = 192;
    if (no_open && (conn->capable & FUSE_CAP_NO_OPEN_SUPPORT))
        conn->want |= FUSE_CAP_NO_OPEN_SUPPORT;
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    struct node *p = node_of(parent);
    if (!p || !p->is_dir) {
        fuse_reply_err(req, ENOTDIR);
        return;
    }
    for (size_t i = 0; i < p->nchildren; i++) {
        if (strcmp(nodes[p->children[i]].name, name) == 0) {
            struct fuse_entry_param e = {.ino = p->children[i] + 1,
                                         .attr_timeout = timeout, .entry_timeout = timeout};
            fill_stat(e.ino, &e.attr);
            fuse_reply_entry(req, &e);
            return;
        }
    }
    fuse_reply_err(req, ENOENT);
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)fi;
    struct stat st;
    if (!node_of(ino)) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    fill_stat(ino, &st);
    fuse_reply_attr(req, &st, timeout);
}

static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct node *n = node_of(ino);
    if (!n || n->is_dir) {
        fuse_reply_err(req, n ? EISDIR : ENOENT);
        return;
    }
    if ((fi->flags & O_ACCMODE) != O_RDONLY) {
        fuse_reply_err(req, EROFS);
        return;
    }
    if (no_open) {
        /* The kernel stops sending opens and releases for every file of the mount. */
        fuse_reply_err(req, ENOSYS);
        return;
    }
    fi->keep_cache = 1;
    fuse_reply_open(req, fi);
}

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                    struct fuse_file_info *fi)
{
    (void)fi;
    struct node *n = node_of(ino);
    if (!n || off < 0 || (size_t)off >= n->size) {
        fuse_reply_buf(req, NULL, 0);
        return;
    }
    if (size > n->size - (size_t)off)
        size = n->size - (size_t)off;
    fuse_reply_buf(req, n->data + off, size);
}

static void op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                       struct fuse_file_info *fi)
{
    (void)fi;
    struct node *d = node_of(ino);
    if (!d || !d->is_dir) {
        fuse_reply_err(req, ENOTDIR);
        return;
    }
    char *buf = malloc(size);
    size_t used = 0;
    if (!buf) {
        fuse_reply_err(req, ENOMEM);
        return;
    }
    for (size_t i = (size_t)off; i < d->nchildren; i++) {
        struct stat st;
        fill_stat(d->children[i] + 1, &st);
        size_t len = fuse_add_direntry(req, buf + used, size - used,
                                       nodes[d->children[i]].name, &st, (off_t)(i + 1));
        if (len > size - used)
            break;
        used += len;
    }
    fuse_reply_buf(req, buf, used);
    free(buf);
}

static const struct fuse_lowlevel_ops ops = {
    .init = op_init,
    .lookup = op_lookup,
    .getattr = op_getattr,
    .open = op_open,
    .read = op_read,
    .readdir = op_readdir,
};

int main(int argc, char **argv)
{
    int foreground = 0;
    for (int i = 3; i < argc; i++) {
        if (strcmp(argv[i], "-f") == 0) {
            foreground = 1;
        } else if (strcmp(argv[i], "--no-open") == 0) {
            no_open = 1;
        } else if (strcmp(argv[i], "--timeout") == 0 && i + 1 < argc) {
            timeout = atof(argv[++i]);
        } else {
            argc = 0;
            break;
        }
    }
    if (argc < 3) {
        fprintf(stderr, "usage: fuse-floor SOURCE MOUNTPOINT [-f] [--no-open] [--timeout S]\n");
        return 2;
    }
    add_node("", 0, 1);
    if (load_tree(argv[1], 0) < 0) {
        fprintf(stderr, "fuse-floor: cannot load %s\n", argv[1]);
        return 1;
    }
    char *fargv[] = {argv[0], "-o", "ro,fsname=fuse-floor,subtype=fuse-floor", NULL};
    struct fuse_args args = FUSE_ARGS_INIT(3, fargv);
    struct fuse_session *se = fuse_session_new(&args, &ops, sizeof(ops), NULL);
    if (!se || fuse_set_signal_handlers(se) < 0 || fuse_session_mount(se, argv[2]) < 0) {
        fprintf(stderr, "fuse-floor: cannot mount on %s\n", argv[2]);
        return 1;
    }
    fuse_daemonize(foreground);
    struct fuse_loop_config *loop = fuse_loop_cfg_create();
    fuse_loop_cfg_set_clone_fd(loop, 0);
    fuse_loop_cfg_set_max_threads(loop, 32);
    fuse_loop_cfg_set_idle_threads(loop, 8);
    int rc = fuse_session_loop_mt(se, loop);
    fuse_loop_cfg_destroy(loop);
    fuse_session_unmount(se);
    fuse_remove_signal_handlers(se);
    fuse_session_destroy(se);
    return rc == 0 ? 0 : 1;
}

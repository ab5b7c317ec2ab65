/* attr.c — attribute synthesis: the ids and attributes of source files, .feat files, packs, a remote mount's entries and the control files. */
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

/* ------------------------------------------------------- the source tree */

/* The id of a source file or directory. */
uint64_t node_id_for(const hapi_fs *fs, const struct stat *st)
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
void source_attr(const hapi_fs *fs, const struct stat *src, uint64_t id, struct stat *st)
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
uint64_t remote_node_id(const char *path, int kind, uint64_t key)
{
    uint64_t h = XXH3_64bits_withSeed(path, strlen(path),
                                      kind == HAPI_NODE_REMOTE_FEAT ? key : 0) &
                 ((1ull << 61) - 1);
    return HASHED_BASE | h << 1 | (uint64_t)(kind == HAPI_NODE_REMOTE_FEAT);
}

int remote_node_kind(int remote_kind)
{
    return remote_kind == HAPI_REMOTE_DIR    ? HAPI_NODE_DIR
           : remote_kind == HAPI_REMOTE_FEAT ? HAPI_NODE_REMOTE_FEAT
                                             : HAPI_NODE_FILE;
}

/* Attributes of path on a remote mount, its node kind and id. Returns 0 or a negative errno. */
int remote_attr(hapi_fs *fs, const char *path, int *kind, struct stat *st)
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
void remote_feat_content(const struct stat *st, uint64_t parent, pid_t by,
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
void feat_node(const hapi_view *v, const struct stat *src, uint64_t parent, pid_t by,
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
int pack_attr(hapi_fs *fs, const char *dir, const struct stat *dir_st, int kind,
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

void ctl_dir_attr(const hapi_fs *fs, struct stat *st)
{
    memset(st, 0, sizeof(*st));
    st->st_ino = CTL_DIR_ID;
    st->st_mode = S_IFDIR | 0555;
    st->st_nlink = 2;
    st->st_mtim.tv_sec = (time_t)(fs->started_realtime);
    st->st_ctim = st->st_atim = st->st_mtim;
}

int ctl_index(const char *name)
{
    for (int i = 0; hapi_ctl_files[i]; i++)
        if (strcmp(name, hapi_ctl_files[i]) == 0)
            return i;
    return -1;
}

/* The index in hapi_ctl_files of a control file's node id, or -1. */
int ctl_file_index(fuse_ino_t ino)
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
void ctl_file_attr(hapi_fs *fs, int index, struct stat *st)
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

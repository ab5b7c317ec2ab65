/* source.h — the source tree: beneath-the-root opens, identities, loads, the walker; who asks. */
#ifndef HAPI_FUSEFS_SOURCE_H
#define HAPI_FUSEFS_SOURCE_H

#include <stdatomic.h>
#include <stddef.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "cache.h"
#include "hapi.h"

/*
 * The source tree, opened once: every path is relative to its root ("" is
 * the root) and resolved beneath it (symlinks may not leave it, magic links
 * are refused). Immutable after open; every function is thread-safe.
 */
typedef struct hapi_source hapi_source;

/* Opens root (a directory). Returns 0, or -errno with err; *out is NULL on failure. */
int hapi_source_open(const char *root, hapi_source **out, hapi_error *err);
/* Closes it. Accepts NULL. */
void hapi_source_close(hapi_source *s);

/* The root's O_PATH descriptor (owned by s) and device. */
int hapi_source_root_fd(const hapi_source *s);
dev_t hapi_source_dev(const hapi_source *s);

/*
 * Opens path beneath the root with openat(2) flags. Returns an fd (the
 * caller closes it) or -errno; a path that would leave the root is -ENOENT.
 */
int hapi_source_open_beneath(const hapi_source *s, const char *path, int flags);

/* stat() of path beneath the root, following symlinks that stay beneath it. Returns 0 or -errno. */
int hapi_source_stat(const hapi_source *s, const char *path, struct stat *st);

/* The identity (size, times, inode) that st describes. */
void hapi_source_identity_of(const struct stat *st, hapi_source_id *id);

/*
 * Who asks: a request's user and groups, for what the kernel's mode checks
 * (default_permissions) cannot decide on their own: a pack's images, the
 * names in .hapifs/errors, .hapifs/ctl.
 */
#define HAPI_CRED_GROUPS 64
typedef struct hapi_cred {
    uid_t uid;
    gid_t gid;
    int ngroups;                    /* of groups; more than HAPI_CRED_GROUPS are not seen */
    gid_t groups[HAPI_CRED_GROUPS]; /* supplementary */
} hapi_cred;

/*
 * Reads the supplementary groups of process (or thread) pid from
 * /proc/PID/status into groups (at most max). Returns their count, which may
 * exceed max (the rest are not read), or -errno. (libfuse's
 * fuse_req_getgroups does the same, but reads past its buffer: AddressSanitizer
 * reported it in Debian 12's libfuse 3.14.)
 */
int hapi_cred_read_groups(pid_t pid, gid_t *groups, int max);

/* 1 when c is in group g (primary or supplementary), else 0. */
int hapi_cred_in_group(const hapi_cred *c, gid_t g);

/*
 * 1 when c may do mask (R_OK, X_OK, or both) on a file of attributes st by
 * its mode bits, as the kernel decides without ACLs (root may read and
 * search anything, and run what has an x bit), else 0. NULL c may.
 */
int hapi_cred_may(const hapi_cred *c, const struct stat *st, int mask);

/*
 * 1 when c could learn path's name from the source tree: search on every
 * directory from the root to path's parent and read on that parent (so
 * listing it shows the name), else 0 (also when path cannot be reached).
 * NULL c may. path "" (the root) is always seen.
 */
int hapi_source_may_see(const hapi_source *s, const hapi_cred *c, const char *path);

/* The identity of the regular file path. Returns 0, -EINVAL (not a regular file) or -errno. */
int hapi_source_identity(const hapi_source *s, const char *path, hapi_source_id *id);

/*
 * Reads the whole file path into *data (malloc'd, the caller frees; *size
 * bytes), with in *id (may be NULL) the identity it had throughout the read:
 * a file changed while being read is read again (three tries, then -EAGAIN).
 * Returns 0 or < 0 with err; *data is NULL on failure.
 */
int hapi_source_load(const hapi_source *s, const char *path, void **data, size_t *size,
                     hapi_source_id *id, hapi_error *err);

/* What hapi_source_walk() calls its function with; valid during the call only. */
typedef struct hapi_source_entry {
    const char *path;        /* relative to the root */
    const char *name;        /* the last component of path */
    int is_image;            /* an image name (hapi_image_name_is_image) */
    const struct stat *st;   /* with HAPI_WALK_STAT: what path leads to; else NULL */
} hapi_source_entry;

enum hapi_walk_flags {
    HAPI_WALK_RECURSE = 1,  /* descend into directories, depth first */
    HAPI_WALK_STAT = 2,     /* stat every entry; those that cannot be are skipped */
    HAPI_WALK_ALL = 4,      /* call fn for every directory and regular file, not only images */
};

/*
 * Calls fn for the entries of directory dir ("" = the root): without
 * HAPI_WALK_ALL only for images (by name and, with HAPI_WALK_STAT, a regular
 * file), with it for every directory and regular file too. Stops when fn
 * returns < 0 (that code is returned) or *stop (may be NULL) is set. Returns
 * 0 or < 0; a dir that is not a directory is empty (0).
 */
int hapi_source_walk(const hapi_source *s, const char *dir, int flags, atomic_int *stop,
                     int (*fn)(const hapi_source_entry *e, void *arg), void *arg);

/* dir/name ("" dir: name alone), malloc'd; NULL when out of memory. */
char *hapi_path_join(const char *dir, const char *name);

/* A path's length for estimates of the store's size ("train/n01440764/n01440764_10026.JPEG"). */
#define HAPI_TYPICAL_PATH 40

#endif

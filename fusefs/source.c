/* source.c — the source tree: opens and stats beneath its root, file identities, whole-file loads, the one tree walker. */
#include "source.h"
#include "cache.h"
#include "extractor.h"
#include "hapi.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

struct hapi_source {
    int root_fd; /* O_PATH of the root */
    dev_t dev;
};

int hapi_source_open(const char *root, hapi_source **out, hapi_error *err)
{
    struct stat st;
    *out = NULL;
    hapi_source *s = calloc(1, sizeof(*s));
    if (!s)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    s->root_fd = open(root, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (s->root_fd < 0 || fstat(s->root_fd, &st) < 0) {
        int rc = -errno;
        if (s->root_fd >= 0)
            close(s->root_fd);
        free(s);
        return hapi_error_set(err, rc, "source %s: %s", root, strerror(-rc));
    }
    s->dev = st.st_dev;
    *out = s;
    return 0;
}

void hapi_source_close(hapi_source *s)
{
    if (!s)
        return;
    close(s->root_fd);
    free(s);
}

int hapi_source_root_fd(const hapi_source *s)
{
    return s->root_fd;
}

dev_t hapi_source_dev(const hapi_source *s)
{
    return s->dev;
}

char *hapi_path_join(const char *dir, const char *name)
{
    char *p = NULL;
    if (asprintf(&p, "%s%s%s", dir, *dir ? "/" : "", name) < 0)
        return NULL;
    return p;
}

int hapi_source_open_beneath(const hapi_source *s, const char *path, int flags)
{
    struct open_how how = {
        .flags = (uint64_t)(flags | O_CLOEXEC),
        .resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS,
    };
    /* glibc 2.36 has no openat2() wrapper. */
    long fd = syscall(SYS_openat2, s->root_fd, *path ? path : ".", &how, sizeof(how));
    if (fd < 0)
        return errno == EXDEV ? -ENOENT : -errno;
    return (int)fd;
}

int hapi_source_stat(const hapi_source *s, const char *path, struct stat *st)
{
    int fd = hapi_source_open_beneath(s, path, O_PATH);
    if (fd < 0)
        return fd;
    int rc = fstat(fd, st) < 0 ? -errno : 0;
    close(fd);
    return rc;
}

void hapi_source_identity_of(const struct stat *st, hapi_source_id *id)
{
    *id = (hapi_source_id){
        .size = (uint64_t)st->st_size,
        .mtime_ns = (int64_t)st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec,
        .ctime_ns = (int64_t)st->st_ctim.tv_sec * 1000000000 + st->st_ctim.tv_nsec,
        .ino = (uint64_t)st->st_ino,
    };
}

int hapi_cred_in_group(const hapi_cred *c, gid_t g)
{
    if (c->gid == g)
        return 1;
    for (int i = 0; i < c->ngroups && i < HAPI_CRED_GROUPS; i++)
        if (c->groups[i] == g)
            return 1;
    return 0;
}

int hapi_cred_may(const hapi_cred *c, const struct stat *st, int mask)
{
    if (!c)
        return 1;
    mode_t want = (mode_t)(((mask & R_OK) ? 4 : 0) | ((mask & X_OK) ? 1 : 0));
    if (c->uid == 0)
        return !(mask & X_OK) || S_ISDIR(st->st_mode) || (st->st_mode & 0111);
    mode_t bits = c->uid == st->st_uid                 ? (st->st_mode >> 6) & 7
                  : hapi_cred_in_group(c, st->st_gid) ? (st->st_mode >> 3) & 7
                                                        : st->st_mode & 7;
    return (bits & want) == want;
}

int hapi_source_may_see(const hapi_source *s, const hapi_cred *c, const char *path)
{
    if (!c || !*path)
        return 1;
    char *copy = strdup(path);
    if (!copy)
        return 0;
    /* every directory above path: search; its parent: read too */
    int ok = 1;
    char *end = strrchr(copy, '/');
    struct stat st;
    if (hapi_source_stat(s, "", &st) < 0 || !hapi_cred_may(c, &st, X_OK | (end ? 0 : R_OK)))
        ok = 0;
    for (char *slash = copy; ok && end && (slash = strchr(slash, '/')); slash++) {
        *slash = '\0';
        if (hapi_source_stat(s, copy, &st) < 0 || !S_ISDIR(st.st_mode) ||
            !hapi_cred_may(c, &st, X_OK | (slash == end ? R_OK : 0)))
            ok = 0;
        *slash = '/';
    }
    free(copy);
    return ok;
}

int hapi_source_identity(const hapi_source *s, const char *path, hapi_source_id *id)
{
    struct stat st;
    int rc = hapi_source_stat(s, path, &st);
    if (rc == 0 && !S_ISREG(st.st_mode))
        rc = -EINVAL;
    if (rc == 0)
        hapi_source_identity_of(&st, id);
    return rc;
}

int hapi_cred_read_groups(pid_t pid, gid_t *groups, int max)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    char *buf;
    size_t used;
    int rc = hapi_read_all(fd, 4096, &buf, &used); /* a status is a few KiB */
    close(fd);
    if (rc < 0)
        return rc;
    buf[used] = '\0'; /* hapi_read_all leaves room for it */
    const char *line = strstr(buf, "\nGroups:");
    int count = line ? 0 : -EIO;
    for (const char *p = line ? line + 8 : ""; *p && *p != '\n';) {
        char *end;
        unsigned long g = strtoul(p, &end, 10);
        if (end == p) {
            p++;
            continue;
        }
        if (count < max)
            groups[count] = (gid_t)g;
        count++;
        p = end;
    }
    free(buf);
    return count;
}

/*
 * A file replaced or rewritten during the read is read again, so the
 * features stored under an identity are those of exactly that content: a
 * reader gets the old or the new features, never a mix.
 */
int hapi_source_load(const hapi_source *s, const char *path, void **data, size_t *size,
                     hapi_source_id *id, hapi_error *err)
{
    *data = NULL;
    for (int attempt = 0; attempt < 3; attempt++) {
        struct stat before, after;
        int fd = hapi_source_open_beneath(s, path, O_RDONLY);
        if (fd < 0)
            return hapi_error_set(err, fd, "cannot open the source: %s", hapi_strerror(fd));
        if (fstat(fd, &before) < 0) {
            int rc = -errno;
            close(fd);
            return hapi_error_set(err, rc, "cannot stat the source: %s", hapi_strerror(rc));
        }
        char *buf = NULL;
        size_t used = 0;
        int rc = hapi_read_all(fd, (size_t)before.st_size, &buf, &used);
        if (rc == 0 && fstat(fd, &after) < 0) {
            rc = -errno;
            free(buf);
        }
        close(fd);
        if (rc < 0)
            return hapi_error_set(err, rc, "cannot read the source: %s", hapi_strerror(rc));
        hapi_source_id a, b;
        hapi_source_identity_of(&before, &a);
        hapi_source_identity_of(&after, &b);
        if (memcmp(&a, &b, sizeof(a)) == 0 && used == a.size) {
            if (id)
                *id = a;
            *data = buf;
            *size = used;
            return 0;
        }
        free(buf); /* changed under us: read it again */
    }
    return hapi_error_set(err, -EAGAIN, "the source kept changing while being read");
}

/* ------------------------------------------------------------------ walker */

/*
 * One walker for every purpose: readdir (each entry stat'ed, as the mount
 * shows it) and the background walks over 10^5–10^6 files (d_type only, a
 * stat only for symlinks and unknown types that might be directories).
 */
int hapi_source_walk(const hapi_source *s, const char *dir, int flags, atomic_int *stop,
                     int (*fn)(const hapi_source_entry *e, void *arg), void *arg)
{
    int fd = hapi_source_open_beneath(s, dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0)
        return fd == -ENOTDIR ? 0 : fd;
    DIR *d = fdopendir(fd);
    if (!d) {
        int rc = -errno;
        close(fd);
        return rc;
    }
    int rc = 0;
    while (rc >= 0 && !(stop && atomic_load(stop))) {
        errno = 0;
        struct dirent *de = readdir(d);
        if (!de) {
            rc = errno ? -errno : 0;
            break;
        }
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
            continue;
        char *child = NULL;
        if (asprintf(&child, "%s%s%s", dir, *dir ? "/" : "", de->d_name) < 0) {
            rc = -ENOMEM;
            break;
        }
        hapi_source_entry e = { child, de->d_name, hapi_image_name_is_image(de->d_name), NULL };
        struct stat st;
        int is_dir, is_reg;
        if (flags & HAPI_WALK_STAT) {
            /* A symlink counts as what it leads to, if that is beneath the root. */
            if (hapi_source_stat(s, child, &st) < 0) {
                free(child);
                continue;
            }
            e.st = &st;
            is_dir = S_ISDIR(st.st_mode);
            is_reg = S_ISREG(st.st_mode);
        } else {
            int maybe = de->d_type == DT_LNK || de->d_type == DT_UNKNOWN;
            is_reg = de->d_type == DT_REG || (maybe && e.is_image);
            is_dir = de->d_type == DT_DIR;
            if (maybe && !e.is_image && (flags & (HAPI_WALK_RECURSE | HAPI_WALK_ALL)))
                is_dir = hapi_source_stat(s, child, &st) == 0 && S_ISDIR(st.st_mode);
        }
        if (is_dir) {
            if (flags & HAPI_WALK_ALL)
                rc = fn(&e, arg);
            if (rc >= 0 && (flags & HAPI_WALK_RECURSE))
                rc = hapi_source_walk(s, child, flags, stop, fn, arg);
        } else if (is_reg && (e.is_image || (flags & HAPI_WALK_ALL))) {
            rc = fn(&e, arg);
        }
        free(child);
    }
    closedir(d);
    return rc;
}

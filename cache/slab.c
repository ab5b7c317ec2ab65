/* slab.c — slab files: one file of fixed-size slots per slot size; opening, reading, writing, trimming, emptying them. */
#include "cache-priv.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

/*
 * The descriptor of the slab file of slot_size, opened (and with create,
 * created) on first use; -errno if it cannot be opened, -EMFILE when
 * SLAB_CLASSES sizes are open already. Lock-free once open: lookups call it.
 */
int hapi_cache__slab_fd(hapi_cache *c, uint32_t slot_size, bool create)
{
    int n = atomic_load_explicit(&c->slab_count, memory_order_acquire);
    for (int i = 0; i < n; i++)
        if (c->slabs[i].slot_size == slot_size)
            return c->slabs[i].fd;
    pthread_mutex_lock(&c->slab_lock);
    int fd;
    n = atomic_load_explicit(&c->slab_count, memory_order_relaxed);
    for (int i = 0; i < n; i++) {
        if (c->slabs[i].slot_size == slot_size) {
            fd = c->slabs[i].fd;
            goto out;
        }
    }
    if (n == SLAB_CLASSES) {
        fd = -EMFILE;
        goto out;
    }
    char path[PATH_MAX];
    if (snprintf(path, sizeof(path), "%s/%u", c->slab_dir, slot_size) >= (int)sizeof(path)) {
        fd = -ENAMETOOLONG;
        goto out;
    }
    fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW | (create ? O_CREAT : 0), 0644);
    if (fd < 0) {
        fd = -errno;
        goto out;
    }
    c->slabs[n] = (struct slab){ .slot_size = slot_size, .fd = fd };
    atomic_store_explicit(&c->slab_count, n + 1, memory_order_release);
out:
    pthread_mutex_unlock(&c->slab_lock);
    return fd;
}

/*
 * Reads the bytes of a slab value v (checked by hapi_cache__value_check(): ref and size
 * filled) into a new buffer, and verifies them against v's checksum. Returns
 * CHECK_OK with *out (the caller frees it), CHECK_BAD (no such file, a short
 * read, a checksum that differs: the slot was reused, never written, or
 * damaged), or -ENOMEM.
 */
int hapi_cache__slab_read(hapi_cache *c, const MDB_val *v, const struct slab_ref *ref, size_t size,
                          uint8_t **out)
{
    const uint8_t *p = v->mv_data;
    uint32_t path_len = get_le32(p + 12);
    *out = NULL;
    int fd = hapi_cache__slab_fd(c, ref->slot_size, false);
    if (fd < 0)
        return CHECK_BAD;
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf)
        return -ENOMEM;
    off_t offset = (off_t)(ref->slot * ref->slot_size);
    size_t done = 0;
    while (done < size) {
        ssize_t r = pread(fd, buf + done, size - done, offset + (off_t)done);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        done += (size_t)r;
    }
    if (done < size ||
        hapi_cache__value_checksum(p, p + HAPI_CACHE__HEADER_SIZE, path_len, buf, size) !=
            get_le64(p + 56)) {
        free(buf);
        return CHECK_BAD;
    }
    *out = buf;
    return CHECK_OK;
}

/* Writes size bytes at offset of fd, whole. Returns 0 or an errno (positive, as LMDB's are). */
int hapi_cache__write_full(int fd, const void *data, size_t size, off_t offset)
{
    const uint8_t *p = data;
    while (size > 0) {
        ssize_t w = pwrite(fd, p, size, offset);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            return errno;
        if (w == 0)
            return EIO;
        p += w;
        size -= (size_t)w;
        offset += w;
    }
    return 0;
}

/*
 * Cuts the slab files this process has open to their high-water marks as
 * txn, a write transaction that has changed nothing yet, sees them: the
 * committed marks. LMDB's write lock keeps every other writer out, so no slot
 * past a mark is being written, and none is named by a committed entry.
 * A failed truncation leaves bytes past the mark, which later slots overwrite.
 */
void hapi_cache__slab_trim(hapi_cache *c, MDB_txn *txn)
{
    int n = atomic_load_explicit(&c->slab_count, memory_order_acquire);
    for (int i = 0; i < n; i++) {
        struct slab_class sc;
        struct stat st;
        off_t end;
        if (hapi_cache__class_get(c, txn, c->slabs[i].slot_size, &sc) != 0)
            continue;
        end = (off_t)(sc.high * c->slabs[i].slot_size);
        if (fstat(c->slabs[i].fd, &st) == 0 && st.st_size > end)
            (void)!ftruncate(c->slabs[i].fd, end);
    }
    c->trim_pending = false;
}

/*
 * Empties the slab files found in the slab directory: those of a store that
 * is gone (a new data.mdb, or a reset one). Called while creating a store, in
 * its first write transaction. Returns 0 or -errno.
 */
int hapi_cache__slab_files_empty(hapi_cache *c)
{
    DIR *d = opendir(c->slab_dir);
    struct dirent *e;
    if (!d)
        return -errno;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] < '1' || e->d_name[0] > '9')
            continue; /* ".", "..", and nothing of ours */
        int fd = openat(dirfd(d), e->d_name, O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0)
            continue;
        int rc = ftruncate(fd, 0);
        close(fd);
        if (rc != 0) {
            rc = -errno;
            closedir(d);
            return rc;
        }
    }
    closedir(d);
    return 0;
}

/* open.c — opening and closing a store: the LMDB environment, its databases and format, a reset of a foreign or damaged store. */
#include "cache-priv.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define DEFAULT_MAX_BYTES (UINT64_C(1) << 30)
#define DEFAULT_MAX_READERS 512

/* Pooled read transactions keep their reader slot; leave most slots to bursts and other processes. */
#define POOL_MAX 64

/* Creates and opens c->env on c->dir; on failure c->env is NULL and err says why. */
static int env_open(hapi_cache *c, uint64_t max_bytes, int max_readers, hapi_error *err)
{
    const char *dir = c->dir;
    MDB_stat st;
    int rc;

    rc = mdb_env_create(&c->env);
    if (rc) {
        c->env = NULL;
        return hapi_error_set(err, HAPI_ECACHE, "cache %s: %s", dir, mdb_strerror(rc));
    }
    if ((rc = mdb_env_set_mapsize(c->env, (size_t)max_bytes)) != 0 ||
        (rc = mdb_env_set_maxreaders(c->env, (unsigned)max_readers)) != 0 ||
        (rc = mdb_env_set_maxdbs(c->env, MAX_DBS)) != 0) {
        rc = hapi_error_set(err, HAPI_ECACHE, "cache %s: %s", dir, mdb_strerror(rc));
        goto fail;
    }

    /*
     * MDB_NOTLS: FUSE serves lookups from a pool of worker threads and the
     *   value of a lookup is released after the reply, so reader slots must
     *   belong to transactions, not threads; it also lets us pool reset
     *   transactions and renew them from any thread.
     * MDB_NOSYNC: the store is a cache that can be rebuilt. Without a flush
     *   per commit a put costs no fsync. It costs no safety against a
     *   crash of the process (kill -9 at any moment): without MDB_WRITEMAP,
     *   LMDB writes a transaction's pages with write() to the file, then its
     *   meta page; whatever the kernel got is in the page cache, and a commit
     *   the process did not finish never reached the meta page, so a reopen
     *   sees the last finished commit, whole. Only a crash of the OS or the
     *   disk can lose recent commits (never integrity, since the meta page
     *   points only at pages LMDB does not reuse until two commits later);
     *   they are recomputed. close() flushes once.
     * MDB_NORDAHEAD: lookups come in the random order of shuffled epochs;
     *   readahead would fill the page cache with neighbouring entries no
     *   one asked for and push out the ones being read.
     */
    rc = mdb_env_open(c->env, dir, MDB_NOTLS | MDB_NOSYNC | MDB_NORDAHEAD, 0644);
    if (rc) {
        if (rc == MDB_INVALID || rc == MDB_VERSION_MISMATCH || rc == MDB_CORRUPTED)
            rc = hapi_error_set(err, HAPI_ECORRUPT, "cache %s/data.mdb: %s", dir,
                                mdb_strerror(rc));
        else if (rc > 0)
            rc = hapi_error_set(err, -rc, "cache %s: cannot open the LMDB store: %s", dir,
                                mdb_strerror(rc));
        else
            rc = hapi_error_set(err, HAPI_ECACHE, "cache %s: cannot open the LMDB store: %s",
                                dir, mdb_strerror(rc));
        goto fail;
    }
    /* A process that died inside a read leaves its slot taken, pinning old pages: free such slots. */
    rc = mdb_reader_check(c->env, &c->stale_readers_cleared);
    if (rc) {
        rc = hapi_error_set(err, HAPI_ECACHE, "cache %s: reader check: %s", dir,
                            mdb_strerror(rc));
        goto fail;
    }
    if (mdb_env_get_maxkeysize(c->env) < HAPI_CACHE__KEY_MAX) {
        rc = hapi_error_set(err, HAPI_ECACHE, "cache %s: LMDB keys limited to %d bytes, need %d",
                            dir, mdb_env_get_maxkeysize(c->env), HAPI_CACHE__KEY_MAX);
        goto fail;
    }
    mdb_env_stat(c->env, &st);
    c->psize = st.ms_psize;
    /* LMDB's me_nodemax: half a page's room, less an index slot, even. */
    c->node_max = (((c->psize - 16) / 2) & ~1u) - 2;
    rc = hapi_cache__databases_init(c, err);
    if (rc)
        goto fail;
    return 0;

fail:
    mdb_env_close(c->env); /* also after a failed mdb_env_open, as LMDB requires */
    c->env = NULL;
    return rc;
}

/*
 * Replaces the store in dir by nothing, for a fresh one: data.mdb is kept
 * aside as data.mdb.reset, lock.mdb removed. LMDB holds a shared fcntl lock
 * on the first byte of lock.mdb in every process that has the store open:
 * if we cannot take it exclusively, the store is in use and stays.
 */
static int reset_store(const char *dir, hapi_error *err)
{
    char data[PATH_MAX], aside[PATH_MAX], lock[PATH_MAX];
    int fd, rc = 0;

    if (snprintf(data, sizeof(data), "%s/data.mdb", dir) >= (int)sizeof(data) ||
        snprintf(aside, sizeof(aside), "%s/data.mdb.reset", dir) >= (int)sizeof(aside) ||
        snprintf(lock, sizeof(lock), "%s/lock.mdb", dir) >= (int)sizeof(lock))
        return hapi_error_set(err, -ENAMETOOLONG, "cache %s: path too long", dir);
    fd = open(lock, O_RDWR | O_CLOEXEC);
    if (fd >= 0) {
        struct flock fl = { .l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1 };
        if (fcntl(fd, F_SETLK, &fl) != 0) {
            close(fd);
            return hapi_error_set(err, HAPI_ECORRUPT,
                                  "cache %s/data.mdb: cannot reset a store another process has open",
                                  dir);
        }
    }
    /* Removing files while holding the lock: no process can open the old store meanwhile. */
    if (rename(data, aside) != 0 && errno != ENOENT)
        rc = hapi_error_set(err, -errno, "cache %s: cannot move data.mdb aside: %s", dir,
                            strerror(errno));
    else if (unlink(lock) != 0 && errno != ENOENT)
        rc = hapi_error_set(err, -errno, "cache %s: cannot remove lock.mdb: %s", dir,
                            strerror(errno));
    if (fd >= 0)
        close(fd);
    return rc;
}

/* Closes the slab files and destroys the locks of c; fields_free() then ends its teardown. */
static void locks_destroy(hapi_cache *c)
{
    for (int i = 0; i < c->slab_count; i++)
        close(c->slabs[i].fd);
    pthread_mutex_destroy(&c->slab_lock);
    pthread_mutex_destroy(&c->access_lock);
    pthread_mutex_destroy(&c->write_lock);
    pthread_mutex_destroy(&c->pool_lock);
    pthread_cond_destroy(&c->idle);
}

/* Frees c and the buffers it owns: the last step of its teardown. */
static void fields_free(hapi_cache *c)
{
    free(c->drain);
    free(c->log);
    free(c->pool);
    free(c->slab_dir);
    free(c->dir);
    free(c);
}

/*
 * Checks the directory ourselves first: LMDB would report a bare errno on
 * its lock file, and these are the mistakes an operator makes. Returns 0 or
 * -errno (err says why).
 */
static int dir_check(const char *dir, hapi_error *err)
{
    struct stat st;
    int rc;

    if (stat(dir, &st) != 0) {
        rc = -errno;
        return hapi_error_set(err, rc, "cache directory %s: %s", dir, strerror(-rc));
    }
    if (!S_ISDIR(st.st_mode))
        return hapi_error_set(err, -ENOTDIR, "cache directory %s: is not a directory", dir);
    if (access(dir, W_OK | X_OK) != 0) {
        rc = -errno;
        return hapi_error_set(err, rc, "cache directory %s: %s", dir, strerror(-rc));
    }
    return 0;
}

int hapi_cache_open(const char *dir, const hapi_cache_options *opt,
                    hapi_cache **out, hapi_error *err)
{
    hapi_cache *c = NULL;
    hapi_error e = { 0 };
    uint64_t max_bytes = opt && opt->max_bytes ? opt->max_bytes : DEFAULT_MAX_BYTES;
    int max_readers = opt && opt->max_readers > 0 ? opt->max_readers : DEFAULT_MAX_READERS;
    int rc;

    if (out)
        *out = NULL;
    if (!dir || !out)
        return hapi_error_set(err, HAPI_EINVAL, "cache: no directory given");

    if ((rc = dir_check(dir, err)) != 0)
        return rc;

    c = calloc(1, sizeof(*c));
    if (!c) {
        rc = hapi_error_set(err, -ENOMEM, "cache %s: out of memory", dir);
        goto fail_alloc;
    }
    c->dir = strdup(dir);
    if (asprintf(&c->slab_dir, "%s/%s", dir, HAPI_CACHE__SLAB_DIR) < 0)
        c->slab_dir = NULL;
    c->pool_max = max_readers / 2 < POOL_MAX ? max_readers / 2 : POOL_MAX;
    c->pool = calloc((size_t)(c->pool_max > 0 ? c->pool_max : 1), sizeof(*c->pool));
    c->log = malloc(ACCESS_LOG_BYTES);
    c->drain = malloc(ACCESS_LOG_BYTES);
    if (!c->dir || !c->slab_dir || !c->pool || !c->log || !c->drain) {
        rc = hapi_error_set(err, -ENOMEM, "cache %s: out of memory", dir);
        goto fail_fields;
    }
    if (mkdir(c->slab_dir, 0755) != 0 && errno != EEXIST) {
        rc = -errno;
        hapi_error_set(err, rc, "cache directory %s: %s", c->slab_dir, strerror(-rc));
        goto fail_fields;
    }

    rc = hapi_cond_init_monotonic(&c->idle);
    if (rc) {
        rc = hapi_error_set(err, -rc, "cache %s: %s", dir, strerror(rc));
        goto fail_fields;
    }
    pthread_mutex_init(&c->pool_lock, NULL);
    pthread_mutex_init(&c->write_lock, NULL);
    pthread_mutex_init(&c->access_lock, NULL);
    pthread_mutex_init(&c->slab_lock, NULL);

    /* The map size is the store's bound; LMDB wants a multiple of the OS page size. */
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0)
        page = 4096;
    max_bytes = (max_bytes + (uint64_t)page - 1) / (uint64_t)page * (uint64_t)page;

    rc = env_open(c, max_bytes, max_readers, &e);
    if (rc == HAPI_ECORRUPT && opt && opt->reset) {
        rc = reset_store(dir, &e);
        if (rc == 0)
            rc = env_open(c, max_bytes, max_readers, &e);
        c->reset_at_open = rc == 0;
    }
    if (rc) {
        hapi_error_set(err, rc, "%s%s", e.message,
                       rc == HAPI_ECORRUPT ? "; use cache_reset=1 to replace it with an empty store"
                                           : "");
        goto fail_locks;
    }

    *out = c;
    return 0;

fail_locks:
    locks_destroy(c);
fail_fields:
    fields_free(c);
fail_alloc:
    return rc;
}

void hapi_cache_close(hapi_cache *c)
{
    if (!c)
        return;
    /* Hits since the last write still count for the LRU order of the next run. */
    hapi_cache_flush_access(c, NULL);
    if (c->trim_pending) {
        /* The slab disk that the last evictions gave back: a write transaction that writes nothing. */
        MDB_txn *txn;
        if (hapi_cache__write_begin(c, &txn, NULL) == 0)
            mdb_txn_abort(txn);
    }
    for (int i = 0; i < c->pool_count; i++)
        mdb_txn_abort(c->pool[i]);
    /* With MDB_NOSYNC nothing was flushed: a clean close makes the store durable. */
    mdb_env_sync(c->env, 1);
    mdb_env_close(c->env);
    /*
     * The slab files are not flushed: a slot that an OS crash loses fails its
     * checksum, a miss, as do LMDB's own lost commits.
     */
    locks_destroy(c);
    fields_free(c);
}

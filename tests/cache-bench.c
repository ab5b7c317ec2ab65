/* cache-bench.c — measures the feature store: hit latency with LRU logging, bytes per entry, put, flush and eviction costs. */
#include <errno.h>
#include <ftw.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache.h"
#include "cache-int.h"

/*
 * entries per store (-n, 20,000 by default, figures extrapolated to 100k);
 * lookups flush the access log every FLUSH_EVERY hits (outside the timed
 * call), as the daemon's periodic flush would, so that every timed hit pays
 * for logging rather than for a drop.
 */
enum { BATCH = 64, LOOKUPS = 200000, FLUSH_EVERY = 2000 };
static unsigned entries = 20000; /* -n */

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb; (void)flag; (void)ftw;
    return remove(p);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void path_of(char *out, size_t n, unsigned i)
{
    snprintf(out, n, "train/n%08u/ILSVRC2012_val_%08u.JPEG", i / 100, i);
}

/* Fills c with entries values of size bytes in batches; returns the time taken (ns), 0 on failure. */
static uint64_t fill_store(hapi_cache *c, const hapi_cache_namespace *ns, const uint8_t *data,
                           size_t size)
{
    static char paths[BATCH][96];
    hapi_cache_item items[BATCH];
    hapi_source_id id = { .size = 110000, .mtime_ns = 1, .ctime_ns = 2, .ino = 3 };
    hapi_error err = { 0 };
    uint64_t t0 = hapi_now_ns();
    for (unsigned base = 0; base < entries; base += BATCH) {
        unsigned n = entries - base < BATCH ? entries - base : BATCH;
        for (unsigned j = 0; j < n; j++) {
            path_of(paths[j], sizeof(paths[j]), base + j);
            items[j] = (hapi_cache_item){ .path = paths[j], .id = id, .data = data, .size = size };
            items[j].id.ino = base + j;
        }
        if (hapi_cache_put(c, ns, items, n, &err) != 0) {
            fprintf(stderr, "put: %s\n", err.message);
            return 0;
        }
    }
    return hapi_now_ns() - t0;
}

static long long file_size(const char *dir)
{
    char file[PATH_MAX];
    struct stat sb;
    snprintf(file, sizeof(file), "%s/data.mdb", dir);
    return stat(file, &sb) == 0 ? (long long)sb.st_size : -1;
}

/* The disk blocks of every file under a directory (data.mdb, lock.mdb, the slab files), as du counts them. */
static long long disk_blocks;
static int add_blocks(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)p; (void)ftw;
    if (flag == FTW_F)
        disk_blocks += (long long)sb->st_blocks * 512;
    return 0;
}

static long long disk_bytes(const char *dir)
{
    disk_blocks = 0;
    nftw(dir, add_blocks, 16, FTW_PHYS);
    return disk_blocks;
}

/* One run: fill a fresh store with entries values of size bytes, then time random hits and the rest. */
static int bench(size_t size)
{
    char dir[] = "/tmp/hapi-cache-bench-XXXXXX";
    hapi_cache *c = NULL;
    hapi_error err = { 0 };
    hapi_cache_namespace ns;
    uint8_t digest[16] = { 0 };
    hapi_source_id id = { .size = 110000, .mtime_ns = 1, .ctime_ns = 2, .ino = 3 };
    uint8_t *data = malloc(size);
    uint64_t *lat = malloc(sizeof(*lat) * LOOKUPS);
    int rc = -1;

    if (!data || !lat || !mkdtemp(dir))
        goto out;
    for (size_t i = 0; i < size; i++)
        data[i] = (uint8_t)(i * 131 + 7);
    hapi_cache_namespace_make(digest, 5, 1, "exact 256 224", &ns);
    if ((rc = hapi_cache_open(dir, NULL, &c, &err)) != 0) {
        fprintf(stderr, "open: %s\n", err.message);
        goto out_dir;
    }
    uint64_t put_ns = fill_store(c, &ns, data, size);
    if (!put_ns) {
        rc = -1;
        goto out_close;
    }
    /* What a warm-up leaves, before the lookups' LRU updates copy index pages. */
    long long disk_filled = disk_bytes(dir);

    /*
     * Random hits through the API (pooled transaction, header and checksum
     * checks, access logging), twice: the first pass pays the first touch of
     * each mapped page after the puts (as a first epoch would), the second is
     * steady state. The log is applied every FLUSH_EVERY hits, timed apart.
     */
    unsigned seed = 12345;
    uint64_t sum = 0, flush_ns = 0, flushed = 0;
    double mean[2], p50[2], p99[2];
    for (int pass = 0; pass < 2; pass++) {
        for (int r = 0; r < LOOKUPS; r++) {
            char path[96];
            unsigned i = (unsigned)rand_r(&seed) % entries;
            hapi_cache_value v;
            path_of(path, sizeof(path), i);
            id.ino = i;
            uint64_t a = hapi_now_ns();
            int hit = hapi_cache_get(c, &ns, path, &id, &v);
            if (hit == 1)
                sum += ((const uint8_t *)v.data)[size - 1];
            hapi_cache_release(c, &v);
            lat[r] = hapi_now_ns() - a;
            if (hit != 1) {
                fprintf(stderr, "unexpected miss %d\n", hit);
                rc = -1;
                goto out_close;
            }
            if ((r + 1) % FLUSH_EVERY == 0) {
                uint64_t f0 = hapi_now_ns();
                int n = hapi_cache_flush_access(c, &err);
                flush_ns += hapi_now_ns() - f0;
                if (n < 0) {
                    fprintf(stderr, "flush: %s\n", err.message);
                    rc = -1;
                    goto out_close;
                }
                flushed += (uint64_t)n;
            }
        }
        qsort(lat, LOOKUPS, sizeof(*lat), cmp_u64);
        mean[pass] = 0;
        for (int r = 0; r < LOOKUPS; r++)
            mean[pass] += (double)lat[r];
        mean[pass] /= LOOKUPS * 1000.0;
        p50[pass] = (double)lat[LOOKUPS / 2] / 1000;
        p99[pass] = (double)lat[LOOKUPS * 99 / 100] / 1000;
    }

    /* The same lookups at the bare LMDB layer: one txn renew/get/reset, no checks, no logging. */
    MDB_env *env = hapi_cache__env(c);
    MDB_dbi dbi = hapi_cache__features_dbi(c);
    MDB_txn *txn = NULL;
    mdb_txn_begin(env, NULL, MDB_RDONLY, &txn);
    mdb_txn_reset(txn);
    uint64_t raw0 = hapi_now_ns();
    for (int r = 0; r < LOOKUPS; r++) {
        char path[96];
        uint8_t key[HAPI_CACHE__KEY_MAX];
        path_of(path, sizeof(path), (unsigned)rand_r(&seed) % entries);
        MDB_val k = { .mv_size = hapi_cache__key_make(&ns, path, key), .mv_data = key }, v;
        mdb_txn_renew(txn);
        if (mdb_get(txn, dbi, &k, &v) == 0)
            sum += ((const uint8_t *)v.mv_data)[v.mv_size - 1];
        mdb_txn_reset(txn);
    }
    double raw = (double)(hapi_now_ns() - raw0) / LOOKUPS;
    mdb_txn_abort(txn);

    /* Per-namespace counts on demand: a walk of the namespace's keys. */
    hapi_cache_namespace_stats nst;
    uint64_t s0 = hapi_now_ns();
    enum { SCANS = 20 };
    for (int i = 0; i < SCANS; i++)
        hapi_cache_namespace_stats_get(c, &ns, &nst);
    double scan_ms = (double)(hapi_now_ns() - s0) / SCANS / 1e6;

    hapi_cache_stats st;
    hapi_cache_stats_get(c, &st);
    hapi_cache_close(c);
    c = NULL;
    long long fsize = file_size(dir);
    long long disk = disk_bytes(dir);
    double per_entry = (double)(st.bytes_used - st.bytes_free) / entries;

    printf("value %5zu B, %u entries: put %.1f us/entry (batches of %d, LRU index included)\n"
           "  hit, first touch: mean %.2f us, p50 %.2f, p99 %.2f; steady: mean %.2f us, p50 %.2f, "
           "p99 %.2f; get's own mean %.2f us; bare LMDB renew+get+reset %.2f us\n"
           "  access log: %.2f us per access applied (%llu applied, flushes of %d)\n",
           size, entries, (double)put_ns / entries / 1000, BATCH, mean[0], p50[0], p99[0],
           mean[1], p50[1], p99[1], st.hit_mean_us, raw / 1000,
           flushed ? (double)flush_ns / (double)flushed / 1000 : 0.0,
           (unsigned long long)flushed, FLUSH_EVERY);
    printf("  store: data.mdb %lld B, in use %llu B -> %.0f B/entry, %.0f B/entry beyond the "
           "%zu feature bytes (%.1f%%); 100k entries: %.0f MiB\n"
           "  namespace stats walk: %.2f ms for %llu entries (%.2f ms per 100k)  [checksum %llu]\n",
           fsize, (unsigned long long)(st.bytes_used - st.bytes_free), per_entry,
           per_entry - (double)size, size, 100.0 * (per_entry - (double)size) / (double)size,
           per_entry * 100000 / 1048576, scan_ms, (unsigned long long)nst.entries,
           scan_ms * 100000 / (double)entries, (unsigned long long)sum % 10);
    printf("  disk (du, every file of the store): filled %lld B -> %.0f B/entry, %.3fx the "
           "feature; after the lookups %lld B -> %.0f B/entry, %.3fx\n",
           disk_filled, (double)disk_filled / entries, (double)disk_filled / entries / (double)size,
           disk, (double)disk / entries, (double)disk / entries / (double)size);

    /*
     * Eviction: the same puts into a map that holds about a third of them,
     * timing the eviction transactions (from the store's internal counter).
     */
    char dir2[] = "/tmp/hapi-cache-bench-XXXXXX";
    if (!mkdtemp(dir2)) {
        rc = -1;
        goto out_dir;
    }
    hapi_cache_options opt = { .max_bytes = (uint64_t)(per_entry * entries / 3) };
    if ((rc = hapi_cache_open(dir2, &opt, &c, &err)) != 0) {
        fprintf(stderr, "open: %s\n", err.message);
        nftw(dir2, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
        goto out_dir;
    }
    uint64_t bounded_ns = fill_store(c, &ns, data, size);
    uint64_t evict_ns = hapi_cache__evict_ns(c);
    hapi_cache_stats_get(c, &st);
    hapi_cache_close(c);
    c = NULL;
    nftw(dir2, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    if (!bounded_ns || !st.evictions) {
        fprintf(stderr, "bounded fill failed or evicted nothing\n");
        rc = -1;
        goto out_dir;
    }
    printf("  eviction: map %.1f MiB, %llu of %u entries evicted, %llu kept: put %.1f us/entry "
           "all included; eviction transactions %.2f us per entry evicted\n",
           (double)opt.max_bytes / 1048576, (unsigned long long)st.evictions, entries,
           (unsigned long long)st.entries, (double)bounded_ns / entries / 1000,
           (double)evict_ns / (double)st.evictions / 1000);
    rc = 0;

out_close:
    hapi_cache_close(c);
out_dir:
    nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
out:
    free(lat);
    free(data);
    return rc;
}

int main(int argc, char **argv)
{
    /* a ResNet-18 feature at 64 px in bf16, and a ResNet-50 pooled one in fp16, .npy headers included */
    static const size_t sizes[] = { 1152, 4224 };
    int opt;
    while ((opt = getopt(argc, argv, "n:h")) != -1) {
        if (opt == 'n' && atoi(optarg) > 0) {
            entries = (unsigned)atoi(optarg);
            continue;
        }
        fprintf(stderr, "usage: %s [-n ENTRIES] [SIZE...]\n"
                        "  fills a fresh store with ENTRIES (20000) features of each SIZE (1152, "
                        "4224 bytes), times hits, prints bytes per entry\n", argv[0]);
        return opt == 'h' ? 0 : 2;
    }
    if (optind < argc) {
        for (int i = optind; i < argc; i++)
            if (atol(argv[i]) <= 0 || bench((size_t)atol(argv[i])) != 0)
                return 1;
        return 0;
    }
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++)
        if (bench(sizes[i]) != 0)
            return 1;
    return 0;
}

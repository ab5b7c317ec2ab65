/* cache-bench.c — measures the feature store: hit latency and bytes of store per entry beyond the features. */
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

enum { ENTRIES = 10000, BATCH = 64, LOOKUPS = 200000 };

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

/* One run: fill a fresh store with ENTRIES values of size bytes, then time random hits. */
static int bench(size_t size)
{
    char dir[] = "/tmp/hapi-cache-bench-XXXXXX";
    hapi_cache *c = NULL;
    hapi_error err = { 0 };
    hapi_cache_namespace ns;
    uint8_t digest[16] = { 0 };
    hapi_source_id id = { .size = 110000, .mtime_ns = 1, .ctime_ns = 2, .ino = 3 };
    static char paths[BATCH][96];
    hapi_cache_item items[BATCH];
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

    uint64_t t0 = hapi_now_ns();
    for (unsigned base = 0; base < ENTRIES; base += BATCH) {
        unsigned n = ENTRIES - base < BATCH ? ENTRIES - base : BATCH;
        for (unsigned j = 0; j < n; j++) {
            path_of(paths[j], sizeof(paths[j]), base + j);
            items[j] = (hapi_cache_item){ .path = paths[j], .id = id, .data = data, .size = size };
            items[j].id.ino = base + j;
        }
        if ((rc = hapi_cache_put(c, &ns, items, n, &err)) != 0) {
            fprintf(stderr, "put: %s\n", err.message);
            goto out_close;
        }
    }
    uint64_t put_ns = hapi_now_ns() - t0;

    /*
     * Random hits through the API (pooled transaction, header and checksum
     * checks), twice: the first pass pays the first touch of each mapped page
     * after the puts (as a first epoch would), the second is steady state.
     */
    unsigned seed = 12345;
    uint64_t sum = 0;
    double mean[2], p50[2], p99[2];
    for (int pass = 0; pass < 2; pass++) {
        for (int r = 0; r < LOOKUPS; r++) {
            char path[96];
            unsigned i = (unsigned)rand_r(&seed) % ENTRIES;
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
        }
        qsort(lat, LOOKUPS, sizeof(*lat), cmp_u64);
        mean[pass] = 0;
        for (int r = 0; r < LOOKUPS; r++)
            mean[pass] += (double)lat[r];
        mean[pass] /= LOOKUPS * 1000.0;
        p50[pass] = (double)lat[LOOKUPS / 2] / 1000;
        p99[pass] = (double)lat[LOOKUPS * 99 / 100] / 1000;
    }

    /* The same lookups at the bare LMDB layer: one txn begin/get/abort, no checks. */
    MDB_env *env = hapi_cache__env(c);
    MDB_dbi dbi = hapi_cache__features_dbi(c);
    MDB_txn *txn = NULL;
    mdb_txn_begin(env, NULL, MDB_RDONLY, &txn);
    mdb_txn_reset(txn);
    uint64_t raw0 = hapi_now_ns();
    for (int r = 0; r < LOOKUPS; r++) {
        char path[96];
        uint8_t key[HAPI_CACHE__KEY_MAX];
        path_of(path, sizeof(path), (unsigned)rand_r(&seed) % ENTRIES);
        MDB_val k = { .mv_size = hapi_cache__key_make(&ns, path, key), .mv_data = key }, v;
        mdb_txn_renew(txn);
        if (mdb_get(txn, dbi, &k, &v) == 0)
            sum += ((const uint8_t *)v.mv_data)[v.mv_size - 1];
        mdb_txn_reset(txn);
    }
    double raw = (double)(hapi_now_ns() - raw0) / LOOKUPS;
    mdb_txn_abort(txn);

    hapi_cache_stats st;
    hapi_cache_stats_get(c, &st);
    hapi_cache_close(c);
    c = NULL;
    char file[sizeof(dir) + 16];
    struct stat sb;
    snprintf(file, sizeof(file), "%s/data.mdb", dir);
    stat(file, &sb);

    printf("value %5zu B, %d entries: put %.1f us/entry (batches of %d)\n"
           "  hit, first touch: mean %.2f us, p50 %.2f, p99 %.2f; "
           "steady: mean %.2f us, p50 %.2f, p99 %.2f; bare LMDB renew+get+reset %.2f us\n",
           size, ENTRIES, (double)put_ns / ENTRIES / 1000, BATCH, mean[0], p50[0], p99[0],
           mean[1], p50[1], p99[1], raw / 1000);
    printf("  store: data.mdb %lld B, used %llu B, %d entries -> %.0f B/entry, "
           "%.0f B/entry beyond the %zu feature bytes (%.1f%%)  [checksum %llu]\n",
           (long long)sb.st_size, (unsigned long long)st.bytes_used, ENTRIES,
           (double)sb.st_size / ENTRIES, (double)sb.st_size / ENTRIES - (double)size, size,
           100.0 * ((double)sb.st_size / ENTRIES - (double)size) / (double)size,
           (unsigned long long)sum % 10);
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

int main(void)
{
    static const size_t sizes[] = { 4096, 4096 + 128, 8192 };
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++)
        if (bench(sizes[i]) != 0)
            return 1;
    return 0;
}

/*
 * fuzz-cache.c — libFuzzer target: the decoding of a stored cache value. A
 * damaged value, or one another program (or format) wrote, must be a miss
 * counted as bad or stale, never a crash and never a hit with wrong bytes.
 *
 * Input: one byte (bit 0: the entry of a short path, or of a path long
 * enough to be stored under a digest, whose value holds the full path; bit
 * 1: look it up with the identity the seeds were stored under, or another),
 * then the value's bytes, written raw into the store's LMDB database.
 *
 * With HAPI_FUZZ_WRITE_SEEDS=DIR it writes real values of both kinds to DIR
 * (tests/fuzz/make-seeds calls it) and exits: features kept in LMDB, and one
 * kept in a slab file, whose value is a reference to slot 0. The store being
 * fuzzed holds that feature in its slot 0 too, so that a reference can hit.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cache-int.h"

static hapi_cache *cache;
static hapi_cache_namespace ns;
static char short_path[] = "class0/x.jpg";
static char long_path[HAPI_CACHE_PATH_MAX + 64];
static const hapi_source_id stored_id = { 1234, 5678, 91011, 1213 };
/* The one feature written to a slab (slot 0 of its size), in the seeds' store and in the fuzzed one. */
static uint8_t slab_feat[1152];
static char slab_path[] = "keep/slab.jpg";

static void write_raw(const char *path, const void *data, size_t size)
{
    uint8_t key[HAPI_CACHE__KEY_MAX];
    MDB_val k = { .mv_size = hapi_cache__key_make(&ns, path, key), .mv_data = key };
    MDB_val v = { .mv_size = size, .mv_data = (void *)data };
    MDB_txn *txn;
    if (mdb_txn_begin(hapi_cache__env(cache), NULL, 0, &txn) != 0)
        abort();
    if (mdb_put(txn, hapi_cache__features_dbi(cache), &k, &v, 0) != 0 || mdb_txn_commit(txn) != 0)
        abort();
}

static void write_seeds(const char *dir)
{
    float feat[64];
    for (int i = 0; i < 64; i++)
        feat[i] = (float)i / 7.0f;
    /* the third: the short path's feature again, in a slab (the first slab put: slot 0) */
    const char *paths[] = { short_path, long_path, short_path };
    for (int i = 0; i < 3; i++) {
        hapi_cache_item item = { paths[i], stored_id, feat, sizeof(feat) };
        if (i == 2)
            item = (hapi_cache_item){ paths[i], stored_id, slab_feat, sizeof(slab_feat) };
        hapi_error err = { 0 };
        if (hapi_cache_put(cache, &ns, &item, 1, &err) < 0)
            abort();
        uint8_t key[HAPI_CACHE__KEY_MAX];
        MDB_val k = { .mv_size = hapi_cache__key_make(&ns, paths[i], key), .mv_data = key }, v;
        MDB_txn *txn;
        if (mdb_txn_begin(hapi_cache__env(cache), NULL, MDB_RDONLY, &txn) != 0 ||
            mdb_get(txn, hapi_cache__features_dbi(cache), &k, &v) != 0)
            abort();
        for (int other = 0; other < 2; other++) {
            char name[512];
            snprintf(name, sizeof(name), "%s/%s-%s", dir,
                     i == 0 ? "short" : i == 1 ? "long" : "short-slab",
                     other ? "other-id" : "stored-id");
            FILE *f = fopen(name, "wb");
            uint8_t sel = (uint8_t)((i == 1) | other << 1);
            if (!f || fwrite(&sel, 1, 1, f) != 1 || fwrite(v.mv_data, 1, v.mv_size, f) != v.mv_size)
                abort();
            fclose(f);
        }
        mdb_txn_abort(txn);
    }
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    char dir[] = "/tmp/hapi-fuzz-cache-XXXXXX";
    if (!mkdtemp(dir))
        abort();
    hapi_cache_options opt = { .max_bytes = 64u << 20 };
    hapi_error err = { 0 };
    if (hapi_cache_open(dir, &opt, &cache, &err) < 0) {
        fprintf(stderr, "fuzz-cache: %s\n", err.message);
        abort();
    }
    static const uint8_t digest[16] = { 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16 };
    hapi_cache_namespace_make(digest, 3, 0, "exact", &ns);
    memset(long_path, 'd', sizeof(long_path) - 1);
    memcpy(long_path, "deep/", 5);
    long_path[sizeof(long_path) - 1] = '\0';
    for (size_t i = 0; i < sizeof(slab_feat); i++)
        slab_feat[i] = (uint8_t)(i * 37 + 11);
    const char *seeds = getenv("HAPI_FUZZ_WRITE_SEEDS");
    if (seeds) {
        mkdir(seeds, 0755);
        write_seeds(seeds);
        exit(0);
    }
    /* Slot 0 of the slab holds the seeds' slab feature, under a key the inputs never replace. */
    hapi_cache_item item = { slab_path, stored_id, slab_feat, sizeof(slab_feat) };
    if (hapi_cache_put(cache, &ns, &item, 1, &err) < 0)
        abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    const char *path = (data[0] & 1) ? long_path : short_path;
    hapi_source_id id = stored_id;
    if (data[0] & 2)
        id.mtime_ns++;
    write_raw(path, data + 1, size - 1);

    hapi_cache_stats before, after;
    if (hapi_cache_stats_get(cache, &before) < 0)
        abort();
    hapi_cache_value val;
    int rc = hapi_cache_get(cache, &ns, path, &id, &val);
    if (rc == 1) {
        /*
         * a hit only for a value that verifies: its bytes are inside the stored
         * value, or they are the one feature in a slab, whole
         */
        bool slab = val.data && val.size == sizeof(slab_feat) &&
                    memcmp(val.data, slab_feat, sizeof(slab_feat)) == 0;
        if (!val.data || (!slab && val.size > size - 1))
            abort();
        volatile uint8_t last = val.size ? ((const uint8_t *)val.data)[val.size - 1] : 0;
        (void)last;
        hapi_cache_release(cache, &val);
    } else if (rc == 0) {
        if (val.miss != HAPI_CACHE_MISS_BAD && val.miss != HAPI_CACHE_MISS_STALE &&
            val.miss != HAPI_CACHE_MISS_ABSENT)
            abort();
        if (hapi_cache_stats_get(cache, &after) < 0)
            abort();
        /* counted: a bad value as bad, another identity as stale */
        if (val.miss == HAPI_CACHE_MISS_BAD && after.bad != before.bad + 1)
            abort();
        if (val.miss == HAPI_CACHE_MISS_STALE && after.stale != before.stale + 1)
            abort();
    } else {
        abort(); /* the store itself is sound: a lookup does not fail */
    }
    return 0;
}

/* format.c — the store's format: its named databases, the format record that marks it as ours, upgrades of older versions. */
#include "cache-priv.h"

#include <string.h>

/* The store's own marker, in the "meta" database under the key "format". */
#define FORMAT_KEY "format"
#define FORMAT_MAGIC "hapifs-cache" /* 12 bytes, then a u32 format version */
#define FORMAT_MAGIC_SIZE 12
#define FORMAT_RECORD_SIZE (FORMAT_MAGIC_SIZE + 4)
/*
 * 2 added the "lru" and "stamps" databases; a version-1 store is indexed on
 * open. 3 added the slab files and the "slots" database; the inline values of
 * a version-2 store are still read as they are, and leave by eviction.
 */
#define FORMAT_VERSION 3

/*
 * Indexes a version-1 store (entries without an LRU order) in txn: stamps in
 * key order, which keeps a directory's entries together.
 */
static int upgrade_v1(hapi_cache *c, MDB_txn *txn)
{
    MDB_cursor *cur;
    MDB_val k, v;
    MDB_cursor_op op = MDB_FIRST;
    uint64_t stamp = 1;
    int rc = mdb_cursor_open(txn, c->features_dbi, &cur);
    if (rc)
        return rc;
    while ((rc = mdb_cursor_get(cur, &k, &v, op)) == 0) {
        op = MDB_NEXT;
        if ((rc = hapi_cache__touch(c, txn, k.mv_data, k.mv_size, &stamp, false, 0)) != 0)
            break;
    }
    mdb_cursor_close(cur);
    return rc == MDB_NOTFOUND ? 0 : rc;
}

/* Writes the format record of this version into "meta". */
static int format_put(hapi_cache *c, MDB_txn *txn)
{
    uint8_t record[FORMAT_RECORD_SIZE];
    memcpy(record, FORMAT_MAGIC, FORMAT_MAGIC_SIZE);
    put_le32(record + FORMAT_MAGIC_SIZE, FORMAT_VERSION);
    MDB_val k = { .mv_size = strlen(FORMAT_KEY), .mv_data = FORMAT_KEY };
    MDB_val v = { .mv_size = sizeof(record), .mv_data = record };
    return mdb_put(txn, c->meta_dbi, &k, &v, 0);
}

/*
 * Makes a new store, in txn: marks it as ours before anything else goes in,
 * and empties the slab files a store that is gone left. Returns 0 or a hapi
 * code (err says why).
 */
static int store_create(hapi_cache *c, MDB_txn *txn, hapi_error *err)
{
    int rc = mdb_dbi_open(txn, "meta", MDB_CREATE, &c->meta_dbi);
    if (rc == 0)
        rc = format_put(c, txn);
    if (rc)
        return hapi_error_set(err, hapi_cache__lmdb_to_code(rc),
                              "cache %s: cannot initialize the store: %s",
                              c->dir, mdb_strerror(rc));
    /*
     * Slab files left by a store that is gone (reset, or data.mdb deleted)
     * hold nothing this one names: empty them, under the write lock this
     * transaction holds, before any slot is handed out.
     */
    if ((rc = hapi_cache__slab_files_empty(c)) != 0)
        return hapi_error_set(err, rc, "cache %s/%s: cannot empty the slab files: %s", c->dir,
                              HAPI_CACHE__SLAB_DIR, strerror(-rc));
    return 0;
}

/*
 * Checks in txn that an existing store is ours, in a format version this code
 * reads, and sets *version to it. A foreign LMDB file has keys but no "meta"
 * database or a format record that is not ours. Returns 0 or a hapi code
 * (err says why).
 */
static int store_check(hapi_cache *c, MDB_txn *txn, uint32_t *version, hapi_error *err)
{
    MDB_val k, v;
    int rc = mdb_dbi_open(txn, "meta", 0, &c->meta_dbi);
    if (rc == MDB_NOTFOUND || rc == MDB_INCOMPATIBLE)
        return hapi_error_set(err, HAPI_ECORRUPT,
                              "cache %s/data.mdb: an LMDB store that is not hapifs's", c->dir);
    if (rc)
        return hapi_error_set(err, hapi_cache__lmdb_to_code(rc), "cache %s/data.mdb: %s",
                              c->dir, mdb_strerror(rc));
    k = (MDB_val){ .mv_size = strlen(FORMAT_KEY), .mv_data = FORMAT_KEY };
    rc = mdb_get(txn, c->meta_dbi, &k, &v);
    if (rc && rc != MDB_NOTFOUND)
        return hapi_error_set(err, hapi_cache__lmdb_to_code(rc), "cache %s/data.mdb: %s",
                              c->dir, mdb_strerror(rc));
    if (rc == MDB_NOTFOUND || v.mv_size != FORMAT_RECORD_SIZE ||
        memcmp(v.mv_data, FORMAT_MAGIC, FORMAT_MAGIC_SIZE) != 0)
        return hapi_error_set(err, HAPI_ECORRUPT,
                              "cache %s/data.mdb: an LMDB store that is not hapifs's", c->dir);
    *version = get_le32((const uint8_t *)v.mv_data + FORMAT_MAGIC_SIZE);
    if (*version != FORMAT_VERSION && *version != 1 && *version != 2)
        return hapi_error_set(err, HAPI_ECORRUPT,
                              "cache %s/data.mdb: store format version %u, this hapifs reads %u",
                              c->dir, *version, FORMAT_VERSION);
    return 0;
}

/*
 * Opens the named databases in one write transaction, creating them in a new
 * store, and checks that an existing store is ours (a new LMDB file has an
 * empty main database); upgrades an older format. Returns 0 or a hapi code
 * (err says why).
 */
int hapi_cache__databases_init(hapi_cache *c, hapi_error *err)
{
    MDB_txn *txn = NULL;
    MDB_dbi main_dbi;
    MDB_stat st;
    uint32_t version = FORMAT_VERSION;
    int rc;

    rc = mdb_txn_begin(c->env, NULL, 0, &txn);
    if (rc) {
        rc = hapi_error_set(err, hapi_cache__lmdb_to_code(rc),
                            "cache %s: cannot begin a transaction: %s",
                            c->dir, mdb_strerror(rc));
        goto fail_begin;
    }
    rc = mdb_dbi_open(txn, NULL, 0, &main_dbi);
    if (rc == 0)
        rc = mdb_stat(txn, main_dbi, &st);
    if (rc) {
        rc = hapi_error_set(err, hapi_cache__lmdb_to_code(rc), "cache %s/data.mdb: %s", c->dir,
                            mdb_strerror(rc));
        goto fail_txn;
    }
    rc = st.ms_entries == 0 ? store_create(c, txn, err) : store_check(c, txn, &version, err);
    if (rc)
        goto fail_txn;

    if ((rc = mdb_dbi_open(txn, "features", MDB_CREATE, &c->features_dbi)) != 0 ||
        (rc = mdb_dbi_open(txn, "lru", MDB_CREATE, &c->lru_dbi)) != 0 ||
        (rc = mdb_dbi_open(txn, "stamps", MDB_CREATE, &c->stamps_dbi)) != 0 ||
        (rc = mdb_dbi_open(txn, "slots", MDB_CREATE, &c->slots_dbi)) != 0) {
        rc = hapi_error_set(err, hapi_cache__lmdb_to_code(rc), "cache %s/data.mdb: databases: %s",
                            c->dir, mdb_strerror(rc));
        goto fail_txn;
    }
    /*
     * A version-2 store needs only the "slots" database, made above: its
     * inline values stay readable as they are.
     */
    if (version == 1)
        rc = upgrade_v1(c, txn);
    if (rc == 0 && version != FORMAT_VERSION)
        rc = format_put(c, txn);
    if (rc) {
        rc = hapi_error_set(err, hapi_cache__lmdb_to_code(rc),
                            "cache %s: cannot upgrade a version-%u store: %s",
                            c->dir, version, mdb_strerror(rc));
        goto fail_txn;
    }
    /* Handles opened in a committed transaction stay valid for the environment's life. */
    rc = mdb_txn_commit(txn);
    if (rc) {
        rc = hapi_error_set(err, hapi_cache__lmdb_to_code(rc),
                            "cache %s: cannot commit: %s", c->dir,
                            mdb_strerror(rc));
        goto fail_begin;
    }
    return 0;

fail_txn:
    mdb_txn_abort(txn);
fail_begin:
    return rc;
}

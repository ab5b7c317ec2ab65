/* test-packindex.c — the pack index format (fusefs/packindex.c): its bytes, a round trip, the head's version, and every refusal with its reason. */
#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "extractor.h"
#include "hapi.h"
#include "packindex.h"
#include "remote.h"

/*
 * The index of a directory of six images: names with a space, a quote, a
 * control character, a backslash and UTF-8; one failed, some cached. Its
 * text below was written by the index writer as it stood in pack.c before
 * the format moved to packindex.c: the bytes, and above all the version,
 * must not change (a compute-side mount compares a kept index's version
 * with the one a storage mount of another build serves).
 */
#define ENTRIES 6
static const char *const names[ENTRIES] = {
    " space.jpg", "\"q.jpg", "a\x01" "c.jpeg", "a\\b.png", "bad.jpg", "zz\xc3\xa9t\xc3\xa9.JPG",
};
static const hapi_source_id ids[ENTRIES] = {
    { 12345, 1700000000123456789LL, 1700000001987654321LL, 42 },
    { 0, 0, 0, 1 },
    { 1u << 31, -5, 7, INT64_MAX },
    { 9, 10, 11, 12 },
    { 77, 1700000002000000000LL, 1700000002000000001LL, 99 },
    { 3, 4, 5, 6 },
};
static const hapi_packindex_status statuses[ENTRIES] = {
    HAPI_PACKINDEX_CACHED, HAPI_PACKINDEX_PENDING, HAPI_PACKINDEX_CACHED,
    HAPI_PACKINDEX_PENDING, HAPI_PACKINDEX_FAILED, HAPI_PACKINDEX_CACHED,
};

static const char golden[] =
    "{\"format\":\"hapifs-pack/1\",\"version\":\"115db0d526402d17\","
    "\"dir\":\"train/d\xc3\xa9j\xc3\xa0 \\\"vu\\\"\",\"pack\":\".hapifs-pack.npy\","
    "\"namespace\":\"0123456789abcdef0123456789abcdef\",\"split\":3,\"stage\":\"layer1\","
    "\"dtype\":\"<f2\",\"row_shape\":[64,7,7],\"count\":6,\"header_bytes\":128,"
    "\"row_bytes\":6272,\"size\":37760,\"failed_rows\":\"NaN\",\"entries\":["
    "{\"name\":\" space.jpg\",\"size\":12345,\"mtime_ns\":1700000000123456789,"
    "\"ctime_ns\":1700000001987654321,\"ino\":42,\"status\":\"cached\"},"
    "{\"name\":\"\\\"q.jpg\",\"size\":0,\"mtime_ns\":0,\"ctime_ns\":0,\"ino\":1,"
    "\"status\":\"pending\"},"
    "{\"name\":\"a\\u0001c.jpeg\",\"size\":2147483648,\"mtime_ns\":-5,\"ctime_ns\":7,"
    "\"ino\":9223372036854775807,\"status\":\"cached\"},"
    "{\"name\":\"a\\\\b.png\",\"size\":9,\"mtime_ns\":10,\"ctime_ns\":11,\"ino\":12,"
    "\"status\":\"pending\"},"
    "{\"name\":\"bad.jpg\",\"size\":77,\"mtime_ns\":1700000002000000000,"
    "\"ctime_ns\":1700000002000000001,\"ino\":99,\"status\":\"failed\","
    "\"error\":\"image could not be decoded\"},"
    "{\"name\":\"zz\xc3\xa9t\xc3\xa9.JPG\",\"size\":3,\"mtime_ns\":4,\"ctime_ns\":5,\"ino\":6,"
    "\"status\":\"cached\"}]}";

static hapi_packindex_entry entries[ENTRIES];

/* The fixture's index, as pack.c fills one (every pointer borrowed). */
static hapi_packindex fixture(void)
{
    hapi_packindex x = {
        .dir = "train/d\xc3\xa9j\xc3\xa0 \"vu\"", .ns_hex = "0123456789abcdef0123456789abcdef",
        .split = 3, .stage = "layer1", .dtype = HAPI_DTYPE_FP16, .ndim = 3,
        .shape = { 64, 7, 7 }, .count = ENTRIES, .entries = entries,
    };
    int64_t pack_shape[4] = { ENTRIES, 64, 7, 7 };
    char header[HAPI_NPY_HEADER_MAX];
    x.header_bytes = (uint64_t)hapi_npy_header(header, x.dtype, pack_shape, 4);
    x.row_bytes = 64 * 7 * 7 * 2;
    x.size = x.header_bytes + ENTRIES * x.row_bytes;
    for (int i = 0; i < ENTRIES; i++)
        entries[i] = (hapi_packindex_entry){ .name = names[i], .id = ids[i],
                                             .status = statuses[i] };
    entries[4].code = HAPI_EDECODE;
    return x;
}

static char *write_text(const hapi_packindex *x, size_t *len)
{
    char *text = NULL;
    ck_assert_int_eq(hapi_packindex_write(x, &text, len), 0);
    ck_assert_ptr_nonnull(text);
    ck_assert_uint_eq(*len, strlen(text));
    return text;
}

START_TEST(the_bytes_do_not_change)
{
    hapi_packindex x = fixture();
    size_t len;
    char *text = write_text(&x, &len);
    ck_assert_str_eq(text, golden);
    char version[17];
    hapi_packindex_version(&x, version);
    ck_assert_str_eq(version, "115db0d526402d17");
    free(text);
}
END_TEST

START_TEST(a_written_index_parses_back_whole)
{
    hapi_packindex x = fixture();
    size_t len;
    char *text = write_text(&x, &len);
    hapi_packindex *y = NULL;
    hapi_error err = { 0 };
    ck_assert_int_eq(hapi_packindex_parse(text, len, &y, &err), 0);
    ck_assert_ptr_nonnull(y);
    /* The remote mount's check (the fuzz target's) accepts it too. */
    ck_assert_int_eq(hapi_remote_index_check(text, len, "train/x", &err), 0);
    ck_assert_str_eq(y->version, "115db0d526402d17");
    ck_assert_str_eq(y->dir, x.dir);
    ck_assert_str_eq(y->ns_hex, x.ns_hex);
    ck_assert_int_eq(y->split, 3);
    ck_assert_str_eq(y->stage, "layer1");
    ck_assert_int_eq(y->dtype, HAPI_DTYPE_FP16);
    ck_assert_int_eq(y->ndim, 3);
    ck_assert_mem_eq(y->shape, x.shape, 3 * sizeof(int64_t));
    ck_assert_uint_eq(y->header_bytes, 128);
    ck_assert_uint_eq(y->row_bytes, 6272);
    ck_assert_uint_eq(y->size, 128 + 6 * 6272);
    ck_assert_uint_eq(y->count, ENTRIES);
    for (int i = 0; i < ENTRIES; i++) {
        const hapi_packindex_entry *e = &y->entries[i];
        ck_assert_str_eq(e->name, names[i]);
        ck_assert_mem_eq(&e->id, &ids[i], sizeof(ids[i]));
        ck_assert_int_eq(e->status, statuses[i]);
        ck_assert_int_eq(e->code, 0); /* the text carries the reason, not the code */
        if (statuses[i] == HAPI_PACKINDEX_FAILED)
            ck_assert_str_eq(e->error, hapi_strerror(HAPI_EDECODE));
        else
            ck_assert_ptr_null(e->error);
    }
    /* Written again (the code put back), it is the same text. */
    y->entries[4].code = HAPI_EDECODE;
    size_t len2;
    char *again = write_text(y, &len2);
    ck_assert_str_eq(again, text);
    free(again);
    hapi_packindex_free(y);
    free(text);
}
END_TEST

START_TEST(the_version_is_of_what_may_be_served)
{
    hapi_packindex x = fixture();
    char v0[17], v[17];
    hapi_packindex_version(&x, v0);
    /* Statuses change while features are computed: not the version. */
    entries[0].status = HAPI_PACKINDEX_PENDING;
    entries[1].status = HAPI_PACKINDEX_CACHED;
    hapi_packindex_version(&x, v);
    ck_assert_str_eq(v, v0);
    /* An identity, a failure, a name, the namespace or the shape do. */
    entries[3].id.mtime_ns++;
    hapi_packindex_version(&x, v);
    ck_assert_str_ne(v, v0);
    x = fixture();
    entries[4].code = -EIO;
    hapi_packindex_version(&x, v);
    ck_assert_str_ne(v, v0);
    x = fixture();
    entries[4].status = HAPI_PACKINDEX_PENDING; /* no longer failed: its code no longer counts */
    hapi_packindex_version(&x, v);
    ck_assert_str_ne(v, v0);
    entries[4].code = 0;
    char v1[17];
    hapi_packindex_version(&x, v1);
    ck_assert_str_eq(v1, v);
    x = fixture();
    x.ns_hex[31] = '0';
    hapi_packindex_version(&x, v);
    ck_assert_str_ne(v, v0);
    x = fixture();
    x.shape[2] = 8;
    hapi_packindex_version(&x, v);
    ck_assert_str_ne(v, v0);
}
END_TEST

START_TEST(the_head_names_the_version)
{
    char version[17];
    char head[200];
    memcpy(head, golden, sizeof(head) - 1);
    head[sizeof(head) - 1] = '\0';
    hapi_packindex_head_version(head, version);
    ck_assert_str_eq(version, "115db0d526402d17");
    static const char *const none[] = {
        "{\"version\":\"115db0d526402d17\",\"format\":\"hapifs-pack/1\"}", /* not second */
        "{\"format\":\"hapifs-pack/2\",\"version\":\"115db0d526402d17\"",
        "{\"format\":\"hapifs-pack/1\",\"version\":\"115DB0D526402D17\"",
        "{\"format\":\"hapifs-pack/1\",\"version\":\"115db0d526402d1\"",
        "{\"format\":\"hapifs-pack/1\",\"version\":\"115db0d526402d170\"",
        "{\"format\":\"hapifs-pack/1\",\"version\":\"115db0d5",
        "",
    };
    for (size_t i = 0; i < sizeof(none) / sizeof(*none); i++) {
        strcpy(version, "x");
        hapi_packindex_head_version(none[i], version);
        ck_assert_msg(version[0] == '\0', "head %zu named '%s'", i, version);
    }
}
END_TEST

START_TEST(the_text_stays_within_its_bound)
{
    /* The worst name: every byte a control character (six bytes escaped), as long as allowed. */
    static char worst[NAME_MAX - 5 + 1];
    memset(worst, '\x01', sizeof(worst) - 1);
    memcpy(worst + sizeof(worst) - 5, ".jpg", 5);
    hapi_packindex x = fixture();
    entries[4].name = worst; /* out of order: the writer does not mind */
    entries[4].id = (hapi_source_id){ UINT64_MAX >> 1, INT64_MIN, INT64_MIN, UINT64_MAX >> 1 };
    entries[4].code = HAPI_ECORRUPT;
    uint64_t bound = HAPI_PACKINDEX_HEAD_BOUND;
    for (int i = 0; i < ENTRIES; i++)
        bound += hapi_packindex_entry_bound(entries[i].name);
    size_t len;
    char *text = write_text(&x, &len);
    ck_assert_uint_le(len, bound);
    ck_assert_uint_gt(len, 6 * (sizeof(worst) - 5)); /* it was escaped */
    free(text);
}
END_TEST

/* A change to the golden index: key (of entries[entry] if entry >= 0) set to value, or removed. */
struct edit {
    int entry;
    const char *key;
    const char *value;           /* JSON text; NULL: remove the key */
};

/* The golden index with up to three edits, as text (the caller frees). */
static char *edited(const struct edit *edits)
{
    json_error_t je;
    json_t *j = json_loads(golden, 0, &je);
    ck_assert_ptr_nonnull(j);
    for (int i = 0; i < 3 && edits[i].key; i++) {
        const struct edit *e = &edits[i];
        json_t *o = e->entry >= 0 ? json_array_get(json_object_get(j, "entries"), (size_t)e->entry)
                                  : j;
        ck_assert_ptr_nonnull(o);
        if (e->value) {
            json_t *v = json_loads(e->value, JSON_DECODE_ANY, &je);
            ck_assert_msg(v != NULL, "bad test value %s", e->value);
            json_object_set_new(o, e->key, v);
        } else {
            json_object_del(o, e->key);
        }
    }
    char *text = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    ck_assert_ptr_nonnull(text);
    return text;
}

static const char disagree[] = "count, row_bytes or entries disagree";
static const char malformed[] = "missing or malformed namespace, dtype, row_shape or entries";
static const char header_disagree[] = "header_bytes or size disagree with the shape";

static const struct {
    struct edit edits[3];
    const char *message;
} refusals[] = {
    { { { -1, "format", "\"hapifs-pack/2\"" } }, "not a hapifs-pack/1 index" },
    { { { -1, "format", NULL } }, "not a hapifs-pack/1 index" },
    { { { -1, "format", "1" } }, "not a hapifs-pack/1 index" },
    { { { -1, "namespace", NULL } }, malformed },
    { { { -1, "namespace", "\"0123456789ABCDEF0123456789abcdef\"" } }, malformed },
    { { { -1, "namespace", "\"0123456789abcdef0123456789abcde\"" } }, malformed },
    { { { -1, "dtype", "\"<f8\"" } }, malformed },
    { { { -1, "dtype", "4" } }, malformed },
    { { { -1, "row_shape", "[]" } }, malformed },
    { { { -1, "row_shape", "[1,1,1,1,1,1,1,1]" } }, malformed },
    { { { -1, "row_shape", "64" } }, malformed },
    { { { -1, "entries", "{}" } }, malformed },
    { { { -1, "row_shape", "[\"64\",7,7]" } }, "bad row_shape" },
    { { { -1, "row_shape", "[64,0,7]" } }, "bad row_shape" },
    { { { -1, "row_shape", "[64,7,16777217]" } }, "bad row_shape" },
    { { { -1, "count", "\"6\"" } }, disagree },
    { { { -1, "count", NULL } }, disagree },
    { { { -1, "count", "5" } }, disagree },
    { { { -1, "count", "-1" } }, disagree },
    { { { -1, "row_bytes", "6274" } }, disagree },
    { { { -1, "size", "37760.0" } }, disagree },
    /* absurd sizes: a row of 2^29 elements; seven dimensions whose product wraps to 0 */
    { { { -1, "row_shape", "[16777216,32]" }, { -1, "row_bytes", "1073741824" } }, disagree },
    { { { -1, "row_shape", "[16777216,16777216,65536]" }, { -1, "row_bytes", "0" },
        { -1, "size", "128" } }, disagree },
    { { { -1, "header_bytes", "64" } }, header_disagree },
    { { { -1, "size", "37761" } }, header_disagree },
    { { { -1, "size", "-1" } }, header_disagree },
    { { { 1, "name", "\"a/b.jpg\"" } }, "entry 1: bad name, identity or status" },
    { { { 1, "name", "\"..\"" } }, "entry 1: bad name, identity or status" },
    { { { 1, "name", "\"\"" } }, "entry 1: bad name, identity or status" },
    { { { 1, "name", "\"notes.txt\"" } }, "entry 1: bad name, identity or status" },
    { { { 1, "name", "7" } }, "entry 1: bad name, identity or status" },
    { { { 0, "name", NULL } }, "entry 0: bad name, identity or status" },
    { { { 2, "ino", NULL } }, "entry 2: bad name, identity or status" },
    { { { 2, "mtime_ns", "\"5\"" } }, "entry 2: bad name, identity or status" },
    { { { 5, "size", "3.5" } }, "entry 5: bad name, identity or status" },
    { { { 3, "status", NULL } }, "entry 3: bad name, identity or status" },
    { { { 3, "status", "0" } }, "entry 3: bad name, identity or status" },
    { { { 1, "name", "\" space.jpg\"" } }, "entry 1: names out of order" },
    /* names that are not UTF-8, in hex: one key only, lowercase pairs, no NUL, a name still */
    { { { 1, "name_hex", "\"2071\"" } }, "entry 1: bad name, identity or status" },
    { { { 1, "name", NULL }, { 1, "name_hex", "\"2g2e6a7067\"" } },
      "entry 1: bad name, identity or status" },
    { { { 1, "name", NULL }, { 1, "name_hex", "\"2E6A7067\"" } },
      "entry 1: bad name, identity or status" },
    { { { 1, "name", NULL }, { 1, "name_hex", "\"22712e6a706\"" } },
      "entry 1: bad name, identity or status" },
    { { { 1, "name", NULL }, { 1, "name_hex", "\"2200712e6a7067\"" } },
      "entry 1: bad name, identity or status" },
    { { { 1, "name", NULL }, { 1, "name_hex", "\"222f712e6a7067\"" } },
      "entry 1: bad name, identity or status" },
    { { { 1, "name", NULL }, { 1, "name_hex", "7" } }, "entry 1: bad name, identity or status" },
    { { { -1, "dir_hex", "\"74\"" } }, "bad dir or dir_hex" },
    { { { -1, "dir", NULL }, { -1, "dir_hex", "\"7\"" } }, "bad dir or dir_hex" },
    { { { 5, "name", "\"b.jpg\"" } }, "entry 5: names out of order" },
};

START_TEST(a_bad_index_is_refused_with_why)
{
    int i = _i;
    char *text = edited(refusals[i].edits);
    hapi_packindex *y = (hapi_packindex *)&y; /* not NULL: a refusal must set it to NULL */
    hapi_error err = { 0 };
    int rc = hapi_packindex_parse(text, strlen(text), &y, &err);
    ck_assert_msg(rc == HAPI_ECORRUPT, "case %d (%s): %d", i, text, rc);
    ck_assert_ptr_null(y);
    ck_assert_str_eq(err.message, refusals[i].message);
    ck_assert_int_eq(err.code, HAPI_ECORRUPT);
    /* The remote mount's check (the fuzz target's) refuses it alike. */
    hapi_error err2 = { 0 };
    ck_assert_int_eq(hapi_remote_index_check(text, strlen(text), "train", &err2), HAPI_ECORRUPT);
    ck_assert_str_eq(err2.message, refusals[i].message);
    free(text);
}
END_TEST

/*
 * A name or a directory that is not UTF-8 (Latin-1, from an old archive) is written in hex
 * (JSON strings are Unicode: the whole index could not be written) and parses back to its bytes.
 */
START_TEST(a_name_that_is_not_utf8_goes_in_hex)
{
    hapi_packindex x = fixture();
    static const char latin1[] = "zz\xe9t\xe9.JPG";
    x.dir = "train/d\xe9j\xe0";
    entries[5].name = latin1;
    size_t len;
    char *text = write_text(&x, &len);
    ck_assert_ptr_nonnull(strstr(text, "\"dir_hex\":\"747261696e2f64e96ae0\","));
    ck_assert_ptr_nonnull(strstr(text, "{\"name_hex\":\"7a7ae974e92e4a5047\",\"size\":3,"));
    ck_assert_ptr_nonnull(strstr(text, "{\"name\":\" space.jpg\","));
    ck_assert_ptr_null(strstr(text, "\"dir\":"));
    hapi_packindex *y = NULL;
    hapi_error err = { 0 };
    ck_assert_int_eq(hapi_packindex_parse(text, len, &y, &err), 0);
    ck_assert_int_eq(hapi_remote_index_check(text, len, "train/x", &err), 0);
    ck_assert_str_eq(y->dir, x.dir);
    ck_assert_str_eq(y->entries[5].name, latin1);
    ck_assert_str_eq(y->entries[0].name, names[0]);
    char version[17];
    hapi_packindex_version(&x, version);
    ck_assert_str_eq(y->version, version);
    hapi_packindex_free(y);
    free(text);
}
END_TEST

START_TEST(a_name_too_long_for_its_feat_is_refused)
{
    char name[NAME_MAX - 1]; /* as JSON: quoted, NAME_MAX - 4 bytes (one over), a NUL */
    memset(name, 'n', sizeof(name));
    name[0] = '"';
    memcpy(name + sizeof(name) - 6, ".jpg\"", 6);
    ck_assert_uint_eq(strlen(name) - 2, NAME_MAX - 4);
    struct edit edits[3] = { { 5, "name", name } };
    char *text = edited(edits);
    hapi_packindex *y;
    hapi_error err = { 0 };
    ck_assert_int_eq(hapi_packindex_parse(text, strlen(text), &y, &err), HAPI_ECORRUPT);
    ck_assert_str_eq(err.message, "entry 5: bad name, identity or status");
    free(text);
    /* ... while NAME_MAX - 5 bytes are taken. */
    memcpy(name + sizeof(name) - 7, ".jpg\"", 6);
    text = edited(edits);
    ck_assert_int_eq(hapi_packindex_parse(text, strlen(text), &y, &err), 0);
    ck_assert_uint_eq(strlen(y->entries[5].name), NAME_MAX - 5);
    hapi_packindex_free(y);
    free(text);
}
END_TEST

START_TEST(a_torn_index_is_refused_an_old_tail_ignored)
{
    size_t len = strlen(golden);
    for (size_t n = 0; n < len; n++) {
        hapi_packindex *y;
        hapi_error err = { 0 };
        int rc = hapi_packindex_parse(golden, n, &y, &err);
        ck_assert_msg(rc == HAPI_ECORRUPT, "%zu bytes: %d", n, rc);
        ck_assert_msg(strncmp(err.message, "not JSON (", 10) == 0, "%zu bytes: %s", n,
                      err.message);
    }
    /* What a network filesystem's page cache may append: the tail of a longer, older index. */
    char *longer;
    ck_assert_int_ge(asprintf(&longer, "%s\"ino\":6,\"status\":\"cached\"}]}", golden), 0);
    hapi_packindex *y;
    hapi_error err = { 0 };
    ck_assert_int_eq(hapi_packindex_parse(longer, strlen(longer), &y, &err), 0);
    ck_assert_uint_eq(y->count, ENTRIES);
    hapi_packindex_free(y);
    free(longer);
}
END_TEST

START_TEST(the_fields_no_check_needs_are_optional)
{
    /* An index without dir, split, stage or a well-formed version is read; they are unknown. */
    struct edit edits[3] = { { -1, "dir", NULL }, { -1, "split", "\"3\"" },
                             { -1, "version", "\"x\"" } };
    char *text = edited(edits);
    hapi_packindex *y;
    hapi_error err = { 0 };
    ck_assert_int_eq(hapi_packindex_parse(text, strlen(text), &y, &err), 0);
    ck_assert_ptr_null(y->dir);
    ck_assert_int_eq(y->split, -1);
    ck_assert_str_eq(y->version, "");
    ck_assert_str_eq(y->stage, "layer1");
    hapi_packindex_free(y);
    free(text);
    /* A status other than cached or failed is pending; an error without failed is kept. */
    struct edit statuses_edits[3] = { { 0, "status", "\"computing\"" }, { 1, "error", "\"why\"" } };
    text = edited(statuses_edits);
    ck_assert_int_eq(hapi_packindex_parse(text, strlen(text), &y, &err), 0);
    ck_assert_int_eq(y->entries[0].status, HAPI_PACKINDEX_PENDING);
    ck_assert_str_eq(y->entries[1].error, "why");
    hapi_packindex_free(y);
    free(text);
    /* No entries at all: a pack of a header only. */
    struct edit empty[3] = { { -1, "entries", "[]" }, { -1, "count", "0" }, { -1, "size", "128" } };
    text = edited(empty);
    ck_assert_int_eq(hapi_packindex_parse(text, strlen(text), &y, &err), 0);
    ck_assert_uint_eq(y->count, 0);
    ck_assert_uint_eq(y->size, 128);
    hapi_packindex_free(y);
    free(text);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("packindex");
    struct {
        const char *name;
        const TTest *test;
    } cases[] = {
        { "the_bytes_do_not_change", the_bytes_do_not_change },
        { "a_written_index_parses_back_whole", a_written_index_parses_back_whole },
        { "the_version_is_of_what_may_be_served", the_version_is_of_what_may_be_served },
        { "the_head_names_the_version", the_head_names_the_version },
        { "the_text_stays_within_its_bound", the_text_stays_within_its_bound },
        { "a_name_too_long_for_its_feat_is_refused", a_name_too_long_for_its_feat_is_refused },
        { "a_name_that_is_not_utf8_goes_in_hex", a_name_that_is_not_utf8_goes_in_hex },
        { "a_torn_index_is_refused_an_old_tail_ignored",
          a_torn_index_is_refused_an_old_tail_ignored },
        { "the_fields_no_check_needs_are_optional", the_fields_no_check_needs_are_optional },
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(*cases); i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_add_test(tc, cases[i].test);
        suite_add_tcase(s, tc);
    }
    TCase *tc = tcase_create("a_bad_index_is_refused_with_why");
    tcase_add_loop_test(tc, a_bad_index_is_refused_with_why, 0,
                        (int)(sizeof(refusals) / sizeof(*refusals)));
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

/* packindex.c — the pack index format (DIR/.hapifs-pack.json) written and parsed: see packindex.h. */
#include "packindex.h"
#include "shared.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#define HEX_DIGITS "0123456789abcdef"
#define MAX_DIM (1 << 24)      /* a row_shape dimension */
#define MAX_ELEMS (1u << 28)   /* a row's elements */

static const char *dtype_name(int dtype)
{
    return dtype == HAPI_DTYPE_FP16 ? "<f2" : "<f4";
}

/* ---------------------------------------------------------------- version */

/* The failure code an entry contributes to the version: 0 unless it failed. */
static int entry_code(const hapi_packindex_entry *e)
{
    return e->status == HAPI_PACKINDEX_FAILED ? e->code : 0;
}

/*
 * The head's part of the version. The widths are those the format's
 * documentation names (int, size_t, int64_t): the version of an index must
 * not change with the struct that carries it.
 */
static void version_head(const hapi_packindex *x, XXH3_state_t *st)
{
    int dtype = x->dtype;
    size_t count = x->count;
    XXH3_64bits_update(st, x->ns_hex, strlen(x->ns_hex) + 1);
    XXH3_64bits_update(st, &dtype, sizeof(dtype));
    XXH3_64bits_update(st, &count, sizeof(count));
    for (int i = 0; i < x->ndim; i++) {
        int64_t d = x->shape[i];
        XXH3_64bits_update(st, &d, sizeof(d));
    }
}

static void version_entry(const hapi_packindex_entry *e, XXH3_state_t *st)
{
    int code = entry_code(e);
    XXH3_64bits_update(st, e->name, strlen(e->name) + 1);
    XXH3_64bits_update(st, &e->id, sizeof(e->id));
    XXH3_64bits_update(st, &code, sizeof(code));
}

static void version_hex(XXH3_state_t *st, char version[17])
{
    snprintf(version, 17, "%016llx", (unsigned long long)XXH3_64bits_digest(st));
}

void hapi_packindex_version(const hapi_packindex *x, char version[17])
{
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    version_head(x, &st);
    for (size_t i = 0; i < x->count; i++)
        version_entry(&x->entries[i], &st);
    version_hex(&st, version);
}

/* ----------------------------------------------------------------- writer */

static const char *status_name(hapi_packindex_status status)
{
    return status == HAPI_PACKINDEX_FAILED   ? "failed"
           : status == HAPI_PACKINDEX_CACHED ? "cached"
                                             : "pending";
}

/*
 * Text s as a JSON string under key, or, where s is not UTF-8 (a Latin-1 file
 * name: JSON strings are Unicode), its bytes in lowercase hex under key_hex.
 * A new reference with *used set to the key, or NULL without memory.
 */
static json_t *text_json(const char *s, const char *key, const char *key_hex, const char **used)
{
    json_t *v = json_string(s); /* NULL: not UTF-8, or no memory */
    *used = key;
    if (v)
        return v;
    size_t n = strlen(s);
    char *hex = malloc(2 * n + 1);
    if (!hex)
        return NULL;
    hapi_hex(s, n, hex);
    *used = key_hex;
    v = json_string(hex);
    free(hex);
    return v;
}

static json_t *entry_json(const hapi_packindex_entry *e)
{
    const hapi_source_id *id = &e->id;
    const char *key;
    json_t *name = text_json(e->name, "name", "name_hex", &key);
    if (!name)
        return NULL;
    json_t *j = json_pack("{s:o, s:I, s:I, s:I, s:I, s:s}", key, name,
                          "size", (json_int_t)id->size, "mtime_ns", (json_int_t)id->mtime_ns,
                          "ctime_ns", (json_int_t)id->ctime_ns, "ino", (json_int_t)id->ino,
                          "status", status_name(e->status));
    if (j && e->status == HAPI_PACKINDEX_FAILED)
        json_object_set_new(j, "error", json_string(hapi_strerror(e->code)));
    return j;
}

/* The whole index as JSON (a new reference), or NULL without memory. */
static json_t *index_json(const hapi_packindex *x, const char *version)
{
    json_t *shape = json_array(), *entries = json_array(), *j = NULL;
    const char *dir_key = "dir";
    json_t *dir = x->dir ? text_json(x->dir, "dir", "dir_hex", &dir_key) : NULL;
    int ok = shape && entries && (dir || !x->dir);
    for (int i = 0; ok && i < x->ndim; i++)
        ok = json_array_append_new(shape, json_integer(x->shape[i])) == 0;
    for (size_t i = 0; ok && i < x->count; i++)
        ok = json_array_append_new(entries, entry_json(&x->entries[i])) == 0;
    /* jansson keeps insertion order: "format" and "version" come first */
    if (ok)
        j = json_pack("{s:s, s:s, s:O?, s:s, s:s, s:i, s:s?, s:s, s:O,"
                      " s:I, s:I, s:I, s:I, s:s, s:O}",
                      "format", HAPI_PACK_FORMAT, "version", version, dir_key, dir,
                      "pack", HAPI_PACK_NAME, "namespace", x->ns_hex, "split", x->split,
                      "stage", x->stage, "dtype", dtype_name(x->dtype), "row_shape", shape,
                      "count", (json_int_t)x->count, "header_bytes", (json_int_t)x->header_bytes,
                      "row_bytes", (json_int_t)x->row_bytes, "size", (json_int_t)x->size,
                      "failed_rows", "NaN", "entries", entries);
    json_decref(shape);
    json_decref(entries);
    json_decref(dir);
    return j;
}

int hapi_packindex_write(const hapi_packindex *x, char **text, size_t *len)
{
    char version[17];
    hapi_packindex_version(x, version);
    json_t *j = index_json(x, version);
    *text = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (!*text)
        return -ENOMEM;
    *len = strlen(*text);
    return 0;
}

uint64_t hapi_packindex_entry_bound(const char *name)
{
    return 6 * strlen(name) + 256; /* \uXXXX escapes at worst */
}

/* ----------------------------------------------------------------- parser */

/* Whether s is n lowercase hex digits and nothing more. */
static int hex_ok(const char *s, size_t n)
{
    return strlen(s) == n && strspn(s, HEX_DIGITS) == n;
}

/* A copy of o[key] when it is a string (*out NULL when it is not). Returns 0 or -ENOMEM. */
static int string_of(json_t *o, const char *key, const char **out)
{
    const char *s = json_string_value(json_object_get(o, key));
    *out = s ? strdup(s) : NULL;
    return s && !*out ? -ENOMEM : 0;
}

/*
 * o[key] when it is a string, else o[key_hex] decoded when it is lowercase hex
 * of bytes other than NUL (see text_json()): a copy in *out, NULL when there
 * is neither. Returns 0, -ENOMEM, or HAPI_ECORRUPT (both keys, or bad hex).
 */
static int text_of(json_t *o, const char *key, const char *key_hex, const char **out)
{
    const char *s = json_string_value(json_object_get(o, key));
    const char *hex = json_string_value(json_object_get(o, key_hex));
    *out = NULL;
    if (s && hex)
        return HAPI_ECORRUPT;
    if (!hex)
        return string_of(o, key, out);
    size_t n = strlen(hex);
    if (n % 2)
        return HAPI_ECORRUPT;
    char *text = malloc(n / 2 + 1);
    if (!text)
        return -ENOMEM;
    text[n / 2] = '\0';
    if (hapi_unhex(hex, n / 2, text) < 0 || strlen(text) != n / 2) { /* or a NUL byte in it */
        free(text);
        return HAPI_ECORRUPT;
    }
    *out = text;
    return 0;
}

/* A name from an index: one path component, not "." or "..", an image. */
static int name_ok(const char *name)
{
    size_t len = strlen(name);
    return len > 0 && len <= NAME_MAX - 5 && !strchr(name, '/') && strcmp(name, ".") != 0 &&
           strcmp(name, "..") != 0 && hapi_image_name_is_image(name);
}

static int64_t json_int_of(json_t *o, const char *key, int *bad)
{
    json_t *v = json_object_get(o, key);
    if (!json_is_integer(v)) {
        *bad = 1;
        return 0;
    }
    return json_integer_value(v);
}


static hapi_packindex_status status_of(const char *status)
{
    return strcmp(status, "failed") == 0   ? HAPI_PACKINDEX_FAILED
           : strcmp(status, "cached") == 0 ? HAPI_PACKINDEX_CACHED
                                           : HAPI_PACKINDEX_PENDING;
}

/*
 * Parses the x->count entries of an index (entries, a JSON array of as many)
 * into x->entries: each one's name, identity, status and error, the names in
 * byte order. Returns 0, HAPI_ECORRUPT or -ENOMEM with why in err.
 */
static int parse_entries(hapi_packindex *x, json_t *entries, hapi_error *err)
{
    int rc = HAPI_ECORRUPT, bad = 0;
    for (size_t i = 0; i < x->count; i++) {
        json_t *e = json_array_get(entries, i);
        const char *status = json_string_value(json_object_get(e, "status"));
        hapi_packindex_entry *ie = &x->entries[i];
        /* the entry owns its name from here: hapi_packindex_free() frees it */
        int name_rc = text_of(e, "name", "name_hex", &ie->name);
        if (name_rc == -ENOMEM)
            return hapi_error_set(err, -ENOMEM, "out of memory");
        const char *name = ie->name;
        ie->id.size = (uint64_t)json_int_of(e, "size", &bad);
        ie->id.mtime_ns = json_int_of(e, "mtime_ns", &bad);
        ie->id.ctime_ns = json_int_of(e, "ctime_ns", &bad);
        ie->id.ino = (uint64_t)json_int_of(e, "ino", &bad);
        if (bad || name_rc < 0 || !name || !name_ok(name) || !status) {
            hapi_error_set(err, rc, "entry %zu: bad name, identity or status", i);
            return rc;
        }
        /* The pack's rows are in the byte order of the names: the index must say so too. */
        if (i > 0 && strcmp(x->entries[i - 1].name, name) >= 0) {
            hapi_error_set(err, rc, "entry %zu: names out of order", i);
            return rc;
        }
        ie->status = status_of(status);
        if (string_of(e, "error", &ie->error) < 0)
            return hapi_error_set(err, -ENOMEM, "out of memory");
    }
    return 0;
}

/*
 * The head's namespace, dtype and row_shape into x, and whether format and
 * entries are there. Returns 0 or HAPI_ECORRUPT with why in err.
 */
static int parse_kind(hapi_packindex *x, json_t *j, hapi_error *err)
{
    int rc = HAPI_ECORRUPT;
    json_t *format = json_object_get(j, "format"), *entries = json_object_get(j, "entries");
    json_t *shape = json_object_get(j, "row_shape");
    const char *dtype = json_string_value(json_object_get(j, "dtype"));
    const char *ns = json_string_value(json_object_get(j, "namespace"));
    if (!json_is_string(format) || strcmp(json_string_value(format), HAPI_PACK_FORMAT) != 0)
        return hapi_error_set(err, rc, "not a %s index", HAPI_PACK_FORMAT);
    if (!ns || !hex_ok(ns, 32) || !dtype ||
        (strcmp(dtype, "<f2") != 0 && strcmp(dtype, "<f4") != 0) || !json_is_array(shape) ||
        json_array_size(shape) < 1 || json_array_size(shape) > HAPI_MAX_DIMS - 1 ||
        !json_is_array(entries))
        return hapi_error_set(err, rc,
                              "missing or malformed namespace, dtype, row_shape or entries");
    memcpy(x->ns_hex, ns, 33);
    x->dtype = strcmp(dtype, "<f2") == 0 ? HAPI_DTYPE_FP16 : HAPI_DTYPE_FP32;
    x->ndim = (int)json_array_size(shape);
    for (int i = 0; i < x->ndim; i++) {
        json_t *d = json_array_get(shape, (size_t)i);
        if (!json_is_integer(d) || json_integer_value(d) < 1 || json_integer_value(d) > MAX_DIM)
            return hapi_error_set(err, rc, "bad row_shape");
        x->shape[i] = json_integer_value(d);
    }
    return 0;
}

/*
 * The head's count and sizes into x, checked against the shape (parsed
 * before) and the entries. Returns 0 or HAPI_ECORRUPT with why in err.
 */
static int parse_sizes(hapi_packindex *x, json_t *j, hapi_error *err)
{
    int rc = HAPI_ECORRUPT, bad = 0;
    /*
     * Stopped past the bound, so it cannot wrap: seven dimensions of up to
     * 2^24 could multiply to 2^64, a row of 0 bytes.
     */
    uint64_t elems = 1;
    for (int i = 0; i < x->ndim && elems <= MAX_ELEMS; i++)
        elems *= (uint64_t)x->shape[i];
    uint64_t row = elems * (x->dtype == HAPI_DTYPE_FP16 ? 2 : 4);
    int64_t count = json_int_of(j, "count", &bad), row_bytes = json_int_of(j, "row_bytes", &bad);
    int64_t header_bytes = json_int_of(j, "header_bytes", &bad);
    int64_t size = json_int_of(j, "size", &bad);
    if (bad || elems > MAX_ELEMS || count < 0 ||
        (size_t)count != json_array_size(json_object_get(j, "entries")) ||
        (uint64_t)row_bytes != row)
        return hapi_error_set(err, rc, "count, row_bytes or entries disagree");
    /* The header of a row alone (a .feat's) must exist too: the compute side serves it. */
    char header[HAPI_NPY_HEADER_MAX];
    int hl = hapi_npy_header(header, x->dtype, x->shape, x->ndim);
    int64_t pack_shape[HAPI_MAX_DIMS];
    pack_shape[0] = count;
    memcpy(pack_shape + 1, x->shape, (size_t)x->ndim * sizeof(int64_t));
    int phl = hapi_npy_header(header, x->dtype, pack_shape, x->ndim + 1);
    if (hl < 0 || phl < 0 || header_bytes != phl ||
        (uint64_t)size != (uint64_t)phl + (uint64_t)count * row)
        return hapi_error_set(err, rc, "header_bytes or size disagree with the shape");
    x->count = (size_t)count;
    x->row_bytes = row;
    x->header_bytes = (uint64_t)phl;
    x->size = (uint64_t)size;
    return 0;
}

/* The head's fields the checks do not need: version (if well-formed), dir, split, stage. */
static int parse_rest(hapi_packindex *x, json_t *j, hapi_error *err)
{
    const char *version = json_string_value(json_object_get(j, "version"));
    if (version && hex_ok(version, 16))
        memcpy(x->version, version, 17);
    json_t *split = json_object_get(j, "split");
    x->split = json_is_integer(split) && json_integer_value(split) >= 0 &&
                       json_integer_value(split) <= INT_MAX
                   ? (int)json_integer_value(split)
                   : -1;
    int dir_rc = text_of(j, "dir", "dir_hex", &x->dir);
    if (dir_rc == -ENOMEM || string_of(j, "stage", &x->stage) < 0)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    if (dir_rc < 0)
        return hapi_error_set(err, HAPI_ECORRUPT, "bad dir or dir_hex");
    return 0;
}

int hapi_packindex_parse(const char *text, size_t len, hapi_packindex **out, hapi_error *err)
{
    json_error_t je;
    *out = NULL;
    /* The first JSON value only (see packindex.h: an old tail may follow it). */
    json_t *j = json_loadb(text, len, JSON_DISABLE_EOF_CHECK, &je);
    if (!j)
        return hapi_error_set(err, HAPI_ECORRUPT, "not JSON (%s, line %d)", je.text, je.line);
    int rc;
    hapi_packindex *x = calloc(1, sizeof(*x));
    if (!x) {
        rc = hapi_error_set(err, -ENOMEM, "out of memory");
        goto out;
    }
    if ((rc = parse_kind(x, j, err)) < 0 || (rc = parse_sizes(x, j, err)) < 0 ||
        (rc = parse_rest(x, j, err)) < 0)
        goto out;
    if (!(x->entries = calloc(x->count ? x->count : 1, sizeof(*x->entries)))) {
        rc = hapi_error_set(err, -ENOMEM, "out of memory");
        goto out;
    }
    if ((rc = parse_entries(x, json_object_get(j, "entries"), err)) < 0)
        goto out;
    *out = x;
    x = NULL;
out:
    json_decref(j);
    hapi_packindex_free(x);
    return rc;
}

void hapi_packindex_free(hapi_packindex *x)
{
    if (!x)
        return;
    for (size_t i = 0; x->entries && i < x->count; i++) {
        free((char *)x->entries[i].name);
        free((char *)x->entries[i].error);
    }
    free(x->entries);
    free((char *)x->dir);
    free((char *)x->stage);
    free(x);
}

/* ------------------------------------------------------------------- head */

void hapi_packindex_head_version(const char *head, char version[17])
{
    static const char prefix[] = "{\"format\":\"" HAPI_PACK_FORMAT "\",\"version\":\"";
    version[0] = '\0';
    if (strncmp(head, prefix, sizeof(prefix) - 1) != 0)
        return;
    head += sizeof(prefix) - 1;
    if (strspn(head, HEX_DIGITS) != 16 || head[16] != '"')
        return;
    memcpy(version, head, 16);
    version[16] = '\0';
}

/* packindex.h — the pack index format (DIR/.hapifs-pack.json): its struct, its writer, its parser. */
#ifndef HAPI_FUSEFS_PACKINDEX_H
#define HAPI_FUSEFS_PACKINDEX_H

#include <stddef.h>
#include <stdint.h>

#include "cache.h"
#include "extractor.h"
#include "hapi.h"

/*
 * The index of a directory's pack: what a storage mount serves as
 * DIR/.hapifs-pack.json beside DIR/.hapifs-pack.npy (pack.c fills a
 * hapi_packindex and writes it here), and what a compute-side mount
 * (-o remote) reads back before it trusts the pack (remote-index.c parses it
 * here). It is compact JSON, one object, its keys in this order:
 *
 *   format       "hapifs-pack/1" (HAPI_PACK_FORMAT)
 *   version      16 lowercase hex digits: see "The version" below
 *   dir          the directory, relative to the source's root ("" for the root);
 *                dir_hex instead where it is not UTF-8 (see name_hex)
 *   pack         ".hapifs-pack.npy" (HAPI_PACK_NAME), the file the index describes
 *   namespace    32 lowercase hex digits: the storage side's cache namespace
 *                (model, split, dtype, preprocessing, precision); the compute
 *                side's cache key is (namespace, path, identity)
 *   split        the split: the stages [0, split) the storage side runs
 *   stage        the name of stage split - 1, whose output the rows are
 *   dtype        "<f4" or "<f2": a row's elements, little-endian
 *   row_shape    the shape of one row (one image's features), 1 to
 *                HAPI_MAX_DIMS - 1 dimensions, each 1 to 2^24
 *   count        rows: the number of entries
 *   header_bytes the pack's .npy header: the length hapi_npy_header() gives
 *                for (count, row_shape...) in dtype
 *   row_bytes    bytes of a row: the product of row_shape times 2 or 4
 *   size         the pack's bytes: header_bytes + count * row_bytes
 *   failed_rows  "NaN": what a failed row's elements are in the pack
 *   entries      per row, in the byte order of the names (the pack's order):
 *     name       the image's name in dir: one path component, not "." or
 *                "..", an image name (.jpg .jpeg .png), at most NAME_MAX - 5
 *                bytes (its .feat name must fit)
 *     name_hex   instead of name where the name is not UTF-8 (a Latin-1 name
 *                from an old archive; JSON strings are Unicode): its bytes as
 *                lowercase hex pairs, none 00. Never both.
 *     size, mtime_ns, ctime_ns, ino
 *                the image's identity (hapi_source_id) when the snapshot was taken
 *     status     "cached" (in the storage side's cache), "pending" (not yet
 *                computed) or "failed" (it cannot be: its row is NaN)
 *     error      only with "failed": why, as text (hapi_strerror())
 *
 * The version is a hash (XXH3-64) of everything in the index that says what
 * the compute side may serve: the namespace's hex and its NUL, dtype (an
 * int), count (a size_t), each row_shape dimension (an int64_t), then per
 * entry its name and NUL, its identity (the 32 bytes of hapi_source_id) and
 * its failure code (an int, 0 unless failed). Not the statuses cached and
 * pending, which change while features are computed. It is always the
 * second key, so a compute-side mount checks a kept index by reading the
 * first few hundred bytes (hapi_packindex_head_version()), not all of it.
 *
 * A parser refuses (HAPI_ECORRUPT) an index whose format is another, whose
 * namespace, dtype, row_shape, entries or an entry's name, identity or
 * status is missing or malformed (a name_hex or dir_hex too, or beside its
 * name or dir), whose count, row_bytes, header_bytes or
 * size disagree with the shape and the entries, or whose names are out of
 * order. It reads only the first JSON value of the text: through a network
 * filesystem that kept an older, longer size, a read past the new content's
 * end returns the old tail. It does not check the version against the
 * entries (a parsed index has no failure codes), nor pack and failed_rows.
 */

typedef enum hapi_packindex_status {
    HAPI_PACKINDEX_PENDING = 0,  /* parsed from any status but "cached" and "failed" */
    HAPI_PACKINDEX_CACHED = 1,
    HAPI_PACKINDEX_FAILED = 2
} hapi_packindex_status;

typedef struct hapi_packindex_entry {
    const char *name;
    hapi_source_id id;
    hapi_packindex_status status;
    /*
     * A failed row's reason, a code (HAPI_... or -errno, not 0): the writer
     * hashes it into the version and writes hapi_strerror(code) as "error".
     * 0 in a parsed index, which carries the text only.
     */
    int code;
    /* A parsed failed row's "error" text, NULL if it has none. The writer does not read it. */
    const char *error;
} hapi_packindex_entry;

typedef struct hapi_packindex {
    char version[17];          /* parsed: as the text says, "" if it names none or a malformed one;
                                  the writer computes it (hapi_packindex_version()) */
    const char *dir;           /* parsed: NULL when the text has no such string */
    char ns_hex[33];
    int split;                 /* parsed: -1 when the text has no such integer */
    const char *stage;         /* parsed: NULL when the text has no such string */
    int dtype;                 /* enum hapi_dtype */
    int ndim;                  /* of a row */
    int64_t shape[HAPI_MAX_DIMS];
    uint64_t header_bytes;     /* the writer writes these three as given */
    uint64_t row_bytes;
    uint64_t size;
    size_t count;
    hapi_packindex_entry *entries; /* count of them, in the byte order of their names */
} hapi_packindex;

/*
 * Ownership: a hapi_packindex that hapi_packindex_parse() made owns its
 * strings and its entries (hapi_packindex_free()); one its caller fills for
 * the writer is the caller's, every pointer borrowed for the call.
 */

/* x's version: 16 lowercase hex digits and a NUL into version (see above). */
void hapi_packindex_version(const hapi_packindex *x, char version[17]);

/*
 * Writes x as index text (malloc'd, *len bytes and a NUL; the caller frees
 * it) with the version computed, the fields as given: x must be what the
 * parser accepts for the parser to accept it. Returns 0 or -ENOMEM (*text
 * NULL).
 */
int hapi_packindex_write(const hapi_packindex *x, char **text, size_t *len);

/* Bytes the writer's text can take: a head, then per entry a bound of its own. */
#define HAPI_PACKINDEX_HEAD_BOUND 4096
/* The bound of an entry named name (its \uXXXX escapes, error text, numbers included). */
uint64_t hapi_packindex_entry_bound(const char *name);

/*
 * Parses the len bytes of text (no NUL needed) as an index, checking every
 * field against the others (see above). Returns 0 with *out (free it with
 * hapi_packindex_free()), or HAPI_ECORRUPT / -ENOMEM with why in err and
 * *out NULL.
 */
int hapi_packindex_parse(const char *text, size_t len, hapi_packindex **out, hapi_error *err);

/* Frees a parsed index. Accepts NULL. */
void hapi_packindex_free(hapi_packindex *x);

/*
 * The version named at the head of an index text (head, NUL-terminated, a
 * few hundred bytes are enough) into version: "" when the head is not of a
 * HAPI_PACK_FORMAT index or names no well-formed version.
 */
void hapi_packindex_head_version(const char *head, char version[17]);

#endif

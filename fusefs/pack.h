/* pack.h — per-directory packs and their indexes. */
#ifndef HAPI_FUSEFS_PACK_H
#define HAPI_FUSEFS_PACK_H

#include <stdint.h>
#include <sys/types.h>
#include <time.h>

#include "serve.h"
#include "shared.h"
#include "source.h"
#include "view.h"

/*
 * Per-directory packs: DIR/.hapifs-pack.npy holds the features of every
 * image directly in DIR (those its listing shows as .feat), in the byte
 * order of their names, as one .npy array of shape (N, feature shape), so
 * that a reader fetches a directory's features with a few large sequential
 * reads instead of a lookup, an open, a read and a release per file.
 * DIR/.hapifs-pack.json is its index: the namespace, the shape, and per
 * image its name, source identity and status. Neither is listed.
 *
 * A pack is a snapshot taken when it is opened (the names and identities,
 * the view): its bytes stay those of that snapshot however the directory
 * changes. A sample that cannot be computed (an undecodable image) does not
 * fail the pack: its row is all NaN, the index says "failed", and its own
 * .feat stays an error.
 */

typedef struct hapi_packs hapi_packs;
typedef struct hapi_pack hapi_pack;

/* Makes the pack layer over borrowed layers. Returns 0 or -ENOMEM. */
int hapi_packs_new(hapi_source *source, hapi_views *views, hapi_serve *serve, hapi_packs **out);
void hapi_packs_free(hapi_packs *p);

/* What a directory's pack looks like now, without computing anything. */
typedef struct hapi_pack_info {
    uint64_t count;            /* images */
    uint64_t size;             /* bytes of the pack (header + count rows) */
    uint64_t index_bound;      /* the index is never longer than this */
    struct timespec mtime, ctime; /* the latest of the directory's and its images' */
    uint64_t key;              /* a hash of what its bytes are: namespace, names, identities */
} hapi_pack_info;

/*
 * Describes dir's pack at the current view (waiting for the first).
 * Returns 0, -ENOENT (no image directly in dir), -ENOTDIR, -ENODEV
 * (unmounting) or -errno.
 */
int hapi_pack_info_get(hapi_packs *p, const char *dir, hapi_pack_info *info);

/*
 * Opens dir's pack at the current view: a snapshot of its images. who (NULL:
 * anyone) must be able to read every one of them, or it is -EACCES: a pack
 * holds the features of each. Returns 0 or what hapi_pack_info_get()
 * returns; *out NULL on failure.
 */
int hapi_pack_open(hapi_packs *p, const char *dir, const hapi_cred *who, hapi_pack **out);
/* What an open pack is (as hapi_pack_info_get() told before it was opened). */
void hapi_pack_describe(const hapi_pack *k, hapi_pack_info *info);
/* The pack's size in bytes. */
uint64_t hapi_pack_size(const hapi_pack *k);
/*
 * The key of its snapshot (as hapi_pack_info's): two opens with one key read
 * the same bytes (but for rows of images that change while being read).
 */
uint64_t hapi_pack_key(const hapi_pack *k);
/*
 * Fills buf with bytes [off, off + size) of the pack, computing the rows it
 * covers (and asking for the next ones ahead). Waits only for the rows it
 * covers. Returns the bytes written (0 at the end), or -ECANCELED / -ENOMEM.
 * Thread-safe.
 */
ssize_t hapi_pack_read(hapi_pack *k, char *buf, size_t size, off_t off);
/* Closes it. Accepts NULL. */
void hapi_pack_close(hapi_pack *k);

/*
 * dir's index as JSON text (malloc'd, *len bytes, the caller frees), made
 * now. Returns 0 or what hapi_pack_info_get() returns.
 */
int hapi_pack_index(hapi_packs *p, const char *dir, char **text, size_t *len);

typedef struct hapi_pack_stats {
    uint64_t opens, reads, bytes, rows, rows_failed, index_reads;
    uint64_t rows_split;         /* rows a read covered in part, kept for the other parts */
    uint64_t rows_split_dropped; /* ... dropped (no room) before every part was read */
} hapi_pack_stats;
void hapi_pack_stats_get(hapi_packs *p, hapi_pack_stats *st);

#endif

/* view.h — what a .feat is at one split; the holder of the current view. */
#ifndef HAPI_FUSEFS_VIEW_H
#define HAPI_FUSEFS_VIEW_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "cache.h"
#include "extractor.h"
#include "hapi.h"

/*
 * What the .feat files are at one split: the namespace, the .npy header,
 * the size, and the batcher that computes them. Every field is fixed before
 * the view is shared (the batcher is attached by serve.c, which made it);
 * only refs changes after. A read keeps the view it opened the file with,
 * so a live split change never mixes two shapes in one open file; the view
 * goes when its last user puts it.
 */
typedef struct hapi_view {
    atomic_int refs;
    int split;                   /* stages [0, split) */
    int dtype;                   /* enum hapi_dtype of the features */
    hapi_stage_info output;      /* of stage split - 1 */
    hapi_cache_namespace ns;
    char ns_hex[33];
    char npy_header[HAPI_NPY_HEADER_MAX];
    size_t npy_header_len;
    size_t sample_bytes;
    uint64_t feat_size;          /* header + data */
    uint64_t serial;             /* 1, 2, ... in order of creation */
    hapi_batcher *batcher;       /* freed with the view */
    void *batcher_ctx;           /* the batcher's context, freed (free()) after it */
} hapi_view;

/* The holder of the current view. Thread-safe. */
typedef struct hapi_views hapi_views;

/*
 * Makes the holder for features of ex's model in dtype (enum hapi_dtype),
 * computed in precision (enum hapi_precision), with no current view. Checks
 * that ex's split makes an .npy. Returns 0 or < 0 with err. ex must outlive it.
 */
int hapi_views_new(hapi_extractor *ex, int dtype, int precision, hapi_views **out,
                   hapi_error *err);
/* Frees the holder and puts the current view. Accepts NULL. */
void hapi_views_free(hapi_views *vs);

/*
 * The namespace of split: everything that changes the bytes of a feature
 * (model digest, split, dtype, preprocessing, precision).
 */
void hapi_views_namespace(const hapi_views *vs, int split, hapi_cache_namespace *ns);

/*
 * Describes the .feat files at split in a new view (one reference, no
 * batcher yet, not current). Returns 0 or HAPI_EINVAL / -ENOMEM with err.
 */
int hapi_view_new(hapi_views *vs, int split, hapi_view **out, hapi_error *err);

/* The current view with a reference, waiting while there is none yet; NULL once stopped. */
hapi_view *hapi_views_get(hapi_views *vs);
/* The current view with a reference, or NULL if there is none; never waits. */
hapi_view *hapi_views_peek(hapi_views *vs);
/*
 * Makes v current, taking over the caller's reference, and returns the
 * previous current view with its reference (NULL for the first). v NULL
 * means there will be nothing to serve: waiters get NULL, as after stop.
 */
hapi_view *hapi_views_swap(hapi_views *vs, hapi_view *v);
/* No view will come any more: wakes every hapi_views_get() waiter with NULL. */
void hapi_views_stop(hapi_views *vs);

/*
 * A read of bytes [off, off + size) of a .feat (an .npy header of header_len
 * bytes, then the features, feat_size bytes in all): copies the header's
 * part into buf and sets [*dpos, *dend), the part of the features that
 * follows it in buf. Returns the header bytes copied, or -1 at or past the end.
 */
ssize_t hapi_feat_split_read(const char *header, size_t header_len, uint64_t feat_size,
                             char *buf, size_t size, off_t off, size_t *dpos, size_t *dend);

/* If name is "<image>.feat" for an image name, the length of "<image>", else 0. */
size_t hapi_feat_stem_len(const char *name);

/*
 * The bytes of NaN in dtype (little-endian, as the .npy header says), *width
 * of them: a pack's row whose image could not be computed repeats them.
 */
const unsigned char *hapi_feat_nan(int dtype, size_t *width);

/* Adds a reference. */
void hapi_view_ref(hapi_view *v);
/* Drops one; the last frees the view and its batcher. Accepts NULL. */
void hapi_view_put(hapi_view *v);

#endif

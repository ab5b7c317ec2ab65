/* serve.h — the bytes of a .feat read: the cache, or computed through the view's batcher. */
#ifndef HAPI_FUSEFS_SERVE_H
#define HAPI_FUSEFS_SERVE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "cache.h"
#include "extractor.h"
#include "hapi.h"
#include "log.h"
#include "source.h"
#include "view.h"

/* Counters of the serving path; all cumulative since the mount. */
typedef struct hapi_serve_stats {
    uint64_t feat_reads;      /* read requests on .feat files */
    uint64_t feat_bytes;      /* bytes returned */
    uint64_t hits, misses;
    uint64_t computed;        /* samples computed and handed to the cache */
    uint64_t errors;          /* reads that failed (a kernel retry counts again) */
    uint64_t cache_put_failures;
    uint64_t hit_ns;          /* time in cache lookups that hit */
    uint64_t stale;           /* lookups that found an older version's features */
    uint64_t bad;             /* lookups that found damaged entries */
    uint64_t collected;       /* entries of deleted sources removed */
    uint64_t passthrough_bytes; /* asked of source files shown as they are */
    uint64_t completed[HAPI_PRIORITY_COUNT]; /* requests answered (computed or failed), by
                                                the priority they were made at */
    uint64_t origin_computed[HAPI_PRIORITY_COUNT]; /* computed, by who asked first */
} hapi_serve_stats;

/* What serving needs: borrowed, all must outlive it. */
typedef struct hapi_serve_config {
    hapi_source *source;
    hapi_extractor *ex;
    hapi_cache *cache;
    hapi_views *views;
    hapi_error_ring *errors;   /* failed samples are recorded here */
    int batch_wait_us;         /* how long a partial batch waits for more demand */
    int decode_threads;
    uint64_t mem_budget;       /* in-flight images and tensors, model included */
    hapi_node *node;           /* the node's budget and cores, which batchers draw from */
    int torch_threads;         /* core tokens the inferences of a batcher hold */
    int inference_workers;     /* inference threads of a batcher, sharing torch_threads */
} hapi_serve_config;

typedef struct hapi_serve hapi_serve;

/* Makes the serving layer. Returns 0 or -ENOMEM with err. */
int hapi_serve_new(const hapi_serve_config *cfg, hapi_serve **out, hapi_error *err);
/* Frees it (every view made by it must be gone). Accepts NULL. */
void hapi_serve_free(hapi_serve *s);

/*
 * Makes a view of split with its batcher started (not yet current).
 * model_bytes is the memory the model itself takes at that split and batch
 * (from the profile; 0 if unknown): the batcher's budget is what the mount's
 * budget leaves. Returns 0 or < 0 with err.
 */
int hapi_serve_view_new(hapi_serve *s, int split, int batch, uint64_t model_bytes,
                        hapi_view **out, hapi_error *err);

/*
 * Registers fn, called after every miss has been submitted, with the view and
 * the image path (prefetch: the layer above queues the rest of the directory).
 * Set once, before the first read; fn runs on the reading thread.
 */
void hapi_serve_on_miss(hapi_serve *s, void (*fn)(void *arg, hapi_view *v, const char *path),
                        void *arg);

/*
 * Fills buf with bytes [off, off + size) of the .feat of image path, opened
 * with identity *id at view v: from the cache, or computed by v's batcher
 * (waiting; one computation however many readers wait); a view without a
 * batcher (an old split's, made for the read) reads the cache only, -ESTALE
 * on a miss. Returns the bytes written (0 at or past the end), or a negative
 * code: the image's failure
 * (HAPI_EDECODE, ...), recorded in the error ring, or -ECANCELED when
 * unmounting. Thread-safe.
 */
ssize_t hapi_serve_read(hapi_serve *s, hapi_view *v, const char *path, const hapi_source_id *id,
                        char *buf, size_t size, off_t off);

/*
 * One sample of a read of several (a pack): features bytes [from, to) of the
 * image path at identity id go to dst. A part with dst NULL is read-ahead:
 * asked for (unless cached) and not waited for.
 */
typedef struct hapi_serve_part {
    const char *path;
    const hapi_source_id *id;
    char *dst;
    size_t from, to;
    int code;            /* out: 0, or why this sample has no features */
} hapi_serve_part;

/*
 * Fills every part from the cache or by computing it at demand priority:
 * all misses are submitted before any is waited for, so that they share
 * batches. A sample's failure is its part's code (recorded in the error ring
 * by the sink), not the call's. Returns 0, -ENOMEM, or -ECANCELED when
 * unmounting. Thread-safe.
 */
int hapi_serve_read_parts(hapi_serve *s, hapi_view *v, hapi_serve_part *parts, size_t n);

/* 1 if the features of path at identity id are cached at v, else 0. Counts nothing. */
int hapi_serve_cached(hapi_serve *s, hapi_view *v, const char *path, const hapi_source_id *id);

#define HAPI_QUEUE_CACHED 1   /* hapi_serve_queue: already cached, nothing queued */
#define HAPI_QUEUE_SKIPPED 2  /* ... the source is gone or not a regular file */
/*
 * Queues the image path at v for background work at priority (prefetch or
 * warm-up), fire-and-forget, unless it is cached; waits while two batches of
 * that priority are queued. Returns 0 (queued), HAPI_QUEUE_CACHED,
 * HAPI_QUEUE_SKIPPED, or -ECANCELED (stop set, batcher stopping) / -ENOMEM.
 */
int hapi_serve_queue(hapi_serve *s, hapi_view *v, const char *path, int priority,
                     atomic_int *stop);

/* Counts bytes asked of a source file shown as it is (fs.c reads those itself). */
void hapi_serve_note_passthrough(hapi_serve *s, size_t bytes);

/* Removes the cached features of a source found deleted, at the current view. */
void hapi_serve_collect(hapi_serve *s, const char *path);

/*
 * Removes the current view's entries for path: an image, or every image
 * beneath a directory ("" = all). Returns the count, or < 0 with err.
 */
int hapi_serve_evict(hapi_serve *s, const char *path, hapi_error *err);

/* Fills *st. Thread-safe. */
void hapi_serve_stats_get(hapi_serve *s, hapi_serve_stats *st);

#endif

/* background.h — the warm-up walker, directory prefetch and the cache keeper. */
#ifndef HAPI_FUSEFS_BACKGROUND_H
#define HAPI_FUSEFS_BACKGROUND_H

#include <stdint.h>

#include "cache.h"
#include "hapi.h"
#include "serve.h"
#include "shared.h"
#include "source.h"
#include "view.h"

typedef struct hapi_background_config {
    hapi_source *source;
    hapi_cache *cache;
    hapi_views *views;
    hapi_serve *serve;         /* registers its miss hook there */
    int prefetch;              /* enum hapi_prefetch_mode */
    uint64_t cache_size;       /* the cache's bound (prefetch stays under half of it) */
    int warm;                  /* warm the whole tree at start */
} hapi_background_config;

typedef struct hapi_background hapi_background;

/*
 * Starts the cache keeper, the prefetch thread (prefetch=dir) and, with
 * warm, a warm-up of the whole tree (it counts at once and computes once the
 * first view exists). A thread that cannot start is logged and left out.
 * Returns 0 or -ENOMEM with err.
 */
int hapi_background_start(const hapi_background_config *cfg, hapi_background **out,
                          hapi_error *err);
/*
 * Stops and joins every thread and frees. The views must be stopped first
 * (hapi_views_stop) so that a walker waiting for the first view goes, and the
 * current view's batcher stopped so that one waiting for queue room goes.
 * Accepts NULL.
 */
void hapi_background_stop(hapi_background *bg);

/*
 * The number of images in the tree (found by the layer above), or ok 0 if
 * counting failed: prefetch waits for it to judge whether the tree fits half
 * the cache, and runs if it cannot know.
 */
void hapi_background_set_tree_size(hapi_background *bg, uint64_t images, int ok);

/* Starts warming path (relative; "" for all) in the background. Returns 0, -EBUSY, -errno. */
int hapi_warm_start(hapi_background *bg, const char *path);
/*
 * Stops an unfinished warm-up for good (ctl "warm stop"): the walker is told
 * to stop and joined; what it has queued already (two batches at most) is
 * still computed. Its status says HAPI_WARM_STOPPED until the next start.
 * Returns 1 if a warm-up was stopped, 0 if none was running.
 */
int hapi_warm_stop(hapi_background *bg);
/*
 * Stops an unfinished warm-up and returns what it was warming (malloc'd, to
 * hand to hapi_warm_start() again), or NULL if none was running.
 */
char *hapi_warm_pause(hapi_background *bg);

/* A warm-up's progress; path is a copy (malloc'd, NULL when idle): free it. */
typedef struct hapi_warm_status {
    int state;                 /* enum hapi_warm_state */
    char *path;
    uint64_t total, cached, skipped, submitted, completed;
    double elapsed_s;
} hapi_warm_status;
/* Fills *ws (a consistent path with the counters of its run). Returns 0 or -ENOMEM. */
int hapi_warm_status_get(hapi_background *bg, hapi_warm_status *ws);

typedef struct hapi_prefetch_stats {
    int mode;                                  /* enum hapi_prefetch_mode */
    uint64_t dirs, pending_dirs, submitted, cached, computed, dropped;
} hapi_prefetch_stats;
void hapi_prefetch_stats_get(hapi_background *bg, hapi_prefetch_stats *ps);

#endif

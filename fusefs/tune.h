/* tune.h — the profile, the policy, live split and batch changes. */
#ifndef HAPI_FUSEFS_TUNE_H
#define HAPI_FUSEFS_TUNE_H

#include <stdint.h>

#include "background.h"
#include "cache.h"
#include "extractor.h"
#include "hapi.h"
#include "options.h"
#include "policy.h"
#include "serve.h"
#include "source.h"
#include "view.h"

typedef struct hapi_tune_config {
    const hapi_fs_options *opt;
    hapi_source *source;
    hapi_extractor *ex;
    hapi_cache *cache;
    hapi_views *views;
    hapi_serve *serve;
    hapi_background *background;
    hapi_node *node;             /* the node's cores, all taken while profiling; NULL: none */
    /* Called after every split change, with only tune.switch_lock held (fs: kernel invalidation). */
    void (*on_split_change)(void *arg);
    void *arg;
    /*
     * If not NULL, a profile waits until serving(arg) returns 1 (at most
     * TUNE_SERVING_WAIT_MS): the mount's own start-up (the session, io_uring's
     * workers registering) would land in its timings.
     */
    int (*serving)(void *arg);
} hapi_tune_config;

typedef struct hapi_tune hapi_tune;

/*
 * Starts choosing in the background: the profile (stored or measured), the
 * decode cost, the policy's split and batch; then makes the first view
 * current and counts the tree. .feat operations wait for that view.
 * Returns 0 or < 0 with err.
 */
int hapi_tune_start(const hapi_tune_config *cfg, hapi_tune **out, hapi_error *err);
/*
 * Cancels a profile in progress, joins the thread and frees. Call it before
 * the views and the layers below go (it does not touch the current view).
 * Accepts NULL.
 */
void hapi_tune_stop(hapi_tune *t);

/*
 * Switches to split (1..freeze): a new view, the warm-up moved to it, the
 * callback called. by_operator says who asked. Returns 0, -EAGAIN (no first
 * view yet), HAPI_EINVAL or < 0 with err.
 */
int hapi_tune_set_split(hapi_tune *t, int split, int by_operator, hapi_error *err);
/* Sets the batch (0 = auto, else 1..HAPI_BATCH_MAX). Returns 0, -EAGAIN or HAPI_EINVAL. */
int hapi_tune_set_batch(hapi_tune *t, int batch, hapi_error *err);

enum hapi_tune_input {
    HAPI_TUNE_LINK, HAPI_TUNE_CLIENT_SPEED, HAPI_TUNE_EPOCHS,
    HAPI_TUNE_RTT,          /* seconds */
    HAPI_TUNE_TRANSPORT,    /* enum hapi_policy_transport */
    HAPI_TUNE_COMPUTE_CACHE, /* bytes */
    HAPI_TUNE_READERS,      /* concurrent per-file readers on the compute tier */
    HAPI_TUNE_COMPUTE_FILE_MS, /* ms; < 0: back to HAPI_POLICY_COMPUTE_FILE_MS */
    HAPI_TUNE_LINK_BYTES    /* in source images' bytes; < 0 (any): no bound */
};
/* Sets one of the policy's inputs (bits/s, a ratio, a count); the caller validated it. */
void hapi_tune_set_input(hapi_tune *t, int which, double value);
/* Sets the compute tier's measured ms per sample of stages [0, n) (n 0: none, the profile over
   client_speed); the caller validated them (n <= HAPI_PROFILE_MAX_STAGES, each >= 0). */
void hapi_tune_set_compute_stages(hapi_tune *t, int n, const double *ms);

/*
 * Runs the policy on the current inputs and cache state. split 0 lets it
 * choose; a split > 0 is explained against every other (its batch chosen);
 * split -1 means the current view's. Fills *choice and, if in_out is not
 * NULL, the inputs used (in_out->profile points into t: valid until the next
 * profile, i.e. for the mount's life). Returns 0, -EAGAIN (still measuring)
 * or HAPI_EINVAL (no profile) with err.
 */
int hapi_tune_choose(hapi_tune *t, int split, hapi_policy_input *in_out,
                     hapi_policy_choice *choice, hapi_error *err);

/* What tune holds now, for the control files. */
typedef struct hapi_tune_status {
    int split_by_operator;
    int batch, batch_auto;
    double link_bps, link_bytes, client_speed, rtt_s;
    double compute_file_ms;    /* the policy's input */
    int compute_file_given;    /* ... measured and given (mount option, ctl), not the default */
    int epochs, transport;
    uint64_t split_changes;
    int state;                 /* 0 measuring, 1 ready, < 0 failed (code) */
    char error[HAPI_ERROR_MESSAGE_MAX]; /* why, when failed */
    int reused;                /* the profile was read from the cache directory */
    double decode_ms, source_bytes;
    int decode_samples;
    int compute_nstages;       /* the compute tier's measured stages (0: none) */
    double compute_stage_ms[HAPI_PROFILE_MAX_STAGES];
} hapi_tune_status;
void hapi_tune_status_get(hapi_tune *t, hapi_tune_status *st);
/* The profile as JSON text (malloc'd, the caller frees), or NULL if there is none. */
char *hapi_tune_profile_json(hapi_tune *t);

#endif

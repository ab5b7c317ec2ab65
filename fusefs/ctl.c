/* ctl.c — the control files under .hapifs/: their content (JSON) and the table of commands ctl takes. */
#include "ctl.h"
#include "background.h"
#include "cache.h"
#include "extractor.h"
#include "hapi.h"
#include "log.h"
#include "metrics.h"
#include "options.h"
#include "pack.h"
#include "policy.h"
#include "remote.h"
#include "serve.h"
#include "shared.h"
#include "source.h"
#include "tune.h"
#include "uring.h"
#include "view.h"
#include "watch.h"

#include "policy.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

const char *const hapi_ctl_files[] = { "config", "stats", "metrics", "errors", "profile",
                                       "policy", HAPI_CTL_MODEL, HAPI_CTL_WRITABLE, NULL };

struct hapi_ctl {
    hapi_ctl_config cfg;
};

int hapi_ctl_new(const hapi_ctl_config *cfg, hapi_ctl **out)
{
    *out = calloc(1, sizeof(**out));
    if (!*out)
        return -ENOMEM;
    (*out)->cfg = *cfg;
    return 0;
}

void hapi_ctl_free(hapi_ctl *c)
{
    free(c);
}

hapi_ctl_text *hapi_ctl_text_new(const char *data, size_t len)
{
    hapi_ctl_text *t = malloc(sizeof(*t) + len + 1);
    if (!t)
        return NULL;
    atomic_init(&t->refs, 1);
    t->len = len;
    memcpy(t->data, data, len);
    t->data[len] = '\0';
    return t;
}

hapi_ctl_text *hapi_ctl_text_ref(hapi_ctl_text *t)
{
    atomic_fetch_add(&t->refs, 1);
    return t;
}

void hapi_ctl_text_put(hapi_ctl_text *t)
{
    if (t && atomic_fetch_sub(&t->refs, 1) == 1)
        free(t);
}

/* ---------------------------------------------------------------- render */

static json_t *shape_json(const hapi_stage_info *s)
{
    json_t *a = json_array();
    for (int i = 0; a && i < s->ndim; i++)
        json_array_append_new(a, json_integer(s->shape[i]));
    return a;
}

/* The split part of config: what a .feat is now, and what the training side still runs. */
static json_t *render_split(hapi_ctl *c)
{
    /* Waits while the policy chooses (a first mount's profile): scripts need the split. */
    hapi_view *v = hapi_views_get(c->cfg.views);
    int freeze = hapi_extractor_freeze(c->cfg.ex);
    if (!v)
        return json_pack("{s:s, s:i}", "state", "unmounting", "freeze", freeze);
    hapi_tune_status ts;
    hapi_tune_status_get(c->cfg.tune, &ts);
    json_t *j = json_pack("{s:i, s:s, s:i, s:o, s:[i, i], s:s, s:I, s:s, s:s}", "index",
                          v->split, "stage", v->output.name, "freeze", freeze, "shape",
                          shape_json(&v->output), "stages_after", v->split, freeze, "dtype",
                          c->cfg.opt->dtype == HAPI_DTYPE_FP16 ? "float16" : "float32",
                          "feat_size", (json_int_t)v->feat_size, "by",
                          ts.split_by_operator ? "operator" : "policy", "namespace", v->ns_hex);
    hapi_view_put(v);
    return j;
}

/* Whether the kernel sends requests through the ring (every worker registered). */
static int uring_active(hapi_ctl *c)
{
    hapi_uring_stats u;
    hapi_uring_stats_get(c->cfg.uring ? *c->cfg.uring : NULL, &u);
    return u.active;
}

/* precision=auto: what was measured (or read back) to choose; NULL without it. */
static json_t *render_precision_auto(hapi_ctl *c)
{
    const hapi_precision_choice *pa = c->cfg.precision_auto;
    char *text = pa ? hapi_precision_choice_to_json(pa) : NULL;
    json_t *choice = text ? json_loads(text, 0, NULL) : NULL;
    free(text);
    if (choice)
        json_object_set_new(choice, "stored", json_boolean(pa->stored));
    return choice;
}

static json_t *render_config(hapi_ctl *c)
{
    const hapi_fs_options *o = c->cfg.opt;
    const hapi_model_meta *meta = hapi_extractor_meta(c->cfg.ex);
    const hapi_preprocess *pp = hapi_extractor_preprocess(c->cfg.ex);
    hapi_model *m = hapi_extractor_model(c->cfg.ex);
    char digest[33];
    hapi_hex(hapi_extractor_model_digest(c->cfg.ex), 16, digest);

    json_t *stages = json_array();
    int n = hapi_model_num_stages(m);
    for (int i = 0; stages && i < n; i++) {
        hapi_stage_info info;
        if (hapi_model_stage(m, i, &info) < 0)
            continue;
        json_t *st = json_pack("{s:i, s:s, s:o, s:s}", "index", i, "name", info.name, "shape",
                               shape_json(&info), "precision",
                               hapi_precision_name(info.precision));
        /* a bf16 model's check at the probe, an int8 one's at its calibration: what moved a
           stage to fp32, or kept it in bf16 or int8 */
        if (st && (o->precision == HAPI_PRECISION_BF16 || o->precision == HAPI_PRECISION_INT8))
            json_object_set_new(st, "check_cosine", json_real(info.check_cosine));
        json_array_append_new(stages, st);
    }
    json_t *split = render_split(c);
    char rate[32];
    hapi_tune_status ts;
    hapi_tune_status_get(c->cfg.tune, &ts);
    hapi_policy_format_rate(ts.link_bps, rate, sizeof(rate));
    json_t *compute_stages = json_array();
    for (int i = 0; compute_stages && i < ts.compute_nstages; i++)
        json_array_append_new(compute_stages, json_real(ts.compute_stage_ms[i]));
    json_t *config = json_pack(
        "{s:s, s:o, s:o, s:{s:o, s:s, s:s, s:s?, s:s?, s:s, s:o}, s:o, "
        "s:{s:s, s:s, s:i, s:i, s:[f,f,f], s:[f,f,f], s:I}, s:{s:o, s:s, s:I}, "
        "s:{s:s, s:f, s:f, s:s, s:f, s:o, s:f, s:b, s:i}, s:{s:i, s:i, s:b, s:b, s:b, s:b, s:s, s:s, s:i, s:b, s:i, s:i, s:i, s:I, s:s}}",
        "version", HAPI_VERSION,
        /* paths as a person reads them, whatever their bytes: see hapi_json_text() */
        "source", hapi_json_text(o->source),
        "mountpoint", hapi_json_text(o->mountpoint),
        "model",
          "path", hapi_json_text(o->model), "digest", digest, "arch", meta->arch,
          /* random weights show here, so features of an untrained model are never a surprise */
          "weights", meta->weights[0] ? meta->weights : NULL,
          "weights_enum", meta->weights_enum[0] ? meta->weights_enum : NULL,
          "precision", hapi_precision_name(o->precision), "stages", stages,
        "split", split,
        "preprocess",
          "mode", pp->mode == HAPI_PREPROCESS_FAST ? "fast" : "exact",
          "interpolation", hapi_interpolation_name(pp->interpolation), "resize", pp->resize,
          "crop", pp->crop, "mean", pp->mean[0], pp->mean[1], pp->mean[2], "std", pp->std[0],
          pp->std[1], pp->std[2], "max_pixels", (json_int_t)pp->max_pixels,
        "cache",
          "dir", hapi_json_text(o->cache_dir), "namespace", json_object_get(split, "namespace") ?
              json_string_value(json_object_get(split, "namespace")) : "",
          "size_limit", (json_int_t)o->cache_size,
        "policy",
          "link", rate, "link_bytes", ts.link_bytes, "rtt_ms", ts.rtt_s * 1e3,
          "transport", ts.transport == HAPI_TRANSPORT_PACK ? "pack" : "file",
          "client_speed", ts.client_speed, "compute_stages_ms", compute_stages,
          "compute_file_ms", ts.compute_file_ms, "compute_file_ms_given", ts.compute_file_given,
          "epochs", ts.epochs,
        "runtime",
          "threads", o->threads, "torch_threads", o->torch_threads, "show_raw", o->show_raw,
          "watch", o->watch, "no_open", c->cfg.no_open, "uring", uring_active(c), "device", o->device, "blas", hapi_model_blas(), "batch", ts.batch,
          "batch_auto", ts.batch_auto,
          "batch_wait_ms", o->batch_wait_us / 1000,
          "decode_threads", o->decode_threads, "inference_workers", o->inference_workers,
          "mem_budget", (json_int_t)o->mem_budget,
          "prefetch", o->prefetch == HAPI_PREFETCH_DIR ? "dir" : "off");
    json_t *choice = render_precision_auto(c);
    if (choice && config)
        json_object_set_new(json_object_get(config, "model"), "precision_auto", choice);
    else
        json_decref(choice);
    /* precision=int8: what calibrated it */
    if (config && o->precision == HAPI_PRECISION_INT8) {
        const hapi_calibration *cal = hapi_extractor_calibration(c->cfg.ex);
        char hex[33];
        hapi_hex(cal->digest, 16, hex);
        json_object_set_new(json_object_get(config, "model"), "int8_calibration",
                            json_pack("{s:i, s:s, s:s, s:f, s:f}", "images", cal->images,
                                      "samples", cal->images ? "source" : "seeded",
                                      "digest", hex, "seconds", cal->seconds,
                                      "min_cosine", cal->min_cosine));
    }
    return config;
}

static json_t *render_warm(hapi_ctl *c)
{
    static const char *const states[] = { "idle", "counting", "running", "done", "stopped" };
    hapi_warm_status ws;
    if (hapi_warm_status_get(c->cfg.background, &ws) < 0)
        return NULL;
    if (ws.state == HAPI_WARM_IDLE)
        return json_pack("{s:s}", "state", "idle");
    uint64_t done = ws.cached + ws.skipped + ws.completed;
    double rate = ws.elapsed_s > 0 ? (double)ws.completed / ws.elapsed_s : 0;
    if (done > ws.total)
        done = ws.total;
    double eta = ws.state >= HAPI_WARM_DONE ? 0.0
                 : rate > 0                 ? (double)(ws.total - done) / rate
                                            : -1;
    json_t *j = json_pack("{s:s, s:o, s:I, s:I, s:I, s:I, s:I, s:f, s:f, s:f}", "state",
                          states[ws.state], "path", hapi_json_text(ws.path), "total",
                          (json_int_t)ws.total,
                          "done", (json_int_t)done, "cached", (json_int_t)ws.cached, "computed",
                          (json_int_t)ws.completed, "skipped", (json_int_t)ws.skipped,
                          "rate_per_s", rate, "elapsed_s", ws.elapsed_s, "eta_s", eta);
    free(ws.path);
    return j;
}

static json_t *render_batcher(hapi_ctl *c)
{
    hapi_batcher_stats b;
    hapi_view *v = hapi_views_peek(c->cfg.views);
    if (!v)
        return json_null(); /* the policy is still choosing */
    hapi_batcher_stats_get(v->batcher, &b);
    hapi_view_put(v);
    double per = b.samples ? 1.0 / (double)b.samples : 0;
    return json_pack("{s:i, s:{s:I, s:I, s:I}, s:I, s:I, s:I, s:I, s:f, s:I, s:I, s:I, "
                     "s:f, s:f, s:I, s:I, s:I, s:I}",
                     "batch", b.batch,
                     "queued", "demand", (json_int_t)b.queued[HAPI_PRIORITY_DEMAND],
                     "prefetch", (json_int_t)b.queued[HAPI_PRIORITY_PREFETCH],
                     "warm", (json_int_t)b.queued[HAPI_PRIORITY_WARM],
                     "in_flight", (json_int_t)b.in_flight,
                     "batches", (json_int_t)b.batches,
                     "samples", (json_int_t)b.samples,
                     "failed", (json_int_t)b.failed,
                     "mean_batch", b.batches ? (double)(b.samples + b.failed) / (double)b.batches : 0.0,
                     "joined", (json_int_t)b.joined,
                     "promoted", (json_int_t)b.promoted,
                     "oom_splits", (json_int_t)b.oom_splits,
                     "decode_ms_per_sample", (double)b.decode_ns / 1e6 * per,
                     "inference_ms_per_sample", (double)b.inference_ns / 1e6 * per,
                     "mem_in_use", (json_int_t)b.mem_in_use,
                     "mem_peak", (json_int_t)b.mem_peak,
                     "mem_budget", (json_int_t)c->cfg.opt->mem_budget,
                     "mem_waits", (json_int_t)b.mem_waits);
}

static json_t *render_cache(hapi_ctl *c, const hapi_serve_stats *s)
{
    hapi_cache_stats cs = { 0 };
    hapi_cache_namespace_stats ns = { 0 };
    hapi_cache_stats_get(c->cfg.cache, &cs);
    hapi_view *v = hapi_views_peek(c->cfg.views);
    uint64_t feat_size = v ? v->feat_size : 0;
    if (v)
        hapi_cache_namespace_stats_get(c->cfg.cache, &v->ns, &ns);
    hapi_view_put(v);
    return json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:f, s:I, "
                     "s:{s:I, s:I}}",
                     "entries", (json_int_t)cs.entries,
                     "bytes_used", (json_int_t)cs.bytes_used,
                     "bytes_free", (json_int_t)cs.bytes_free,
                     "size_limit", (json_int_t)cs.map_size,
                     "feat_size", (json_int_t)feat_size,
                     "hits", (json_int_t)cs.hits,
                     "misses", (json_int_t)cs.misses,
                     "stale", (json_int_t)cs.stale,
                     "bad", (json_int_t)cs.bad,
                     "evictions", (json_int_t)cs.evictions,
                     "evictions_total", (json_int_t)cs.evictions_total,
                     "collected", (json_int_t)s->collected,
                     "hit_latency_us", cs.hit_mean_us,
                     "accesses_dropped", (json_int_t)cs.accesses_dropped,
                     "namespace", "entries", (json_int_t)ns.entries,
                     "bytes", (json_int_t)ns.bytes);
}

static json_t *render_prefetch(hapi_ctl *c)
{
    hapi_prefetch_stats p;
    hapi_prefetch_stats_get(c->cfg.background, &p);
    return json_pack("{s:s, s:I, s:I, s:I, s:I, s:I, s:I}",
                     "mode", p.mode == HAPI_PREFETCH_DIR ? "dir" : "off",
                     "dirs", (json_int_t)p.dirs,
                     "pending_dirs", (json_int_t)p.pending_dirs,
                     "submitted", (json_int_t)p.submitted,
                     "cached", (json_int_t)p.cached,
                     "computed", (json_int_t)p.computed,
                     "dropped", (json_int_t)p.dropped);
}

/* The node's shared budget and cores: totals only, no other mount's name. */
static json_t *render_node(hapi_ctl *c)
{
    if (!c->cfg.node)
        return json_null();
    hapi_node_stats n;
    hapi_node_stats_get(c->cfg.node, &n);
    return json_pack("{s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I}",
                     "file", c->cfg.opt->node_path,
                     "mem_total", (json_int_t)n.mem_total,
                     "mem_used", (json_int_t)n.mem_used,
                     "cores", (json_int_t)n.cores,
                     "cores_used", (json_int_t)n.cores_used,
                     "mounts", (json_int_t)n.mounts,
                     "waiting", (json_int_t)n.waiting,
                     "reaped", (json_int_t)n.reaped,
                     "own_fixed", (json_int_t)n.own_fixed,
                     "own_flight", (json_int_t)n.own_flight,
                     "own_waits", (json_int_t)n.own_waits);
}

/* The FUSE requests answered, by type: what each file costs in round trips to the daemon. */
static json_t *render_requests(hapi_ctl *c)
{
    json_t *j = json_object();
    for (int i = 0; j && c->cfg.requests && i < HAPI_REQ_COUNT; i++)
        json_object_set_new(j, hapi_fs_request_names[i],
                            json_integer((json_int_t)atomic_load(&c->cfg.requests->n[i])));
    return j;
}

/*
 * What watch.c sees of the source: the directories watched (their names and
 * listings are trusted by the kernel for the long timeout), the changes told
 * to the kernel, why a directory is not watched, and whether the kernel takes
 * epoch notices (one ends every name: split changes, names told late) and how
 * many it was sent.
 */
static json_t *render_watch(hapi_ctl *c)
{
    hapi_watch_stats w = { 0 };
    if (c->cfg.watch)
        hapi_watch_stats_get(c->cfg.watch, &w);
    return json_pack("{s:I, s:I, s:I, s:I, s:I, s:b, s:I}", "dirs", (json_int_t)w.dirs,
                     "events", (json_int_t)w.events, "overflows", (json_int_t)w.overflows,
                     "refused", (json_int_t)w.refused, "remote", (json_int_t)w.remote,
                     "epochs", c->cfg.epochs && *c->cfg.epochs, "epoch_notices",
                     (json_int_t)(c->cfg.epoch_notices ? atomic_load(c->cfg.epoch_notices) : 0));
}

/*
 * FUSE over io_uring (uring.c): its workers, the entries the kernel holds,
 * and the requests served through it rather than /dev/fuse.
 */
static json_t *render_uring(hapi_ctl *c)
{
    hapi_uring_stats u;
    hapi_uring_stats_get(c->cfg.uring ? *c->cfg.uring : NULL, &u);
    return json_pack("{s:i, s:i, s:i, s:I}", "queues", u.queues, "workers", u.workers,
                     "registered", u.registered, "requests", (json_int_t)u.requests);
}

static json_t *render_stats(hapi_ctl *c)
{
    hapi_serve_stats s;
    hapi_tune_status ts;
    hapi_pack_stats ps;
    hapi_serve_stats_get(c->cfg.serve, &s);
    hapi_tune_status_get(c->cfg.tune, &ts);
    hapi_pack_stats_get(c->cfg.packs, &ps);
    double uptime = (double)(hapi_now_ns() - c->cfg.started_ns) / 1e9;
    return json_pack(
        "{s:f, s:I, s:{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:f}, "
        "s:{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I}, s:o, s:o, s:o, s:o, s:{s:I}, s:o, s:o, s:o, s:o}",
        "uptime_s", uptime,
        "split_changes", (json_int_t)ts.split_changes,
        "feat",
          "reads", (json_int_t)s.feat_reads,
          "bytes", (json_int_t)s.feat_bytes,
          "hits", (json_int_t)s.hits,
          "misses", (json_int_t)s.misses,
          "computed", (json_int_t)s.computed,
          "failed", (json_int_t)s.errors,
          "cache_put_failures", (json_int_t)s.cache_put_failures,
          "hit_latency_us", s.hits ? (double)s.hit_ns / 1e3 / (double)s.hits : 0.0,
        "pack",
          "opens", (json_int_t)ps.opens,
          "reads", (json_int_t)ps.reads,
          "bytes", (json_int_t)ps.bytes,
          "rows", (json_int_t)ps.rows,
          "rows_failed", (json_int_t)ps.rows_failed,
          "index_reads", (json_int_t)ps.index_reads,
          "rows_split", (json_int_t)ps.rows_split,
          "rows_split_dropped", (json_int_t)ps.rows_split_dropped,
        "batcher", render_batcher(c),
        "warm", render_warm(c),
        "prefetch", render_prefetch(c),
        "cache", render_cache(c, &s),
        "passthrough",
          "bytes", (json_int_t)s.passthrough_bytes,
        "node", render_node(c),
        "requests", render_requests(c),
        "watch", render_watch(c),
        "uring", render_uring(c));
}

static json_t *render_profile(hapi_ctl *c)
{
    hapi_tune_status ts;
    hapi_tune_status_get(c->cfg.tune, &ts);
    if (ts.state == 0)
        return json_pack("{s:s}", "state", "measuring");
    if (ts.state < 0)
        return json_pack("{s:s, s:s}", "state", "failed", "error", ts.error);
    char *text = hapi_tune_profile_json(c->cfg.tune);
    json_t *j = text ? json_loads(text, 0, NULL) : NULL;
    free(text);
    if (j) {
        json_object_set_new(j, "state", json_string(ts.reused ? "stored" : "measured"));
        json_object_set_new(j, "decode_ms", json_real(ts.decode_ms));
        json_object_set_new(j, "decode_samples", json_integer(ts.decode_samples));
        json_object_set_new(j, "source_bytes", json_real(ts.source_bytes));
    }
    return j;
}

/* The policy now: the current split explained against every other, and what auto would pick. */
static json_t *render_policy(hapi_ctl *c)
{
    hapi_policy_choice *choice = malloc(sizeof(*choice));
    hapi_policy_input in;
    hapi_error err = { 0 };
    json_t *j = NULL;
    if (!choice)
        return NULL;
    /* What the policy would choose now, with the inputs and the cache as they are. */
    int rc = hapi_tune_choose(c->cfg.tune, 0, &in, choice, &err);
    if (rc == -EAGAIN) {
        j = json_pack("{s:s}", "state", "measuring");
    } else if (rc < 0) {
        j = json_pack("{s:s, s:s}", "state", "failed", "error", err.message);
    } else {
        char *text = hapi_policy_to_json(&in, choice);
        j = text ? json_loads(text, 0, NULL) : NULL;
        free(text);
        hapi_view *v = hapi_views_peek(c->cfg.views);
        hapi_tune_status ts;
        hapi_tune_status_get(c->cfg.tune, &ts);
        if (j && v)
            json_object_set_new(j, "current",
                                json_pack("{s:i, s:s, s:i, s:s, s:b}", "split", v->split,
                                          "stage", v->output.name, "batch", ts.batch, "by",
                                          ts.split_by_operator ? "operator" : "policy",
                                          "differs", v->split != choice->split));
        hapi_view_put(v);
        /* the arithmetic the splits are timed in, and with precision=auto how it was chosen */
        if (j)
            json_object_set_new(j, "precision",
                                json_pack("{s:s, s:o*}", "name",
                                          hapi_precision_name(c->cfg.opt->precision), "auto",
                                          render_precision_auto(c)));
        if (j)
            json_object_set_new(j, "state", json_string("ready"));
    }
    free(choice);
    return j;
}

/* ------------------------------------------------- a remote mount's files */

/* The cache part of a remote mount's stats: the store, and the sources' namespace in it. */
static json_t *render_remote_cache(hapi_ctl *c)
{
    hapi_cache_stats cs = { 0 };
    hapi_cache_namespace_stats ns = { 0 };
    hapi_remote_source_stats ss;
    hapi_cache_stats_get(c->cfg.cache, &cs);
    for (size_t i = 0; i < hapi_remote_source_count(c->cfg.remote); i++) {
        hapi_remote_source_stats_get(c->cfg.remote, i, &ss);
        if (!ss.checked)
            continue;
        hapi_cache_namespace_stats_get(c->cfg.cache, &ss.ns, &ns);
        break;
    }
    return json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:f, s:{s:I, s:I}}",
                     "entries", (json_int_t)cs.entries,
                     "bytes_used", (json_int_t)cs.bytes_used,
                     "bytes_free", (json_int_t)cs.bytes_free,
                     "size_limit", (json_int_t)cs.map_size,
                     "hits", (json_int_t)cs.hits,
                     "misses", (json_int_t)cs.misses,
                     "stale", (json_int_t)cs.stale,
                     "evictions", (json_int_t)cs.evictions,
                     "evictions_total", (json_int_t)cs.evictions_total,
                     "hit_latency_us", cs.hit_mean_us,
                     "namespace", "entries", (json_int_t)ns.entries,
                     "bytes", (json_int_t)ns.bytes);
}

static json_t *render_remote_sources(hapi_ctl *c)
{
    json_t *a = json_array();
    for (size_t i = 0; a && i < hapi_remote_source_count(c->cfg.remote); i++) {
        hapi_remote_source_stats ss;
        hapi_remote_source_stats_get(c->cfg.remote, i, &ss);
        json_array_append_new(
            a, json_pack("{s:o, s:s, s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:o}",
                         "path", hapi_json_text(ss.path),
                         "state", ss.refused    ? "refused"
                                  : !ss.checked ? "down"
                                  : ss.reachable ? "ok"
                                                 : "unreachable",
                         "namespace", ss.namespace_hex,
                         "index_reads", (json_int_t)ss.index_reads,
                         "index_checks", (json_int_t)ss.index_checks,
                         "index_bytes", (json_int_t)ss.index_bytes,
                         "packs", (json_int_t)ss.packs,
                         "pack_bytes", (json_int_t)ss.pack_bytes,
                         "rows", (json_int_t)ss.rows,
                         "rows_failed", (json_int_t)ss.rows_failed,
                         "fetch_failures", (json_int_t)ss.fetch_failures,
                         "file_reads", (json_int_t)ss.file_reads,
                         "last_error", hapi_json_text(ss.last_error)));
    }
    return a;
}

static json_t *render_remote_stats(hapi_ctl *c)
{
    static const char *const states[] = { "idle", "counting", "running", "done", "stopped" };
    hapi_remote_stats rs;
    hapi_remote_stats_get(c->cfg.remote, &rs);
    hapi_remote_features rf;
    hapi_remote_features_get(c->cfg.remote, &rf);
    json_t *sources = render_remote_sources(c);
    uint64_t index_bytes = 0, pack_bytes = 0, packs = 0;
    for (size_t i = 0; i < json_array_size(sources); i++) {
        json_t *e = json_array_get(sources, i);
        index_bytes += (uint64_t)json_integer_value(json_object_get(e, "index_bytes"));
        pack_bytes += (uint64_t)json_integer_value(json_object_get(e, "pack_bytes"));
        packs += (uint64_t)json_integer_value(json_object_get(e, "packs"));
    }
    uint64_t done = rs.warm_cached + rs.warm_fetched + rs.warm_failed;
    double rate = rs.warm_elapsed_s > 0 ? (double)rs.warm_fetched / rs.warm_elapsed_s : 0;
    double eta = rs.warm_state >= HAPI_WARM_DONE ? 0.0
                 : rate > 0 && rs.warm_total > done ? (double)(rs.warm_total - done) / rate
                                                     : -1;
    json_t *warm = rs.warm_state == HAPI_WARM_IDLE
                       ? json_pack("{s:s}", "state", "idle")
                       : json_pack("{s:s, s:o, s:I, s:I, s:I, s:I, s:I, s:I, s:f, s:f, s:f}",
                                   "state", states[rs.warm_state], "path",
                                   hapi_json_text(rs.warm_path),
                                   "total", (json_int_t)rs.warm_total, "done", (json_int_t)done,
                                   "cached", (json_int_t)rs.warm_cached,
                                   "computed", (json_int_t)rs.warm_fetched,
                                   "skipped", (json_int_t)rs.warm_failed,
                                   "dirs", (json_int_t)rs.warm_dirs, "rate_per_s", rate,
                                   "elapsed_s", rs.warm_elapsed_s, "eta_s", eta);
    double uptime = (double)(hapi_now_ns() - c->cfg.started_ns) / 1e9;
    return json_pack("{s:f, s:{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I}, "
                     "s:{s:I, s:I, s:I, s:I, s:I, s:I, s:o}, s:o, s:o, s:o, s:o}",
                     "uptime_s", uptime,
                     "feat",
                       "reads", (json_int_t)rs.reads,
                       "bytes", (json_int_t)rs.bytes,
                       "hits", (json_int_t)rs.hits,
                       "misses", (json_int_t)rs.misses,
                       "computed", (json_int_t)rf.rows, /* features=freeze: finished here */
                       "fetched", (json_int_t)rs.fetched_rows,
                       "failed", (json_int_t)rs.failed,
                       "stale", (json_int_t)rs.stale,
                       "cache_put_failures", (json_int_t)rs.cache_put_failures,
                       "uncached_hits", (json_int_t)rs.uncached_hits,
                     "remote",
                       "packs", (json_int_t)packs,
                       "pack_bytes", (json_int_t)pack_bytes,
                       "index_bytes", (json_int_t)index_bytes,
                       "fetches_running", (json_int_t)rs.fetches_running,
                       "fetches_queued", (json_int_t)rs.fetches_queued,
                       "waits", (json_int_t)rs.waits,
                       "sources", sources,
                     "warm", warm,
                     "cache", render_remote_cache(c),
                     "requests", render_requests(c),
                     "uring", render_uring(c));
}

/*
 * features=freeze: the split a script sees is the freeze point (train.py then
 * runs no trunk), with what the storage side sends kept as storage_split; and
 * "features" says which.
 */
static void render_finish(json_t *j, const hapi_remote_features *rf)
{
    json_t *split = json_object_get(j, "split");
    if (!rf->usable) {
        json_object_set_new(j, "features", json_pack("{s:s, s:s}", "mode", "freeze", "error",
                                                     rf->why));
        return;
    }
    const char *dtype = json_string_value(json_object_get(split, "dtype"));
    int fp16 = !dtype || strcmp(dtype, "float16") == 0;
    json_t *stage = json_object_get(json_array_get(json_object_get(json_object_get(j, "model"),
                                                                   "stages"),
                                                   (size_t)rf->freeze - 1), "name");
    json_t *shape = json_array();
    for (int d = 0; shape && d < rf->ndim; d++)
        json_array_append_new(shape, json_integer(rf->shape[d]));
    json_int_t feat_size = (json_int_t)rf->feat_size[fp16];
    json_t *sent = split ? json_deep_copy(split) : json_null();
    json_object_set_new(j, "features",
                        json_pack("{s:s, s:i, s:O?, s:O?, s:s, s:I, s:s, s:I, s:b, s:o?}",
                                  "mode", "freeze", "freeze", rf->freeze, "stage", stage, "shape",
                                  shape, "dtype", fp16 ? "float16" : "float32", "feat_size",
                                  feat_size, "namespace", rf->ns_hex[fp16], "computed",
                                  (json_int_t)rf->rows, "model_loaded", rf->loaded,
                                  "storage_split", sent));
    if (split) {
        json_object_set_new(split, "index", json_integer(rf->freeze));
        json_object_set(split, "stage", stage ? stage : json_null());
        json_object_set(split, "shape", shape ? shape : json_null());
        json_object_set_new(split, "stages_after", json_pack("[i, i]", rf->freeze, rf->freeze));
        json_object_set_new(split, "feat_size", json_integer(feat_size));
        json_object_set_new(split, "namespace", json_string(rf->ns_hex[fp16]));
    }
    json_decref(shape);
}

/*
 * A remote mount's config: the storage side's (read now, or as it was at
 * mount if no source answers), so that a training script finds the model
 * and the split, with this mount's own source, mount point, cache and
 * sources.
 */
static json_t *render_remote_config(hapi_ctl *c)
{
    const hapi_fs_options *o = c->cfg.opt;
    char *text = NULL;
    size_t len = 0;
    json_t *j = NULL;
    if (hapi_remote_read_storage_file(c->cfg.remote, "config", &text, &len) == 0)
        j = json_loadb(text, len, 0, NULL);
    free(text);
    if (!j) {
        const char *stored = hapi_remote_storage_config(c->cfg.remote);
        j = stored ? json_loads(stored, 0, NULL) : NULL;
    }
    if (!j && !(j = json_object()))
        return NULL;
    hapi_remote_features rf;
    hapi_remote_features_get(c->cfg.remote, &rf);
    if (rf.finish)
        render_finish(j, &rf);
    json_t *split = json_object_get(j, "split");
    const char *ns = split ? json_string_value(json_object_get(split, "namespace")) : NULL;
    json_t *storage_source = json_object_get(j, "source");
    json_object_set(j, "storage_source", storage_source ? storage_source : json_null());
    json_object_set_new(j, "source", hapi_json_text(o->source));
    json_object_set_new(j, "mountpoint", hapi_json_text(o->mountpoint));
    json_object_set_new(j, "cache", json_pack("{s:o, s:s, s:I}", "dir", hapi_json_text(o->cache_dir),
                                              "namespace", ns ? ns : "",
                                              "size_limit", (json_int_t)o->cache_size));
    json_object_set_new(j, "remote",
                        json_pack("{s:o, s:f, s:i, s:i}", "sources", render_remote_sources(c),
                                  "refresh_s", o->refresh_ms / 1000.0, "fetch_threads",
                                  o->fetch_threads, "threads", o->threads));
    json_object_del(j, "runtime");
    json_object_del(j, "policy");
    return j;
}

/* profile and policy of a remote mount: the storage side's, read through. */
static hapi_ctl_text *render_remote_storage_file(hapi_ctl *c, const char *name)
{
    char *text = NULL;
    size_t len = 0;
    if (hapi_remote_read_storage_file(c->cfg.remote, name, &text, &len) < 0) {
        char line[128];
        int n = snprintf(line, sizeof(line), "{\"state\": \"unavailable\", \"error\": "
                         "\"no source answered\"}\n");
        return hapi_ctl_text_new(line, (size_t)n);
    }
    hapi_ctl_text *t = hapi_ctl_text_new(text, len);
    free(text);
    return t;
}

static const char ctl_help[] =
    "# write one command per line to this file:\n"
    "#   warm [PATH]   compute the features of PATH (default: everything) in the background;\n"
    "#                 progress in .hapifs/stats under \"warm\" (a folder named stop: /stop)\n"
    "#   warm stop     stop the warm-up in progress (what it queued, two batches, is computed)\n"
    "#   evict [all]   drop this mount's cached features (they are computed again when read)\n"
    "#   evict PATH    drop those of an image, or of every image beneath a directory\n"
    "#   split N|NAME|auto   serve the features of another split (auto: the policy's);\n"
    "#                 open files keep theirs, the next open sees the new shape\n"
    "#   batch N|auto  the storage-side batch\n"
    "#   link RATE     tell the policy the link's rate (e.g. 1Gbit); see .hapifs/policy\n"
    "#   link_bytes X|any   the most a split's .feat may put on the link, in source\n"
    "#                 images' bytes (1: never more than the images; any: no bound)\n"
    "#   client_speed X, epochs N, rtt TIME, transport file|pack, compute_cache SIZE,\n"
    "#   readers N     the policy's other inputs\n"
    "#   compute_stages MS,MS,...|none   the compute tier's ms per sample of the frozen\n"
    "#                 stages, measured there (probe-speed.py prints the line)\n"
    "#   compute_file_ms MS|default   its training loop's CPU per file beside the stages,\n"
    "#                 measured there (probe-speed.py prints the line)\n"
    "# a write that is refused fails (EINVAL, EBUSY, ...); reading the same open file\n"
    "# then returns \"error: REASON\" (after a command that worked, \"ok\")\n";

static const char remote_ctl_help[] =
    "# a remote (compute-side) mount; write one command per line to this file:\n"
    "#   warm [PATH]   fetch the packs of PATH (default: everything) into the local cache;\n"
    "#                 progress in .hapifs/stats under \"warm\" (a folder named stop: /stop)\n"
    "#   warm stop     stop the warm-up in progress (fetches already queued go on)\n"
    "#   evict [all]   drop the cached features of the sources' namespace\n"
    "#   evict PATH    drop those of a .feat, or of every .feat beneath a directory\n"
    "# split, batch and the policy's inputs belong to the storage side's mount\n"
    "# a write that is refused fails (EINVAL, EBUSY, ...); reading the same open file\n"
    "# then returns \"error: REASON\" (after a command that worked, \"ok\")\n";

/* Takes text (malloc'd JSON without its newline) and makes a text object of it and a newline. */
static hapi_ctl_text *text_of(char *text)
{
    if (!text)
        return NULL;
    size_t len = strlen(text);
    if (len >= HAPI_CTL_SIZE_MAX)
        len = HAPI_CTL_SIZE_MAX - 1; /* never longer than its stat says */
    hapi_ctl_text *t = malloc(sizeof(*t) + len + 2);
    if (t) {
        atomic_init(&t->refs, 1);
        t->len = len + 1;
        memcpy(t->data, text, len);
        memcpy(t->data + len, "\n", 2); /* so that `cat` leaves the prompt on its own line */
    }
    free(text);
    return t;
}

struct shown_to {
    hapi_ctl *c;
    const hapi_cred *who;
};

/* Whether the reader could learn path from the source tree (see hapi_ctl_render). */
static int shown(const char *path, void *arg)
{
    const struct shown_to *t = arg;
    return t->c->cfg.source && hapi_source_may_see(t->c->cfg.source, t->who, path);
}

/* Hides from who the names in stats that it could not list in the source tree. */
static void redact_stats(hapi_ctl *c, json_t *j, const hapi_cred *who)
{
    struct shown_to t = { c, who };
    json_t *warm = json_object_get(j, "warm");
    const char *path = json_string_value(json_object_get(warm, "path"));
    if (path && !shown(path, &t))
        json_object_set_new(warm, "path", json_string("(hidden)"));
    json_t *sources = json_object_get(json_object_get(j, "remote"), "sources");
    for (size_t i = 0; i < json_array_size(sources); i++) {
        json_t *e = json_array_get(sources, i);
        if (*json_string_value(json_object_get(e, "last_error")))
            json_object_set_new(e, "last_error", json_string("(hidden)"));
    }
}

hapi_ctl_text *hapi_ctl_render(hapi_ctl *c, const char *name, const hapi_cred *who)
{
    json_t *j = NULL;
    /* metrics is stats in another format: the same numbers, the same redaction */
    int metrics = strcmp(name, "metrics") == 0;
    int stats = metrics || strcmp(name, "stats") == 0;
    if (strcmp(name, "errors") == 0) {
        struct shown_to t = { c, who };
        return text_of(hapi_error_ring_json(c->cfg.errors, who ? shown : NULL, &t));
    }
    if (strcmp(name, HAPI_CTL_WRITABLE) == 0)
        return c->cfg.remote ? hapi_ctl_text_new(remote_ctl_help, sizeof(remote_ctl_help) - 1)
                             : hapi_ctl_text_new(ctl_help, sizeof(ctl_help) - 1);
    if (c->cfg.remote) {
        if (strcmp(name, "profile") == 0 || strcmp(name, "policy") == 0)
            return render_remote_storage_file(c, name);
        j = strcmp(name, "config") == 0 ? render_remote_config(c)
            : stats                      ? render_remote_stats(c)
                                         : NULL;
    } else if (strcmp(name, "config") == 0)
        j = render_config(c);
    else if (stats)
        j = render_stats(c);
    else if (strcmp(name, "profile") == 0)
        j = render_profile(c);
    else if (strcmp(name, "policy") == 0)
        j = render_policy(c);
    if (!j)
        return NULL;
    if (who && stats)
        redact_stats(c, j, who);
    if (metrics) {
        char *text = NULL;
        hapi_metrics_render(j, c->cfg.opt->mountpoint, &text);
        json_decref(j);
        return text_of(text);
    }
    char *text = json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(j);
    return text_of(text);
}

/* -------------------------------------------------------------- commands */

/* On a remote mount: path is a directory or file of the mount, or an image whose .feat is. */
/*
 * Whether path (a directory, a .feat or its image's name) is on the remote
 * mount: 0, -ENOENT, or -EIO when a source that may have it is down.
 */
static int remote_path_stat(hapi_ctl *c, const char *path)
{
    struct stat st;
    int kind;
    int rc = hapi_remote_stat(c->cfg.remote, path, &kind, &st);
    if (rc == 0)
        return 0;
    char *feat = NULL;
    if (asprintf(&feat, "%s.feat", path) < 0)
        return -ENOMEM;
    int frc = hapi_remote_stat(c->cfg.remote, feat, &kind, &st);
    free(feat);
    return frc == 0 ? 0 : rc == -ENOENT ? frc : rc;
}

/* A path given to a command stays beneath the mount: no '..' component. */
static int command_path_syntax(const char *word, hapi_error *err)
{
    while (*word == '/')
        word++;
    for (const char *p = word; *p; p++)
        if (p[0] == '.' && p[1] == '.' && (p == word || p[-1] == '/') && (p[2] == '/' || !p[2]))
            return hapi_error_set(err, -EINVAL, "'%s': '..' is not allowed", word);
    return 0;
}

/* A path given to a command: relative to the mount, beneath it, existing in the source. */
static int command_path(hapi_ctl *c, const char *word, char **out, hapi_error *err)
{
    int rc = command_path_syntax(word, err);
    if (rc < 0)
        return rc;
    while (*word == '/')
        word++;
    char *path = strdup(word);
    if (!path)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    size_t len = strlen(path);
    while (len && path[len - 1] == '/')
        path[--len] = '\0';
    struct stat st;
    rc = c->cfg.remote ? remote_path_stat(c, path) : hapi_source_stat(c->cfg.source, path, &st);
    if (rc == -EIO) { /* a remote mount's source down: it may have it */
        free(path);
        return hapi_error_set(err, -EIO, "'%s': a source that may have it is down (see errors)",
                              word);
    }
    if (rc < 0) {
        free(path);
        return hapi_error_set(err, -ENOENT, "'%s': no such file or directory", word);
    }
    *out = path;
    return 0;
}

/* A module code as the errno a refused command returns: the layers' own codes are EINVAL. */
static int command_errno(int rc, int otherwise)
{
    return rc > HAPI_ERRNO_BASE ? rc : otherwise;
}

/*
 * Every handler checks its words first and, with c NULL (hapi_ctl_check),
 * stops there: a write is carried out only when all its lines check.
 */
static int cmd_warm(hapi_ctl *c, int n, char **words, hapi_error *err)
{
    char *path = NULL;
    /* "warm stop" stops; a folder named stop is "warm /stop" (paths lose their leading '/') */
    int stop = n == 2 && strcmp(words[1], "stop") == 0;
    if (!c)
        return stop ? 0 : command_path_syntax(n == 2 ? words[1] : "", err);
    if (stop) {
        int stopped = c->cfg.remote ? hapi_remote_warm_stop(c->cfg.remote)
                                    : hapi_warm_stop(c->cfg.background);
        if (!stopped)
            hapi_log(HAPI_LOG_INFO, "warm stop: no warm-up was running");
        return 0;
    }
    int rc = command_path(c, n == 2 ? words[1] : "", &path, err);
    if (rc < 0)
        return rc;
    rc = c->cfg.remote ? hapi_remote_warm_start(c->cfg.remote, path)
                       : hapi_warm_start(c->cfg.background, path);
    free(path);
    if (rc == -EBUSY)
        return hapi_error_set(err, rc, "a warm-up is already running");
    if (rc < 0)
        return hapi_error_set(err, rc, "cannot start the warm-up: %s", hapi_strerror(rc));
    return 0;
}

static int cmd_evict(hapi_ctl *c, int n, char **words, hapi_error *err)
{
    char *path = NULL;
    const char *word = n == 2 && strcmp(words[1], "all") != 0 ? words[1] : "";
    if (!c)
        return command_path_syntax(word, err);
    int rc = command_path(c, word, &path, err);
    if (rc < 0)
        return rc;
    rc = c->cfg.remote ? hapi_remote_evict(c->cfg.remote, path, err)
                       : hapi_serve_evict(c->cfg.serve, path, err);
    if (rc >= 0)
        hapi_log(HAPI_LOG_INFO, "evicted %d entries of '%s'", rc, path);
    free(path);
    return rc < 0 ? command_errno(rc, -EIO) : 0;
}

static int cmd_split(hapi_ctl *c, int n, char **words, hapi_error *err)
{
    (void)n;
    int split, rc;
    int automatic = strcmp(words[1], "auto") == 0;
    if (!c) /* a stage name or number: the model says which exist */
        return 0;
    if (automatic) {
        hapi_policy_choice *choice = malloc(sizeof(*choice));
        rc = choice ? hapi_tune_choose(c->cfg.tune, 0, NULL, choice, err)
                    : hapi_error_set(err, -ENOMEM, "out of memory");
        split = choice ? choice->split : 0;
        free(choice);
        if (rc < 0)
            return rc == -EAGAIN ? rc : -EINVAL;
    } else if ((split = hapi_extractor_parse_split(c->cfg.ex, words[1], err)) < 0) {
        return -EINVAL;
    }
    rc = hapi_tune_set_split(c->cfg.tune, split, !automatic, err);
    return rc < 0 ? command_errno(rc, -EINVAL) : 0;
}

static int cmd_batch(hapi_ctl *c, int n, char **words, hapi_error *err)
{
    (void)n;
    char *end;
    long b = strcmp(words[1], "auto") == 0 ? 0 : strtol(words[1], &end, 10);
    if (strcmp(words[1], "auto") != 0 && (*end || b < 1 || b > HAPI_BATCH_MAX))
        return hapi_error_set(err, -EINVAL, "usage: batch N|auto (N in 1..%d)", HAPI_BATCH_MAX);
    if (!c)
        return 0;
    int rc = hapi_tune_set_batch(c->cfg.tune, (int)b, err);
    return rc < 0 ? command_errno(rc, -EINVAL) : 0;
}

/*
 * link RATE, client_speed X, epochs N, ..., compute_stages MS,...|none: the policy's inputs,
 * parsed and checked by its table (policy/inputs.c), as the mount options are.
 */
static int cmd_input(hapi_ctl *c, int n, char **words, hapi_error *err)
{
    (void)n;
    hapi_policy_input_value in;
    if (hapi_policy_input_parse(words[0], words[1], &in, err) < 0)
        return -EINVAL;
    if (!c)
        return 0;
    if (strcmp(words[0], "compute_stages") == 0) {
        hapi_tune_set_compute_stages(c->cfg.tune, in.count, in.list);
        hapi_log(HAPI_LOG_INFO, "policy input compute_stages = %s (%d stages)", words[1],
                 in.count);
        return 0;
    }
    int which = strcmp(words[0], "link") == 0           ? HAPI_TUNE_LINK
                : strcmp(words[0], "client_speed") == 0 ? HAPI_TUNE_CLIENT_SPEED
                : strcmp(words[0], "rtt") == 0          ? HAPI_TUNE_RTT
                : strcmp(words[0], "transport") == 0    ? HAPI_TUNE_TRANSPORT
                : strcmp(words[0], "compute_cache") == 0 ? HAPI_TUNE_COMPUTE_CACHE
                : strcmp(words[0], "readers") == 0      ? HAPI_TUNE_READERS
                : strcmp(words[0], "compute_file_ms") == 0 ? HAPI_TUNE_COMPUTE_FILE_MS
                : strcmp(words[0], "link_bytes") == 0   ? HAPI_TUNE_LINK_BYTES
                                                        : HAPI_TUNE_EPOCHS;
    /* compute_file_ms default and link_bytes any are -1: tune's "back to the policy's
       constant" and "no bound" */
    hapi_tune_set_input(c->cfg.tune, which, in.number);
    hapi_log(HAPI_LOG_INFO, "policy input %s = %s", words[0], words[1]);
    return 0;
}

/* The commands ctl takes: name, words after it (min..max), usage, handler. */
static const struct command {
    const char *name;
    int min, max;
    const char *usage;
    int (*run)(hapi_ctl *c, int n, char **words, hapi_error *err);
} commands[] = {
    { "warm", 0, 1, "warm [PATH]|stop", cmd_warm },
    { "evict", 0, 1, "evict [all|PATH]", cmd_evict },
    { "split", 1, 1, "split N|NAME|auto", cmd_split },
    { "batch", 1, 1, "batch N|auto", cmd_batch },
    { "link", 1, 1, "link RATE", cmd_input },
    { "link_bytes", 1, 1, "link_bytes X|any", cmd_input },
    { "client_speed", 1, 1, "client_speed VALUE", cmd_input },
    { "epochs", 1, 1, "epochs VALUE", cmd_input },
    { "rtt", 1, 1, "rtt TIME", cmd_input },
    { "transport", 1, 1, "transport file|pack", cmd_input },
    { "compute_cache", 1, 1, "compute_cache SIZE", cmd_input },
    { "readers", 1, 1, "readers N", cmd_input },
    { "compute_file_ms", 1, 1, "compute_file_ms MS|default", cmd_input },
    { "compute_stages", 1, 1, "compute_stages MS,MS,...|none", cmd_input },
};

/* Checks one line fully, then carries it out (with c NULL: checks only, remote or not). */
static int run_line(hapi_ctl *c, int remote, char *line, hapi_error *err)
{
    char *words[4];
    int n = 0;
    char *save = NULL;
    for (char *w = strtok_r(line, " \t", &save); w; w = strtok_r(NULL, " \t", &save)) {
        if (n == 4)
            return hapi_error_set(err, -EINVAL, "too many words");
        words[n++] = w;
    }
    if (n == 0)
        return 0;
    for (size_t i = 0; i < sizeof(commands) / sizeof(*commands); i++) {
        const struct command *cmd = &commands[i];
        if (strcmp(words[0], cmd->name) != 0)
            continue;
        if (n - 1 < cmd->min || n - 1 > cmd->max)
            return hapi_error_set(err, -EINVAL, "usage: %s", cmd->usage);
        if (remote && cmd->run != cmd_warm && cmd->run != cmd_evict)
            return hapi_error_set(err, -EINVAL, "%s: a command of the storage side's mount; "
                                  "this is a remote mount (warm and evict only)", cmd->name);
        return cmd->run(c, n, words, err);
    }
    return hapi_error_set(err, -EINVAL,
                          "unknown command '%s' (known: warm, evict, split, batch, link, "
                          "link_bytes, client_speed, epochs, rtt, transport, compute_cache, readers, "
                          "compute_stages, compute_file_ms)",
                          words[0]);
}

/* Each line of text through run_line. */
static int run_text(hapi_ctl *c, int remote, const char *text, size_t len, hapi_error *err)
{
    if (len > HAPI_CTL_LINE_MAX)
        return hapi_error_set(err, -EINVAL, "command longer than %d bytes", HAPI_CTL_LINE_MAX);
    char buf[HAPI_CTL_LINE_MAX + 1];
    memcpy(buf, text, len);
    buf[len] = '\0';
    if (memchr(buf, '\0', len))
        return hapi_error_set(err, -EINVAL, "command contains a NUL byte");
    char *save = NULL;
    for (char *line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        size_t l = strlen(line);
        if (l && line[l - 1] == '\r')
            line[l - 1] = '\0';
        int rc = run_line(c, remote, line, err);
        if (rc < 0)
            return rc;
    }
    return 0;
}

int hapi_ctl_check(const char *text, size_t len, int remote, hapi_error *err)
{
    return run_text(NULL, remote, text, len, err);
}

int hapi_ctl_command(hapi_ctl *c, const char *text, size_t len, hapi_error *err)
{
    int remote = c->cfg.remote != NULL;
    int rc = hapi_ctl_check(text, len, remote, err);
    return rc < 0 ? rc : run_text(c, remote, text, len, err);
}

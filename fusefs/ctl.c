/* ctl.c — the JSON content of the control files under .hapifs/: config, stats, errors. */
#include "fusefs-int.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

static json_t *shape_json(const hapi_stage_info *s)
{
    json_t *a = json_array();
    for (int i = 0; a && i < s->ndim; i++)
        json_array_append_new(a, json_integer(s->shape[i]));
    return a;
}

static json_t *render_config(hapi_fs *fs)
{
    const hapi_fs_options *o = fs->opt;
    const hapi_model_meta *meta = hapi_extractor_meta(fs->ex);
    const hapi_preprocess *pp = hapi_extractor_preprocess(fs->ex);
    hapi_model *m = hapi_extractor_model(fs->ex);
    int split = hapi_extractor_split(fs->ex);
    char digest[33];
    const uint8_t *d = hapi_extractor_model_digest(fs->ex);
    for (int i = 0; i < 16; i++)
        snprintf(digest + 2 * i, 3, "%02x", d[i]);

    json_t *stages = json_array();
    int n = hapi_model_num_stages(m);
    for (int i = 0; stages && i < n; i++) {
        hapi_stage_info info;
        if (hapi_model_stage(m, i, &info) == 0)
            json_array_append_new(stages, json_pack("{s:i, s:s, s:o}", "index", i, "name",
                                                    info.name, "shape", shape_json(&info)));
    }
    const hapi_stage_info *out = hapi_extractor_output(fs->ex);
    return json_pack(
        "{s:s, s:s, s:s, s:{s:s, s:s, s:s, s:o}, s:{s:i, s:s, s:i, s:o, s:o, s:s, s:I}, "
        "s:{s:s, s:i, s:i, s:[f,f,f], s:[f,f,f], s:I}, s:{s:s, s:s, s:I}, s:{s:i, s:i, s:b, s:s}}",
        "version", HAPI_VERSION,
        "source", o->source,
        "mountpoint", o->mountpoint,
        "model",
          "path", o->model, "digest", digest, "arch", meta->arch, "stages", stages,
        "split",
          "index", split, "stage", out->name, "freeze", hapi_extractor_freeze(fs->ex),
          "shape", shape_json(out),
          "stages_after", json_pack("[i, i]", split, n),
          "dtype", o->dtype == HAPI_DTYPE_FP16 ? "float16" : "float32",
          "feat_size", (json_int_t)fs->feat_size,
        "preprocess",
          "mode", pp->mode == HAPI_PREPROCESS_FAST ? "fast" : "exact", "resize", pp->resize,
          "crop", pp->crop, "mean", pp->mean[0], pp->mean[1], pp->mean[2], "std", pp->std[0],
          pp->std[1], pp->std[2], "max_pixels", (json_int_t)pp->max_pixels,
        "cache",
          "dir", o->cache_dir, "namespace", fs->ns_hex, "size_limit", (json_int_t)o->cache_size,
        "runtime",
          "threads", o->threads, "torch_threads", o->torch_threads, "show_raw", o->show_raw,
          "device", o->device);
}

static json_t *render_stats(hapi_fs *fs)
{
    hapi_fs_stats *s = &fs->stats;
    hapi_cache_stats cs = { 0 };
    hapi_cache_stats_get(fs->cache, &cs);
    uint64_t hits = atomic_load(&s->hits);
    uint64_t computed = atomic_load(&s->computed);
    double uptime = (double)(hapi_now_ns() - fs->started_ns) / 1e9;
    return json_pack(
        "{s:f, s:{s:I, s:I, s:I, s:I, s:I, s:I, s:I}, s:{s:f, s:f}, s:{s:I, s:I, s:I, s:I}, "
        "s:{s:I}}",
        "uptime_s", uptime,
        "feat",
          "reads", (json_int_t)atomic_load(&s->feat_reads),
          "bytes", (json_int_t)atomic_load(&s->feat_bytes),
          "hits", (json_int_t)hits,
          "misses", (json_int_t)atomic_load(&s->misses),
          "computed", (json_int_t)computed,
          "failed_reads", (json_int_t)atomic_load(&s->errors),
          "cache_put_failures", (json_int_t)atomic_load(&s->cache_put_failures),
        "latency_ms",
          "compute_mean", computed ? (double)atomic_load(&s->inference_ns) / 1e6 / (double)computed : 0.0,
          "hit_mean", hits ? (double)atomic_load(&s->hit_ns) / 1e6 / (double)hits : 0.0,
        "cache",
          "entries", (json_int_t)cs.entries, "bytes_used", (json_int_t)cs.bytes_used,
          "size_limit", (json_int_t)cs.map_size, "feat_size", (json_int_t)fs->feat_size,
        "passthrough",
          "bytes", (json_int_t)atomic_load(&s->passthrough_bytes));
}

/* Appends a newline so that `cat` leaves the prompt on its own line. Takes text. */
static char *with_newline(char *text)
{
    if (!text)
        return NULL;
    size_t len = strlen(text);
    char *bigger = realloc(text, len + 2);
    if (!bigger) {
        free(text);
        return NULL;
    }
    memcpy(bigger + len, "\n", 2);
    return bigger;
}

char *hapi_ctl_render(hapi_fs *fs, const char *name)
{
    json_t *j = NULL;
    if (strcmp(name, "errors") == 0)
        return with_newline(hapi_error_ring_json(fs->errors));
    if (strcmp(name, "config") == 0)
        j = render_config(fs);
    else if (strcmp(name, "stats") == 0)
        j = render_stats(fs);
    if (!j)
        return NULL;
    char *text = json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(j);
    return with_newline(text);
}

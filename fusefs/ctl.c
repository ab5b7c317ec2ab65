/* ctl.c — the JSON content of the control files under .hapifs/: config, stats, errors. */
#include "fusefs-int.h"

#include <errno.h>
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

/* The split part of config: what a .feat is now, and what the training side still runs. */
static json_t *render_split(hapi_fs *fs)
{
    /* Waits while the policy chooses (a first mount's profile): scripts need the split. */
    hapi_view *v = hapi_view_get(fs);
    int freeze = hapi_extractor_freeze(fs->ex);
    json_t *j;
    if (!v)
        return json_pack("{s:s, s:i}", "state", "unmounting", "freeze", freeze);
    pthread_mutex_lock(&fs->tune.lock);
    const char *by = fs->tune.split_by_operator ? "operator" : "policy";
    pthread_mutex_unlock(&fs->tune.lock);
    j = json_pack("{s:i, s:s, s:i, s:o, s:[i, i], s:s, s:I, s:s, s:s}", "index", v->split,
                  "stage", v->output.name, "freeze", freeze, "shape", shape_json(&v->output),
                  "stages_after", v->split, freeze, "dtype",
                  fs->opt->dtype == HAPI_DTYPE_FP16 ? "float16" : "float32", "feat_size",
                  (json_int_t)v->feat_size, "by", by, "namespace", v->ns_hex);
    hapi_view_put(v);
    return j;
}

static json_t *render_config(hapi_fs *fs)
{
    const hapi_fs_options *o = fs->opt;
    const hapi_model_meta *meta = hapi_extractor_meta(fs->ex);
    const hapi_preprocess *pp = hapi_extractor_preprocess(fs->ex);
    hapi_model *m = hapi_extractor_model(fs->ex);
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
    json_t *split = render_split(fs);
    char rate[32];
    pthread_mutex_lock(&fs->tune.lock);
    hapi_policy_format_rate(fs->tune.in.link_bps, rate, sizeof(rate));
    double client_speed = fs->tune.in.client_speed;
    int epochs = fs->tune.in.epochs, batch = fs->tune.batch, batch_auto = fs->tune.batch_auto;
    pthread_mutex_unlock(&fs->tune.lock);
    return json_pack(
        "{s:s, s:s, s:s, s:{s:s, s:s, s:s, s:s, s:o}, s:o, "
        "s:{s:s, s:i, s:i, s:[f,f,f], s:[f,f,f], s:I}, s:{s:s, s:s, s:I}, "
        "s:{s:s, s:f, s:i}, s:{s:i, s:i, s:b, s:s, s:i, s:b, s:i, s:i, s:I, s:s}}",
        "version", HAPI_VERSION,
        "source", o->source,
        "mountpoint", o->mountpoint,
        "model",
          "path", o->model, "digest", digest, "arch", meta->arch,
          "precision", o->precision == HAPI_PRECISION_BF16 ? "bf16" : "fp32", "stages", stages,
        "split", split,
        "preprocess",
          "mode", pp->mode == HAPI_PREPROCESS_FAST ? "fast" : "exact", "resize", pp->resize,
          "crop", pp->crop, "mean", pp->mean[0], pp->mean[1], pp->mean[2], "std", pp->std[0],
          pp->std[1], pp->std[2], "max_pixels", (json_int_t)pp->max_pixels,
        "cache",
          "dir", o->cache_dir, "namespace", json_object_get(split, "namespace") ?
              json_string_value(json_object_get(split, "namespace")) : "",
          "size_limit", (json_int_t)o->cache_size,
        "policy",
          "link", rate, "client_speed", client_speed, "epochs", epochs,
        "runtime",
          "threads", o->threads, "torch_threads", o->torch_threads, "show_raw", o->show_raw,
          "device", o->device, "batch", batch, "batch_auto", batch_auto,
          "batch_wait_ms", o->batch_wait_us / 1000,
          "decode_threads", o->decode_threads, "mem_budget", (json_int_t)o->mem_budget,
          "prefetch", o->prefetch == HAPI_PREFETCH_DIR ? "dir" : "off");
}

static json_t *render_warm(hapi_fs *fs)
{
    if (!fs->warm.root)
        return json_pack("{s:s}", "state", "idle");
    uint64_t total = atomic_load(&fs->warm.total);
    uint64_t cached = atomic_load(&fs->warm.cached);
    uint64_t skipped = atomic_load(&fs->warm.skipped);
    uint64_t completed = atomic_load(&fs->warm.completed);
    uint64_t done = cached + skipped + completed;
    double elapsed = (double)(hapi_now_ns() - fs->warm.started_ns) / 1e9;
    double rate = elapsed > 0 ? (double)completed / elapsed : 0;
    const char *state = !atomic_load(&fs->warm.counted) ? "counting"
                        : hapi_warm_finished(fs)        ? "done"
                                                         : "running";
    if (done > total)
        done = total;
    double eta = rate > 0 ? (double)(total - done) / rate : -1;
    return json_pack("{s:s, s:s, s:I, s:I, s:I, s:I, s:I, s:f, s:f, s:f}", "state", state,
                     "path", fs->warm.root, "total", (json_int_t)total, "done", (json_int_t)done,
                     "cached", (json_int_t)cached, "computed", (json_int_t)completed,
                     "skipped", (json_int_t)skipped, "rate_per_s", rate, "elapsed_s", elapsed,
                     "eta_s", strcmp(state, "done") == 0 ? 0.0 : eta);
}

static json_t *render_batcher(hapi_fs *fs)
{
    hapi_batcher_stats b;
    hapi_view *v = hapi_view_peek(fs);
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
                     "mem_budget", (json_int_t)fs->opt->mem_budget,
                     "mem_waits", (json_int_t)b.mem_waits);
}

static json_t *render_cache(hapi_fs *fs)
{
    hapi_cache_stats cs = { 0 };
    hapi_cache_namespace_stats ns = { 0 };
    hapi_cache_stats_get(fs->cache, &cs);
    hapi_view *v = hapi_view_peek(fs);
    uint64_t feat_size = v ? v->feat_size : 0;
    if (v)
        hapi_cache_namespace_stats_get(fs->cache, &v->ns, &ns);
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
                     "collected", (json_int_t)atomic_load(&fs->stats.collected),
                     "hit_latency_us", cs.hit_mean_us,
                     "accesses_dropped", (json_int_t)cs.accesses_dropped,
                     "namespace", "entries", (json_int_t)ns.entries,
                     "bytes", (json_int_t)ns.bytes);
}

static json_t *render_prefetch(hapi_fs *fs)
{
    return json_pack("{s:s, s:I, s:I, s:I, s:I, s:I, s:I}",
                     "mode", fs->opt->prefetch == HAPI_PREFETCH_DIR ? "dir" : "off",
                     "dirs", (json_int_t)atomic_load(&fs->prefetch.dirs),
                     "pending_dirs", (json_int_t)atomic_load(&fs->prefetch.pending_dirs),
                     "submitted", (json_int_t)atomic_load(&fs->prefetch.submitted),
                     "cached", (json_int_t)atomic_load(&fs->prefetch.cached),
                     "computed", (json_int_t)atomic_load(&fs->prefetch.computed),
                     "dropped", (json_int_t)atomic_load(&fs->prefetch.dropped));
}

static json_t *render_stats(hapi_fs *fs)
{
    hapi_fs_stats *s = &fs->stats;
    uint64_t hits = atomic_load(&s->hits);
    double uptime = (double)(hapi_now_ns() - fs->started_ns) / 1e9;
    return json_pack(
        "{s:f, s:I, s:{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:f}, s:o, s:o, s:o, s:o, s:{s:I}}",
        "uptime_s", uptime,
        "split_changes", (json_int_t)atomic_load(&fs->tune.split_changes),
        "feat",
          "reads", (json_int_t)atomic_load(&s->feat_reads),
          "bytes", (json_int_t)atomic_load(&s->feat_bytes),
          "hits", (json_int_t)hits,
          "misses", (json_int_t)atomic_load(&s->misses),
          "computed", (json_int_t)atomic_load(&s->computed),
          "failed", (json_int_t)atomic_load(&s->errors),
          "cache_put_failures", (json_int_t)atomic_load(&s->cache_put_failures),
          "hit_latency_us", hits ? (double)atomic_load(&s->hit_ns) / 1e3 / (double)hits : 0.0,
        "batcher", render_batcher(fs),
        "warm", render_warm(fs),
        "prefetch", render_prefetch(fs),
        "cache", render_cache(fs),
        "passthrough",
          "bytes", (json_int_t)atomic_load(&s->passthrough_bytes));
}

static json_t *render_profile(hapi_fs *fs)
{
    pthread_mutex_lock(&fs->tune.lock);
    int state = fs->tune.state;
    json_t *j;
    if (state == 0) {
        j = json_pack("{s:s}", "state", "measuring");
    } else if (state < 0) {
        j = json_pack("{s:s, s:s}", "state", "failed", "error", fs->tune.error);
    } else {
        char *text = hapi_profile_to_json(&fs->tune.profile);
        j = text ? json_loads(text, 0, NULL) : NULL;
        free(text);
        if (j) {
            json_object_set_new(j, "state", json_string(fs->tune.reused ? "stored" : "measured"));
            json_object_set_new(j, "decode_ms", json_real(fs->tune.decode_ms));
            json_object_set_new(j, "decode_samples", json_integer(fs->tune.decode_samples));
            json_object_set_new(j, "source_bytes", json_real(fs->tune.source_bytes));
        }
    }
    pthread_mutex_unlock(&fs->tune.lock);
    return j;
}

/* The policy now: the current split explained against every other, and what auto would pick. */
static json_t *render_policy(hapi_fs *fs)
{
    hapi_policy_choice *c = malloc(sizeof(*c));
    hapi_policy_input in;
    hapi_error err = { 0 };
    json_t *j = NULL;
    if (!c)
        return NULL;
    /* What the policy would choose now, with the inputs and the cache as they are. */
    int rc = hapi_tune_choose(fs, 0, &in, c, &err);
    if (rc == -EAGAIN) {
        j = json_pack("{s:s}", "state", "measuring");
    } else if (rc < 0) {
        j = json_pack("{s:s, s:s}", "state", "failed", "error", err.message);
    } else {
        char *text = hapi_policy_to_json(&in, c);
        j = text ? json_loads(text, 0, NULL) : NULL;
        free(text);
        hapi_view *v = hapi_view_peek(fs);
        pthread_mutex_lock(&fs->tune.lock);
        int by_operator = fs->tune.split_by_operator, batch = fs->tune.batch;
        pthread_mutex_unlock(&fs->tune.lock);
        if (j && v)
            json_object_set_new(j, "current",
                                json_pack("{s:i, s:s, s:i, s:s, s:b}", "split", v->split,
                                          "stage", v->output.name, "batch", batch, "by",
                                          by_operator ? "operator" : "policy", "differs",
                                          v->split != c->split));
        hapi_view_put(v);
        if (j)
            json_object_set_new(j, "state", json_string("ready"));
    }
    free(c);
    return j;
}

static const char ctl_help[] =
    "# write one command per line to this file:\n"
    "#   warm [PATH]   compute the features of PATH (default: everything) in the background;\n"
    "#                 progress in .hapifs/stats under \"warm\"\n"
    "#   evict [all]   drop this mount's cached features (they are computed again when read)\n"
    "#   evict PATH    drop those of an image, or of every image beneath a directory\n"
    "#   split N|NAME|auto   serve the features of another split (auto: the policy's);\n"
    "#                 open files keep theirs, the next open sees the new shape\n"
    "#   batch N|auto  the storage-side batch\n"
    "#   link RATE     tell the policy the link's rate (e.g. 1Gbit); see .hapifs/policy\n"
    "#   client_speed X, epochs N   the policy's other inputs\n";

/* A path given to a command: relative to the mount, beneath it, existing in the source. */
static int command_path(hapi_fs *fs, const char *word, char **out, hapi_error *err)
{
    while (*word == '/')
        word++;
    for (const char *p = word; *p; p++)
        if (p[0] == '.' && p[1] == '.' && (p == word || p[-1] == '/') && (p[2] == '/' || !p[2]))
            return hapi_error_set(err, -EINVAL, "'%s': '..' is not allowed", word);
    char *path = strdup(word);
    if (!path)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    size_t len = strlen(path);
    while (len && path[len - 1] == '/')
        path[--len] = '\0';
    struct stat st;
    if (hapi_fs_stat_beneath(fs->source_fd, path, &st) < 0) {
        free(path);
        return hapi_error_set(err, -ENOENT, "'%s': no such file or directory", word);
    }
    *out = path;
    return 0;
}

/* Checks one line fully, then carries it out. */
static int run_line(hapi_fs *fs, char *line, hapi_error *err)
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
    if (strcmp(words[0], "warm") == 0) {
        if (n > 2)
            return hapi_error_set(err, -EINVAL, "usage: warm [PATH]");
        char *path = NULL;
        int rc = command_path(fs, n == 2 ? words[1] : "", &path, err);
        if (rc < 0)
            return rc;
        rc = hapi_warm_start(fs, path);
        free(path);
        if (rc == -EBUSY)
            return hapi_error_set(err, rc, "a warm-up is already running");
        if (rc < 0)
            return hapi_error_set(err, rc, "cannot start the warm-up: %s", hapi_strerror(rc));
        return 0;
    }
    if (strcmp(words[0], "evict") == 0) {
        if (n > 2)
            return hapi_error_set(err, -EINVAL, "usage: evict [all|PATH]");
        char *path = NULL;
        int rc = command_path(fs, n == 2 && strcmp(words[1], "all") != 0 ? words[1] : "", &path,
                              err);
        if (rc < 0)
            return rc;
        rc = hapi_feat_evict(fs, path, err);
        if (rc >= 0)
            hapi_log(HAPI_LOG_INFO, "evicted %d entries of '%s'", rc, path);
        free(path);
        return rc < 0 ? (rc > HAPI_ERRNO_BASE ? rc : -EIO) : 0;
    }
    if (strcmp(words[0], "split") == 0) {
        if (n != 2)
            return hapi_error_set(err, -EINVAL, "usage: split N|NAME|auto");
        int split;
        if (strcmp(words[1], "auto") == 0) {
            hapi_policy_choice *c = malloc(sizeof(*c));
            int rc = c ? hapi_tune_choose(fs, 0, NULL, c, err)
                       : hapi_error_set(err, -ENOMEM, "out of memory");
            split = c ? c->split : 0;
            free(c);
            if (rc < 0)
                return rc == -EAGAIN ? rc : -EINVAL;
        } else if ((split = hapi_extractor_parse_split(fs->ex, words[1], err)) < 0) {
            return -EINVAL;
        }
        int rc = hapi_tune_set_split(fs, split, strcmp(words[1], "auto") != 0, err);
        return rc < 0 ? (rc > HAPI_ERRNO_BASE ? rc : -EINVAL) : 0;
    }
    if (strcmp(words[0], "batch") == 0) {
        char *end;
        long b = n == 2 && strcmp(words[1], "auto") != 0 ? strtol(words[1], &end, 10) : 0;
        if (n != 2 || (strcmp(words[1], "auto") != 0 && (*end || b < 1 || b > HAPI_BATCH_MAX)))
            return hapi_error_set(err, -EINVAL, "usage: batch N|auto (N in 1..%d)",
                                  HAPI_BATCH_MAX);
        int rc = hapi_tune_set_batch(fs, (int)b, err);
        return rc < 0 ? (rc > HAPI_ERRNO_BASE ? rc : -EINVAL) : 0;
    }
    if (strcmp(words[0], "link") == 0 || strcmp(words[0], "client_speed") == 0 ||
        strcmp(words[0], "epochs") == 0) {
        if (n != 2)
            return hapi_error_set(err, -EINVAL, "usage: %s VALUE", words[0]);
        double value = 0;
        char *end;
        if (words[0][0] == 'l') {
            if (hapi_policy_parse_rate(words[1], &value, err) < 0)
                return -EINVAL;
        } else {
            value = strtod(words[1], &end);
            int is_epochs = words[0][0] == 'e';
            if (*end || !(value > 0) || value > 1e6 || (is_epochs && value != (int)value))
                return hapi_error_set(err, -EINVAL, "%s %s: expected a positive %s", words[0],
                                      words[1], is_epochs ? "whole number" : "number");
        }
        pthread_mutex_lock(&fs->tune.lock);
        if (words[0][0] == 'l')
            fs->tune.in.link_bps = value;
        else if (words[0][0] == 'c')
            fs->tune.in.client_speed = value;
        else
            fs->tune.in.epochs = (int)value;
        pthread_mutex_unlock(&fs->tune.lock);
        hapi_log(HAPI_LOG_INFO, "policy input %s = %s", words[0], words[1]);
        return 0;
    }
    return hapi_error_set(err, -EINVAL,
                          "unknown command '%s' (known: warm, evict, split, batch, link, "
                          "client_speed, epochs)", words[0]);
}

int hapi_ctl_command(hapi_fs *fs, const char *text, size_t len, hapi_error *err)
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
        int rc = run_line(fs, line, err);
        if (rc < 0)
            return rc;
    }
    return 0;
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
    if (strcmp(name, HAPI_CTL_WRITABLE) == 0)
        return strdup(ctl_help);
    if (strcmp(name, "config") == 0)
        j = render_config(fs);
    else if (strcmp(name, "stats") == 0)
        j = render_stats(fs);
    else if (strcmp(name, "profile") == 0)
        j = render_profile(fs);
    else if (strcmp(name, "policy") == 0)
        j = render_policy(fs);
    if (!j)
        return NULL;
    char *text = json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(j);
    return with_newline(text);
}

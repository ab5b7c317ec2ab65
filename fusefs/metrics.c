/*
 * metrics.c — .hapifs/metrics: the numbers of .hapifs/stats in the
 * Prometheus text exposition format (version 0.0.4), for a node's scraper.
 *
 * One rule makes every name, so that nothing in stats is missing here and
 * the man page can state the rule and list the result:
 *   - a number at stats path a.b.c is hapifs_a_b_c; units become base units
 *     (_us and _ms to _seconds, _ms_per_sample to _seconds_per_sample, _per_s
 *     to _per_second, _s to _seconds) with the value scaled; three paths are
 *     renamed (see renamed[]) so that no gauge ends in _total and no two
 *     names collide;
 *   - it is a gauge if its path is in the gauges table below, else a counter,
 *     whose name ends in _total;
 *   - a "state" string is a gauge of value 1 with the state as a label;
 *     other strings (paths, names) are left out;
 *   - the objects of remote.sources are one sample each, labelled with the
 *     source's path, under hapifs_remote_source_*;
 *   - every sample is labelled with the mountpoint, so that the files of
 *     several mounts can be collected together.
 */
#include "metrics.h"

#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

/* Paths (a trailing .* takes everything under it) whose numbers go up and down. */
static const char *const gauges[] = {
    "uptime_s", "batcher.batch", "batcher.queued.*", "batcher.in_flight", "batcher.mean_batch",
    "batcher.decode_ms_per_sample", "batcher.inference_ms_per_sample", "batcher.mem_in_use",
    "batcher.mem_peak", "batcher.mem_budget", "warm.*", "prefetch.pending_dirs",
    "cache.entries", "cache.bytes_used", "cache.bytes_free", "cache.size_limit",
    "cache.feat_size", "cache.hit_latency_us", "cache.namespace.*", "feat.hit_latency_us",
    "node.mem_total", "node.mem_used", "node.cores", "node.cores_used", "node.mounts",
    "node.waiting", "node.own_fixed", "node.own_flight", "remote.fetches_running",
    "remote.fetches_queued", "watch.dirs", "uring.queues", "uring.workers", "uring.registered",
    NULL,
};

/* Paths whose name would collide with another's once counters end in _total. */
static const struct {
    const char *path, *name;
} renamed[] = {
    { "cache.evictions_total", "cache_store_evictions" }, /* every process's, persisted */
    { "warm.total", "warm.images" },                      /* gauges, not counters */
    { "node.mem_total", "node.mem_budget" },
};

struct sample {
    char *name;   /* hapifs_..., without labels */
    int gauge;
    char *labels; /* inside the braces, without the mountpoint */
    double value;
    char *help;   /* the stats path */
};

struct out {
    struct sample *s;
    size_t n, cap;
    int failed;
};

static int is_gauge(const char *path)
{
    for (int i = 0; gauges[i]; i++) {
        size_t n = strlen(gauges[i]);
        if (n > 2 && strcmp(gauges[i] + n - 2, ".*") == 0
                ? strncmp(path, gauges[i], n - 1) == 0
                : strcmp(path, gauges[i]) == 0)
            return 1;
    }
    return 0;
}

static int ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* A label value, escaped as the format says: backslash, double quote, newline. */
static char *label_escape(const char *v)
{
    size_t n = strlen(v);
    char *o = malloc(2 * n + 1), *p = o;
    if (!o)
        return NULL;
    for (; *v; v++) {
        if (*v == '\\' || *v == '"') {
            *p++ = '\\';
            *p++ = *v;
        } else if (*v == '\n') {
            *p++ = '\\';
            *p++ = 'n';
        } else {
            *p++ = *v;
        }
    }
    *p = '\0';
    return o;
}

/* labels with key="value" added, value escaped; malloc'd, NULL when out of memory. */
static char *label_add(const char *labels, const char *key, const char *value)
{
    char *esc = label_escape(value), *l = NULL;
    if (esc && asprintf(&l, "%s%s%s=\"%s\"", labels, *labels ? "," : "", key, esc) < 0)
        l = NULL;
    free(esc);
    return l;
}

/* A sample of stats path (its name made from name_path: see the top). */
static void add(struct out *o, const char *path, const char *name_path, const char *prefix,
                const char *labels, double value, int state_sample)
{
    if (o->failed)
        return;
    if (o->n == o->cap) {
        size_t cap = o->cap ? o->cap * 2 : 128;
        struct sample *s = realloc(o->s, cap * sizeof(*s));
        if (!s) {
            o->failed = 1;
            return;
        }
        o->s = s;
        o->cap = cap;
    }
    /* the name: the path (or its replacement), units to base units */
    char base[256];
    snprintf(base, sizeof(base), "%s", name_path);
    for (size_t i = 0; i < sizeof(renamed) / sizeof(*renamed); i++)
        if (strcmp(path, renamed[i].path) == 0)
            snprintf(base, sizeof(base), "%s", renamed[i].name);
    size_t len = strlen(base);
    static const struct {
        const char *from, *to;
        double scale;
    } units[] = {
        { "_ms_per_sample", "_seconds_per_sample", 1e-3 },
        { "_per_s", "_per_second", 1 },
        { "_us", "_seconds", 1e-6 },
        { "_ms", "_seconds", 1e-3 },
        { "_s", "_seconds", 1 },
    };
    for (size_t i = 0; i < sizeof(units) / sizeof(*units); i++)
        if (ends_with(base, units[i].from)) {
            size_t stem = len - strlen(units[i].from);
            snprintf(base + stem, sizeof(base) - stem, "%s", units[i].to);
            value *= units[i].scale;
            break;
        }
    for (char *c = base; *c; c++)
        if (*c == '.')
            *c = '_';
    int gauge = state_sample || is_gauge(path);
    struct sample *s = &o->s[o->n];
    memset(s, 0, sizeof(*s));
    s->gauge = gauge;
    s->value = value;
    if (asprintf(&s->name, "hapifs_%s%s%s", prefix, base,
                 gauge || ends_with(base, "_total") ? "" : "_total") < 0)
        s->name = NULL;
    s->labels = strdup(labels);
    s->help = strdup(path);
    if (!s->name || !s->labels || !s->help) {
        free(s->name);
        free(s->labels);
        free(s->help);
        o->failed = 1;
        return;
    }
    o->n++;
}

static void walk(struct out *o, json_t *j, const char *path, const char *name_path,
                 const char *prefix, const char *labels);

static void walk_sources(struct out *o, json_t *a, const char *labels)
{
    for (size_t i = 0; i < json_array_size(a); i++) {
        json_t *e = json_array_get(a, i);
        const char *src = json_string_value(json_object_get(e, "path"));
        char *l = label_add(labels, "source", src ? src : "");
        if (!l) {
            o->failed = 1;
            return;
        }
        walk(o, e, "remote.sources[]", "", "remote_source_", l);
        free(l);
    }
}

/*
 * Adds the samples of j, whose stats path is path ("" at the top), named
 * prefix + name_path + the key.
 */
static void walk(struct out *o, json_t *j, const char *path, const char *name_path,
                 const char *prefix, const char *labels)
{
    const char *key;
    json_t *v;
    json_object_foreach(j, key, v) {
        char sub[256], name[256];
        snprintf(sub, sizeof(sub), "%s%s%s", path, *path ? "." : "", key);
        snprintf(name, sizeof(name), "%s%s%s", name_path, *name_path ? "." : "", key);
        if (json_is_object(v)) {
            walk(o, v, sub, name, prefix, labels);
        } else if (json_is_array(v)) {
            if (strcmp(sub, "remote.sources") == 0)
                walk_sources(o, v, labels);
        } else if (json_is_integer(v) || json_is_real(v)) {
            add(o, sub, name, prefix, labels, json_number_value(v), 0);
        } else if (json_is_boolean(v)) {
            add(o, sub, name, prefix, labels, json_is_true(v), 1);
        } else if (json_is_string(v) && strcmp(key, "state") == 0) {
            char *l = label_add(labels, "state", json_string_value(v));
            if (!l) {
                o->failed = 1;
                return;
            }
            add(o, sub, name, prefix, l, 1, 1);
            free(l);
        }
    }
}

/* Appends to a growing text; sets *failed when out of memory. */
static void emit(char **text, size_t *len, size_t *cap, int *failed, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

static void emit(char **text, size_t *len, size_t *cap, int *failed, const char *fmt, ...)
{
    if (*failed)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(*text + *len, *cap - *len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            *failed = 1;
            return;
        }
        if ((size_t)n < *cap - *len) {
            *len += (size_t)n;
            return;
        }
        size_t cap2 = (*cap + (size_t)n) * 2;
        char *t = realloc(*text, cap2);
        if (!t) {
            *failed = 1;
            return;
        }
        *text = t;
        *cap = cap2;
    }
}

int hapi_metrics_render(json_t *stats, const char *mountpoint, char **text)
{
    struct out o = { 0 };
    char *mp = label_escape(mountpoint ? mountpoint : "");
    *text = NULL;
    if (!mp)
        return -ENOMEM;
    walk(&o, stats, "", "", "", "");
    size_t cap = 4096, used = 0;
    int failed = o.failed;
    char *t = failed ? NULL : malloc(cap);
    if (!t)
        failed = 1;
    else
        t[0] = '\0';
    /* a family's samples together, families in the order first seen */
    for (size_t i = 0; i < o.n && !failed; i++) {
        int first = 1;
        for (size_t k = 0; k < i && first; k++)
            first = strcmp(o.s[k].name, o.s[i].name) != 0;
        if (!first)
            continue;
        emit(&t, &used, &cap, &failed, "# HELP %s .hapifs/stats %s\n# TYPE %s %s\n", o.s[i].name,
             o.s[i].help, o.s[i].name, o.s[i].gauge ? "gauge" : "counter");
        for (size_t k = i; k < o.n; k++) {
            if (strcmp(o.s[k].name, o.s[i].name) != 0)
                continue;
            double v = o.s[k].value;
            emit(&t, &used, &cap, &failed,
                 v == (double)(int64_t)v ? "%s{mountpoint=\"%s\"%s%s} %.0f\n"
                                         : "%s{mountpoint=\"%s\"%s%s} %.9g\n",
                 o.s[k].name, mp, *o.s[k].labels ? "," : "", o.s[k].labels, v);
        }
    }
    for (size_t i = 0; i < o.n; i++) {
        free(o.s[i].name);
        free(o.s[i].labels);
        free(o.s[i].help);
    }
    free(o.s);
    free(mp);
    if (failed) {
        free(t);
        return -ENOMEM;
    }
    *text = t;
    return 0;
}

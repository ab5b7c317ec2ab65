/* log.c — the daemon's log (a file, stderr or syslog) and the ring of recent errors behind .hapifs/errors. */
#include "log.h"
#include "hapi.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <syslog.h>
#include <time.h>

/* The log is process-wide: the daemon has one, and its threads all write to it. */
static FILE *log_file;
static int log_to_stderr;
static int log_debug;
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;

int hapi_log_open(const char *path, int to_stderr, int debug)
{
    log_debug = debug;
    log_to_stderr = 0;
    if (path) {
        FILE *f = fopen(path, "ae");
        if (!f)
            return -errno;
        setvbuf(f, NULL, _IOLBF, 0);
        log_file = f;
    } else if (to_stderr) {
        log_to_stderr = 1;
    } else {
        openlog("hapifs", LOG_PID, LOG_DAEMON);
    }
    return 0;
}

void hapi_log_close(void)
{
    if (log_file)
        fclose(log_file);
    log_file = NULL;
}

void hapi_log(int level, const char *fmt, ...)
{
    static const char *const names[] = { "error", "warning", "info", "debug" };
    static const int priorities[] = { LOG_ERR, LOG_WARNING, LOG_INFO, LOG_DEBUG };
    char line[PATH_MAX + HAPI_ERROR_MESSAGE_MAX]; /* a path and a whole hapi_error message */
    va_list ap;

    if (level == HAPI_LOG_DEBUG && !log_debug)
        return;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);

    if (!log_file && !log_to_stderr) {
        syslog(priorities[level], "%s", line);
        return;
    }
    struct timespec ts;
    struct tm tm;
    char stamp[32];
    clock_gettime(CLOCK_REALTIME, &ts);
    localtime_r(&ts.tv_sec, &tm);
    strftime(stamp, sizeof(stamp), "%Y-%m-%d %H:%M:%S", &tm);
    pthread_mutex_lock(&log_lock);
    fprintf(log_file ? log_file : stderr, "%s.%03ld hapifs %s: %s\n", stamp,
            ts.tv_nsec / 1000000, names[level], line);
    pthread_mutex_unlock(&log_lock);
}

/* A fixed ring: the newest HAPI_ERRORS_KEPT errors, plus a count of all. */
struct hapi_error_ring {
    pthread_mutex_t lock;
    uint64_t count;
    struct {
        time_t when;
        int code;
        uint64_t repeats;
        char *path;
        char *message;
    } slot[HAPI_ERRORS_KEPT];
};

hapi_error_ring *hapi_error_ring_new(void)
{
    hapi_error_ring *r = calloc(1, sizeof(*r));
    if (r)
        pthread_mutex_init(&r->lock, NULL);
    return r;
}

void hapi_error_ring_free(hapi_error_ring *r)
{
    if (!r)
        return;
    for (int i = 0; i < HAPI_ERRORS_KEPT; i++) {
        free(r->slot[i].path);
        free(r->slot[i].message);
    }
    pthread_mutex_destroy(&r->lock);
    free(r);
}

void hapi_error_ring_add(hapi_error_ring *r, const char *path, int code, const char *message)
{
    if (!r) {
        hapi_log(HAPI_LOG_ERROR, "%s: %s", path, message);
        return;
    }
    /*
     * The kernel retries a page read that failed, and readers retry too: the
     * same failure of the same file within a few seconds is one error, counted
     * as repeated, not a new line in the log.
     */
    time_t now = time(NULL);
    pthread_mutex_lock(&r->lock);
    if (r->count > 0) {
        int last = (int)((r->count - 1) % HAPI_ERRORS_KEPT);
        if (r->slot[last].path && strcmp(r->slot[last].path, path) == 0 &&
            strcmp(r->slot[last].message, message) == 0 && now - r->slot[last].when <= 5) {
            r->slot[last].repeats++;
            pthread_mutex_unlock(&r->lock);
            return;
        }
    }
    pthread_mutex_unlock(&r->lock);
    hapi_log(HAPI_LOG_ERROR, "%s: %s", path, message);
    char *p = strdup(path);
    char *m = strdup(message);
    pthread_mutex_lock(&r->lock);
    int i = (int)(r->count % HAPI_ERRORS_KEPT);
    free(r->slot[i].path);
    free(r->slot[i].message);
    r->slot[i].when = now;
    r->slot[i].code = code;
    r->slot[i].repeats = 0;
    r->slot[i].path = p;
    r->slot[i].message = m;
    r->count++;
    pthread_mutex_unlock(&r->lock);
}

/*
 * The length of the valid UTF-8 sequence at p, or 0: as jansson checks it,
 * no overlong form, surrogate or code point past U+10FFFF (RFC 3629).
 */
static size_t utf8_len(const unsigned char *p)
{
    if (p[0] < 0x80)
        return 1;
    size_t n = p[0] >= 0xc2 && p[0] <= 0xdf ? 2 : p[0] >= 0xe0 && p[0] <= 0xef ? 3
             : p[0] >= 0xf0 && p[0] <= 0xf4 ? 4 : 0;
    /* the second byte's range: narrower after E0, ED, F0 and F4 */
    unsigned lo = p[0] == 0xe0 ? 0xa0 : p[0] == 0xf0 ? 0x90 : 0x80;
    unsigned hi = p[0] == 0xed ? 0x9f : p[0] == 0xf4 ? 0x8f : 0xbf;
    if (n && (p[1] < lo || p[1] > hi))
        return 0;
    for (size_t i = 2; i < n; i++)
        if ((p[i] & 0xc0) != 0x80)
            return 0;
    return n;
}

json_t *hapi_json_text(const char *s)
{
    json_t *v = s ? json_string(s) : json_null();
    if (v || !s)
        return v;
    char *out = malloc(4 * strlen(s) + 1), *o = out;
    if (!out)
        return NULL;
    for (const unsigned char *p = (const unsigned char *)s; *p;) {
        size_t n = utf8_len(p);
        if (n) {
            memcpy(o, p, n);
            o += n;
            p += n;
        } else {
            o += sprintf(o, "\\x%02x", *p++);
        }
    }
    *o = '\0';
    v = json_string(out);
    free(out);
    return v;
}

char *hapi_error_ring_json(hapi_error_ring *r, int (*shown)(const char *path, void *arg),
                           void *arg)
{
    json_t *list = json_array();
    json_t *root = json_object();
    char **paths = calloc(HAPI_ERRORS_KEPT, sizeof(*paths)); /* as recorded: for shown */
    char *text = NULL;
    size_t n = 0;

    if (!list || !root || !paths)
        goto out;
    pthread_mutex_lock(&r->lock);
    uint64_t kept = r->count < HAPI_ERRORS_KEPT ? r->count : HAPI_ERRORS_KEPT;
    for (uint64_t k = r->count - kept; k < r->count; k++) {
        int i = (int)(k % HAPI_ERRORS_KEPT);
        char when[32];
        struct tm tm;
        gmtime_r(&r->slot[i].when, &tm);
        strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", &tm);
        json_t *e = json_pack("{s:s, s:o?, s:o?, s:s, s:I}", "time", when, "path",
                              hapi_json_text(r->slot[i].path), "error",
                              hapi_json_text(r->slot[i].message), "kind",
                              hapi_strerror(r->slot[i].code), "repeats",
                              (json_int_t)r->slot[i].repeats);
        if (json_array_append_new(list, e) == 0)
            paths[n++] = r->slot[i].path ? strdup(r->slot[i].path) : NULL;
    }
    json_object_set_new(root, "count", json_integer((json_int_t)r->count));
    pthread_mutex_unlock(&r->lock);
    if (shown) {
        /* outside the lock: deciding may stat the source */
        json_int_t hidden = 0;
        for (size_t k = n; k-- > 0;) {
            if (!paths[k] || !shown(paths[k], arg)) {
                json_array_remove(list, k);
                hidden++;
            }
        }
        json_object_set_new(root, "hidden", json_integer(hidden));
    }
    json_object_set(root, "errors", list);
    text = json_dumps(root, JSON_INDENT(2));
out:
    for (size_t k = 0; k < n; k++)
        free(paths[k]);
    free(paths);
    json_decref(list);
    json_decref(root);
    return text;
}

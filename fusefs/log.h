/* log.h — the daemon's log and the ring of recent errors (.hapifs/errors). */
#ifndef HAPI_FUSEFS_LOG_H
#define HAPI_FUSEFS_LOG_H

enum hapi_log_level { HAPI_LOG_ERROR, HAPI_LOG_WARNING, HAPI_LOG_INFO, HAPI_LOG_DEBUG };

/* Sends the log to path (appending), or stderr when path is NULL and to_stderr, else syslog. */
int hapi_log_open(const char *path, int to_stderr, int debug);
void hapi_log_close(void);
void hapi_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The most recent errors, kept for .hapifs/errors. Thread-safe. */
#define HAPI_ERRORS_KEPT 256
typedef struct hapi_error_ring hapi_error_ring;
hapi_error_ring *hapi_error_ring_new(void);
void hapi_error_ring_free(hapi_error_ring *r);
/* Records that path failed with code and message, and logs it. */
void hapi_error_ring_add(hapi_error_ring *r, const char *path, int code, const char *message);
/*
 * A JSON text {"count": N, "errors": [...]} (malloc'd, caller frees), or
 * NULL. With shown, only the errors whose path it returns nonzero for are
 * listed, and "hidden" counts the others.
 */
char *hapi_error_ring_json(hapi_error_ring *r, int (*shown)(const char *path, void *arg),
                           void *arg);

/*
 * s (a path, a message naming one) as a JSON string for a person to read,
 * NULL as JSON null: where it is not UTF-8 (a Latin-1 file name; jansson
 * refuses such a string, and the whole JSON text was lost), each byte that is
 * not is written as the four characters \xNN, as Python's backslashreplace
 * does. A new reference (jansson's json_t), or NULL without memory.
 */
struct json_t;
struct json_t *hapi_json_text(const char *s);

#endif

/* hapi.h — what every hapifs module shares: the error space, the error status object, timing. */
#ifndef HAPI_H
#define HAPI_H

#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Error codes. Functions return 0 (or a count) on success and a negative
 * number on failure: either a negated errno value (-ENOMEM, -ENOENT, ...) or
 * one of the hapifs codes below, which live in a reserved range far from any
 * errno. hapi_strerror() describes both. "Not found" is a result, not an
 * error: functions that look things up say how they report it.
 */
enum {
    HAPI_ERRNO_BASE = -30000,
    HAPI_EDECODE = -30000,    /* the image could not be decoded */
    HAPI_EFORMAT = -30001,    /* not a format we read (neither JPEG nor PNG) */
    HAPI_ETOOBIG = -30002,    /* image over the pixel limit, refused before decoding */
    HAPI_EMODEL = -30003,     /* the model failed to load or to run */
    HAPI_ENOTSTAGED = -30004, /* the model file is not a staged hapifs archive */
    HAPI_EOOM = -30005,       /* out of memory while running the model */
    HAPI_ECACHE = -30006,     /* the cache store failed */
    HAPI_ECORRUPT = -30007,   /* stored data is corrupt or foreign */
    HAPI_EINVAL = -30008,     /* a bad argument or option value */
    HAPI_ERRNO_LAST = -30008
};

/*
 * A message's room: a whole path (PATH_MAX, 4096 on Linux; common/error.c
 * checks it) and 256 bytes of words around it, so that a message naming a
 * mount point or a file is never cut.
 */
#define HAPI_ERROR_MESSAGE_MAX (4096 + 256)

/*
 * A status object owned by the caller, filled by a failing call with its
 * code and a one-line message naming what failed. May be NULL wherever a
 * function takes one; functions never read it, they only write on failure.
 * It is 4.3 KB: declare it once per function, not in arrays or per item.
 */
typedef struct hapi_error {
    int code;
    char message[HAPI_ERROR_MESSAGE_MAX];
} hapi_error;

/* Describes a hapifs code or a negated errno. The string is static. */
const char *hapi_strerror(int code);

/*
 * Fills err (if not NULL) with code and a printf-style message, and returns
 * code so a caller can write `return hapi_error_set(err, -EIO, ...)`.
 */
int hapi_error_set(hapi_error *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/*
 * Writes the n bytes at bytes as 2n lowercase hex digits and a NUL into out,
 * which must hold 2n + 1 bytes (digests, namespaces).
 */
void hapi_hex(const void *bytes, size_t n, char *out);

/*
 * Reads 2n lowercase hex digits at hex into the n bytes at out: the inverse
 * of hapi_hex(). Returns 0, or -1 if one of them is not a lowercase hex digit.
 */
int hapi_unhex(const char *hex, size_t n, void *out);

/*
 * Reads fd to its end from offset 0 into a malloc'd buffer (*data, the caller frees) of at
 * least hint + 1 bytes, so that a NUL fits after the *size bytes read. Returns 0 or -errno.
 */
int hapi_read_all(int fd, size_t hint, char **data, size_t *size);

/* Monotonic clock in nanoseconds. */
uint64_t hapi_now_ns(void);

/* CPU time in nanoseconds: the calling thread's, or with process nonzero the whole process's
   (its other threads too, e.g. torch's intra-op workers). */
uint64_t hapi_cpu_ns(int process);

/* pthread_cond_init on the monotonic clock, for timed waits whose deadline is
   CLOCK_MONOTONIC (they then do not move with the wall clock). Returns 0 or a
   positive errno, as pthread_cond_init. */
int hapi_cond_init_monotonic(pthread_cond_t *cond);

/* Fills ts with the CLOCK_MONOTONIC time ns nanoseconds from now: the deadline
   for pthread_cond_timedwait on a condition made by hapi_cond_init_monotonic().
   Every timed wait in hapifs goes through the two, so none moves with the
   wall clock. */
void hapi_deadline_after_ns(struct timespec *ts, uint64_t ns);

#ifdef __cplusplus
}
#endif

#endif

/* error.c — the shared error space: descriptions and the status object. */
#include "hapi.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

_Static_assert(HAPI_ERROR_MESSAGE_MAX >= PATH_MAX + 256,
               "a hapi_error message holds a whole path and the words around it");

const char *hapi_strerror(int code)
{
    switch (code) {
    case 0: return "success";
    case HAPI_EDECODE: return "image could not be decoded";
    case HAPI_EFORMAT: return "not a JPEG or PNG image";
    case HAPI_ETOOBIG: return "image is over the pixel limit";
    case HAPI_EMODEL: return "model error";
    case HAPI_ENOTSTAGED: return "not a staged hapifs model archive";
    case HAPI_EOOM: return "out of memory while running the model";
    case HAPI_ECACHE: return "feature cache error";
    case HAPI_ECORRUPT: return "stored data is corrupt or foreign";
    case HAPI_EINVAL: return "invalid argument";
    default: break;
    }
    if (code < 0 && code > HAPI_ERRNO_BASE)
        return strerrordesc_np(-code) ? strerrordesc_np(-code) : "unknown error";
    return "unknown error";
}

int hapi_error_set(hapi_error *err, int code, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        err->code = code;
        va_start(ap, fmt);
        vsnprintf(err->message, sizeof(err->message), fmt, ap);
        va_end(ap);
    }
    return code;
}

void hapi_hex(const void *bytes, size_t n, char *out)
{
    static const char digits[] = "0123456789abcdef";
    const unsigned char *b = bytes;
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[b[i] >> 4];
        out[2 * i + 1] = digits[b[i] & 0xf];
    }
    out[2 * n] = '\0';
}

static int hex_digit(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

int hapi_unhex(const char *hex, size_t n, void *out)
{
    unsigned char *b = out;
    for (size_t i = 0; i < n; i++) {
        int hi = hex_digit(hex[2 * i]), lo = hi < 0 ? -1 : hex_digit(hex[2 * i + 1]);
        if (lo < 0)
            return -1;
        b[i] = (unsigned char)(hi << 4 | lo);
    }
    return 0;
}

static uint64_t clock_ns(clockid_t clock)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t hapi_now_ns(void)
{
    return clock_ns(CLOCK_MONOTONIC);
}

uint64_t hapi_cpu_ns(int process)
{
    return clock_ns(process ? CLOCK_PROCESS_CPUTIME_ID : CLOCK_THREAD_CPUTIME_ID);
}

int hapi_cond_init_monotonic(pthread_cond_t *cond)
{
    pthread_condattr_t attr;
    int rc = pthread_condattr_init(&attr);
    if (rc)
        return rc;
    rc = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    if (!rc)
        rc = pthread_cond_init(cond, &attr);
    pthread_condattr_destroy(&attr);
    return rc;
}

void hapi_deadline_after_ns(struct timespec *ts, uint64_t ns)
{
    uint64_t at = hapi_now_ns() + ns;
    ts->tv_sec = (time_t)(at / 1000000000u);
    ts->tv_nsec = (long)(at % 1000000000u);
}

int hapi_read_all(int fd, size_t hint, char **data, size_t *size)
{
    size_t cap = hint + 1, used = 0;
    char *buf = malloc(cap);
    if (!buf)
        return -ENOMEM;
    for (;;) {
        if (used == cap) {
            char *bigger = realloc(buf, cap * 2);
            if (!bigger) {
                free(buf);
                return -ENOMEM;
            }
            buf = bigger;
            cap *= 2;
        }
        ssize_t r = pread(fd, buf + used, cap - used, (off_t)used);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            int rc = -errno;
            free(buf);
            return rc;
        }
        if (r == 0)
            break;
        used += (size_t)r;
    }
    *data = buf;
    *size = used;
    return 0;
}

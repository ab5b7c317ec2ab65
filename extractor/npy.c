/* npy.c — the header of a .npy (format 1.0) file, the format of every .feat. */
#include "extractor.h"

#include <ctype.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

int hapi_npy_header(char *buf, int dtype, const int64_t *shape, int ndim)
{
    char dict[HAPI_NPY_HEADER_MAX];
    char dims[160] = "";
    size_t used = 0;

    if (ndim < 0 || ndim > HAPI_MAX_DIMS || (dtype != HAPI_DTYPE_FP32 && dtype != HAPI_DTYPE_FP16))
        return HAPI_EINVAL;
    /* numpy writes (n,) for one dimension and (a, b, c) for more. */
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return HAPI_EINVAL;
        used += (size_t)snprintf(dims + used, sizeof(dims) - used, "%s%lld%s",
                                 i ? ", " : "", (long long)shape[i], ndim == 1 ? "," : "");
        if (used >= sizeof(dims))
            return HAPI_EINVAL;
    }

    int dlen = snprintf(dict, sizeof(dict),
                        "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }",
                        dtype == HAPI_DTYPE_FP16 ? "<f2" : "<f4", dims);
    if (dlen < 0 || (size_t)dlen >= sizeof(dict))
        return HAPI_EINVAL;

    /* magic (6) + version (2) + length (2) + dict + padding + '\n' */
    size_t total = 10 + (size_t)dlen + 1;
    total = (total + 63) / 64 * 64;
    if (total > HAPI_NPY_HEADER_MAX)
        return HAPI_EINVAL;
    size_t hlen = total - 10;

    memcpy(buf, "\x93NUMPY\x01\x00", 8);
    buf[8] = (char)(hlen & 0xff);
    buf[9] = (char)(hlen >> 8);
    memcpy(buf + 10, dict, (size_t)dlen);
    memset(buf + 10 + dlen, ' ', hlen - (size_t)dlen - 1);
    buf[total - 1] = '\n';
    return (int)total;
}

int hapi_npy_parse(const char *buf, size_t len, int *dtype, int64_t *shape, int *ndim)
{
    if (len < 10)
        return len < 6 || memcmp(buf, "\x93NUMPY", 6) == 0 ? -EAGAIN : HAPI_EINVAL;
    if (memcmp(buf, "\x93NUMPY\x01\x00", 8) != 0)
        return HAPI_EINVAL;
    size_t total = 10 + ((size_t)(unsigned char)buf[8] | (size_t)(unsigned char)buf[9] << 8);
    if (total > HAPI_NPY_HEADER_MAX)
        return HAPI_EINVAL;
    if (len < total)
        return -EAGAIN;
    if (buf[total - 1] != '\n')
        return HAPI_EINVAL;
    /* exactly what hapi_npy_header() writes: the dict, then spaces */
    static const char start[] = "{'descr': '<f", order[] = "', 'fortran_order': False, 'shape': (";
    const char *p = buf + 10, *end = buf + total - 1;
    if ((size_t)(end - p) < sizeof(start) + sizeof(order) || memcmp(p, start, sizeof(start) - 1))
        return HAPI_EINVAL;
    p += sizeof(start) - 1;
    if (*p != '4' && *p != '2')
        return HAPI_EINVAL;
    *dtype = *p++ == '4' ? HAPI_DTYPE_FP32 : HAPI_DTYPE_FP16;
    if (memcmp(p, order, sizeof(order) - 1) != 0)
        return HAPI_EINVAL;
    p += sizeof(order) - 1;
    *ndim = 0;
    while (p < end && *p != ')') {
        if (*ndim == HAPI_MAX_DIMS || !isdigit((unsigned char)*p))
            return HAPI_EINVAL;
        int64_t v = 0;
        while (p < end && isdigit((unsigned char)*p)) {
            if (v > (INT64_MAX - 9) / 10)
                return HAPI_EINVAL;
            v = v * 10 + (*p++ - '0');
        }
        shape[(*ndim)++] = v;
        if (p < end && *p == ',')
            p++;
        if (p < end && *p == ' ')
            p++;
    }
    if (end - p < 4 || memcmp(p, "), }", 4) != 0)
        return HAPI_EINVAL;
    for (p += 4; p < end; p++)
        if (*p != ' ')
            return HAPI_EINVAL;
    return (int)total;
}

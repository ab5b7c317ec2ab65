/* npy.c — the header of a .npy (format 1.0) file, the format of every .feat. */
#include "extractor.h"

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

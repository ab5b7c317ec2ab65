/* hapi-dump.c — test tool: writes the preprocessed tensor of an image as .npy, or times decode and preprocess. */
#include "extractor.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char usage[] =
    "usage: hapi-dump preprocess IMAGE OUT.npy [--resize R] [--crop C] [--mean a,b,c]\n"
    "                 [--std a,b,c] [--fast] [--max-pixels N] [--interpolation bilinear|bicubic]\n"
    "       hapi-dump time IMAGE... [--resize R] [--crop C] [--repeat K] [--fast]\n"
    "                 [--max-pixels N] [--interpolation bilinear|bicubic]\n";

/* Reads a whole file into a malloc'd buffer. Returns 0 or -errno. */
static int read_file(const char *path, uint8_t **data, size_t *size)
{
    FILE *f = fopen(path, "rb");
    uint8_t *buf = NULL;
    size_t cap = 0, len = 0;
    int ret = 0;

    *data = NULL;
    *size = 0;
    if (!f)
        return -errno;
    for (;;) {
        if (len == cap) {
            size_t ncap = cap ? cap * 2 : 1 << 16;
            uint8_t *nbuf = realloc(buf, ncap);
            if (!nbuf) {
                ret = -ENOMEM;
                goto out;
            }
            buf = nbuf;
            cap = ncap;
        }
        size_t n = fread(buf + len, 1, cap - len, f);
        len += n;
        if (n == 0) {
            if (ferror(f))
                ret = -EIO;
            break;
        }
    }
out:
    fclose(f);
    if (ret < 0) {
        free(buf);
        return ret;
    }
    *data = buf;
    *size = len;
    return 0;
}

/* Writes a float32 C-order array as .npy 1.0 with the data starting at a multiple of 64. */
static int write_npy(const char *path, const float *v, int ndim, const long *shape)
{
    char header[HAPI_NPY_HEADER_MAX];
    int64_t dims[HAPI_MAX_DIMS];
    size_t count = 1;
    for (int i = 0; i < ndim; i++) {
        dims[i] = shape[i];
        count *= (size_t)shape[i];
    }
    /* the daemon's own .npy header, so the tests compare like with like */
    int len = hapi_npy_header(header, HAPI_DTYPE_FP32, dims, ndim);
    if (len < 0)
        return -EINVAL;
    size_t padded = (size_t)len;

    FILE *f = fopen(path, "wb");
    if (!f)
        return -errno;
    int ok = fwrite(header, 1, padded, f) == padded && fwrite(v, sizeof(float), count, f) == count;
    if (fclose(f) != 0)
        ok = 0;
    return ok ? 0 : -EIO;
}

static int parse_triple(const char *s, float v[3])
{
    char *end;
    for (int i = 0; i < 3; i++) {
        v[i] = strtof(s, &end);
        if (end == s || (i < 2 && *end != ',') || (i == 2 && *end != '\0'))
            return -1;
        s = end + 1;
    }
    return 0;
}

static int parse_int(const char *s, long long min, long long *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < min)
        return -1;
    *out = v;
    return 0;
}

static int cmd_preprocess(const char *image, const char *npy, const hapi_preprocess *pp)
{
    hapi_decoder *dec = NULL;
    hapi_error err = {0};
    uint8_t *data = NULL;
    size_t size;
    float *out = NULL;
    int ret;

    ret = read_file(image, &data, &size);
    if (ret < 0) {
        fprintf(stderr, "hapi-dump: %s: %s\n", image, hapi_strerror(ret));
        return 1;
    }
    out = malloc(sizeof(float) * 3 * (size_t)pp->crop * (size_t)pp->crop);
    ret = out ? hapi_decoder_new(&dec) : -ENOMEM;
    if (ret == 0)
        ret = hapi_image_load(dec, data, size, pp, out, &err);
    else
        hapi_error_set(&err, ret, "%s", hapi_strerror(ret));
    if (ret == 0) {
        long shape[3] = {3, pp->crop, pp->crop};
        ret = write_npy(npy, out, 3, shape);
        if (ret < 0)
            hapi_error_set(&err, ret, "writing %s: %s", npy, hapi_strerror(ret));
    }
    if (ret < 0)
        fprintf(stderr, "hapi-dump: %s: %s\n", image, err.message);
    hapi_decoder_free(dec);
    free(out);
    free(data);
    return ret < 0 ? 1 : 0;
}

static int cmd_time(char **images, int count, const hapi_preprocess *pp, int repeat)
{
    hapi_decoder *dec = NULL;
    float *out = malloc(sizeof(float) * 3 * (size_t)pp->crop * (size_t)pp->crop);
    int status = 0;

    if (!out || hapi_decoder_new(&dec) < 0) {
        fprintf(stderr, "hapi-dump: out of memory\n");
        free(out);
        return 1;
    }
    printf("%-40s %11s %9s %13s\n", "image", "size", "decode_ms", "preprocess_ms");
    for (int i = 0; i < count; i++) {
        hapi_error err = {0};
        hapi_image img = {0};
        uint8_t *data;
        size_t size;
        uint64_t t_dec = 0, t_pre = 0;
        int ret = read_file(images[i], &data, &size);
        if (ret < 0) {
            fprintf(stderr, "hapi-dump: %s: %s\n", images[i], hapi_strerror(ret));
            status = 1;
            continue;
        }
        for (int r = 0; r < repeat && ret == 0; r++) {
            uint64_t t0 = hapi_now_ns();
            ret = hapi_image_decode(dec, data, size, pp->max_pixels,
                                    pp->mode == HAPI_PREPROCESS_FAST ? pp->resize : 0, &img, &err);
            uint64_t t1 = hapi_now_ns();
            if (ret == 0)
                ret = hapi_image_preprocess(&img, pp, out, &err);
            uint64_t t2 = hapi_now_ns();
            t_dec += t1 - t0;
            t_pre += t2 - t1;
            if (ret == 0 && r + 1 < repeat)
                hapi_image_release(&img);
        }
        if (ret < 0) {
            fprintf(stderr, "hapi-dump: %s: %s\n", images[i], err.message);
            status = 1;
        } else {
            char dims[32];
            snprintf(dims, sizeof(dims), "%dx%d", img.width, img.height);
            printf("%-40s %11s %9.3f %13.3f\n", images[i], dims, t_dec / 1e6 / repeat,
                   t_pre / 1e6 / repeat);
        }
        hapi_image_release(&img);
        free(data);
    }
    hapi_decoder_free(dec);
    free(out);
    return status;
}

int main(int argc, char **argv)
{
    hapi_preprocess pp = {
        .resize = 256, .crop = 224,
        .mean = {0.485f, 0.456f, 0.406f}, .std = {0.229f, 0.224f, 0.225f},
        .mode = HAPI_PREPROCESS_EXACT, .max_pixels = 100000000,
    };
    char **pos = calloc((size_t)argc + 1, sizeof(char *));
    int npos = 0, repeat = 1;
    long long v;

    if (!pos)
        return 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        if (strcmp(a, "--fast") == 0) {
            pp.mode = HAPI_PREPROCESS_FAST;
            continue;
        }
        if (strncmp(a, "--", 2) != 0) {
            pos[npos++] = argv[i];
            continue;
        }
        if (!val) {
            bad = 1;
        } else if (strcmp(a, "--resize") == 0) {
            bad = parse_int(val, 1, &v) < 0 || v > 1 << 20;
            pp.resize = (int)v;
        } else if (strcmp(a, "--crop") == 0) {
            bad = parse_int(val, 1, &v) < 0 || v > 1 << 14;
            pp.crop = (int)v;
        } else if (strcmp(a, "--repeat") == 0) {
            bad = parse_int(val, 1, &v) < 0 || v > 1 << 20;
            repeat = (int)v;
        } else if (strcmp(a, "--max-pixels") == 0) {
            bad = parse_int(val, 0, &v) < 0;
            pp.max_pixels = (uint64_t)v;
        } else if (strcmp(a, "--mean") == 0) {
            bad = parse_triple(val, pp.mean) < 0;
        } else if (strcmp(a, "--std") == 0) {
            bad = parse_triple(val, pp.std) < 0;
        } else if (strcmp(a, "--interpolation") == 0) {
            pp.interpolation = hapi_interpolation_parse(val);
            bad = pp.interpolation < 0;
        } else {
            bad = 1;
        }
        if (bad) {
            fprintf(stderr, "hapi-dump: bad option %s %s\n%s", a, val ? val : "", usage);
            free(pos);
            return 2;
        }
        i++;
    }
    int status;
    if (npos == 3 && strcmp(pos[0], "preprocess") == 0) {
        status = cmd_preprocess(pos[1], pos[2], &pp);
    } else if (npos >= 2 && strcmp(pos[0], "time") == 0) {
        status = cmd_time(pos + 1, npos - 1, &pp, repeat);
    } else {
        fputs(usage, stderr);
        status = 2;
    }
    free(pos);
    return status;
}

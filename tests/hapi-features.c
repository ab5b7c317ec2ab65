/* hapi-features.c — test tool: writes the features of images as .npy, or times decode, preprocess and inference. */
#include "extractor.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char usage[] =
    "usage: hapi-features MODEL OUTDIR IMAGE... [--split S] [--freeze F] [--dtype fp32|fp16]\n"
    "                    [--fast] [--threads N] [--bf16]\n"
    "       hapi-features --time MODEL IMAGE... [--split S] [--repeat K] [--batch B]\n"
    "                    [--threads N] [--fast] [--no-optimize] [--bf16]\n"
    "Writes OUTDIR/<basename of IMAGE>.npy for each image; --time prints the cost per\n"
    "image (mean and median, in ms) of decode, preprocess and inference at batch 1 and at\n"
    "batch B (default 32, the images repeated to fill it), with freed memory kept for the\n"
    "next batch as the daemon keeps it (hapi_extractor_keep_heap).\n";

struct options {
    const char *split;
    const char *freeze; /* NULL: the model's default (a split past it is refused) */
    int dtype;
    int mode;
    int threads;
    int repeat;
    int batch;
    int optimize;
    int precision;
};

/* Reads a whole file into a malloc'd buffer. Returns 0 or -errno. */
static int read_file(const char *path, uint8_t **data, size_t *size)
{
    int ret = 0;
    uint8_t *buf = NULL;
    FILE *f = fopen(path, "rb");

    *data = NULL;
    *size = 0;
    if (!f)
        return -errno;
    if (fseek(f, 0, SEEK_END) != 0) {
        ret = -errno;
        goto out;
    }
    long len = ftell(f);
    if (len < 0 || fseek(f, 0, SEEK_SET) != 0) {
        ret = -errno;
        goto out;
    }
    buf = malloc(len ? (size_t)len : 1);
    if (!buf) {
        ret = -ENOMEM;
        goto out;
    }
    if (fread(buf, 1, (size_t)len, f) != (size_t)len) {
        ret = -EIO;
        goto out;
    }
    *data = buf;
    *size = (size_t)len;
    buf = NULL;
out:
    free(buf);
    fclose(f);
    return ret;
}

/*
 * Writes one sample's features as .npy 1.0: the header dict padded with spaces so that the
 * data starts at a multiple of 64 bytes, as a .feat file is. Returns 0 or -errno.
 */
static int write_npy(const char *path, const void *data, size_t bytes, int dtype,
                     const hapi_stage_info *info)
{
    char header[HAPI_NPY_HEADER_MAX];
    /* the daemon's own .npy header, so the tests compare like with like */
    int len = hapi_npy_header(header, dtype, info->shape, info->ndim);
    if (len < 0)
        return -EINVAL;
    size_t padded = (size_t)len;

    FILE *f = fopen(path, "wb");
    if (!f)
        return -errno;
    int ok = fwrite(header, 1, padded, f) == padded && fwrite(data, 1, bytes, f) == bytes;
    if (fclose(f) != 0 || !ok)
        return -EIO;
    return 0;
}

static const char *base_name(const char *path)
{
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

static int open_extractor(const char *model, const struct options *o, hapi_extractor **ex)
{
    hapi_error err = {0};
    hapi_extractor_config cfg = {
        .model_path = model, .split = o->split, .freeze = o->freeze, .dtype = o->dtype,
        .mode = o->mode, .threads = o->threads, .precision = o->precision,
    };
    int rc = hapi_extractor_open(&cfg, ex, &err);
    if (rc < 0)
        fprintf(stderr, "hapi-features: %s: %s\n", model, err.message);
    return rc;
}

static int cmd_features(const char *model, const char *outdir, char **images, int count,
                        const struct options *o)
{
    int failed = 0;
    hapi_extractor *ex = NULL;
    hapi_decoder *dec = NULL;
    void *feat = NULL;

    if (open_extractor(model, o, &ex) < 0)
        return 1;
    if (hapi_decoder_new(&dec) < 0 || !(feat = malloc(hapi_extractor_sample_bytes(ex)))) {
        fprintf(stderr, "hapi-features: out of memory\n");
        failed = 1;
        goto out;
    }
    for (int i = 0; i < count; i++) {
        hapi_error err = {0};
        uint8_t *data;
        size_t size;
        char path[4096];
        int rc = read_file(images[i], &data, &size);
        if (rc < 0) {
            fprintf(stderr, "hapi-features: %s: %s\n", images[i], strerror(-rc));
            failed = 1;
            continue;
        }
        rc = hapi_extractor_compute(ex, dec, data, size, feat, &err);
        free(data);
        if (rc < 0) {
            fprintf(stderr, "hapi-features: %s: %s\n", images[i], err.message);
            failed = 1;
            continue;
        }
        snprintf(path, sizeof(path), "%s/%s.npy", outdir, base_name(images[i]));
        rc = write_npy(path, feat, hapi_extractor_sample_bytes(ex), hapi_extractor_dtype(ex),
                       hapi_extractor_output(ex));
        if (rc < 0) {
            fprintf(stderr, "hapi-features: %s: %s\n", path, strerror(-rc));
            failed = 1;
        }
    }
out:
    free(feat);
    hapi_decoder_free(dec);
    hapi_extractor_close(ex);
    return failed;
}

#define MS_SINCE(t0) ((double)(hapi_now_ns() - (t0)) / 1e6)

static int compare_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Prints "name mean M median D" of n samples in ms (each already per image); sorts v. */
static void print_stat(const char *name, double *v, int n)
{
    double sum = 0;
    for (int i = 0; i < n; i++)
        sum += v[i];
    qsort(v, (size_t)n, sizeof(*v), compare_double);
    double median = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
    printf("%-18s mean %9.3f  median %9.3f\n", name, sum / n, median);
}

static int cmd_time(const char *model_path, char **images, int count, const struct options *o)
{
    int status = 1;
    hapi_extractor *ex = NULL;
    hapi_model *own = NULL, *model;
    hapi_decoder *dec = NULL;
    hapi_error err = {0};
    hapi_image img = {0};
    float *inputs = NULL, *batch_in = NULL;
    void *out = NULL;
    double *decode_ms = NULL, *preprocess_ms = NULL, *b1_ms = NULL, *bn_ms = NULL;
    uint8_t **data = calloc((size_t)count, sizeof(*data));
    size_t *sizes = calloc((size_t)count, sizeof(*sizes));

    uint64_t t0 = hapi_now_ns();
    if (!data || !sizes || open_extractor(model_path, o, &ex) < 0)
        goto out;
    double open_ms = MS_SINCE(t0);
    model = hapi_extractor_model(ex);
    const hapi_preprocess *pp = hapi_extractor_preprocess(ex);
    int split = hapi_extractor_split(ex);
    if (!o->optimize) {
        hapi_model_options opt = {.threads = o->threads, .optimize = 0,
                                  .precision = o->precision};
        t0 = hapi_now_ns();
        if (hapi_model_load(model_path, &opt, &own, &err) < 0 ||
            hapi_model_probe(own, 3, pp->crop, pp->crop, &err) < 0) {
            fprintf(stderr, "hapi-features: %s: %s\n", model_path, err.message);
            goto out;
        }
        open_ms = MS_SINCE(t0);
        model = own;
    }

    size_t in_floats = 3 * (size_t)pp->crop * (size_t)pp->crop;
    size_t out_bytes = hapi_extractor_sample_bytes(ex);
    inputs = malloc((size_t)count * in_floats * sizeof(float));
    batch_in = malloc((size_t)o->batch * in_floats * sizeof(float));
    out = malloc((size_t)o->batch * out_bytes);
    int runs = o->repeat * count;
    int batch_runs = (runs + o->batch - 1) / o->batch;
    if (batch_runs < 3)
        batch_runs = 3;
    decode_ms = malloc((size_t)runs * sizeof(double));
    preprocess_ms = malloc((size_t)runs * sizeof(double));
    b1_ms = malloc((size_t)runs * sizeof(double));
    bn_ms = malloc((size_t)batch_runs * sizeof(double));
    if (hapi_decoder_new(&dec) < 0 || !inputs || !batch_in || !out || !decode_ms ||
        !preprocess_ms || !b1_ms || !bn_ms) {
        fprintf(stderr, "hapi-features: out of memory\n");
        goto out;
    }
    for (int i = 0; i < count; i++) {
        int rc = read_file(images[i], &data[i], &sizes[i]);
        if (rc < 0) {
            fprintf(stderr, "hapi-features: %s: %s\n", images[i], strerror(-rc));
            goto out;
        }
    }

    /* Decode and preprocess, each timed alone over every image, repeat times. */
    int min_side = pp->mode == HAPI_PREPROCESS_FAST ? pp->resize : 0;
    for (int r = 0; r < o->repeat; r++) {
        for (int i = 0; i < count; i++) {
            uint64_t a = hapi_now_ns();
            int rc = hapi_image_decode(dec, data[i], sizes[i], pp->max_pixels, min_side, &img,
                                       &err);
            if (rc < 0) {
                fprintf(stderr, "hapi-features: %s: %s\n", images[i], err.message);
                goto out;
            }
            uint64_t b = hapi_now_ns();
            rc = hapi_image_preprocess(&img, pp, inputs + (size_t)i * in_floats, &err);
            uint64_t c = hapi_now_ns();
            hapi_image_release(&img);
            if (rc < 0) {
                fprintf(stderr, "hapi-features: %s: %s\n", images[i], err.message);
                goto out;
            }
            decode_ms[r * count + i] = (double)(b - a) / 1e6;
            preprocess_ms[r * count + i] = (double)(c - b) / 1e6;
        }
    }

    /* Inference at batch 1, after a warm-up run (the executor specializes on first runs). */
    for (int w = 0; w < 3; w++)
        if (hapi_model_run(model, split, inputs, 1, o->dtype, out, out_bytes, &err) < 0)
            goto run_failed;
    for (int r = 0; r < o->repeat; r++) {
        for (int i = 0; i < count; i++) {
            t0 = hapi_now_ns();
            if (hapi_model_run(model, split, inputs + (size_t)i * in_floats, 1, o->dtype, out,
                               out_bytes, &err) < 0)
                goto run_failed;
            b1_ms[r * count + i] = MS_SINCE(t0);
        }
    }

    /* Inference at batch B on the images repeated to fill it. */
    for (int b = 0; b < o->batch; b++)
        memcpy(batch_in + (size_t)b * in_floats, inputs + (size_t)(b % count) * in_floats,
               in_floats * sizeof(float));
    size_t batch_bytes = (size_t)o->batch * out_bytes;
    if (hapi_model_run(model, split, batch_in, o->batch, o->dtype, out, batch_bytes, &err) < 0)
        goto run_failed;
    for (int r = 0; r < batch_runs; r++) {
        t0 = hapi_now_ns();
        if (hapi_model_run(model, split, batch_in, o->batch, o->dtype, out, batch_bytes, &err) < 0)
            goto run_failed;
        bn_ms[r] = MS_SINCE(t0) / o->batch;
    }

    const hapi_stage_info *st = hapi_extractor_output(ex);
    printf("model %s (%s @%d), split %d (%s), %s, optimize %s, %d images x %d\n", model_path,
           hapi_extractor_meta(ex)->arch, pp->crop, split, st->name,
           o->dtype == HAPI_DTYPE_FP16 ? "fp16" : "fp32", o->optimize ? "on" : "off", count,
           o->repeat);
    printf("load+probe_ms       %.1f\n", open_ms);
    char name[32];
    snprintf(name, sizeof(name), "inference_b%d_ms", o->batch);
    print_stat("decode_ms", decode_ms, runs);
    print_stat("preprocess_ms", preprocess_ms, runs);
    print_stat("inference_b1_ms", b1_ms, runs);
    print_stat(name, bn_ms, batch_runs);
    status = 0;
    goto out;
run_failed:
    fprintf(stderr, "hapi-features: %s: %s\n", model_path, err.message);
out:
    free(decode_ms);
    free(preprocess_ms);
    free(b1_ms);
    free(bn_ms);
    if (data)
        for (int i = 0; i < count; i++)
            free(data[i]);
    free(data);
    free(sizes);
    free(out);
    free(batch_in);
    free(inputs);
    hapi_decoder_free(dec);
    hapi_model_free(own);
    hapi_extractor_close(ex);
    return status;
}

/* Parses a positive integer option value; exits with usage on a bad one. */
static int positive(const char *name, const char *value)
{
    char *end;
    long v = value ? strtol(value, &end, 10) : 0;
    if (!value || *end || v < 1 || v > 1000000) {
        fprintf(stderr, "hapi-features: %s needs a positive integer\n%s", name, usage);
        exit(2);
    }
    return (int)v;
}

int main(int argc, char **argv)
{
    struct options o = {.split = "auto", .dtype = HAPI_DTYPE_FP32, .mode = HAPI_PREPROCESS_EXACT,
                        .threads = 0, .repeat = 3, .batch = 32, .optimize = 1};
    char **pos = calloc((size_t)argc, sizeof(*pos));
    int npos = 0, timing = 0;

    if (!pos)
        return 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *next = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--split") == 0 && next) {
            o.split = next;
            i++;
        } else if (strcmp(a, "--freeze") == 0 && next) {
            o.freeze = next;
            i++;
        } else if (strcmp(a, "--dtype") == 0 && next) {
            if (strcmp(next, "fp32") && strcmp(next, "fp16")) {
                fprintf(stderr, "hapi-features: --dtype is fp32 or fp16\n%s", usage);
                return 2;
            }
            o.dtype = strcmp(next, "fp16") == 0 ? HAPI_DTYPE_FP16 : HAPI_DTYPE_FP32;
            i++;
        } else if (strcmp(a, "--fast") == 0) {
            o.mode = HAPI_PREPROCESS_FAST;
        } else if (strcmp(a, "--bf16") == 0) {
            o.precision = HAPI_PRECISION_BF16;
        } else if (strcmp(a, "--time") == 0) {
            timing = 1;
        } else if (strcmp(a, "--no-optimize") == 0) {
            o.optimize = 0;
        } else if (strcmp(a, "--repeat") == 0) {
            o.repeat = positive(a, next);
            i++;
        } else if (strcmp(a, "--batch") == 0) {
            o.batch = positive(a, next);
            i++;
        } else if (strcmp(a, "--threads") == 0) {
            o.threads = positive(a, next);
            i++;
        } else if (a[0] == '-' && a[1] == '-') {
            fprintf(stderr, "hapi-features: unknown option %s\n%s", a, usage);
            return 2;
        } else {
            pos[npos++] = argv[i];
        }
    }
    int status;
    if (timing && npos >= 2) {
        hapi_extractor_keep_heap(1ull << 30); /* timed as the daemon runs, at its default mem= */
        status = cmd_time(pos[0], pos + 1, npos - 1, &o);
    } else if (!timing && npos >= 3) {
        status = cmd_features(pos[0], pos[1], pos + 2, npos - 2, &o);
    } else {
        fputs(usage, stderr);
        status = 2;
    }
    free(pos);
    return status;
}

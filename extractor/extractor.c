/* extractor.c — a mount's feature source: the model, its metadata, the split and the preprocessing. */
#include "extractor.h"

#include <ctype.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>
#include <xxhash.h>

struct hapi_extractor {
    hapi_model *model;
    hapi_model_meta meta;
    hapi_preprocess preprocess;
    int split;              /* stages [0, split) run */
    int freeze;             /* stages [0, freeze) are frozen; split <= freeze */
    int dtype;
    hapi_stage_info output; /* stage split - 1 */
    size_t sample_bytes;
    uint8_t digest[16];     /* XXH3-128 of the model file, canonical (big-endian) bytes */
    hapi_calibration calibration; /* of an int8 model */
};

/*
 * The format of hapifs.json and the versions this code reads: 1, and 2, which adds
 * "interpolation" (required there; version 1 is bilinear).
 */
#define HAPI_META_FORMAT "hapifs-staged"
#define HAPI_META_VERSION_MIN 1
#define HAPI_META_VERSION 2
/* Beyond this, an input size is a typo, not a model. */
#define HAPI_META_MAX_SIZE 8192

int hapi_file_digest(const char *path, uint8_t digest[16], hapi_error *err)
{
    enum { CHUNK = 1 << 20 };
    int rc = 0;
    int fd = -1;
    char *buf = NULL;
    XXH3_state_t *state = NULL;

    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        rc = -errno;
        hapi_error_set(err, rc, "%s: %s", path, strerror(errno));
        goto out;
    }
    buf = malloc(CHUNK);
    state = XXH3_createState();
    if (!buf || !state || XXH3_128bits_reset(state) != XXH_OK) {
        rc = hapi_error_set(err, -ENOMEM, "%s: out of memory for the digest", path);
        goto out;
    }
    for (;;) {
        ssize_t n = read(fd, buf, CHUNK);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            rc = -errno;
            hapi_error_set(err, rc, "%s: %s", path, strerror(errno));
            goto out;
        }
        if (n == 0)
            break;
        XXH3_128bits_update(state, buf, (size_t)n);
    }
    XXH128_canonical_t canonical;
    XXH128_canonicalFromHash(&canonical, XXH3_128bits_digest(state));
    memcpy(digest, canonical.digest, 16);
out:
    XXH3_freeState(state);
    free(buf);
    if (fd >= 0)
        close(fd);
    return rc;
}

/* Reads an integer member in [min, max]; 0 or HAPI_ENOTSTAGED naming the field. */
static int meta_int(json_t *root, const char *key, int min, int max, int *out, hapi_error *err)
{
    json_t *v = json_object_get(root, key);
    if (!json_is_integer(v) || json_integer_value(v) < min || json_integer_value(v) > max)
        return hapi_error_set(err, HAPI_ENOTSTAGED, "hapifs.json: \"%s\" %s (an integer in %d..%d)",
                              key, v ? "is invalid" : "is missing", min, max);
    *out = (int)json_integer_value(v);
    return 0;
}

/* Reads a 3-number array such as "mean"; positive requires every value > 0. */
static int meta_triple(json_t *root, const char *key, int positive, float out[3], hapi_error *err)
{
    json_t *v = json_object_get(root, key);
    if (!json_is_array(v) || json_array_size(v) != 3)
        goto bad;
    for (size_t i = 0; i < 3; i++) {
        json_t *x = json_array_get(v, i);
        if (!json_is_number(x) || (positive && json_number_value(x) <= 0))
            goto bad;
        out[i] = (float)json_number_value(x);
    }
    return 0;
bad:
    return hapi_error_set(err, HAPI_ENOTSTAGED, "hapifs.json: \"%s\" %s (3 %snumbers)", key,
                          v ? "is invalid" : "is missing", positive ? "positive " : "");
}

/*
 * Reads a string member into buf (size bytes with its NUL). An absent or null optional member
 * leaves buf empty; a required one, a member that is not a string, an empty or too long one
 * is HAPI_ENOTSTAGED naming the field.
 */
static int meta_string(json_t *root, const char *key, int required, char *buf, size_t size,
                       hapi_error *err)
{
    json_t *v = json_object_get(root, key);
    buf[0] = '\0';
    if ((!v || json_is_null(v)) && !required) /* absent or null: none */
        return 0;
    const char *text = json_string_value(v);
    if (!text || !*text || strlen(text) >= size)
        return hapi_error_set(err, HAPI_ENOTSTAGED,
                              "hapifs.json: \"%s\" %s (a string of 1..%zu bytes)", key,
                              v ? "is invalid" : "is missing", size - 1);
    strcpy(buf, text);
    return 0;
}

/*
 * The resize filter: version 2 names it, version 1 is bilinear (and may say so, no more), so
 * an archive is never served with a filter other than the one its weights were trained with.
 */
static int meta_interpolation(json_t *root, int version, int *out, hapi_error *err)
{
    json_t *v = json_object_get(root, "interpolation");
    const char *name = json_string_value(v);
    int interpolation = version == 1 && !v ? HAPI_INTERP_BILINEAR : hapi_interpolation_parse(name);
    if (version == 1 && interpolation != HAPI_INTERP_BILINEAR)
        return hapi_error_set(err, HAPI_ENOTSTAGED,
                              "hapifs.json: version 1 resizes bilinearly; \"interpolation\" "
                              "\"%s\" needs version 2", name ? name : "(not a string)");
    if (interpolation < 0)
        return hapi_error_set(err, HAPI_ENOTSTAGED,
                              "hapifs.json: \"interpolation\" %s%s%s (bilinear or bicubic)",
                              !v ? "is missing" : name ? "\"" : "is not a string",
                              name ? name : "", name ? "\" is unknown" : "");
    *out = interpolation;
    return 0;
}

/*
 * Parses the archive's hapifs.json into meta and checks it against the model: the stage list
 * must name the archive's children in order, so a split by name means what the user read.
 */
static int parse_meta(const char *text, hapi_model *model, hapi_model_meta *meta, hapi_error *err)
{
    int rc = 0;
    json_error_t jerr;
    json_t *root = json_loads(text, 0, &jerr);
    if (!json_is_object(root)) {
        rc = hapi_error_set(err, HAPI_ENOTSTAGED, "hapifs.json: %s",
                            root ? "not a JSON object" : jerr.text);
        goto out;
    }
    memset(meta, 0, sizeof(*meta));

    const char *format = json_string_value(json_object_get(root, "format"));
    if (!format || strcmp(format, HAPI_META_FORMAT) != 0) {
        rc = hapi_error_set(err, HAPI_ENOTSTAGED, "hapifs.json: \"format\" is not \"%s\"",
                            HAPI_META_FORMAT);
        goto out;
    }
    json_t *version = json_object_get(root, "version");
    if (!json_is_integer(version) || json_integer_value(version) < HAPI_META_VERSION_MIN ||
        json_integer_value(version) > HAPI_META_VERSION) {
        char found[32] = "missing";
        if (json_is_integer(version))
            snprintf(found, sizeof(found), "%lld", (long long)json_integer_value(version));
        else if (version)
            snprintf(found, sizeof(found), "not an integer");
        rc = hapi_error_set(err, HAPI_ENOTSTAGED,
                            "hapifs.json: version %s, this hapifs reads versions %d..%d", found,
                            HAPI_META_VERSION_MIN, HAPI_META_VERSION);
        goto out;
    }
    meta->version = (int)json_integer_value(version);
    if ((rc = meta_string(root, "arch", 1, meta->arch, sizeof(meta->arch), err)) < 0 ||
        (rc = meta_interpolation(root, meta->version, &meta->interpolation, err)) < 0 ||
        (rc = meta_string(root, "weights", 0, meta->weights, sizeof(meta->weights), err)) < 0 ||
        (rc = meta_string(root, "weights_enum", 0, meta->weights_enum,
                          sizeof(meta->weights_enum), err)) < 0 ||
        (rc = meta_int(root, "input_size", 1, HAPI_META_MAX_SIZE, &meta->input_size, err)) < 0 ||
        (rc = meta_int(root, "resize_size", meta->input_size, HAPI_META_MAX_SIZE,
                       &meta->resize_size, err)) < 0 ||
        (rc = meta_triple(root, "mean", 0, meta->mean, err)) < 0 ||
        (rc = meta_triple(root, "std", 1, meta->std, err)) < 0)
        goto out;

    int num_stages = hapi_model_num_stages(model);
    json_t *stages = json_object_get(root, "stages");
    if (!json_is_array(stages) || (int)json_array_size(stages) != num_stages) {
        rc = hapi_error_set(err, HAPI_ENOTSTAGED,
                            "hapifs.json: \"stages\" must list the archive's %d stages",
                            num_stages);
        goto out;
    }
    for (int i = 0; i < num_stages; i++) {
        hapi_stage_info info;
        const char *name = json_string_value(json_array_get(stages, (size_t)i));
        hapi_model_stage(model, i, &info);
        if (!name || strcmp(name, info.name) != 0) {
            rc = hapi_error_set(err, HAPI_ENOTSTAGED,
                                "hapifs.json: stage %d is \"%s\" but the archive's is \"%s\"", i,
                                name ? name : "(not a string)", info.name);
            goto out;
        }
    }
    rc = meta_int(root, "freeze", 1, num_stages, &meta->freeze, err);
out:
    json_decref(root);
    return rc;
}

const char *hapi_precision_name(int precision)
{
    return precision == HAPI_PRECISION_BF16 ? "bf16" : precision == HAPI_PRECISION_INT8 ? "int8"
                                                                                  : "fp32";
}

void hapi_model_append_fp32_stages(const hapi_model *m, int from, int to, char *buf,
                                   size_t size)
{
    const char *sep = " fp32_stages=";
    for (int i = from; i < to; i++) {
        hapi_stage_info info;
        size_t len = strlen(buf);
        if (hapi_model_stage(m, i, &info) == 0 && info.precision == HAPI_PRECISION_FP32 &&
            info.check_cosine != 0.0 && len < size) {
            snprintf(buf + len, size - len, "%s%d", sep, i);
            sep = ",";
        }
    }
}

/* ------------------------------------------------------------ calibration */

enum { CALIB_MAX_DEPTH = 16, CALIB_MAX_BYTES = 64 << 20 };

/* Reads path whole (a regular file of up to CALIB_MAX_BYTES) into *data (malloc'd); its size,
   or -1. */
static ssize_t read_whole(const char *path, char **data)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    struct stat st;
    size_t size = 0;
    *data = NULL;
    if (fd < 0)
        return -1;
    int ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0 &&
             st.st_size <= CALIB_MAX_BYTES &&
             hapi_read_all(fd, (size_t)st.st_size, data, &size) == 0 &&
             size == (size_t)st.st_size; /* not one that changed while read */
    close(fd);
    if (!ok) {
        free(*data);
        *data = NULL;
    }
    return ok ? (ssize_t)size : -1;
}

static int calib_filter(const struct dirent *d) { return d->d_name[0] != '.'; }

/*
 * Preprocesses the images under dir in name order, depth first (entries sorted, hidden ones
 * skipped, files that do not decode passed over), into out until c->images reaches want.
 */
static void calib_walk(const char *dir, int depth, hapi_decoder *dec, const hapi_preprocess *pp,
                       size_t sample, float *out, int want, hapi_calibration *c)
{
    struct dirent **names = NULL;
    int n = scandir(dir, &names, calib_filter, alphasort);
    for (int i = 0; i < n; i++) {
        char path[PATH_MAX];
        if (c->images < want &&
            snprintf(path, sizeof(path), "%s/%s", dir, names[i]->d_name) < (int)sizeof(path)) {
            struct stat st;
            if (lstat(path, &st) == 0 && S_ISDIR(st.st_mode) && depth < CALIB_MAX_DEPTH) {
                calib_walk(path, depth + 1, dec, pp, sample, out, want, c);
            } else if (S_ISREG(st.st_mode) && hapi_image_name_is_image(names[i]->d_name)) {
                char *data;
                ssize_t size = read_whole(path, &data);
                hapi_error err = { 0 };
                if (size > 0 && hapi_image_load(dec, data, (size_t)size, pp,
                                                out + (size_t)c->images * sample, &err) == 0)
                    c->images++;
                free(data);
            }
        }
        free(names[i]);
    }
    free(names);
}

/* Seeded image-like samples (a coarse random grid of 16x16 blocks with a little fine noise, in
   a normalized photo's range), for a source without images. */
static void calib_synthetic(float *out, int count, int channels, int side)
{
    uint64_t s = 20261207;
    for (int k = 0; k < count; k++)
        for (int ch = 0; ch < channels; ch++) {
            float coarse[64][64];
            for (int y = 0; y < 64; y++)
                for (int x = 0; x < 64; x++) {
                    s = s * 6364136223846793005ull + 1442695040888963407ull;
                    coarse[y][x] = (float)((double)(s >> 11) / 9007199254740992.0) * 4.0f - 2.0f;
                }
            for (int y = 0; y < side; y++)
                for (int x = 0; x < side; x++) {
                    s = s * 6364136223846793005ull + 1442695040888963407ull;
                    float fine = (float)((double)(s >> 11) / 9007199254740992.0) * 0.2f - 0.1f;
                    *out++ = coarse[(y / 16) % 64][(x / 16) % 64] + fine;
                }
        }
}

/* An int8 model's calibration: the first images under cfg->calibrate_dir, or seeded samples. */
static int calibrate(hapi_extractor *ex, const char *dir, double min_cosine, hapi_error *err)
{
    hapi_calibration *c = &ex->calibration;
    size_t side = (size_t)ex->meta.input_size, sample = 3 * side * side;
    float *samples = malloc(HAPI_INT8_CALIBRATION_IMAGES * sample * sizeof(float));
    hapi_decoder *dec = NULL;
    if (!samples)
        return hapi_error_set(err, -ENOMEM, "out of memory for the calibration samples");
    memset(c, 0, sizeof(*c));
    if (dir && *dir && hapi_decoder_new(&dec) == 0) {
        calib_walk(dir, 0, dec, &ex->preprocess, sample, samples, HAPI_INT8_CALIBRATION_IMAGES,
                   c);
        hapi_decoder_free(dec);
    }
    int n = c->images;
    if (n == 0) {
        n = HAPI_INT8_CALIBRATION_IMAGES;
        calib_synthetic(samples, n, 3, (int)side);
    }
    XXH128_canonical_t canon;
    XXH128_canonicalFromHash(&canon, XXH3_128bits(samples, (size_t)n * sample * sizeof(float)));
    memcpy(c->digest, canon.digest, sizeof(c->digest));
    uint64_t t0 = hapi_now_ns();
    c->min_cosine = min_cosine > 0 ? min_cosine : HAPI_INT8_MIN_COSINE;
    int rc = hapi_model_calibrate(ex->model, samples, n, c->min_cosine, ex->freeze - 1, err);
    c->seconds = (double)(hapi_now_ns() - t0) / 1e9;
    free(samples);
    /* the calibration's activations and the fp32 copy of the weights are free now: give them
       back (hapi_extractor_keep_heap() keeps up to the budget otherwise) */
    malloc_trim(0);
    return rc;
}

const hapi_calibration *hapi_extractor_calibration(const hapi_extractor *ex)
{
    return &ex->calibration;
}

/* Appends the valid split words ("1..N or a, b, c") to buf, for error messages. */
static void describe_stages(hapi_model *model, int limit, char *buf, size_t size)
{
    size_t len = (size_t)snprintf(buf, size, "1..%d or", limit);
    for (int i = 0; i < limit && len < size; i++) {
        hapi_stage_info info;
        hapi_model_stage(model, i, &info);
        len += (size_t)snprintf(buf + len, size - len, "%s %s", i ? "," : "", info.name);
    }
}

/* "N" (1..num_stages) or a stage name (its index + 1); HAPI_EINVAL otherwise. */
static int parse_stage_word(hapi_model *model, const char *what, const char *word, hapi_error *err)
{
    int n = hapi_model_num_stages(model);
    char valid[160];

    if (word && *word && isdigit((unsigned char)word[0])) {
        char *end;
        errno = 0;
        long v = strtol(word, &end, 10);
        if (*end == '\0' && errno == 0 && v >= 1 && v <= n)
            return (int)v;
    } else if (word) {
        for (int i = 0; i < n; i++) {
            hapi_stage_info info;
            hapi_model_stage(model, i, &info);
            if (strcmp(word, info.name) == 0)
                return i + 1;
        }
    }
    describe_stages(model, n, valid, sizeof(valid));
    return hapi_error_set(err, HAPI_EINVAL, "%s '%s': not a stage; valid: %s", what,
                          word ? word : "", valid);
}

int hapi_extractor_parse_split(const hapi_extractor *ex, const char *word, hapi_error *err)
{
    if (!ex)
        return hapi_error_set(err, HAPI_EINVAL, "no extractor");
    return parse_stage_word(ex->model, "split", word, err);
}

void hapi_extractor_keep_heap(uint64_t keep_bytes)
{
    mallopt(M_MMAP_MAX, 0);
    mallopt(M_TRIM_THRESHOLD, keep_bytes > INT_MAX ? INT_MAX : (int)keep_bytes);
    mallopt(M_ARENA_MAX, 1);
}

int hapi_extractor_open(const hapi_extractor_config *cfg, hapi_extractor **out, hapi_error *err)
{
    int rc;
    hapi_extractor *ex = NULL;

    if (!out)
        return hapi_error_set(err, HAPI_EINVAL, "hapi_extractor_open: null out pointer");
    *out = NULL;
    if (!cfg || !cfg->model_path)
        return hapi_error_set(err, HAPI_EINVAL, "hapi_extractor_open: no model path");
    if (cfg->dtype != HAPI_DTYPE_FP32 && cfg->dtype != HAPI_DTYPE_FP16)
        return hapi_error_set(err, HAPI_EINVAL, "dtype %d: not fp16 or fp32", cfg->dtype);
    if (cfg->mode != HAPI_PREPROCESS_EXACT && cfg->mode != HAPI_PREPROCESS_FAST)
        return hapi_error_set(err, HAPI_EINVAL, "preprocess mode %d: not exact or fast", cfg->mode);

    ex = calloc(1, sizeof(*ex));
    if (!ex)
        return hapi_error_set(err, -ENOMEM, "out of memory");

    /* Digest first: an unreadable file is reported as such, before libtorch sees it. */
    if ((rc = hapi_file_digest(cfg->model_path, ex->digest, err)) < 0)
        goto fail;
    hapi_model_options opt = {.device = cfg->device, .threads = cfg->threads, .optimize = 1,
                              .precision = cfg->precision};
    if ((rc = hapi_model_load(cfg->model_path, &opt, &ex->model, err)) < 0)
        goto fail;
    if ((rc = parse_meta(hapi_model_metadata(ex->model), ex->model, &ex->meta, err)) < 0)
        goto fail;

    if (cfg->freeze && *cfg->freeze) {
        if ((rc = parse_stage_word(ex->model, "freeze", cfg->freeze, err)) < 0)
            goto fail;
        ex->freeze = rc;
    } else {
        ex->freeze = ex->meta.freeze;
    }
    /* "auto" is the freeze index until the policy module chooses. */
    if (!cfg->split || !*cfg->split || strcmp(cfg->split, "auto") == 0) {
        ex->split = ex->freeze;
    } else {
        if ((rc = parse_stage_word(ex->model, "split", cfg->split, err)) < 0)
            goto fail;
        ex->split = rc;
    }
    if (ex->split > ex->freeze) {
        char valid[160];
        describe_stages(ex->model, ex->freeze, valid, sizeof(valid));
        rc = hapi_error_set(err, HAPI_EINVAL,
                            "split %d is past the frozen stages (freeze %d); valid: %s",
                            ex->split, ex->freeze, valid);
        goto fail;
    }

    /* Probe last: it runs every stage once, which a bad split need not wait for. */
    if ((rc = hapi_model_probe(ex->model, 3, ex->meta.input_size, ex->meta.input_size, err)) < 0)
        goto fail;
    ex->preprocess = (hapi_preprocess){
        .resize = ex->meta.resize_size,
        .crop = ex->meta.input_size,
        .mode = cfg->mode,
        .max_pixels = cfg->max_pixels,
        .interpolation = ex->meta.interpolation,
    };
    memcpy(ex->preprocess.mean, ex->meta.mean, sizeof(ex->meta.mean));
    memcpy(ex->preprocess.std, ex->meta.std, sizeof(ex->meta.std));
    if (cfg->precision == HAPI_PRECISION_INT8 &&
        (rc = calibrate(ex, cfg->calibrate_dir, cfg->int8_min_cosine, err)) < 0)
        goto fail;
    hapi_model_stage(ex->model, ex->split - 1, &ex->output);
    ex->dtype = cfg->dtype;
    ex->sample_bytes = hapi_extractor_split_bytes(ex, ex->split);
    *out = ex;
    return 0;
fail:
    hapi_extractor_close(ex);
    return rc;
}

void hapi_extractor_close(hapi_extractor *ex)
{
    if (!ex)
        return;
    hapi_model_free(ex->model);
    free(ex);
}

const hapi_model_meta *hapi_extractor_meta(const hapi_extractor *ex) { return &ex->meta; }
hapi_model *hapi_extractor_model(const hapi_extractor *ex) { return ex->model; }
const hapi_preprocess *hapi_extractor_preprocess(const hapi_extractor *ex)
{
    return &ex->preprocess;
}
int hapi_extractor_split(const hapi_extractor *ex) { return ex->split; }
int hapi_extractor_freeze(const hapi_extractor *ex) { return ex->freeze; }
int hapi_extractor_dtype(const hapi_extractor *ex) { return ex->dtype; }
const hapi_stage_info *hapi_extractor_output(const hapi_extractor *ex) { return &ex->output; }
size_t hapi_extractor_sample_bytes(const hapi_extractor *ex) { return ex->sample_bytes; }
size_t hapi_extractor_split_bytes(const hapi_extractor *ex, int split)
{
    hapi_stage_info info;
    if (hapi_model_stage(ex->model, split - 1, &info) < 0 || info.ndim == 0)
        return 0;
    size_t elements = 1;
    for (int d = 0; d < info.ndim; d++)
        elements *= (size_t)info.shape[d];
    return elements * (ex->dtype == HAPI_DTYPE_FP16 ? 2 : 4);
}
const uint8_t *hapi_extractor_model_digest(const hapi_extractor *ex) { return ex->digest; }

int hapi_extractor_compute(hapi_extractor *ex, hapi_decoder *dec, const void *data, size_t size,
                           void *out, hapi_error *err)
{
    /* A buffer per call keeps concurrent callers apart; its cost is small next to inference. */
    size_t crop = (size_t)ex->preprocess.crop;
    float *input = malloc(3 * crop * crop * sizeof(float));
    if (!input)
        return hapi_error_set(err, -ENOMEM, "out of memory for the input tensor");
    int rc = hapi_image_load(dec, data, size, &ex->preprocess, input, err);
    if (rc == 0)
        rc = hapi_model_run(ex->model, ex->split, input, 1, ex->dtype, out, ex->sample_bytes, err);
    free(input);
    return rc;
}

/* ------------------------------------------------------------------ BLAS */

static char blas_name[64] = "unknown";
static pthread_once_t blas_once = PTHREAD_ONCE_INIT;

static void blas_find(void)
{
    Dl_info info;
    void *sym = dlsym(RTLD_DEFAULT, "sgemm_"); /* Fortran BLAS, which libtorch calls */
    char real[PATH_MAX];
    if (!sym || !dladdr(sym, &info) || !info.dli_fname || !realpath(info.dli_fname, real))
        return;
    /* .../x86_64-linux-gnu/openblas-pthread/libblas.so.3: the alternative's directory */
    const char *dir = basename(dirname(real));
    if (strcmp(dir, "blas") == 0)
        dir = "reference";
    else if (strcmp(dir, "x86_64-linux-gnu") == 0 || strcmp(dir, "lib") == 0)
        dir = basename(real); /* a library put in place by hand */
    snprintf(blas_name, sizeof(blas_name), "%s", dir);
}

const char *hapi_model_blas(void)
{
    pthread_once(&blas_once, blas_find);
    return blas_name;
}

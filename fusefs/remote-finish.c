/* remote-finish.c — features=freeze on a compute-side mount: the storage side's model kept and loaded here, and the stages [split, freeze) run on fetched rows, so that a .feat is the freeze point's whatever the storage side's split. */
#include "remote-int.h"
#include "log.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#define FINISH_BATCH 8            /* rows per run of the stages: bounds the activations' memory */
#define MODEL_MAX ((size_t)4 << 30) /* a model archive longer than this is refused */

/*
 * The namespace a .feat of dtype lives in: the model (its digest), its
 * preprocessing, the freeze stage, the dtype, the precision the stages
 * run in here and, where not fp32, the storage side's (with an int8
 * calibration's digest: storage_precision, "" for fp32), not the split. Features
 * reached through different splits share it: they agree within the rounding
 * of the split's dtype (fp32: to 1e-5 relative; fp16: cosine above
 * 0.9999999 on the test models; tests/test-model.c), and a split change on
 * the storage side must not change what a training script reads.
 */
static void finish_ns(const char *digest, const char *preprocess, int freeze, int dtype,
                      int precision, const char *storage_precision, hapi_cache_namespace *ns,
                      char hex[33])
{
    char text[4096]; /* the preprocessing's JSON is a few hundred bytes */
    int n = snprintf(text, sizeof(text),
                     "hapifs-finish/1 model=%s freeze=%d dtype=%d precision=%d preprocess=%s%s",
                     digest, freeze, dtype, precision, preprocess, storage_precision);
    XXH128_hash_t h = XXH3_128bits(text, n < (int)sizeof(text) ? (size_t)n : sizeof(text) - 1);
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, h);
    memcpy(ns->bytes, c.digest, sizeof(ns->bytes));
    hapi_hex(ns->bytes, sizeof(ns->bytes), hex);
}

/*
 * Copies the storage side's model archive (in, closed) to out (path names it
 * in messages) and checks its XXH3-128 against digest (hex). Returns 0 or
 * < 0 with why in err.
 */
static int copy_model(int in, int out, const char *path, const char *digest, hapi_error *err)
{
    XXH3_state_t *st = XXH3_createState();
    char *buf = malloc(1 << 20);
    int rc = !st || !buf || XXH3_128bits_reset(st) != XXH_OK
                 ? hapi_error_set(err, -ENOMEM, "out of memory")
                 : 0;
    size_t total = 0;
    for (off_t off = 0; rc == 0;) {
        ssize_t n = hapi_remote_pread_all(in, buf, 1 << 20, off);
        if (n < 0) {
            rc = hapi_error_set(err, (int)n, "cannot read the storage side's .hapifs/model: %s",
                                hapi_strerror((int)n));
            break;
        }
        if (n == 0)
            break;
        if ((total += (size_t)n) > MODEL_MAX) {
            rc = hapi_error_set(err, -EFBIG, "the storage side's model is over %zu bytes",
                                MODEL_MAX);
            break;
        }
        XXH3_128bits_update(st, buf, (size_t)n);
        errno = 0; /* a short write sets none: the disk is full */
        if (write(out, buf, (size_t)n) != n) {
            int e = errno ? errno : ENOSPC;
            rc = hapi_error_set(err, -e, "%s: %s", path, strerror(e));
        }
        off += n;
    }
    if (rc == 0) {
        XXH128_canonical_t c;
        char got[33];
        XXH128_canonicalFromHash(&c, XXH3_128bits_digest(st));
        hapi_hex(c.digest, sizeof(c.digest), got);
        if (strcmp(got, digest) != 0)
            rc = hapi_error_set(err, HAPI_ECORRUPT, "the storage side's model has digest %s, "
                                "its config says %s", got, digest);
    }
    free(buf);
    XXH3_freeState(st);
    close(in);
    return rc;
}

/* Opens the storage side's .hapifs/model. Returns the descriptor or < 0 with err. */
static int open_storage_model(hapi_remote *r, hapi_error *err)
{
    int fd = hapi_remote_open_storage_file(r, "model");
    if (fd < 0)
        return hapi_error_set(err, fd, "cannot open the storage side's .hapifs/model: %s",
                              hapi_strerror(fd));
    return fd;
}

/*
 * Keeps the storage side's model at path, through a temporary file renamed
 * into place. Returns 0 or < 0 with why in err.
 */
static int keep_model(hapi_remote *r, const char *path, const char *digest, hapi_error *err)
{
    char tmp[PATH_MAX + 96];
    snprintf(tmp, sizeof(tmp), "%s.%d.tmp", path, (int)getpid());
    int in = open_storage_model(r, err);
    if (in < 0)
        return in;
    int out = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (out < 0) {
        int e = errno;
        close(in);
        return hapi_error_set(err, -e, "%s: %s", tmp, strerror(e));
    }
    int rc = copy_model(in, out, tmp, digest, err);
    if (close(out) < 0 && rc == 0)
        rc = hapi_error_set(err, -errno, "%s: %s", tmp, strerror(errno));
    if (rc == 0 && rename(tmp, path) < 0)
        rc = hapi_error_set(err, -errno, "%s: %s", path, strerror(errno));
    if (rc < 0)
        unlink(tmp);
    return rc;
}

/* Whether a keep_model() failure is the cache directory's (no room, read-only, not ours). */
static int cache_dir_refused(int rc)
{
    return rc == -ENOSPC || rc == -EDQUOT || rc == -EROFS || rc == -EACCES || rc == -EPERM;
}

/*
 * The storage side's model in memory (a memfd) for a cache directory that
 * cannot keep it: loaded from there at every mount. Returns the descriptor
 * (the caller closes it once the model is loaded) or < 0 with err.
 */
static int model_in_memory(hapi_remote *r, const char *digest, hapi_error *err)
{
    int out = memfd_create("hapifs-model", MFD_CLOEXEC);
    if (out < 0)
        return hapi_error_set(err, -errno, "memfd_create: %s", strerror(errno));
    int in = open_storage_model(r, err);
    int rc = in < 0 ? in : copy_model(in, out, "the model's copy in memory", digest, err);
    if (rc < 0) {
        close(out);
        return rc;
    }
    return out;
}

/* Sets fin's .feat headers and row bytes from its freeze shape. Returns 0 or < 0 with err. */
static int finish_shape(struct finish *fin, hapi_error *err)
{
    size_t elems = 1;
    for (int i = 0; i < fin->ndim; i++)
        elems *= (size_t)fin->shape[i];
    for (int d = 0; d < 2; d++) {
        int hl = hapi_npy_header(fin->header[d], d ? HAPI_DTYPE_FP16 : HAPI_DTYPE_FP32,
                                 fin->shape, fin->ndim);
        if (hl < 0)
            return hapi_error_set(err, HAPI_ECORRUPT, "no .npy header for the freeze stage's "
                                  "shape");
        fin->header_len[d] = (size_t)hl;
        fin->row_bytes[d] = elems * (d ? 2 : 4);
    }
    return 0;
}

/*
 * Loads the storage side's model (kept in the cache directory by digest, or
 * in memory where that directory cannot keep it) and probes it into
 * fin->model; with shape_known, its freeze stage must have fin's shape, else
 * it sets it. Returns 0 or < 0 with err.
 */
static int model_open(struct finish *fin, int shape_known, hapi_error *err)
{
    hapi_remote *r = fin->r;
    char path[PATH_MAX + 64];
    snprintf(path, sizeof(path), "%s/model-%s.pt", fin->model_dir, fin->digest);
    struct stat st;
    int mem = -1, rc;
    /* else kept from an earlier mount: the digest names it */
    if (stat(path, &st) < 0 && (rc = keep_model(r, path, fin->digest, err)) < 0) {
        if (!cache_dir_refused(rc))
            return rc;
        hapi_log(HAPI_LOG_WARNING, "features=freeze: the cache directory cannot keep the model "
                 "(%s): loaded from memory, and fetched again at every mount", err->message);
        if ((mem = model_in_memory(r, fin->digest, err)) < 0)
            return mem;
        snprintf(path, sizeof(path), "/proc/self/fd/%d", mem);
    }
    hapi_model_options mo = { .device = "cpu", .precision = r->cfg.precision,
                              .threads = r->cfg.torch_threads };
    hapi_model *m = NULL;
    rc = hapi_model_load(path, &mo, &m, err);
    if (mem >= 0)
        close(mem); /* the weights are libtorch's now */
    hapi_stage_info info;
    if (rc == 0 && (rc = hapi_model_probe(m, 3, fin->crop, fin->crop, err)) == 0 &&
        (fin->freeze > hapi_model_num_stages(m) ||
         hapi_model_stage(m, fin->freeze - 1, &info) < 0))
        rc = hapi_error_set(err, HAPI_ECORRUPT, "freeze stage %d of a model of %d stages",
                            fin->freeze, hapi_model_num_stages(m));
    if (rc == 0 && shape_known &&
        (info.ndim != fin->ndim ||
         memcmp(info.shape, fin->shape, (size_t)info.ndim * sizeof(int64_t)) != 0))
        rc = hapi_error_set(err, HAPI_ECORRUPT, "the model's freeze stage is not of the shape "
                            "the storage side's config gives");
    if (rc < 0) {
        hapi_model_free(m);
        return rc;
    }
    if (!shape_known) {
        fin->ndim = info.ndim;
        memcpy(fin->shape, info.shape, sizeof(fin->shape));
    }
    fin->model = m;
    return 0;
}

/* Records why the model cannot be used (fin->lock held or at open), once, where operators see it. */
static void model_failed(struct finish *fin, int rc, const char *message)
{
    fin->load_code = rc;
    snprintf(fin->load_why, sizeof(fin->load_why), "features=freeze: %.480s", message);
    hapi_log(HAPI_LOG_ERROR, "%s: .feat files of splits before the freeze point are not served",
             fin->load_why);
    hapi_error_ring_add(fin->r->cfg.errors, ".hapifs/model", rc, fin->load_why);
}

/*
 * Sets up fin from the storage side's config (JSON text): the model's
 * digest, freeze stage and crop, the freeze stage's shape and the
 * namespaces. The model is loaded now when the config's split is before the
 * freeze stage (its shape is needed), else when an index needs it. Returns 0
 * or < 0 with err.
 */
static int finish_load(struct finish *fin, const char *config, const char *model_dir,
                       hapi_error *err)
{
    json_error_t je;
    json_t *j = json_loads(config, 0, &je);
    const char *digest = json_string_value(json_object_get(json_object_get(j, "model"), "digest"));
    json_t *split = json_object_get(j, "split"), *pp = json_object_get(j, "preprocess");
    json_t *freeze = json_object_get(split, "freeze"), *crop = json_object_get(pp, "crop");
    json_t *index = json_object_get(split, "index"), *shape = json_object_get(split, "shape");
    char *pp_text = pp ? json_dumps(pp, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    /* the storage side's arithmetic changes the rows it sends: bf16, int8 and its samples */
    json_t *model = json_object_get(j, "model");
    const char *sp = json_string_value(json_object_get(model, "precision"));
    const char *cal = json_string_value(json_object_get(json_object_get(model,
                                                                        "int8_calibration"),
                                                        "digest"));
    char storage_precision[96] = "";
    if (sp && strcmp(sp, "fp32") != 0)
        snprintf(storage_precision, sizeof(storage_precision), " storage_precision=%.8s%s%.32s",
                 sp, cal ? ":" : "", cal ? cal : "");
    int rc = 0;
    if (!digest || strlen(digest) != 32 || strspn(digest, "0123456789abcdef") != 32 ||
        !json_is_integer(freeze) || json_integer_value(freeze) < 1 ||
        json_integer_value(freeze) > 1024 || !json_is_integer(crop) ||
        json_integer_value(crop) < 1 || json_integer_value(crop) > 65536 || !pp_text) {
        rc = hapi_error_set(err, HAPI_ECORRUPT, "the storage side's config names no model "
                            "digest, freeze stage or crop");
        goto out;
    }
    memcpy(fin->digest, digest, sizeof(fin->digest));
    if (!(fin->model_dir = strdup(model_dir))) {
        rc = hapi_error_set(err, -ENOMEM, "out of memory");
        goto out;
    }
    fin->freeze = (int)json_integer_value(freeze);
    fin->crop = (int)json_integer_value(crop);
    /* at the freeze point, the config gives its shape: no model is needed yet */
    int at_freeze = json_is_integer(index) && json_integer_value(index) == fin->freeze &&
                    json_is_array(shape) && json_array_size(shape) >= 1 &&
                    json_array_size(shape) <= HAPI_MAX_DIMS;
    for (size_t i = 0; at_freeze && i < json_array_size(shape); i++) {
        json_t *v = json_array_get(shape, i);
        at_freeze = json_is_integer(v) && json_integer_value(v) >= 1;
        fin->shape[i] = at_freeze ? json_integer_value(v) : 0;
    }
    fin->ndim = at_freeze ? (int)json_array_size(shape) : 0;
    if (!at_freeze && (rc = model_open(fin, 0, err)) < 0)
        goto out;
    if ((rc = finish_shape(fin, err)) < 0)
        goto out;
    for (int d = 0; d < 2; d++)
        finish_ns(digest, pp_text, fin->freeze, d ? HAPI_DTYPE_FP16 : HAPI_DTYPE_FP32,
                  fin->r->cfg.precision, storage_precision, &fin->ns[d], fin->ns_hex[d]);
out:
    free(pp_text);
    json_decref(j);
    return rc;
}

/*
 * Sets up features=freeze from the first checked source's config: the model
 * (copied into model_dir once), its freeze stage's shape, the namespaces. A
 * model that cannot be used is logged and kept as why (every index is then
 * refused: .feat reads fail with EIO); only -ENOMEM fails the open.
 */
int hapi_remote__finish_open(hapi_remote *r, const char *model_dir)
{
    struct finish *fin = calloc(1, sizeof(*fin));
    if (!fin)
        return -ENOMEM;
    atomic_init(&fin->rows, 0);
    fin->r = r;
    pthread_mutex_init(&fin->lock, NULL);
    const char *config = NULL;
    for (size_t i = 0; i < r->nsources && !config; i++)
        if (atomic_load(&r->sources[i].checked))
            config = r->sources[i].config;
    hapi_error err = { 0 };
    int rc = config ? finish_load(fin, config, model_dir, &err)
                    : hapi_error_set(&err, -EIO, "no source serves its config");
    if (rc == -ENOMEM) {
        hapi_remote__finish_close(fin);
        return rc;
    }
    if (rc < 0) {
        fin->code = rc;
        snprintf(fin->why, sizeof(fin->why), "features=freeze: %.480s", err.message);
        hapi_log(HAPI_LOG_ERROR, "%s: .feat files are not served", fin->why);
        hapi_error_ring_add(r->cfg.errors, ".hapifs/model", rc, fin->why);
    } else {
        hapi_log(HAPI_LOG_INFO, "features=freeze: stages [split, %d) of the storage side's model "
                 "run here (%s); features in namespace %.12s", fin->freeze,
                 fin->model ? "loaded" : "loaded when a split before it is served",
                 fin->ns_hex[0]);
    }
    r->finish = fin;
    return 0;
}

void hapi_remote__finish_close(struct finish *fin)
{
    if (!fin)
        return;
    hapi_model_free(fin->model);
    pthread_mutex_destroy(&fin->lock);
    free(fin->model_dir);
    free(fin);
}

/*
 * Makes x's .feat the freeze stage's output (its namespace, shape, header,
 * bytes), finished here when the storage side's split is before it. Refused
 * (HAPI_EINVAL, err) when the model could not be used, the index names no
 * split, or its split is past the freeze stage (the features cannot be taken
 * back to it).
 */
int hapi_remote__finish_keep(struct finish *fin, struct dir_index *x, hapi_error *err)
{
    if (fin->code < 0)
        return hapi_error_set(err, fin->code, "%s", fin->why);
    if (x->split < 1 || x->split > fin->freeze)
        return hapi_error_set(err, HAPI_EINVAL, "features=freeze: the storage side's split %d is "
                              "past its freeze stage %d", x->split, fin->freeze);
    hapi_stage_info info = { 0 };
    if (x->split == fin->freeze) { /* the rows are the .feat files' */
        info.ndim = fin->ndim;
        memcpy(info.shape, fin->shape, sizeof(info.shape));
    } else {
        pthread_mutex_lock(&fin->lock);
        if (!fin->model && fin->load_code == 0) {
            hapi_error lerr = { 0 };
            int rc = model_open(fin, 1, &lerr);
            if (rc < 0)
                model_failed(fin, rc, lerr.message);
            else
                hapi_log(HAPI_LOG_INFO, "features=freeze: the storage side's model loaded for "
                         "split %d", x->split);
        }
        int rc = fin->load_code;
        if (rc < 0)
            hapi_error_set(err, rc, "%s", fin->load_why);
        else
            hapi_model_stage(fin->model, x->split - 1, &info);
        pthread_mutex_unlock(&fin->lock);
        if (rc < 0)
            return rc;
    }
    if (info.ndim != x->pack_ndim ||
        memcmp(info.shape, x->pack_shape, (size_t)info.ndim * sizeof(int64_t)) != 0)
        return hapi_error_set(err, HAPI_ECORRUPT, "features=freeze: the pack's rows are not "
                              "the output of stage %d of this model", x->split);
    int d = x->dtype == HAPI_DTYPE_FP16;
    x->finish = x->split < fin->freeze;
    x->ns = fin->ns[d];
    memcpy(x->ns_hex, fin->ns_hex[d], sizeof(x->ns_hex));
    x->ndim = fin->ndim;
    memcpy(x->shape, fin->shape, sizeof(x->shape));
    memcpy(x->header, fin->header[d], fin->header_len[d]);
    x->header_len = fin->header_len[d];
    x->row_bytes = fin->row_bytes[d];
    return 0;
}

/*
 * Runs the stages [x->split, freeze) on n pack rows of x (in: the pack's
 * rows; out: room for n .feat rows), a few at a time. Returns 0, or
 * HAPI_EOOM, HAPI_EMODEL... with why in err.
 */
int hapi_remote__finish_rows(hapi_remote *r, const struct dir_index *x, const char *in, size_t n,
                             char *out, hapi_error *err)
{
    struct finish *fin = r->finish;
    for (size_t i = 0; i < n; i += FINISH_BATCH) {
        size_t k = n - i < FINISH_BATCH ? n - i : FINISH_BATCH;
        int rc = hapi_model_run_range(fin->model, x->split, fin->freeze,
                                      in + i * x->pack_row_bytes, x->dtype, (int)k, x->dtype,
                                      out + i * x->row_bytes, k * x->row_bytes, err);
        if (rc < 0) {
            char why[sizeof(err->message)];
            snprintf(why, sizeof(why), "%s", err->message);
            return hapi_error_set(err, rc, "stages [%d, %d) of the storage side's model: %s",
                                  x->split, fin->freeze, why);
        }
        atomic_fetch_add(&fin->rows, k);
    }
    return 0;
}

void hapi_remote_features_get(hapi_remote *r, hapi_remote_features *out)
{
    memset(out, 0, sizeof(*out));
    struct finish *fin = r->finish;
    if (!fin)
        return;
    _Static_assert(sizeof(out->shape) == sizeof(fin->shape), "HAPI_MAX_DIMS");
    out->finish = 1;
    out->usable = fin->code == 0;
    snprintf(out->why, sizeof(out->why), "%s", fin->why);
    /* busy: the model is being loaded (seconds): a config read does not wait for it */
    if (fin->code == 0 && pthread_mutex_trylock(&fin->lock) == 0) {
        out->usable = fin->load_code == 0;
        snprintf(out->why, sizeof(out->why), "%s", fin->load_why);
        out->loaded = fin->model != NULL;
        pthread_mutex_unlock(&fin->lock);
    }
    out->freeze = fin->freeze;
    out->ndim = fin->ndim;
    memcpy(out->shape, fin->shape, sizeof(out->shape));
    memcpy(out->ns_hex, fin->ns_hex, sizeof(out->ns_hex));
    for (int d = 0; d < 2; d++)
        out->feat_size[d] = fin->header_len[d] + fin->row_bytes[d];
    out->rows = atomic_load(&fin->rows);
}

/* view.c — what a .feat is at one split (namespace, .npy header, size) and the holder of the current view. */
#include "view.h"
#include "cache.h"
#include "extractor.h"
#include "hapi.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct hapi_views {
    hapi_extractor *ex;
    int dtype;
    char ns_desc[256];          /* the preprocessing part of every namespace */
    atomic_uint_fast64_t serial;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    hapi_view *current;         /* NULL until the policy has chosen the split */
    int stopping;               /* no view will come: waiters get NULL */
};

void hapi_views_namespace(const hapi_views *vs, int split, hapi_cache_namespace *ns)
{
    /* and the stages before the split that a bf16 model's check moved to fp32 */
    char desc[sizeof(vs->ns_desc) + 128];
    snprintf(desc, sizeof(desc), "%s", vs->ns_desc);
    hapi_model_append_fp32_stages(hapi_extractor_model(vs->ex), 0, split, desc, sizeof(desc));
    hapi_cache_namespace_make(hapi_extractor_model_digest(vs->ex), split, vs->dtype, desc, ns);
}

int hapi_views_new(hapi_extractor *ex, int dtype, int precision, hapi_views **out,
                   hapi_error *err)
{
    *out = NULL;
    /* The split asked for must make an .npy before the mount is promised. */
    const hapi_stage_info *o = hapi_extractor_output(ex);
    char header[HAPI_NPY_HEADER_MAX];
    int rc = hapi_npy_header(header, dtype, o->shape, o->ndim);
    if (rc < 0)
        return hapi_error_set(err, rc, "cannot describe the output of stage %s as .npy", o->name);
    hapi_views *vs = calloc(1, sizeof(*vs));
    if (!vs)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    vs->ex = ex;
    vs->dtype = dtype;
    /* A namespace covers everything that changes the bytes of a feature: this and the split. */
    const hapi_preprocess *pp = hapi_extractor_preprocess(ex);
    snprintf(vs->ns_desc, sizeof(vs->ns_desc),
             "mode=%d resize=%d crop=%d mean=%.9g,%.9g,%.9g std=%.9g,%.9g,%.9g", pp->mode,
             pp->resize, pp->crop, pp->mean[0], pp->mean[1], pp->mean[2], pp->std[0], pp->std[1],
             pp->std[2]);
    /* bf16 features differ from fp32 ones in their last digits: a namespace of their own. The
       fp32 description stays as it was, so existing caches keep their features. */
    if (precision == HAPI_PRECISION_BF16)
        strncat(vs->ns_desc, " precision=bf16", sizeof(vs->ns_desc) - strlen(vs->ns_desc) - 1);
    /* int8 features depend on the calibration's samples too: their digest names them */
    if (precision == HAPI_PRECISION_INT8) {
        char hex[33];
        size_t len = strlen(vs->ns_desc);
        hapi_hex(hapi_extractor_calibration(ex)->digest, 16, hex);
        snprintf(vs->ns_desc + len, sizeof(vs->ns_desc) - len, " precision=int8 calibration=%s",
                 hex);
    }
    /* The model digest covers hapifs.json, which names the filter; the namespace says so too,
       so that it never rests on how the digest is taken. Bilinear keeps its old description. */
    if (pp->interpolation != HAPI_INTERP_BILINEAR) {
        size_t len = strlen(vs->ns_desc);
        snprintf(vs->ns_desc + len, sizeof(vs->ns_desc) - len, " interpolation=%s",
                 hapi_interpolation_name(pp->interpolation));
    }
    pthread_mutex_init(&vs->lock, NULL);
    pthread_cond_init(&vs->cond, NULL);
    *out = vs;
    return 0;
}

void hapi_views_free(hapi_views *vs)
{
    if (!vs)
        return;
    hapi_view_put(vs->current);
    pthread_mutex_destroy(&vs->lock);
    pthread_cond_destroy(&vs->cond);
    free(vs);
}

int hapi_view_new(hapi_views *vs, int split, hapi_view **out, hapi_error *err)
{
    hapi_view *v = calloc(1, sizeof(*v));
    *out = NULL;
    if (!v)
        return hapi_error_set(err, -ENOMEM, "out of memory");
    atomic_init(&v->refs, 1);
    v->serial = atomic_fetch_add(&vs->serial, 1) + 1;
    v->split = split;
    v->dtype = vs->dtype;
    if (hapi_model_stage(hapi_extractor_model(vs->ex), split - 1, &v->output) < 0) {
        free(v);
        return hapi_error_set(err, HAPI_EINVAL, "no stage %d", split);
    }
    hapi_views_namespace(vs, split, &v->ns);
    hapi_cache_namespace_hex(&v->ns, v->ns_hex);
    int rc = hapi_npy_header(v->npy_header, vs->dtype, v->output.shape, v->output.ndim);
    if (rc < 0) {
        free(v);
        return hapi_error_set(err, rc, "cannot describe the output of stage %s as .npy",
                              v->output.name);
    }
    v->npy_header_len = (size_t)rc;
    v->sample_bytes = hapi_extractor_split_bytes(vs->ex, split);
    v->feat_size = v->npy_header_len + v->sample_bytes;
    *out = v;
    return 0;
}

void hapi_view_ref(hapi_view *v)
{
    atomic_fetch_add(&v->refs, 1);
}

void hapi_view_put(hapi_view *v)
{
    if (!v || atomic_fetch_sub(&v->refs, 1) != 1)
        return;
    hapi_batcher_free(v->batcher);
    free(v->batcher_ctx);
    free(v);
}

hapi_view *hapi_views_peek(hapi_views *vs)
{
    pthread_mutex_lock(&vs->lock);
    hapi_view *v = vs->current;
    if (v)
        hapi_view_ref(v);
    pthread_mutex_unlock(&vs->lock);
    return v;
}

hapi_view *hapi_views_get(hapi_views *vs)
{
    pthread_mutex_lock(&vs->lock);
    while (!vs->current && !vs->stopping)
        pthread_cond_wait(&vs->cond, &vs->lock);
    hapi_view *v = vs->current;
    if (v)
        hapi_view_ref(v);
    pthread_mutex_unlock(&vs->lock);
    return v;
}

hapi_view *hapi_views_swap(hapi_views *vs, hapi_view *v)
{
    pthread_mutex_lock(&vs->lock);
    hapi_view *old = vs->current;
    vs->current = v;
    if (!v)
        vs->stopping = 1; /* nothing to serve: readers get an error, not a wait */
    pthread_cond_broadcast(&vs->cond);
    pthread_mutex_unlock(&vs->lock);
    return old;
}

void hapi_views_stop(hapi_views *vs)
{
    pthread_mutex_lock(&vs->lock);
    vs->stopping = 1;
    pthread_cond_broadcast(&vs->cond);
    pthread_mutex_unlock(&vs->lock);
}

ssize_t hapi_feat_split_read(const char *header, size_t header_len, uint64_t feat_size,
                             char *buf, size_t size, off_t off, size_t *dpos, size_t *dend)
{
    if (off < 0 || (uint64_t)off >= feat_size)
        return -1;
    size_t pos = (size_t)off, hdr = header_len;
    size_t end = size < feat_size - pos ? pos + size : (size_t)feat_size;
    size_t n = 0;
    if (pos < hdr) {
        size_t stop = end < hdr ? end : hdr;
        memcpy(buf, header + pos, stop - pos);
        n = stop - pos;
    }
    /* The data part of the read, as offsets into the features. */
    *dpos = (pos > hdr ? pos : hdr) - hdr;
    *dend = end > hdr ? end - hdr : *dpos;
    return (ssize_t)n;
}

size_t hapi_feat_stem_len(const char *name)
{
    size_t len = strlen(name);
    if (len <= 5 || strcmp(name + len - 5, ".feat") != 0 || len - 5 > NAME_MAX)
        return 0;
    char stem[NAME_MAX + 1];
    memcpy(stem, name, len - 5);
    stem[len - 5] = '\0';
    return hapi_image_name_is_image(stem) ? len - 5 : 0;
}

const unsigned char *hapi_feat_nan(int dtype, size_t *width)
{
    static const unsigned char nan16[2] = { 0x00, 0x7e }, nan32[4] = { 0x00, 0x00, 0xc0, 0x7f };
    *width = dtype == HAPI_DTYPE_FP16 ? 2 : 4;
    return dtype == HAPI_DTYPE_FP16 ? nan16 : nan32;
}

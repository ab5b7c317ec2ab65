/* image.c — decodes JPEG/PNG like PIL's convert("RGB") and preprocesses like torchvision, bit for bit. */
#include "extractor.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <spng.h>
#include <turbojpeg.h>

/*
 * The reference is PIL.Image.open(p).convert("RGB") followed by torchvision's
 * Resize -> CenterCrop -> ToTensor -> Normalize on Pillow 9.4 / torchvision
 * 0.14. Every arithmetic step below mirrors one of theirs (Pillow's
 * Resample.c, Convert.c, Unpack.c, PngImagePlugin.py; torchvision's
 * functional.py), so that the tensors are equal float for float, not merely
 * close. Where a step looks odd (a reciprocal multiply, a rounding offset),
 * that is why.
 */

struct hapi_decoder {
    tjhandle tj;
};

/* libspng refuses chunks and cached metadata over these; image data is bounded by max_pixels. */
#define HAPI_PNG_CHUNK_LIMIT (64u << 20)
#define HAPI_PNG_CACHE_LIMIT (64u << 20)
/* Larger crops are refused as bad parameters: no model takes a 64k-pixel-wide input. */
#define HAPI_MAX_CROP 65536
/* PNG dimensions are 31-bit; keep both sides where int arithmetic stays safe. */
#define HAPI_PNG_MAX_SIDE (1u << 24)

int hapi_decoder_new(hapi_decoder **out)
{
    hapi_decoder *dec;

    *out = NULL;
    dec = calloc(1, sizeof(*dec));
    if (!dec)
        return -ENOMEM;
    dec->tj = tjInitDecompress();
    if (!dec->tj) {
        free(dec);
        /* TurboJPEG fails here only when it cannot allocate its state. */
        return -ENOMEM;
    }
    *out = dec;
    return 0;
}

void hapi_decoder_free(hapi_decoder *dec)
{
    if (!dec)
        return;
    if (dec->tj)
        tjDestroy(dec->tj);
    free(dec);
}

void hapi_image_release(hapi_image *img)
{
    if (!img)
        return;
    free(img->pixels);
    img->pixels = NULL;
    img->width = 0;
    img->height = 0;
}

static int check_pixels(uint64_t width, uint64_t height, uint64_t max_pixels, hapi_error *err)
{
    if (max_pixels && width * height > max_pixels)
        return hapi_error_set(err, HAPI_ETOOBIG,
                              "image is %llux%llu, over the limit of %llu pixels",
                              (unsigned long long)width, (unsigned long long)height,
                              (unsigned long long)max_pixels);
    return 0;
}

/* Allocates width * height * channels bytes, refusing sizes that overflow size_t. */
static uint8_t *alloc_pixels(int width, int height, int channels)
{
    size_t n;

    if (__builtin_mul_overflow((size_t)width, (size_t)height, &n) ||
        __builtin_mul_overflow(n, (size_t)channels, &n))
        return NULL;
    return malloc(n);
}

/* Pillow's MULDIV255: a * b / 255 rounded, without a division. */
static inline int muldiv255(int a, int b)
{
    int t = a * b + 128;
    return ((t >> 8) + t) >> 8;
}

static inline uint8_t clip8_int(int v)
{
    return v <= 0 ? 0 : v >= 255 ? 255 : (uint8_t)v;
}

/*
 * Converts TurboJPEG's CMYK pixels to RGB in place (3 <= 4, so writing pixel
 * i never overwrites an unread byte). Pillow decodes every CMYK/YCCK JPEG
 * with rawmode "CMYK;I": it assumes Adobe's inverted convention and inverts
 * all four bytes, then applies its cmyk2rgb.
 */
static void cmyk_to_rgb(uint8_t *px, size_t count)
{
    for (size_t i = 0; i < count; i++) {
        const uint8_t *in = px + i * 4;
        int c = 255 - in[0], m = 255 - in[1], y = 255 - in[2], k = 255 - in[3];
        int nk = 255 - k;
        uint8_t *o = px + i * 3;
        o[0] = clip8_int(nk - muldiv255(c, nk));
        o[1] = clip8_int(nk - muldiv255(m, nk));
        o[2] = clip8_int(nk - muldiv255(y, nk));
    }
}

/*
 * Picks the smallest TurboJPEG scaling factor (at most 1/1: never upscale)
 * whose scaled short side is still >= min_short_side.
 */
static void choose_scale(int width, int height, int min_short_side, int *sw, int *sh)
{
    int n = 0;
    tjscalingfactor *sf = tjGetScalingFactors(&n);
    int best_short = width < height ? width : height;

    *sw = width;
    *sh = height;
    if (!sf || min_short_side <= 0)
        return;
    for (int i = 0; i < n; i++) {
        if (sf[i].num > sf[i].denom)
            continue;
        int w = TJSCALED(width, sf[i]);
        int h = TJSCALED(height, sf[i]);
        int s = w < h ? w : h;
        if (s >= min_short_side && s < best_short) {
            best_short = s;
            *sw = w;
            *sh = h;
        }
    }
}

static int decode_jpeg(hapi_decoder *dec, const uint8_t *data, size_t size,
                       uint64_t max_pixels, int min_short_side, hapi_image *out,
                       hapi_error *err)
{
    /* Zeroed: for a tables-only datastream TurboJPEG returns success and sets nothing. */
    int width = 0, height = 0, subsamp = -1, colorspace = -1, sw, sh, pf, ret;
    uint8_t *px = NULL;

    if (tjDecompressHeader3(dec->tj, data, (unsigned long)size, &width, &height,
                            &subsamp, &colorspace) != 0)
        return hapi_error_set(err, HAPI_EDECODE, "JPEG header: %s",
                              tjGetErrorStr2(dec->tj));
    if (width <= 0 || height <= 0)
        return hapi_error_set(err, HAPI_EDECODE, "JPEG has no image (%dx%d)", width, height);
    ret = check_pixels((uint64_t)width, (uint64_t)height, max_pixels, err);
    if (ret < 0)
        return ret;

    choose_scale(width, height, min_short_side, &sw, &sh);
    /* libjpeg cannot convert CMYK/YCCK to RGB: take CMYK and convert as Pillow does. */
    int cmyk = colorspace == TJCS_CMYK || colorspace == TJCS_YCCK;
    pf = cmyk ? TJPF_CMYK : TJPF_RGB;
    px = alloc_pixels(sw, sh, cmyk ? 4 : 3);
    if (!px)
        return hapi_error_set(err, -ENOMEM, "no memory for a %dx%d image", sw, sh);

    /*
     * flags = 0: accurate islow IDCT and fancy upsampling, which is what
     * Pillow asks of libjpeg; the fast variants change pixels.
     */
    if (tjDecompress2(dec->tj, data, (unsigned long)size, px, sw, 0, sh, pf, 0) != 0) {
        const char *msg = tjGetErrorStr2(dec->tj);
        /*
         * A libjpeg warning (e.g. extraneous bytes) still yields the image,
         * and PIL ignores it too. Truncation is a warning for libjpeg but an
         * error for PIL ("image file is truncated"), so refuse it.
         */
        if (tjGetErrorCode(dec->tj) != TJERR_WARNING ||
            (msg && strstr(msg, "Premature end of JPEG file"))) {
            ret = hapi_error_set(err, HAPI_EDECODE, "JPEG: %s", msg ? msg : "decode failed");
            goto fail;
        }
    }
    if (cmyk) {
        cmyk_to_rgb(px, (size_t)sw * (size_t)sh);
        /* Give back the fourth byte per pixel; keeping the larger block is harmless. */
        uint8_t *shrunk = realloc(px, (size_t)sw * (size_t)sh * 3);
        if (shrunk)
            px = shrunk;
    }
    out->width = sw;
    out->height = sh;
    out->pixels = px;
    return 0;

fail:
    free(px);
    return ret;
}

/* Reads sample x of a PNG row in its native layout (SPNG_FMT_PNG: packed sub-byte, host-endian 16-bit). */
static inline unsigned png_sample(const uint8_t *row, size_t x, int depth)
{
    switch (depth) {
    case 1: return (row[x >> 3] >> (7 - (x & 7))) & 1u;
    case 2: return (row[x >> 2] >> (6 - 2 * (x & 3))) & 3u;
    case 4: return (row[x >> 1] >> (4 - 4 * (x & 1))) & 15u;
    case 8: return row[x];
    default: {
        uint16_t v;
        memcpy(&v, row + 2 * x, 2);
        return v;
    }
    }
}

/*
 * Converts one decoded PNG row to RGB the way Pillow does it
 * (PngImagePlugin's mode table, then convert("RGB")):
 * - gray 1/2/4 bit: "1", "L;2", "L;4" scale to 0..255 (x255, x85, x17);
 * - gray 16 bit: mode "I" keeps the full value and I -> RGB *clips* to
 *   0..255, so anything >= 255 is white (not the high byte!);
 * - 16-bit RGB, RGBA, gray+alpha: the high byte ("RGB;16B" etc.);
 * - alpha is dropped, never composited; tRNS is ignored;
 * - palette: PLTE lookup; indices past the PLTE keep Pillow's default
 *   grayscale palette entry (i, i, i).
 */
static void png_row_to_rgb(const uint8_t *row, uint8_t *o, int width, int ctype, int depth,
                           const uint8_t (*palette)[3])
{
    for (int x = 0; x < width; x++, o += 3) {
        unsigned v;
        switch (ctype) {
        case SPNG_COLOR_TYPE_GRAYSCALE:
        case SPNG_COLOR_TYPE_GRAYSCALE_ALPHA: {
            size_t idx = ctype == SPNG_COLOR_TYPE_GRAYSCALE ? (size_t)x : (size_t)x * 2;
            v = png_sample(row, idx, depth);
            if (depth == 16)
                v = ctype == SPNG_COLOR_TYPE_GRAYSCALE ? (v > 255 ? 255 : v) : v >> 8;
            else if (depth < 8)
                v = v * (255u / ((1u << depth) - 1));
            o[0] = o[1] = o[2] = (uint8_t)v;
            break;
        }
        case SPNG_COLOR_TYPE_TRUECOLOR:
        case SPNG_COLOR_TYPE_TRUECOLOR_ALPHA: {
            size_t n = ctype == SPNG_COLOR_TYPE_TRUECOLOR ? 3 : 4;
            for (size_t c = 0; c < 3; c++) {
                v = png_sample(row, (size_t)x * n + c, depth);
                o[c] = (uint8_t)(depth == 16 ? v >> 8 : v);
            }
            break;
        }
        default: /* indexed */
            v = png_sample(row, (size_t)x, depth);
            memcpy(o, palette[v], 3);
            break;
        }
    }
}

static int decode_png(const uint8_t *data, size_t size, uint64_t max_pixels,
                      hapi_image *out, hapi_error *err)
{
    spng_ctx *ctx = NULL;
    struct spng_ihdr ihdr;
    uint8_t *raw = NULL, *px = NULL;
    uint8_t palette[256][3];
    size_t len, stride;
    int ret, rc;

    ctx = spng_ctx_new(0);
    if (!ctx)
        return hapi_error_set(err, -ENOMEM, "no memory for a PNG decoder");
    spng_set_image_limits(ctx, HAPI_PNG_MAX_SIDE, HAPI_PNG_MAX_SIDE);
    spng_set_chunk_limits(ctx, HAPI_PNG_CHUNK_LIMIT, HAPI_PNG_CACHE_LIMIT);
    rc = spng_set_png_buffer(ctx, data, size);
    if (rc == 0)
        rc = spng_get_ihdr(ctx, &ihdr);
    if (rc != 0) {
        ret = hapi_error_set(err, HAPI_EDECODE, "PNG header: %s", spng_strerror(rc));
        goto out;
    }
    ret = check_pixels(ihdr.width, ihdr.height, max_pixels, err);
    if (ret < 0)
        goto out;

    if (ihdr.color_type == SPNG_COLOR_TYPE_INDEXED) {
        struct spng_plte plte;
        rc = spng_get_plte(ctx, &plte);
        if (rc != 0) {
            ret = hapi_error_set(err, HAPI_EDECODE, "PNG palette: %s", spng_strerror(rc));
            goto out;
        }
        /* Pillow starts from a grayscale ramp and overwrites the PLTE entries. */
        for (int i = 0; i < 256; i++)
            palette[i][0] = palette[i][1] = palette[i][2] = (uint8_t)i;
        for (uint32_t i = 0; i < plte.n_entries && i < 256; i++) {
            palette[i][0] = plte.entries[i].red;
            palette[i][1] = plte.entries[i].green;
            palette[i][2] = plte.entries[i].blue;
        }
    }

    /* The PNG's own layout: we do the conversion ourselves to match Pillow's rules. */
    rc = spng_decoded_image_size(ctx, SPNG_FMT_PNG, &len);
    if (rc != 0) {
        ret = hapi_error_set(err, HAPI_EDECODE, "PNG: %s", spng_strerror(rc));
        goto out;
    }
    /*
     * Zeroed: libspng deinterlaces sub-byte pixels by OR-ing bits into the
     * destination, so an interlaced 1/2/4-bit image needs a clean buffer
     * (found with ASan's malloc fill; plain malloc often hides it).
     */
    raw = calloc(1, len);
    px = alloc_pixels((int)ihdr.width, (int)ihdr.height, 3);
    if (!raw || !px) {
        ret = hapi_error_set(err, -ENOMEM, "no memory for a %ux%u PNG",
                             (unsigned)ihdr.width, (unsigned)ihdr.height);
        goto out;
    }
    rc = spng_decode_image(ctx, raw, len, SPNG_FMT_PNG, 0);
    if (rc != 0) {
        ret = hapi_error_set(err, HAPI_EDECODE, "PNG: %s", spng_strerror(rc));
        goto out;
    }
    stride = len / ihdr.height;
    for (uint32_t y = 0; y < ihdr.height; y++)
        png_row_to_rgb(raw + y * stride, px + (size_t)y * ihdr.width * 3, (int)ihdr.width,
                       ihdr.color_type, ihdr.bit_depth, (const uint8_t (*)[3])palette);
    out->width = (int)ihdr.width;
    out->height = (int)ihdr.height;
    out->pixels = px;
    px = NULL;
    ret = 0;

out:
    free(px);
    free(raw);
    spng_ctx_free(ctx);
    return ret;
}

int hapi_image_size(const void *data, size_t size, int *width, int *height)
{
    const uint8_t *d = data;
    *width = *height = 0;
    if (size >= 24 && memcmp(d, "\x89PNG\r\n\x1a\n", 8) == 0) {
        if (memcmp(d + 12, "IHDR", 4) != 0)
            return HAPI_EDECODE;
        uint32_t w = (uint32_t)d[16] << 24 | (uint32_t)d[17] << 16 | (uint32_t)d[18] << 8 | d[19];
        uint32_t h = (uint32_t)d[20] << 24 | (uint32_t)d[21] << 16 | (uint32_t)d[22] << 8 | d[23];
        if (w == 0 || h == 0 || w > HAPI_PNG_MAX_SIDE || h > HAPI_PNG_MAX_SIDE)
            return HAPI_EDECODE;
        *width = (int)w;
        *height = (int)h;
        return 0;
    }
    if (size < 4 || d[0] != 0xff || d[1] != 0xd8)
        return HAPI_EFORMAT;
    /* Walk the marker segments to the first start-of-frame. */
    size_t i = 2;
    while (i + 4 <= size) {
        if (d[i] != 0xff)
            return HAPI_EDECODE;
        uint8_t marker = d[i + 1];
        if (marker == 0xff) { /* fill byte */
            i++;
            continue;
        }
        size_t len = (size_t)d[i + 2] << 8 | d[i + 3];
        int sof = marker >= 0xc0 && marker <= 0xcf && marker != 0xc4 && marker != 0xc8 &&
                  marker != 0xcc;
        if (sof) {
            if (i + 9 > size)
                return HAPI_EDECODE;
            *height = d[i + 5] << 8 | d[i + 6];
            *width = d[i + 7] << 8 | d[i + 8];
            return *width > 0 && *height > 0 ? 0 : HAPI_EDECODE;
        }
        if (marker == 0xda || len < 2)
            return HAPI_EDECODE; /* scan data before any frame header */
        i += 2 + len;
    }
    return HAPI_EDECODE;
}

int hapi_image_decode(hapi_decoder *dec, const void *data, size_t size,
                      uint64_t max_pixels, int min_short_side,
                      hapi_image *out, hapi_error *err)
{
    static const uint8_t png_magic[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    const uint8_t *d = data;

    if (!out)
        return hapi_error_set(err, HAPI_EINVAL, "no output image");
    out->width = out->height = 0;
    out->pixels = NULL;
    if (!dec || (!data && size))
        return hapi_error_set(err, HAPI_EINVAL, "no decoder or no data");
    if (size >= 3 && d[0] == 0xff && d[1] == 0xd8 && d[2] == 0xff)
    {
        int rc = decode_jpeg(dec, d, size, max_pixels, min_short_side, out, err);
        /*
         * A libjpeg error longjmps out of the decompressor without aborting
         * it, and TurboJPEG 2.1 then reports the next file's header as read
         * with no size (seen: a file cut before its SOS marker, then a good
         * one decoded as 0x0). A fresh handle after any failure is cheap and
         * sure; failures are rare.
         */
        if (rc < 0 && rc != HAPI_ETOOBIG) {
            tjhandle fresh = tjInitDecompress();
            if (fresh) {
                tjDestroy(dec->tj);
                dec->tj = fresh;
            }
        }
        return rc;
    }
    if (size >= 8 && memcmp(d, png_magic, 8) == 0)
        return decode_png(d, size, max_pixels, out, err);
    return hapi_error_set(err, HAPI_EFORMAT, "neither JPEG nor PNG (unknown magic bytes)");
}

/* ------------------------------------------------------------ resampling */

/*
 * Fixed-point filter weights of Pillow's 8-bit resampler: 32 bits minus 8
 * for the pixel and 2 for headroom.
 */
#define PRECISION_BITS 22

/*
 * Weights of the resize of one axis from in_size to out_size, for output
 * indices [first, last) only. For output i, pixels [start[i], start[i] +
 * count[i]) contribute with weights k[i * ksize ...]. Indices are local:
 * start/count/k are indexed by i - first.
 */
typedef struct axis_coeffs {
    int first, last, ksize;
    int *start;
    int *count;
    int32_t *k;
} axis_coeffs;

static void axis_free(axis_coeffs *a)
{
    free(a->start);
    free(a->count);
    free(a->k);
}

/* A resampling filter: its kernel and the half-width where it becomes zero, at scale 1. */
typedef struct resample_filter {
    double (*kernel)(double x);
    double support;
} resample_filter;

static double bilinear_filter(double x)
{
    if (x < 0.0)
        x = -x;
    if (x < 1.0)
        return 1.0 - x;
    return 0.0;
}

/*
 * Keys' cubic convolution with a = -0.5, written as Pillow writes it: the
 * same products in the same order, so every weight is the same double.
 */
static double bicubic_filter(double x)
{
    const double a = -0.5;
    if (x < 0.0)
        x = -x;
    if (x < 1.0)
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
    if (x < 2.0)
        return (((x - 5) * x + 8) * x - 4) * a;
    return 0.0;
}

/* Indexed by enum hapi_interpolation. */
static const resample_filter filters[] = {
    [HAPI_INTERP_BILINEAR] = {bilinear_filter, 1.0},
    [HAPI_INTERP_BICUBIC] = {bicubic_filter, 2.0},
};
static const char *const interpolation_names[] = {
    [HAPI_INTERP_BILINEAR] = "bilinear",
    [HAPI_INTERP_BICUBIC] = "bicubic",
};
#define INTERPOLATIONS ((int)(sizeof(filters) / sizeof(filters[0])))

const char *hapi_interpolation_name(int interpolation)
{
    if (interpolation < 0 || interpolation >= INTERPOLATIONS)
        return NULL;
    return interpolation_names[interpolation];
}

int hapi_interpolation_parse(const char *name)
{
    for (int i = 0; name && i < INTERPOLATIONS; i++)
        if (strcmp(name, interpolation_names[i]) == 0)
            return i;
    return HAPI_EINVAL;
}

/*
 * Mirrors Pillow's precompute_coeffs() + normalize_coeffs_8bpc() for any of
 * its filters, in the same double operations and order: scale from a float
 * box width, the support widened by the downscale factor, the centre at
 * (i + 0.5) * scale, the window rounded with +0.5 and truncation, the tap
 * position multiplied by the reciprocal of filterscale, normalisation by the
 * sum, then rounding to 22 fractional bits away from zero (bicubic's
 * negative lobes round down).
 */
static int axis_init(axis_coeffs *a, const resample_filter *filter, int in_size, int out_size,
                     int first, int last)
{
    double scale, filterscale, support, ss;
    double *w = NULL;
    int n = last - first;

    memset(a, 0, sizeof(*a));
    a->first = first;
    a->last = last;
    scale = (double)(float)in_size / out_size;
    filterscale = scale < 1.0 ? 1.0 : scale;
    support = filter->support * filterscale;
    ss = 1.0 / filterscale;
    a->ksize = (int)ceil(support) * 2 + 1;
    if (n <= 0)
        return 0;
    a->start = malloc(sizeof(int) * (size_t)n);
    a->count = malloc(sizeof(int) * (size_t)n);
    a->k = malloc(sizeof(int32_t) * (size_t)n * (size_t)a->ksize);
    w = malloc(sizeof(double) * (size_t)a->ksize);
    if (!a->start || !a->count || !a->k || !w) {
        free(w);
        axis_free(a);
        return -ENOMEM;
    }
    for (int i = first; i < last; i++) {
        double center = (i + 0.5) * scale;
        double ww = 0.0;
        int xmin = (int)(center - support + 0.5);
        int xmax = (int)(center + support + 0.5);
        int32_t *k = a->k + (size_t)(i - first) * (size_t)a->ksize;

        if (xmin < 0)
            xmin = 0;
        if (xmax > in_size)
            xmax = in_size;
        xmax -= xmin;
        for (int x = 0; x < xmax; x++) {
            w[x] = filter->kernel((x + xmin - center + 0.5) * ss);
            ww += w[x];
        }
        for (int x = 0; x < xmax; x++) {
            double v = ww != 0.0 ? w[x] / ww : w[x];
            k[x] = v < 0 ? (int32_t)(-0.5 + v * (1 << PRECISION_BITS))
                         : (int32_t)(0.5 + v * (1 << PRECISION_BITS));
        }
        a->start[i - first] = xmin;
        a->count[i - first] = xmax;
    }
    free(w);
    return 0;
}

/*
 * Pillow's clip8 for a fixed-point accumulator (a lookup on v >> 22 there;
 * the same values): bicubic's negative lobes take sums below 0 and above 255.
 */
static inline uint8_t clip8_fixed(int32_t v)
{
    if (v >= (1 << PRECISION_BITS << 8))
        return 255;
    if (v <= 0)
        return 0;
    return (uint8_t)(v >> PRECISION_BITS);
}

/*
 * Where the centre crop of one axis falls: output index i of the crop reads
 * resized index i + shift. When the resized side is shorter than the crop,
 * torchvision pads (c - s) // 2 zeros before and (c - s + 1) // 2 after and
 * then the sizes match; otherwise the offset is round((s - c) / 2.0) with
 * Python's round-half-to-even.
 */
static int crop_shift(int size, int crop)
{
    if (size < crop)
        return -((crop - size) / 2);
    int diff = size - crop;
    int half = diff / 2;
    if (diff & 1) /* x.5: round to the even neighbour */
        half += half & 1;
    return half;
}

/* Whether `img` can be preprocessed with `pp` into `out`: 0, or HAPI_EINVAL saying why not. */
static int preprocess_check(const hapi_image *img, const hapi_preprocess *pp, const float *out,
                            hapi_error *err)
{
    if (!img || !img->pixels || img->width <= 0 || img->height <= 0)
        return hapi_error_set(err, HAPI_EINVAL, "empty image");
    /* The crop bound keeps index arithmetic (shift + crop) far from int overflow. */
    if (!pp || !out || pp->resize <= 0 || pp->crop <= 0 || pp->crop > HAPI_MAX_CROP)
        return hapi_error_set(err, HAPI_EINVAL, "bad preprocess parameters (resize %d, crop %d)",
                              pp ? pp->resize : 0, pp ? pp->crop : 0);
    for (int c = 0; c < 3; c++)
        if (!(pp->std[c] != 0.0f) || !isfinite(pp->std[c]) || !isfinite(pp->mean[c]))
            return hapi_error_set(err, HAPI_EINVAL, "bad normalisation for channel %d", c);
    if (!hapi_interpolation_name(pp->interpolation))
        return hapi_error_set(err, HAPI_EINVAL, "unknown interpolation %d", pp->interpolation);
    return 0;
}

/*
 * One resize and centre crop, computed only where the crop falls: its place in the resized
 * image, each pass's weights and the rows between the passes. resize_plan_free() frees what
 * vertical_weights(), horizontal_pass() and vertical_buffers() allocate into it.
 */
typedef struct resize_plan {
    int in_w, in_h;         /* the source */
    int out_w, out_h;       /* the resized image, before the crop */
    int crop;
    int shift_x, shift_y;   /* crop index i reads resized index i + shift (crop_shift) */
    int cx0, cx1, cy0, cy1; /* the resized columns [cx0, cx1) and rows [cy0, cy1) in the crop */
    int need_h, need_v;     /* whether each axis changes size */
    axis_coeffs hx, vy;     /* owned: the weights of each pass */
    uint8_t *hbuf;          /* owned: the horizontal pass's rows, when it runs */
    const uint8_t *hbase;   /* the rows the vertical pass reads: hbuf's or the source's */
    size_t hstride;         /* bytes from one of those rows to the next */
    int hrow0;              /* the source row that hbase's first row stands for */
    size_t rowlen;          /* bytes of one resized row inside the crop */
    int32_t *acc;           /* owned: the vertical pass's accumulator row */
    uint8_t *vrow;          /* owned: the vertical pass's output row */
} resize_plan;

static void resize_plan_free(resize_plan *r)
{
    free(r->acc);
    free(r->vrow);
    free(r->hbuf);
    axis_free(&r->hx);
    axis_free(&r->vy);
}

/* Sizes and the crop's window for `img` under `pp`; HAPI_EINVAL if the resized image would be
   too large. */
static int resize_plan_init(resize_plan *r, const hapi_image *img, const hapi_preprocess *pp,
                            hapi_error *err)
{
    const int in_w = img->width, in_h = img->height, crop = pp->crop;
    /* torchvision: short side -> resize, long side int(resize * long / short). */
    int64_t out_w, out_h;
    if (in_w <= in_h) {
        out_w = pp->resize;
        out_h = (int64_t)pp->resize * in_h / in_w;
    } else {
        out_h = pp->resize;
        out_w = (int64_t)pp->resize * in_w / in_h;
    }
    if (out_w > INT_MAX / 4 || out_h > INT_MAX / 4 || out_w < 1 || out_h < 1)
        return hapi_error_set(err, HAPI_EINVAL, "resized image would be %lldx%lld",
                              (long long)out_w, (long long)out_h);
    r->in_w = in_w;
    r->in_h = in_h;
    r->out_w = (int)out_w;
    r->out_h = (int)out_h;
    r->crop = crop;

    /* Only the resized rows/columns inside the crop are computed: each output pixel is independent. */
    r->shift_x = crop_shift(r->out_w, crop);
    r->shift_y = crop_shift(r->out_h, crop);
    r->cx0 = r->shift_x < 0 ? 0 : r->shift_x;
    r->cx1 = r->shift_x + crop > r->out_w ? r->out_w : r->shift_x + crop;
    r->cy0 = r->shift_y < 0 ? 0 : r->shift_y;
    r->cy1 = r->shift_y + crop > r->out_h ? r->out_h : r->shift_y + crop;
    r->need_h = r->out_w != in_w;
    r->need_v = r->out_h != in_h;
    r->rowlen = (size_t)(r->cx1 - r->cx0) * 3;
    return 0;
}

/* The vertical pass's weights, and the rows of the source it will read, [ry0, ry1);
   0 or -ENOMEM. */
static int vertical_weights(resize_plan *r, const resample_filter *filter, int *ry0, int *ry1)
{
    *ry0 = r->cy0;
    *ry1 = r->cy1;
    if (!r->need_v)
        return 0;
    int ret = axis_init(&r->vy, filter, r->in_h, r->out_h, r->cy0, r->cy1);
    if (ret < 0)
        return ret;
    *ry0 = r->vy.start[0];
    *ry1 = r->vy.start[r->cy1 - r->cy0 - 1] + r->vy.count[r->cy1 - r->cy0 - 1];
    return 0;
}

/*
 * Horizontal pass into an 8-bit image, rounded and clamped as Pillow
 * does. The three channels accumulate together, as in Pillow.
 * Without one, the vertical pass reads the source's own rows. 0 or -ENOMEM.
 */
static int horizontal_pass(resize_plan *r, const hapi_image *img, const resample_filter *filter,
                           int ry0, int ry1)
{
    const int wcols = r->cx1 - r->cx0;
    if (!r->need_h) {
        r->hbase = img->pixels + (size_t)r->cx0 * 3;
        r->hstride = (size_t)r->in_w * 3;
        r->hrow0 = 0;
        return 0;
    }
    int ret = axis_init(&r->hx, filter, r->in_w, r->out_w, r->cx0, r->cx1);
    if (ret < 0)
        return ret;
    r->hbuf = malloc((size_t)(ry1 - ry0) * (size_t)wcols * 3);
    if (!r->hbuf)
        return -ENOMEM;
    const axis_coeffs *hx = &r->hx;
    for (int y = ry0; y < ry1; y++) {
        const uint8_t *src = img->pixels + (size_t)y * (size_t)r->in_w * 3;
        uint8_t *dst = r->hbuf + (size_t)(y - ry0) * (size_t)wcols * 3;
        for (int i = 0; i < wcols; i++) {
            const int32_t *k = hx->k + (size_t)i * (size_t)hx->ksize;
            const uint8_t *p = src + (size_t)hx->start[i] * 3;
            int32_t s0 = 1 << (PRECISION_BITS - 1), s1 = s0, s2 = s0;
            for (int j = 0; j < hx->count[i]; j++, p += 3) {
                s0 += p[0] * k[j];
                s1 += p[1] * k[j];
                s2 += p[2] * k[j];
            }
            dst[i * 3 + 0] = clip8_fixed(s0);
            dst[i * 3 + 1] = clip8_fixed(s1);
            dst[i * 3 + 2] = clip8_fixed(s2);
        }
    }
    r->hbase = r->hbuf;
    r->hstride = (size_t)wcols * 3;
    r->hrow0 = ry0;
    return 0;
}

/*
 * The vertical pass goes a whole row at a time: for each tap, one
 * weighted source row is added into an accumulator row. The integer sums
 * are the same as Pillow's per-pixel loop, in an order the compiler can
 * vectorise. Its two rows, when there is a vertical pass; 0 or -ENOMEM.
 */
static int vertical_buffers(resize_plan *r)
{
    if (!r->need_v)
        return 0;
    r->acc = malloc(sizeof(int32_t) * r->rowlen);
    r->vrow = malloc(r->rowlen);
    return r->acc && r->vrow ? 0 : -ENOMEM;
}

/*
 * Resized row y inside the crop's columns (rowlen bytes), or NULL when y is outside the crop's
 * rows. The vertical pass's row lives until the next call. The loops run on local copies of the
 * plan's fields: a byte store may alias the plan, and would keep them from being vectorised.
 */
static const uint8_t *resized_row(const resize_plan *r, int y)
{
    const uint8_t *hbase = r->hbase;
    const size_t hstride = r->hstride, rowlen = r->rowlen;
    const int hrow0 = r->hrow0;
    int32_t *acc = r->acc;
    uint8_t *vrow = r->vrow;

    if (y < r->cy0 || y >= r->cy1)
        return NULL;
    if (!r->need_v)
        return hbase + (size_t)(y - hrow0) * hstride;
    const int i = y - r->cy0;
    const int32_t *k = r->vy.k + (size_t)i * (size_t)r->vy.ksize;
    for (size_t t = 0; t < rowlen; t++)
        acc[t] = 1 << (PRECISION_BITS - 1);
    for (int j = 0; j < r->vy.count[i]; j++) {
        const uint8_t *src = hbase + (size_t)(r->vy.start[i] + j - hrow0) * hstride;
        const int32_t kj = k[j];
        for (size_t t = 0; t < rowlen; t++)
            acc[t] += src[t] * kj;
    }
    for (size_t t = 0; t < rowlen; t++)
        vrow[t] = clip8_fixed(acc[t]);
    return vrow;
}

/* The crop, normalised, into `out` as three planes of crop x crop floats. */
static void write_crop(const resize_plan *r, const hapi_preprocess *pp, float *out)
{
    const int crop = r->crop, shift_x = r->shift_x, cx0 = r->cx0, cx1 = r->cx1;
    float table[3][256];

    /* ToTensor (p / 255.0f) then Normalize ((x - mean) / std) as a per-channel table: same floats. */
    for (int c = 0; c < 3; c++)
        for (int p = 0; p < 256; p++)
            table[c][p] = ((float)p / 255.0f - pp->mean[c]) / pp->std[c];

    const size_t plane = (size_t)crop * (size_t)crop;
    for (int oy = 0; oy < crop; oy++) {
        float *o[3] = {out + (size_t)oy * crop, out + plane + (size_t)oy * crop,
                       out + 2 * plane + (size_t)oy * crop};
        const uint8_t *row = resized_row(r, oy + r->shift_y);

        /* torchvision pads with fill=0: outside the image a pixel is 0 before ToTensor. */
        for (int ox = 0; ox < crop; ox++) {
            const int x = ox + shift_x;
            if (row && x >= cx0 && x < cx1) {
                const uint8_t *p = row + (size_t)(x - cx0) * 3;
                o[0][ox] = table[0][p[0]];
                o[1][ox] = table[1][p[1]];
                o[2][ox] = table[2][p[2]];
            } else {
                o[0][ox] = table[0][0];
                o[1][ox] = table[1][0];
                o[2][ox] = table[2][0];
            }
        }
    }
}

int hapi_image_preprocess(const hapi_image *img, const hapi_preprocess *pp,
                          float *out, hapi_error *err)
{
    resize_plan r = {0};
    int ry0, ry1, ret;

    if ((ret = preprocess_check(img, pp, out, err)) < 0)
        return ret;
    const resample_filter *filter = &filters[pp->interpolation];
    if ((ret = resize_plan_init(&r, img, pp, err)) < 0)
        return ret;
    if (vertical_weights(&r, filter, &ry0, &ry1) < 0 ||
        horizontal_pass(&r, img, filter, ry0, ry1) < 0 || vertical_buffers(&r) < 0) {
        ret = hapi_error_set(err, -ENOMEM, "no memory to resize a %dx%d image", r.in_w, r.in_h);
        goto out;
    }
    write_crop(&r, pp, out);
    ret = 0;
out:
    resize_plan_free(&r);
    return ret;
}

int hapi_image_load(hapi_decoder *dec, const void *data, size_t size,
                    const hapi_preprocess *pp, float *out, hapi_error *err)
{
    hapi_image img = {0};
    int ret;

    if (!pp)
        return hapi_error_set(err, HAPI_EINVAL, "no preprocess parameters");
    ret = hapi_image_decode(dec, data, size, pp->max_pixels,
                            pp->mode == HAPI_PREPROCESS_FAST ? pp->resize : 0, &img, err);
    if (ret < 0)
        return ret;
    ret = hapi_image_preprocess(&img, pp, out, err);
    hapi_image_release(&img);
    return ret;
}

int hapi_image_name_is_image(const char *name)
{
    static const char *const exts[] = {".jpg", ".jpeg", ".png"};
    size_t n;

    if (!name)
        return 0;
    n = strlen(name);
    for (size_t i = 0; i < sizeof(exts) / sizeof(exts[0]); i++) {
        size_t e = strlen(exts[i]);
        /* A bare ".jpg" is a hidden file, not an image with a name. */
        if (n > e && strcasecmp(name + n - e, exts[i]) == 0)
            return 1;
    }
    return 0;
}

/* test-image.c — unit tests of image decoding and preprocessing, on images the tests encode themselves. */
#include "extractor.h"

#include <check.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <spng.h>
#include <turbojpeg.h>

static const hapi_preprocess imagenet = {
    .resize = 32, .crop = 24,
    .mean = {0.485f, 0.456f, 0.406f}, .std = {0.229f, 0.224f, 0.225f},
    .mode = HAPI_PREPROCESS_EXACT, .max_pixels = 0,
};

/* ToTensor then Normalize of one 8-bit value, in torchvision's float order. */
static float normalised(int p, int c, const hapi_preprocess *pp)
{
    return ((float)p / 255.0f - pp->mean[c]) / pp->std[c];
}

/* A smooth, distinct-per-pixel RGB pattern that survives JPEG at quality 100. */
static uint8_t *pattern_rgb(int w, int h)
{
    uint8_t *px = malloc((size_t)w * h * 3);
    ck_assert_ptr_nonnull(px);
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++) {
            uint8_t *p = px + ((size_t)y * w + x) * 3;
            p[0] = (uint8_t)(40 + 4 * x);
            p[1] = (uint8_t)(30 + 5 * y);
            p[2] = (uint8_t)(200 - 2 * x - 2 * y);
        }
    return px;
}

/* Encodes pixels with TurboJPEG; the caller frees with tjFree(). */
static unsigned char *encode_jpeg(const uint8_t *px, int w, int h, int pf, int subsamp,
                                  int quality, unsigned long *size)
{
    tjhandle tj = tjInitCompress();
    unsigned char *buf = NULL;
    ck_assert_ptr_nonnull(tj);
    ck_assert_int_eq(tjCompress2(tj, px, w, 0, h, pf, &buf, size, subsamp, quality, 0), 0);
    tjDestroy(tj);
    return buf;
}

/* Encodes a PNG with libspng from data in the PNG's own layout; the caller frees with free(). */
static void *encode_png(const void *px, size_t len, int w, int h, int depth, int ctype,
                        const struct spng_plte *plte, size_t *size)
{
    spng_ctx *ctx = spng_ctx_new(SPNG_CTX_ENCODER);
    struct spng_ihdr ihdr = {.width = (uint32_t)w, .height = (uint32_t)h,
                             .bit_depth = (uint8_t)depth, .color_type = (uint8_t)ctype};
    int rc;
    ck_assert_ptr_nonnull(ctx);
    spng_set_option(ctx, SPNG_ENCODE_TO_BUFFER, 1);
    ck_assert_int_eq(spng_set_ihdr(ctx, &ihdr), 0);
    if (plte)
        ck_assert_int_eq(spng_set_plte(ctx, (struct spng_plte *)plte), 0);
    ck_assert_int_eq(spng_encode_image(ctx, px, len, SPNG_FMT_PNG, SPNG_ENCODE_FINALIZE), 0);
    void *out = spng_get_png_buffer(ctx, size, &rc);
    ck_assert_int_eq(rc, 0);
    ck_assert_ptr_nonnull(out);
    spng_ctx_free(ctx);
    return out;
}

static hapi_decoder *new_decoder(void)
{
    hapi_decoder *dec = NULL;
    ck_assert_int_eq(hapi_decoder_new(&dec), 0);
    ck_assert_ptr_nonnull(dec);
    return dec;
}

/* ------------------------------------------------------------------ decode */

START_TEST(jpeg_dims_and_pixels)
{
    const int w = 37, h = 23;
    uint8_t *src = pattern_rgb(w, h);
    unsigned long size;
    unsigned char *jpg = encode_jpeg(src, w, h, TJPF_RGB, TJSAMP_444, 100, &size);
    hapi_decoder *dec = new_decoder();
    hapi_image img;
    hapi_error err = {0};

    ck_assert_int_eq(hapi_image_decode(dec, jpg, size, 0, 0, &img, &err), 0);
    ck_assert_int_eq(img.width, w);
    ck_assert_int_eq(img.height, h);
    int worst = 0;
    for (size_t i = 0; i < (size_t)w * h * 3; i++) {
        int d = abs((int)img.pixels[i] - (int)src[i]);
        worst = d > worst ? d : worst;
    }
    /* Quality 100 at 4:4:4 is lossy only through rounding. */
    ck_assert_int_le(worst, 3);
    hapi_image_release(&img);
    ck_assert_ptr_null(img.pixels);
    ck_assert_int_eq(img.width, 0);
    hapi_image_release(&img); /* twice is fine */
    hapi_image_release(NULL);
    hapi_decoder_free(dec);
    tjFree(jpg);
    free(src);
}
END_TEST

START_TEST(jpeg_fast_scale)
{
    const int w = 640, h = 480;
    uint8_t *src = pattern_rgb(w, h);
    unsigned long size;
    unsigned char *jpg = encode_jpeg(src, w, h, TJPF_RGB, TJSAMP_420, 90, &size);
    hapi_decoder *dec = new_decoder();
    hapi_image img;

    /* 1/4 gives a short side of 120 >= 100; 1/8 (60) would be too small. */
    ck_assert_int_eq(hapi_image_decode(dec, jpg, size, 0, 100, &img, NULL), 0);
    ck_assert_int_eq(img.width, 160);
    ck_assert_int_eq(img.height, 120);
    hapi_image_release(&img);
    /* 3/8 gives exactly 180. */
    ck_assert_int_eq(hapi_image_decode(dec, jpg, size, 0, 180, &img, NULL), 0);
    ck_assert_int_eq(img.width, 240);
    ck_assert_int_eq(img.height, 180);
    hapi_image_release(&img);
    /* Never upscaled: a target above the short side decodes at full size. */
    ck_assert_int_eq(hapi_image_decode(dec, jpg, size, 0, 1000, &img, NULL), 0);
    ck_assert_int_eq(img.width, w);
    ck_assert_int_eq(img.height, h);
    hapi_image_release(&img);
    hapi_decoder_free(dec);
    tjFree(jpg);
    free(src);
}
END_TEST

START_TEST(jpeg_gray_is_rgb_equal)
{
    const int w = 30, h = 20;
    uint8_t gray[30 * 20];
    for (int i = 0; i < w * h; i++)
        gray[i] = (uint8_t)(20 + (i % w) * 6 + (i / w) * 2);
    unsigned long size;
    unsigned char *jpg = encode_jpeg(gray, w, h, TJPF_GRAY, TJSAMP_GRAY, 100, &size);
    hapi_decoder *dec = new_decoder();
    hapi_image img;

    ck_assert_int_eq(hapi_image_decode(dec, jpg, size, 0, 0, &img, NULL), 0);
    ck_assert_int_eq(img.width, w);
    ck_assert_int_eq(img.height, h);
    for (int i = 0; i < w * h; i++) {
        const uint8_t *p = img.pixels + (size_t)i * 3;
        ck_assert_int_eq(p[0], p[1]);
        ck_assert_int_eq(p[1], p[2]);
        ck_assert_int_le(abs((int)p[0] - (int)gray[i]), 2);
    }
    hapi_image_release(&img);
    hapi_decoder_free(dec);
    tjFree(jpg);
}
END_TEST

START_TEST(jpeg_cmyk_as_pil)
{
    /* TurboJPEG stores CMYK input as YCCK. Pillow reads it as inverted (Adobe) CMYK. */
    const int w = 16, h = 16;
    uint8_t cmyk[16 * 16 * 4];
    for (int i = 0; i < w * h; i++) {
        cmyk[i * 4 + 0] = 255;
        cmyk[i * 4 + 1] = 55;
        cmyk[i * 4 + 2] = 255;
        cmyk[i * 4 + 3] = 205;
    }
    unsigned long size;
    unsigned char *jpg = encode_jpeg(cmyk, w, h, TJPF_CMYK, TJSAMP_444, 100, &size);
    hapi_decoder *dec = new_decoder();
    hapi_image img;

    ck_assert_int_eq(hapi_image_decode(dec, jpg, size, 0, 0, &img, NULL), 0);
    /* inverted: C=0 M=200 Y=0 K=50 -> nk=205: R=B=205, G=205-muldiv255(200,205)=44 */
    for (int i = 0; i < w * h; i++) {
        const uint8_t *p = img.pixels + (size_t)i * 3;
        ck_assert_int_le(abs(p[0] - 205), 2);
        ck_assert_int_le(abs(p[1] - 44), 2);
        ck_assert_int_le(abs(p[2] - 205), 2);
    }
    hapi_image_release(&img);
    hapi_decoder_free(dec);
    tjFree(jpg);
}
END_TEST

START_TEST(jpeg_truncated_is_edecode)
{
    const int w = 64, h = 64;
    uint8_t *src = pattern_rgb(w, h);
    unsigned long size;
    unsigned char *jpg = encode_jpeg(src, w, h, TJPF_RGB, TJSAMP_420, 90, &size);
    hapi_decoder *dec = new_decoder();
    hapi_image img = {.pixels = (uint8_t *)1};
    hapi_error err = {0};

    ck_assert_int_eq(hapi_image_decode(dec, jpg, size / 2, 0, 0, &img, &err), HAPI_EDECODE);
    ck_assert_int_eq(err.code, HAPI_EDECODE);
    ck_assert_ptr_null(img.pixels);
    ck_assert_ptr_nonnull(strstr(err.message, "Premature end"));
    /* The decoder is still usable after a failure. */
    ck_assert_int_eq(hapi_image_decode(dec, jpg, size, 0, 0, &img, &err), 0);
    ck_assert_int_eq(img.width, w);
    hapi_image_release(&img);
    hapi_decoder_free(dec);
    tjFree(jpg);
    free(src);
}
END_TEST

/* A file cut before its scan fails in the header; the next good file still decodes. */
START_TEST(jpeg_header_failure_then_good)
{
    const int w = 90, h = 70;
    uint8_t *src = calloc((size_t)w * h, 3);
    unsigned long size;
    unsigned char *jpg = encode_jpeg(src, w, h, TJPF_RGB, TJSAMP_420, 90, &size);
    hapi_decoder *dec = new_decoder();
    hapi_image img = {0};
    hapi_error err = {0};

    /* cut inside the tables, before SOS */
    ck_assert_int_eq(hapi_image_decode(dec, jpg, 200, 0, 0, &img, &err), HAPI_EDECODE);
    ck_assert_ptr_null(img.pixels);
    ck_assert_int_eq(hapi_image_decode(dec, jpg, size, 0, 0, &img, &err), 0);
    ck_assert_int_eq(img.width, w);
    ck_assert_int_eq(img.height, h);
    ck_assert_int_eq(img.pixels[0], 0);
    hapi_image_release(&img);
    hapi_decoder_free(dec);
    tjFree(jpg);
    free(src);
}
END_TEST

/* Dimensions from the header alone, for memory accounting before a decode. */
START_TEST(size_from_header)
{
    const int w = 301, h = 17;
    uint8_t *src = pattern_rgb(w, h);
    unsigned long size;
    unsigned char *jpg = encode_jpeg(src, w, h, TJPF_RGB, TJSAMP_420, 80, &size);
    int gw, gh;
    ck_assert_int_eq(hapi_image_size(jpg, size, &gw, &gh), 0);
    ck_assert_int_eq(gw, w);
    ck_assert_int_eq(gh, h);
    size_t plen = 0;
    void *png = encode_png(src, (size_t)w * h * 3, w, h, 8, SPNG_COLOR_TYPE_TRUECOLOR, NULL, &plen);
    ck_assert_int_eq(hapi_image_size(png, plen, &gw, &gh), 0);
    ck_assert_int_eq(gw, w);
    ck_assert_int_eq(gh, h);
    ck_assert_int_eq(hapi_image_size("GIF89a......", 12, &gw, &gh), HAPI_EFORMAT);
    ck_assert_int_eq(hapi_image_size(jpg, 20, &gw, &gh), HAPI_EDECODE); /* cut before SOF */
    ck_assert_int_eq(gw, 0);
    free(png);
    tjFree(jpg);
    free(src);
}
END_TEST

START_TEST(garbage_is_eformat)
{
    uint8_t junk[300];
    hapi_decoder *dec = new_decoder();
    hapi_image img;
    hapi_error err = {0};

    for (size_t i = 0; i < sizeof(junk); i++)
        junk[i] = (uint8_t)(i * 7 + 3);
    ck_assert_int_eq(hapi_image_decode(dec, junk, sizeof(junk), 0, 0, &img, &err), HAPI_EFORMAT);
    ck_assert_int_eq(err.code, HAPI_EFORMAT);
    ck_assert_ptr_null(img.pixels);
    ck_assert_int_eq(hapi_image_decode(dec, junk, 0, 0, 0, &img, NULL), HAPI_EFORMAT);
    /* JPEG magic followed by nonsense is a JPEG that does not decode. */
    junk[0] = 0xff, junk[1] = 0xd8, junk[2] = 0xff;
    ck_assert_int_eq(hapi_image_decode(dec, junk, sizeof(junk), 0, 0, &img, &err), HAPI_EDECODE);
    ck_assert_ptr_null(img.pixels);
    hapi_decoder_free(dec);
}
END_TEST

static uint32_t crc32_png(const uint8_t *p, size_t n)
{
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
    }
    return ~c;
}

static void put_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24), p[1] = (uint8_t)(v >> 16), p[2] = (uint8_t)(v >> 8), p[3] = (uint8_t)v;
}

START_TEST(huge_header_is_etoobig)
{
    uint8_t *src = pattern_rgb(16, 16);
    unsigned long size;
    unsigned char *jpg = encode_jpeg(src, 16, 16, TJPF_RGB, TJSAMP_444, 90, &size);
    hapi_decoder *dec = new_decoder();
    hapi_image img;
    hapi_error err = {0};

    /* Rewrite the baseline SOF to claim 65000 x 65000 (4.2 gigapixels, 12.7 GB of RGB). */
    unsigned char *sof = NULL;
    for (unsigned long i = 0; i + 9 < size; i++)
        if (jpg[i] == 0xff && jpg[i + 1] == 0xc0) {
            sof = jpg + i;
            break;
        }
    ck_assert_ptr_nonnull(sof);
    sof[5] = sof[7] = 0xfd;
    sof[6] = sof[8] = 0xe8;
    uint64_t t0 = hapi_now_ns();
    ck_assert_int_eq(hapi_image_decode(dec, jpg, size, 100000000, 0, &img, &err), HAPI_ETOOBIG);
    /*
     * Refused from the header: that takes microseconds, while decoding would first allocate and
     * fill 12.7 GB, many seconds at best. The limit is 1 s, not a few milliseconds, so a slow or
     * loaded machine passes; it still proves nothing large was decoded.
     */
    ck_assert_uint_lt(hapi_now_ns() - t0, 1000000000u);
    ck_assert_int_eq(err.code, HAPI_ETOOBIG);
    ck_assert_ptr_nonnull(strstr(err.message, "65000x65000"));
    ck_assert_ptr_null(img.pixels);

    /* The same for a PNG whose IHDR claims 100000 x 100000. */
    uint8_t one[3] = {1, 2, 3};
    size_t psize;
    uint8_t *png = encode_png(one, 3, 1, 1, 8, SPNG_COLOR_TYPE_TRUECOLOR, NULL, &psize);
    put_be32(png + 16, 100000);
    put_be32(png + 20, 100000);
    put_be32(png + 29, crc32_png(png + 12, 17));
    t0 = hapi_now_ns();
    ck_assert_int_eq(hapi_image_decode(dec, png, psize, 100000000, 0, &img, &err), HAPI_ETOOBIG);
    ck_assert_uint_lt(hapi_now_ns() - t0, 1000000000u); /* from the header, as above */
    ck_assert_ptr_null(img.pixels);
    /* Exactly at the limit is allowed. */
    free(png);
    png = encode_png(one, 3, 1, 1, 8, SPNG_COLOR_TYPE_TRUECOLOR, NULL, &psize);
    ck_assert_int_eq(hapi_image_decode(dec, png, psize, 1, 0, &img, NULL), 0);
    ck_assert_int_eq(img.pixels[2], 3);
    hapi_image_release(&img);
    free(png);
    hapi_decoder_free(dec);
    tjFree(jpg);
    free(src);
}
END_TEST

START_TEST(png_rgb_exact)
{
    const int w = 13, h = 7;
    uint8_t *src = pattern_rgb(w, h);
    size_t size;
    uint8_t *png = encode_png(src, (size_t)w * h * 3, w, h, 8, SPNG_COLOR_TYPE_TRUECOLOR, NULL, &size);
    hapi_decoder *dec = new_decoder();
    hapi_image img;

    ck_assert_int_eq(hapi_image_decode(dec, png, size, 0, 5, &img, NULL), 0);
    ck_assert_int_eq(img.width, w); /* fast mode does not apply to PNG */
    ck_assert_int_eq(img.height, h);
    ck_assert_mem_eq(img.pixels, src, (size_t)w * h * 3);
    hapi_image_release(&img);
    ck_assert_int_eq(hapi_image_decode(dec, png, size - 20, 0, 0, &img, NULL), HAPI_EDECODE);
    hapi_decoder_free(dec);
    free(png);
    free(src);
}
END_TEST

START_TEST(png_modes_as_pil)
{
    hapi_decoder *dec = new_decoder();
    hapi_image img;
    size_t size;
    uint8_t *png;

    /* 16-bit gray: Pillow's mode "I" clips to 0..255 instead of taking the high byte. */
    uint16_t g16[6] = {0, 7, 255, 256, 4000, 65535};
    png = encode_png(g16, sizeof(g16), 6, 1, 16, SPNG_COLOR_TYPE_GRAYSCALE, NULL, &size);
    ck_assert_int_eq(hapi_image_decode(dec, png, size, 0, 0, &img, NULL), 0);
    const uint8_t want16[6] = {0, 7, 255, 255, 255, 255};
    for (int i = 0; i < 6; i++) {
        ck_assert_int_eq(img.pixels[i * 3], want16[i]);
        ck_assert_int_eq(img.pixels[i * 3 + 2], want16[i]);
    }
    hapi_image_release(&img);
    free(png);

    /* 16-bit RGBA: high bytes, alpha dropped (not composited). */
    uint16_t rgba16[8] = {0x1234, 0xff00, 0x00ff, 0x0000, 0xabcd, 0x0101, 0x8000, 0xffff};
    png = encode_png(rgba16, sizeof(rgba16), 2, 1, 16, SPNG_COLOR_TYPE_TRUECOLOR_ALPHA, NULL, &size);
    ck_assert_int_eq(hapi_image_decode(dec, png, size, 0, 0, &img, NULL), 0);
    const uint8_t want_rgba[6] = {0x12, 0xff, 0x00, 0xab, 0x01, 0x80};
    ck_assert_mem_eq(img.pixels, want_rgba, 6);
    hapi_image_release(&img);
    free(png);

    /* 2-bit palette with 2 entries: indices past the PLTE read Pillow's gray ramp. */
    struct spng_plte plte = {.n_entries = 2};
    plte.entries[0] = (struct spng_plte_entry){10, 20, 30, 255};
    plte.entries[1] = (struct spng_plte_entry){40, 50, 60, 255};
    uint8_t idx = 0x1b; /* 0, 1, 2, 3 */
    png = encode_png(&idx, 1, 4, 1, 2, SPNG_COLOR_TYPE_INDEXED, &plte, &size);
    ck_assert_int_eq(hapi_image_decode(dec, png, size, 0, 0, &img, NULL), 0);
    const uint8_t want_p[12] = {10, 20, 30, 40, 50, 60, 2, 2, 2, 3, 3, 3};
    ck_assert_mem_eq(img.pixels, want_p, 12);
    hapi_image_release(&img);
    free(png);

    /* 4-bit gray scales by 17. */
    uint8_t g4[2] = {0x0f, 0x8a}; /* 0, 15, 8, 10 */
    png = encode_png(g4, 2, 4, 1, 4, SPNG_COLOR_TYPE_GRAYSCALE, NULL, &size);
    ck_assert_int_eq(hapi_image_decode(dec, png, size, 0, 0, &img, NULL), 0);
    ck_assert_int_eq(img.pixels[0], 0);
    ck_assert_int_eq(img.pixels[3], 255);
    ck_assert_int_eq(img.pixels[6], 136);
    ck_assert_int_eq(img.pixels[10], 170);
    hapi_image_release(&img);
    free(png);
    hapi_decoder_free(dec);
}
END_TEST

/* -------------------------------------------------------------- preprocess */

START_TEST(preprocess_constant_colour)
{
    const int w = 50, h = 40;
    const uint8_t colour[3] = {10, 128, 250};
    hapi_image img = {.width = w, .height = h, .pixels = malloc((size_t)w * h * 3)};
    const int n = 3 * imagenet.crop * imagenet.crop;
    float *out = malloc(sizeof(float) * (size_t)(n + 16));

    ck_assert_ptr_nonnull(img.pixels);
    ck_assert_ptr_nonnull(out);
    for (int i = 0; i < w * h; i++)
        memcpy(img.pixels + (size_t)i * 3, colour, 3);
    for (int i = 0; i < n + 16; i++)
        out[i] = 12345.0f;
    ck_assert_int_eq(hapi_image_preprocess(&img, &imagenet, out, NULL), 0);
    for (int c = 0; c < 3; c++) {
        float want = normalised(colour[c], c, &imagenet);
        for (int i = 0; i < imagenet.crop * imagenet.crop; i++)
            ck_assert_float_eq(out[c * imagenet.crop * imagenet.crop + i], want);
    }
    for (int i = n; i < n + 16; i++) /* nothing written past 3 x crop x crop */
        ck_assert_float_eq(out[i], 12345.0f);
    hapi_image_release(&img);
    free(out);
}
END_TEST

START_TEST(preprocess_smaller_than_crop)
{
    /* 20x10 with resize 10 stays 20x10; crop 16 pads 3 rows above and 3 below with zeros. */
    hapi_image img = {.width = 20, .height = 10, .pixels = malloc(20 * 10 * 3)};
    hapi_preprocess pp = imagenet;
    float out[3 * 16 * 16];

    ck_assert_ptr_nonnull(img.pixels);
    memset(img.pixels, 200, 20 * 10 * 3);
    pp.resize = 10;
    pp.crop = 16;
    ck_assert_int_eq(hapi_image_preprocess(&img, &pp, out, NULL), 0);
    for (int c = 0; c < 3; c++)
        for (int y = 0; y < 16; y++)
            for (int x = 0; x < 16; x++) {
                int inside = y >= 3 && y < 13;
                ck_assert_float_eq(out[c * 256 + y * 16 + x], normalised(inside ? 200 : 0, c, &pp));
            }
    /* Both sides short: 6x4 at crop 9 pads (1 left, 2 right) and (2 top, 3 bottom). */
    hapi_image_release(&img);
    img = (hapi_image){.width = 6, .height = 4, .pixels = malloc(6 * 4 * 3)};
    ck_assert_ptr_nonnull(img.pixels);
    memset(img.pixels, 100, 6 * 4 * 3);
    pp.resize = 4;
    pp.crop = 9;
    ck_assert_int_eq(hapi_image_preprocess(&img, &pp, out, NULL), 0);
    for (int y = 0; y < 9; y++)
        for (int x = 0; x < 9; x++) {
            int inside = y >= 2 && y < 6 && x >= 1 && x < 7;
            ck_assert_float_eq(out[y * 9 + x], normalised(inside ? 100 : 0, 0, &pp));
        }
    hapi_image_release(&img);
}
END_TEST

START_TEST(preprocess_crop_rounds_half_to_even)
{
    /* 16 wide, no resize (short side 16); row y holds value 8 * y. */
    hapi_preprocess pp = imagenet;
    float out[3 * 10 * 10];
    pp.resize = 16;
    pp.crop = 10;
    for (int h = 27; h <= 29; h += 2) {
        hapi_image img = {.width = 16, .height = h, .pixels = malloc((size_t)16 * h * 3)};
        ck_assert_ptr_nonnull(img.pixels);
        for (int y = 0; y < h; y++)
            memset(img.pixels + (size_t)y * 16 * 3, 8 * y, 16 * 3);
        ck_assert_int_eq(hapi_image_preprocess(&img, &pp, out, NULL), 0);
        /* (27 - 10) / 2 = 8.5 -> 8; (29 - 10) / 2 = 9.5 -> 10; columns: (16 - 10) / 2 = 3. */
        int top = h == 27 ? 8 : 10;
        ck_assert_float_eq(out[0], normalised(8 * top, 0, &pp));
        ck_assert_float_eq(out[9 * 10 + 9], normalised(8 * (top + 9), 0, &pp));
        hapi_image_release(&img);
    }
}
END_TEST

START_TEST(preprocess_resizes_like_pil)
{
    /*
     * 4x2 at resize 1 becomes 2x1 (scale 2, support 2). Output column 0 is
     * centred at 1.0 and reads x = 0, 1, 2 with triangle weights at
     * |x + 0.5 - 1| / 2: 0.75, 0.75, 0.25, normalised to 3/7, 3/7, 1/7.
     * Row 0: (0*3 + 80*3 + 160) / 7 = 57.1 -> 57; row 1: (16*3 + 96*3 + 176) / 7
     * = 73.1 -> 73. Vertically both rows weigh 1/2: 65.0 -> 65.
     */
    hapi_image img = {.width = 4, .height = 2, .pixels = calloc(4 * 2, 3)};
    hapi_preprocess pp = imagenet;
    float out[3 * 1 * 1];
    ck_assert_ptr_nonnull(img.pixels);
    const uint8_t row0[4] = {0, 80, 160, 240}, row1[4] = {16, 96, 176, 255};
    for (int x = 0; x < 4; x++) {
        img.pixels[x * 3] = row0[x];
        img.pixels[(4 + x) * 3] = row1[x];
    }
    pp.resize = 1;
    pp.crop = 1;
    ck_assert_int_eq(hapi_image_preprocess(&img, &pp, out, NULL), 0);
    ck_assert_float_eq(out[0], normalised(65, 0, &pp));
    ck_assert_float_eq(out[1], normalised(0, 1, &pp));
    hapi_image_release(&img);
}
END_TEST

START_TEST(preprocess_bicubic_like_pil)
{
    /*
     * A step 0 -> 255 in an 8x1 row, upscaled to 16x2 (resize 2): scale 1/2,
     * support 2, four taps. Output column 7 is centred at 3.75 and reads
     * x = 2..5 at distances 1.25, 0.25, 0.75, 1.75: weights -0.0703125,
     * 0.8671875, 0.2265625, -0.0234375 (exact in binary; sum 1). Over
     * 0, 0, 255, 255: 51.8 -> 52, where bilinear gives 64. Column 8 mirrors
     * it: 203.2 -> 203. The negative lobes overshoot: column 6 sums to -17.9
     * and column 9 to 272.9, clamped to 0 and 255.
     */
    hapi_image img = {.width = 8, .height = 1, .pixels = calloc(8, 3)};
    hapi_preprocess pp = imagenet;
    float out[3 * 16 * 16];
    ck_assert_ptr_nonnull(img.pixels);
    memset(img.pixels + 4 * 3, 255, 4 * 3);
    pp.resize = 2;
    pp.crop = 16; /* the two rows land at 7 and 8, between padding */
    pp.interpolation = HAPI_INTERP_BICUBIC;
    ck_assert_int_eq(hapi_image_preprocess(&img, &pp, out, NULL), 0);
    const float *row = out + 7 * 16;
    ck_assert_float_eq(row[5], normalised(0, 0, &pp));
    ck_assert_float_eq(row[6], normalised(0, 0, &pp));
    ck_assert_float_eq(row[7], normalised(52, 0, &pp));
    ck_assert_float_eq(row[8], normalised(203, 0, &pp));
    ck_assert_float_eq(row[9], normalised(255, 0, &pp));
    ck_assert_float_eq(row[16 + 7], normalised(52, 0, &pp)); /* the second row is the same */
    pp.interpolation = HAPI_INTERP_BILINEAR;
    ck_assert_int_eq(hapi_image_preprocess(&img, &pp, out, NULL), 0);
    ck_assert_float_eq(out[7 * 16 + 7], normalised(64, 0, &pp));
    hapi_image_release(&img);
}
END_TEST

START_TEST(interpolation_names)
{
    ck_assert_str_eq(hapi_interpolation_name(HAPI_INTERP_BILINEAR), "bilinear");
    ck_assert_str_eq(hapi_interpolation_name(HAPI_INTERP_BICUBIC), "bicubic");
    ck_assert_ptr_null(hapi_interpolation_name(2));
    ck_assert_ptr_null(hapi_interpolation_name(-1));
    ck_assert_int_eq(hapi_interpolation_parse("bilinear"), HAPI_INTERP_BILINEAR);
    ck_assert_int_eq(hapi_interpolation_parse("bicubic"), HAPI_INTERP_BICUBIC);
    ck_assert_int_eq(hapi_interpolation_parse("Bicubic"), HAPI_EINVAL);
    ck_assert_int_eq(hapi_interpolation_parse("lanczos"), HAPI_EINVAL);
    ck_assert_int_eq(hapi_interpolation_parse(""), HAPI_EINVAL);
    ck_assert_int_eq(hapi_interpolation_parse(NULL), HAPI_EINVAL);
}
END_TEST

START_TEST(preprocess_bad_arguments)
{
    uint8_t px[3] = {1, 2, 3};
    hapi_image img = {.width = 1, .height = 1, .pixels = px};
    hapi_preprocess pp = imagenet;
    hapi_error err = {0};
    float out[3 * 24 * 24];

    pp.crop = 0;
    ck_assert_int_eq(hapi_image_preprocess(&img, &pp, out, &err), HAPI_EINVAL);
    ck_assert_int_eq(err.code, HAPI_EINVAL);
    pp = imagenet;
    pp.std[1] = 0.0f;
    ck_assert_int_eq(hapi_image_preprocess(&img, &pp, out, NULL), HAPI_EINVAL);
    pp = imagenet;
    pp.interpolation = 2;
    ck_assert_int_eq(hapi_image_preprocess(&img, &pp, out, &err), HAPI_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.message, "interpolation"));
    img.pixels = NULL;
    ck_assert_int_eq(hapi_image_preprocess(&img, &imagenet, out, NULL), HAPI_EINVAL);
}
END_TEST

START_TEST(load_decodes_then_preprocesses)
{
    const int w = 64, h = 48;
    uint8_t *src = malloc((size_t)w * h * 3);
    ck_assert_ptr_nonnull(src);
    for (int i = 0; i < w * h; i++)
        src[i * 3] = 90, src[i * 3 + 1] = 160, src[i * 3 + 2] = 30;
    size_t size;
    uint8_t *png = encode_png(src, (size_t)w * h * 3, w, h, 8, SPNG_COLOR_TYPE_TRUECOLOR, NULL, &size);
    hapi_decoder *dec = new_decoder();
    hapi_preprocess pp = imagenet;
    float out[3 * 24 * 24];
    hapi_error err = {0};

    ck_assert_int_eq(hapi_image_load(dec, png, size, &pp, out, &err), 0);
    ck_assert_float_eq(out[0], normalised(90, 0, &pp));
    ck_assert_float_eq(out[24 * 24 + 100], normalised(160, 1, &pp));
    ck_assert_float_eq(out[2 * 24 * 24 + 575], normalised(30, 2, &pp));
    pp.max_pixels = (uint64_t)w * h - 1;
    ck_assert_int_eq(hapi_image_load(dec, png, size, &pp, out, &err), HAPI_ETOOBIG);
    hapi_decoder_free(dec);
    free(png);
    free(src);
}
END_TEST

START_TEST(name_is_image)
{
    ck_assert(hapi_image_name_is_image("a.jpg"));
    ck_assert(hapi_image_name_is_image("dir/A.JPEG"));
    ck_assert(hapi_image_name_is_image("n01440764_10026.JPEG"));
    ck_assert(hapi_image_name_is_image("x.Png"));
    ck_assert(!hapi_image_name_is_image("x.jpg.feat"));
    ck_assert(!hapi_image_name_is_image(".jpg"));
    ck_assert(!hapi_image_name_is_image("jpg"));
    ck_assert(!hapi_image_name_is_image("x.gif"));
    ck_assert(!hapi_image_name_is_image("x.jpgx"));
    ck_assert(!hapi_image_name_is_image(""));
    ck_assert(!hapi_image_name_is_image(NULL));
}
END_TEST

static Suite *image_suite(void)
{
    Suite *s = suite_create("image");
    struct {
        const char *name;
        const TTest *test;
    } cases[] = {
        {"jpeg_dims_and_pixels", jpeg_dims_and_pixels},
        {"jpeg_fast_scale", jpeg_fast_scale},
        {"jpeg_gray_is_rgb_equal", jpeg_gray_is_rgb_equal},
        {"jpeg_cmyk_as_pil", jpeg_cmyk_as_pil},
        {"jpeg_truncated_is_edecode", jpeg_truncated_is_edecode},
        {"jpeg_header_failure_then_good", jpeg_header_failure_then_good},
        {"size_from_header", size_from_header},
        {"garbage_is_eformat", garbage_is_eformat},
        {"huge_header_is_etoobig", huge_header_is_etoobig},
        {"png_rgb_exact", png_rgb_exact},
        {"png_modes_as_pil", png_modes_as_pil},
        {"preprocess_constant_colour", preprocess_constant_colour},
        {"preprocess_smaller_than_crop", preprocess_smaller_than_crop},
        {"preprocess_crop_rounds_half_to_even", preprocess_crop_rounds_half_to_even},
        {"preprocess_resizes_like_pil", preprocess_resizes_like_pil},
        {"preprocess_bicubic_like_pil", preprocess_bicubic_like_pil},
        {"interpolation_names", interpolation_names},
        {"preprocess_bad_arguments", preprocess_bad_arguments},
        {"load_decodes_then_preprocesses", load_decodes_then_preprocesses},
        {"name_is_image", name_is_image},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_add_test(tc, cases[i].test);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(image_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

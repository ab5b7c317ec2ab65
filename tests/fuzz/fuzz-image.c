/*
 * fuzz-image.c — libFuzzer target: the image path of every .feat read on
 * untrusted files. The header-only size probe, then decode and preprocess in
 * exact and fast mode, at full size and at a DCT-reduced scale.
 *
 * Input: one control byte (mode, sizes), then the file's bytes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "extractor.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static hapi_decoder *dec;
    if (!dec && hapi_decoder_new(&dec) < 0)
        abort();
    if (size < 1)
        return 0;
    uint8_t ctl = data[0];
    data++, size--;

    int w = 0, h = 0;
    int size_rc = hapi_image_size(data, size, &w, &h);
    if (size_rc == 0 && (w <= 0 || h <= 0))
        abort(); /* a size it says it found must be a size */

    /* A small model input, so that a run is about the decoder, not the resampler. */
    hapi_preprocess pp = {
        .resize = 8 + (ctl & 0x1f),
        .crop = 4 + ((ctl >> 5) & 3) * 4,
        .mean = { 0.485f, 0.456f, 0.406f },
        .std = { 0.229f, 0.224f, 0.225f },
        .mode = (ctl & 0x80) ? HAPI_PREPROCESS_FAST : HAPI_PREPROCESS_EXACT,
        .max_pixels = 1u << 22, /* what a mount's max_pixels= does for big headers */
        /* ctl's bits are all taken: the length's parity picks the filter (bicubic reads
           twice as far each side) */
        .interpolation = (size & 1) ? HAPI_INTERP_BICUBIC : HAPI_INTERP_BILINEAR,
    };
    float out[3 * 16 * 16];
    hapi_error err = { 0 };
    int rc = hapi_image_load(dec, data, size, &pp, out, &err);
    if (rc < 0 && !err.message[0])
        abort(); /* every failure says why */

    /* The decoder alone, full size: its image must be what it claims. */
    hapi_image img = { 0 };
    memset(&err, 0, sizeof(err));
    if (hapi_image_decode(dec, data, size, pp.max_pixels, 0, &img, &err) == 0) {
        if (img.width <= 0 || img.height <= 0 || !img.pixels)
            abort();
        volatile uint8_t last = img.pixels[(size_t)img.width * img.height * 3 - 1];
        (void)last;
        if (size_rc == 0 && (img.width != w || img.height != h))
            abort(); /* the header probe and the decoder agree */
    } else if (img.pixels) {
        abort(); /* on failure out->pixels is NULL */
    }
    hapi_image_release(&img);
    return 0;
}

/* namespace.c — namespaces: the digest that names one configuration of model, split, dtype and preprocessing. */
#include "cache-priv.h"

#include <stdint.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY /* for XXH3_state_t on the stack: no allocation, no failure */
#include <xxhash.h>

/* Version of the namespace encoding: bump it when the encoding changes, so old entries become unreachable. */
#define NAMESPACE_ENCODING_VERSION 1

/*
 * The digest covers a canonical byte string, so it does not depend on struct
 * layout or on how the caller spelled numbers: "hapifs-ns", the encoding
 * version, the 16 model-digest bytes, split and dtype as little-endian 32-bit
 * integers, the preprocess text's length (64-bit) and its bytes. The length
 * prefix keeps the text from running into any field added later.
 */
void hapi_cache_namespace_make(const uint8_t model_digest[16], int split, int dtype,
                               const char *preprocess, hapi_cache_namespace *out)
{
    static const uint8_t zero_digest[16];
    const char *text = preprocess ? preprocess : "";
    size_t text_len = strlen(text);
    uint8_t fixed[10 + 4 + 16 + 4 + 4 + 8];
    uint8_t *p = fixed;
    XXH3_state_t state;
    XXH128_hash_t h;
    XXH128_canonical_t canon;

    memcpy(p, "hapifs-ns", 10); /* with its NUL */
    p += 10;
    put_le32(p, NAMESPACE_ENCODING_VERSION);
    p += 4;
    memcpy(p, model_digest ? model_digest : zero_digest, 16);
    p += 16;
    put_le32(p, (uint32_t)split);
    p += 4;
    put_le32(p, (uint32_t)dtype);
    p += 4;
    put_le64(p, (uint64_t)text_len);

    /* A state on the stack needs no XXH3_createState(), which could fail in a void function. */
    XXH3_INITSTATE(&state);
    XXH3_128bits_reset(&state);
    XXH3_128bits_update(&state, fixed, sizeof(fixed));
    XXH3_128bits_update(&state, text, text_len);
    h = XXH3_128bits_digest(&state);
    /* The canonical (big-endian) form makes the bytes the same on every host. */
    XXH128_canonicalFromHash(&canon, h);
    memcpy(out->bytes, canon.digest, HAPI_CACHE_NAMESPACE_SIZE);
}

void hapi_cache_namespace_hex(const hapi_cache_namespace *ns, char hex[33])
{
    hapi_hex(ns->bytes, HAPI_CACHE_NAMESPACE_SIZE, hex);
}

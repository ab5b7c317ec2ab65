/* value.c — keys and stored values: the key of a path, the value header, its checksum and its checks. */
#include "cache-priv.h"

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include <xxhash.h>

size_t hapi_cache__key_make(const hapi_cache_namespace *ns, const char *path,
                            uint8_t key[HAPI_CACHE__KEY_MAX])
{
    size_t len = strlen(path);
    memcpy(key, ns->bytes, HAPI_CACHE_NAMESPACE_SIZE);
    if (len <= HAPI_CACHE_PATH_MAX) {
        memcpy(key + HAPI_CACHE_NAMESPACE_SIZE, path, len);
        return HAPI_CACHE_NAMESPACE_SIZE + len;
    }
    /*
     * Keep a long prefix readable and ordered like the path (entries of one
     * directory stay near each other), then the digest of the whole path. The
     * value stores the full path: a digest collision is then a miss, not a
     * wrong answer.
     */
    uint8_t *p = key + HAPI_CACHE_NAMESPACE_SIZE;
    XXH128_canonical_t canon;
    memcpy(p, path, HAPI_CACHE__PREFIX_SIZE);
    p += HAPI_CACHE__PREFIX_SIZE;
    *p++ = '\0';
    XXH128_canonicalFromHash(&canon, XXH3_128bits(path, len));
    memcpy(p, canon.digest, 16);
    return HAPI_CACHE__KEY_MAX;
}

/* The checksum of a value: header (checksum field zero) and stored path seed the hash of the data. */
uint64_t hapi_cache__value_checksum(const uint8_t header[HAPI_CACHE__HEADER_SIZE],
                                    const void *path, size_t path_len,
                                    const void *data, size_t data_len)
{
    uint8_t h[HAPI_CACHE__HEADER_SIZE];
    memcpy(h, header, sizeof(h));
    memset(h + 56, 0, 8);
    uint64_t seed = XXH3_64bits(h, sizeof(h));
    if (path_len)
        seed ^= XXH3_64bits(path, path_len) * UINT64_C(0x9E3779B97F4A7C15);
    return XXH3_64bits_withSeed(data, data_len, seed);
}

void hapi_cache__header_encode(uint8_t h[HAPI_CACHE__HEADER_SIZE], const hapi_source_id *id,
                               uint32_t data_len, uint32_t path_len, bool slab, uint64_t stored_ns)
{
    put_le32(h + 0, HAPI_CACHE__MAGIC);
    put_le16(h + 4, HAPI_CACHE__VERSION);
    put_le16(h + 6, (uint16_t)((path_len ? HAPI_CACHE__FLAG_HASHED_KEY : 0) |
                               (slab ? HAPI_CACHE__FLAG_SLAB : 0)));
    put_le32(h + 8, data_len);
    put_le32(h + 12, path_len);
    put_le64(h + 16, id->size);
    put_le64(h + 24, (uint64_t)id->mtime_ns);
    put_le64(h + 32, (uint64_t)id->ctime_ns);
    put_le64(h + 40, id->ino);
    put_le64(h + 48, stored_ns);
    put_le64(h + 56, 0);
}

/*
 * The slab reference of a stored value, copied out (v may point into a page
 * the caller is about to change). Returns false for an inline value or one
 * whose reference does not parse: such a value has no slot to free.
 */
bool hapi_cache__slab_ref_of(const MDB_val *v, struct slab_ref *ref)
{
    const uint8_t *p = v->mv_data;
    if (v->mv_size < HAPI_CACHE__HEADER_SIZE + HAPI_CACHE__SLAB_REF_SIZE ||
        get_le32(p) != HAPI_CACHE__MAGIC || !(get_le16(p + 6) & HAPI_CACHE__FLAG_SLAB))
        return false;
    const uint8_t *r = p + v->mv_size - HAPI_CACHE__SLAB_REF_SIZE;
    ref->slot_size = get_le32(r);
    ref->slot = get_le64(r + 8);
    ref->stamp = get_le64(r + 16);
    uint32_t data_len = get_le32(p + 8);
    return ref->slot_size != 0 && slab_sized(data_len) && ref->slot_size == slot_size_of(data_len) &&
           ref->slot <= (uint64_t)INT64_MAX / ref->slot_size - 1;
}

/*
 * Checks a stored value against the lookup: format, identity, the full path
 * for hashed keys, lengths, checksum. On success points *data and *size at the
 * feature bytes inside v; for a slab value, fills *ref and *size and returns
 * CHECK_SLAB, the checksum left to hapi_cache__slab_read(). A value in our
 * format for another identity of the source is stale; one for another path (a digest collision of a hashed key)
 * is absent; anything that does not verify is bad. The caller treats all
 * three as misses, and the next put of the path replaces the entry.
 */
enum check hapi_cache__value_check(const MDB_val *v, const hapi_source_id *id, const char *path,
                                   bool hashed, const void **data, size_t *size, struct slab_ref *ref)
{
    const uint8_t *p = v->mv_data;
    if (v->mv_size < HAPI_CACHE__HEADER_SIZE)
        return CHECK_BAD;
    if (get_le32(p + 0) != HAPI_CACHE__MAGIC || get_le16(p + 4) != HAPI_CACHE__VERSION)
        return CHECK_BAD;
    uint16_t flags = get_le16(p + 6);
    uint32_t data_len = get_le32(p + 8);
    uint32_t path_len = get_le32(p + 12);
    if (get_le64(p + 16) != id->size || (int64_t)get_le64(p + 24) != id->mtime_ns ||
        (int64_t)get_le64(p + 32) != id->ctime_ns || get_le64(p + 40) != id->ino)
        return CHECK_STALE;
    if (hashed != ((flags & HAPI_CACHE__FLAG_HASHED_KEY) != 0))
        return CHECK_BAD;
    if (hashed) {
        size_t len = strlen(path);
        if (v->mv_size < HAPI_CACHE__HEADER_SIZE + (size_t)path_len)
            return CHECK_BAD;
        if (path_len != len || memcmp(p + HAPI_CACHE__HEADER_SIZE, path, len) != 0)
            return CHECK_ABSENT;
    } else if (path_len != 0) {
        return CHECK_BAD;
    }
    size_t offset = HAPI_CACHE__HEADER_SIZE + pad16(path_len);
    if (flags & HAPI_CACHE__FLAG_SLAB) {
        /* The checksum can only be checked once the bytes are read from the slab. */
        if (v->mv_size != offset + HAPI_CACHE__SLAB_REF_SIZE || !hapi_cache__slab_ref_of(v, ref))
            return CHECK_BAD;
        *size = data_len;
        return CHECK_SLAB;
    }
    if (v->mv_size != offset + (size_t)data_len)
        return CHECK_BAD;
    if (hapi_cache__value_checksum(p, p + HAPI_CACHE__HEADER_SIZE, path_len, p + offset,
                                   data_len) != get_le64(p + 56))
        return CHECK_BAD;
    *data = p + offset;
    *size = data_len;
    return CHECK_OK;
}

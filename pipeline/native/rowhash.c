/*
 * quern's row hash: XXH3-128 of many rows in one call (quern.pipeline.integrity.rowhash loads it with ctypes).
 *
 * A batch digest (quern.pipeline.integrity.batch_digest) hashes every row of a leaf; from Python that is one
 * call per row, whose cost is mostly Python's. These loops make the same calls in C (ctypes releases
 * the GIL around each call). The hash is xxHash's own (xxhash/, version 0.8.4,
 * the release the xxhash package bundles), so the digests equal xxhash.xxh3_128_digest of each row.
 * On x86 the dispatcher picks SSE2, AVX2 or AVX-512 at run time. Built by .build/hatch_build.py.
 */
#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define QUERN_API __attribute__((visibility("default")))
#else
#define QUERN_API
#endif

#define XXH_INLINE_ALL
#include "xxhash/xxhash.h"

#if defined(QUERN_X86_DISPATCH)
#include "xxhash/xxh_x86dispatch.h"
#define QUERN_XXH3_128(p, n) XXH3_128bits_withSeed_dispatch((p), (n), 0)
#define QUERN_XXH3_128_SEEDED(p, n, s) XXH3_128bits_withSeed_dispatch((p), (n), (s))
#else
#define QUERN_XXH3_128(p, n) XXH3_128bits((p), (n))
#define QUERN_XXH3_128_SEEDED(p, n, s) XXH3_128bits_withSeed((p), (n), (s))
#endif
#include <stdlib.h>
#include <string.h>

/* The version of these functions' signatures: rowhash.py refuses a library of another. */
QUERN_API int quern_rowhash_abi(void) { return 2; }

/* The xxHash release built in (XXH_VERSION_NUMBER: 804 for 0.8.4). */
QUERN_API unsigned quern_rowhash_xxh_version(void) { return XXH_versionNumber(); }

/* XXH3-128 of n rows of width bytes, each stride bytes after the last, into out (16 bytes a row, in
 * xxHash's canonical, big-endian order, as xxhash.xxh3_128_digest gives them). */
QUERN_API void quern_xxh3_128_rows(const unsigned char *data, size_t n, size_t width, size_t stride, unsigned char *out) {
    for (size_t i = 0; i < n; i++) {
        XXH128_hash_t h = QUERN_XXH3_128(data + i * stride, width);
        XXH128_canonicalFromHash((XXH128_canonical_t *)(out + 16 * i), h);
    }
}

/* XXH3-128 of n spans of data, span i being bytes [offsets[i], offsets[i + 1]), into out as above. */
QUERN_API void quern_xxh3_128_spans(const unsigned char *data, const int64_t *offsets, size_t n, unsigned char *out) {
    for (size_t i = 0; i < n; i++) {
        XXH128_hash_t h = QUERN_XXH3_128(data + offsets[i], (size_t)(offsets[i + 1] - offsets[i]));
        XXH128_canonicalFromHash((XXH128_canonical_t *)(out + 16 * i), h);
    }
}

/* The n 16-byte digests of raw as a JSON array's items: "32 hex digits", "...", ... into out
 * (36 * n - 2 bytes; nothing for n = 0). Each byte's two digits come from a table made on each call. */
QUERN_API void quern_json_hex(const unsigned char *raw, size_t n, char *out) {
    static const char digits[] = "0123456789abcdef";
    char pairs[512];
    for (int b = 0; b < 256; b++) {
        pairs[2 * b] = digits[b >> 4];
        pairs[2 * b + 1] = digits[b & 15];
    }
    for (size_t i = 0; i < n; i++) {
        char *o = out + 36 * i;
        const unsigned char *r = raw + 16 * i;
        o[0] = '"';
        for (int j = 0; j < 16; j++) memcpy(o + 1 + 2 * j, pairs + 2 * r[j], 2);
        o[33] = '"';
        if (i + 1 < n) {
            o[34] = ',';
            o[35] = ' ';
        }
    }
}

/* SplitMix64's finaliser (quern.pipeline.order.index.hash64). */
static inline uint64_t quern_hash64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* 8 bytes as a little-endian word, and back (on any byte order). */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
static inline uint64_t quern_le64(const unsigned char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}
static inline void quern_put_le64(unsigned char *p, uint64_t w) { memcpy(p, &w, 8); }
#else
static inline uint64_t quern_le64(const unsigned char *p) {
    uint64_t w = 0;
    for (int i = 7; i >= 0; i--) w = (w << 8) | p[i];
    return w;
}
static inline void quern_put_le64(unsigned char *p, uint64_t w) {
    for (int i = 0; i < 8; i++, w >>= 8) p[i] = (unsigned char)w;
}
#endif

/* A batch's row digests and leaf digests, as batch_digest.py defines them, for a batch of numeric leaves.
 *
 * n rows; k leaves in path order, leaf i's rows being width[i] bytes each at data[i] (C order, canonical),
 * large[i] nonzero for a leaf hashed by row (over 16 bytes a row), seeds[i] its leaf digest's seed;
 * layout: L, the xxh3_64 of the batch's layout. Writes the n row digests (16 bytes each: the last part's
 * digest, as two little-endian words, each XOR the row's seed) to rows_out and the k leaf digests (xxh3_128
 * of a large leaf's parts, or of a small leaf's bytes, with its seed; canonical) to leaves_out.
 * Returns 0, or -1 when memory for the parts cannot be had (nothing is then written). */
QUERN_API int quern_batch_digests(size_t n, size_t k, const unsigned char *const *data, const size_t *width,
                                  const unsigned char *large, const uint64_t *seeds, uint64_t layout,
                                  unsigned char *rows_out, unsigned char *leaves_out) {
    size_t nlarge = 0, small_bytes = 0;
    for (size_t i = 0; i < k; i++) {
        if (large[i]) nlarge++;
        else small_bytes += width[i];
    }
    size_t words = (small_bytes + 7) / 8, stride = 8 * words;
    /* the parts (16 bytes a row per large leaf, or one of the rows' small bytes), then the rows' small
     * leaves' bytes, in path order, zero-padded to a multiple of 8 bytes a row */
    size_t parts = 16 * n * (nlarge ? nlarge : 1);
    unsigned char *buf = calloc(parts + n * stride + 1, 1);
    if (!buf) return -1;
    unsigned char *small = buf + parts;
    for (size_t i = 0, at = 0; i < k; at += large[i] ? 0 : width[i], i++) {
        if (large[i] || !width[i]) continue;
        const unsigned char *src = data[i];
        unsigned char *dst = small + at;
        size_t w = width[i];
        switch (w) { /* a fixed size: the copy is a load and a store */
        case 4: for (size_t r = 0; r < n; r++) memcpy(dst + r * stride, src + 4 * r, 4); break;
        case 8: for (size_t r = 0; r < n; r++) memcpy(dst + r * stride, src + 8 * r, 8); break;
        case 2: for (size_t r = 0; r < n; r++) memcpy(dst + r * stride, src + 2 * r, 2); break;
        case 1: for (size_t r = 0; r < n; r++) dst[r * stride] = src[r]; break;
        default: for (size_t r = 0; r < n; r++) memcpy(dst + r * stride, src + w * r, w);
        }
    }
    /* the parts, leaf after leaf */
    if (nlarge) {
        unsigned char *p = buf;
        for (size_t i = 0; i < k; i++) {
            if (!large[i]) continue;
            for (size_t r = 0; r < n; r++)
                XXH128_canonicalFromHash((XXH128_canonical_t *)(p + 16 * r), QUERN_XXH3_128(data[i] + r * width[i], width[i]));
            p += 16 * n;
        }
    }
    const uint64_t first = quern_hash64(layout);
    for (size_t r = 0; r < n; r++) {
        const unsigned char *row = small + r * stride;
        uint64_t s = layout;
        const unsigned char *last;
        if (!nlarge) { /* one part: xxh3_128 of the row's small bytes */
            XXH128_canonicalFromHash((XXH128_canonical_t *)(buf + 16 * r), QUERN_XXH3_128(row, small_bytes));
            last = buf + 16 * r;
        } else {
            if (words) {
                s = first ^ quern_le64(row);
                for (size_t j = 1; j < words; j++) s = quern_hash64(s) ^ quern_le64(row + 8 * j);
            }
            for (size_t j = 0; j + 1 < nlarge; j++) { /* the other parts, two words each */
                const unsigned char *part = buf + 16 * (j * n + r);
                s = quern_hash64(s) ^ quern_le64(part);
                s = quern_hash64(s) ^ quern_le64(part + 8);
            }
            last = buf + 16 * ((nlarge - 1) * n + r);
        }
        quern_put_le64(rows_out + 16 * r, quern_le64(last) ^ s);
        quern_put_le64(rows_out + 16 * r + 8, quern_le64(last + 8) ^ s);
    }
    /* the leaf digests */
    const unsigned char *p = buf;
    for (size_t i = 0; i < k; i++) {
        XXH128_hash_t h;
        if (large[i]) {
            h = QUERN_XXH3_128_SEEDED(p, 16 * n, seeds[i]);
            p += 16 * n;
        } else {
            h = QUERN_XXH3_128_SEEDED(data[i], n * width[i], seeds[i]);
        }
        XXH128_canonicalFromHash((XXH128_canonical_t *)(leaves_out + 16 * i), h);
    }
    free(buf);
    return 0;
}

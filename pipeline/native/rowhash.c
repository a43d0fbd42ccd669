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
#else
#define QUERN_XXH3_128(p, n) XXH3_128bits((p), (n))
#endif

/* The version of these functions' signatures: rowhash.py refuses a library of another. */
QUERN_API int quern_rowhash_abi(void) { return 1; }

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

/* The hex digit of a nibble (0-15), without a table, so that the loop below vectorises. */
static inline char quern_hex_digit(unsigned v) { return (char)(v + '0' + (((9u - v) >> 31) * ('a' - '0' - 10))); }

/* The n 16-byte digests of raw as a JSON array's items: "32 hex digits", "...", ... into out
 * (36 * n - 2 bytes; nothing for n = 0). */
QUERN_API void quern_json_hex(const unsigned char *raw, size_t n, char *out) {
    for (size_t i = 0; i < n; i++) {
        char *o = out + 36 * i;
        const unsigned char *r = raw + 16 * i;
        o[0] = '"';
        for (int j = 0; j < 16; j++) {
            o[1 + 2 * j] = quern_hex_digit(r[j] >> 4);
            o[2 + 2 * j] = quern_hex_digit(r[j] & 15u);
        }
        o[33] = '"';
        if (i + 1 < n) {
            o[34] = ',';
            o[35] = ' ';
        }
    }
}

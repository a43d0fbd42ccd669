/*
 * quern's image normalisation: (pixel - mean) / std per channel, uint8 in, float32 out.
 *
 * quern.transforms.image.normalize's arithmetic, NumPy's own: each pixel converted to float32, the
 * channel's float32 mean subtracted, the result divided by its float32 std, each step rounded to
 * float32 (no fused multiply-add: built with -ffp-contract=off), so the values equal NumPy's
 * image.astype(float32) - mean, / std. One pass over the pixels, 8 of them (8 * channels values)
 * at a time with the channels' means and stds laid out to match; an AVX2 clone on x86-64.
 */
#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define QUERN_API __attribute__((visibility("default")))
#else
#define QUERN_API
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define QUERN_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define QUERN_CLONES
#endif

#define QUERN_MAX_CHANNELS 16

/* n values of c channels (value i is channel i % c), c at most 16, into out. 0, or -1 for too many channels. */
QUERN_API QUERN_CLONES int quern_normalize_u8_f32(const uint8_t *restrict in, size_t n, int c, const float *mean,
                                                  const float *std, float *restrict out) {
    if (c < 1 || c > QUERN_MAX_CHANNELS) return -1;
    float m[8 * QUERN_MAX_CHANNELS], s[8 * QUERN_MAX_CHANNELS];
    size_t period = 8 * (size_t)c, i = 0;
    for (size_t j = 0; j < period; j++) {
        m[j] = mean[j % c];
        s[j] = std[j % c];
    }
    for (; i + period <= n; i += period)
        for (size_t j = 0; j < period; j++) out[i + j] = ((float)in[i + j] - m[j]) / s[j];
    for (size_t j = 0; i < n; i++, j++) out[i] = ((float)in[i] - m[j]) / s[j];
    return 0;
}

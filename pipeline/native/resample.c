/*
 * quern's image resize: Pillow's bilinear resample of a uint8 image, bit for bit, on packed channels.
 *
 * Part of libimage (with normalize.c); quern.transforms.image.native loads it with ctypes (the GIL is
 * released during a call) and quern.transforms.image.resampling calls it. The
 * arithmetic is Pillow's (src/libImaging/Resample.c): the same filter weights in double precision,
 * normalised and rounded to 22-bit fixed point, a horizontal pass over the rows the vertical pass
 * needs, rounded to 8 bits, then the vertical pass. Pillow does this on 4 bytes a pixel (its RGB
 * is RGBX) with one loop shape; here the channels are packed (1 to 4 or more, each a band of
 * its own, as Pillow's "L" image of each), the vertical pass runs along whole rows (a loop the
 * compiler vectorises) and integer sums are order-free, so the pixels are Pillow's. Built by
 * .build/hatch_build.py with -ffp-contract=off (no fused multiply-add: Pillow's weights exactly).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__)
#define QUERN_API __attribute__((visibility("default")))
#else
#define QUERN_API
#endif

#define PRECISION_BITS (32 - 8 - 2)

/* On x86-64 the passes are also compiled for AVX2 (8 lanes of 32-bit products, against SSE2's
 * emulated ones), the loader picking the clone the processor runs; the pixels are the same. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define QUERN_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define QUERN_CLONES
#endif

/* The version of libimage's functions' signatures (this file's and normalize.c's): native.py refuses a
 * library of another. */
QUERN_API int quern_image_abi(void) { return 1; }

static inline double bilinear(double x) {
    if (x < 0.0) x = -x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

/* Pillow's precompute_coeffs (bilinear, support 1) and normalize_coeffs_8bpc: per output pixel, its
 * first input pixel and count in bounds, its ksize fixed-point weights in kk. The kernel size, or 0. */
static int coeffs(int in_size, float in0, float in1, int out_size, int **boundsp, int32_t **kkp) {
    double scale = (double)(in1 - in0) / out_size, filterscale = scale < 1.0 ? 1.0 : scale;
    double support = 1.0 * filterscale, inv = 1.0 / filterscale;
    int ksize = (int)ceil(support) * 2 + 1;
    double *k = malloc((size_t)ksize * sizeof(double));
    int32_t *kk = malloc((size_t)out_size * (size_t)ksize * sizeof(int32_t));
    int *bounds = malloc((size_t)out_size * 2 * sizeof(int));
    if (!k || !kk || !bounds) {
        free(k), free(kk), free(bounds);
        return 0;
    }
    for (int xx = 0; xx < out_size; xx++) {
        double center = in0 + (xx + 0.5) * scale, ww = 0.0;
        int xmin = (int)(center - support + 0.5), xmax = (int)(center + support + 0.5), x;
        if (xmin < 0) xmin = 0;
        if (xmax > in_size) xmax = in_size;
        xmax -= xmin;
        for (x = 0; x < xmax; x++) {
            k[x] = bilinear((x + xmin - center + 0.5) * inv);
            ww += k[x];
        }
        for (x = 0; x < ksize; x++) {
            double w = x < xmax ? (ww != 0.0 ? k[x] / ww : k[x]) : 0.0;
            kk[xx * ksize + x] = w < 0 ? (int32_t)(-0.5 + w * (1 << PRECISION_BITS)) : (int32_t)(0.5 + w * (1 << PRECISION_BITS));
        }
        bounds[xx * 2] = xmin;
        bounds[xx * 2 + 1] = xmax;
    }
    free(k);
    *boundsp = bounds;
    *kkp = kk;
    return ksize;
}

static inline uint8_t clip8(int32_t ss) {
    int32_t v = ss >> PRECISION_BITS;
    return (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
}

/* One row's horizontal pass, c channels (a constant where inlined): for each output pixel, its taps
 * in turn, each adding to the c sums of the pixel. */
static inline void horizontal_row(const uint8_t *in, uint8_t *out, int out_w, int c, int ksize, const int *bounds,
                                  const int32_t *kk) {
    int32_t ss[8];
    for (int xx = 0; xx < out_w; xx++) {
        const uint8_t *p = in + (size_t)bounds[xx * 2] * c;
        const int32_t *k = kk + xx * ksize;
        int n = bounds[xx * 2 + 1];
        for (int ch = 0; ch < c; ch++) ss[ch] = 1 << (PRECISION_BITS - 1);
        for (int x = 0; x < n; x++, p += c)
            for (int ch = 0; ch < c; ch++) ss[ch] += p[ch] * k[x];
        for (int ch = 0; ch < c; ch++) out[xx * c + ch] = clip8(ss[ch]);
    }
}

/* The same for any number of channels, one at a time. */
static void horizontal_row_any(const uint8_t *in, uint8_t *out, int out_w, int c, int ksize, const int *bounds,
                               const int32_t *kk) {
    for (int xx = 0; xx < out_w; xx++) {
        const uint8_t *p = in + (size_t)bounds[xx * 2] * c;
        const int32_t *k = kk + xx * ksize;
        for (int ch = 0; ch < c; ch++) {
            int32_t ss = 1 << (PRECISION_BITS - 1);
            for (int x = 0; x < bounds[xx * 2 + 1]; x++) ss += p[x * c + ch] * k[x];
            out[xx * c + ch] = clip8(ss);
        }
    }
}

QUERN_CLONES static void horizontal(const uint8_t *in, ptrdiff_t stride, int rows, int c, uint8_t *out, int out_w, int ksize,
                       const int *bounds, const int32_t *kk) {
    for (int y = 0; y < rows; y++) {
        const uint8_t *row = in + y * stride;
        uint8_t *o = out + (size_t)y * out_w * c;
        if (c == 3)
            horizontal_row(row, o, out_w, 3, ksize, bounds, kk);
        else if (c == 1)
            horizontal_row(row, o, out_w, 1, ksize, bounds, kk);
        else if (c == 4)
            horizontal_row(row, o, out_w, 4, ksize, bounds, kk);
        else if (c == 2)
            horizontal_row(row, o, out_w, 2, ksize, bounds, kk);
        else
            horizontal_row_any(row, o, out_w, c, ksize, bounds, kk);
    }
}

QUERN_CLONES static void vertical(const uint8_t *in, ptrdiff_t stride, size_t width, uint8_t *restrict out, int out_h,
                                  int ksize, const int *bounds, const int32_t *kk, int32_t *restrict acc) {
    for (int yy = 0; yy < out_h; yy++) {
        const int32_t *k = kk + yy * ksize;
        const uint8_t *first = in + (ptrdiff_t)bounds[yy * 2] * stride;
        for (size_t i = 0; i < width; i++) acc[i] = 1 << (PRECISION_BITS - 1);
        for (int y = 0; y < bounds[yy * 2 + 1]; y++) {
            const uint8_t *restrict row = first + y * stride;
            int32_t w = k[y];
            for (size_t i = 0; i < width; i++) acc[i] += row[i] * w;
        }
        uint8_t *o = out + (size_t)yy * width;
        for (size_t i = 0; i < width; i++) o[i] = clip8(acc[i]);
    }
}

/* An h x w image of c uint8 channels whose rows are stride bytes apart (each row's pixels packed), its
 * box (x0, y0, x1, y1) resized to out_h x out_w with Pillow's bilinear filter, into out (packed):
 * the vertical pass first (over the columns the horizontal pass reads), rounded to 8 bits, then the
 * horizontal pass; a pass is left out where its axis keeps its size and box, as Pillow does. 0, or -1
 * when memory ran out. */
QUERN_API int quern_resize_bilinear_u8(const uint8_t *in, int h, int w, int c, ptrdiff_t stride, float x0, float y0,
                                       float x1, float y1, uint8_t *out, int out_h, int out_w) {
    int *bv = NULL, *bh = NULL;
    int32_t *kv = NULL, *kh = NULL, *acc = NULL;
    uint8_t *temp = NULL;
    int rc = -1, kvsize = 0, khsize = 0, first = 0, last = w;
    int need_h = out_w != w || x0 != 0 || x1 != out_w, need_v = out_h != h || y0 != 0 || y1 != out_h;
    if (need_h) {
        if (!(khsize = coeffs(w, x0, x1, out_w, &bh, &kh))) goto done;
        first = bh[0];  /* the columns the horizontal pass reads */
        last = bh[out_w * 2 - 2] + bh[out_w * 2 - 1];
        for (int i = 0; i < out_w; i++) bh[i * 2] -= first;
    }
    const uint8_t *src = in + (ptrdiff_t)first * c;
    ptrdiff_t src_stride = stride;
    int rows = h;
    size_t width = (size_t)(last - first) * c;
    if (need_v) {
        if (!(kvsize = coeffs(h, y0, y1, out_h, &bv, &kv))) goto done;
        uint8_t *dst = need_h ? (temp = malloc((size_t)out_h * width + 1)) : out;
        if (!dst || !(acc = malloc(width * sizeof(int32_t) + 1))) goto done;
        vertical(src, stride, width, dst, out_h, kvsize, bv, kv, acc);
        src = dst;
        src_stride = (ptrdiff_t)width;
        rows = out_h;
    }
    if (need_h)
        horizontal(src, src_stride, rows, c, out, out_w, khsize, bh, kh);
    else if (!need_v)
        for (int y = 0; y < h; y++) memcpy(out + y * width, src + y * src_stride, width);
    rc = 0;
done:
    free(bv), free(kv), free(bh), free(kh), free(acc), free(temp);
    return rc;
}

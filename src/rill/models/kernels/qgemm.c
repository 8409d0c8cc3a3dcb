/* Quantized matrix products for x86 CPUs with AVX-512 VNNI: y[M, N] = x[M, K] @ w[N, K]^T.
 *
 * Weights are unsigned bytes u (4-bit values 0..15, or int8 values + 128) with a scale s and
 * an offset z per output row and group of 32 inputs: w = s * u + z. Activations are rounded
 * to int8 per row and group of 32 (x ~ dx * xq), so one group's contribution is
 *     dx * (s * sum(u * xq) + z * sum(xq)),
 * and sum(u * xq) is what VPDPBUSD computes (unsigned bytes times signed bytes, four at a
 * time into 32-bit lanes). This is the scheme llama.cpp's CPU kernels use; the code and the
 * layout are rill's own (see rill/models/qkernel.py for the layout and the Python side).
 *
 * Layout of one block of 16 output rows (lane l = row % 16), groups g of 32 inputs:
 *   4-bit: per group 4 chunks of 64 bytes; chunk c, lane l, byte i holds input 8c+i (low
 *          nibble) and 8c+4+i (high nibble) of row l.
 *   8-bit: per group 8 chunks of 64 bytes; chunk c, lane l, byte i holds input 4c+i of row l.
 *   scales and offsets: fp16, [block][group][16].
 *
 * 6-bit weights (a GGUF Q6_K tensor as it is: w = d * sub * (u - 32), u = 0..63, an int8 sub
 * per 16 inputs and an fp16 d per 256) keep their 6.5625 bits a weight:
 *   per group 4 chunks of 64 bytes of low nibbles, laid out as the 4-bit ones (operand o =
 *          2c + nibble covers inputs 4o..4o+3), then 2 vectors of 64 bytes of high bit pairs:
 *          vector o/4, lane l, byte i, bits 2(o%4)..2(o%4)+1 are the top two bits of input
 *          4o+i of row l;
 *   "scales": int8 subs [block][group][half][16]; "offsets": fp16 d [block][group/8][16].
 * The offset -32 d sub takes the sum of each half group's int8 activations (dsh).
 *
 * "bits 5" is 4-bit values with a GGUF Q4_K tensor's own scales (w = d sc u - dmin mn, 6-bit
 * sc and mn per 32 inputs, fp16 d and dmin per 256): values laid out as the 4-bit ones,
 * "scales" u8 [block][group][sc, mn][16], "offsets" fp16 [block][group/8][d, -dmin][16]:
 * 4.625 bits a weight where fp16 scales and offsets per 32 take 5.
 * Blocks are consecutive; rows past N in the last block are zero and never stored.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define GROUP 32

/* How far ahead of its reads a 4- or 6-bit block asks for its weights (measured on an 8960-wide
 * product: 4 KB ahead made one row 14 % faster than 1 KB and the same as 8 KB; the hardware
 * prefetcher alone left the 4-bit kernel at 30 GB/s where the 8-bit one read 38, and the
 * 8-bit kernel got slower with it). */
#ifndef PF_BYTES
#define PF_BYTES 4096
#endif

static inline void prefetch(const void *p, int bytes)
{
    for (int i = 0; i < bytes; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T0);
}



/* What is done to each row of x before it is rounded (PRE_*):
 *   PRE_NONE:   x [M, K] as it is;
 *   PRE_RMS:    x [M, K] times 1/sqrt(mean(x^2) + eps), times norm [K] (float32): an RMS norm,
 *               so the normalised rows are never written out;
 *   PRE_SWIGLU: x [M, 2K] holds gate and up halves; silu(gate) * up. */
enum { PRE_NONE = 0, PRE_RMS = 1, PRE_SWIGLU = 2 };

/* Round each (prepared) row of x to int8 per group of 32: xq [M, K], dx [M, K/32] the scale,
 * dsx [M, K/32] the scale times the sum of the group's int8 values, dsh [M, K/32, 2] the
 * same for each half of the group (16 values). x is float32, or bfloat16
 * when x_bf16. Returns 0, or -1 when scratch could not be had. */
static int quantize_rows(const void *x, int x_bf16, int64_t M, int64_t K, int8_t *xq, float *dx, float *dsx,
                         float *dsh, int pre, const float *norm, float eps)
{
    const int64_t G = K / GROUP;
    const int64_t stride = pre == PRE_SWIGLU ? 2 * K : K;
    float *inv_rms = NULL;
    if (pre == PRE_RMS) {
        inv_rms = malloc((size_t)M * sizeof(float));
        if (inv_rms == NULL) return -1;
#pragma omp parallel for schedule(static) if (M * K >= 65536)
        for (int64_t m = 0; m < M; m++) {
            __m512 ss = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += 16) {
                const __m512 v = load_ps(x, x_bf16, m * K + k);
                ss = _mm512_fmadd_ps(v, v, ss);
            }
            inv_rms[m] = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)K + eps);
        }
    }
#pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t mg = 0; mg < M * G; mg++) {
        const int64_t m = mg / G, g = mg % G;
        const int64_t at = m * stride + g * GROUP;
        __m512 a = load_ps(x, x_bf16, at), b = load_ps(x, x_bf16, at + 16);
        if (pre == PRE_RMS) {
            const __m512 r = _mm512_set1_ps(inv_rms[m]);
            a = _mm512_mul_ps(_mm512_mul_ps(a, r), _mm512_loadu_ps(norm + g * GROUP));
            b = _mm512_mul_ps(_mm512_mul_ps(b, r), _mm512_loadu_ps(norm + g * GROUP + 16));
        } else if (pre == PRE_SWIGLU) {
            const __m512 one = _mm512_set1_ps(1.0f);
            const __m512 ua = load_ps(x, x_bf16, at + K), ub = load_ps(x, x_bf16, at + K + 16);
            a = _mm512_mul_ps(_mm512_div_ps(a, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), a)))), ua);
            b = _mm512_mul_ps(_mm512_div_ps(b, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), b)))), ub);
        }
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        float d = amax / 127.0f;
        float id = d > 0.0f ? 1.0f / d : 0.0f;
        __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
        __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)(xq + m * K + g * GROUP), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(xq + m * K + g * GROUP + 16), _mm512_cvtsepi32_epi8(qb));
        const int sum_a = _mm512_reduce_add_epi32(qa), sum_b = _mm512_reduce_add_epi32(qb);
        dx[mg] = d;
        dsx[mg] = d * (float)(sum_a + sum_b);
        dsh[2 * mg] = d * (float)sum_a;
        dsh[2 * mg + 1] = d * (float)sum_b;
    }
    free(inv_rms);
    return 0;
}

static inline __m512i bcast4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* The 16 outputs of each of MT activation rows (fewer in the last block, where n0 + 16 > N). */
static inline void store_rows(const __m512 *acc, int mt, float *y, int64_t m0, int64_t N, int64_t n0)
{
    const int64_t valid = N - n0 < 16 ? N - n0 : 16;
    const __mmask16 mask = (__mmask16)((1u << valid) - 1u);
    for (int i = 0; i < mt; i++) _mm512_mask_storeu_ps(y + (m0 + i) * N + n0, mask, acc[i]);
}

/* One block of 16 rows against MT activation rows starting at m0. */
#define DEFINE_BLOCK(MT)                                                                                  \
    static void block_##MT(int bits, const uint8_t *wb, const uint16_t *sb, const uint16_t *zb, int64_t K, \
                           const int8_t *xq, const float *dx, const float *dsx, int64_t m0, float *y,        \
                           int64_t N, int64_t n0)                                                           \
    {                                                                                                     \
        const int64_t G = K / GROUP;                                                                      \
        const __m512i low = _mm512_set1_epi8(0x0F);                                                       \
        __m512 acc[MT], d = _mm512_setzero_ps(), dm = _mm512_setzero_ps();                                \
        for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();                                        \
        for (int64_t g = 0; g < G; g++) {                                                                 \
            __m512i dot[MT];                                                                              \
            for (int i = 0; i < MT; i++) dot[i] = _mm512_setzero_si512();                                 \
            if (bits == 4 || bits == 5) {                                                                 \
                const uint8_t *w = wb + g * 256;                                                          \
                prefetch(w + PF_BYTES, 256);                                                              \
                for (int c = 0; c < 4; c++) {                                                             \
                    __m512i v = _mm512_loadu_si512((const void *)(w + c * 64));                           \
                    __m512i lo = _mm512_and_si512(v, low);                                                \
                    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);                          \
                    for (int i = 0; i < MT; i++) {                                                        \
                        const int8_t *xr = xq + (m0 + i) * K + g * GROUP + c * 8;                         \
                        dot[i] = _mm512_dpbusd_epi32(dot[i], lo, bcast4(xr));                             \
                        dot[i] = _mm512_dpbusd_epi32(dot[i], hi, bcast4(xr + 4));                         \
                    }                                                                                     \
                }                                                                                         \
            } else {                                                                                      \
                const uint8_t *w = wb + g * 512;                                                          \
                for (int c = 0; c < 8; c++) {                                                             \
                    __m512i v = _mm512_loadu_si512((const void *)(w + c * 64));                           \
                    for (int i = 0; i < MT; i++) {                                                        \
                        const int8_t *xr = xq + (m0 + i) * K + g * GROUP + c * 4;                         \
                        dot[i] = _mm512_dpbusd_epi32(dot[i], v, bcast4(xr));                              \
                    }                                                                                     \
                }                                                                                         \
            }                                                                                             \
            __m512 s, z;                                                                                  \
            if (bits == 5) { /* 6-bit sub-scales and mins (u8) of fp16 d and -dmin per 8 groups */        \
                const uint8_t *sm = (const uint8_t *)sb + g * 32;                                         \
                if (g % 2 == 0) prefetch(sm + PF_BYTES / 8, 64);                                          \
                if (g % 8 == 0) {                                                                         \
                    d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(zb + g / 8 * 32)));         \
                    dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(zb + g / 8 * 32 + 16)));   \
                }                                                                                         \
                s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sm)))); \
                z = _mm512_mul_ps(dm, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sm + 16))))); \
            } else {                                                                                      \
                if (bits == 4 && g % 2 == 0) { /* 8-bit weights stream fast enough without */             \
                    prefetch(sb + (g + PF_BYTES / 256) * 16, 64);                                         \
                    prefetch(zb + (g + PF_BYTES / 256) * 16, 64);                                         \
                }                                                                                         \
                s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + g * 16)));                 \
                z = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(zb + g * 16)));                 \
            }                                                                                             \
            for (int i = 0; i < MT; i++) {                                                                \
                const int64_t mg = (m0 + i) * G + g;                                                      \
                __m512 t = _mm512_mul_ps(s, _mm512_cvtepi32_ps(dot[i]));                                  \
                acc[i] = _mm512_fmadd_ps(t, _mm512_set1_ps(dx[mg]), acc[i]);                              \
                acc[i] = _mm512_fmadd_ps(z, _mm512_set1_ps(dsx[mg]), acc[i]);                             \
            }                                                                                             \
        }                                                                                                 \
        store_rows(acc, MT, y, m0, N, n0);                                                                \
    }

DEFINE_BLOCK(1)
DEFINE_BLOCK(2)
DEFINE_BLOCK(3)
DEFINE_BLOCK(4)

/* Top bit pairs of operand j (0..3) of a high-bit vector, moved to bits 4-5 of each byte
 * (the 16-bit shifts carry neighbouring bits only into bits the mask drops). */
static inline __m512i high_pair(__m512i h, int j)
{
    const __m512i m = _mm512_set1_epi8(0x30);
    switch (j) {
    case 0: return _mm512_and_si512(_mm512_slli_epi16(h, 4), m);
    case 1: return _mm512_and_si512(_mm512_slli_epi16(h, 2), m);
    case 2: return _mm512_and_si512(h, m);
    default: return _mm512_and_si512(_mm512_srli_epi16(h, 2), m);
    }
}

/* One block of 16 rows of 6-bit weights against MT activation rows starting at m0. */
#define DEFINE_BLOCK6(MT)                                                                                 \
    static void block6_##MT(const uint8_t *wb, const int8_t *sb, const uint16_t *db, int64_t K,           \
                            const int8_t *xq, const float *dx, const float *dsh, int64_t m0, float *y,     \
                            int64_t N, int64_t n0)                                                        \
    {                                                                                                     \
        const int64_t G = K / GROUP;                                                                      \
        const __m512i low = _mm512_set1_epi8(0x0F);                                                       \
        __m512 acc[MT];                                                                                   \
        __m512 d = _mm512_setzero_ps();                                                                   \
        for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();                                        \
        for (int64_t g = 0; g < G; g++) {                                                                 \
            if (g % 8 == 0) d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(db + g / 8 * 16))); \
            __m512i dot[2][MT];                                                                           \
            for (int i = 0; i < MT; i++) dot[0][i] = dot[1][i] = _mm512_setzero_si512();                  \
            const uint8_t *w = wb + g * 384;                                                              \
            prefetch(w + PF_BYTES, 384);                                                                  \
            if (g % 2 == 0) prefetch(sb + (g + PF_BYTES / 256) * 32, 64);                                 \
            const __m512i h[2] = {_mm512_loadu_si512((const void *)(w + 256)),                            \
                                  _mm512_loadu_si512((const void *)(w + 320))};                           \
            for (int c = 0; c < 4; c++) {                                                                 \
                const __m512i v = _mm512_loadu_si512((const void *)(w + c * 64));                         \
                const __m512i hv = h[c / 2];                                                              \
                const __m512i lo = _mm512_or_si512(_mm512_and_si512(v, low), high_pair(hv, 2 * (c % 2))); \
                const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low),        \
                                                   high_pair(hv, 2 * (c % 2) + 1));                       \
                for (int i = 0; i < MT; i++) {                                                            \
                    const int8_t *xr = xq + (m0 + i) * K + g * GROUP + c * 8;                             \
                    dot[c / 2][i] = _mm512_dpbusd_epi32(dot[c / 2][i], lo, bcast4(xr));                   \
                    dot[c / 2][i] = _mm512_dpbusd_epi32(dot[c / 2][i], hi, bcast4(xr + 4));               \
                }                                                                                         \
            }                                                                                             \
            const __m128i subs_a = _mm_loadu_si128((const __m128i *)(sb + g * 32));                      \
            const __m128i subs_b = _mm_loadu_si128((const __m128i *)(sb + g * 32 + 16));                 \
            const __m512 sa = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(subs_a)));        \
            const __m512 sbv = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(subs_b)));       \
            for (int i = 0; i < MT; i++) {                                                                \
                const int64_t mg = (m0 + i) * G + g;                                                      \
                __m512 t = _mm512_fmadd_ps(sa, _mm512_cvtepi32_ps(dot[0][i]),                             \
                                           _mm512_mul_ps(sbv, _mm512_cvtepi32_ps(dot[1][i])));            \
                acc[i] = _mm512_fmadd_ps(t, _mm512_set1_ps(dx[mg]), acc[i]);                              \
                acc[i] = _mm512_fmadd_ps(sa, _mm512_set1_ps(-32.0f * dsh[2 * mg]), acc[i]);               \
                acc[i] = _mm512_fmadd_ps(sbv, _mm512_set1_ps(-32.0f * dsh[2 * mg + 1]), acc[i]);          \
            }                                                                                             \
        }                                                                                                 \
        store_rows(acc, MT, y, m0, N, n0);                                                                \
    }

DEFINE_BLOCK6(1)
DEFINE_BLOCK6(2)
DEFINE_BLOCK6(3)
DEFINE_BLOCK6(4)

/* Every activation row against one block of weights: four rows a call, then the rest
 * (BLOCK##_MT takes the arguments given, then m0, y, N and the block's first row). */
#define OVER_ROWS(BLOCK, ...)                                                                             \
    do {                                                                                                  \
        int64_t m0 = 0;                                                                                   \
        for (; m0 + 4 <= M; m0 += 4) BLOCK##_4(__VA_ARGS__, m0, y, N, b * 16);                            \
        switch (M - m0) {                                                                                 \
        case 3: BLOCK##_3(__VA_ARGS__, m0, y, N, b * 16); break;                                          \
        case 2: BLOCK##_2(__VA_ARGS__, m0, y, N, b * 16); break;                                          \
        case 1: BLOCK##_1(__VA_ARGS__, m0, y, N, b * 16); break;                                          \
        default: break;                                                                                   \
        }                                                                                                 \
    } while (0)

/* Products of at least DYNAMIC_MIN_ROWS activation rows hand their weight blocks out in chunks
 * to whichever thread is free (rill_set_schedule(1)), instead of half to each thread: where the
 * engine shares its cores with other busy processes, a thread they preempt no longer stalls
 * the product until it runs again. Fewer rows stay static: their products are bound by the
 * weights' read, which a contiguous half per thread streams best. */
#define DYNAMIC_MIN_ROWS 8
static int schedule_dynamic = 0;

int rill_set_schedule(int dynamic)
{
    schedule_dynamic = dynamic != 0;
    return 0;
}

/* One block of 16 weight rows (block b) times every activation row. */
static void qgemm_block(int bits, const uint8_t *w, const void *s, const uint16_t *z, int64_t N, int64_t K,
                        const int8_t *xq, const float *dx, const float *dsx, const float *dsh, int64_t M, float *y,
                        int64_t b, int64_t G, int64_t block_bytes)
{
    const uint8_t *wb = w + b * block_bytes;
    if (bits == 6) {
        OVER_ROWS(block6, wb, (const int8_t *)s + b * G * 32, z + b * (G / 8) * 16, K, xq, dx, dsh);
    } else if (bits == 5) {
        /* u8 sub-scales and mins [block][group][2][16], fp16 [block][group/8][2][16] */
        OVER_ROWS(block, bits, wb, (const uint16_t *)((const uint8_t *)s + b * G * 32), z + b * (G / 8) * 32, K,
                  xq, dx, dsx);
    } else {
        OVER_ROWS(block, bits, wb, (const uint16_t *)s + b * G * 16, z + b * G * 16, K, xq, dx, dsx);
    }
}

/* y [M, N] float32 = dequantized activations (xq, dx, dsx, dsh from quantize_rows) times the
 * blocked weights w (bits 4, 5, 6 or 8) with scales s and offsets z. */
static void qgemm(int bits, const uint8_t *w, const void *s, const uint16_t *z, int64_t N, int64_t K,
                  const int8_t *xq, const float *dx, const float *dsx, const float *dsh, int64_t M, float *y)
{
    const int64_t G = K / GROUP;
    const int64_t blocks = (N + 15) / 16;
    const int64_t block_bytes = G * (bits == 4 || bits == 5 ? 256 : bits == 6 ? 384 : 512);
    if (schedule_dynamic && M >= DYNAMIC_MIN_ROWS) {
        const int64_t chunk = blocks / 16 > 1 ? blocks / 16 : 1; /* about 16 chunks a product */
#pragma omp parallel for schedule(dynamic, chunk)
        for (int64_t b = 0; b < blocks; b++) qgemm_block(bits, w, s, z, N, K, xq, dx, dsx, dsh, M, y, b, G, block_bytes);
    } else {
#pragma omp parallel for schedule(static)
        for (int64_t b = 0; b < blocks; b++) qgemm_block(bits, w, s, z, N, K, xq, dx, dsx, dsh, M, y, b, G, block_bytes);
    }
}

/* y [M, N] = pre(x) [M, K] @ w^T in one call: x and y float32, or both bfloat16 when x_bf16
 * (y rounded to nearest even); pre, norm and eps as quantize_rows takes them (x is [M, 2K]
 * for PRE_SWIGLU). Scratch for the rounded activations comes from malloc; returns 0, or -1
 * when it could not be had (y untouched). */
int rill_linear(int bits, const uint8_t *w, const void *s, const uint16_t *z, int64_t N, int64_t K,
                const void *x, int x_bf16, int64_t M, void *y, int pre, const float *norm, float eps)
{
    const int64_t G = K / GROUP;
    int8_t *xq = malloc((size_t)(M * K));
    float *dx = malloc((size_t)(M * G) * sizeof(float));
    float *dsx = malloc((size_t)(M * G) * sizeof(float));
    float *dsh = malloc((size_t)(2 * M * G) * sizeof(float));
    float *yf = x_bf16 ? malloc((size_t)(M * N) * sizeof(float)) : (float *)y;
    int status = -1;
    if (xq && dx && dsx && dsh && yf && quantize_rows(x, x_bf16, M, K, xq, dx, dsx, dsh, pre, norm, eps) == 0) {
        qgemm(bits, w, s, z, N, K, xq, dx, dsx, dsh, M, yf);
        if (x_bf16) {
            uint16_t *yb = (uint16_t *)y;
            const int64_t total = M * N, full = total / 16 * 16;
#pragma omp parallel for schedule(static) if (total >= 65536)
            for (int64_t i = 0; i < full; i += 16) store_ps(yb, 1, i, _mm512_loadu_ps(yf + i));
            if (full < total) {
                const __mmask16 rest = (__mmask16)((1u << (total - full)) - 1u);
                _mm256_mask_storeu_epi16(yb + full, rest, to_bf16(_mm512_maskz_loadu_ps(rest, yf + full)));
            }
        }
        status = 0;
    }
    free(xq);
    free(dx);
    free(dsx);
    free(dsh);
    if (x_bf16) free(yf);
    return status;
}

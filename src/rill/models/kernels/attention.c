/* One decode step of attention for rows that each add one token (AVX-512F).
 *
 * For decode row b (physical KV row b), this does in one call what the model's torch path
 * does in a dozen operations:
 *   1. RoPE (rotate-half layout) on the row's query heads and key heads, rounded as torch
 *      rounds them (x*cos and rotated*sin each to the tensor dtype, then their sum);
 *   2. write the rotated keys and the values at position pos[b] of the row's cache;
 *   3. attend each query head over the keys lo..pos[b] of its KV head (lo = pos - window + 1
 *      with a sliding window, else 0): float32 scores, softmax, weighted sum of values;
 *      the result is rounded once to the tensor dtype.
 *
 * Layouts (all contiguous; "elem" is float32, or bfloat16 when bf16):
 *   qkv  [B, (H + 2 KVH) * D]: query heads, then key heads, then value heads;
 *   cos, sin [B, D]; pos [B] int64;
 *   caches [rows, KVH, max_len, D]: token b's row is rows[b], or b when rows is NULL;
 *   out [B, H * D]. Query head h reads KV head h / (H / KVH).
 * D must be a multiple of 32. Work items are (row, KV head) pairs, spread over OpenMP threads.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define MAX_D 256

/* Rotate one head x (D values at x_at) into out (float32, rounded to the dtype's precision). */
static void rope(const void *x, int bf16, int64_t x_at, const void *cos, const void *sin, int64_t cs_at, int64_t D,
                 float *out)
{
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i += 16) {
        const __m512 x1 = load_ps(x, bf16, x_at + i), x2 = load_ps(x, bf16, x_at + half + i);
        const __m512 c1 = load_ps(cos, bf16, cs_at + i), c2 = load_ps(cos, bf16, cs_at + half + i);
        const __m512 s1 = load_ps(sin, bf16, cs_at + i), s2 = load_ps(sin, bf16, cs_at + half + i);
        /* torch: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype. */
        __m512 a1 = _mm512_mul_ps(x1, c1), b1 = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), s1);
        __m512 a2 = _mm512_mul_ps(x2, c2), b2 = _mm512_mul_ps(x1, s2);
        if (bf16) {
            a1 = round_bf16(a1), b1 = round_bf16(b1), a2 = round_bf16(a2), b2 = round_bf16(b2);
        }
        __m512 r1 = _mm512_add_ps(a1, b1), r2 = _mm512_add_ps(a2, b2);
        if (bf16) {
            r1 = round_bf16(r1), r2 = round_bf16(r2);
        }
        _mm512_storeu_ps(out + i, r1);
        _mm512_storeu_ps(out + half + i, r2);
    }
}

/* s[0..n) = softmax(s), in place, 16 lanes at a time. */
static void softmax(float *s, int64_t n)
{
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t l = 0; l < n; l += 16) {
        const __mmask16 m = n - l >= 16 ? 0xFFFF : (__mmask16)((1u << (n - l)) - 1u);
        top = _mm512_mask_max_ps(top, m, top, _mm512_maskz_loadu_ps(m, s + l));
    }
    const __m512 t = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (int64_t l = 0; l < n; l += 16) {
        const __mmask16 m = n - l >= 16 ? 0xFFFF : (__mmask16)((1u << (n - l)) - 1u);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + l), t));
        _mm512_mask_storeu_ps(s + l, m, e);
        total = _mm512_mask_add_ps(total, m, total, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    for (int64_t l = 0; l < n; l += 16) {
        const __mmask16 m = n - l >= 16 ? 0xFFFF : (__mmask16)((1u << (n - l)) - 1u);
        _mm512_mask_storeu_ps(s + l, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + l), inv));
    }
}

/* The lane sums of 16 vectors in one vector: lane n holds the sum of in[n]'s lanes. Every
 * vector's lanes are added in the same order whatever its place, so a key's score does not
 * depend on which block of 16 it falls in. A tree of 15 adds, where sixteen horizontal sums
 * would each wait on the last. */
static inline __m512 sum16(const __m512 *in)
{
    __m512 a[8], c[4], e[2];
    for (int i = 0; i < 8; i++) /* 128-bit lanes (x0+x2, x1+x3, y0+y2, y1+y3) */
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(in[2 * i], in[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(in[2 * i], in[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++) /* 128-bit lane k: four partial sums of in[4i + k] */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++) /* lane k, elements (0, 2): in[8i + k]; (1, 3): in[8i + 4 + k] */
        e[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[2 * i], c[2 * i + 1]), _mm512_unpackhi_ps(c[2 * i], c[2 * i + 1]));
    /* element m of 128-bit lane k: the sum of in[k + 4m] */
    const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, t);
}

/* Weighted values of up to four heads over 16 C lanes of D from lane i (C = 2 or 4): each
 * head's sum over the keys in order, its accumulators held in registers across the keys. */
#define WEIGHTED_VALUES(J, C)                                                                                          \
    static void weighted_##J##_##C(const float *s, int64_t L, const void *v_cache, int bf16, int64_t at, int64_t D,     \
                                   void *out, int64_t out_at)                                                          \
    {                                                                                                                  \
        __m512 acc[J][C];                                                                                              \
        for (int j = 0; j < J; j++)                                                                                    \
            for (int c = 0; c < C; c++) acc[j][c] = _mm512_setzero_ps();                                               \
        for (int64_t l = 0; l < L; l++) {                                                                              \
            __m512 v[C];                                                                                               \
            for (int c = 0; c < C; c++) v[c] = load_ps(v_cache, bf16, at + l * D + 16 * c);                           \
            for (int j = 0; j < J; j++) {                                                                              \
                const __m512 w = _mm512_set1_ps(s[j * L + l]);                                                         \
                for (int c = 0; c < C; c++) acc[j][c] = _mm512_fmadd_ps(w, v[c], acc[j][c]);                           \
            }                                                                                                          \
        }                                                                                                              \
        for (int j = 0; j < J; j++)                                                                                    \
            for (int c = 0; c < C; c++) store_ps(out, bf16, out_at + j * D + 16 * c, acc[j][c]);                       \
    }
WEIGHTED_VALUES(1, 2)
WEIGHTED_VALUES(2, 2)
WEIGHTED_VALUES(3, 2)
WEIGHTED_VALUES(4, 2)
WEIGHTED_VALUES(1, 4)
WEIGHTED_VALUES(2, 4)
WEIGHTED_VALUES(3, 4)
WEIGHTED_VALUES(4, 4)

typedef void (*weighted_fn)(const float *, int64_t, const void *, int, int64_t, int64_t, void *, int64_t);
static const weighted_fn WEIGHTED[2][4] = {
    {weighted_1_2, weighted_2_2, weighted_3_2, weighted_4_2},
    {weighted_1_4, weighted_2_4, weighted_3_4, weighted_4_4},
};

/* Attention of one (token, KV head) item whose G query heads, rotated, are q: scores over the
 * keys lo..p of the cache head at head_at, softmax, weighted values into out. s has room for
 * G * L scores plus G * 16 vectors of partial sums. */
static void attend(const float (*q)[MAX_D], int64_t G, int64_t D, int bf16, const void *k_cache,
                   const void *v_cache, int64_t head_at, int64_t lo, int64_t L, float scale, float *s, void *out,
                   int64_t out_at)
{
    /* Scores 16 keys at a time: each key's chunks read once for every head of the group, each
     * head's 16 products summed in one tree (sum16). */
    __m512 *part = (__m512 *)(s + ((G * L + 15) & ~(int64_t)15)); /* [G][16], 64-byte aligned */
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t l0 = 0; l0 < L; l0 += 16) {
        const int64_t n = L - l0 < 16 ? L - l0 : 16;
        for (int64_t t = 0; t < 16; t++) {
            if (t >= n) {
                for (int64_t j = 0; j < G; j++) part[j * 16 + t] = _mm512_setzero_ps();
                continue;
            }
            const int64_t k_at = head_at + (lo + l0 + t) * D;
            for (int64_t j = 0; j < G; j++) {
                __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
                for (int64_t i = 0; i < D; i += 32) {
                    even = _mm512_fmadd_ps(_mm512_loadu_ps(q[j] + i), load_ps(k_cache, bf16, k_at + i), even);
                    odd = _mm512_fmadd_ps(_mm512_loadu_ps(q[j] + i + 16), load_ps(k_cache, bf16, k_at + i + 16), odd);
                }
                part[j * 16 + t] = _mm512_add_ps(even, odd);
            }
        }
        const __mmask16 m = n == 16 ? 0xFFFF : (__mmask16)((1u << n) - 1u);
        for (int64_t j = 0; j < G; j++) _mm512_mask_storeu_ps(s + j * L + l0, m, _mm512_mul_ps(vscale, sum16(part + j * 16)));
    }
    for (int64_t j = 0; j < G; j++) softmax(s + j * L, L);
    /* Values: up to four heads and 64 lanes a pass, so every key's value chunk is read once a
     * pass and the accumulators stay in registers. */
    for (int64_t j0 = 0; j0 < G; j0 += 4) {
        const int64_t J = G - j0 < 4 ? G - j0 : 4;
        for (int64_t i = 0; i < D; i += D - i >= 64 ? 64 : 32)
            WEIGHTED[D - i >= 64][J - 1](s + j0 * L, L, v_cache, bf16, head_at + lo * D + i, D, out,
                                         out_at + j0 * D + i);
    }
}

/* Rotate token b's key head kv and write it and the value head at position p of the cache head at head_at. */
static void write_key_value(const void *qkv, int bf16, int64_t b, int64_t kv, int64_t H, int64_t KVH, int64_t D,
                            int64_t width, const void *cos, const void *sin, void *k_cache, void *v_cache,
                            int64_t head_at, int64_t p)
{
    float k[MAX_D];
    rope(qkv, bf16, b * width + (H + kv) * D, cos, sin, b * D, D, k);
    for (int64_t i = 0; i < D; i += 16) {
        store_ps(k_cache, bf16, head_at + p * D + i, _mm512_loadu_ps(k + i));
        store_ps(v_cache, bf16, head_at + p * D + i, load_ps(qkv, bf16, b * width + (H + KVH + kv) * D + i));
    }
}

/* Token b goes to cache row rows[b] (rows may be NULL: row b). With rows, several tokens may
 * share a row (a draft being verified: consecutive positions of one sequence); every key and
 * value is then written before any token attends, so each sees the tokens before it. Each
 * token's result equals what a one-token call at its position computes, bit for bit.
 * Returns 0, or -1 when scratch for the scores could not be had (nothing written). */
int rill_decode_attention(const void *qkv, int bf16, int64_t B, int64_t H, int64_t KVH, int64_t D,
                          const void *cos, const void *sin, const int64_t *pos, const int64_t *rows, void *k_cache,
                          void *v_cache, int64_t max_len, int64_t window, float scale, void *out)
{
    if (D % 32 || D > MAX_D || H % KVH) return -1;
    const int64_t G = H / KVH, width = (H + 2 * KVH) * D;
    int64_t longest = 0; /* the most keys a token attends */
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = window > 0 && pos[b] + 1 > window ? window : pos[b] + 1;
        longest = L > longest ? L : longest;
    }
    /* Scratch for one item at a time: G * longest scores, rounded up to whole vectors, then
     * G * 16 vectors of partial sums; one per thread, so it grows with the context, never
     * with the number of tokens. */
    const int64_t per_item = ((G * longest + 15) & ~(int64_t)15) + G * 16 * 16;
    const int64_t threads = B * KVH > 1 ? omp_get_max_threads() : 1;
    float *scratch = aligned_alloc(64, (size_t)(threads * per_item) * sizeof(float));
    if (scratch == NULL) return -1;
    if (rows != NULL) {
#pragma omp parallel for schedule(static) if (B * KVH > 1)
        for (int64_t item = 0; item < B * KVH; item++) {
            const int64_t b = item / KVH, kv = item % KVH;
            write_key_value(qkv, bf16, b, kv, H, KVH, D, width, cos, sin, k_cache, v_cache,
                            (rows[b] * KVH + kv) * max_len * D, pos[b]);
        }
    }
#pragma omp parallel for schedule(static) if (B * KVH > 1)
    for (int64_t item = 0; item < B * KVH; item++) {
        const int64_t b = item / KVH, kv = item % KVH, p = pos[b];
        const int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0, L = p + 1 - lo;
        const int64_t head_at = ((rows != NULL ? rows[b] : b) * KVH + kv) * max_len * D;  /* this row's head */
        float q[G][MAX_D];
        for (int64_t j = 0; j < G; j++) rope(qkv, bf16, b * width + (kv * G + j) * D, cos, sin, b * D, D, q[j]);
        if (rows == NULL) write_key_value(qkv, bf16, b, kv, H, KVH, D, width, cos, sin, k_cache, v_cache, head_at, p);
        attend((const float (*)[MAX_D])q, G, D, bf16, k_cache, v_cache, head_at, lo, L, scale,
               scratch + omp_get_thread_num() * per_item, out, b * H * D + kv * G * D);
    }
    free(scratch);
    return 0;
}

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

static inline float dot(const float *q, const void *k, int bf16, int64_t k_at, int64_t D)
{
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load_ps(k, bf16, k_at + i), acc);
    return _mm512_reduce_add_ps(acc);
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

/* Attention of one (token, KV head) item whose G query heads, rotated, are q: scores over the
 * keys lo..p of the cache head at head_at, softmax, weighted values into out. */
static void attend(const float (*q)[MAX_D], int64_t G, int64_t D, int bf16, const void *k_cache,
                   const void *v_cache, int64_t head_at, int64_t lo, int64_t L, float scale, float *s, void *out,
                   int64_t out_at)
{
    for (int64_t l = 0; l < L; l++) {
        for (int64_t j = 0; j < G; j++) s[j * L + l] = scale * dot(q[j], k_cache, bf16, head_at + (lo + l) * D, D);
    }
    for (int64_t j = 0; j < G; j++) softmax(s + j * L, L);
    /* Values: each chunk of 16 lanes read once for all G heads of the group. */
    for (int64_t i = 0; i < D; i += 16) {
        __m512 acc[G];
        for (int64_t j = 0; j < G; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t l = 0; l < L; l++) {
            const __m512 v = load_ps(v_cache, bf16, head_at + (lo + l) * D + i);
            for (int64_t j = 0; j < G; j++) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(s[j * L + l]), v, acc[j]);
        }
        for (int64_t j = 0; j < G; j++) store_ps(out, bf16, out_at + j * D + i, acc[j]);
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
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) longest = pos[b] + 1 > longest ? pos[b] + 1 : longest;
    float *scores = malloc((size_t)(B * KVH * G * longest) * sizeof(float));
    if (scores == NULL) return -1;
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
               scores + item * G * longest, out, b * H * D + kv * G * D);
    }
    free(scores);
    return 0;
}

/* Vector helpers shared by rill's CPU kernels (AVX-512F). */
#ifndef RILL_SIMD_H
#define RILL_SIMD_H

#include <immintrin.h>
#include <stdint.h>

static inline __m512 load_bf16(const uint16_t *p)
{
    /* bfloat16 is the top half of a float32. */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Round float lanes to bfloat16 (nearest, ties to even), as torch rounds a float result to
 * bf16; NaN stays NaN. */
static inline __m256i to_bf16(__m512 v)
{
    __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    u = _mm512_mask_or_epi32(rounded, nan, u, _mm512_set1_epi32(0x00400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

/* v rounded to bfloat16 and back to float: what a bf16 tensor would hold. */
static inline __m512 round_bf16(__m512 v)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

/* 16 lanes at element ``at`` of a float32 array, or of a bfloat16 one when bf16. */
static inline __m512 load_ps(const void *p, int bf16, int64_t at)
{
    return bf16 ? load_bf16((const uint16_t *)p + at) : _mm512_loadu_ps((const float *)p + at);
}

/* 16 lanes to element ``at`` of a float32 array, or of a bfloat16 one (rounded) when bf16. */
static inline void store_ps(void *p, int bf16, int64_t at, __m512 v)
{
    if (bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)p + at), to_bf16(v));
    else _mm512_storeu_ps((float *)p + at, v);
}

/* e^x for float lanes (|error| < 2 ulp over the range SiLU needs): x = n ln2 + r, |r| <= ln2/2,
 * e^r by a degree-6 polynomial, times 2^n by VSCALEFPS (which saturates to 0 and inf). */
static inline __m512 exp_ps(__m512 x)
{
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-103.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

#endif

/* A whole decode step through every layer of a Llama-family model, in one call.
 *
 * Per layer, what the model's Python path does in about a dozen calls (each a kernel call or
 * a torch operation, with Python between them):
 *   qkv  = rms_norm(x) * input_norm @ w_qkv^T (+ bias)      rill_linear, PRE_RMS
 *   attn = RoPE, cache write and attention of each token     rill_decode_attention
 *   x    = x + attn @ w_o^T (+ bias)
 *   gu   = rms_norm(x) * post_norm @ w_gate_up^T (+ bias)    rill_linear, PRE_RMS
 *   x    = x + (silu(gate) * up) @ w_down^T (+ bias)         rill_linear, PRE_SWIGLU
 * Every intermediate is rounded to bfloat16 where the Python path holds a bf16 tensor (each
 * product's output, each bias sum, each residual sum), so the result is bit for bit that
 * path's. On a 1.5B model the Python between the calls was about an eighth of a decode step,
 * on a 135M one more than half.
 *
 * Layouts: x [B, hidden] bfloat16, updated in place; the caches, cos, sin, pos and rows as
 * rill_decode_attention takes them (k_caches[l], v_caches[l] for layer l). Weights as
 * rill_linear takes them; a NULL bias is none.
 */
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

int rill_linear(int bits, const uint8_t *w, const void *s, const uint16_t *z, int64_t N, int64_t K, const void *x,
                int x_bf16, int64_t M, void *y, int pre, const float *norm, float eps);
int rill_decode_attention(const void *qkv, int bf16, int64_t B, int64_t H, int64_t KVH, int64_t D, const void *cos,
                          const void *sin, const int64_t *pos, const int64_t *rows, void *k_cache, void *v_cache,
                          int64_t max_len, int64_t window, float scale, void *out);

enum { PRE_NONE = 0, PRE_RMS = 1, PRE_SWIGLU = 2 };

/* One quantized product: its blocked weight (rill_linear's arguments) and an optional bias. */
typedef struct {
    int64_t bits;
    const uint8_t *packed;
    const void *scales;
    const uint16_t *offsets;
    int64_t rows, cols;
    const uint16_t *bias; /* bfloat16 [rows], or NULL */
} rill_product;

/* One decoder layer's weights. */
typedef struct {
    rill_product qkv, o, gate_up, down;
    const float *input_norm, *post_norm; /* float32 [hidden] */
    int64_t window;                      /* sliding window, or 0 */
} rill_layer;

/* Each of the n / width rows of a gets b: a[r, i] = bf16(a[r, i] + b[i]), torch's bfloat16
 * add (the float sum rounded to nearest even). */
static void add_bf16(uint16_t *a, const uint16_t *b, int64_t n, int64_t width)
{
    for (int64_t at = 0; at < n; at += width) {
        int64_t i = 0;
        for (; i + 16 <= width; i += 16)
            _mm256_storeu_si256((__m256i *)(a + at + i), to_bf16(_mm512_add_ps(load_bf16(a + at + i), load_bf16(b + i))));
        if (i < width) {
            const __mmask16 rest = (__mmask16)((1u << (width - i)) - 1u);
            const __m512 x = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(rest, a + at + i)), 16));
            const __m512 y = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(rest, b + i)), 16));
            _mm256_mask_storeu_epi16(a + at + i, rest, to_bf16(_mm512_add_ps(x, y)));
        }
    }
}

/* y [B, rows] = pre(x) @ w^T (+ bias), bfloat16. */
static int product(const rill_product *p, const uint16_t *x, int64_t B, uint16_t *y, int pre, const float *norm,
                   float eps)
{
    if (rill_linear((int)p->bits, p->packed, p->scales, p->offsets, p->rows, p->cols, x, 1, B, y, pre, norm, eps))
        return -1;
    if (p->bias != NULL) add_bf16(y, p->bias, B * p->rows, p->rows);
    return 0;
}

/* Every layer on x [B, hidden] (bfloat16, in place). Returns 0, or -1 when scratch could not
 * be had (x and the caches are then partly updated: the step must not be used). */
int rill_decode_layers(const rill_layer *layers, int64_t num_layers, uint16_t *x, int64_t B, int64_t hidden,
                       int64_t H, int64_t KVH, int64_t D, float eps, const uint16_t *cos, const uint16_t *sin,
                       const int64_t *pos, const int64_t *rows, void *const *k_caches, void *const *v_caches,
                       int64_t max_len, float scale)
{
    int64_t widest = hidden;
    for (int64_t l = 0; l < num_layers; l++) {
        const rill_layer *layer = &layers[l];
        if (layer->qkv.rows > widest) widest = layer->qkv.rows;
        if (layer->gate_up.rows > widest) widest = layer->gate_up.rows;
        if (H * D > widest) widest = H * D;
    }
    uint16_t *a = malloc((size_t)(B * widest) * sizeof(uint16_t));
    uint16_t *b = malloc((size_t)(B * widest) * sizeof(uint16_t));
    int status = -1;
    if (a == NULL || b == NULL) goto done;
    for (int64_t l = 0; l < num_layers; l++) {
        const rill_layer *layer = &layers[l];
        if (product(&layer->qkv, x, B, a, PRE_RMS, layer->input_norm, eps)) goto done;
        if (rill_decode_attention(a, 1, B, H, KVH, D, cos, sin, pos, rows, k_caches[l], v_caches[l], max_len,
                                  layer->window, scale, b))
            goto done;
        if (product(&layer->o, b, B, a, PRE_NONE, NULL, 0.0f)) goto done;
        add_bf16(x, a, B * hidden, B * hidden);
        if (product(&layer->gate_up, x, B, a, PRE_RMS, layer->post_norm, eps)) goto done;
        if (product(&layer->down, a, B, b, PRE_SWIGLU, NULL, 0.0f)) goto done;
        add_bf16(x, b, B * hidden, B * hidden);
    }
    status = 0;
done:
    free(a);
    free(b);
    return status;
}

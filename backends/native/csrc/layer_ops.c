/* The elementwise parts of a decoder layer for CPUs, each one pass over the rows of the flat
 * [tokens, ...] layout: residual add + RMSNorm, SwiGLU's silu(gate) * up, and rotary embedding of the
 * query and key heads together with the KV-cache write. In torch each took 3-6 passes over memory with
 * fp32 copies in between, which cost as much as the attention itself in a bf16 prefill step.
 *
 * Arithmetic is fp32. For bf16 storage, results are rounded where the torch reference (layer_ops.py,
 * following HF's Llama) rounds them, so both paths give the same tokens. Rows are spread over the
 * process's OpenMP threads. Built and loaded by cpu_kernels.py.
 */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "fp8.h"
#include "kernels.h"
#include "vector_math.h"

/* v as the storage type would hold it. */
static inline __attribute__((always_inline)) float round_to(float v, const int bf16) {
    return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
}

static inline __attribute__((always_inline)) void add_rms_norm_row(
        void *x, void *residual, const void *weight, void *out, const int64_t hidden, float eps, const int bf16) {
    float sumsq = 0.0f;
    if (residual) { /* residual = x + residual, in the storage type, as torch adds */
        #pragma omp simd reduction(+:sumsq)
        for (int64_t i = 0; i < hidden; i++) {
            const float r = round_to(load(x, i, bf16) + load(residual, i, bf16), bf16);
            store(residual, i, r, bf16);
            sumsq += r * r;
        }
    } else {
        #pragma omp simd reduction(+:sumsq)
        for (int64_t i = 0; i < hidden; i++) sumsq += load(x, i, bf16) * load(x, i, bf16);
    }
    const void *src = residual ? residual : x;
    const float inv = 1.0f / sqrtf(sumsq / (float)hidden + eps);
    /* HF's RMSNorm casts the normalised row to the storage type before multiplying by the weight. */
    #pragma omp simd
    for (int64_t i = 0; i < hidden; i++)
        store(out, i, load(weight, i, bf16) * round_to(load(src, i, bf16) * inv, bf16), bf16);
}

#if defined(HAVE_AVX512_BF16)
/* The bf16 rows' norm, in blocks of 32 values read as pairs and rounded two vectors at once (vector_math.h). The
 * second rounding leaves the words in yet another order, which the weight is permuted to follow and one word
 * permute undoes at the store. Conversions were most of the norm's time; the rows' sums of squares are taken a few
 * rows ahead of their scaling, so that one row's reduction and square root overlap another's work. */
#define NORM_ROWS 8

/* The words of round_two_bf16's words read as pairs and rounded again: value m = 4a + b is at word 8b + a. */
static const uint16_t FROM_ROUNDED_TWICE[32] __attribute__((aligned(64))) = {
    0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27, 4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31};

/* 1 / rms of a row; with a residual, first residual = x + residual (rounded as torch adds). */
static inline float inv_rms_bf16x32(const uint16_t *x, uint16_t *residual, const int64_t hidden, float eps) {
    __m512 sumsq = _mm512_setzero_ps();
    for (int64_t i = 0; i < hidden; i += 32) {
        __m512i v = _mm512_loadu_si512(x + i);
        if (residual) {
            const __m512i r = _mm512_loadu_si512(residual + i);
            v = round_two_bf16(_mm512_add_ps(even_f32(v), even_f32(r)), _mm512_add_ps(odd_f32(v), odd_f32(r)));
            _mm512_storeu_si512(residual + i, interleave_halves(v));
        }
        sumsq = _mm512_dpbf16_ps(sumsq, (__m512bh)v, (__m512bh)v); /* squares of bf16 values are exact in fp32 */
    }
    return 1.0f / sqrtf(_mm512_reduce_add_ps(sumsq) / (float)hidden + eps);
}

/* out = bf16(weight * bf16(x * inv)), HF's two roundings, with the weight in fp32 in FROM_ROUNDED_TWICE's order. */
static inline void scale_row_bf16x32(const uint16_t *x, const float *weight, uint16_t *out, const int64_t hidden,
                                     float inv) {
    const __m512 s = _mm512_set1_ps(inv);
    const __m512i order = _mm512_load_si512(FROM_ROUNDED_TWICE);
    for (int64_t i = 0; i < hidden; i += 32) {
        const __m512i v = _mm512_loadu_si512(x + i);
        const __m512i p = round_two_bf16(_mm512_mul_ps(even_f32(v), s), _mm512_mul_ps(odd_f32(v), s));
        const __m512 even = _mm512_mul_ps(even_f32(p), _mm512_load_ps(weight + i));
        const __m512 odd = _mm512_mul_ps(odd_f32(p), _mm512_load_ps(weight + i + 16));
        _mm512_storeu_si512(out + i, _mm512_permutexvar_epi16(order, round_two_bf16(even, odd)));
    }
}

static void add_rms_norm_bf16x32(uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out,
                                 int64_t rows, int64_t hidden, float eps) {
    float w[hidden] __attribute__((aligned(64))); /* the weight in fp32, permuted: 2.3 KB for SmolLM2 */
    for (int64_t i = 0; i < hidden; i++) /* value 4a + b of each block of 32 at 8b + a */
        w[i / 32 * 32 + 8 * (i % 4) + i % 32 / 4] = bf16_to_f32(weight[i]);
    #pragma omp parallel for schedule(static)
    for (int64_t r0 = 0; r0 < rows; r0 += NORM_ROWS) {
        const int64_t n = rows - r0 < NORM_ROWS ? rows - r0 : NORM_ROWS;
        float inv[NORM_ROWS];
        for (int64_t r = 0; r < n; r++)
            inv[r] = inv_rms_bf16x32(x + (r0 + r) * hidden, residual ? residual + (r0 + r) * hidden : NULL, hidden, eps);
        for (int64_t r = 0; r < n; r++) {
            const int64_t at = (r0 + r) * hidden;
            scale_row_bf16x32(residual ? residual + at : x + at, w, out + at, hidden, inv[r]);
        }
    }
}
#endif

/* out = rms_norm(x + residual) * weight and residual = x + residual (without a residual: out =
 * rms_norm(x) * weight). Rows of `hidden` contiguous elements; `out` may be `x`. */
int add_rms_norm(void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t hidden,
                 float eps, int is_bf16) {
#if defined(HAVE_AVX512_BF16)
    if (is_bf16 && hidden % 32 == 0) {
        add_rms_norm_bf16x32(x, residual, weight, out, rows, hidden, eps);
        return 0;
    }
#endif
    const int64_t size = is_bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        void *xr = (char *)x + r * hidden * size, *outr = (char *)out + r * hidden * size;
        void *res = residual ? (char *)residual + r * hidden * size : NULL;
        if (is_bf16) add_rms_norm_row(xr, res, weight, outr, hidden, eps, 1);
        else add_rms_norm_row(xr, res, weight, outr, hidden, eps, 0);
    }
    return 0;
}

/* torch's silu, g / (1 + e^-g) in float, for gates below FAR_NEGATIVE: where fast math's vector exp is not met
 * (it may overflow early, and its reciprocals of the huge sums fall below float's normal range). In double, with
 * float's own overflow of 1 + e^-g (to -0) and -inf / inf (NaN) kept; not inlined, so never vectorised. */
#define FAR_NEGATIVE (-80.0f)
static __attribute__((noinline)) float silu_far_negative(const float g) {
    uint32_t bits;
    memcpy(&bits, &g, sizeof bits);
    if (bits == 0xff800000u) return NAN;  /* -inf: bit test, as fast math assumes no infinities */
    const double sum = (double)(float)exp(-(double)g);  /* 1 + e^-g in float: e^-g, 1 lost in its rounding */
    return sum > FLT_MAX ? -0.0f : (float)((double)g / sum);
}

/* vector_math.h's exp_f32x16 one lane at a time, for silu's e^-g in bf16 rows without its AVX-512 BF16 path:
 * libmvec's expf, 1 ulp off on some gates, put silu(5.9375) on a bf16 midpoint that torch's lies below. Every
 * operation is the vector one's (fmaf stays one rounding; 2^n is built from its bits, exact for the clamped range
 * here), so the loop still vectorises. */
static inline __attribute__((always_inline)) float exp_like_vector(float x) {
    x = fmaxf(x, -87.0f);
    const float n = nearbyintf(x * 1.44269504f);
    const float f = fmaf(-n, 0.693147181f, x);
    float p = 1.0f / 720;
    p = fmaf(p, f, 1.0f / 120);
    p = fmaf(p, f, 1.0f / 24);
    p = fmaf(p, f, 1.0f / 6);
    p = fmaf(p, f, 0.5f);
    p = fmaf(p, f, 1.0f);
    p = fmaf(p, f, 1.0f);
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;  /* 2^n: n in [-126, 116] for x in [-87, 80] */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* a / b rounded once, as torch divides: fast math vectorises a plain division as a reciprocal estimate and a
 * Newton step (2 ulp), which flips bf16 midpoints (5.9375, -0.00390625 on AVX2); one exact residual (fma) and a
 * correction from that estimate round it as a true division on every bf16 gate. */
static inline __attribute__((always_inline)) float divide_rounded(const float a, const float b) {
    const float y = 1.0f / b, q = a * y;
    return fmaf(fmaf(-q, b, a), y, q);
}

static inline __attribute__((always_inline)) void silu_and_mul_row(const void *x, void *out, const int64_t d,
                                                                    const int bf16) {
    int far = 0;
    #pragma omp simd reduction(|:far)
    for (int64_t i = 0; i < d; i++) {
        const float g = load(x, i, bf16);
        const float t = fminf(-g, -FAR_NEGATIVE);  /* clamped: fixed below */
        const float silu = round_to(bf16 ? divide_rounded(g, 1.0f + exp_like_vector(t)) : g / (1.0f + expf(t)), bf16);
        store(out, i, silu * load(x, d + i, bf16), bf16);
        far |= g < FAR_NEGATIVE;
    }
    for (int64_t i = 0; far && i < d; i++) {
        const float g = load(x, i, bf16);
        if (g < FAR_NEGATIVE) store(out, i, round_to(silu_far_negative(g), bf16) * load(x, d + i, bf16), bf16);
    }
}

/* out [rows, d] = silu(x[:, :d]) * x[:, d:] for x [rows, 2d] (gate and up side by side). bf16 rows of whole
 * vectors take vector_math.h's silu where AVX-512 BF16 is there, faster; the loop elsewhere rounds as it does
 * (its exp and its division, above): torch's bit for bit on every bf16 gate either way. */
int silu_and_mul(const void *x, void *out, int64_t rows, int64_t d, int is_bf16) {
    const int64_t size = is_bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const void *xr = (const char *)x + 2 * r * d * size;
        void *outr = (char *)out + r * d * size;
#if defined(HAVE_AVX512_BF16)
        if (is_bf16 && d % 16 == 0) {
            for (int64_t i = 0; i < d; i += 16) {
                const __m512 gate = load_bf16x16((const uint16_t *)xr + i);
                const __m512 up = load_bf16x16((const uint16_t *)xr + d + i);
                _mm256_storeu_si256((__m256i *)((uint16_t *)outr + i), silu_mul_bf16x16(gate, up));
            }
            continue;
        }
#endif
        if (is_bf16) silu_and_mul_row(xr, outr, d, 1);
        else silu_and_mul_row(xr, outr, d, 0);
    }
    return 0;
}

static inline __attribute__((always_inline)) void rotate_row(void *x, const float *cos, const float *sin,
                                                              const int64_t half, const int bf16) {
    #pragma omp simd
    for (int64_t i = 0; i < half; i++) { /* HF's rotate-half layout: pairs (i, i + half) */
        const float a = load(x, i, bf16), b = load(x, half + i, bf16);
        store(x, i, a * cos[i] - b * sin[i], bf16);
        store(x, half + i, b * cos[i] + a * sin[i], bf16);
    }
}

static inline __attribute__((always_inline)) void store_fp8_as(const void *src, uint8_t *dst, int64_t n,
                                                               const int is_bf16, const int format) {
    int64_t i = 0;
#if defined(HAVE_FP8_VECTORS)
    for (; i + 16 <= n; i += 16) {
        const __m512 x = is_bf16 ? load_bf16x16((const uint16_t *)src + i) : _mm512_loadu_ps((const float *)src + i);
        _mm_storeu_si128((__m128i *)(dst + i), f32x16_to_fp8(x, format));
    }
#endif
    for (; i < n; i++) dst[i] = f32_to_fp8(load(src, i, is_bf16), format);
}

/* dst[i] = src[i] (n values, fp32 or bf16) rounded to the fp8 format. */
static void store_fp8(const void *src, uint8_t *dst, int64_t n, int is_bf16, int format) {
    if (format == KV_FP8_E4M3) is_bf16 ? store_fp8_as(src, dst, n, 1, KV_FP8_E4M3) : store_fp8_as(src, dst, n, 0, KV_FP8_E4M3);
    else is_bf16 ? store_fp8_as(src, dst, n, 1, KV_FP8_E5M2) : store_fp8_as(src, dst, n, 0, KV_FP8_E5M2);
}

/* For each token t of qkv [tokens, (num_heads + 2 * num_kv_heads) * head_dim] (row stride `stride`):
 * rotate its query and key heads in place by cos/sin [tokens, head_dim / 2] (fp32, looked up for its
 * position), then store its key and value heads into slot slot_mapping[t] of the head-major caches
 * [num_kv_heads, cache_slots, head_dim]: copied, or rounded to the caches' fp8 kv_format (fp8.h). */
int rotary_store_kv(void *qkv, int64_t stride, const float *cos, const float *sin, void *k_cache, void *v_cache,
                    const int64_t *slot_mapping, int64_t tokens, int64_t num_heads, int64_t num_kv_heads,
                    int64_t head_dim, int64_t cache_slots, int is_bf16, int kv_format) {
    const int64_t size = is_bf16 ? 2 : 4, half = head_dim / 2, row_bytes = head_dim * size;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        char *row = (char *)qkv + t * stride * size;
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {
#if defined(HAVE_AVX512_BF16)
            if (is_bf16 && half % 16 == 0) { /* faster than the scalar loop, which rounds by integer arithmetic */
                uint16_t *x = (uint16_t *)(row + h * row_bytes);
                for (int64_t i = 0; i < half; i += 16) {
                    const __m512 a = load_bf16x16(x + i);
                    const __m512 b = load_bf16x16(x + half + i);
                    const __m512 co = _mm512_loadu_ps(c + i), si = _mm512_loadu_ps(s + i);
                    _mm256_storeu_si256((__m256i *)(x + i),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_fmsub_ps(a, co, _mm512_mul_ps(b, si))));
                    _mm256_storeu_si256((__m256i *)(x + half + i),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(b, co, _mm512_mul_ps(a, si))));
                }
                continue;
            }
#endif
            if (is_bf16) rotate_row(row + h * row_bytes, c, s, half, 1);
            else rotate_row(row + h * row_bytes, c, s, half, 0);
        }
        const int64_t slot = slot_mapping[t];
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const char *k = row + (num_heads + h) * row_bytes, *v = row + (num_heads + num_kv_heads + h) * row_bytes;
            if (kv_format != KV_AS_ACTIVATIONS) {
                const int64_t at = (h * cache_slots + slot) * head_dim;
                store_fp8(k, (uint8_t *)k_cache + at, head_dim, is_bf16, kv_format);
                store_fp8(v, (uint8_t *)v_cache + at, head_dim, is_bf16, kv_format);
                continue;
            }
            const int64_t at = (h * cache_slots + slot) * row_bytes;
            memcpy((char *)k_cache + at, k, row_bytes);
            memcpy((char *)v_cache + at, v, row_bytes);
        }
    }
    return 0;
}

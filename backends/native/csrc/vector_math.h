/* AVX-512 arithmetic shared by the CPU kernels: bf16 <-> fp32 vectors and SwiGLU's silu(gate) * up with the
 * roundings of the bf16 reference (HF's Llama: gate and up rounded to bf16, silu rounded, the product rounded). */
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#include <stdint.h>

/* 16 bf16 values -> fp32 (exact: a bf16 is the top half of a float). AVX-512F alone. */
static inline __m512 bf16x16_to_f32(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* The 16 bf16 values at p as fp32. */
static inline __m512 load_bf16x16(const uint16_t *p) { return bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)p)); }
#endif

#if defined(__AVX512F__) && defined(__AVX512DQ__)
/* 2^t for the tile attention kernels' probabilities (t below a lazily raised maximum, or a little above it):
 * 2^floor(t) times a cubic of the rest, fitted for relative error on [0, 1): ~8.6e-5, below the bf16 rounding the
 * probabilities get before they meet the values; its constant term is 1, so 2^0 is exactly 1 (a rescale of a row
 * whose maximum stays put must be 1, or it compounds over a long prompt's steps). The rest is one instruction
 * (vreduceps), and scalef floors t itself; past fp32's range it gives +inf, and far below 0 a denormal, or 0 under
 * the flush-to-zero the kernels set around their tasks. Cheaper than a degree-6 Taylor form or libmvec's expf. */
static inline __m512 exp2_probability(__m512 t) {
    const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); /* t - floor(t), in [0, 1) */
    __m512 p = _mm512_set1_ps(0.0770652f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.227647f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69511634f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, t); /* p * 2^floor(t) */
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1

/* v rounded to bf16 (nearest even) and back. */
static inline __m512 round_bf16(__m512 v) { return bf16x16_to_f32((__m256i)_mm512_cvtneps_pbh(v)); }

/* A block of 32 bf16 values read as 16 pairs (32-bit lanes): the even values in fp32 are the low halves shifted
 * up, the odd ones the high halves masked, one instruction per 16 values where widening takes two. */
static inline __m512 even_f32(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
static inline __m512 odd_f32(__m512i pairs) {
    return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u)));
}

/* Two vectors rounded to bf16 at once (cvtne2ps, the cost of one cvtneps): a's 16 values, then b's. For a block
 * split by even_f32 and odd_f32, value m then lies at word m / 2 (even m) or 16 + m / 2 (odd m). */
static inline __m512i round_two_bf16(__m512 a, __m512 b) { return (__m512i)_mm512_cvtne2ps_pbh(b, a); }

/* The 16-bit words of v's two halves interleaved: word i of the low half and word i of the high half become pair
 * i (32-bit lane i, the low half's word first). round_two_bf16's words of a block split by even_f32 and odd_f32
 * come back in the block's order; two rounded vectors of 16 lanes become 16 pairs of their lanes. */
static inline __m512i interleave_halves(__m512i v) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, v);
}

/* exp(x) to ~2e-7 relative: 2^round(x log2 e) times a degree-6 polynomial of the rest; x clamped below at -87
 * (normal results), inf past 88.7 as expf. */
static inline __m512 exp_f32x16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* bf16(bf16(silu(gate)) * up) for bf16-valued gate and up (in fp32 lanes), as torch computes silu: g / (1 + e^-g),
 * which it matches bit for bit on every bf16 gate. The division is one with its rounding mode spelled out: a plain
 * one, under -ffast-math, may become a product with a reciprocal, one rounding more (a bf16 midpoint flipped). */
static inline __m256i silu_mul_bf16x16(__m512 gate, __m512 up) {
    const __m512 e = exp_f32x16(_mm512_sub_ps(_mm512_setzero_ps(), gate));
    const __m512 silu = round_bf16(_mm512_div_round_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e),
                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(silu, up));
}
#endif

/* 8-bit float KV caches (vLLM's kv_cache_dtype fp8_e4m3 and fp8_e5m2, with its default scale of 1): keys and values
 * stored in one byte, half a bf16 cache's, so a decode step, which reads the whole cache, reads half the bytes.
 * Stores round to nearest even and saturate at the format's largest finite value, as vLLM's conversions do
 * (torch's .to() saturates e4m3 only: the reference path clamps first). Loads are exact in fp32 and in bf16. */
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "vector_math.h"

/* How a KV cache stores keys and values (the kernels' `kv_format`): as the activations (fp32 or bf16), or fp8. */
enum kv_format { KV_AS_ACTIVATIONS = 0, KV_FP8_E4M3 = 1, KV_FP8_E5M2 = 2 };

/* Mantissa bits and exponent bias of an fp8 format; its largest finite code (e4m3: 448; e5m2: 57344). */
#define FP8_MBITS(f) ((f) == KV_FP8_E4M3 ? 3 : 2)
#define FP8_BIAS(f) ((f) == KV_FP8_E4M3 ? 7 : 15)
#define FP8_MAX_CODE(f) ((f) == KV_FP8_E4M3 ? 0x7eu : 0x7bu)

/* x rounded to the fp8 `format` (nearest even; saturating; NaN stays NaN). */
static inline uint8_t f32_to_fp8(float x, int format) {
    const int mbits = FP8_MBITS(format), bias = FP8_BIAS(format);
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
    bits &= 0x7fffffffu;
    if (bits > 0x7f800000u) return sign | 0x7fu;
    float a;
    memcpy(&a, &bits, sizeof a);
    if (a < ldexpf(1.0f, 1 - bias)) /* below the smallest normal: a multiple of 2^(1 - bias - mbits), rounded */
        return sign | (uint8_t)nearbyintf(a * ldexpf(1.0f, bias - 1 + mbits));
    const int shift = 23 - mbits; /* round the fp32 mantissa to mbits bits; a carry raises the exponent */
    bits += (1u << (shift - 1)) - 1 + ((bits >> shift) & 1u);
    const uint32_t code = (bits >> shift) - ((uint32_t)(127 - bias) << mbits);
    return sign | (uint8_t)(code > FP8_MAX_CODE(format) ? FP8_MAX_CODE(format) : code);
}

static inline float fp8_to_f32(uint8_t b, int format) {
    const int mbits = FP8_MBITS(format), bias = FP8_BIAS(format);
    const int e = (b & 0x7f) >> mbits, m = b & ((1 << mbits) - 1);
    const float a = e ? ldexpf((float)((1 << mbits) + m), e - bias - mbits) : ldexpf((float)m, 1 - bias - mbits);
    return b & 0x80 ? -a : a;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_FP8_VECTORS 1

/* The fp8 codes in the 16-bit lanes of b (sign-extended) as bf16, exactly, in 6 integer operations per 32 values
 * (through fp16 and fp32 took far more, and decode then read fp8 slower than bf16): one shift moves a
 * code's exponent and mantissa bits to bf16's places and its sign, copied into the high bits by the extension, to
 * bf16's; a mask keeps those, an add rebiases the exponent. Codes below the smallest normal take their magnitude
 * from a table (bf16's own subnormals would be zeros to the tile unit), then every lane its sign again. */
static inline __m512i fp8x32_to_bf16(__m512i b, const int format) {
    const int mbits = FP8_MBITS(format), bias = FP8_BIAS(format), shift = 7 - mbits;
    static const uint16_t subnormals[2][32] = {{0, 0x3b00, 0x3b80, 0x3bc0, 0x3c00, 0x3c20, 0x3c40, 0x3c60}, /* m 2^-9 */
                                               {0, 0x3780, 0x3800, 0x3840}};                              /* m 2^-16 */
    const __m512i sign = _mm512_set1_epi16((short)0x8000), kept = _mm512_set1_epi16((short)(0x8000 | 0x7f << shift));
    const __m512i placed = _mm512_and_si512(_mm512_slli_epi16(b, shift), kept);
    const __m512i normal = _mm512_add_epi16(placed, _mm512_set1_epi16((127 - bias) << 7));
    const __mmask32 sub = _mm512_testn_epi16_mask(placed, _mm512_set1_epi16(0x7f80)); /* exponent 0 */
    /* the table's index is a lane's low 5 bits: a subnormal code's mantissa, its exponent bits being 0 */
    const __m512i table = _mm512_loadu_si512(subnormals[format == KV_FP8_E5M2]);
    const __m512i r = _mm512_mask_permutexvar_epi16(normal, sub, b, table);
    return _mm512_ternarylogic_epi32(r, placed, sign, 0xf8); /* r | (placed & sign) */
}

/* The 32 fp8 values at p as bf16. */
static inline __m512i load_fp8x32(const uint8_t *p, const int format) {
    return fp8x32_to_bf16(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)), format);
}

/* x rounded to fp8 as f32_to_fp8 does, 16 values at once. */
static inline __m128i f32x16_to_fp8(__m512 x, const int format) {
    const int mbits = FP8_MBITS(format), bias = FP8_BIAS(format), shift = 23 - mbits;
    const __m512i bits = _mm512_castps_si512(x), a = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
    __m512i r = _mm512_add_epi32(a, _mm512_add_epi32(_mm512_set1_epi32((1 << (shift - 1)) - 1),
                                                     _mm512_and_si512(_mm512_srli_epi32(a, shift), _mm512_set1_epi32(1))));
    r = _mm512_sub_epi32(_mm512_srli_epi32(r, shift), _mm512_set1_epi32((127 - bias) << mbits));
    r = _mm512_min_epi32(r, _mm512_set1_epi32((int)FP8_MAX_CODE(format)));
    const __mmask16 sub = _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32((128 - bias) << 23));
    const __m512 scaled = _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(ldexpf(1.0f, bias - 1 + mbits)));
    r = _mm512_mask_mov_epi32(r, sub, _mm512_cvtps_epi32(scaled)); /* the current rounding: nearest even */
    r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7f800000)), _mm512_set1_epi32(0x7f));
    r = _mm512_or_si512(r, _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80)));
    return _mm512_cvtepi32_epi8(r);
}
#endif

static inline __attribute__((always_inline)) void widen_fp8_as(const uint8_t *src, void *dst, int64_t n,
                                                               const int format, const int to_bf16) {
    int64_t i = 0;
#if defined(HAVE_FP8_VECTORS)
    for (; i + 32 <= n; i += 32) {
        const __m512i h = load_fp8x32(src + i, format);
        if (to_bf16) {
            _mm512_storeu_si512((uint16_t *)dst + i, h);
        } else {
            _mm512_storeu_ps((float *)dst + i, bf16x16_to_f32(_mm512_castsi512_si256(h)));
            _mm512_storeu_ps((float *)dst + i + 16, bf16x16_to_f32(_mm512_extracti64x4_epi64(h, 1)));
        }
    }
#endif
    for (; i < n; i++) store(dst, i, fp8_to_f32(src[i], format), to_bf16); /* exact in bf16: no rounding */
}

/* n fp8 values from src widened into dst as fp32, or as bf16 if to_bf16 (exact: their mantissas fit in 7 bits). */
static inline void widen_fp8(const uint8_t *src, void *dst, int64_t n, int format, int to_bf16) {
    if (format == KV_FP8_E4M3) to_bf16 ? widen_fp8_as(src, dst, n, KV_FP8_E4M3, 1) : widen_fp8_as(src, dst, n, KV_FP8_E4M3, 0);
    else to_bf16 ? widen_fp8_as(src, dst, n, KV_FP8_E5M2, 1) : widen_fp8_as(src, dst, n, KV_FP8_E5M2, 0);
}

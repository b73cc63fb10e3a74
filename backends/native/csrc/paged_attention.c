/* Paged attention for CPUs, reading keys and values in place from the head-major paged cache
 * [num_kv_heads, num_blocks, block_size, head_dim] (no gather copy).
 *
 * Decode (one query token per sequence): one task per (sequence, KV head). A task walks the sequence's
 * blocks once; each block is scored against every query head of the KV group while it is in cache (one
 * K/V read serves the whole group) and folded into a running max, sum and accumulator per head (online
 * softmax). With AVX-512 (head sizes a multiple of 32) keys come 16 at a time, read in place: their 16
 * scores land in one vector (per-key partial sums, then one transposing reduction), bf16 keys multiply in
 * pairs without widening where the CPU has AVX512-BF16, the softmax update runs on the vector, and each
 * value row is loaded once for the whole group. Where the CPU has AMX tiles (and the build knows them),
 * bf16 caches go through two tile products per 16 keys instead (attend_block_amx).
 * Prefill (causal, after an optional cached prefix): one task per (sequence, KV head, tile of queries);
 * keys come 16 at a time, transposed once per task so that a tile's scores build up as vector FMAs, and
 * the weighted values accumulate in registers, four query rows by 16 columns at a time.
 *
 * Tasks are spread over OpenMP threads (the process's libgomp: the one torch has loaded already).
 * Sums are fp32; bf16 storage is widened block by block (or multiplied in pairs, above). Built and loaded by cpu_kernels.py;
 * the pure-torch paths in attention.py are the reference.
 */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "prefill_tasks.h"

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 64

static void widen(const uint16_t *src, float *dst, int64_t n) {
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

/* acc = acc * alpha + sum over t < n of p[t] * v[t] (rows of d floats) for one query head. Inlined at
 * call sites with a constant d, so the row loops unroll and stay in registers. */
static inline __attribute__((always_inline)) void fold_values(const float *p, const float *v, int64_t n,
                                                              const int64_t d, float alpha, float *acc) {
    float row[MAX_HEAD_DIM];
    #pragma omp simd
    for (int64_t i = 0; i < d; i++) row[i] = 0.0f;
    for (int64_t t = 0; t < n; t++) {
        #pragma omp simd
        for (int64_t i = 0; i < d; i++) row[i] += p[t] * v[t * d + i];
    }
    #pragma omp simd
    for (int64_t i = 0; i < d; i++) acc[i] = acc[i] * alpha + row[i];
}

/* Fold n keys, whose scores (q . k, scaled) are p[0..n), and their values (rows of d floats) into the
 * running softmax state (acc, m, l) of one query head. */
static inline __attribute__((always_inline)) void fold_scores(float *p, const float *v, int64_t n, const int64_t d,
                                                              int first, float *acc, float *m, float *l) {
    float top = -FLT_MAX;
    for (int64_t t = 0; t < n; t++) top = p[t] > top ? p[t] : top;
    /* A new maximum rescales what was summed under the old one (nothing was, for the first keys). */
    const float m_new = first || top > *m ? top : *m;
    const float alpha = first ? 0.0f : expf(*m - m_new);
    float sum = 0.0f;
    #pragma omp simd reduction(+:sum)
    for (int64_t t = 0; t < n; t++) {
        p[t] = expf(p[t] - m_new);
        sum += p[t];
    }
    fold_values(p, v, n, d, alpha, acc);
    *l = *l * alpha + sum;
    *m = m_new;
}

/* Fold n keys/values (rows of d floats) into the running softmax state of `group` query heads. */
static inline __attribute__((always_inline)) void attend_block(
        const float *k, const float *v, int64_t n, const int64_t d, int64_t group, int first, float scale,
        float q[][MAX_HEAD_DIM], float acc[][MAX_HEAD_DIM], float *m, float *l) {
    float p[MAX_BLOCK_SIZE];
    for (int64_t g = 0; g < group; g++) {
        for (int64_t t = 0; t < n; t++) {
            float score = 0.0f;
            #pragma omp simd reduction(+:score)
            for (int64_t i = 0; i < d; i++) score += q[g][i] * k[t * d + i];
            p[t] = score * scale;
        }
        fold_scores(p, v, n, d, first, acc[g], &m[g], &l[g]);
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define DECODE_KEYS 16 /* keys scored at once: one score per lane */

/* Lane t: the sum of a[t]'s lanes. A transposing tree of 45 shuffles and adds gives all 16 sums at once;
 * one horizontal reduction per key (~8 dependent operations each) made scoring slower than loading. */
static inline __m512 sum_each16(const __m512 a[16]) {
    __m512 b[8], c[4], e[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: a[2i] and a[2i+1], two partial sums each, interleaved */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: keys 4i..4i+3, in order */
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++) /* 128-bit lanes: keys 8i..8i+3 twice, then 8i+4..8i+7 twice */
        e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline __m512 widen16(const uint16_t *p) { /* 16 bf16 -> 16 floats */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Scores q . k[t] of n <= 16 keys (rows of d elements, d a multiple of 32), lanes past n zero. qf: the
 * query in fp32; qh: in bf16 (read with a bf16 cache). With AVX512-BF16, bf16 rows multiply in pairs
 * (vdpbf16ps: exact products, fp32 sums) without widening. */
static inline __attribute__((always_inline)) __m512 scores16(const float *qf, const uint16_t *qh, const void *k,
                                                             int64_t n, const int64_t d, const int bf16) {
    __m512 part[DECODE_KEYS];
    for (int64_t t = 0; t < DECODE_KEYS; t++) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t c = 0; t < n && c < d; c += 32) {
            if (bf16) {
                const uint16_t *kr = (const uint16_t *)k + t * d + c;
#if defined(__AVX512BF16__)
                a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qh + c), (__m512bh)_mm512_loadu_si512(kr));
#else
                (void)qh;
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qf + c), widen16(kr), a);
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qf + c + 16), widen16(kr + 16), a);
#endif
            } else {
                const float *kr = (const float *)k + t * d + c;
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qf + c), _mm512_loadu_ps(kr), a);
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qf + c + 16), _mm512_loadu_ps(kr + 16), a);
            }
        }
        part[t] = a;
    }
    return sum_each16(part);
}

/* acc[j] = acc[j] * alpha[j] + sum over t < n of p[j][t] * v[t] for G (a constant <= 4) query heads, the
 * value rows (d elements, a multiple of 32) read in place and widened from bf16 on the fly: each value
 * vector is loaded once for all G heads, and the 2G accumulators are independent FMA chains. */
static inline __attribute__((always_inline)) void fold_heads(const void *v, int64_t n, const int64_t d,
                                                             const int64_t G, float p[][DECODE_KEYS],
                                                             const float *alpha, float acc[][MAX_HEAD_DIM],
                                                             const int bf16) {
    for (int64_t c = 0; c < d; c += 32) {
        __m512 a[4][2];
        for (int64_t j = 0; j < G; j++) {
            a[j][0] = _mm512_mul_ps(_mm512_loadu_ps(acc[j] + c), _mm512_set1_ps(alpha[j]));
            a[j][1] = _mm512_mul_ps(_mm512_loadu_ps(acc[j] + c + 16), _mm512_set1_ps(alpha[j]));
        }
        for (int64_t t = 0; t < n; t++) {
            __m512 x0, x1;
            if (bf16) {
                x0 = widen16((const uint16_t *)v + t * d + c);
                x1 = widen16((const uint16_t *)v + t * d + c + 16);
            } else {
                x0 = _mm512_loadu_ps((const float *)v + t * d + c);
                x1 = _mm512_loadu_ps((const float *)v + t * d + c + 16);
            }
            for (int64_t j = 0; j < G; j++) {
                const __m512 w = _mm512_set1_ps(p[j][t]);
                a[j][0] = _mm512_fmadd_ps(w, x0, a[j][0]);
                a[j][1] = _mm512_fmadd_ps(w, x1, a[j][1]);
            }
        }
        for (int64_t j = 0; j < G; j++) {
            _mm512_storeu_ps(acc[j] + c, a[j][0]);
            _mm512_storeu_ps(acc[j] + c + 16, a[j][1]);
        }
    }
}

/* attend_block for a cache row read in place (fp32 or bf16), 16 keys at a time, every head's scores in
 * one vector; q unscaled (qf fp32, qh the bf16 query when the cache is bf16). */
static inline __attribute__((always_inline)) void attend_block16(
        const void *k, const void *v, int64_t n, const int64_t d, int64_t group, int first, float scale,
        float qf[][MAX_HEAD_DIM], const uint16_t *qh, float acc[][MAX_HEAD_DIM], float *m, float *l,
        const int bf16) {
    float p[MAX_GROUP][DECODE_KEYS], alpha[MAX_GROUP];
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t t0 = 0; t0 < n; t0 += DECODE_KEYS) {
        const int64_t nt = n - t0 < DECODE_KEYS ? n - t0 : DECODE_KEYS;
        const char *kt = (const char *)k + t0 * d * size, *vt = (const char *)v + t0 * d * size;
        const __mmask16 valid = (__mmask16)((1u << nt) - 1);
        for (int64_t g = 0; g < group; g++) {
            __m512 sv = _mm512_mul_ps(scores16(qf[g], bf16 ? qh + g * d : NULL, kt, nt, d, bf16),
                                      _mm512_set1_ps(scale));
            sv = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-FLT_MAX), sv);
            const float top = _mm512_reduce_max_ps(sv);
            const float m_new = first && t0 == 0 ? top : fmaxf(m[g], top);
            alpha[g] = first && t0 == 0 ? 0.0f : expf(m[g] - m_new);
            _mm512_storeu_ps(p[g], _mm512_sub_ps(sv, _mm512_set1_ps(m_new)));
            #pragma omp simd
            for (int64_t t = 0; t < DECODE_KEYS; t++) p[g][t] = expf(p[g][t]); /* 0 past nt */
            l[g] = l[g] * alpha[g] + _mm512_reduce_add_ps(_mm512_loadu_ps(p[g]));
            m[g] = m_new;
        }
        for (int64_t g = 0; g < group; g += 4) { /* constant head counts: accumulators in registers */
            switch (group - g < 4 ? group - g : 4) {
            case 1: fold_heads(vt, nt, d, 1, p + g, alpha + g, acc + g, bf16); break;
            case 2: fold_heads(vt, nt, d, 2, p + g, alpha + g, acc + g, bf16); break;
            case 3: fold_heads(vt, nt, d, 3, p + g, alpha + g, acc + g, bf16); break;
            default: fold_heads(vt, nt, d, 4, p + g, alpha + g, acc + g, bf16);
            }
        }
    }
}
#endif

#if defined(HAVE_AMX_BF16)
/* Decode on the AMX tiles (bf16 caches, blocks a multiple of 16 keys): per 16 keys, the scores of every
 * head of the group come from one tile product (the keys as they lie in the cache times the group's
 * queries), and the weighted values from another (the group's probabilities, rounded to bf16 as GPU
 * flash attention does, times the values interleaved in key pairs). The vector path spends most of its
 * time on the reductions and FMAs these replace. */
#define DECODE_AMX 1

/* The tiles and what they hold (literal numbers: the tile intrinsics paste them into register names). */
#define T_SCORES 0
#define T_KEYS 1
#define T_QUERIES 2
#define T_PROBS 3
#define T_VALUES 4
#define T_OUT0 5
#define T_OUT1 6

/* This thread's tile shapes for a group of `group` query heads (tile state is per thread). */
static void amx_configure(int64_t group) {
    struct tile_config c = {0};
    c.palette = 1;
    c.rows[T_SCORES] = 16, c.colsb[T_SCORES] = group * 4;  /* 16 keys x group scores, fp32 */
    c.rows[T_KEYS] = 16, c.colsb[T_KEYS] = 64;             /* 16 keys x 32 dims, bf16 */
    c.rows[T_QUERIES] = 16, c.colsb[T_QUERIES] = group * 4; /* 16 dim pairs x group queries, bf16 pairs */
    c.rows[T_PROBS] = group, c.colsb[T_PROBS] = 32;        /* group x 16 probabilities, bf16 */
    c.rows[T_VALUES] = 8, c.colsb[T_VALUES] = 64;          /* 8 key pairs x 16 dims, bf16 pairs */
    c.rows[T_OUT0] = c.rows[T_OUT1] = group, c.colsb[T_OUT0] = c.colsb[T_OUT1] = 64; /* group x 16 dims, fp32 */
    _tile_loadconfig(&c);
}

/* The group's bf16 queries as the B operand of q . k: row r of dims chunk c holds, per head, dims
 * 32c + 2r and 32c + 2r + 1 (one 32-bit pair). */
static void amx_queries(const uint16_t *qh, int64_t group, int64_t d, uint32_t qb[][16][16]) {
    for (int64_t c = 0; c < d / 32; c++)
        for (int64_t r = 0; r < 16; r++)
            for (int64_t g = 0; g < group; g++) memcpy(&qb[c][r][g], qh + g * d + 32 * c + 2 * r, 4);
}

/* Fold the block's first n <= 16 keys (rows of d bf16, d a multiple of 32; the block holds 16 rows) into
 * the running softmax state of the group's heads. */
static inline __attribute__((always_inline)) void attend_block_amx(
        const uint16_t *k, const uint16_t *v, int64_t n, const int64_t d, int64_t group, int first, float scale,
        uint32_t qb[][16][16], float acc[][MAX_HEAD_DIM], float *m, float *l) {
    float sbuf[16][16], obuf[2][16][16];
    uint16_t pb[16][16], vb[MAX_HEAD_DIM / 16][8][32];
    _tile_zero(T_SCORES);
    for (int64_t c = 0; c < d / 32; c++) {
        _tile_loadd(T_KEYS, k + 32 * c, d * 2);
        _tile_loadd(T_QUERIES, qb[c], 64);
        _tile_dpbf16ps(T_SCORES, T_KEYS, T_QUERIES);
    }
    _tile_stored(T_SCORES, sbuf, 64);
    /* Values in key pairs (keys past n as zeros): row r of dims chunk j interleaves keys 2r and 2r + 1. */
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t r = 0; r < 8; r++) {
        const __mmask32 even = 2 * r < n ? ~(__mmask32)0 : 0, odd = 2 * r + 1 < n ? ~(__mmask32)0 : 0;
        for (int64_t c = 0; c < d; c += 32) {
            const __m512i a = _mm512_maskz_loadu_epi16(even, v + 2 * r * d + c);
            const __m512i b = _mm512_maskz_loadu_epi16(odd, v + (2 * r + 1) * d + c);
            _mm512_storeu_si512(vb[c / 16][r], _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(vb[c / 16 + 1][r], _mm512_permutex2var_epi16(a, hi, b));
        }
    }
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    const __mmask16 valid = (__mmask16)((1u << n) - 1);
    float alpha[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        __m512 sv = _mm512_mul_ps(_mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(g)), &sbuf[0][0], 4),
                                  _mm512_set1_ps(scale));
        sv = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-FLT_MAX), sv);
        const float top = _mm512_reduce_max_ps(sv);
        const float m_new = first ? top : fmaxf(m[g], top);
        alpha[g] = first ? 0.0f : m_new == m[g] ? 1.0f : expf(m[g] - m_new); /* most blocks raise no maximum */
        float p[16];
        _mm512_storeu_ps(p, _mm512_sub_ps(sv, _mm512_set1_ps(m_new)));
        #pragma omp simd
        for (int64_t t = 0; t < 16; t++) p[t] = expf(p[t]); /* 0 past n */
        const __m512 pv = _mm512_loadu_ps(p);
        l[g] = l[g] * alpha[g] + _mm512_reduce_add_ps(pv);
        m[g] = m_new;
        _mm256_storeu_si256((__m256i *)pb[g], (__m256i)_mm512_cvtneps_pbh(pv));
    }
    _tile_loadd(T_PROBS, pb, 32);
    for (int64_t j = 0; j < d / 16; j++) { /* two output tiles in turn: one is stored while the other fills */
        if (j % 2 == 0) {
            _tile_zero(T_OUT0);
            _tile_loadd(T_VALUES, vb[j], 64);
            _tile_dpbf16ps(T_OUT0, T_PROBS, T_VALUES);
            _tile_stored(T_OUT0, obuf[0], 64);
        } else {
            _tile_zero(T_OUT1);
            _tile_loadd(T_VALUES, vb[j], 64);
            _tile_dpbf16ps(T_OUT1, T_PROBS, T_VALUES);
            _tile_stored(T_OUT1, obuf[1], 64);
        }
        for (int64_t g = 0; g < group; g++) {
            float *a = acc[g] + 16 * j;
            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_loadu_ps(a), _mm512_set1_ps(alpha[g]),
                                                _mm512_loadu_ps(obuf[j % 2][g])));
        }
    }
}
#endif

/* Ask for the keys and values of cache row `row` (KV head x num_blocks + block) ahead of use. Blocks are scattered over the cache, so the
 * hardware prefetcher, which follows one address stream, has barely started by the end of a block;
 * decode reads the whole KV cache once per step from memory and waited on it. Decode asks
 * PREFETCH_AHEAD blocks ahead: two, three or four blocks ahead were 2-10% slower (64 x 512 keys, bf16 and
 * fp32), as were the same requests spread over the block's arithmetic, or made for a task's first blocks. */
#define PREFETCH_AHEAD 1
static inline void prefetch_block(const void *k_cache, const void *v_cache, int64_t row, int64_t bytes) {
    const char *k = (const char *)k_cache + row * bytes, *v = (const char *)v_cache + row * bytes;
    for (int64_t at = 0; at < bytes; at += 64) {
        __builtin_prefetch(k + at);
        __builtin_prefetch(v + at);
    }
}

/* Whether the kernel handles this layout (fixed-size per-task buffers bound it). */
int paged_attention_supported(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {
    return num_kv_heads > 0 && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= MAX_GROUP &&
           head_dim <= MAX_HEAD_DIM && block_size <= MAX_BLOCK_SIZE;
}

/* out[s, h] = softmax(q[s, h] . K[s]^T * scale) V[s] for every sequence s and query head h.
 * q: [num_seqs, num_heads, head_dim] with q_stride elements between sequences (heads contiguous);
 * out: the same shape, contiguous; caches: [num_kv_heads, num_blocks, block_size, head_dim];
 * block_tables: num_seqs rows of table_stride int64; context_lens: [num_seqs] int64, each >= 1.
 * Returns 0, or -1 for a layout paged_attention_supported refuses. */
int paged_decode_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                           const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens, void *out,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks,
                           int64_t block_size, int64_t head_dim, float scale, int is_bf16) {
    if (!paged_attention_supported(num_heads, num_kv_heads, head_dim, block_size)) return -1;
    const int64_t group = num_heads / num_kv_heads, d = head_dim, size = is_bf16 ? 2 : 4;
#if defined(DECODE_AMX)
    const int amx = is_bf16 && d % 32 == 0 && block_size % 16 == 0 && amx_permitted();
#endif
    #pragma omp parallel
    {
#if defined(DECODE_AMX)
    if (amx) amx_configure(group);
#endif
    #pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t s = 0; s < num_seqs; s++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], m[MAX_GROUP], l[MAX_GROUP];
            float kbuf[MAX_BLOCK_SIZE * MAX_HEAD_DIM], vbuf[MAX_BLOCK_SIZE * MAX_HEAD_DIM];
            const int64_t head0 = (s * num_heads + h * group) * d, q0 = s * q_stride + h * group * d;
            const int64_t *table = block_tables + s * table_stride;
            for (int64_t g = 0; g < group; g++) {
                for (int64_t i = 0; i < d; i++) {
                    qf[g][i] = load(q, q0 + g * d + i, is_bf16);
                    acc[g][i] = 0.0f;
                }
                l[g] = 0.0f;
            }
#if defined(DECODE_AMX)
            uint32_t qb[MAX_HEAD_DIM / 32][16][16];
            if (amx) amx_queries((const uint16_t *)q + q0, group, d, qb);
#endif
            const int64_t ctx = context_lens[s];
            for (int64_t start = 0; start < ctx; start += block_size) {
                const int64_t n = ctx - start < block_size ? ctx - start : block_size;
                const int64_t base = (h * num_blocks + table[start / block_size]) * block_size * d;
                if (start + PREFETCH_AHEAD * block_size < ctx)
                    prefetch_block(k_cache, v_cache, h * num_blocks + table[start / block_size + PREFETCH_AHEAD],
                                   block_size * d * size);
                const void *kb = (const char *)k_cache + base * size, *vb = (const char *)v_cache + base * size;
#if defined(DECODE_AMX)
                if (amx) { /* 16 keys per pair of tile products */
                    for (int64_t t = 0; t < n; t += 16)
                        attend_block_amx((const uint16_t *)kb + t * d, (const uint16_t *)vb + t * d, n - t < 16 ? n - t : 16,
                                         d, group, start + t == 0, scale, qb, acc, m, l);
                    continue;
                }
#endif
#if defined(__AVX512F__)
                if (d % 32 == 0) { /* in place, 16 keys per vector of scores */
                    const uint16_t *qh = is_bf16 ? (const uint16_t *)q + q0 : NULL;
                    if (d == 64 && is_bf16) attend_block16(kb, vb, n, 64, group, start == 0, scale, qf, qh, acc, m, l, 1);
                    else if (d == 64) attend_block16(kb, vb, n, 64, group, start == 0, scale, qf, qh, acc, m, l, 0);
                    else if (is_bf16) attend_block16(kb, vb, n, d, group, start == 0, scale, qf, qh, acc, m, l, 1);
                    else attend_block16(kb, vb, n, d, group, start == 0, scale, qf, qh, acc, m, l, 0);
                    continue;
                }
#endif
                const float *k = kb, *v = vb;
                if (is_bf16) {
                    widen(kb, kbuf, n * d);
                    widen(vb, vbuf, n * d);
                    k = kbuf;
                    v = vbuf;
                }
                switch (d) { /* constant head sizes: unrolled, vectorised row loops */
                case 64: attend_block(k, v, n, 64, group, start == 0, scale, qf, acc, m, l); break;
                case 128: attend_block(k, v, n, 128, group, start == 0, scale, qf, acc, m, l); break;
                default: attend_block(k, v, n, d, group, start == 0, scale, qf, acc, m, l);
                }
            }
            for (int64_t g = 0; g < group; g++) {
                const float inv = 1.0f / l[g];
                for (int64_t i = 0; i < d; i++) {
                    store(out, head0 + g * d + i, acc[g][i] * inv, is_bf16);
                }
            }
        }
    }
#if defined(DECODE_AMX)
    if (amx) _tile_release(); /* leave no tile state for the thread's next user to save and restore */
#endif
    }
    return 0;
}

/* ------------------------------------------------------------------------------- prefill (causal) */
#define TILE_ROWS 64 /* query rows (query tokens x query heads of one KV group) one task scores together */
#define KEYS 16      /* keys scored at once per query row */

/* The widest vector this build's ISA holds in one register: a wider GCC vector type is emulated through
 * the stack (a 16-lane type on AVX2 ran the score loop 7x slower than two 8-lane ones). */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
#define VECS (KEYS / LANES) /* vectors per KEYS floats */
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));

static inline vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* s[r] = q[r] . keys for `rows` rows (a multiple of 4), the keys transposed (kt[i * KEYS + t]): four rows
 * at a time, so four FMA chains per vector hide each other's latency and share every key load. */
static inline __attribute__((always_inline)) void score_rows(const float *kt, const int64_t d, int64_t rows,
                                                            float q[][MAX_HEAD_DIM], float s[][KEYS]) {
    for (int64_t r = 0; r < rows; r += 4) {
        vf a[4][VECS] = {{0}};
        for (int64_t i = 0; i < d; i++) {
            for (int v = 0; v < VECS; v++) {
                const vf k = loadv(kt + i * KEYS + v * LANES);
                for (int j = 0; j < 4; j++) a[j][v] += q[r + j][i] * k;
            }
        }
        for (int j = 0; j < 4; j++) {
            for (int v = 0; v < VECS; v++) storev(s[r + j] + v * LANES, a[j][v]);
        }
    }
}

/* acc[r] = acc[r] * alpha[r] + sum over t < n of p[r][t] * v[t], for `rows` rows (a multiple of 4): four
 * rows by KEYS columns of acc stay in registers while the n value rows stream past. */
static inline __attribute__((always_inline)) void accumulate_rows(const float *v, int64_t n, const int64_t d,
                                                                 int64_t rows, float p[][KEYS], const float *alpha,
                                                                 float acc[][MAX_HEAD_DIM]) {
    for (int64_t r = 0; r < rows; r += 4) {
        int64_t c = 0;
        for (; c + KEYS <= d; c += KEYS) {
            vf a[4][VECS];
            for (int j = 0; j < 4; j++) {
                for (int u = 0; u < VECS; u++) a[j][u] = loadv(acc[r + j] + c + u * LANES) * alpha[r + j];
            }
            for (int64_t t = 0; t < n; t++) {
                for (int u = 0; u < VECS; u++) {
                    const vf x = loadv(v + t * d + c + u * LANES);
                    for (int j = 0; j < 4; j++) a[j][u] += p[r + j][t] * x;
                }
            }
            for (int j = 0; j < 4; j++) {
                for (int u = 0; u < VECS; u++) storev(acc[r + j] + c + u * LANES, a[j][u]);
            }
        }
        for (int64_t j = r; j < r + 4; j++) { /* head sizes that are not a multiple of KEYS */
            for (int64_t i = c; i < d; i++) {
                float x = acc[j][i] * alpha[j];
                for (int64_t t = 0; t < n; t++) x += p[j][t] * v[t * d + i];
                acc[j][i] = x;
            }
        }
    }
}

/* Fold n <= KEYS keys, at positions key0.., into the running softmax state (acc, m, l) of `rows` query
 * rows: scores, then per row the new maximum, the rescale of what was summed under the old one and the
 * probabilities (zero for keys past the row's position: causal), then the weighted values. */
static inline __attribute__((always_inline)) void attend_keys(
        const float *kt, const float *v, int64_t n, const int64_t d, int64_t rows, const int64_t *pos,
        int64_t key0, float q[][MAX_HEAD_DIM], float acc[][MAX_HEAD_DIM], float *m, float *l) {
    float s[TILE_ROWS][KEYS], alpha[TILE_ROWS];
    score_rows(kt, d, rows, q, s);
    for (int64_t r = 0; r < rows; r++) {
        const int64_t visible = pos[r] - key0 + 1 < n ? pos[r] - key0 + 1 : n;
        float top = -FLT_MAX;
        #pragma omp simd reduction(max:top)
        for (int64_t t = 0; t < KEYS; t++) top = fmaxf(top, t < visible ? s[r][t] : -FLT_MAX);
        const float m_new = fmaxf(m[r], top);
        alpha[r] = m[r] == -FLT_MAX ? 0.0f : expf(m[r] - m_new); /* nothing summed yet: nothing to rescale */
        float sum = 0.0f;
        #pragma omp simd reduction(+:sum)
        for (int64_t t = 0; t < KEYS; t++) {
            s[r][t] = t < visible ? expf(s[r][t] - m_new) : 0.0f;
            sum += s[r][t];
        }
        l[r] = l[r] * alpha[r] + sum;
        m[r] = m_new;
    }
    accumulate_rows(v, n, d, rows, s, alpha, acc);
}

/* Causal attention for prefill chunks, reading all keys (cached prefix and this chunk's, already written)
 * from the paged cache. Sequence s owns query rows query_starts[s] .. + query_lens[s] of q and out
 * [tokens, num_heads, head_dim] (q: q_stride elements between tokens; out: contiguous); its queries are
 * the last query_lens[s] of context_lens[s] positions. One task per (sequence, KV head, tile of
 * TILE_ROWS / group queries); a tile walks its keys KEYS at a time (each block in KEYS-key slices), each
 * slice transposed once and scored against all the tile's rows. Returns 0, or -1 for a layout
 * paged_attention_supported refuses. */
int paged_prefill_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                            const int64_t *block_tables,
                            int64_t table_stride, const int64_t *query_starts, const int64_t *query_lens,
                            const int64_t *context_lens, void *out, int64_t num_seqs, int64_t num_heads,
                            int64_t num_kv_heads, int64_t num_blocks, int64_t block_size, int64_t head_dim,
                            float scale, int is_bf16) {
    if (!paged_attention_supported(num_heads, num_kv_heads, head_dim, block_size)) return -1;
    const int64_t group = num_heads / num_kv_heads, d = head_dim, tile = TILE_ROWS / group;
    const int64_t tasks = prefill_tiles(query_lens, num_seqs, tile) * num_kv_heads;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; task++) {
        const struct prefill_task t = prefill_task(task, query_lens, num_kv_heads, tile);
        const int64_t s = t.seq, h = t.head, first_q = t.first_q, nq = t.nq;
        const int64_t rows = nq * group, prefix = context_lens[s] - query_lens[s];
        const int64_t padded = (rows + 3) & ~(int64_t)3; /* rows past `rows`: zero queries, results dropped */
        float qf[TILE_ROWS][MAX_HEAD_DIM], acc[TILE_ROWS][MAX_HEAD_DIM], m[TILE_ROWS], l[TILE_ROWS];
        float kt[MAX_HEAD_DIM * KEYS], vbuf[KEYS * MAX_HEAD_DIM];
        int64_t pos[TILE_ROWS];
        for (int64_t r = 0; r < padded; r++) { /* row r: query first_q + r / group, head h * group + r % group */
            const int64_t at = (query_starts[s] + first_q + r / group) * q_stride + (h * group + r % group) * d;
            for (int64_t i = 0; i < d; i++) {
                qf[r][i] = r < rows ? load(q, at + i, is_bf16) * scale : 0.0f;
                acc[r][i] = 0.0f;
            }
            pos[r] = prefix + first_q + (r < rows ? r : rows - 1) / group;
            m[r] = -FLT_MAX;
            l[r] = 0.0f;
        }
        const int64_t keys = prefix + first_q + nq; /* the tile's last query sees this many keys */
        for (int64_t key0 = 0, n; key0 < keys; key0 += n) { /* n: up to KEYS keys, within one block */
            const int64_t block = block_tables[s * table_stride + key0 / block_size];
            const int64_t in_block = block_size - key0 % block_size, left = keys - key0;
            n = left < in_block ? left : in_block;
            n = n < KEYS ? n : KEYS;
            const int64_t base = ((h * num_blocks + block) * block_size + key0 % block_size) * d;
            if (key0 % block_size == 0 && key0 + block_size < keys) /* a new block: ask for the next one */
                prefetch_block(k_cache, v_cache, h * num_blocks + block_tables[s * table_stride + key0 / block_size + 1],
                               block_size * d * (is_bf16 ? 2 : 4));
            for (int64_t t = 0; t < KEYS; t++) { /* transpose keys (zeros past n), widen values */
                for (int64_t i = 0; i < d; i++) kt[i * KEYS + t] = t < n ? load(k_cache, base + t * d + i, is_bf16) : 0.0f;
            }
            const float *v = (const float *)v_cache + base;
            if (is_bf16) {
                widen((const uint16_t *)v_cache + base, vbuf, n * d);
                v = vbuf;
            }
            switch (d) { /* constant head sizes: unrolled, vectorised row loops */
            case 64: attend_keys(kt, v, n, 64, padded, pos, key0, qf, acc, m, l); break;
            case 128: attend_keys(kt, v, n, 128, padded, pos, key0, qf, acc, m, l); break;
            default: attend_keys(kt, v, n, d, padded, pos, key0, qf, acc, m, l);
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            const int64_t at = ((query_starts[s] + first_q + r / group) * num_heads + h * group + r % group) * d;
            const float inv = 1.0f / l[r];
            for (int64_t i = 0; i < d; i++) store(out, at + i, acc[r][i] * inv, is_bf16);
        }
    }
    return 0;
}

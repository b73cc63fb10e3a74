/* Paged attention for CPUs, reading keys and values in place from the head-major paged cache
 * [num_kv_heads, num_blocks, block_size, head_dim] (no gather copy).
 *
 * Decode (one query token per sequence): one task per (sequence, KV head). A task walks the sequence's
 * blocks once; each block is scored against every query head of the KV group while it is in cache (one
 * K/V read serves the whole group) and folded into a running max, sum and accumulator per head (online
 * softmax). With AVX-512 (head sizes a multiple of 32) keys come 16 at a time, read in place: their 16
 * scores land in one vector (per-key partial sums, then one transposing reduction), bf16 keys multiply in
 * pairs without widening where the CPU has AVX512-BF16, the softmax update runs on the vector, and each
 * value row is loaded once for the whole group. Where the CPU has AMX tiles (and the build knows them), bf16
 * queries take decode_attention_amx.c instead.
 * Prefill (causal, after an optional cached prefix): one task per (sequence, KV head, tile of up to 4 vectors
 * of query rows: 64 with AVX-512), holding its queries, scores and outputs with the rows as vector lanes;
 * keys and values are read as rows, 32 keys per slice, each element broadcast against the rows (register
 * blocks of 4 keys or 4 output columns by the row vectors with AVX-512, 2 elsewhere), and the online softmax
 * runs down the keys, one row per lane; bf16 caches on AVX512-BF16 multiply two products at a time (vdpbf16ps:
 * queries and probabilities in pairs, keys read in place, values interleaved in key pairs per slice).
 *
 * Tasks are spread over OpenMP threads (the process's libgomp: the one torch has loaded already); in prefill each
 * thread takes a run of them of about equal cost (prefill_share).
 * Sums are fp32; bf16 storage is widened block by block in decode (or multiplied in pairs, above), slice by
 * slice in prefill (or multiplied in pairs, above). fp8 caches (kv_format, fp8.h) hold half a bf16 cache's bytes; each block read is widened
 * to fp32 first and then attended as an fp32 block.
 * Built and loaded by cpu_kernels.py;
 * the pure-torch paths in attention.py are the reference.
 */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "fp8.h"
#include "kernels.h"
#include "prefetch.h"
#include "prefill_tasks.h"
#include "vector_math.h"

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
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qf + c), load_bf16x16(kr), a);
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qf + c + 16), load_bf16x16(kr + 16), a);
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
                x0 = load_bf16x16((const uint16_t *)v + t * d + c);
                x1 = load_bf16x16((const uint16_t *)v + t * d + c + 16);
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
        const int bf16, struct prefetch *next) {
    float p[MAX_GROUP][DECODE_KEYS], alpha[MAX_GROUP];
    const int64_t heads = group * ((n + DECODE_KEYS - 1) / DECODE_KEYS); /* score passes in this block */
    const int64_t per_head = (next->bytes / 64 + heads - 1) / heads;    /* lines to ask for after each */
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
            prefetch_slice(next, per_head); /* the next block's lines, spread over the heads' scores */
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

/* Whether the kernel handles this layout (fixed-size per-task buffers bound it). */
int paged_attention_supported(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {
    return num_kv_heads > 0 && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= MAX_GROUP &&
           head_dim <= MAX_HEAD_DIM && block_size <= MAX_BLOCK_SIZE;
}

/* out[s, h] = softmax(q[s, h] . K[s]^T * scale) V[s] for every sequence s and query head h.
 * q: [num_seqs, num_heads, head_dim] with q_stride elements between sequences (heads contiguous);
 * out: the same shape, contiguous; caches: [num_kv_heads, num_blocks, block_size, head_dim], stored as q
 * (is_bf16) or as kv_format says; block_tables: num_seqs rows of table_stride int64; context_lens: [num_seqs]
 * int64, each >= 1. Returns 0, or -1 for a layout paged_attention_supported refuses. */
int paged_decode_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                           const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens, void *out,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks,
                           int64_t block_size, int64_t head_dim, float scale, int is_bf16, int kv_format) {
    if (!paged_attention_supported(num_heads, num_kv_heads, head_dim, block_size)) return -1;
    if (paged_decode_attention_amx(q, q_stride, k_cache, v_cache, block_tables, table_stride, context_lens, out,
                                   num_seqs, num_heads, num_kv_heads, num_blocks, block_size, head_dim, scale, is_bf16,
                                   kv_format) == 0)
        return 0;
    const int64_t group = num_heads / num_kv_heads, d = head_dim, size = is_bf16 ? 2 : 4;
    const int64_t kv_size = kv_format == KV_AS_ACTIVATIONS ? size : 1;
    /* fp8 blocks are widened to fp32 as they are read: after that, the block is an fp32 cache block in L1 */
    const int kv_bf16 = kv_format == KV_AS_ACTIVATIONS && is_bf16; /* whether the block read is bf16 */
    #pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t s = 0; s < num_seqs; s++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], m[MAX_GROUP], l[MAX_GROUP];
            /* a block widened: from fp8 (before any path), or from bf16 (on the last one) */
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
            const int64_t ctx = context_lens[s];
            for (int64_t start = 0; start < ctx; start += block_size) {
                const int64_t n = ctx - start < block_size ? ctx - start : block_size;
                const int64_t base = (h * num_blocks + table[start / block_size]) * block_size * d;
                struct prefetch next = {0}; /* the next block */
                if (start + block_size < ctx) {
                    const int64_t row = (h * num_blocks + table[start / block_size + 1]) * block_size * d * kv_size;
                    next = prefetch_lines((const char *)k_cache + row, (const char *)v_cache + row, block_size * d * kv_size);
                }
                const void *kb = (const char *)k_cache + base * kv_size, *vb = (const char *)v_cache + base * kv_size;
                if (kv_format != KV_AS_ACTIVATIONS) {
                    widen_fp8(kb, kbuf, n * d, kv_format, 0);
                    widen_fp8(vb, vbuf, n * d, kv_format, 0);
                    kb = kbuf, vb = vbuf;
                }
#if defined(__AVX512F__)
                if (d % 32 == 0) { /* in place, 16 keys per vector of scores */
                    const uint16_t *qh = kv_bf16 ? (const uint16_t *)q + q0 : NULL;
                    if (d == 64 && kv_bf16) attend_block16(kb, vb, n, 64, group, start == 0, scale, qf, qh, acc, m, l, 1, &next);
                    else if (d == 64) attend_block16(kb, vb, n, 64, group, start == 0, scale, qf, qh, acc, m, l, 0, &next);
                    else if (kv_bf16) attend_block16(kb, vb, n, d, group, start == 0, scale, qf, qh, acc, m, l, 1, &next);
                    else attend_block16(kb, vb, n, d, group, start == 0, scale, qf, qh, acc, m, l, 0, &next);
                    continue;
                }
#endif
                prefetch_rest(&next);
                const float *k = kb, *v = vb;
                if (kv_bf16) {
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
    return 0;
}

/* ------------------------------------------------------------------------------- prefill (causal) */
/* The widest vector this build's ISA holds in one register: a wider GCC vector type is emulated through
 * the stack (on AVX2 a 16-lane type ran the score loop slower than two 8-lane ones: docs/performance.md). */
#if defined(__AVX512F__)
#define LANES 16
#define AT_ONCE 4 /* keys (scores) or value columns (outputs) per register block: 4 x ROW_VECS accumulators */
#elif defined(__AVX__)
#define LANES 8
#define AT_ONCE 2 /* 16 registers: 2 x ROW_VECS accumulators */
#else
#define LANES 4
#define AT_ONCE 2
#endif
#define ROW_VECS 4                     /* a task's query rows fill up to this many vectors */
#define TILE_ROWS (ROW_VECS * LANES)   /* query rows (query tokens x query heads of one KV group) per task */
#define KEYS 32                        /* keys per slice: scored, softmaxed, then folded into the outputs */
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));

static inline vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* Everything in a task is held with query rows as vector lanes ("transposed"): the queries qt[i][r], the
 * scores st[t][r] (key t), the outputs ot[i][r]. Keys and values are then read as rows, in place in an fp32
 * cache, each element broadcast against a vector of query rows: no key is transposed, and the softmax
 * runs down the keys, one row per lane. */

/* st[t][r] = q[r] . k[t] for t < n (rounded up to AT_ONCE: krow repeats its last key), rv row vectors. */
static inline __attribute__((always_inline)) void score_slice(const float *const *krow, int64_t n, const int64_t d,
                                                             const int rv, float qt[][TILE_ROWS],
                                                             float st[][TILE_ROWS]) {
    for (int64_t t = 0; t < n; t += AT_ONCE) {
        vf a[AT_ONCE][ROW_VECS] = {{0}};
        for (int64_t i = 0; i < d; i++) {
            vf qv[ROW_VECS];
            for (int v = 0; v < rv; v++) qv[v] = loadv(qt[i] + v * LANES);
            for (int j = 0; j < AT_ONCE; j++) {
                const float k = krow[t + j][i];
                for (int v = 0; v < rv; v++) a[j][v] += k * qv[v];
            }
        }
        for (int j = 0; j < AT_ONCE; j++) {
            for (int v = 0; v < rv; v++) storev(st[t + j] + v * LANES, a[j][v]);
        }
    }
}

/* ot[i][r] = ot[i][r] * alpha[r] + sum over t < n of p[t][r] * v[t][i]: AT_ONCE output columns by rv row
 * vectors stay in registers while the slice's n values stream past. */
static inline __attribute__((always_inline)) void accumulate_slice(const float *const *vrow, int64_t n,
                                                                  const int64_t d, const int rv,
                                                                  float p[][TILE_ROWS], const float *alpha,
                                                                  float ot[][TILE_ROWS]) {
    vf al[ROW_VECS];
    for (int v = 0; v < rv; v++) al[v] = loadv(alpha + v * LANES);
    int64_t c = 0;
    for (; c + AT_ONCE <= d; c += AT_ONCE) {
        vf a[AT_ONCE][ROW_VECS];
        for (int j = 0; j < AT_ONCE; j++) {
            for (int v = 0; v < rv; v++) a[j][v] = loadv(ot[c + j] + v * LANES) * al[v];
        }
        for (int64_t t = 0; t < n; t++) {
            vf pv[ROW_VECS];
            for (int v = 0; v < rv; v++) pv[v] = loadv(p[t] + v * LANES);
            for (int j = 0; j < AT_ONCE; j++) {
                const float x = vrow[t][c + j];
                for (int v = 0; v < rv; v++) a[j][v] += x * pv[v];
            }
        }
        for (int j = 0; j < AT_ONCE; j++) {
            for (int v = 0; v < rv; v++) storev(ot[c + j] + v * LANES, a[j][v]);
        }
    }
    for (; d % AT_ONCE && c < d; c++) { /* head sizes that are not a multiple of AT_ONCE */
        vf a[ROW_VECS];
        for (int v = 0; v < rv; v++) a[v] = loadv(ot[c] + v * LANES) * al[v];
        for (int64_t t = 0; t < n; t++) {
            for (int v = 0; v < rv; v++) a[v] += vrow[t][c] * loadv(p[t] + v * LANES);
        }
        for (int v = 0; v < rv; v++) storev(ot[c] + v * LANES, a[v]);
    }
}

/* exp(x) for x <= 0 to ~2e-7 relative, as 2^round(x log2 e) times a degree-6 polynomial of the rest (inlined
 * and vectorised with the loop around it, where libmvec's expf costs a call per vector);
 * flushed to 0 below -EXP_FLOOR. The product of a smaller weight with a value, or with an output rescaled by
 * it, may be a denormal, and denormal arithmetic (no flush-to-zero in a library) is many times slower; weights under e^-40 of the row's largest change no fp32 sum. */
#define EXP_FLOOR 40.0f
static inline float exp_or_zero(float x) {
    const float t = fmaxf(x, -EXP_FLOOR) * 1.44269504f, n = nearbyintf(t), f = (t - n) * 0.693147181f;
    float p = 1.0f / 720;
    p = p * f + 1.0f / 120;
    p = p * f + 1.0f / 24;
    p = p * f + 1.0f / 6;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return x > -EXP_FLOOR ? p * two_n : 0.0f;
}

/* The online softmax of one slice's scores st (n keys, the first at position key0) for `rv` vectors of query rows
 * at positions pos[r]: the new maximum per row (keys past a row's position do not count: causal), into alpha the
 * rescale of what was summed under the old one, the probabilities over the scores, the running sums l. */
static inline __attribute__((always_inline)) void softmax_slice(float st[][TILE_ROWS], int64_t n, const int rv,
                                                               const int32_t *pos, int32_t key0, float *m, float *l,
                                                               float *alpha) {
    const int64_t lanes = rv * LANES;
    float top[TILE_ROWS], sum[TILE_ROWS];
    memcpy(top, m, lanes * sizeof *top);
    for (int64_t t = 0; t < n; t++) {
        #pragma omp simd
        for (int64_t r = 0; r < lanes; r++) top[r] = key0 + t <= pos[r] && st[t][r] > top[r] ? st[t][r] : top[r];
    }
    #pragma omp simd
    for (int64_t r = 0; r < lanes; r++) {
        alpha[r] = exp_or_zero(m[r] - top[r]); /* 0 before the first key: m is -FLT_MAX there */
        m[r] = top[r];
        sum[r] = 0.0f;
    }
    for (int64_t t = 0; t < n; t++) {
        #pragma omp simd
        for (int64_t r = 0; r < lanes; r++) {
            st[t][r] = key0 + t <= pos[r] ? exp_or_zero(st[t][r] - top[r]) : 0.0f;
            sum[r] += st[t][r];
        }
    }
    #pragma omp simd
    for (int64_t r = 0; r < lanes; r++) l[r] = l[r] * alpha[r] + sum[r];
}

/* Fold the n keys of one slice, the first at position key0, into the running softmax state (ot, m, l) of
 * `rv` vectors of query rows at positions pos[r]: scores, their softmax, weighted values. */
static inline __attribute__((always_inline)) void attend_slice(
        const float *const *krow, const float *const *vrow, int64_t n, const int64_t d, const int rv,
        const int32_t *pos, int32_t key0, float qt[][TILE_ROWS], float ot[][TILE_ROWS], float *m, float *l) {
    float st[KEYS][TILE_ROWS], alpha[TILE_ROWS];
    score_slice(krow, n, d, rv, qt, st);
    softmax_slice(st, n, rv, pos, key0, m, l, alpha);
    accumulate_slice(vrow, n, d, rv, st, alpha, ot);
}

/* CALL(RV, D) with the row vectors `rv` and common head sizes `d` as constants: unrolled, all in registers. */
#define SHAPE_D(CALL, RV) do { if (d == 64) CALL(RV, 64); else if (d == 128) CALL(RV, 128); else CALL(RV, d); } while (0)
#define CONSTANT_SHAPE(CALL) do { switch (rv) { case 1: SHAPE_D(CALL, 1); break; case 2: SHAPE_D(CALL, 2); break; \
                                                case 3: SHAPE_D(CALL, 3); break; default: SHAPE_D(CALL, 4); } } while (0)

/* attend_slice with constant shapes. */
static void attend_slice_any(const float *const *krow, const float *const *vrow, int64_t n, int64_t d, int rv,
                             const int32_t *pos, int32_t key0, float qt[][TILE_ROWS], float ot[][TILE_ROWS],
                             float *m, float *l) {
#define ATTEND(RV, D) attend_slice(krow, vrow, n, D, RV, pos, key0, qt, ot, m, l)
    CONSTANT_SHAPE(ATTEND);
#undef ATTEND
}

typedef uint32_t pair_rows[TILE_ROWS];    /* one bf16 pair per query row */
typedef uint32_t pair_dims[MAX_HEAD_DIM]; /* one bf16 pair per dimension */

#if defined(HAVE_AVX512_BF16)
/* bf16 caches on AVX512-BF16 (without AMX tiles, which take prefill_attention_amx.c): the same tasks and online
 * softmax, with every product taken two at a time by vdpbf16ps, one instruction per 32 products where the fp32
 * path takes two FMAs and widens the keys and values first. Scores: the queries as dimension pairs by row,
 * qp[i][r] = (q[r][2i], q[r][2i + 1]), against a key's pair i broadcast from the cache, read in place. Outputs:
 * the probabilities rounded to bf16 (as flash attention rounds them on GPUs, and the tile kernel here) as key
 * pairs by row, pp[i][r] = (p[2i][r], p[2i + 1][r]), against the values interleaved in key pairs once per slice,
 * vp[i][c] = (v[2i][c], v[2i + 1][c]), for every query tile's rows alike. */
/* st[t][r] = scale * q[r] . k[t] for t < n (rounded up to AT_ONCE: krow repeats its last key). */
static inline __attribute__((always_inline)) void score_pairs(const uint16_t *const *krow, int64_t n, const int64_t d,
                                                             const int rv, const pair_rows *qp, float scale,
                                                             float st[][TILE_ROWS]) {
    for (int64_t t = 0; t < n; t += AT_ONCE) {
        __m512 a[AT_ONCE][ROW_VECS];
        for (int j = 0; j < AT_ONCE; j++)
            for (int v = 0; v < rv; v++) a[j][v] = _mm512_setzero_ps();
        for (int64_t i = 0; i < d / 2; i++) {
            __m512bh q[ROW_VECS];
            for (int v = 0; v < rv; v++) q[v] = (__m512bh)_mm512_loadu_si512(qp[i] + v * LANES);
            for (int j = 0; j < AT_ONCE; j++) { /* _mm_loadu_si32: a pair at any alignment */
                const __m512bh k = (__m512bh)_mm512_broadcastd_epi32(_mm_loadu_si32(krow[t + j] + 2 * i));
                for (int v = 0; v < rv; v++) a[j][v] = _mm512_dpbf16_ps(a[j][v], q[v], k);
            }
        }
        for (int j = 0; j < AT_ONCE; j++)
            for (int v = 0; v < rv; v++) _mm512_storeu_ps(st[t + j] + v * LANES, _mm512_mul_ps(a[j][v], _mm512_set1_ps(scale)));
    }
}

/* vp[i][c] = (v[2i][c], v[2i + 1][c]) for the slice's n value rows (a missing last row: zeros). */
static inline __attribute__((always_inline)) void interleave_values(const uint16_t *const *vrow, int64_t n,
                                                                   const int64_t d, pair_dims *vp) {
    const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                           39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16)); /* dimensions 16-31 of 32 */
    for (int64_t i = 0; 2 * i < n; i++) {
        for (int64_t c = 0; c < d; c += 32) {
            const __m512i a = _mm512_loadu_si512(vrow[2 * i] + c);
            const __m512i b = 2 * i + 1 < n ? _mm512_loadu_si512(vrow[2 * i + 1] + c) : _mm512_setzero_si512();
            _mm512_storeu_si512(vp[i] + c, _mm512_permutex2var_epi16(a, first, b));
            _mm512_storeu_si512(vp[i] + c + 16, _mm512_permutex2var_epi16(a, second, b));
        }
    }
}

/* ot[c][r] = ot[c][r] * alpha[r] + sum over t < n of p[t][r] * v[t][c]: the probabilities st rounded into key
 * pairs, then AT_ONCE output columns by rv row vectors in registers while the slice's value pairs stream past.
 * Past an odd n, st's row holds a finite score (score_pairs repeats the last key), whose pair meets a zero value
 * row. */
static inline __attribute__((always_inline)) void accumulate_pairs(const pair_dims *vp, int64_t n, const int64_t d,
                                                                  const int rv, float st[][TILE_ROWS],
                                                                  const float *alpha, float ot[][TILE_ROWS]) {
    pair_rows pp[KEYS / 2];
    const int64_t pairs = (n + 1) / 2;
    for (int64_t i = 0; i < pairs; i++)
        for (int v = 0; v < rv; v++)
            _mm512_storeu_si512(pp[i] + v * LANES, interleave_halves(round_two_bf16(
                _mm512_loadu_ps(st[2 * i] + v * LANES), _mm512_loadu_ps(st[2 * i + 1] + v * LANES))));
    __m512 al[ROW_VECS];
    for (int v = 0; v < rv; v++) al[v] = _mm512_loadu_ps(alpha + v * LANES);
    for (int64_t c = 0; c < d; c += AT_ONCE) {
        __m512 a[AT_ONCE][ROW_VECS];
        for (int j = 0; j < AT_ONCE; j++)
            for (int v = 0; v < rv; v++) a[j][v] = _mm512_mul_ps(_mm512_loadu_ps(ot[c + j] + v * LANES), al[v]);
        for (int64_t i = 0; i < pairs; i++) {
            __m512bh p[ROW_VECS];
            for (int v = 0; v < rv; v++) p[v] = (__m512bh)_mm512_loadu_si512(pp[i] + v * LANES);
            for (int j = 0; j < AT_ONCE; j++) {
                const __m512bh x = (__m512bh)_mm512_set1_epi32((int)vp[i][c + j]);
                for (int v = 0; v < rv; v++) a[j][v] = _mm512_dpbf16_ps(a[j][v], p[v], x);
            }
        }
        for (int j = 0; j < AT_ONCE; j++)
            for (int v = 0; v < rv; v++) _mm512_storeu_ps(ot[c + j] + v * LANES, a[j][v]);
    }
}

/* attend_slice on bf16 pairs, with constant shapes. */
static void attend_pairs_any(const uint16_t *const *krow, const uint16_t *const *vrow, int64_t n, int64_t d, int rv,
                             const int32_t *pos, int32_t key0, const pair_rows *qp, float scale, pair_dims *vp,
                             float ot[][TILE_ROWS], float *m, float *l) {
    float st[KEYS][TILE_ROWS], alpha[TILE_ROWS];
#define ATTEND(RV, D) do { score_pairs(krow, n, D, RV, qp, scale, st); softmax_slice(st, n, RV, pos, key0, m, l, alpha); \
                           interleave_values(vrow, n, D, vp); accumulate_pairs(vp, n, D, RV, st, alpha, ot); } while (0)
    CONSTANT_SHAPE(ATTEND);
#undef ATTEND
}
#endif

/* Causal attention for prefill chunks, reading all keys (cached prefix and this chunk's, already written)
 * from the paged cache. Sequence s owns query rows query_starts[s] .. + query_lens[s] of q and out
 * [tokens, num_heads, head_dim] (q: q_stride elements between tokens; out: contiguous); its queries are
 * the last query_lens[s] of context_lens[s] positions. One task per (sequence, KV head, tile of TILE_ROWS
 * query rows: its tokens x the group's query heads, prefill_tasks.h); a tile walks its keys KEYS at a time,
 * across blocks. bf16 and fp8 keys and values are widened slice by slice; fp32 ones are read in place. Returns 0,
 * or -1 for a layout paged_attention_supported refuses. */
int paged_prefill_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                            const int64_t *block_tables,
                            int64_t table_stride, const int64_t *query_starts, const int64_t *query_lens,
                            const int64_t *context_lens, void *out, int64_t num_seqs, int64_t num_heads,
                            int64_t num_kv_heads, int64_t num_blocks, int64_t block_size, int64_t head_dim,
                            float scale, int is_bf16, int kv_format) {
    if (!paged_attention_supported(num_heads, num_kv_heads, head_dim, block_size)) return -1;
    const int64_t group = num_heads / num_kv_heads, d = head_dim;
    const int widened = is_bf16 || kv_format != KV_AS_ACTIVATIONS; /* else fp32, read in place */
#if defined(HAVE_AVX512_BF16)
    const int paired = is_bf16 && kv_format == KV_AS_ACTIVATIONS && d % 32 == 0; /* bf16 read in place, in pairs */
#else
    const int paired = 0;
#endif
    #pragma omp parallel
    {
        int64_t first, end; /* a task's fixed work, its queries' loads and output, ~1 slice of keys */
        prefill_share(query_lens, context_lens, num_seqs, num_kv_heads, group, TILE_ROWS, KEYS, 1, &first, &end);
        for (int64_t task = first; task < end; task++) {
            const struct prefill_task t = prefill_task(task, query_lens, num_kv_heads, group, TILE_ROWS);
            const int64_t s = t.seq, h = t.head, first = t.first_row, rows = t.rows;
            const int64_t prefix = context_lens[s] - query_lens[s];
            const int rv = (int)((rows + LANES - 1) / LANES); /* lanes past `rows`: the last row again, dropped */
            union { float f[MAX_HEAD_DIM][TILE_ROWS]; pair_rows pairs[MAX_HEAD_DIM / 2]; } qt; /* scaled, or pairs */
            float ot[MAX_HEAD_DIM][TILE_ROWS], m[TILE_ROWS], l[TILE_ROWS];
            float kbuf[KEYS * MAX_HEAD_DIM]; /* keys widened */
            union { float f[KEYS * MAX_HEAD_DIM]; pair_dims pairs[KEYS / 2]; } vbuf; /* values widened, or pairs */
            const float *krow[KEYS], *vrow[KEYS];
            const uint16_t *krow16[KEYS], *vrow16[KEYS]; /* bf16 rows in place */
            int32_t pos[TILE_ROWS];
            for (int64_t r = 0; r < rv * LANES; r++) {
                const int64_t row = first + (r < rows ? r : rows - 1); /* token row / group, head row % group */
                const int64_t at = (query_starts[s] + row / group) * q_stride + (h * group + row % group) * d;
                for (int64_t i = 0; i < d; i++) {
                    if (paired && i % 2 == 0) memcpy(&qt.pairs[i / 2][r], (const uint16_t *)q + at + i, 4);
                    else if (!paired) qt.f[i][r] = load(q, at + i, is_bf16) * scale;
                    ot[i][r] = 0.0f;
                }
                pos[r] = (int32_t)(prefix + row / group);
                m[r] = -FLT_MAX;
                l[r] = 0.0f;
            }
            const int64_t keys = prefill_tile_keys(query_lens, context_lens, s, first, rows, group);
            for (int64_t key0 = 0; key0 < keys; key0 += KEYS) {
                const int64_t n = keys - key0 < KEYS ? keys - key0 : KEYS;
                for (int64_t j = 0, run; j < n; j += run) { /* the slice's keys, block by block */
                    const int64_t key = key0 + j, block = block_tables[s * table_stride + key / block_size];
                    const int64_t at = ((h * num_blocks + block) * block_size + key % block_size) * d;
                    run = block_size - key % block_size < n - j ? block_size - key % block_size : n - j;
                    if (paired) {
                        for (int64_t u = 0; u < run; u++) {
                            krow16[j + u] = (const uint16_t *)k_cache + at + u * d;
                            vrow16[j + u] = (const uint16_t *)v_cache + at + u * d;
                        }
                        continue;
                    }
                    if (kv_format != KV_AS_ACTIVATIONS) {
                        widen_fp8((const uint8_t *)k_cache + at, kbuf + j * d, run * d, kv_format, 0);
                        widen_fp8((const uint8_t *)v_cache + at, vbuf.f + j * d, run * d, kv_format, 0);
                    } else if (is_bf16) {
                        widen((const uint16_t *)k_cache + at, kbuf + j * d, run * d);
                        widen((const uint16_t *)v_cache + at, vbuf.f + j * d, run * d);
                    }
                    for (int64_t u = 0; u < run; u++) {
                        krow[j + u] = widened ? kbuf + (j + u) * d : (const float *)k_cache + at + u * d;
                        vrow[j + u] = widened ? vbuf.f + (j + u) * d : (const float *)v_cache + at + u * d;
                    }
                }
                for (int64_t j = n; j < (n + AT_ONCE - 1) / AT_ONCE * AT_ONCE; j++) { /* the last key again */
                    if (paired) krow16[j] = krow16[n - 1];
                    else krow[j] = krow[n - 1];
                }
#if defined(HAVE_AVX512_BF16)
                if (paired) {
                    attend_pairs_any(krow16, vrow16, n, d, rv, pos, (int32_t)key0, qt.pairs, scale, vbuf.pairs, ot, m, l);
                    continue;
                }
#else
                (void)vrow16;
#endif
                attend_slice_any(krow, vrow, n, d, rv, pos, (int32_t)key0, qt.f, ot, m, l);
            }
            for (int64_t r = 0, row = first; r < rows; r++, row++) {
                const int64_t at = ((query_starts[s] + row / group) * num_heads + h * group + row % group) * d;
                const float inv = 1.0f / l[r];
                for (int64_t i = 0; i < d; i++) store(out, at + i, ot[i][r] * inv, is_bf16);
            }
        }
    }
    return 0;
}

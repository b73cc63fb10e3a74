/* Paged attention for CPUs, reading keys and values in place from the head-major paged cache
 * [num_kv_heads, num_blocks, block_size, head_dim] (no gather copy).
 *
 * Decode (one query token per sequence): one task per (sequence, KV head). A task walks the sequence's
 * blocks once; each block is scored against every query head of the KV group while it is in cache (one
 * K/V read serves the whole group) and folded into a running max, sum and accumulator per head (online
 * softmax).
 * Prefill (causal, after an optional cached prefix): one task per (sequence, KV head, tile of queries);
 * keys come 16 at a time, transposed once per task so that a tile's scores build up as vector FMAs, and
 * the weighted values accumulate in registers, four query rows by 16 columns at a time.
 *
 * Tasks are spread over OpenMP threads (the process's libgomp: the one torch has loaded already).
 * Arithmetic is fp32; bf16 storage is widened block by block. Built and loaded by cpu_kernels.py;
 * the pure-torch paths in attention.py are the reference.
 */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 64

static void widen(const uint16_t *src, float *dst, int64_t n) {
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

/* Fold n keys/values (rows of d floats) into the running softmax state of `group` query heads.
 * Inlined at call sites with a constant d, so the per-head row loops unroll and stay in registers. */
static inline __attribute__((always_inline)) void attend_block(
        const float *k, const float *v, int64_t n, const int64_t d, int64_t group, int first,
        float q[][MAX_HEAD_DIM], float acc[][MAX_HEAD_DIM], float *m, float *l) {
    float p[MAX_BLOCK_SIZE];
    for (int64_t g = 0; g < group; g++) {
        float top = -FLT_MAX;
        for (int64_t t = 0; t < n; t++) {
            float score = 0.0f;
            #pragma omp simd reduction(+:score)
            for (int64_t i = 0; i < d; i++) score += q[g][i] * k[t * d + i];
            p[t] = score;
            top = score > top ? score : top;
        }
        /* A new maximum rescales what was summed under the old one (nothing was, for the first block). */
        const float m_new = first || top > m[g] ? top : m[g];
        const float alpha = first ? 0.0f : expf(m[g] - m_new);
        float sum = 0.0f;
        #pragma omp simd reduction(+:sum)
        for (int64_t t = 0; t < n; t++) {
            p[t] = expf(p[t] - m_new);
            sum += p[t];
        }
        float row[MAX_HEAD_DIM];
        #pragma omp simd
        for (int64_t i = 0; i < d; i++) row[i] = 0.0f;
        for (int64_t t = 0; t < n; t++) {
            #pragma omp simd
            for (int64_t i = 0; i < d; i++) row[i] += p[t] * v[t * d + i];
        }
        #pragma omp simd
        for (int64_t i = 0; i < d; i++) acc[g][i] = acc[g][i] * alpha + row[i];
        l[g] = l[g] * alpha + sum;
        m[g] = m_new;
    }
}

/* Ask for the keys and values of cache row `row` (KV head x num_blocks + block) ahead of use. Blocks are scattered over the cache, so the
 * hardware prefetcher, which follows one address stream, has barely started by the end of a block;
 * decode reads the whole KV cache once per step from memory and waited on it. */
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
    const int64_t group = num_heads / num_kv_heads, d = head_dim;
    #pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t s = 0; s < num_seqs; s++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], m[MAX_GROUP], l[MAX_GROUP];
            float kbuf[MAX_BLOCK_SIZE * MAX_HEAD_DIM], vbuf[MAX_BLOCK_SIZE * MAX_HEAD_DIM];
            const int64_t head0 = (s * num_heads + h * group) * d, q0 = s * q_stride + h * group * d;
            for (int64_t g = 0; g < group; g++) {
                for (int64_t i = 0; i < d; i++) {
                    const int64_t at = q0 + g * d + i;
                    qf[g][i] = load(q, at, is_bf16) * scale;
                    acc[g][i] = 0.0f;
                }
                l[g] = 0.0f;
            }
            const int64_t ctx = context_lens[s], block_bytes = block_size * d * (is_bf16 ? 2 : 4);
            for (int64_t start = 0; start < ctx; start += block_size) {
                const int64_t block = block_tables[s * table_stride + start / block_size];
                const int64_t n = ctx - start < block_size ? ctx - start : block_size;
                const int64_t base = (h * num_blocks + block) * block_size * d;
                if (start + block_size < ctx) /* the next block, while this one is scored */
                    prefetch_block(k_cache, v_cache,
                                   h * num_blocks + block_tables[s * table_stride + start / block_size + 1], block_bytes);
                const float *k = (const float *)k_cache + base, *v = (const float *)v_cache + base;
                if (is_bf16) {
                    widen((const uint16_t *)k_cache + base, kbuf, n * d);
                    widen((const uint16_t *)v_cache + base, vbuf, n * d);
                    k = kbuf;
                    v = vbuf;
                }
                switch (d) { /* constant head sizes: unrolled, vectorised row loops */
                case 64: attend_block(k, v, n, 64, group, start == 0, qf, acc, m, l); break;
                case 128: attend_block(k, v, n, 128, group, start == 0, qf, acc, m, l); break;
                default: attend_block(k, v, n, d, group, start == 0, qf, acc, m, l);
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
    int64_t tiles = 0; /* tiles before each sequence: tasks are numbered (tile, KV head) */
    for (int64_t s = 0; s < num_seqs; s++) tiles += (query_lens[s] + tile - 1) / tile;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < tiles * num_kv_heads; task++) {
        const int64_t h = task % num_kv_heads;
        int64_t t0 = task / num_kv_heads, s = 0;
        while (t0 >= (query_lens[s] + tile - 1) / tile) t0 -= (query_lens[s++] + tile - 1) / tile;
        const int64_t first_q = t0 * tile, nq = query_lens[s] - first_q < tile ? query_lens[s] - first_q : tile;
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

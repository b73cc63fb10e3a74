/* Decode attention on the AMX tiles: one query token per sequence, bf16 queries, bf16 or fp8 caches read in place
 * from the head-major paged cache [num_kv_heads, num_blocks, block_size, head_dim] (blocks a multiple of 16 keys).
 *
 * One task per (sequence, KV head) walks the keys 32 at a time, every head of the KV group at once. Per 16 keys the
 * scores come from one tile product per 32 dims: the keys as they lie in the cache (A) times the group's queries as
 * dimension pairs (B), 16 keys x group scores. Each head's softmax runs on its 32 scores as two vectors; the
 * probabilities, rounded to bf16 as GPU flash attention does, are the A operand of the output's products, and the
 * values, interleaved in key pairs as they are read, the B operand: group x 16 dims per product, into the output,
 * which stays in tiles across steps at head sizes up to 64 (RESIDENT_DIM). As in the prefill kernel, a head's
 * running maximum is its first step's and is raised only when a step's probabilities may pass e^SLACK (their
 * sum does); only then does the output leave the tiles, to be rescaled. fp8 keys are widened to bf16 rows for the
 * tile loads; fp8 values are widened as they are interleaved.
 * A decode step reads the whole KV cache once, from memory: each task asks for the next step's keys and values while
 * it works on this one, 2 lines of each between the rows of the value interleave (prefetch.h).
 * What this design gave against the kernel before it: docs/performance.md, "Measurements behind the code"
 * (benchmarks/decode_attention.py).
 * Built and loaded by cpu_kernels.py; paged_decode_attention (paged_attention.c) hands its bf16 work here.
 */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "amx.h"
#include "fp8.h"
#include "kernels.h"
#include "prefetch.h"
#include "vector_math.h"

#define MAX_GROUP 16
#define MAX_DIM 256
#define STEP 32        /* keys per step: two score products per 32 dims, one probability tile */
#define RESIDENT_DIM 64 /* up to this head size, the output stays in the tiles across steps */
#define SLACK 8.0f     /* see the file comment: probabilities stay under e^SLACK */

#if defined(HAVE_AMX_BF16) && defined(HAVE_FP8_VECTORS)
#define DECODE_TILES 1
/* The tiles and what they hold (literal numbers: the tile intrinsics paste them into register names). */
#define T_S 0  /* 16 keys x group scores, fp32 */
#define T_KV 1 /* A: 16 keys x 32 dims of keys; or B: 16 key pairs x 16 dims of values (bf16 pairs) */
#define T_Q 2  /* B: 16 dim pairs x group queries (bf16 pairs) */
#define T_P 3  /* A: group x 32 probabilities, bf16 */
#define T_O0 4 /* group x 16 dims of output each, fp32 */
#define T_O1 5
#define T_O2 6
#define T_O3 7

/* This thread's tile shapes for a group of `group` query heads (tile state is per thread). */
static void configure(int64_t group) {
    struct tile_config c = {0};
    c.palette = 1;
    c.rows[T_S] = 16, c.colsb[T_S] = group * 4;
    c.rows[T_KV] = 16, c.colsb[T_KV] = 64;
    c.rows[T_Q] = 16, c.colsb[T_Q] = group * 4;
    c.rows[T_P] = group, c.colsb[T_P] = 64;
    for (int t = T_O0; t <= T_O3; t++) c.rows[t] = group, c.colsb[t] = 64;
    load_tile_config(&c);
}

/* The cache row (KV head x block x slot) of the sequence's key `key`, through its block table. */
static inline int64_t key_row(const int64_t *table, int64_t key, int64_t head, int64_t num_blocks, int64_t block_size) {
    return (head * num_blocks + table[key / block_size]) * block_size + key % block_size;
}

/* The 32 values of one key row at `at` (elements) from a bf16 or fp8 (format) cache as bf16; zeros if !present. */
static inline __attribute__((always_inline)) __m512i value_row(const void *v, int64_t at, int present, const int format) {
    if (!present) return _mm512_setzero_si512();
    if (format == KV_AS_ACTIVATIONS) return _mm512_loadu_si512((const uint16_t *)v + at);
    return load_fp8x32((const uint8_t *)v + at, format);
}

/* Values of nk <= 16 keys (rows of d at v, bf16 or fp8) into rows [8 half, 8 half + 8) of vb, in key pairs: row r
 * of dims chunk j interleaves dims 16j.. of keys 2r and 2r + 1 (keys past nk as zeros). Between rows, the next
 * step's lines are asked for (prefetch). */
static inline __attribute__((always_inline)) void interleave_values(const void *v, int64_t nk, const int64_t d,
                                                                    const int format, int64_t half,
                                                                    uint16_t vb[][16][32], struct prefetch *next) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t r = 0; r < 8; r++) {
        prefetch_slice(next, 2);
        for (int64_t c = 0; c < d; c += 32) {
            const __m512i a = value_row(v, 2 * r * d + c, 2 * r < nk, format);
            const __m512i b = value_row(v, (2 * r + 1) * d + c, 2 * r + 1 < nk, format);
            _mm512_store_si512(vb[c / 16][8 * half + r], _mm512_permutex2var_epi16(a, lo, b));
            _mm512_store_si512(vb[c / 16 + 1][8 * half + r], _mm512_permutex2var_epi16(a, hi, b));
        }
    }
}

/* Output tile J <-> o[J] (group rows of 16 dims); the products take the step's values of dims chunk j0 + J. */
#define O_TILES(OP) do { OP(0, T_O0); if (nt > 1) OP(1, T_O1); if (nt > 2) OP(2, T_O2); if (nt > 3) OP(3, T_O3); } while (0)
#define O_STORE(J, T) _tile_stored(T, o[J], 64)
#define O_LOAD(J, T) _tile_loadd(T, o[J], 64)
#define O_ZERO(J, T) _tile_zero(T)
#define O_PRODUCT(J, T) do { _tile_loadd(T_KV, vb[j0 + (J)], 64); _tile_dpbf16ps(T, T_P, T_KV); } while (0)

/* One task: the group's queries qh (bf16, d each, contiguous) against the ctx keys and values of KV head `head`
 * through `table`; the normalised outputs into out (bf16, d per head, contiguous). */
static inline __attribute__((always_inline)) void attend_task(
        const uint16_t *qh, const void *k_cache, const void *v_cache, const int64_t *table, int64_t ctx, int64_t head,
        int64_t num_blocks, int64_t block_size, const int64_t d, int64_t group, float scale, const int format,
        uint16_t *out) {
    uint32_t qb[MAX_DIM / 32][16][16] __attribute__((aligned(64)));    /* dims chunk, dim pair, head */
    float s[STEP][16] __attribute__((aligned(64)));                    /* key, head */
    uint16_t pb[MAX_GROUP][STEP] __attribute__((aligned(64)));         /* head, key */
    uint16_t vb[MAX_DIM / 16][16][32] __attribute__((aligned(64)));    /* dims chunk, key pair, dim x 2 */
    uint16_t kw[16 * MAX_DIM] __attribute__((aligned(64)));            /* 16 fp8 keys widened */
    float o[MAX_DIM / 16][MAX_GROUP][16] __attribute__((aligned(64))); /* dims chunk, head, 16 dims */
    float m[MAX_GROUP], l[MAX_GROUP];                                  /* in base 2: scores times scale log2 e */
    const int64_t nt = d / 16, resident = d <= RESIDENT_DIM, size = format == KV_AS_ACTIVATIONS ? 2 : 1;
    const __m512 to_log2 = _mm512_set1_ps(scale * 1.44269504f);
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    for (int64_t c = 0; c < d / 32; c++) /* row r of chunk c: per head, dims 32c + 2r and 32c + 2r + 1 */
        for (int64_t r = 0; r < 16; r++)
            for (int64_t g = 0; g < group; g++) memcpy(&qb[c][r][g], qh + g * d + 32 * c + 2 * r, 4);
    for (int64_t g = 0; g < group; g++) l[g] = 0.0f;
    if (resident) O_TILES(O_ZERO);
    else memset(o, 0, sizeof o);
    __asm__ volatile("" ::: "memory"); /* GCC's tileloadd declares no memory read: qb is stored first */
    for (int64_t t0 = 0; t0 < ctx; t0 += STEP) {
        const int64_t n = ctx - t0 < STEP ? ctx - t0 : STEP;
        for (int64_t half = 0; half * 16 < n; half++) { /* 16 keys of one block */
            const int64_t key = t0 + 16 * half, nk = n - 16 * half < 16 ? n - 16 * half : 16;
            const int64_t at = key_row(table, key, head, num_blocks, block_size) * d;
            struct prefetch next = {0}; /* these 16 keys' counterparts in the next step */
            if (key + STEP < ctx) {
                const int64_t ahead = key_row(table, key + STEP, head, num_blocks, block_size) * d * size;
                next = prefetch_lines((const char *)k_cache + ahead, (const char *)v_cache + ahead, 16 * d * size);
            }
            const uint16_t *k = (const uint16_t *)k_cache + at;
            if (format != KV_AS_ACTIVATIONS) {
                widen_fp8((const uint8_t *)k_cache + at, kw, nk * d, format, 1);
                k = kw;
                __asm__ volatile("" ::: "memory"); /* kw is stored before the tile loads read it */
            }
            _tile_zero(T_S);
            for (int64_t c = 0; c < d / 32; c++) {
                _tile_loadd(T_KV, k + 32 * c, d * 2);
                _tile_loadd(T_Q, qb[c], 64);
                _tile_dpbf16ps(T_S, T_KV, T_Q);
            }
            _tile_stored(T_S, s[16 * half], 64);
            interleave_values((const char *)v_cache + at * size, nk, d, format, half, vb, &next);
            prefetch_rest(&next);
        }
        if (n <= 16) /* no second half: its values are zeros */
            for (int64_t j = 0; j < nt; j++) memset(vb[j][8], 0, sizeof vb[j][8] * 8);
        __asm__ volatile("" ::: "memory"); /* GCC's tilestored declares no memory write: s is read below */
        const __mmask16 valid0 = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
        const __mmask16 valid1 = n <= 16 ? 0 : n >= 32 ? 0xffff : (__mmask16)((1u << (n - 16)) - 1);
        float alpha[MAX_GROUP];
        int raised = 0;
        for (int64_t g = 0; g < group; g++) {
            const __m512i lanes = _mm512_add_epi32(column, _mm512_set1_epi32((int)g));
            const __m512 x0 = _mm512_mul_ps(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid0, lanes, s[0], 4), to_log2);
            const __m512 x1 = _mm512_mul_ps(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid1, lanes, s[16], 4), to_log2);
            alpha[g] = 1.0f;
            /* The first step takes the maximum; a later one only if its probabilities may have passed e^SLACK. */
            for (int pass = t0 == 0;; pass = 1) {
                if (pass) {
                    const __m512 none = _mm512_set1_ps(-FLT_MAX);
                    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(none, valid0, x0),
                                                                         _mm512_mask_mov_ps(none, valid1, x1)));
                    if (t0 == 0) {
                        m[g] = top;
                    } else if (top > m[g]) {
                        alpha[g] = exp2f(m[g] - top), raised = 1;
                        l[g] *= alpha[g], m[g] = top;
                    }
                }
                const __m512 mg = _mm512_set1_ps(m[g]);
                const __m512 p0 = _mm512_maskz_mov_ps(valid0, exp2_probability(_mm512_sub_ps(x0, mg)));
                const __m512 p1 = _mm512_maskz_mov_ps(valid1, exp2_probability(_mm512_sub_ps(x1, mg)));
                const float sum = _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
                if (!pass && sum > expf(SLACK)) continue; /* a constant: folded at compile time */
                l[g] += sum;
                _mm512_store_si512(pb[g], round_two_bf16(p0, p1));
                break;
            }
        }
        if (raised) { /* the output so far, rescaled for the raised maxima */
            if (resident) O_TILES(O_STORE);
            __asm__ volatile("" ::: "memory"); /* the tile stores before the vector loads */
            for (int64_t j = 0; j < nt; j++)
                for (int64_t g = 0; g < group; g++)
                    _mm512_store_ps(o[j][g], _mm512_mul_ps(_mm512_load_ps(o[j][g]), _mm512_set1_ps(alpha[g])));
            __asm__ volatile("" ::: "memory"); /* the vector stores before the tile loads */
            if (resident) O_TILES(O_LOAD);
        }
        __asm__ volatile("" ::: "memory"); /* pb and vb are stored before the tile loads read them */
        _tile_loadd(T_P, pb, STEP * 2);
        if (resident) {
            const int64_t j0 = 0;
            O_TILES(O_PRODUCT);
        } else { /* larger heads: 16 dims at a time, added into o in memory */
            for (int64_t j0 = 0; j0 < nt; j0++) {
                float step_o[MAX_GROUP][16] __attribute__((aligned(64)));
                _tile_zero(T_O0);
                O_PRODUCT(0, T_O0);
                _tile_stored(T_O0, step_o, 64);
                __asm__ volatile("" ::: "memory"); /* GCC's tilestored declares no memory write: step_o is read */
                for (int64_t g = 0; g < group; g++)
                    _mm512_store_ps(o[j0][g], _mm512_add_ps(_mm512_load_ps(o[j0][g]), _mm512_load_ps(step_o[g])));
            }
        }
    }
    if (resident) O_TILES(O_STORE);
    __asm__ volatile("" ::: "memory");
    for (int64_t g = 0; g < group; g++) {
        const __m512 inv = _mm512_set1_ps(1.0f / l[g]);
        for (int64_t j = 0; j < nt; j++)
            _mm256_storeu_si256((__m256i *)(out + g * d + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o[j][g]), inv)));
    }
}
#endif

/* The contract of paged_decode_attention (paged_attention.c) for bf16 q and out (is_bf16) and bf16 or fp8 caches;
 * returns 0, or 1 where it does not run here (no tiles, fp32, head sizes not a multiple of 32, blocks not a
 * multiple of 16 keys, groups over 16 heads). */
int paged_decode_attention_amx(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                               const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                               void *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                               int64_t num_blocks, int64_t block_size, int64_t head_dim, float scale, int is_bf16,
                               int kv_format) {
#if defined(DECODE_TILES)
    const int64_t group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0, d = head_dim;
    if (!is_bf16 || group < 1 || group > MAX_GROUP || num_heads % num_kv_heads || d % 32 || d > MAX_DIM ||
        block_size % 16 || !amx_permitted())
        return 1;
    #pragma omp parallel
    {
        configure(group);
        /* Flush-to-zero and denormals-are-zero for the softmax: probabilities far below a maximum underflow to 0,
         * not to denormals, whose arithmetic takes microcode assists. */
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t s = 0; s < num_seqs; s++) {
            for (int64_t h = 0; h < num_kv_heads; h++) {
                const uint16_t *qh = (const uint16_t *)q + s * q_stride + h * group * d;
                uint16_t *o = (uint16_t *)out + (s * num_heads + h * group) * d;
                const int64_t *table = block_tables + s * table_stride;
                switch (kv_format) { /* constant formats: the value loads compile branch-free */
                case KV_FP8_E4M3:
                    attend_task(qh, k_cache, v_cache, table, context_lens[s], h, num_blocks, block_size, d, group,
                                scale, KV_FP8_E4M3, o);
                    break;
                case KV_FP8_E5M2:
                    attend_task(qh, k_cache, v_cache, table, context_lens[s], h, num_blocks, block_size, d, group,
                                scale, KV_FP8_E5M2, o);
                    break;
                default:
                    attend_task(qh, k_cache, v_cache, table, context_lens[s], h, num_blocks, block_size, d, group,
                                scale, KV_AS_ACTIVATIONS, o);
                }
            }
        }
        _mm_setcsr(csr);
        _tile_release(); /* leave no tile state for the thread's next user to save and restore */
    }
    return 0;
#else
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)block_tables, (void)table_stride, (void)context_lens;
    (void)out, (void)num_seqs, (void)num_heads, (void)num_kv_heads, (void)num_blocks, (void)block_size;
    (void)head_dim, (void)scale, (void)is_bf16, (void)kv_format;
    return 1;
#endif
}

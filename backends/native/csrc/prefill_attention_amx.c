/* Causal prefill attention for bf16 caches on the AMX tiles, flash-attention style.
 *
 * First each (sequence, KV head) gathers its keys and values from the paged cache once into what the tile
 * products read: keys as they are stored, one row per key (the A operand of the scores), and values
 * transposed into key pairs per dimension (the A operand of the output), each step's 32 keys in a block of
 * their own, so that every value tile is 1 KB in one piece (with rows of all the keys, a tile's 16 rows lay
 * a multiple of 1 KB apart and fell into the same few L1 sets); 64 KB per 512 keys at
 * head size 64, shared by all its query tiles. Then one task per (sequence, KV head, tile of 16 query rows: the
 * query tokens x the heads of the KV group, token-major, a token's heads split between tiles where 16 rows end
 * inside it: prefill_tasks.h) walks the keys 32 at a time. Its queries, as dimension pairs by row,
 * are the B operand: the scores come out transposed (32 keys x 16 rows, four tile products at head size 64),
 * so each row's online softmax (running maximum and sum, causal mask) runs down the key vectors with no
 * reduction across lanes, and its rescale is one vector. The probabilities are rounded to bf16 (as GPU
 * flash attention does), interleaved in key pairs (the B operand of the output) and multiplied into the
 * values per 16 dimensions into the fp32 output, dimension by row, which stays in up to four tiles at head
 * sizes up to 64: the rows' maxima are taken in the first step and raised only when a row's probabilities may
 * pass e^RESCALE_SLACK, so the output leaves the tiles to be rescaled only then; larger heads accumulate it in
 * memory. The steps are software-pipelined: step n's softmax runs in slices between the tile products of step
 * n + 1's scores and step n - 1's P V, so the tile unit works while the vector units do; the softmax scales,
 * masks (only in steps that cross the first row's position) and exponentiates in one pass (two in a step that
 * raises a maximum), in base 2, under flush-to-zero. Queries (read in place), values and the output change
 * layout by 16 x 16 transposes of 32-bit pairs in registers.
 * Each thread takes a run of tasks of about equal cost (prefill_share, prefill_tasks.h).
 * What each of these choices gave, and torch's flash kernel beside it: docs/performance.md, "Measurements behind
 * the code".
 * Built and loaded by cpu_kernels.py; attention/cpu_attention.py calls it.
 */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "fp8.h"
#include "kernels.h"
#include "prefill_tasks.h"
#include "vector_math.h"

#define ROWS 16   /* query rows per task: one tile of rows */
#define STEP 32   /* keys per step: two score tiles, one probability tile */
#define MAX_DIM 256

/* Whether paged_prefill_attention_amx runs here for this layout. */
int prefill_attention_amx_supported(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {
#if defined(HAVE_AMX_BF16)
    return amx_permitted() && num_kv_heads > 0 && num_heads % num_kv_heads == 0 &&
           num_heads / num_kv_heads <= ROWS && head_dim > 0 && head_dim % 32 == 0 && head_dim <= MAX_DIM &&
           block_size > 0;
#else
    (void)num_heads, (void)num_kv_heads, (void)head_dim, (void)block_size;
    return 0;
#endif
}

#if defined(HAVE_AMX_BF16)
#define T_A 0      /* A operand: 16 keys x 32 dims of keys as they lie, or 16 dims x 16 key pairs of values */
#define T_B 1      /* B operand: 16 dim pairs x 16 query rows, or 16 key pairs x 16 rows of probabilities */
#define T_S0 2     /* scores: the step's first 16 keys x 16 rows */
#define T_S1 3     /* and its last 16 */
#define T_O0 4     /* output, 16 dims x 16 rows per tile: all of it at head sizes up to 64 (RESIDENT_DIM) */
#define T_O1 5
#define T_O2 6
#define T_O3 7
#define RESIDENT_DIM 64
/* The rows' running maxima are the first step's; a later step is exponentiated against them, and only if some
 * row's sum of the step's probabilities passes e^RESCALE_SLACK (so one of them may have) are the step's maxima
 * taken, every row raised to its own where that is higher, the output rescaled and the step exponentiated again.
 * So probabilities stay under e^8 (fine in bf16 and in fp32 sums), the maxima cost a pass only where they move,
 * and the output, rescaled only on a raise, stays in the tiles. Probabilities are 2^t in base
 * 2 (exp2_probability, vector_math.h). */
#define RESCALE_SLACK 8.0f

static void configure(void) {
    struct tile_config c = {0};
    c.palette = 1;
    for (int t = T_A; t <= T_O3; t++) c.rows[t] = 16, c.colsb[t] = 64;
    load_tile_config(&c);
}

/* r[i] lane j <-> r[j] lane i, for 16 vectors of 16 32-bit lanes: interleave 32-bit lanes, then 64-bit pairs,
 * then 128-bit quarters twice. */
static inline void transpose_16x16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
            t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

/* The gathered values of the step of keys from N0 (a multiple of STEP): a block [d][STEP / 2] of key pairs. */
#define STEP_VALUES(VT, N0, D) ((VT) + (N0) / STEP * ((D) * STEP / 2))

/* Keys 0..ctx of one (sequence, KV head) from the paged cache (bf16, or fp8 as kv_format says): k[n] as stored (d
 * bf16 each), and in vt, per step of STEP keys from n0, a block [d][STEP / 2] whose [i][p] is dim i of keys n0 + 2p
 * and n0 + 2p + 1 (one 32-bit pair, the first in the low half); zeros up to `padded` keys (a multiple of STEP). */
static void gather(const void *k_cache, const void *v_cache, const int64_t *table, int64_t ctx, int64_t padded,
                   int64_t head, int64_t num_blocks, int64_t block_size, int64_t d, int kv_format, uint16_t *k,
                   uint32_t *vt) {
    uint16_t wide[STEP][MAX_DIM]; /* a step's fp8 values, widened */
    memset(k + ctx * d, 0, (padded - ctx) * d * 2);
    for (int64_t n0 = 0; n0 < ctx; n0 += 32) { /* a step's keys at a time: per dim, their 16 pairs make one vector */
        const int64_t nn = ctx - n0 < 32 ? ctx - n0 : 32;
        const uint16_t *v[32];
        for (int64_t t = 0; t < nn; t++) {
            const int64_t n = n0 + t;
            const int64_t row = ((head * num_blocks + table[n / block_size]) * block_size + n % block_size) * d;
            if (kv_format != KV_AS_ACTIVATIONS) {
                widen_fp8((const uint8_t *)k_cache + row, k + n * d, d, kv_format, 1);
                widen_fp8((const uint8_t *)v_cache + row, wide[t], d, kv_format, 1);
                v[t] = wide[t];
            } else {
                memcpy(k + n * d, (const uint16_t *)k_cache + row, d * 2);
                v[t] = (const uint16_t *)v_cache + row;
            }
        }
        for (int64_t i0 = 0; i0 < d; i0 += 16) {
            __m512i x[16]; /* key pair p: lane i its dim i0 + i */
            for (int64_t p = 0; p < 16; p++) {
                const __m256i a = 2 * p < nn ? _mm256_loadu_si256((const __m256i *)(v[2 * p] + i0)) : _mm256_setzero_si256();
                const __m256i b = 2 * p + 1 < nn ? _mm256_loadu_si256((const __m256i *)(v[2 * p + 1] + i0))
                                                 : _mm256_setzero_si256();
                x[p] = interleave_halves(_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
            }
            transpose_16x16(x);
            for (int64_t i = 0; i < 16; i++) _mm512_store_si512(STEP_VALUES(vt, n0, d) + (i0 + i) * (STEP / 2), x[i]);
        }
    }
}

/* Output tile J <-> 16 rows of o (dims) by ROWS floats. */
#define O_TILES(OP) do { OP(0, T_O0); if (nt > 1) OP(1, T_O1); if (nt > 2) OP(2, T_O2); if (nt > 3) OP(3, T_O3); } while (0)
#define O_STORE(J, T) _tile_stored(T, &o[16 * (J)][0], 64)
#define O_LOAD(J, T) _tile_loadd(T, &o[16 * (J)][0], 64)
#define O_ZERO(J, T) _tile_zero(T)
/* Output tile T += the values of dims 16 J.. of the step at key PV_N0 times the probabilities in T_B. */
#define O_PRODUCT(J, T) do { _tile_loadd(T_A, STEP_VALUES(vt, pv_n0, d) + 16 * (J) * (STEP / 2), STEP * 2); \
                             _tile_dpbf16ps(T, T_A, T_B); } while (0)

/* The scores of keys [N0, N0 + STEP) for the task's rows, transposed: keys by rows, in T_S0 and T_S1; AFTER runs
 * after each tile product (a slice of the vector work they overlap). */
#define SCORES(N0, AFTER) do {                                            \
        _tile_zero(T_S0);                                                 \
        _tile_zero(T_S1);                                                 \
        for (int64_t c = 0; c < d / 32; c++) {                            \
            _tile_loadd(T_B, &qt[16 * c][0], 64);                         \
            _tile_loadd(T_A, k + (N0) * d + 32 * c, d * 2);               \
            _tile_dpbf16ps(T_S0, T_A, T_B);                               \
            AFTER;                                                        \
            _tile_loadd(T_A, k + ((N0) + 16) * d + 32 * c, d * 2);        \
            _tile_dpbf16ps(T_S1, T_A, T_B);                               \
            AFTER;                                                        \
        }                                                                 \
    } while (0)

/* The P V of the step at key N0 (probabilities PT) added to o in memory, 16 dims at a time: heads larger than
 * RESIDENT_DIM. */
#define PV_IN_MEMORY(PT, N0) do {                                                                              \
        const int64_t pv_n0 = (N0);                                                                           \
        _tile_loadd(T_B, &(PT)[0][0], 64);                                                                    \
        for (int64_t j = 0; j < nt; j++) {                                                                    \
            float step_o[16][ROWS] __attribute__((aligned(64)));                                              \
            _tile_zero(T_O0);                                                                                 \
            O_PRODUCT(j, T_O0);                                                                               \
            _tile_stored(T_O0, &step_o[0][0], 64);                                                            \
            __asm__ volatile("" ::: "memory"); /* GCC's tilestored declares no memory write: step_o is read */ \
            for (int64_t i = 0; i < 16; i++)                                                                 \
                _mm512_store_ps(o[16 * j + i], _mm512_add_ps(_mm512_load_ps(o[16 * j + i]), _mm512_load_ps(step_o[i]))); \
        }                                                                                                     \
    } while (0)

/* One task: query rows [0, rows) (bf16, d wide, at q_rows[r]; ROWS of them) against keys [0, keys), row r seeing keys
 * up to pos[r]; the normalised output rows into out_rows[r] (bf16). Scores are taken transposed (keys by
 * rows), so each row's softmax runs down the 32 key vectors of a step and its rescale is one vector. Up to
 * RESIDENT_DIM the output accumulates in tiles across steps, leaving them only when a maximum is raised;
 * larger heads accumulate it in memory, one tile product per 16 dims per step.
 * The steps are software-pipelined: step n's softmax runs in slices between the tile products of step n + 1's
 * scores and step n - 1's P V (resident heads), so that neither unit waits for the other. Scores and
 * probabilities alternate between two buffers: a tile store or load never waits on the vector loads or stores
 * of the same step. (Issued as blocks, the next step's scores before the softmax and its P V after it, the tile
 * products overlapped the softmax far less: see the top of the file.) */
static void attend_tile(const uint16_t *const *q_rows, int64_t rows, const int64_t *pos, int64_t keys, const uint16_t *k,
                        const uint32_t *vt, int64_t d, float scale, uint16_t **out_rows) {
    uint32_t qt[MAX_DIM / 2][ROWS] __attribute__((aligned(64)));  /* dim pair p, row r */
    float o[MAX_DIM][ROWS] __attribute__((aligned(64)));           /* output, dim by row */
    float s[2][STEP][ROWS] __attribute__((aligned(64)));           /* scores of even and odd steps */
    uint32_t pt[2][STEP / 2][ROWS] __attribute__((aligned(64)));   /* their probabilities, key pair by row: bf16 pairs */
    const int resident = d <= RESIDENT_DIM;
    const int64_t nt = d / 16; /* output tiles (resident: at most 4) */
    for (int64_t p0 = 0; p0 < d / 2; p0 += 16) { /* rows of 16 dim pairs -> dim pairs of 16 rows */
        __m512i x[16];
        for (int64_t r = 0; r < ROWS; r++) x[r] = _mm512_loadu_si512(q_rows[r] + 2 * p0);
        transpose_16x16(x);
        for (int64_t p = 0; p < 16; p++) _mm512_store_si512(qt[p0 + p], x[p]);
    }
    if (resident) O_TILES(O_ZERO);
    else for (int64_t i = 0; i < d; i++) _mm512_store_ps(o[i], _mm512_setzero_ps());
    __m512 m = _mm512_set1_ps(-FLT_MAX), l = _mm512_setzero_ps(); /* m in raw scores: scale > 0 keeps their order */
    int32_t pos32[ROWS];
    for (int64_t r = 0; r < ROWS; r++) pos32[r] = (int32_t)pos[r];
    const __m512i row_pos = _mm512_loadu_si512(pos32);
    const __m512 to_log2 = _mm512_set1_ps(scale * 1.44269504f), limit = _mm512_set1_ps(expf(RESCALE_SLACK));
    __asm__ volatile("" ::: "memory"); /* GCC's tileloadd declares no memory read: qt is stored first */
    SCORES(0, (void)0);
    _tile_stored(T_S0, &s[0][0][0], 64);
    _tile_stored(T_S1, &s[0][16][0], 64);
    __asm__ volatile("" ::: "memory"); /* GCC's tilestored declares no memory write: s is read below */
    for (int64_t n0 = 0, cur = 0; n0 < keys; n0 += STEP, cur ^= 1) {
        const float (*sc)[ROWS] = s[cur];
        uint32_t (*pc)[ROWS] = pt[cur];
        /* Rows see keys up to their positions (the first row's is the smallest): only steps past it mask. */
        const int causal = n0 + STEP - 1 > pos[0];
        __mmask16 seen[STEP];
        for (int64_t t = 0; t < STEP; t++)
            seen[t] = causal ? _mm512_cmpge_epi32_mask(row_pos, _mm512_set1_epi32((int)(n0 + t))) : 0xffff;
        if (!resident && n0 > 0) PV_IN_MEMORY(pt[cur ^ 1], n0 - STEP);
        /* The step's maxima are taken in the first step, or when some probability may have passed e^slack (its
         * row's sum did), and then the step is exponentiated again (see RESCALE_SLACK). */
        for (int pass = 0;; pass++) {
            if (pass > 0 || n0 == 0) {
                __m512 top = _mm512_set1_ps(-FLT_MAX);
                for (int64_t t = 0; t < STEP; t++) top = _mm512_mask_max_ps(top, seen[t], top, _mm512_load_ps(sc[t]));
                const __m512 m_new = _mm512_max_ps(m, top);
                /* exactly 1 where m stays; 0 before the first key (the floor keeps -FLT_MAX * to_log2 finite) */
                const __m512 alpha = exp2_probability(
                    _mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(m, m_new), to_log2), _mm512_set1_ps(-200.0f)));
                l = _mm512_mul_ps(l, alpha);
                m = m_new;
                if (n0 > 0) { /* every earlier step's P V is issued by now (pass 0 issued step n - 1's) */
                    if (resident) O_TILES(O_STORE);
                    __asm__ volatile("" ::: "memory"); /* the tile stores before the loads below */
                    for (int64_t i = 0; i < d; i++) _mm512_store_ps(o[i], _mm512_mul_ps(_mm512_load_ps(o[i]), alpha));
                    __asm__ volatile("" ::: "memory"); /* GCC's tileloadd declares no memory read: the stores first */
                    if (resident) O_TILES(O_LOAD);
                }
            }
            const __m512 m_log2 = _mm512_mul_ps(m, to_log2);
            __m512 sum = _mm512_setzero_ps();
            int64_t t = 0; /* the step's keys exponentiated so far */
            /* Keys [t, U) of the step: 2^((s - m) scale log2 e), 0 for keys a row does not see. */
#define SOFTMAX_UPTO(U) for (const int64_t u = (U); t < u && t < STEP; t += 2) {                             \
                const __m512 a = _mm512_maskz_mov_ps(seen[t], exp2_probability(                              \
                    _mm512_fmsub_ps(_mm512_load_ps(sc[t]), to_log2, m_log2)));                                  \
                const __m512 b = _mm512_maskz_mov_ps(seen[t + 1], exp2_probability(                          \
                    _mm512_fmsub_ps(_mm512_load_ps(sc[t + 1]), to_log2, m_log2)));                              \
                sum = _mm512_add_ps(sum, _mm512_add_ps(a, b));                                                \
                _mm512_store_si512((__m512i *)pc[t / 2], interleave_halves(round_two_bf16(a, b)));            \
            }
            if (pass == 0) { /* a slice of the softmax after each tile product of the next scores and last P V */
                const int next = n0 + STEP < keys, previous = resident && n0 > 0;
                const int64_t products = (next ? d / 16 : 0) + (previous ? nt : 0);
                const int64_t per = products ? (STEP / 2 + products - 1) / products * 2 : STEP; /* keys per slice */
                if (next) {
                    SCORES(n0 + STEP, SOFTMAX_UPTO(t + per));
                    _tile_stored(T_S0, &s[cur ^ 1][0][0], 64);
                    _tile_stored(T_S1, &s[cur ^ 1][16][0], 64);
                }
                if (previous) {
                    const int64_t pv_n0 = n0 - STEP;
                    _tile_loadd(T_B, &pt[cur ^ 1][0][0], 64);
                    O_PRODUCT(0, T_O0);
                    SOFTMAX_UPTO(t + per);
                    if (nt > 1) { O_PRODUCT(1, T_O1); SOFTMAX_UPTO(t + per); }
                    if (nt > 2) { O_PRODUCT(2, T_O2); SOFTMAX_UPTO(t + per); }
                    if (nt > 3) { O_PRODUCT(3, T_O3); SOFTMAX_UPTO(t + per); }
                }
            }
            SOFTMAX_UPTO(STEP);
#undef SOFTMAX_UPTO
            if (pass > 0 || n0 == 0 || !_mm512_cmp_ps_mask(sum, limit, _CMP_GT_OQ)) {
                l = _mm512_add_ps(l, sum);
                break;
            }
        }
        __asm__ volatile("" ::: "memory"); /* as above: pt and s are written before tile loads read them */
    }
    if (keys > 0) { /* the last step's P V */
        const int64_t last = (keys - 1) / STEP * STEP;
        if (resident) {
            const int64_t pv_n0 = last;
            _tile_loadd(T_B, &pt[(last / STEP) & 1][0][0], 64);
            O_TILES(O_PRODUCT);
        } else {
            PV_IN_MEMORY(pt[(last / STEP) & 1], last);
        }
    }
    if (resident) O_TILES(O_STORE);
    __asm__ volatile("" ::: "memory");
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
    for (int64_t p0 = 0; p0 < d / 2; p0 += 16) { /* 16 dim pairs of all rows, normalised, then by row */
        __m512i x[16];
        for (int64_t p = 0; p < 16; p++) {
            const __m512 a = _mm512_mul_ps(_mm512_load_ps(o[2 * (p0 + p)]), inv);
            const __m512 b = _mm512_mul_ps(_mm512_load_ps(o[2 * (p0 + p) + 1]), inv);
            x[p] = interleave_halves(round_two_bf16(a, b)); /* lane r: row r's pair */
        }
        transpose_16x16(x);
        for (int64_t r = 0; r < rows; r++) _mm512_storeu_si512(out_rows[r] + 2 * p0, x[r]);
    }
}
#endif

/* The same contract as paged_prefill_attention (paged_attention.c), for bf16 q and out (is_bf16) and bf16 or fp8
 * caches; returns 0, or 1 where it does not run (fp32, or see prefill_attention_amx_supported), -2 without memory. */
int paged_prefill_attention_amx(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                                const int64_t *block_tables, int64_t table_stride, const int64_t *query_starts,
                                const int64_t *query_lens, const int64_t *context_lens, void *out, int64_t num_seqs,
                                int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                                int64_t head_dim, float scale, int is_bf16, int kv_format) {
#if defined(HAVE_AMX_BF16)
    /* scale > 0: the running maxima are kept on unscaled scores */
    if (!is_bf16 || !(scale > 0) || !prefill_attention_amx_supported(num_heads, num_kv_heads, head_dim, block_size))
        return 1;
    const int64_t group = num_heads / num_kv_heads, d = head_dim;
    int64_t *offset = malloc((num_seqs + 1) * sizeof *offset); /* each sequence's gathered keys, in elements */
    if (!offset) return -2;
    offset[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        offset[s + 1] = offset[s] + ((context_lens[s] + STEP - 1) / STEP * STEP) * d / 2 * num_kv_heads;
    uint16_t *keys = aligned_alloc(64, offset[num_seqs] * 4 + 64);
    uint32_t *values = aligned_alloc(64, offset[num_seqs] * 4 + 64);
    if (!keys || !values) {
        free(keys), free(values), free(offset);
        return -2;
    }
    #pragma omp parallel
    {
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t s = 0; s < num_seqs; s++) {
            for (int64_t h = 0; h < num_kv_heads; h++) {
                const int64_t padded = (context_lens[s] + STEP - 1) / STEP * STEP, at = offset[s] + h * padded * d / 2;
                gather(k_cache, v_cache, block_tables + s * table_stride, context_lens[s], padded, h, num_blocks,
                       block_size, d, kv_format, keys + 2 * at, values + at);
            }
        }
        configure();
        /* Flush-to-zero and denormals-are-zero for the softmax: probabilities far below a row's maximum underflow
         * to 0 instead of to denormals, whose arithmetic takes microcode assists (and masked keys need no clamp). */
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);
        int64_t first, end; /* a task's fixed work (its first scores and last P V, which nothing overlaps, and the
                             * transposes of queries and output) weighs as ~6 steps of keys */
        prefill_share(query_lens, context_lens, num_seqs, num_kv_heads, group, ROWS, STEP, 6, &first, &end);
        for (int64_t task = first; task < end; task++) {
            const struct prefill_task t = prefill_task(task, query_lens, num_kv_heads, group, ROWS);
            const int64_t s = t.seq, h = t.head, rows = t.rows, prefix = context_lens[s] - query_lens[s];
            const int64_t padded = (context_lens[s] + STEP - 1) / STEP * STEP, at = offset[s] + h * padded * d / 2;
            const uint16_t *q_rows[ROWS];
            uint16_t *out_rows[ROWS];
            int64_t pos[ROWS];
            for (int64_t r = 0; r < ROWS; r++) { /* rows past `rows`: the last one again, its output dropped */
                const int64_t row = t.first_row + (r < rows ? r : rows - 1);
                const int64_t token = query_starts[s] + row / group, head = h * group + row % group;
                q_rows[r] = (const uint16_t *)q + token * q_stride + head * d;
                out_rows[r] = (uint16_t *)out + (token * num_heads + head) * d;
                pos[r] = prefix + row / group;
            }
            const int64_t visible = prefill_tile_keys(query_lens, context_lens, s, t.first_row, rows, group);
            attend_tile(q_rows, rows, pos, visible, keys + 2 * at, values + at, d, scale, out_rows);
        }
        _mm_setcsr(csr);
        _tile_release(); /* leave no tile state for the thread's next user to save and restore */
    }
    free(keys), free(values), free(offset);
    return 0;
#else
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)block_tables, (void)table_stride, (void)query_starts;
    (void)query_lens, (void)context_lens, (void)out, (void)num_seqs, (void)num_heads, (void)num_kv_heads;
    (void)num_blocks, (void)block_size, (void)head_dim, (void)scale, (void)is_bf16, (void)kv_format;
    return 1;
#endif
}

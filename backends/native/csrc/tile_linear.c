/* bf16 linear layers on the AMX tiles: out[m, n] = sum_k x[m, k] w[n, k], from the weight laid out as B tiles.
 *
 * Few rows (a decode step, up to STREAM_ROWS): a step streams every weight once and does little with it, so its
 * speed is the memory's, and oneDNN's matmul on its own packed weights reads them well below the copy bandwidth:
 * this kernel reads the weight as AMX B tiles that lie contiguously in memory, one after the other as the tile
 * products want them (tile_layout in linear_kernels.py), so each thread streams one run of memory that the hardware
 * prefetchers follow. The rows of x are the A tiles,
 * read in place (16 rows, or the remainder, by 32 columns). Per 16 output columns, up to 4 A tiles (64 rows)
 * share one B tile load. Output columns are spread over the process's OpenMP threads. Products are fp32 (the
 * tiles' accumulators), rounded once to bf16.
 * Weight-only int8 (quantization: int8, bf16 activations) takes the same path with half the bytes to read:
 * each int8 tile is widened to bf16 (exact: |w| <= 127) in a 1 KB buffer that stays in L1, and the output
 * columns are scaled by their per-channel scales before rounding; its tiles are prefetched ahead (PF_TILES).
 *
 * More rows (a prefill) are compute-bound: blocks of 32 rows x 32 columns, four accumulator tiles fed by two A
 * and two B tiles per 32 columns of k, the weight taken in chunks of columns that stay in L2 while every row
 * block passes them; the row block's A tiles stay in L1 across the chunk's columns, as the B tiles are loaded
 * with the no-reuse hint (without it, L2 -> L1 traffic bound the loop). A block's accumulators
 * are stored and rounded to bf16 while the next block's tile products run (the vector work overlaps the
 * tiles'), and SwiGLU's silu(gate) * up can be that rounding (tile_linear_silu_mul: no [m, 2I] intermediate), or
 * the residual add after a layer's last projection (tile_linear_add).
 * int8 weights take the blocked path too, every rounding included: each chunk is widened to bf16 once, by all
 * threads, into one of two shared buffers (the other holds the chunk being multiplied), and the rounding pass
 * scales the columns first; the widening is what int8 adds over bf16, where dequantising the whole weight for
 * oneDNN's matmul made int8 prefills slower than bf16's.
 * CPUs with AVX512-BF16 but no tiles (AMD Zen 4) run the streaming path on vectors (stream_vectors), from the same
 * layout; there larger steps are oneDNN's (tile_linear_supported says which).
 * Built and loaded by cpu_kernels.py.
 */

#include <stdint.h>

#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "kernels.h"
#include "vector_math.h"

/* Which steps tile_linear multiplies here: 2 any number of rows (built with the tile instructions and granted the
 * tile registers), 1 up to STREAM_ROWS (AVX512-BF16 vectors), 0 none. */
int tile_linear_supported(void) {
#if defined(HAVE_AMX_BF16)
    if (amx_permitted()) return 2;
#endif
#if defined(HAVE_AVX512_BF16)
    return 1;
#else
    return 0;
#endif
}

#if defined(HAVE_AVX512_BF16)
/* 32 int8 weights widened to bf16: int8 -> int32 -> fp32 -> bf16, all exact (|w| <= 127). */
static inline __m512i widen_int8x32(const int8_t *w) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 16))));
    return round_two_bf16(lo, hi);
}

/* The 16 scales of output columns 16j.. as fp32 (stored as fp32 or bf16), or ones without scales. */
static inline __m512 column_scales(const void *scales, int64_t j, int scales_bf16) {
    if (!scales) return _mm512_set1_ps(1.0f);
    if (!scales_bf16) return _mm512_loadu_ps((const float *)scales + 16 * j);
    return load_bf16x16((const uint16_t *)scales + 16 * j);
}
#endif

#if defined(HAVE_AMX_BF16)
/* Tile registers (literal numbers: the tile intrinsics paste them into register names): 0-3 accumulate 16
 * full rows each, T_REST the remainder rows (fewer than 16) of the last pass. */
#define T_W 4
#define T_X 5
#define T_X_REST 6
#define T_REST 7
/* int8 tiles are asked for this many tiles (4 KB) ahead: the widening between tile products left the
 * hardware prefetcher behind. bf16 tiles stream without it, and asking ahead made them slower. */
#define PF_TILES 8

static void configure(int64_t rest) {
    struct tile_config c = {0};
    c.palette = 1;
    for (int t = 0; t < 4; t++) c.rows[t] = 16, c.colsb[t] = 64; /* 16 rows x 16 columns, fp32 */
    c.rows[T_W] = 16, c.colsb[T_W] = 64;                        /* 16 column pairs x 16 outputs, bf16 pairs */
    c.rows[T_X] = 16, c.colsb[T_X] = 64;                        /* 16 rows x 32 columns, bf16 */
    if (rest) c.rows[T_X_REST] = c.rows[T_REST] = rest, c.colsb[T_X_REST] = c.colsb[T_REST] = 64;
    load_tile_config(&c);
}

/* An accumulator tile's rows times the columns' scales, rounded to bf16, into out (row stride n). */
static inline void store_rows(int tile_rows, float acc[16][16], __m512 scale, uint16_t *out, int64_t n) {
    for (int r = 0; r < tile_rows; r++) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(acc[r]), scale);
        _mm256_storeu_si256((__m256i *)(out + r * n), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* An int8 B tile (512 weights) widened to bf16 into buf. */
static inline void widen_tile(const int8_t *w, uint16_t *buf) {
    for (int i = 0; i < 512; i += 32) _mm512_store_si512((__m512i *)(buf + i), widen_int8x32(w + i));
}

#define PRODUCT(T, i) do { _tile_loadd(T_X, x + (m0 + 16 * (i)) * k + kk * 32, k * 2); \
                           _tile_dpbf16ps(T, T_X, T_W); } while (0)
#define STORE(T, i) do { _tile_stored(T, acc, 64); __asm__ volatile("" ::: "memory"); /* see multiply_block */ \
                         store_rows(16, acc, scale, out + (m0 + 16 * (i)) * n + j * 16, n); } while (0)

/* The blocked path's tiles: 0-3 accumulate (rows 0-15 x columns 0-15, rows 0-15 x 16-31, rows 16-31 x 0-15,
 * rows 16-31 x 16-31), two A tiles of 16 rows and two B tiles of 16 columns feed them. */
#define T_A0 4
#define T_A1 5
#define T_B0 6
#define T_B1 7
/* A chunk of the weight's columns that stays in L2 (2 MB per core here) while every row block passes it:
 * 544 columns at k = 576, 192 at 1536 (of those tried, 512-1024 and 256 were best). */
#define CHUNK_BYTES (640 * 1024)

/* The tile column (16 outputs) that side s (0 or 1) of column block cb multiplies: the block's 32 columns, or with
 * SILU_MUL the gate's 16 and the up's same 16 (n / 32 tile columns further on). */
static inline int64_t block_tile_column(int64_t cb, int s, int silu_mul, int64_t n) {
    return silu_mul ? cb + s * (n / 32) : 2 * cb + s;
}

static void configure_blocks(void) {
    struct tile_config c = {0};
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    load_tile_config(&c);
}

/* What the rounding pass makes of a block's sums: the products, silu(gate) * up, or the products added to
 * what out holds (a residual stream, rounded as torch adds: the product rounded first, then the sum). */
enum rounding { PRODUCTS, SILU_MUL, ADD_TO_OUT };

/* One block's accumulators, stored, waiting to be rounded into out while the next block multiplies. Its 32 units
 * are its rows: row u's 32 outputs (tiles 2 (u / 16) and the next, row u % 16), one whole cache line of out, or
 * with SILU_MUL its 16 outputs silu(gate) * up (the block's first 16 columns are the gate's, the last 16 the
 * up's). Whole lines, rounded two vectors at once, beat units of 16 outputs whose two half-line stores came
 * far apart. */
#define UNITS 32
struct pending {
    float acc[4][16][16] __attribute__((aligned(64)));
    uint16_t *out;   /* the block's first output */
    int64_t n;       /* out's row stride */
    int rows;        /* rows of the block that exist (the last may have fewer than 32) */
    enum rounding rounding;
    int done;        /* units rounded so far */
    int scaled;      /* int8 weights: the columns' scales multiply the sums first */
    __m512 scale_lo, scale_hi; /* the scales of the block's first and last 16 columns */
};

/* Round units [done, upto) of the pending block into out. */
static inline void drain(struct pending *p, int upto) {
    for (int u = p->done; u < upto && u < p->rows; u++) {
        const int t = 2 * (u >> 4), row = u & 15;
        __m512 lo = _mm512_load_ps(p->acc[t][row]), hi = _mm512_load_ps(p->acc[t + 1][row]);
        if (p->scaled) lo = _mm512_mul_ps(lo, p->scale_lo), hi = _mm512_mul_ps(hi, p->scale_hi);
        uint16_t *out = p->out + u * p->n;
        if (p->rounding == SILU_MUL) {
            _mm256_storeu_si256((__m256i *)out, silu_mul_bf16x16(round_bf16(lo), round_bf16(hi)));
        } else if (p->rounding == ADD_TO_OUT) { /* the products rounded, then their sums with out */
            const __m512i products = round_two_bf16(lo, hi), sums = _mm512_loadu_si512(out);
            const __m512 even = _mm512_add_ps(even_f32(products), even_f32(sums));
            const __m512 odd = _mm512_add_ps(odd_f32(products), odd_f32(sums));
            _mm512_storeu_si512(out, interleave_halves(round_two_bf16(even, odd)));
        } else {
            _mm512_storeu_si512(out, round_two_bf16(lo, hi));
        }
    }
    p->done = upto;
}

/* Rows a0 and a1 (16 each, row stride k) times B tiles b0 and b1 (16 columns each, k / 32 tiles) into tiles
 * 0-3, rounding the pending block's units a few per step of k meanwhile, then storing the tiles into it. Spread
 * over its steps of k it also asks for `lines` cache lines from `next` on into L2 (a share of the next row
 * block's rows). */
static inline void multiply_block(const uint16_t *a0, const uint16_t *a1, const uint16_t *b0, const uint16_t *b1,
                                  int64_t k, struct pending *p, const char *next, int64_t lines) {
    const int64_t k_tiles = k / 32, ahead = (lines + k_tiles - 1) / k_tiles;
    const int per = (UNITS - p->done + (int)k_tiles - 1) / (int)k_tiles;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t kk = 0; kk < k_tiles; kk++) { /* B tiles with the no-reuse hint: the A tiles stay in L1 */
        _tile_loadd(T_A0, a0 + kk * 32, k * 2);
        _tile_stream_loadd(T_B0, b0 + kk * 512, 64);
        _tile_dpbf16ps(0, T_A0, T_B0);
        _tile_stream_loadd(T_B1, b1 + kk * 512, 64);
        _tile_dpbf16ps(1, T_A0, T_B1);
        _tile_loadd(T_A1, a1 + kk * 32, k * 2);
        _tile_dpbf16ps(2, T_A1, T_B0);
        _tile_dpbf16ps(3, T_A1, T_B1);
        drain(p, p->done + per < UNITS ? p->done + per : UNITS);
        for (int64_t i = kk * ahead; i < (kk + 1) * ahead && i < lines; i++) _mm_prefetch(next + i * 64, _MM_HINT_T1);
    }
    __asm__ volatile("" ::: "memory"); /* GCC's tilestored declares no memory write: the reads above first */
    _tile_stored(0, p->acc[0], 64);
    _tile_stored(1, p->acc[1], 64);
    _tile_stored(2, p->acc[2], 64);
    _tile_stored(3, p->acc[3], 64);
    __asm__ volatile("" ::: "memory");
}

/* out = x w^T for m rows (any), bf16 w in tile_layout (or int8 with `scales`, as tile_linear takes them), in
 * blocks of 32 rows x 32 outputs (ADD_TO_OUT: out +=); with SILU_MUL, w is [2 half, k] and out [m, half] =
 * silu(gate) * up, blocks of 32 rows x 16 outputs (16 of the gate's columns and the up's same 16). Other outputs:
 * n a multiple of 32; SILU_MUL: half a multiple of 16. -2 without memory. */
static int blocked_linear(const uint16_t *x, const void *w_tiles, int w_int8, const void *scales, int scales_bf16,
                          uint16_t *out, int64_t m, int64_t n, int64_t k, enum rounding rounding) {
    const int silu_mul = rounding == SILU_MUL;
    const int64_t k_tiles = k / 32, blocks = n / 32, row_blocks = (m + 31) / 32; /* 32 columns of w per block */
    const int64_t out_n = silu_mul ? n / 2 : n, out_cols = silu_mul ? 16 : 32;
    int64_t chunk = CHUNK_BYTES / (64 * k); /* column blocks per chunk: two B tiles of k / 32 KB each */
    if (chunk < 1) chunk = 1;
    uint16_t *tail = NULL;     /* the last rows, if fewer than 32, padded with zero rows */
    uint16_t *widened = NULL;  /* int8: two chunks' tiles widened to bf16 */
    const int64_t chunk_elems = chunk * 2 * k_tiles * 512; /* a widened chunk: its blocks' two tile columns */
    if (m % 32) {
        if (!(tail = calloc(32 * k, 2))) return -2;
        memcpy(tail, x + (m - m % 32) * k, (m % 32) * k * 2);
    }
    if (w_int8 && !(widened = aligned_alloc(64, 2 * chunk_elems * 2))) {
        free(tail);
        return -2;
    }
    #pragma omp parallel
    {
        configure_blocks();
        struct pending p = {.rows = 0, .done = UNITS}; /* nothing pending */
        for (int64_t c0 = 0; c0 < blocks; c0 += chunk) {
            const int64_t c1 = c0 + chunk < blocks ? c0 + chunk : blocks;
            /* int8: the chunk's tiles widened into the buffer its parity picks; the barrier after this loop also
             * means every thread is done with the chunk before last, whose buffer the next chunk takes */
            uint16_t *chunk_w = w_int8 ? widened + (c0 / chunk % 2) * chunk_elems : NULL;
            if (w_int8) {
                #pragma omp for collapse(2) schedule(static)
                for (int64_t i = 0; i < 2 * (c1 - c0); i++) { /* block c0 + i / 2's side i % 2 */
                    for (int64_t kk = 0; kk < k_tiles; kk++) {
                        const int64_t tc = block_tile_column(c0 + i / 2, i % 2, silu_mul, n);
                        widen_tile((const int8_t *)w_tiles + (tc * k_tiles + kk) * 512, chunk_w + (i * k_tiles + kk) * 512);
                    }
                }
            }
            #pragma omp for collapse(2) schedule(static) nowait
            for (int64_t rb = 0; rb < row_blocks; rb++) {
                for (int64_t cb = c0; cb < c1; cb++) {
                    const uint16_t *a = 32 * rb + 32 <= m ? x + 32 * rb * k : tail;
                    const int64_t t0 = block_tile_column(cb, 0, silu_mul, n), t1 = block_tile_column(cb, 1, silu_mul, n);
                    /* the next row block's rows (32 x k bf16: k cache lines) come into L2 while this one's
                     * column blocks pass, a share of them per block */
                    const int64_t share = (k + (c1 - c0) - 1) / (c1 - c0), first = (cb - c0) * share;
                    const int64_t lines = 32 * rb + 64 <= m && first < k ? (share < k - first ? share : k - first) : 0;
                    /* the block's two tile columns: in the widened chunk (int8), or in the weight */
                    const uint16_t *b0 = w_int8 ? chunk_w + 2 * (cb - c0) * k_tiles * 512
                                                : (const uint16_t *)w_tiles + t0 * k_tiles * 512;
                    const uint16_t *b1 = w_int8 ? b0 + k_tiles * 512 : (const uint16_t *)w_tiles + t1 * k_tiles * 512;
                    multiply_block(a, a + 16 * k, b0, b1, k, &p,
                                   lines ? (const char *)(x + 32 * (rb + 1) * k) + first * 64 : NULL, lines);
                    p.scaled = scales != NULL;
                    if (scales) {
                        p.scale_lo = column_scales(scales, t0, scales_bf16);
                        p.scale_hi = column_scales(scales, t1, scales_bf16);
                    }
                    p.out = out + 32 * rb * out_n + cb * out_cols;
                    p.n = out_n;
                    p.rows = m - 32 * rb < 32 ? (int)(m - 32 * rb) : 32;
                    p.rounding = rounding;
                    p.done = 0;
                }
            }
        }
        drain(&p, UNITS);
        _tile_release(); /* leave no tile state for the thread's next user to save and restore */
    }
    free(tail), free(widened);
    return 0;
}

/* The streaming path on the tiles: every row of x against each 16 output columns' B tiles in turn. */
static void stream_tiles(const uint16_t *x, const void *w_tiles, const void *scales, uint16_t *out, int64_t m,
                         int64_t n, int64_t k, int w_int8, int scales_bf16) {
    const int64_t k_tiles = k / 32, rest = m % 16;
    #pragma omp parallel
    {
        configure(rest);
        float acc[16][16];
        uint16_t widened[512] __attribute__((aligned(64)));
        #pragma omp for schedule(static)
        for (int64_t j = 0; j < n / 16; j++) { /* 16 output columns: their tiles lie one after the other */
            const uint16_t *wj = (const uint16_t *)w_tiles + j * k_tiles * 512;
            const int8_t *wj8 = (const int8_t *)w_tiles + j * k_tiles * 512;
            const __m512 scale = column_scales(scales, j, scales_bf16);
            for (int64_t m0 = 0; m0 < m; m0 += 64) {
                const int64_t left = m - m0, g = left >= 64 ? 4 : left / 16;
                const int with_rest = left < 64 && rest;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                if (with_rest) _tile_zero(T_REST);
                for (int64_t kk = 0; kk < k_tiles; kk++) {
                    if (w_int8) {
                        for (int line = 0; line < 512; line += 64)
                            _mm_prefetch((const char *)(wj8 + (kk + PF_TILES) * 512 + line), _MM_HINT_T0);
                        widen_tile(wj8 + kk * 512, widened);
                        _tile_loadd(T_W, widened, 64);
                    } else {
                        _tile_loadd(T_W, wj + kk * 512, 64);
                    }
                    switch (g) { /* constant tile numbers per case */
                    case 4: PRODUCT(0, 0); PRODUCT(1, 1); PRODUCT(2, 2); PRODUCT(3, 3); break;
                    case 3: PRODUCT(0, 0); PRODUCT(1, 1); PRODUCT(2, 2); break;
                    case 2: PRODUCT(0, 0); PRODUCT(1, 1); break;
                    case 1: PRODUCT(0, 0); break;
                    default: break;
                    }
                    if (with_rest) {
                        _tile_loadd(T_X_REST, x + (m0 + 16 * g) * k + kk * 32, k * 2);
                        _tile_dpbf16ps(T_REST, T_X_REST, T_W);
                    }
                }
                if (g > 0) STORE(0, 0);
                if (g > 1) STORE(1, 1);
                if (g > 2) STORE(2, 2);
                if (g > 3) STORE(3, 3);
                if (with_rest) {
                    _tile_stored(T_REST, acc, 64);
                    __asm__ volatile("" ::: "memory");
                    store_rows(rest, acc, scale, out + (m0 + 16 * g) * n + j * 16, n);
                }
            }
        }
        _tile_release(); /* leave no tile state for the thread's next user to save and restore */
    }
}
#endif

#if defined(HAVE_AVX512_BF16)
/* The streaming path on CPUs with AVX512-BF16 but no tiles (AMD Zen 4): the same layout read as vectors. Tile
 * column j's weights are one run of k / 2 rows of 64 bytes, row p holding columns 2p and 2p + 1 of its 16 outputs
 * side by side, which is what vdpbf16ps multiplies by one pair of x broadcast to every lane: per row of x and
 * 16 outputs, k / 2 dot products of pairs into one fp32 vector. Up to VEC_ROWS rows of x by two tile columns
 * (32 outputs) accumulate in 24 vector registers; each weight row, loaded once from memory, serves them all, and
 * the next rows of x read it again from L2 (two tile columns of k = 1536 take 96 KB). */
#define VEC_ROWS 12

/* Weight row p of a tile column's run, as 16 bf16 pairs: bf16, or int8 widened. */
static inline __attribute__((always_inline)) __m512bh weight_row(const void *run, int64_t p, const int w_int8) {
    if (w_int8) return (__m512bh)widen_int8x32((const int8_t *)run + 32 * p);
    return (__m512bh)_mm512_loadu_si512((const uint16_t *)run + 32 * p);
}

/* Rows [0, r) of x (row stride k) by `cols` tile columns (1 or 2: the runs `run` and `second`), rounded to bf16 with
 * their scales into out (row stride n). Inlined with constant r and cols, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void vector_block(const uint16_t *x, int64_t k, const void *run,
                                                               const void *second, const __m512 scale[2],
                                                               uint16_t *out, int64_t n, const int w_int8,
                                                               const int r, const int cols) {
    const int64_t pairs = k / 2;
    __m512 acc[VEC_ROWS][2];
    for (int i = 0; i < r; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const __m512bh w0 = weight_row(run, p, w_int8);
        const __m512bh w1 = cols == 2 ? weight_row(second, p, w_int8) : w0;
        for (int i = 0; i < r; i++) { /* x's pair p of row i, in every lane; _mm_loadu_si32 reads any alignment */
            const __m512bh xi = (__m512bh)_mm512_broadcastd_epi32(_mm_loadu_si32(x + i * k + 2 * p));
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xi, w0);
            if (cols == 2) acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xi, w1);
        }
    }
    for (int i = 0; i < r; i++) {
        for (int c = 0; c < cols; c++) {
            const __m512 v = _mm512_mul_ps(acc[i][c], scale[c]);
            _mm256_storeu_si256((__m256i *)(out + i * n + 16 * c), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

#define VEC_CASE(R) case R: vector_block(xb, k, run, run + run_bytes, scale, ob, n, w_int8, R, cols); break;
/* One constant-shape block per (rows, columns); int8 and bf16 weights apart, so neither tests per row. */
#define VEC_BLOCK(COLS, INT8) do { const int cols = COLS, w_int8 = INT8; switch (r) { \
    VEC_CASE(1) VEC_CASE(2) VEC_CASE(3) VEC_CASE(4) VEC_CASE(5) VEC_CASE(6) \
    VEC_CASE(7) VEC_CASE(8) VEC_CASE(9) VEC_CASE(10) VEC_CASE(11) VEC_CASE(12) } } while (0)

/* tile_linear's streaming path on vectors, for m <= STREAM_ROWS: each thread takes a share of the pairs of tile
 * columns, and passes every row block of x over each. */
static void stream_vectors(const uint16_t *x, const void *w_tiles, const void *scales, uint16_t *out, int64_t m,
                           int64_t n, int64_t k, int w_int8, int scales_bf16) {
    const int64_t groups = (n / 16 + 1) / 2; /* of two tile columns; the last has one where n / 16 is odd */
    const int64_t run_bytes = k / 2 * 32 * (w_int8 ? 1 : 2); /* one tile column's weights */
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t j = 2 * g, columns = n / 16 - j < 2 ? 1 : 2;
        const char *run = (const char *)w_tiles + j * run_bytes;
        const __m512 scale[2] = {column_scales(scales, j, scales_bf16),
                                 columns == 2 ? column_scales(scales, j + 1, scales_bf16) : _mm512_set1_ps(1.0f)};
        for (int64_t r0 = 0; r0 < m; r0 += VEC_ROWS) {
            const uint16_t *xb = x + r0 * k;
            uint16_t *ob = out + r0 * n + j * 16;
            const int r = m - r0 < VEC_ROWS ? (int)(m - r0) : VEC_ROWS;
            if (columns == 2) {
                if (w_int8) VEC_BLOCK(2, 1); else VEC_BLOCK(2, 0);
            } else {
                if (w_int8) VEC_BLOCK(1, 1); else VEC_BLOCK(1, 0);
            }
        }
    }
}
#endif

/* x [m, k] and out [m, n] bf16, row-major; w_tiles: the weight [n, k] as tile_layout lays it out, bf16, or
 * int8 (w_int8) with scales [n] (fp32, or bf16 if scales_bf16; NULL for none). More than STREAM_ROWS rows, n a
 * multiple of 32, take the blocked path on the tiles (bf16 weights without scales, or int8 with them); without
 * tiles (tile_linear_supported() == 1) only steps of up to STREAM_ROWS rows run, on vectors.
 * Returns 0, 1 where it does not run (neither here, n not a multiple of 16 or k of 32), -2 without memory. */
int tile_linear(const uint16_t *x, const void *w_tiles, const void *scales, uint16_t *out, int64_t m, int64_t n,
                int64_t k, int w_int8, int scales_bf16) {
    if (n % 16 || k <= 0 || k % 32 || m < 1) return 1;
#if defined(HAVE_AMX_BF16)
    if (amx_permitted()) {
        if (m > STREAM_ROWS && n % 32 == 0 && w_int8 == (scales != NULL))
            return blocked_linear(x, w_tiles, w_int8, scales, scales_bf16, out, m, n, k, PRODUCTS);
        stream_tiles(x, w_tiles, scales, out, m, n, k, w_int8, scales_bf16);
        return 0;
    }
#endif
#if defined(HAVE_AVX512_BF16)
    if (m <= STREAM_ROWS) {
        stream_vectors(x, w_tiles, scales, out, m, n, k, w_int8, scales_bf16);
        return 0;
    }
#endif
    (void)x, (void)w_tiles, (void)scales, (void)out, (void)w_int8, (void)scales_bf16;
    return 1;
}

/* out [m, half] = silu(x gate^T) * (x up^T) for x [m, k] and w_tiles the [gate; up] weight [2 half, k] in
 * tile_layout, bf16, or int8 (w_int8) with scales [2 half] as tile_linear takes them, rounded as the bf16 reference
 * rounds (vector_math.h): SwiGLU's activation in the matmul's rounding pass. Returns 0, 1 where it does not run
 * (no tiles here, half not a multiple of 16 or k of 32, scales without int8), -2 without memory. */
int tile_linear_silu_mul(const uint16_t *x, const void *w_tiles, const void *scales, uint16_t *out, int64_t m,
                         int64_t half, int64_t k, int w_int8, int scales_bf16) {
#if defined(HAVE_AMX_BF16)
    if (!amx_permitted() || half % 16 || k <= 0 || k % 32 || w_int8 != (scales != NULL)) return 1;
    return blocked_linear(x, w_tiles, w_int8, scales, scales_bf16, out, m, 2 * half, k, SILU_MUL);
#else
    (void)x, (void)w_tiles, (void)scales, (void)out, (void)m, (void)half, (void)k, (void)w_int8, (void)scales_bf16;
    return 1;
#endif
}

/* residual [m, n] += x w^T for bf16 x [m, k] and the weight [n, k] in tile_layout (bf16, or int8 with scales, as
 * tile_linear takes them), rounded as torch adds a bf16 layer's output to the residual stream (the product rounded
 * to bf16, then the sum): the residual add in the matmul's rounding pass, instead of a pass of its own before the
 * next norm. Steps of more than STREAM_ROWS rows, n a multiple of 32. Returns 0, 1 where it does not run (no tiles
 * here, or the shapes), -2 without memory. */
int tile_linear_add(const uint16_t *x, const void *w_tiles, const void *scales, uint16_t *residual, int64_t m,
                    int64_t n, int64_t k, int w_int8, int scales_bf16) {
#if defined(HAVE_AMX_BF16)
    if (!amx_permitted() || m <= STREAM_ROWS || n % 32 || k <= 0 || k % 32 || w_int8 != (scales != NULL)) return 1;
    return blocked_linear(x, w_tiles, w_int8, scales, scales_bf16, residual, m, n, k, ADD_TO_OUT);
#else
    (void)x, (void)w_tiles, (void)scales, (void)residual, (void)m, (void)n, (void)k, (void)w_int8,
        (void)scales_bf16;
    return 1;
#endif
}

/* bf16 linear layers for the few rows of a decode step on the AMX tiles: out[m, n] = sum_k x[m, k] w[n, k].
 *
 * With a few rows a step streams every weight once and does little with it, so its speed is the memory's.
 * oneDNN's matmul on its own packed weights reads them at ~18 GB/s here at 1-16 rows (of ~28 GB/s copy
 * bandwidth): this kernel reads the weight as AMX B tiles that lie contiguously in memory, one after the
 * other as the tile products want them (tile_layout in linear.py), so each thread streams one run of memory
 * that the hardware prefetchers follow, and reaches ~26 GB/s at one row. The rows of x are the A tiles,
 * read in place (16 rows, or the remainder, by 32 columns). Per 16 output columns, up to 4 A tiles (64
 * rows) share one B tile load; more rows re-read the columns' tiles from cache. Output columns are spread
 * over the process's OpenMP threads. Products are fp32 (the tiles' accumulators), rounded once to bf16.
 * Weight-only int8 (quantization: int8, bf16 activations) takes the same path with half the bytes to read:
 * each int8 tile is widened to bf16 (exact: |w| <= 127) in a 1 KB buffer that stays in L1, and the output
 * columns are scaled by their per-channel scales before rounding; its tiles are prefetched ahead (PF_TILES).
 * Built and loaded by cpu_kernels.py.
 */

#include <stdint.h>

#include "amx.h"
#include "kernels.h"

/* Whether tile_linear runs here: built with the tile instructions and granted the tile registers. */
int tile_linear_supported(void) {
#if defined(HAVE_AMX_BF16)
    return amx_permitted();
#else
    return 0;
#endif
}

#if defined(HAVE_AMX_BF16)
/* Tile registers (literal numbers: the tile intrinsics paste them into register names): 0-3 accumulate 16
 * full rows each, T_REST the remainder rows (fewer than 16) of the last pass. */
#define T_W 4
#define T_X 5
#define T_X_REST 6
#define T_REST 7
/* int8 tiles are asked for this many tiles (4 KB) ahead: the widening between tile products left the
 * hardware prefetcher behind (SmolLM2's int8 layers at one row 7.9 -> 5.4 ms; 4 or 16 ahead were slower).
 * bf16 tiles stream without it, and asking ahead made them slower (10.4 -> 11.2 ms at one row). */
#define PF_TILES 8

static void configure(int64_t rest) {
    struct tile_config c = {0};
    c.palette = 1;
    for (int t = 0; t < 4; t++) c.rows[t] = 16, c.colsb[t] = 64; /* 16 rows x 16 columns, fp32 */
    c.rows[T_W] = 16, c.colsb[T_W] = 64;                        /* 16 column pairs x 16 outputs, bf16 pairs */
    c.rows[T_X] = 16, c.colsb[T_X] = 64;                        /* 16 rows x 32 columns, bf16 */
    if (rest) c.rows[T_X_REST] = c.rows[T_REST] = rest, c.colsb[T_X_REST] = c.colsb[T_REST] = 64;
    _tile_loadconfig(&c);
}

/* An accumulator tile's rows times the columns' scales, rounded to bf16, into out (row stride n). */
static inline void store_rows(int tile_rows, float acc[16][16], __m512 scale, uint16_t *out, int64_t n) {
    for (int r = 0; r < tile_rows; r++) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(acc[r]), scale);
        _mm256_storeu_si256((__m256i *)(out + r * n), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* An int8 B tile (512 weights) widened to bf16 into buf: int8 -> int32 -> fp32 -> bf16, all exact. */
static inline void widen_tile(const int8_t *w, uint16_t *buf) {
    for (int i = 0; i < 512; i += 32) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + i))));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + i + 16))));
        _mm512_store_si512((__m512i *)(buf + i), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* The 16 scales of output columns 16j.. as fp32 (stored as fp32 or bf16), or ones without scales. */
static inline __m512 column_scales(const void *scales, int64_t j, int scales_bf16) {
    if (!scales) return _mm512_set1_ps(1.0f);
    if (!scales_bf16) return _mm512_loadu_ps((const float *)scales + 16 * j);
    const __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)scales + 16 * j));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

#define PRODUCT(T, i) do { _tile_loadd(T_X, x + (m0 + 16 * (i)) * k + kk * 32, k * 2); \
                           _tile_dpbf16ps(T, T_X, T_W); } while (0)
#define STORE(T, i) do { _tile_stored(T, acc, 64); \
                         store_rows(16, acc, scale, out + (m0 + 16 * (i)) * n + j * 16, n); } while (0)
#endif

/* x [m, k] and out [m, n] bf16, row-major; w_tiles: the weight [n, k] as tile_layout lays it out, bf16, or
 * int8 (w_int8) with scales [n] (fp32, or bf16 if scales_bf16; NULL for none).
 * Returns 0, or 1 where it does not run (no tiles here, n not a multiple of 16 or k of 32). */
int tile_linear(const uint16_t *x, const void *w_tiles, const void *scales, uint16_t *out, int64_t m, int64_t n,
                int64_t k, int w_int8, int scales_bf16) {
#if defined(HAVE_AMX_BF16)
    if (!amx_permitted() || n % 16 || k % 32) return 1;
    const int64_t k_tiles = k / 32, full = m / 16, rest = m % 16;
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
                    store_rows(rest, acc, scale, out + (m0 + 16 * g) * n + j * 16, n);
                }
            }
        }
        _tile_release(); /* leave no tile state for the thread's next user to save and restore */
    }
    return 0;
#else
    (void)x, (void)w_tiles, (void)scales, (void)out, (void)m, (void)n, (void)k, (void)w_int8, (void)scales_bf16;
    return 1;
#endif
}

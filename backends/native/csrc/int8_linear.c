/* Weight-only int8 matmul for the few rows of a decode step: out[m, n] = scales[n] * sum_k x[m, k] * w[n, k]
 * for x [m, k] and out [m, n] stored as fp32 or bf16, w [n, k] int8, scales [n] in x's storage type.
 * Arithmetic is fp32.
 *
 * With a handful of rows the step streams every weight once and does little with it, so its speed is the
 * memory's: int8 weights are a quarter of fp32's bytes. torch's own _weight_int8pack_mm has no AVX2 path
 * (slower than an fp32 oneDNN matmul at one row on AVX2: benchmarks/int8_matmul.py), so this one
 * is written to vectorise on any x86-64 level: each int8 weight is widened once for up to ROWS rows of x.
 * Output columns are spread over the process's OpenMP threads: each thread streams its own weight rows.
 * Many rows (a prefill) are not its job: linear_kernels.py dequantises and calls a blocked GEMM there.
 * Built and loaded by cpu_kernels.py.
 */

#include <stdint.h>

#include "bf16.h"

#define ROWS 4  /* rows of x per pass over a weight row */
#define LANES 16 /* partial sums per row: independent FMA chains, so the adds do not wait on each other */

/* Rows r0..r0+nrows-1 (nrows <= ROWS) of x times weight row wn: the sums into acc. */
static inline __attribute__((always_inline)) void dot_tile(const void *x, const int8_t *wn, const int64_t r0,
                                                            const int nrows, const int64_t k, float *acc,
                                                            const int bf16) {
    float part[ROWS][LANES] = {{0.0f}};
    int64_t i = 0;
    for (; i + LANES <= k; i += LANES) {
        for (int j = 0; j < nrows; j++) {
            #pragma omp simd
            for (int l = 0; l < LANES; l++) part[j][l] += load(x, (r0 + j) * k + i + l, bf16) * (float)wn[i + l];
        }
    }
    for (int j = 0; j < nrows; j++) {
        float a = 0.0f;
        for (int l = 0; l < LANES; l++) a += part[j][l];
        for (int64_t t = i; t < k; t++) a += load(x, (r0 + j) * k + t, bf16) * (float)wn[t];
        acc[j] = a;
    }
}

static inline __attribute__((always_inline)) void dot_rows(const void *x, const int8_t *wn, const float scale,
                                                            void *out, const int64_t rows, const int64_t n,
                                                            const int64_t k, const int64_t col, const int bf16) {
    for (int64_t r = 0; r < rows; r += ROWS) {
        float acc[ROWS];
        const int left = rows - r < ROWS ? (int)(rows - r) : ROWS;
        switch (left) { /* constant row counts: each case unrolls into registers */
            case 1: dot_tile(x, wn, r, 1, k, acc, bf16); break;
            case 2: dot_tile(x, wn, r, 2, k, acc, bf16); break;
            case 3: dot_tile(x, wn, r, 3, k, acc, bf16); break;
            default: dot_tile(x, wn, r, ROWS, k, acc, bf16);
        }
        for (int j = 0; j < left; j++) store(out, (r + j) * n + col, acc[j] * scale, bf16);
    }
}

int int8_linear(const void *x, const int8_t *w, const void *scales, void *out, int64_t rows, int64_t n, int64_t k,
                int is_bf16) {
    #pragma omp parallel for schedule(static)
    for (int64_t col = 0; col < n; col++) {
        const int8_t *wn = w + col * k;
        if (is_bf16) dot_rows(x, wn, load(scales, col, 1), out, rows, n, k, col, 1);
        else dot_rows(x, wn, load(scales, col, 0), out, rows, n, k, col, 0);
    }
    return 0;
}

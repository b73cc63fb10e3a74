/* fp32 linear layers for steps of up to 128 rows (STRIP_ROWS in linear_kernels.py) on AVX-512: out[m, n] = sum_k x[m, k] w[n, k].
 *
 * A decode step streams every weight once; oneDNN's fp32 matmul on its packed weights does not overlap that
 * stream with its arithmetic, and reads at about half the copy bandwidth (docs/performance.md, "Measurements behind the code"). This kernel reads the weight as
 * strips of 32 output columns laid out k-major (strip_layout in linear_kernels.py: [n / 32][k][32], 128 bytes per k),
 * so each thread streams one contiguous run and prefetches it 4 KB ahead. Per strip and 128 columns of k
 * (16 KB, kept in L1) up to 12 rows at a time accumulate in 24 vector registers: each k loads the strip's
 * two vectors once and broadcasts one x value per row. Partial sums of a strip's rows live in `out` between
 * the passes over k. Strips are spread over the process's OpenMP threads. Built and loaded by cpu_kernels.py.
 */

#include <stdint.h>

#include "kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define STRIP 32          /* output columns per strip: two 16-float vectors */
#define KC 128            /* columns of k per pass: a strip's 16 KB slice stays in L1 for every row block */
#define ROWS 12           /* rows per block: 2 x 12 accumulators of the 32 vector registers */
#define PREFETCH 1024     /* floats ahead of the strip's current k (4 KB): the stream's next pages */

/* Whether strip_linear runs here: built for AVX-512. */
int strip_linear_supported(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)
/* Rows [0, r) of x (row stride ldx) times kc columns of one strip's slice w, added to out (row stride ldo),
 * or written there when `first`. Inlined with a constant r, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void strip_block(const float *x, int64_t ldx, const float *w, float *out,
                                                              int64_t ldo, int64_t kc, const int r, int first) {
    __m512 acc[ROWS][2];
    for (int i = 0; i < r; i++) {
        acc[i][0] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + i * ldo);
        acc[i][1] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + i * ldo + 16);
    }
    for (int64_t kk = 0; kk < kc; kk++) {
        const float *wk = w + kk * STRIP;
        _mm_prefetch((const char *)(wk + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(wk + PREFETCH + 16), _MM_HINT_T0);
        const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
        for (int i = 0; i < r; i++) {
            const __m512 xi = _mm512_set1_ps(x[i * ldx + kk]);
            acc[i][0] = _mm512_fmadd_ps(xi, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(xi, w1, acc[i][1]);
        }
    }
    for (int i = 0; i < r; i++) {
        _mm512_storeu_ps(out + i * ldo, acc[i][0]);
        _mm512_storeu_ps(out + i * ldo + 16, acc[i][1]);
    }
}

#define ROW_CASE(R) case R: strip_block(xb, k, wb, ob, n, kc, R, first); break;
#endif

/* out [m, n] = x [m, k] @ w.T from w's strips; returns nonzero (and writes nothing) where it cannot run. */
int strip_linear(const float *x, const float *w_strips, float *out, int64_t m, int64_t n, int64_t k) {
#if defined(__AVX512F__)
    if (n % STRIP != 0 || m < 1 || k < 1) return 1;
    #pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < n / STRIP; s++) {
        const float *strip = w_strips + s * k * STRIP;
        for (int64_t k0 = 0; k0 < k; k0 += KC) {
            const int64_t kc = k - k0 < KC ? k - k0 : KC;
            const int first = k0 == 0;
            for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
                const float *xb = x + r0 * k + k0, *wb = strip + k0 * STRIP;
                float *ob = out + r0 * n + s * STRIP;
                switch (m - r0 < ROWS ? (int)(m - r0) : ROWS) {
                    ROW_CASE(1) ROW_CASE(2) ROW_CASE(3) ROW_CASE(4) ROW_CASE(5) ROW_CASE(6)
                    ROW_CASE(7) ROW_CASE(8) ROW_CASE(9) ROW_CASE(10) ROW_CASE(11) ROW_CASE(12)
                }
            }
        }
    }
    return 0;
#else
    (void)x, (void)w_strips, (void)out, (void)m, (void)n, (void)k;
    return 1;
#endif
}

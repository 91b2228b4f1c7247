/* Linear layers for prompt rows (AVX2): y (M x N, fp32) = x (M x K, fp32) @ w (N x K).T, M large.

   Prefill multiplies hundreds of rows by each weight, so it is bound by arithmetic, not by
   reading the weight, and linear.c's dot-product tiles (one 8-lane accumulator per output,
   summed across at the end) spend too much on loads and on widening bf16 per row tile. Here,
   as in BLIS-style kernels, a panel of 16 weight rows is widened once into a k-major buffer,
   and each output is a lane of a register: 6 input rows x 16 outputs, one broadcast of x per
   row and step of k, 12 FMAs per 8 loads. Measured on the default model's layers at 800 rows,
   about twice linear.c's throughput.

   Every output (m, n) is summed in one fixed order whatever M is and wherever the row falls in
   a tile (an FMA chain over each block of KB k's, the blocks' sums added in order), so a
   prompt token gets the same bits in any prefill, chunked or not, batched or not. They are not
   linear.c's bits: the engine sends prompt rows here and decode and verify rows there, always.
   The blocks keep the widened panel in L1, and short chains keep the rounding error near
   linear.c's. N must be a multiple of 8. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "pool.h"

#define PANEL 16 /* weight rows widened together */
#define ROWS 6   /* input rows per register tile */
#define KB 256   /* k per block: the panel's 16 KB stays in L1 */

/* rows m0..m0+MM of x against the panel (KB x 16, k-major, fp32) over k in [k0, k0 + kn) */
#define DEFINE_TILE(NAME, NV)                                                                    \
    static inline __attribute__((always_inline)) void NAME(                                      \
        const float *panel, const float *x, float *y, int64_t K, int64_t N, int64_t n0,          \
        int64_t k0, int64_t kn, const int MM) {                                                  \
        __m256 acc[ROWS][2];                                                                     \
        for (int i = 0; i < MM; i++)                                                             \
            for (int v = 0; v < NV; v++)                                                         \
                acc[i][v] = _mm256_setzero_ps();                                                 \
        for (int64_t k = 0; k < kn; k++) {                                                       \
            __m256 b[2];                                                                         \
            for (int v = 0; v < NV; v++) b[v] = _mm256_load_ps(panel + k * PANEL + 8 * v);       \
            for (int i = 0; i < MM; i++) {                                                       \
                __m256 a = _mm256_broadcast_ss(x + i * K + k0 + k);                              \
                for (int v = 0; v < NV; v++) acc[i][v] = _mm256_fmadd_ps(a, b[v], acc[i][v]);    \
            }                                                                                    \
        }                                                                                        \
        for (int i = 0; i < MM; i++)                                                             \
            for (int v = 0; v < NV; v++) {                                                       \
                float *out = y + i * N + n0 + 8 * v;                                             \
                _mm256_storeu_ps(out, k0 ? _mm256_add_ps(_mm256_loadu_ps(out), acc[i][v]) : acc[i][v]); \
            }                                                                                    \
    }

DEFINE_TILE(tile16, 2)
DEFINE_TILE(tile8, 1)

#define ROW_TILES(TILE)                                                                          \
    for (int64_t m0 = 0; m0 < M; m0 += ROWS) {                                                   \
        const float *xm = x + m0 * K;                                                            \
        float *ym = y + m0 * N;                                                                  \
        switch (M - m0 < ROWS ? M - m0 : ROWS) {                                                 \
        case 6: TILE(panel, xm, ym, K, N, n0, k0, kn, 6); break;                                 \
        case 5: TILE(panel, xm, ym, K, N, n0, k0, kn, 5); break;                                 \
        case 4: TILE(panel, xm, ym, K, N, n0, k0, kn, 4); break;                                 \
        case 3: TILE(panel, xm, ym, K, N, n0, k0, kn, 3); break;                                 \
        case 2: TILE(panel, xm, ym, K, N, n0, k0, kn, 2); break;                                 \
        default: TILE(panel, xm, ym, K, N, n0, k0, kn, 1); break;                                \
        }                                                                                        \
    }

static inline float widen_bf16(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

typedef struct {
    const void *w;
    const float *x;
    float *y;
    int64_t M, N, K;
    int bf16;
} prefill_job;

static void prefill_share(void *ctx, int share, int shares) {
    const prefill_job *job = (const prefill_job *)ctx;
    const float *x = job->x;
    float *y = job->y;
    const int64_t M = job->M, N = job->N, K = job->K;
    float *panel = aligned_alloc(32, sizeof(float) * KB * PANEL);
    if (!panel) return;
    int64_t panels = (N + PANEL - 1) / PANEL;
    for (int64_t p = panels * share / shares; p < panels * (share + 1) / shares; p++) {
        const int64_t n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;
        for (int64_t k0 = 0; k0 < K; k0 += KB) {
            const int64_t kn = K - k0 < KB ? K - k0 : KB;
            for (int64_t n = 0; n < width; n++) {
                if (job->bf16) {
                    const uint16_t *row = (const uint16_t *)job->w + (n0 + n) * K + k0;
                    for (int64_t k = 0; k < kn; k++) panel[k * PANEL + n] = widen_bf16(row[k]);
                } else {
                    const float *row = (const float *)job->w + (n0 + n) * K + k0;
                    for (int64_t k = 0; k < kn; k++) panel[k * PANEL + n] = row[k];
                }
            }
            if (width == PANEL) {
                ROW_TILES(tile16)
            } else {
                ROW_TILES(tile8)
            }
        }
    }
    free(panel);
}

/* Returns 0, or -1 where N is not a multiple of 8. */
int linear_prefill(const void *w, const float *x, float *y, int64_t M, int64_t N, int64_t K, int bf16) {
    if (N % 8) return -1;
    prefill_job job = {w, x, y, M, N, K, bf16 != 0};
    pool_run(prefill_share, &job);
    return 0;
}

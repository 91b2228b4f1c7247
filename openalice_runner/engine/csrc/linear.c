/* Small-M linear layers for AVX2 CPUs: y (M x N, fp32) = x (M x K, fp32) @ w (N x K).T.

   Decode and speculative verify multiply a handful of rows by a large weight, so the cost is
   reading the weight once. General GEMM libraries pack the weight per call and, for bf16 on
   CPUs without bf16 arithmetic, convert it too; for M = 2..8 that costs 2-4x a one-row pass.
   Here each tile of weight rows is read (and widened from bf16) once and multiplied by every
   input row while it sits in registers. The weights stream from memory, so each tile asks for
   the rows a few tiles ahead (software prefetch): measured over the model's layers, a one-row
   pass takes 10.5 ms instead of 13.8.

   Every output (m, n) is one 8-lane accumulator over k in a fixed order, whatever M is, so a
   one-row decode and a many-row verify of the same token agree bit for bit. */
#include <immintrin.h>
#include <stdint.h>

#include "pool.h"
#include "vec.h"

#define NT 2 /* weight rows per tile */
#define MT 4 /* input rows per tile */
#define WIDE_MT 8 /* up to this many rows: one pass over each weight row */
#define PREFETCH_AHEAD 4096 /* bytes: the weight rows of the next tiles */

static inline __m256 load_bf16(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __m256 load_f32(const float *p) { return _mm256_loadu_ps(p); }

/* NN weight rows from n0 times MM input rows from m0; NN and MM are constants after inlining. */
#define DEFINE_TILE(NAME, WTYPE, LOAD)                                                          \
    static inline __attribute__((always_inline)) void NAME(                                     \
        const WTYPE *w, const float *x, float *y, int64_t n0, int64_t m0, int64_t N, int64_t K, \
        const int NN, const int MM) {                                                           \
        __m256 acc[NT][WIDE_MT];                                                                \
        for (int i = 0; i < NN; i++)                                                            \
            for (int j = 0; j < MM; j++) acc[i][j] = _mm256_setzero_ps();                       \
        const WTYPE *wr = w + n0 * K;                                                           \
        const float *xr = x + m0 * K;                                                           \
        for (int64_t k = 0; k < K; k += 8) {                                                    \
            _mm_prefetch((const char *)(wr + (NN - 1) * K + k) + PREFETCH_AHEAD, _MM_HINT_T0);   \
            __m256 a[NT];                                                                       \
            for (int i = 0; i < NN; i++) a[i] = LOAD(wr + i * K + k);                           \
            for (int j = 0; j < MM; j++) {                                                      \
                __m256 v = _mm256_loadu_ps(xr + j * K + k);                                     \
                for (int i = 0; i < NN; i++) acc[i][j] = _mm256_fmadd_ps(a[i], v, acc[i][j]);   \
            }                                                                                   \
        }                                                                                       \
        for (int i = 0; i < NN; i++)                                                            \
            for (int j = 0; j < MM; j++) y[(m0 + j) * N + n0 + i] = hsum(acc[i][j]);            \
    }

#define ROWS_OF_X(TILE, NN)                                                                    \
    for (int64_t m0 = 0; m0 < M; m0 += MT) {                                                   \
        switch (M - m0 < MT ? M - m0 : MT) {                                                   \
        case 4: TILE(w, x, y, n0, m0, N, K, NN, 4); break;                                     \
        case 3: TILE(w, x, y, n0, m0, N, K, NN, 3); break;                                     \
        case 2: TILE(w, x, y, n0, m0, N, K, NN, 2); break;                                     \
        default: TILE(w, x, y, n0, m0, N, K, NN, 1); break;                                    \
        }                                                                                      \
    }

typedef struct {
    const void *w;
    const float *x;
    float *y;
    int64_t M, N, K;
} linear_job;

/* K must be a multiple of 8; x, w and y contiguous. Each share takes a contiguous run of blocks. */
#define DEFINE_LINEAR(NAME, TILE, WTYPE)                                                       \
    static void NAME##_share(void *ctx, int share, int shares) {                               \
        const linear_job *job = (const linear_job *)ctx;                                       \
        const WTYPE *w = (const WTYPE *)job->w;                                                \
        const float *x = job->x;                                                               \
        float *y = job->y;                                                                     \
        int64_t M = job->M, N = job->N, K = job->K;                                            \
        int64_t blocks = (N + NT - 1) / NT;                                                    \
        for (int64_t b = blocks * share / shares; b < blocks * (share + 1) / shares; b++) {    \
            int64_t n0 = b * NT;                                                               \
            if (M > MT && M <= WIDE_MT) {                                                      \
                /* 5..8 rows: all of them against one weight row at a time, so the weights */  \
                /* stream from memory once while the rows stay in L1 */                        \
                for (int64_t n = n0; n < n0 + NT && n < N; n++) {                              \
                    switch (M) {                                                               \
                    case 8: TILE(w, x, y, n, 0, N, K, 1, 8); break;                            \
                    case 7: TILE(w, x, y, n, 0, N, K, 1, 7); break;                            \
                    case 6: TILE(w, x, y, n, 0, N, K, 1, 6); break;                            \
                    default: TILE(w, x, y, n, 0, N, K, 1, 5); break;                           \
                    }                                                                          \
                }                                                                              \
            } else if (N - n0 >= 2) {                                                          \
                ROWS_OF_X(TILE, 2)                                                             \
            } else {                                                                           \
                ROWS_OF_X(TILE, 1)                                                             \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    void NAME(const WTYPE *w, const float *x, float *y, int64_t M, int64_t N, int64_t K) {     \
        linear_job job = {w, x, y, M, N, K};                                                   \
        pool_run(NAME##_share, &job);                                                          \
    }

DEFINE_TILE(tile_bf16, uint16_t, load_bf16)
DEFINE_TILE(tile_f32, float, load_f32)
DEFINE_LINEAR(linear_bf16, tile_bf16, uint16_t)
DEFINE_LINEAR(linear_f32, tile_f32, float)

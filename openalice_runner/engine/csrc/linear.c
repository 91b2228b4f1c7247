/* Linear layers for AVX2 (and AVX-512) CPUs: y (M x N, fp32) = x (M x K, fp32) @ w (N x K).T, any M.

   One kernel serves a one-row decode, a verify of a few draft rows, a batch of sequences and
   a prefill of hundreds of prompt rows, and gives every row the same bits whatever the other
   rows are. That is what keeps speculative and batched output identical to plain decoding.

   The weight is packed once, at load, into panels of 16 output rows stored k-major: step k of
   a panel is the 16 weights that multiply x[., k], 32 contiguous bytes of bf16. A register
   tile of up to 6 input rows x 16 outputs broadcasts x[m, k] and does 2 FMAs per row per step
   (BLIS-style); widening bf16 is two unpacks per step, shared by all rows of the tile (the
   panel's order is permuted so that the unpacks land columns 0-7 and 8-15 in place).
   - One row (decode) streams the weight from memory once; the panels are read in order and
     prefetched ahead. Each output's sum is one FMA chain, so a one-row tile over one panel has
     only 2 chains in flight and waits on the FMA's latency (on an AMD EPYC, 4 cycles a step);
     one or two rows therefore take several panels at once (FEW_PANELS), the same chains side
     by side: 1.5-1.7x on weights in cache (a draft model, a head), 1.08-1.13x on the default
     model's, which come from memory (docs/benchmarks/2026-12-07-avx2-loops.md).
   - Several rows reuse each panel step from registers, and across row tiles from L1 (k runs in
     blocks of KB), so a verify or a batch of 8 costs little more than one row, and a prefill
     runs at arithmetic speed.

   Every output (m, n) is the same sum in the same order for any M and any tile it falls in:
   an FMA chain over each block of KB k's from zero, the blocks' sums added in order. */
#define _GNU_SOURCE
#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx.h"
#include "pool.h"

#define PANEL 16         /* output rows per panel */
#define ROWS 6           /* input rows per register tile */
#define KB 256           /* k per block: a panel block (8 KB bf16) stays in L1 across row tiles */
#define PREFETCH_AHEAD 2048 /* bytes of panel ahead of the step being read */

/* panel slot -> output column within a full bf16 panel, for the in-place unpacks below */
static const int BF16_ORDER[PANEL] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

/* The 16 (or 8, the last panel of an N % 16 == 8 weight) weights of one step as fp32. */
static inline void load_bf16_16(const uint16_t *p, __m256 *b) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), zero = _mm256_setzero_si256();
    b[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v)); /* columns 0-7 */
    b[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v)); /* columns 8-15 */
}
static inline void load_bf16_8(const uint16_t *p, __m256 *b) {
    b[0] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline void load_f32_16(const float *p, __m256 *b) {
    b[0] = _mm256_loadu_ps(p);
    b[1] = _mm256_loadu_ps(p + 8);
}
static inline void load_f32_8(const float *p, __m256 *b) { b[0] = _mm256_loadu_ps(p); }

/* MM rows of x (row stride K) against one panel block of kn steps; NV = panel width / 8.
   `first`: this is the first k block, so y is set rather than added to. */
#define DEFINE_TILE(NAME, WTYPE, NV, LOAD)                                                       \
    static inline __attribute__((always_inline)) void NAME(                                      \
        const WTYPE *wp, const float *x, float *y, int64_t K, int64_t N, int64_t kn, int first,  \
        const int MM) {                                                                          \
        __m256 acc[ROWS][2];                                                                     \
        for (int i = 0; i < MM; i++)                                                             \
            for (int v = 0; v < NV; v++) acc[i][v] = _mm256_setzero_ps();                        \
        for (int64_t k = 0; k < kn; k++) {                                                       \
            _mm_prefetch((const char *)(wp + k * 8 * NV) + PREFETCH_AHEAD, _MM_HINT_T0);         \
            __m256 b[2];                                                                         \
            LOAD(wp + k * 8 * NV, b);                                                            \
            for (int i = 0; i < MM; i++) {                                                       \
                const __m256 a = _mm256_broadcast_ss(x + i * K + k);                             \
                for (int v = 0; v < NV; v++) acc[i][v] = _mm256_fmadd_ps(a, b[v], acc[i][v]);    \
            }                                                                                    \
        }                                                                                        \
        for (int i = 0; i < MM; i++)                                                             \
            for (int v = 0; v < NV; v++) {                                                       \
                float *out = y + i * N + 8 * v;                                                  \
                _mm256_storeu_ps(out, first ? acc[i][v] : _mm256_add_ps(_mm256_loadu_ps(out), acc[i][v])); \
            }                                                                                    \
    }

DEFINE_TILE(tile_bf16_16, uint16_t, 2, load_bf16_16)
DEFINE_TILE(tile_bf16_8, uint16_t, 1, load_bf16_8)
DEFINE_TILE(tile_f32_16, float, 2, load_f32_16)
DEFINE_TILE(tile_f32_8, float, 1, load_f32_8)

/* MM (1 or 2) rows against NP full panels side by side (`pstride` elements apart): 2 * MM * NP
   FMA chains in flight instead of 2 * MM, each output still its own chain in the same order. */
#define FEW_PANELS 4 /* panels side by side for one row (two rows take 2): 8 chains */
#define DEFINE_FEW_TILE(NAME, WTYPE, LOAD)                                                        \
    static inline __attribute__((always_inline)) void NAME(                                      \
        const WTYPE *wp, int64_t pstride, const float *x, float *y, int64_t K, int64_t N, int64_t kn, \
        int first, const int MM, const int NP) {                                                 \
        __m256 acc[2][FEW_PANELS][2];                                                            \
        for (int i = 0; i < MM; i++)                                                             \
            for (int p = 0; p < NP; p++) acc[i][p][0] = acc[i][p][1] = _mm256_setzero_ps();      \
        for (int64_t k = 0; k < kn; k++) {                                                       \
            __m256 a[2];                                                                         \
            for (int i = 0; i < MM; i++) a[i] = _mm256_broadcast_ss(x + i * K + k);              \
            for (int p = 0; p < NP; p++) {                                                       \
                const WTYPE *step = wp + p * pstride + k * PANEL;                                \
                _mm_prefetch((const char *)step + PREFETCH_AHEAD, _MM_HINT_T0);                  \
                __m256 b[2];                                                                     \
                LOAD(step, b);                                                                   \
                for (int i = 0; i < MM; i++)                                                     \
                    for (int v = 0; v < 2; v++) acc[i][p][v] = _mm256_fmadd_ps(a[i], b[v], acc[i][p][v]); \
            }                                                                                    \
        }                                                                                        \
        for (int i = 0; i < MM; i++)                                                             \
            for (int p = 0; p < NP; p++)                                                         \
                for (int v = 0; v < 2; v++) {                                                    \
                    float *out = y + i * N + p * PANEL + 8 * v;                                  \
                    _mm256_storeu_ps(out, first ? acc[i][p][v] : _mm256_add_ps(_mm256_loadu_ps(out), acc[i][p][v])); \
                }                                                                                \
    }

DEFINE_FEW_TILE(few_bf16, uint16_t, load_bf16_16)
DEFINE_FEW_TILE(few_f32, float, load_f32_16)

/* NP consecutive full panels from n0 for M (1 or 2) rows, over every k block */
#define FEW_ROWS(FEW, WTYPE)                                                                     \
    for (int64_t k0 = 0; k0 < K; k0 += KB) {                                                     \
        const int64_t kn = K - k0 < KB ? K - k0 : KB;                                            \
        const int first = k0 == 0;                                                               \
        const WTYPE *wp = (const WTYPE *)job->w + n0 * K + k0 * PANEL;                           \
        const float *xm = x + k0;                                                                \
        float *ym = y + n0;                                                                      \
        if (M == 1) {                                                                            \
            switch (np) {                                                                        \
            case 4: FEW(wp, PANEL * K, xm, ym, K, N, kn, first, 1, 4); break;                    \
            case 3: FEW(wp, PANEL * K, xm, ym, K, N, kn, first, 1, 3); break;                    \
            case 2: FEW(wp, PANEL * K, xm, ym, K, N, kn, first, 1, 2); break;                    \
            default: FEW(wp, PANEL * K, xm, ym, K, N, kn, first, 1, 1); break;                   \
            }                                                                                    \
        } else if (np == 2) {                                                                    \
            FEW(wp, PANEL * K, xm, ym, K, N, kn, first, 2, 2);                                   \
        } else {                                                                                 \
            FEW(wp, PANEL * K, xm, ym, K, N, kn, first, 2, 1);                                   \
        }                                                                                        \
    }

#define ROW_TILES(TILE)                                                                          \
    for (int64_t m0 = 0; m0 < M; m0 += ROWS) {                                                   \
        const float *xm = x + m0 * K + k0;                                                       \
        float *ym = y + m0 * N + n0;                                                             \
        switch (M - m0 < ROWS ? M - m0 : ROWS) {                                                 \
        case 6: TILE(wp, xm, ym, K, N, kn, first, 6); break;                                     \
        case 5: TILE(wp, xm, ym, K, N, kn, first, 5); break;                                     \
        case 4: TILE(wp, xm, ym, K, N, kn, first, 4); break;                                     \
        case 3: TILE(wp, xm, ym, K, N, kn, first, 3); break;                                     \
        case 2: TILE(wp, xm, ym, K, N, kn, first, 2); break;                                     \
        default: TILE(wp, xm, ym, K, N, kn, first, 1); break;                                    \
        }                                                                                        \
    }

typedef struct {
    const void *w;
    const float *x;
    float *y;
    int64_t M, N, K;
} linear_job;

/* Each share takes a contiguous run of panels: panel p holds outputs 16p.. and starts at
   w + 16p * K (a full panel is 16 K weights, the last one of an N % 16 == 8 weight 8 K). */
#define DEFINE_LINEAR(NAME, WTYPE, TILE16, TILE8, FEW)                                           \
    static void NAME##_share(void *ctx, int share, int shares) {                                 \
        const linear_job *job = (const linear_job *)ctx;                                         \
        const float *x = job->x;                                                                 \
        float *y = job->y;                                                                       \
        const int64_t M = job->M, N = job->N, K = job->K;                                        \
        const int64_t panels = (N + PANEL - 1) / PANEL, full = N / PANEL;                        \
        const int64_t end = panels * (share + 1) / shares;                                       \
        int64_t p = panels * share / shares;                                                     \
        if (M == 1 || M == 2) { /* full panels a few at a time; a half panel in the loop below */ \
            const int64_t group = M == 1 ? FEW_PANELS : 2, stop = end < full ? end : full;       \
            for (int64_t np; p < stop; p += np) {                                                \
                const int64_t n0 = p * PANEL;                                                    \
                np = stop - p < group ? stop - p : group;                                        \
                FEW_ROWS(FEW, WTYPE)                                                             \
            }                                                                                    \
        }                                                                                        \
        for (; p < end; p++) {                                                                   \
            const int64_t n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;               \
            const WTYPE *panel = (const WTYPE *)job->w + n0 * K;                                 \
            for (int64_t k0 = 0; k0 < K; k0 += KB) {                                             \
                const int64_t kn = K - k0 < KB ? K - k0 : KB;                                    \
                const int first = k0 == 0;                                                       \
                const WTYPE *wp = panel + k0 * width;                                            \
                if (width == PANEL) {                                                            \
                    ROW_TILES(TILE16)                                                            \
                } else {                                                                         \
                    ROW_TILES(TILE8)                                                             \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    void NAME(const WTYPE *w, const float *x, float *y, int64_t M, int64_t N, int64_t K) {       \
        linear_job job = {w, x, y, M, N, K};                                                     \
        pool_run(NAME##_share, &job);                                                            \
    }

DEFINE_LINEAR(linear_bf16_avx2, uint16_t, tile_bf16_16, tile_bf16_8, few_bf16)
DEFINE_LINEAR(linear_f32, float, tile_f32_16, tile_f32_8, few_f32)

/* AVX-512 (where the CPU has it): the same sums in the same order, twice the arithmetic.

   A zmm register holds a whole panel step (16 outputs), so a register tile is up to WROWS
   input rows x 2 panels: 24 accumulators, one FMA per row and panel per k. On two cores the
   AVX2 tile above is arithmetic-bound past about six rows; with twice the arithmetic per
   instruction an 8-row pass costs about 1.4 one-row passes instead of 1.5, a 16-row one 2.1
   instead of 2.2 (whole passes, README), and a one-row pass is faster too. Each output is still an
   FMA chain over each block of KB k's from zero, the blocks' sums added in order, so it gets
   the same bits as the AVX2 kernel. Full bf16 panels are stored for it with their steps in
   pairs (`pack_weight`, where K is even): 64 bytes hold steps k and k + 1 of the 16 outputs,
   (k, k + 1) side by side per output, the layout `vdpbf16ps` and AMX tiles read as it is; this
   tile widens step k from the pairs' low halves and k + 1 from their high halves, and runs the
   same FMA chain. Half panels (N % 16 == 8) keep the AVX2 tile. */
#define WROWS 12 /* input rows per AVX-512 register tile */
#define AVX512 __attribute__((target("avx512f,avx512bw")))

static inline AVX512 __m512 load_bf16_zmm(const uint16_t *p) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* whether a panel's steps are stored in pairs (see above) */
static inline int paired(const int wide, const int64_t width, const int64_t K) {
    return wide && width == PANEL && K % 2 == 0;
}

/* MM rows against NP (1 or 2) consecutive full panels; w0 and w1 are the panels' block starts. */
static inline __attribute__((always_inline)) AVX512 void tile_bf16_zmm(
    const uint16_t *w0, const uint16_t *w1, const float *x, float *y, int64_t K, int64_t N, int64_t kn,
    int first, const int MM, const int NP, const int pairs) {
    __m512 acc[WROWS][2];
    for (int i = 0; i < MM; i++)
        for (int v = 0; v < NP; v++) acc[i][v] = _mm512_setzero_ps();
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t k = 0; pairs && k < kn; k += 2) { /* kn is even */
        _mm_prefetch((const char *)(w0 + k * PANEL) + PREFETCH_AHEAD, _MM_HINT_T0);
        __m512 b[2][2]; /* [panel][step k, k + 1] */
        __m512i v = _mm512_loadu_si512(w0 + k * PANEL);
        b[0][0] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        b[0][1] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
        if (NP == 2) {
            _mm_prefetch((const char *)(w1 + k * PANEL) + PREFETCH_AHEAD, _MM_HINT_T0);
            v = _mm512_loadu_si512(w1 + k * PANEL);
            b[1][0] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            b[1][1] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
        }
        for (int i = 0; i < MM; i++) {
            const __m512 a0 = _mm512_set1_ps(x[i * K + k]), a1 = _mm512_set1_ps(x[i * K + k + 1]);
            for (int v = 0; v < NP; v++) acc[i][v] = _mm512_fmadd_ps(a1, b[v][1], _mm512_fmadd_ps(a0, b[v][0], acc[i][v]));
        }
    }
    for (int64_t k = 0; !pairs && k < kn; k++) {
        _mm_prefetch((const char *)(w0 + k * PANEL) + PREFETCH_AHEAD, _MM_HINT_T0);
        __m512 b[2];
        b[0] = load_bf16_zmm(w0 + k * PANEL);
        if (NP == 2) {
            _mm_prefetch((const char *)(w1 + k * PANEL) + PREFETCH_AHEAD, _MM_HINT_T0);
            b[1] = load_bf16_zmm(w1 + k * PANEL);
        }
        for (int i = 0; i < MM; i++) {
            const __m512 a = _mm512_set1_ps(x[i * K + k]);
            for (int v = 0; v < NP; v++) acc[i][v] = _mm512_fmadd_ps(a, b[v], acc[i][v]);
        }
    }
    for (int i = 0; i < MM; i++)
        for (int v = 0; v < NP; v++) {
            float *out = y + i * N + PANEL * v;
            _mm512_storeu_ps(out, first ? acc[i][v] : _mm512_add_ps(_mm512_loadu_ps(out), acc[i][v]));
        }
}

#define ZMM_CASE(MM) case MM: tile_bf16_zmm(w0, w1, xm, ym, K, N, kn, first, MM, NP, pairs); break;
#define DEFINE_ZMM_ROWS(NAME, NP_)                                                               \
    static AVX512 void NAME(const uint16_t *w0, const uint16_t *w1, const float *x, float *y,     \
                            int64_t M, int64_t K, int64_t N, int64_t kn, int first) {             \
        const int NP = NP_, pairs = paired(1, PANEL, K);                                         \
        for (int64_t m0 = 0; m0 < M; m0 += WROWS) {                                              \
            const float *xm = x + m0 * K;                                                        \
            float *ym = y + m0 * N;                                                              \
            switch (M - m0 < WROWS ? M - m0 : WROWS) {                                           \
            ZMM_CASE(12) ZMM_CASE(11) ZMM_CASE(10) ZMM_CASE(9) ZMM_CASE(8) ZMM_CASE(7)           \
            ZMM_CASE(6) ZMM_CASE(5) ZMM_CASE(4) ZMM_CASE(3) ZMM_CASE(2)                          \
            default: tile_bf16_zmm(w0, w1, xm, ym, K, N, kn, first, 1, NP, pairs); break;        \
            }                                                                                    \
        }                                                                                        \
    }
DEFINE_ZMM_ROWS(zmm_rows_1, 1)
DEFINE_ZMM_ROWS(zmm_rows_2, 2)

static AVX512 void linear_bf16_zmm_share(void *ctx, int share, int shares) {
    const linear_job *job = (const linear_job *)ctx;
    const float *x = job->x;
    float *y = job->y;
    const int64_t M = job->M, N = job->N, K = job->K;
    const int64_t panels = (N + PANEL - 1) / PANEL, end = panels * (share + 1) / shares;
    for (int64_t p = panels * share / shares; p < end;) {
        const int64_t n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;
        const uint16_t *panel = (const uint16_t *)job->w + n0 * K;
        const int pair = width == PANEL && p + 1 < end && N - n0 >= 2 * PANEL;
        for (int64_t k0 = 0; k0 < K; k0 += KB) {
            const int64_t kn = K - k0 < KB ? K - k0 : KB;
            const int first = k0 == 0;
            const uint16_t *wp = panel + k0 * width;
            if (pair)
                zmm_rows_2(wp, panel + PANEL * K + k0 * PANEL, x + k0, y + n0, M, K, N, kn, first);
            else if (width == PANEL)
                zmm_rows_1(wp, wp, x + k0, y + n0, M, K, N, kn, first);
            else
                ROW_TILES(tile_bf16_8)
        }
        p += pair ? 2 : 1;
    }
}

static int turned_off(const char *name) { /* the variable says 0, false, no or off */
    const char *env = getenv(name);
    return env && (!strcasecmp(env, "0") || !strcasecmp(env, "false") || !strcasecmp(env, "no") || !strcasecmp(env, "off"));
}

/* 1 where the AVX-512 tile runs (the CPU has AVX-512 F and BW and OPENALICE_NATIVE_AVX512 is
   not 0, false, no or off), decided once per process: `pack_weight` lays bf16 panels out for it. */

int linear_wide(void) {
    static int wide = -1;
    if (wide < 0) {
        const int off = turned_off("OPENALICE_NATIVE_AVX512");
        __builtin_cpu_init();
        wide = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && !off;
    }
    return wide;
}

void linear_bf16(const uint16_t *w, const float *x, float *y, int64_t M, int64_t N, int64_t K) {
    linear_job job = {w, x, y, M, N, K};
    pool_run(linear_wide() ? linear_bf16_zmm_share : linear_bf16_avx2_share, &job);
}

/* w (N x K) row-major -> panels (see above). N % 8 == 0. `bf16`: 2-byte weights, else 4;
   full bf16 panels with their steps in pairs where the AVX-512 tile reads them (K even), or in
   natural column order (K odd). */
void pack_weight(const void *w, void *out, int64_t N, int64_t K, int bf16) {
    const int wide = linear_wide();
    for (int64_t n0 = 0; n0 < N; n0 += PANEL) {
        const int64_t width = N - n0 < PANEL ? N - n0 : PANEL;
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < width; j++) {
                const int64_t col = bf16 && width == PANEL && !wide ? BF16_ORDER[j] : j;
                const int pairs = bf16 && paired(wide, width, K);
                const int64_t from = (n0 + col) * K + k;
                const int64_t to = n0 * K + (pairs ? (k / 2) * 2 * PANEL + 2 * j + k % 2 : k * width + j);
                if (bf16)
                    ((uint16_t *)out)[to] = ((const uint16_t *)w)[from];
                else
                    ((float *)out)[to] = ((const float *)w)[from];
            }
    }
}

/* bf16 activations on the CPU's bf16 dot products (AVX512-BF16 `vdpbf16ps`), for prompt rows only.

   A prefill chunk is arithmetic-bound, and `vdpbf16ps` does two bf16 multiply-adds per fp32
   lane where the tiles above do one fp32 FMA: x is rounded to bf16 (to nearest even, as torch
   does), the weight is bf16 already. It reads the same packed panels: a zmm load at step k
   holds steps k and k + 1 of a full panel (16 outputs each), and one permute interleaves them
   into the (k, k + 1) pairs per output that the instruction wants, shared by every row of the
   register tile. Each output is one chain of pair products over k = 0, 2, 4, ... in order, so a
   row gets the same bits whatever the other rows are (a prompt's keys and values do not depend
   on how it was chunked). Decode, verify and tree rows never come here: they keep the fp32
   tiles and their bits. Half panels (N % 16 == 8) run the same chain on 8 lanes. K % 8 == 0. */
#define BF16DP __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define DROWS 12 /* input rows per register tile */
#define DMB 96   /* input rows per block: their bf16 x (DMB x K) stays in L2 across panels */

int linear_bf16dp_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

/* the permute that turns steps k | k + 1 (16 + 16 bf16 of a panel) into 16 (k, k + 1) pairs;
   the AVX2 layout's slots hold columns BF16_ORDER[slot] (its own inverse); panels stored in pairs
   (the AVX-512 layout, K % 8 == 0 here) are in place already */
static inline BF16DP __m512i pair_index(const int wide, const int width) {
    int16_t idx[32];
    for (int j = 0; j < 32; j++) idx[j] = wide && width == PANEL ? (int16_t)j : 0;
    for (int j = 0; j < width && !(wide && width == PANEL); j++) {
        const int slot = width == PANEL && !wide ? BF16_ORDER[j] : j;
        idx[2 * j] = (int16_t)slot;
        idx[2 * j + 1] = (int16_t)(width + slot);
    }
    return _mm512_loadu_si512(idx);
}

static inline __attribute__((always_inline)) BF16DP void tile_bf16dp(
    const uint16_t *w0, const uint16_t *w1, const uint16_t *x, float *y, int64_t K, int64_t N,
    const __m512i idx, const int MM, const int NP) {
    __m512 acc[DROWS][2];
    for (int i = 0; i < MM; i++)
        for (int v = 0; v < NP; v++) acc[i][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 2) {
        __m512bh b[2];
        b[0] = (__m512bh)_mm512_permutexvar_epi16(idx, _mm512_loadu_si512(w0 + k * PANEL));
        if (NP == 2) b[1] = (__m512bh)_mm512_permutexvar_epi16(idx, _mm512_loadu_si512(w1 + k * PANEL));
        for (int i = 0; i < MM; i++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x + i * K + k));
            for (int v = 0; v < NP; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], a, b[v]);
        }
    }
    for (int i = 0; i < MM; i++)
        for (int v = 0; v < NP; v++) _mm512_storeu_ps(y + i * N + PANEL * v, acc[i][v]);
}

/* a half panel: 8 outputs, steps k | k + 1 are 16 contiguous bf16 */
static inline BF16DP void tile_bf16dp_8(const uint16_t *w, const uint16_t *x, float *y, int64_t K, int64_t N,
                                        const __m512i idx, int64_t MM) {
    const __m256i idx8 = _mm512_castsi512_si256(idx);
    for (int64_t i = 0; i < MM; i++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 2) {
            const __m256i b = _mm256_permutexvar_epi16(idx8, _mm256_loadu_si256((const __m256i *)(w + k * 8)));
            const __m256i a = _mm256_set1_epi32(*(const int32_t *)(x + i * K + k));
            acc = _mm256_dpbf16_ps(acc, (__m256bh)a, (__m256bh)b);
        }
        _mm256_storeu_ps(y + i * N, acc);
    }
}

#define DP_CASE(MM) case MM: tile_bf16dp(w0, w1, xm, ym, K, N, idx, MM, NP); break;
#define DEFINE_DP_ROWS(NAME, NP_)                                                                \
    static BF16DP void NAME(const uint16_t *w0, const uint16_t *w1, const uint16_t *x, float *y,  \
                            int64_t M, int64_t K, int64_t N, const __m512i idx) {                 \
        const int NP = NP_;                                                                      \
        for (int64_t m0 = 0; m0 < M; m0 += DROWS) {                                              \
            const uint16_t *xm = x + m0 * K;                                                     \
            float *ym = y + m0 * N;                                                              \
            switch (M - m0 < DROWS ? M - m0 : DROWS) {                                           \
            DP_CASE(12) DP_CASE(11) DP_CASE(10) DP_CASE(9) DP_CASE(8) DP_CASE(7)                 \
            DP_CASE(6) DP_CASE(5) DP_CASE(4) DP_CASE(3) DP_CASE(2)                               \
            default: tile_bf16dp(w0, w1, xm, ym, K, N, idx, 1, NP); break;                       \
            }                                                                                    \
        }                                                                                        \
    }
DEFINE_DP_ROWS(dp_rows_1, 1)
DEFINE_DP_ROWS(dp_rows_2, 2)

typedef struct {
    const uint16_t *w;
    const float *x;
    uint16_t *xb; /* x in bf16, M x K */
    float *y;
    int64_t M, N, K;
} dp_job;

/* rows of x to bf16, to nearest even (what torch's .to(torch.bfloat16) gives, NaN aside) */
static BF16DP void dp_convert_share(void *ctx, int share, int shares) {
    const dp_job *job = (const dp_job *)ctx;
    const int64_t total = job->M * job->K, lo = total * share / shares / 16 * 16;
    const int64_t hi = share + 1 == shares ? total : total * (share + 1) / shares / 16 * 16;
    int64_t i = lo;
    for (; i + 16 <= hi; i += 16)
        _mm256_storeu_si256((__m256i *)(job->xb + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(job->x + i)));
    for (; i < hi; i++) { /* to nearest even, as vcvtneps2bf16 (finite x) */
        uint32_t u;
        __builtin_memcpy(&u, job->x + i, 4);
        job->xb[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

static BF16DP void dp_share(void *ctx, int share, int shares) {
    const dp_job *job = (const dp_job *)ctx;
    const int64_t M = job->M, N = job->N, K = job->K;
    const int wide = linear_wide();
    const __m512i idx16 = pair_index(wide, PANEL), idx8 = pair_index(wide, 8);
    const int64_t panels = (N + PANEL - 1) / PANEL, begin = panels * share / shares, end = panels * (share + 1) / shares;
    for (int64_t m0 = 0; m0 < M; m0 += DMB) {
        const int64_t mb = M - m0 < DMB ? M - m0 : DMB;
        const uint16_t *x = job->xb + m0 * K;
        float *y = job->y + m0 * N;
        for (int64_t p = begin; p < end;) {
            const int64_t n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;
            const uint16_t *panel = job->w + n0 * K;
            const int pair = width == PANEL && p + 1 < end && N - n0 >= 2 * PANEL;
            if (pair)
                dp_rows_2(panel, panel + PANEL * K, x, y + n0, mb, K, N, idx16);
            else if (width == PANEL)
                dp_rows_1(panel, panel, x, y + n0, mb, K, N, idx16);
            else
                tile_bf16dp_8(panel, x, y + n0, K, N, idx8, mb);
            p += pair ? 2 : 1;
        }
    }
}

/* AMX tiles for prompt rows, where the CPU has them (Sapphire Rapids and later).

   `vdpbf16ps` above does 32 bf16 multiply-adds per instruction; one AMX `tdpbf16ps` does 8,192
   (a 16 x 32 bf16 tile of x against a 32 x 16 tile of w into a 16 x 16 fp32 tile), several
   times the arithmetic per cycle. Rows go through in blocks of 32 (x's bf16 copy is padded
   with zero rows), columns in pairs of panels: four accumulator tiles, two of x, two of w.
   The weight tile wants each output's (k, k + 1) pairs side by side, 16 outputs to a 64-byte
   row: the AVX-512 layout stores full panels so, and the tiles read them in place; the AVX2
   layout's (OPENALICE_NATIVE_AVX512=0) are permuted into it in a buffer per share, once per
   call, and read back for every row block.

   Each output is one accumulation over k blocks of 32 in order, within a block the pairs in
   order, whatever the row count, the row's block or the share: a row's bits do not depend on
   the other rows (they are not those of the `vdpbf16ps` tile: another summation order).
   Linux hands out the tiles' state on request (arch_prctl), once per process. */
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
#define AMX_ROWS 32 /* rows per block: two x tiles */
#define AMX_K 32    /* k per tile */

/* 1 where prompt rows run on AMX tiles: the CPU has AMX-TILE and AMX-BF16 (and AVX512-BF16),
   Linux grants the tile state, and OPENALICE_NATIVE_AMX is not 0, false, no or off. Decided once
   per process. */
int linear_amx(void) {
    static int amx = -1;
    if (amx < 0) {
        const int off = turned_off("OPENALICE_NATIVE_AMX");
        unsigned a, b, c, d;
        const int tiles = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) && (d >> 24 & 1);
        /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; fails where the kernel has no AMX support */
        amx = !off && tiles && linear_bf16dp_supported() && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }
    return amx;
}

typedef struct {
    const uint16_t *w; /* packed panels */
    const uint16_t *xb; /* x in bf16, M padded to AMX_ROWS with zero rows */
    float *y;
    int64_t M, N, K;
    int wide;
    _Atomic int failed; /* a share found no memory for its pairs */
} amx_job;

/* panel (16 outputs x K, steps k-major) -> K / 2 rows of 16 (k, k + 1) pairs */
static AMX void amx_pairs(const uint16_t *panel, uint16_t *out, int64_t K, const __m512i idx) {
    for (int64_t k = 0; k < K; k += 2)
        _mm512_storeu_si512(out + k * PANEL, _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(panel + k * PANEL)));
}

static AMX void amx_share(void *ctx, int share, int shares) {
    amx_job *job = (amx_job *)ctx;
    const int64_t M = job->M, N = job->N, K = job->K;
    const int64_t panels = N / PANEL, begin = panels * share / shares, end = panels * (share + 1) / shares;
    if (begin == end) return;
    const tile_config cfg = amx_tiles_16x64();
    /* panels stored in pairs are read in place; others are permuted into `pairs`, two at a time */
    uint16_t *pairs = job->wide ? NULL : (uint16_t *)aligned_alloc(64, 2 * PANEL * K * sizeof(uint16_t));
    if (!job->wide && !pairs) {
        job->failed = 1;
        return;
    }
    _tile_loadconfig(&cfg);
    const __m512i idx = pair_index(job->wide, PANEL);
    float scratch[AMX_ROWS * 2 * PANEL];
    const int64_t xs = K * 2, ps = 2 * PANEL * 2; /* strides in bytes: rows of x, rows of pairs */
    for (int64_t p = begin; p < end; p += 2) {
        const int two = p + 1 < end;
        const int64_t n0 = p * PANEL;
        const uint16_t *b0 = job->w + n0 * K, *b1 = b0 + PANEL * K;
        if (!job->wide) {
            amx_pairs(b0, pairs, K, idx);
            if (two) amx_pairs(b1, pairs + PANEL * K, K, idx);
            b0 = pairs, b1 = pairs + PANEL * K;
        }
        for (int64_t m0 = 0; m0 < M; m0 += AMX_ROWS) {
            const uint16_t *a = job->xb + m0 * K;
            const int lower = M - m0 > 16; /* a last block of 16 rows or fewer skips the lower row tile */
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t k0 = 0; k0 < K; k0 += AMX_K) {
                _tile_loadd(4, a + k0, xs);
                _tile_loadd(6, b0 + k0 * PANEL, ps);
                _tile_dpbf16ps(0, 4, 6);
                if (lower) {
                    _tile_loadd(5, a + 16 * K + k0, xs);
                    _tile_dpbf16ps(2, 5, 6);
                }
                if (two) {
                    _tile_loadd(7, b1 + k0 * PANEL, ps);
                    _tile_dpbf16ps(1, 4, 7);
                    if (lower) _tile_dpbf16ps(3, 5, 7);
                }
            }
            const int full = m0 + AMX_ROWS <= M;
            float *out = full ? job->y + m0 * N + n0 : scratch;
            const int64_t os = (full ? N : 2 * PANEL) * 4;
            _tile_stored(0, out, os);
            if (lower) _tile_stored(2, out + 16 * (os / 4), os);
            if (two) {
                _tile_stored(1, out + PANEL, os);
                if (lower) _tile_stored(3, out + 16 * (os / 4) + PANEL, os);
            }
            if (!full)
                for (int64_t i = 0; i < M - m0; i++)
                    __builtin_memcpy(job->y + (m0 + i) * N + n0, scratch + i * 2 * PANEL, (two ? 2 : 1) * PANEL * 4);
        }
    }
    free(pairs);
    _tile_release();
}

/* y (M x N fp32) = bf16(x) @ w.T on packed bf16 panels; returns -1 where the CPU lacks
   AVX512-BF16, -2 without memory for x's bf16 copy or the AMX weight pairs. */
int linear_bf16dp(const uint16_t *w, const float *x, float *y, int64_t M, int64_t N, int64_t K) {
    if (!linear_bf16dp_supported()) return -1;
    /* AMX: whole tiles of k and whole panels of columns (the model's shapes all are) */
    const int amx = linear_amx() && K % AMX_K == 0 && N % PANEL == 0;
    const int64_t rows = amx ? (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : M;
    uint16_t *xb = (uint16_t *)aligned_alloc(64, ((rows * K * 2 + 63) / 64) * 64);
    if (!xb) return -2;
    dp_job job = {w, x, xb, y, M, N, K};
    pool_run(dp_convert_share, &job);
    if (amx) {
        memset(xb + M * K, 0, (rows - M) * K * 2);
        amx_job tiles = {w, xb, y, M, N, K, linear_wide(), 0};
        pool_run(amx_share, &tiles);
        if (tiles.failed) {
            free(xb);
            return -2;
        }
    } else {
        pool_run(dp_share, &job);
    }
    free(xb);
    return 0;
}

/* The small per-row steps of a decoder layer, each one call instead of several torch ops.

   At one to a few rows per pass, torch spends more time dispatching an RMS norm (six ops), a
   rotary embedding (five) or a SiLU gate (three) than computing it: about a fifth of a decode
   step. Every row is computed on its own in a fixed order, like the other kernels. All
   tensors are contiguous fp32 unless said otherwise. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "pool.h"
#include "vec.h"

#define PARALLEL_ROWS 32 /* from this many rows on, the rows are shared among the workers */

static void norm_row(const float *x, const float *w, float *out, int64_t dim, float eps) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
        __m256 v = _mm256_loadu_ps(x + d);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum(acc) / (float)dim + eps));
    for (int64_t d = 0; d < dim; d += 8)
        _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_loadu_ps(w + d), _mm256_mul_ps(_mm256_loadu_ps(x + d), inv)));
}

typedef struct {
    float *x;
    const float *delta, *w;
    float *out;
    int64_t rows, dim;
    float eps;
} norm_job;

static void norm_share(void *ctx, int share, int shares) {
    const norm_job *job = (const norm_job *)ctx;
    int64_t dim = job->dim;
    for (int64_t r = job->rows * share / shares; r < job->rows * (share + 1) / shares; r++) {
        float *x = job->x + r * dim;
        if (job->delta) {
            const float *dl = job->delta + r * dim;
            for (int64_t d = 0; d < dim; d += 8)
                _mm256_storeu_ps(x + d, _mm256_add_ps(_mm256_loadu_ps(x + d), _mm256_loadu_ps(dl + d)));
        }
        norm_row(x, job->w, job->out + r * dim, dim, job->eps);
    }
}

static void run_rows(share_fn fn, void *job, int64_t rows) {
    if (rows >= PARALLEL_ROWS)
        pool_run(fn, job);
    else
        fn(job, 0, 1);
}

/* out = w * x / rms(x) per row (dim % 8 == 0). With `delta`, x += delta first (the residual
   add), in place. */
void add_rms_norm(float *x, const float *delta, const float *w, float *out, int64_t rows, int64_t dim, float eps) {
    norm_job job = {x, delta, w, out, rows, dim, eps};
    run_rows(norm_share, &job, rows);
}

/* silu(g) = g * sigmoid(g), with exp taken of -|g| only (exp_nonpositive's range). */
static inline __m256 silu(__m256 g) {
    __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 e = exp_nonpositive(_mm256_or_ps(g, sign)); /* exp(-|g|) */
    __m256 one = _mm256_set1_ps(1.0f);
    __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
    __m256 positive = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ);
    __m256 sigmoid = _mm256_blendv_ps(_mm256_mul_ps(e, inv), inv, positive);
    return _mm256_mul_ps(g, sigmoid);
}

typedef struct {
    const float *gate_up;
    float *out;
    int64_t rows, inter;
} silu_job;

static void silu_share(void *ctx, int share, int shares) {
    const silu_job *job = (const silu_job *)ctx;
    int64_t n = job->inter;
    for (int64_t r = job->rows * share / shares; r < job->rows * (share + 1) / shares; r++) {
        const float *g = job->gate_up + r * 2 * n, *u = g + n;
        float *o = job->out + r * n;
        for (int64_t d = 0; d < n; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(silu(_mm256_loadu_ps(g + d)), _mm256_loadu_ps(u + d)));
    }
}

/* out (rows, inter) = silu(gate) * up, gate_up (rows, 2 * inter) = [gate | up]; inter % 8 == 0. */
void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter) {
    silu_job job = {gate_up, out, rows, inter};
    run_rows(silu_share, &job, rows);
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    __builtin_memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Rotate the q and k heads of each row of qkv (rows, n_heads + 2 * n_kv, D) in place by the
   row's rotary position (rope_pos[r], or row_pos[r] where rope_pos is NULL; HF rotate-half
   layout; cos/sin (max_positions, D)), then store its k and v heads in the cache
   (slots, n_kv, max_len, D), bf16 or fp32, at (row_slot[r], row_pos[r]). A tree node's rotary
   position is its depth past the root, its cache position its index in the tree. */
void rope_store(float *qkv, const float *cos_table, const float *sin_table, const int64_t *row_slot,
                const int64_t *row_pos, const int64_t *rope_pos, int64_t rows, int64_t n_heads,
                int64_t n_kv, int64_t D, void *keys, void *values, int64_t max_len, int kv_bf16) {
    int64_t half = D / 2, width = n_heads + 2 * n_kv;
    for (int64_t r = 0; r < rows; r++) {
        int64_t angle = rope_pos ? rope_pos[r] : row_pos[r];
        const float *c = cos_table + angle * D, *s = sin_table + angle * D;
        float *row = qkv + r * width * D;
        for (int64_t h = 0; h < n_heads + n_kv; h++) {
            float *x = row + h * D;
            for (int64_t d = 0; d < half; d++) {
                float a = x[d], b = x[d + half];
                x[d] = a * c[d] - b * s[d];
                x[d + half] = b * c[d + half] + a * s[d + half];
            }
        }
        for (int64_t h = 0; h < n_kv; h++) {
            const float *k = row + (n_heads + h) * D, *v = row + (n_heads + n_kv + h) * D;
            int64_t at = ((row_slot[r] * n_kv + h) * max_len + row_pos[r]) * D;
            if (kv_bf16) {
                uint16_t *kc = (uint16_t *)keys + at, *vc = (uint16_t *)values + at;
                for (int64_t d = 0; d < D; d++) {
                    kc[d] = to_bf16(k[d]);
                    vc[d] = to_bf16(v[d]);
                }
            } else {
                __builtin_memcpy((float *)keys + at, k, sizeof(float) * D);
                __builtin_memcpy((float *)values + at, v, sizeof(float) * D);
            }
        }
    }
}

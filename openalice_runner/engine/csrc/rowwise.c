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

#define ZMM __attribute__((target("avx512f")))

static inline ZMM __m512 silu_zmm(__m512 g) { /* silu's operations on 16 lanes: the same bits */
    __m512 e = exp_nonpositive_zmm(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(g), _mm512_set1_epi32((int)0x80000000u))));
    __m512 one = _mm512_set1_ps(1.0f);
    __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, e));
    __mmask16 positive = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
    return _mm512_mul_ps(g, _mm512_mask_blend_ps(positive, _mm512_mul_ps(e, inv), inv));
}

static ZMM void silu_share_zmm(void *ctx, int share, int shares) {
    const silu_job *job = (const silu_job *)ctx;
    int64_t n = job->inter, n16 = n & ~(int64_t)15;
    for (int64_t r = job->rows * share / shares; r < job->rows * (share + 1) / shares; r++) {
        const float *g = job->gate_up + r * 2 * n, *u = g + n;
        float *o = job->out + r * n;
        for (int64_t d = 0; d < n16; d += 16)
            _mm512_storeu_ps(o + d, _mm512_mul_ps(silu_zmm(_mm512_loadu_ps(g + d)), _mm512_loadu_ps(u + d)));
        for (int64_t d = n16; d < n; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(silu(_mm256_loadu_ps(g + d)), _mm256_loadu_ps(u + d)));
    }
}

int linear_wide(void); /* linear.c: AVX-512 F and BW, and OPENALICE_NATIVE_AVX512 not off */

/* out (rows, inter) = silu(gate) * up, gate_up (rows, 2 * inter) = [gate | up]; inter % 8 == 0. */
void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter) {
    silu_job job = {gate_up, out, rows, inter};
    run_rows(linear_wide() ? silu_share_zmm : silu_share, &job, rows);
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    __builtin_memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

typedef struct {
    float *qkv;
    const float *cos_table, *sin_table;
    const int64_t *row_slot, *row_pos, *rope_pos;
    int64_t rows, n_heads, n_kv, D;
    void *keys, *values;
    int64_t max_len;
    int kv_bf16;
} rope_job;

static void rope_share(void *ctx, int share, int shares) {
    const rope_job *job = (const rope_job *)ctx;
    const int64_t D = job->D, half = D / 2, n_heads = job->n_heads, n_kv = job->n_kv, width = n_heads + 2 * n_kv;
    for (int64_t r = job->rows * share / shares; r < job->rows * (share + 1) / shares; r++) {
        int64_t angle = job->rope_pos ? job->rope_pos[r] : job->row_pos[r];
        const float *c = job->cos_table + angle * D, *s = job->sin_table + angle * D;
        float *row = job->qkv + r * width * D;
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
            int64_t at = ((job->row_slot[r] * n_kv + h) * job->max_len + job->row_pos[r]) * D;
            if (job->kv_bf16) {
                uint16_t *kc = (uint16_t *)job->keys + at, *vc = (uint16_t *)job->values + at;
                for (int64_t d = 0; d < D; d++) {
                    kc[d] = to_bf16(k[d]);
                    vc[d] = to_bf16(v[d]);
                }
            } else {
                __builtin_memcpy((float *)job->keys + at, k, sizeof(float) * D);
                __builtin_memcpy((float *)job->values + at, v, sizeof(float) * D);
            }
        }
    }
}

/* Rotate the q and k heads of each row of qkv (rows, n_heads + 2 * n_kv, D) in place by the
   row's rotary position (rope_pos[r], or row_pos[r] where rope_pos is NULL; HF rotate-half
   layout; cos/sin (max_positions, D)), then store its k and v heads in the cache
   (slots, n_kv, max_len, D), bf16 or fp32, at (row_slot[r], row_pos[r]). A tree node's rotary
   position is its depth past the root, its cache position its index in the tree. Rows write
   distinct cache entries, so a prompt chunk's rows are shared among the workers. */
void rope_store(float *qkv, const float *cos_table, const float *sin_table, const int64_t *row_slot,
                const int64_t *row_pos, const int64_t *rope_pos, int64_t rows, int64_t n_heads,
                int64_t n_kv, int64_t D, void *keys, void *values, int64_t max_len, int kv_bf16) {
    rope_job job = {qkv, cos_table, sin_table, row_slot, row_pos, rope_pos, rows, n_heads, n_kv, D,
                    keys, values, max_len, kv_bf16};
    run_rows(rope_share, &job, rows);
}

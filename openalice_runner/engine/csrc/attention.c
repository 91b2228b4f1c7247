/* Causal attention for ragged rows read straight from the KV cache (AVX2).

   Row r is one query token of some sequence: it sits in cache slot row_slot[r] at position
   row_pos[r] and attends to that slot's keys 0..row_pos[r]. Rows of different sequences, with
   different lengths and different numbers of tokens (a decode step, a verify of γ drafts, a
   prefill chunk), share one call: no padding, no mask, no gathered copy of the cache.

   Each (row, head) is computed in a fixed order from its own position alone, so a token gets
   the same bits whether it is decoded alone or verified among drafts.

   Tree rows (speculative trees verified in one pass): where tree_from is given and
   tree_from[r] <= row_pos[r], row r attends keys 0..tree_from[r]-1 and then only the keys
   tree_from[r] + b for the set bits b of tree_bits[r] (its ancestors in the tree, and itself),
   in increasing order. The visible keys are scored and summed as one consecutive run, exactly
   as the same token's keys are when decoded on a chain, so a tree's accepted path gets the
   same bits as plain decoding.

   q, out: (R, n_heads, D) fp32. keys, values: (slots, n_kv_heads, max_len, D), fp32 or bf16
   (a bf16 model keeps its cache in bf16: half the memory, and half the bytes each decode step
   reads, which is most of the attention's cost at long contexts). D % 8 == 0. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "pool.h"
#include "vec.h"

/* 8 cache entries widened to fp32: bf16 is the top half of an fp32, so widening is exact */
static inline __m256 load_kv(const void *base, int64_t i, const int bf16) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)base + i);
}

#define MAX_GROUP 8  /* query heads per KV head handled together */
#define MAX_DV 16    /* D / 8 */

/* The G query heads that share one KV head, over keys 0..n-1: softmax(q.k * scale) @ v.
   Each key and value row is loaded once for all G heads. s: G rows of `stride` floats. */
static inline __attribute__((always_inline)) void score_key(
    const float *q, const void *k, float *s, int64_t stride, int64_t j, int64_t key,
    const int64_t D, const int64_t G, float scale, const int bf16) {
    __m256 kj[MAX_DV];
    for (int64_t d = 0; d < D / 8; d++) kj[d] = load_kv(k, key * D + 8 * d, bf16);
    for (int64_t g = 0; g < G; g++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t d = 0; d < D / 8; d++) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + 8 * d), kj[d], acc);
        s[g * stride + j] = hsum(acc) * scale;
    }
}

/* Keys 0..n_prefix-1, then the keys extra[0..n_extra-1], as one run of n_prefix + n_extra. */
static inline __attribute__((always_inline)) void attend_group(
    const float *q, const void *k, const void *v, float *out, float *s, int64_t stride,
    int64_t n_prefix, const int64_t *extra, int64_t n_extra, const int64_t D, const int64_t G,
    float scale, const int bf16) {
    const int64_t dv = D / 8;
    int64_t n = n_prefix + n_extra;
    int64_t padded = (n + 7) & ~(int64_t)7;
    for (int64_t j = 0; j < n_prefix; j++) score_key(q, k, s, stride, j, j, D, G, scale, bf16);
    for (int64_t e = 0; e < n_extra; e++) score_key(q, k, s, stride, n_prefix + e, extra[e], D, G, scale, bf16);
    float inv[MAX_GROUP];
    for (int64_t g = 0; g < G; g++) {
        float *sg = s + g * stride;
        for (int64_t j = n; j < padded; j++) sg[j] = -INFINITY;
        __m256 mx = _mm256_set1_ps(-INFINITY);
        for (int64_t j = 0; j < padded; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sg + j));
        __m256 m = _mm256_set1_ps(hmax(mx));
        __m256 total = _mm256_setzero_ps();
        for (int64_t j = 0; j < padded; j += 8) {
            __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sg + j), m));
            _mm256_storeu_ps(sg + j, e);
            total = _mm256_add_ps(total, e);
        }
        inv[g] = 1.0f / hsum(total);
    }
    for (int64_t g = 0; g < G; g++) {
        const float *sg = s + g * stride;
        __m256 acc[MAX_DV];
        for (int64_t d = 0; d < dv; d++) acc[d] = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            __m256 p = _mm256_set1_ps(sg[j]);
            int64_t key = j < n_prefix ? j : extra[j - n_prefix];
            for (int64_t d = 0; d < dv; d++) acc[d] = _mm256_fmadd_ps(p, load_kv(v, key * D + 8 * d, bf16), acc[d]);
        }
        for (int64_t d = 0; d < dv; d++) _mm256_storeu_ps(out + g * D + 8 * d, _mm256_mul_ps(acc[d], _mm256_set1_ps(inv[g])));
    }
}

static void attend_group_any(const float *q, const void *k, const void *v, float *out, float *s,
                             int64_t stride, int64_t n, const int64_t *extra, int64_t n_extra,
                             int64_t D, int64_t G, float scale, int bf16) {
    if (bf16)
        attend_group(q, k, v, out, s, stride, n, extra, n_extra, D, G, scale, 1);
    else
        attend_group(q, k, v, out, s, stride, n, extra, n_extra, D, G, scale, 0);
}

/* the common shape (SmolLM2, Llama 3: head_dim 64, 3 or 4 heads per KV head) with constants */
static void attend_group_64_3(const float *q, const void *k, const void *v, float *out, float *s,
                              int64_t stride, int64_t n, const int64_t *extra, int64_t n_extra,
                              float scale, int bf16) {
    if (bf16)
        attend_group(q, k, v, out, s, stride, n, extra, n_extra, 64, 3, scale, 1);
    else
        attend_group(q, k, v, out, s, stride, n, extra, n_extra, 64, 3, scale, 0);
}

typedef struct {
    const float *q;
    const void *keys, *values;
    float *out;
    const int64_t *row_slot, *row_pos, *tree_from;
    const uint64_t *tree_bits;
    int64_t R, n_heads, n_kv_heads, D, max_len;
    float scale;
    int bf16;
} attention_job;

/* Tasks are (row, KV head); shares take every shares-th task, so long and short rows mix. */
static void attention_share(void *ctx, int share, int shares) {
    const attention_job *job = (const attention_job *)ctx;
    int64_t group = job->n_heads / job->n_kv_heads, D = job->D, stride = job->max_len + 8;
    int64_t width = job->bf16 ? 2 : 4; /* bytes per cache entry */
    float *s = (float *)malloc(sizeof(float) * (size_t)(stride * group));
    if (!s) return;
    for (int64_t task = share; task < job->R * job->n_kv_heads; task += shares) {
        int64_t r = task / job->n_kv_heads, kvh = task % job->n_kv_heads;
        int64_t base = (job->row_slot[r] * job->n_kv_heads + kvh) * job->max_len * D * width;
        const char *k = (const char *)job->keys + base, *v = (const char *)job->values + base;
        const float *qr = job->q + (r * job->n_heads + kvh * group) * D;
        float *o = job->out + (r * job->n_heads + kvh * group) * D;
        int64_t n = job->row_pos[r] + 1, extra[64], n_extra = 0;
        if (job->tree_from && job->tree_from[r] < n) {
            n = job->tree_from[r];
            for (int b = 0; b < 64; b++)
                if ((job->tree_bits[r] >> b) & 1) extra[n_extra++] = n + b;
        }
        if (D == 64 && group == 3)
            attend_group_64_3(qr, k, v, o, s, stride, n, extra, n_extra, job->scale, job->bf16);
        else
            attend_group_any(qr, k, v, o, s, stride, n, extra, n_extra, D, group, job->scale, job->bf16);
    }
    free(s);
}

/* Returns 0, or -1 where the shape is not supported (D % 8, D > 128, group > 8). `kv_bf16`:
   keys and values are bf16, else fp32. tree_from, tree_bits: NULL, or per-row tree visibility
   (see the top of this file). */
int attention(const float *q, const void *keys, const void *values, float *out,
              const int64_t *row_slot, const int64_t *row_pos, const int64_t *tree_from,
              const uint64_t *tree_bits, int64_t R, int64_t n_heads, int64_t n_kv_heads, int64_t D,
              int64_t max_len, float scale, int kv_bf16) {
    int64_t group = n_heads / n_kv_heads;
    if (D % 8 || D / 8 > MAX_DV || group > MAX_GROUP || group * n_kv_heads != n_heads) return -1;
    attention_job job = {q, keys, values, out, row_slot, row_pos, tree_from, tree_bits,
                         R, n_heads, n_kv_heads, D, max_len, scale, kv_bf16 != 0};
    pool_run(attention_share, &job);
    return 0;
}

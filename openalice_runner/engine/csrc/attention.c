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

#include "amx.h"
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

/* softmax of s[0..n-1] in place (unnormalised exps; s padded to a multiple of 8 with -inf):
   returns 1 / their sum. Both paths below use it. */
static inline float softmax_row(float *s, int64_t n) {
    int64_t padded = (n + 7) & ~(int64_t)7;
    for (int64_t j = n; j < padded; j++) s[j] = -INFINITY;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < padded; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
    __m256 m = _mm256_set1_ps(hmax(mx));
    __m256 total = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j += 8) {
        __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
        _mm256_storeu_ps(s + j, e);
        total = _mm256_add_ps(total, e);
    }
    return 1.0f / hsum(total);
}

/* Keys 0..n_prefix-1, then the keys extra[0..n_extra-1], as one run of n_prefix + n_extra. */
static inline __attribute__((always_inline)) void attend_group(
    const float *q, const void *k, const void *v, float *out, float *s, int64_t stride,
    int64_t n_prefix, const int64_t *extra, int64_t n_extra, const int64_t D, const int64_t G,
    float scale, const int bf16) {
    const int64_t dv = D / 8;
    int64_t n = n_prefix + n_extra;
    for (int64_t j = 0; j < n_prefix; j++) score_key(q, k, s, stride, j, j, D, G, scale, bf16);
    for (int64_t e = 0; e < n_extra; e++) score_key(q, k, s, stride, n_prefix + e, extra[e], D, G, scale, bf16);
    float inv[MAX_GROUP];
    for (int64_t g = 0; g < G; g++) inv[g] = softmax_row(s + g * stride, n);
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

/* ---- runs of rows: a prefill chunk, a verify of γ drafts, a decode step ----------------------

   Rows of one slot at consecutive positions see the same keys (each one more than the row
   before), so up to TILE_ROWS of them are done together: each block of 8 keys (and later of 8
   values) is loaded and widened once for the tile's TILE_ROWS x G query heads instead of once
   per row and head, and 8 scores are reduced at once (hsum8) instead of one by one. Every
   (row, head) still gets the bits of attend_group: the same FMA chain over d per key, the same
   reduction tree (hsum's), the same softmax, the same FMA chain over keys for the values. */
#define TILE_ROWS 4
#define KEY_BLOCK 8

/* The hsums of a[0..7] as one vector, each summed exactly as hsum() sums it:
   ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). */
static inline __m256 hsum8(const __m256 *a) {
    __m256 s[4];
    for (int i = 0; i < 4; i++) /* [a(2i): l_k + l_k+4, k < 4 | a(2i+1): the same] */
        s[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    __m256 n[2]; /* [a0: m0+m2, m1+m3, a2: ... | a1: ..., a3: ...] and the same for a4..a7 */
    for (int i = 0; i < 2; i++)
        n[i] = _mm256_add_ps(_mm256_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m256 h = _mm256_hadd_ps(n[0], n[1]); /* [a0, a2, a4, a6 | a1, a3, a5, a7] */
    return _mm256_permutevar8x32_ps(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Keys (or values) j0..j0+count-1 as KEY_BLOCK rows of D fp32, rows past count zero: straight
   from an fp32 cache when the block is whole, else widened into `scratch`. */
static inline __attribute__((always_inline)) const float *kv_block(
    const void *base, int64_t j0, int64_t count, const int64_t D, const int bf16, float *scratch) {
    if (!bf16 && count == KEY_BLOCK) return (const float *)base + j0 * D;
    for (int64_t k = 0; k < KEY_BLOCK; k++)
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(scratch + k * D + d, k < count ? load_kv(base, (j0 + k) * D + d, bf16) : _mm256_setzero_ps());
    return scratch;
}

/* ---- a row's heads against a block: one at a time, or G together where 32 registers allow ------

   One head at a time loads a key or value chunk for every FMA: two loads an FMA, so the loads set
   the pace. With AVX-512 VL's 32 registers (the same ymm instructions) a row's G heads go
   together: each key chunk is loaded once for G x KEY_BLOCK score chains, each value chunk once
   for G sums. Each chain is the same FMAs on the same operands in the same order either way: the
   same bits. (Reading a lone row's keys straight from the cache instead of kv_block's widened
   copy was tried: no faster in a whole pass.) */
#define HEADS_MAX 3 /* 24 score chains + 3 q chunks + 1 key chunk: 28 of 32 registers */

/* G heads of one row (q + g * D) against the block kb: G rows of 8 scores (times scale) at
   s + g * stride. */
static inline __attribute__((always_inline)) void score_heads(const float *q, const float *kb, float *s, int64_t stride,
                                                              const int64_t D, const int64_t G, float scale) {
    __m256 acc[HEADS_MAX][KEY_BLOCK];
    for (int64_t g = 0; g < G; g++)
        for (int kk = 0; kk < KEY_BLOCK; kk++) acc[g][kk] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 qd[HEADS_MAX];
        for (int64_t g = 0; g < G; g++) qd[g] = _mm256_loadu_ps(q + g * D + d);
        for (int kk = 0; kk < KEY_BLOCK; kk++) {
            const __m256 kd = _mm256_loadu_ps(kb + kk * D + d);
            for (int64_t g = 0; g < G; g++) acc[g][kk] = _mm256_fmadd_ps(qd[g], kd, acc[g][kk]);
        }
    }
    for (int64_t g = 0; g < G; g++) _mm256_storeu_ps(s + g * stride, _mm256_mul_ps(hsum8(acc[g]), _mm256_set1_ps(scale)));
}

/* G heads of one row: the block's first jn values (vb) weighted by s + g * stride, added to the
   sums at a + g * D. */
static inline __attribute__((always_inline)) void value_heads(const float *s, int64_t stride, const float *vb, int64_t jn,
                                                              float *a, const int64_t D, const int64_t G) {
    __m256 av[HEADS_MAX][MAX_DV];
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D / 8; d++) av[g][d] = _mm256_loadu_ps(a + g * D + 8 * d);
    for (int64_t jj = 0; jj < jn; jj++) {
        __m256 p[HEADS_MAX];
        for (int64_t g = 0; g < G; g++) p[g] = _mm256_set1_ps(s[g * stride + jj]);
        for (int64_t d = 0; d < D / 8; d++) {
            const __m256 vd = _mm256_loadu_ps(vb + jj * D + 8 * d);
            for (int64_t g = 0; g < G; g++) av[g][d] = _mm256_fmadd_ps(p[g], vd, av[g][d]);
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D / 8; d++) _mm256_storeu_ps(a + g * D + 8 * d, av[g][d]);
}

/* Rows p0..p0+T-1 of one slot (row t sees keys 0..p0+t), the G heads of one KV head.
   q: row t's head g at q + t * q_stride + g * D; out likewise. s: T * G rows of `stride` floats;
   acc: T * G * D floats; kb: KEY_BLOCK * D floats. `heads`: a row's G heads together (G <=
   HEADS_MAX, 32 registers), else one by one. */
static inline __attribute__((always_inline)) void attend_tile(
    const float *q, int64_t q_stride, const void *k, const void *v, float *out, int64_t p0, int64_t T,
    float *s, int64_t stride, float *acc, float *kb, const int64_t D, const int64_t G, float scale, const int bf16,
    const int heads) {
    const int64_t n_max = p0 + T, hg = heads ? G : 1; /* heads per call */
    for (int64_t j0 = 0; j0 < n_max; j0 += KEY_BLOCK) {
        const float *keys = kv_block(k, j0, n_max - j0 < KEY_BLOCK ? n_max - j0 : KEY_BLOCK, D, bf16, kb);
        for (int64_t t = 0; t < T; t++) {
            if (j0 > p0 + t) continue; /* row t sees keys 0..p0+t */
            for (int64_t g = 0; g < G; g += hg)
                score_heads(q + t * q_stride + g * D, keys, s + (t * G + g) * stride + j0, stride, D, hg, scale);
        }
    }
    float inv[TILE_ROWS * MAX_GROUP];
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < G; g++) inv[t * G + g] = softmax_row(s + (t * G + g) * stride, p0 + t + 1);
    for (int64_t i = 0; i < T * G * D; i += 8) _mm256_storeu_ps(acc + i, _mm256_setzero_ps());
    for (int64_t j0 = 0; j0 < n_max; j0 += KEY_BLOCK) {
        const float *values = kv_block(v, j0, n_max - j0 < KEY_BLOCK ? n_max - j0 : KEY_BLOCK, D, bf16, kb);
        for (int64_t t = 0; t < T; t++) {
            int64_t jn = p0 + t + 1 - j0; /* this row's keys in the block */
            if (jn <= 0) continue;
            if (jn > KEY_BLOCK) jn = KEY_BLOCK;
            for (int64_t g = 0; g < G; g += hg)
                value_heads(s + (t * G + g) * stride + j0, stride, values, jn, acc + (t * G + g) * D, D, hg);
        }
    }
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < G; g++)
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(out + t * q_stride + g * D + d,
                                 _mm256_mul_ps(_mm256_loadu_ps(acc + (t * G + g) * D + d), _mm256_set1_ps(inv[t * G + g])));
}

/* SmolLM2's shape (head_dim 64, 3 heads per KV head) with a row's heads together, where AVX-512 VL
   gives the registers for it. */
static __attribute__((target("avx512f,avx512vl"))) void attend_tile_64_3_heads(
    const float *q, int64_t q_stride, const void *k, const void *v, float *out, int64_t p0, int64_t T, float *s,
    int64_t stride, float *acc, float *kb, float scale, int bf16) {
    if (bf16) attend_tile(q, q_stride, k, v, out, p0, T, s, stride, acc, kb, 64, 3, scale, 1, 1);
    else attend_tile(q, q_stride, k, v, out, p0, T, s, stride, acc, kb, 64, 3, scale, 0, 1);
}

int linear_wide(void); /* linear.c: AVX-512 F and BW, and OPENALICE_NATIVE_AVX512 not off */

static int heads_together(void) {
    static int wide = -1;
    if (wide < 0) wide = linear_wide() && __builtin_cpu_supports("avx512vl");
    return wide;
}

static void attend_tile_any(const float *q, int64_t q_stride, const void *k, const void *v, float *out, int64_t p0,
                            int64_t T, float *s, int64_t stride, float *acc, float *kb, int64_t D, int64_t G,
                            float scale, int bf16) {
    if (D == 64 && G == 3 && heads_together()) {
        attend_tile_64_3_heads(q, q_stride, k, v, out, p0, T, s, stride, acc, kb, scale, bf16);
    } else if (D == 64 && G == 3) { /* SmolLM2, Llama 3: constants */
        if (bf16) attend_tile(q, q_stride, k, v, out, p0, T, s, stride, acc, kb, 64, 3, scale, 1, 0);
        else attend_tile(q, q_stride, k, v, out, p0, T, s, stride, acc, kb, 64, 3, scale, 0, 0);
    } else if (bf16) {
        attend_tile(q, q_stride, k, v, out, p0, T, s, stride, acc, kb, D, G, scale, 1, 0);
    } else {
        attend_tile(q, q_stride, k, v, out, p0, T, s, stride, acc, kb, D, G, scale, 0, 0);
    }
}

typedef struct {
    const float *q;
    const void *keys, *values;
    float *out;
    const int64_t *row_slot, *row_pos, *tree_from;
    const uint64_t *tree_bits;
    const int64_t *tile_start; /* tiles of rows: tile i is rows tile_start[i]..tile_start[i+1]-1 */
    int64_t tiles, n_heads, n_kv_heads, D, max_len, stride;
    float scale;
    int bf16;
} attention_job;

static int is_tree_row(const attention_job *job, int64_t r) {
    return job->tree_from && job->tree_from[r] < job->row_pos[r] + 1;
}

/* A tile's work: its rows times the keys its last row sees. */
static int64_t tile_work(const attention_job *job, int64_t tile) {
    const int64_t r = job->tile_start[tile], last = job->tile_start[tile + 1] - 1;
    return (last - r + 1) * (job->row_pos[last] + 1);
}

/* Tasks are (KV head, tile), a KV head's tiles one after another: a verify's tiles (4 + 4 + 1
   rows) read the same keys and values, and a share that takes them in a row reads them from memory
   once and then from its own cache. Each share takes a run of tasks holding about its part of the
   work (tile_work), so long and short tiles still balance. */
static void attention_share(void *ctx, int share, int shares) {
    const attention_job *job = (const attention_job *)ctx;
    int64_t group = job->n_heads / job->n_kv_heads, D = job->D, stride = job->stride;
    int64_t width = job->bf16 ? 2 : 4; /* bytes per cache entry */
    float *s = (float *)malloc(sizeof(float) * (size_t)(stride * group * TILE_ROWS + D * group * TILE_ROWS + D * KEY_BLOCK));
    if (!s) return;
    float *acc = s + stride * group * TILE_ROWS, *kb = acc + D * group * TILE_ROWS;
    int64_t work = 0, done = 0; /* all tasks' work; the work of the tasks before this one */
    for (int64_t tile = 0; tile < job->tiles; tile++) work += tile_work(job, tile);
    work *= job->n_kv_heads;
    for (int64_t task = 0; task < job->tiles * job->n_kv_heads; task++) {
        int64_t tile = task % job->tiles, kvh = task / job->tiles;
        const int64_t w = tile_work(job, tile), mid = 2 * done + w; /* twice the task's midpoint */
        done += w;
        if (mid * shares / (2 * work) != share) continue; /* another share's part holds its midpoint */
        int64_t r = job->tile_start[tile], T = job->tile_start[tile + 1] - r;
        int64_t base = (job->row_slot[r] * job->n_kv_heads + kvh) * job->max_len * D * width;
        const char *k = (const char *)job->keys + base, *v = (const char *)job->values + base;
        const float *qr = job->q + (r * job->n_heads + kvh * group) * D;
        float *o = job->out + (r * job->n_heads + kvh * group) * D;
        if (is_tree_row(job, r)) { /* a tree row: its visible keys are not one run */
            int64_t n = job->tree_from[r], extra[64], n_extra = 0;
            for (int b = 0; b < 64; b++)
                if ((job->tree_bits[r] >> b) & 1) extra[n_extra++] = n + b;
            if (D == 64 && group == 3)
                attend_group_64_3(qr, k, v, o, s, stride, n, extra, n_extra, job->scale, job->bf16);
            else
                attend_group_any(qr, k, v, o, s, stride, n, extra, n_extra, D, group, job->scale, job->bf16);
            continue;
        }
        attend_tile_any(qr, job->n_heads * D, k, v, o, job->row_pos[r], T, s, stride, acc, kb, D, group,
                        job->scale, job->bf16);
    }
    free(s);
}

/* Returns 0, or -1 where the shape is not supported (D % 8, D > 128, group > 8), -2 where
   memory ran out. `kv_bf16`: keys and values are bf16, else fp32. tree_from, tree_bits: NULL,
   or per-row tree visibility (see the top of this file). */
int attention(const float *q, const void *keys, const void *values, float *out,
              const int64_t *row_slot, const int64_t *row_pos, const int64_t *tree_from,
              const uint64_t *tree_bits, int64_t R, int64_t n_heads, int64_t n_kv_heads, int64_t D,
              int64_t max_len, float scale, int kv_bf16) {
    int64_t group = n_heads / n_kv_heads;
    if (D % 8 || D / 8 > MAX_DV || group > MAX_GROUP || group * n_kv_heads != n_heads) return -1;
    int64_t *tile_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(R + 1));
    if (!tile_start) return -2;
    attention_job job = {q, keys, values, out, row_slot, row_pos, tree_from, tree_bits, tile_start,
                         0, n_heads, n_kv_heads, D, max_len, 0, scale, kv_bf16 != 0};
    int64_t longest = 0;
    for (int64_t r = 0; r < R; r++) {
        /* a row joins the tile before it when it is the next position of the same slot */
        int64_t first = job.tiles ? tile_start[job.tiles - 1] : -1;
        int joins = first >= 0 && r - first < TILE_ROWS && row_slot[r] == row_slot[r - 1] &&
                    row_pos[r] == row_pos[r - 1] + 1 && !is_tree_row(&job, r) && !is_tree_row(&job, first);
        if (!joins) tile_start[job.tiles++] = r;
        if (row_pos[r] + 1 > longest) longest = row_pos[r] + 1;
    }
    tile_start[job.tiles] = R;
    job.stride = ((longest + 7) & ~(int64_t)7) + 8;
    pool_run(attention_share, &job);
    free(tile_start);
    return 0;
}

/* ---- prompt rows on the CPU's bf16 dot products (AVX512-BF16), for bf16 prefill -------------

   A prefill chunk's attention is arithmetic: 16 rows of one slot at consecutive positions and one
   query head go together, one row per fp32 lane, so the online softmax (running max, rescale,
   sums) is lane-wise with no horizontal reduction. q is rounded to bf16; scores are `vdpbf16ps`
   over pairs of d against keys broadcast from the bf16 cache; the softmax weights are rounded to
   bf16 and multiplied with pairs of values the same way, all sums in fp32. Keys go in blocks of
   16 from key 0; a key a row does not see gives it a weight of exactly 0 (and its max and sums
   are then unchanged, rescaled by exactly 1), so each row's bits depend only on its own position
   and the cache, not on the other rows of its tile. Decode, verify and tree rows never come
   here. Needs D % 32 == 0, D <= 128, a bf16 cache. */
#define BF16DP __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512dq")))
#define PT 16 /* rows per tile: the fp32 lanes */
#define PK 16 /* keys per block */

static inline uint16_t to_bf16(float f) { /* to nearest even (finite f) */
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* 2^x for x <= 0: x = n + f with f in [-0.5, 0.5], 2^f by its degree-5 Taylor polynomial (relative
   error under 3e-6, far below the bf16 rounding of the weights it makes), times 2^n in one
   vscalefps; below -127 (and NaN, -inf less -inf, which max turns into -127) about 0. Ten
   instructions against exp_nonpositive_zmm's sixteen: the softmax's exps are a fifth of a prompt
   tile's time. */
static inline BF16DP __m512 exp2_nonpositive_zmm(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3333558e-3f); /* ln(2)^k / k!, k = 5..0 */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#define LOG2E 1.44269504088896341f

/* One block's step of the online softmax, lanes the rows, in base 2 (`scale` is the attention's
   scale times log2(e), so 2^(scaled score) is e^(score x scale)): s[j] (the raw scores of key j0 + j;
   the first nk are keys, the rest padding) become the block's weights, 0 where a row does not see
   the key; the running max m and sum l move on. Returns the factor the output so far is rescaled by. */
static inline __attribute__((always_inline)) BF16DP __m512 softmax_block(
    __m512 *s, const int64_t n, const int64_t nk, const int64_t j0, const __m512i last, const __m512 scale, __m512 *m,
    __m512 *l) {
    __mmask16 seen[32];
    __m512 mx = *m;
    for (int64_t j = 0; j < n; j++) {
        seen[j] = j < nk ? _mm512_cmp_epi32_mask(_mm512_set1_epi32((int)(j0 + j)), last, _MM_CMPINT_LE) : 0;
        s[j] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen[j], _mm512_mul_ps(s[j], scale));
        mx = _mm512_max_ps(mx, s[j]);
    }
    const __m512 factor = exp2_nonpositive_zmm(_mm512_sub_ps(*m, mx));
    *m = mx;
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        s[j] = _mm512_maskz_mov_ps(seen[j], exp2_nonpositive_zmm(_mm512_sub_ps(s[j], mx)));
        sum = _mm512_add_ps(sum, s[j]);
    }
    *l = _mm512_fmadd_ps(*l, factor, sum);
    return factor;
}

typedef struct {
    const float *q;
    const uint16_t *keys, *values;
    float *out;
    const int64_t *row_slot, *row_pos, *tile_start;
    int64_t tiles, n_heads, n_kv_heads, D, max_len;
    float scale;
    _Atomic int failed; /* a share found no memory for its scratch */
} prompt_job;

/* the tile's q rows of head h as bf16 pairs, transposed: qp[p * PT + t] = (q[t][2p], q[t][2p + 1]);
   lanes past T copy row 0 */
static void q_pairs(const prompt_job *job, int64_t r0, int64_t T, int64_t h, int32_t *qp) {
    const int64_t D = job->D;
    for (int64_t t = 0; t < PT; t++) {
        const float *qr = job->q + ((r0 + (t < T ? t : 0)) * job->n_heads + h) * D;
        for (int64_t p = 0; p < D / 2; p++)
            qp[p * PT + t] = (int32_t)((uint32_t)to_bf16(qr[2 * p]) | ((uint32_t)to_bf16(qr[2 * p + 1]) << 16));
    }
}

/* tile (rows r0..r0+T-1, positions p0..), query head h */
static BF16DP void prompt_tile(const prompt_job *job, int64_t r0, int64_t T, int64_t h, int32_t *qp, float *ot) {
    const int64_t D = job->D, DP = D / 2, G = job->n_heads / job->n_kv_heads;
    const int64_t p0 = job->row_pos[r0], n_max = p0 + T;
    const int64_t base = (job->row_slot[r0] * job->n_kv_heads + h / G) * job->max_len * D;
    const uint16_t *K = job->keys + base, *V = job->values + base;
    q_pairs(job, r0, T, h, qp);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    /* each lane's last visible key: p0 + t (lanes past T: p0) */
    const __m512i last = _mm512_add_epi32(_mm512_set1_epi32((int)p0),
                                          _mm512_maskz_mov_epi32(_cvtu32_mask16((1u << T) - 1u), lane));
    const __m512 scale = _mm512_set1_ps(job->scale * LOG2E);
    __m512i ileave; /* (P_j lane t, P_j+1 lane t) pairs from [P_j | P_j+1] */
    {
        int16_t idx[32];
        for (int t = 0; t < 16; t++) { idx[2 * t] = (int16_t)t; idx[2 * t + 1] = (int16_t)(16 + t); }
        ileave = _mm512_loadu_si512(idx);
    }
    __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) _mm512_storeu_ps(ot + d * PT, _mm512_setzero_ps());
    int32_t vp[PK / 2 * 128]; /* value pairs of the block: vp[jp * D + d] = (v[2jp][d], v[2jp+1][d]) */
    for (int64_t j0 = 0; j0 < n_max; j0 += PK) {
        const int64_t nk = n_max - j0 < PK ? n_max - j0 : PK;
        __m512 s[PK];
        for (int64_t j = 0; j < PK; j++) s[j] = _mm512_setzero_ps();
        for (int64_t j = 0; j < nk; j += 4) {
            const int32_t *k0 = (const int32_t *)(K + (j0 + j) * D);
            const int64_t kn = nk - j < 4 ? nk - j : 4;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t p = 0; p < DP; p++) {
                const __m512bh qv = (__m512bh)_mm512_loadu_si512(qp + p * PT);
                a0 = _mm512_dpbf16_ps(a0, qv, (__m512bh)_mm512_set1_epi32(k0[p]));
                if (kn > 1) a1 = _mm512_dpbf16_ps(a1, qv, (__m512bh)_mm512_set1_epi32(k0[DP + p]));
                if (kn > 2) a2 = _mm512_dpbf16_ps(a2, qv, (__m512bh)_mm512_set1_epi32(k0[2 * DP + p]));
                if (kn > 3) a3 = _mm512_dpbf16_ps(a3, qv, (__m512bh)_mm512_set1_epi32(k0[3 * DP + p]));
            }
            s[j] = a0; if (kn > 1) s[j + 1] = a1; if (kn > 2) s[j + 2] = a2; if (kn > 3) s[j + 3] = a3;
        }
        const __m512 factor = softmax_block(s, PK, nk, j0, last, scale, &m, &l);
        /* value pairs, keys past the block's end zero (the cache there may hold anything) */
        for (int64_t jp = 0; jp < PK / 2; jp++) {
            const int64_t ja = j0 + 2 * jp, jb = ja + 1;
            for (int64_t d = 0; d < D; d++) {
                const uint32_t va = 2 * jp < nk ? V[ja * D + d] : 0, vb = 2 * jp + 1 < nk ? V[jb * D + d] : 0;
                vp[jp * D + d] = (int32_t)(va | (vb << 16));
            }
        }
        __m512bh pp[PK / 2];
        for (int64_t jp = 0; jp < PK / 2; jp++)
            pp[jp] = (__m512bh)_mm512_permutexvar_epi16(ileave, (__m512i)_mm512_cvtne2ps_pbh(s[2 * jp + 1], s[2 * jp]));
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            __m512 o[16];
            for (int64_t d = 0; d < 16; d++) o[d] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d0 + d) * PT), factor);
            for (int64_t jp = 0; jp < (nk + 1) / 2; jp++)
                for (int64_t d = 0; d < 16; d++)
                    o[d] = _mm512_dpbf16_ps(o[d], pp[jp], (__m512bh)_mm512_set1_epi32(vp[jp * D + d0 + d]));
            for (int64_t d = 0; d < 16; d++) _mm512_storeu_ps(ot + (d0 + d) * PT, o[d]);
        }
    }
    float inv[PT];
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
    for (int64_t t = 0; t < T; t++) {
        float *o = job->out + ((r0 + t) * job->n_heads + h) * D;
        for (int64_t d = 0; d < D; d++) o[d] = ot[d * PT + t] * inv[t];
    }
}

static BF16DP void prompt_share(void *ctx, int share, int shares) {
    prompt_job *job = (prompt_job *)ctx;
    int32_t *qp = (int32_t *)aligned_alloc(64, sizeof(int32_t) * 64 * PT);
    float *ot = (float *)aligned_alloc(64, sizeof(float) * 128 * PT);
    if (!qp || !ot) { free(qp); free(ot); job->failed = 1; return; }
    /* tasks (tile, head) interleaved across shares: tiles late in a chunk see more keys */
    for (int64_t task = share; task < job->tiles * job->n_heads; task += shares) {
        const int64_t tile = task / job->n_heads, h = task % job->n_heads;
        const int64_t r0 = job->tile_start[tile];
        prompt_tile(job, r0, job->tile_start[tile + 1] - r0, h, qp, ot);
    }
    free(qp);
    free(ot);
}

/* ---- prompt rows on AMX tiles, where the CPU has them (linear_amx(), csrc/linear.c) ----------

   The tiles above, 16 rows of one slot and one query head with lanes as rows, and the same lane-wise
   online softmax, with the products on AMX in blocks of 32 keys: the scores come out transposed
   (keys x rows, the lanes' layout) from the keys as they lie in the cache against q's (d, d + 1)
   pairs; the weights, rounded to bf16, are transposed to rows x keys and multiplied with the
   values' key pairs into fp32 tiles, which are added to the output rescaled per row. A block that
   ends past the last key any row sees is copied with zero keys, so nothing past it is read. Each
   row's bits depend only on its own position and the cache: lanes and tile rows do not mix. */
#define AMXT __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx512dq")))
#define AK 32 /* keys per block */
#define AMX_D 128

typedef struct {
    int32_t qp[AMX_D / 2 * PT];      /* q pairs: qp[p * 16 + t] = (q[t][2p], q[t][2p + 1]) */
    float s[AK * PT];                /* scores, keys x rows */
    int32_t p[PT * PT];              /* the weights' key pairs, rows x pairs */
    uint16_t vp[AMX_D * AK];         /* values' key pairs per 16 d: [d / 16][pair][d % 16][2] */
    float pv[PT * AMX_D], o[PT * AMX_D]; /* this block's weights x values, the running output (rows x d) */
    uint16_t kpad[AK * AMX_D], vpad[AK * AMX_D]; /* a last block's keys and values, zero past its end */
} amx_scratch;

/* r[i] (16 rows of 16 dwords) -> r[j] = column j */
static inline AMXT void transpose_16x16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++) /* 4 x 4 blocks are in place within 128-bit lanes: move the lanes */
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
    }
}

static AMXT void amx_prompt_tile(const prompt_job *job, int64_t r0, int64_t T, int64_t h, amx_scratch *w) {
    const int64_t D = job->D, G = job->n_heads / job->n_kv_heads;
    const int64_t p0 = job->row_pos[r0], n_max = p0 + T;
    const int64_t base = (job->row_slot[r0] * job->n_kv_heads + h / G) * job->max_len * D;
    const uint16_t *K = job->keys + base, *V = job->values + base;
    q_pairs(job, r0, T, h, w->qp);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i last = _mm512_add_epi32(_mm512_set1_epi32((int)p0),
                                          _mm512_maskz_mov_epi32(_cvtu32_mask16((1u << T) - 1u), lane));
    const __m512 scale = _mm512_set1_ps(job->scale * LOG2E);
    __m512i ileave, vlo, vhi; /* (P_j, P_j+1) per lane; values of keys a, b interleaved by d */
    {
        int16_t idx[32], lo[32], hi[32];
        for (int t = 0; t < 16; t++) {
            idx[2 * t] = (int16_t)t, idx[2 * t + 1] = (int16_t)(16 + t);
            lo[2 * t] = (int16_t)t, lo[2 * t + 1] = (int16_t)(32 + t);
            hi[2 * t] = (int16_t)(16 + t), hi[2 * t + 1] = (int16_t)(48 + t);
        }
        ileave = _mm512_loadu_si512(idx), vlo = _mm512_loadu_si512(lo), vhi = _mm512_loadu_si512(hi);
    }
    __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
    for (int64_t i = 0; i < PT * D; i++) w->o[i] = 0.0f;
    for (int64_t j0 = 0; j0 < n_max; j0 += AK) {
        const int64_t nk = n_max - j0 < AK ? n_max - j0 : AK;
        const uint16_t *kb = K + j0 * D, *vb = V + j0 * D;
        if (nk < AK) {
            __builtin_memcpy(w->kpad, kb, nk * D * 2);
            __builtin_memcpy(w->vpad, vb, nk * D * 2);
            __builtin_memset(w->kpad + nk * D, 0, (AK - nk) * D * 2);
            __builtin_memset(w->vpad + nk * D, 0, (AK - nk) * D * 2);
            kb = w->kpad, vb = w->vpad;
        }
        /* scores, transposed: tile 0 keys 0-15, tile 1 keys 16-31, lanes the rows */
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
            _tile_loadd(5, w->qp + d0 / 2 * PT, 64);
            _tile_loadd(4, kb + d0, D * 2);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(4, kb + 16 * D + d0, D * 2);
            _tile_dpbf16ps(1, 4, 5);
        }
        _tile_stored(0, w->s, 64);
        _tile_stored(1, w->s + 16 * PT, 64);
        __m512 s[AK];
        for (int64_t j = 0; j < AK; j++) s[j] = _mm512_loadu_ps(w->s + j * PT);
        const __m512 factor = softmax_block(s, AK, nk, j0, last, scale, &m, &l);
        /* weights to bf16 key pairs (pairs x rows), then rows x pairs: the tile's rows are q's rows */
        __m512i pairs[AK / 2];
        for (int64_t jp = 0; jp < AK / 2; jp++)
            pairs[jp] = _mm512_permutexvar_epi16(ileave, (__m512i)_mm512_cvtne2ps_pbh(s[2 * jp + 1], s[2 * jp]));
        transpose_16x16(pairs);
        for (int64_t t = 0; t < PT; t++) _mm512_storeu_si512(w->p + t * PT, pairs[t]);
        /* values' key pairs: for 16 d at a time, row jp holds (v[2jp][d], v[2jp + 1][d]) */
        for (int64_t jp = 0; jp < AK / 2; jp++) {
            const uint16_t *a = vb + 2 * jp * D, *b = a + D;
            for (int64_t d0 = 0; d0 < D; d0 += 32) {
                const __m512i za = _mm512_loadu_si512(a + d0), zb = _mm512_loadu_si512(b + d0);
                _mm512_storeu_si512(w->vp + (d0 / 16 * (AK / 2) + jp) * 32, _mm512_permutex2var_epi16(za, vlo, zb));
                _mm512_storeu_si512(w->vp + ((d0 / 16 + 1) * (AK / 2) + jp) * 32, _mm512_permutex2var_epi16(za, vhi, zb));
            }
        }
        _tile_loadd(4, w->p, 64);
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            _tile_zero(0);
            _tile_loadd(5, w->vp + d0 / 16 * (AK / 2) * 32, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_stored(0, w->pv + d0, D * 4);
        }
        float f[PT];
        _mm512_storeu_ps(f, factor);
        for (int64_t t = 0; t < PT; t++) {
            const __m512 ft = _mm512_set1_ps(f[t]);
            for (int64_t d = 0; d < D; d += 16)
                _mm512_storeu_ps(w->o + t * D + d, _mm512_fmadd_ps(_mm512_loadu_ps(w->o + t * D + d), ft,
                                                                   _mm512_loadu_ps(w->pv + t * D + d)));
        }
    }
    float inv[PT];
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
    for (int64_t t = 0; t < T; t++) {
        float *out = job->out + ((r0 + t) * job->n_heads + h) * D;
        for (int64_t d = 0; d < D; d++) out[d] = w->o[t * D + d] * inv[t];
    }
}

static AMXT void amx_prompt_share(void *ctx, int share, int shares) {
    prompt_job *job = (prompt_job *)ctx;
    amx_scratch *w = (amx_scratch *)aligned_alloc(64, sizeof(amx_scratch));
    if (!w) {
        job->failed = 1;
        return;
    }
    const tile_config cfg = amx_tiles_16x64();
    _tile_loadconfig(&cfg);
    for (int64_t task = share; task < job->tiles * job->n_heads; task += shares) {
        const int64_t tile = task / job->n_heads, h = task % job->n_heads;
        const int64_t r0 = job->tile_start[tile];
        amx_prompt_tile(job, r0, job->tile_start[tile + 1] - r0, h, w);
    }
    _tile_release();
    free(w);
}

int attention_prompt_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
           __builtin_cpu_supports("avx512dq");
}

/* Rows as `attention` takes them (no tree rows), bf16 cache. Returns 0, -1 where unsupported
   (shape or CPU), -2 where memory ran out. */
int attention_prompt(const float *q, const uint16_t *keys, const uint16_t *values, float *out,
                     const int64_t *row_slot, const int64_t *row_pos, int64_t R, int64_t n_heads,
                     int64_t n_kv_heads, int64_t D, int64_t max_len, float scale) {
    if (D % 32 || D > 128 || n_heads % n_kv_heads || !attention_prompt_supported()) return -1;
    int64_t *tile_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(R + 1));
    if (!tile_start) return -2;
    int64_t tiles = 0;
    for (int64_t r = 0; r < R; r++) {
        const int64_t first = tiles ? tile_start[tiles - 1] : -1;
        const int joins = first >= 0 && r - first < PT && row_slot[r] == row_slot[r - 1] && row_pos[r] == row_pos[r - 1] + 1;
        if (!joins) tile_start[tiles++] = r;
    }
    tile_start[tiles] = R;
    prompt_job job = {q, keys, values, out, row_slot, row_pos, tile_start, tiles, n_heads, n_kv_heads, D, max_len, scale, 0};
    pool_run(linear_amx() ? amx_prompt_share : prompt_share, &job);
    free(tile_start);
    return job.failed ? -2 : 0;
}

/* ---- prompt rows in fp32 (AVX2): lanes the query vectors, tiles as small matrix products ---------

   Where prompt rows run in fp32, attend_tile above gives them the bits of decode rows: each score is
   8 partial sums reduced by a shuffle tree, and on a prefill chunk it runs at about 40% of the FMA
   peak (an AMD EPYC with AVX2 only; its hot spots the reductions). A prompt's rows only need bits that
   depend on their own position and the cache (its cache must not depend on how it was chunked), so
   here FT rows of one slot at consecutive positions and the G query heads of one KV head go together
   as T x G query vectors, one per fp32 lane (padded to a multiple of 16 with copies of vector 0), as
   the bf16 prompt tiles do. A score is one FMA chain over d (6 keys x 16 lanes a register tile, each
   key broadcast from the block widened once), the softmax is online and lane-wise (running max,
   rescale, sum: no horizontal step), and a weight times the values one FMA chain over the block's
   keys (6 d x 16 lanes a register tile). Keys go in blocks of FB from key 0, the last one padded
   with zero keys; a key a lane's row does not see gets the weight exactly 0 (its max and sum then
   stay as they were, rescaled by exactly 1). Decode, verify and tree rows never come here. */
#define FT 16        /* rows per tile */
#define FB 24        /* keys per block: four register tiles of 6 */
#define FL 16        /* lanes per register tile: two ymm */
#define FV_MAX (FT * MAX_GROUP)

typedef struct {
    const float *q;
    const void *keys, *values;
    float *out;
    const int64_t *row_slot, *row_pos, *tile_start;
    int64_t tiles, n_heads, n_kv_heads, D, max_len;
    float scale;
    int bf16;
    _Atomic int failed;
} f32_prompt_job;

typedef struct {
    float qt[128 * FV_MAX];  /* q transposed: qt[d * nvp + v] */
    float st[FB * FV_MAX];   /* the block's scores, then weights: st[j * nvp + v] */
    float ot[128 * FV_MAX];  /* the running output, transposed: ot[d * nvp + v] */
    float kw[FB * 128], vw[FB * 128]; /* the block's keys and values, fp32, zero past its end */
    float m[FV_MAX], l[FV_MAX], factor[FV_MAX];
    int32_t last[FV_MAX];    /* each lane's last visible key */
} f32_prompt_scratch;

/* scores of keys jb..jb+5 (kw rows) for lanes v0..v0+15: st[j * nvp + v] */
static inline __attribute__((always_inline)) void f32_prompt_scores(f32_prompt_scratch *w, int64_t nvp, int64_t v0, int64_t jb,
                                                               const int64_t D, const int NK) {
    __m256 acc[6][2];
    for (int j = 0; j < NK; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m256 q0 = _mm256_loadu_ps(w->qt + d * nvp + v0), q1 = _mm256_loadu_ps(w->qt + d * nvp + v0 + 8);
        for (int j = 0; j < NK; j++) {
            const __m256 k = _mm256_broadcast_ss(w->kw + (jb + j) * D + d);
            acc[j][0] = _mm256_fmadd_ps(q0, k, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(q1, k, acc[j][1]);
        }
    }
    for (int j = 0; j < NK; j++) {
        _mm256_storeu_ps(w->st + (jb + j) * nvp + v0, acc[j][0]);
        _mm256_storeu_ps(w->st + (jb + j) * nvp + v0 + 8, acc[j][1]);
    }
}

/* ot[d][v] = ot[d][v] * factor[v] + sum over the block's keys j of st[j][v] * vw[j][d], for d in
   d0..d0+ND-1 and lanes v0..v0+15 */
static inline __attribute__((always_inline)) void f32_prompt_values(f32_prompt_scratch *w, int64_t nvp, int64_t v0, int64_t d0,
                                                               const int64_t D, const int ND) {
    __m256 acc[6][2];
    const __m256 f0 = _mm256_loadu_ps(w->factor + v0), f1 = _mm256_loadu_ps(w->factor + v0 + 8);
    for (int i = 0; i < ND; i++) {
        acc[i][0] = _mm256_mul_ps(_mm256_loadu_ps(w->ot + (d0 + i) * nvp + v0), f0);
        acc[i][1] = _mm256_mul_ps(_mm256_loadu_ps(w->ot + (d0 + i) * nvp + v0 + 8), f1);
    }
    for (int64_t j = 0; j < FB; j++) {
        const __m256 p0 = _mm256_loadu_ps(w->st + j * nvp + v0), p1 = _mm256_loadu_ps(w->st + j * nvp + v0 + 8);
        for (int i = 0; i < ND; i++) {
            const __m256 v = _mm256_broadcast_ss(w->vw + j * D + d0 + i);
            acc[i][0] = _mm256_fmadd_ps(p0, v, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(p1, v, acc[i][1]);
        }
    }
    for (int i = 0; i < ND; i++) {
        _mm256_storeu_ps(w->ot + (d0 + i) * nvp + v0, acc[i][0]);
        _mm256_storeu_ps(w->ot + (d0 + i) * nvp + v0 + 8, acc[i][1]);
    }
}

/* keys (or values) j0..j0+nk-1 widened to fp32 rows of D, rows nk..FB-1 zero */
static inline void f32_prompt_block(const void *base, int64_t j0, int64_t nk, int64_t D, int bf16, float *dst) {
    for (int64_t j = 0; j < FB; j++)
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(dst + j * D + d, j < nk ? load_kv(base, (j0 + j) * D + d, bf16) : _mm256_setzero_ps());
}

/* the online softmax's step for one block, 8 lanes at a time (scores to weights, m and l move on) */
static inline void f32_prompt_softmax(f32_prompt_scratch *w, int64_t nvp, int64_t j0, float scale) {
    const __m256 sc = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t v0 = 0; v0 < nvp; v0 += 8) {
        const __m256i last = _mm256_loadu_si256((const __m256i *)(w->last + v0));
        const __m256 m = _mm256_loadu_ps(w->m + v0);
        __m256 s[FB], seen[FB], mx = m;
        for (int64_t j = 0; j < FB; j++) {
            seen[j] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(j0 + j)), last)); /* unseen */
            s[j] = _mm256_blendv_ps(_mm256_mul_ps(_mm256_loadu_ps(w->st + j * nvp + v0), sc), ninf, seen[j]);
            mx = _mm256_max_ps(mx, s[j]);
        }
        const __m256 factor = exp_nonpositive(_mm256_sub_ps(m, mx));
        __m256 sum = _mm256_setzero_ps();
        for (int64_t j = 0; j < FB; j++) {
            const __m256 p = _mm256_andnot_ps(seen[j], exp_nonpositive(_mm256_sub_ps(s[j], mx)));
            _mm256_storeu_ps(w->st + j * nvp + v0, p);
            sum = _mm256_add_ps(sum, p);
        }
        _mm256_storeu_ps(w->m + v0, mx);
        _mm256_storeu_ps(w->factor + v0, factor);
        _mm256_storeu_ps(w->l + v0, _mm256_fmadd_ps(_mm256_loadu_ps(w->l + v0), factor, sum));
    }
}

#define F32_VALUES_ND(D0, ND) \
    switch (ND) { case 6: f32_prompt_values(w, nvp, v0, D0, D, 6); break; case 5: f32_prompt_values(w, nvp, v0, D0, D, 5); break; \
    case 4: f32_prompt_values(w, nvp, v0, D0, D, 4); break; case 3: f32_prompt_values(w, nvp, v0, D0, D, 3); break; \
    case 2: f32_prompt_values(w, nvp, v0, D0, D, 2); break; default: f32_prompt_values(w, nvp, v0, D0, D, 1); break; }

/* rows r0..r0+T-1 (positions p0..), the G query heads of KV head kvh */
static inline __attribute__((always_inline)) void f32_prompt_tile(const f32_prompt_job *job, int64_t r0, int64_t T, int64_t kvh,
                                                             f32_prompt_scratch *w, const int64_t D, const int bf16) {
    const int64_t G = job->n_heads / job->n_kv_heads, nv = T * G, nvp = (nv + FL - 1) / FL * FL;
    const int64_t p0 = job->row_pos[r0], n_max = p0 + T;
    const int64_t width = bf16 ? 2 : 4;
    const int64_t base = (job->row_slot[r0] * job->n_kv_heads + kvh) * job->max_len * D * width;
    const char *K = (const char *)job->keys + base, *V = (const char *)job->values + base;
    for (int64_t v = 0; v < nvp; v++) { /* lane v: row v / G, head v % G; lanes past nv copy lane 0 */
        const int64_t u = v < nv ? v : 0, t = u / G;
        const float *qv = job->q + ((r0 + t) * job->n_heads + kvh * G + u % G) * D;
        for (int64_t d = 0; d < D; d++) w->qt[d * nvp + v] = qv[d];
        w->last[v] = (int32_t)(p0 + t);
        w->m[v] = -INFINITY;
        w->l[v] = 0.0f;
    }
    for (int64_t i = 0; i < D * nvp; i += 8) _mm256_storeu_ps(w->ot + i, _mm256_setzero_ps());
    for (int64_t j0 = 0; j0 < n_max; j0 += FB) {
        const int64_t nk = n_max - j0 < FB ? n_max - j0 : FB;
        f32_prompt_block(K, j0, nk, D, bf16, w->kw);
        f32_prompt_block(V, j0, nk, D, bf16, w->vw);
        for (int64_t v0 = 0; v0 < nvp; v0 += FL) {
            for (int64_t jb = 0; jb < FB; jb += 6) f32_prompt_scores(w, nvp, v0, jb, D, 6);
        }
        f32_prompt_softmax(w, nvp, j0, job->scale);
        for (int64_t v0 = 0; v0 < nvp; v0 += FL)
            for (int64_t d0 = 0; d0 < D; d0 += 6) {
                const int64_t nd = D - d0 < 6 ? D - d0 : 6;
                F32_VALUES_ND(d0, nd)
            }
    }
    for (int64_t v = 0; v < nv; v++) {
        const int64_t t = v / G;
        float *o = job->out + ((r0 + t) * job->n_heads + kvh * G + v % G) * D;
        const float inv = 1.0f / w->l[v];
        for (int64_t d = 0; d < D; d++) o[d] = w->ot[d * nvp + v] * inv;
    }
}

static void f32_prompt_share(void *ctx, int share, int shares) {
    f32_prompt_job *job = (f32_prompt_job *)ctx;
    f32_prompt_scratch *w = (f32_prompt_scratch *)aligned_alloc(64, sizeof(f32_prompt_scratch));
    if (!w) {
        job->failed = 1;
        return;
    }
    /* tasks (tile, KV head) interleaved across shares: tiles late in a chunk see more keys */
    for (int64_t task = share; task < job->tiles * job->n_kv_heads; task += shares) {
        const int64_t tile = task / job->n_kv_heads, kvh = task % job->n_kv_heads;
        const int64_t r0 = job->tile_start[tile], T = job->tile_start[tile + 1] - r0;
        if (job->D == 64) {
            if (job->bf16) f32_prompt_tile(job, r0, T, kvh, w, 64, 1);
            else f32_prompt_tile(job, r0, T, kvh, w, 64, 0);
        } else if (job->bf16) {
            f32_prompt_tile(job, r0, T, kvh, w, job->D, 1);
        } else {
            f32_prompt_tile(job, r0, T, kvh, w, job->D, 0);
        }
    }
    free(w);
}

/* Prompt rows as `attention` takes them (no tree rows), fp32 or bf16 cache. Returns 0, -1 where
   the shape is not supported (D % 8, D > 128, group > 8), -2 where memory ran out. */
int attention_prompt_f32(const float *q, const void *keys, const void *values, float *out,
                         const int64_t *row_slot, const int64_t *row_pos, int64_t R, int64_t n_heads,
                         int64_t n_kv_heads, int64_t D, int64_t max_len, float scale, int kv_bf16) {
    if (D % 8 || D > 128 || n_heads % n_kv_heads || n_heads / n_kv_heads > MAX_GROUP) return -1;
    int64_t *tile_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(R + 1));
    if (!tile_start) return -2;
    int64_t tiles = 0;
    for (int64_t r = 0; r < R; r++) {
        const int64_t first = tiles ? tile_start[tiles - 1] : -1;
        const int joins = first >= 0 && r - first < FT && row_slot[r] == row_slot[r - 1] && row_pos[r] == row_pos[r - 1] + 1;
        if (!joins) tile_start[tiles++] = r;
    }
    tile_start[tiles] = R;
    f32_prompt_job job = {q, keys, values, out, row_slot, row_pos, tile_start, tiles, n_heads, n_kv_heads, D, max_len,
                     scale, kv_bf16 != 0, 0};
    pool_run(f32_prompt_share, &job);
    free(tile_start);
    return job.failed ? -2 : 0;
}

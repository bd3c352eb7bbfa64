/* CPU kernels of the executor's fp32/bf16 CPU path, called through ctypes.
 *
 * Built at first use by services/executor/cpu_kernels.py (gcc -O3 -march=native -fopenmp);
 * every loop over rows runs on torch's own OpenMP pool (same libgomp soname).
 *
 *   paged_decode_attention   one query row per sequence, K/V read in place from the pool
 *   prefill_attention        causal attention of a chunk at position 0 over its own K/V
 *   add_rms_norm             residual += h; out = rms_norm(residual) * w        (fp32)
 *   silu_and_mul             out = silu(gate) * up, from the fused [gate | up] rows (fp32)
 *   rope_and_cache           rotate q and k heads in place, store k and v in their slots
 *                            (fp32 rows into an fp32 or a bf16 cache)
 *   (each of the three also as ..._bf16, for a bf16 model: same steps, bf16 rows)
 *   greedy_logprobs          per row: the first argmax and its log_softmax value
 *   pack_linear_weight,      y = x W^T + b in fp32 over a weight packed once into column
 *   linear_packed            panels (AVX-512, or AVX2 + FMA; see below); optionally
 *                            y += x W^T + b, or silu(gate) * up of a [gate | up] weight
 *   ..._bf16, ..._dp         the same for a bf16 model: bf16 weights widened to fp32, or
 *                            (AVX-512 bf16) k-pairs multiplied by bf16 dot products
 *
 * Why C: decode attention on a CPU is bound by memory traffic. The torch path gathers
 * every sequence's blocks into a padded copy and reads that copy again: three times the
 * traffic of reading the pool in place. The three elementwise kernels each replace four
 * to seven torch ops (one pass over the rows instead of one per op).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROW 16384    /* floats: Hq * D of one token (and Hkv * D <= Hq * D) */
#define MAX_HEADS 256

/* Vectors of VW floats: AVX-512 (VW = 16), or AVX2 + FMA (VW = 8); the GEMM and the
 * decode attention are written once over these. Without either, plain C only. */
#if defined(__AVX512F__)
#define GEMM_VW 16
#define GEMM_MR 14
typedef __m512 vec_t;
typedef __mmask16 vmask_t;
#define V_LOADU(p) _mm512_loadu_ps(p)
#define V_STOREU(p, v) _mm512_storeu_ps(p, v)
#define V_SET1(x) _mm512_set1_ps(x)
#define V_ZERO() _mm512_setzero_ps()
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_ADD(a, b) _mm512_add_ps(a, b)
#define V_MUL(a, b) _mm512_mul_ps(a, b)
#define V_MLOAD(m, p) _mm512_maskz_loadu_ps(m, p)
#define V_MSTORE(p, m, v) _mm512_mask_storeu_ps(p, m, v)
/* per 128-bit lane: interleave the low (high) halves' 32-bit values, or 64-bit pairs */
#define V_UNPACKLO(a, b) _mm512_unpacklo_ps(a, b)
#define V_UNPACKHI(a, b) _mm512_unpackhi_ps(a, b)
#define V_UNPACKLO64(a, b) \
    _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)))
#define V_UNPACKHI64(a, b) \
    _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)))
static inline vmask_t lanes(int64_t n) {              /* the first n of 16 lanes */
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define GEMM_VW 8
#define GEMM_MR 6
typedef __m256 vec_t;
typedef __m256i vmask_t;
#define V_LOADU(p) _mm256_loadu_ps(p)
#define V_STOREU(p, v) _mm256_storeu_ps(p, v)
#define V_SET1(x) _mm256_set1_ps(x)
#define V_ZERO() _mm256_setzero_ps()
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_ADD(a, b) _mm256_add_ps(a, b)
#define V_MUL(a, b) _mm256_mul_ps(a, b)
#define V_MLOAD(m, p) _mm256_maskload_ps(p, m)      /* masked-off lanes are not read */
#define V_MSTORE(p, m, v) _mm256_maskstore_ps(p, m, v)
#define V_UNPACKLO(a, b) _mm256_unpacklo_ps(a, b)
#define V_UNPACKHI(a, b) _mm256_unpackhi_ps(a, b)
#define V_UNPACKLO64(a, b) \
    _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(a), _mm256_castps_pd(b)))
#define V_UNPACKHI64(a, b) \
    _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(a), _mm256_castps_pd(b)))
static inline vmask_t lanes(int64_t n) {              /* the first n of 8 lanes */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 0 ? 0 : n > 8 ? 8 : n)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

/* ------------------------------------------------------------ paged decode attention
 *
 * Layouts (kernels/reference.py):
 *   q          [B, Hq, D]                       fp32, unscaled, rows q_ld apart (below)
 *   k/v cache  [num_blocks, block_size, Hkv, D] fp32 or bf16 (dtype_bf16 = 1)
 *   tables     [B, max_blocks]                  int32 physical block ids
 *   lens       [B]                              int32 context length (with this token)
 *   out        [B, Hq, D]                       fp32
 *   scratch    [threads, Hq, max_len]           fp32 scores, one slice per thread
 *
 * Work item = one sequence: each token's K (then V) row of all Hkv heads is one contiguous
 * read, shared by the Hq/Hkv query heads of each KV head (GQA). Two passes over the
 * context (scores, then the weighted sum of V) instead of an online softmax: one exp per
 * score and no rescaling of the accumulator.
 */
static inline const float *load_row(const void *base, int64_t off, int64_t n, int bf16,
                                    float *buf) {
    if (!bf16) return (const float *)base + off;
    const uint16_t *src = (const uint16_t *)base + off;
    uint32_t *u = (uint32_t *)buf;
    for (int64_t i = 0; i < n; i++) u[i] = (uint32_t)src[i] << 16;   /* bf16 -> fp32 */
    return buf;
}

/* The blocks are scattered over the pool: while block `blk` is read, ask for the next one
 * of the table (the hardware prefetcher follows a stream, not a block table). Returns the
 * next block's first byte, or NULL at the last block. */
static inline const char *next_block(const void *cache, const int32_t *table, int64_t blk,
                                     int64_t t0, int64_t ctx, int64_t bs, int64_t row_bytes) {
    return t0 + bs < ctx ? (const char *)cache + (int64_t)table[blk + 1] * bs * row_bytes : 0;
}

static inline void prefetch_row(const char *next, int64_t o, int64_t row_bytes) {
    if (next)
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + o * row_bytes + b, 0, 1);
}

/* Each of the hq score rows [0, ctx) -> exp(s - max) in place; inv[j] = 1 / its sum. */
static inline void softmax_rows(float *sc, int64_t hq, int64_t ctx, int64_t max_len,
                                float *inv) {
    for (int64_t j = 0; j < hq; j++) {
        float *s = sc + j * max_len;
        float m = s[0];
        for (int64_t t = 1; t < ctx; t++) m = s[t] > m ? s[t] : m;
        float sum = 0.f;
        for (int64_t t = 0; t < ctx; t++) {
            s[t] = expf(s[t] - m);
            sum += s[t];
        }
        inv[j] = 1.f / sum;
    }
}

/* Inlined into one copy per common head size (attend, below), so that the compiler sees
 * `d` as a constant: the dot products and the V updates unroll into whole vector registers
 * with no remainder loops (43 -> 21 ms per decode step with the loop order below; either
 * change alone gives about 43). */
static inline __attribute__((always_inline)) void
attend_impl(const float *q, const void *kc, const void *vc, int bf16, const int32_t *table,
            int64_t ctx, int64_t bs, int64_t hq, int64_t hkv, int64_t d, float *sc,
            int64_t max_len, float *out) {
    float buf[MAX_ROW], acc[MAX_ROW], inv[MAX_HEADS];
    int64_t g = hq / hkv, width = hkv * d, row_bytes = width * (bf16 ? 2 : 4);
    for (int64_t t0 = 0, blk = 0; t0 < ctx; t0 += bs, blk++) {       /* scores = q . k */
        int64_t n = ctx - t0 < bs ? ctx - t0 : bs;
        int64_t base = (int64_t)table[blk] * bs * width;
        const char *next = next_block(kc, table, blk, t0, ctx, bs, row_bytes);
        for (int64_t o = 0; o < n; o++) {
            const float *row = load_row(kc, base + o * width, width, bf16, buf);
            prefetch_row(next, o, row_bytes);
            for (int64_t h = 0, j = 0; h < hkv; h++) {          /* the g heads of KV head h */
                const float *kr = row + h * d;
                for (int64_t jj = 0; jj < g; jj++, j++) {
                    const float *qj = q + j * d;
                    float s = 0.f;
                    for (int64_t i = 0; i < d; i++) s += qj[i] * kr[i];
                    sc[j * max_len + t0 + o] = s;
                }
            }
        }
    }
    softmax_rows(sc, hq, ctx, max_len, inv);
    memset(acc, 0, sizeof(float) * (size_t)(hq * d));                /* acc = p . v */
    for (int64_t t0 = 0, blk = 0; t0 < ctx; t0 += bs, blk++) {
        int64_t n = ctx - t0 < bs ? ctx - t0 : bs;
        int64_t base = (int64_t)table[blk] * bs * width;
        const char *next = next_block(vc, table, blk, t0, ctx, bs, row_bytes);
        for (int64_t o = 0; o < n; o++) {
            const float *row = load_row(vc, base + o * width, width, bf16, buf);
            prefetch_row(next, o, row_bytes);
            for (int64_t h = 0, j = 0; h < hkv; h++) {
                const float *vr = row + h * d;
                for (int64_t jj = 0; jj < g; jj++, j++) {
                    float p = sc[j * max_len + t0 + o];
                    float *a = acc + j * d;
                    for (int64_t i = 0; i < d; i++) a[i] += p * vr[i];
                }
            }
        }
    }
    for (int64_t j = 0; j < hq; j++)
        for (int64_t i = 0; i < d; i++) out[j * d + i] = acc[j * d + i] * inv[j];
}

#ifdef GEMM_VW
/* The same attention in vectors, for head sizes that are a multiple of VW. Per block and
 * per KV head, each of its query heads in turn:
 *   scores: VW tokens at a time, one accumulator per token (d / VW FMAs each), then one
 *           tree of shuffles adds each accumulator's lanes into lane t of one vector,
 *           instead of one horizontal sum per token;
 *   p . V:  the head's d / VW accumulators stay in registers over the block's tokens,
 *           instead of a load and a store of the accumulator per token.
 * The block's rows are read from L1 once per query head; memory sees the same reads in
 * the same order as attend_impl (whole rows, block by block), and the next block of the
 * table is asked for while the current one is worked on, spread over its query heads. */
/* VW values from `p` + `off` values as fp32: loaded, or (bf = 1) bf16 widened in the
 * register (K/V rows here, weight panels in the GEMM). */
static inline __attribute__((always_inline)) vec_t load_vec(const void *p, int64_t off,
                                                             int bf) {
    if (!bf) return V_LOADU((const float *)p + off);
    const uint16_t *src = (const uint16_t *)p + off;
#if GEMM_VW == 16
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
#else
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src)), 16));
#endif
}

/* a[0..VW) -> one vector whose lane t is the sum of a[t]'s lanes. */
static inline __attribute__((always_inline)) vec_t sum_lanes(const vec_t *a) {
#if GEMM_VW == 16
    __m512 r[8], s[4], u[2];
    for (int i = 0; i < 8; i++)          /* per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3 */
        r[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)          /* per 128-bit lane: tokens 4i .. 4i+3 */
        s[i] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * i], r[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(r[2 * i], r[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)          /* 128-bit lanes 0+2, 1+3 of two such vectors */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                         _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
#else
    __m256 r[4], s[2];
    for (int i = 0; i < 4; i++)
        r[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        s[i] = _mm256_add_ps(_mm256_shuffle_ps(r[2 * i], r[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(r[2 * i], r[2 * i + 1], 0xEE));
    return _mm256_add_ps(_mm256_permute2f128_ps(s[0], s[1], 0x20),
                         _mm256_permute2f128_ps(s[0], s[1], 0x31));
#endif
}

/* A bf16 cache in the vector kernel is read 2 VW values at a time as VW 32-bit lanes,
 * lane i holding value 2i in its low half and 2i + 1 in its high half: `split_even` (a
 * shift) and `split_odd` (a mask) widen the two halves to fp32 with one instruction per VW
 * values, where `load_vec` takes two (a zero-extension and a shift). The query and the
 * output rows are kept in the same order, per 2 VW values [the even ones | the odd ones]
 * (`split_row`, `merge_row`): the dot products take the same terms. */
static inline int split_layout(int bf16, int64_t d) { return bf16 && d % (2 * GEMM_VW) == 0; }

#if GEMM_VW == 16
typedef __m512i pairs_t;
static inline vec_t split_even(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
static inline vec_t split_odd(__m512i x) {
    return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
}
static inline __m512i load_pairs(const void *p) { return _mm512_loadu_si512(p); }
#else
typedef __m256i pairs_t;
static inline vec_t split_even(__m256i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); }
static inline vec_t split_odd(__m256i x) {
    return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline __m256i load_pairs(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
#endif

/* dst[0, d) = src[0, d) * scale in the split order (above). */
static inline void split_row(float *dst, const float *src, int64_t d, float scale) {
    for (int64_t c = 0; c < d; c += 2 * GEMM_VW)
        for (int64_t i = 0; i < GEMM_VW; i++) {
            dst[c + i] = src[c + 2 * i] * scale;
            dst[c + GEMM_VW + i] = src[c + 2 * i + 1] * scale;
        }
}

/* row[0, d), in the split order, back to the natural one, times `scale`, in place. */
static inline void merge_row(float *row, int64_t d, float scale) {
    float tmp[2 * GEMM_VW];
    for (int64_t c = 0; c < d; c += 2 * GEMM_VW) {
        for (int64_t i = 0; i < GEMM_VW; i++) {
            tmp[2 * i] = row[c + i] * scale;
            tmp[2 * i + 1] = row[c + GEMM_VW + i] * scale;
        }
        memcpy(row + c, tmp, sizeof tmp);
    }
}

#define ATT_VC 8         /* accumulators of the p . V loop: d is taken 8 vectors at a time */
#define ATT_GH 4         /* ... for up to 4 query heads of one KV head at a time */
#if GEMM_VW == 16
#define ATT_REGS 24      /* of the 32 zmm registers */
#else
#define ATT_REGS 8       /* of the 16 ymm registers */
#endif

/* p . V for gh query heads of one KV head over a block's n tokens, values [c0, c0 + nc VW)
 * of the head: o (the first head's output row) += sum over t of p[t] V[t], the heads'
 * score rows `max_len` apart from p; each V vector is loaded (and widened) once for all
 * gh heads. The npf 64-byte lines from pf (the next block's) are prefetched spread over
 * the tokens, a few a token: issued all at once before a group of heads, they measured
 * slower on the AMD EPYC Zen 4 (docs/executor.md). */
static inline __attribute__((always_inline)) void
pv_heads(const int gh, int64_t nc, int split, int bf16, const float *p, int64_t max_len,
         const char *hb, int64_t row_bytes, int64_t n, int64_t c0, float *o, int64_t d,
         const char *pf, int64_t npf) {
    const int64_t VW = GEMM_VW;
    vec_t acc[ATT_GH][ATT_VC];
    int64_t pft = n > 0 ? (npf + n - 1) / n : 0, pfl = 0;
    for (int a = 0; a < gh; a++)
        for (int c = 0; c < ATT_VC; c++)
            acc[a][c] = c < nc ? V_LOADU(o + a * d + c0 + c * VW) : V_ZERO();
    for (int64_t t = 0; t < n; t++) {
        vec_t pv[ATT_GH];
        for (int a = 0; a < gh; a++) pv[a] = V_SET1(p[a * max_len + t]);
        for (int64_t e = 0; e < pft && pfl < npf; e++, pfl++)
            __builtin_prefetch(pf + pfl * 64, 0, 1);
        const char *row = hb + t * row_bytes;
        if (split)                          /* nc is even: d % (2 VW) == 0 */
            for (int c = 0; c < ATT_VC; c += 2) {
                if (c >= nc) break;
                pairs_t x = load_pairs((const uint16_t *)row + c0 + c * VW);
                vec_t ve = split_even(x), vo = split_odd(x);
                for (int a = 0; a < gh; a++) {
                    acc[a][c] = V_FMA(pv[a], ve, acc[a][c]);
                    acc[a][c + 1] = V_FMA(pv[a], vo, acc[a][c + 1]);
                }
            }
        else
            for (int c = 0; c < ATT_VC; c++)
                if (c < nc) {
                    vec_t v = load_vec(row, c0 + c * VW, bf16);
                    for (int a = 0; a < gh; a++) acc[a][c] = V_FMA(pv[a], v, acc[a][c]);
                }
    }
    for (int a = 0; a < gh; a++)
        for (int c = 0; c < ATT_VC; c++)
            if (c < nc) V_STOREU(o + a * d + c0 + c * VW, acc[a][c]);
}

static inline __attribute__((always_inline)) void
attend_vec_impl(const float *q, const void *kc, const void *vc, int bf16, const int32_t *table,
                int64_t ctx, int64_t bs, int64_t hq, int64_t hkv, int64_t d, float *sc,
                int64_t max_len, float *out, int64_t max_group) {
    const int64_t VW = GEMM_VW;
    int64_t g = hq / hkv, width = hkv * d, row_bytes = width * (bf16 ? 2 : 4);
    int64_t nblk = (ctx + bs - 1) / bs, esize = bf16 ? 2 : 4;
    int split = split_layout(bf16, d);      /* q arrives split, out is merged at the end */
    /* p . V: as many query heads at a time as have their accumulators fit in ATT_REGS
     * registers, and at most max_group (the caller's, timed per CPU); one at a time for a
     * head size known only at run time (the compiler cannot size the register arrays then) */
    int64_t nvec = d / VW < ATT_VC ? d / VW : ATT_VC;
    int64_t gmax = !__builtin_constant_p(d) || ATT_REGS / nvec < 1 ? 1
                 : ATT_REGS / nvec < ATT_GH ? ATT_REGS / nvec : ATT_GH;
    if (max_group < gmax) gmax = max_group < 1 ? 1 : max_group;
    float inv[MAX_HEADS];
    for (int pass = 0; pass < 2; pass++) {       /* 0: scores = q . k;  1: out += p . v */
        const void *cache = pass ? vc : kc;
        if (pass) memset(out, 0, sizeof(float) * (size_t)(hq * d));
        for (int64_t blk = 0, t0 = 0; blk < nblk; blk++, t0 += bs) {
            int64_t n = ctx - t0 < bs ? ctx - t0 : bs;
            const char *b0 = (const char *)cache + (int64_t)table[blk] * bs * row_bytes;
            /* the next block (V's first while K's last is read): lines spread over the
             * hq head passes below */
            const char *next = blk + 1 < nblk
                ? (const char *)cache + (int64_t)table[blk + 1] * bs * row_bytes
                : !pass ? (const char *)vc + (int64_t)table[0] * bs * row_bytes : 0;
            int64_t nn = blk + 1 < nblk ? (ctx - t0 - bs < bs ? ctx - t0 - bs : bs)
                                        : (ctx < bs ? ctx : bs);
            int64_t lines = next ? (nn * row_bytes + 63) / 64 : 0, per = (lines + hq - 1) / hq;
            for (int64_t h = 0; h < hkv; h++) {
                const char *hb = b0 + h * d * esize;             /* head h of row 0 */
                if (!pass)
                    for (int64_t j = h * g; j < (h + 1) * g; j++) {
                        for (int64_t l = j * per; l < (j + 1) * per && l < lines; l++)
                            __builtin_prefetch(next + l * 64, 0, 1);
                        const float *qj = q + j * d;
                        for (int64_t o = 0; o < n; o += VW) {
                            vec_t acc[GEMM_VW];
                            const char *rows[GEMM_VW];
                            for (int t = 0; t < VW; t++) {       /* past n: row o again */
                                rows[t] = hb + (o + t < n ? o + t : o) * row_bytes;
                                acc[t] = V_ZERO();
                            }
                            if (split)
                                for (int64_t c = 0; c < d; c += 2 * VW) {
                                    vec_t qe = V_LOADU(qj + c), qo = V_LOADU(qj + c + VW);
                                    for (int t = 0; t < VW; t++) {
                                        pairs_t x = load_pairs(
                                            (const uint16_t *)rows[t] + c);
                                        acc[t] = V_FMA(qe, split_even(x), acc[t]);
                                        acc[t] = V_FMA(qo, split_odd(x), acc[t]);
                                    }
                                }
                            else
                                for (int64_t c = 0; c < d; c += VW) {
                                    vec_t qv = V_LOADU(qj + c);
                                    for (int t = 0; t < VW; t++)
                                        acc[t] = V_FMA(qv, load_vec(rows[t], c, bf16), acc[t]);
                                }
                            V_MSTORE(sc + j * max_len + t0 + o, lanes(n - o), sum_lanes(acc));
                        }
                    }
                else
                    /* the query heads of KV head h, up to gmax at a time: each V value is
                     * loaded (and widened) once for all of them */
                    for (int64_t j0 = h * g; j0 < (h + 1) * g; j0 += gmax) {
                        int64_t gb = (h + 1) * g - j0 < gmax ? (h + 1) * g - j0 : gmax;
                        int64_t l0 = j0 * per;
                        int64_t l1 = (j0 + gb) * per < lines ? (j0 + gb) * per : lines;
                        const float *p = sc + j0 * max_len + t0;
                        for (int64_t c0 = 0; c0 < d; c0 += ATT_VC * VW) {
                            int64_t nc = (d - c0) / VW < ATT_VC ? (d - c0) / VW : ATT_VC;
#define PV_HEADS(GH) pv_heads(GH, nc, split, bf16, p, max_len, hb, row_bytes, n, c0, \
                              out + j0 * d, d, next + l0 * 64, c0 || l1 < l0 ? 0 : l1 - l0)
                            switch (gb) {            /* register arrays of constant size */
                            case 4: PV_HEADS(4); break;
                            case 3: PV_HEADS(3); break;
                            case 2: PV_HEADS(2); break;
                            default: PV_HEADS(1);
                            }
#undef PV_HEADS
                        }
                    }
            }
        }
        if (!pass) softmax_rows(sc, hq, ctx, max_len, inv);
    }
    for (int64_t j = 0; j < hq; j++)
        if (split)
            merge_row(out + j * d, d, inv[j]);
        else
            for (int64_t i = 0; i < d; i++) out[j * d + i] *= inv[j];
}
#endif

static void attend(const float *q, const void *kc, const void *vc, int bf16,
                   const int32_t *table, int64_t ctx, int64_t bs, int64_t hq, int64_t hkv,
                   int64_t d, float *sc, int64_t max_len, float *out, int64_t max_group) {
#ifdef GEMM_VW
#define ATTEND_VEC(D) attend_vec_impl(q, kc, vc, bf16, table, ctx, bs, hq, hkv, D, sc, max_len, \
                                      out, max_group)
    if (d == 64) { ATTEND_VEC(64); return; }
    if (d == 128) { ATTEND_VEC(128); return; }
    if (d % GEMM_VW == 0) { ATTEND_VEC(d); return; }
#undef ATTEND_VEC
#endif
#define ATTEND(D) attend_impl(q, kc, vc, bf16, table, ctx, bs, hq, hkv, D, sc, max_len, out)
    if (d == 64) ATTEND(64);
    else if (d == 128) ATTEND(128);
    else ATTEND(d);
#undef ATTEND
}

/* q is taken unscaled, its rows `q_ld` floats apart (a view of the QKV projection's
 * rows): each sequence's row is multiplied by `scale` here (the same fp32 products as a
 * separate pass over [B, Hq, D] would make, without that pass, its copy and its parallel
 * region). max_group: at most this many query heads of a KV head at a time in the
 * weighted sum of V (1: one at a time; the same sums either way). Returns 0, or -1 when a
 * dimension exceeds the fixed buffers (the caller falls back). */
int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache,
                           int dtype_bf16, const int32_t *tables, int64_t max_blocks,
                           const int32_t *lens, float *out, int64_t B, int64_t hq, int64_t hkv,
                           int64_t d, int64_t bs, float *scratch, int64_t max_len,
                           int num_threads, float scale, int64_t q_ld, int max_group) {
    if (hq * d > MAX_ROW || hq > MAX_HEADS || hq % hkv) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t b = 0; b < B; b++) {
        float *sc = scratch + (int64_t)omp_get_thread_num() * hq * max_len;
        float qs[MAX_ROW];
#ifdef GEMM_VW
        if (split_layout(dtype_bf16, d))     /* attend_vec_impl's order for a bf16 cache */
            for (int64_t j = 0; j < hq; j++) split_row(qs + j * d, q + b * q_ld + j * d, d, scale);
        else
#endif
        for (int64_t i = 0; i < hq * d; i++) qs[i] = q[b * q_ld + i] * scale;
        attend(qs, k_cache, v_cache, dtype_bf16, tables + b * max_blocks, lens[b],
               bs, hq, hkv, d, sc, max_len, out + b * hq * d, max_group);
    }
    return 0;
}

/* ------------------------------------------------------------ elementwise, fp32 rows */

/* residual [T, H] (+= h [T, H] unless h is NULL); out [T, H] = residual / rms * w.
 * Statistics in fp32 as transformers' LlamaRMSNorm. */
void add_rms_norm(float *residual, const float *h, const float *w, float *out, int64_t T,
                  int64_t H, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++) {
        float *r = residual + t * H;
        float *o = out + t * H;
        if (h) {
            const float *x = h + t * H;
            for (int64_t i = 0; i < H; i++) r[i] += x[i];
        }
        float ss = 0.f;
        for (int64_t i = 0; i < H; i++) ss += r[i] * r[i];
        float inv = 1.f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; i++) o[i] = (r[i] * inv) * w[i];
    }
}

/* gu [T, 2I] = [gate | up] per row; out [T, I] = gate * sigmoid(gate) * up. */
void silu_and_mul(const float *gu, float *out, int64_t T, int64_t I, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I;
        const float *u = g + I;
        float *o = out + t * I;
        /* the clamp keeps expf finite (-ffast-math assumes no infinities) */
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.f + expf(fminf(-g[i], 80.f))) * u[i];
    }
}

/* bf16 <-> fp32 (bf16 rows of a bf16 model, and a 16-bit KV cache of an fp32 one). */
static inline float bf2f(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t f2bf(float f) {              /* round to nearest even, as torch */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);   /* NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* f rounded to the nearest bf16 (as f2bf), kept as an fp32 value; and the bf16 bits of an
 * fp32 value that is one already. Branch-free, so that loops of them vectorise. */
static inline float rbf(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    uint32_t r = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) & 0xffff0000u;
    uint32_t nan = v.u | 0x00400000u;
    v.u = (int32_t)(v.u & 0x7fffffffu) > 0x7f800000 ? nan & 0xffff0000u : r;
    return v.f;
}

static inline uint16_t bf_bits(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    return (uint16_t)(v.u >> 16);
}

static inline void store_row(void *cache, int64_t off, const float *src, int64_t n,
                             int bf16) {
    if (!bf16) {
        memcpy((float *)cache + off, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + off;
    for (int64_t i = 0; i < n; i++) dst[i] = f2bf(src[i]);
}

/* qkv [T, (Hq + 2 Hkv) D] with row stride `stride`: rotate the Hq + Hkv q/k heads in place
 * (rotate-half convention, cos/sin [max_len, D/2] indexed by positions), then copy each
 * token's k and v heads into slot_mapping[t] of the caches [slots, Hkv, D], fp32 or
 * (kv_bf16 = 1) rounded to bf16. */
void rope_and_cache(float *qkv, int64_t stride, const int64_t *positions, const float *cos_t,
                    const float *sin_t, const int64_t *slots, void *k_cache, void *v_cache,
                    int kv_bf16, int64_t T, int64_t hq, int64_t hkv, int64_t d,
                    int num_threads) {
    int64_t half = d / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * stride;
        const float *c = cos_t + positions[t] * half;
        const float *s = sin_t + positions[t] * half;
        for (int64_t head = 0; head < hq + hkv; head++) {
            float *x1 = row + head * d;
            float *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
        int64_t slot = slots[t];
        if (slot >= 0) {
            store_row(k_cache, slot * hkv * d, row + hq * d, hkv * d, kv_bf16);
            store_row(v_cache, slot * hkv * d, row + (hq + hkv) * d, hkv * d, kv_bf16);
        }
    }
}

/* ------------------------------------------------------------ elementwise, bf16 rows
 *
 * The same three steps for a bf16 model, so that its layer also runs 8 parallel regions
 * instead of about 25 torch ops (each a region of its own where the tensor is large, and
 * each region wakes the sleeping OpenMP threads). Math in fp32; every value is rounded to
 * bf16 where the torch ops of the fallback path (llama.py) round it, in the same order. The
 * two paths can still differ by one bf16 step where the fp32 values before rounding do in
 * their last bit (the order of the norm's sum of squares, the exp of SiLU). */
void add_rms_norm_bf16(uint16_t *residual, const uint16_t *h, const uint16_t *w,
                       uint16_t *out, int64_t T, int64_t H, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++) {
        uint16_t *r = residual + t * H;
        uint16_t *o = out + t * H;
        if (h) {
            const uint16_t *x = h + t * H;
            for (int64_t i = 0; i < H; i++) r[i] = f2bf(bf2f(r[i]) + bf2f(x[i]));
        }
        float ss = 0.f;
        for (int64_t i = 0; i < H; i++) ss += bf2f(r[i]) * bf2f(r[i]);
        float inv = 1.f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; i++) o[i] = f2bf(bf2f(w[i]) * bf2f(f2bf(bf2f(r[i]) * inv)));
    }
}

void silu_and_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t T, int64_t I,
                       int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gu + t * 2 * I;
        const uint16_t *u = g + I;
        uint16_t *o = out + t * I;
        for (int64_t i = 0; i < I; i++) {
            float x = bf2f(g[i]);
            o[i] = f2bf(bf2f(f2bf(x / (1.f + expf(fminf(-x, 80.f))))) * bf2f(u[i]));
        }
    }
}

/* cos/sin [max_len, D/2] in bf16, as the model keeps them. */
void rope_and_cache_bf16(uint16_t *qkv, int64_t stride, const int64_t *positions,
                         const uint16_t *cos_t, const uint16_t *sin_t, const int64_t *slots,
                         uint16_t *k_cache, uint16_t *v_cache, int64_t T, int64_t hq,
                         int64_t hkv, int64_t d, int num_threads) {
    int64_t half = d / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++) {
        uint16_t *row = qkv + t * stride;
        const uint16_t *c = cos_t + positions[t] * half;
        const uint16_t *s = sin_t + positions[t] * half;
        for (int64_t head = 0; head < hq + hkv; head++) {
            uint16_t *x1 = row + head * d;
            uint16_t *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                float a = bf2f(x1[i]), b = bf2f(x2[i]), ci = bf2f(c[i]), si = bf2f(s[i]);
                x1[i] = f2bf(bf2f(f2bf(a * ci)) - bf2f(f2bf(b * si)));
                x2[i] = f2bf(bf2f(f2bf(b * ci)) + bf2f(f2bf(a * si)));
            }
        }
        int64_t slot = slots[t];
        if (slot >= 0) {
            memcpy(k_cache + slot * hkv * d, row + hq * d, sizeof(uint16_t) * (size_t)(hkv * d));
            memcpy(v_cache + slot * hkv * d, row + (hq + hkv) * d,
                   sizeof(uint16_t) * (size_t)(hkv * d));
        }
    }
}

/* ------------------------------------------------------------ prefill attention
 *
 * Causal attention of one prompt chunk of n tokens at positions start .. start + n - 1
 * over the keys of positions 0 .. start + n - 1:
 *   q   [n, Hq, D]      rows q_ld values apart (a view of the QKV projection's rows)
 *   k/v [nk, Hkv, D]    nk = start + n; with table = NULL rows kv_ld values apart (the
 *                       chunk's own fresh K/V, start 0), else token t's row in block
 *                       table[t / bs], slot t % bs of a pool [blocks, bs, Hkv, D]
 *                       (kv_ld = Hkv * D)
 *   out [n, Hq, D]      rows out_ld values apart
 * q and out fp32 or bf16 (bf16 = 1: the output rounded once to bf16), K/V fp32 or bf16
 * (kv_bf16); the sums in fp32.
 * As GEMMs in registers: K is first laid out transposed per KV head ([D][nk], fp32), so that
 * a tile of PA_MR query rows scores VW keys per vector with one FMA per row and d; the
 * scores of the tile's rows (up to its last row's position) stay in an L2-sized buffer for
 * the softmax; then PA_PR rows x PA_PC vectors of D are summed over the keys, p broadcast
 * per row and key. The rows of one query head and tile are one work item, the tiles with
 * the most keys first. torch's flash attention for the CPU runs these small causal
 * products (prompts of tens to hundreds of tokens, a few heads) at a fraction of the GEMM
 * rate, and in bf16 on a CPU without AMX through MKL's widening bf16 GEMM.
 * scratch: hkv * d * np (K^T) + hkv * nk * d (V) + threads * PA_MR * (np + d) floats,
 * np = nk rounded up to VW (prefill_scratch_floats(nk, ...)). Returns 0, or -1 where d is not a
 * multiple of the vector width or hq of hkv (the caller falls back). */
#ifdef GEMM_VW
#if GEMM_VW == 16
#define PA_MR 14         /* query rows of a score tile (14 accumulators) */
#define PA_PR 7          /* p . V: rows x vectors of d in registers (28 accumulators) */
#define PA_PC 4
#else
#define PA_MR 12
#define PA_PR 3
#define PA_PC 3
#endif

int64_t prefill_scratch_floats(int64_t n, int64_t hkv, int64_t d, int num_threads) {
    int64_t np = (n + GEMM_VW - 1) / GEMM_VW * GEMM_VW;
    return hkv * d * np + hkv * n * d + (int64_t)num_threads * PA_MR * (np + d);
}

static inline float elem(const void *p, int64_t i, int bf16) {
    return bf16 ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* out rows [mr] x vectors [nc] = (p [mr][lim], rows np apart) . V rows [lim] (d apart),
 * each row times inv[r]; fp32 or bf16 out (rows out_ld values apart). */
static inline __attribute__((always_inline)) void
pv_tile(const float *p, int64_t np, const float *vh, int64_t d, int64_t lim, const float *inv,
        int64_t mr, int64_t nc, char *out, int64_t out_ld, int bf16) {
    const int64_t VW = GEMM_VW;
    vec_t acc[PA_PR][PA_PC];
    for (int r = 0; r < PA_PR; r++)
        for (int c = 0; c < PA_PC; c++) acc[r][c] = V_ZERO();
    for (int64_t t = 0; t < lim; t++) {
        vec_t x[PA_PC];
        for (int c = 0; c < PA_PC; c++) x[c] = c < nc ? V_LOADU(vh + t * d + c * VW) : V_ZERO();
        for (int r = 0; r < PA_PR; r++)
            if (r < mr) {
                vec_t pv = V_SET1(p[r * np + t]);
                for (int c = 0; c < PA_PC; c++)
                    if (c < nc) acc[r][c] = V_FMA(pv, x[c], acc[r][c]);
            }
    }
    for (int r = 0; r < PA_PR; r++)
        for (int c = 0; c < PA_PC; c++) {
            if (r >= mr || c >= nc) continue;
            vec_t y = V_MUL(acc[r][c], V_SET1(inv[r]));
            if (!bf16) {
                V_STOREU((float *)out + r * out_ld + c * VW, y);
            } else {
                float tmp[GEMM_VW];
                V_STOREU(tmp, y);
                for (int l = 0; l < VW; l++)
                    ((uint16_t *)out)[r * out_ld + c * VW + l] = f2bf(tmp[l]);
            }
        }
}

int prefill_attention(const void *q, int64_t q_ld, int bf16, const void *k, const void *v,
                      int64_t kv_ld, int kv_bf16, const int32_t *table, int64_t bs,
                      int64_t start, void *out, int64_t out_ld, int64_t n, int64_t hq,
                      int64_t hkv, int64_t d, float scale, float *scratch, int num_threads) {
    const int64_t VW = GEMM_VW;
    if (d % VW || hq % hkv || n < 1 || start < 0) return -1;
    int64_t nk = start + n, g = hq / hkv, np = (nk + VW - 1) / VW * VW;
    int64_t nt = (n + PA_MR - 1) / PA_MR;
    float *kt = scratch, *vf = kt + hkv * d * np, *sbase = vf + hkv * nk * d;
#pragma omp parallel num_threads(num_threads)
    {
        /* K^T per KV head and V as fp32 rows, VW tokens at a time: K in squares of VW
         * tokens x VW channels (each K row read in order; the square's VW lines of K^T,
         * np floats apart, are on few pages), V row by row */
#pragma omp for schedule(static)
        for (int64_t t0 = 0; t0 < np; t0 += VW) {
            int64_t rows[GEMM_VW];
            for (int64_t t = t0; t < t0 + VW; t++)
                rows[t - t0] = t >= nk ? -1 : table ? (int64_t)table[t / bs] * bs + t % bs : t;
            for (int64_t hc0 = 0; hc0 < hkv * d; hc0 += VW)
                for (int64_t t = t0; t < t0 + VW; t++) {
                    int64_t row = rows[t - t0];
                    for (int64_t hc = hc0; hc < hc0 + VW; hc++)
                        kt[hc * np + t] = row < 0 ? 0.f : elem(k, row * kv_ld + hc, kv_bf16);
                }
            for (int64_t t = t0; t < t0 + VW && t < nk; t++)
                for (int64_t h = 0; h < hkv; h++)
                    for (int64_t c = 0; c < d; c++)
                        vf[(h * nk + t) * d + c] =
                            elem(v, rows[t - t0] * kv_ld + h * d + c, kv_bf16);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < hq * nt; it++) {
            int64_t tile = nt - 1 - it / hq, j = it % hq, h = j / g;
            int64_t i0 = tile * PA_MR, m = n - i0 < PA_MR ? n - i0 : PA_MR;
            int64_t kvn = start + i0 + m;                 /* keys the tile's last row sees */
            float *s = sbase + (int64_t)omp_get_thread_num() * PA_MR * (np + d);
            float *qs = s + PA_MR * np, inv[PA_MR];
            for (int64_t r = 0; r < PA_MR; r++)          /* the tile's rows, scaled: [d][PA_MR] */
                for (int64_t c = 0; c < d; c++)
                    qs[c * PA_MR + r] = r < m ? elem(q, (i0 + r) * q_ld + j * d + c, bf16) * scale
                                              : 0.f;
            const float *kh = kt + h * d * np;
            for (int64_t t0 = 0; t0 < kvn; t0 += VW) {        /* scores of keys t0 .. t0+VW */
                vec_t acc[PA_MR];
                for (int r = 0; r < PA_MR; r++) acc[r] = V_ZERO();
                for (int64_t c = 0; c < d; c++) {
                    vec_t kv = V_LOADU(kh + c * np + t0);
                    const float *qc = qs + c * PA_MR;
                    for (int r = 0; r < PA_MR; r++) acc[r] = V_FMA(V_SET1(qc[r]), kv, acc[r]);
                }
                for (int r = 0; r < PA_MR; r++) V_STOREU(s + r * np + t0, acc[r]);
            }
            for (int64_t r = 0; r < m; r++) {   /* row i0 + r sees keys 0 .. start + i0 + r */
                float *sr = s + r * np, mx = sr[0], sum = 0.f;
                int64_t len = start + i0 + r + 1;
                for (int64_t t = 1; t < len; t++) mx = sr[t] > mx ? sr[t] : mx;
                for (int64_t t = 0; t < len; t++) {
                    sr[t] = expf(sr[t] - mx);
                    sum += sr[t];
                }
                for (int64_t t = len; t < kvn; t++) sr[t] = 0.f;
                inv[r] = 1.f / sum;
            }
            const float *vh = vf + h * nk * d;
            for (int64_t r0 = 0; r0 < m; r0 += PA_PR) {
                int64_t mr = m - r0 < PA_PR ? m - r0 : PA_PR, lim = start + i0 + r0 + mr;
                for (int64_t c0 = 0; c0 < d; c0 += PA_PC * VW) {
                    int64_t nc = (d - c0) / VW < PA_PC ? (d - c0) / VW : PA_PC;
                    char *o = (char *)out + ((i0 + r0) * out_ld + j * d + c0) * (bf16 ? 2 : 4);
                    if (mr == PA_PR && nc == PA_PC)    /* constants: no guards in the loop */
                        pv_tile(s + r0 * np, np, vh + c0, d, lim, inv + r0, PA_PR, PA_PC, o,
                                out_ld, bf16);
                    else
                        pv_tile(s + r0 * np, np, vh + c0, d, lim, inv + r0, mr, nc, o, out_ld,
                                bf16);
                }
            }
        }
    }
    return 0;
}
#else
int64_t prefill_scratch_floats(int64_t n, int64_t hkv, int64_t d, int num_threads) {
    return 0;
}
int prefill_attention(const void *q, int64_t q_ld, int bf16, const void *k, const void *v,
                      int64_t kv_ld, int kv_bf16, const int32_t *table, int64_t bs,
                      int64_t start, void *out, int64_t out_ld, int64_t n, int64_t hq,
                      int64_t hkv, int64_t d, float scale, float *scratch, int num_threads) {
    return -1;
}
#endif

/* ------------------------------------------------------------ greedy sampling
 *
 * logits [R, V] fp32 (rows `ld` apart) -> token[r] = the first index of the row's maximum,
 * logprob[r] = log_softmax(row)[token] = -log(sum(exp(x - max))). One read of each row
 * from memory (the second pass finds it in L2) instead of torch's log_softmax (which also
 * writes [R, V]) plus max. */
static inline int64_t row_argmax(const float *x, int64_t v) {
    int64_t i = 0, best = 0;
    float m = x[0];
#ifdef __AVX512F__
    if (v >= 16) {
        __m512 mv = _mm512_loadu_ps(x);
        __m512i iv = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i cur = iv, step = _mm512_set1_epi32(16);
        for (i = 16; i + 16 <= v; i += 16) {
            cur = _mm512_add_epi32(cur, step);
            __m512 xv = _mm512_loadu_ps(x + i);
            __mmask16 gt = _mm512_cmp_ps_mask(xv, mv, _CMP_GT_OQ);   /* strict: first wins */
            mv = _mm512_mask_mov_ps(mv, gt, xv);
            iv = _mm512_mask_mov_epi32(iv, gt, cur);
        }
        float vals[16];
        int32_t idx[16];
        _mm512_storeu_ps(vals, mv);
        _mm512_storeu_si512(idx, iv);
        m = vals[0], best = idx[0];
        for (int l = 1; l < 16; l++)
            if (vals[l] > m || (vals[l] == m && idx[l] < best)) m = vals[l], best = idx[l];
    }
#endif
    for (; i < v; i++)
        if (x[i] > m) m = x[i], best = i;
    return best;
}

void greedy_logprobs(const float *logits, int64_t rows, int64_t v, int64_t ld, int64_t *token,
                     float *logprob, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * ld;
        int64_t best = row_argmax(x, v);
        float m = x[best], sum = 0.f;
        for (int64_t i = 0; i < v; i++) sum += expf(x[i] - m);
        token[r] = best;
        logprob[r] = -logf(sum);
    }
}

/* ------------------------------------------------------------ fp32 GEMM, packed weight
 *
 * y [M, N] = x [M, K] W^T + b, W an nn.Linear weight [N, K]. Decode steps multiply few
 * rows (one per running sequence) by every weight of the model, which comes from memory
 * each step: at 64 rows oneDNN and MKL reach about 60 % of their large-matrix rate here,
 * because they leave the weight stream to the hardware prefetcher. This kernel asks for
 * the weight ahead of time itself.
 *
 * One source for two instruction sets: with AVX-512 a vector holds VW = 16 floats and a
 * tile is up to MR = 14 rows (28 of the 32 zmm registers accumulate); with AVX2 + FMA
 * (Zen 2/3, Intel before Skylake-X) VW = 8 and MR = 6 (12 of the 16 ymm registers).
 * Packed layout: W in panels of NR = 2 VW output columns, panel p = [K][NR] floats
 * (columns past N are zero), so a panel is one contiguous stream and each k-step of the
 * micro-kernel loads one row of it (two vectors). Each thread takes a contiguous range of
 * panels. For each panel the micro-kernel computes tiles of up to MR rows x NR columns in
 * 2 MR vector accumulators (row values broadcast from x, copied into tiles [K][rows] that
 * stay in L2), and while it does, it prefetches the thread's next panel into L2, spread
 * evenly over the panel's tiles: one line every few k-steps instead of a burst that stalls
 * the FMAs. Rows are taken in blocks of about 1 MiB of x, so that large prefill batches
 * also stay in L2. Measured on 2 cores (Xeon with AVX-512, SmolLM2's four projections, 30
 * layers, weights from memory; loadtest/bench_cpu_gemm.py): 1.3-1.7x oneDNN up to 128
 * rows, 1.2x at 256, level at 512, 0.97x at 2048 rows (docs/executor.md has the AVX2
 * figures).
 */

#ifdef GEMM_VW
#define GEMM_NR (2 * GEMM_VW)
#if GEMM_VW == 16 && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define GEMM_DP 1        /* bf16 dot products of pairs (vdpbf16ps): linear_packed_dp */

/* bf16 <-> fp32 in registers: vcvtneps2bf16 rounds to nearest even, as f2bf */
static inline __m256i v_bf16(__m512 a) { return (__m256i)_mm512_cvtneps_pbh(a); }
static inline __m512 v_widen(__m256i b) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
static inline __m512 v_round(__m512 a) { return v_widen(v_bf16(a)); }
#ifdef __GLIBC__
/* glibc's 16-lane expf (libmvec), which gcc calls for the vectorised loops of expf here
 * (elsewhere the silu epilogue takes the plain loops below) */
#define GEMM_VEXPF 1
extern __m512 _ZGVeN16v_expf(__m512 x);
#endif
#endif
int linear_packed_available(void) { return 1; }
int linear_packed_nr(void) { return GEMM_NR; }

/* w [N, K] -> panels of NR columns, `esize` bytes per value (4: fp32, 2: bf16; the bf16
 * panels are read by linear_packed_bf16). With glu = 1, w is a fused [gate | up] weight
 * [2I, K] (N = 2I) and each panel holds VW gate columns, then the VW up columns of the
 * same outputs, so that one tile ends with both halves of silu(gate) * up in registers. */
static void pack_panels(const char *w, int64_t n, int64_t k, int glu, char *out, int esize,
                        int pairs, int num_threads) {
    int64_t half = n / 2, panels = glu ? (half + GEMM_VW - 1) / GEMM_VW
                                       : (n + GEMM_NR - 1) / GEMM_NR;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < (pairs ? (k + 1) / 2 * 2 : k); kk++)
            for (int64_t j = 0; j < GEMM_NR; j++) {
                int64_t col = p * GEMM_NR + j, ok = col < n && kk < k;
                if (glu) {
                    col = p * GEMM_VW + j % GEMM_VW;
                    ok = col < half && kk < k;
                    col += j < GEMM_VW ? 0 : half;
                }
                char *dst = out + (pairs ? ((p * ((k + 1) / 2) + kk / 2) * GEMM_NR + j) * 2 + kk % 2
                                         : (p * k + kk) * GEMM_NR + j) * esize;
                if (ok) memcpy(dst, w + (col * k + kk) * esize, (size_t)esize);
                else memset(dst, 0, (size_t)esize);
            }
}

void pack_linear_weight(const float *w, int64_t n, int64_t k, int glu, float *out,
                        int num_threads) {
    pack_panels((const char *)w, n, k, glu, (char *)out, 4, 0, num_threads);
}

void pack_linear_weight_bf16(const uint16_t *w, int64_t n, int64_t k, int glu, uint16_t *out,
                             int num_threads) {
    pack_panels((const char *)w, n, k, glu, (char *)out, 2, 0, num_threads);
}

enum { EPI_STORE = 0, EPI_ADD = 1, EPI_GLU = 2 };

/* One k-step of a tile's prefetching: every `every` steps the next `per` of the 64-byte
 * lines [0, nlines) of `pf` (a countdown: no division in the k loop). */
static inline __attribute__((always_inline)) void
prefetch_step(const char *pf, int64_t every, int64_t per, int64_t nlines, int64_t *wait,
              int64_t *line) {
    if (--*wait <= 0) {
        *wait = every;
        for (int64_t e = *line + per; *line < e && *line < nlines; ++*line)
            _mm_prefetch(pf + *line * 64, _MM_HINT_T1);
    }
}

/* One tile: r = x[0:mr, :] . panel + bias, then by `epi`: y[0:mr, 0:NR] = r (EPI_STORE),
 * y += r (EPI_ADD), or y[0:mr, 0:VW] = silu(r[:, :VW]) * r[:, VW:] (EPI_GLU), masked to
 * the `ncols` valid columns (m0, m1 as lane masks). `mr` and `bf` are constants in each
 * copy made by gemm_tile, so acc lives in registers. With bf = 1 the panel and y are bf16:
 * the sums are fp32 and every value is rounded to bf16 where torch's bf16 ops round it
 * (the product; then the sum with y; or gate and up, silu(gate), and the product, as
 * silu_and_mul_bf16). While the tile runs, 64-byte lines [0, nlines) of `pf` are
 * prefetched, `per` every `every` k-steps. */
static inline __attribute__((always_inline)) void
gemm_tile_impl(const int mr, const float *xt, const void *panel, int64_t k,
               const float *bias, vmask_t m0, vmask_t m1, int64_t ncols, void *y, int64_t ldy,
               const char *pf, int64_t every, int64_t per, int64_t nlines, int epi,
               const int bf) {
    vec_t acc[GEMM_MR][2];
    vec_t b0 = bias ? V_MLOAD(m0, bias) : V_ZERO();
    vec_t b1 = bias ? V_MLOAD(m1, bias + GEMM_VW) : V_ZERO();
    for (int r = 0; r < mr; r++) {
        acc[r][0] = b0;
        acc[r][1] = b1;
    }
#ifdef GEMM_DP
    if (bf == 2) {     /* k = k-pairs; xt holds each row's pair of bf16 values as 32 bits */
        const int32_t *x2 = (const int32_t *)xt;
        const uint16_t *wp = (const uint16_t *)panel;
        for (int64_t kk = 0, wait = 0, line = 0; kk < k; kk++) {
            __m512bh w0 = (__m512bh)_mm512_load_si512(wp + kk * 2 * GEMM_NR);
            __m512bh w1 = (__m512bh)_mm512_load_si512(wp + kk * 2 * GEMM_NR + 2 * GEMM_VW);
            prefetch_step(pf, every, per, nlines, &wait, &line);
            for (int r = 0; r < mr; r++) {
                __m512bh a = (__m512bh)_mm512_set1_epi32(x2[kk * mr + r]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
            }
        }
    } else
#endif
    for (int64_t kk = 0, wait = 0, line = 0; kk < k; kk++) {
        vec_t w0 = load_vec(panel, kk * GEMM_NR, bf);
        vec_t w1 = load_vec(panel, kk * GEMM_NR + GEMM_VW, bf);
        prefetch_step(pf, every, per, nlines, &wait, &line);
        for (int r = 0; r < mr; r++) {
            vec_t a = V_SET1(xt[kk * mr + r]);
            acc[r][0] = V_FMA(a, w0, acc[r][0]);
            acc[r][1] = V_FMA(a, w1, acc[r][1]);
        }
    }
#ifdef GEMM_DP
#ifdef GEMM_VEXPF
    if (bf == 2 && epi == EPI_GLU) {    /* silu_and_mul_bf16's roundings, in registers */
        for (int r = 0; r < mr; r++) {
            __m512 g = v_round(acc[r][0]), u = v_round(acc[r][1]);
            __m512 e = _ZGVeN16v_expf(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g),
                                                    _mm512_set1_ps(80.f)));
            __m512 s = v_round(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
            _mm256_mask_storeu_epi16((uint16_t *)y + r * ldy, m0, v_bf16(_mm512_mul_ps(s, u)));
        }
        return;
    }
#endif
    if (bf == 2 && epi != EPI_GLU) {  /* rounded in registers, 16 columns at a time */
        for (int r = 0; r < mr; r++) {
            uint16_t *yr = (uint16_t *)y + r * ldy;
            for (int h = 0; h < 2; h++) {
                vmask_t m = h ? m1 : m0;
                __m512 a = acc[r][h];
                if (epi == EPI_ADD)     /* y + the rounded product, rounded */
                    a = _mm512_add_ps(v_widen(_mm256_maskz_loadu_epi16(m, yr + h * GEMM_VW)),
                                      v_widen(v_bf16(a)));
                _mm256_mask_storeu_epi16(yr + h * GEMM_VW, m, v_bf16(a));
            }
        }
        return;
    }
#endif
    if (bf) {         /* plain loops over the tile's values, which gcc vectorises */
        float t[GEMM_MR * GEMM_NR];
        for (int r = 0; r < mr; r++) {
            V_STOREU(t + r * GEMM_NR, acc[r][0]);
            V_STOREU(t + r * GEMM_NR + GEMM_VW, acc[r][1]);
        }
        for (int r = 0; r < mr; r++) {
            uint16_t *yr = (uint16_t *)y + r * ldy;
            float *tr = t + r * GEMM_NR;
            if (epi == EPI_GLU)
                for (int64_t j = 0; j < ncols; j++) {
                    float g = rbf(tr[j]), u = rbf(tr[GEMM_VW + j]);
                    tr[j] = rbf(rbf(g / (1.f + expf(fminf(-g, 80.f)))) * u);
                }
            else if (epi == EPI_ADD)
                for (int64_t j = 0; j < ncols; j++) tr[j] = rbf(bf2f(yr[j]) + rbf(tr[j]));
            else
                for (int64_t j = 0; j < ncols; j++) tr[j] = rbf(tr[j]);
            for (int64_t j = 0; j < ncols; j++) yr[j] = bf_bits(tr[j]);
        }
        return;
    }
    float *yf = (float *)y;
    if (epi == EPI_GLU) {       /* the scalar formula of silu_and_mul, vectorised by gcc */
        float g[GEMM_MR * GEMM_VW], u[GEMM_MR * GEMM_VW];
        for (int r = 0; r < mr; r++) {
            V_STOREU(g + r * GEMM_VW, acc[r][0]);
            V_STOREU(u + r * GEMM_VW, acc[r][1]);
        }
        for (int i = 0; i < mr * GEMM_VW; i++)
            g[i] = g[i] / (1.f + expf(fminf(-g[i], 80.f))) * u[i];
        for (int r = 0; r < mr; r++) V_MSTORE(yf + r * ldy, m0, V_LOADU(g + r * GEMM_VW));
        return;
    }
    for (int r = 0; r < mr; r++) {
        vec_t a0 = acc[r][0], a1 = acc[r][1];
        if (epi == EPI_ADD) {   /* (x W^T + b) rounded, then added: as F.linear, then add_ */
            a0 = V_ADD(V_MLOAD(m0, yf + r * ldy), a0);
            a1 = V_ADD(V_MLOAD(m1, yf + r * ldy + GEMM_VW), a1);
        }
        V_MSTORE(yf + r * ldy, m0, a0);
        V_MSTORE(yf + r * ldy + GEMM_VW, m1, a1);
    }
}

static void gemm_tile(int mr, const float *xt, const void *panel, int64_t k,
                      const float *bias, vmask_t m0, vmask_t m1, int64_t ncols, void *y,
                      int64_t ldy, const char *pf, int64_t every, int64_t per, int64_t nlines,
                      int epi, int bf) {
#ifdef GEMM_DP
#define TILE_DP(R) if (bf == 2) gemm_tile_impl(R, xt, panel, k, bias, m0, m1, ncols, y, ldy, \
                                               pf, every, per, nlines, epi, 2); else
#else
#define TILE_DP(R)
#endif
#define TILE(R) case R: \
    TILE_DP(R) if (bf) gemm_tile_impl(R, xt, panel, k, bias, m0, m1, ncols, y, ldy, pf, every, \
                                      per, nlines, epi, 1); \
    else gemm_tile_impl(R, xt, panel, k, bias, m0, m1, ncols, y, ldy, pf, every, per, \
                        nlines, epi, 0); \
    break;
    switch (mr) {
#if GEMM_MR > 6
    TILE(14) TILE(13) TILE(12) TILE(11) TILE(10) TILE(9) TILE(8) TILE(7)
#endif
    TILE(6) TILE(5) TILE(4) TILE(3) TILE(2) TILE(1)
    }
#undef TILE
#undef TILE_DP
}

/* v[0..VW): VW rows of VW 32-bit values -> v[j] holds value j of every row, lane r from
 * row r. Interleaved pairs of rows, then of pairs, then the 128-bit lanes of the groups of
 * four rows gathered. */
static inline __attribute__((always_inline)) void transpose_vw(vec_t *v) {
    vec_t a[GEMM_VW], b[GEMM_VW];
    for (int i = 0; i < GEMM_VW / 2; i++) {   /* per 128-bit lane L: rows 2i, 2i+1 at 4L,
                                                * 4L+1 | at 4L+2, 4L+3 */
        a[2 * i] = V_UNPACKLO(v[2 * i], v[2 * i + 1]);
        a[2 * i + 1] = V_UNPACKHI(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < GEMM_VW / 4; i++) {   /* b[4i + m], lane L: rows 4i .. 4i+3 at 4L + m */
        b[4 * i] = V_UNPACKLO64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = V_UNPACKHI64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = V_UNPACKLO64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = V_UNPACKHI64(a[4 * i + 1], a[4 * i + 3]);
    }
#if GEMM_VW == 16
    for (int m = 0; m < 4; m++) {   /* value 4L + m: lane L of the four groups' b[4i + m] */
        __m512 c = _mm512_shuffle_f32x4(b[m], b[4 + m], 0x44);
        __m512 d = _mm512_shuffle_f32x4(b[m], b[4 + m], 0xEE);
        __m512 e = _mm512_shuffle_f32x4(b[8 + m], b[12 + m], 0x44);
        __m512 f = _mm512_shuffle_f32x4(b[8 + m], b[12 + m], 0xEE);
        v[m] = _mm512_shuffle_f32x4(c, e, 0x88);
        v[4 + m] = _mm512_shuffle_f32x4(c, e, 0xDD);
        v[8 + m] = _mm512_shuffle_f32x4(d, f, 0x88);
        v[12 + m] = _mm512_shuffle_f32x4(d, f, 0xDD);
    }
#else
    for (int m = 0; m < 4; m++) {   /* value 4L + m: lane L of the two groups' b[4i + m] */
        v[m] = _mm256_permute2f128_ps(b[m], b[4 + m], 0x20);
        v[4 + m] = _mm256_permute2f128_ps(b[m], b[4 + m], 0x31);
    }
#endif
}

/* A tile of x: dst[kk * mr + r] = value kk of row r (rows `row_bytes` apart from x0), kk <
 * nk; 32-bit values (fp32, or the bf16 pairs of the dp kernel, copied as they are), or bf16
 * widened (bf = 1). VW values of each row at a time, a VW x VW square transposed in
 * registers and written as VW runs of mr values (each row read in order a vector at a
 * time, the tile written in order). */
static inline __attribute__((always_inline)) void
copy_tile(const char *x0, int64_t row_bytes, int mr, int64_t nk, int bf, float *dst) {
    const vmask_t m = lanes(mr);
    int64_t kk = 0;
    for (; kk + GEMM_VW <= nk; kk += GEMM_VW) {
        vec_t v[GEMM_VW];
        for (int r = 0; r < GEMM_VW; r++)
            v[r] = r < mr ? load_vec(x0 + r * row_bytes, kk, bf) : V_ZERO();
        transpose_vw(v);
        for (int j = 0; j < GEMM_VW; j++) V_MSTORE(dst + (kk + j) * mr, m, v[j]);
    }
    for (; kk < nk; kk++)
        for (int r = 0; r < mr; r++) {
            const char *xr = x0 + r * row_bytes;
            if (bf)
                dst[kk * mr + r] = bf2f(((const uint16_t *)xr)[kk]);
            else
                memcpy(dst + kk * mr + r, xr + kk * 4, 4);
        }
}

/* Panels done by a thread other than their owner, since the library was loaded. */
static _Atomic int64_t panels_taken_over;
int64_t gemm_panels_taken_over(void) { return atomic_load(&panels_taken_over); }

/* The next unclaimed panel of one thread's share, on a cache line of its own. */
typedef struct {
    _Atomic int64_t next;
    char pad[64 - sizeof(int64_t)];
} panel_claim_t;

/* Thread t's next panel *p, from the end *p1 of the run it is on: its own run first
 * (*run = 0), then the runs of the threads after it. 0 when every panel is claimed. */
static inline int claim_panel(panel_claim_t *claims, int t, int nt, int64_t panels, int *run,
                              int64_t *p, int64_t *p1) {
    for (; *run < nt; ++*run) {
        int u = (t + *run) % nt;
        *p1 = panels * (u + 1) / nt;
        *p = atomic_fetch_add_explicit(&claims[u].next, 1, memory_order_relaxed);
        if (*p < *p1) {
            if (*run) atomic_fetch_add_explicit(&panels_taken_over, 1, memory_order_relaxed);
            return 1;
        }
    }
    return 0;
}

/* x [M, K] rows `ldx` apart; packed by pack_panels; bias [N] (fp32) or NULL (and NULL
 * with EPI_GLU); y [M, N] rows `ldy` apart, or [M, I] with EPI_GLU (N = 2I). With bf = 1,
 * x, the panels and y are bf16. Returns 0, or -1 when a buffer cannot be allocated.
 *
 * Each thread owns an equal run of panels and takes them in order, one claim (an atomic
 * add on its own counter) per panel; a thread done with its run takes the panels the
 * others have not claimed yet. Alone on its cores every thread does its own run, as a
 * static split would; when the OS gives a thread's core to another process for a while,
 * its partner does its remaining panels instead of waiting at the barrier. */
static int gemm(const void *x, int64_t m, int64_t k, int64_t ldx, const void *packed,
                int64_t n, const float *bias, void *y, int64_t ldy, int epi, int bf,
                int num_threads) {
    int64_t esize = bf ? 2 : 4;
    int64_t ks = bf == 2 ? (k + 1) / 2 : k;        /* k-steps of the tile: pairs with dp */
    int64_t cols = epi == EPI_GLU ? GEMM_VW : GEMM_NR;   /* output columns per panel */
    if (epi == EPI_GLU) n /= 2;
    int64_t panels = (n + cols - 1) / cols;
    int64_t pstride = ks * GEMM_NR * (bf == 2 ? 4 : esize);     /* bytes per panel */
    int64_t lines = pstride / 64;                                /* 64-byte lines per panel */
    int64_t block = (1 << 20) / (4 * k) / GEMM_MR * GEMM_MR;     /* rows of x per ~1 MiB */
    if (block < GEMM_MR) block = GEMM_MR;
    /* x in tiles [K][rows] (fp32): the micro-kernel's row values for one k-step are
     * adjacent */
    float *xp = aligned_alloc(64, (size_t)((block * k * 4 + 63) / 64 * 64));
    panel_claim_t *claims = aligned_alloc(64, sizeof(panel_claim_t) * (size_t)num_threads);
    if (!xp || !claims) {
        free(xp);
        free(claims);
        return -1;
    }
#pragma omp parallel num_threads(num_threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t i0 = 0; i0 < m; i0 += block) {
            /* (every thread passed the last block's barrier: no claim on it is pending) */
            atomic_store_explicit(&claims[t].next, panels * t / nt, memory_order_relaxed);
            int64_t i1 = i0 + block < m ? i0 + block : m;
            /* equal tiles: 64 rows are 13+13+13+13+12, not 14+14+14+14+8 */
            int64_t tiles = (i1 - i0 + GEMM_MR - 1) / GEMM_MR;
            int64_t rows = (i1 - i0 + tiles - 1) / tiles;
            int64_t share = (lines + tiles - 1) / tiles;          /* lines to fetch per tile */
            int64_t per = (share + ks - 1) / ks, every = ks * per / share;
#pragma omp for schedule(static)
            for (int64_t tile = 0; tile < tiles; tile++) {
                int64_t i = i0 + tile * rows, mr = i1 - i < rows ? i1 - i : rows;
                float *dst = xp + tile * rows * k;
                const char *x0 = (const char *)x + i * ldx * esize;
                if (bf == 2) {              /* [k-pairs][rows], two bf16 values in 32 bits */
                    copy_tile(x0, ldx * 2, (int)mr, k / 2, 0, dst);
                    if (k % 2)              /* the last pair: x[k - 1] and a zero */
                        for (int64_t r = 0; r < mr; r++)
                            ((uint32_t *)dst)[(k / 2) * mr + r] =
                                ((const uint16_t *)x0)[r * ldx + k - 1];
                } else {
                    copy_tile(x0, ldx * esize, (int)mr, k, bf, dst);
                }
            }                                        /* (the loop ends with a barrier) */
            for (int run = 0;;) {
                int64_t p, p1;
                if (!claim_panel(claims, t, nt, panels, &run, &p, &p1)) break;
                const char *panel = (const char *)packed + p * pstride;
                const char *next = p + 1 < p1 ? panel + pstride : panel;
                int64_t ncols = n - p * cols < cols ? n - p * cols : cols;
                vmask_t m0 = lanes(ncols), m1 = lanes(ncols - GEMM_VW);
                if (epi == EPI_GLU) m1 = m0;
                const float *b = bias ? bias + p * GEMM_NR : NULL;
                for (int64_t i = i0, tile = 0; i < i1; i += rows, tile++) {
                    int mr = (int)(i1 - i < rows ? i1 - i : rows);
                    int64_t first = tile * share;
                    int64_t nl = lines - first < share ? lines - first : share;
                    char *yt = (char *)y + (i * ldy + p * cols) * esize;
                    gemm_tile(mr, xp + (i - i0) * k, panel, ks, b, m0, m1, ncols, yt, ldy,
                              next + first * 64, every, per, nl, epi, bf);
                }
            }
#pragma omp barrier                           /* xp is refilled for the next row block */
        }
    }
    free(xp);
    free(claims);
    return 0;
}

int linear_packed(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed,
                  int64_t n, const float *bias, float *y, int64_t ldy, int epi,
                  int num_threads) {
    return gemm(x, m, k, ldx, packed, n, bias, y, ldy, epi, 0, num_threads);
}

/* The same product for a bf16 model on a CPU that has no bf16 GEMM of its own (AVX2):
 * bf16 weights (half the bytes of fp32 from memory each step), fp32 sums. The bias is
 * passed widened to fp32 (exact). */
int linear_packed_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t ldx,
                       const uint16_t *packed, int64_t n, const float *bias, uint16_t *y,
                       int64_t ldy, int epi, int num_threads) {
    return gemm(x, m, k, ldx, packed, n, bias, y, ldy, epi, 1, num_threads);
}
#else
int linear_packed_available(void) { return 0; }
int64_t gemm_panels_taken_over(void) { return 0; }
int linear_packed_nr(void) { return 0; }
void pack_linear_weight(const float *w, int64_t n, int64_t k, int glu, float *out,
                        int num_threads) {}
void pack_linear_weight_bf16(const uint16_t *w, int64_t n, int64_t k, int glu, uint16_t *out,
                             int num_threads) {}
int linear_packed_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t ldx,
                       const uint16_t *packed, int64_t n, const float *bias, uint16_t *y,
                       int64_t ldy, int epi, int num_threads) { return -1; }
int linear_packed(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed,
                  int64_t n, const float *bias, float *y, int64_t ldy, int epi,
                  int num_threads) { return -1; }
#endif

/* The same bf16 product with bf16 arithmetic where the CPU has it (AVX-512 bf16: AMD Zen 4
 * and Zen 5, Intel from Cooper Lake): one vdpbf16ps multiplies two k-steps, products exact
 * and sums in fp32. The weight is packed in panels [ceil(K/2)][NR][2]: the two weights of a
 * k-pair side by side, as vdpbf16ps multiplies them with a row's two values (K odd: a zero
 * after the last). */
int linear_packed_dp_available(void) {
#ifdef GEMM_DP
    return 1;
#else
    return 0;
#endif
}

void pack_linear_weight_dp(const uint16_t *w, int64_t n, int64_t k, int glu, uint16_t *out,
                           int num_threads) {
#ifdef GEMM_DP
    pack_panels((const char *)w, n, k, glu, (char *)out, 2, 1, num_threads);
#endif
}

int linear_packed_dp(const uint16_t *x, int64_t m, int64_t k, int64_t ldx,
                     const uint16_t *packed, int64_t n, const float *bias, uint16_t *y,
                     int64_t ldy, int epi, int num_threads) {
#ifdef GEMM_DP
    return gemm(x, m, k, ldx, packed, n, bias, y, ldy, epi, 2, num_threads);
#else
    return -1;
#endif
}

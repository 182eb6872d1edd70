/* A decode step's attention over the ring of layer inputs, keys and values absorbed (kernels/ops.cpp calls it for
   a batch's one-token steps where that reads fewer bytes; model/fused.py says when).

   Transformer-XL's keys and values are linear in the layer's input (k_j = W_k h_j, v_j = W_v h_j, no bias, no
   norm between where pre_lnorm is off), and the ring of inputs h (the paper's mems) sits beside the rings of
   keys and values. So head h's attention over the ring is

     score(j) = qt_h . h_j + bd_h[dist(j)],      qt_h = W_k,h^T (q_h + u) scale   (the caller's product)
     ctx_h    = sum_j p_j h_j,                   its output W_v,h ctx_h + p_self v_self  (the caller's product)

   with p the softmax over the ring's window and the token itself (score s_self). The pass reads each slot's
   d_model floats once for every head, half the bytes of its key and value; it does H times the multiply-adds
   of the two passes over keys and values. Where a batch's rings come from DRAM the bytes cost more than the
   arithmetic of a few heads; where they sit in the last-level cache (a small batch, a short ring) the keys' and
   values' kernel (kernels/attend_one.c) is the faster (BENCHMARKS.md, "Keys and values absorbed, built").

   Row b's token is at position seen[b]; slot j of its ring holds position last - back(j), back(j) = (top - j)
   mod M (top = last % M, last = seen[b] - 1); it sees every stored slot (back(j) <= last), at distance back(j) +
   1. One pass over the slots in tiles of TILE rows: each tile's scores for every head, an online softmax (the
   running maximum starts at the token's own score), and the tile's rows weighted into ctx while they are in L1.
   A call handles rows [b0, b1), so the op splits a batch across threads; each row's result is the same bits
   whichever thread computes it. Float32; d_model a multiple of 64 (ops.cpp checks). */
#include <stdint.h>

#include "vec.h"

enum { TILE = 64, ABSORB_MAX_HEADS = 4 };  /* ops.cpp absorbs only models of at most this many heads */

static inline float hsum(v16 v)
{
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* s[h * TILE + r + k] += the sum of acc[h][k]'s lanes, all sixteen at once (vec.h: a tenth faster from cache than
   sixteen reductions one by one, BENCHMARKS.md); heads from H on are zeros */
static inline __attribute__((always_inline)) void add_sums(const int H, float *restrict s, int64_t r,
                                                           const v16 acc[ABSORB_MAX_HEADS][4])
{
    v16 a[16];
    for (int h = 0; h < ABSORB_MAX_HEADS; h++)
        for (int k = 0; k < 4; k++) a[4 * h + k] = h < H ? acc[h][k] : (v16){0.f};
    const v16 f = sums16(a);
    for (int h = 0; h < H; h++)  /* lane 4h + k: acc[h][k]'s sum */
        for (int k = 0; k < 4; k++) s[h * TILE + r + k] += f[4 * h + k];
}

/* The next rows' prefetch: two lines, then the cursor moves on (to `end`). One call in each of the scores' and the
   values' inner iterations, (n/4)(dm/16) + (dm/64)n of them a tile: the next tile's n dm / 16 lines, spread evenly
   over the whole tile's work, so that DRAM is kept busy during the scores too. Over the values' pass alone, a
   batch-16 step's rings were read 6-12% slower; every other or every fourth line alone (leaving the rest to the
   hardware), slower still; into L1 or L2, the same (BENCHMARKS.md). L2 leaves L1 to the tile being read. */
static inline __attribute__((always_inline)) void prefetch_step(const float **pf, const float *end)
{
    if (*pf < end) {
        __builtin_prefetch(*pf, 0, 2);
        __builtin_prefetch(*pf + 16, 0, 2);
        *pf += 32;
    }
}

/* s[h * TILE + r] += qt_h . x_r for the tile's rows r < n (x: n rows of dm, contiguous) */
static inline __attribute__((always_inline)) void scores(const int H, float *restrict s, const float *restrict qt,
                                                         int64_t q_sh, const float *restrict x, int64_t dm,
                                                         int64_t n, const float **pf, const float *end)
{
    int64_t r = 0;
    for (; r + 4 <= n; r += 4) {
        v16 acc[ABSORB_MAX_HEADS][4];
        for (int h = 0; h < H; h++)
            for (int k = 0; k < 4; k++) acc[h][k] = (v16){0.f};
        for (int64_t d = 0; d < dm; d += 16) {
            prefetch_step(pf, end);
            v16 xr[4];  /* four rows' floats, loaded once for every head */
            for (int k = 0; k < 4; k++) {
                xr[k] = *(const v16 *)(x + (r + k) * dm + d);
                REGISTER(xr[k]);
            }
            for (int h = 0; h < H; h++) {
                const v16 q = *(const v16 *)(qt + h * q_sh + d);
                for (int k = 0; k < 4; k++) acc[h][k] += q * xr[k];
            }
        }
        add_sums(H, s, r, (const v16(*)[4])acc);
    }
    for (; r < n; r++) {
        v16 acc[ABSORB_MAX_HEADS];
        for (int h = 0; h < H; h++) acc[h] = (v16){0.f};
        for (int64_t d = 0; d < dm; d += 16) {
            const v16 xr = *(const v16 *)(x + r * dm + d);
            for (int h = 0; h < H; h++) acc[h] += *(const v16 *)(qt + h * q_sh + d) * xr;
        }
        for (int h = 0; h < H; h++) s[h * TILE + r] += hsum(acc[h]);
    }
}

/* ctx_h += sum_r p[h * TILE + r] x_r, 64 floats of d_model at a time held in registers for every head, while the
   next rows are prefetched (a burst of a tile's rows instead ran a batch-16 step 25% slower) */
static inline __attribute__((always_inline)) void values(const int H, float *restrict ctx, int64_t c_sh,
                                                         const float *restrict p, const float *restrict x,
                                                         int64_t dm, int64_t n, const float **pf, const float *end)
{
    enum { W = 4 };  /* d_model is a multiple of 64 */
    for (int64_t d = 0; d < dm; d += 64) {
        v16 acc[ABSORB_MAX_HEADS][W];
        for (int h = 0; h < H; h++)
            for (int w = 0; w < W; w++) acc[h][w] = *(const v16 *)(ctx + h * c_sh + d + 16 * w);
        for (int64_t r = 0; r < n; r++) {
            prefetch_step(pf, end);
            v16 xr[4];
            for (int w = 0; w < W; w++) {
                xr[w] = *(const v16 *)(x + r * dm + d + 16 * w);
                REGISTER(xr[w]);
            }
            for (int h = 0; h < H; h++) {
                const float ph = p[h * TILE + r];
                for (int w = 0; w < W; w++) acc[h][w] += ph * xr[w];
            }
        }
        for (int h = 0; h < H; h++)
            for (int w = 0; w < W; w++) *(v16 *)(ctx + h * c_sh + d + 16 * w) = acc[h][w];
    }
}

/* One row's pass over the slots [j0, j1) of its ring, where slot j is at distance dist0 - j; during its last tile
   the rows at `after` (n_after of them: the next pass's first) are prefetched */
static inline __attribute__((always_inline)) void run(const int H, const float *ring, int64_t j0, int64_t j1,
                                                      int64_t dist0, const float *qt, int64_t q_sh, const float *bd,
                                                      int64_t bd_sh, int64_t dm, float *ctx, int64_t c_sh,
                                                      float *m, float *z, float *self_w, const float *after,
                                                      int64_t n_after)
{
    float s[ABSORB_MAX_HEADS * TILE];
    for (int64_t t0 = j0; t0 < j1; t0 += TILE) {
        const int64_t n = j1 - t0 < TILE ? j1 - t0 : TILE;
        const int64_t nn = j1 - t0 - n < TILE ? j1 - t0 - n : TILE;  /* the next tile's rows */
        const float *x = ring + t0 * dm;
        const float *pf = nn > 0 ? ring + (t0 + n) * dm : after != NULL ? after : x;  /* the next rows, if any */
        const float *end = pf == x ? x : pf + (nn > 0 ? nn : n_after) * dm;
        for (int h = 0; h < H; h++)
            for (int64_t r = 0; r < n; r++) s[h * TILE + r] = bd[h * bd_sh + dist0 - t0 - r];
        scores(H, s, qt, q_sh, x, dm, n, &pf, end);
        for (int h = 0; h < H; h++) {  /* the online softmax: rescale what came before when the maximum rises */
            float *sh = s + h * TILE, mx = m[h];
            for (int64_t r = 0; r < n; r++) mx = sh[r] > mx ? sh[r] : mx;
            if (mx > m[h]) {
                const float c = exp_neg(m[h] - mx);
                for (int64_t d = 0; d < dm; d++) ctx[h * c_sh + d] *= c;
                z[h] *= c;
                self_w[h] *= c;
                m[h] = mx;
            }
            float sum = 0.f;
            for (int64_t r = 0; r < n; r++) {
                sh[r] = exp_neg(sh[r] - mx);
                sum += sh[r];
            }
            z[h] += sum;
        }
        values(H, ctx, c_sh, s, x, dm, n, &pf, end);
    }
}

/* Row b's attention */
static inline __attribute__((always_inline)) void attend_row(const int H, int64_t M, int64_t dm, const float *ring,
                                                             int64_t seen, const float *qt, int64_t q_sh,
                                                             const float *bd, int64_t bd_sh, const float *s_self,
                                                             float *ctx, int64_t c_sh, float *p_self)
{
    float m[ABSORB_MAX_HEADS], z[ABSORB_MAX_HEADS], self_w[ABSORB_MAX_HEADS];
    for (int h = 0; h < H; h++) {
        m[h] = s_self[h];  /* itself: weight e^0 against the running maximum */
        z[h] = 1.f;
        self_w[h] = 1.f;
        for (int64_t d = 0; d < dm; d++) ctx[h * c_sh + d] = 0.f;
    }
    const int64_t last = seen - 1;
    if (last >= 0) {
        const int64_t top = last % M;
        const int wraps = last >= M;  /* slots above top hold the older tokens, back = top - j + M */
        run(H, ring, 0, top + 1, top + 1, qt, q_sh, bd, bd_sh, dm, ctx, c_sh, m, z, self_w,
            wraps ? ring + (top + 1) * dm : NULL, wraps ? (M - top - 1 < TILE ? M - top - 1 : TILE) : 0);
        if (wraps)
            run(H, ring, top + 1, M, top + M + 1, qt, q_sh, bd, bd_sh, dm, ctx, c_sh, m, z, self_w, NULL, 0);
    }
    for (int h = 0; h < H; h++) {
        const float inv = 1.f / z[h];
        for (int64_t d = 0; d < dm; d++) ctx[h * c_sh + d] *= inv;
        p_self[h] = self_w[h] * inv;
    }
}

/* Rows b in [b0, b1): qt [B, H, dm] at qt + b q_sb + h q_sh (d contiguous); bd [H, B, M+1] at bd + h bd_sh +
   b bd_sb (distance contiguous); s_self [B, H] contiguous; ring b [M, dm] row-major at rings[b]; out ctx [B, H,
   dm] at ctx + b c_sb + h c_sh, p_self [B, H] contiguous. Returns -2 for more heads than ABSORB_MAX_HEADS or a
   d_model not a multiple of 64 (ops.cpp checks both first). */
int txl_attend_absorbed(int64_t b0, int64_t b1, int64_t H, int64_t M, int64_t dm, const float *qt, int64_t q_sb,
                        int64_t q_sh, const float *bd, int64_t bd_sb, int64_t bd_sh, const float *s_self,
                        const float *const *rings, const int64_t *seen, float *ctx, int64_t c_sb, int64_t c_sh,
                        float *p_self)
{
    if (H < 1 || H > ABSORB_MAX_HEADS || dm % 64 != 0) return -2;
    for (int64_t b = b0; b < b1; b++) {
        const float *q = qt + b * q_sb, *bdb = bd + b * bd_sb, *ss = s_self + b * H;
        float *c = ctx + b * c_sb, *ps = p_self + b * H;
        switch (H) {  /* a copy for each head count, so that a tile's accumulators are registers */
        case 1: attend_row(1, M, dm, rings[b], seen[b], q, q_sh, bdb, bd_sh, ss, c, c_sh, ps); break;
        case 2: attend_row(2, M, dm, rings[b], seen[b], q, q_sh, bdb, bd_sh, ss, c, c_sh, ps); break;
        case 3: attend_row(3, M, dm, rings[b], seen[b], q, q_sh, bdb, bd_sh, ss, c, c_sh, ps); break;
        default: attend_row(4, M, dm, rings[b], seen[b], q, q_sh, bdb, bd_sh, ss, c, c_sh, ps); break;
        }
    }
    return 0;
}

/* Loops shared by the kernels (kernels/attend_one.c, chunk_softmax.c, linear_rows.c, sample_rows.c), written so
   that gcc vectorises them (-O3 -ffast-math, model/fused.py). */
#ifndef TXL_VEC_H
#define TXL_VEC_H

#include <stddef.h>
#include <stdint.h>

/* Software prefetch of [p, p + len) into L2 (NULL: nothing). Inlined early on purpose: gcc otherwise finds
   the function free of side effects and deletes the calls (it did, silently, until 2026-11-24). */
__attribute__((always_inline)) static inline void prefetch_run(const float *p, int64_t len)
{
    if (p == NULL) return;
    for (int64_t i = 0; i < len; i += 16) __builtin_prefetch(p + i, 0, 1);  /* t2: L2; t0 measured 1.6x slower */
}

/* y[j] += c0 w0[j] + c1 w1[j] + c2 w2[j] + c3 w3[j]: y is read and written once per four rows */
static inline void axpy4(float *restrict y, const float *restrict w0, const float *restrict w1,
                         const float *restrict w2, const float *restrict w3,
                         float c0, float c1, float c2, float c3, int64_t len)
{
    for (int64_t j = 0; j < len; j++) y[j] += c0 * w0[j] + c1 * w1[j] + c2 * w2[j] + c3 * w3[j];
}

/* Sixteen floats: gcc lowers it to what the target has (one AVX-512 register, two AVX2 ones, four NEON ones).
   may_alias and aligned(4): loaded from and stored to any float array. */
typedef float v16 __attribute__((vector_size(64), aligned(4), may_alias));

/* Keeps a loaded vector in a register: gcc otherwise folds the load into each multiply-add that uses it, and a
   block's four rows then load every weight vector four times (a 16-row step's products were load-bound: 12 x 512
   20.4 -> 13.2 ms with this, 6 x 256 2.2 -> 1.0 ms, the same bits). An empty asm that "changes" v, on x86 with
   AVX-512 (where v16 is one register); elsewhere nothing. Only for a vector used more than once: the barrier also
   keeps gcc from scheduling the loads, and a one-row block (a batch-1 step) was 5-10% slower with it. */
#if defined(__x86_64__) && defined(__AVX512F__)
#define REGISTER(v) __asm__("" : "+v"(v))
#else
#define REGISTER(v) ((void)0)
#endif

#if defined(__has_builtin) && !defined(TXL_SUMS_ONE_BY_ONE)  /* (the second: to build and test the other) */
#if __has_builtin(__builtin_shufflevector)
#define TXL_SUMS_TREE 1
#endif
#endif

/* Lane j of the result: the sum of a[j]'s sixteen lanes, for sixteen vectors at once (a register tile's sums:
   4 rows x 4 heads or outputs). Four rounds, each adding the halves of pairs of vectors into one (16 -> 8 -> 4 ->
   2 -> 1 vectors): 15 shuffle pairs and adds, where sixteen reductions one by one took 4 rounds each. A vector's
   lanes are added in the same order whatever is reduced beside it (zeros for a smaller tile), so a tile of any
   shape gives the same bits. Without the builtin, the lanes are added in order, out of line for the same reason. */
#ifdef TXL_SUMS_TREE
static inline __attribute__((always_inline)) v16 sums16(const v16 a[16])
{
    v16 b[8], c[4], e[2];
    for (int i = 0; i < 8; i++)  /* lanes 0-7: a[i]'s 8 partial sums, 8-15: a[i + 8]'s */
        b[i] = __builtin_shufflevector(a[i], a[i + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(a[i], a[i + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)  /* lanes 4j-4j+3: a[i + 4j]'s 4 */
        c[i] = __builtin_shufflevector(b[i], b[i + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
               __builtin_shufflevector(b[i], b[i + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)  /* lanes 2j, 2j+1: a[i + 2j]'s 2 */
        e[i] = __builtin_shufflevector(c[i], c[i + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
               __builtin_shufflevector(c[i], c[i + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    return __builtin_shufflevector(e[0], e[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           __builtin_shufflevector(e[0], e[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
#else
static __attribute__((noinline, unused)) v16 sums16(const v16 a[16])
{
    v16 f;
    for (int j = 0; j < 16; j++) {
        float s = 0.f;
        for (int i = 0; i < 16; i++) s += a[j][i];
        f[j] = s;
    }
    return f;
}
#endif

/* Y[r][j] = init[j] + sum_d A[r][d] X[d][j] (init NULL: 0) for rows r < R of A (R <= 4, rows lda apart) and
   columns [j0, j0 + 16 W) of X (W <= 8; rows ldx apart, unit stride along j): R x W sums of 16 held in registers
   while X's D rows stream past once (a product's inputs against a column-major weight, queries against a ring's
   keys). Each output is one chain of multiply-adds in the order of d, whatever R and W: any grouping of rows
   and columns (threads split them differently) gives the same bits. */
static inline __attribute__((always_inline)) void cols_block(int R, int W, float *restrict Y, int64_t ldy,
                                                             const float *restrict X, int64_t ldx,
                                                             const float *restrict A, int64_t lda, int64_t D,
                                                             int64_t j0, const float *restrict init)
{
    v16 acc[4][8];
    for (int r = 0; r < R; r++)
        for (int w = 0; w < W; w++) acc[r][w] = init == NULL ? (v16){0.f} : *(const v16 *)(init + j0 + 16 * w);
    const float *x = X + j0;
    for (int64_t d = 0; d < D; d++, x += ldx) {
        v16 xd[8];  /* loaded once, used by every row */
        for (int w = 0; w < W; w++) {
            xd[w] = *(const v16 *)(x + 16 * w);
            if (R > 1) REGISTER(xd[w]);
        }
        for (int r = 0; r < R; r++) {
            const float a = A[r * lda + d];
            for (int w = 0; w < W; w++) acc[r][w] += a * xd[w];
        }
    }
    for (int r = 0; r < R; r++)
        for (int w = 0; w < W; w++) *(v16 *)(Y + r * ldy + j0 + 16 * w) = acc[r][w];
}

/* e^x for x <= 0 (a score minus the maximum), to about 2 ulp: Cephes' expf, written so that a loop of it
   vectorises (libm's expf is a call per element: a third of kernels/attend_one.c's arithmetic at mem_len 512) */
static inline float exp_neg(float x)
{
    x = x < -87.3f ? -87.3f : x;                        /* e^-87.3 is the smallest normal float's order */
    const float n = __builtin_floorf(x * 1.44269504f + 0.5f);  /* x = n ln2 + r, |r| <= ln2 / 2 */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    union { int32_t i; float f; } two_n = { .i = ((int32_t)n + 127) << 23 };
    return p * two_n.f;
}

#endif

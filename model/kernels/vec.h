/* Loops shared by the kernels (kernels/attend_one.c, kernels/linear_rows.c), written so that gcc vectorises
   them (-O3 -ffast-math, model/fused.py). Four rows a pass: the row they share is read once per four. */
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

/* a[r] += p . v_r for four rows v_r: four sums in flight, p read once */
static inline void dots4(float a[4], const float *restrict p, const float *restrict v0,
                         const float *restrict v1, const float *restrict v2, const float *restrict v3, int64_t len)
{
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    for (int64_t j = 0; j < len; j++) {
        a0 += p[j] * v0[j];
        a1 += p[j] * v1[j];
        a2 += p[j] * v2[j];
        a3 += p[j] * v3[j];
    }
    a[0] += a0, a[1] += a1, a[2] += a2, a[3] += a3;
}

#endif

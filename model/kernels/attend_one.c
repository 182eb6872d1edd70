/* One decode step's attention for a batch of Transformer-XL sessions, fused (model/fused.py builds it;
   kernels/ops.cpp checks its tensors and calls it).

   For each row b and head h, the query of the token at position seen[b] attends to itself and to the ring's
   M slots (slot j holds position last - back(j), back(j) = (last - j) mod M, where last = seen[b] - 1; a slot
   with back(j) > last is still empty):

     score(j) = ((q + u) . k_j + (q + v) . (W_r R)[dist(j)]) * scale,   dist(j) = back(j) + 1, dist(self) = 0
     out      = softmax(score) @ [V_ring; v_self]

   then the token's key and value are stored into slot seen[b] % M. A call handles the rows h*B + b in
   [begin, end), so the op can split a batch's rows across threads. Float32 only; every tensor is passed as a
   pointer with its element strides, so column-major rings (model/cache.py) stream contiguous rows. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

enum { MAX_D_HEAD = 1024 };  /* ops.cpp refuses larger heads */

/* e^x for x <= 0 (a score minus the maximum), to about 2 ulp: Cephes' expf, written so that a loop of it
   vectorises (libm's expf is a call per element, a third of this kernel's arithmetic at mem_len 512) */
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

/* Software prefetch. A row's keys are read as 4-row blocks of 2 KB runs (mem_len 512): too short for the
   hardware prefetchers, which left a batch-16 step reading its rings at half this core's bandwidth. Each pass
   of CHUNK slots over four rows reads CHUNK/4 lines and asks for the CHUNK/4 lines AHEAD floats further along
   the row's stream: its K^T, then its V^T, then the next row's K^T (the position table has a stream of its
   own). 25 -> 13 us a row for batch 16 at mem_len 512, 55 -> 40 at 1600 (BENCHMARKS.md). */
enum { AHEAD = 8192, CHUNK = 64 };  /* 32 KB ahead: 16-64 KB measured alike, 4 KB a third slower */

/* Where the stream of regions r[0], r[1], r[2] (n floats each; NULL: none) is ``at + AHEAD`` floats in. */
static inline const float *ahead(const float *const r[3], int64_t n, int64_t at)
{
    at += AHEAD;
    for (int i = 0; i < 3; i++, at -= n)
        if (at < n) return r[i] == NULL ? NULL : r[i] + at;
    return NULL;
}

int txl_attend_one(int64_t begin, int64_t end,                      /* rows h*B + b of this call */
                   int64_t B, int64_t H, int64_t D, int64_t M,
                   const float *qkv, int64_t qkv_sb,                   /* [B, 3*H*D]: the token's q, k, v */
                   const float *u, const float *vb,                     /* [H, D] each: r_w_bias, r_r_bias */
                   float *kr, float *vr,                                /* rings [B, H, M, D], these strides: */
                   int64_t r_sb, int64_t r_sh, int64_t r_sj, int64_t r_sd,
                   const float *tab,                                    /* W_r R [H, M+1, D], these strides: */
                   int64_t t_sh, int64_t t_sj, int64_t t_sd,
                   const int64_t *seen, float scale,
                   float *out)                                          /* [B, H*D] */
{
    float *s = malloc(2 * (size_t)(M + 1) * sizeof(float)), *bd = s + (M + 1);  /* scores; position terms */
    if (s == NULL) return -1;
    float qu[MAX_D_HEAD], qv[MAX_D_HEAD];
    for (int64_t row = begin; row < end; row++) {
        const int64_t h = row / B, b = row % B;  /* head-major: a thread's rows share a position table */
        if (seen[b] < 0) continue;  /* never the case; a negative slot would write before the ring */
        const int64_t last = seen[b] - 1, slot = seen[b] % M;
        const int64_t top = last < 0 ? -1 : last % M;  /* the slot of the newest stored token */
        const float *q = qkv + b * qkv_sb + h * D, *kn = q + H * D, *vn = q + 2 * H * D;
        float *K = kr + b * r_sb + h * r_sh, *V = vr + b * r_sb + h * r_sh;
        const float *T = tab + h * t_sh;
        /* the prefetched streams, where the rings and table are column-major (model/cache.py): a row's K^T and
           V^T, then the next row's K^T; its position table (read from memory once a head, then from L2) */
        const int64_t n = r_sj == 1 && r_sd == M ? D * M : 0, n_tab = t_sj == 1 && t_sd == M + 1 ? D * (M + 1) : 0;
        const float *stream[3] = {K, V, row + 1 < end ? kr + ((row + 1) % B) * r_sb + ((row + 1) / B) * r_sh : NULL};
        const float *tab_stream[3] = {T, NULL, NULL};
        for (int64_t d = 0; d < D; d++) {
            qu[d] = q[d] + u[h * D + d];
            qv[d] = q[d] + vb[h * D + d];
        }
        for (int64_t j = 0; j <= M; j++) s[j] = bd[j] = 0.f;
        int64_t d = 0;  /* a . k_j for every slot: rows of K^T, contiguous when column-major (model/cache.py) */
        if (r_sj == 1 && t_sj == 1)  /* four rows a pass: s and bd are read and written a quarter as often */
            for (; d + 4 <= D; d += 4) {
                const float *k0 = K + d * r_sd, *k1 = k0 + r_sd, *k2 = k1 + r_sd, *k3 = k2 + r_sd;
                const float *r0 = T + d * t_sd, *r1 = r0 + t_sd, *r2 = r1 + t_sd, *r3 = r2 + t_sd;  /* W_r R rows */
                const float a0 = qu[d], a1 = qu[d + 1], a2 = qu[d + 2], a3 = qu[d + 3];
                const float c0 = qv[d], c1 = qv[d + 1], c2 = qv[d + 2], c3 = qv[d + 3];
                int64_t j0 = 0;
                for (; j0 + CHUNK <= M; j0 += CHUNK) {
                    if (n) prefetch_run(ahead(stream, n, d * M + 4 * j0), 4 * CHUNK);
                    axpy4(s + j0, k0 + j0, k1 + j0, k2 + j0, k3 + j0, a0, a1, a2, a3, CHUNK);
                }
                axpy4(s + j0, k0 + j0, k1 + j0, k2 + j0, k3 + j0, a0, a1, a2, a3, M - j0);
                int64_t t0 = 0;
                for (; t0 + CHUNK <= M + 1; t0 += CHUNK) {
                    if (n_tab) prefetch_run(ahead(tab_stream, n_tab, d * (M + 1) + 4 * t0), 4 * CHUNK);
                    axpy4(bd + t0, r0 + t0, r1 + t0, r2 + t0, r3 + t0, c0, c1, c2, c3, CHUNK);
                }
                axpy4(bd + t0, r0 + t0, r1 + t0, r2 + t0, r3 + t0, c0, c1, c2, c3, M + 1 - t0);
            }
        for (; d < D; d++) {
            const float *kd = K + d * r_sd, *td = T + d * t_sd;
            const float a = qu[d], c = qv[d];
            for (int64_t j = 0; j < M; j++) s[j] += a * kd[j * r_sj];
            for (int64_t t = 0; t <= M; t++) bd[t] += c * td[t * t_sj];
        }
        float self = 0.f;
        for (d = 0; d < D; d++) self += qu[d] * kn[d];
        self = (self + bd[0]) * scale;
        /* slot j holds the token top - j steps before the newest for j <= top, and (once the ring has wrapped)
           top - j + M for j > top; before it has wrapped, the top + 1 slots from 0 are all there is */
        const int64_t filled = seen[b] >= M ? M : top + 1;
        for (int64_t j = 0; j <= top; j++) s[j] = (s[j] + bd[top - j + 1]) * scale;
        for (int64_t j = top + 1; j < filled; j++) s[j] = (s[j] + bd[top - j + M + 1]) * scale;
        float mx = self, sum = 0.f;
        for (int64_t j = 0; j < filled; j++) mx = s[j] > mx ? s[j] : mx;
        const float p_self = exp_neg(self - mx);
        for (int64_t j = 0; j < filled; j++) {
            s[j] = exp_neg(s[j] - mx);
            sum += s[j];
        }
        for (int64_t j = filled; j < M; j++) s[j] = 0.f;
        sum += p_self;
        const float inv = 1.f / sum;
        float *o = out + b * H * D + h * D;
        d = 0;
        if (r_sj == 1)  /* four value rows a pass over the probabilities */
            for (; d + 4 <= D; d += 4) {
                const float *v0 = V + d * r_sd, *v1 = v0 + r_sd, *v2 = v1 + r_sd, *v3 = v2 + r_sd;
                float a[4] = {0.f, 0.f, 0.f, 0.f};
                int64_t j0 = 0;
                for (; j0 + CHUNK <= M; j0 += CHUNK) {
                    if (n) prefetch_run(ahead(stream, n, n + d * M + 4 * j0), 4 * CHUNK);
                    dots4(a, s + j0, v0 + j0, v1 + j0, v2 + j0, v3 + j0, CHUNK);
                }
                dots4(a, s + j0, v0 + j0, v1 + j0, v2 + j0, v3 + j0, M - j0);
                const float a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
                o[d] = (a0 + p_self * vn[d]) * inv;
                o[d + 1] = (a1 + p_self * vn[d + 1]) * inv;
                o[d + 2] = (a2 + p_self * vn[d + 2]) * inv;
                o[d + 3] = (a3 + p_self * vn[d + 3]) * inv;
            }
        for (; d < D; d++) {
            const float *vd = V + d * r_sd;
            float a = 0.f;
            for (int64_t j = 0; j < M; j++) a += s[j] * vd[j * r_sj];
            o[d] = (a + p_self * vn[d]) * inv;
        }
        for (d = 0; d < D; d++) {
            K[slot * r_sj + d * r_sd] = kn[d];
            V[slot * r_sj + d * r_sd] = vn[d];
        }
    }
    free(s);
    return 0;
}

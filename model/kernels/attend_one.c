/* A decode call's attention for a batch of Transformer-XL sessions, fused (model/fused.py builds it;
   kernels/ops.cpp checks its tensors and calls it): L <= MAX_CHUNK new tokens per session (a decode step's
   one, a short prompt's few).

   For each row b and head h, the query of the chunk's token i (position seen[b] + i) attends to itself, to
   the chunk's earlier tokens i' < i, and to the ring slots still within its window: slot j holds position
   last - back(j), back(j) = (last - j) mod M, where last = seen[b] - 1; a slot with back(j) > last is still
   empty, and one with back(j) > M - 1 - i is more than M tokens before token i:

     score(j) = ((q + u) . k_j + (q + v) . (W_r R)[dist(j)]) * scale,   dist = back(j) + 1 + i (ring),
                                                                         i - i' (chunk), 0 (itself)
     out      = softmax(score) @ [V_ring; v_chunk]

   then the chunk's last min(L, M) keys and values are stored into slots (seen[b] + i) % M. Every query reads
   the ring in the same pass, so a short prompt costs one pass, as a decode step does. A call handles the rows
   h*B + b in [begin, end), so the op can split a batch's rows across threads. Float32 only; every tensor is
   passed as a pointer with its element strides, so column-major rings (model/cache.py) stream contiguous
   rows. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

enum { MAX_D_HEAD = 1024, MAX_CHUNK = 8 };  /* ops.cpp refuses larger heads and chunks */

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
                   int64_t B, int64_t H, int64_t D, int64_t M, int64_t L,
                   const float *qkv, int64_t qkv_sb, int64_t qkv_sl,   /* [B, L, 3*H*D]: the tokens' q, k, v */
                   const float *u, const float *vb,                     /* [H, D] each: r_w_bias, r_r_bias */
                   float *kr, float *vr,                                /* rings [B, H, M, D], these strides: */
                   int64_t r_sb, int64_t r_sh, int64_t r_sj, int64_t r_sd,
                   const float *tab,                                    /* W_r R [H, M+1, D], these strides: */
                   int64_t t_sh, int64_t t_sj, int64_t t_sd,
                   const int64_t *seen, float scale,
                   float *out)                                          /* [B, L, H*D] */
{
    if (L < 1 || L > MAX_CHUNK) return -2;
    /* per query: scores of the ring's slots, position terms for distances 0..M, (q + u) and (q + v) */
    const size_t n = (size_t)L * (2 * (size_t)(M + 1) + 2 * (size_t)D);
    float *s = malloc(n * sizeof(float));
    if (s == NULL) return -1;
    float *bd = s + L * (M + 1), *qu = bd + L * (M + 1), *qv = qu + L * D;
    for (int64_t row = begin; row < end; row++) {
        const int64_t h = row / B, b = row % B;  /* head-major: a thread's rows share a position table */
        if (seen[b] < 0) continue;  /* never the case; a negative slot would write before the ring */
        const int64_t last = seen[b] - 1;
        const int64_t top = last < 0 ? -1 : last % M;  /* the slot of the newest stored token */
        const float *q0 = qkv + b * qkv_sb + h * D;  /* token i's q at q0 + i qkv_sl; its k, v H*D and 2H*D on */
        float *K = kr + b * r_sb + h * r_sh, *V = vr + b * r_sb + h * r_sh;
        const float *T = tab + h * t_sh;
        /* the prefetched streams, where the rings and table are column-major (model/cache.py): a row's K^T and
           V^T, then the next row's K^T; its position table (read from memory once a head, then from L2) */
        const int64_t nk = r_sj == 1 && r_sd == M ? D * M : 0, n_tab = t_sj == 1 && t_sd == M + 1 ? D * (M + 1) : 0;
        const float *stream[3] = {K, V, row + 1 < end ? kr + ((row + 1) % B) * r_sb + ((row + 1) / B) * r_sh : NULL};
        const float *tab_stream[3] = {T, NULL, NULL};
        for (int64_t i = 0; i < L; i++)
            for (int64_t d = 0; d < D; d++) {
                qu[i * D + d] = q0[i * qkv_sl + d] + u[h * D + d];
                qv[i * D + d] = q0[i * qkv_sl + d] + vb[h * D + d];
            }
        for (int64_t j = 0; j < L * (M + 1); j++) s[j] = bd[j] = 0.f;
        int64_t d = 0;  /* a . k_j for every slot: rows of K^T, contiguous when column-major (model/cache.py) */
        if (r_sj == 1 && t_sj == 1)  /* four rows a pass: s and bd are read and written a quarter as often */
            for (; d + 4 <= D; d += 4) {
                const float *k0 = K + d * r_sd, *k1 = k0 + r_sd, *k2 = k1 + r_sd, *k3 = k2 + r_sd;
                const float *r0 = T + d * t_sd, *r1 = r0 + t_sd, *r2 = r1 + t_sd, *r3 = r2 + t_sd;  /* W_r R rows */
                int64_t j0 = 0;
                for (; j0 + CHUNK <= M; j0 += CHUNK) {
                    if (nk) prefetch_run(ahead(stream, nk, d * M + 4 * j0), 4 * CHUNK);
                    for (int64_t i = 0; i < L; i++) {
                        const float *a = qu + i * D + d;
                        axpy4(s + i * (M + 1) + j0, k0 + j0, k1 + j0, k2 + j0, k3 + j0, a[0], a[1], a[2], a[3], CHUNK);
                    }
                }
                for (int64_t i = 0; i < L; i++) {
                    const float *a = qu + i * D + d;
                    axpy4(s + i * (M + 1) + j0, k0 + j0, k1 + j0, k2 + j0, k3 + j0, a[0], a[1], a[2], a[3], M - j0);
                }
                int64_t t0 = 0;
                for (; t0 + CHUNK <= M + 1; t0 += CHUNK) {
                    if (n_tab) prefetch_run(ahead(tab_stream, n_tab, d * (M + 1) + 4 * t0), 4 * CHUNK);
                    for (int64_t i = 0; i < L; i++) {
                        const float *c = qv + i * D + d;
                        axpy4(bd + i * (M + 1) + t0, r0 + t0, r1 + t0, r2 + t0, r3 + t0, c[0], c[1], c[2], c[3], CHUNK);
                    }
                }
                for (int64_t i = 0; i < L; i++) {
                    const float *c = qv + i * D + d;
                    axpy4(bd + i * (M + 1) + t0, r0 + t0, r1 + t0, r2 + t0, r3 + t0, c[0], c[1], c[2], c[3],
                          M + 1 - t0);
                }
            }
        for (; d < D; d++) {
            const float *kd = K + d * r_sd, *td = T + d * t_sd;
            for (int64_t i = 0; i < L; i++) {
                const float a = qu[i * D + d], c = qv[i * D + d];
                float *si = s + i * (M + 1), *bi = bd + i * (M + 1);
                for (int64_t j = 0; j < M; j++) si[j] += a * kd[j * r_sj];
                for (int64_t t = 0; t <= M; t++) bi[t] += c * td[t * t_sj];
            }
        }
        /* per query: its window of the ring, scores, softmax; then the chunk's tokens up to itself */
        float chunk_p[MAX_CHUNK][MAX_CHUNK], inv[MAX_CHUNK];
        for (int64_t i = 0; i < L; i++) {
            float *si = s + i * (M + 1);
            const float *bi = bd + i * (M + 1), *qi = qu + i * D;
            /* slot j holds the token top - j steps before the newest for j <= top, and (once the ring has
               wrapped) top - j + M for j > top; query i sees those at most lim = M - 1 - i steps back */
            const int64_t lim = last < M - 1 - i ? last : M - 1 - i;
            const int64_t a0 = top - lim > 0 ? top - lim : 0;  /* [a0, top]: the newer slots it sees */
            const int64_t w0 = top + M - lim > top + 1 ? top + M - lim : top + 1;  /* [w0, M): the wrapped ones */
            const int64_t c0 = i - M > 0 ? i - M : 0;  /* the chunk's tokens within M of it, itself included */
            float mx = 0.f;
            for (int64_t c = i; c >= c0; c--) {  /* itself first: the maximum starts at a score */
                const float *kc = q0 + c * qkv_sl + H * D;
                float dot = 0.f;
                for (int64_t e = 0; e < D; e++) dot += qi[e] * kc[e];
                chunk_p[i][c] = (dot + bi[i - c]) * scale;
                mx = c == i || chunk_p[i][c] > mx ? chunk_p[i][c] : mx;
            }
            for (int64_t j = a0; j <= top; j++) {
                si[j] = (si[j] + bi[top - j + 1 + i]) * scale;
                mx = si[j] > mx ? si[j] : mx;
            }
            for (int64_t j = w0; j < M; j++) {
                si[j] = (si[j] + bi[top - j + M + 1 + i]) * scale;
                mx = si[j] > mx ? si[j] : mx;
            }
            float sum = 0.f;
            for (int64_t j = 0; j < a0; j++) si[j] = 0.f;
            for (int64_t j = a0; j <= top; j++) {
                si[j] = exp_neg(si[j] - mx);
                sum += si[j];
            }
            for (int64_t j = top + 1; j < w0; j++) si[j] = 0.f;
            for (int64_t j = w0; j < M; j++) {
                si[j] = exp_neg(si[j] - mx);
                sum += si[j];
            }
            for (int64_t c = 0; c < c0; c++) chunk_p[i][c] = 0.f;
            for (int64_t c = c0; c <= i; c++) {
                chunk_p[i][c] = exp_neg(chunk_p[i][c] - mx);
                sum += chunk_p[i][c];
            }
            inv[i] = 1.f / sum;
        }
        float *o0 = out + b * L * H * D + h * D;  /* token i's output at o0 + i H*D */
        d = 0;
        if (r_sj == 1)  /* four value rows a pass over the probabilities */
            for (; d + 4 <= D; d += 4) {
                const float *v0 = V + d * r_sd, *v1 = v0 + r_sd, *v2 = v1 + r_sd, *v3 = v2 + r_sd;
                float a[MAX_CHUNK][4] = {{0.f}};
                int64_t j0 = 0;
                for (; j0 + CHUNK <= M; j0 += CHUNK) {
                    if (nk) prefetch_run(ahead(stream, nk, nk + d * M + 4 * j0), 4 * CHUNK);
                    for (int64_t i = 0; i < L; i++)
                        dots4(a[i], s + i * (M + 1) + j0, v0 + j0, v1 + j0, v2 + j0, v3 + j0, CHUNK);
                }
                for (int64_t i = 0; i < L; i++) {
                    dots4(a[i], s + i * (M + 1) + j0, v0 + j0, v1 + j0, v2 + j0, v3 + j0, M - j0);
                    float *o = o0 + i * H * D;
                    for (int64_t e = 0; e < 4; e++) {
                        float acc = a[i][e];
                        for (int64_t c = 0; c <= i; c++) acc += chunk_p[i][c] * q0[c * qkv_sl + 2 * H * D + d + e];
                        o[d + e] = acc * inv[i];
                    }
                }
            }
        for (; d < D; d++) {
            const float *vd = V + d * r_sd;
            for (int64_t i = 0; i < L; i++) {
                const float *si = s + i * (M + 1);
                float acc = 0.f;
                for (int64_t j = 0; j < M; j++) acc += si[j] * vd[j * r_sj];
                for (int64_t c = 0; c <= i; c++) acc += chunk_p[i][c] * q0[c * qkv_sl + 2 * H * D + d];
                o0[i * H * D + d] = acc * inv[i];
            }
        }
        for (int64_t i = L > M ? L - M : 0; i < L; i++) {  /* the chunk's last M tokens enter the ring */
            const int64_t slot = (seen[b] + i) % M;
            const float *kn = q0 + i * qkv_sl + H * D, *vn = kn + H * D;
            for (d = 0; d < D; d++) {
                K[slot * r_sj + d * r_sd] = kn[d];
                V[slot * r_sj + d * r_sd] = vn[d];
            }
        }
    }
    free(s);
    return 0;
}

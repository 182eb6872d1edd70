/* A decode call's attention for a batch of Transformer-XL sessions, fused (model/fused.py builds it;
   kernels/ops.cpp checks its tensors and calls it): 1 to MAX_CHUNK new tokens per session, as many as each
   row has (a decode step's one, a short prompt's few: the rows' tokens packed, row b's from start[b]).

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
   rows. Each row's rings are their own pointers (krows[b], vrows[b]): one batch tensor's rows, or sessions'
   own states decoded together where they lie (model/cache.RowTable), so that joining and leaving a batch
   copies no ring. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

enum { MAX_D_HEAD = 1024, MAX_CHUNK = 8 };  /* ops.cpp refuses larger heads and chunks */

/* Queries whose position terms one pass over a head's table computes: the rows of one head in a batch share its
   table, which a pass per row had re-read from L2 or L3 (at mem_len 1600 the table, 410 KB a head, does not stay
   in L2 beside a row's 820 KB of keys and values): a third of the kernel's time at batch 16 (BENCHMARKS.md). */
enum { GROUP = 16 };

/* Y[r * ldy + j] = sum_d A[r * D + d] X[j * sj + d * sd] for r < rows, j < n: scores of `rows` queries against
   the keys (or position table) X. Where X is stored column-major (sj == 1, model/cache.py) its rows are read in
   blocks of columns: 64 at a time for four queries, each block once while it is in L1; 128 at a time for one
   (eight independent sums: four left a decode step's key pass waiting on its multiply-adds); otherwise, and
   for the last n % 16 columns, one column at a time. */
static void project(float *Y, int64_t ldy, const float *X, int64_t sj, int64_t sd, const float *A, int64_t rows,
                    int64_t D, int64_t n)
{
    const int64_t r4 = rows - rows % 4, n16 = sj == 1 ? n - n % 16 : 0;
    int64_t j0 = 0;
    for (; j0 + 64 <= n16; j0 += 64)
        for (int64_t r = 0; r < r4; r += 4) cols_block(4, 4, Y + r * ldy, ldy, X, sd, A + r * D, D, D, j0, NULL);
    for (int64_t r = 0; r < rows; r++) {
        int64_t j = r < r4 ? j0 : 0;
        if (r >= r4)
            for (; j + 128 <= n16; j += 128) cols_block(1, 8, Y + r * ldy, ldy, X, sd, A + r * D, D, D, j, NULL);
        for (; j < n16; j += 16) cols_block(1, 1, Y + r * ldy, ldy, X, sd, A + r * D, D, D, j, NULL);
        for (; j < n; j++) {
            float acc = 0.f;
            for (int64_t d = 0; d < D; d++) acc += A[r * D + d] * X[j * sj + d * sd];
            Y[r * ldy + j] = acc;
        }
    }
}

/* out = p @ V for a row's L queries: one row of V^T at a time (a contiguous run of M floats, column-major),
   read once for every query while it is in L1. With Kn, Vn (another row's keys and values, column-major), a run
   of each is prefetched into L2 per d, so that the next row's rings arrive while this one computes. Inlined
   twice, with and without them, so that a batch-1 call carries no prefetch test in its loop. */
static inline __attribute__((always_inline)) void values(float *o0, int64_t ldo, const float *V, int64_t r_sj,
                                                         int64_t r_sd, const float *s, int64_t M, int64_t D,
                                                         int64_t L, float chunk_p[][MAX_CHUNK], const float *inv,
                                                         const float *v0, int64_t qkv_sl, const float *Kn,
                                                         const float *Vn)
{
    for (int64_t d = 0; d < D; d++) {
        prefetch_run(Kn == NULL ? NULL : Kn + d * r_sd, M);
        prefetch_run(Vn == NULL ? NULL : Vn + d * r_sd, M);
        const float *vd = V + d * r_sd;
        for (int64_t i = 0; i < L; i++) {
            const float *si = s + i * (M + 1);
            float acc = 0.f;
            if (r_sj == 1)
                for (int64_t j = 0; j < M; j++) acc += si[j] * vd[j];
            else
                for (int64_t j = 0; j < M; j++) acc += si[j] * vd[j * r_sj];
            for (int64_t c = 0; c <= i; c++) acc += chunk_p[i][c] * v0[c * qkv_sl + d];
            o0[i * ldo + d] = acc * inv[i];
        }
    }
}

int txl_attend_one(int64_t begin, int64_t end,                      /* rows h*B + b of this call */
                   int64_t B, int64_t H, int64_t D, int64_t M,
                   const float *qkv, int64_t qkv_sl,                    /* [T, 3*H*D]: the tokens' q, k, v */
                   const int64_t *start,                                /* row b's tokens: [start[b], start[b+1]) */
                   const float *u, const float *vb,                     /* [H, D] each: r_w_bias, r_r_bias */
                   float *const *krows, float *const *vrows,            /* row b's rings [H, M, D], strides: */
                   int64_t r_sh, int64_t r_sj, int64_t r_sd,
                   const float *tab,                                    /* W_r R [H, M+1, D], these strides: */
                   int64_t t_sh, int64_t t_sj, int64_t t_sd,
                   const int64_t *seen, float scale,
                   float *out)                                          /* [T, H*D] */
{
    for (int64_t b = 0; b < B; b++)
        if (start[b + 1] - start[b] < 1 || start[b + 1] - start[b] > MAX_CHUNK) return -2;
    /* scores of a row's queries against the ring; position terms of a group's queries (up to GROUP, or one row's
       MAX_CHUNK) for distances 0..M; the row's (q + u); the group's (q + v) */
    enum { GROUP_Q = (int)GROUP > (int)MAX_CHUNK ? (int)GROUP : (int)MAX_CHUNK };
    const size_t n = (size_t)(MAX_CHUNK + GROUP_Q) * (size_t)(M + 1) + (size_t)(MAX_CHUNK + GROUP_Q) * (size_t)D;
    float *s = malloc(n * sizeof(float));
    if (s == NULL) return -1;
    float *bd = s + MAX_CHUNK * (M + 1), *qu = bd + GROUP_Q * (M + 1), *qv = qu + MAX_CHUNK * D;
    int64_t g0 = begin, g1 = begin;  /* the rows whose position terms bd holds */
    int64_t goff[GROUP_Q];  /* row g0 + r's first query in bd (a row has at least one) */
    for (int64_t row = begin; row < end; row++) {
        const int64_t h = row / B, b = row % B;  /* head-major: consecutive rows share a position table */
        const int64_t L = start[b + 1] - start[b];  /* this row's new tokens */
        if (seen[b] < 0) continue;  /* never the case; a negative slot would write before the ring */
        if (row >= g1) {  /* the next group: rows of this head while their queries fit in GROUP (one at least) */
            const int64_t last_row = end < (h + 1) * B ? end : (h + 1) * B;
            int64_t nq = 0;
            for (g0 = g1 = row; g1 < last_row; g1++) {
                const int64_t lr = start[g1 % B + 1] - start[g1 % B];
                if (g1 > g0 && nq + lr > GROUP) break;
                goff[g1 - g0] = nq;
                for (int64_t i = 0; i < lr; i++)
                    for (int64_t d = 0; d < D; d++)
                        qv[(nq + i) * D + d] = qkv[(start[g1 % B] + i) * qkv_sl + h * D + d] + vb[h * D + d];
                nq += lr;
            }
            project(bd, M + 1, tab + h * t_sh, t_sj, t_sd, qv, nq, D, M + 1);  /* [nq, M+1] */
        }
        const float *bd_row = bd + goff[row - g0] * (M + 1);  /* query i's position terms at + i (M+1) */
        const int64_t last = seen[b] - 1;
        const int64_t top = last < 0 ? -1 : last % M;  /* the slot of the newest stored token */
        const float *q0 = qkv + start[b] * qkv_sl + h * D;  /* token i's q at q0 + i qkv_sl; its k, v H*D, 2H*D on */
        float *K = krows[b] + h * r_sh, *V = vrows[b] + h * r_sh;
        for (int64_t i = 0; i < L; i++)
            for (int64_t d = 0; d < D; d++) qu[i * D + d] = q0[i * qkv_sl + d] + u[h * D + d];
        project(s, M + 1, K, r_sj, r_sd, qu, L, D, M);  /* (q + u) . k_j for every slot: [L, M] */
        /* per query: its window of the ring, scores, softmax; then the chunk's tokens up to itself */
        float chunk_p[MAX_CHUNK][MAX_CHUNK], inv[MAX_CHUNK];
        for (int64_t i = 0; i < L; i++) {
            float *si = s + i * (M + 1);
            const float *bi = bd_row + i * (M + 1), *qi = qu + i * D;
            /* slot j holds the token top - j steps before the newest for j <= top, and (once the ring has
               wrapped) top - j + M for j > top; query i sees those at most lim = M - 1 - i steps back */
            const int64_t lim = last < M - 1 - i ? last : M - 1 - i;
            int64_t a0 = top - lim > 0 ? top - lim : 0;  /* [a0, top]: the newer slots it sees */
            int64_t w0 = top + M - lim > top + 1 ? top + M - lim : top + 1;  /* [w0, M): the wrapped ones */
            a0 = a0 < top + 1 ? a0 : top + 1;  /* none, for a query M or more tokens into the chunk (lim < 0) */
            w0 = w0 < M ? w0 : M;  /* so that the loops below stay in this query's row of scores */
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
        /* the next row's keys and values go into L2 meanwhile: in a batch it is another session's (rows are
           head-major), whose rings the hardware prefetcher only finds a run at a time; with one session it is
           the next head's, adjacent, which it finds unaided */
        const int64_t next = row + 1 < end && B > 1 && r_sj == 1 ? row + 1 : -1;
        float *o0 = out + start[b] * H * D + h * D;  /* token i's output at o0 + i H*D */
        if (next < 0)
            values(o0, H * D, V, r_sj, r_sd, s, M, D, L, chunk_p, inv, q0 + 2 * H * D, qkv_sl, NULL, NULL);
        else
            values(o0, H * D, V, r_sj, r_sd, s, M, D, L, chunk_p, inv, q0 + 2 * H * D, qkv_sl,
                   krows[next % B] + (next / B) * r_sh, vrows[next % B] + (next / B) * r_sh);
        for (int64_t i = L > M ? L - M : 0; i < L; i++) {  /* the chunk's last M tokens enter the ring */
            const int64_t slot = (seen[b] + i) % M;
            const float *kn = q0 + i * qkv_sl + H * D, *vn = kn + H * D;
            for (int64_t d = 0; d < D; d++) {
                K[slot * r_sj + d * r_sd] = kn[d];
                V[slot * r_sj + d * r_sd] = vn[d];
            }
        }
    }
    free(s);
    return 0;
}

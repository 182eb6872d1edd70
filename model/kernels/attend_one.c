/* One decode step's attention for a batch of Transformer-XL sessions, fused (model/fused.py builds it;
   kernels/attend_one_op.cpp checks its tensors and calls it).

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

enum { MAX_D_HEAD = 1024 };  /* attend_one_op.cpp refuses larger heads */

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
        for (int64_t d = 0; d < D; d++) {
            qu[d] = q[d] + u[h * D + d];
            qv[d] = q[d] + vb[h * D + d];
        }
        for (int64_t j = 0; j <= M; j++) s[j] = bd[j] = 0.f;
        int64_t d = 0;  /* a . k_j for every slot: rows of K^T, contiguous when column-major (model/cache.py) */
        if (r_sj == 1 && t_sj == 1)  /* four rows a pass: s and bd are read and written a quarter as often */
            for (; d + 4 <= D; d += 4) {
                const float *k0 = K + d * r_sd, *k1 = k0 + r_sd, *k2 = k1 + r_sd, *k3 = k2 + r_sd;
                const float *t0 = T + d * t_sd, *t1 = t0 + t_sd, *t2 = t1 + t_sd, *t3 = t2 + t_sd;
                const float a0 = qu[d], a1 = qu[d + 1], a2 = qu[d + 2], a3 = qu[d + 3];
                const float c0 = qv[d], c1 = qv[d + 1], c2 = qv[d + 2], c3 = qv[d + 3];
                for (int64_t j = 0; j < M; j++) s[j] += a0 * k0[j] + a1 * k1[j] + a2 * k2[j] + a3 * k3[j];
                for (int64_t t = 0; t <= M; t++) bd[t] += c0 * t0[t] + c1 * t1[t] + c2 * t2[t] + c3 * t3[t];
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
        /* slot j holds the token back(j) = top - j steps before the newest (plus M above top, once the ring
           has wrapped); before it has, slots above top are still empty */
        const int full = seen[b] >= M;
        float mx = self, sum = 0.f;
        for (int64_t j = 0; j < M; j++) {
            const int64_t back = j <= top ? top - j : top - j + M;
            s[j] = (s[j] + bd[back + 1]) * scale;
            if ((full || j <= top) && s[j] > mx) mx = s[j];
        }
        const float p_self = expf(self - mx);
        for (int64_t j = 0; j < M; j++) {
            s[j] = (full || j <= top) ? expf(s[j] - mx) : 0.f;
            sum += s[j];
        }
        sum += p_self;
        const float inv = 1.f / sum;
        float *o = out + b * H * D + h * D;
        d = 0;
        if (r_sj == 1)  /* four value rows a pass over the probabilities */
            for (; d + 4 <= D; d += 4) {
                const float *v0 = V + d * r_sd, *v1 = v0 + r_sd, *v2 = v1 + r_sd, *v3 = v2 + r_sd;
                float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
                for (int64_t j = 0; j < M; j++) {
                    const float p = s[j];
                    a0 += p * v0[j];
                    a1 += p * v1[j];
                    a2 += p * v2[j];
                    a3 += p * v3[j];
                }
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

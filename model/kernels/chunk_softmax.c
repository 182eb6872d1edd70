/* A prefill chunk's attention probabilities, in one pass per query (model/fused.py builds it; kernels/ops.cpp
   checks its tensors and calls it). A chunk of C tokens per session attends to its ring of M slots and to its
   own tokens; torch's products have made the content scores and the position scores, and this does what torch
   did in five passes over [batch, H, C, M + C] (join the two blocks, gather each query's position scores by
   distance, add, mask, softmax), each query's row of 3-6 KB once while it is in L1:

     ring[n, h, i, s] = ((q_i + u) . k_s)                over the ring's slots s < M   (in: before; out: probability)
     own[n, h, i, c]  = ((q_i + u) . k_c)                over the chunk's tokens c < C
     pos[h, n, i, d]  = ((q_i + v) . (W_r R)_d)          for distances d <= M

   Query i of session n is at position p_i = seen[n] + i; slot s holds the latest position p < seen[n] with
   p = s mod M, so seen[n] - M <= p (none while p would be negative). Query i sees what lies at most M tokens back, itself included: ring
   positions max(0, p_i - M) .. seen[n] - 1 and the chunk's tokens max(0, i - M) .. i; every other score is
   blocked and its probability 0. The score of a key at distance d is the sum of its content score and pos[d],
   and the probabilities are the softmax of a query's scores over both blocks (queries come scaled by the
   caller), as model/transformer_xl.py computes them with torch ops (tests compare the two to float rounding).
   A call handles rows r = (n H + h) C + i in [r0, r1), so the op splits them across threads; each row's result
   is the same whichever thread computes it. */
#include <stdint.h>

#include "vec.h"

/* x[j] += pos[d0 - j] for j < len (the distance falls as the slot rises); their maximum, with mx's */
static inline float add_positions(float *restrict x, const float *restrict pos, int64_t d0, int64_t len, float mx)
{
    for (int64_t j = 0; j < len; j++) {
        x[j] += pos[d0 - j];
        mx = x[j] > mx ? x[j] : mx;
    }
    return mx;
}

/* x[j] = e^(x[j] - mx) for j < len; their sum */
static inline float exp_shifted(float *restrict x, int64_t len, float mx)
{
    float sum = 0.f;
    for (int64_t j = 0; j < len; j++) {
        x[j] = exp_neg(x[j] - mx);
        sum += x[j];
    }
    return sum;
}

static inline void scaled(float *restrict x, int64_t len, float c)
{
    for (int64_t j = 0; j < len; j++) x[j] *= c;
}

static inline void zeroed(float *restrict x, int64_t len)
{
    for (int64_t j = 0; j < len; j++) x[j] = 0.f;
}

void txl_chunk_softmax(int64_t r0, int64_t r1, int64_t N, int64_t H, int64_t C, int64_t M, float *ring, float *own,
                       const float *pos, const int64_t *seen)
{
    for (int64_t r = r0; r < r1; r++) {
        const int64_t i = r % C, h = (r / C) % H, n = r / (C * H);
        float *x = ring + r * M, *y = own + r * C;
        const float *pr = pos + ((h * N + n) * C + i) * (M + 1);
        const int64_t p = seen[n] + i;
        /* the ring's positions in view, [lo, seen): slots [a, a + len1) hold lo .., then slots [0, len2) (wrapped) */
        const int64_t lo = p - M > 0 ? p - M : 0, count = seen[n] - lo > 0 ? seen[n] - lo : 0;
        const int64_t a = lo % M, len1 = count < M - a ? count : M - a, len2 = count - len1;
        const int64_t c0 = i - M > 0 ? i - M : 0;  /* the chunk's tokens in view: [c0, i] */
        /* itself first: the maximum starts at a score (d = 0) */
        float mx = y[i] + pr[0];
        mx = add_positions(y + c0, pr, i - c0, i - c0 + 1, mx);
        mx = add_positions(x + a, pr, p - lo, len1, mx);
        mx = add_positions(x, pr, p - lo - len1, len2, mx);
        const float sum = exp_shifted(y + c0, i - c0 + 1, mx) + exp_shifted(x + a, len1, mx) +
                          exp_shifted(x, len2, mx);
        const float inv = 1.f / sum;
        scaled(y + c0, i - c0 + 1, inv);
        scaled(x + a, len1, inv);
        scaled(x, len2, inv);
        zeroed(y, c0);
        zeroed(y + i + 1, C - i - 1);
        zeroed(x + len2, a - len2 > 0 ? a - len2 : 0);
        zeroed(x + a + len1, M - a - len1);
    }
}

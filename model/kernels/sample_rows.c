/* One token per row, drawn from softmax(logits / T) by inverse CDF with the row's own uniform u in [0, 1)
   (model/sampling.py draws u from the request's generator), or the first most likely token where T is below
   greedy_below. Sampling a row of the bundled model took some fifteen small torch ops, ~85 us, an eighth of
   a batch-1 step (BENCHMARKS.md); here it is one pass over the row.

   p_j = e^((x_j - max) / T) is summed in blocks of BLOCK (vectorised), the block sums are accumulated in
   double, and the draw is the first j whose running sum passes u * total: the block first, then the token in
   it. A row's result depends only on its own logits, T and u, never on the other rows of the call or on how
   threads split them. Float32 logits only (kernels/ops.cpp checks them). */
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

enum { BLOCK = 256 };

static int64_t argmax(const float *x, int64_t V)
{
    int64_t best = 0;
    for (int64_t j = 1; j < V; j++)
        if (x[j] > x[best]) best = j;
    return best;
}

static int64_t draw(const float *x, int64_t V, double temperature, double u, float *p, double *block_sums)
{
    float mx = x[0];
    for (int64_t j = 1; j < V; j++) mx = x[j] > mx ? x[j] : mx;
    const float inv_t = (float)(1.0 / temperature);
    double total = 0.0;
    const int64_t blocks = (V + BLOCK - 1) / BLOCK;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t j0 = b * BLOCK, j1 = j0 + BLOCK < V ? j0 + BLOCK : V;
        float s = 0.f;
        for (int64_t j = j0; j < j1; j++) {
            p[j] = exp_neg((x[j] - mx) * inv_t);
            s += p[j];
        }
        block_sums[b] = s;
        total += s;
    }
    const double target = u * total;
    double run = 0.0;
    int64_t b = 0;
    while (b + 1 < blocks && run + block_sums[b] <= target) run += block_sums[b++];
    const int64_t j0 = b * BLOCK, j1 = j0 + BLOCK < V ? j0 + BLOCK : V;
    for (int64_t j = j0; j < j1; j++) {
        run += p[j];
        if (run > target) return j;
    }
    return j1 - 1;  /* the block's sum rounded above its tokens' running sum: its last token */
}

/* Rows [r0, r1): out[r] for logits row r (row stride x_sr floats). Returns -1 when out of memory. */
int txl_sample_rows(int64_t r0, int64_t r1, int64_t V, const float *logits, int64_t x_sr,
                    const double *temperature, const double *u, double greedy_below, int64_t *out)
{
    float *p = malloc((size_t)V * sizeof(float));
    double *block_sums = malloc((size_t)((V + BLOCK - 1) / BLOCK) * sizeof(double));
    if (p == NULL || block_sums == NULL) {
        free(p);
        free(block_sums);
        return -1;
    }
    for (int64_t r = r0; r < r1; r++) {
        const float *x = logits + r * x_sr;
        out[r] = temperature[r] < greedy_below ? argmax(x, V) : draw(x, V, temperature[r], u[r], p, block_sums);
    }
    free(p);
    free(block_sums);
    return 0;
}

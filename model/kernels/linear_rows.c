/* y = x W^T + bias for a few rows of x (a decode step's batch), streaming the weight once, or for a block of a
   prefill chunk's rows in register tiles (kernels/ops.cpp checks the tensors, splits the outputs over threads and
   the rows into blocks of 64).

   torch's product of one row with a 256 x 1024 weight read it at half this CPU's single-core bandwidth, and
   of five rows four times slower than of one (BENCHMARKS.md): the weights, not the attention, were most of
   a batch-1 step. Here each of the N rows reuses every weight line while it is in L1. The weight may be stored
   either way (model/decode.py keeps widening weights column-major for torch's sake):
     row-major    (w_si == 1): y[n, o] = x[n] . W[o, :], four contiguous weight rows a tile;
     column-major (w_so == 1): y[n, :] += x[n, i] W[:, i], four contiguous columns a pass (below TILE_ROWS
                               rows), or 64 outputs of every column a tile.
   A call fills outputs [o0, o1) of every row. Float32 only. */
#include <stddef.h>
#include <stdint.h>

#include "vec.h"

/* Software prefetch into L2, AHEAD floats (32 KB) ahead of the reads: the four interleaved columns a
   column-major pass reads are too short a stream for the hardware prefetchers. CHUNK: outputs a column pass
   takes at a time (a multiple of 16, so threads' blocks of 64 outputs split at the same places). */
enum { AHEAD = 8192, CHUNK = 64 };

/* From TILE_ROWS rows on, a product is arithmetic-bound rather than bandwidth-bound (a weight line in L1 serves
   every row), and the rows go through register tiles: 4 rows x 64 outputs for a column-major weight, 4 rows x 4
   outputs for a row-major one. 16 rows of 6 x 256: 2.26 -> 1.96 ms a step's products, 12 x 512: 25.3 -> 20.1
   ms; below 4 rows the column-major streaming loop is faster. A row-major weight always goes through tiles: one
   row's four independent sums read a 12 x 512 step's second feed-forward weights at 44 GB/s, where a dot
   product per output (one chain of sums) read them at 25 (BENCHMARKS.md). */
enum { TILE_ROWS = 4 };

/* The horizontal sum of a register: out of line, so that every tile sums its lanes in the same order. */
static __attribute__((noinline)) float hsum(v16 v)
{
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* y[n][o] = bias[o] + x[n] . W[o] for R rows n and C outputs o of a row-major weight (R, C <= 4): R x C sums of
   16 in registers along the inputs, the C weight rows read once for the R rows */
static inline __attribute__((always_inline)) void dots_tile(int R, int C, float *restrict y, int64_t ldy,
                                                            const float *restrict x, int64_t ldx,
                                                            const float *restrict W, int64_t ldw, int64_t in,
                                                            const float *restrict bias)
{
    v16 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = (v16){0.f};
    int64_t i = 0;
    for (; i + 16 <= in; i += 16) {
        v16 xi[4];  /* loaded once, used by every output */
        for (int r = 0; r < R; r++) {
            xi[r] = *(const v16 *)(x + r * ldx + i);
            if (C > 1 && R > 1) REGISTER(xi[r]);
        }
        for (int c = 0; c < C; c++) {
            v16 w = *(const v16 *)(W + c * ldw + i);
            if (R > 1) REGISTER(w);
            for (int r = 0; r < R; r++) acc[r][c] += w * xi[r];
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s = hsum(acc[r][c]);
            for (int64_t k = i; k < in; k++) s += x[r * ldx + k] * W[c * ldw + k];
            y[r * ldy + c] = s + (bias == NULL ? 0.f : bias[c]);
        }
}

/* Outputs [o0, o1) of N >= TILE_ROWS rows in register tiles */
static void linear_tiles(int64_t o0, int64_t o1, int64_t N, int64_t in, int64_t out, const float *x,
                         const float *W, int64_t w_so, int64_t w_si, const float *bias, float *y)
{
    const int64_t n4 = N - N % 4;
    if (w_si == 1) {
        int64_t o = o0;
        for (; o + 4 <= o1; o += 4) {
            const float *w = W + o * w_so, *b = bias == NULL ? NULL : bias + o;
            for (int64_t n = 0; n < n4; n += 4) dots_tile(4, 4, y + n * out + o, out, x + n * in, in, w, w_so, in, b);
            for (int64_t n = n4; n < N; n++) dots_tile(1, 4, y + n * out + o, out, x + n * in, in, w, w_so, in, b);
        }
        for (; o < o1; o++)
            for (int64_t n = 0; n < N; n++)
                dots_tile(1, 1, y + n * out + o, out, x + n * in, in, W + o * w_so, w_so, in,
                          bias == NULL ? NULL : bias + o);
        return;
    }
    int64_t o = o0;  /* column-major: X[i][o] = W[o + i w_si] */
    for (; o + 64 <= o1; o += 64) {
        for (int64_t n = 0; n < n4; n += 4) cols_block(4, 4, y + n * out, out, W, w_si, x + n * in, in, in, o, bias);
        for (int64_t n = n4; n < N; n++) cols_block(1, 4, y + n * out, out, W, w_si, x + n * in, in, in, o, bias);
    }
    for (; o + 16 <= o1; o += 16)
        for (int64_t n = 0; n < N; n++) cols_block(1, 1, y + n * out, out, W, w_si, x + n * in, in, in, o, bias);
    for (; o < o1; o++)
        for (int64_t n = 0; n < N; n++) {
            float acc = bias == NULL ? 0.f : bias[o];
            for (int64_t i = 0; i < in; i++) acc += x[n * in + i] * W[o + i * w_si];
            y[n * out + o] = acc;
        }
}

void txl_linear_rows(int64_t o0, int64_t o1, int64_t N, int64_t in, int64_t out,
                     const float *x,                          /* [N, in], contiguous */
                     const float *W, int64_t w_so, int64_t w_si,  /* [out, in]: W[o, i] at o * w_so + i * w_si */
                     const float *bias,                       /* [out] or NULL */
                     float *y)                                /* [N, out], contiguous */
{
    if (w_si == 1 || N >= TILE_ROWS) {
        linear_tiles(o0, o1, N, in, out, x, W, w_so, w_si, bias, y);
        return;
    }
    const int64_t len = o1 - o0, ahead = 4 * ((AHEAD + 4 * len - 1) / (4 * len));  /* columns, whole passes */
    for (int64_t n = 0; n < N; n++)
        for (int64_t o = o0; o < o1; o++) y[n * out + o] = bias == NULL ? 0.f : bias[o];
    int64_t i = 0;
    for (; i + 4 <= in; i += 4) {
        const float *w0 = W + i * w_si + o0 * w_so, *w1 = w0 + w_si, *w2 = w1 + w_si, *w3 = w2 + w_si;
        const float *later = i + ahead + 4 <= in ? w0 + ahead * w_si : NULL;
        for (int64_t c = 0; c < len; c += CHUNK) {  /* CHUNK outputs of the four columns, and of the later four */
            const int64_t m = len - c < CHUNK ? len - c : CHUNK;
            if (later != NULL)
                for (int r = 0; r < 4; r++) prefetch_run(later + r * w_si + c, m);
            for (int64_t n = 0; n < N; n++) {
                const float *a = x + n * in + i;
                axpy4(y + n * out + o0 + c, w0 + c, w1 + c, w2 + c, w3 + c, a[0], a[1], a[2], a[3], m);
            }
        }
    }
    for (; i < in; i++) {
        const float *w = W + i * w_si + o0 * w_so;
        for (int64_t n = 0; n < N; n++) {
            const float a = x[n * in + i];
            float *yn = y + n * out + o0;
            for (int64_t o = 0; o < len; o++) yn[o] += a * w[o];
        }
    }
}

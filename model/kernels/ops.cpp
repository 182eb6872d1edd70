// The torch ops around the C kernels: txlserve::attend_one and attend_rows (kernels/attend_one.c, and
// kernels/attend_absorbed.c for a batch's one-token steps where that reads fewer bytes), linear_rows
// (kernels/linear_rows.c), chunk_softmax (kernels/chunk_softmax.c) and txlserve::sample_rows
// (kernels/sample_rows.c). Each checks what its C code
// trusts, then calls it. C++ ops (not Python ones), so that a traced decode step calls them without taking the
// GIL (model/fused.py).
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <vector>

extern "C" int txl_attend_one(int64_t begin, int64_t end, int64_t B, int64_t H, int64_t D, int64_t M,
                              const float *qkv, int64_t qkv_sl, const int64_t *start, const float *u, const float *vb, float *const *krows, float *const *vrows,
                              int64_t r_sh, int64_t r_sj, int64_t r_sd, const float *tab, int64_t t_sh,
                              int64_t t_sj, int64_t t_sd, const int64_t *seen, float scale, float *out);
extern "C" int txl_attend_absorbed(int64_t b0, int64_t b1, int64_t H, int64_t M, int64_t dm, const float *qt,
                                   int64_t q_sb, int64_t q_sh, const float *bd, int64_t bd_sb, int64_t bd_sh,
                                   const float *s_self, const float *const *rings, const int64_t *seen, float *ctx,
                                   int64_t c_sb, int64_t c_sh, float *p_self);
extern "C" int txl_sample_rows(int64_t r0, int64_t r1, int64_t V, const float *logits, int64_t x_sr,
                                const double *temperature, const double *u, double greedy_below, int64_t *out);
extern "C" void txl_chunk_softmax(int64_t r0, int64_t r1, int64_t N, int64_t H, int64_t C, int64_t M, float *ring,
                                  float *own, const float *pos, const int64_t *seen);
extern "C" void txl_linear_rows(int64_t o0, int64_t o1, int64_t N, int64_t in, int64_t out, const float *x,
                                const float *W, int64_t w_so, int64_t w_si, const float *bias, float *y);

namespace {

constexpr int64_t kMaxDHead = 1024;  // kernels/attend_one.c: MAX_D_HEAD
constexpr int64_t kMaxChunk = 8;     // kernels/attend_one.c: MAX_CHUNK

bool is_cpu_float(const at::Tensor &t) { return t.device().is_cpu() && t.scalar_type() == at::kFloat; }

// Numbers in an error message, written by snprintf rather than by c10::str's ostream: on a host where the process
// holds the C++ runtime's locale facets from two libraries, formatting an integer into an ostream from this
// library crashed the process (a segfault on a GPU image, torch 2.11) where the check meant to raise ValueError.
std::string num(int64_t x) { return std::to_string(x); }

// The tokens each of a call's B rows had seen before it: contiguous int64 [B] on the CPU, none negative.
void check_seen(const char *op, const at::Tensor &seen, int64_t B) {
  TORCH_CHECK_VALUE(seen.device().is_cpu() && seen.scalar_type() == at::kLong && seen.dim() == 1 &&
                        seen.size(0) == B && seen.is_contiguous(),
                    op, ": seen must be contiguous int64 [batch]");
  const int64_t *pos = seen.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++) TORCH_CHECK_VALUE(pos[b] >= 0, op, ": seen ", num(pos[b]), " < 0");
}

// What both attention ops check of the tensors they share: the tokens' q, k, v `qkv [N, L, 3*H*D]` (read as the
// packed [T = N*L, 3*H*D]), the biases, the position table, the tokens seen, and where each row's tokens start
// (`st`, B+1 entries from 0 to T, 1 to kMaxChunk tokens a row). B rows, H heads of D, rings of M slots.
void check_step(const char *op, const at::Tensor &qkv, const at::Tensor &u, const at::Tensor &vb,
                const at::Tensor &table, const at::Tensor &seen, const int64_t *st, int64_t B, int64_t H, int64_t M,
                int64_t D) {
  TORCH_CHECK_VALUE(is_cpu_float(qkv) && is_cpu_float(u) && is_cpu_float(vb) && is_cpu_float(table), op,
                    ": float32 CPU tensors only");
  TORCH_CHECK_VALUE(M > 0 && D > 0 && D <= kMaxDHead, op, ": mem_len ", num(M), " d_head ", num(D));
  TORCH_CHECK_VALUE(qkv.dim() == 3 && qkv.size(2) == 3 * H * D, op, ": qkv must be [.., tokens, 3*heads*d_head]");
  TORCH_CHECK_VALUE(u.dim() == 2 && u.size(0) == H && u.size(1) == D && u.is_contiguous() &&
                        vb.sizes() == u.sizes() && vb.is_contiguous(),
                    op, ": biases must be contiguous [heads, d_head]");
  TORCH_CHECK_VALUE(table.dim() == 3 && table.size(0) == H && table.size(1) == M + 1 && table.size(2) == D, op,
                    ": the position table must be [heads, mem_len+1, d_head]");
  check_seen(op, seen, B);
  const int64_t T = qkv.size(0) * qkv.size(1);
  TORCH_CHECK_VALUE(st[0] == 0 && st[B] == T, op, ": start must run from 0 to the ", num(T), " tokens");
  for (int64_t b = 0; b < B; b++)
    TORCH_CHECK_VALUE(st[b + 1] - st[b] >= 1 && st[b + 1] - st[b] <= kMaxChunk, op, ": row ", num(b), " has ",
                      num(st[b + 1] - st[b]), " tokens, not 1..", num(kMaxChunk));
}

// The kernel over every (head, row) of contiguous `qkv [N, L, 3*H*D]`, rows' tokens from st, rings at krows[b],
// vrows[b] with element strides rs (head, slot, d): the attention's output [N, L, H*D].
at::Tensor run_attend(const char *op, const at::Tensor &qkv, const int64_t *st, int64_t B, const at::Tensor &u,
                      const at::Tensor &vb, const std::vector<float *> &krows, const std::vector<float *> &vrows,
                      const int64_t rs[3], const at::Tensor &table, const at::Tensor &seen, double scale, int64_t H,
                      int64_t M, int64_t D) {
  at::Tensor out = at::empty({qkv.size(0), qkv.size(1), H * D}, qkv.options());  // [N, L, H*D]
  std::atomic<int> status{0};
  // Rows (b, h) are independent: each reads and writes its own ring; torch's intra-op threads share them.
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    const int rc = txl_attend_one(begin, end, B, H, D, M, qkv.data_ptr<float>(), 3 * H * D, st,
                                  u.data_ptr<float>(), vb.data_ptr<float>(), krows.data(), vrows.data(), rs[0], rs[1],
                                  rs[2], table.data_ptr<float>(), table.stride(0), table.stride(1), table.stride(2),
                                  seen.data_ptr<int64_t>(), static_cast<float>(scale), out.data_ptr<float>());
    if (rc != 0) status.store(rc);
  });
  TORCH_CHECK(status.load() != -1, op, ": out of memory for ", num(2 * kMaxChunk * (M + 1)), " scores");
  TORCH_CHECK(status.load() == 0, op, ": the kernel refused the rows' token counts");  // check_step's, again
  return out;
}

// Keys and values absorbed (kernels/attend_absorbed.c): a step of one token a row reads each session's ring of
// layer inputs once for every head instead of its rings of keys and values, half the bytes for H times the
// multiply-adds. Worth it where a layer's keys and values come from DRAM, not from the last-level cache, and the
// heads are few: at least `min_bytes` of them (model/fused.py: ABSORB_MIN_BYTES), at most kAbsorbMaxHeads heads.
// On a 2-vCPU Xeon with a 300 MiB L3, whole steps of 6 x 256 at mem_len 1600: 16 sessions (52 MB a layer) 25
// against 33-44 ms, 8 (26 MB) 15-19 against 17-21; at mem_len 512 16 sessions (17 MB) break even, and the bundled
// 4 x 256 at 128 loses at every batch up to 64 (17 MB): BENCHMARKS.md, "Keys and values absorbed, built". `kv` is the attention's [2*H*D, d_model] key
// and value weights, `hrows[b]` row b's ring of layer inputs [M, d_model], row-major.
constexpr int64_t kAbsorbMaxHeads = 4;  // kernels/attend_absorbed.c: ABSORB_MAX_HEADS

bool absorbs(const std::optional<at::Tensor> &kv, int64_t min_bytes, int64_t B, int64_t T, int64_t H, int64_t D,
             int64_t M) {
  if (!kv.has_value() || T != B || H > kAbsorbMaxHeads || B * M * 2 * H * D * 4 < min_bytes) return false;
  const at::Tensor &w = *kv;
  return is_cpu_float(w) && w.dim() == 2 && w.size(0) == 2 * H * D && w.size(1) % 64 == 0 &&
         (w.stride(0) == 1 || w.stride(1) == 1);
}

// The C loops against torch's product on this CPU (AMD Zen 5, one thread), BENCHMARKS.md: 1.3x at 1 row, 1.6x at
// 4; with register tiles from 4 rows, a step's products: 32 rows of the bundled 4 x 256 1.2 ms against torch's 2.2,
// 64 rows 2.4 against 3.9, 64 rows of 2 layers of 512 5.3 against 8.1 and of 1024 29.8 against 34.8; a prefill
// chunk's 128 rows 90-118 GMAC/s against torch's 53-55 at every shape of 6 x 256 and 12 x 512. Rows go in blocks
// of kRowBlock, so that a block's inputs stay in L2 while a thread's weights pass over them.
constexpr int64_t kRowBlock = 64;

// y[e] = x[e] W_e^T for entries e < E: x [E, N, in] and y [E, N, out] contiguous, W_e[o, i] at w + e * w_se +
// o * w_so + i * w_si, one of w_so and w_si 1 (row- or column-major). The register tiles of linear_rows, for
// small products batched over heads or sessions: torch's bmm ran the absorbed step's position scores ([4, 16,
// 64] x [4, 64, 1601] a layer) at 15-20 GMAC/s, 2-3 ms of a 32 ms step of 6 x 256 (BENCHMARKS.md). Work items are
// (entry, 64 outputs): every output is computed by the same instructions whatever the threads.
void entries_linear(const float *x, const float *w, int64_t w_se, int64_t w_so, int64_t w_si, int64_t E, int64_t N,
                    int64_t in, int64_t out, float *y) {
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (out + kBlock - 1) / kBlock;
  at::parallel_for(0, E * blocks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      const int64_t e = t / blocks, o0 = (t % blocks) * kBlock;
      for (int64_t r = 0; r < N; r += kRowBlock)
        txl_linear_rows(o0, std::min(out, o0 + kBlock), std::min(kRowBlock, N - r), in, out, x + (e * N + r) * in,
                        w + e * w_se, w_so, w_si, nullptr, y + (e * N + r) * out);
    }
  });
}

// The token's q, k, v `q [B, 1, 3*H*D]` (contiguous) attend through the absorbed kernel; their keys and values
// are stored into the rings as run_attend's kernel stores them. The products around the kernel are the register
// tiles' (entries_linear), a head at a time: qt = W_k,h^T (q + u) scale [H, B, d_model]; the position terms
// (q + v) scale . W_r R [H, B, M+1]; the output W_v,h ctx_h + p_self v_self.
at::Tensor run_absorbed(const char *op, const at::Tensor &q, const at::Tensor &u, const at::Tensor &vb,
                        const at::Tensor &kv, const std::vector<float *> &hrows,
                        const std::vector<float *> &krows, const std::vector<float *> &vrows, const int64_t rs[3],
                        const at::Tensor &table, const at::Tensor &seen, double scale, int64_t H, int64_t M,
                        int64_t D) {
  const int64_t B = q.size(0), dm = kv.size(1);
  const at::Tensor heads = q.view({B, 3, H, D});
  const at::Tensor qh = heads.select(1, 0), kh = heads.select(1, 1), vh = heads.select(1, 2);  // [B, H, D] each
  const at::Tensor qu = (qh + u) * scale, qv = (qh + vb) * scale;                              // [B, H, D]
  const at::Tensor quh = qu.transpose(0, 1).contiguous(), qvh = qv.transpose(0, 1).contiguous();  // [H, B, D]
  // W_k,h [D, dm] and W_v,h at kv's rows h D and (H + h) D, kv row- or column-major (model/decode.py stores
  // widening weights column-major on a CPU); the position table W_r R [H, M+1, D]
  const float *wk = kv.data_ptr<float>(), *wv = wk + H * D * kv.stride(0);
  const int64_t k0 = kv.stride(0), k1 = kv.stride(1);
  at::Tensor qt = at::empty({H, B, dm}, q.options()), bd = at::empty({H, B, M + 1}, q.options());
  entries_linear(quh.data_ptr<float>(), wk, D * k0, k1, k0, H, B, D, dm, qt.data_ptr<float>());  // [H, B, dm]
  TORCH_CHECK(table.stride(2) == 1 || table.stride(1) == 1, op, ": the position table needs one unit stride");
  entries_linear(qvh.data_ptr<float>(), table.data_ptr<float>(), table.stride(0), table.stride(1), table.stride(2), H,
                 B, D, M + 1, bd.data_ptr<float>());  // [H, B, M+1]
  const at::Tensor s_self = ((qu * kh).sum(-1) + bd.select(2, 0).transpose(0, 1)).contiguous();  // [B, H]
  at::Tensor ctx = at::empty({H, B, dm}, q.options()), p_self = at::empty({B, H}, q.options());
  std::atomic<int> status{0};
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {  // rows are independent: each reads its own ring
    const int rc = txl_attend_absorbed(b0, b1, H, M, dm, qt.data_ptr<float>(), qt.stride(1), qt.stride(0),
                                       bd.data_ptr<float>(), bd.stride(1), bd.stride(0), s_self.data_ptr<float>(),
                                       hrows.data(), seen.data_ptr<int64_t>(), ctx.data_ptr<float>(), dm, B * dm,
                                       p_self.data_ptr<float>());
    if (rc != 0) status.store(rc);
  });
  TORCH_CHECK(status.load() == 0, op, ": the absorbed kernel refused ", num(H), " heads of d_model ", num(dm));
  at::Tensor o = at::empty({H, B, D}, q.options());
  entries_linear(ctx.data_ptr<float>(), wv, D * k0, k0, k1, H, B, dm, D, o.data_ptr<float>());  // [H, B, D]
  const at::Tensor out = o.transpose(0, 1) + p_self.unsqueeze(-1) * vh;                       // [B, H, D]
  const at::Tensor kc = kh.contiguous(), vc = vh.contiguous();  // [B, H, D]
  const float *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  const int64_t *pos = seen.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++) {  // the token's key and value enter slot seen % M, after every read of the ring
    const int64_t slot = pos[b] % M;
    for (int64_t h = 0; h < H; h++)
      for (int64_t d = 0; d < D; d++) {
        krows[b][h * rs[0] + slot * rs[1] + d * rs[2]] = kp[(b * H + h) * D + d];
        vrows[b][h * rs[0] + slot * rs[1] + d * rs[2]] = vp[(b * H + h) * D + d];
      }
  }
  return out.reshape({B, 1, H * D});
}

// With `hid` (the rings of layer inputs [B, M, d_model], row-major, before this step's) and `kv` (the key and value
// weights), a batch's one-token step may go through the absorbed kernel (absorbs(), at `absorb_min_bytes` of keys
// and values); the caller stores the step's layer inputs into `hid` afterwards either way.
at::Tensor attend_one(const at::Tensor &qkv, const at::Tensor &u, const at::Tensor &vb, at::Tensor &k,
                      at::Tensor &v, const at::Tensor &table, const at::Tensor &seen, double scale,
                      const std::optional<at::Tensor> &hid, const std::optional<at::Tensor> &kv,
                      int64_t absorb_min_bytes) {
  constexpr const char *op = "txlserve::attend_one";
  TORCH_CHECK_VALUE(k.dim() == 4, op, ": rings must be [batch, heads, mem_len, d_head]");
  const int64_t B = k.size(0), H = k.size(1), M = k.size(2), D = k.size(3);
  TORCH_CHECK_VALUE(is_cpu_float(k) && is_cpu_float(v), op, ": float32 CPU tensors only");
  TORCH_CHECK_VALUE(v.sizes() == k.sizes() && v.strides() == k.strides(), op,
                    ": the value ring must match the key ring");
  TORCH_CHECK_VALUE(qkv.dim() == 3 && qkv.size(0) == B && qkv.size(1) >= 1 && qkv.size(1) <= kMaxChunk &&
                        qkv.size(2) == 3 * H * D && qkv.stride(2) == 1,
                    op, ": qkv must be [batch, 1..", num(kMaxChunk), ", 3*heads*d_head], its last dim contiguous");
  const at::Tensor q = qkv.contiguous();  // row b's L tokens from b*L
  const int64_t L = q.size(1);
  std::vector<int64_t> st(B + 1);
  for (int64_t b = 0; b <= B; b++) st[b] = b * L;
  check_step(op, q, u, vb, table, seen, st.data(), B, H, M, D);
  std::vector<float *> krows(B), vrows(B);
  for (int64_t b = 0; b < B; b++) {
    krows[b] = k.data_ptr<float>() + b * k.stride(0);
    vrows[b] = v.data_ptr<float>() + b * v.stride(0);
  }
  const int64_t rs[3] = {k.stride(1), k.stride(2), k.stride(3)};
  if (hid.has_value() && absorbs(kv, absorb_min_bytes, B, B * L, H, D, M)) {
    const at::Tensor &x = *hid;
    TORCH_CHECK_VALUE(is_cpu_float(x) && x.dim() == 3 && x.size(0) == B && x.size(1) == M &&
                          x.size(2) == kv->size(1) && x.stride(2) == 1 && x.stride(1) == x.size(2),
                      op, ": hid must be float32 [batch, mem_len, d_model], each row's ring row-major");
    std::vector<float *> hrows(B);
    for (int64_t b = 0; b < B; b++) hrows[b] = x.data_ptr<float>() + b * x.stride(0);
    return run_absorbed(op, q, u, vb, *kv, hrows, krows, vrows, rs, table, seen, scale, H, M, D);
  }
  return run_attend(op, q, st.data(), B, u, vb, krows, vrows, rs, table, seen, scale, H, M, D);
}

// attend_one for sessions decoded where they lie (model/cache.RowTable), each with as many new tokens as it has:
// the tokens of `qkv [N, L, 3*H*D]` packed (T = N*L), row b's from start[b] to start[b+1]; its layer input ring
// [M, d_model] (row-major), key and value rings [H, M, D] (strides `ring`) start at the addresses rows[0][b],
// rows[1][b], rows[2][b]. Each row's last min(its tokens, M) layer inputs of `h [N, L, d_model]` are stored too (the
// keys and values by the kernel). The addresses are trusted: the caller keeps every session alive and checked its
// layout as it joined; this checks their form and the layout's, as far as numbers can be checked.
at::Tensor attend_rows(const at::Tensor &qkv, const at::Tensor &start, const at::Tensor &u, const at::Tensor &vb,
                       const at::Tensor &rows, const at::Tensor &h, const at::Tensor &table, const at::Tensor &seen,
                       double scale, at::IntArrayRef ring, const std::optional<at::Tensor> &kv,
                       int64_t absorb_min_bytes) {
  constexpr const char *op = "txlserve::attend_rows";
  TORCH_CHECK_VALUE(rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.dim() == 2 &&
                        rows.size(0) == 3 && rows.stride(1) == 1,
                    op, ": rows must be int64 [3, batch] (layer inputs, keys, values), the batch contiguous");
  TORCH_CHECK_VALUE(table.dim() == 3, op, ": the position table must be [heads, mem_len+1, d_head]");
  const int64_t B = rows.size(1), H = table.size(0), M = table.size(1) - 1, D = table.size(2);
  TORCH_CHECK_VALUE(start.device().is_cpu() && start.scalar_type() == at::kLong && start.dim() == 1 &&
                        start.size(0) == B + 1 && start.is_contiguous(),
                    op, ": start must be contiguous int64 [batch + 1]");
  const at::Tensor q = qkv.contiguous();
  check_step(op, q, u, vb, table, seen, start.data_ptr<int64_t>(), B, H, M, D);
  TORCH_CHECK_VALUE(ring.size() == 3 && ring[0] > 0 && ring[1] > 0 && ring[2] > 0 &&
                        (H - 1) * ring[0] + (M - 1) * ring[1] + (D - 1) * ring[2] == H * M * D - 1,
                    op, ": ring strides must lay out [heads, mem_len, d_head] densely");
  TORCH_CHECK_VALUE(is_cpu_float(h) && h.dim() == 3 && h.size(0) == q.size(0) && h.size(1) == q.size(1),
                    op, ": h must be float32 [.., tokens, d_model], as qkv");
  const at::Tensor hc = h.contiguous();
  const int64_t *addr = rows.data_ptr<int64_t>(), sr = rows.stride(0);
  std::vector<float *> hrows(B), krows(B), vrows(B);
  for (int64_t b = 0; b < B; b++) {
    TORCH_CHECK_VALUE(addr[b] != 0 && addr[sr + b] != 0 && addr[2 * sr + b] != 0, op, ": row ", num(b), " has no rings");
    hrows[b] = reinterpret_cast<float *>(addr[b]);
    krows[b] = reinterpret_cast<float *>(addr[sr + b]);
    vrows[b] = reinterpret_cast<float *>(addr[2 * sr + b]);
  }
  const int64_t rs[3] = {ring[0], ring[1], ring[2]}, *st = start.data_ptr<int64_t>();
  const int64_t dm = hc.size(2), *pos = seen.data_ptr<int64_t>();
  at::Tensor out;
  if (absorbs(kv, absorb_min_bytes, B, q.size(0) * q.size(1), H, D, M) && kv->size(1) == dm)
    out = run_absorbed(op, q.view({B, 1, 3 * H * D}), u, vb, *kv, hrows, krows, vrows, rs, table, seen, scale, H, M,
                       D).view({q.size(0), q.size(1), H * D});
  else
    out = run_attend(op, q, st, B, u, vb, krows, vrows, rs, table, seen, scale, H, M, D);
  const float *hp = hc.data_ptr<float>();
  for (int64_t b = 0; b < B; b++) {  // each row's last tokens' layer inputs enter its ring (seen: before them)
    const int64_t L = st[b + 1] - st[b];
    for (int64_t i = L > M ? L - M : 0; i < L; i++)
      std::copy_n(hp + (st[b] + i) * dm, dm, hrows[b] + ((pos[b] + i) % M) * dm);
  }
  return out;
}

// x W^T + bias, as at::linear computes it: the C loops for float32 x and a weight with one unit stride (row- or
// column-major), at::linear itself for anything else, so a traced step may call it at any batch size.
at::Tensor linear_rows(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
  const bool b_ok = !bias.has_value() || (is_cpu_float(*bias) && bias->dim() == 1 && bias->is_contiguous() &&
                                          weight.dim() == 2 && bias->size(0) == weight.size(0));
  if (!(is_cpu_float(x) && is_cpu_float(weight) && b_ok && weight.dim() == 2 && x.dim() >= 1 &&
        x.size(-1) == weight.size(1) && (weight.stride(1) == 1 || weight.stride(0) == 1)))
    return at::linear(x, weight, bias);
  const int64_t out = weight.size(0), in = weight.size(1), rows = in > 0 ? x.numel() / in : 0;
  if (rows < 1 || out < 1) return at::linear(x, weight, bias);
  const at::Tensor xc = x.reshape({rows, in}).contiguous();  // [rows, in]
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = out;
  at::Tensor y = at::empty(sizes, x.options());  // [..., out], contiguous
  const float *b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const float *xp = xc.data_ptr<float>(), *w = weight.data_ptr<float>();
  float *yp = y.data_ptr<float>();
  // Outputs are independent: torch's intra-op threads take a share of the weight each, in blocks of 64, so
  // that every output is computed by the same instructions (vector body or tail) whatever the thread count.
  constexpr int64_t kBlock = 64;
  at::parallel_for(0, (out + kBlock - 1) / kBlock, 2, [&](int64_t b0, int64_t b1) {
    for (int64_t r = 0; r < rows; r += kRowBlock)
      txl_linear_rows(b0 * kBlock, std::min(out, b1 * kBlock), std::min(kRowBlock, rows - r), in, out,
                      xp + r * in, w, weight.stride(0), weight.stride(1), b, yp + r * out);
  });
  return y;
}

// a @ b for float32 a [B, R, K] and b [B, K, N], each entry's b read as a column-major [N, K] weight by the register
// tiles: the attention's products in a chunked prefill (scores against the keys and the position table, the
// probabilities' sum of the values), 117-119 GMAC/s one thread against torch's bmm at 53-54 for 128 queries of 640
// keys (BENCHMARKS.md). Anything else is torch's bmm.
at::Tensor bmm_rows(const at::Tensor &a, const at::Tensor &b) {
  if (!(is_cpu_float(a) && is_cpu_float(b) && a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) &&
        a.size(2) == b.size(1)))
    return a.bmm(b);
  const int64_t B = a.size(0), R = a.size(1), K = a.size(2), N = b.size(2);
  if (B < 1 || R < 1 || K < 1 || N < 1) return a.bmm(b);
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();  // [B, R, K], [B, K, N]
  at::Tensor y = at::empty({B, R, N}, a.options());           // [B, R, N]
  entries_linear(ac.data_ptr<float>(), bc.data_ptr<float>(), K * N, 1, N, B, R, K, N, y.data_ptr<float>());
  return y;
}

// A prefill chunk's attention probabilities (kernels/chunk_softmax.c), in place: the content scores of its C queries
// against the ring, `ring [N, H, C, M]`, and against the chunk's own keys, `own [N, H, C, C]`, with the position
// scores `pos [H, N, C, M+1]` (the layout of one [H, N*C, Dh] x [H, Dh, M+1] product) of sessions that had seen
// `seen [N]` tokens before the chunk.
void chunk_softmax(at::Tensor &ring, at::Tensor &own, const at::Tensor &pos, const at::Tensor &seen) {
  constexpr const char *op = "txlserve::chunk_softmax";
  TORCH_CHECK_VALUE(is_cpu_float(ring) && is_cpu_float(own) && is_cpu_float(pos), op, ": float32 CPU tensors only");
  TORCH_CHECK_VALUE(ring.dim() == 4 && own.dim() == 4 && pos.dim() == 4, op, ": four dimensions each");
  const int64_t N = ring.size(0), H = ring.size(1), C = ring.size(2), M = ring.size(3);
  TORCH_CHECK_VALUE(M > 0 && own.size(0) == N && own.size(1) == H && own.size(2) == C && own.size(3) == C, op,
                    ": own must be [batch, heads, chunk, chunk] beside ring [batch, heads, chunk, mem_len]");
  TORCH_CHECK_VALUE(pos.size(0) == H && pos.size(1) == N && pos.size(2) == C && pos.size(3) == M + 1, op,
                    ": pos must be [heads, batch, chunk, mem_len+1]");
  TORCH_CHECK_VALUE(ring.is_contiguous() && own.is_contiguous() && pos.is_contiguous(), op,
                    ": ring, own and pos must be contiguous");
  check_seen(op, seen, N);
  const int64_t *sp = seen.data_ptr<int64_t>();
  at::assert_no_overlap(ring, own);  // the C code takes each for its own memory (restrict)
  at::assert_no_overlap(ring, pos);
  at::assert_no_overlap(own, pos);
  // Rows (n, h, i) are independent, each computed whole by one thread: the same bits at any thread count.
  at::parallel_for(0, N * H * C, 16, [&](int64_t r0, int64_t r1) {
    txl_chunk_softmax(r0, r1, N, H, C, M, ring.data_ptr<float>(), own.data_ptr<float>(), pos.data_ptr<float>(), sp);
  });
}

// One token per row of float32 logits [rows, vocab]: drawn with the row's uniform u at its temperature, or the
// first most likely token where the temperature is below greedy_below (model/sampling.py).
at::Tensor sample_rows(const at::Tensor &logits, const at::Tensor &temperature, const at::Tensor &u,
                       double greedy_below) {
  TORCH_CHECK_VALUE(is_cpu_float(logits) && logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1,
                    "txlserve::sample_rows: logits must be float32 CPU [rows, vocab], the vocab contiguous");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  for (const at::Tensor *t : {&temperature, &u})
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->scalar_type() == at::kDouble && t->dim() == 1 &&
                          t->size(0) == rows && t->is_contiguous(),
                      "txlserve::sample_rows: temperature and u must be contiguous float64 [rows]");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));  // [rows]
  std::atomic<int> status{0};
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    const int rc = txl_sample_rows(r0, r1, vocab, logits.data_ptr<float>(), logits.stride(0),
                                   temperature.data_ptr<double>(), u.data_ptr<double>(), greedy_below,
                                   out.data_ptr<int64_t>());
    if (rc != 0) status.store(rc);
  });
  TORCH_CHECK(status.load() == 0, "txlserve::sample_rows: out of memory for ", num(vocab), " probabilities");
  return out;
}

}  // namespace

TORCH_LIBRARY(txlserve, m) {
  m.def("attend_one(Tensor qkv, Tensor u, Tensor vb, Tensor(a!) k, Tensor(b!) v, Tensor table, Tensor seen, "
        "float scale, Tensor? hid=None, Tensor? kv=None, int absorb_min_bytes=0) -> Tensor");
  // It writes rings that are not its arguments (through the addresses in `rows`): TorchScript must not take it for
  // a pure function it may drop, merge or move.
  m.def(torch::schema("attend_rows(Tensor qkv, Tensor start, Tensor u, Tensor vb, Tensor rows, Tensor h, "
                      "Tensor table, Tensor seen, float scale, int[] ring, Tensor? kv=None, "
                      "int absorb_min_bytes=0) -> Tensor",
                      c10::AliasAnalysisKind::CONSERVATIVE));
  m.def("linear_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("bmm_rows(Tensor a, Tensor b) -> Tensor");
  m.def("chunk_softmax(Tensor(a!) ring, Tensor(b!) own, Tensor pos, Tensor seen) -> ()");
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor u, float greedy_below) -> Tensor");
}

TORCH_LIBRARY_IMPL(txlserve, CPU, m) {
  m.impl("attend_one", attend_one);
  m.impl("attend_rows", attend_rows);
  m.impl("linear_rows", linear_rows);
  m.impl("bmm_rows", bmm_rows);
  m.impl("chunk_softmax", chunk_softmax);
  m.impl("sample_rows", sample_rows);
}

"""A GPU decode step's attention as two Triton kernels (imported only where Triton is; ``model.gpu_attention``
calls them).

Split-K "flash-decoding": the ring of each (row, head) is cut into ``S`` spans, one program each, so that a
batch-1 step still fills the GPU; each program returns its span's running maximum, sum of exponentials and
weighted values, and a second kernel joins the spans with the token's own key and value, then stores them into
the ring slot they take (after every span has read the ring, which the second launch orders). The score of ring
slot j for the token at position ``seen``, as :class:`model.transformer_xl.RelPartialLearnableMultiHeadAttn`
computes it with torch ops:

    back(j) = (seen - 1 - j) mod M      (how far back slot j's token is; the slot is empty if back > seen - 1)
    score   = ((q + u) . k_j + (q + v) . (W_r R)[back + 1]) * scale,   itself at distance 0

Loads are in the model's dtype, arithmetic in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

NEG = tl.constexpr(-1.0e30)  # a running maximum's start: finite, so an empty span rescales by exp(0 - ...) = 0, not nan


# Sizes that change with the batch or the memory are not specialised on (Triton compiles a variant per value
# class of each integer argument): a new batch size never compiles a new variant in the middle of serving.
@triton.jit(do_not_specialize=["M", "H", "S", "span"])
def spans(qkv, q_sb, u, vb, k, v, k_sb, k_sh, k_sj, k_sd, v_sb, v_sh, v_sj, v_sd, tab, t_sh, t_sj, t_sd, seen,
          m_out, l_out, acc_out, scale, M, H, S, span,
          D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b * H + h, s): slots [s * span, (s + 1) * span) of row b's ring of head h."""
    bh = tl.program_id(0)
    s = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # row offsets b * k_sb pass 2**31 for large rings and batches
    h = bh % H
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(qkv + b * q_sb + h * D + d, mask=dm, other=0.0).to(tl.float32)
    q_u = (q + tl.load(u + h * D + d, mask=dm, other=0.0).to(tl.float32)) * scale  # [BLOCK_D]
    q_v = (q + tl.load(vb + h * D + d, mask=dm, other=0.0).to(tl.float32)) * scale
    last = tl.load(seen + b) - 1  # the previous token's position (-1: an empty ring)
    m_i = tl.zeros([1], dtype=tl.float32) + NEG
    l_i = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    begin = s * span
    for start in range(begin, begin + span, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] ring slots
        jm = j < M
        back = (last - j + M) % M  # last >= -1 and j < M: never negative
        ok = jm & (back <= last)  # a slot of the ring still empty is never read
        lm = ok[:, None] & dm[None, :]
        kj = tl.load(k + b * k_sb + h * k_sh + j[:, None] * k_sj + d[None, :] * k_sd, mask=lm, other=0.0)
        rj = tl.load(tab + h * t_sh + (back + 1)[:, None] * t_sj + d[None, :] * t_sd, mask=lm, other=0.0)
        score = tl.sum(kj.to(tl.float32) * q_u[None, :], 1) + tl.sum(rj.to(tl.float32) * q_v[None, :], 1)
        score = tl.where(ok, score, float("-inf"))  # [BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(score, 0))  # [1]
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(score - m_new)  # [BLOCK_N]
        vj = tl.load(v + b * v_sb + h * v_sh + j[:, None] * v_sj + d[None, :] * v_sd, mask=lm, other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * vj.to(tl.float32), 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    one = tl.arange(0, 1)
    tl.store(m_out + bh * S + s + one, m_i)
    tl.store(l_out + bh * S + s + one, l_i)
    tl.store(acc_out + (bh * S + s) * BLOCK_D + d, acc)


@triton.jit(do_not_specialize=["M", "H", "S"])
def join(qkv, q_sb, u, vb, k, v, k_sb, k_sh, k_sj, k_sd, v_sb, v_sh, v_sj, v_sd, tab, t_sh, t_sj, t_sd, seen,
         m_in, l_in, acc_in, out, o_sb, scale, M, H, S,
         D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program b * H + h: its spans and the token itself, softmax-weighted; then the token's key and value into
    slot seen % M."""
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = bh % H
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    row = qkv + b * q_sb + h * D + d
    q = tl.load(row, mask=dm, other=0.0).to(tl.float32)
    q_u = (q + tl.load(u + h * D + d, mask=dm, other=0.0).to(tl.float32)) * scale
    q_v = (q + tl.load(vb + h * D + d, mask=dm, other=0.0).to(tl.float32)) * scale
    k_new = tl.load(row + H * D, mask=dm, other=0.0)
    v_new = tl.load(row + 2 * H * D, mask=dm, other=0.0)
    r_0 = tl.load(tab + h * t_sh + d * t_sd, mask=dm, other=0.0).to(tl.float32)
    own = tl.sum(k_new.to(tl.float32) * q_u, 0) + tl.sum(r_0 * q_v, 0)  # the token's score for itself
    i = tl.arange(0, BLOCK_S)
    im = i < S
    m_s = tl.load(m_in + bh * S + i, mask=im, other=NEG)  # [BLOCK_S]
    l_s = tl.load(l_in + bh * S + i, mask=im, other=0.0)
    top = tl.maximum(tl.max(m_s, 0), own)
    w = tl.where(im, tl.exp(m_s - top), 0.0)
    w_own = tl.exp(own - top)
    acc_s = tl.load(acc_in + (bh * S + i)[:, None] * BLOCK_D + d[None, :], mask=im[:, None] & dm[None, :], other=0.0)
    acc = tl.sum(acc_s * w[:, None], 0) + w_own * v_new.to(tl.float32)  # [BLOCK_D]
    total = tl.sum(l_s * w, 0) + w_own
    tl.store(out + b * o_sb + h * D + d, (acc / total).to(out.dtype.element_ty), mask=dm)
    slot = tl.load(seen + b) % M
    tl.store(k + b * k_sb + h * k_sh + slot * k_sj + d * k_sd, k_new.to(k.dtype.element_ty), mask=dm)
    tl.store(v + b * v_sb + h * v_sh + slot * v_sj + d * v_sd, v_new.to(v.dtype.element_ty), mask=dm)

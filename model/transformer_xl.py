"""Transformer-XL (Dai et al., 2019): relative positional attention and segment recurrence.

Batch-first throughout. ``mems`` is one tensor ``[n_layer, batch, mlen, d_model]``
holding the *input* of every layer for the previous ``mlen`` tokens (``None`` when
empty); it is concatenated with the current segment for keys and values only and
updated under no-grad, detached.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import TXLConfig


class PositionalEmbedding(nn.Module):
    """Sinusoidal embedding of relative distances, sin and cos halves concatenated."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0.0, d_model, 2.0) / d_model))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, pos_seq: Tensor) -> Tensor:
        sinusoid = torch.outer(pos_seq.float(), self.inv_freq)  # [klen, d_model/2]
        return torch.cat([sinusoid.sin(), sinusoid.cos()], dim=-1)  # [klen, d_model]


def relative_positions(klen: int, clamp_len: int, device: torch.device | None = None) -> Tensor:
    """Distances klen-1 .. 0 (the order `_rel_shift` expects), clamped at ``clamp_len`` (0: off)."""
    pos_seq = torch.arange(klen - 1, -1, -1, device=device)  # [klen]
    return pos_seq.clamp(max=clamp_len) if clamp_len > 0 else pos_seq


def attn_mask(qlen: int, mlen: int, window: int | None, device: torch.device | None = None) -> Tensor:
    """True where query i may NOT see key j: the future, and with a ``window``
    (``same_length``) keys more than ``window`` tokens back."""
    i = torch.arange(qlen, device=device)[:, None]
    j = torch.arange(mlen + qlen, device=device)[None, :]
    dist = mlen + i - j  # [qlen, klen]
    mask = dist < 0
    if window is not None:
        mask = mask | (dist > window)
    return mask


def _rel_shift(x: Tensor) -> Tensor:
    """Turn scores against distances (klen-1 .. 0) into scores against key positions:
    out[..., i, j] = x[..., i, j + qlen - 1 - i] (valid where j <= i + mlen)."""
    b, h, qlen, klen = x.shape
    zero_pad = x.new_zeros(b, h, qlen, 1)
    x_padded = torch.cat([zero_pad, x], dim=-1).view(b, h, klen + 1, qlen)  # [b, h, klen+1, qlen]
    return x_padded[:, :, 1:].reshape(b, h, qlen, klen)  # [b, h, qlen, klen]


class RelPartialLearnableMultiHeadAttn(nn.Module):
    """score(i, j) = (q_i + u)·k_j  +  (q_i + v)·W_r R_{i-j}  — terms (a)+(c) and (b)+(d)."""

    def __init__(self, cfg: TXLConfig) -> None:
        super().__init__()
        self.n_head, self.d_head, self.pre_lnorm = cfg.n_head, cfg.d_head, cfg.pre_lnorm
        self.qkv_net = nn.Linear(cfg.d_model, 3 * cfg.n_head * cfg.d_head, bias=False)
        self.r_net = nn.Linear(cfg.d_model, cfg.n_head * cfg.d_head, bias=False)
        self.o_net = nn.Linear(cfg.n_head * cfg.d_head, cfg.d_model, bias=False)
        self.layer_norm = nn.LayerNorm(cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.dropatt = nn.Dropout(cfg.dropatt)
        self.scale = 1.0 / math.sqrt(cfg.d_head)

    def forward(self, h: Tensor, r: Tensor, r_w_bias: Tensor, r_r_bias: Tensor, mask: Tensor,
                mems: Tensor | None = None) -> Tensor:
        bsz, qlen, _ = h.shape
        cat = h if mems is None else torch.cat([mems, h], dim=1)  # [bsz, klen, d_model]
        klen = cat.size(1)
        w_heads = self.qkv_net(self.layer_norm(cat) if self.pre_lnorm else cat)  # [bsz, klen, 3*H*Dh]
        q, k, v = w_heads.chunk(3, dim=-1)
        q = q[:, -qlen:].reshape(bsz, qlen, self.n_head, self.d_head)  # [bsz, qlen, H, Dh]
        k = k.reshape(bsz, klen, self.n_head, self.d_head)  # [bsz, klen, H, Dh]
        v = v.reshape(bsz, klen, self.n_head, self.d_head)  # [bsz, klen, H, Dh]
        r_head_k = self.r_net(r).view(klen, self.n_head, self.d_head)  # [klen, H, Dh]

        ac = torch.einsum("bihd,bjhd->bhij", q + r_w_bias, k)  # [bsz, H, qlen, klen]
        bd = _rel_shift(torch.einsum("bihd,jhd->bhij", q + r_r_bias, r_head_k))  # [bsz, H, qlen, klen]
        score = ((ac + bd) * self.scale).masked_fill(mask, float("-inf"))  # [bsz, H, qlen, klen]
        prob = self.dropatt(F.softmax(score.float(), dim=-1).type_as(score))
        attn_vec = torch.einsum("bhij,bjhd->bihd", prob, v).reshape(bsz, qlen, -1)  # [bsz, qlen, H*Dh]
        attn_out = self.drop(self.o_net(attn_vec))  # [bsz, qlen, d_model]
        return h + attn_out if self.pre_lnorm else self.layer_norm(h + attn_out)


class PositionwiseFF(nn.Module):
    def __init__(self, cfg: TXLConfig) -> None:
        super().__init__()
        self.pre_lnorm = cfg.pre_lnorm
        self.core_net = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_inner), nn.ReLU(inplace=True), nn.Dropout(cfg.dropout),
            nn.Linear(cfg.d_inner, cfg.d_model), nn.Dropout(cfg.dropout),
        )
        self.layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        if self.pre_lnorm:
            return x + self.core_net(self.layer_norm(x))
        return self.layer_norm(x + self.core_net(x))


class RelPartialLearnableDecoderLayer(nn.Module):
    def __init__(self, cfg: TXLConfig) -> None:
        super().__init__()
        self.dec_attn = RelPartialLearnableMultiHeadAttn(cfg)
        self.pos_ff = PositionwiseFF(cfg)
        if cfg.untie_r:  # per-layer u and v
            self.r_w_bias = nn.Parameter(torch.zeros(cfg.n_head, cfg.d_head))
            self.r_r_bias = nn.Parameter(torch.zeros(cfg.n_head, cfg.d_head))

    def forward(self, h: Tensor, r: Tensor, r_w_bias: Tensor, r_r_bias: Tensor, mask: Tensor,
                mems: Tensor | None = None) -> Tensor:
        return self.pos_ff(self.dec_attn(h, r, r_w_bias, r_r_bias, mask, mems))


class MemTransformerLM(nn.Module):
    """``forward(tokens [batch, qlen], mems) -> (logits [batch, qlen, vocab], new_mems)``."""

    def __init__(self, cfg: TXLConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.word_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.emb_scale = cfg.d_model**0.5
        self.drop = nn.Dropout(cfg.dropout)
        self.pos_emb = PositionalEmbedding(cfg.d_model)
        self.layers = nn.ModuleList(RelPartialLearnableDecoderLayer(cfg) for _ in range(cfg.n_layer))
        if not cfg.untie_r:  # u and v shared by all layers
            self.r_w_bias = nn.Parameter(torch.zeros(cfg.n_head, cfg.d_head))
            self.r_r_bias = nn.Parameter(torch.zeros(cfg.n_head, cfg.d_head))
        self.out_layer = nn.Linear(cfg.d_model, cfg.vocab_size)
        self.reset_parameters()
        if cfg.tie_weight:
            self.out_layer.weight = self.word_emb.weight

    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith("bias") and p.dim() == 1:
                nn.init.zeros_(p)
            elif "layer_norm.weight" in name:
                nn.init.normal_(p, 1.0, std)
            else:  # linear weights, embeddings, r_w_bias, r_r_bias
                nn.init.normal_(p, 0.0, std)

    def biases(self, i: int) -> tuple[Tensor, Tensor]:
        """(u, v) = (r_w_bias, r_r_bias) of layer ``i``, per layer or shared."""
        owner = self.layers[i] if self.cfg.untie_r else self
        return owner.r_w_bias, owner.r_r_bias

    def hidden(self, tokens: Tensor, mems: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Last layer's output and the new mems; the shared core of logits and loss."""
        cfg = self.cfg
        qlen = tokens.size(1)
        mems = None if mems is None or mems.size(2) == 0 else mems.detach()  # SG(mems): the paper's stop-gradient
        mlen = 0 if mems is None else mems.size(2)
        klen = mlen + qlen
        mask = attn_mask(qlen, mlen, cfg.mem_len if cfg.same_length else None, tokens.device)
        pos_seq = relative_positions(klen, cfg.clamp_len, tokens.device)  # [klen]
        pos_emb = self.drop(self.pos_emb(pos_seq))  # [klen, d_model]

        core_out = self.drop(self.word_emb(tokens) * self.emb_scale)  # [bsz, qlen, d_model]
        hids = [core_out]
        for i, layer in enumerate(self.layers):
            r_w_bias, r_r_bias = self.biases(i)
            core_out = layer(core_out, pos_emb, r_w_bias, r_r_bias, mask, None if mems is None else mems[i])
            hids.append(core_out)
        return self.drop(core_out), self._update_mems(hids[:-1], mems)

    @torch.no_grad()
    def _update_mems(self, hids: list[Tensor], mems: Tensor | None) -> Tensor | None:
        if self.cfg.mem_len == 0:
            return None
        new = torch.stack(hids)  # [n_layer, bsz, qlen, d_model]
        cat = new if mems is None else torch.cat([mems, new], dim=2)  # [n_layer, bsz, mlen+qlen, d_model]
        return cat[:, :, -self.cfg.mem_len:].detach()

    def forward(self, tokens: Tensor, mems: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        h, new_mems = self.hidden(tokens, mems)
        return self.out_layer(h), new_mems  # [bsz, qlen, vocab]

    def loss(self, tokens: Tensor, targets: Tensor, mems: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Per-token negative log-likelihood in nats ``[bsz, qlen]`` and the new mems."""
        logits, new_mems = self(tokens, mems)
        nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
        return nll.view_as(targets), new_mems

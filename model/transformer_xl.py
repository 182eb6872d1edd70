"""Transformer-XL (Dai et al., 2019): relative positional attention and segment recurrence.

Batch-first throughout. ``mems`` is one tensor ``[n_layer, batch, mlen, d_model]``
holding the *input* of every layer for the previous ``mlen`` tokens (``None`` when
empty); it is concatenated with the current segment for keys and values only and
updated under no-grad, detached.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model import fused
from model.adaptive import AdaptiveEmbedding, AdaptiveLogSoftmax
from model.cache import LayerCache, Positions, RingCache
from model.config import TXLConfig


class Dropout(nn.Dropout):
    """``nn.Dropout`` that is not called at all outside training: evaluating and decoding would still dispatch
    18 identity ops per step (4 layers), each giving the GIL up and taking it back."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) if self.training and self.p > 0 else x


class PositionalEmbedding(nn.Module):
    """Sinusoidal embedding of relative distances, sin and cos halves concatenated."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.d_model = d_model
        # a buffer only to follow the model's dtype; the frequencies are computed at that precision
        self.register_buffer("inv_freq", torch.zeros(d_model // 2), persistent=False)

    def forward(self, pos_seq: Tensor) -> Tensor:
        dtype = torch.float64 if self.inv_freq.dtype == torch.float64 else torch.float32  # never 16-bit angles
        inv_freq = 1.0 / (10000 ** (torch.arange(0.0, self.d_model, 2.0, dtype=dtype, device=pos_seq.device)
                                    / self.d_model))  # [d_model/2]
        sinusoid = torch.outer(pos_seq.to(dtype), inv_freq)  # [klen, d_model/2]
        return torch.cat([sinusoid.sin(), sinusoid.cos()], dim=-1)  # [klen, d_model]


def relative_positions(klen: int, clamp_len: int, device: torch.device | None = None) -> Tensor:
    """Distances 0 .. klen-1, clamped at ``clamp_len`` (0: off): the rows of the position table."""
    pos_seq = torch.arange(klen, device=device)  # [klen]
    return pos_seq.clamp(max=clamp_len) if clamp_len > 0 else pos_seq


def attn_mask(qlen: int, mlen: int, window: int | None, device: torch.device | None = None) -> Tensor:
    """True where query i may NOT see key j: the future, and with a ``window``
    (``same_length``) keys more than ``window`` tokens back."""
    dist = segment_distances(qlen, mlen, device)  # [qlen, klen]
    mask = dist < 0
    if window is not None:
        mask = mask | (dist > window)
    return mask


def segment_distances(qlen: int, mlen: int, device: torch.device | None = None) -> Tensor:
    """``i - j`` for query i (after ``mlen`` memory tokens) and key j: [qlen, mlen+qlen]."""
    return mlen + torch.arange(qlen, device=device)[:, None] - torch.arange(mlen + qlen, device=device)


def segment_positions(qlen: int, mlen: int, cfg: TXLConfig, r: Tensor) -> Positions:
    """A segment after ``mlen`` memory tokens; ``r`` holds the sinusoids of distances 0..klen-1 (clamped)."""
    dist = segment_distances(qlen, mlen, r.device)  # [qlen, klen]
    blocked = attn_mask(qlen, mlen, cfg.mem_len if cfg.same_length else None, r.device)
    return Positions(dist.clamp(min=0)[None, None], blocked[None, None], r)


def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores are normalised in fp32 for 16-bit models and in the model's own precision otherwise."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def fused_step(h: Tensor, cache: LayerCache | None) -> bool:
    """Whether this call's attention is one kernel call: on a CPU a decode step, a short prompt (up to
    ``fused.MAX_CHUNK`` tokens) or sessions where they lie (up to as many a row, packed), in C
    (:mod:`model.fused`); on a GPU a decode step's one token a row, in Triton (:mod:`model.gpu_attention`). The
    cache says which (``RingCache.fused``)."""
    return cache is not None and cache.fused and (cache.addr is not None or h.size(1) <= fused.MAX_CHUNK)


def fused_products(cache: LayerCache | None) -> bool:
    """Whether this call's products go through ``txlserve::linear_rows``: a fused cache's calls, a decode step's
    few rows, and a prefill chunk's many where ``Decoder.tune_products`` found the tiles the faster on this host
    (training keeps torch's, which have a backward)."""
    return cache is not None and cache.products


def linear(layer: nn.Linear, x: Tensor, kernel: bool = False, weight: Tensor | None = None) -> Tensor:
    """``layer(x)``, or by ``weight`` (rows of the layer's: the memory's keys and values only); with ``kernel``
    (:func:`fused_products`), ``txlserve::linear_rows``: the same product, its weight streamed once for a step's
    few rows (torch's few-row products read it at half the bandwidth, or slower), a chunk's rows in register
    tiles (twice torch's speed on the AMD hosts; slower than torch's on an AVX-512 host, where
    ``Decoder.tune_products`` keeps torch's for chunks, BENCHMARKS.md)."""
    w, b = (layer.weight, layer.bias) if weight is None else (weight, None)
    return fused.linear_rows(x, w, b) if kernel else F.linear(x, w, b)


def _first(mm: Callable[[Tensor, Tensor], Tensor], a: Tensor, b: Tensor, n: int | None) -> Tensor:
    """``mm(a, b)`` [..., R, N] with only its first ``n`` columns computed (all where ``n`` is None), the rest left
    unwritten: the scores of a young ring, whose later slots the chunk's softmax never reads (it writes their
    probabilities 0). The same dot products, which a narrower product may round differently in the last bit."""
    if n is None or n >= b.size(-1):
        return mm(a, b).contiguous()
    out = a.new_empty(*a.shape[:-1], b.size(-1))  # [..., R, N]
    if n:
        out[..., :n] = mm(a, b[..., :n])
    return out


class RelPartialLearnableMultiHeadAttn(nn.Module):
    """score(i, j) = (q_i + u)·k_j  +  (q_i + v)·W_r R_{i-j}  — terms (a)+(c) and (b)+(d).

    The one attention of the model, for training, evaluation, prefill and decode. Keys and
    values come from the segment and, when training, from ``mems`` projected here; when
    decoding, from the ``cache`` ring, which holds them projected once, with the position
    table ``W_r R``; the chunk's own keys and values are then stored into the ring."""

    def __init__(self, cfg: TXLConfig) -> None:
        super().__init__()
        self.n_head, self.d_head, self.pre_lnorm = cfg.n_head, cfg.d_head, cfg.pre_lnorm
        self.qkv_net = nn.Linear(cfg.d_model, 3 * cfg.n_head * cfg.d_head, bias=False)
        self.r_net = nn.Linear(cfg.d_model, cfg.n_head * cfg.d_head, bias=False)
        self.o_net = nn.Linear(cfg.n_head * cfg.d_head, cfg.d_model, bias=False)
        self.layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.drop = Dropout(cfg.dropout)
        self.dropatt = Dropout(cfg.dropatt)
        self.scale = 1.0 / math.sqrt(cfg.d_head)

    def _heads(self, x: Tensor) -> Tensor:
        n = x.size(-1) // (self.n_head * self.d_head)  # named, not -1: a length of 0 must still split
        return x.view(x.size(0), x.size(1), n, self.n_head, self.d_head).permute(2, 0, 3, 1, 4)  # [n, b, H, len, Dh]

    def project(self, h: Tensor, kernel: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v ``[batch, H, len, Dh]`` of the layer inputs ``h [batch, len, d_model]``."""
        q, k, v = self._heads(linear(self.qkv_net, self.layer_norm(h) if self.pre_lnorm else h, kernel))
        return q, k, v

    def project_kv(self, h: Tensor, kernel: bool = False) -> tuple[Tensor, Tensor]:
        """Keys and values only (the memory needs no queries): ``[batch, H, len, Dh]`` each."""
        x = self.layer_norm(h) if self.pre_lnorm else h
        kv = self.qkv_net.weight[self.n_head * self.d_head:]  # [2*H*Dh, d_model]
        k, v = self._heads(linear(self.qkv_net, x, kernel, weight=kv))
        return k, v

    def position_keys(self, r: Tensor) -> Tensor:
        """``W_r R``: the position table [H, n_dist, Dh] for sinusoids ``r [n_dist, d_model]``."""
        return self.r_net(r).view(-1, self.n_head, self.d_head).transpose(0, 1)

    def forward(self, h: Tensor, pos: Positions, r_w_bias: Tensor, r_r_bias: Tensor, mems: Tensor | None = None,
                cache: LayerCache | None = None) -> Tensor:
        kernel = fused_products(cache)
        if fused_step(h, cache):  # a decode step (a CPU's short prompt too): the same math in one kernel call
            qkv = linear(self.qkv_net, self.layer_norm(h) if self.pre_lnorm else h, kernel)  # [bsz, qlen, 3*H*Dh]
            # W_k, W_v, where a CPU step may apply them to the ring of inputs h itself (not to a normalised h)
            absorbable = cache.absorb is not None and not self.pre_lnorm
            kv = self.qkv_net.weight[self.n_head * self.d_head:] if absorbable else None  # [2*H*Dh, d_model]
            vec = cache.attend(qkv, h, r_w_bias, r_r_bias, self.scale, kv)  # [bsz, qlen, H*Dh]; h, k, v in the ring now
        else:
            vec = self._attend(h, pos, r_w_bias, r_r_bias, mems, cache, kernel)  # [bsz, qlen, H*Dh]
        attn_out = self.drop(linear(self.o_net, vec, kernel))  # [bsz, qlen, d_model]
        return h + attn_out if self.pre_lnorm else self.layer_norm(h + attn_out)

    def _attend(self, h: Tensor, pos: Positions, r_w_bias: Tensor, r_r_bias: Tensor, mems: Tensor | None,
                cache: LayerCache | None, kernel: bool) -> Tensor:
        bsz, qlen, _ = h.shape
        mm = fused.matmul if kernel else torch.matmul  # the C products where the cache takes them, else torch's
        q, k, v = self.project(h, kernel)  # [bsz, H, qlen, Dh]
        if cache is not None:
            blocks, r_head_k = [(cache.k, cache.v), (k, v)], cache.r_head_k  # ring, then the chunk
        else:
            blocks = [(k, v)] if mems is None else [self.project_kv(mems), (k, v)]
            r_head_k = self.position_keys(pos.r)  # [H, n_dist, Dh]
        # the scale applied to the queries, not to the scores: one pass over [bsz, H, qlen, Dh] instead of
        # [bsz, H, qlen, klen] (exact for power-of-two d_head, where the scale is too)
        q_u, q_v = (q + r_w_bias[:, None]) * self.scale, (q + r_r_bias[:, None]) * self.scale  # [bsz, H, qlen, Dh]
        # one [H, bsz*qlen, Dh] x [H, Dh, n_dist] product: broadcasting the table over the batch would copy it
        q_v = q_v.transpose(0, 1).reshape(self.n_head, -1, self.d_head)  # [H, bsz*qlen, Dh]
        if cache is not None and cache.softmax:  # a CPU's chunk (no dropout: never while training): the next
            # five passes, in one pass a query; the products' outputs are contiguous already (free if so)
            n = cache.filled  # a young ring's scores: its slots [0, n), distances below n + qlen
            probs = [_first(mm, q_u, cache.k.transpose(-1, -2), n), mm(q_u, k.transpose(-1, -2)).contiguous()]
            bd = _first(mm, q_v, r_head_k.transpose(-1, -2), None if n is None else n + qlen)  # [H, bsz*qlen, m+1]
            fused.chunk_softmax(*probs, bd.view(self.n_head, bsz, qlen, -1), cache.seen)  # in place
        else:
            acs = [mm(q_u, kb.transpose(-1, -2)) for kb, _ in blocks]  # [bsz, H, qlen, len(block)] each
            bd = mm(q_v, r_head_k.transpose(-1, -2)).view(self.n_head, bsz, qlen, -1).transpose(0, 1)
            # [bsz, H, qlen, n_dist]
            bd = bd.gather(-1, pos.dist.expand(bsz, self.n_head, qlen, -1))  # [bsz, H, qlen, klen]
            ac = acs[0] if len(acs) == 1 else torch.cat(acs, -1)  # [bsz, H, qlen, klen]
            score = ac.add_(bd).masked_fill_(pos.blocked, float("-inf"))  # [bsz, H, qlen, klen], in place
            prob = self.dropatt(F.softmax(score.to(softmax_dtype(score.dtype)), dim=-1).type_as(score))
            probs = prob.split([kb.size(2) for kb, _ in blocks], -1)
        vec = None
        for p, (_, vb) in zip(probs, blocks):
            part = mm(p, vb)  # [bsz, H, qlen, Dh]
            vec = part if vec is None else vec + part
        if cache is not None:
            cache.store(h, k, v)
        return vec.transpose(1, 2).reshape(bsz, qlen, -1)  # [bsz, qlen, H*Dh]


class PositionwiseFF(nn.Module):
    def __init__(self, cfg: TXLConfig) -> None:
        super().__init__()
        self.pre_lnorm = cfg.pre_lnorm
        self.core_net = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_inner), nn.ReLU(inplace=True), Dropout(cfg.dropout),
            nn.Linear(cfg.d_inner, cfg.d_model), Dropout(cfg.dropout),
        )
        self.layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    def forward(self, x: Tensor, kernel: bool = False) -> Tensor:
        """``kernel``: a call on a fused cache (:func:`fused_products`), whose products go through the C kernel."""
        core = self._core(self.layer_norm(x) if self.pre_lnorm else x, kernel)  # [bsz, qlen, d_model]
        return x + core if self.pre_lnorm else self.layer_norm(x + core)

    def _core(self, x: Tensor, kernel: bool) -> Tensor:
        if not kernel:
            return self.core_net(x)
        inner, outer = self.core_net[0], self.core_net[3]  # its dropouts are identities outside training
        return linear(outer, F.relu(linear(inner, x, kernel)), kernel)


class RelPartialLearnableDecoderLayer(nn.Module):
    def __init__(self, cfg: TXLConfig) -> None:
        super().__init__()
        self.dec_attn = RelPartialLearnableMultiHeadAttn(cfg)
        self.pos_ff = PositionwiseFF(cfg)
        if cfg.untie_r:  # per-layer u and v
            self.r_w_bias = nn.Parameter(torch.zeros(cfg.n_head, cfg.d_head))
            self.r_r_bias = nn.Parameter(torch.zeros(cfg.n_head, cfg.d_head))

    def forward(self, h: Tensor, pos: Positions, r_w_bias: Tensor, r_r_bias: Tensor, mems: Tensor | None = None,
                cache: LayerCache | None = None) -> Tensor:
        return self.pos_ff(self.dec_attn(h, pos, r_w_bias, r_r_bias, mems, cache), fused_products(cache))


class MemTransformerLM(nn.Module):
    """``forward(tokens [batch, qlen], mems) -> (logits [batch, qlen, vocab], new_mems)``.

    Input and output layers are adaptive (:mod:`model.adaptive`); a byte model's are a plain
    embedding and softmax. Logits are scores whose log-softmax is the log-probability (already
    log-probabilities with an adaptive softmax): :meth:`loss` and scoring never build them."""

    def __init__(self, cfg: TXLConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.word_emb = AdaptiveEmbedding(cfg)
        self.drop = Dropout(cfg.dropout)
        self.pos_emb = PositionalEmbedding(cfg.d_model)
        self.layers = nn.ModuleList(RelPartialLearnableDecoderLayer(cfg) for _ in range(cfg.n_layer))
        if not cfg.untie_r:  # u and v shared by all layers
            self.r_w_bias = nn.Parameter(torch.zeros(cfg.n_head, cfg.d_head))
            self.r_r_bias = nn.Parameter(torch.zeros(cfg.n_head, cfg.d_head))
        self.crit = AdaptiveLogSoftmax(cfg)
        self.reset_parameters()
        self.tie_weights()

    def tie_weights(self) -> None:
        """The softmax shares the embedding's tables (``tie_weight``) and, per cluster, its projections
        (``tie_projs``), as the reference ties them; called again after weights are loaded by assignment."""
        emb, crit = self.word_emb, self.crit
        if self.cfg.tie_weight:
            for out, layer in zip(crit.out_layers, emb.emb_layers):
                out.weight = layer.weight
        for i, tied in enumerate(self.cfg.tie_projs):
            if tied and len(crit.out_projs) > i and len(emb.emb_projs):
                crit.out_projs[i] = emb.emb_projs[0 if self.cfg.div_val == 1 else i]

    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.is_meta:  # built to be loaded by assignment: nothing to draw (and meta's normal_ imports dynamo)
                continue
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

    def hidden(self, tokens: Tensor, mems: Tensor | None = None, *,
               cache: RingCache | None = None) -> tuple[Tensor, Tensor | None]:
        """Last layer's output and the new mems; the shared core of logits and loss.

        With a ``cache`` (decoding) the memory is the cache's ring, which the layers update in
        place; the new mems are then None."""
        cfg = self.cfg
        qlen = tokens.size(1)
        if cache is not None:
            pos, mems = cache.positions, None
        else:
            mems = None if mems is None or mems.size(2) == 0 else mems.detach()  # SG(mems): the paper's stop-gradient
            mlen = 0 if mems is None else mems.size(2)
            r = self.pos_emb(relative_positions(mlen + qlen, cfg.clamp_len, tokens.device))  # [klen, d_model]
            r = self.drop(r.to(self.crit.out_layers[0].weight.dtype))
            pos = segment_positions(qlen, mlen, cfg, r)
        core_out = self.drop(self.word_emb(tokens))  # [bsz, qlen, d_model]
        hids = [core_out]
        for i, layer in enumerate(self.layers):
            r_w_bias, r_r_bias = self.biases(i)
            core_out = layer(core_out, pos, r_w_bias, r_r_bias, None if mems is None else mems[i],
                             None if cache is None else cache.layer(i))
            hids.append(core_out)
        if cache is not None:
            return self.drop(core_out), None
        return self.drop(core_out), self._update_mems(hids[:-1], mems)

    @torch.no_grad()
    def _update_mems(self, hids: list[Tensor], mems: Tensor | None) -> Tensor | None:
        if self.cfg.mem_len == 0:
            return None
        new = torch.stack(hids)  # [n_layer, bsz, qlen, d_model]
        cat = new if mems is None else torch.cat([mems, new], dim=2)  # [n_layer, bsz, mlen+qlen, d_model]
        return cat[:, :, -self.cfg.mem_len:].detach()

    def forward(self, tokens: Tensor, mems: Tensor | None = None, *, cache: RingCache | None = None,
                targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits ``[bsz, qlen, vocab]`` and the new mems; with ``targets [bsz, qlen]`` the per-token
        negative log-likelihood in nats ``[bsz, qlen]`` instead (training goes through here, so DDP sees it)."""
        h, new_mems = self.hidden(tokens, mems, cache=cache)
        if targets is not None:
            return -self.crit.target_logprob(h, targets), new_mems
        return self.crit.logits(h), new_mems

    def loss(self, tokens: Tensor, targets: Tensor, mems: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Per-token negative log-likelihood in nats ``[bsz, qlen]`` and the new mems."""
        return self(tokens, mems, targets=targets)

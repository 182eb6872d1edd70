"""Adaptive input embeddings and the projected adaptive log-softmax, as the paper's word-level models use them.

A vocabulary of hundreds of thousands of words is split by frequency into clusters
``[0, c0), [c0, c1), ..., [c_last, vocab)``. Cluster i lives in ``d_embed // div_val**i``
dimensions (rare words get small vectors), projected to and from ``d_model``. The
softmax is two-level: a head over the frequent words plus one entry per tail cluster,
then a softmax inside the chosen cluster, so a word's log-probability is
``log p(cluster) + log p(word | cluster)``. With no cutoffs and ``d_embed == d_model``
both layers reduce to a plain embedding and a plain linear softmax.

Parameter names are the reference's (``emb_layers``, ``emb_projs``, ``out_layers``,
``out_projs``, ``cluster_weight``, ``cluster_bias``), so imported weights map one to one.
Scoring given targets (:meth:`AdaptiveLogSoftmax.target_logprob`) never builds the
``[tokens, vocab]`` table; only a next-token distribution does (:meth:`~AdaptiveLogSoftmax.logits`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import TXLConfig


def cluster_bounds(cfg: TXLConfig) -> list[tuple[int, int]]:
    """``(start, end)`` token ids of the head cluster and of each tail cluster."""
    ends = [0, *cfg.cutoffs, cfg.vocab_size]
    return list(zip(ends, ends[1:]))


def cluster_dims(cfg: TXLConfig) -> list[int]:
    """Embedding width of each cluster's own weights (all ``d_embed`` when ``div_val`` is 1: one shared table)."""
    return [cfg.d_embed // cfg.div_val**i for i in range(cfg.n_clusters + 1)]


def _embedding(n: int, d: int) -> nn.Embedding:
    """``nn.Embedding(n, d)``; built on the meta device (a checkpoint about to be assigned), without its
    ``normal_`` init, whose meta version imports torch._dynamo: 1.8 s of every server and CLI start. (The model's
    ``reset_parameters`` initialises every real table again anyway.)"""
    if torch.empty(0).is_meta:  # under ``with torch.device("meta")``
        return nn.Embedding(n, d, _weight=torch.empty(n, d))
    return nn.Embedding(n, d)


class AdaptiveEmbedding(nn.Module):
    """``tokens [batch, len] -> [batch, len, d_model]``, scaled by ``sqrt(d_model)`` as in the paper."""

    def __init__(self, cfg: TXLConfig) -> None:
        super().__init__()
        self.bounds, self.emb_scale = cluster_bounds(cfg), cfg.d_model**0.5
        self.emb_layers, self.emb_projs = nn.ModuleList(), nn.ParameterList()
        if cfg.div_val == 1:  # one table for the whole vocabulary
            self.emb_layers.append(_embedding(cfg.vocab_size, cfg.d_embed))
            if cfg.d_embed != cfg.d_model:
                self.emb_projs.append(nn.Parameter(torch.empty(cfg.d_model, cfg.d_embed)))
        else:
            for (lo, hi), d in zip(self.bounds, cluster_dims(cfg)):
                self.emb_layers.append(_embedding(hi - lo, d))
                self.emb_projs.append(nn.Parameter(torch.empty(cfg.d_model, d)))

    def forward(self, tokens: Tensor) -> Tensor:
        if len(self.emb_layers) == 1:
            emb = self.emb_layers[0](tokens)  # [batch, len, d_embed]
            if len(self.emb_projs):
                emb = F.linear(emb, self.emb_projs[0])  # [batch, len, d_model]
            return emb * self.emb_scale
        flat = tokens.reshape(-1)  # [n]
        out: Tensor | None = None  # [n, d_model], in the dtype the projections produce (bf16 under autocast)
        for (lo, hi), layer, proj in zip(self.bounds, self.emb_layers, self.emb_projs):
            idx = ((flat >= lo) & (flat < hi)).nonzero().squeeze(1)  # [n_i]
            if idx.numel():
                piece = F.linear(layer(flat[idx] - lo), proj)  # [n_i, d_model]
                if out is None:
                    out = piece.new_zeros(flat.numel(), piece.size(1))
                out.index_copy_(0, idx, piece.to(out.dtype))
        if out is None:  # no tokens at all
            out = self.emb_projs[0].new_zeros(0, self.emb_projs[0].size(0))
        return out.view(*tokens.shape, -1) * self.emb_scale


class AdaptiveLogSoftmax(nn.Module):
    """The output layer: next-token scores from the last layer's ``h [..., d_model]``."""

    def __init__(self, cfg: TXLConfig) -> None:
        super().__init__()
        self.bounds, self.shortlist = cluster_bounds(cfg), cluster_bounds(cfg)[0][1]
        n_tail = cfg.n_clusters
        if n_tail:
            self.cluster_weight = nn.Parameter(torch.zeros(n_tail, cfg.d_embed))
            self.cluster_bias = nn.Parameter(torch.zeros(n_tail))
        self.out_layers, self.out_projs = nn.ModuleList(), nn.ParameterList()
        if cfg.div_val == 1:  # one table, sliced per cluster; a projection per cluster when d_embed differs
            self.out_layers.append(nn.Linear(cfg.d_embed, cfg.vocab_size))
            if cfg.d_embed != cfg.d_model:
                for _ in self.bounds:
                    self.out_projs.append(nn.Parameter(torch.empty(cfg.d_model, cfg.d_embed)))
        else:
            for (lo, hi), d in zip(self.bounds, cluster_dims(cfg)):
                self.out_layers.append(nn.Linear(d, hi - lo))
                self.out_projs.append(nn.Parameter(torch.empty(cfg.d_model, d)))

    def _cluster(self, i: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """Weight, bias and projection of cluster i; the head carries one extra row per tail cluster."""
        if len(self.out_layers) == 1:
            lo, hi = self.bounds[i]
            weight, bias = self.out_layers[0].weight[lo:hi], self.out_layers[0].bias[lo:hi]
        else:
            weight, bias = self.out_layers[i].weight, self.out_layers[i].bias
        if i == 0 and len(self.bounds) > 1:
            weight = torch.cat([weight, self.cluster_weight])  # [shortlist + n_tail, d_i]
            bias = torch.cat([bias, self.cluster_bias])
        proj = self.out_projs[i] if len(self.out_projs) else None  # [d_model, d_i]
        return weight, bias, proj

    def _cluster_logprobs(self, h: Tensor, i: int) -> Tensor:
        weight, bias, proj = self._cluster(i)
        if proj is not None:
            h = h @ proj  # [n, d_i]
        return F.log_softmax(F.linear(h, weight, bias).float(), dim=-1)  # [n, cluster size (+ n_tail)]

    def logits(self, h: Tensor) -> Tensor:
        """Scores over the whole vocabulary ``[..., vocab]`` whose log-softmax is the model's log-probability:
        the raw logits of a plain softmax, the log-probabilities themselves of an adaptive one (float32)."""
        flat = h.reshape(-1, h.size(-1))  # [n, d_model]
        if len(self.bounds) == 1:
            weight, bias, proj = self._cluster(0)
            x = flat if proj is None else flat @ proj
            return F.linear(x, weight, bias).float().view(*h.shape[:-1], -1)  # [..., vocab]
        head = self._cluster_logprobs(flat, 0)  # [n, shortlist + n_tail]
        parts = [head[:, :self.shortlist]]
        for i in range(1, len(self.bounds)):
            parts.append(head[:, self.shortlist + i - 1, None] + self._cluster_logprobs(flat, i))  # [n, size_i]
        return torch.cat(parts, dim=-1).view(*h.shape[:-1], -1)  # [..., vocab]

    def target_logprob(self, h: Tensor, target: Tensor) -> Tensor:
        """``log p(target)`` for ``h [..., d_model]`` and ``target [...]`` (float32), cluster by cluster:
        only the head and the clusters the targets fall in are computed, never a ``[n, vocab]`` table."""
        flat, tgt = h.reshape(-1, h.size(-1)), target.reshape(-1)  # [n, d_model], [n]
        if len(self.bounds) == 1:
            return self.logits(flat).log_softmax(-1).gather(1, tgt[:, None]).view(target.shape)
        head = self._cluster_logprobs(flat, 0)  # [n, shortlist + n_tail]
        out = torch.empty(tgt.numel(), dtype=torch.float32, device=tgt.device)  # [n]
        for i, (lo, hi) in enumerate(self.bounds):
            idx = ((tgt >= lo) & (tgt < hi)).nonzero().squeeze(1)  # [n_i]
            if not idx.numel():
                continue
            if i == 0:
                out[idx] = head[idx].gather(1, tgt[idx, None]).squeeze(1)
            else:
                tail = self._cluster_logprobs(flat[idx], i)  # [n_i, size_i]
                out[idx] = head[idx, self.shortlist + i - 1] + tail.gather(1, (tgt[idx] - lo)[:, None]).squeeze(1)
        return out.view(target.shape)

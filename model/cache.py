"""The decode cache: what a batch of sessions keeps between calls, and how one call sees it.

A session's keys and values are projected once, when its tokens enter the memory,
and kept in a per-layer ring of ``mem_len`` slots (slot = position % mem_len) beside
the layer inputs (the paper's mems). The attention module reads and writes the ring
through a :class:`LayerCache` (gpt-fast's pattern: the cache update happens inside
the one attention); nothing here computes attention.

Every query attends to itself and exactly the ``mem_len`` tokens before it, so a
ring of ``mem_len`` slots plus the chunk being fed is all a call ever needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Positions:
    """Where each query may look, and at which relative distance: shared by every layer of one call."""

    dist: Tensor  # [batch|1, 1, qlen, klen] int64: row of the position table (distance, clamped)
    blocked: Tensor  # [batch|1, 1, qlen, klen] bool: True where query i may not see key j
    r: Tensor | None = None  # [n_dist, d_model] sinusoids R_0.. for the layers to project; None with a cache


@dataclass
class DecodeState:
    """The hot form of a batch of sessions; rings are indexed by absolute position % mem_len."""

    hid: Tensor  # [n_layer, batch, mem_len, d_model]  layer inputs (the paper's mems)
    k: Tensor  # [n_layer, batch, n_head, mem_len, d_head]
    v: Tensor  # [n_layer, batch, n_head, mem_len, d_head]
    seen: Tensor  # [batch] int64: tokens seen
    last_logits: Tensor  # [batch, vocab]: the prediction after the last token seen

    @property
    def batch(self) -> int:
        return self.seen.numel()

    def rows(self, index: list[int] | Tensor) -> DecodeState:
        idx = torch.as_tensor(index, device=self.seen.device, dtype=torch.long)
        return DecodeState(self.hid[:, idx], self.k[:, idx], self.v[:, idx], self.seen[idx], self.last_logits[idx])

    @staticmethod
    def cat(states: list[DecodeState]) -> DecodeState:
        if len(states) == 1:
            return states[0]
        return DecodeState(torch.cat([s.hid for s in states], 1), torch.cat([s.k for s in states], 1),
                           torch.cat([s.v for s in states], 1), torch.cat([s.seen for s in states]),
                           torch.cat([s.last_logits for s in states]))


@dataclass
class LayerCache:
    """One layer's ring during one call: the keys/values to attend over before the chunk's own, the
    position table ``W_r R_d`` (d = 0..mem_len) projected once, and where the chunk's last tokens go."""

    hid: Tensor  # [batch, mem_len, d_model]
    k: Tensor  # [batch, n_head, mem_len, d_head]
    v: Tensor  # [batch, n_head, mem_len, d_head]
    r_head_k: Tensor  # [n_head, mem_len+1, d_head]
    rows: Tensor  # [batch, 1]
    slots: Tensor  # [batch, keep]: ring slots of the chunk's last `keep` tokens

    def store(self, h: Tensor, k: Tensor, v: Tensor) -> None:
        """Put the chunk's last ``keep`` layer inputs ``h [batch, chunk, d]`` and keys/values
        ``[batch, H, chunk, Dh]`` into the ring, after the attention has read it."""
        keep = self.slots.size(1)
        self.hid[self.rows, self.slots] = h[:, -keep:]  # [batch, keep, d_model]
        self.k[self.rows, :, self.slots] = k[:, :, -keep:].transpose(1, 2)  # [batch, keep, H, Dh]
        self.v[self.rows, :, self.slots] = v[:, :, -keep:].transpose(1, 2)


class RingCache:
    """A :class:`DecodeState` as one call of ``chunk`` tokens sees it."""

    def __init__(self, state: DecodeState, r_head_k: Tensor, chunk: int) -> None:
        self.state, self.r_head_k, self.chunk = state, r_head_k, chunk  # r_head_k [n_layer, H, mem_len+1, Dh]
        m, seen, dev = state.k.size(3), state.seen, state.seen.device
        keep = min(chunk, m)  # only the last mem_len tokens of a chunk enter the ring
        self.rows = torch.arange(state.batch, device=dev)[:, None]  # [batch, 1]
        self.slots = (seen[:, None] + torch.arange(chunk - keep, chunk, device=dev)).remainder(m)  # [batch, keep]
        pos = seen[:, None] + torch.arange(chunk, device=dev)  # [batch, chunk]
        last = seen[:, None] - 1  # [batch, 1]
        p_ring = last - (last - torch.arange(m, device=dev)).remainder(m)  # [batch, mem_len] slot positions
        d_ring = pos[:, :, None] - p_ring[:, None, :]  # [batch, chunk, mem_len]
        d_self = torch.arange(chunk, device=dev)[:, None] - torch.arange(chunk, device=dev)  # [chunk, chunk]
        dist = torch.cat([d_ring, d_self.expand(state.batch, chunk, chunk)], dim=-1)  # [batch, chunk, m+chunk]
        blocked = (dist < 0) | (dist > m)
        blocked[:, :, :m] |= (p_ring < 0)[:, None, :]  # empty slots
        self.positions = Positions(dist.clamp(0, m)[:, None], blocked[:, None])

    def layer(self, i: int) -> LayerCache:
        s = self.state
        return LayerCache(s.hid[i], s.k[i], s.v[i], self.r_head_k[i], self.rows, self.slots)

    def advance(self, last_logits: Tensor) -> None:
        self.state.seen += self.chunk
        self.state.last_logits = last_logits  # [batch, vocab]

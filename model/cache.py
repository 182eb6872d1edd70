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

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from model.fused import MAX_CHUNK


def column_major(t: Tensor) -> Tensor:
    """``t`` unchanged in shape and values, its last two dims stored transposed. On a CPU a product with one
    query row (``q @ K^T``, ``p @ V``, ``x @ W^T``) streams long contiguous rows this way: 1.3-2.2x faster for
    keys, position tables and widening weights (``bench decode``, BENCHMARKS.md)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _same_layout(like: Tensor, t: Tensor) -> Tensor:
    return column_major(t) if like.dim() > 1 and like.stride(-2) == 1 and like.size(-1) > 1 else t


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
    k: Tensor  # [n_layer, batch, n_head, mem_len, d_head]  (on a CPU stored column-major: see column_major)
    v: Tensor  # [n_layer, batch, n_head, mem_len, d_head]
    seen: Tensor  # [batch] int64: tokens seen
    last_logits: Tensor  # [batch, vocab]: the prediction after the last token seen

    @property
    def batch(self) -> int:
        return self.seen.numel()

    def rows(self, index: list[int] | Tensor) -> DecodeState:
        idx = torch.as_tensor(index, device=self.seen.device, dtype=torch.long)
        k, v = _same_layout(self.k, self.k[:, idx]), _same_layout(self.v, self.v[:, idx])  # rings keep their layout
        return DecodeState(self.hid[:, idx], k, v, self.seen[idx], self.last_logits[idx])

    def span(self, start: int, end: int) -> DecodeState:
        """Rows [start, end) as views: a step on them writes through (``last_logits`` is replaced, not written)."""
        rows = slice(start, end)
        return DecodeState(self.hid[:, rows], self.k[:, rows], self.v[:, rows], self.seen[rows], self.last_logits[rows])

    def copy_row(self, dst: int, src: DecodeState, row: int = 0) -> None:
        """Row ``dst`` becomes a copy of ``src``'s row ``row``: one session's rings, nobody else's."""
        self.hid[:, dst] = src.hid[:, row]
        self.k[:, dst] = src.k[:, row]
        self.v[:, dst] = src.v[:, row]
        self.seen[dst] = src.seen[row]
        self.last_logits[dst] = src.last_logits[row]

    @property
    def row_bytes(self) -> int:
        """Device bytes one session occupies here."""
        return sum(t[:, :1].nbytes for t in (self.hid, self.k, self.v)) + self.last_logits[:1].nbytes + 8

    @staticmethod
    def cat(states: list[DecodeState]) -> DecodeState:
        if len(states) == 1:
            return states[0]
        k0, v0 = states[0].k, states[0].v
        return DecodeState(torch.cat([s.hid for s in states], 1),
                           _same_layout(k0, torch.cat([s.k for s in states], 1)),
                           _same_layout(v0, torch.cat([s.v for s in states], 1)), torch.cat([s.seen for s in states]),
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
    seen: Tensor  # [batch] int64: tokens before the chunk
    fused: bool = False  # calls of up to MAX_CHUNK tokens attend in one C call (model.fused)
    products: bool = False  # every call's products go through the C kernel (model.fused.linear_rows)

    def store(self, h: Tensor, k: Tensor, v: Tensor) -> None:
        """Put the chunk's last ``keep`` layer inputs ``h [batch, chunk, d]`` and keys/values
        ``[batch, H, chunk, Dh]`` into the ring, after the attention has read it."""
        keep = self.slots.size(1)
        self.hid[self.rows, self.slots] = h[:, -keep:]  # [batch, keep, d_model]
        self.k[self.rows, :, self.slots] = k[:, :, -keep:].transpose(1, 2)  # [batch, keep, H, Dh]
        self.v[self.rows, :, self.slots] = v[:, :, -keep:].transpose(1, 2)

    def store_hid(self, h: Tensor) -> None:
        """Put a fused call's last ``keep`` layer inputs ``h [batch, chunk, d]`` into the ring (their keys and
        values are stored by the fused attention)."""
        self.hid[self.rows, self.slots] = h[:, -self.slots.size(1):]  # [batch, keep, d_model]


class RingCache:
    """A batch of rings (a :class:`DecodeState`'s tensors) as one call of ``chunk`` tokens sees it."""

    def __init__(self, hid: Tensor, k: Tensor, v: Tensor, seen: Tensor, r_head_k: Tensor, chunk: int,
                 fused: bool = False) -> None:
        self.hid, self.k, self.v, self.r_head_k = hid, k, v, r_head_k  # r_head_k [n_layer, H, mem_len+1, Dh]
        self.seen = seen
        m, batch, dev = k.size(3), seen.numel(), seen.device
        self.fused = fused and chunk <= MAX_CHUNK  # the C kernel reads the ring once for the chunk's tokens
        self.products = fused
        keep = min(chunk, m)  # only the last mem_len tokens of a chunk enter the ring
        self.rows = torch.arange(batch, device=dev)[:, None]  # [batch, 1]
        self.slots = (seen[:, None] + torch.arange(chunk - keep, chunk, device=dev)).remainder(m)  # [batch, keep]
        self.positions: Positions | None = None  # the fused attention finds them itself
        if self.fused:
            return
        pos = seen[:, None] + torch.arange(chunk, device=dev)  # [batch, chunk]
        last = seen[:, None] - 1  # [batch, 1]
        p_ring = last - (last - torch.arange(m, device=dev)).remainder(m)  # [batch, mem_len] slot positions
        d_ring = pos[:, :, None] - p_ring[:, None, :]  # [batch, chunk, mem_len]
        d_self = torch.arange(chunk, device=dev)[:, None] - torch.arange(chunk, device=dev)  # [chunk, chunk]
        dist = torch.cat([d_ring, d_self.expand(batch, chunk, chunk)], dim=-1)  # [batch, chunk, m+chunk]
        blocked = (dist < 0) | (dist > m)
        blocked[:, :, :m] |= (p_ring < 0)[:, None, :]  # empty slots
        self.positions = Positions(dist.clamp(0, m)[:, None], blocked[:, None])

    def layer(self, i: int) -> LayerCache:
        return LayerCache(self.hid[i], self.k[i], self.v[i], self.r_head_k[i], self.rows, self.slots, self.seen,
                          self.fused, self.products)


class SlotTable:
    """The decode batch as a fixed-capacity table of rows (as static key/value caches are): rows [0, n) are
    the sessions generating now. A session joins by copying its own state into row n and leaves by moving the
    last row into its place, so joins and leaves never copy the other sessions' rings. The table grows by
    doubling up to ``capacity`` (a byte budget's worth of rows), which is the only time rows move together."""

    def __init__(self, new_state: Callable[[int], DecodeState], capacity: int) -> None:
        self.new_state, self.capacity = new_state, max(1, capacity)
        self.table: DecodeState | None = None
        self.n = 0
        self._view: DecodeState | None = None  # rows [0, n) as views, kept while n and the table stay

    @property
    def free(self) -> int:
        return self.capacity - self.n

    def join(self, state: DecodeState) -> int:
        """Copy a batch-1 ``state`` into the next row; its row index."""
        if self.n >= self.capacity:
            raise RuntimeError("the slot table is full")
        if self.table is None or self.n == self.table.batch:
            grown = self.new_state(min(self.capacity, max(4, 2 * self.n)))
            for r in range(self.n):
                grown.copy_row(r, self.table, r)
            self.table = grown
        self.table.copy_row(self.n, state)
        self.n += 1
        self._view = None
        return self.n - 1

    def leave(self, row: int) -> None:
        """Free ``row`` (export it first): the last row moves into its place."""
        last = self.n - 1
        if row != last:
            self.table.copy_row(row, self.table, last)
        self.n = last
        self._view = None

    def active(self, start: int = 0, end: int | None = None) -> DecodeState:
        """Rows [start, end) (default: every row in use) as views, for one step; call :meth:`stepped` after it.
        The views of every row are made once per batch composition, not once a step (five ops each time)."""
        end = self.n if end is None else end
        if start != 0 or end != self.n:
            return self.table.span(start, end)
        if self._view is None:
            self._view = self.table.span(0, self.n)
        return self._view

    def stepped(self, view: DecodeState, start: int = 0) -> None:
        """Keep the next-token scores of a step on rows [start, start + view.batch)."""
        self.table.last_logits[start:start + view.batch] = view.last_logits
        if view is not self._view:
            self._view = None  # its scores of those rows are older than the table's now

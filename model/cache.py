"""The decode cache: what a batch of sessions keeps between calls, and how one call sees it.

A session's keys and values are projected once, when its tokens enter the memory,
and kept in a per-layer ring of ``mem_len`` slots (slot = position % mem_len) beside
the layer inputs (the paper's mems). The attention module reads and writes the ring
through a :class:`LayerCache` (gpt-fast's pattern: the cache update happens inside
the one attention); nothing here computes attention.

Every query attends to itself and exactly the ``mem_len`` tokens before it, so a
ring of ``mem_len`` slots plus the chunk being fed is all a call ever needs.

A server's decode batch is a table of rows: a :class:`RowTable` decodes each session
where it lies, by the addresses of its own rings (the fused attention's way), and a
:class:`SlotTable` copies sessions into rows of one batch tensor (every other way).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from model import fused, gpu_attention
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
        """Device bytes one session occupies here (read once a request by the hot set: no views made, 4 us not 13)."""
        rings = sum(t.nbytes // max(1, t.size(1)) for t in (self.hid, self.k, self.v))  # [layers, batch, ...]
        return rings + self.last_logits.nbytes // max(1, self.last_logits.size(0)) + 8  # [batch, vocab]

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
class RowBatch:
    """Sessions decoded together where they lie (a :class:`RowTable`'s rows): each keeps its rings in its own
    batch-1 :class:`DecodeState`, which a call reads and advances through their addresses."""

    rows: Tensor  # [3, n_layer, batch] int64: where each session's layer inputs, keys and values of each layer are
    seen: Tensor  # [batch] int64: tokens seen
    last_logits: Tensor  # [batch, vocab]: the prediction after the last token seen

    @property
    def batch(self) -> int:
        return self.seen.numel()


@dataclass
class LayerCache:
    """One layer's ring during one call: the keys/values to attend over before the chunk's own, the
    position table ``W_r R_d`` (d = 0..mem_len) projected once, and where the chunk's last tokens go."""

    hid: Tensor | None  # [batch, mem_len, d_model]; None: the rings are at ``addr``
    k: Tensor | None  # [batch, n_head, mem_len, d_head]
    v: Tensor | None  # [batch, n_head, mem_len, d_head]
    r_head_k: Tensor  # [n_head, mem_len+1, d_head]
    rows: Tensor | None  # [batch, 1]
    slots: Tensor | None  # [batch, keep]: ring slots of the chunk's last `keep` tokens
    seen: Tensor  # [batch] int64: tokens before the chunk
    fused: bool = False  # this call attends in one kernel call: C on a CPU (model.fused), Triton on a GPU
    products: bool = False  # this call's products go through the C kernels (model.fused.linear_rows, matmul)
    addr: Tensor | None = None  # [3, batch] int64: each session's rings of this layer (a RowBatch's call)
    ring: tuple[int, int, int] = (0, 0, 0)  # with addr: a ring's element strides (head, slot, d_head)
    start: Tensor | None = None  # with addr: [batch+1] int64, row b's tokens are [start[b], start[b+1]) of the call
    softmax: bool = False  # a chunk's probabilities in one C pass a query (model.fused.chunk_softmax)
    # with ``softmax``: ring slots [0, filled) hold the rows' keys, the rest nothing yet (young sessions'); None:
    # score them all
    filled: int | None = None
    # a CPU step whose keys and values of a layer come to this many bytes or more reads the layer inputs' ring in
    # their place (fused.attend_one); None: never
    absorb: int | None = None

    def attend(self, qkv: Tensor, h: Tensor, u: Tensor, vb: Tensor, scale: float, kv: Tensor | None = None) -> Tensor:
        """The fused attention of a call (:mod:`model.fused`: up to MAX_CHUNK tokens a row on a CPU;
        :mod:`model.gpu_attention`: one a row on a GPU) with queries, keys and values ``qkv [batch, chunk,
        3*H*Dh]`` and layer inputs ``h [batch, chunk, d]``: [batch, chunk, H*Dh], before ``o_net``. Their keys,
        values and inputs are in the rings afterwards. ``kv``: the attention's key and value weights, where a CPU
        step may read the inputs' ring in their place (:func:`model.fused.attend_one`)."""
        if self.addr is not None:  # the rows' tokens packed: qkv [N, L, 3*H*Dh], h [N, L, d] (N*L tokens)
            return fused.attend_rows(qkv, self.start, u, vb, self.addr, h, self.r_head_k, self.seen, scale, self.ring,
                                     kv, self.absorb or 0)
        if qkv.is_cuda:  # one token a row (RingCache makes such a call fused only then): Triton's kernels
            out = gpu_attention.attend_step(qkv, u, vb, self.k, self.v, self.r_head_k, self.seen, scale)
        else:
            out = fused.attend_one(qkv, u, vb, self.k, self.v, self.r_head_k, self.seen, scale,
                                   self.hid if kv is not None else None, kv, self.absorb or 0)
        self.store_hid(h)
        return out

    def store(self, h: Tensor, k: Tensor, v: Tensor) -> None:
        """Put the chunk's last ``keep`` layer inputs ``h [batch, chunk, d]`` and keys/values
        ``[batch, H, chunk, Dh]`` into the ring, after the attention has read it."""
        keep = self.slots.size(1)
        if h.device.type == "cpu" and h.size(0) <= 4 and not torch.jit.is_tracing():
            # a CPU call of a few rows (a prefill's chunks): each row's slots are one run of the ring, or two where
            # it wraps, so slices copy them (indexed stores took 9% of a 6 x 256 prefill); a trace keeps the
            # indices, not the numbers
            m, first = self.hid.size(1), h.size(1) - keep
            for b, s0 in enumerate(self.slots[:, 0].tolist()):
                n1 = min(keep, m - s0)
                for at, frm, n in ((s0, first, n1), (0, first + n1, keep - n1)):
                    if n:
                        self.hid[b, at:at + n] = h[b, frm:frm + n]  # [n, d_model]
                        self.k[b, :, at:at + n] = k[b, :, frm:frm + n]  # [H, n, Dh]
                        self.v[b, :, at:at + n] = v[b, :, frm:frm + n]
            return
        self.hid[self.rows, self.slots] = h[:, -keep:]  # [batch, keep, d_model]
        self.k[self.rows, :, self.slots] = k[:, :, -keep:].transpose(1, 2)  # [batch, keep, H, Dh]
        self.v[self.rows, :, self.slots] = v[:, :, -keep:].transpose(1, 2)

    def store_hid(self, h: Tensor) -> None:
        """Put a fused call's last ``keep`` layer inputs ``h [batch, chunk, d]`` into the ring (their keys and
        values are stored by the fused attention)."""
        self.hid[self.rows, self.slots] = h[:, -self.slots.size(1):]  # [batch, keep, d_model]


class RingCache:
    """A batch of rings (a :class:`DecodeState`'s tensors) as one call of ``chunk`` tokens sees it."""

    def __init__(self, hid: Tensor | None, k: Tensor | None, v: Tensor | None, seen: Tensor, r_head_k: Tensor,
                 chunk: int, fused: bool = False, *, addr: Tensor | None = None,
                 ring: tuple[int, int, int] = (0, 0, 0), start: Tensor | None = None,
                 products: bool | None = None, absorb: int | None = None) -> None:
        self.hid, self.k, self.v, self.r_head_k = hid, k, v, r_head_k  # r_head_k [n_layer, H, mem_len+1, Dh]
        self.seen, self.addr, self.ring, self.start = seen, addr, ring, start  # addr [3, n_layer, batch]
        m, batch, dev = r_head_k.size(2) - 1, seen.numel(), seen.device
        # the C kernel reads the ring once for up to MAX_CHUNK tokens a row; the GPU's, once for a decode step's one
        self.fused = fused and (chunk <= (MAX_CHUNK if dev.type == "cpu" else 1) or addr is not None)
        self.products = fused if products is None else products  # the C products (fused.linear_rows, matmul)
        # a CPU's longer chunk: torch's (or the C) products, then its probabilities in one C pass a query
        self.softmax = fused and dev.type == "cpu" and not self.fused
        # the slots any row has written (they fill in order until the ring wraps): the rest are never read, so a
        # young session's prefill chunk scores only these (one host read a call)
        self.filled = min(m, int(seen.max())) if self.softmax and batch else None
        # bytes from which a step absorbs the keys and values (the op decides per call: fused.attend_one)
        self.absorb = absorb if self.fused and dev.type == "cpu" else None
        if addr is not None:  # a RowBatch's rows, tokens packed (``start``); the kernel checks each row's count
            if not fused:
                raise ValueError("sessions decoded where they lie need the fused attention")
            self.rows = self.slots = self.positions = None
            return
        keep = min(chunk, m)  # only the last mem_len tokens of a chunk enter the ring
        self.rows = torch.arange(batch, device=dev)[:, None]  # [batch, 1]
        self.slots = (seen[:, None] + torch.arange(chunk - keep, chunk, device=dev)).remainder(m)  # [batch, keep]
        self.positions: Positions | None = None  # the fused attention and the C softmax find them themselves
        if self.fused or self.softmax:
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
        if self.addr is not None:
            return LayerCache(None, None, None, self.r_head_k[i], None, None, self.seen, self.fused, self.products,
                              self.addr[:, i], self.ring, self.start, absorb=self.absorb)
        return LayerCache(self.hid[i], self.k[i], self.v[i], self.r_head_k[i], self.rows, self.slots, self.seen,
                          self.fused, self.products, softmax=self.softmax, filled=self.filled, absorb=self.absorb)


class SlotTable:
    """The decode batch as a fixed-capacity table of rows (as static key/value caches are): rows [0, n) are
    the sessions generating now. A session joins by copying its own state into row n and leaves by moving the
    last row into its place, so joins and leaves never copy the other sessions' rings. For decoders without the
    fused attention (a GPU, or no C compiler); with it, :class:`RowTable` copies no ring at all. The table grows by
    doubling up to ``capacity`` (a byte budget's worth of rows), which is the only time rows move together."""

    ragged = False  # every row of a call is fed as many tokens
    prompts_in_steps = False  # short prompts joining an idle batch are read in one pass (GraphedTable: in steps)

    def __init__(self, new_state: Callable[..., DecodeState], capacity: int) -> None:
        self.new_state, self.capacity = new_state, max(1, capacity)  # new_state: a Decoder's ``empty``
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

    def seen_at(self, row: int) -> int:
        return int(self.table.seen[row])

    def export(self, row: int) -> DecodeState:
        """``row``'s session as a batch-1 state of its own: a copy (the one a session pays to leave the batch)."""
        own = self.new_state(1, zeroed=False)  # every part of it is copied over
        own.copy_row(0, self.table, row)
        return own

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
        rows = self.table.last_logits[start:start + view.batch]
        if view.last_logits.data_ptr() != rows.data_ptr():  # a graphed step wrote them there already
            rows.copy_(view.last_logits)
        if view is not self._view:
            self._view = None  # its scores of those rows are older than the table's now


class RowTable:
    """The decode batch as rows that point at the sessions' own batch-1 states, decoded where they lie (as paged
    key/value caches are, a session's rings being its page): a session joins and leaves the batch by its
    addresses alone and comes out as the very state it went in as, so a request copies none of its rings (a
    :class:`SlotTable` copies each session in and out: the engine loop alone at 64 streams read 0.83 of the
    engine with those copies and 1.00 without, BENCHMARKS.md, "Sessions decoded where they lie"). Same
    interface as :class:`SlotTable`; only the fused attention reads rings by address (``Decoder.table`` picks
    the table). A row's scores and count of tokens live in the table while it is in the
    batch, and go back into the session's state when it is exported."""

    ragged = True  # a call may feed each row its own number of tokens (Decoder.advance_rows)
    prompts_in_steps = False  # short prompts joining an idle batch are read in one packed pass

    def __init__(self, new_state: Callable[..., DecodeState], capacity: int) -> None:
        self.new_state, self.capacity = new_state, max(1, capacity)  # new_state: a Decoder's ``empty``
        self.like = new_state(1, meta=True)  # the layout a session must have to be read in place (no memory)
        self.states: list[DecodeState] = []  # the session of each row
        self.held: list[tuple[Tensor, Tensor, Tensor]] = []  # the tensors behind each row's addresses, kept alive
        self.rows = torch.zeros(3, self.like.k.size(0), 0, dtype=torch.long)  # [3, n_layer, rows]: addresses
        self.seen = torch.zeros(0, dtype=torch.long)  # [rows]
        self.last_logits = torch.zeros(0, self.like.last_logits.size(1))  # [rows, vocab]
        self._in = set()  # the sessions' key rings, by address: a session read in place is never in two rows
        self._view: RowBatch | None = None

    @property
    def n(self) -> int:
        return len(self.states)

    @property
    def free(self) -> int:
        return self.capacity - self.n

    def _fits(self, state: DecodeState) -> bool:
        """Whether ``state`` can be read in place: one session on this CPU, laid out as the decoder lays it out."""
        def same(t: Tensor, like: Tensor, layer_dims: int) -> bool:
            return (t.device.type == "cpu" and t.dtype == like.dtype and t.shape == like.shape
                    and t.stride()[-layer_dims:] == like.stride()[-layer_dims:])

        def span(t: Tensor) -> tuple[int, int]:  # the bytes a tensor reaches (strides of a session's are >= 0)
            return t.data_ptr(), t.data_ptr() + t.element_size() * (1 + sum((n - 1) * st for n, st in
                                                                           zip(t.shape, t.stride())))

        def layers_apart(t: Tensor) -> bool:  # each layer's ring its own memory: no layer writes over another
            return t.stride(0) >= 1 + sum((n - 1) * st for n, st in zip(t.shape[1:], t.stride()[1:]))

        like = self.like
        if not (same(state.hid, like.hid, 2) and same(state.k, like.k, 3) and same(state.v, like.v, 3)
                and same(state.seen, like.seen, 1) and same(state.last_logits, like.last_logits, 1)):
            return False
        (a0, a1), (b0, b1), (c0, c1) = (span(t) for t in (state.hid, state.k, state.v))
        apart = a1 <= b0 or b1 <= a0, a1 <= c0 or c1 <= a0, b1 <= c0 or c1 <= b0  # hid, k, v never overlap
        return all(apart) and all(layers_apart(t) for t in (state.hid, state.k, state.v))

    def join(self, state: DecodeState) -> int:
        """Add a batch-1 ``state`` as the next row (by reference; a state laid out otherwise is copied once into
        one that is not); its row index. The table owns the state until :meth:`export`."""
        if self.n >= self.capacity:
            raise RuntimeError("the slot table is full")
        if not self._fits(state):
            own = self.new_state(1, zeroed=False)
            own.copy_row(0, state)
            state = own
        key = state.k.data_ptr()
        if key in self._in:
            raise RuntimeError("this session is already in the batch")
        r = self.n
        if r == self.seen.numel():  # grow the small tensors; the sessions stay where they are
            size = min(self.capacity, max(4, 2 * r))
            rows, seen = torch.zeros(3, self.rows.size(1), size, dtype=torch.long), torch.zeros(size, dtype=torch.long)
            logits = torch.zeros(size, self.last_logits.size(1))
            rows[:, :, :r], seen[:r], logits[:r] = self.rows, self.seen, self.last_logits
            self.rows, self.seen, self.last_logits = rows, seen, logits
        layers = torch.arange(self.rows.size(1))  # [n_layer]
        for j, t in enumerate((state.hid, state.k, state.v)):
            self.rows[j, :, r] = t.data_ptr() + t.element_size() * t.stride(0) * layers
        self.seen[r], self.last_logits[r] = state.seen[0], state.last_logits[0]
        self.states.append(state)
        self.held.append((state.hid, state.k, state.v))
        self._in.add(key)
        self._view = None
        return r

    def seen_at(self, row: int) -> int:
        return int(self.seen[row])

    def export(self, row: int) -> DecodeState:
        """``row``'s session: the state that joined, its scores and count of tokens brought up to date (no copy
        of its rings). Call :meth:`leave` next: the table no longer writes it."""
        state = self.states[row]
        state.seen[0], state.last_logits[0] = self.seen[row], self.last_logits[row]
        return state

    def leave(self, row: int) -> None:
        """Free ``row`` (export it first): the last row's addresses move into its place."""
        last = self.n - 1
        self._in.discard(self.held[row][1].data_ptr())
        if row != last:
            self.rows[:, :, row], self.seen[row] = self.rows[:, :, last], self.seen[last]
            self.last_logits[row] = self.last_logits[last]
            self.states[row], self.held[row] = self.states[last], self.held[last]
        self.rows[:, :, last] = 0  # no address outlives its row (the op refuses 0)
        self.states.pop()
        self.held.pop()
        self._view = None

    def active(self, start: int = 0, end: int | None = None) -> RowBatch:
        """Rows [start, end) (default: every row in use), for one step; call :meth:`stepped` after it."""
        end = self.n if end is None else end
        if not 0 <= start <= end <= self.n:
            raise IndexError(f"rows [{start}, {end}) of a table of {self.n}")
        if start == 0 and end == self.n and self._view is not None:
            return self._view
        view = RowBatch(self.rows[:, :, start:end], self.seen[start:end], self.last_logits[start:end])
        if start == 0 and end == self.n:
            self._view = view
        return view

    def stepped(self, view: RowBatch, start: int = 0) -> None:
        """Keep the next-token scores of a step on rows [start, start + view.batch)."""
        self.last_logits[start:start + view.batch] = view.last_logits
        if view is not self._view:
            self._view = None

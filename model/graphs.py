"""Decode steps as CUDA graphs: a replay launches a whole step at once instead of a few hundred small kernels.

On a GPU a small model's eager step is bound by those launches, not by its arithmetic (the bundled model's took
about 3 ms on an H200, slower than a 2-core CPU's). A graph fixes shapes and addresses, so a server's batch runs
on a table of rows allocated once, and each step replays the graph of the smallest captured batch size that holds
its rows (vLLM's ``cudagraph_capture_sizes``): 1, 2, 4, then every multiple of 8.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from model.cache import DecodeState, SlotTable
from model.sampling import sample_on_device
from txlserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from model.decode import Decoder

__all__ = ["Drawn", "GraphedStep", "GraphedTable", "capture_sizes"]

log = logging.getLogger(__name__)


def capture_sizes(capacity: int) -> list[int]:
    """The batch sizes captured for a table of ``capacity`` rows: 1, 2, 4, every multiple of 8 below it, and it."""
    return sorted({s for s in (1, 2, 4) if s < capacity} | set(range(8, capacity, 8)) | {max(1, capacity)})


def _warm_up(decoder: Decoder, state: DecodeState, tokens: Tensor, steps: int, *, in_place: bool = False) -> None:
    """Eager steps on a copy of ``state`` (on ``state`` itself where ``in_place``: rows nobody uses), on a side
    stream, before a capture: lazy initialisation (cuBLAS handles, the allocator) must not happen inside one."""
    dev = decoder.device
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        scratch = state if in_place else state.rows(list(range(state.batch)))
        for _ in range(steps):
            decoder.advance(scratch, tokens)
    torch.cuda.current_stream(dev).wait_stream(side)


def _capture(decoder: Decoder, state: DecodeState, tokens: Tensor, record: Callable[[], None], *, warmup: int,
             in_place: bool = False, pool: tuple[int, int] | None = None) -> torch.cuda.CUDAGraph:
    """``record()`` (a step on ``state`` fed ``tokens``) captured as a graph after ``warmup`` eager steps, under
    the model's device: a capture records on the current device's streams, so on ``cuda:N`` it must be N's."""
    with torch.cuda.device(decoder.device):
        _warm_up(decoder, state, tokens, warmup, in_place=in_place)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                record()
        except Exception:
            _release_generator(decoder.device)
            raise
    return graph


def _release_generator(device: torch.device) -> None:
    """A capture that fails ends before PyTorch takes the device's default generator out of capture mode, and
    every random op on the device then fails ("Offset increment outside graph capture"): a dropout of a training
    run in the same process, say. A clone of its state (seed and offset, not in capture) takes its place."""
    gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    if hasattr(gen, "graphsafe_set_state") and hasattr(gen, "clone_state"):
        gen.graphsafe_set_state(gen.clone_state())


@dataclass
class Drawn:
    """Tokens drawn on the device for rows [0, n) of a decode table, on their way to the host."""

    tokens: Tensor  # [n] int64 on the host (pinned on a GPU), written once ``ready`` has passed
    ready: torch.cuda.Event | None  # None: written already (a CPU's table)

    def tolist(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()  # the GIL is released while it waits
        return self.tokens.tolist()


def _capture_ops(device: torch.device, fn: Callable[[], None], pool: tuple[int, int]) -> torch.cuda.CUDAGraph:
    """``fn`` (a few ops on fixed buffers, no model step) captured after one eager run on a side stream."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            fn()
    return graph


class GraphedStep:
    """One decode step for a fixed batch, captured as a CUDA graph.

    The capture records the step on ``state`` without running it; every :meth:`__call__` copies the
    tokens in, replays, and leaves ``state`` advanced exactly as :meth:`Decoder.step` would, with
    ``state.last_logits`` a view of the graph's output (holding the state's scores until the first replay)."""

    def __init__(self, decoder: Decoder, state: DecodeState, warmup: int = 2) -> None:
        if decoder.device.type != "cuda":
            raise InvalidRequestError("CUDA graphs need a CUDA device", param="device")
        self.device = decoder.device
        self.tokens = torch.zeros(state.batch, 1, dtype=torch.long, device=decoder.device)  # [batch, 1]
        before = state.last_logits  # [batch, vocab]

        def record() -> None:
            self.logits = decoder.step(state, self.tokens)  # [batch, 1, vocab], refreshed by each replay

        self.graph = _capture(decoder, state, self.tokens, record, warmup=warmup)
        state.last_logits.copy_(before)  # the graph's output, not yet computed: the scores the state had

    def __call__(self, tokens: Tensor) -> Tensor:
        self.tokens.copy_(tokens)
        with torch.cuda.device(self.device):
            self.graph.replay()
        return self.logits


class GraphedTable(SlotTable):
    """A :class:`SlotTable` on a GPU whose one-token steps replay CUDA graphs (``Decoder.table`` gives it where
    ``Decoder.cuda_graphs``). Its rows are allocated once, at full capacity, since a graph reads and writes fixed
    addresses; a step of ``n`` rows replays the graph of the smallest captured size >= ``n``, and the rows beyond
    ``n`` step too, on whatever token they last had: no session is in them, and a session that joins copies over
    all of its row. Each graph writes its next-token scores into the table's own rows, so no graph's output is
    read after another replays (they share one memory pool). Calls of several tokens (prompts read in the
    batch), or on some of the rows, run eagerly; so does every step if a capture fails (logged): the results are
    the same.

    Overlapped steps (:meth:`launch`, the engine loop's where every row's tokens may be drawn on the device, as
    SGLang's overlap scheduler and vLLM's async scheduling run): a step feeds each row the token drawn after its
    last step, or a token the host gives (a prompt's), then draws the row's next token from the new scores and
    starts its copy to the host, all queued without waiting for the device; so the host handles one step's tokens
    (their text, stop strings, the hand-off to the streams) while the next step runs.

    ``capture=False`` runs the same padded steps eagerly: how the padding is tested without a GPU."""

    def __init__(self, decoder: Decoder, capacity: int, *, capture: bool = True) -> None:
        super().__init__(decoder.empty, capacity)
        self.decoder, self.capture = decoder, capture
        self.table = decoder.empty(self.capacity)  # every row now: never grows, never moves
        self.sizes = capture_sizes(self.capacity)
        self.tokens = torch.zeros(self.capacity, 1, dtype=torch.long, device=decoder.device)  # [capacity, 1]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None  # the captures' shared memory pool
        # Short prompts joining even an idle batch are read a token a step (the engine loop's choice): a replay is
        # a small part of an eager pass of a few tokens (0.2-0.5 ms against ~3 ms for the bundled model), so
        # MAX_CHUNK tokens in replays cost less than one such pass; False once steps run eagerly
        self.prompts_in_steps = capture
        dev, cap, pin = decoder.device, self.capacity, decoder.device.type == "cuda"
        self.next = torch.zeros(cap, dtype=torch.long, device=dev)  # [capacity]: each row's token drawn last
        self.inputs = torch.zeros(cap, 4, dtype=torch.float64, device=dev)  # [capacity, 4]: token, use it, temp, draw
        # host sides of the copies, used in turn: one is reused only after the step that read or wrote it passed;
        # rows [0, n) of each are contiguous, so a copy is one transfer from pinned memory that does not wait
        self._host_in = [torch.zeros(cap, 4, dtype=torch.float64, pin_memory=pin) for _ in range(4)]
        self._host_out = [torch.zeros(cap, dtype=torch.long, pin_memory=pin) for _ in range(4)]
        self._ready = [torch.cuda.Event() if pin else None for _ in range(4)]
        self._turn = 0
        self.helpers: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}  # ("feed" | "draw", size): captured

    def size(self, n: int) -> int:
        """The rows a step of ``n`` rows runs: the smallest captured size that holds them."""
        return next(s for s in self.sizes if s >= n)

    def leave(self, row: int) -> None:
        last = self.n - 1
        super().leave(row)
        if row != last:
            self.next[row] = self.next[last]  # the moved row's drawn token moves with it

    def clear(self) -> None:
        """Every row free again (the engine loop's reset after a failed step): rows and graphs stay, where a new
        table would first take a second capacity's worth of memory."""
        self.n, self._view = 0, None

    def capture_all(self) -> None:
        """Capture every size, largest first (the smaller ones then fit in the memory it took), before the
        first request: a capture takes tens of milliseconds. With no session in the table yet, each warms up on
        the table's own rows, not on a copy of them."""
        for s in reversed(self.sizes):
            if self._graph(s) is None:
                return
            self._helper("feed", s)
            self._helper("draw", s)

    def _graph(self, s: int) -> torch.cuda.CUDAGraph | None:
        if s not in self.graphs and self.capture:
            try:
                state, tokens = self.table.span(0, s), self.tokens[:s]  # rows [0, s) as views; [s, 1]

                def record() -> None:
                    self.decoder.advance(state, tokens)
                    self.table.last_logits[:s].copy_(state.last_logits)  # [s, vocab] into the table's rows

                if self._pool is None:
                    with torch.cuda.device(self.decoder.device):
                        self._pool = torch.cuda.graph_pool_handle()
                self.graphs[s] = _capture(self.decoder, state, tokens, record, warmup=1, in_place=self.n == 0,
                                          pool=self._pool)
            except Exception as err:  # the eager step is exact: run it from now on
                log.warning("decode steps run eagerly: capturing a CUDA graph of %d rows failed (%s: %s)", s,
                            type(err).__name__, err)
                self.capture, self.graphs, self.prompts_in_steps = False, {}, False
        return self.graphs.get(s)

    def advance(self, view: DecodeState, tokens: Tensor) -> None:
        """Feed ``tokens [n, chunk]`` to ``view``, from :meth:`active`: every row in use replays a graph where the
        call is one token a row; scores land in the table."""
        n = view.batch
        whole = n == self.n and view.seen.data_ptr() == self.table.seen.data_ptr()  # rows [0, n): all of them
        if tokens.size(1) != 1 or not whole or n == 0:
            self.decoder.advance(view, tokens)
            return
        self.tokens[:n].copy_(tokens, non_blocking=True)  # [n, 1]; rows n.. keep earlier (valid) tokens
        self._step(self.size(n))
        view.last_logits = self.table.last_logits[:n]  # [n, vocab]

    def _step(self, s: int) -> None:
        """Rows [0, s) fed ``tokens[:s]``: the graph of ``s`` rows replayed, or the same padded step eagerly."""
        graph = self._graph(s)
        if graph is not None:
            with torch.cuda.device(self.decoder.device):
                graph.replay()
        else:
            padded = self.table.span(0, s)
            self.decoder.advance(padded, self.tokens[:s])
            self.table.last_logits[:s] = padded.last_logits  # [s, vocab]

    # -- overlapped steps ------------------------------------------------------------------------------------
    def launch(self, feed: Sequence[int], use: Sequence[bool], temps: Sequence[float],
               draws: Sequence[float]) -> Drawn:
        """Step every row in use, rows [0, n): row ``r`` is fed ``feed[r]`` where ``use[r]``, else the token drawn
        after its last step; then its next token is drawn from the new scores with temperature ``temps[r]`` and
        uniform draw ``draws[r]`` (:func:`sample_on_device`). Nothing here waits for the device."""
        n, s = self.n, self.size(self.n)
        host_in, host_out, ready = self._take_turn()
        host_in[:n] = torch.tensor([feed, use, temps, draws], dtype=torch.float64).T  # [n, 4]
        self.inputs[:n].copy_(host_in[:n], non_blocking=True)  # rows n.. keep earlier (valid) values
        self._run("feed", s)
        self._step(s)
        self._run("draw", s)
        return self._to_host(host_out, ready, n)

    def draw(self, rows: Sequence[bool], temps: Sequence[float], draws: Sequence[float]) -> Drawn:
        """Draw the next token of each row ``r`` in use where ``rows[r]``, from the scores it holds (a session that
        joined from its memory alone, or rows stepped with tokens the host drew), without a step; the others keep
        the token they had. Rare (a join without a prompt, a switch from host-drawn steps): eager."""
        n = self.n
        host_in, host_out, ready = self._take_turn()
        host_in[:n] = torch.tensor([[0] * n, rows, temps, draws], dtype=torch.float64).T  # [n, 4]
        self.inputs[:n].copy_(host_in[:n], non_blocking=True)
        fresh = sample_on_device(self.table.last_logits[:n], self.inputs[:n, 2], self.inputs[:n, 3])  # [n]
        self.next[:n] = torch.where(self.inputs[:n, 1] > 0, fresh, self.next[:n])
        return self._to_host(host_out, ready, n)

    def _take_turn(self) -> tuple[Tensor, Tensor, torch.cuda.Event | None]:
        t, self._turn = self._turn, (self._turn + 1) % len(self._host_in)
        return self._host_in[t], self._host_out[t], self._ready[t]

    def _to_host(self, host_out: Tensor, ready: torch.cuda.Event | None, n: int) -> Drawn:
        host_out[:n].copy_(self.next[:n], non_blocking=True)
        if ready is not None:
            ready.record(torch.cuda.current_stream(self.decoder.device))  # the copy's stream: on cuda:N, N's
        return Drawn(host_out[:n], ready)

    def _feed(self, s: int) -> None:
        self.tokens[:s, 0] = torch.where(self.inputs[:s, 1] > 0, self.inputs[:s, 0].long(), self.next[:s])

    def _draw(self, s: int) -> None:
        self.next[:s] = sample_on_device(self.table.last_logits[:s], self.inputs[:s, 2], self.inputs[:s, 3])

    def _helper(self, kind: str, s: int) -> torch.cuda.CUDAGraph | None:
        """The graph of ``_feed`` or ``_draw`` for ``s`` rows (captured with the steps); None: run them eagerly."""
        if (kind, s) not in self.helpers and self.capture and self._pool is not None:
            fn = getattr(self, "_" + kind)
            try:
                self.helpers[kind, s] = _capture_ops(self.decoder.device, lambda: fn(s), self._pool)
            except Exception as err:  # the eager ops are exact
                _release_generator(self.decoder.device)
                log.warning("a step's token %s runs eagerly: capturing it for %d rows failed (%s: %s)", kind, s,
                            type(err).__name__, err)
                self.capture, self.graphs, self.helpers, self.prompts_in_steps = False, {}, {}, False
        return self.helpers.get((kind, s))

    def _run(self, kind: str, s: int) -> None:
        graph = self._helper(kind, s)
        if graph is None:
            getattr(self, "_" + kind)(s)
        else:
            with torch.cuda.device(self.decoder.device):
                graph.replay()

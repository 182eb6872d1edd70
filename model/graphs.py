"""Decode steps as CUDA graphs: a replay launches a whole step at once instead of a few hundred small kernels.

On a GPU a small model's eager step is bound by those launches, not by its arithmetic (the bundled model's took
about 3 ms on an H200, slower than a 2-core CPU's). A graph fixes shapes and addresses, so a server's batch runs
on a table of rows allocated once, and each step replays the graph of the smallest captured batch size that holds
its rows (vLLM's ``cudagraph_capture_sizes``): 1, 2, 4, then every multiple of 8.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from model.cache import DecodeState, SlotTable
from txlserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from model.decode import Decoder

__all__ = ["GraphedStep", "GraphedTable", "capture_sizes"]

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

    def size(self, n: int) -> int:
        """The rows a step of ``n`` rows runs: the smallest captured size that holds them."""
        return next(s for s in self.sizes if s >= n)

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
        s = self.size(n)
        self.tokens[:n].copy_(tokens, non_blocking=True)  # [n, 1]; rows n.. keep earlier (valid) tokens
        graph = self._graph(s)
        if graph is not None:
            with torch.cuda.device(self.decoder.device):
                graph.replay()
        else:
            padded = self.table.span(0, s)
            self.decoder.advance(padded, self.tokens[:s])
            self.table.last_logits[:s] = padded.last_logits  # [s, vocab]
        view.last_logits = self.table.last_logits[:n]  # [n, vocab]

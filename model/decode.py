"""Incremental decoding: the model's cache, allocated, advanced and read here; the attention is the model's.

A token's keys and values are projected once, when it enters the memory, and kept
in a per-layer ring of ``mem_len`` slots (:mod:`model.cache`); the position term
reads a per-layer table ``W_r R_d`` for distances 0..mem_len computed once at
start-up. Every query attends to itself and exactly the ``mem_len`` tokens before
it (the reference model's ``same_length`` window), so prefill chunk sizes, request
boundaries and batching never change a result.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from model import gpu_attention
from model.cache import DecodeState, RingCache, RowBatch, RowTable, SlotTable, column_major
from model.config import TXLConfig
from model.fused import ABSORB_MAX_HEADS, ABSORB_MIN_BYTES, MAX_CHUNK, MAX_D_HEAD
from model.fused import available as attention_kernel_built
from model.graphs import GraphedTable
from model.transformer_xl import MemTransformerLM
from txlserve.errors import ConfigError, InvalidRequestError

__all__ = ["Decoder", "DecodeState", "default_prefill_chunk"]

log = logging.getLogger(__name__)

# Calls of up to this many tokens run as traced graphs too, one per length (a request's short prompt, read as it
# joins the batch; the tail of a chunked prefill): eagerly, dispatching a few hundred torch ops from Python
# cost more than the arithmetic (3.2 -> 2.3 ms for 4 tokens of the bundled model; 1.4 ms with the fused attention).
MAX_TRACED_CHUNK = 8

# Decoder.tune_products's measurements, by shape and thread count: one decision per process.
_TUNED: dict[tuple[int | bool, ...], dict[str, float]] = {}
_TUNING = threading.Lock()
TORCH_MARGIN = 0.95  # torch's products are kept only when they take less than this share of the tiles' time
TUNE_RING = 2048  # the longest ring the products are timed against (Decoder._time_products)
STEP_TUNE_ROWS = 16  # the decode batch a step's products are timed at (Decoder.tune_step_products)


def default_prefill_chunk(mem_len: int, device: torch.device) -> int:
    """Prefill chunk size from the shape. A chunk of C tokens costs C x (mem_len + C) in attention: on a CPU,
    chunks near mem_len/4 keep those scores small while the projections still see wide matrices (1.3-1.9x
    the reference forward in BENCHMARKS.md, where 512-token chunks were slower than it), but not under 256: on an
    AVX-512 host, where torch's products run a chunk's rows, 128-row chunks ran them at a lower rate, and 256 read
    6 x 256 / 512's prefill at 1.25x the reference against 1.16x, the bundled model's at 1.21x against 1.16x
    ("A prefill's multiply-adds"). On a GPU a chunk's
    kernel launches cost as much as its arithmetic: 2,048 tokens for a memory under 1,024 (the bundled model on
    an H200: 83k tokens/s in chunks of 256, 648k in chunks of 2,048, 675k of 4,096), else as long as the memory,
    up to 2,048 (12 layers / 512 at mem_len 1,600: 131k tokens/s in chunks of 1,600, 92k of 4,096). The engine
    loop reads this many prompt tokens between decode steps, so a long prompt holds the streams up for one
    chunk at a time (about 3 ms for the bundled model's 2,048 on that GPU)."""
    if device.type == "cuda":
        return 2048 if mem_len < 1024 else min(2048, mem_len)
    return max(256, min(512, mem_len // 4))


def available_bytes(device: torch.device) -> int | None:
    """Memory ``device`` can still give new tensors, where it says: a CUDA device's free memory, a Linux host's
    MemAvailable; None where neither is known (the check below is then skipped)."""
    if device.type == "cuda":  # with what the caching allocator holds and does not use: it is reused first
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - \
            torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        with contextlib.suppress(OSError, ValueError, StopIteration), open("/proc/meminfo") as info:
            return int(next(line for line in info if line.startswith("MemAvailable:")).split()[1]) * 1024
    return None


def check_fits(cfg: TXLConfig, mem_len: int, device: torch.device, dtype: torch.dtype, chunk: int) -> None:
    """Refuse a ``mem_len`` that cannot fit on ``device``, in one line: past the memory a process was killed
    mid-allocation with no message (``generate --mem-len 1048576`` on the bundled model). A lower bound, counted
    without the model: the position table as it is built (up to three at once), one session's layer inputs, keys
    and values, and one layer's attention scores and probabilities for a prefill ``chunk`` (which the start-up's
    choice of products runs too). The real peak is higher: at mem_len 262,144 the bundled model's ``generate``
    took 23 GB where this counts 10.7."""
    table = cfg.n_layer * cfg.n_head * (mem_len + 1) * cfg.d_head
    session = cfg.n_layer * mem_len * (cfg.d_model + 2 * cfg.n_head * cfg.d_head)
    need = dtype.itemsize * (3 * table + session) + 4 * 2 * cfg.n_head * chunk * (mem_len + chunk)
    free = available_bytes(device)
    if free is not None and need > free:
        def size(n: int) -> str:
            return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

        raise ConfigError(f"mem_len {mem_len:,} needs at least {size(need)} on {device} (its position table, one "
                          f"session and a prefill chunk's scores), and {size(free)} is available: use a smaller "
                          f"mem_len", param="mem_len")


def widen_layout(model: MemTransformerLM) -> None:
    """Store the layers' weights that widen (``out >= in``: the query/key/value, position and first
    feed-forward projections) column-major, in place: same values, same shapes, and a one-row product
    ``x @ W^T`` then streams the weight's rows (1.5-2.2x on a CPU for these shapes; narrowing weights are
    faster as they are). Only the layers: the softmax may share its weight with the embedding."""
    for module in model.layers.modules():
        if isinstance(module, torch.nn.Linear) and module.out_features >= module.in_features:
            module.weight.data = column_major(module.weight.data)


class Decoder:
    """The model at a given ``mem_len``/``clamp_len`` with the position tables its cache needs."""

    def __init__(self, model: MemTransformerLM, *, mem_len: int, clamp_len: int = 0,
                 traced: bool | None = None, fused: bool | None = None, cuda_graphs: bool | None = None,
                 absorb_min_bytes: int | None = ABSORB_MIN_BYTES) -> None:
        if mem_len < 1:
            raise InvalidRequestError("mem_len must be at least 1 for decoding", param="mem_len")
        self.model, self.cfg = model.eval(), model.cfg
        self.mem_len, self.clamp_len = mem_len, clamp_len
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.columns = self.device.type == "cpu"  # column-major rings, table and widening weights (column_major)
        if self.columns:
            widen_layout(model)
        dist = torch.arange(mem_len + 1, device=self.device)  # [mem_len+1]
        if clamp_len > 0:
            dist = dist.clamp(max=clamp_len)
        with torch.no_grad():
            r = model.pos_emb(dist).to(self.dtype)  # [mem_len+1, d_model]
            self.r_head_k = self._layout(torch.stack([layer.dec_attn.position_keys(r) for layer in model.layers]))
            # [n_layer, n_head, mem_len+1, d_head]
        # Calls of up to MAX_TRACED_CHUNK tokens run as one traced graph each (trace_step); by default on a CPU.
        # Not with an adaptive input embedding: which of its clusters run depends on the tokens, and a trace
        # would fix them.
        traceable = len(model.word_emb.emb_layers) == 1
        self.traced = traceable and (self.device.type == "cpu" if traced is None else traced)
        # The attention of calls of up to fused.MAX_CHUNK tokens in one C call (model.fused): float32 on a CPU,
        # where the kernels build.
        fusable = self.device.type == "cpu" and self.dtype == torch.float32 and self.cfg.d_head <= MAX_D_HEAD
        self.fused = fusable and (fused is None or fused) and attention_kernel_built()
        # Where the fused attention runs, one-token steps of a model the absorbed kernel serves (few heads, d_model
        # a multiple of 64, keys of h itself) whose keys and values of a layer come to absorb_min_bytes (a batch's,
        # from DRAM) read the layer inputs' rings in their place (half the bytes: model.fused.attend_one, which
        # decides per call by the same rule); None: never.
        c = self.cfg
        absorbable = not c.pre_lnorm and c.n_head <= ABSORB_MAX_HEADS and c.d_model % 64 == 0
        self.absorb_min_bytes = absorb_min_bytes if self.fused and absorbable else None
        # A decode step's attention in Triton's kernels on a GPU (model.gpu_attention), where Triton is installed;
        # not in a TorchScript trace, which would record their outputs' allocation and not their launches.
        shape = (self.cfg.n_head, self.cfg.d_head, mem_len)
        self.gpu_fused = ((fused is None or fused) and not self.traced
                          and gpu_attention.available(self.device, self.dtype, *shape))
        # A server's decode steps replayed as CUDA graphs (model.graphs.GraphedTable): by default on a GPU; not
        # with an adaptive input embedding either (it reads which clusters its tokens fall in back to the host).
        self.cuda_graphs = traceable and self.device.type == "cuda" and (cuda_graphs is None or cuda_graphs)
        # Calls of more than MAX_CHUNK tokens a row (a prefill's chunks): their products in the C tiles, or in
        # torch's where tune_products measured those faster on this host; likewise a step's few tokens a row
        # (tune_step_products), whose attention stays the C kernel's either way.
        self.chunk_kernels = self.step_kernels = True
        self.ring = tuple(self.empty(1, meta=True).k.stride()[2:])  # a session's ring's strides (head, slot, d)
        self._packings: dict[tuple[int, int], tuple[Tensor, Tensor, Tensor]] = {}  # a row batch's, by shape
        self._graphs: dict[tuple[int, bool, bool], torch.jit.ScriptModule] = {}  # by chunk length, rows or not,
        # and the products it records (step_kernels: a trace fixes them)
        self._tracing = threading.Lock()

    def _layout(self, t: Tensor) -> Tensor:
        return column_major(t) if self.columns else t

    def _ring(self, batch: int, new: Callable[..., Tensor], device: torch.device | str, m: int) -> Tensor:
        """A ring [n_layer, batch, H, m, Dh] made by ``new`` (zeros, empty), in its layout (no copy)."""
        c, kw = self.cfg, dict(device=device, dtype=self.dtype)
        if self.columns:
            return new(c.n_layer, batch, c.n_head, c.d_head, m, **kw).transpose(-1, -2)
        return new(c.n_layer, batch, c.n_head, m, c.d_head, **kw)

    def empty(self, batch: int = 1, *, zeroed: bool = True, meta: bool = False,
              ring: int | None = None) -> DecodeState:
        """``batch`` sessions with nothing seen. ``zeroed=False`` leaves the memory unwritten, for a state every
        row of which is about to be copied over (a session leaving the batch: 1.5 MB of zeros saved per request
        on the bundled checkpoint); ``meta=True`` gives the shapes and layouts alone, with no memory. ``ring``:
        rings of that many slots, not ``mem_len`` (the tuning's scratch state only: no call of this decoder's
        reads such a state but :meth:`_time_products`)."""
        c, m, dev = self.cfg, ring or self.mem_len, "meta" if meta else self.device
        new = torch.zeros if zeroed else torch.empty
        return DecodeState(
            hid=new(c.n_layer, batch, m, c.d_model, device=dev, dtype=self.dtype),
            k=self._ring(batch, new, dev, m),
            v=self._ring(batch, new, dev, m),
            seen=torch.zeros(batch, dtype=torch.long, device=dev),
            last_logits=torch.zeros(batch, c.vocab_size, device=dev, dtype=torch.float32),
        )

    def table(self, capacity: int) -> SlotTable | RowTable:
        """The decode batch of a server's engine loop: sessions decoded where they lie when the fused attention
        reads their rings (no copy as they join and leave), else a table of rows they are copied into, whose
        steps replay CUDA graphs on a GPU."""
        if self.kernels:
            return RowTable(self.empty, capacity)
        return GraphedTable(self, capacity) if self.cuda_graphs else SlotTable(self.empty, capacity)

    @torch.no_grad()
    def advance(self, state: DecodeState | RowBatch, tokens: Tensor) -> Tensor:
        """Feed ``tokens [batch, chunk]`` to every session of ``state`` (in place): the last layer's outputs
        [batch, chunk, d_model]; only the next token's scores are computed (``state.last_logits``), so a long
        prompt never builds a [tokens, vocab] table (267,735 words wide for the published WikiText-103 model).
        A :class:`RowBatch` (sessions where they lie) takes calls of up to ``fused.MAX_CHUNK`` tokens."""
        if isinstance(state, RowBatch):
            batch, chunk = tokens.shape
            if not 1 <= chunk <= MAX_CHUNK:  # what the kernel takes a row (checked before a graph could fail)
                raise ValueError(f"sessions decoded where they lie take 1 to {MAX_CHUNK} tokens a call, not {chunk}")
            packing = self._packings.get((batch, chunk))
            if packing is None:  # [batch+1], [batch], [batch]: made once per shape, not once a step
                start = torch.arange(0, batch * chunk + 1, chunk, device=tokens.device)
                packing = self._packings[batch, chunk] = (start, start.diff(), start[1:] - 1)
            return self._rows(state, tokens, *packing)
        graph = self.graph(tokens.size(1)) if self.traced else None
        args = (state.hid, state.k, state.v, state.seen, tokens)
        h, state.last_logits = self._run(graph, self.forward, args)  # [b, c, d], [b, V]
        return h

    @torch.no_grad()
    def advance_rows(self, state: RowBatch, tokens: Tensor, start: Tensor) -> Tensor:
        """Feed each session of ``state`` its own tokens, packed: row ``b``'s are ``tokens[0, start[b]:start[b+1]]``
        (1 to ``fused.MAX_CHUNK`` of them; ``tokens [1, T]``, ``start`` int64 [batch+1]), in one call, so that a
        prompt joining a batch is read in the step that advances the others (vLLM's mixed prefill and decode
        batches). The last layer's outputs [1, T, d_model]; ``state.last_logits`` after each row's last token."""
        counts = start.diff()  # [batch]
        if counts.numel() and not 1 <= int(counts.min()) <= int(counts.max()) <= MAX_CHUNK:  # before a graph fails
            raise ValueError(f"sessions decoded where they lie take 1 to {MAX_CHUNK} tokens a call, not "
                             f"{counts.tolist()}")
        return self._rows(state, tokens, start, counts, start[1:] - 1)

    def _rows(self, state: RowBatch, tokens: Tensor, start: Tensor, counts: Tensor, last: Tensor) -> Tensor:
        graph = self.graph(0, rows=True) if self.traced else None
        h, state.last_logits = self._run(graph, self.forward_rows, (state.rows, state.seen, tokens, start, counts,
                                                                     last))
        return h

    def _run(self, graph: torch.jit.ScriptModule | None, eager: Callable[..., tuple[Tensor, Tensor]],
             args: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        if graph is None:
            return eager(*args)
        try:
            return graph(*args)
        except Exception as err:  # this call fails (its rows are the caller's to drop); later ones run eagerly
            log.warning("steps run eagerly from now on: a traced step failed (%s: %s)", type(err).__name__, err)
            self.traced = False
            raise

    def absorbs(self, batch: int) -> bool:
        """Whether a one-token step of ``batch`` rows reads the layer inputs' rings in place of the keys' and
        values' (the rule ``txlserve::attend_one`` applies, kernels/ops.cpp ``absorbs``; for reports such as
        ``bench decode``'s bytes a step reads)."""
        c = self.cfg
        return (self.absorb_min_bytes is not None
                and batch * self.mem_len * 2 * c.n_head * c.d_head * 4 >= self.absorb_min_bytes)

    @property
    def kernels(self) -> bool:
        """Whether calls go through the C kernels now: not while training (they have no attention dropout)."""
        return self.fused and not self.model.training

    def forward(self, hid: Tensor, k: Tensor, v: Tensor, seen: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """One call on a state's tensors, which it advances in place: the last layer's outputs [batch, chunk,
        d_model] and the next token's scores [batch, vocab] (float32). Tensors in and out, so it can be traced."""
        chunk = tokens.size(1)
        fused = self.kernels or (self.gpu_fused and not self.model.training and gpu_attention.usable())
        cache = RingCache(hid, k, v, seen, self.r_head_k, chunk, fused, products=self.kernel_products(chunk),
                          absorb=self.absorb_min_bytes)
        h, _ = self.model.hidden(tokens, cache=cache)  # [batch, chunk, d_model]
        seen += chunk
        return h, self.model.crit.logits(h[:, -1]).float()  # [batch, vocab]

    def forward_rows(self, rows: Tensor, seen: Tensor, tokens: Tensor, start: Tensor, counts: Tensor,
                     last: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`forward` on sessions where they lie (a :class:`RowBatch`'s addresses ``rows [3, n_layer, batch]``
        and ``seen``, which it advances in place), the tokens of ``tokens [N, L]`` read in order, row ``b`` fed
        ``counts[b]`` of them from ``start[b]`` (``last[b]``: its last): the last layer's outputs [N, L, d_model]
        and the scores after each row's last token [batch, vocab]."""
        cache = RingCache(None, None, None, seen, self.r_head_k, 0, self.kernels, addr=rows, ring=self.ring,
                          start=start, products=self.kernel_products(1), absorb=self.absorb_min_bytes)  # <= MAX_CHUNK
        h, _ = self.model.hidden(tokens, cache=cache)  # [N, L, d_model]
        seen += counts
        return h, self.model.crit.logits(h.flatten(0, 1).index_select(0, last)).float()  # [batch, vocab]

    def graph(self, chunk: int, rows: bool = False) -> torch.jit.ScriptModule | None:
        """:meth:`forward` for ``chunk`` tokens (``rows``: :meth:`forward_rows`, any tokens), traced once per length
        (on first use) by :func:`trace_step`; None for chunks longer than MAX_TRACED_CHUNK, or where tracing failed
        (TorchScript is deprecated and may go): calls then run eagerly, with the same results."""
        if not rows and not 1 <= chunk <= MAX_TRACED_CHUNK:
            return None
        chunk = 0 if rows else chunk  # one graph serves every packing of a row batch (its sizes stay symbolic)
        key = (chunk, rows, self.step_kernels)
        with self._tracing:
            if key not in self._graphs and self.traced:
                try:
                    self._graphs[key] = trace_step(self, chunk, rows)
                except Exception as err:  # any failure leaves the eager path, which is exact
                    log.warning("steps run eagerly: tracing them failed (%s: %s)", type(err).__name__, err)
                    self.traced = False
            return self._graphs.get(key) if self.traced else None

    def one_token_graph(self) -> torch.jit.ScriptModule | None:
        """The graph of a decode step (:meth:`graph` of one token)."""
        return self.graph(1)

    @torch.no_grad()
    def warm_up(self) -> None:
        """Trace the one-token step (of a state's, and of a row table's batch where that is the server's) and run
        it twice on a scratch state, so that the first request does not pay for it (about 0.3 s each for the
        bundled model: the trace, then TorchScript's profiling runs)."""
        if self.traced and self.one_token_graph() is not None:
            tokens = torch.zeros(1, 1, dtype=torch.long, device=self.device)  # [1, 1]
            batches: list[DecodeState | RowBatch] = [self.empty(1)]
            if self.kernels:  # the engine loop's batch (Decoder.table): a graph of its own
                table = RowTable(self.empty, 1)
                table.join(self.empty(1))
                batches.append(table.active())
            with contextlib.suppress(Exception):  # a failure has been logged, and steps run eagerly
                for _ in range(2):
                    for batch in batches:
                        self.advance(batch, tokens)

    def kernel_products(self, tokens: int) -> bool:
        """Whether a call of ``tokens`` a row takes its products from the C tiles: with the kernels, where
        :meth:`tune_step_products` (a step's few tokens) or :meth:`tune_products` (longer calls) kept them."""
        return self.kernels and (self.step_kernels if tokens <= MAX_CHUNK else self.chunk_kernels)

    @torch.no_grad()
    def tune_products(self, chunk: int, rounds: int = 4) -> dict[str, float] | None:
        """Time a layer on a ``chunk``-token call against a full ring, its products in the C tiles and in
        torch's, and keep torch's for every call of more than MAX_CHUNK tokens a row only where they are at
        least 5% faster (:data:`TORCH_MARGIN`: the tiles give the same bits at any thread count). Hosts differ:
        on the AMD hosts the tiles ran a chunk's products about twice as fast as torch's; on an Intel host with
        AVX-512 torch's made a whole prefill 1.14-1.23x faster (BENCHMARKS.md, "A prefill chunk's products").
        Rounds alternate which goes first and which layer they run, so neither always finds it warm. One
        decision per shape and thread count in a process (:data:`_TUNED`, under a lock), so engines in one
        process agree to the last bit. The milliseconds a layer each way, or None where there is nothing to
        choose."""
        if not self.kernels or chunk <= MAX_CHUNK:
            return None
        c = self.cfg
        key = (c.d_model, c.n_head, c.d_head, c.d_inner, c.pre_lnorm, self.mem_len, chunk, torch.get_num_threads())
        with _TUNING:
            if key not in _TUNED:
                _TUNED[key] = self._time_products(1, chunk, rounds)
        tuned = _TUNED[key]
        self.chunk_kernels = not tuned["torch_ms"] < TORCH_MARGIN * tuned["kernel_ms"]
        return tuned

    @torch.no_grad()
    def tune_step_products(self, rows: int = STEP_TUNE_ROWS, rounds: int = 4) -> dict[str, float] | None:
        """:meth:`tune_products` for a decode step: a layer on ``rows`` sessions' one token each, its products in
        the C kernel and in torch's, the attention the C kernel's both ways. The C products stream each weight
        once a row: on AVX-512 hosts faster than torch's few-row products, but on an AVX2-only AMD EPYC (Zen 3)
        their register tiles ran 10-20x slower than torch's at 8 to 64 rows, and the bundled model's step at
        64 rows took 120 ms against 21 with torch's (BENCHMARKS.md, "Decode steps on an AVX2-only host")."""
        if not self.kernels:
            return None
        c = self.cfg
        key = ("step", c.d_model, c.n_head, c.d_head, c.d_inner, c.pre_lnorm, self.mem_len, rows,
               torch.get_num_threads())
        with _TUNING:
            if key not in _TUNED:
                _TUNED[key] = self._time_products(rows, 1, rounds)
        tuned = _TUNED[key]
        self.step_kernels = not tuned["torch_ms"] < TORCH_MARGIN * tuned["kernel_ms"]
        return tuned

    def _time_products(self, rows: int, chunk: int, rounds: int) -> dict[str, float]:
        c = self.cfg
        # a full ring (the chunk attends to all of it, as a prefill's later ones do) of up to TUNE_RING slots:
        # past that both ways' time grows alike with the ring, and a longer one only took longer to time and
        # filled the memory (mem_len 65,536: 40 s and 13 GB at start-up for the bundled model's 16-row step)
        m = min(self.mem_len, TUNE_RING)
        state = self.empty(rows, ring=m)
        state.seen.fill_(m)
        r_head_k = self._layout(self.r_head_k[:, :, : m + 1].contiguous())
        # [n_layer, n_head, m+1, d_head]: distances 0..m
        rng = torch.Generator(self.device).manual_seed(0)  # not the global one: loading draws nothing
        h = torch.randn(rows, chunk, c.d_model, dtype=self.dtype, device=self.device, generator=rng)
        # [rows, chunk, d_model]

        def seconds(kernels: bool, i: int) -> float:
            cache = RingCache(state.hid, state.k, state.v, state.seen, r_head_k, chunk, True, products=kernels)
            u, v = self.model.biases(i)
            t0 = time.perf_counter()
            self.model.layers[i](h, cache.positions, u, v, None, cache.layer(i))
            return time.perf_counter() - t0

        seconds(True, 0), seconds(False, 0)  # untimed: the first of each allocates
        best = {True: float("inf"), False: float("inf")}
        for r in range(rounds):
            for kernels in ((True, False) if r % 2 else (False, True)):
                best[kernels] = min(best[kernels], seconds(kernels, (r + 1) % c.n_layer))
        kernel_ms, torch_ms = 1e3 * best[True], 1e3 * best[False]
        what = f"a decode step's products ({rows} rows)" if chunk == 1 else \
            f"a prefill chunk's products ({chunk} tokens)"
        log.info("%s: %s (a layer: the C tiles %.2f ms, torch's %.2f ms)", what,
                 "torch's" if torch_ms < TORCH_MARGIN * kernel_ms else "the C tiles", kernel_ms, torch_ms)
        return {"kernel_ms": kernel_ms, "torch_ms": torch_ms}

    def step(self, state: DecodeState, tokens: Tensor) -> Tensor:
        """:meth:`advance`, with every token's scores: logits [batch, chunk, vocab] (float32)."""
        h = self.advance(state, tokens)
        return state.last_logits[:, None] if tokens.size(1) == 1 else self.logits(h)

    @torch.no_grad()
    def logits(self, h: Tensor) -> Tensor:
        """Scores over the vocabulary for the last layer's outputs ``h [..., d_model]``: [..., vocab] float32."""
        return self.model.crit.logits(h).float()

    def prefill(self, state: DecodeState, tokens: Tensor, *, chunk_size: int = 512) -> Tensor:
        """Feed a long ``tokens [batch, n]`` in chunks (a banded mask per chunk); outputs [batch, n, d_model]."""
        if tokens.size(1) == 0:
            return torch.zeros(state.batch, 0, self.cfg.d_model, device=self.device, dtype=self.dtype)
        return torch.cat([self.advance(state, tokens[:, s:s + chunk_size])
                          for s in range(0, tokens.size(1), chunk_size)], dim=1)

    @torch.no_grad()
    def project_kv(self, hid: Tensor) -> tuple[Tensor, Tensor]:
        """The ring's keys and values for stored layer inputs ``hid [n_layer, m, d_model]``: [n_layer, H, m, Dh]."""
        kernel = self.kernel_products(hid.size(1))
        kv = [layer.dec_attn.project_kv(hid[i][None], kernel) for i, layer in enumerate(self.model.layers)]
        return torch.stack([k[0] for k, _ in kv]), torch.stack([v[0] for _, v in kv])


class _Forward(torch.nn.Module):
    """:meth:`Decoder.forward` (or ``forward_rows``) as a module holding the model, so that a trace reads the
    weights from the model (shared, as they are) instead of freezing copies of them as constants."""

    def __init__(self, decoder: Decoder, rows: bool) -> None:
        super().__init__()
        self.model, self.forward_fn = decoder.model, decoder.forward_rows if rows else decoder.forward
        self.register_buffer("r_head_k", decoder.r_head_k, persistent=False)

    def forward(self, *state: Tensor) -> tuple[Tensor, Tensor]:
        return self.forward_fn(*state)


def trace_step(decoder: Decoder, chunk: int, rows: bool = False) -> torch.jit.ScriptModule:
    """A call of ``chunk`` tokens as one TorchScript graph: one Python call instead of a few hundred torch ops,
    each of which gives the GIL up and takes it back, so a server's event loop no longer stretches every step (a
    64-row step took twice as long beside one in BENCHMARKS.md), and batch-1 steps lose most of their dispatch
    cost. The batch size stays symbolic (sizes are traced as ops), so one trace serves every batch; tests check
    it equals :meth:`Decoder.forward` at other batch sizes, ring wrap included. Traced on a scratch state (with
    ``rows``, two scratch sessions read where they lie, whose addresses are the graph's input, not constants)."""
    if rows:  # two sessions fed 1 and 2 tokens
        table = RowTable(decoder.empty, 2)
        for _ in range(2):
            table.join(decoder.empty(1))
        view, start = table.active(), torch.tensor([0, 1, 3], device=decoder.device)  # [batch+1]
        inputs = (view.rows, view.seen, torch.zeros(1, 3, dtype=torch.long, device=decoder.device), start,
                  start.diff(), start[1:] - 1)
    else:
        scratch = decoder.empty(2)
        tokens = torch.zeros(2, chunk, dtype=torch.long, device=decoder.device)  # [batch, chunk]
        inputs = (scratch.hid, scratch.k, scratch.v, scratch.seen, tokens)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # Python ints of sizes: checked by the tests
        warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13 deprecates tracing; the fallback is eager
        return torch.jit.trace(_Forward(decoder, rows), inputs, check_trace=False)

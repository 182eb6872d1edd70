"""A fake engine for in-process tests of the request lifecycle: it speaks the engine loop's interface
(``submit`` -> an async iterator of token events ending with ``Finished``), and the test decides when each
token is produced, so nothing depends on timing.

Each request generates the letters of ``"abcdef..."``, one per ``release()`` of the gate; a prompt containing
``FAIL`` fails after its first token; a cancel ends the request at the next token with what was generated.
The state it commits is a real (small) session state, so a real store validates and keeps it.
"""

from __future__ import annotations

import asyncio
import string
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from model.engine import TokenEvent
from model.tokenizer import ByteTokenizer
from server.scheduler import PHASES, Finished
from txlserve.errors import InvalidRequestError

N_LAYER, D_MODEL, MEM_LEN = 2, 8, 16


@dataclass
class FakeState:
    seen: torch.Tensor  # [1]: tokens seen, as DecodeState has it
    batch: int = 1
    row_bytes: int = 64


class FakeEngine:
    tokenizer = ByteTokenizer()
    fingerprint = "fake-engine"
    mem_len = MEM_LEN
    clamp_len = 0
    config = SimpleNamespace(n_layer=N_LAYER, d_model=D_MODEL, vocab_size=256)
    decoder = SimpleNamespace(dtype=torch.float32)
    tokenizer_id = "byte:fake"
    window_len = N_LAYER * MEM_LEN + 1
    row_bytes = 2 * N_LAYER * MEM_LEN * D_MODEL * 4  # a session's key and value rings, as Engine.row_bytes

    def check_window(self, window: list[int], tokens_seen: int, *, every_id: bool = False) -> list[int]:
        return window[-self.window_len:]

    def renumber(self, state: FakeState, tokens_seen: int) -> None:
        state.seen[0] = tokens_seen

    def encode(self, text: str | bytes) -> list[int]:
        return self.tokenizer.encode(text)

    def new_state(self) -> FakeState:
        return FakeState(torch.zeros(1, dtype=torch.long))

    def import_state(self, tensors: dict, *, tokens_seen: int, fingerprint: str) -> FakeState:
        assert fingerprint == self.fingerprint
        return FakeState(torch.tensor([tokens_seen]))

    def persisted_nbytes(self, dtype: torch.dtype | None = None) -> int:
        return N_LAYER * MEM_LEN * D_MODEL * (dtype or torch.float32).itemsize + 256 * 4

    def export_state(self, state: FakeState, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        seen = int(state.seen[0])
        return {"mems": torch.full((N_LAYER, min(seen, MEM_LEN), D_MODEL), float(seen), dtype=dtype),
                "last_logits": torch.zeros(256)}


@dataclass
class FakeRequest:
    scheduler: FakeScheduler
    state: FakeState
    ids: list[int]
    params: object
    stream: asyncio.Queue | None = None
    scored: bool = True  # an append's text scored, or only read
    cancelled: bool = False
    woken: asyncio.Event = field(default_factory=asyncio.Event)  # a cancel, or the scheduler's reads opened
    events: list[TokenEvent] = field(default_factory=list)
    result: FakeState | None = None  # the state its Finished handed back
    copies: list[FakeRequest] = field(default_factory=list)  # the same prompt's other choices (submit's copies)

    def cancel(self) -> None:
        self.cancelled = True
        self.scheduler.wake()
        self.woken.set()

    async def __aiter__(self) -> AsyncIterator[TokenEvent | Finished]:
        s = self.scheduler
        s.running.append(self)
        try:
            seen = int(self.state.seen[0]) + len(self.ids)
            if self.params is None and not s.reads_open:  # held (reads_open False) until opened or cancelled
                s.reading.set()
                while not s.reads_open and not self.cancelled:
                    await self.woken.wait()
                    self.woken.clear()
                if self.cancelled:  # as the engine loop ends a cancelled prompt: nothing read, nothing to store
                    yield Finished(None, int(self.state.seen[0]), "cancelled")
                    return
            if self.params is None:  # an append: read the text, no tokens
                self.result = FakeState(torch.tensor([seen]))
                yield Finished(self.result, seen, None)
                return
            reason, n, generated = None, 0, []
            for i in range(self.params.max_tokens):
                await s.gate.acquire()
                if self.cancelled:
                    reason = "cancelled"
                    break
                if i == 1 and any(bytes(self.ids[j:j + 4]) == b"FAIL" for j in range(len(self.ids))):
                    raise InvalidRequestError("the fake engine was told to fail")
                last = i + 1 == self.params.max_tokens
                event = TokenEvent(ord(string.ascii_lowercase[i % 26]), string.ascii_lowercase[i % 26],
                                   finish_reason="length" if last else None)
                seen, n = seen + 1, n + 1
                generated.append(event.token)
                self.events.append(event)
                if last or self.stream is None:
                    yield event
                else:  # as the engine loop does: tokens but the last go straight to the stream
                    self.stream.put_nowait(event)
            self.result = FakeState(torch.tensor([seen]))
            yield Finished(self.result, seen, reason or "length", completion_tokens=n, generated=generated)
        finally:
            s.running.remove(self)


class FakeScheduler:
    """What the runtime needs of the engine loop: ``submit``, gauges, ``stop``."""

    def __init__(self, engine: FakeEngine, *, open_gate: bool = True) -> None:
        self.engine, self.capacity, self.steps, self.waiting = engine, 8, 0, 0
        self.running: list[FakeRequest] = []  # the requests generating, as the engine loop's rows
        self.gate = asyncio.Semaphore(10**6 if open_gate else 0)
        self.requests: list[FakeRequest] = []
        self.reads_open = True  # False: reads without generation (appends, rebuilds) wait for open_reads()
        self.reading = asyncio.Event()  # set once such a read waits

    @property
    def batch_size(self) -> int:
        return len(self.running)

    generated = prompt_tokens = 0  # /metrics' engine loop figures: a fake loop spends no time

    def loop_seconds(self) -> dict[str, float]:
        return dict.fromkeys(PHASES, 0.0)

    def cpu_seconds(self) -> float | None:
        return None

    def submit(self, state: FakeState, ids: list[int], params: object, *, stream: asyncio.Queue | None = None,
               scored: bool = True, copies: list = (), **_: object) -> FakeRequest:
        request = FakeRequest(self, state, list(ids), params, stream, scored=scored)
        request.copies = [FakeRequest(self, FakeState(state.seen.clone()), list(ids), p, s, scored=scored)
                          for p, s in copies]
        self.requests += [request, *request.copies]
        return request

    def open_reads(self) -> None:
        self.reads_open = True
        for request in self.requests:
            request.woken.set()

    def release(self, n: int = 1) -> None:
        """Let ``n`` more tokens be produced."""
        for _ in range(n):
            self.gate.release()

    def wake(self) -> None:
        """A cancelled request notices at its next token: let it look."""
        self.gate.release()

    def stop(self, timeout: float = 0) -> None:
        pass

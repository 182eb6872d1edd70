"""The engine loop: one thread owns the device and advances every active request together.

Each iteration reads one prefill chunk of one waiting request (round robin, so a
long document never stalls the streams), then runs one decode step for every
generating request at once (continuous batching: requests join and leave at any
step). Results go back to the asyncio side through each job's ``emit``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from model.decode import DecodeState
from model.engine import Engine, Generation, Score, TokenEvent
from model.sampling import SamplingParams

log = logging.getLogger("txlserve.scheduler")


@dataclass
class JobDone:
    tensors: dict[str, torch.Tensor] | None  # the session state to commit; None when nothing changed
    tokens_seen: int
    finish_reason: str | None  # "stop" | "length" | "cancelled" | None (append)
    completion_tokens: int = 0
    score: Score | None = None


@dataclass
class JobFailed:
    error: BaseException


@dataclass
class Job:
    state: DecodeState  # batch-1 state while prefilling; moved into the shared batch to decode
    pending: list[int]  # tokens still to feed
    params: SamplingParams | None  # None: feed only (append), no generation
    emit: Callable[[Any], None]
    hot: bool = True  # export the key/value cache for the hot tier
    dtype: torch.dtype | None = None  # dtype of the exported mems
    cancelled: bool = False
    generation: Generation | None = None
    score: Score = field(default_factory=lambda: Score(0, 0.0))

    def cancel(self) -> None:
        self.cancelled = True  # read by the engine thread between steps


class Scheduler:
    def __init__(self, engine: Engine, *, max_batch: int = 32, prefill_chunk: int = 512) -> None:
        self.engine, self.max_batch, self.prefill_chunk = engine, max_batch, prefill_chunk
        self.inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.prefilling: deque[Job] = deque()
        self.ready: deque[Job] = deque()  # prompt read, waiting for a batch slot
        self.running: list[Job] = []
        self.batch: DecodeState | None = None
        self.steps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="txlserve-engine", daemon=True)

    @property
    def waiting(self) -> int:
        return self.inbox.qsize() + len(self.prefilling) + len(self.ready)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.inbox.put(None)
        self._thread.join(timeout)

    def submit(self, job: Job) -> Job:
        self.inbox.put(job)
        return job

    # -- the loop ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            idle = not (self.prefilling or self.ready or self.running)
            try:
                self._drain(block=idle)
                self._prefill_one()
                self._decode_step()
            except Exception as err:  # a bug must fail the requests involved, never the loop
                log.exception("engine step failed")
                for job in [*self.running, *self.prefilling, *self.ready]:
                    job.emit(JobFailed(err))
                self.running, self.batch = [], None
                self.prefilling.clear()
                self.ready.clear()

    def _drain(self, block: bool) -> None:
        try:
            job = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            while True:
                if job is not None:
                    self.prefilling.append(job)
                job = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _prefill_one(self) -> None:
        if not self.prefilling:
            return
        job = self.prefilling[0]  # stays counted as waiting while its chunk runs
        if job.cancelled:  # the prompt joins the session only once completely read
            self.prefilling.popleft()
            job.emit(JobDone(None, int(job.state.seen[0]), "cancelled"))
            return
        chunk, job.pending = job.pending[: self.prefill_chunk], job.pending[self.prefill_chunk:]
        if chunk and job.params is None:
            part = self.engine.score(job.state, chunk)
            job.score = Score(job.score.tokens + part.tokens, job.score.logprob + part.logprob)
        elif chunk:
            self.engine.feed(job.state, chunk)
        if job.pending:
            self.prefilling.rotate(-1)  # round robin: the next waiting request reads its next chunk
            return
        self.prefilling.popleft()
        if job.params is None:
            job.emit(self._done(job, job.state, 0, None))
        else:
            job.generation = Generation(job.params)
            self.ready.append(job)

    def _done(self, job: Job, state: DecodeState, row: int, reason: str | None) -> JobDone:
        tensors = self.engine.export_state(state, row, dtype=job.dtype, hot=job.hot)
        n = len(job.generation.tokens) if job.generation else 0
        return JobDone(tensors, int(state.seen[row]), reason, n, job.score if job.params is None else None)

    def _regroup(self, leaving: list[int]) -> None:
        """Take finished rows out of the batch and let waiting requests in (the only copies of the rings)."""
        for r in leaving:
            job = self.running[r]
            job.emit(self._done(job, self.batch, r, job.generation.finish_reason or "cancelled"))
        keep = [r for r in range(len(self.running)) if r not in set(leaving)]
        joining = []
        while self.ready and len(keep) + len(joining) < self.max_batch:
            joining.append(self.ready.popleft())
        if not leaving and not joining:
            return
        parts = ([self.batch.rows(keep)] if keep else []) + [j.state for j in joining]
        self.running = [self.running[r] for r in keep] + joining
        self.batch = DecodeState.cat(parts) if parts else None

    def _decode_step(self) -> None:
        self._regroup([r for r, job in enumerate(self.running) if job.cancelled])
        if not self.running:
            return
        logits = self.batch.last_logits.float().cpu()  # [batch, vocab]
        events: list[TokenEvent] = [job.generation.on_logits(logits[r]) for r, job in enumerate(self.running)]
        tokens = torch.tensor([[ev.token] for ev in events], device=self.engine.device)  # [batch, 1]
        for job, ev in zip(self.running, events):
            job.emit(ev)
        self.engine.decoder.step(self.batch, tokens)
        self.steps += 1
        self._regroup([r for r, ev in enumerate(events) if ev.finish_reason is not None])

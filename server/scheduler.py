"""The engine loop: one thread owns the device and advances every active request together.

Each iteration reads up to one prefill chunk of prompt tokens across the waiting
requests (round robin, so a long document never stalls the streams and many short
prompts are read at once), then runs one decode step for every request in the batch
(continuous batching over a table of rows, ``Decoder.table``: requests join and leave at
any step, and on a CPU with the fused attention a session is decoded where it lies, so
joining and leaving copy none of its rings; a short
prompt joining a busy batch is fed in those steps, whole in the next one where sessions
are decoded where they lie and a token a step otherwise, as vLLM mixes prompt tokens
into decode batches). Results go back to the asyncio side once per
iteration, one wake-up per event loop; with ``stream_interval`` N > 1 (vLLM's setting), a
request's generated tokens after its first go in groups of N, so a stream wakes its
event loop once every N steps (each wake-up cost one stream about 8% of its tokens/s:
BENCHMARKS.md, "What a token's hand-off costs"). On a GPU's graphed table the steps overlap the host's work: each
row's next token is drawn on the device at the end of its step and the next step is queued before the host has
accepted this one's tokens (``_overlapped_step``; SGLang's overlap scheduler), one stream 1.24-1.33x as fast
through the server on an H100 (BENCHMARKS.md, "Eighth lease").

Every moment of the loop's thread after its warm-up is counted in one of :data:`PHASES` (``phase_seconds``, the
metric ``txlserve_engine_loop_seconds_total``; they add up to the thread's wall time), and the thread's CPU time
is read from the kernel (:meth:`Scheduler.cpu_seconds`): where a step's host period goes, and how much of it the
thread waited (for the GIL, the device or work) rather than ran, is then measured on the machine that serves, in
the same run as its load (``bench serve``), not guessed from a sampling profiler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from model.cache import RowBatch
from model.decode import DecodeState
from model.engine import Engine, Generation, Score, TokenEvent
from model.fused import MAX_CHUNK
from model.graphs import Drawn, GraphedTable
from model.sampling import SamplingParams, ScoredTokens, drawn_on_device
from txlserve.errors import InvalidRequestError, Unavailable

log = logging.getLogger("txlserve.scheduler")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc's unit of CPU time


def _thread_cpu(native_id: int) -> float | None:
    """A thread of this process's CPU time in seconds: the scheduler's nanoseconds where the kernel keeps them,
    else user and system time in clock ticks (10 ms); None without /proc."""
    task = Path(f"/proc/self/task/{native_id}")
    try:
        return int((task / "schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime (fields 14, 15 of stat)
    except (OSError, ValueError, IndexError):
        return None


# Where the engine loop's thread spends its time (``Scheduler.phase_seconds``), each moment in exactly one:
PHASES = (
    "idle",  # waiting for a request, nothing to do
    "admit",  # taking submitted requests
    "prefill",  # reading long prompts a chunk at a time
    "regroup",  # rows leaving and joining the decode table, and each leaving request's end (its export: on a
    # GPU's overlapped steps, that waits for the step just queued, as "sync" does)
    "prepare",  # a step's per-row inputs: the tokens to feed, the draws' temperatures and numbers
    "forward",  # running (CPU) or queuing (GPU) a step of the model, and the device's draws of tokens
    "sync",  # waiting for the device's results: drawn tokens, next-token scores to the host
    "sample",  # drawing tokens on the host
    "accept",  # each generated token's text, stop strings and length, and its event
    "handoff",  # handing the events to the event loops (in an engine process: packing and sending them)
)


@dataclass
class Finished:
    """The last item of a request: the state to commit, why it ended, and (appends) the score."""

    state: DecodeState | None  # the session after this request (batch 1: the state submitted, advanced in place,
    # where the fused attention decoded it where it lay; else a copy); None: nothing was read
    tokens_seen: int
    finish_reason: str | None  # "stop" | "length" | "cancelled" | None (append)
    completion_tokens: int = 0
    score: Score | None = None
    generated: list[int] = field(default_factory=list)  # every generated token, all of them fed to the state
    queue_s: float | None = None  # submitted until the engine first worked on it
    prefill_s: float | None = None  # from then until its prompt was read
    text: str = ""  # text the generation still held back as it was cancelled, released after its last token
    ended: float | None = field(default_factory=time.monotonic)  # as the engine ended it: made then (the system's
    # clock, every process's alike; None: not known)


@dataclass
class PromptScores(ScoredTokens):
    """Each prompt token's logprob and top alternatives, sent once the prompt is read and before any generated
    token, for ``echo`` with ``logprobs`` (and appends asking for them)."""


@dataclass
class JobFailed:
    error: BaseException


@dataclass(eq=False)
class SharedState:
    """A prompt's state once read, shared by its choices waiting for a row: each copies it as it takes one, and
    the last takes it itself (that copy had been made for nobody)."""

    state: DecodeState
    waiting: int  # choices that have yet to take it (or leave)

    def take(self, copy: Callable[[DecodeState], DecodeState]) -> DecodeState:
        self.leave()
        return self.state if self.waiting == 0 else copy(self.state)

    def leave(self) -> None:
        """A choice that will not take it (it left before a row): one fewer to share it."""
        self.waiting -= 1


@dataclass(eq=False)  # identity semantics: jobs live in sets
class Job:
    state: DecodeState | None  # batch-1 state while prefilling; None once it joined the decode batch (which holds it)
    pending: list[int]  # tokens still to feed
    params: SamplingParams | None  # None: feed only (append), no generation
    loop: asyncio.AbstractEventLoop  # where the request waits: its items are put into ``inbox`` on that loop
    inbox: asyncio.Queue
    stream: asyncio.Queue | None = None  # where tokens but the last (and PromptScores) go instead, if given
    cancelled: bool = False
    prev: int | None = None  # the prompt's last token (how a word tokenizer spaces the first generated word)
    scored: bool = True  # an append is scored; a session rebuilt from its window is only read
    prompt_logprobs: int | None = None  # score every prompt token, with this many alternatives
    prompt_ranks: bool = False  # and its rank in the vocabulary (vLLM's prompt_logprobs): a count, so asked for
    prompt_scores: PromptScores = field(default_factory=PromptScores)
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None  # the engine's first work on it (a prompt chunk, or joining the batch)
    read: float | None = None  # its prompt completely read
    generation: Generation | None = None
    on_device: bool = False  # its tokens can be drawn on the device (temperature alone: no top_k, top_p, logprobs)
    score: Score = field(default_factory=lambda: Score(0, 0.0))
    held: list[TokenEvent] = field(default_factory=list)  # generated tokens not yet handed over (stream_interval)
    handed: int = 0  # generated tokens handed over so far
    prompt: set[int] = field(default_factory=set)  # the prompt's tokens, where repetition_penalty needs them
    # the other choices of the same prompt (a request's n; vLLM's child requests of a parent): they wait while this
    # job reads the prompt, then each takes a copy of its state (:meth:`Scheduler._fan_out`): read once, not n times
    copies: list[Job] = field(default_factory=list)
    # a copy's: the prompt's state, shared by its copies until each takes a row and a state of its own then (n
    # choices beyond the free rows wait holding one state between them, not one each)
    source: SharedState | None = None

    def __post_init__(self) -> None:
        if self.params is not None and self.params.repetition_penalty != 1:
            self.prompt = set(self.pending)  # pending is read away as the prompt is fed

    def start(self) -> None:
        if self.started is None:
            self.started = time.monotonic()

    def prompt_read(self) -> None:
        self.start()
        if self.read is None:
            self.read = time.monotonic()

    def cancel(self) -> None:
        self.cancelled = True  # read by the engine thread between steps

    def add_copy(self, params: SamplingParams | None, loop: Any, inbox: Any, stream: Any = None) -> Job:
        """Another choice of this job's prompt, with its own sampling and queues (see ``copies``). It holds no copy
        of the prompt (127 of a million-token one were a gigabyte, made on the event loop): it is given what it
        still has to read when it takes the state; the prompt's tokens for repetition_penalty are shared."""
        job = Job(None, [], params, loop, inbox, stream, prev=self.prev, scored=self.scored,
                  prompt_logprobs=self.prompt_logprobs, prompt_ranks=self.prompt_ranks)
        if params is not None and params.repetition_penalty != 1:
            job.prompt = self.prompt or set(self.pending)  # read only (Generation copies it)
        self.copies.append(job)
        return job


def batch_capacity(engine: Engine, *, max_batch: int, batch_bytes: int) -> int:
    """How many sessions generate together: as many as ``batch_bytes`` of rings hold, at most ``max_batch``."""
    return max(1, min(max_batch, batch_bytes // engine.row_bytes))


class EngineRequest:
    """One request in the engine: ``async for item in request`` yields (a :class:`PromptScores` when asked for,
    then) :class:`TokenEvent`s and ends with one
    :class:`Finished` (or raises what failed the request); :meth:`cancel` ends it within a step, and the
    ``Finished`` then holds what was generated so far. SSE, WebSocket, append and the CLI all read this."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.copies: list[EngineRequest] = []  # the other choices of its prompt (Scheduler.submit's ``copies``)

    def cancel(self) -> None:
        self.job.cancel()

    async def __aiter__(self) -> AsyncIterator[TokenEvent | Finished]:
        while True:
            item = await self.job.inbox.get()
            if isinstance(item, JobFailed):
                raise item.error
            yield item
            if isinstance(item, Finished):
                return


def streamed(item: Any) -> bool:
    """Whether a request's ``item`` goes to its stream queue, where it has one: every token but the one that ends
    generation, and the PromptScores; the rest go to the request itself."""
    return isinstance(item, PromptScores) or (isinstance(item, TokenEvent) and item.finish_reason is None)


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for inbox, item in items:
        inbox.put_nowait(item)


class Scheduler:
    SHORT_PROMPT = MAX_CHUNK  # prompt tokens a request may bring straight into the decode batch (read whole in a
    # step of a row table: at most what the fused attention takes a row)

    def __init__(self, engine: Engine, *, max_batch: int = 256, batch_bytes: int = 1 << 30,
                 prefill_chunk: int = 512, stream_interval: int = 1, overlap: bool = True) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, not {stream_interval}")
        self.engine, self.prefill_chunk, self.stream_interval = engine, prefill_chunk, stream_interval
        self.overlap = overlap  # on a graphed table: draw tokens on the device, a step queued before the last one's
        # tokens are handled (``_overlapped_step``)
        self._drawn: list[tuple[Drawn, list[Job | None]]] = []  # tokens drawn on the device and not yet accepted,
        # with the job each row's token is for (None: nobody's, a prompt token's step); fed by the next step
        self.capacity = batch_capacity(engine, max_batch=max_batch, batch_bytes=batch_bytes)
        self.inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()  # fed by :meth:`enqueue`
        # the copies of the jobs put into the inbox, and of those taken out: what waits there is their difference
        # (submits come from an event loop or an engine process's threads, under the lock; the loop takes them out)
        self._copies_in, self._copies_out, self._copies_lock = 0, 0, threading.Lock()
        self.prefilling: deque[Job] = deque()
        self.ready: deque[Job] = deque()  # prompt read (or short), waiting for a row of the decode table
        self.slots = engine.decoder.table(self.capacity)  # the decode batch (model.cache: RowTable or SlotTable)
        self.running: list[Job] = []  # the job of each active row
        self.active: set[Job] = set()  # accepted and not yet answered
        self.steps = 0
        self.generated = 0  # tokens accepted (each request's generated tokens)
        self.prompt_tokens_in_batch = 0  # prompt tokens read in the decode table as rows joined, not by prefill
        self.prompt_tokens_prefilled = 0  # and by prefill
        self._outbox: list[tuple[Job, asyncio.Queue, Any]] = []  # items and their queues, handed over per iteration
        self._stop = threading.Event()
        self.warmed = threading.Event()  # set once the engine thread has traced or captured its steps
        self._thread = threading.Thread(target=self._run, name="txlserve-engine", daemon=True)
        self.phase_seconds = dict.fromkeys(PHASES, 0.0)  # written by the loop's thread alone; read loop_seconds()
        self._lap_t = 0.0
        self._idle_since: float | None = None  # blocked for a request since then (its last lap): idle so far
        self._cpu_base = 0.0  # the thread's CPU time at the end of its warm-up (the phases count from there)
        self._read = dict.fromkeys(PHASES, 0.0)  # the last loop_seconds(), which the next never undercuts
        self._read_lock = threading.Lock()
        self._native_id: int | None = None

    @property
    def batch_size(self) -> int:
        return len(self.running)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens read, either way (a prompt a request's n choices share: once)."""
        return self.prompt_tokens_in_batch + self.prompt_tokens_prefilled

    @property
    def waiting(self) -> int:
        # read on other threads (a scrape, the engine process's reader) while the loop's thread rotates the deque:
        # list() copies it in one step under the GIL, where a generator over it could meet it mid-change
        copies = sum(len(job.copies) for job in list(self.prefilling)) if self.prefilling else 0
        taken = self._copies_out  # read first: a submit and its take between the two reads count, never go below
        copies += self._copies_in - taken  # a request's choices count from its submit on
        return self.inbox.qsize() + len(self.prefilling) + copies + len(self.ready)

    @property
    def busy(self) -> bool:
        """Whether the loop has work beyond the iteration it is in: rows to step, prompts to read, requests to
        take. Read on the loop's own thread (as its hand-off runs), its rows and queues are exact; a request
        arriving at that moment may count or not."""
        return bool(self.running or self.ready or self.prefilling or not self.inbox.empty())

    def start(self) -> None:
        self._thread.start()

    def _lap(self, phase: str) -> None:
        """Count the time since the last lap in ``phase``: the loop laps as it moves from one phase to the next."""
        now = time.perf_counter()
        self.phase_seconds[phase] += now - self._lap_t
        self._lap_t = now

    def loop_seconds(self) -> dict[str, float]:
        """``phase_seconds`` as of now, from any thread: a loop blocked for a request (up to half a second at a
        time) has been idle since its last lap, which a reading would otherwise count in the window after it.
        Never less than an earlier reading (a reading races the loop's laps by microseconds, and a counter that
        went back would read as a reset to Prometheus)."""
        phases = dict(self.phase_seconds)  # first the phases, then the clock, then the wait: a lap in between is
        now = time.perf_counter()  # then under-counted (and held up by the clamp below), never counted twice
        since = self._idle_since
        if since is not None:
            phases["idle"] += max(0.0, now - since)
        with self._read_lock:
            for phase, seconds in phases.items():
                phases[phase] = self._read[phase] = max(seconds, self._read[phase])
        return phases

    def cpu_seconds(self) -> float | None:
        """The loop thread's CPU time since its warm-up, as its phases count, from the kernel, read from any
        thread at no cost to the loop; None where there is no /proc (or the thread has not started)."""
        if self._native_id is None:
            return None
        cpu = _thread_cpu(self._native_id)
        return None if cpu is None else max(0.0, cpu - self._cpu_base)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():  # a step outlived the timeout: the thread fails its jobs when it ends
            log.error("the engine thread did not stop within %.0f s", timeout)
            return
        self._fail_all()

    def _fail_all(self) -> None:
        for job in list(self.active):  # nobody will advance them any more
            self._finish(job, JobFailed(Unavailable("the server is shutting down")))
        self._flush()

    def submit(self, state: DecodeState, ids: list[int], params: SamplingParams | None, *,
               scored: bool = True, prompt_logprobs: int | None = None, prompt_ranks: bool = False,
               stream: asyncio.Queue | None = None, last: int | None = None,
               copies: Sequence[tuple[SamplingParams | None, asyncio.Queue | None]] = ()) -> EngineRequest:
        """Feed ``ids`` to ``state`` (a batch-1 session the engine now owns) and, with ``params``, generate;
        without, score them (``scored``) or only read them. Called on an event loop. With ``stream``, every token
        but the one that ends generation (and the PromptScores) is put there directly, and the request yields
        only that last token and the Finished: a run that streams tokens to its client and holds back the last
        one until its commit then costs the event loop one hop per token, not two. ``last``: the state's last
        token (a session's), which spaces the first generated word when ``ids`` is empty. ``copies``: the same
        prompt's other choices (their sampling and stream), each a request of its own (the result's ``copies``);
        the prompt is read once for all of them."""
        self.check(state, ids, params)
        loop = asyncio.get_running_loop()
        job = Job(state, list(ids), params, loop, asyncio.Queue(), stream, prev=ids[-1] if ids else last,
                  scored=scored, prompt_logprobs=prompt_logprobs, prompt_ranks=prompt_ranks)
        request = EngineRequest(job)
        request.copies = [EngineRequest(job.add_copy(p, loop, asyncio.Queue(), s)) for p, s in copies]
        self.enqueue(job)
        return request

    def enqueue(self, job: Job) -> None:
        """Hand ``job`` (with its copies) to the loop; any thread."""
        if job.copies:
            with self._copies_lock:
                self._copies_in += len(job.copies)
        self.inbox.put(job)

    @staticmethod
    def check(state: DecodeState, ids: list[int], params: SamplingParams | None) -> None:
        """Refuse what the loop cannot serve, before a job exists."""
        if params is not None and not ids and int(state.seen[0]) == 0:
            raise InvalidRequestError("nothing to continue from: the prompt is empty and there is no memory "
                                      "(no session, or an empty one)", param="prompt")

    def _emit(self, job: Job, item: Any) -> None:
        """Queue ``item`` for its request. With ``stream_interval`` N > 1 a generated token after the first waits
        until N are waiting; whatever ends the request (its last token, Finished, a failure) takes the waiting
        ones with it, in order."""
        if isinstance(item, TokenEvent) and item.finish_reason is None and self.stream_interval > 1:
            job.held.append(item)
            if job.handed and len(job.held) < self.stream_interval:
                return
            item = None
        if job.held:
            held, job.held = job.held, []
            job.handed += len(held)
            for each in held:
                self._queue(job, each)
        if item is not None:
            self._queue(job, item)

    def _queue(self, job: Job, item: Any) -> None:
        self._outbox.append((job, job.stream if job.stream is not None and streamed(item) else job.inbox, item))

    def _flush(self) -> None:
        """Hand this iteration's items to the event loops: one wake-up per loop and step, not one per token."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for job, to, item in self._outbox:
            by_loop.setdefault(job.loop, []).append((to, item))
        self._outbox = []
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody is waiting any more
                loop.call_soon_threadsafe(_deliver, items)

    def _finish(self, job: Job, item: Finished | JobFailed) -> None:
        """A job's last word; every accepted job gets exactly one, whatever fails."""
        if job in self.active:
            self.active.discard(job)
            self._emit(job, item)

    # -- the loop ---------------------------------------------------------------------------------
    def _run(self) -> None:
        self._native_id = threading.get_native_id()
        try:
            try:
                self.engine.decoder.warm_up()  # before the first request, not during it
                if isinstance(self.slots, GraphedTable):
                    self.slots.capture_all()
            except Exception:  # a warm-up is an optimisation: the loop must run whatever it met
                log.exception("the engine's warm-up failed")
            finally:
                self.warmed.set()
            self._lap_t = time.perf_counter()  # the phases count from here: the warm-up is not the loop's
            self._cpu_base = _thread_cpu(self._native_id) or 0.0
            self._loop()
        finally:
            self._fail_all()  # whatever is still active when the loop ends is answered by this thread

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                idle = not (self.prefilling or self.ready or self.running)
                self._idle_since = self._lap_t if idle else None
                self._drain(block=idle)
                self._idle_since = None  # before the lap: a reading between the two under-counts, never twice
                self._lap("idle" if idle else "admit")
                self._prefill()
                self._lap("prefill")
                self._decode_step()
                self._flush()
                self._lap("handoff")
            except Exception as err:  # a bug must fail the requests involved, never the loop
                self._idle_since = None
                log.exception("engine step failed")
                for job in list(self.active):
                    self._finish(job, JobFailed(err))
                self.running, self._drawn = [], []
                if isinstance(self.slots, GraphedTable):
                    self.slots.clear()  # its rows and graphs stay: a new one would take a second capacity first
                else:
                    self.slots = self.engine.decoder.table(self.capacity)
                self.prefilling.clear()
                self.ready.clear()
                self._flush()
                self._lap("regroup")

    def _drain(self, block: bool) -> None:
        try:
            job = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            while True:
                if job is not None:
                    self.active.add(job)
                    self.active.update(job.copies)
                    self._copies_out += len(job.copies)  # (before _admit hands them on, counted there then)
                    self._admit(job)
                job = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _admit(self, job: Job) -> None:
        """A short prompt joins the decode batch directly and is read there: into an empty batch in one forward
        pass with every other prompt that joins in the same iteration (of its length, where the table copies
        sessions in: :meth:`_read_prompts`; on a GPU's graphed steps, a token a replay, as into a busy batch),
        into a busy one in the decode steps (:meth:`_regroup`); a longer one is prefilled in chunks first.
        Many requests arriving at once then cost one batched pass, not one each; a short prompt's other choices
        (``Job.copies``) join as requests of their own, a longer one's wait until it is read."""
        if job.params is not None and len(job.pending) <= self.SHORT_PROMPT and job.prompt_logprobs is None:
            copies = self._fan_out(job)
            if copies is None:
                return
            self._generation(job)
            self.ready.append(job)
            for other in copies:
                self._admit(other)
        else:
            self.prefilling.append(job)

    def _fan_out(self, job: Job) -> list[Job] | None:
        """``job``'s copies, each given what it has still to read, its timings, and one copy of its state between
        them (each copies it again as it takes a row: :meth:`_own_states`); None if that copy failed (a device out
        of memory, say), which fails ``job`` and its copies alone."""
        copies, job.copies = job.copies, []
        rows = sum(other.params is not None for other in copies)  # scored choices end with the job's own state
        try:  # job's own state advances in its row
            source = SharedState(self.engine.copy_state(job.state), rows) if rows else None
        except Exception as err:
            log.exception("copying a prompt's state for its other choices failed")
            self._fail_each([job, *copies], err)
            return None
        for other in copies:
            other.source, other.pending = source if other.params is not None else None, list(job.pending)
            other.started, other.read = job.started, job.read
        return copies

    def _own_states(self, joining: list[Job]) -> list[Job]:
        """``joining``, each prompt's copy among them given a state of its own as it takes a row; one whose copy
        failed is failed, alone, and left out."""
        ready = []
        for job in joining:
            if job.state is None:
                source, job.source = job.source, None
                try:
                    job.state = source.take(self.engine.copy_state)
                except Exception as err:
                    log.exception("copying a prompt's state for one of its choices failed")
                    self._finish(job, JobFailed(err))
                    continue
            ready.append(job)
        return ready

    def _fail_each(self, jobs: list[Job], err: BaseException) -> None:
        for job in jobs:
            self._finish(job, JobFailed(err))

    def _generation(self, job: Job) -> None:
        job.generation = Generation(job.params, self.engine.tokenizer, job.prev, prompt=job.prompt)
        job.on_device = drawn_on_device(job.params, self.engine.config.vocab_size)

    def _prefill(self) -> None:
        """Read up to ``prefill_chunk`` prompt tokens per iteration, across waiting requests in turn: a long
        document is read a chunk at a time between decode steps, and many short prompts are all read at once."""
        budget = self.prefill_chunk
        for _ in range(len(self.prefilling)):
            if budget <= 0 or not self.prefilling:
                return
            budget -= self._prefill_one(budget)

    def _prefill_one(self, budget: int) -> int:
        """One chunk (at most ``budget`` tokens) of the first waiting request's prompt; the tokens read."""
        job = self.prefilling[0]  # stays counted as waiting while its chunk runs
        # a prompt joins the session only once completely read; one that a request's other choices share is read on
        # while any of them wants it, the first's own cancel notwithstanding
        if job.cancelled and all(other.cancelled for other in job.copies):
            self.prefilling.popleft()
            for each in (job, *job.copies):
                self._finish(each, Finished(None, int(job.state.seen[0]), "cancelled"))
            return 0
        chunk, job.pending = job.pending[:budget], job.pending[budget:]
        job.start()
        try:  # a prefill touches only this job's own state: a failure fails only this job (and its copies)
            if chunk and job.prompt_logprobs is not None:
                part = self.engine.token_scores(job.state, chunk, job.prompt_logprobs, ranks=job.prompt_ranks)
                job.prompt_scores.extend(part)
                known, logprob = part.known()
                job.score = Score(job.score.tokens + known, job.score.logprob + logprob)
            elif chunk and job.params is None and job.scored:
                part = self.engine.score(job.state, chunk)
                job.score = Score(job.score.tokens + part.tokens, job.score.logprob + part.logprob)
            elif chunk:
                self.engine.feed(job.state, chunk)
            self.prompt_tokens_prefilled += len(chunk)
        except Exception as err:
            log.exception("prefill failed")
            self.prefilling.popleft()
            self._fail_each([job, *job.copies], err)
            return len(chunk)
        if job.pending:
            self.prefilling.rotate(-1)  # round robin: the next waiting request reads its next chunk
            return len(chunk)
        job.prompt_read()
        self.prefilling.popleft()
        copies = self._fan_out(job)
        for each in (job, *copies) if copies is not None else ():  # the other choices start where it ends
            each.score = job.score
            if job.prompt_logprobs is not None:
                self._emit(each, job.prompt_scores)
            if each.params is None:  # scored alone, ending now: the prompt's state is theirs too (never stored)
                each.state = job.state
                self._finish(each, self._done(each, None, None))
            else:
                self._generation(each)
                self.ready.append(each)
        return max(1, len(chunk))

    def _done(self, job: Job, row: int | None, reason: str | None) -> Finished:
        """The request's session as a batch-1 state of its own: the job's, or its ``row`` of the decode table,
        exported (the session that joined; a copy where the table copies sessions in)."""
        # int() of a device's count waits for the step just queued (a GPU's overlapped steps): once a request, and
        # by then the host's own work for the step has mostly outlasted it
        if row is None and job.state is None:  # a prompt's copy that left before it took a row: nothing of its own
            source, job.source = job.source, None
            source.leave()  # the last to take it need not copy it
            return Finished(None, int(source.state.seen[0]), reason)
        if job.pending:  # left while its prompt was still being fed: a partial prompt is never stored
            return Finished(None, int(job.state.seen[0]) if row is None else self.slots.seen_at(row), reason)
        state = job.state if row is None else self.slots.export(row)
        generated = list(job.generation.tokens) if job.generation else []
        queue_s = None if job.started is None else job.started - job.submitted
        prefill_s = None if job.read is None or job.started is None else job.read - job.started
        held = job.generation.release() if job.generation and reason == "cancelled" else ""
        return Finished(state, int(state.seen[0]), reason, len(generated),
                        job.score if job.params is None else None, generated, queue_s, prefill_s, held)

    def _regroup(self, leaving: list[int], failed: dict[int, BaseException] | None = None) -> None:
        """Finished (or failed) rows leave the decode table and waiting requests join it while it has rows; no
        move copies another session (and with the fused attention none copies any ring at all). Joining short
        prompts are then read in place, in one pass, when the batch was empty; otherwise they ride along in the
        next decode step (:meth:`_decode_step`: whole, in a row table; else a token a step): a pass of their own
        would hold every generating row up, and requests that end at different steps join a few at a time, so a
        load of mixed lengths had such a pass almost every step (BENCHMARKS.md: the engine loop at 16 streams
        0.82 -> 0.87 of the engine alone)."""
        failed = failed or {}
        for r in leaving:
            job = self.running[r]
            self._finish(job, self._done(job, r, job.generation.finish_reason or "cancelled"))
        self._drop(set(leaving), failed)
        joining = []
        while self.ready and len(joining) < self.slots.free:
            job = self.ready.popleft()
            if job.cancelled:  # left before its first token: commit the prompt
                self._finish(job, self._done(job, None, "cancelled"))
                continue
            joining.append(job)
        first = len(self.running)
        joining = self._own_states(joining)  # a prompt's copies take their own states here
        for job in sorted(joining, key=lambda j: len(j.pending)):  # prompts of one length in adjacent rows
            self.slots.join(job.state)
            job.start()
            job.state = None  # the row is its state now
            self.running.append(job)
            if not job.pending:  # nothing to read (a session continued from its memory alone)
                job.prompt_read()
        if first == 0 and not self.slots.prompts_in_steps:  # no other row to hold up; on a GPU's graphed steps
            # the prompts ride along here too, a token a replay (GraphedTable.prompts_in_steps)
            self._lap("regroup")
            failed = self._read_prompts(first)
            self._lap("forward")
            self._drop(set(), failed)

    def _read_prompts(self, first: int) -> dict[int, BaseException]:
        """Feed the prompts of rows [first, n) that joined with tokens to read, on the decode table's rows in place:
        in one packed pass where sessions are decoded where they lie (each row its own length), else one pass per
        run of equal lengths; the rows whose pass failed, with the error."""
        failed: dict[int, BaseException] = {}
        r = first
        while r < len(self.running):
            length = len(self.running[r].pending)
            end = r + 1
            while end < len(self.running) and (len(self.running[end].pending) == length or (
                    length and self.slots.ragged)):  # rows are sorted by length: the rest all have tokens
                end += 1
            group = self.running[r:end]
            try:
                if length:
                    rows = self.slots.active(r, end)  # views of the group's rows
                    if self.slots.ragged:
                        self._advance_packed(rows, [job.pending for job in group])
                    else:
                        tokens = torch.tensor([job.pending for job in group], device=self.engine.device)  # [k, length]
                        self.engine.decoder.advance(rows, tokens)
                    self.slots.stepped(rows, r)
                    self.prompt_tokens_in_batch += sum(len(job.pending) for job in group)
            except Exception as err:  # a pass touches only its group's rows: only that group fails
                log.exception("reading prompts failed")
                failed.update((i, err) for i in range(r, end))
            else:
                for job in group:
                    job.pending = []
                    job.prompt_read()
            r = end
        return failed

    def _advance_packed(self, rows: RowBatch, feeds: list[list[int]]) -> None:
        """Feed row ``b`` of ``rows`` the tokens ``feeds[b]`` (1 to MAX_CHUNK of them), all in one call."""
        dev = self.engine.device
        start = torch.tensor([0] + [len(f) for f in feeds], device=dev).cumsum(0)  # [batch+1]
        tokens = torch.tensor([t for f in feeds for t in f], device=dev)[None]  # [1, T]
        self.engine.decoder.advance_rows(rows, tokens, start)

    def _drop(self, rows: set[int], failed: dict[int, BaseException]) -> None:
        """Answer the failed rows' requests, then free ``rows`` and those rows (highest first: the last row,
        moved into a freed one, stays valid)."""
        for r, err in failed.items():
            self._finish(self.running[r], JobFailed(err))
        for r in sorted(rows | set(failed), reverse=True):
            self.slots.leave(r)
            self.running[r] = self.running[-1]
            self.running.pop()

    def _decode_step(self) -> None:
        for job in [j for j in self.ready if j.cancelled]:  # left before its first token: commit the prompt
            self.ready.remove(job)
            self._finish(job, self._done(job, None, "cancelled"))
        cancelled = [r for r, job in enumerate(self.running) if job.cancelled]
        if cancelled or self.ready:  # a cancelled row's token drawn on the device, not yet accepted, is dropped:
            self._regroup(cancelled)  # the session holds every token its stream was sent, and no other
        self._lap("regroup")
        if not self.running:
            self._drawn = []  # drawn for rows that left: nobody's
            return
        on_device = self.overlap and isinstance(self.slots, GraphedTable)
        if on_device and all(job.on_device for job in self.running):
            self._overlapped_step()
        else:
            self._step(on_device)

    def _accept_drawn(self) -> tuple[dict[int, TokenEvent], dict[int, BaseException], dict[int, int]]:
        """Accept the tokens drawn on the device for the rows still generating (a row whose last token ended its
        request, or that left, drew one more that nobody reads) and send them to their streams; by row: the
        events, the rows whose accept failed, and the tokens."""
        events: dict[int, TokenEvent] = {}
        failed: dict[int, BaseException] = {}
        tokens: dict[int, int] = {}
        if not self._drawn:
            return events, failed, tokens
        at = {job: r for r, job in enumerate(self.running)}
        self._lap("prepare")
        drawns = [(drawn.tolist(), jobs) for drawn, jobs in self._drawn]  # waits for the steps that drew them
        self._lap("sync")
        for drawn, jobs in drawns:
            for job, token in zip(jobs, drawn):
                r = at.get(job) if job is not None else None
                if r is None:  # left: ended on its last token, cancelled or failed
                    continue
                tokens[r] = token
                try:
                    events[r] = job.generation.accept(token, None)  # no logprobs where tokens are drawn there
                except Exception as err:  # as in _step: this row alone fails, after the step that fed it
                    failed[r] = err
        self._drawn = []
        for r, event in events.items():
            self._emit(self.running[r], event)
        self.generated += len(events)
        self._lap("accept")
        return events, failed, tokens

    def _overlapped_step(self) -> None:
        """One decode step of every row, queued on the device before the tokens drawn after the last step reach
        the host; each row's next token is drawn on the device at the end of the step, so the host accepts one
        step's tokens (text, stop strings, the hand-off to the streams) while the next step runs. Each token is
        fed by the step after the one that drew it, as in :meth:`_step`: a request that ends on a token has
        been fed it when it leaves, and the one more token its row drew is nobody's. Each row draws its
        uniform number from its request's generator once per token, as :meth:`_step` does, and on a graphed
        table such a request's tokens are drawn on the device in every step, overlapped or not, so a seeded
        request draws the same tokens in any batch (with ``overlap`` off, the host's C kernel draws them from the
        same numbers: the same tokens up to rounding)."""
        slots = self.slots
        self._draw_fresh()
        self._lap("forward")
        feed, use, temps, draws, takes = [], [], [], [], []
        for job in self.running:
            riding = bool(job.pending)  # a prompt token to read; the last one's step draws the first token
            feed.append(job.pending[0] if riding else 0)
            use.append(riding)
            temps.append(job.generation.params.temperature)
            last = len(job.pending) <= 1
            draws.append(job.generation.rng.random() if last else 0.0)
            takes.append(job if last else None)
        self._lap("prepare")
        drawn = slots.launch(feed, use, temps, draws)
        self._lap("forward")
        self._stepped(riding=any(use), whole=False)
        events, failed, _ = self._accept_drawn()  # the tokens the step just queued feeds
        self._drawn = [(drawn, takes)]
        self._flush()
        self._lap("handoff")
        self._regroup([r for r, ev in events.items() if ev.finish_reason is not None], failed)
        self._lap("regroup")

    def _draw_fresh(self) -> None:
        """Draw on the device, from the scores they hold, the next token of the rows generating with none drawn yet
        (a session joined from its memory alone, rows after host-drawn steps) whose tokens are drawn there."""
        waiting = {job for _, jobs in self._drawn for job in jobs if job is not None}
        fresh = [job.on_device and not job.pending and job not in waiting for job in self.running]
        if any(fresh):
            jobs = [job if f else None for job, f in zip(self.running, fresh)]
            draws = [job.generation.rng.random() if f else 0.0 for job, f in zip(self.running, fresh)]
            self._drawn.append((self.slots.draw(fresh, [job.generation.params.temperature for job in self.running],
                                                draws), jobs))

    def _step(self, on_device: bool = False) -> None:
        """One decode step that waits for its tokens: where a row asks for ``top_k``, ``top_p`` or logprobs (drawn
        on the host), on a CPU's table, or with ``overlap`` off. ``on_device`` (a GPU's graphed table): the other
        rows' tokens are still drawn on the device, so a request's tokens never depend on which path its batch
        mates put it on (the device's softmax and the host's C kernel round apart: ~1e-3 of tokens differed for a
        32k vocabulary on an H100); tokens the device drew for the batch before are fed as they are."""
        batch = self.slots.active()  # views of rows [0, n)
        if on_device:
            self._draw_fresh()
            self._lap("forward")
        events, failed, drawn = self._accept_drawn()
        fed = [job.pending[0] if job.pending else drawn.get(r, 0) for r, job in enumerate(self.running)]
        sampling = [r for r, job in enumerate(self.running) if not job.pending and r not in drawn]
        riding = any(job.pending for job in self.running)  # some rows still read their prompts
        self._lap("prepare")
        if sampling:
            logits = batch.last_logits.float().cpu()  # [batch, vocab]
            self._lap("sync")
            rows = logits[sampling] if len(sampling) < len(self.running) else logits  # [sampling, vocab]
            chosen = Generation.choose([self.running[r].generation for r in sampling], rows)
            self._lap("sample")
            for r, token in zip(sampling, chosen):  # sampled together
                try:
                    events[r] = self.running[r].generation.accept(token, logits, r)
                    fed[r] = events[r].token
                except Exception as err:  # one request's bad luck is not the batch's: its row steps on a filler
                    failed[r] = err  # token and leaves after the step; every other row advances as planned
                    fed[r] = 0
            for r in sampling:  # sent before the step that feeds them: a token reaches its stream one step
                if r in events:  # sooner (the final one waits for the commit anyway)
                    self._emit(self.running[r], events[r])
            self.generated += sum(r in events for r in sampling)
            self._lap("accept")
        self._flush()
        self._lap("handoff")
        whole = riding and self.slots.ragged  # a joining prompt is read whole in this step, else a token of it
        if whole:
            self._advance_packed(batch, [job.pending or [fed[r]] for r, job in enumerate(self.running)])
        else:
            tokens = torch.tensor(fed, device=self.engine.device)[:, None]  # [batch, 1]
            if isinstance(self.slots, GraphedTable):
                self.slots.advance(batch, tokens)  # a CUDA graph's replay
            else:
                self.engine.decoder.advance(batch, tokens)
        self.slots.stepped(batch)
        self._stepped(riding, whole)
        self._lap("forward")
        self._regroup([r for r, ev in events.items() if ev.finish_reason is not None], failed)
        self._lap("regroup")

    def _stepped(self, riding: bool, whole: bool) -> None:
        """Count a step and the prompt tokens it read (``riding``: rows still read prompts): each prompt whole
        (``whole``), else one token of it."""
        self.steps += 1
        for job in self.running if riding else ():
            if job.pending:
                n = len(job.pending) if whole else 1
                del job.pending[:n]
                self.prompt_tokens_in_batch += n
                if not job.pending:
                    job.prompt_read()

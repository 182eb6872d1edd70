"""One request's life, independent of the HTTP connection that started it:
lease the session, rebuild its state, let the engine loop work, commit, release.

A run is its own asyncio task, so a client that disconnects only *cancels* it: the
run still collects the engine's final state and commits what was generated.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from memory_store import Lease, SessionInfo
from memory_store.codec import INLINE_BYTES, TOKENS_SEEN_MAX
from model.cache import DecodeState
from model.engine import TokenEvent
from model.sampling import SamplingParams
from server.engine_core import CoreFinished, Need
from server.runtime import Runtime
from server.scheduler import EngineRequest, Finished, PromptScores
from server.session_state import extend_window, importable, persisted, rebuild_window, restore, stored_window
from txlserve.errors import (
    EngineDead,
    InvalidRequestError,
    Overloaded,
    RequestCancelled,
    SessionBusy,
    SessionConflict,
    SessionNotFound,
    StoreUnavailable,
    Unavailable,
)

log = logging.getLogger(__name__)


# How long a request waits for a stopped run on its session to commit (a commit's Redis write, ms, bounded by the
# store's timeout): past it, the request finds the session busy as it would have.
STOPPED_RUN_WAIT_S = 5.0
# How long a run on the same session that still generates is given to hear that its client left.
NOTICE_S = 0.1
# The same, for a run on another replica: it must also say so in Redis (Lease.ending), on a machine that may be busy.
REMOTE_NOTICE_S = 0.5


@dataclass
class Final:
    done: Finished
    last: TokenEvent | None  # the token that ended generation, held back until the commit
    info: SessionInfo | None  # the session after commit
    cached_tokens: int  # tokens already in the session's memory before this request
    source: str | None = None  # where the session's state came from: "hot", "redis", "rebuild"; None: new


@dataclass
class Failed:
    error: BaseException


class Shared:
    """A prompt's ``n`` choices read it once: the first choice's run submits every one of them (the engine reads
    the prompt, then copies its state into each: the scheduler's ``Job.copies``, vLLM's child requests of a
    parent) and hands each other run its request. Runs join as they are made, which a request's are in one go,
    before any of them starts."""

    def __init__(self) -> None:
        self.first: Run | None = None
        self.copies: list[Run] = []  # the other choices' runs

    def join(self, run: Run) -> asyncio.Future | None:
        """Where ``run`` (not the first) finds its request."""
        if self.first is None:
            self.first = run
            run.task.add_done_callback(lambda _: self.fail(Unavailable(
                "the request's first choice ended before it started the others")))  # however it ended
            return None
        self.copies.append(run)
        return asyncio.get_running_loop().create_future()

    async def request(self, run: Run, submit: Callable[[list[tuple[SamplingParams | None, asyncio.Queue]]], Any]
                      ) -> Any:
        """``run``'s engine request: the first run's ``submit(copies)`` starts the others' too, each found here."""
        if run.handed is not None:
            return await run.handed
        request = submit([(other.params, other.events) for other in self.copies])
        for other, copy in zip(self.copies, request.copies):
            if other.handed is not None and not other.handed.done():
                other.handed.set_result(copy)
        return request

    def fail(self, err: BaseException) -> None:
        for run in self.copies:
            if run.handed is not None and not run.handed.done():
                run.handed.set_exception(err)


class Run:
    """Feed ``ids`` to a session (or a fresh state) and, with ``params``, generate.

    ``events`` yields (PromptScores when asked for, then) TokenEvent*, then one Final or Failed. ``shared``: the
    other choices of the same prompt, which read it once (:class:`Shared`; new states only)."""

    def __init__(self, rt: Runtime, *, ids: list[int], params: SamplingParams | None, owner: str | None,
                 session_id: str | None = None, create_metadata: dict | None = None,
                 create: bool = False, history: tuple[list[int], int] | None = None,
                 prompt_logprobs: int | None = None, session_param: str | None = None, scored: bool = True,
                 shared: Shared | None = None, prompt_ranks: bool = False) -> None:
        if rt.engine_dead:
            raise EngineDead.because(rt.engine_dead)
        if rt.draining or not rt.ready:
            raise Unavailable("the server is shutting down" if rt.draining else "the server is starting")
        if len(rt.runs) >= rt.most_runs:
            raise Overloaded("too many requests are waiting; retry shortly")
        self.rt, self.ids, self.params, self.owner = rt, ids, params, owner
        self.session_id, self.create, self.create_metadata = session_id, create, create_metadata
        self.session_param = session_param  # the body's field that named the session, for its errors' ``param``
        self.history = history  # a new session's (token window, tokens seen): an imported session
        self.prompt_logprobs = prompt_logprobs  # score each prompt token (echo with logprobs, appends)
        self.prompt_ranks = prompt_ranks  # each one's rank in the vocabulary too (vLLM's prompt_logprobs)
        self.scored = scored  # without params: the text's log-likelihood (an append's), or only read it
        self.scores: PromptScores | None = None  # those scores, once the engine sent them
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self.request: EngineRequest | None = None
        self.cancelled = False
        self.deleted = False
        self.lost = False
        self.lease: Lease | None = None  # held while the run continues a session
        self.started = time.monotonic()
        self.submitted: float | None = None  # the request handed to the engine (its lifecycle's phases: _final)
        self.answered: float | None = None  # the engine's end of it in hand
        self.stopped = asyncio.Event()  # cancelled, or ended
        self._marking: asyncio.Future | None = None  # the lease marked ending in Redis (_ending)
        self.task = asyncio.create_task(self._main())
        self.task.add_done_callback(lambda _: self.stopped.set())
        self.shared = shared
        self.handed = None if shared is None else shared.join(self)  # another choice submits this one's request
        rt.track(self)

    def cancel(self) -> None:
        self.cancelled = True
        self.stopped.set()
        if self.request is not None:
            self.request.cancel()
        self._ending()

    def _ending(self) -> None:
        """A stopped run that holds its session's lease says so in Redis, so that another replica's request for
        the session waits for its commit (:meth:`_leased`), as this server's own do (:meth:`_after_stopped_runs`)."""
        if self.cancelled and self.lease is not None and not self.lease.released and self._marking is None:
            self._marking = asyncio.ensure_future(self.lease.ending())

    def lease_lost(self, deleted: bool) -> None:
        """Its lease is gone: ``deleted``, the session with it (a DELETE wins over a running request, here or
        through another replica or worker), else it expired while Redis was away and another request took it.
        Whatever this run makes cannot be committed: it stops, and ends with a 404 (deleted) or a 409, whether
        its prompt was read or not."""
        self.lost, self.deleted = True, self.deleted or deleted
        self.cancel()

    def _check_count(self, seen: int) -> None:
        """Refuse, before anything runs, a request that would take its session past the tokens a session counts
        (an imported session's, near 2^62): it generated in full, then its commit was refused (as vLLM refuses a
        prompt and max_tokens past the context before it generates)."""
        n, most = len(self.ids), len(self.ids) + (self.params.max_tokens if self.params is not None else 0)
        if seen + most <= TOKENS_SEEN_MAX:
            return
        past = f"past {TOKENS_SEEN_MAX:,}, the most a session counts"
        if self.params is None:  # an append
            raise InvalidRequestError(f"this session has seen {seen:,} tokens: {n:,} more would take it {past}; "
                                      "start a new session", param="text")
        room = TOKENS_SEEN_MAX - seen - n
        fix = f"ask for at most {room:,}" if room > 0 else "start a new session"
        raise InvalidRequestError(f"this session has seen {seen:,} tokens: {n:,} prompt tokens and max_tokens "
                                  f"{self.params.max_tokens:,} would take it {past}; {fix}", param="max_tokens")

    async def _main(self) -> None:
        if self.rt.core is not None:
            return await self._main_core()
        rt, size = self.rt, self.rt.engine.window_len
        try:
            if self.session_id is None:
                window, seen = self.history or ([], 0)
                state = await self._rebuild(window, seen) if seen else None if self.handed else rt.engine.new_state()
                done, last = await self._schedule(self._engine_run(state, window))
                info = None
                if self.create:
                    window = extend_window(window, self.ids + done.generated, seen, size)
                    info = await rt.store.create(owner=self.owner, tensors=await self._persisted(done, window),
                                                 mem_len=rt.engine.mem_len, tokens_seen=done.tokens_seen,
                                                 metadata=self.create_metadata)
                    rt.hot.put(info.session_id, info.revision, done.state, window)
                await self._final(Final(done, last, info, 0, "rebuild" if seen else None))
                return
            async with await self._leased(await self._after_stopped_runs()) as lease:
                lease.on_lost, self.lease = self.lease_lost, lease  # deleted through another replica, say: stop
                self._ending()  # its client left while it waited for the lease
                info = lease.session.info
                cached = info.tokens_seen
                self._check_count(cached)
                t0 = time.monotonic()
                state, window, source = await self._restore(lease)
                rt.metrics.restores.labels(source).inc()
                rt.metrics.restore_time.labels(source).observe(time.monotonic() - t0)
                done, last = await self._schedule(self._engine_run(state, window))
                window = extend_window(window, self.ids + done.generated, cached, size, info.window_span)
                if done.tokens_seen != cached or source == "rebuild":  # a rebuilt session is stored warm again
                    # a restored state only grew: the store writes only the new tokens' rows of its memory
                    info = await rt.store.commit(lease, await self._persisted(done, window),
                                                 tokens_seen=done.tokens_seen, mem_len=rt.engine.mem_len,
                                                 release=True, appended=source != "rebuild")
                rt.hot.put(self.session_id, info.revision, done.state, window)
            # the lease is released before the client hears the end, so its next request finds the session free
            await self._final(Final(done, last, info, cached, source))
        except Exception as err:  # delivered to the handler, which answers in OpenAI's error shape
            self._failed(err)
            await self.events.put(Failed(self._named(err)))

    async def _submitted(self, submit: Callable[[list[tuple[SamplingParams | None, asyncio.Queue]]], Any]) -> Any:
        """The run's engine request, made by ``submit(copies)``: where it shares its prompt with other choices, the
        first run's call makes every one's (:class:`Shared`)."""
        return submit([]) if self.shared is None else await self.shared.request(self, submit)

    def _failed(self, err: Exception) -> None:
        if self.shared is not None and self.handed is None:  # the prompt's other choices did not start either
            self.shared.fail(err)

    async def _main_core(self) -> None:
        """:meth:`_main` with the engine in its own process (``--engine-process``): the session's state stays
        there; this side leases, hands over the stored tensors when the engine's hot set misses, and commits
        what the engine exports."""
        rt, core = self.rt, self.rt.core
        req = None
        try:
            if self.session_id is None:
                window, seen = self.history or ([], 0)  # the engine checks the window, as it rebuilds it
                self.submitted = time.monotonic()
                req = await self._submitted(lambda copies: core.submit(
                    self.ids, self.params, history=(window, seen) if seen else None, persist=self.create,
                    prompt_logprobs=self.prompt_logprobs, prompt_ranks=self.prompt_ranks, scored=self.scored,
                    stream=self.events, copies=copies))
                done, last = await self._schedule(self._core_run(req, None))
                info = None
                if self.create:
                    info = await rt.store.create(owner=self.owner, tensors=done.tensors, mem_len=core.mem_len,
                                                 tokens_seen=done.tokens_seen, metadata=self.create_metadata)
                    req.keep(info.session_id, info.revision)
                await self._final(Final(done, last, info, 0, "rebuild" if seen else None))
                return
            async with await self._leased(await self._after_stopped_runs()) as lease:
                lease.on_lost, self.lease = self.lease_lost, lease
                self._ending()  # its client left while it waited for the lease
                info = lease.session.info
                cached = info.tokens_seen
                self._check_count(cached)
                self.submitted = time.monotonic()
                req = core.submit(self.ids, self.params, key=(self.session_id, info.revision), persist=True,
                                  prompt_logprobs=self.prompt_logprobs, prompt_ranks=self.prompt_ranks,
                                  scored=self.scored, stream=self.events, window_span=info.window_span)
                done, last = await self._schedule(self._core_run(req, lease))
                if done.tokens_seen != cached or done.source == "rebuild":
                    info = await rt.store.commit(lease, done.tensors, tokens_seen=done.tokens_seen,
                                                 mem_len=core.mem_len, release=True,
                                                 appended=done.source != "rebuild")
                req.keep(self.session_id, info.revision)
            await self._final(Final(done, last, info, cached, done.source))
        except Exception as err:
            self._failed(err)
            await self.events.put(Failed(self._named(err)))
        finally:
            if req is not None:
                req.close()

    async def _final(self, final: Final) -> None:
        """End the run with ``final``, first counting where its time went (``txlserve_request_lifecycle_seconds``),
        each moment in one phase: ``start`` until the engine had it (a stopped run's commit waited for, the
        lease, a session restored in this process), ``engine`` until the engine ended it (queued, its prompt
        read, its tokens generated; in this process, its state exported too), ``export`` until an engine
        process had exported the state and sent the end, ``handoff`` until this server had them (the message,
        the event loop's wake-up), ``commit`` until it was stored and the lease released. The engine's times
        are read on its own clock: ``time.monotonic`` is the system's, every process's alike."""
        now, submitted, answered = time.monotonic(), self.submitted, self.answered
        if submitted is not None and answered is not None:
            ended, sent = final.done.ended, getattr(final.done, "sent", None)
            ended = answered if ended is None else min(max(ended, submitted), answered)
            sent = ended if sent is None else min(max(sent, ended), answered)
            phases = self.rt.metrics.lifecycle
            phases["start"].observe(submitted - self.started)
            phases["engine"].observe(ended - submitted)
            phases["export"].observe(sent - ended)
            phases["handoff"].observe(answered - sent)
            phases["commit"].observe(now - answered)
        await self.events.put(final)

    async def _after_stopped_runs(self) -> list[Run]:
        """Wait (a few ms, bounded) for this server's runs on the same session that were stopped (their client
        left or cancelled) to commit what they made. "Stop generating, then continue" sends its next request at
        once: it was a 409 nearly every time (and the OpenAI SDK's retries hid it as a second's delay). The
        client that left may not have been heard yet (its connection's end and the new request can be read in
        one turn of the event loop): a run still generating gets a moment to be told. This server's runs that
        held the session (:meth:`_leased` reads how they stand when the lease is refused). A cancel of this run
        ends the wait."""
        others = _holders(self.rt, self.session_id, but=self)
        await _stopped_committed(others, self._until)
        return others

    async def _until(self, aws: list[asyncio.Future], timeout: float) -> None:
        """Wait for all of ``aws`` (none is cancelled here), for ``timeout`` at most, or until this run is
        cancelled."""
        loop, pending = asyncio.get_running_loop(), set(aws)
        deadline = loop.time() + timeout
        me = asyncio.ensure_future(self.stopped.wait())
        try:
            while pending and not self.cancelled and (left := deadline - loop.time()) > 0:
                done, _ = await asyncio.wait(pending | {me}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                pending -= done
        finally:
            me.cancel()

    async def _leased(self, here: list[Run]) -> Lease:
        """The session's lease. One held by a run whose client left is waited for while that run commits
        (bounded): this server's own (``here``, as :meth:`_after_stopped_runs` left them), or another replica's
        that said so in Redis (:meth:`_ending`). One that this server's own running request holds is a 409 at once;
        one another replica holds, not known to be ending, is asked again for ``REMOTE_NOTICE_S`` (the time that
        replica may need to hear its client left and say so), then is a 409. A cancel of this run ends the wait
        (a 499), and it never takes the lease then."""
        started, pause = time.monotonic(), 0.005
        while True:
            if self.cancelled:
                raise self._cancelled()
            try:
                return await self.rt.store.lease(self.session_id, owner=self.owner, tensors=False)
            except SessionBusy as err:
                held = [r for r in here if r.lease is not None and not r.lease.released]
                stopping = err.ending or any(r.cancelled for r in held)
                if held and not stopping:
                    raise
                if time.monotonic() - started >= (STOPPED_RUN_WAIT_S if stopping else REMOTE_NOTICE_S):
                    raise
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stopped.wait(), timeout=pause)  # a cancel ends the wait at once
            pause = min(2 * pause, 0.05)

    def _named(self, err: Exception) -> Exception:
        """A session that is not there (or was deleted meanwhile) names the body's field that asked for it."""
        if isinstance(err, SessionNotFound) and err.param is None:
            err.param = self.session_param
            if self.session_param == "session_id" and "not found" in err.message:  # a vLLM client's own id, maybe
                err.message = (f"{err.message}: session_id names a session made by POST /v1/sessions (vLLM's "
                               f"free-form session_id, a routing hint, is not taken here)")
                err.args = (err.message,)
        return err

    async def _core_run(self, req, lease) -> tuple[Any, TokenEvent | None]:
        self.request = req
        if self.cancelled:
            req.cancel()
        last = None
        async for item in req:
            if isinstance(item, Need):  # a hot miss: the stored session, as the lease read it
                tensors = await self.rt.store.read_tensors(lease)
                req.provide(tensors, tokens_seen=lease.session.info.tokens_seen,
                            fingerprint=lease.session.info.fingerprint)
            elif isinstance(item, CoreFinished):
                self.answered = time.monotonic()
                if lease is not None and item.source is not None:  # a restored session, cancelled or not
                    self.rt.metrics.restores.labels(item.source).inc()
                    if item.restore_s is not None:  # measured in the engine's process: from its start to its state
                        self.rt.metrics.restore_time.labels(item.source).observe(item.restore_s)
                return item, last
            else:
                last = item
        raise RuntimeError("the engine ended a request without its Finished")  # pragma: no cover

    async def _restore(self, lease) -> tuple[DecodeState, list[int] | None, str]:
        """The leased session's state, its token window, and where the state came from: the hot set (no copy),
        its hidden states in Redis, or, for a cold session or one another checkpoint wrote, its window."""
        rt, info = self.rt, lease.session.info
        hot = rt.hot.take(self.session_id, info.revision)
        if hot is not None:
            return (*hot, "hot")
        tensors = await rt.store.read_tensors(lease)
        window = stored_window(tensors)
        if importable(rt.engine, tensors, info.fingerprint):
            state = await asyncio.to_thread(restore, rt.engine, tensors, info.tokens_seen,
                                            info.fingerprint)  # as it was written
            return state, window, "redis"
        return await self._rebuild(window or [], info.tokens_seen), window, "rebuild"

    async def _rebuild(self, window: list[int], tokens_seen: int) -> DecodeState:
        """Prefill the window from an empty state (through the engine loop, batched with everything else),
        then place its rings at the session's positions."""
        window = rebuild_window(self.rt.engine, window, tokens_seen, self.session_id)
        done = None
        self.request = self.rt.scheduler.submit(self.rt.engine.new_state(), window, None, scored=False)
        if self.cancelled:  # a cancel stops the rebuild within a step too (it waited for the whole window)
            self.request.cancel()
        async for item in self.request:
            done = item
        if isinstance(done, Finished) and done.state is None and self.cancelled:
            raise self._cancelled()
        if not isinstance(done, Finished) or done.state is None:
            raise Unavailable("the session could not be rebuilt: the server is shutting down")
        await asyncio.to_thread(self.rt.engine.renumber, done.state, tokens_seen)
        return done.state

    async def _persisted(self, done: Finished, window: list[int] | None) -> dict:
        engine, dtype = self.rt.engine, self.rt.storage_dtype
        if engine.persisted_nbytes(dtype) <= INLINE_BYTES:
            return persisted(engine, done.state, window, dtype)
        return await asyncio.to_thread(persisted, engine, done.state, window, dtype)

    async def _schedule(self, running: Coroutine[Any, Any, tuple[Any, TokenEvent | None]]
                        ) -> tuple[Any, TokenEvent | None]:
        done, last = await running
        m = self.rt.metrics
        if done.queue_s is not None:
            m.queue_time.observe(done.queue_s)
        if done.prefill_s is not None and self.ids:
            m.prefill_time.observe(done.prefill_s)
        m.request_prompt_tokens.observe(len(self.ids))  # every run's: the totals are these histograms' sums
        m.prompt_tokens.inc(len(self.ids))
        if self.params is not None:
            m.request_generation_tokens.observe(done.completion_tokens)
            m.generation_tokens.inc(done.completion_tokens)
        if done.state is None and done.finish_reason == "cancelled":
            raise self._cancelled()
        return done, last

    def _cancelled(self) -> Exception:
        """Why a run cancelled before its text was read stored nothing."""
        if self.deleted:
            return SessionNotFound(f"session {self.session_id!r} was deleted")
        if self.lost and self.lease is not None and self.lease.lost_to_outage:
            return StoreUnavailable(f"Redis could not be reached for longer than the lease on session "
                                    f"{self.session_id!r} lasts: the request was stopped; nothing was stored")
        if self.lost:
            return SessionConflict(f"the lease on session {self.session_id!r} expired or another request took it; "
                                   "nothing was stored")
        if self.rt.draining:
            return Unavailable("the server is shutting down: the request was cancelled before its text was read; "
                               "nothing was stored")
        return RequestCancelled("the request was cancelled before its text was read (the client left or cancelled "
                                "it); nothing was stored")

    async def _engine_run(self, state, window: list[int] | None) -> tuple[Finished, TokenEvent | None]:
        rt = self.rt
        self.submitted = time.monotonic()
        self.request = await self._submitted(lambda copies: rt.scheduler.submit(
            state, self.ids, self.params, prompt_logprobs=self.prompt_logprobs, prompt_ranks=self.prompt_ranks,
            scored=self.scored, stream=self.events,  # tokens straight to the client, all but the last
            last=window[-1] if window else None, copies=copies))
        if self.cancelled:
            self.request.cancel()
        last = None
        async for item in self.request:  # the token that ended generation, held back until the commit; Finished
            if isinstance(item, Finished):
                self.answered = time.monotonic()
                return item, last
            last = item
        raise RuntimeError("the engine ended a request without its Finished")  # pragma: no cover


async def first_item(run: Run) -> Any:
    """Wait for the run's first result so that errors become a proper status before any body is sent."""
    item = await run.events.get()
    if isinstance(item, Failed):
        raise item.error
    return item


async def settled(rt: Runtime, session_id: str) -> None:
    """Wait (bounded) for a request whose client left to commit what it made on the session before the session is
    read (its info, export or fork), as a request on the session waits (:meth:`Run._after_stopped_runs`,
    :meth:`Run._leased`): "stop generating, then save" or "then branch" read the session as it stood before the
    stream, without a word, 4 times in 6 (found by a helper). A request still generating gets the same moment to
    be told its client left (``NOTICE_S`` here, ``REMOTE_NOTICE_S`` through another replica); past it the
    session is read as its last commit left it: a read never waits for a generation."""
    loop = asyncio.get_running_loop()
    if here := _holders(rt, session_id):
        await _stopped_committed(here, _wait)
        return
    started, pause = loop.time(), 0.005
    while True:  # another replica's request, or none
        held, ending = await rt.store.lease_state(session_id)
        if not held or loop.time() - started >= (STOPPED_RUN_WAIT_S if ending else REMOTE_NOTICE_S):
            return
        await asyncio.sleep(pause)
        pause = min(2 * pause, 0.05)


def _holders(rt: Runtime, session_id: str | None, but: Run | None = None) -> list[Run]:
    """This server's runs (but ``but``) that hold the session's lease: a run that committed has let it go."""
    return [r for r in rt.runs
            if r is not but and r.session_id == session_id and r.lease is not None and not r.lease.released]


async def _stopped_committed(runs: list[Run], until: Callable[[list[asyncio.Future], float], Awaitable[None]]
                             ) -> None:
    """Give ``runs`` still generating ``NOTICE_S`` to hear their client left, then wait for those stopped to
    commit (``STOPPED_RUN_WAIT_S`` at most): waits made by ``until(futures, timeout)``."""
    told = [asyncio.ensure_future(r.stopped.wait()) for r in runs if not r.stopped.is_set()]
    if told:
        await until(told, NOTICE_S)
        for waiter in told:
            waiter.cancel()
    await until([r.task for r in runs if r.cancelled], STOPPED_RUN_WAIT_S)


async def _wait(aws: list[asyncio.Future], timeout: float) -> None:
    if aws:
        await asyncio.wait(aws, timeout=timeout)

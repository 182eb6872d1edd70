"""One request's life, independent of the HTTP connection that started it:
lease the session, rebuild its state, let the engine loop work, commit, release.

A run is its own asyncio task, so a client that disconnects only *cancels* it: the
run still collects the engine's final state and commits what was generated.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from memory_store import SessionInfo
from model.engine import TokenEvent
from model.sampling import SamplingParams
from server.runtime import Runtime
from server.scheduler import EngineRequest, Finished
from txlserve.errors import Overloaded, Unavailable


@dataclass
class Final:
    done: Finished
    last: TokenEvent | None  # the token that ended generation, held back until the commit
    info: SessionInfo | None  # the session after commit
    cached_tokens: int  # tokens already in the session's memory before this request


@dataclass
class Failed:
    error: BaseException


class Run:
    """Feed ``ids`` to a session (or a fresh state) and, with ``params``, generate.

    ``events`` yields TokenEvent*, then one Final or Failed."""

    def __init__(self, rt: Runtime, *, ids: list[int], params: SamplingParams | None, owner: str | None,
                 session_id: str | None = None, create_metadata: dict | None = None,
                 create: bool = False) -> None:
        s = rt.settings
        if rt.draining or not rt.ready:
            raise Unavailable("the server is shutting down" if rt.draining else "the server is starting")
        if len(rt.runs) >= s.max_queue + rt.scheduler.capacity:  # every request in flight, whatever its phase
            raise Overloaded("too many requests are waiting; retry shortly")
        self.rt, self.ids, self.params, self.owner = rt, ids, params, owner
        self.session_id, self.create, self.create_metadata = session_id, create, create_metadata
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self.request: EngineRequest | None = None
        self.cancelled = False
        self.started = time.monotonic()
        self.task = asyncio.create_task(self._main())
        rt.runs.add(self)
        self.task.add_done_callback(lambda _: rt.runs.discard(self))

    def cancel(self) -> None:
        self.cancelled = True
        if self.request is not None:
            self.request.cancel()

    async def _main(self) -> None:
        rt = self.rt
        try:
            if self.session_id is None:
                done, last = await self._schedule(rt.engine.new_state())
                info = None
                if self.create:
                    info = await rt.store.create(owner=self.owner, tensors=await self._persisted(done),
                                                 mem_len=rt.engine.mem_len, tokens_seen=done.tokens_seen,
                                                 metadata=self.create_metadata)
                    rt.hot.put(info.session_id, info.version, done.state)
                await self.events.put(Final(done, last, info, 0))
                return
            async with rt.store.lease(self.session_id, owner=self.owner, tensors=False) as lease:
                info = lease.session.info
                cached = info.tokens_seen
                state = rt.hot.take(self.session_id, info.version)  # hot: the engine's own state, no copy
                if state is None:
                    tensors = await rt.store.read_tensors(lease)
                    state = await asyncio.to_thread(rt.engine.import_state, tensors, tokens_seen=cached,
                                                    fingerprint=info.fingerprint)  # as it was written
                done, last = await self._schedule(state)
                if done.tokens_seen != cached:
                    info = await rt.store.commit(lease, await self._persisted(done), tokens_seen=done.tokens_seen)
                rt.hot.put(self.session_id, info.version, done.state)
            # the lease is released before the client hears the end, so its next request finds the session free
            await self.events.put(Final(done, last, info, cached))
        except Exception as err:  # delivered to the handler, which answers in OpenAI's error shape
            await self.events.put(Failed(err))

    async def _persisted(self, done: Finished) -> dict:
        """What Redis keeps of a session: its mems and next-token scores, in the storage dtype."""
        return await asyncio.to_thread(self.rt.engine.export_state, done.state, dtype=self.rt.storage_dtype)

    async def _schedule(self, state) -> tuple[Finished, TokenEvent | None]:
        done, last = await self._engine_run(state)
        if done.state is None and done.finish_reason == "cancelled":
            raise Unavailable("the request was cancelled before its text was read (the server is shutting down "
                              "or the client left); nothing was stored")
        return done, last

    async def _engine_run(self, state) -> tuple[Finished, TokenEvent | None]:
        rt = self.rt
        self.request = rt.scheduler.submit(state, self.ids, self.params)
        if self.cancelled:
            self.request.cancel()
        last = None
        async for item in self.request:
            if isinstance(item, Finished):
                return item, last
            if item.finish_reason is None:
                await self.events.put(item)
            else:
                last = item  # held back until the commit
        raise RuntimeError("the engine ended a request without its Finished")  # pragma: no cover


async def first_item(run: Run) -> Any:
    """Wait for the run's first result so that errors become a proper status before any body is sent."""
    item = await run.events.get()
    if isinstance(item, Failed):
        raise item.error
    return item


"""The async side of ``txlserve_client._websocket``: completions over ``/v1/ws`` with ``await``, ``async for`` and
``async with``, as the sync connection and stream behave (see that module's docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Mapping
from types import TracebackType
from typing import Any, TypeVar

import websockets.asyncio.client
import websockets.exceptions
from websockets.protocol import State

from txlserve_client._base import BaseClient, Prompt, close_soon, closed_error, ws_completion_body
from txlserve_client._exceptions import APIError, RequestCancelledError
from txlserve_client._types import CompletionChunk
from txlserve_client._websocket import (
    _CONNECT_ERRORS,
    DROPPED_CLOSE_TIMEOUT_S,
    Target,
    _cancel,
    _chunk,
    _closed,
    _message,
    _Running,
    _timed_out,
    _unkept,
    connect_error,
)

T = TypeVar("T")


async def _within(aw: Awaitable[T], timeout: float) -> T:
    """``aw``'s result, or TimeoutError after ``timeout`` s. Not ``asyncio.wait_for``: before Python 3.12 it returns
    a result that arrives as its task is cancelled and drops the cancel, so ``task.cancel()`` of a task reading a
    stream (a "stop" button) was lost a third of the time, and the stream read on to its end (found by a helper)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout):
            return await aw
    task, expired = asyncio.current_task(), False  # Python 3.10: asyncio.timeout's way, by hand

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    handle = asyncio.get_running_loop().call_later(timeout, expire)
    try:
        return await aw
    except asyncio.CancelledError:
        if expired:
            raise asyncio.TimeoutError from None
        raise
    finally:
        handle.cancel()


def _dropped(ws: websockets.asyncio.client.ClientConnection) -> Callable[[], Awaitable[None]]:
    """The close of a connection dropped mid-completion, bounded. Nothing read its tokens, so the library had
    paused reading, and its close waited for the server's close frame behind them: for its 10 s close timeout,
    past the 5 s the client gives begun closes (``closes_begun``), so ``asyncio.run`` ended with the socket
    open, a ResourceWarning (1 run in 7 under ``-X dev``). The library closes the socket at this deadline."""
    ws.close_timeout = DROPPED_CLOSE_TIMEOUT_S
    return ws.close


def _never_sent() -> RequestCancelledError:
    return RequestCancelledError("the completion was cancelled before it was sent: nothing was generated and nothing "
                                 "was stored", status=499, type="invalid_request_error", code="request_cancelled")


class AsyncWebSocketConnection(_Running):
    """One open WebSocket; an async context manager that closes it (and closed once dropped)."""

    def __init__(self, ws: websockets.asyncio.client.ClientConnection, read_timeout: float | None) -> None:
        super().__init__()
        self._ws, self._read_timeout = ws, read_timeout
        self._loop = asyncio.get_running_loop()
        self._owner: asyncio.Task[Any] | None = None  # the task that started the running completion
        self._unsent: weakref.ref[AsyncWebSocketStream] | None = None  # the last completion made, until it is sent
        self._starting = asyncio.Lock()  # as the sync connection's lock: one task at a time checks, finishes the
        # completion before and sends (two tasks that took over a dropped one both read it: the library's error)

    @classmethod
    async def open(cls, client: BaseClient, options: Mapping[str, Any]) -> AsyncWebSocketConnection:
        target = Target.of(client, options)
        if client.is_closed:
            raise closed_error()
        attempt = 0
        while True:
            try:
                ws = await websockets.asyncio.client.connect(target.url, **target.connect)
                return cls(ws, target.read_timeout)
            except _CONNECT_ERRORS as err:
                if (delay := client._reopen_delay(attempt, err)) is None:
                    raise connect_error(err, target.url) from err
            await asyncio.sleep(delay)
            attempt += 1
            if client.is_closed:  # closed while the retry waited
                raise closed_error()

    def completion(self, *, model: str, prompt: Prompt = "", **options: Any) -> AsyncWebSocketStream:
        """The request is sent when the stream is first read (or entered with ``async with``)."""
        body = ws_completion_body(model, prompt, options, where="completion()")
        stream = AsyncWebSocketStream({"type": "completion.create", **body}, conn=self)
        self._unsent = weakref.ref(stream)
        return stream

    async def cancel(self) -> None:
        """Stop the running completion; its stream then ends with finish_reason "cancelled". The last one made and
        not yet sent (its stream not yet read, or waiting for the one before it to end) is never sent: its stream
        raises RequestCancelledError, as the sync connection's does for a cancel that comes before any token (the
        sync one is sent as it is made, and so has cancelled the one before it already)."""
        if (unsent := self._unsent() if self._unsent is not None else None) is not None and not unsent.done:
            unsent.cancelled = True
        await self._cancel_running()

    async def _cancel_running(self) -> None:
        if self._running:
            await self._send(_cancel(self._running_id))

    async def _begin(self, stream: AsyncWebSocketStream) -> None:
        """A new completion closes (cancels) the one before it, unless another task, still running, started that
        one: two tasks' completions on one connection cancelled the first and failed the second with the
        websockets library's own error. A stream that fails to start is as one never read (a cancel flags it);
        one cancelled while the one before it was read to its end is never sent."""
        me, left = asyncio.current_task(), False
        try:
            async with self._starting:  # a second task waits here, then finds the first's completion streaming
                owner = self._owner
                if self._read_elsewhere() and owner not in (None, me) and not owner.done():
                    raise APIError("a completion is streaming on this connection in another task: a connection "
                                   "runs one completion at a time (open one connection per task, or wait for that "
                                   "one)")
                self._owner = me
                await self._finish(keep=True)
                if stream.cancelled:
                    stream.done = True
                    raise _never_sent()
                self._running, self._running_id, self._active = True, None, weakref.ref(stream)
                try:
                    await self._send(stream.request)
                except asyncio.CancelledError:  # while the frame drained: the library had it already, so it
                    left = True  # runs, and a cancel, a close or the next completion's start stops it (found by a
                    raise  # review: reset, it was sent again and the first ran on, out of reach)
                except BaseException:
                    self._running, self._active = False, None  # nothing runs: the request never left
                    raise
        except BaseException:
            stream.started = left
            raise
        if self._unsent is not None and self._unsent() is stream:
            self._unsent = None

    async def _finish(self, *, keep: bool = False) -> None:
        """As the sync connection's ``_finish``."""
        try:
            if self._running:
                await self._send(_cancel(self._running_id))
                while self._running:
                    msg = await self._next()
                    self._keep(msg) if keep else _chunk(msg)
        except APIError:
            self._abandoned()  # the completion is over either way

    async def _send(self, msg: dict[str, Any]) -> None:
        self._usable()
        try:
            await self._ws.send(json.dumps(msg))
        except websockets.exceptions.ConnectionClosed as err:
            raise _closed(err) from err

    async def _next(self) -> dict[str, Any]:
        while not self._ours(msg := await self._recv()):
            pass
        return self._heard(msg)

    async def _recv(self) -> dict[str, Any]:
        self._usable()
        try:
            if self._read_timeout is None:
                return _message(await self._ws.recv())
            return _message(await _within(self._ws.recv(), self._read_timeout))
        except websockets.exceptions.ConnectionClosed as err:
            raise _closed(err) from err
        except (TimeoutError, asyncio.TimeoutError) as err:  # two classes before Python 3.11
            self._gave_up()
            with contextlib.suppress(Exception):  # closed either way
                await _dropped(self._ws)()
            raise _timed_out(self._read_timeout) from err

    async def close(self) -> None:
        await self._ws.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit
            if (ws := getattr(self, "_ws", None)) is not None and ws.state is not State.CLOSED:
                close_soon(getattr(self, "_loop", None), _dropped(ws))

    async def __aenter__(self) -> AsyncWebSocketConnection:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


class AsyncConnect:
    """What ``AsyncClient.ws.connect()`` returns: ``await`` it, or ``async with`` it to close the connection."""

    def __init__(self, client: BaseClient, options: Mapping[str, Any]) -> None:
        self._client, self._options = client, options
        self._conn: AsyncWebSocketConnection | None = None

    def __await__(self) -> Generator[Any, None, AsyncWebSocketConnection]:
        return AsyncWebSocketConnection.open(self._client, self._options).__await__()

    async def __aenter__(self) -> AsyncWebSocketConnection:
        self._conn = await AsyncWebSocketConnection.open(self._client, self._options)
        return self._conn

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._conn is not None:
            await self._conn.close()


class AsyncWebSocketStream(AsyncIterator[CompletionChunk]):
    """The chunks of one completion; an async context manager that cancels it if unfinished.

    It runs on ``conn``, or (for ``ws.stream``) on a connection it opens with ``open`` and closes (as it is
    dropped, if unfinished)."""

    def __init__(self, request: dict[str, Any], *, conn: AsyncWebSocketConnection | None = None,
                 open: Callable[[], Awaitable[AsyncWebSocketConnection]] | None = None) -> None:
        self.request, self._conn, self._open, self._owns = request, conn, open, conn is None
        self.started = self.done = self.cancelled = False
        self.id: str | None = None  # the completion's, once the server has named it
        self._kept: deque[CompletionChunk | APIError] = deque()  # read by the next completion's start

    async def _start(self) -> AsyncWebSocketConnection:
        if self.cancelled and not self.started:  # cancelled before it was sent: it never is
            self.done = True
            raise _never_sent()
        if self._conn is None:
            assert self._open is not None
            self._conn = await self._open()
        if not self.started:
            self.started = True
            try:
                await self._conn._begin(self)
            except RequestCancelledError:  # cancelled as its connection opened, or as the one before it ended
                if self._owns:
                    await self._conn.close()
                raise
        return self._conn

    async def __anext__(self) -> CompletionChunk:
        if self._kept:
            return _unkept(self._kept)
        if self.done:  # (a cancelled one that never left raised once)
            raise StopAsyncIteration
        conn = await self._start()
        while not self.done:
            msg = await conn._next()
            self.id = msg.get("id") or self.id
            if self.done and self._owns:
                await conn.close()
            if (chunk := _chunk(msg)) is not None:
                return chunk
        raise StopAsyncIteration

    def __aiter__(self) -> AsyncWebSocketStream:
        return self

    async def cancel(self) -> None:
        """Stop the completion; one not yet sent (before its first read, or while the one before it ends) never
        is. Only this completion: another task's, running on the connection meanwhile, runs on."""
        if self.done:
            return
        conn = self._conn
        if conn is not None and conn._running and conn._active is not None and conn._active() is self:
            await conn._cancel_running()
        else:
            self.cancelled = True

    async def close(self) -> None:
        """Cancel the completion if it still runs and read it to its end."""
        try:
            if self.started and not self.done and self._conn is not None:
                await self._conn._finish()
        finally:
            if self._owns and self._conn is not None:
                await self._conn.close()

    def __del__(self) -> None:
        if self._owns and self._conn is not None and not self.done:  # its connection is this stream's alone
            with contextlib.suppress(Exception):
                close_soon(self._conn._loop, _dropped(self._conn._ws))

    async def __aenter__(self) -> AsyncWebSocketStream:
        await self._start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

"""Completions over the WebSocket ``/v1/ws``: many in turn on one connection, each cancellable.

    with client.ws.connect() as conn:
        for chunk in conn.completion(model="m", prompt="Once", max_tokens=500):
            print(chunk.text, end="")
            if enough:
                conn.cancel()  # the loop still ends, with finish_reason "cancelled"

The keyword options of ``completion`` are those of ``completions.create`` (less ``stream`` and
``stream_options``: the WebSocket always streams and always reports usage on its last chunk).
A completion left before its end is cancelled and read to its end when the next one starts or
the stream is closed, so the connection is always ready for the next one.

A connection is not thread-safe: it runs one completion at a time, read by one thread (``cancel()`` may come
from another). Open one connection per thread; the ``Client`` itself may be shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from types import TracebackType
from typing import Any

import websockets.asyncio.client
import websockets.exceptions
import websockets.sync.client

from txlserve_client._base import BaseClient, Prompt, closed_error, completion_body, connection_error
from txlserve_client._exceptions import APIConnectionError, APIError, AuthenticationError, error_from_body
from txlserve_client._types import CompletionChunk

MAX_MESSAGE_BYTES = 16 * 2**20
_END_TYPES = ("completion.done", "error")
# what opening a connection can raise, said as connect_error: InvalidURI where a redirect points to http(s)://
# (websockets follows redirects itself)
_CONNECT_ERRORS = (OSError, TimeoutError, asyncio.TimeoutError, websockets.exceptions.InvalidHandshake,
                   websockets.exceptions.InvalidURI)


def connect_options(client: BaseClient) -> dict[str, Any]:
    headers = client._headers()
    return {"additional_headers": headers, "user_agent_header": headers.pop("User-Agent"),
            "open_timeout": client.timeout.connect, "max_size": MAX_MESSAGE_BYTES}


def _cancel(completion_id: str | None) -> dict[str, Any]:
    """A cancel naming the completion once known: the server ignores one that names another (a late cancel of an
    earlier completion would otherwise stop the next)."""
    return {"type": "cancel"} if completion_id is None else {"type": "cancel", "id": completion_id}


def connect_error(err: Exception) -> APIError:
    """The exception for a failed opening handshake or socket."""
    if isinstance(err, websockets.exceptions.InvalidStatus):
        status = err.response.status_code
        try:
            body = json.loads(err.response.body or b"null")
        except ValueError:
            body = None
        if status in (401, 403) and not (isinstance(body, dict) and "error" in body):  # a bare refusal
            return AuthenticationError("the server refused the WebSocket: invalid or missing API key",
                                       status=status, type="authentication_error", code="invalid_api_key")
        return error_from_body(body, status)
    return connection_error(err)


def _message(raw: str | bytes) -> dict[str, Any]:
    try:
        msg = json.loads(raw)
    except ValueError:  # not JSON, or bytes that are not UTF-8 (a UnicodeDecodeError is a ValueError)
        raise APIError(f"unexpected WebSocket message: {raw[:200]!r}") from None
    if not isinstance(msg, dict):
        raise APIError(f"unexpected WebSocket message: {raw[:200]!r}")
    return msg


def _chunk(msg: dict[str, Any]) -> CompletionChunk | None:
    """The chunk a server message carries; None for a type this client does not know; raises on ``error``."""
    kind = msg.get("type")
    if kind == "error":
        raise error_from_body(msg)
    if kind in ("completion.delta", "completion.done"):
        return CompletionChunk.from_ws(msg)
    return None


def _closed(err: websockets.exceptions.ConnectionClosed) -> APIConnectionError:
    return APIConnectionError(f"the WebSocket closed ({err})")


class WebSocketConnection:
    """One open WebSocket; a context manager that closes it."""

    def __init__(self, ws: websockets.sync.client.ClientConnection, read_timeout: float | None,
                 exit_stack: contextlib.ExitStack) -> None:
        self._ws, self._read_timeout, self._exit_stack = ws, read_timeout, exit_stack
        self._active: WebSocketStream | None = None
        self._owner: threading.Thread | None = None  # the thread that started the running completion
        self._lock = threading.Lock()

    @classmethod
    def open(cls, client: BaseClient) -> WebSocketConnection:
        if client.is_closed:
            raise closed_error()
        stack = contextlib.ExitStack()  # websockets >= 17.1 wants connect() entered as a context manager
        try:
            ws = stack.enter_context(websockets.sync.client.connect(client.ws_url, **connect_options(client)))
        except _CONNECT_ERRORS as err:
            raise connect_error(err) from err
        return cls(ws, client.timeout.read, stack)

    def completion(self, *, model: str, prompt: Prompt = "", **options: Any) -> WebSocketStream:
        return self._start(completion_body(model, prompt, False, options))

    def _start(self, body: dict[str, Any], *, owns_connection: bool = False) -> WebSocketStream:
        """As ``AsyncWebSocketConnection._begin``: two threads' completions on one connection cancelled each other,
        got each other's errors, or failed with the websockets library's own ConcurrencyError."""
        me = threading.current_thread()
        with self._lock:
            owner = self._owner
            if self._active is not None and not self._active.done and owner not in (None, me) and owner.is_alive():
                raise APIError("a completion is streaming on this connection in another thread: a connection runs "
                               "one completion at a time (open one connection per thread, or wait for that one)")
            if self._active is not None:
                self._active.close()
            self._send({"type": "completion.create", **body})
            self._active, self._owner = WebSocketStream(self, owns_connection=owns_connection), me
            return self._active

    def cancel(self) -> None:
        """Stop the running completion; its stream then ends with finish_reason "cancelled"."""
        if self._active is not None and not self._active.done:
            self._send(_cancel(self._active.id))

    def _send(self, msg: dict[str, Any]) -> None:
        try:
            self._ws.send(json.dumps(msg))
        except websockets.exceptions.ConnectionClosed as err:
            raise _closed(err) from err

    def _recv(self) -> dict[str, Any]:
        try:
            return _message(self._ws.recv(timeout=self._read_timeout))
        except websockets.exceptions.ConnectionClosed as err:
            raise _closed(err) from err
        except (TimeoutError, asyncio.TimeoutError) as err:  # two classes before Python 3.11
            raise connection_error(err) from err
        except RuntimeError as err:  # websockets' ConcurrencyError (a RuntimeError before 14.0): a second reader
            raise APIError("another thread is reading this WebSocket: a connection is read by one thread at a "
                           "time (open one connection per thread)") from err

    def close(self) -> None:
        self._exit_stack.close()

    def __enter__(self) -> WebSocketConnection:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class WebSocketStream(Iterator[CompletionChunk]):
    """The chunks of one completion on a connection; a context manager that cancels it if unfinished."""

    def __init__(self, conn: WebSocketConnection, *, owns_connection: bool = False) -> None:
        self._conn, self._owns = conn, owns_connection
        self.done = False
        self.id: str | None = None  # the completion's, once the server has named it

    def __next__(self) -> CompletionChunk:
        while not self.done:
            msg = self._conn._recv()
            self.id = msg.get("id") or self.id
            self.done = msg.get("type") in _END_TYPES
            if self.done and self._owns:
                self._conn.close()
            if (chunk := _chunk(msg)) is not None:
                return chunk
        raise StopIteration

    def __iter__(self) -> WebSocketStream:
        return self

    def cancel(self) -> None:
        self._conn.cancel()

    def close(self) -> None:
        """Cancel the completion if it still runs and read it to its end."""
        try:
            if not self.done:
                self._conn.cancel()
                for _ in self:
                    pass
        except APIError:
            pass  # the completion is over either way
        finally:
            if self._owns:
                self._conn.close()

    def __enter__(self) -> WebSocketStream:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class AsyncWebSocketConnection:
    """One open WebSocket; an async context manager that closes it."""

    def __init__(self, ws: websockets.asyncio.client.ClientConnection, read_timeout: float | None) -> None:
        self._ws, self._read_timeout = ws, read_timeout
        self._active: AsyncWebSocketStream | None = None
        self._owner: asyncio.Task | None = None  # the task that started the running completion

    @classmethod
    async def open(cls, client: BaseClient) -> AsyncWebSocketConnection:
        if client.is_closed:
            raise closed_error()
        try:
            ws = await websockets.asyncio.client.connect(client.ws_url, **connect_options(client))
        except _CONNECT_ERRORS as err:
            raise connect_error(err) from err
        return cls(ws, client.timeout.read)

    def completion(self, *, model: str, prompt: Prompt = "", **options: Any) -> AsyncWebSocketStream:
        """The request is sent when the stream is first read (or entered with ``async with``)."""
        body = completion_body(model, prompt, False, options)
        return AsyncWebSocketStream({"type": "completion.create", **body}, conn=self)

    async def cancel(self) -> None:
        """Stop the running completion; its stream then ends with finish_reason "cancelled"."""
        if self._active is not None and not self._active.done:
            await self._send(_cancel(self._active.id))

    async def _begin(self, stream: AsyncWebSocketStream) -> None:
        """A new completion closes (cancels) the one before it, unless another task, still running, started that
        one: two tasks' completions on one connection cancelled the first and failed the second with the
        websockets library's own error."""
        owner, me = self._owner, asyncio.current_task()
        if self._active is not None and not self._active.done and owner not in (None, me) and not owner.done():
            raise APIError("a completion is streaming on this connection in another task: a connection runs "
                           "one completion at a time (open one connection per task, or wait for that one)")
        if self._active is not None:
            await self._active.close()
        self._active, self._owner = stream, me
        await self._send(stream.request)

    async def _send(self, msg: dict[str, Any]) -> None:
        try:
            await self._ws.send(json.dumps(msg))
        except websockets.exceptions.ConnectionClosed as err:
            raise _closed(err) from err

    async def _recv(self) -> dict[str, Any]:
        try:
            if self._read_timeout is None:
                return _message(await self._ws.recv())
            return _message(await asyncio.wait_for(self._ws.recv(), self._read_timeout))
        except websockets.exceptions.ConnectionClosed as err:
            raise _closed(err) from err
        except (TimeoutError, asyncio.TimeoutError) as err:  # two classes before Python 3.11
            raise connection_error(err) from err

    async def close(self) -> None:
        await self._ws.close()

    async def __aenter__(self) -> AsyncWebSocketConnection:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


class AsyncConnect:
    """What ``AsyncClient.ws.connect()`` returns: ``await`` it, or ``async with`` it to close the connection."""

    def __init__(self, client: BaseClient) -> None:
        self._client = client
        self._conn: AsyncWebSocketConnection | None = None

    def __await__(self) -> Generator[Any, None, AsyncWebSocketConnection]:
        return AsyncWebSocketConnection.open(self._client).__await__()

    async def __aenter__(self) -> AsyncWebSocketConnection:
        self._conn = await AsyncWebSocketConnection.open(self._client)
        return self._conn

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._conn is not None:
            await self._conn.close()


class AsyncWebSocketStream(AsyncIterator[CompletionChunk]):
    """The chunks of one completion; an async context manager that cancels it if unfinished.

    It runs on ``conn``, or (for ``ws.stream``) on a connection it opens with ``open`` and closes."""

    def __init__(self, request: dict[str, Any], *, conn: AsyncWebSocketConnection | None = None,
                 open: Callable[[], Awaitable[AsyncWebSocketConnection]] | None = None) -> None:
        self.request, self._conn, self._open, self._owns = request, conn, open, conn is None
        self.started = self.done = False
        self.id: str | None = None  # the completion's, once the server has named it

    async def _start(self) -> AsyncWebSocketConnection:
        if self._conn is None:
            assert self._open is not None
            self._conn = await self._open()
        if not self.started:
            self.started = True
            await self._conn._begin(self)
        return self._conn

    async def __anext__(self) -> CompletionChunk:
        conn = await self._start()
        while not self.done:
            msg = await conn._recv()
            self.id = msg.get("id") or self.id
            self.done = msg.get("type") in _END_TYPES
            if self.done and self._owns:
                await conn.close()
            if (chunk := _chunk(msg)) is not None:
                return chunk
        raise StopAsyncIteration

    def __aiter__(self) -> AsyncWebSocketStream:
        return self

    async def cancel(self) -> None:
        if self._conn is not None:
            await self._conn.cancel()

    async def close(self) -> None:
        """Cancel the completion if it still runs and read it to its end."""
        try:
            if self.started and not self.done and self._conn is not None:
                await self._conn.cancel()
                async for _ in self:
                    pass
        except APIError:
            pass  # the completion is over either way
        finally:
            if self._owns and self._conn is not None:
                await self._conn.close()

    async def __aenter__(self) -> AsyncWebSocketStream:
        await self._start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

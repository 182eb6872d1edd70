"""Completions over the WebSocket ``/v1/ws``: many in turn on one connection, each cancellable.

    with client.ws.connect() as conn:
        for chunk in conn.completion(model="m", prompt="Once", max_tokens=500):
            print(chunk.text, end="")
            if enough:
                conn.cancel()  # the loop still ends, with finish_reason "cancelled"

The keyword options of ``completion`` are those of ``completions.create`` (less ``stream`` and
``stream_options``: the WebSocket always streams and always reports usage on its last chunk).
A completion left before its end is cancelled and read to its end when the next one starts or
the stream is closed, so the connection is always ready for the next one; what the next one's start read is
kept for the stream, so a loop still reading it gets its last tokens and its end. A cancel that arrives
while the prompt is still being read ends the loop with ``RequestCancelledError`` instead: no token
was made, and nothing was stored (a session is as it was).

A stream of ``ws.stream`` dropped unfinished closes its connection, and a connection dropped unclosed
closes itself, as a dropped SSE stream does: the server then stops the completion and commits what it
made, where the session stayed busy until the completion ran to its end (found by a helper).

A read that times out (no message within the client's read timeout) closes the connection, as httpx drops a
connection whose read timed out: the server then stops the completion and commits what it made, and every later
call on the connection raises APIConnectionError. Kept open, the connection's next completion was answered with
the late messages of the one before (its tokens, or its 499 that says nothing was stored when the first had
been). A message naming another completion than the running one (a late one of an earlier completion) is
skipped for the same reason. The client sends no pings of its own: one that stops reading for a while stops
reading their pongs too, and its pings closed the connection (1011) after 40 s of a pause an SSE stream survives;
the server's pings wait as long as its send deadline.

A connection is not thread-safe: it runs one completion at a time, read by one thread (``cancel()`` may come
from another). Open one connection per thread; the ``Client`` itself may be shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx
import websockets.exceptions
import websockets.sync.client

from txlserve_client._base import (
    BaseClient,
    Prompt,
    check_options,
    checked_timeout,
    closed_error,
    connection_error,
    merged_headers,
    ws_completion_body,
)
from txlserve_client._exceptions import (
    APIConnectionError,
    APIError,
    APITimeoutError,
    AuthenticationError,
    PayloadTooLargeError,
    error_from_body,
)
from txlserve_client._types import CompletionChunk

MAX_MESSAGE_BYTES = 16 * 2**20
DROPPED_CLOSE_TIMEOUT_S = 1.0  # a dropped or timed-out connection's closing handshake, before its socket is closed
_END_TYPES = ("completion.done", "error")
# what opening a connection can raise, said as connect_error: InvalidURI where a redirect points to http(s)://
# (websockets follows redirects itself)
_CONNECT_ERRORS = (OSError, TimeoutError, asyncio.TimeoutError, websockets.exceptions.InvalidHandshake,
                   websockets.exceptions.ConnectionClosed,  # a connection dropped mid-handshake (websockets 17's)
                   websockets.exceptions.InvalidURI)


@dataclass(frozen=True)
class Target:
    """Where and how a connection opens: the client's settings under a call's ``RequestOptions``."""

    url: str
    connect: dict[str, Any]  # websockets' connect()'s arguments
    read_timeout: float | None  # the longest wait for a message

    @classmethod
    def of(cls, client: BaseClient, options: Mapping[str, Any]) -> Target:
        check_options(options, body=False, where="ws.connect()")
        headers = merged_headers(client._headers(), options.get("extra_headers"))
        timeout = checked_timeout(options.get("timeout", client.timeout))
        query = {k: v for k, v in {**client.default_query, **(options.get("extra_query") or {})}.items()
                 if v is not None}
        url = str(httpx.URL(client.ws_url, params=query)) if query else client.ws_url
        return cls(url, {"additional_headers": [(k, v) for k, v in headers.items() if k != "user-agent"],
                         "user_agent_header": headers.get("user-agent"), "open_timeout": timeout.connect,
                         "max_size": MAX_MESSAGE_BYTES, "ping_interval": None}, timeout.read)


def _cancel(completion_id: str | None) -> dict[str, Any]:
    """A cancel naming the completion once known: the server ignores one that names another (a late cancel of an
    earlier completion would otherwise stop the next)."""
    return {"type": "cancel"} if completion_id is None else {"type": "cancel", "id": completion_id}


def connect_error(err: Exception, url: str | None = None) -> APIError:
    """The exception for a failed opening handshake or socket (``url``: the address tried)."""
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
    return connection_error(err, url)


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


def _closed(err: websockets.exceptions.ConnectionClosed) -> APIError:
    if err.rcvd is not None and err.rcvd.code == 1009:  # the server's "message too big": what HTTP answers 413
        return PayloadTooLargeError(f"the server closed the WebSocket: a message was larger than it takes (its "
                                    f"--max-body-bytes) ({err})", status=413, type="invalid_request_error",
                                    code="payload_too_large")
    return APIConnectionError(f"the WebSocket closed ({err})")


def _timed_out(read_timeout: float | None) -> APITimeoutError:
    return APITimeoutError(f"no message from the server within the read timeout ({read_timeout:g} s): the WebSocket "
                           f"was closed, so the server stops the completion; in a session it keeps what it had made "
                           f"by then (sessions.get tells how much). Open a new connection for the next completion")


def _unkept(kept: deque[CompletionChunk | APIError]) -> CompletionChunk:
    """The next of what the connection kept for a stream: a chunk, or the error its completion ended with."""
    item = kept.popleft()
    if isinstance(item, APIError):
        raise item
    return item


class _Running:
    """What a connection knows of its running completion: whether its end is still to be read, its id once named,
    and its stream while referenced. Not the stream itself: a stream that held its connection and was held by it
    made a cycle that kept both, and the socket, open until the cyclic collector ran."""

    def __init__(self) -> None:
        self._running = False
        self._running_id: str | None = None
        self._active: weakref.ref[Any] | None = None
        self._ended: deque[str] = deque(maxlen=16)  # the ids of the last completions whose end was read
        self._broken: str | None = None  # why the connection was closed under its user (a read that timed out)

    def _usable(self) -> None:
        """Raise where the connection was closed under its user: the library's own error would not say why."""
        if self._broken is not None:
            raise APIConnectionError(f"this WebSocket connection is closed: {self._broken}; open another "
                                     f"(client.ws.connect())")

    def _ours(self, msg: dict[str, Any]) -> bool:
        """Whether ``msg`` is the running completion's. One naming another completion is a late message of an
        earlier one (a cancel's answer that came after its reader gave up): taken as this one's, it gave it the
        other's tokens, or the other's 499 ("nothing was stored") for a completion that was stored. One naming
        none answers the message just sent (a request refused before its run began)."""
        mid = msg.get("id")
        if not isinstance(mid, str) or not mid:
            return True
        if self._running_id is not None:
            return mid == self._running_id
        return mid not in self._ended

    def _abandoned(self) -> None:
        """Note a completion left unread to its end (its reader failed): a late message of it is skipped."""
        if self._running and self._running_id is not None:
            self._ended.append(self._running_id)
        self._running = False

    def _gave_up(self) -> None:
        """Note a read that timed out: the completion is left to the server to stop once the connection closes."""
        self._running = False
        self._broken = "a read timed out, and it was closed then"

    def _read_elsewhere(self) -> bool:
        """Whether a completion runs whose stream someone still holds: one left by ``break`` and dropped is read
        to its end by whoever starts the next, in any thread or task (found by a helper)."""
        return self._running and self._active is not None and self._active() is not None

    def _keep(self, msg: dict[str, Any]) -> None:
        """A message of the running completion read by the start of the next one, kept for its stream, which a
        loop may still be reading: a completion started inside another's loop had ended that loop at once, its
        last tokens and its end unseen, though the session kept them (found by a helper). Its stream yields them
        (or raises its error) before it ends."""
        stream = self._active() if self._active is not None else None
        try:
            chunk = _chunk(msg)
        except APIError as err:
            if stream is not None:
                stream._kept.append(err)
            raise
        if stream is not None and chunk is not None:
            stream._kept.append(chunk)

    def _heard(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Note a message of the running completion (its end: the completion is over, and its stream done)."""
        self._running_id = msg.get("id") or self._running_id
        if msg.get("type") in _END_TYPES:
            self._running = False
            if self._running_id is not None:
                self._ended.append(self._running_id)
            if (stream := self._active() if self._active is not None else None) is not None:
                stream.done = True
        return msg


class WebSocketConnection(_Running):
    """One open WebSocket; a context manager that closes it (and closed once dropped)."""

    def __init__(self, ws: websockets.sync.client.ClientConnection, read_timeout: float | None,
                 exit_stack: contextlib.ExitStack) -> None:
        super().__init__()
        self._ws, self._read_timeout, self._exit_stack = ws, read_timeout, exit_stack
        self._owner: threading.Thread | None = None  # the thread that started the running completion
        self._lock = threading.Lock()

    @classmethod
    def open(cls, client: BaseClient, options: Mapping[str, Any]) -> WebSocketConnection:
        target = Target.of(client, options)
        if client.is_closed:
            raise closed_error()
        attempt = 0
        while True:
            stack = contextlib.ExitStack()  # websockets >= 17.1 wants connect() entered as a context manager
            try:
                ws = stack.enter_context(websockets.sync.client.connect(target.url, **target.connect))
                return cls(ws, target.read_timeout, stack)
            except _CONNECT_ERRORS as err:
                if (delay := client._reopen_delay(attempt, err)) is None:
                    raise connect_error(err, target.url) from err
            time.sleep(delay)
            attempt += 1
            if client.is_closed:  # closed while the retry waited
                raise closed_error()

    def completion(self, *, model: str, prompt: Prompt = "", **options: Any) -> WebSocketStream:
        return self._start(ws_completion_body(model, prompt, options, where="completion()"))

    def _start(self, body: dict[str, Any], *, owns_connection: bool = False) -> WebSocketStream:
        """As ``AsyncWebSocketConnection._begin``: two threads' completions on one connection cancelled each other,
        got each other's errors, or failed with the websockets library's own ConcurrencyError."""
        me = threading.current_thread()
        with self._lock:
            owner = self._owner
            if self._read_elsewhere() and owner not in (None, me) and owner.is_alive():
                raise APIError("a completion is streaming on this connection in another thread: a connection runs "
                               "one completion at a time (open one connection per thread, or wait for that one)")
            self._finish(keep=True)
            self._send({"type": "completion.create", **body})
            stream = WebSocketStream(self, owns_connection=owns_connection)
            self._running, self._running_id, self._active, self._owner = True, None, weakref.ref(stream), me
            return stream

    def _finish(self, *, keep: bool = False) -> None:
        """Cancel the running completion, if any, and read it to its end (its stream may be gone); with ``keep``
        (another completion starts), what is read is kept for its stream."""
        try:
            if self._running:
                self._send(_cancel(self._running_id))
                while self._running:
                    msg = self._next()
                    self._keep(msg) if keep else _chunk(msg)
        except APIError:
            self._abandoned()  # the completion is over either way

    def cancel(self) -> None:
        """Stop the running completion; its stream then ends with finish_reason "cancelled"."""
        if self._running:
            self._send(_cancel(self._running_id))

    def _send(self, msg: dict[str, Any]) -> None:
        self._usable()
        try:
            self._ws.send(json.dumps(msg))
        except websockets.exceptions.ConnectionClosed as err:
            raise _closed(err) from err

    def _next(self) -> dict[str, Any]:
        while not self._ours(msg := self._recv()):
            pass
        return self._heard(msg)

    def _recv(self) -> dict[str, Any]:
        self._usable()
        try:
            return _message(self._ws.recv(timeout=self._read_timeout))
        except websockets.exceptions.ConnectionClosed as err:
            raise _closed(err) from err
        except (TimeoutError, asyncio.TimeoutError) as err:  # two classes before Python 3.11
            self._gave_up()
            self._ws.close_timeout = DROPPED_CLOSE_TIMEOUT_S
            with contextlib.suppress(Exception):  # closed either way
                self.close()
            raise _timed_out(self._read_timeout) from err
        except RuntimeError as err:  # websockets' ConcurrencyError (a RuntimeError before 14.0): a second reader
            raise APIError("another thread is reading this WebSocket: a connection is read by one thread at a "
                           "time (open one connection per thread)") from err

    def close(self) -> None:
        self._exit_stack.close()

    def __del__(self) -> None:
        if sys.is_finalizing():  # the library's reader thread is frozen by now: a close would wait on it for ever
            return  # (a script ending with a connection held hung, found by a helper); the process's exit closes it
        with contextlib.suppress(Exception):  # a socket already torn down
            self.close()

    def __enter__(self) -> WebSocketConnection:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class WebSocketStream(Iterator[CompletionChunk]):
    """The chunks of one completion on a connection; a context manager that cancels it if unfinished. One of
    ``ws.stream`` owns its connection, and closes it once dropped unfinished."""

    def __init__(self, conn: WebSocketConnection, *, owns_connection: bool = False) -> None:
        self._conn, self._owns = conn, owns_connection
        self.done = False  # its end was read (by it, or by the connection as the next completion started)
        self.id: str | None = None  # the completion's, once the server has named it
        self._kept: deque[CompletionChunk | APIError] = deque()  # read by the next completion's start

    def __next__(self) -> CompletionChunk:
        if self._kept:
            return _unkept(self._kept)
        while not self.done:
            msg = self._conn._next()
            self.id = msg.get("id") or self.id
            if self.done and self._owns:
                self._conn.close()
            if (chunk := _chunk(msg)) is not None:
                return chunk
        raise StopIteration

    def __iter__(self) -> WebSocketStream:
        return self

    def cancel(self) -> None:
        if not self.done:
            self._conn.cancel()

    def close(self) -> None:
        """Cancel the completion if it still runs and read it to its end."""
        try:
            if not self.done:
                self._conn._finish()
        finally:
            if self._owns:
                self._conn.close()

    def __del__(self) -> None:
        if self._owns and not self.done and not sys.is_finalizing():  # its connection is this stream's alone:
            with contextlib.suppress(Exception):  # closing it stops the completion (at exit: as the connection's)
                self._conn.close()

    def __enter__(self) -> WebSocketStream:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

"""Server-sent events of ``/v1/completions`` with ``stream=True``, as iterators of ``CompletionChunk``.

Closing a stream before its end (``close()``, leaving its ``with`` block or breaking out of its loop there, or
dropping its last reference) closes the HTTP response; the server then cancels the generation and commits what it
generated so far to the session, if there is one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator
from types import TracebackType

import httpx

from txlserve_client._base import close_soon, connection_error, decoding_error
from txlserve_client._exceptions import APIConnectionError, APIError, error_from_body, request_of
from txlserve_client._types import CompletionChunk

DONE = "[DONE]"


class SSELines:
    """Text in, lines out, ended only where SSE ends them (CR, LF or CRLF). httpx's ``iter_lines`` also ends a
    line at U+0085, U+2028 and U+2029 (``str.splitlines``), which JSON carries unescaped inside a string: text
    holding one was cut mid-event and failed to parse (found by a helper). A last line with no end is an event
    cut short, which SSE discards."""

    def __init__(self) -> None:
        self._rest = ""

    def feed(self, text: str) -> list[str]:
        text, self._rest = self._rest + text, ""
        lines = []
        start = 0
        while True:
            cr, lf = text.find("\r", start), text.find("\n", start)
            end = min(i for i in (cr, lf) if i >= 0) if cr >= 0 or lf >= 0 else -1
            if end < 0 or (end == cr and end + 1 == len(text)):  # no end yet, or a CR whose LF may come next
                break
            lines.append(text[start:end])
            start = end + (2 if end == cr and text.startswith("\n", end + 1) else 1)
        self._rest = text[start:]
        return lines


class SSEDecoder:
    """Lines in, the ``data`` of each complete event out (the parts of the SSE format the server uses)."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        if not line:  # a blank line ends an event
            data, self._data = self._data, []
            return "\n".join(data) if data else None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None  # comments (":...") and other fields are ignored


class SSEEvents:
    """Text in, the ``data`` of each complete event out: :class:`SSELines` into :class:`SSEDecoder`."""

    def __init__(self) -> None:
        self._lines, self._decoder = SSELines(), SSEDecoder()

    def feed(self, text: str) -> list[str]:
        return [data for line in self._lines.feed(text) if (data := self._decoder.feed(line)) is not None]


def chunk_from_event(data: str, response: httpx.Response | None = None) -> CompletionChunk | None:
    """The chunk an event carries; None for the final ``[DONE]``; raises the error an error event carries (with
    ``response``, the stream's)."""
    if data == DONE:
        return None
    try:
        body = json.loads(data)
        if "error" in body:
            raise error_from_body(body, response=response)
        return CompletionChunk.from_sse(body)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:  # not the server's event
        raise APIError(f"an event of the stream is not a txlserve server's ({type(err).__name__}): "
                       f"{data[:200]!r}", response=response) from None


_ENDED_EARLY = "the stream ended before [DONE]: the server closed the connection"


def _iter_chunks(response: httpx.Response) -> Generator[CompletionChunk, None, None]:
    """The chunks of ``response``. A function of the response, not a method of the stream: a generator that
    held the stream (``self``) made a reference cycle, so a stream dropped after ``break`` without ``with``
    or ``close()`` kept its connection open, and the server generating into the session, until the cyclic
    garbage collector ran (seconds or minutes later)."""
    events = SSEEvents()
    try:
        for text in response.iter_text():
            for data in events.feed(text):
                if (chunk := chunk_from_event(data, response)) is None:
                    return
                yield chunk
    except httpx.TransportError as err:
        raise connection_error(err) from err
    except httpx.DecodingError as err:
        raise decoding_error(err, response) from err
    finally:
        response.close()
    raise APIConnectionError(_ENDED_EARLY, request=request_of(response))


async def _aiter_chunks(response: httpx.Response) -> AsyncGenerator[CompletionChunk, None]:
    """As ``_iter_chunks``, for ``AsyncStream``."""
    events = SSEEvents()
    try:
        async for text in response.aiter_text():
            for data in events.feed(text):
                if (chunk := chunk_from_event(data, response)) is None:
                    return
                yield chunk
    except httpx.TransportError as err:
        raise connection_error(err) from err
    except httpx.DecodingError as err:
        raise decoding_error(err, response) from err
    finally:
        await response.aclose()
    raise APIConnectionError(_ENDED_EARLY, request=request_of(response))


class Stream(Iterator[CompletionChunk]):
    """The chunks of one streamed completion; a context manager that closes the HTTP response.

    A stream dropped unfinished (its last reference gone, as after ``break`` out of a ``for`` over
    ``create(..., stream=True)``) closes its response at once; one still referenced stays open until
    ``close()``: prefer ``with``."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self._chunks = _iter_chunks(response)
        self._closed = False

    @property
    def _request_id(self) -> str | None:
        """openai-python's: the id the server logged the request under (its ``x-request-id``)."""
        return self.response.headers.get("x-request-id")

    def __del__(self) -> None:  # a stream never iterated: its generator never started, so its finally never runs
        with contextlib.suppress(Exception):  # at interpreter exit, or a response already torn down
            self.response.close()

    def __next__(self) -> CompletionChunk:
        try:
            return next(self._chunks)
        except (APIConnectionError, ValueError):  # closed from another thread: the read it ended, or a next()
            if self._closed:  # that met close() inside the generator ("generator already executing")
                raise StopIteration from None
            raise

    def __iter__(self) -> Stream:
        return self

    def close(self) -> None:
        """Also from another thread than the one reading (a stop button), as openai-python's: the read waiting
        there ends, and the loop over the stream with it. That had raised "generator already executing", and the
        server generated on into the session."""
        self._closed = True
        try:
            self._chunks.close()
        except ValueError:  # being read in another thread: its socket is shut, which wakes the read
            shutdown_socket(self.response)
        self.response.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class AsyncStream(AsyncIterator[CompletionChunk]):
    """The chunks of one streamed completion; an async context manager that closes the HTTP response."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self._chunks = _aiter_chunks(response)  # no cycle: asyncio's finalizer closes it once the stream is dropped
        self._loop = asyncio.get_running_loop()
        self._closed = False

    @property
    def _request_id(self) -> str | None:
        """openai-python's: the id the server logged the request under (its ``x-request-id``)."""
        return self.response.headers.get("x-request-id")

    def __del__(self) -> None:
        """A stream never iterated: its generator never started, so asyncio has nothing to finalize, and the
        server generated on into a busy session (found by a helper). Its response is closed on its loop."""
        response = getattr(self, "response", None)
        if response is not None and not response.is_closed:
            close_soon(getattr(self, "_loop", None), response.aclose)

    async def __anext__(self) -> CompletionChunk:
        try:
            return await self._chunks.__anext__()
        except (APIConnectionError, RuntimeError):  # closed by another task: as Stream's
            if self._closed:
                raise StopAsyncIteration from None
            raise

    def __aiter__(self) -> AsyncStream:
        return self

    async def close(self) -> None:
        """Also from another task than the one reading, as :meth:`Stream.close` from another thread."""
        self._closed = True
        try:
            await self._chunks.aclose()
        except RuntimeError:  # "aclose(): asynchronous generator is already running": being read by another task
            shutdown_socket(self.response)
        await self.response.aclose()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


def shutdown_socket(response: httpx.Response) -> None:
    """Shut the connection's socket both ways: a read waiting on it in another thread or task returns (closing
    the socket would not wake it), and the server sees the client leave."""
    stream = response.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

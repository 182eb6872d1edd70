"""uvicorn's HTTP protocol, with a deadline for each request's headers and its own errors in OpenAI's shape.

uvicorn closes a keep-alive connection that stays silent after a response, but not one that
sends part of a request's headers and stops, nor one that never sends a byte: each holds a
socket and a file descriptor for ever (slowloris). The ASGI app cannot help, since it first
hears of a request once its headers are complete (``BodyLimit`` bounds the body from there).
So the protocol itself gives every connection ``timeout_s`` from its start, and from the end
of each response, to complete the next request's headers; past that it closes, with a 408
where part of a request had come (nginx's ``client_header_timeout``). A request uvicorn cannot parse (a bad
Content-Length, a garbage request line) gets its 400 in OpenAI's error shape, not plain text.
"""

from __future__ import annotations

import asyncio
import json

from server.errors import error_body
from txlserve.errors import ConfigError

# The request line and headers h11 buffers while they are incomplete. Its default, 16 KiB, made a long URL (a
# 60,000-character session id) a 400 "not valid HTTP" or an ordinary 404 depending on whether its bytes arrived
# in one read or two; the header deadline above bounds how long a head may take. (httptools has no such limit on
# the head, but refuses a URL over 65,535 bytes as not valid HTTP, a 400, where h11 reads it: left as it is.)
MAX_HEAD_BYTES = 1 << 20


SENT_STATUS = "txlserve.sent_status"  # in a request's scope: the status the protocol answered in the app's stead


def raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response in OpenAI's shape, for the protocol to write before it closes."""
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


TIMEOUT_RESPONSE = raw_response(408, "Request Timeout", "the request's headers did not arrive in time",
                                "request_timeout")
BAD_REQUEST_RESPONSE = raw_response(400, "Bad Request", "the request is not valid HTTP/1.1 (its request line or "
                                    "headers could not be parsed)", "invalid_http")


class SendDeadline:
    """A protocol mixin: a connection whose writes stay paused (the client reads nothing while its send buffer is
    full) for ``send_timeout_s`` is aborted, as nginx's ``send_timeout`` closes it. A stream whose client never read
    held its run's text, and the server's memory, for ever: 220 MB a connection for an echoed prompt with
    logprobs, found by a helper (a WebSocket's keepalive closed it, but a close waits for the buffer to drain). The
    app then hears a disconnect, as when the client leaves. 0: never."""

    send_timeout_s: float = 0.0
    writes_paused = False  # the client reads nothing while the server has more to send (the drain ends these)
    _stall: asyncio.TimerHandle | None = None

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        self.writes_paused = True
        if self._stall is None and self.send_timeout_s:
            self._stall = asyncio.get_running_loop().call_later(self.send_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        self.writes_paused = False
        self._unstall()
        super().resume_writing()  # type: ignore[misc]

    def abort_if_stalled(self) -> None:
        """End the connection now if its client reads nothing (the drain: its response would wait past the
        shutdown, and uvicorn then cancelled its app with a traceback, found by a helper)."""
        if self.writes_paused:
            self._unstall()
            self._stalled()

    def connection_lost(self, exc: Exception | None) -> None:
        self._unstall()
        super().connection_lost(exc)  # type: ignore[misc]

    def _unstall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        self._stall = None
        transport = self.transport  # type: ignore[attr-defined]
        if transport.get_protocol() is self:  # not a connection upgraded since (the WebSocket's own watches it)
            transport.abort()  # a close would wait for the buffer to drain, which it never does


def websocket_protocol_class(send_timeout_s: float) -> type | str:
    """uvicorn's WebSocket protocol (``ws="auto"``'s choice), with the send deadline."""
    from uvicorn.protocols.websockets.auto import AutoWebSocketsProtocol

    if AutoWebSocketsProtocol is None:  # no WebSocket library: uvicorn refuses upgrades itself
        return "auto"

    class WebSocketProtocol(SendDeadline, AutoWebSocketsProtocol):  # type: ignore[misc, valid-type]
        pass

    WebSocketProtocol.send_timeout_s = send_timeout_s
    return WebSocketProtocol


def protocol_class(timeout_s: float, http: str = "auto", send_timeout_s: float = 0.0) -> type:
    """The protocol uvicorn's ``http`` setting picks (``auto``: httptools where installed, else h11), with the
    deadline: a class to pass as ``uvicorn.Config(http=...)``. httptools parses in C: with a fast engine (a GPU,
    or a small model) one stream's tokens/s rose 22% with it and uvloop (BENCHMARKS.md, "The server's steps as
    CUDA graphs")."""
    try:
        if http == "h11":
            raise ImportError
        import httptools  # noqa: F401  (only whether it is there)
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
        parser = "httptools"
    except ImportError:
        if http == "httptools":
            raise ConfigError("http is httptools, but httptools is not installed (pip install httptools)") from None
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
        parser = "h11"

    class Protocol(SendDeadline, base):  # type: ignore[misc, valid-type]
        parser_name = parser  # the parser it runs, for the start-up log
        _deadline: asyncio.TimerHandle | None = None
        _heard = False  # bytes arrived since the deadline was armed
        # h11 bounds a request's head itself (MAX_HEAD_BYTES, given to uvicorn); httptools has no bound, and
        # uvicorn keeps appending a request line's pieces, so a client could fill the memory before the deadline
        _count_head = parser == "httptools"
        _head_bytes = 0  # bytes received since the current request began, while its headers are incomplete
        _head_done = False

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._arm(self.cycle)

        def on_message_begin(self) -> None:
            self._head_bytes, self._head_done = 0, False
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._head_done = True
            super().on_headers_complete()

        def on_header(self, name: bytes, value: bytes) -> None:
            if not self._head_done:
                return super().on_header(name, value)
            # a trailer field after a chunked body: uvicorn would append it to headers the app has already read,
            # without bound; it is dropped (RFC 9110 lets a recipient discard trailers), and its bytes count
            self._head_bytes += len(name) + len(value)
            if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self.transport.close()

        def on_response_complete(self) -> None:
            done = self.cycle  # before super(), which may already start a pipelined request's cycle
            super().on_response_complete()
            self._arm(done)

        def data_received(self, data: bytes) -> None:
            self._heard = True
            if self.transport.is_closing():  # a trailer past the bound closed it: nothing more is parsed
                return
            super().data_received(data)
            if self._count_head and not self._head_done and not self.transport.is_closing():
                self._head_bytes += len(data)  # after the parse: a request that began in this piece has reset it
                if self._head_bytes > MAX_HEAD_BYTES:  # as h11 answers a head past its bound
                    if self.cycle is None or self.cycle.response_complete:  # not inside a response under way
                        self.transport.write(BAD_REQUEST_RESPONSE)
                    self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            if self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete:
                return super().send_400_response(msg)  # a response is under way: uvicorn's own handling
            # uvicorn's is text/plain; where the app waits on the body (a bad chunk, more bytes than the
            # Content-Length said) nothing of its answer went out yet, and the connection closes after this
            self.transport.write(BAD_REQUEST_RESPONSE)
            self.transport.close()
            if self.cycle is not None:  # the app hears a disconnect (a 499): the log says what the client got
                self.cycle.scope[SENT_STATUS] = 400

        def _arm(self, cycle: object) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._heard = False
            # uvicorn makes a new request cycle once a request's headers are complete: the same cycle at the
            # deadline means no request began since it was armed
            self._deadline = self.loop.call_later(timeout_s, self._expire, cycle)

        def _expire(self, cycle: object) -> None:
            self._deadline = None
            transport = self.transport
            if (self.cycle is not cycle or (self.cycle is not None and not self.cycle.response_complete)
                    or transport.is_closing() or transport.get_protocol() is not self):
                return  # a request began or runs (or the connection became a WebSocket, or is closing anyway)
            if self._heard:  # part of a request came: say why it ends; a silent connection just closes
                transport.write(TIMEOUT_RESPONSE)
            transport.close()

    Protocol.send_timeout_s = send_timeout_s
    return Protocol

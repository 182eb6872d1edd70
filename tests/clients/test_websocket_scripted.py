"""WebSocket connections against a scripted server (``scripted_ws``): a read that times out, and messages that
belong to an earlier completion."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest
import websockets.asyncio.server
from txlserve_client import (
    APIConnectionError,
    APIError,
    APITimeoutError,
    AsyncClient,
    AsyncWebSocketConnection,
    AsyncWebSocketStream,
    Client,
    RequestCancelledError,
    Timeout,
)
from websockets.protocol import State

from tests.clients.scripted_ws import DONE, ScriptedWebSocket
from tests.live import wait_for

CANCELLED = {"type": "error", "id": "cmpl-1", "status": 499, "error": {
    "message": "cancelled before its text was read", "type": "invalid_request_error", "code": "request_cancelled"}}


async def _answer(ws: websockets.asyncio.server.ServerConnection, n: int) -> None:
    await ws.send(json.dumps({"type": "completion.delta", "id": f"cmpl-{n}", "text": f"<{n}>"}))
    await ws.send(json.dumps({"type": "completion.done", "id": f"cmpl-{n}", **DONE}))


@pytest.fixture
def slow_cancel_server() -> Iterator[ScriptedWebSocket]:
    """The first completion silent, its cancel answered 0.3 s later with a 499; later ones answered at once."""
    async def handler(ws: websockets.asyncio.server.ServerConnection) -> None:
        n = 0
        async for raw in ws:
            msg = json.loads(raw)
            if msg["type"] == "completion.create":
                n += 1
                if n > 1:
                    await _answer(ws, n)
            elif n == 1:
                await asyncio.sleep(0.3)  # the late answer is what the test is about: the client's wait is 0.1 s
                await ws.send(json.dumps(CANCELLED))

    with ScriptedWebSocket(handler) as server:
        yield server


@pytest.fixture
def late_message_server() -> Iterator[ScriptedWebSocket]:
    """Each completion answered at once; the second preceded by a late 499 and a delta of the first."""
    async def handler(ws: websockets.asyncio.server.ServerConnection) -> None:
        n = 0
        async for raw in ws:
            if json.loads(raw)["type"] == "completion.create":
                n += 1
                if n == 2:
                    await ws.send(json.dumps({"type": "completion.delta", "id": "cmpl-1", "text": "<late>"}))
                    await ws.send(json.dumps(CANCELLED))
                await _answer(ws, n)

    with ScriptedWebSocket(handler) as server:
        yield server


def test_a_completion_after_a_read_timeout_gets_its_own_answer(slow_cancel_server: ScriptedWebSocket) -> None:
    """The reviewer's case: a read that timed out kept the connection, and the next completion on it got the first
    one's 499 ("nothing was stored"), or its tokens."""
    with Client(base_url=slow_cancel_server.url, timeout=Timeout(0.1, connect=5), max_retries=0) as client, \
            client.ws.connect() as conn:
        with pytest.raises(APIConnectionError):
            list(conn.completion(model="m", prompt="long"))
        for n in (2, 3):
            try:
                chunks = list(conn.completion(model="m", prompt="short"))
            except RequestCancelledError as err:
                pytest.fail(f"completion {n} raised an earlier completion's error: {err!r}")
            except APIConnectionError:
                continue
            assert {c.id for c in chunks} == {f"cmpl-{n}"}


def test_a_read_that_times_out_closes_the_connection(slow_cancel_server: ScriptedWebSocket) -> None:
    """As httpx drops a connection whose read timed out: the server then stops the completion (and keeps what it
    made), and the connection's later calls say why they cannot run."""
    with Client(base_url=slow_cancel_server.url, timeout=Timeout(0.1, connect=5), max_retries=0) as client, \
            client.ws.connect() as conn:
        with pytest.raises(APITimeoutError, match="the WebSocket was closed"):
            next(conn.completion(model="m", prompt="long"))
        assert slow_cancel_server.wait_ended(1), "the connection stayed open after its read timed out"
        with pytest.raises(APIConnectionError, match="a read timed out"):
            conn.completion(model="m", prompt="short")


def test_a_late_message_of_an_earlier_completion_is_skipped(late_message_server: ScriptedWebSocket) -> None:
    with Client(base_url=late_message_server.url, max_retries=0) as client, client.ws.connect() as conn:
        assert [c.text for c in conn.completion(model="m", prompt="a")] == ["<1>", ""]
        chunks = list(conn.completion(model="m", prompt="b"))
    assert [(c.id, c.text) for c in chunks] == [("cmpl-2", "<2>"), ("cmpl-2", "")]


@pytest.mark.anyio
async def test_the_async_connection_closes_after_a_read_timeout(slow_cancel_server: ScriptedWebSocket) -> None:
    async with AsyncClient(base_url=slow_cancel_server.url, timeout=Timeout(0.1, connect=5), max_retries=0) as client, \
            client.ws.connect() as conn:
        with pytest.raises(APITimeoutError, match="the WebSocket was closed"):
            async for _ in conn.completion(model="m", prompt="long"):
                pass
        assert await asyncio.to_thread(slow_cancel_server.wait_ended, 1), "the connection stayed open"
        for _ in (2, 3):
            with pytest.raises(APIConnectionError, match="a read timed out"):
                async for _ in conn.completion(model="m", prompt="short"):
                    pass


@pytest.mark.anyio
async def test_the_async_connection_skips_a_late_message_too(late_message_server: ScriptedWebSocket) -> None:
    async with AsyncClient(base_url=late_message_server.url, max_retries=0) as client, \
            client.ws.connect() as conn:
        assert [c.text async for c in conn.completion(model="m", prompt="a")] == ["<1>", ""]
        chunks = [c async for c in conn.completion(model="m", prompt="b")]
    assert [(c.id, c.text) for c in chunks] == [("cmpl-2", "<2>"), ("cmpl-2", "")]


@pytest.fixture
def held_cancel_server() -> Iterator[ScriptedWebSocket]:
    """The first completion silent until cancelled, its 499 held until the test sets ``release`` (at most 10 s);
    later ones answered at once. Every message the client sent is in ``heard``, in order."""
    heard: list[dict] = []
    release = threading.Event()

    async def handler(ws: websockets.asyncio.server.ServerConnection) -> None:
        n, answered = 0, False
        async for raw in ws:
            msg = json.loads(raw)
            heard.append(msg)
            if msg["type"] == "completion.create":
                n += 1
                if n > 1:
                    await _answer(ws, n)
            elif n == 1 and not answered:
                answered = True
                await asyncio.to_thread(release.wait, 10)
                await ws.send(json.dumps(CANCELLED))

    with ScriptedWebSocket(handler) as server:
        server.heard, server.release = heard, release  # type: ignore[attr-defined]
        yield server


def _types(server: ScriptedWebSocket) -> list[str]:
    return [m["type"] for m in server.heard]  # type: ignore[attr-defined]


def test_a_completion_cancelled_by_the_next_ones_start_raises_its_499_in_its_own_loop_once(
        held_cancel_server: ScriptedWebSocket) -> None:
    """The next completion's start reads the one before to its end: that one's 499 (cancelled while its prompt was
    read) is kept for its own stream, raised there once, never in the next one's."""
    held_cancel_server.release.set()  # type: ignore[attr-defined]
    with Client(base_url=held_cancel_server.url, max_retries=0) as client, client.ws.connect() as conn:
        first = conn.completion(model="m", prompt="long")
        second = conn.completion(model="m", prompt="short")
        assert [(c.id, c.text) for c in second] == [("cmpl-2", "<2>"), ("cmpl-2", "")]
        with pytest.raises(RequestCancelledError):
            next(first)
        assert list(first) == []


@pytest.mark.anyio
async def test_the_async_one_too(held_cancel_server: ScriptedWebSocket) -> None:
    held_cancel_server.release.set()  # type: ignore[attr-defined]
    async with AsyncClient(base_url=held_cancel_server.url, max_retries=0) as client, client.ws.connect() as conn:
        first = conn.completion(model="m", prompt="long")
        async with first:  # sent
            chunks = [c async for c in conn.completion(model="m", prompt="short")]
            assert [(c.id, c.text) for c in chunks] == [("cmpl-2", "<2>"), ("cmpl-2", "")]
            with pytest.raises(RequestCancelledError):
                await first.__anext__()
            assert [c async for c in first] == []


async def _heard(server: ScriptedWebSocket, kind: str, count: int = 1) -> None:
    """Wait (bounded) until the server has read ``count`` messages of ``kind``."""
    assert await asyncio.to_thread(wait_for, lambda: _types(server).count(kind) >= count or None, 10,
                                   f"{count} {kind} message(s)")


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["stream", "connection"])
async def test_an_async_completion_cancelled_while_the_one_before_ends_is_never_sent(
        held_cancel_server: ScriptedWebSocket, how: str) -> None:
    """Its start cancels the one before and reads it to its end; a stop pressed meanwhile had cancelled that one
    again and let this one run to its max_tokens (found by a review)."""
    async with AsyncClient(base_url=held_cancel_server.url, max_retries=0) as client, client.ws.connect() as conn:
        first = conn.completion(model="m", prompt="long")
        async with first:
            second = conn.completion(model="m", prompt="short")

            async def stop() -> None:  # a stop button's task
                await _heard(held_cancel_server, "cancel")  # the second's start is reading the first to its end
                await (second.cancel() if how == "stream" else conn.cancel())
                held_cancel_server.release.set()  # type: ignore[attr-defined]
            stopping = asyncio.ensure_future(stop())
            with pytest.raises(RequestCancelledError, match="before it was sent"):
                await second.__anext__()
            await stopping
            assert second.done and [c async for c in second] == []
    assert _types(held_cancel_server).count("completion.create") == 1


@pytest.mark.anyio
async def test_a_stream_that_failed_to_start_cancels_only_itself(held_cancel_server: ScriptedWebSocket) -> None:
    """A completion refused because another task's streams on the connection: its cancel had sent a cancel for
    that other task's completion, and the connection's cancel recursed without end (found by a review)."""
    async with AsyncClient(base_url=held_cancel_server.url, max_retries=0) as client, client.ws.connect() as conn:
        first = conn.completion(model="m", prompt="long")

        async def read_first() -> None:
            async for _ in first:
                pass
        reader = asyncio.ensure_future(read_first())
        await _heard(held_cancel_server, "completion.create")
        second = conn.completion(model="m", prompt="short")
        with pytest.raises(APIError, match="another task"):
            async for _ in second:
                pass
        await second.cancel()  # its own: not the first's
        await conn.cancel()  # the connection's: the running one (the first), and the unsent second
        held_cancel_server.release.set()  # type: ignore[attr-defined]
        with pytest.raises(RequestCancelledError):
            await reader
        with pytest.raises(RequestCancelledError, match="before it was sent"):
            async for _ in second:
                pass
    assert _types(held_cancel_server) == ["completion.create", "cancel"]


class _DrainingSocket:
    """A fake of the websockets library's connection (our seam): ``send`` takes the frame, then waits for
    ``drained``, as the library's send buffers a frame and then waits for its buffer to drain."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.drained = asyncio.Event()
        self.inbox: asyncio.Queue[str] = asyncio.Queue()
        self.state = State.OPEN

    async def send(self, data: str) -> None:
        self.sent.append(json.loads(data))
        await self.drained.wait()

    async def recv(self) -> str:
        return await self.inbox.get()

    async def close(self) -> None:
        self.state = State.CLOSED


@pytest.mark.anyio
async def test_an_async_completion_whose_reader_is_cancelled_as_its_request_drains_runs_and_can_be_stopped() -> None:
    """A stop (``task.cancel()``) while the request's frame drains: the frame had left, yet the stream was reset as
    never sent, so a second read sent it again, and the first, marked as not running, could not be cancelled
    (found by a review). It runs: its cancel goes out, and its end is its own."""
    fake = _DrainingSocket()
    conn = AsyncWebSocketConnection(fake, None)  # type: ignore[arg-type]
    stream = conn.completion(model="m", prompt="long")
    reading = asyncio.ensure_future(stream.__anext__())
    for _ in range(10_000):  # until the frame is taken (a few loop turns), bounded
        if fake.sent:
            break
        await asyncio.sleep(0)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    fake.drained.set()
    await stream.cancel()
    assert [m["type"] for m in fake.sent] == ["completion.create", "cancel"]
    fake.inbox.put_nowait(json.dumps({"type": "completion.done", "id": "cmpl-1", **DONE,
                                      "finish_reason": "cancelled"}))
    chunks = [c async for c in stream]
    assert chunks[-1].finish_reason == "cancelled" and stream.done
    assert [m["type"] for m in fake.sent] == ["completion.create", "cancel"]  # never sent twice


@pytest.mark.anyio
async def test_a_one_shot_stream_cancelled_as_its_connection_opens_closes_it() -> None:
    """``ws.stream`` owns its connection: cancelled while it opened, the stream was never sent and raised, but its
    connection stayed open until collected (found by a review)."""
    fake, opened = _DrainingSocket(), asyncio.Event()

    async def open_later() -> AsyncWebSocketConnection:
        await opened.wait()
        return AsyncWebSocketConnection(fake, None)  # type: ignore[arg-type]

    stream = AsyncWebSocketStream({"type": "completion.create", "model": "m", "prompt": "x"}, open=open_later)
    reading = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)  # (any number of turns: the stream waits for its connection until ``opened``)
    await stream.cancel()
    opened.set()
    with pytest.raises(RequestCancelledError, match="before it was sent"):
        await reading
    assert fake.sent == [] and fake.state is State.CLOSED

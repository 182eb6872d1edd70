"""WebSocket connections against a scripted server (``scripted_ws``): a read that times out, and messages that
belong to an earlier completion."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
import websockets.asyncio.server
from txlserve_client import APIConnectionError, APITimeoutError, AsyncClient, Client, RequestCancelledError, Timeout

from tests.clients.scripted_ws import DONE, ScriptedWebSocket

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

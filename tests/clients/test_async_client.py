"""AsyncClient against a real server: the same API with await, async for and async with."""

from __future__ import annotations

import asyncio
import gc

import pytest
from txlserve_client import (
    APIConnectionError,
    APIError,
    APITimeoutError,
    AsyncClient,
    AsyncStream,
    AsyncWebSocketConnection,
    AsyncWebSocketStream,
    AuthenticationError,
    BadRequestError,
    Completion,
    NotFoundError,
    RequestCancelledError,
    SessionBusyError,
    SessionRef,
)
from websockets.protocol import State

from tests.conftest import KeyedServer
from tests.live import LONG, MODEL, LiveServer

pytestmark = pytest.mark.anyio


async def test_completion_and_stream(aclient: AsyncClient) -> None:
    done = await aclient.completions.create(model=MODEL, prompt="Hello", max_tokens=10, temperature=0)
    assert isinstance(done, Completion) and done.usage.completion_tokens == 10
    stream = await aclient.completions.create(model=MODEL, prompt="Hello", max_tokens=10, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
    assert isinstance(stream, AsyncStream)
    async with stream:
        chunks = [c async for c in stream]
    assert "".join(c.text for c in chunks) == done.text
    assert chunks[-1].usage == done.usage
    as_ids = await aclient.completions.create(model=MODEL, prompt=[list(b"Hello")], max_tokens=10, temperature=0)
    assert as_ids.text == done.text  # a batch of one token-id prompt (the bundled model's ids are bytes)
    banned = await aclient.completions.create(model=MODEL, prompt="Hello", max_tokens=10, temperature=0,
                                              extra_body={"allowed_token_ids": [ord("z")]})  # vLLM's, as the SDK's
    assert banned.text == "z" * 10


async def test_sessions(aclient: AsyncClient) -> None:
    created = await aclient.sessions.create(text="abc", metadata={"k": "v"})
    appended = await aclient.sessions.append(created.id, "de")
    assert appended.tokens_seen == 5 and appended.appended_tokens == 2
    done = await aclient.completions.create(model=MODEL, prompt="f", max_tokens=3, session_id=created.id)
    assert done.session == SessionRef(created.id, 9) and done.usage.cached_tokens == 5
    fork = await aclient.sessions.fork(created.id)
    assert (await aclient.sessions.get(fork.id)).tokens_seen == 9
    updated = await aclient.sessions.update(fork.id, metadata={"k": None, "branch": "b"})
    assert updated.metadata == {"branch": "b"} and updated.tokens_seen == 9
    assert (await aclient.sessions.get(created.id)).metadata == {"k": "v"}  # the fork's own
    assert (await aclient.sessions.delete(fork.id)).deleted
    with pytest.raises(NotFoundError):
        await aclient.sessions.get(fork.id)


async def test_list_pages(keyed_server: KeyedServer) -> None:
    async with AsyncClient(base_url=keyed_server.url, api_key=keyed_server.keys[0]) as client:
        mine = [(await client.sessions.create()).id for _ in range(3)]
        page = await client.sessions.list(limit=2)
        assert page.has_more and len(page.data) == 2
        seen = [s.id async for s in page.iter_all()]
        assert set(mine) <= set(seen) and len(seen) == len(set(seen))
        # as OpenAI's SDK's AsyncPaginator: every session of every page, with or without the await
        assert [s.id async for s in client.sessions.list(limit=2)] == seen
        assert [s.id async for s in await client.sessions.list(limit=2)] == seen
        assert [s.id async for s in client.sessions.list(limit=2, after=seen[0])] == seen[1:]
    async with AsyncClient(base_url=keyed_server.url, api_key="wrong") as client:
        with pytest.raises(AuthenticationError):
            await client.sessions.list()


async def test_session_busy_and_early_close(aclient: AsyncClient) -> None:
    session = await aclient.sessions.create(text="abc")
    stream = await aclient.completions.create(model=MODEL, prompt="d", max_tokens=LONG, session_id=session.id,
                                              stream=True)
    async with stream:
        await stream.__anext__()
        with pytest.raises(SessionBusyError) as info:
            await aclient.completions.create(model=MODEL, prompt="x", max_tokens=1, session_id=session.id)
        assert info.value.status == 409
    for _ in range(200):  # the cancelled run commits what it generated, then frees the session
        if (s := await aclient.sessions.get(session.id)).tokens_seen > 4:
            break
        await asyncio.sleep(0.05)
    assert 4 < s.tokens_seen < 4 + LONG


async def test_a_stream_closed_by_another_task_ends_its_loop_and_the_run(grouped_server: LiveServer) -> None:
    """As the sync client's from another thread: ``close()`` while another task awaited the stream raised
    "aclose(): asynchronous generator is already running", and the session got every token."""
    async with AsyncClient(base_url=grouped_server.url, timeout=30) as client:
        session = await client.sessions.create(text="abc")
        stream = await client.completions.create(model=MODEL, prompt="d", max_tokens=LONG, session_id=session.id,
                                                 stream=True)
        await stream.__anext__()  # the next chunk is 100,000 tokens away

        async def read() -> int:
            return sum([1 async for _ in stream])

        reader = asyncio.create_task(read())
        for _ in range(10_000):  # until the reader awaits inside the stream's generator
            if stream._chunks.ag_running or reader.done():
                break
            await asyncio.sleep(0)
        assert stream._chunks.ag_running, reader
        await stream.close()
        assert await asyncio.wait_for(reader, 30) == 0
        for _ in range(600):  # the cancelled run commits what it generated
            if (s := await client.sessions.get(session.id)).tokens_seen > 4:
                break
            await asyncio.sleep(0.05)
        assert 4 < s.tokens_seen < 4 + LONG


@pytest.mark.parametrize("drop", ["break", "unread", "ws"])
async def test_a_stream_dropped_closes_at_once(aclient: AsyncClient, drop: str) -> None:
    """As the sync client's: with the cyclic collector off, a stream left by ``break`` closes as it is dropped; so
    does one dropped before it was read (asyncio has no generator of it to finalize), and ``ws.stream`` left by
    ``break`` (both generated on to max_tokens into a busy session, found by a helper), on the stream's loop."""
    session = await aclient.sessions.create(text="abc")
    gc.disable()
    try:
        if drop == "ws":
            async for _ in aclient.ws.stream(model=MODEL, prompt="d", max_tokens=LONG, session_id=session.id):
                break
        else:
            stream = await aclient.completions.create(model=MODEL, prompt="d", max_tokens=LONG,
                                                      session_id=session.id, stream=True)
            if drop == "break":
                async for _ in stream:
                    break
            del stream
        for _ in range(600):  # the cancelled run commits what it generated
            if (s := await aclient.sessions.get(session.id)).tokens_seen > 4:
                break
            await asyncio.sleep(0.05)
    finally:
        gc.enable()
    assert 4 < s.tokens_seen < 4 + LONG


async def test_a_dropped_connection_whose_reading_paused_closes_within_the_clients_wait(
        aclient: AsyncClient) -> None:
    """Tokens that nobody reads fill the library's queue and it pauses reading; the dropped connection's close then
    waited for the server's close frame behind them for the library's 10 s, past the 5 s the client waits for
    begun closes: ``asyncio.run`` ended with the socket open (a ResourceWarning, 2 runs in 7 of a script's test)."""
    from txlserve_client import _base

    conn = await aclient.ws.connect()
    async for _ in conn.completion(model=MODEL, prompt="b", max_tokens=LONG):
        break
    ws = conn._ws
    for _ in range(6000):  # the tiny model's tokens fill the queue in milliseconds; bounded at 60 s
        if not ws.transport.is_reading():
            break
        await asyncio.sleep(0.01)
    assert not ws.transport.is_reading(), "the library never paused reading"
    del conn
    gc.collect()  # the finalizer begins the close
    loop = asyncio.get_running_loop()
    started = loop.time()
    await _base.closes_begun()
    assert ws.state is State.CLOSED and loop.time() - started < 5


async def test_a_cancel_that_meets_a_websocket_message_is_never_lost() -> None:
    """``task.cancel()`` of a task reading a WebSocket (a "stop" button) as its next message arrives: the read was
    ``asyncio.wait_for``, which before Python 3.12 returns the message and drops the cancel, so the task read on
    to the completion's end (a third of the time on a token stream, found by a helper). The connection's socket
    here is the test's own, answered at that moment; its read timeout still holds."""

    class Socket:
        state = State.CLOSED  # nothing for the connection's finalizer to close

        def __init__(self) -> None:
            self.reading = asyncio.get_running_loop().create_future()
            self.message: asyncio.Future[str] | None = None

        async def recv(self) -> str:
            self.message = asyncio.get_running_loop().create_future()
            self.reading.set_result(None)
            return await self.message

    ws = Socket()
    conn = AsyncWebSocketConnection(ws, read_timeout=60)  # type: ignore[arg-type]
    task = asyncio.create_task(conn._recv())
    await ws.reading
    ws.message.set_result('{"type": "completion.delta"}')
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(APITimeoutError):
        await AsyncWebSocketConnection(Socket(), read_timeout=0.05)._recv()  # type: ignore[arg-type]


async def test_errors(aclient: AsyncClient) -> None:
    with pytest.raises(NotFoundError):
        await aclient.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(BadRequestError) as info:
        await aclient.completions.create(model=MODEL, prompt="x", temperature=-1.0, stream=True)
    assert info.value.param == "temperature"


async def test_a_websocket_that_could_not_connect_is_opened_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the sync client's: it failed at once, without saying where."""
    async with AsyncClient(base_url="http://127.0.0.1:9", max_retries=2) as client:
        waits: list[int] = []
        monkeypatch.setattr(client, "_backoff", lambda attempt: waits.append(attempt) or 0.0)
        with pytest.raises(APIConnectionError, match="at ws://127.0.0.1:9 "):
            await client.ws.connect()
        assert waits == [0, 1]


async def test_websocket(aclient: AsyncClient) -> None:
    session = await aclient.sessions.create(text="abc")
    async with aclient.ws.connect() as conn:
        chunks = [c async for c in conn.completion(model=MODEL, prompt="Hello", max_tokens=6)]
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 6
        only = conn.completion(model=MODEL, prompt="Hi", max_tokens=3, extra_body={"allowed_token_ids": [ord("s")]})
        assert "".join([c.text async for c in only]) == "sss"  # extra_body, as completions.create takes it

        chunks = []
        running = conn.completion(model=MODEL, prompt="d", max_tokens=LONG, session_id=session.id)
        async for chunk in running:
            chunks.append(chunk)
            if len(chunks) == 3:
                await conn.cancel()  # it names the completion: the server ignores a cancel that names another
        assert running.id == chunk.id and chunk.id.startswith("cmpl-")
        assert chunk.finish_reason == "cancelled" and chunk.usage.completion_tokens < LONG
        assert chunk.session == SessionRef(session.id, 4 + chunk.usage.completion_tokens)

        stream = conn.completion(model=MODEL, prompt="x", max_tokens=LONG)
        async for _ in stream:
            break  # left running: the next completion cancels it first
        again = [c async for c in conn.completion(model=MODEL, prompt="y", max_tokens=2)]
        assert stream.done and again[-1].usage.completion_tokens == 2

        with pytest.raises(NotFoundError):
            async for _ in conn.completion(model="no-such-model", prompt="x"):
                pass

    one_shot = aclient.ws.stream(model=MODEL, prompt="Hello", max_tokens=LONG)
    assert isinstance(one_shot, AsyncWebSocketStream)
    async with one_shot:
        await one_shot.__anext__()
    assert one_shot.done


@pytest.mark.parametrize("how", ["stream", "connection", "one-shot"])
async def test_a_websocket_completion_cancelled_before_its_first_read_is_never_sent(aclient: AsyncClient,
                                                                                    how: str) -> None:
    """The async stream sends its request on its first read: a cancel before it (a "stop" pressed at once) did
    nothing, and the completion ran to its max_tokens into the session (found by a helper). Now it is never sent:
    the stream raises RequestCancelledError, as the sync stream does for a cancel before any token, the session is
    as it was, and the connection runs the next one."""
    session = await aclient.sessions.create(text="abc")
    async with aclient.ws.connect() as conn:
        if how == "one-shot":
            stream = aclient.ws.stream(model=MODEL, prompt="d", max_tokens=LONG, session_id=session.id)
            await stream.cancel()
        else:
            stream = conn.completion(model=MODEL, prompt="d", max_tokens=LONG, session_id=session.id)
            await (stream.cancel() if how == "stream" else conn.cancel())
        with pytest.raises(RequestCancelledError) as refused:
            async for _ in stream:
                pass
        assert (refused.value.status, refused.value.code) == (499, "request_cancelled")
        assert stream.done and [c async for c in stream] == []  # ended: read again, nothing more
        again = [c async for c in conn.completion(model=MODEL, prompt="e", max_tokens=2, session_id=session.id)]
        assert again[-1].session == SessionRef(session.id, 3 + 1 + 2)  # "d" never reached it


async def test_a_completion_started_inside_anothers_loop_leaves_that_loop_its_last_tokens(
        aclient: AsyncClient) -> None:
    """Starting B in A's loop cancels A and reads it to its end; A's loop then ended at once, its last tokens and
    its end unread though its session kept them (found by a helper). A's loop now reads them, and ends with
    finish_reason "cancelled": the session holds what A's loop read."""
    session = await aclient.sessions.create(text="abc")
    async with aclient.ws.connect() as conn:
        first = conn.completion(model=MODEL, prompt="d", max_tokens=LONG, session_id=session.id)
        chunks = []
        async for chunk in first:
            chunks.append(chunk)
            if len(chunks) == 2:
                inner = [c async for c in conn.completion(model=MODEL, prompt="Hi", max_tokens=2)]
                assert inner[-1].finish_reason == "length"
        assert chunks[-1].finish_reason == "cancelled"
        made = chunks[-1].usage.completion_tokens
        assert sum(1 for c in chunks if c.text or c.finish_reason is None) >= 2 and made < LONG
        got = await aclient.sessions.get(session.id)
        assert got.tokens_seen == 3 + 1 + made


@pytest.mark.parametrize("between", [False, True])
async def test_a_second_task_on_a_websocket_connection_is_refused_and_the_first_runs_on(
        aclient: AsyncClient, between: bool) -> None:
    """A connection runs one completion at a time. Another task's completion, started while the first task read
    its own, cancelled the first and failed with the websockets library's own error (not an APIError); started
    while the first task awaited something else between its chunks (``between``), it cancelled the first."""
    async with aclient.ws.connect() as conn:
        reading = asyncio.Event()

        async def first() -> list:
            chunks = []
            async for chunk in conn.completion(model=MODEL, prompt="a", max_tokens=LONG):
                chunks.append(chunk)
                reading.set()
                if between:
                    await asyncio.sleep(0.01)  # writing the chunk somewhere, say
            return chunks

        task = asyncio.create_task(first())
        await asyncio.wait_for(reading.wait(), 60)  # its task now waits in the connection's read
        with pytest.raises(APIError, match="in another task"):
            async for _ in conn.completion(model=MODEL, prompt="b", max_tokens=2):
                pass
        await conn.cancel()
        chunks = await asyncio.wait_for(task, 60)
        assert chunks[-1].finish_reason == "cancelled" and chunks[-1].usage.completion_tokens >= len(chunks) - 1
        again = [c async for c in conn.completion(model=MODEL, prompt="c", max_tokens=2)]  # and it serves on
        assert again[-1].usage.completion_tokens == 2


async def test_a_completion_left_and_dropped_is_taken_over_by_another_task(aclient: AsyncClient) -> None:
    """A completion left by ``break`` (its stream dropped) is read to its end by the next completion, whichever task
    starts it: another task was refused as if the first still read it (found by a helper)."""
    async with aclient.ws.connect() as conn:
        async for _ in conn.completion(model=MODEL, prompt="a", max_tokens=LONG):
            break

        async def other() -> list:
            return [c async for c in conn.completion(model=MODEL, prompt="b", max_tokens=2)]

        again = await asyncio.wait_for(asyncio.create_task(other()), 60)
        assert again[-1].usage.completion_tokens == 2
        # two tasks at once after a dropped one: one takes over, the other is refused plainly (both read the dropped
        # completion, and one failed with the websockets library's own error, found by a review)
        async for _ in conn.completion(model=MODEL, prompt="c", max_tokens=LONG):
            break
        got = await asyncio.wait_for(asyncio.gather(other(), other(), return_exceptions=True), 60)
        assert sorted(type(g).__name__ for g in got) == ["APIError", "list"], got
        assert "in another task" in str(next(g for g in got if isinstance(g, APIError)))


async def test_many_concurrent_completions(aclient: AsyncClient) -> None:
    results = await asyncio.gather(*(aclient.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=8)
                                     for i in range(8)))
    assert all(r.usage.completion_tokens == 8 for r in results)


async def test_a_closed_async_client_says_so() -> None:
    async with AsyncClient(base_url="http://127.0.0.1:9", max_retries=0) as client:
        pass
    with pytest.raises(APIConnectionError, match="this client is closed"):
        await client.models.list()
    with pytest.raises(APIConnectionError, match="this client is closed"):
        async with client.ws.connect():
            pass

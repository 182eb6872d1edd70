"""The whole request lifecycle in-process, through ``build_app(runtime=...)``, with a fake engine whose tokens
the test releases one by one: streaming and commit, a client that leaves, a failure mid-stream, and a drain.
A real Redis keeps the sessions. Nothing here waits for time to pass: every wait is on an event."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from memory_store import MemoryStore, ModelIdentity
from server.app import build_app
from server.cpu_latency import CpuLatencyQos
from server.hot_states import HotStates
from server.metrics import Metrics
from server.runtime import Runtime, close_runtime
from server.settings import Settings
from tests.server.fake_engine import D_MODEL, N_LAYER, FakeEngine, FakeScheduler
from tests.server.test_cpu_latency import turns_until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
MODEL = "fake"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def running_app(redis_url: str, tmp_path, *, open_gate: bool = True, cpu_latency: CpuLatencyQos | None = None,
                      **settings) -> AsyncIterator:
    engine = FakeEngine()
    scheduler = FakeScheduler(engine, open_gate=open_gate)
    store = MemoryStore.from_url(redis_url, identity=ModelIdentity(engine.fingerprint, N_LAYER, D_MODEL),
                                 data_dir=str(tmp_path))
    await store.start()
    config = Settings(model_name=MODEL, redis_url=redis_url, data_dir=str(tmp_path), **settings)
    hot = HotStates(1 << 20)
    cpu_latency = cpu_latency or CpuLatencyQos(None)
    rt = Runtime(config, engine, scheduler, store, Metrics(scheduler, store, hot, cpu_latency), hot, ready=True,
                 cpu_latency=cpu_latency)
    app = build_app(config, runtime=rt)
    async with app.router.lifespan_context(app):  # closing it is the server's drain
        yield app, rt, scheduler


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost", timeout=30)


async def asgi_post(app, path: str, body: dict, *, sent: asyncio.Queue, leave: asyncio.Event | None = None) -> None:
    """POST straight to the ASGI app: every message it sends goes to ``sent``; once ``leave`` is set the
    client has gone (``http.disconnect``), as uvicorn reports a closed connection."""
    raw, delivered = json.dumps(body).encode(), False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await (leave or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict) -> None:
        await sent.put(msg)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("test", 80), "state": {}}
    await app(scope, receive, send)


def sse_payloads(messages: list[dict]) -> list:
    text = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body").decode()
    return [b[6:] if b[6:] == "[DONE]" else json.loads(b[6:]) for b in text.split("\n\n") if b]


async def next_chunk(sent: asyncio.Queue) -> list:
    """The SSE payloads of the next non-empty body message."""
    while True:
        msg = await sent.get()
        if msg["type"] == "http.response.body" and msg.get("body"):
            return sse_payloads([msg])


async def settle(rt: Runtime) -> None:
    """Every run (they outlive their HTTP requests) has committed and ended."""
    await asyncio.gather(*(r.task for r in list(rt.runs)))


async def test_stream_commits_the_generated_tokens(redis_url, tmp_path):
    async with running_app(redis_url, tmp_path) as (app, rt, _), _client(app) as c:
        sid = (await c.post("/v1/sessions", json={"text": "Hi"})).json()["id"]
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "yo", "max_tokens": 3, "stream": True,
                                                  "session_id": sid})
        events = [json.loads(b[6:]) if b[6:] != "[DONE]" else "[DONE]" for b in r.text.split("\n\n") if b]
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "abc" and events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-2]["session"] == {"id": sid, "tokens_seen": 2 + 2 + 3}
        await settle(rt)
        assert (await rt.store.info(sid)).tokens_seen == 7


async def test_max_tokens_zero_reads_the_prompt_without_scoring_it(redis_url, tmp_path):
    """max_tokens 0 with echo reads the prompt into the session and generates nothing; its log-likelihood (an
    output projection a token: on a word model's vocabulary, most of the work) is an append's, not wanted here."""
    async with running_app(redis_url, tmp_path) as (app, rt, scheduler), _client(app) as c:
        sid = (await c.post("/v1/sessions", json={"text": "Hi"})).json()["id"]
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "yo", "max_tokens": 0, "echo": True,
                                                  "session_id": sid})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "yo", r.text
        assert r.json()["session"] == {"id": sid, "tokens_seen": 4}
        await c.post(f"/v1/sessions/{sid}/append", json={"text": "more"})
        assert [q.scored for q in scheduler.requests if q.params is None] == [True, False, True]  # create, 0, append
        await settle(rt)


async def test_a_client_that_leaves_during_a_rebuild_stops_it(redis_url, tmp_path):
    """With the engine in the server's process, a session's rebuild from its window (an import, a cold session,
    another model's) did not hear its run's cancel: a client that left waited for the whole window to be read.
    Now the rebuild stops and nothing is stored."""
    async with running_app(redis_url, tmp_path) as (app, rt, scheduler):
        async with _client(app) as c:
            sid = (await c.post("/v1/sessions", json={"text": "Hello there"})).json()["id"]
            doc = (await c.get(f"/v1/sessions/{sid}/export")).json()
            before = (await c.get("/v1/sessions")).json()["data"]
        scheduler.reads_open = False
        sent, leave = asyncio.Queue(), asyncio.Event()
        post = asyncio.create_task(asgi_post(app, "/v1/sessions/import", doc, sent=sent, leave=leave))
        await asyncio.wait_for(scheduler.reading.wait(), 30)  # the rebuild reads the window
        leave.set()  # the client goes
        await asyncio.wait_for(post, 30)  # it waited on the rebuild for good
        await asyncio.wait_for(settle(rt), 30)
        assert [r.cancelled for r in scheduler.requests if r.params is None][-1]
        async with _client(app) as c:
            assert (await c.get("/v1/sessions")).json()["data"] == before  # no session made


async def test_a_client_that_leaves_cancels_its_run_which_commits_what_was_generated(redis_url, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="txlserve.requests")
    async with running_app(redis_url, tmp_path, open_gate=False) as (app, rt, engine):
        async with _client(app) as c:
            sid = (await c.post("/v1/sessions", json={"text": "Hi"})).json()["id"]  # an append needs no tokens
        sent, leave = asyncio.Queue(), asyncio.Event()
        task = asyncio.create_task(asgi_post(app, "/v1/completions", {
            "model": MODEL, "prompt": "yo", "max_tokens": 50, "stream": True, "session_id": sid}, sent=sent,
            leave=leave))
        engine.release()
        assert (await next_chunk(sent))[0]["choices"][0]["text"] == "a"
        engine.release()
        assert (await next_chunk(sent))[0]["choices"][0]["text"] == "b"
        leave.set()  # the client is gone
        await task
        await settle(rt)
        (request,) = [r for r in engine.requests if r.params is not None]
        assert request.cancelled and len(request.events) == 2  # no token after the client left
        assert (await rt.store.info(sid)).tokens_seen == 2 + 2 + len(request.events)
        assert rt.metrics.disconnects._value.get() == 1
        (line,) = [json.loads(r.getMessage()) for r in caplog.records
                   if r.name == "txlserve.requests" and '"/v1/completions"' in r.getMessage()]
        assert (line["prompt_tokens"], line["completion_tokens"], line["finish_reason"], line["session_id"]) == (
            2, 2, "cancelled", sid)  # what the client got: the log line is written when it leaves


async def test_a_client_gone_before_its_body_was_read_is_a_499_and_nothing_runs(redis_url, tmp_path):
    """uvicorn answers ``receive()`` with ``http.disconnect`` once the connection has closed, even when the body
    had arrived: a client that sends everything and leaves at once, on a busy host, is gone before the body is
    read. FastAPI makes that a 400 ("error parsing the body"); it is a client that left, as nginx counts it."""
    async with running_app(redis_url, tmp_path) as (app, rt, engine):
        async with _client(app) as c:
            sid = (await c.post("/v1/sessions", json={"text": "Hi"})).json()["id"]
        before = len(engine.requests)
        for path in ("/v1/completions", f"/v1/sessions/{sid}/append"):
            sent: list[dict] = []

            async def receive() -> dict:
                return {"type": "http.disconnect"}

            async def send(msg: dict, sent=sent) -> None:
                sent.append(msg)

            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                     "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                     "headers": [(b"content-type", b"application/json"), (b"content-length", b"40")],
                     "client": ("127.0.0.1", 1), "server": ("test", 80), "state": {}}
            await app(scope, receive, send)
            assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499, (path, sent)
            body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
            assert body["error"]["code"] == "request_cancelled", body
            route = path if path == "/v1/completions" else "/v1/sessions/{session_id}/append"
            assert rt.metrics.requests.labels(route, "499")._value.get() == 1
        assert len(engine.requests) == before and (await rt.store.info(sid)).tokens_seen == 2


async def test_a_failure_mid_stream_is_an_error_event_with_its_status_and_nothing_is_committed(redis_url, tmp_path):
    async with running_app(redis_url, tmp_path) as (app, rt, _), _client(app) as c:
        sid = (await c.post("/v1/sessions", json={"text": "Hi"})).json()["id"]
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "FAIL", "max_tokens": 5, "stream": True,
                                                  "session_id": sid})
        payloads = [b[6:] for b in r.text.split("\n\n") if b]
        assert json.loads(payloads[0])["choices"][0]["text"] == "a"
        error = json.loads(payloads[1])
        assert error["status"] == 400 and error["error"]["code"] == "invalid_request"
        assert payloads[-1] == "[DONE]"
        await settle(rt)
        assert (await rt.store.info(sid)).tokens_seen == 2  # the session is as it was
        plain = await c.post("/v1/completions", json={"model": MODEL, "prompt": "FAIL", "max_tokens": 5})
        assert plain.status_code == 400 and plain.json()["error"]["code"] == "invalid_request"  # same error, no stream


async def test_a_commit_of_unknown_outcome_is_a_503_not_to_be_retried(redis_url, tmp_path, monkeypatch):
    """OpenAI's SDKs retry a 503, and a commit that had landed was then applied twice: this one says not to."""
    from txlserve.errors import CommitUnknown

    async with running_app(redis_url, tmp_path) as (app, rt, _), _client(app) as c:
        sid = (await c.post("/v1/sessions", json={"text": "Hi"})).json()["id"]

        async def unknown(*args: object, **kw: object) -> object:
            raise CommitUnknown("Redis at test stopped answering as the session was committed")

        monkeypatch.setattr(rt.store, "commit", unknown)
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "yo", "max_tokens": 2, "session_id": sid})
        assert r.status_code == 503 and r.json()["error"]["code"] == "commit_outcome_unknown", r.text
        assert r.headers["x-should-retry"] == "false" and "retry-after" not in r.headers


async def test_drain_ends_streams_as_cancelled_commits_them_and_refuses_new_work(redis_url, tmp_path):
    async with running_app(redis_url, tmp_path, open_gate=False, shutdown_timeout_s=0.0) as (app, rt, engine):
        async with _client(app) as c:
            sid = (await c.post("/v1/sessions", json={"text": "Hi"})).json()["id"]
        sent = asyncio.Queue()
        task = asyncio.create_task(asgi_post(app, "/v1/completions", {
            "model": MODEL, "prompt": "yo", "max_tokens": 50, "stream": True, "session_id": sid}, sent=sent))
        engine.release()
        assert (await next_chunk(sent))[0]["choices"][0]["text"] == "a"
        drain = asyncio.create_task(close_runtime(rt))  # what SIGTERM does
        async with _client(app) as c:
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
        await drain
        await task
        messages = []
        while not sent.empty():
            messages.append(sent.get_nowait())
        payloads = sse_payloads(messages)
        assert payloads[-1] == "[DONE]"
        last = payloads[-2]
        assert last["choices"][0]["finish_reason"] == "cancelled"  # the same word as over WebSocket
        assert last["session"]["tokens_seen"] == 2 + 2 + 1


@pytest.mark.parametrize("extra", [{}, {"logprobs": 0, "return_token_ids": True}], ids=["text", "logprobs-ids"])
async def test_tokens_waiting_together_leave_in_one_chunk(redis_url, tmp_path, extra):
    """Tokens already waiting when the stream reads one (a --stream-interval group, or a client or event loop
    that fell behind) leave in one SSE chunk, their text, logprobs and ids in order, as vLLM merges a slow
    consumer's outputs; the last token goes in the write of the end."""
    async with running_app(redis_url, tmp_path, open_gate=False) as (app, rt, engine):
        sent = asyncio.Queue()
        task = asyncio.create_task(asgi_post(app, "/v1/completions", {
            "model": MODEL, "prompt": "yo", "max_tokens": 5, "stream": True, **extra}, sent=sent))
        engine.release()
        (first,) = await next_chunk(sent)  # alone: nothing else waited
        assert first["choices"][0]["text"] == "a"
        engine.release(3)  # three tokens at once
        (merged,) = await next_chunk(sent)
        choice = merged["choices"][0]
        assert choice["text"] == "bcd"
        if extra:
            assert first["choices"][0]["token_ids"] == [97] and first["choices"][0]["prompt_token_ids"] == [121, 111]
            assert choice["token_ids"] == [98, 99, 100] and choice.get("prompt_token_ids") is None
            assert choice["logprobs"]["tokens"] == ["b", "c", "d"] and choice["logprobs"]["text_offset"] == [1, 2, 3]
        engine.release()
        await task
        end = await next_chunk(sent)
        assert [p if p == "[DONE]" else p["choices"][0]["text"] for p in end] == ["e", "", "[DONE]"]
        assert end[1]["choices"][0]["finish_reason"] == "length"


async def test_a_choice_with_no_token_yet_sends_no_chunk(redis_url, tmp_path):
    """With ``return_token_ids`` a choice's first chunk carries its prompt's ids: a write of another choice's
    token must not send an empty chunk for a choice that has none yet (its prompt ids alone)."""
    async with running_app(redis_url, tmp_path, open_gate=False) as (app, _rt, engine):
        sent = asyncio.Queue()
        task = asyncio.create_task(asgi_post(app, "/v1/completions", {
            "model": MODEL, "prompt": "yo", "max_tokens": 2, "n": 2, "stream": True, "return_token_ids": True},
            sent=sent))
        engine.release()  # one token, of one choice
        first, *others = await next_chunk(sent)
        assert others == [], others
        assert first["choices"][0]["token_ids"] == [97] and first["choices"][0]["prompt_token_ids"] == [121, 111]
        engine.release(3)
        await task
        rest = [p for p in sse_payloads([sent.get_nowait() for _ in range(sent.qsize())]) if p != "[DONE]"]
        other = 1 - first["choices"][0]["index"]
        mine = [p["choices"][0] for p in rest if p["choices"] and p["choices"][0]["index"] == other]
        assert mine[0]["token_ids"][0] == 97 and mine[0]["prompt_token_ids"] == [121, 111]  # its first: a token


async def test_websocket_tokens_waiting_together_leave_in_one_delta(redis_url, tmp_path):
    """Over a WebSocket the tokens already waiting when one is read leave in one ``completion.delta``: their text,
    ids and logprobs in order, as vLLM merges a slow consumer's outputs. A token alone is a delta alone, and the
    last goes out before the end."""
    async with running_app(redis_url, tmp_path, open_gate=False) as (app, _rt, engine):
        frames: asyncio.Queue = asyncio.Queue()
        out: asyncio.Queue = asyncio.Queue()
        for frame in ({"type": "websocket.connect"}, {"type": "websocket.receive", "text": json.dumps(
                {"type": "completion.create", "model": MODEL, "prompt": "yo", "max_tokens": 5, "logprobs": 0,
                 "return_token_ids": True})}):
            frames.put_nowait(frame)

        async def send(msg: dict) -> None:
            if msg["type"] == "websocket.send":
                out.put_nowait(json.loads(msg["text"]))

        scope = {"type": "websocket", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "ws",
                 "path": "/v1/ws", "raw_path": b"/v1/ws", "query_string": b"", "root_path": "", "headers": [],
                 "client": ("127.0.0.1", 1), "server": ("test", 80), "subprotocols": [], "state": {}}
        task = asyncio.create_task(app(scope, frames.get, send))
        try:
            engine.release()
            first = await asyncio.wait_for(out.get(), 30)
            assert (first["text"], first["token_ids"], first["prompt_token_ids"]) == ("a", [97], [121, 111])
            engine.release(3)  # three tokens at once
            merged = await asyncio.wait_for(out.get(), 30)
            assert (merged["text"], merged["token_ids"]) == ("bcd", [98, 99, 100])
            assert "prompt_token_ids" not in merged  # the first delta's alone
            logprobs = merged["logprobs"]
            assert logprobs["tokens"] == ["b", "c", "d"] and logprobs["text_offset"] == [1, 2, 3]
            assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 3
            engine.release()
            last, done = await asyncio.wait_for(out.get(), 30), await asyncio.wait_for(out.get(), 30)
            assert (last["type"], last["text"], last["token_ids"]) == ("completion.delta", "e", [101])
            assert (done["type"], done["text"], done["finish_reason"]) == ("completion.done", "abcde", "length")
            # a failure read after tokens waiting with it: they leave first, then the error
            frames.put_nowait({"type": "websocket.receive", "text": json.dumps(
                {"type": "completion.create", "model": MODEL, "prompt": "FAIL", "max_tokens": 5})})
            engine.release(2)  # its first token, and the failure at its second
            sent, error = await asyncio.wait_for(out.get(), 30), await asyncio.wait_for(out.get(), 30)
            assert (sent["type"], sent["text"]) == ("completion.delta", "a")
            assert error["type"] == "error" and error["id"] == sent["id"] and error["status"] == 400, error
        finally:
            frames.put_nowait({"type": "websocket.disconnect", "code": 1000})
            await asyncio.wait_for(task, 30)


async def test_the_cpu_latency_request_is_held_while_requests_run(redis_url, tmp_path):
    """``--cpu-latency-qos-us``: held from a request's start until its run has committed and ended (here with no
    linger), shown in /metrics, taken again by the next request, let go by the drain."""
    target = tmp_path / "qos"
    target.write_bytes(b"")
    qos = CpuLatencyQos(0, opener=lambda _device, flags: os.open(target, flags), linger_s=0)

    async with running_app(redis_url, tmp_path, open_gate=False, cpu_latency=qos) as (app, rt, engine):
        async with _client(app) as c:
            assert not qos.held and "txlserve_cpu_latency_qos_held 0.0" in (await c.get("/metrics")).text
            sid = (await c.post("/v1/sessions", json={"text": "Hi"})).json()["id"]  # a request too
            await settle(rt)
            await turns_until(qos, held=False)
            assert not qos.held and qos.holds == 1
            sent = asyncio.Queue()
            task = asyncio.create_task(asgi_post(app, "/v1/completions", {
                "model": MODEL, "prompt": "yo", "max_tokens": 3, "stream": True, "session_id": sid}, sent=sent))
            engine.release()
            assert (await next_chunk(sent))[0]["choices"][0]["text"] == "a"
            assert qos.held and qos.holds == 2 and "txlserve_cpu_latency_qos_held 1.0" in (
                await c.get("/metrics")).text
            engine.release(2)
            await task
            await settle(rt)
            await turns_until(qos, held=False)
            assert not qos.held and qos.holds == 2
            assert (await rt.store.info(sid)).tokens_seen == 2 + 2 + 3
        qos.linger_s = 60  # the next request's hold would outlive it: the drain lets it go
        async with _client(app) as c:
            assert (await c.post(f"/v1/sessions/{sid}/append", json={"text": "more"})).status_code == 200
        await settle(rt)
        assert qos.held and qos.holds == 3
        await close_runtime(rt)
        assert not qos.held


async def test_a_hot_session_continues_from_the_engines_own_state(redis_url, tmp_path):
    """The state a request leaves is the state the next request on that session is given (no copy, no
    restore); once it is gone from the hot set, the session is restored from Redis."""
    async with running_app(redis_url, tmp_path) as (app, rt, engine), _client(app) as c:
        sid = (await c.post("/v1/sessions", json={"text": "Hi"})).json()["id"]
        assert (await c.get(f"/v1/sessions/{sid}")).json()["tier"] == "hot"
        body = {"model": MODEL, "prompt": "yo", "max_tokens": 2, "session_id": sid}
        await c.post("/v1/completions", json=body)
        await settle(rt)
        first, second = engine.requests[-2:]
        assert rt.hot.hits == 1 and rt.hot.misses == 0
        await c.post("/v1/completions", json=body)
        await settle(rt)
        third = engine.requests[-1]
        assert rt.hot.hits == 2 and second.state is first.result and third.state is second.result
        rt.hot.discard(sid)  # evicted, or another replica wrote it: Redis has it
        assert (await c.get(f"/v1/sessions/{sid}")).json()["tier"] == "redis"
        await c.post("/v1/completions", json=body)
        await settle(rt)
        fourth = engine.requests[-1]
        assert rt.hot.misses == 1 and fourth.state is not third.result and int(fourth.state.seen[0]) == 2 + 2 * 4
        assert (await rt.store.info(sid)).tokens_seen == 2 + 3 * 4


async def test_the_lease_is_released_before_the_answer_ends(redis_url, tmp_path):
    """A client that continues its session as soon as the previous answer ended must never be told it is busy:
    the run hands over its Final (the end of every response) only once the session's lease is released, whether
    the commit gave it back (something new was read) or the lease's exit did (nothing new)."""
    import redis.asyncio

    from memory_store.redis_tier import lease_key
    from server.service import Final, Run

    raw = redis.asyncio.Redis.from_url(redis_url)
    try:
        async with running_app(redis_url, tmp_path) as (app, rt, _), _client(app) as c:
            sid = (await c.post("/v1/sessions", json={"text": "Hi"})).json()["id"]
            for ids in ([1, 2], []):
                run = Run(rt, ids=ids, params=None, owner=None, session_id=sid)
                item = await run.events.get()
                assert isinstance(item, Final) and not await raw.exists(lease_key(sid))
            assert (await c.get(f"/v1/sessions/{sid}")).json()["tokens_seen"] == 4
            for _ in range(2):
                r = await c.post("/v1/completions",
                                 json={"model": MODEL, "prompt": "yo", "max_tokens": 2, "session_id": sid})
                assert r.status_code == 200 and not await raw.exists(lease_key(sid))
    finally:
        await raw.aclose()


async def test_a_session_another_replica_holds_is_waited_for_only_while_that_holder_is_ending(redis_url, tmp_path,
                                                                                           monkeypatch):
    """Another replica's lease (a second store on the same Redis): not known to be ending, a 409; marked ending
    (its client left, it commits), waited for until it lets go, then served; and a request whose client leaves
    while it waits ends there (a 499 in the log), taking nothing. Every wait is on an event: the store's refusal
    of the lease is observed, not timed."""
    from txlserve.errors import SessionBusy

    async with running_app(redis_url, tmp_path) as (app, rt, _), _client(app) as c:
        refused = asyncio.Queue()
        lease_of = rt.store.lease

        async def observed(*args, **kwargs):
            try:
                return await lease_of(*args, **kwargs)
            except SessionBusy as err:
                refused.put_nowait(err.ending)
                raise

        monkeypatch.setattr(rt.store, "lease", observed)
        sid = (await c.post("/v1/sessions", json={"text": "Hi"})).json()["id"]
        body = {"model": MODEL, "prompt": "yo", "max_tokens": 2, "session_id": sid}
        async with MemoryStore.from_url(redis_url, identity=rt.store.identity, data_dir=str(tmp_path)) as other:
            held = await other.lease(sid)
            r = await c.post("/v1/completions", json=body)  # running elsewhere: asked again, then refused
            assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy", r.text
            while not refused.empty():
                assert refused.get_nowait() is False
            await held.ending()
            waiting = asyncio.create_task(c.post("/v1/completions", json=body))
            assert await asyncio.wait_for(refused.get(), 30) is True  # it met the ending holder
            assert not waiting.done()
            await held.release()  # the holder let go: the waiting request is served
            r = await asyncio.wait_for(waiting, 30)
            assert r.status_code == 200 and r.json()["session"]["tokens_seen"] == 2 + 2 + 2, r.text
            # a client that leaves while its request waits: it ends, and never takes the lease
            held = await other.lease(sid)
            await held.ending()
            sent, leave = asyncio.Queue(), asyncio.Event()
            post = asyncio.create_task(asgi_post(app, "/v1/completions", body, sent=sent, leave=leave))
            assert await asyncio.wait_for(refused.get(), 30) is True
            leave.set()
            await asyncio.wait_for(post, 30)
            await asyncio.wait_for(settle(rt), 30)  # its run ended while the other replica still holds the lease
            assert not held.released and not held.lost
            await held.release()
        assert (await rt.store.info(sid)).tokens_seen == 6  # nothing more was stored


async def test_a_session_deleted_while_a_request_runs_on_it_does_not_come_back_hot(redis_url, tmp_path):
    from model.sampling import SamplingParams
    from server.service import Run

    async with running_app(redis_url, tmp_path, open_gate=False) as (app, rt, engine), _client(app) as c:
        sid = (await c.post("/v1/sessions", json={"text": "Hi"})).json()["id"]
        submitted, submit = asyncio.Event(), engine.submit

        def watched_submit(*args, **kwargs):
            submitted.set()
            return submit(*args, **kwargs)

        engine.submit = watched_submit
        run = Run(rt, ids=[], params=SamplingParams(max_tokens=5), owner=None, session_id=sid)
        await submitted.wait()  # the run holds the session's state, taken out of the hot set
        assert (await c.delete(f"/v1/sessions/{sid}")).status_code == 200
        run.cancel()  # ends with nothing new: no commit, and its state must not be kept for a deleted session
        await run.task
        assert rt.hot.revision(sid) is None and len(rt.hot) == 0
        assert (await c.get(f"/v1/sessions/{sid}")).status_code == 404


async def test_a_frame_taken_as_a_websocket_stream_ends_keeps_its_place(redis_url, tmp_path):
    """A frame that the running request took from the connection's inbox while it sent its stream's end is the
    connection's next: it was put back behind the frames sent after it, and they were answered out of order."""
    async with running_app(redis_url, tmp_path) as (app, _rt, _scheduler):
        frames: asyncio.Queue = asyncio.Queue()
        out: list[dict] = []
        for frame in ({"type": "websocket.connect"}, {"type": "websocket.receive", "text": json.dumps(
                {"type": "completion.create", "model": MODEL, "prompt": "x", "max_tokens": 1})}):
            frames.put_nowait(frame)

        async def send(msg: dict) -> None:
            if msg["type"] != "websocket.send":
                return
            out.append(json.loads(msg["text"]))
            if out[-1]["type"] == "completion.done":  # two frames arrive as the end is being sent
                for name in ("first", "second"):
                    frames.put_nowait({"type": "websocket.receive", "text": json.dumps({"type": name})})
                while not frames.empty():  # the connection's reader takes both
                    await asyncio.sleep(0)
                for _ in range(5):  # and the request's read of the inbox, woken by the first, completes
                    await asyncio.sleep(0)
            if sum(e["type"] == "error" for e in out) == 2:
                frames.put_nowait({"type": "websocket.disconnect", "code": 1000})

        scope = {"type": "websocket", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "ws",
                 "path": "/v1/ws", "raw_path": b"/v1/ws", "query_string": b"", "root_path": "", "headers": [],
                 "client": ("127.0.0.1", 1), "server": ("test", 80), "subprotocols": [], "state": {}}
        await asyncio.wait_for(app(scope, frames.get, send), 30)
    assert [e["type"] for e in out] == ["completion.delta", "completion.done", "error", "error"], out
    assert [e["error"]["message"].split(":")[0] for e in out[2:]] == ['unknown message type "first"',
                                                                      'unknown message type "second"']


async def test_a_failing_cold_sweep_is_logged_once_until_it_works_again(caplog) -> None:
    """With Redis gone for good (a dead embedded one), the cold-tier sweep logged a warning on every tick (every
    second with --cold-sweep-s 1, found by a helper). Its own seam: a store whose sweeps fail, then work."""
    results = [RuntimeError("Redis is gone")] * 4 + [0, RuntimeError("gone again"), 0]
    swept = asyncio.Event()

    class Store:
        async def sweep(self, **_) -> int:
            result = results.pop(0)
            if not results:
                swept.set()
            if isinstance(result, Exception):
                raise result
            return result

        async def check_eviction_policy(self) -> None:
            pass

    class Holder:  # what _sweep_forever reads of a Runtime
        settings = Settings(cold_after_s=1, cold_sweep_s=1e-4)
        store = Store()

    caplog.set_level(logging.INFO, logger="txlserve")
    task = asyncio.create_task(Runtime._sweep_forever(Holder()))  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(swept.wait(), 30)
    finally:
        task.cancel()
    said = [r.getMessage() for r in caplog.records if "cold-tier sweep" in r.getMessage()]
    assert [m.split(" (")[0].split(":")[0] for m in said] == [
        "cold-tier sweep failed", "cold-tier sweep works again", "cold-tier sweep failed",
        "cold-tier sweep works again"], said


async def test_the_eviction_policy_is_checked_without_a_cold_tier(caplog) -> None:
    """The check ran inside the cold-tier sweep, which ran only with --cold-after-s or --warm-budget-mb: an evicting
    maxmemory-policy set while a server without them ran went unsaid (found by a review). It runs every
    cold_sweep_s regardless; a sweep only where the cold tier is on."""
    checks, swept = [], []
    checked = asyncio.Event()

    class Store:
        async def sweep(self, **_) -> int:
            swept.append(True)
            return 0

        async def check_eviction_policy(self) -> None:
            checks.append(True)
            if len(checks) == 3:  # a few ticks, each of which would have swept after its check
                checked.set()

    class Holder:  # what start_sweeper and _sweep_forever read of a Runtime
        settings = Settings(cold_after_s=0, warm_budget_mb=0, cold_sweep_s=1e-4)
        store = Store()
        sweeper = None
        _sweep_forever = Runtime._sweep_forever

    holder = Holder()
    Runtime.start_sweeper(holder)  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(checked.wait(), 30)
    finally:
        holder.sweeper.cancel()
    assert len(checks) >= 3 and not swept


async def _waiting(scheduler: FakeScheduler, requests: int) -> None:
    """Until ``requests`` requests wait for a token: the runs start as the event loop turns, no time passes."""
    for _ in range(10_000):
        if len(scheduler.running) >= requests:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{len(scheduler.running)} requests wait for a token, not {requests}")


async def _chunks_until(sent: asyncio.Queue, scheduler: FakeScheduler, choices: int, enough, *, then: int = 1) -> list:
    """Once every choice's request waits for a token (the gate serves its waiters in turn), release one each,
    then ``then`` at a time, reading what each sends, until ``enough(payloads)``. Each read follows a release, so a
    token is always on its way."""
    await _waiting(scheduler, choices)
    scheduler.release(choices)
    payloads = await next_chunk(sent)
    for _ in range(20):
        if enough(payloads):
            return payloads
        scheduler.release(then)
        payloads += await next_chunk(sent)
    raise AssertionError(f"not enough after 20 reads: {payloads}")


async def test_a_choice_that_fails_mid_stream_ends_the_request_and_its_other_choices(redis_url, tmp_path):
    async with running_app(redis_url, tmp_path, open_gate=False) as (app, rt, scheduler):
        sent = asyncio.Queue()
        task = asyncio.create_task(asgi_post(app, "/v1/completions", {
            "model": MODEL, "prompt": ["yo", "FAIL"], "max_tokens": 50, "stream": True}, sent=sent))
        payloads = await _chunks_until(sent, scheduler, 2, lambda p: any("error" in x for x in p if x != "[DONE]"))
        while payloads[-1] != "[DONE]":
            payloads += await next_chunk(sent)
        await task
        await settle(rt)
        error = next(x for x in payloads if x != "[DONE]" and "error" in x)
        assert error["status"] == 400 and error["error"]["code"] == "invalid_request", payloads
        before = [x["choices"][0] for x in payloads[:payloads.index(error)]]
        assert {c["index"] for c in before} == {0, 1} and all(c["finish_reason"] is None for c in before)
        (other,) = [r for r in scheduler.requests if bytes(r.ids) == b"yo"]
        made = len(other.events)
        scheduler.release(100)
        await settle(rt)
        assert other.cancelled and len(other.events) == made  # stopped with the request: nothing after it
        async with _client(app) as c:  # the same failure without a stream is the request's status
            plain = await c.post("/v1/completions", json={"model": MODEL, "prompt": ["yo", "FAIL"], "max_tokens": 5})
        assert plain.status_code == 400 and plain.json()["error"]["code"] == "invalid_request", plain.text
        await settle(rt)


async def test_a_client_that_leaves_cancels_every_choice_of_its_request(redis_url, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="txlserve.requests")
    async with running_app(redis_url, tmp_path, open_gate=False) as (app, rt, scheduler):
        sent, leave = asyncio.Queue(), asyncio.Event()
        task = asyncio.create_task(asgi_post(app, "/v1/completions", {
            "model": MODEL, "prompt": "yo", "n": 3, "max_tokens": 50, "stream": True}, sent=sent, leave=leave))
        payloads = await _chunks_until(sent, scheduler, 3, lambda p: len(p) >= 3, then=0)
        assert sorted(x["choices"][0]["index"] for x in payloads) == [0, 1, 2]  # one token each
        leave.set()
        await task
        await settle(rt)
        requests = [r for r in scheduler.requests if r.params is not None]
        assert len(requests) == 3 and all(r.cancelled and len(r.events) == 1 for r in requests)
        assert rt.metrics.disconnects._value.get() == 1
        (line,) = [json.loads(r.getMessage()) for r in caplog.records
                   if r.name == "txlserve.requests" and '"/v1/completions"' in r.getMessage()]
        assert (line["prompt_tokens"], line["completion_tokens"], line["finish_reason"]) == (2, 3, "cancelled")


async def test_more_choices_than_the_server_ever_holds_is_a_400_not_a_429(redis_url, tmp_path):
    """A request's choices are requests: past what the server holds at once (the batch and --max-queue) it could
    never run, and "retry shortly" would be wrong."""
    async with running_app(redis_url, tmp_path, max_queue=1) as (app, rt, scheduler), _client(app) as c:
        ok = await c.post("/v1/completions", json={"model": MODEL, "prompt": "yo", "n": 9, "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 9  # 8 in the batch, 1 waiting
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "yo", "n": 10, "max_tokens": 2})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "n" and "at most 9 requests" in err["message"], r.text
        assert len(scheduler.requests) == 9  # nothing of it ran


async def test_choices_the_server_cannot_hold_now_are_a_429_before_any_starts(redis_url, tmp_path, monkeypatch):
    """Started one by one, the choices that fit held their places (cancelled, until they ended) and refused other
    requests meanwhile (found by a helper)."""
    from server import completion

    launched = []
    launch = completion.launch
    monkeypatch.setattr(completion, "launch", lambda *a: launched.append(a) or launch(*a))
    async with running_app(redis_url, tmp_path, open_gate=False, max_queue=1) as (app, rt, scheduler):
        sent = asyncio.Queue()
        task = asyncio.create_task(asgi_post(app, "/v1/completions", {
            "model": MODEL, "prompt": "yo", "max_tokens": 3, "stream": True}, sent=sent))
        await _waiting(scheduler, 1)
        async with _client(app) as c:
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "yo", "n": 9, "max_tokens": 2})
            assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded", r.text
            assert len(launched) == 1 and len(rt.runs) == 1  # none of its choices started
            scheduler.release(100)
            ok = await c.post("/v1/completions", json={"model": MODEL, "prompt": "yo", "n": 8, "max_tokens": 2})
            assert ok.status_code == 200 and len(ok.json()["choices"]) == 8
        await task
        await settle(rt)


async def test_a_stream_of_several_choices_begins_as_its_first_choice_does(redis_url, tmp_path):
    """Not once its last choice has begun: that one may wait for a place in the batch while the others run."""
    async with running_app(redis_url, tmp_path, open_gate=False) as (app, rt, scheduler):
        sent = asyncio.Queue()
        task = asyncio.create_task(asgi_post(app, "/v1/completions", {
            "model": MODEL, "prompt": ["yo", "hi"], "max_tokens": 3, "stream": True}, sent=sent))
        await _waiting(scheduler, 2)
        assert [bytes(r.ids) for r in scheduler.running] == [b"yo", b"hi"]  # the gate serves choice 0 first
        scheduler.release(1)
        assert [(p["choices"][0]["index"], p["choices"][0]["text"]) for p in await next_chunk(sent)] == [(0, "a")]
        scheduler.release(100)
        await task
        await settle(rt)


async def test_a_batch_of_prompts_long_together_is_tokenized_off_the_event_loop(redis_url, tmp_path, monkeypatch):
    """Each prompt under the inline limit, together over it: 128 of them held the event loop as one long one."""
    import threading

    async with running_app(redis_url, tmp_path) as (app, rt, _), _client(app) as c:
        threads: list[int] = []
        encode = rt.engine.encode
        monkeypatch.setattr(rt.engine, "encode", lambda text: threads.append(threading.get_ident()) or encode(text))
        for prompts, inline in ((["a" * 100, "b" * 100], True), (["a" * 9000, "b" * 9000], False)):
            threads.clear()
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": 1})
            assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
            assert len(threads) == 2 and all((t == threading.get_ident()) is inline for t in threads), prompts

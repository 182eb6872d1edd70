"""The engine's own process (the default; ``--no-engine-process`` runs it on a thread, test_in_process.py): its
wire, a session read back from Redis through it, what it refuses, a DELETE while it runs a request, and its life
beside the server's (it dies: 503s; the server stops or is killed: it stops)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from server.engine_core import error_from, error_head, pack, unpack
from server.runtime import DRAIN_PING_S
from tests.live import MODEL, LiveServer, stop_then_continue, stream_deleted_midway, wait_for
from tests.procs import pid_alive, wait_exit


def _engine_pid(srv: LiveServer) -> int:
    """The engine process: the server's child running server.engine_core (from /proc: no psutil)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == srv.proc.pid and "server.engine_core" in cmdline:
                return int(entry.name)
    raise AssertionError("the server has no engine process")


def _complete(srv: LiveServer, **body) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=60)


def test_a_session_continued_hot_read_back_from_redis_and_forked_equals_one_request(server):
    """Create (the engine's new state, exported), append (hot: the engine's own state), fork (a copy only Redis
    holds: the engine asks for it), continue: the text one request over the whole document gives."""
    a, b, c = "It was the best of times, ", "it was the worst of times, ", "it was the age of wisdom"
    truth = _complete(server, prompt=a + b + c, max_tokens=24, logprobs=1).json()["choices"][0]
    sid = httpx.post(server.url + "/v1/sessions", json={"text": a}, timeout=60).json()["id"]
    appended = httpx.post(f"{server.url}/v1/sessions/{sid}/append", json={"text": b}, timeout=60).json()
    assert appended["tier"] == "hot" and appended["tokens_seen"] == len(a + b)
    fork = httpx.post(f"{server.url}/v1/sessions/{sid}/fork", timeout=60).json()["id"]
    assert httpx.get(f"{server.url}/v1/sessions/{fork}", timeout=10).json()["tier"] == "redis"
    for session in (sid, fork):
        out = _complete(server, prompt=c, max_tokens=24, logprobs=1, session_id=session).json()
        choice = out["choices"][0]
        assert choice["text"] == truth["text"]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(truth["logprobs"]["token_logprobs"], abs=1e-4)
        assert out["session"]["tokens_seen"] == len(a + b + c) + 24
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'txlserve_session_restores_total{source="hot"}' in metrics
    assert 'txlserve_session_restores_total{source="redis"}' in metrics


def test_a_large_session_is_exported_and_imported_off_the_engines_threads(checkpoint, redis_url, tmp_path):
    """A session over 1 MiB (INLINE_BYTES): its export, its upload and its import run on threads of their own
    (server/engine_core.py); the continuation is the one the whole document gives. A stream of it stopped by its
    client, and the next request sent at once, is served. Its server then stops (SIGTERM), and its engine process
    with it (the kill -9 case is below)."""
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path, args=("--mem-len", "4200")).start()
    try:
        pid = _engine_pid(srv)
        a, b = "It was the best of times, it was the worst of times, " * 85, "it was the age of wisdom"  # 4,505 tokens
        truth = _complete(srv, prompt=a + b, max_tokens=16).json()["choices"][0]["text"]
        sid = httpx.post(srv.url + "/v1/sessions", json={"text": a}, timeout=60).json()
        assert sid["bytes"] > 2 * 4200 * 32 * 4 > 1 << 20  # a full memory: 2 layers, d_model 32, fp32
        fork = httpx.post(f"{srv.url}/v1/sessions/{sid['id']}/fork", timeout=60).json()["id"]  # Redis's alone
        for session in (sid["id"], fork):  # hot, then read from Redis
            assert _complete(srv, prompt=b, max_tokens=16, session_id=session).json()["choices"][0]["text"] == truth
        # "stop generating", then continue at once: the stopped run still committed its megabytes for a few ms,
        # and the next request was a 409 nearly every time (found by a helper). It waits for that commit.
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            stop_then_continue(client, client, fork, 4000)
        assert srv.terminate(timeout=30) in (0, -signal.SIGTERM)
        assert wait_exit([pid], timeout=30) and not pid_alive(pid), "the engine process outlived its server"
    finally:
        srv.stop()


def test_an_append_scores_its_text_and_its_tokens_as_one_request_does(server):
    text = "To be, or not to be, that is the question"
    sid = httpx.post(server.url + "/v1/sessions", json={"text": ""}, timeout=60).json()["id"]
    out = httpx.post(f"{server.url}/v1/sessions/{sid}/append", json={"text": text, "logprobs": 2}, timeout=60).json()
    echo = _complete(server, prompt=text, max_tokens=1, echo=True, logprobs=2).json()["choices"][0]["logprobs"]
    assert out["logprobs"]["token_logprobs"] == pytest.approx(echo["token_logprobs"][:len(text)], abs=1e-4)
    assert out["logprob"] == pytest.approx(sum(echo["token_logprobs"][1:len(text)]), abs=1e-3)


def test_what_the_engine_refuses_is_the_same_error(server):
    r = _complete(server, prompt="", max_tokens=3)  # nothing to continue from: refused in the engine process
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "nothing to continue from" in r.json()["error"]["message"]
    assert _complete(server, prompt="ok", max_tokens=2).status_code == 200  # and it goes on


def test_a_delete_stops_the_request_running_on_the_session(server):
    sid = httpx.post(server.url + "/v1/sessions", json={"text": "Story: "}, timeout=60).json()["id"]
    events = stream_deleted_midway(server.url, sid)
    assert events[-1]["error"]["code"] == "session_not_found" and len(events) < 4000, events[-1]
    assert httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=10).status_code == 404


def test_the_wire_carries_errors_as_the_one_tree():
    from txlserve.errors import SessionIncompatible
    err = error_from(error_head(SessionIncompatible("another model", param="session_id")))
    assert type(err) is SessionIncompatible and err.param == "session_id" and err.status == 422
    bug = error_from(error_head(KeyError("x")))
    assert type(bug) is RuntimeError and "KeyError" in str(bug)  # a bug stays a 500, not a user's error
    assert unpack(pack({"op": "state", "n": [1, None]}, b"\x00\xff")) == ({"op": "state", "n": [1, None]}, b"\x00\xff")


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="waits on pidfds")
def test_an_engine_process_that_dies_fails_requests_and_health_and_the_server_still_stops(checkpoint, redis_url,
                                                                                          tmp_path):
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path).start()
    try:
        pid = _engine_pid(srv)
        sid = httpx.post(srv.url + "/v1/sessions", json={"text": "Kept "}, timeout=60).json()["id"]
        other = httpx.post(srv.url + "/v1/sessions", json={"text": "Hot "}, timeout=60).json()["id"]
        assert httpx.get(f"{srv.url}/v1/sessions/{other}", timeout=10).json()["tier"] == "hot"
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "go", "max_tokens": 4000, "stream": True, "session_id": sid}) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            os.kill(pid, signal.SIGKILL)
            rest = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert rest and rest[-1]["error"]["type"] == "service_unavailable_error", rest[-1:]
        assert "engine process exited" in rest[-1]["error"]["message"] and rest[-1]["error"]["code"] == "engine_dead"
        def unhealthy() -> httpx.Response | None:
            health = httpx.get(srv.url + "/health", timeout=10)
            return None if health.status_code == 200 else health

        health = wait_for(unhealthy, 30, "/health to leave 200")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert httpx.get(srv.url + "/ready", timeout=10).json()["error"]["code"] == "engine_dead"
        r = _complete(srv, prompt="again", max_tokens=2)
        assert r.status_code == 503 and "engine process exited" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["code"] == "engine_dead" and "retry-after" not in r.headers  # until a restart:
        # a Retry-After of 1 s asked clients to retry a dead server every second (found by a helper)
        assert httpx.get(f"{srv.url}/v1/sessions/{sid}", timeout=10).json()["tokens_seen"] == len("Kept ")
        assert httpx.get(f"{srv.url}/v1/sessions/{other}", timeout=10).json()["tier"] == "redis"  # its hot copy
        # died with the engine (it still said "hot")
        assert srv.terminate(timeout=30) in (0, -signal.SIGTERM)
    finally:
        srv.stop()


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="waits on pidfds")
def test_the_engine_process_stops_with_the_server_even_when_it_is_killed(checkpoint, redis_url, tmp_path):
    """kill -9 of the API server: the engine process sees its parent go and exits (a SIGTERM's stop is checked at
    the end of the large-session test above, on a server that test starts anyway)."""
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path).start()
    try:
        pid = _engine_pid(srv)
        assert _complete(srv, prompt="hi", max_tokens=2).status_code == 200
        srv.kill()
        assert wait_exit([pid], timeout=30) and not pid_alive(pid), "the engine process outlived a kill -9"
    finally:
        srv.stop()


# -- the engine process's side of the wire, driven directly (in this process, on threads) ------------------------
@pytest.fixture
def core(checkpoint):
    """An engine process's ``_Core`` serving one end of a socketpair; the test speaks the wire on the other."""
    import socket
    import threading
    from multiprocessing.connection import Connection

    import torch

    from server.core_spawn import core_settings
    from server.engine_core import _Core
    from server.settings import Settings

    ours, theirs = socket.socketpair()
    engine = _Core([Connection(theirs.detach())], core_settings(Settings(checkpoint=str(checkpoint)), str(checkpoint),
                                                              torch.device("cpu"), torch.float32))
    thread = threading.Thread(target=engine.serve, daemon=True)
    thread.start()
    conn = Connection(ours.detach())
    assert _recv(conn)["op"] == "ready"
    yield engine, conn
    conn.send_bytes(pack({"op": "stop"}))
    thread.join(30)
    conn.close()
    assert not thread.is_alive()


def _recv(conn, timeout: float = 30) -> dict:
    assert conn.poll(timeout), "the engine sent nothing"
    head, blob = unpack(conn.recv_bytes())
    return {**head, "blob": blob}


def _until(conn, op: str, rid: int | None = None) -> dict:
    """The next message of ``op`` (for ``rid``), the items of every events message before it collected."""
    items = []
    while True:
        head = _recv(conn)
        items += [i for i in head.get("items", []) if rid is None or i[0] == rid]
        mine = rid is None or head.get("rid") == rid or any(i[0] == rid for i in head.get("items", []))
        if head["op"] == op and mine:
            return {**head, "seen": items}
        if head["op"] == "events" and any(i[1] == "x" for i in items) and op != "events":
            return {**head, "seen": items}


def _run(conn, rid: int, ids: list[int], *, key=None, max_tokens: int = 4, persist: bool = True) -> None:
    from server.engine_core import ids_blob
    conn.send_bytes(pack({"op": "run", "rid": rid, "key": key, "params": {"max_tokens": max_tokens, "temperature": 0},
                          "prompt_logprobs": None, "history": None, "persist": persist}, ids_blob(ids)))


def test_a_scored_prompt_comes_as_arrays_before_its_tokens(core):
    """Echo's prompt scores leave as arrays, read in a moment off the API server's event loop: as one JSON message,
    a long prompt's scores held its reader (and the GIL) for over a second."""
    from model.sampling import ScoredTokens
    from server.engine_core import ids_blob
    engine, conn = core
    ids = [72 + i % 20 for i in range(40)]
    conn.send_bytes(pack({"op": "run", "rid": 1, "key": None, "params": {"max_tokens": 2, "temperature": 0},
                          "prompt_logprobs": 3, "history": None, "persist": False}, ids_blob(ids)))
    scores, tokens = [], 0
    while (head := _recv(conn))["op"] != "finished":
        if head["op"] == "scores":
            assert tokens == 0 and head["rid"] == 1  # before the first token
            scores.append(ScoredTokens.from_bytes(head["blob"]))
        tokens += sum(1 for item in head.get("items", []) if item[1] == "t")
    (got,) = scores
    want = engine.engine.token_scores(engine.engine.new_state(), ids, 3)
    assert list(got.counts) == list(want.counts) and got.counts[0] == -1 and list(got.ids) == list(want.ids)
    assert list(got.values) == pytest.approx(list(want.values), abs=1e-5) and tokens == 2


def test_an_export_that_fails_answers_its_request(core, monkeypatch):
    import server.engine_core as engine_core

    def broken(*_, **__):
        raise MemoryError("no room for the export")
    monkeypatch.setattr(engine_core, "persisted", broken)
    engine, conn = core
    _run(conn, 1, [72, 105])
    end = _until(conn, "finished", 1)
    assert end["op"] == "events" and end["seen"][-1][1] == "x", end  # an error, not silence
    assert "MemoryError" in end["seen"][-1][2]["message"] and not engine.specs and not engine.kept


def test_a_cancel_after_the_end_leaves_the_state_for_its_keep(core):
    engine, conn = core
    _run(conn, 1, [72, 105])
    assert _until(conn, "finished", 1)["state"] is True and 1 in engine.kept
    conn.send_bytes(pack({"op": "cancel", "rid": 1, "abandon": False}))  # the client left as the request ended
    conn.send_bytes(pack({"op": "keep", "rid": 1, "sid": "s", "revision": [1, 1.5]}))
    assert _until(conn, "evicted")["sids"] == []  # kept hot
    _run(conn, 2, [33], key=["s", [1, 1.5]])
    end = _until(conn, "finished", 2)
    assert end["source"] == "hot" and end["tokens_seen"] == 2 + 4 + 1 + 4


def test_an_abandoned_request_leaves_nothing_behind(core):
    engine, conn = core
    _run(conn, 1, [72, 105], max_tokens=100_000)
    _until(conn, "events", 1)  # generating
    conn.send_bytes(pack({"op": "cancel", "rid": 1, "abandon": True}))  # the server will not read its end
    end = _until(conn, "finished", 1)
    assert end["state"] is False and end["finish_reason"] == "cancelled" and not end["blob"]
    assert not engine.kept and not engine.specs


def test_a_request_refused_as_it_arrives_is_answered(core):
    from server.engine_core import ids_blob
    engine, conn = core
    conn.send_bytes(pack({"op": "run", "rid": 7, "key": None, "params": {"max_tokens": 0}, "prompt_logprobs": None,
                          "history": None, "persist": False}, ids_blob([72])))
    (item,) = _until(conn, "events", 7)["seen"]
    assert item[1] == "x" and item[2]["error"] == "InvalidRequestError" and item[2]["param"] == "max_tokens"
    assert not engine.specs


def test_an_export_does_not_hold_up_the_other_requests_steps(core, monkeypatch):
    """A request that ends while others run is exported off the engine's thread: the batch steps on meanwhile."""
    import threading

    import server.engine_core as engine_core
    started, gate, real = threading.Event(), threading.Event(), engine_core.persisted

    def slow(*args, **kwargs):
        started.set()
        assert gate.wait(30), "the test never let the export go"
        return real(*args, **kwargs)
    monkeypatch.setattr(engine_core, "persisted", slow)
    engine, conn = core
    try:
        _run(conn, 2, [72], max_tokens=100_000, persist=False)  # runs on; never exported
        _until(conn, "events", 2)
        _run(conn, 1, [72, 105], max_tokens=2)
        assert started.wait(30), "request 1 was never exported"
        tokens = 0
        while tokens < 20:  # request 2's tokens while request 1's export waits
            head = _recv(conn, timeout=10)
            tokens += sum(1 for i in head.get("items", []) if i[0] == 2 and i[1] == "t")
    finally:
        gate.set()
    end = _until(conn, "finished", 1)
    assert end["state"] is True and end["blob"] and 1 in engine.kept
    conn.send_bytes(pack({"op": "cancel", "rid": 2, "abandon": True}))
    assert _until(conn, "finished", 2)["finish_reason"] == "cancelled"


def test_a_cancel_while_a_large_session_is_imported_never_starts_it(core, monkeypatch):
    """A large session is imported on the engine process's io thread while its reader takes other messages: a
    cancel that lands meanwhile is answered at once, and the import, when it ends, does not start the request."""
    import threading

    engine, conn = core
    _run(conn, 1, [72, 105])  # a session to hand back as if Redis held it
    stored = _until(conn, "finished", 1)
    conn.send_bytes(pack({"op": "drop", "rid": 1}))
    started, gate, real = threading.Event(), threading.Event(), engine.engine.import_state

    def slow(*args, **kwargs):
        started.set()
        assert gate.wait(30), "the test never let the import go"
        return real(*args, **kwargs)
    monkeypatch.setattr(engine.engine, "import_state", slow)
    monkeypatch.setattr(engine, "large", True)  # as a session over INLINE_BYTES is: imported off the reader thread
    try:
        _run(conn, 2, [33], key=["s", [1, 1.5]])  # not hot: the engine asks for it
        assert _until(conn, "need", 2)["rid"] == 2
        conn.send_bytes(pack({"op": "state", "rid": 2, "tokens_seen": stored["tokens_seen"],
                              "fingerprint": engine.engine.fingerprint}, stored["blob"]))
        assert started.wait(30), "the import never started"
        conn.send_bytes(pack({"op": "cancel", "rid": 2, "abandon": False}))
        end = _until(conn, "finished", 2)  # answered while the import still runs
        assert end["state"] is False and end["finish_reason"] == "cancelled"
        assert end["tokens_seen"] == stored["tokens_seen"]  # nothing was read
    finally:
        gate.set()
    engine.io.submit(lambda: None).result(30)  # the import has ended (the io thread runs one task at a time)
    _run(conn, 3, [72], max_tokens=2, persist=False)  # the engine still serves
    while (head := _recv(conn))["op"] != "finished" or head.get("rid") != 3:
        assert head.get("rid") != 2 and not any(i[0] == 2 for i in head.get("items", [])), head  # 2 never ran
    assert 2 not in engine.specs and 2 not in engine.kept


@contextlib.contextmanager
def _shared_core(checkpoint, buffer_bytes: int | None = None):
    """An engine process's ``_Core`` serving two API servers' connections (``--api-server-count 2``), on a thread:
    yields it and the servers' ends, each with the engine's ``ready`` read (``buffer_bytes``: the sockets'
    buffers). Both servers leave at the end, and the engine must then have ended."""
    import socket
    import threading
    from multiprocessing.connection import Connection

    from server.core_spawn import core_settings
    from server.engine_core import _Core
    from server.settings import Settings

    pairs = [socket.socketpair() for _ in range(2)]
    for sock in (sock for pair in pairs for sock in pair) if buffer_bytes else ():
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    engine = _Core([Connection(theirs.detach()) for _, theirs in pairs],
                   core_settings(Settings(checkpoint=str(checkpoint), device="cpu")))  # resolved by the engine
    thread = threading.Thread(target=engine.serve, daemon=True)
    thread.start()
    a, b = (Connection(ours.detach()) for ours, _ in pairs)
    try:
        ready = [_recv(a), _recv(b)]
        assert all(r["op"] == "ready" and r["checkpoint"] == str(checkpoint) for r in ready)
        yield engine, a, b
    finally:
        for conn in (a, b):  # a server that left already is closed already
            conn.close()
    thread.join(30)
    assert not thread.is_alive(), "the engine outlived its last server"


def test_api_servers_share_one_engine_each_numbering_its_own_requests(checkpoint):
    """Two API servers' connections to one engine process (``--api-server-count 2``): the same request number on
    both is two requests, each answered on its own connection; a session one kept is hot for the other; a
    server that leaves abandons its requests while the other's run on; the process ends with the last one."""
    from tests.live import wait_for

    with _shared_core(checkpoint) as (engine, a, b):
        _run(a, 1, [72, 105], max_tokens=3)
        _run(b, 1, [72, 105], max_tokens=5)
        end_a, end_b = _until(a, "finished", 1), _until(b, "finished", 1)
        assert [len([i for i in end["seen"] if i[1] == "t"]) for end in (end_a, end_b)] == [3, 5]
        assert (end_a["tokens_seen"], end_b["tokens_seen"]) == (2 + 3, 2 + 5)
        a.send_bytes(pack({"op": "keep", "rid": 1, "sid": "s", "revision": [1, 1.5]}))
        for conn in (a, b):  # both servers hear it is hot (a session's tier, whichever server is asked)
            assert _until(conn, "evicted")["kept"] == ["s", [1, 1.5]]
        b.send_bytes(pack({"op": "drop", "rid": 1}))
        _run(b, 2, [33], key=["s", [1, 1.5]])
        end = _until(b, "finished", 2)
        assert end["source"] == "hot" and end["tokens_seen"] == 2 + 3 + 1 + 4  # a's session, continued by b
        b.send_bytes(pack({"op": "drop", "rid": 2}))
        b.send_bytes(pack({"op": "stats", "qid": 9}))
        assert _until(b, "stats")["qid"] == 9 and not a.poll(0)  # answered to the one that asked
        a.send_bytes(pack({"op": "hot", "what": "deleted", "sid": "s"}))  # a DELETE through server a
        for conn in (a, b):  # b stops its requests on the session now, as a does (not at a lease renewal)
            assert _until(conn, "deleted")["sid"] == "s"

        _run(a, 3, [72], max_tokens=100_000)
        _until(a, "events", 3)  # generating
        a.close()  # that server is gone: its request is cancelled and nothing is kept for it
        wait_for(lambda: not engine.specs and not engine.kept, 30, "the engine to abandon the request of a server "
                 "that left")
        _run(b, 4, [72], max_tokens=2, persist=False)
        assert _until(b, "finished", 4)["finish_reason"] == "length"  # the other server is still served
        assert engine.live == {1}  # the engine runs on for it


def test_an_api_server_that_reads_nothing_holds_up_only_itself_and_is_dropped(checkpoint):
    """Of two API servers sharing the engine, one stops reading (a stopped process): the engine's messages to it
    pile up on its connection's own thread, the other's requests run and commit as before, and after
    ``stall_timeout_s`` the engine drops the stalled one and its requests. Sent inline, the first message over the
    socket's buffer blocked the engine's thread (or an export, its io thread) and with it every server."""
    from tests.live import wait_for

    with _shared_core(checkpoint, buffer_bytes=4096) as (engine, stalled, b):  # a few steps' messages fill them
        _run(stalled, 1, [72], max_tokens=100_000)  # its tokens keep coming; nobody reads them
        # a send under way is not yet a full socket (a loaded machine can pause one mid-send: seen once): one that
        # has waited two seconds is one the buffer holds up
        wait_for(lambda: engine.senders[0].stalled(2.0), 60, "the stalled server's socket to fill")
        for rid in (1, 2):  # the other server's requests run, end and are kept, while the first stays stalled
            _run(b, rid, [72, 105], max_tokens=3)
            end = _until(b, "finished", rid)
            assert end["state"] is True and end["blob"], end
            b.send_bytes(pack({"op": "keep", "rid": rid, "sid": f"s{rid}", "revision": [1, 1.5]}))
            assert _until(b, "evicted")["kept"] == [f"s{rid}", [1, 1.5]]
        assert 0 in engine.live and engine.senders[0].blocked_since is not None  # still stalled, not yet dropped
        engine.stall_s = 0.5  # as if a minute had passed: looked at within a second
        wait_for(lambda: 0 not in engine.live and not engine.specs, 30, "the engine to drop the stalled server")
        _run(b, 3, [72], max_tokens=2, persist=False)
        assert _until(b, "finished", 3)["finish_reason"] == "length"


class _Wire:
    """A connection's writing end that records what was sent, and holds a large message until released."""

    def __init__(self) -> None:
        import threading
        self.sent: list[bytes] = []
        self.release, self.holding = threading.Event(), threading.Event()

    def send_bytes(self, data: bytes) -> None:
        if len(data) > 1000:
            self.holding.set()
            assert self.release.wait(30), "the test never released the large message"
        self.sent.append(data)


def test_a_small_message_never_waits_behind_a_large_one_and_keeps_its_order():
    import threading

    from server.engine_core import Sender
    wire = _Wire()
    sender = Sender(wire)
    sender.LARGE = 1000
    sender.send(b"before")
    large = threading.Thread(target=sender.send, args=(b"L" * 5000,))
    large.start()
    assert wire.holding.wait(30)
    small = threading.Thread(target=sender.send, args=(b"tokens",))  # as the engine's thread hands a step over
    small.start()
    small.join(10)
    assert not small.is_alive(), "the small message waited for the large one's send"
    assert wire.sent == [b"before"]
    wire.release.set()
    large.join(30)
    assert wire.sent == [b"before", b"L" * 5000, b"tokens"]  # sent by the large one's thread, in order


def test_messages_from_many_threads_all_leave_each_threads_in_order():
    import threading

    from server.engine_core import Sender
    wire = _Wire()
    wire.release.set()
    sender = Sender(wire)
    sender.LARGE = 1000

    def burst(t: int) -> None:
        for i in range(300):
            sender.send(b"%d:%d" % (t, i) + (b"x" * 2000 if i % 50 == 0 else b""))
    threads = [threading.Thread(target=burst, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads)
    for t in range(4):
        mine = [int(m.split(b":")[1].rstrip(b"x")) for m in wire.sent if m.startswith(b"%d:" % t)]
        assert mine == list(range(300))  # none stranded, none reordered


def _with_environ(marker: str) -> list[int]:
    """The live processes whose environment holds ``marker`` (from /proc: no psutil)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if marker.encode() in environ and pid_alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def test_an_engine_process_started_early_is_taken_once_or_goes_with_its_server(checkpoint, tmp_path):
    """`txlserve serve` starts the engine process before it imports torch and FastAPI, so the two imports run side
    by side (server/core_spawn.py). The server takes it once; one it never takes (it failed first) is stopped with
    it, and one whose server vanished exits on its own at the end of its stdin."""
    import subprocess
    import sys
    import uuid

    from server import core_spawn
    from tests.live import REPO

    core_spawn.spawn_early()
    proc, conn = core_spawn.take()
    assert core_spawn.take() is None  # once
    conn.close()
    proc.stdin.close()  # as if its server had died before sending the settings
    assert proc.wait(60) == 0
    core_spawn.spawn_early()
    early = core_spawn._early[0]
    core_spawn.discard()  # what exit does with one nobody took
    assert early.poll() is not None and core_spawn.take() is None
    core_spawn.spawn_early()
    os.killpg(core_spawn._early[0].pid, signal.SIGKILL)
    core_spawn._early[0].wait(30)
    assert core_spawn.take() is None  # died meanwhile: the server spawns a fresh one, whose failure says why
    marker = f"TXL_EARLY_{uuid.uuid4().hex}"
    r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", "0", "--checkpoint", str(checkpoint),
                        "--data-dir", str(tmp_path), "--redis-url", "redis://127.0.0.1:1/0"],  # fails after the start
                       cwd=REPO, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "OMP_NUM_THREADS": "1", marker: "1"})
    assert r.returncode == 2 and "is unavailable" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not _with_environ(marker), "the engine process outlived a server that failed"


def test_an_engine_process_that_dies_before_its_settings_is_a_failed_start(monkeypatch):
    """One started early can die after the server took it and before it read its settings: the write to it
    raised a broken pipe out of the server's start, with the connection left open."""
    import socket
    import subprocess
    import sys

    from server import core_spawn
    from server.engine_core import EngineCore
    from txlserve.errors import Unavailable

    ours, theirs = socket.socketpair()
    theirs.close()
    proc = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.PIPE)
    proc.wait(60)
    monkeypatch.setattr(core_spawn, "take", lambda: (proc, ours))
    core = EngineCore({"checkpoint": "unused", "hot_bytes": 0})
    with pytest.raises(Unavailable, match="the engine process exited while loading"):
        core.start()
    assert core.conn.closed and proc.stdin.closed


def test_a_hung_engine_process_is_killed_and_fails_its_requests(checkpoint, redis_url, tmp_path):
    """A stopped (or wedged) engine process was never noticed: its requests waited with no end, their sessions
    stayed leased (409s), and /health said 200 (found by a helper). It now answers no ping for
    --engine-timeout-s, so it is killed: its requests end with a 503, /health turns 503."""
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path, args=("--engine-timeout-s", "2")).start()
    pid = _engine_pid(srv)
    try:
        sid = httpx.post(srv.url + "/v1/sessions", json={"text": "Kept "}, timeout=60).json()["id"]
        os.kill(pid, signal.SIGSTOP)
        r = _complete(srv, prompt="go", max_tokens=5, session_id=sid)  # bounded by the ping's time, not forever
        assert r.status_code == 503 and "answered nothing for 2 s" in r.json()["error"]["message"], r.text
        health = httpx.get(srv.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert httpx.get(f"{srv.url}/v1/sessions/{sid}", timeout=10).json()["tokens_seen"] == len("Kept ")
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        srv.stop()


def test_a_drain_kills_an_engine_process_that_does_not_hear_its_cancels(checkpoint, redis_url, tmp_path):
    """SIGTERM while the engine process was stopped (found by a helper): the drain's cancels were never heard, so
    it waited out its 10 s, uvicorn then cut the stream mid-body (no end, no [DONE]), and the engine's own stop
    waited 10 s more: the process exited ~25 s past --shutdown-timeout-s, past a container's stop grace. Now an
    engine that answers no ping once the runs are cancelled is killed: the stream ends with a 503 event and
    [DONE], and the server exits soon after."""
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path, args=("--shutdown-timeout-s", "1")).start()
    pid = _engine_pid(srv)
    try:
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "go", "max_tokens": 4000, "stream": True}) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        events = [json.loads(x[6:]) for x in rest if x.startswith("data: {")]
        assert events and events[-1]["status"] == 503, events[-1:]
        assert "answered nothing while the server drained" in events[-1]["error"]["message"]
        assert rest[-1] == "data: [DONE]" or rest[-2:] == ["data: [DONE]", ""], rest[-3:]
        assert srv.proc.wait(30) in (0, -signal.SIGTERM)
        # 1 s of drain, at most DRAIN_PING_S for the ping, then the stop; it took ~25 s more before
        assert time.monotonic() - t0 < 1 + DRAIN_PING_S + 8, time.monotonic() - t0
        assert "Traceback" not in srv.log.read_text()
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        srv.stop()


@pytest.mark.parametrize("disable", [False, True])
def test_disable_overlap_schedule_reaches_the_engine_process_scheduler(checkpoint, disable):
    """``--disable-overlap-schedule`` is the engine's to obey: it crosses to the engine's process in its settings."""
    import socket
    from multiprocessing.connection import Connection

    import torch

    from server.core_spawn import core_settings
    from server.engine_core import _Core
    from server.settings import Settings

    ours, theirs = socket.socketpair()
    settings = core_settings(Settings(checkpoint=str(checkpoint), disable_overlap_schedule=disable), str(checkpoint),
                             torch.device("cpu"), torch.float32)
    engine = _Core([Connection(theirs.detach())], settings)
    try:
        assert engine.scheduler.overlap is not disable
    finally:
        engine.io.shutdown(wait=False)
        ours.close()
        engine.conns[0].close()

"""Disconnects, crashes, restarts, shutdowns and replicas: sessions stay at their last commit."""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest

from tests.live import LONG, MODEL, LiveServer, stop_then_continue, stop_then_read, wait_for
from tests.server.test_scheduling import wait_gauge


def complete(srv, **body) -> dict:
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def settled(srv, sid: str, timeout: float = 120) -> dict:
    """The session once no request holds it (its lease released)."""
    def free() -> dict | None:
        r = httpx.post(f"{srv.url}/v1/sessions/{sid}/append", json={"text": ""}, timeout=30)
        assert r.status_code in (200, 409), r.text
        return r.json() if r.status_code == 200 else None

    return wait_for(free, timeout, f"session {sid} to be free", every=0.1)


def test_client_disconnect_stops_generation_and_commits(server):
    sid = httpx.post(server.url + "/v1/sessions", json={"text": "Story: "}).json()["id"]
    received = ""
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "go", "max_tokens": LONG, "temperature": 0, "stream": True,
            "session_id": sid}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                received += json.loads(line[6:])["choices"][0]["text"]
            if len(received) >= 5:
                break
    info = settled(server, sid)
    generated = info["tokens_seen"] - len("Story: go")
    assert len(received) <= generated < LONG  # stopped early, and kept everything it sent
    full = complete(server, prompt="Story: go", max_tokens=generated)["choices"][0]["text"]
    assert full.startswith(received)
    cont = complete(server, prompt=" next", max_tokens=10, session_id=sid)["choices"][0]["text"]
    assert cont == complete(server, prompt="Story: go" + full + " next", max_tokens=10)["choices"][0]["text"]
    metrics = httpx.get(server.url + "/metrics").text
    (line,) = [x for x in metrics.splitlines() if x.startswith("txlserve_client_disconnects_total ")]
    assert float(line.split()[1]) >= 1


def test_a_client_that_leaves_a_whole_answer_is_logged_as_499(server):
    """A non-streamed completion whose client left: the run stops and commits what it made, and its log line and
    the requests metric said 200, for a response nobody got (found by a helper). They say 499, as nginx does."""
    from tests.server.test_hardening import _log_line

    request_id = f"left-{time.monotonic_ns()}"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=httpx.Timeout(30, read=0.5),
                   headers={"x-request-id": request_id}, json={"model": MODEL, "prompt": "go", "max_tokens": LONG})
    line = _log_line(server, request_id)
    assert line["status"] == 499 and line["finish_reason"] == "cancelled", line
    assert 0 < line["completion_tokens"] < LONG
    metrics = httpx.get(server.url + "/metrics").text
    assert 'txlserve_requests_total{route="/v1/completions",status="499"}' in metrics


@pytest.fixture
def own_server(checkpoint, redis_url, tmp_path):
    servers = []

    def start(port=None, args=("--lease-ttl-ms", "1500")):
        srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path / f"s{len(servers)}", port=port,
                         args=args).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop()


def test_kill_9_mid_stream_then_restart(own_server):
    srv = own_server()
    sid = httpx.post(srv.url + "/v1/sessions", json={"text": "Committed text. "}).json()["id"]
    complete(srv, prompt="More", max_tokens=4, session_id=sid)
    before = httpx.get(f"{srv.url}/v1/sessions/{sid}").json()["tokens_seen"]
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "go", "max_tokens": LONG, "stream": True, "session_id": sid}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 6:
                srv.kill()
                break
    again = own_server(port=srv.port)
    assert httpx.get(f"{again.url}/v1/sessions/{sid}").json()["tokens_seen"] == before
    settled(again, sid)  # the dead server's lease expires by itself
    cont = complete(again, prompt=" on", max_tokens=10, session_id=sid)
    history = "Committed text. More" + complete(again, prompt="Committed text. More", max_tokens=4)[
        "choices"][0]["text"]
    assert cont["choices"][0]["text"] == complete(again, prompt=history + " on", max_tokens=10)["choices"][0]["text"]


def test_two_servers_alternate_like_one(own_server, server):
    a, b = own_server(), server  # two processes over one Redis
    prompts = ["First part. ", "second part, ", "third and ", "last."]

    def run(targets):
        sid = httpx.post(targets[0].url + "/v1/sessions", json={"text": "Shared: "}).json()["id"]
        return [complete(t, prompt=p, max_tokens=6, session_id=sid)["choices"][0]["text"]
                for t, p in zip(targets * 4, prompts)]

    assert run([a, b]) == run([server])
    # "stop generating", then continue at once through the other replica: the stopped run on a still commits for
    # a few ms, and b's request was a 409 nearly every time (found by a helper); a marks its lease ending, and b
    # waits for that commit as a does for its own runs
    sid = httpx.post(a.url + "/v1/sessions", json={"text": "Stopped: "}).json()["id"]
    with httpx.Client(base_url=a.url, timeout=60) as at_a, httpx.Client(base_url=b.url, timeout=60) as at_b:
        stop_then_continue(at_a, at_b, sid, LONG)
        # and a read of the session (its info, export or fork) sent at once, here or there, sees what it made
        stop_then_read(at_a, at_a, sid, LONG)
        stop_then_read(at_a, at_b, sid, LONG)


def test_sigterm_lets_streams_finish_and_commit(own_server, server):
    srv = own_server(args=("--shutdown-timeout-s", "20"))
    sid = httpx.post(srv.url + "/v1/sessions", json={"text": "Graceful "}).json()["id"]
    chunks = []
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "end", "max_tokens": 300, "stream": True, "session_id": sid}) as r:
        for i, line in enumerate(r.iter_lines()):
            if i == 2:
                srv.proc.send_signal(15)
            if line:
                chunks.append(line)
    assert chunks[-1] == "data: [DONE]"
    final = json.loads(chunks[-2][6:]) if '"session"' in chunks[-2] else json.loads(chunks[-3][6:])
    assert final["choices"][0]["finish_reason"] == "length"
    assert srv.proc.wait(30) in (0, -15)  # uvicorn re-raises SIGTERM once shut down
    # what it committed, read by another server over the same Redis
    assert httpx.get(f"{server.url}/v1/sessions/{sid}").json()["tokens_seen"] == len("Graceful end") + 300


def test_sigterm_past_the_timeout_cancels_and_commits(own_server, server):
    srv = own_server(args=("--shutdown-timeout-s", "1"))
    sid = httpx.post(srv.url + "/v1/sessions", json={"text": "Cut "}).json()["id"]
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "off", "max_tokens": LONG, "stream": True, "session_id": sid}) as r:
        lines = []
        for i, line in enumerate(r.iter_lines()):
            if i == 2:
                srv.proc.send_signal(15)
            lines.append(line)
    assert [x for x in lines if x][-1] == "data: [DONE]"  # the stream ended cleanly, not cut
    assert srv.proc.wait(30) in (0, -15)  # uvicorn re-raises SIGTERM once shut down
    log = srv.log.read_text()  # the signal is answered in the log at once, not after the streams end
    assert log.index("draining: waiting up to 1 s for 1 request(s)") < log.index("still running after 1 s"), log
    seen = httpx.get(f"{server.url}/v1/sessions/{sid}").json()["tokens_seen"]  # another server, same Redis
    assert len("Cut off") < seen < len("Cut off") + LONG


def _refused(srv: LiveServer) -> bool:
    """No new connection is served: refused, or (taken by the kernel as the listening socket closed) closed
    before an answer."""
    try:
        httpx.get(srv.url + "/health", timeout=5)
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        return True
    return False


def test_sigterm_lets_websocket_streams_end_then_closes_the_sockets(own_server, server):
    """uvicorn's shutdown closes every WebSocket at once (1012): a completion streaming over one was cut with no
    end, where an SSE stream ran to its end. Now the drain's runs end first (in time, or cancelled past the
    timeout: what the client got is what was committed), their sockets send their last message, and then every
    socket, an idle one too, closes with 1012. An idle keep-alive HTTP connection closes as the drain begins, as
    uvicorn closes it: held open until the drain ended, it took new requests (found by a helper)."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    from tests.server.test_ws import ws_url

    asked = LONG  # the run outlives the drain's 3 s: it is cancelled, and its socket still sends its end
    srv = own_server(args=("--shutdown-timeout-s", "3"))
    sid = httpx.post(srv.url + "/v1/sessions", json={"text": "Graceful "}).json()["id"]
    pooled = httpx.Client(base_url=srv.url, timeout=30)  # an idle keep-alive connection, as SDKs pool them
    with contextlib.closing(pooled), connect(ws_url(srv)) as idle, connect(ws_url(srv)) as conn:
        assert pooled.get("/v1/models").status_code == 200
        conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "end", "max_tokens": asked,
                              "session_id": sid}))
        events = []
        while not events or events[-1]["type"] == "completion.delta":
            events.append(json.loads(conn.recv(timeout=60)))
            if len(events) == 2:
                srv.proc.send_signal(15)
                # the run goes on for 3 s: once the drain began (no new connection), the pooled one is closed too
                wait_for(lambda: _refused(srv), 30, "the server to stop taking connections")
                with pytest.raises(httpx.TransportError):  # (it got a 200 before)
                    pooled.get("/v1/models")
        done = events[-1]
        assert done["type"] == "completion.done" and done["finish_reason"] == "cancelled", events[-3:]
        assert "".join(e["text"] for e in events[:-1]) == done["text"]
        with pytest.raises(ConnectionClosed) as closed:
            idle.recv(timeout=60)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012  # "service restart"
        with pytest.raises(httpx.TransportError):  # closed, and no new connection is taken: its client goes to
            pooled.get("/v1/models")  # another replica
    assert srv.proc.wait(30) in (0, -15)  # uvicorn re-raises SIGTERM once shut down
    tokens_seen = httpx.get(f"{server.url}/v1/sessions/{sid}").json()["tokens_seen"]  # another server, same Redis
    assert tokens_seen == len("Graceful end") + done["usage"]["completion_tokens"] == done["session"]["tokens_seen"]
    assert done["usage"]["completion_tokens"] < asked


def test_a_second_ctrl_c_during_the_drain_stops_at_once_and_quietly(checkpoint, tmp_path):
    """A second Ctrl-C (uvicorn's force exit) while a stream drained printed four tracebacks: the captured signals
    were each raised again (a KeyboardInterrupt through the clean-up), and the app's lifespan, whose shutdown a
    force exit skips, logged its cancellation as a failed shutdown. Now it is one line, and 130 as a Ctrl-C; and
    the embedded Redis the server started is stopped (a forced exit had left it running; found by a reviewer)."""
    import signal

    from tests.procs import wait_exit

    srv = LiveServer(checkpoint, redis_url=None, data_dir=tmp_path / "data",
                     args=("--shutdown-timeout-s", "60")).start()
    redis_pid = int((tmp_path / "data" / "redis.pid").read_text())
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "go", "max_tokens": LONG, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # streaming: the drain will wait for it
        srv.proc.send_signal(signal.SIGINT)
        wait_for(lambda: "draining: waiting up to 60 s" in srv.log.read_text(), 60, "the drain to begin")
        began = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(30) == 130
    assert time.monotonic() - began < 20  # not the drain's 60 s
    log = srv.log.read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    assert "stopped at once (a second signal): 1 request(s) still running" in log, log[-3000:]
    assert wait_exit({redis_pid}, 30), "the embedded Redis outlived its server"


def test_sigterm_ends_a_response_its_client_reads_nothing_of_without_a_traceback(own_server):
    """A stream whose run had ended, but whose client read nothing, held the shutdown until uvicorn's own deadline,
    which cancelled its app with a traceback (found by a helper). Once the drain's runs end, such connections are
    aborted: the server exits at once, and quietly."""
    import signal
    import socket

    srv = own_server(args=("--shutdown-timeout-s", "30"))
    sid = httpx.post(srv.url + "/v1/sessions", json={"text": "Quiet "}, timeout=30).json()["id"]
    asked = 40_000  # with logprobs 3, ~10 MB of events: more than the kernel's buffers hold
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", srv.port))
        body = json.dumps({"model": MODEL, "prompt": "go", "max_tokens": asked, "logprobs": 3, "stream": True,
                           "session_id": sid}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(body) + body)
        done = len("Quiet go") + asked  # the run ends and commits, its response still unsent
        wait_for(lambda: httpx.get(f"{srv.url}/v1/sessions/{sid}", timeout=10).json()["tokens_seen"] == done, 120,
                 "the run's commit")
        began = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) in (0, -signal.SIGTERM)
        assert time.monotonic() - began < 10  # not the drain's 30 s, nor uvicorn's 35
    finally:
        sock.close()
    log = srv.log.read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]


def test_redis_outage_is_503_and_the_server_recovers(checkpoint, redis_server, tmp_path):
    redis = redis_server()
    import threading

    srv = LiveServer(checkpoint, redis_url=redis.url, data_dir=tmp_path / "srv",
                     args=("--store-timeout-s", "0.5", "--lease-ttl-ms", "2500")).start()  # renewed every 0.83 s
    streamed: list[str] = []
    try:
        sid = httpx.post(srv.url + "/v1/sessions", json={"text": "kept "}).json()["id"]
        other = httpx.post(srv.url + "/v1/sessions", json={"text": "long "}).json()["id"]
        started = threading.Event()

        def stream() -> None:  # a run whose lease expires while Redis is away: an outage, not a conflict
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
                    "model": MODEL, "prompt": "x", "max_tokens": LONG, "stream": True, "session_id": other}) as r:
                for line in r.iter_lines():
                    started.set()
                    if line:
                        streamed.append(line)

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(30)
        killed = time.monotonic()
        redis.kill()
        r = httpx.get(srv.url + "/ready", timeout=10)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", timeout=10, json={"model": MODEL, "prompt": "x",
                                                                       "session_id": sid})
        assert r.status_code == 503 and time.monotonic() - t0 < 5
        assert r.json()["error"]["code"] == "store_unavailable"
        assert complete(srv, prompt="stateless still works", max_tokens=3)["usage"]["completion_tokens"] == 3
        time.sleep(max(0.0, 3.0 - (time.monotonic() - killed)))  # the outage outlasts the stream's 2.5 s lease
        redis.start()  # same port, same append-only file
        wait_for(lambda: httpx.get(srv.url + "/ready").status_code == 200, 20, "/ready to answer 200", every=0.2)
        assert httpx.get(f"{srv.url}/v1/sessions/{sid}").json()["tokens_seen"] == 5
        assert complete(srv, prompt="back", max_tokens=2, session_id=sid)["session"]["tokens_seen"] == 11
        reader.join(60)
        assert not reader.is_alive() and streamed[-1] == "data: [DONE]"
        err = json.loads(streamed[-2][len("data: "):])["error"]
        assert err["code"] == "store_unavailable" and "longer than the lease" in err["message"], err  # was a 409
        assert httpx.get(f"{srv.url}/v1/sessions/{other}").json()["tokens_seen"] == 5  # nothing was stored
    finally:
        srv.stop()


def test_tiny_temperature_fails_nobody(server):
    """A temperature that would overflow the logits samples greedily; other requests are unaffected."""
    sid = httpx.post(server.url + "/v1/sessions", json={"text": "side by side "}).json()["id"]
    lines = []
    import threading

    streaming = threading.Event()

    def stream():
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "a", "max_tokens": 1500, "stream": True, "session_id": sid}) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    streaming.set()
        streaming.set()

    t = threading.Thread(target=stream)
    t.start()
    assert streaming.wait(120)
    out = complete(server, prompt="cold", max_tokens=5, temperature=1e-40)
    assert out["choices"][0]["text"] == complete(server, prompt="cold", max_tokens=5)["choices"][0]["text"]
    t.join(120)
    assert lines[-1] == "data: [DONE]" and not any('"error"' in x for x in lines)


def test_non_streaming_client_that_gives_up_stops_generation(server):
    sid = httpx.post(server.url + "/v1/sessions", json={"text": "Patience "}).json()["id"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=0.3, json={
            "model": MODEL, "prompt": "x", "max_tokens": LONG, "session_id": sid})
    info = settled(server, sid)
    assert len("Patience x") <= info["tokens_seen"] < len("Patience x") + LONG


def _requests_counted(srv, status: int) -> float:
    prefix = f'txlserve_requests_total{{route="/v1/completions",status="{status}"}} '
    lines = [x for x in httpx.get(srv.url + "/metrics").text.splitlines() if x.startswith(prefix)]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_stream_left_during_prefill_commits_nothing(server):
    sid = httpx.post(server.url + "/v1/sessions", json={"text": "Before "}).json()["id"]
    left, failed = _requests_counted(server, 499), _requests_counted(server, 503)
    body = {"model": MODEL, "prompt": "p" * 900_000, "max_tokens": 5, "stream": True, "session_id": sid}
    with pytest.raises(httpx.ReadTimeout), httpx.stream("POST", server.url + "/v1/completions", json=body,
                                                        timeout=httpx.Timeout(30, read=0.3)) as r:
        r.read()
    assert settled(server, sid, timeout=60)["tokens_seen"] == len("Before ")
    # the request is counted when its handler ends, just after the release
    wait_for(lambda: _requests_counted(server, 499) > left, 60, "the client that left to be counted as a 499")
    assert _requests_counted(server, 503) == failed  # a client that leaves is not a server error (nginx's 499)


def test_a_stream_of_n_choices_left_while_their_prompt_is_read_ends_them_all(server):
    """n choices share one read of their prompt: a client that leaves during it ends every choice, nothing stays
    running or waiting, and the next such request is served."""
    from tests.server.test_scheduling import _gauge

    left = _requests_counted(server, 499)
    body = {"model": MODEL, "prompt": "p" * 900_000, "n": 4, "max_tokens": 5, "stream": True}
    with pytest.raises(httpx.ReadTimeout), httpx.stream("POST", server.url + "/v1/completions", json=body,
                                                        timeout=httpx.Timeout(30, read=0.3)) as r:
        r.read()
    wait_for(lambda: _requests_counted(server, 499) > left, 60, "the client that left to be counted as a 499")
    wait_for(lambda: _gauge(server, "txlserve_requests_running") == _gauge(server, "txlserve_requests_waiting") == 0,
             60, "every choice to end")
    r = httpx.post(server.url + "/v1/completions", json={**body, "prompt": "p" * 100, "stream": False}, timeout=60)
    assert r.status_code == 200 and [c["finish_reason"] for c in r.json()["choices"]] == ["length"] * 4


def test_websocket_dropped_mid_stream_cancels(server):
    import socket

    from websockets.sync.client import connect

    sid = httpx.post(server.url + "/v1/sessions", json={"text": "Dropped "}).json()["id"]
    with connect(server.url.replace("http://", "ws://") + "/v1/ws") as conn:
        conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "x", "max_tokens": LONG,
                              "session_id": sid}))
        conn.recv(timeout=30)
        conn.socket.shutdown(socket.SHUT_RDWR)  # no closing handshake: the peer just vanishes
    assert settled(server, sid)["tokens_seen"] < len("Dropped x") + LONG


def test_shutdown_during_append_is_503_not_success(own_server, server):
    srv = own_server(args=("--shutdown-timeout-s", "1", "--prefill-chunk", "32"))
    sid = httpx.post(srv.url + "/v1/sessions", json={"text": "Start "}).json()["id"]
    import threading

    result = {}

    def append():
        r = httpx.post(f"{srv.url}/v1/sessions/{sid}/append", json={"text": "z" * 400_000}, timeout=60)
        result["status"], result["body"] = r.status_code, r.json()

    t = threading.Thread(target=append)
    t.start()
    wait_gauge(srv, "txlserve_requests_waiting", 1)  # the append is prefilling
    srv.proc.send_signal(15)
    t.join(60)
    assert result["status"] == 503, result
    assert httpx.get(f"{server.url}/v1/sessions/{sid}").json()["tokens_seen"] == len("Start ")  # same Redis


def test_a_client_gone_before_its_run_starts_commits_nothing(server):
    """The whole request sent, the connection closed at once: the disconnect can arrive while the prompt is
    still being tokenized, before the run exists; the run must still be cancelled before its prompt joins."""
    import socket

    sid = httpx.post(server.url + "/v1/sessions", json={"text": "Gone "}).json()["id"]
    left = _requests_counted(server, 499)
    body = json.dumps({"model": MODEL, "prompt": "g" * 100_000, "max_tokens": 5, "stream": True,
                       "session_id": sid}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head + body)
    # counted as 499 whether the disconnect was seen before its body was read, while its prompt was tokenized,
    # or before its prompt joined
    wait_for(lambda: _requests_counted(server, 499) > left, 60, "the request to be counted as a client that left")
    assert settled(server, sid)["tokens_seen"] == len("Gone ")  # its prompt never joined the session


def test_websocket_cancel_or_leave_while_the_prompt_is_read_stores_nothing(server):
    from websockets.sync.client import connect

    sid = httpx.post(server.url + "/v1/sessions", json={"text": "Kept "}).json()["id"]
    create = {"type": "completion.create", "model": MODEL, "prompt": "w" * 300_000, "max_tokens": 5,
              "session_id": sid}
    with connect(server.url.replace("http://", "ws://") + "/v1/ws", max_size=None) as conn:
        conn.send(json.dumps(create))
        conn.send(json.dumps({"type": "cancel"}))  # long before 300,000 tokens can be read
        reply = json.loads(conn.recv(timeout=60))
        assert reply["type"] == "error" and reply["status"] == 499, reply
        assert reply["error"]["code"] == "request_cancelled"
        conn.send(json.dumps({**create, "prompt": " more", "max_tokens": 2}))  # the connection goes on
        while (reply := json.loads(conn.recv(timeout=60)))["type"] != "completion.done":
            assert reply["type"] == "completion.delta", reply
    assert settled(server, sid)["tokens_seen"] == len("Kept  more") + 2
    with connect(server.url.replace("http://", "ws://") + "/v1/ws") as conn:
        conn.send(json.dumps(create))
    assert settled(server, sid)["tokens_seen"] == len("Kept  more") + 2  # left while it was read: nothing stored


def test_a_session_deleted_through_another_replica_stops_the_request_running_on_it(checkpoint, redis_url, tmp_path):
    """Another replica's DELETE removes the session's keys, its lease among them: this server hears of it only
    when its lease's renewal fails, and the request stops then (it had run to its commit: 200,000 tokens)."""
    import redis as redis_py

    from memory_store.redis_tier import lease_key, ring_key, session_key

    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path,
                     args=("--lease-ttl-ms", "2500", "--max-tokens-limit", str(LONG))).start()  # renewed every 0.83 s
    # (long enough that a busy machine's stalls do not expire it on their own, which would also end the stream)
    try:
        sid = httpx.post(srv.url + "/v1/sessions", json={"text": "gone "}, timeout=30).json()["id"]
        lines = []
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "x", "max_tokens": LONG, "stream": True, "session_id": sid}) as r:
            assert r.status_code == 200
            for i, line in enumerate(r.iter_lines()):
                if i == 1:
                    other = redis_py.Redis.from_url(redis_url)
                    other.delete(session_key(sid), lease_key(sid), ring_key(sid))  # as a DELETE does, elsewhere
                    other.close()
                if line:
                    lines.append(line)
    finally:
        srv.stop()
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][len("data: "):])["error"]
    assert err["code"] == "session_not_found", err  # the renewal saw the session gone, not only its lease
    assert len(lines) < LONG // 4, len(lines)  # stopped at a renewal, not at its 200,000th token



def test_an_embedded_redis_that_dies_turns_health_to_503(checkpoint, tmp_path):
    """The server's own embedded Redis killed: /ready said so for good, but /health stayed 200, so no liveness
    probe restarted a server that could serve no session (found by a helper)."""
    import os
    import signal

    srv = LiveServer(checkpoint, redis_url=None, data_dir=tmp_path / "srv").start()
    try:
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        sid = httpx.post(srv.url + "/v1/sessions", json={"text": "Doomed "}, timeout=30).json()["id"]
        lines = []
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "x", "max_tokens": LONG, "stream": True, "session_id": sid}) as r:
            for i, line in enumerate(r.iter_lines()):
                if i == 1:
                    os.kill(int((tmp_path / "srv" / "redis.pid").read_text()), signal.SIGKILL)
                if line:
                    lines.append(line)
        # the stream stopped as the store died (its tokens could not be stored), not at its 200,000th token or
        # its lease's next renewal (found by a helper: 4,095 tokens over 8 s, then the 503)
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][len("data: "):])
        # Redis died as the run's commit went out: whether it landed cannot be read back
        assert err["error"]["code"] in ("store_unavailable", "commit_outcome_unknown") and err["status"] == 503, err
        assert len(lines) < LONG // 4, len(lines)

        def unhealthy() -> httpx.Response | None:
            health = httpx.get(srv.url + "/health", timeout=10)
            return None if health.status_code == 200 else health

        health = wait_for(unhealthy, 30, "/health to leave 200")
        assert health.status_code == 503 and health.json()["error"]["code"] == "store_dead", health.text
        # why: killed (its log's last line was a start-up warning, and read as the reason; found by a helper); a
        # crash's reason (a full disk) is in its own log alone, which the message quotes then
        assert "embedded Redis server was killed by SIGKILL" in health.json()["error"]["message"]
        wait_for(lambda: "sessions are unavailable until the server is restarted" in srv.log.read_text(), 30,
                 "the death logged as it happened")
    finally:
        srv.stop()


def test_the_port_refuses_connections_until_the_server_can_answer_them(checkpoint, tmp_path):
    """The port is bound at once (a port in use is one line before the load) but takes connections only once the
    server serves: it listened from the start, so a request sent while the model loaded hung unanswered until the
    load ended (a newcomer's first curl, a probe's short timeout; found by a helper). Every attempt is now refused
    at once, or answered."""
    from pathlib import Path

    from server.listen import HOLDS_PORT

    if not HOLDS_PORT:
        pytest.skip("a port is held unlistened only where it can be claimed (Linux)")
    srv = LiveServer(checkpoint, redis_url=None, data_dir=tmp_path / "srv").launch()
    refused_while_bound = 0
    try:
        with httpx.Client(timeout=10) as http:
            def answered() -> httpx.Response | None:
                nonlocal refused_while_bound
                assert srv.proc.poll() is None, srv.log.read_text()[-2000:]
                # the port bound: its claim is there (read, not bound beside it, which could fail the server's bind)
                bound = f"@txlserve-port-{srv.port}\n" in Path("/proc/net/unix").read_text()
                try:
                    return http.get(srv.url + "/ready")  # a hung connection would take the 10 s and fail the test
                except httpx.ConnectError:
                    refused_while_bound += bound
                    return None

            r = wait_for(answered, 60, "the server to answer")
        assert r.status_code == 200, r.text
        assert refused_while_bound > 0, "the load's window was never seen: the test proved nothing"
    finally:
        srv.stop()

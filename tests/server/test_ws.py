"""The WebSocket surface: streaming, cancel, several requests in turn on one connection."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from tests.live import LONG, MODEL, wait_for


def ws_url(server, query: str = "") -> str:
    return server.url.replace("http://", "ws://") + "/v1/ws" + query


def collect(conn) -> list[dict]:
    out = []
    while True:
        msg = json.loads(conn.recv(timeout=60))
        out.append(msg)
        if msg["type"] in ("completion.done", "error"):
            return out


def test_ws_streams_same_text_as_http_and_serves_many_in_turn(server):
    want = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 9,
                                                             "temperature": 0}).json()["choices"][0]["text"]
    with connect(ws_url(server)) as conn:
        for _ in range(2):
            conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "Hello", "max_tokens": 9,
                                  "temperature": 0}))
            msgs = collect(conn)
            deltas, done = msgs[:-1], msgs[-1]
            assert all(m["type"] == "completion.delta" for m in deltas)
            assert "".join(m["text"] for m in deltas) == want == done["text"]
            assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 9
            assert len({m["id"] for m in msgs}) == 1
        ids = list(b"Hello")  # the bundled model reads bytes: its token ids are the prompt's bytes
        conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": ids, "max_tokens": 9,
                              "temperature": 0, "echo": True}))
        done = collect(conn)[-1]
        assert done["type"] == "completion.done" and done["text"] == "Hello" + want, done
        assert "stop_reason" not in done  # none ended it
        conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "Hello", "max_tokens": 9,
                              "temperature": 0, "stop": [want[2:4]]}))
        done = collect(conn)[-1]  # vLLM's stop_reason, as a choice has it
        cut = want.index(want[2:4])  # where that string first ends the greedy text
        assert (done["text"], done["finish_reason"], done["stop_reason"]) == (want[:cut], "stop", want[2:4]), done


def test_ws_a_browser_page_of_another_origin_is_refused(server):
    """Browsers open WebSockets for any page without a preflight: a handshake from a foreign origin is a 403 (with
    no API keys any site could otherwise drive a local server); the server's own origin (its playground) and
    clients that send no Origin are served."""
    for origin in ("http://evil.example", "null", "http://[::1", "https://127.0.0.1:1"):
        with pytest.raises(InvalidStatus) as refused:
            connect(ws_url(server), origin=origin, open_timeout=10)
        response = refused.value.response
        assert response.status_code == 403, origin
        assert json.loads(response.body)["error"]["code"] == "origin_not_allowed"
    for origin in (server.url, None):
        with connect(ws_url(server), origin=origin, open_timeout=10) as conn:
            conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "x", "max_tokens": 2}))
            assert collect(conn)[-1]["type"] == "completion.done"


def test_ws_other_paths_are_404s_and_plain_http_to_the_ws_route_a_426_in_openais_shape(server):
    """A WebSocket to any other path was refused with a bare 403 (what a refused origin gets), and a plain GET of
    /v1/ws said the route did not exist (found by a helper)."""
    base = server.url.replace("http://", "ws://")
    for path in ("/v1/ws/", "/nope", "/v1/completions", "/", "/static/app.js", "/docs/static/x.js"):
        with pytest.raises(InvalidStatus) as refused:
            connect(base + path, open_timeout=10)
        response = refused.value.response
        assert response.status_code == 404, path
        assert json.loads(response.body)["error"]["code"] == "unknown_route", path
    r = httpx.get(server.url + "/v1/ws", timeout=30)
    assert r.status_code == 426 and r.headers["upgrade"] == "websocket"
    assert r.json()["error"]["code"] == "websocket_required"
    assert httpx.get(server.url + "/v1/nope", timeout=30).json()["error"]["code"] == "unknown_route"


def test_ws_a_message_over_the_body_limit_closes_the_connection_with_1009(server):
    """A WebSocket message is held to --max-body-bytes as an HTTP body is (uvicorn's own limit was 16 MiB)."""
    from server.settings import Settings

    limit = Settings().max_body_bytes
    request_id = f"too-big-{uuid.uuid4().hex}"
    with connect(ws_url(server), max_size=None, additional_headers={"x-request-id": request_id}) as conn:
        conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "x" * limit}))
        with pytest.raises(ConnectionClosed) as closed:
            conn.recv(timeout=30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009  # "message too big"
    line = wait_for(lambda: next((json.loads(x[x.index("{"):]) for x in server.log.read_text().splitlines()
                                  if f'"request_id":"{request_id}"' in x), None), 30, "the connection's log line")
    assert (line["status"], line.get("close_code")) == (101, 1009)  # the server closed it, and says why


def test_ws_errors_keep_the_connection(server):
    with connect(ws_url(server)) as conn:
        conn.send("not json")
        assert json.loads(conn.recv(timeout=10))["type"] == "error"
        conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "x", "temperature": -2}))
        err = json.loads(conn.recv(timeout=10))
        assert err["type"] == "error" and err["error"]["param"] == "temperature"
        conn.send(json.dumps({"type": "dance"}))
        err = json.loads(conn.recv(timeout=10))["error"]
        assert err["param"] == "type" and 'unknown message type "dance"' in err["message"], err
        assert '"completion.create" or "cancel"' in err["message"], err
        for stream in ([], {}, -1, "yes", False):  # validated as over HTTP; and a WebSocket always streams
            conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "x", "stream": stream}))
            err = json.loads(conn.recv(timeout=10))
            assert err["type"] == "error" and err["status"] == 400 and err["error"]["param"] == "stream", err
        conn.send(json.dumps({"model": MODEL, "prompt": "x"}))  # no type at all: said so, not "None"
        err = json.loads(conn.recv(timeout=10))["error"]
        assert err["param"] == "type" and err["message"].startswith('no "type"') and "None" not in err["message"]
        conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "x", "top_p": 1e999}))
        err = json.loads(conn.recv(timeout=10))["error"]  # JSON's 1e999 is infinity: as HTTP words it
        assert err["param"] == "top_p" and "finite" in err["message"], err
        conn.send(json.dumps({"type": "completion.create", "model": "nope", "prompt": "x"}))
        assert json.loads(conn.recv(timeout=10))["error"]["type"] == "not_found_error"
        conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "x", "request_id": "r1"}))
        err = json.loads(conn.recv(timeout=10))  # a reused one would let a late cancel stop the next completion
        assert err["status"] == 400 and err["error"]["param"] == "request_id", err
        conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "x",  # SSE's alone: said so
                              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
        err = json.loads(conn.recv(timeout=10))["error"]
        assert err["param"] == "stream_options" and "completion.done" in err["message"], err
        conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "x", "max_tokens": 2,
                              "stream_options": {"continuous_usage_stats": True}}))  # without include_usage: as SSE,
        assert collect(conn)[-1]["type"] == "completion.done"  # nothing to carry, nothing refused
        conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "ok", "max_tokens": 2}))
        assert collect(conn)[-1]["type"] == "completion.done"


def _frame(opcode: int, payload: bytes) -> bytes:
    """A client's (masked) WebSocket frame, for payloads under 126 bytes."""
    mask = b"\x01\x02\x03\x04"
    return bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def test_ws_a_client_that_leaves_as_its_bad_message_is_answered_is_no_server_error(server):
    """A frame and the client's close in one write: the error that answers the frame found the socket closed, and
    the server logged "Exception in ASGI application" with a traceback and closed with 1011 (the fuzzer's log)."""
    import base64
    import socket

    host, port = server.url.removeprefix("http://").split(":")
    start = server.log.stat().st_size
    for i in range(20):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            key = base64.b64encode(bytes(16)).decode()
            sock.sendall(f"GET /v1/ws HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: "
                         f"Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(4096) or b"\r\n\r\n"
            assert head.startswith(b"HTTP/1.1 101"), head
            sock.sendall(_frame(0x1, b"not json %d" % i) + _frame(0x8, (1000).to_bytes(2, "big")))
    ok = httpx.get(server.url + "/health", timeout=30)  # after every connection's handler has run its course
    assert ok.status_code == 200
    with connect(ws_url(server)) as conn:  # and the next client is served
        conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "x", "max_tokens": 2}))
        assert collect(conn)[-1]["type"] == "completion.done"
    with server.log.open("rb") as fh:
        fh.seek(start)
        log = fh.read().decode(errors="replace")
    assert "Exception in ASGI application" not in log and "Traceback" not in log, log[-3000:]


def test_ws_cancel_commits_what_was_generated(server):
    sid = httpx.post(server.url + "/v1/sessions", json={"text": "Begin: "}).json()["id"]
    with connect(ws_url(server)) as conn:
        conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "go", "max_tokens": LONG,
                              "temperature": 0, "session_id": sid}))
        got = [json.loads(conn.recv(timeout=30)) for _ in range(3)]
        assert all(m["type"] == "completion.delta" for m in got)
        conn.send(json.dumps({"type": "cancel", "id": "cmpl-earlier"}))  # another completion's: ignored (it was
        got += [json.loads(conn.recv(timeout=30)) for _ in range(20)]  # this one's, which ended within a step)
        assert all(m["type"] == "completion.delta" for m in got)
        conn.send(json.dumps({"type": "cancel", "id": None}))  # null names none: this one is cancelled
        msgs = collect(conn)
        done = msgs[-1]
        assert done["type"] == "completion.done" and done["finish_reason"] == "cancelled"
        n = done["usage"]["completion_tokens"]
        assert 3 <= n < LONG
        assert done["session"]["tokens_seen"] == len("Begin: go") + n
        text = "".join(m["text"] for m in got + msgs[:-1])
        assert text == done["text"]
    # the session holds exactly prompt + the generated tokens: it continues like one request would
    cont = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": " more", "max_tokens": 12,
                                                             "temperature": 0, "session_id": sid}).json()
    once = httpx.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": "Begin: go" + done["text"] + " more", "max_tokens": 12, "temperature": 0}).json()
    assert cont["choices"][0]["text"] == once["choices"][0]["text"]


def test_ws_cancel_hands_over_the_text_held_back(server):
    """Bytes held back (the start of a possible stop string, or of a character: a UTF-8 lead byte) are in the
    session once generated: a cancel sends them, so the client's text is what the session stored (a helper found
    them missing). Whether a run ends on such a byte depends on when the cancel lands; the engine loop's test
    makes it certain (test_a_cancelled_request_releases_the_text_its_stop_strings_held_back)."""
    stops = [c + "\x00\x01" for c in " ea\n"]
    with connect(ws_url(server)) as conn:
        for seed in range(12):
            sid = httpx.post(server.url + "/v1/sessions", json={"text": "Begin: "}).json()["id"]
            conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "", "max_tokens": 40,
                                  "temperature": 1.0, "seed": seed, "stop": stops, "session_id": sid}))
            got = [json.loads(conn.recv(timeout=30))]
            conn.send(json.dumps({"type": "cancel"}))  # (a loaded machine may see all 40 first: "length")
            msgs = collect(conn)
            done = msgs[-1]
            assert done["finish_reason"] in ("cancelled", "length"), done  # its model writes no "\x00\x01"
            assert "".join(m["text"] for m in got + msgs[:-1]) == done["text"]
            n = done["usage"]["completion_tokens"]
            doc = httpx.get(f"{server.url}/v1/sessions/{sid}/export", timeout=10).json()
            assert len(doc["window"]) == len("Begin: ") + n  # the whole document: 47 tokens at most, under 2 * 24 + 1
            assert bytes(doc["window"][-n:]).decode("utf-8", errors="replace") == done["text"], seed


def test_ws_a_request_sent_as_soon_as_the_last_one_is_done_is_served(server):
    """The next completion.create sent the moment completion.done arrives (after a cancel, as the client library
    does when a stream is left early) is the next request, never "a completion is in progress": the server ends a
    request with its done event (it once looked at the connection once more first, and could read the next
    request there: seen in CI on uvloop)."""
    with connect(ws_url(server)) as conn:
        for i in range(30):
            conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": f"r{i}", "max_tokens": LONG}))
            assert json.loads(conn.recv(timeout=60))["type"] == "completion.delta"
            conn.send(json.dumps({"type": "cancel"}))
            assert collect(conn)[-1]["finish_reason"] == "cancelled"
            conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "x", "max_tokens": 1}))
            msgs = collect(conn)
            assert msgs[-1]["type"] == "completion.done", (i, msgs[-1])


def test_ws_a_request_sent_right_after_a_cancel_waits_its_turn_and_refusals_carry_no_id(server):
    """A create sent right behind a cancel (before the cancelled request's done event) had been refused as "in
    progress" and dropped; now what follows a cancel waits until the cancelled request has ended. An error that
    ends a request carries the request's id; one that refuses a message sent while a request runs carries none,
    so a client can tell the two apart (a helper found them alike)."""
    with connect(ws_url(server)) as conn:
        create = {"type": "completion.create", "model": MODEL, "prompt": "go", "max_tokens": LONG}
        conn.send(json.dumps(create))
        first = json.loads(conn.recv(timeout=60))
        assert first["type"] == "completion.delta"
        conn.send(json.dumps(create))  # a second one while the first runs: refused, the first goes on
        refused = next(m for m in iter(lambda: json.loads(conn.recv(timeout=60)), None)
                       if m["type"] != "completion.delta")
        assert refused["type"] == "error" and "id" not in refused and refused["error"]["param"] == "type", refused
        conn.send(json.dumps({"type": "cancel"}))
        conn.send(json.dumps({**create, "prompt": "next", "max_tokens": 3}))  # at once, behind the cancel
        done = collect(conn)[-1]
        assert (done["type"], done["id"], done["finish_reason"]) == ("completion.done", first["id"], "cancelled")
        following = collect(conn)
        assert following[-1]["type"] == "completion.done" and following[-1]["usage"]["completion_tokens"] == 3
        assert following[-1]["id"] != first["id"]
        sid = httpx.post(server.url + "/v1/sessions", json={"text": "Begin: "}).json()["id"]
        conn.send(json.dumps({**create, "session_id": sid}))
        started = json.loads(conn.recv(timeout=60))
        assert httpx.delete(f"{server.url}/v1/sessions/{sid}", timeout=30).status_code == 200
        ended = collect(conn)[-1]  # the DELETE wins: the running request ends with an error that names it
        assert (ended["type"], ended["id"], ended["error"]["code"]) == ("error", started["id"], "session_not_found")


def test_a_connections_inbox_holds_a_bounded_number_of_frames():
    """A client that sent without reading grew the server's memory without bound, every frame queued (1 GB in
    2.5 s, found by a helper): past INBOX_FRAMES unread frames the reader waits (the socket is not read and TCP
    holds the client back), and the connection's end still gets in."""
    import asyncio

    from server.routes.ws import INBOX_FRAMES, Inbox

    async def scenario() -> None:
        inbox = Inbox()
        for i in range(INBOX_FRAMES):
            await asyncio.wait_for(inbox.put(f"m{i}"), 5)  # room for these: at once
        blocked = asyncio.ensure_future(inbox.put("over"))
        for _ in range(10):  # as many turns of the loop as it takes a put with room
            await asyncio.sleep(0)
        assert not blocked.done()
        assert await inbox.get() == "m0"
        await asyncio.wait_for(blocked, 5)  # one read, one more frame in: full again
        inbox.end()  # the end gets in however full
        got = [await inbox.get() for _ in range(INBOX_FRAMES + 1)]
        assert got[0] == "m1" and got[-2:] == ["over", None]

    asyncio.run(scenario())

"""Regressions from the attack run of issue 9: each case answered 5xx, hung, leaked a key or corrupted a
session before its fix."""

from __future__ import annotations

import contextlib
import json
import math
import re
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urljoin

import httpx
import pytest
import redis
import torch
from websockets.sync.client import connect

from tests.live import API_KEYS, LONG, MODEL, LiveServer, tiny_checkpoint, wait_for

OK = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def ws_url(srv, query: str = "") -> str:
    return srv.url.replace("http://", "ws://") + "/v1/ws" + query


def recv(conn) -> dict:
    return json.loads(conn.recv(timeout=30))


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("extra", [{}, {"top_k": 5}, {"temperature": 0.7}, {"temperature": 1e-4, "top_k": 3}])
@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-46])
def test_tiny_top_p_samples_the_most_likely_token(server, top_p, extra):
    body = {**OK, "prompt": "Once", "max_tokens": 4, "top_p": top_p, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    greedy = httpx.post(server.url + "/v1/completions", json={**body, "top_p": 1.0, "top_k": 0, "temperature": 0},
                        timeout=60).json()["choices"][0]["text"]
    assert r.json()["choices"][0]["text"] == greedy  # top_p -> 0 keeps only the argmax


@pytest.mark.parametrize("path", ["/v1/sessions", "fork"])
def test_lone_surrogate_metadata_is_400_and_nothing_is_stored(server, path):
    owner = httpx.post(server.url + "/v1/sessions", json={"text": "x"}).json()["id"]
    before = httpx.get(server.url + "/v1/sessions?limit=100").json()
    url = server.url + ("/v1/sessions" if path == "/v1/sessions" else f"/v1/sessions/{owner}/fork")
    r = httpx.post(url, content=b'{"metadata": {"k": "\\ud800"}}', headers={"content-type": "application/json"})
    assert_openai_error(r, 400, "metadata")
    after = httpx.get(server.url + "/v1/sessions?limit=100").json()
    assert [s["id"] for s in after["data"]] == [s["id"] for s in before["data"]]


def test_a_stored_session_with_bad_metadata_stays_readable(server, redis_url):
    """Sessions written by an older server with a lone surrogate in their metadata must still list and read."""
    sid = httpx.post(server.url + "/v1/sessions", json={"text": "x", "metadata": {"k": "v"}}).json()["id"]
    r = redis.Redis.from_url(redis_url)
    key = f"txl:{{{sid}}}"
    header = json.loads(r.hget(key, "header"))
    header["metadata"] = {"k": "\ud800", "": "an empty key"}
    r.hset(key, "header", json.dumps(header))  # ensure_ascii writes the "\ud800" escape, as old servers did
    got = httpx.get(f"{server.url}/v1/sessions/{sid}")
    assert got.status_code == 200 and got.json()["metadata"] == {"k": "?", "": "an empty key"}
    assert httpx.get(server.url + "/v1/sessions?limit=100").status_code == 200
    # and its metadata can be changed: an empty key (no longer accepted) removed, the text kept as it reads now
    changed = httpx.post(f"{server.url}/v1/sessions/{sid}", json={"metadata": {"": None, "n": "1"}})
    assert changed.status_code == 200 and changed.json()["metadata"] == {"k": "?", "n": "1"}, changed.text
    assert json.loads(r.hget(key, "header"))["metadata"] == {"k": "?", "n": "1"}


@pytest.mark.parametrize("cursor", ["%C2%B2.abc", "\u00b2.abc", "1.", ".abc", "-1.abc", "1" * 30 + ".abc",
                                    "1.a%20b", "%F0%9F%98%80.x"])
def test_bad_cursor_is_400(server, cursor):
    assert_openai_error(httpx.get(server.url + f"/v1/sessions?after={cursor}"), 400, "after")


@pytest.mark.parametrize("query", ["cursor=abc", "limit=5&offset=10", "page=2"])
def test_an_unknown_list_parameter_is_400_not_the_first_page_again(server, query):
    err = assert_openai_error(httpx.get(server.url + f"/v1/sessions?{query}"), 400)
    assert "after" in err["message"] and err["param"] in query


def _raw_ws_frame(srv, payload: bytes, opcode: int) -> socket.socket:
    """Open a WebSocket by hand and send one masked frame of ``opcode`` (2: binary)."""
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    sock.sendall(b"GET /v1/ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    assert b" 101 " in sock.recv(4096)
    mask = b"\x01\x02\x03\x04"
    sock.sendall(bytes([0x80 | opcode, 0x80 | len(payload)]) + mask
                 + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
    return sock


def test_binary_frame_is_an_error_event_and_the_connection_goes_on(server):
    with connect(ws_url(server)) as conn:
        conn.send(b'{"type": "completion.create"}')
        err = recv(conn)
        assert err["type"] == "error" and "binary" in err["error"]["message"]
        conn.send(json.dumps({"type": "completion.create", **OK}))
        msgs = [recv(conn)]
        while msgs[-1]["type"] not in ("completion.done", "error"):
            msgs.append(recv(conn))
        assert msgs[-1]["type"] == "completion.done"


def test_binary_frame_during_a_completion_is_answered_and_cancel_still_works(server):
    with connect(ws_url(server)) as conn:
        conn.send(json.dumps({"type": "completion.create", **OK, "max_tokens": LONG}))
        assert recv(conn)["type"] == "completion.delta"
        conn.send(b"\x00\x01")
        while (msg := recv(conn))["type"] == "completion.delta":
            pass
        assert msg["type"] == "error" and "binary" in msg["error"]["message"]
        conn.send(json.dumps({"type": "cancel"}))
        while (msg := recv(conn))["type"] == "completion.delta":
            pass
        assert msg["type"] == "completion.done" and msg["finish_reason"] == "cancelled"


def test_ws_handler_ends_with_its_connection_after_a_binary_frame(server):
    """Before the fix the reader task died on a binary frame and the handler outlived the client."""
    sock = _raw_ws_frame(server, b"\xff", opcode=2)
    sock.close()
    wait_for(lambda: re.search(r"^txlserve_websocket_connections 0\.0$", httpx.get(server.url + "/metrics").text,
                               re.M), 20, "the WebSocket handler to end with its connection")


def test_an_integer_too_long_to_convert_is_an_error_event_and_the_connection_goes_on(server):
    """json.loads raises a plain ValueError past Python's 4,300-digit limit: it closed the socket with a
    traceback."""
    with connect(ws_url(server)) as conn:
        conn.send('{"type": "completion.create", "max_tokens": ' + "9" * 4301 + "}")
        event = recv(conn)
        assert event["type"] == "error" and event["status"] == 400 and "4,300 digits" in event["error"]["message"]
        conn.send(json.dumps({"type": "completion.create", **OK}))
        while (event := recv(conn))["type"] == "completion.delta":
            pass
        assert event["type"] == "completion.done", event
    r = httpx.post(server.url + "/v1/completions", content=b'{"max_tokens": ' + b"9" * 4301 + b"}",
                   headers={"content-type": "application/json"}, timeout=30)
    assert "4,300 digits" in assert_openai_error(r, 400)["message"]


def test_deeply_nested_json_is_malformed_input(server):
    nested = "[" * 100_000 + "]" * 100_000
    with connect(ws_url(server), max_size=None) as conn:
        conn.send(nested)
        assert "nested too deeply" in recv(conn)["error"]["message"]  # the cause that applied, not every cause
        conn.send("{not json")
        assert "Expecting property name" in recv(conn)["error"]["message"]
        conn.send('{"type": "completion.create", "model": "' + MODEL + '", "prompt": "x", "max_tokens": 1, '
                  '"user": ' + nested + "}")
        assert recv(conn)["type"] == "error"
        conn.send(json.dumps({"type": "completion.create", **OK}))
        while (msg := recv(conn))["type"] == "completion.delta":
            pass
        assert msg["type"] == "completion.done"
    for path in ("/v1/completions", "/v1/sessions"):
        r = httpx.post(server.url + path, content=nested, headers={"content-type": "application/json"}, timeout=60)
        assert "nested too deeply" in assert_openai_error(r, 400)["message"]
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "\xff"}', timeout=30,
                   headers={"content-type": "application/json"})
    assert "not UTF-8" in assert_openai_error(r, 400)["message"]


@pytest.mark.parametrize("coding", ["gzip", "br", "Deflate, gzip"])
def test_a_body_with_a_content_encoding_is_415(server, coding):
    """A br body was read as JSON and a plain one sent with ``Content-Encoding: br`` served: the header was ignored
    (found by a helper)."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    r = httpx.post(server.url + "/v1/completions", content=body, timeout=30,
                   headers={"content-type": "application/json", "content-encoding": coding})
    err = assert_openai_error(r, 415)
    assert err["code"] == "unsupported_content_encoding" and "uncompressed" in err["message"], err
    assert r.headers["accept-encoding"] == "identity"  # RFC 9110: a 415 for a coding says which it takes
    r = httpx.post(server.url + "/v1/completions", content=body, timeout=30,
                   headers={"content-type": "application/json", "content-encoding": "identity"})
    assert r.status_code == 200, r.text


def test_wrong_redis_type_is_a_corrupt_session(server, redis_url):
    sid = httpx.post(server.url + "/v1/sessions", json={"text": "x"}).json()["id"]
    r = redis.Redis.from_url(redis_url)
    key = f"txl:{{{sid}}}"
    r.delete(key)
    r.rpush(key, "something else wrote this")  # a list where a hash belongs
    assert assert_openai_error(httpx.get(f"{server.url}/v1/sessions/{sid}"), 422)["code"] == "session_corrupt"
    body = {**OK, "session_id": sid}
    assert assert_openai_error(httpx.post(server.url + "/v1/completions", json=body), 422)["code"] == "session_corrupt"
    assert httpx.get(server.url + "/v1/sessions?limit=100").status_code == 200  # listing skips it
    assert httpx.get(server.url + "/ready").status_code == 200
    assert httpx.delete(f"{server.url}/v1/sessions/{sid}").status_code == 200
    assert httpx.get(f"{server.url}/v1/sessions/{sid}").status_code == 404
    assert not r.exists(key)


@pytest.mark.parametrize("field,value", [("tokens_seen", -5), ("mem_len", 10**9), ("version", -1),
                                         ("n_layer", 0), ("payload_bytes", -1)])
def test_header_values_out_of_range_are_422(server, redis_url, field, value):
    sid = httpx.post(server.url + "/v1/sessions", json={"text": "x"}).json()["id"]
    r = redis.Redis.from_url(redis_url)
    key = f"txl:{{{sid}}}"
    header = json.loads(r.hget(key, "header"))
    header[field] = value
    r.hset(key, "header", json.dumps(header))
    assert assert_openai_error(httpx.get(f"{server.url}/v1/sessions/{sid}"), 422)["code"] == "session_corrupt"
    export = httpx.get(f"{server.url}/v1/sessions/{sid}/export")
    assert assert_openai_error(export, 422)["code"] == "session_corrupt"
    body = {**OK, "session_id": sid}
    assert assert_openai_error(httpx.post(server.url + "/v1/completions", json=body), 422)["code"] == "session_corrupt"
    assert httpx.delete(f"{server.url}/v1/sessions/{sid}").status_code == 200


def test_stored_metadata_that_is_not_text_reads_as_its_json(server, redis_url):
    """A value the API never took (the store's Python API took any JSON once, or a hand's edit): its export was a
    500 (found by a helper). It reads as its JSON text, and the session goes on."""
    sid = httpx.post(server.url + "/v1/sessions", json={"text": "x"}).json()["id"]
    r = redis.Redis.from_url(redis_url)
    key = f"txl:{{{sid}}}"
    header = json.loads(r.hget(key, "header"))
    header["metadata"] = {"n": 1, "l": [1]}
    r.hset(key, "header", json.dumps(header))
    assert httpx.get(f"{server.url}/v1/sessions/{sid}").json()["metadata"] == {"n": "1", "l": "[1]"}
    export = httpx.get(f"{server.url}/v1/sessions/{sid}/export")
    assert export.status_code == 200 and export.json()["metadata"] == {"n": "1", "l": "[1]"}
    r2 = httpx.post(f"{server.url}/v1/sessions/{sid}", json={"metadata": {"l": None}})
    assert r2.status_code == 200 and r2.json()["metadata"] == {"n": "1"}
    assert httpx.post(server.url + "/v1/completions", json={**OK, "session_id": sid}, timeout=30).status_code == 200
    assert httpx.delete(f"{server.url}/v1/sessions/{sid}").status_code == 200


def _cold_fork(server, text: str) -> str:
    """A session whose next use reads Redis: a fork of one just made (the original's state is hot)."""
    sid = httpx.post(server.url + "/v1/sessions", json={"text": text}, timeout=30).json()["id"]
    return httpx.post(f"{server.url}/v1/sessions/{sid}/fork", timeout=30).json()["id"]


def test_a_memory_the_model_cannot_hold_is_a_corrupt_session(server, redis_url):
    """A header declaring fewer memory rows than its tokens gave the model's 400, blaming the client (found by a
    helper); the session is left as it was, and can be deleted."""
    sid = _cold_fork(server, "some text")
    r = redis.Redis.from_url(redis_url)
    key = f"txl:{{{sid}}}"
    header = json.loads(r.hget(key, "header"))
    header["mem_rows"] = 0
    r.hset(key, "header", json.dumps(header))
    body = {**OK, "session_id": sid}
    assert assert_openai_error(httpx.post(server.url + "/v1/completions", json=body), 422)["code"] == "session_corrupt"
    assert json.loads(r.hget(key, "header")) == header  # nothing committed
    assert httpx.delete(f"{server.url}/v1/sessions/{sid}").status_code == 200


def test_a_memory_that_is_not_finite_is_rebuilt_from_the_window(server, redis_url):
    """NaNs in a stored ring had continued as NaNs: 200s of NUL bytes, and the NaNs committed (found by a helper)."""
    sid = _cold_fork(server, "some text")
    r = redis.Redis.from_url(redis_url)
    ring = r.get(f"txl:{{{sid}}}:ring")
    r.set(f"txl:{{{sid}}}:ring", b"\xff\xff\xff\x7f" * (len(ring) // 4))  # NaN in every float32
    out = httpx.post(server.url + "/v1/completions", timeout=30, json={
        **OK, "max_tokens": 4, "temperature": 0, "logprobs": 1, "session_id": sid}).json()
    assert all(math.isfinite(lp) for lp in out["choices"][0]["logprobs"]["token_logprobs"]), out
    assert r.get(f"txl:{{{sid}}}:ring") != b"\xff\xff\xff\x7f" * (len(ring) // 4)  # what was committed is sound


def test_unknown_routes_answer_in_openai_shape(server):
    err = assert_openai_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert "/v1/nothing" in err["message"]
    err = assert_openai_error(httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL}), 404, "model")
    assert "v1/completions" in err["message"] and "chat" in err["message"]
    err = assert_openai_error(httpx.get(server.url + "/v1/chat/completions"), 404, "model")  # OpenAI lists there
    assert "v1/completions" in err["message"]  # it was a bare 405
    assert_openai_error(httpx.delete(server.url + "/v1/completions"), 405)


# -- a server with API keys and a short body timeout, whose log the tests read -------------------------------

KEYS = API_KEYS


@pytest.fixture
def keyed(keyed_server):
    """The shared keyed server (its bodies time out after 1.5 s)."""
    return keyed_server.live


def test_bench_serve_takes_an_api_key_and_says_what_a_refusal_was(keyed, tmp_path):
    """Against a server with keys it had no --api-key, and said no server answered when one had, with a 401; a
    document over the server's limits was a KeyError; a server of another model than --checkpoint was measured
    against the engine alone on that checkpoint (both found by helpers)."""
    import asyncio

    from bench.serve import _Connection, _sessions, _stream, served_model
    from txlserve.errors import ConfigError

    with pytest.raises(ConfigError, match="answered 401.*--api-key"):
        served_model(keyed.url)
    assert served_model(keyed.url, KEYS[0]) == MODEL
    assert served_model(keyed.url, KEYS[0], str(keyed.checkpoint)) == MODEL  # the checkpoint it serves
    other = tiny_checkpoint(tmp_path / "other", seed=1)
    with pytest.raises(ConfigError, match=f"serves another model than --checkpoint {other}"):
        served_model(keyed.url, KEYS[0], str(other))  # the engine alone would run another model

    async def stream() -> int:
        sid = (await _sessions(keyed.url, 1, KEYS[0]))[0]
        async with _Connection(keyed.url, MODEL, api_key=KEYS[0]) as conn:
            return (await _stream(conn, {"prompt": "x", "max_tokens": 3, "session_id": sid}))[2]

    assert asyncio.run(stream()) == 3  # the raw client's requests carry the key
    with pytest.raises(ConfigError, match="creating a session, the server answered 401"):
        asyncio.run(_sessions(keyed.url, 1, "wrong-key"))


def test_no_key_in_any_log_line(keyed):
    with connect(ws_url(keyed, f"?api_key={KEYS[1]}")) as conn:
        conn.send(json.dumps({"type": "completion.create", **OK}))
        while recv(conn)["type"] == "completion.delta":
            pass
    with connect(ws_url(keyed), additional_headers={"Authorization": f"Bearer {KEYS[0]}"}) as conn:
        conn.send(json.dumps({"type": "nothing"}))
        recv(conn)
    from websockets.exceptions import InvalidStatus
    with pytest.raises(InvalidStatus, match="401"):  # a WebSocket refused at the handshake
        connect(ws_url(keyed, "?api_key=wrong-key-789")).close()
    with pytest.raises(InvalidStatus, match="404"):  # a key pasted into the path: its line names no path
        connect(ws_url(keyed, f"/{KEYS[1]}")).close()
    httpx.get(keyed.url + f"/v1/models?api_key={KEYS[0]}", headers={"authorization": f"Bearer {KEYS[0]}"})
    httpx.get(keyed.url + "/v1/models?key=wrong-key-789")
    # Starlette decodes names and values, so a percent-encoded key authenticates: its log line must not show it
    every_byte = "".join(f"%{b:02X}" for b in KEYS[1].encode())
    for query in (f"?api%5Fkey={KEYS[1].replace('-', '%2D')}", f"?api%5Fkey={every_byte}", f"?other={every_byte}"):
        with connect(ws_url(keyed, query), additional_headers={"Authorization": f"Bearer {KEYS[1]}"}) as conn:
            conn.send(json.dumps({"type": "nothing"}))
            recv(conn)
    expected = {("/v1/ws", 101), ("/v1/ws", 401), ("/{path:path}", 404), ("/v1/models", 200), ("/v1/models", 401)}

    def logged() -> list[dict]:  # a request's line is written after its response
        lines = [json.loads(line.split("txlserve.requests: ", 1)[1]) for line in keyed.log.read_text().splitlines()
                 if "txlserve.requests: " in line]
        return lines if {(x["route"], x["status"]) for x in lines} >= expected else []

    lines = wait_for(logged, 10, f"request log lines for {sorted(expected)}")  # the lines are there
    log = keyed.log.read_text()
    assert all(isinstance(x["status"], int) for x in lines)  # a WebSocket's too (it was a phrase)
    assert all("?" not in str(x["route"]) for x in lines)  # a route, never a query string
    for secret in (*KEYS, "wrong-key-789"):
        assert secret not in log
    assert every_byte not in log and KEYS[1].replace("-", "%2D") not in log


def test_a_websocket_takes_its_key_as_a_subprotocol(keyed):
    """What a page's WebSocket can send (no header of its own): ``txlserve`` and ``txlserve.api-key.`` + the key in
    base64url, as the playground sends it. Its ``?api_key=`` went into nginx's error log with every failed upstream
    (found by a helper)."""
    import base64

    from websockets.exceptions import InvalidStatus

    def offer(key: bytes) -> list[str]:
        return ["txlserve", "txlserve.api-key." + base64.urlsafe_b64encode(key).decode().rstrip("=")]

    with connect(ws_url(keyed), subprotocols=offer(KEYS[0].encode())) as conn:
        assert conn.subprotocol == "txlserve"  # a browser fails a connection whose offer had none chosen
        conn.send(json.dumps({"type": "completion.create", **OK}))
        while recv(conn)["type"] == "completion.delta":
            pass
    for bad in (offer(b"wrong-key-789"), ["txlserve", "txlserve.api-key.%%%"], ["txlserve", "txlserve.api-key.__8"],
                ["txlserve", "txlserve.api-key.a2V5+A"]):  # "+": base64, not base64url (was decoded)
        with pytest.raises(InvalidStatus, match="401") as info:
            connect(ws_url(keyed), subprotocols=bad).close()
        if "%%%" in bad[1]:  # said as what it is, not read as an empty key
            assert b"not base64url" in info.value.response.body
    with pytest.raises(InvalidStatus, match="400") as info:  # the key alone: none the server could choose
        connect(ws_url(keyed), subprotocols=offer(KEYS[0].encode())[1:]).close()
    assert b"'txlserve'" in info.value.response.body
    with connect(ws_url(keyed), additional_headers={"Authorization": f"Bearer {KEYS[0]}"}) as conn:
        assert conn.subprotocol is None  # none offered, none chosen


def test_a_server_without_keys_reads_no_key_from_a_subprotocol(server):
    """As it ignores an Authorization header: a page's stale key was a 401 there (a reviewer's)."""
    with connect(ws_url(server), subprotocols=["txlserve", "txlserve.api-key.__8"]) as conn:
        assert conn.subprotocol == "txlserve"
    from websockets.exceptions import InvalidStatus
    with pytest.raises(InvalidStatus, match="400"):  # the key alone, keys or not: none could be chosen
        connect(ws_url(server), subprotocols=["txlserve.api-key.aw"]).close()


@pytest.mark.parametrize("key", ["\u00e9", "k\u00e9y-alpha-123", "\u20ac"])
def test_a_non_ascii_key_is_401_not_500(keyed, key):
    """hmac.compare_digest refuses str with non-ASCII characters: such a key was a 500 and a reset connection."""
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=30) as sock:
        for _ in range(2):  # the keep-alive connection survives the refusal
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + key.encode()
                         + b"\r\n\r\n")
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                chunk = sock.recv(4096)
                assert chunk, reply
                reply += chunk
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 401"), reply
            assert json.loads(body)["error"]["type"] == "authentication_error"
    for query in ("?api_key=%C3%A9", "?api_key=%FF", "?api_key=%ED%A0%80"):
        with pytest.raises(Exception, match="401"):
            connect(ws_url(keyed, query)).close()
    assert "Traceback" not in keyed.log.read_text()


def test_a_redis_password_never_reaches_a_log_or_a_response(checkpoint, tmp_path):
    """redis-py takes a password from the URL's query as well as from its user part; only the user part was
    masked, so ``?password=`` showed in the start-up line, in stderr and in every 503 body, /ready's included."""
    from tests.conftest import RedisProcess

    secret = "S3cret-redis-pw"
    r = _serve("--redis-url", f"redis://127.0.0.1:1/0?password={secret}", "--data-dir", str(tmp_path / "none"))
    assert r.returncode == 2 and "unavailable" in r.stderr and secret not in r.stderr + r.stdout, r.stderr
    assert "txlserve: loaded" not in r.stderr  # refused before the model loaded (MemoryStore.check_reachable)
    redis_proc = RedisProcess(tmp_path / "redis", password=secret).start()
    srv = LiveServer(checkpoint, redis_url=f"redis://127.0.0.1:{redis_proc.port}/0?db=0&password={secret}",
                     data_dir=tmp_path / "srv")
    try:
        srv.start()
        assert httpx.post(srv.url + "/v1/completions", json=OK, timeout=60).status_code == 200
        redis_proc.stop()
        bodies = [httpx.get(srv.url + "/ready", timeout=30), httpx.get(srv.url + "/v1/sessions", timeout=30),
                  httpx.post(srv.url + "/v1/sessions", json={"text": "x"}, timeout=30)]
        assert [b.status_code for b in bodies] == [503, 503, 503], [b.text for b in bodies]
        assert all(secret not in b.text and f"127.0.0.1:{redis_proc.port}" in b.text for b in bodies[1:])
        # the open /ready names no address (the log says why): a probe answered who to attack (found by a helper)
        assert f":{redis_proc.port}" not in bodies[0].text and bodies[0].json()["error"]["code"] == "store_unavailable"
        assert "does not answer" in bodies[0].json()["error"]["message"]
    finally:
        srv.stop()
        redis_proc.stop()
    log = srv.log.read_text()
    assert f"Redis at redis://127.0.0.1:{redis_proc.port}/0" in log and secret not in log
    assert log.count("txlserve.health: not ready: ") == 1  # once for the cause, not once per probe


@pytest.mark.parametrize("text", [
    "GET /v1/ws?api_key=sk-secret-1", "/v1/ws?api%5Fkey=sk%2Dsecret%2D1", "/x?a=1&Password=hunter2&b=2",
    "/x?other=%73%6B%2Dsecret%2D1", "Bearer sk-secret-1", "redis://h:1/0?password=hunter2",
    "/v1/ws?api_key=k'ey#sk-secret-1", "GET /v1/ws?api_key=wrong'KEYsecret7 HTTP/1.1", "/v1/ws?token=a#secret",
])
def test_the_log_filter_masks_every_form_of_a_secret(text):
    from server.serve import Redact

    masked = Redact(("sk-secret-1", "k'ey#sk-secret-1")).redact(text)
    assert "secret" not in masked and "hunter2" not in masked and "ey#" not in masked and "***" in masked, masked


@pytest.mark.parametrize("text", [
    '"WebSocket /v1/ws?api_key=sk-Q"zx%2Fwv%2Byu" [accepted]',  # uvicorn's line, the key partly encoded
    '"WebSocket /v1/ws?api_key="sk-Q"zx/wv+y"" 401',  # a quoted near miss
    '"WebSocket /v1/ws/sk-Q%22zx/wv%2Byu" 404',  # the key in a path, as uvicorn's line quotes it
    '"WebSocket /v1/ws/sk-Q%22zx%2Fwv%2Byu" 404',
    '{"method": "WEBSOCKET", "route": "/v1/ws/sk-Q\\"zx/wv+yu", "status": 404}',  # a JSON line's escape
    '{"route":"/v1/ws?api_key=sk-Q\\"zx/wv+yu","status":401}',
])
def test_the_log_filter_masks_a_key_that_holds_a_quote(text):
    """A " ended a query value, so the rest of a key holding one stayed in uvicorn's line; and a key in a path
    was logged percent-encoded or JSON-escaped, forms the whole-key replacement did not know (found by a helper)."""
    from server.serve import Redact

    masked = Redact(('sk-Q"zx/wv+yu',)).redact(text)
    assert not any(part in masked for part in ("zx", "wv", "yu")) and "***" in masked, masked
    assert masked[-5:] == text[-5:] and masked[:10] == text[:10], masked  # the line around it kept


def test_a_key_logged_by_any_logger_or_in_a_traceback_is_masked():
    """The filter sat on six named loggers, which records propagated from their children (memory_store, redis,
    asyncio) pass by, and masked a message but not its traceback (found by a helper)."""
    import io
    import logging

    from server.serve import install_redaction
    from server.settings import Settings
    root, out = logging.getLogger(), io.StringIO()
    handler = logging.StreamHandler(out)
    root.addHandler(handler)
    loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "txlserve",
                                                     "txlserve.requests", "")]
    filtered = loggers + [h for lg in loggers for h in lg.handlers]
    kept = {id(x): list(x.filters) for x in filtered}
    try:
        install_redaction(Settings(api_keys=("sk-secret-1",)))
        logging.getLogger("memory_store.h4").error("a key in a message: %s", "sk-secret-1")
        try:
            raise ValueError("Authorization: Bearer sk-secret-1")
        except ValueError:
            logging.getLogger("redis.h4").exception("a key in a traceback")
    finally:
        for x in filtered:  # as they were, for the other tests
            x.filters[:] = kept.get(id(x), [])
        root.removeHandler(handler)
    text = out.getvalue()
    assert "a key in a message" in text and "Traceback" in text and "ValueError" in text, text
    assert "sk-secret-1" not in text and "ValueError: Authorization: Bearer ***" in text, text


def test_the_log_filter_leaves_other_queries_alone():
    from server.serve import Redact

    assert Redact(("sk-secret-1",)).redact("/v1/sessions?limit=5&after=1.abc") == "/v1/sessions?limit=5&after=1.abc"


def test_redis_urls_lose_their_credentials():
    from memory_store.redis_tier import redact_url

    assert redact_url("redis://user:pw@h:1/2?password=x&db=3") == "redis://h:1/2"
    assert redact_url("rediss://:pw@h/0") == "rediss://h/0"
    assert redact_url("unix:///run/r.sock?db=0&password=x") == "unix:///run/r.sock"
    assert redact_url("redis+cluster://a:b@h:7000?password=x") == "redis+cluster://h:7000"
    assert redact_url("redis://h:notaport/0?password=x") in ("redis://h:notaport/0", "<unparseable Redis URL>")


def test_a_refused_websocket_logs_no_error(keyed):
    """uvicorn logs "returned without completing handshake" after every denial response: one ERROR per 401."""
    with pytest.raises(Exception, match="401"):
        connect(ws_url(keyed, "?api_key=nope")).close()
    httpx.get(keyed.url + "/health")
    assert "without completing handshake" not in keyed.log.read_text()


def test_empty_or_whitespace_keys_never_authenticate(keyed):
    for header in (b"Bearer ", b"Bearer  ", b"Bearer \x01", b"Bearer \t", b"bearer"):
        with socket.create_connection(("127.0.0.1", keyed.port), timeout=30) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nAuthorization: " + header
                         + b"\r\n\r\n")
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
        assert reply.startswith((b"HTTP/1.1 401", b"HTTP/1.1 400")), (header, reply)
    with pytest.raises(Exception, match="401"):
        connect(ws_url(keyed, "?api_key=")).close()


def _log_line(srv, request_id: str) -> dict:
    """The request log's line for ``request_id``, waited for (it is written when the request's handling ends)."""
    line = wait_for(lambda: next((x for x in srv.log.read_text().splitlines() if f'"request_id":"{request_id}"' in x),
                                 None), 20, f"the log line of request {request_id}")
    return json.loads(line[line.index("{"):])


def test_a_body_that_stops_arriving_is_408(keyed):
    sock = socket.create_connection(("127.0.0.1", keyed.port), timeout=30)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"X-Request-Id: stalled-body-408\r\n"
                     b"Authorization: Bearer " + KEYS[0].encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"model\":")
        t0 = time.monotonic()
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
        assert time.monotonic() - t0 < 25
    finally:
        sock.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert httpx.get(keyed.url + "/health").status_code == 200
    # the log line and the requests metric say what the client got (they said 400: the app's answer to a body
    # cut short, which the limit dropped)
    assert _log_line(keyed, "stalled-body-408")["status"] == 408
    metrics = httpx.get(keyed.url + "/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}).text
    assert re.search(r'^txlserve_requests_total\{route="/v1/completions",status="408"\} [1-9]', metrics, re.M)


def test_a_body_declared_too_large_is_logged_as_413(keyed):
    """Refused before any route runs: it had no log line at all."""
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"X-Request-Id: declared-too-large\r\nConnection: close\r\n"
                     b"Authorization: Bearer " + KEYS[0].encode() + b"\r\nContent-Length: 1099511627776\r\n\r\n")
        reply = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 413") and b"x-request-id: declared-too-large" in reply.lower(), reply
    line = _log_line(keyed, "declared-too-large")
    assert line["status"] == 413 and line["method"] == "POST"
    assert line["route"] == "/v1/completions"  # the route its path would have reached (it said "unmatched")


def _read_until_closed(sock: socket.socket) -> bytes:
    reply = b""
    while chunk := sock.recv(4096):  # the socket's own timeout bounds each wait
        reply += chunk
    return reply


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"])
def test_headers_that_never_complete_are_408_and_closed(keyed, sent):
    """uvicorn keeps a connection that never finishes its headers open for ever (slowloris): each one now gets
    the body's deadline (1.5 s here) to send them; one that sent nothing is closed without a word."""
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=30) as sock:
        sock.sendall(sent)
        t0 = time.monotonic()
        reply = _read_until_closed(sock)
        assert time.monotonic() - t0 < 25
    if not sent:
        assert reply == b""
        return
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply
    assert json.loads(body)["error"]["code"] == "request_timeout"


@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n",
    b"NOT A REQUEST LINE AT ALL\r\n\r\n",
    b"GET /\xff HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
])
def test_unparseable_http_is_400_in_openai_shape(keyed, request_bytes):
    """uvicorn answers what it cannot parse itself, in text/plain: now in the same shape as every other error."""
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=30) as sock:
        sock.sendall(request_bytes)
        reply = _read_until_closed(sock)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, reply
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(keyed.url + "/health").status_code == 200


def test_a_keep_alive_connection_gets_a_new_header_deadline_after_each_response(keyed):
    request = (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=30) as sock:
        for _ in range(3):  # 1.8 s in all, past one 1.5 s deadline; each gap leaves 0.9 s to spare on a busy machine
            sock.sendall(request)
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                reply += sock.recv(4096)
            assert reply.startswith(b"HTTP/1.1 200"), reply
            time.sleep(0.6)  # bounded: the pacing under test
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # then half a request, and nothing more
        assert _read_until_closed(sock).startswith(b"HTTP/1.1 408")


def test_a_pipelined_request_is_not_cut_by_the_header_deadline(keyed):
    """Two requests in one write: the second one's cycle starts as the first response completes, and must not be
    mistaken for a connection that never sent its next headers."""
    body = json.dumps({**OK, "max_tokens": 4000}).encode()  # runs past the first response's deadline
    slow = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEYS[0].encode() + b"\r\nContent-Length: " + str(len(body) + 1).encode()
            + b"\r\n\r\n" + body)
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" + slow)  # the second body is one byte short
        first = b""
        while b"\r\n\r\n" not in first or not first.rstrip().endswith(b"}"):  # the first response, whole: the
            first += sock.recv(4096)  # deadline armed as it ended then comes while the second request still runs
        sock.sendall(b" ")
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        reply = first + _read_until_closed(sock)
    assert reply.count(b"HTTP/1.1 200") == 3 and b"HTTP/1.1 408" not in reply, reply  # not "408": ids are random hex


def test_a_websocket_outlives_the_header_deadline(keyed):
    """The WebSocket opens first; a connection opened after it, its headers half sent, is closed with 408 when its
    own deadline passes: by then the WebSocket's deadline has passed too (the event shows it, not a guessed sleep),
    and the WebSocket must still serve."""
    with connect(ws_url(keyed), additional_headers={"Authorization": f"Bearer {KEYS[0]}"}) as conn, \
            socket.create_connection(("127.0.0.1", keyed.port), timeout=30) as later:
        later.sendall(b"GET /health HTTP/1.1\r\n")
        assert _read_until_closed(later).startswith(b"HTTP/1.1 408")
        conn.send(json.dumps({"type": "completion.create", **OK}))
        while (event := recv(conn))["type"] == "completion.delta":
            pass
        assert event["type"] == "completion.done", event


def test_a_slow_but_steady_body_is_not_cut(keyed):
    body = json.dumps({**OK}).encode()
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEYS[0].encode() + b"\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n")
        for i in range(0, len(body), 8):  # each piece well inside the 1.5 s timeout, the whole longer
            sock.sendall(body[i:i + 8])
            time.sleep(0.3)  # bounded: the pacing under test
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 200"), reply


# -- start-up errors are one line ----------------------------------------------------------------------------

def _serve(*args: str, env: dict | None = None, timeout: float = 60):
    import os
    import subprocess
    import sys

    from tests.live import REPO
    # --port 0 first (a case's own --port comes later and wins): never the default 8000, which a server a user
    # started from the README may hold while the tests run
    return subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", "0", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.parametrize("args,env,needle", [
    (("--api-keys", "good", ""), {}, "API key"),
    (("--api-keys",), {}, "--api-keys"),
    ((), {"TXLSERVE_API_KEYS": "good,,other"}, "API key"),
    (("--checkpoint", "/nope/nothing"), {}, "/nope/nothing"),
    (("--threads", "0"), {}, "threads"),
    (("--threads", "100000"), {}, "from 1 to 1024"),
    (("--port", "70000"), {}, "--port must be"),
    (("--device", "tpu"), {}, "--device must be"),
    (("--log-level", "verbose"), {}, "--log-level must be one of"),
    (("--hot-cache-mb", "-5"), {}, "--hot-cache-mb must be >= 0"),
    (("--model-name", ""), {}, "--model-name must be"),
    ((), {"TXLSERVE_MODEL_NAME": " padded "}, "TXLSERVE_MODEL_NAME must be"),
    (("--store-timeout-s", "0"), {}, "--store-timeout-s must be > 0"),
    (("--max-prompt-bytes", "0"), {}, "--max-prompt-bytes must be >= 1"),
    ((), {"TXLSERVE_STREAM_INTERVAL": "0"}, "TXLSERVE_STREAM_INTERVAL must be"),
    (("--api-keys", "k\u00e9y-123"), {}, "ASCII"),
    ((), {"TXLSERVE_SHUTDOWN_TIMEOUT_S": "inf"}, "TXLSERVE_SHUTDOWN_TIMEOUT_S must be a finite"),
    (("--mem-len", "2000000"), {}, "--mem-len must be at most"),
    (("--clamp-len", str(10**20)), {}, "--clamp-len must be at most"),  # a traceback from the engine process
    (("--session-ttl-s", str(10**17)), {}, "--session-ttl-s must be at most"),  # then every session call a 503
    ((), {"TXLSERVE_LEASE_TTL_MS": str(10**22)}, "TXLSERVE_LEASE_TTL_MS must be at most"),
    (("--prefill-products", "mkl"), {}, "--prefill-products must be"),
    (("--loop", "trio"), {}, "--loop must be"),
    ((), {"TXLSERVE_HTTP": "h2"}, "TXLSERVE_HTTP must be"),
    ((), {"TXLSERVE_SWITCH_INTERVAL_MS": "0"}, "TXLSERVE_SWITCH_INTERVAL_MS must be"),
    (("--workers", "0"), {}, "--workers must be >= 1"),
    (("--redis-url", "redis://:s3cr/et@127.0.0.1:1/0"), {}, "percent-encode"),  # a raw "/" in the password
    (("--redis-url", "http://127.0.0.1:6379"), {}, "must start with redis://"),
    (("--redis-url", "redis://127.0.0.1:99999"), {}, "port is a number from 1 to 65535"),
    (("--redis-url", "redis+cluster://127.0.0.1:7000/1"), {}, "a cluster has only database 0"),
])
def test_serve_refuses_bad_settings_in_one_line(args, env, needle, tmp_path: Path):
    r = _serve(*args, "--data-dir", str(tmp_path), env=env)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 3, r.stderr
    assert "s3cr" not in r.stderr + r.stdout  # no part of a password


def test_variables_the_server_does_not_read_are_named():
    """TXLSERVE_API_KEY (the client's) on a server left it open to everyone without a word, and a misspelt
    setting was dropped silently (found by a helper)."""
    from server.settings import Settings, stray_variables
    open_server = stray_variables(Settings(), {"TXLSERVE_API_KEY": "k1", "TXLSERVE_MAX_BACH": "8",
                                               "TXLSERVE_BASE_URL": "http://x", "TXLSERVE_MAX_BATCH": "8"})
    assert len(open_server) == 2 and "TXLSERVE_API_KEYS" in open_server[0] and "requires no API key" in open_server[0]
    assert "TXLSERVE_MAX_BACH is not a setting" in open_server[1]
    assert stray_variables(Settings(api_keys=("k1",)), {"TXLSERVE_API_KEY": "k1"}) == []  # the client beside it


def test_the_model_name_defaults_to_the_checkpoint_s_directory(tmp_path: Path):
    """Every checkpoint had been served as txl-shakespeare-small, so /v1/models named the bundled model while a
    WikiText-103 one answered."""
    from server.settings import Settings
    assert Settings().model_name == "txl-shakespeare-small"  # the bundled one's, as before
    assert Settings(checkpoint=str(tmp_path / "wt103") + "/").model_name == "txl-wt103"
    assert Settings(checkpoint=str(tmp_path / "txl-big")).model_name == "txl-big"  # not txl-txl-big
    assert Settings(checkpoint="/").model_name == "txl-model"
    assert Settings(checkpoint=str(tmp_path / ("x" * 255))).model_name == "txl-" + "x" * 252  # within the limit
    assert Settings.from_env({"TXLSERVE_MODEL_NAME": "mine"}, checkpoint=str(tmp_path)).model_name == "mine"
    assert Settings(checkpoint="wt103").replace(port=1).model_name == "txl-wt103"


@pytest.mark.parametrize("argv,needle", [
    (["serve", "--port", "70000"], "port"),
    (["serve", "--port", "0", "--checkpoint", "/nope/nothing"], "does not exist"),
    (["serve", "--api-keys", " "], "API key"),
    (["serve", "--port", "0", "--redis-url", "redis://:s3cr/et@h:99999/0"], "could not be parsed"),
    # the embedded Redis's data dir named, at once (a file there was "File exists", after the model loaded)
    (["serve", "--port", "0", "--data-dir", "README.md"], "README.md cannot hold the embedded Redis: it is a file"),
    (["serve", "--port", "0", "--host", "192.0.2.1"], "(check --host)")])  # not this machine's: not the port's fault
def test_a_bad_setting_is_refused_before_torch_loads(argv, needle, tmp_path):
    """And leaves no embedded Redis's directory behind (./.txlserve, empty, was made before the checkpoint and the
    address were checked)."""
    import os
    import subprocess
    import sys

    from tests.live import REPO
    (tmp_path / "README.md").write_text("a file")
    code = f"import sys; from server.cli import main; rc = main({argv!r}); print(rc, 'torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.stdout.split() == ["2", "False"], (r.stdout, r.stderr)
    assert r.stderr.startswith("txlserve: error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert needle in r.stderr, r.stderr
    assert not (tmp_path / ".txlserve").exists()


@pytest.mark.parametrize("why", ["a Hugging Face directory", "a device this machine lacks"])
def test_a_start_refused_once_the_model_loads_leaves_no_data_dir(why, tmp_path):
    """A device or a checkpoint's kind is found out only as the model loads, after the data dir was made: an empty
    ./.txlserve stayed behind (found by a helper). One that was there already stays."""
    import torch
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "transfo-xl"}')
    if why == "a device this machine lacks" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    args = ("--checkpoint", str(hf)) if why.startswith("a Hugging") else ("--device", "cuda")
    for data_dir, kept in ((tmp_path / "new" / "data", False), (tmp_path / "hf", True)):
        r = _serve(*args, "--data-dir", str(data_dir))
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert data_dir.exists() == kept and (tmp_path / "new").exists()  # only the directory it made


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "A", "--device", "banana"], ["generate", "--prompt", "A", "--mem-len", "100000000"],
    ["generate", "--prompt", "A", "--top-k", "-1"], ["train", "--data", "x", "--out", "y", "--lr", "nan"],
    ["train", "--data", "x", "--out", "y", "--grad-accum", "0"],
    ["train", "--data", "x", "--out", "y", "--steps", "-1"],
    ["eval", "--checkpoint", "x", "--data", "y", "--batch-size", "0"],
    ["eval", "--checkpoint", "x", "--data", "y", "--max-tokens", "-5"],
    ["bench", "decode", "--batch", "0"], ["bench", "decode", "--shape", "abc"], ["bench", "decode", "--tokens", "0"],
    ["bench", "serve", "--concurrency", "0"], ["bench", "serve", "--duration", "0"],
    ["bench", "store", "--iters", "0"], ["bench", "store", "--tiers", "banana"], ["bench", "scale", "--tokens", "0"],
    ["bench", "decode", "--threads", "100000"],  # a segfault in torch's thread pool (found by a helper)
    ["generate", "--threads", "0", "--prompt", "x"], ["generate", "--threads", "100000", "--prompt", "x"],
    ["eval", "--threads", "0", "--checkpoint", "x", "--data", "x"],
    ["bench", "scale", "--threads", "100000"], ["bench", "store", "--tiers", "hot", "--threads", "100000"],
])
def test_a_bad_number_or_device_is_one_line_from_argparse(argv, capsys):
    """Each had been a traceback from inside torch, the optimizer or the benchmark (found by a helper)."""
    from server.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.strip().splitlines()) == 1 and "error: argument --" in err, err


@pytest.mark.parametrize("argv", [["generate", "--prompt", "x", "--device", "mps"],
                                  ["eval", "--checkpoint", "x", "--data", "x", "--device", "xpu"],
                                  ["generate", "--prompt", "x", "--device", "cuda:7"] if torch.cuda.is_available()
                                  else ["generate", "--prompt", "x", "--device", "cuda"]])
def test_a_device_this_torch_or_machine_lacks_is_one_line(argv, capsys):
    """mps and xpu passed the flag's check and ended in torch's traceback (found by a helper)."""
    from server.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("txlserve: error: --device ") and len(err.strip().splitlines()) == 1, err


def test_settings_too_large_for_memory_are_one_line(monkeypatch, capsys):
    """torch's allocators raise RuntimeError (a --tgt-len or --batch far too large), which came out as a
    traceback: a real allocation that cannot succeed, raised where a command's would be."""
    import server.cli as cli

    monkeypatch.setattr(cli, "_cmd_generate", lambda ns: torch.empty(1 << 50, dtype=torch.uint8))
    assert cli.main(["generate", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "not enough memory for these settings" in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.setattr(cli, "_cmd_generate", lambda ns: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):  # any other RuntimeError is still a bug, shown as one
        cli.main(["generate", "--prompt", "x"])


def test_generate_into_a_full_disk_is_one_line_and_stops_its_engine(checkpoint, monkeypatch, capsys):
    """The prompt's echo was written before the engine's thread was in the try that stops it: a full disk ended in
    an abort at exit (SIGABRT, "terminate called without an active exception")."""
    import errno
    import threading

    from server.cli import main

    class Full:
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stdout", Full())
    assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", "x", "--max-tokens", "2"]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert not [t for t in threading.enumerate() if t.name == "txlserve-engine"]


def test_log_levels_are_read_in_any_case():
    from server.settings import Settings

    assert Settings.from_env({"TXLSERVE_LOG_LEVEL": "WARNING"}).log_level == "warning"


@pytest.mark.parametrize("env, says", [
    ({"TXLSERVE_MEM_LEN": "abc"}, "TXLSERVE_MEM_LEN='abc' is not a whole number (or empty, for the default)"),
    ({"TXLSERVE_MAX_BATCH": "1.5"}, "TXLSERVE_MAX_BATCH='1.5' is not a whole number"),
    ({"TXLSERVE_SHUTDOWN_TIMEOUT_S": "soon"}, "TXLSERVE_SHUTDOWN_TIMEOUT_S='soon' is not a number"),
    ({"TXLSERVE_ENGINE_PROCESS": "maybe"}, "TXLSERVE_ENGINE_PROCESS='maybe' is not true or false"),
])
def test_an_environment_value_of_the_wrong_kind_says_what_it_should_be(env, says):
    """It said "is not a valid int | None": the Python type of the field."""
    from server.settings import Settings
    from txlserve.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        Settings.from_env(env)
    assert str(err.value).startswith(says) and "|" not in str(err.value), err.value


@pytest.mark.parametrize("env, flags, says", [
    ({"TXLSERVE_MAX_BATCH": "0"}, {}, "TXLSERVE_MAX_BATCH must be >= 1, not 0"),
    ({"TXLSERVE_MAX_BATCH": "0"}, {"max_batch": 2, "max_queue": 0}, "--max-queue must be >= 1, not 0"),
    ({}, {"session_ttl_s": -1}, "--session-ttl-s must be >= 0, not -1"),
    ({"TXLSERVE_LOG_LEVEL": "loud"}, {}, "TXLSERVE_LOG_LEVEL must be one of debug"),
    ({"TXLSERVE_COLD_SWEEP_S": "0"}, {}, "TXLSERVE_COLD_SWEEP_S must be > 0, not 0.0"),
    ({"TXLSERVE_THREADS": "2000"}, {}, "TXLSERVE_THREADS must be from 1 to"),
    ({"TXLSERVE_STORE_TIMEOUT_S": "inf"}, {}, "TXLSERVE_STORE_TIMEOUT_S must be a finite number, not inf"),
])
def test_a_setting_out_of_range_is_named_as_it_was_given(env, flags, says):
    """As the flag or the variable that gave it: a bad TXLSERVE_MAX_BATCH said "max_batch must be >= 1", a name
    the user had written nowhere (found by a helper)."""
    from server.settings import Settings
    from txlserve.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        Settings.from_env(env, **flags)
    assert str(err.value).startswith(says), err.value


def test_an_empty_environment_variable_is_an_unset_one():
    """A compose file passes a variable it was not given as an empty one: an empty TXLSERVE_ENGINE_PROCESS turned
    the engine process off (its default is on), and an empty TXLSERVE_PORT was refused (found by a helper)."""
    from server.settings import Settings

    default = Settings()
    given = Settings.from_env({"TXLSERVE_ENGINE_PROCESS": "", "TXLSERVE_PORT": " ", "TXLSERVE_API_KEYS": "",
                               "TXLSERVE_MEM_LEN": "", "TXLSERVE_SHUTDOWN_TIMEOUT_S": ""})
    assert given == default and given.engine_process is True


@pytest.mark.parametrize("env, flags", [({"TXLSERVE_API_KEYS": "kA kB"}, {}), ({}, {"api_keys": ("kA,kB",)})])
def test_api_keys_listed_in_the_other_forms_separator_are_refused(env, flags):
    """Spaces in the variable, or commas after the flag, made one key of two, and locked every client out without a
    word (found by a helper)."""
    from server.settings import Settings
    from txlserve.errors import ConfigError

    with pytest.raises(ConfigError, match="may not hold a space or a comma"):
        Settings.from_env(env, **flags)
    assert Settings.from_env({"TXLSERVE_API_KEYS": "kA, kB"}).api_keys == ("kA", "kB")


def test_enforce_eager_is_a_flag_and_an_environment_variable():
    from server.cli import build_parser
    from server.settings import Settings
    from txlserve.errors import ConfigError

    assert build_parser().parse_args(["serve", "--enforce-eager"]).enforce_eager is True
    assert build_parser().parse_args(["serve"]).enforce_eager is None  # then the environment decides
    assert build_parser().parse_args(["serve", "--no-enforce-eager"]).enforce_eager is False
    assert Settings.from_env({"TXLSERVE_ENFORCE_EAGER": "true"}, enforce_eager=False).enforce_eager is False
    assert Settings.from_env({}).enforce_eager is False
    assert Settings.from_env({"TXLSERVE_ENFORCE_EAGER": "true"}).enforce_eager is True
    assert Settings.from_env({"TXLSERVE_ENFORCE_EAGER": "0"}, enforce_eager=True).enforce_eager is True
    with pytest.raises(ConfigError, match="TXLSERVE_ENFORCE_EAGER"):
        Settings.from_env({"TXLSERVE_ENFORCE_EAGER": "maybe"})
    # a flag wins over its variable, read or not: TXLSERVE_PORT=abc with --port 8961 stopped the server
    # (found by a helper)
    assert Settings.from_env({"TXLSERVE_PORT": "abc"}, port=8961).port == 8961
    with pytest.raises(ConfigError, match="TXLSERVE_PORT"):
        Settings.from_env({"TXLSERVE_PORT": "abc"})


def test_a_port_in_use_is_reported_before_the_model_loads(tmp_path: Path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        # a checkpoint that does not exist: the port must be refused first, before anything is loaded
        r = _serve("--port", str(port), "--checkpoint", "/nope/nothing", "--data-dir", str(tmp_path))
    assert r.returncode == 2 and f"{port}" in r.stderr and "in use" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # a txlserve still loading holds its port bound, not listening, and claimed: two such sockets with SO_REUSEADDR
    # share a port, so a second server loaded beside the first until one of them failed to listen (found by a review)
    from server.listen import HOLDS_PORT, bind, claim_port

    if HOLDS_PORT:
        loading = bind("127.0.0.1", 0, listen=False)
        port = loading.getsockname()[1]
        claim = claim_port(port)
        try:
            r = _serve("--port", str(port), "--checkpoint", "/nope/nothing", "--data-dir", str(tmp_path))
        finally:
            claim.close()
            loading.close()
        assert r.returncode == 2 and f"{port}" in r.stderr and "in use" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_serve_help_describes_every_option():
    from server.settings import Settings

    r = _serve("--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for name in Settings.__dataclass_fields__:
        assert f"TXLSERVE_{name.upper()}" in text, name
    assert "checkpoints/shakespeare-small" in text


def test_docs_work_offline(server):
    """Swagger UI's page names only assets this server serves (no CDN), each relative to the page (behind a prefix
    proxy, absolute ones missed it: tests/test_playground.py tries that), and each of them loads."""
    page = httpx.get(server.url + "/docs")
    assert page.status_code == 200 and "swagger" in page.text.lower()
    urls = re.findall(r"""(?:src|href)=["']([^"']+)["']|fetch\(["']([^"']+)["']\)""", page.text)
    urls = [a or b for a, b in urls]
    assert len(urls) == 4 and "openapi.json" in urls, urls
    assert not [u for u in urls if u.startswith(("http:", "https:", "/"))], urls
    for url in urls:
        r = httpx.get(urljoin(server.url + "/docs", url))
        assert r.status_code == 200 and len(r.content) > 100, url
    assert page.headers["x-frame-options"] == "DENY"  # its Execute buttons, framed by another site, as the page's
    slash = httpx.get(server.url + "/docs/")  # a JSON 404 had named /docs, the root's even behind a prefix proxy
    assert slash.status_code == 307 and slash.headers["location"] == "../docs"


def test_every_example_body_in_the_docs_is_served(server):
    """The docs' "Try it out" made its own bodies from the schemas, which the server refused (a seed of -2^63 past
    its bound once JavaScript rounded it; "model": "string"): each operation's example is a request it takes."""
    doc = httpx.get(server.url + "/openapi.json").json()
    sid = httpx.post(server.url + "/v1/sessions", json={"text": "x"}).json()["id"]
    examples = {(path, method): op["requestBody"]["content"]["application/json"]["example"]
                for path, item in doc["paths"].items() for method, op in item.items()
                if "example" in op.get("requestBody", {}).get("content", {}).get("application/json", {})}
    assert {"/v1/completions", "/v1/sessions", "/v1/sessions/{session_id}"} <= {p for p, _ in examples}
    for (path, method), body in examples.items():
        r = httpx.request(method.upper(), server.url + path.replace("{session_id}", sid), json=body, timeout=60)
        assert r.status_code < 300, (path, r.text)
    assert "SwaggerUIBundle" in httpx.get(server.url + "/docs/static/swagger-ui-bundle.js").text



def test_connections_accepted_by_serve_have_nagle_off():
    """serve binds its socket itself; connections accepted from it must get TCP_NODELAY as asyncio's own
    sockets do (with Nagle on, each kept-alive response waited ~40 ms for the client's delayed ACK)."""
    import asyncio

    from server.listen import bind

    async def main() -> int:
        sock = bind("127.0.0.1", 0)
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        async def handler(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handler, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            try:
                return await asyncio.wait_for(accepted, 30)
            finally:
                writer.close()

    assert asyncio.run(main()) == 1


def test_bench_load_generator_streams_over_one_connection_and_reports_errors(server):
    """The bench's own HTTP client: tokens and usage of a stream, keep-alive between requests, a refused
    request as an error with its status, and only plain http://."""
    import asyncio
    import contextlib

    from bench.serve import _Connection, _stream

    async def go() -> tuple:
        async with _Connection(server.url, MODEL, timeout=60) as conn:
            first = await _stream(conn, {"prompt": "Once", "max_tokens": 5, "temperature": 0}, arrivals_of_tokens=True)
            writer = conn.writer
            second = await _stream(conn, {"prompt": "Once", "max_tokens": 3, "temperature": 0})
            reused = conn.writer is writer
            async with contextlib.aclosing(conn.events({"model": MODEL, "prompt": "Once", "max_tokens": 20,
                                                        "stream": True})) as events:
                async for _ in events:
                    break  # a caller that stops reading leaves a body half read: that connection is dropped
            dropped = conn.writer is None
            third = await _stream(conn, {"prompt": "Once", "max_tokens": 2, "temperature": 0})
            conn.writer.transport.abort()  # a kept-alive connection that went away meanwhile is replaced
            fourth = await _stream(conn, {"prompt": "Once", "max_tokens": 2, "temperature": 0})
            bad = _Connection(server.url, "no-such-model", timeout=60)
            async with bad:
                with pytest.raises(RuntimeError, match="404"):
                    await _stream(bad, {"prompt": "x", "max_tokens": 1})
        return first, second, reused, dropped, third, fourth

    (ttft, gaps, n, arrivals), second, reused, dropped, third, fourth = asyncio.run(go())
    assert n == 5 and len(arrivals) == 5 and ttft > 0 and len(gaps) <= 4
    assert second[2] == 3 and reused and dropped and third[2] == 2 and fourth[2] == 2
    with pytest.raises(ValueError, match="http://"):
        _Connection("https://example.com", MODEL)


def test_bench_counts_each_token_of_a_chunk_that_carries_several():
    """A chunk carries the tokens waiting when it was written: the load generator counts each by its ids
    (``return_token_ids``, asked for), all arrived with their chunk, and times the gaps between chunks. A server
    of our own seam (canned events over a real socket) writes a chunk of one token, then one of three."""
    import asyncio

    from bench.serve import _Connection, _stream

    asked: list[dict] = []

    def event(text: str, ids: list[int] | None, finish: str | None = None, usage: int | None = None) -> bytes:
        choice = {"index": 0, "text": text, "finish_reason": finish, **({"token_ids": ids} if ids else {})}
        chunk = {"choices": [] if usage else [choice], **({"usage": {"completion_tokens": usage}} if usage else {})}
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"Content-Length: (\d+)", head)[1])
        asked.append(json.loads(await reader.readexactly(length)))
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        for body in (event("a", [97]), event("bcd", [98, 99, 100]), event("", None, "length") + event("", None,
                     usage=4) + b"data: [DONE]\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(body), body))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def go() -> tuple:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        async with server, _Connection(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", MODEL,
                                       timeout=30) as conn:
            return await asyncio.wait_for(_stream(conn, {"prompt": "x", "max_tokens": 4}, arrivals_of_tokens=True),
                                          30)

    ttft, gaps, n, arrivals = asyncio.run(go())
    assert asked[0]["return_token_ids"] is True and n == 4 and len(arrivals) == 4 and len(gaps) == 1
    assert arrivals[0] <= arrivals[1] == arrivals[2] == arrivals[3] and ttft > 0


def test_asking_for_a_loop_or_parser_that_is_not_installed_is_a_config_error(monkeypatch):
    """``--loop uvloop`` / ``--http httptools`` without the package: a ConfigError naming it (one line from the
    CLI); ``auto`` falls back to asyncio's loop and h11."""
    import asyncio
    import sys

    from server.http_protocol import protocol_class
    from server.serve import runner
    from txlserve.errors import ConfigError

    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    monkeypatch.setitem(sys.modules, "httptools", None)
    with pytest.raises(ConfigError, match="pip install uvloop"):
        runner("uvloop")
    with pytest.raises(ConfigError, match="pip install httptools"):
        protocol_class(1.0, "httptools")
    assert runner("auto") is asyncio.run
    assert protocol_class(1.0, "auto").__mro__[2].__name__ == "H11Protocol"  # after the send deadline


def test_the_server_process_takes_its_gil_switch_interval(tmp_path: Path):
    """Applied first thing in serve(), before the model loads (here a missing checkpoint stops it)."""
    import socket
    import sys

    import torch

    from server.serve import serve
    from server.settings import Settings
    from txlserve.errors import CheckpointError

    before, threads = sys.getswitchinterval(), torch.get_num_threads()
    try:
        with socket.socket() as sock, pytest.raises(CheckpointError):
            serve(Settings(checkpoint=str(tmp_path / "none"), data_dir=str(tmp_path), switch_interval_ms=0.25), sock)
        assert sys.getswitchinterval() == pytest.approx(0.00025)
    finally:  # serve() sets the process's interval and torch's threads: the tests after this one keep theirs
        sys.setswitchinterval(before)
        torch.set_num_threads(threads)
    assert Settings().switch_interval_ms == 0.5


def test_a_websockets_log_line_has_a_numeric_status_on_every_path(caplog):
    """RequestLog over apps that accept and fail, refuse, close before accepting, or fail before answering; the
    handshake is counted in txlserve_requests_total once, with that status, as it is answered."""
    import asyncio
    import logging
    import types

    from prometheus_client import CollectorRegistry, Counter

    from server.app import RequestLog

    requests = Counter("r", "", ["route", "status"], registry=CollectorRegistry())
    runtime = types.SimpleNamespace(metrics=types.SimpleNamespace(requests=requests))

    def counted() -> dict[str, float]:
        return {s.labels["status"]: s.value for m in requests.collect() for s in m.samples
                if s.name.endswith("_total") and s.value}

    async def run(app) -> dict:
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "websocket.connect"}

        async def send(msg: dict) -> None:
            if msg["type"] in ("websocket.accept", "websocket.http.response.start"):
                assert sum(counted().values()) == len(got) + 1  # counted as answered, before the socket closes
            sent.append(msg)
        with contextlib.suppress(RuntimeError):
            await RequestLog(app, lambda: runtime)({"type": "websocket", "path": "/v1/ws", "headers": []}, receive,
                                                   send)
        (line,) = [json.loads(r.getMessage()) for r in caplog.records if r.name == "txlserve.requests"]
        caplog.clear()
        return line

    async def fails_after_accept(scope, receive, send):
        await send({"type": "websocket.accept"})
        raise RuntimeError("a bug")

    async def refuses(scope, receive, send):
        await send({"type": "websocket.http.response.start", "status": 401, "headers": []})
        await send({"type": "websocket.http.response.body", "body": b"{}"})

    async def closes(scope, receive, send):
        await send({"type": "websocket.close", "code": 1008})

    async def fails_first(scope, receive, send):
        raise RuntimeError("a bug")

    caplog.set_level(logging.INFO, logger="txlserve.requests")
    got: list[dict] = []
    for app in (fails_after_accept, refuses, closes, fails_first):
        got.append(asyncio.run(run(app)))
    assert [(x["status"], x.get("close_code")) for x in got] == [(101, 1011), (401, None), (403, 1008), (500, None)]
    assert counted() == {"101": 1, "401": 1, "403": 1, "500": 1}


def test_a_request_is_counted_when_its_last_byte_goes_out_not_when_its_app_returns():
    """CI saw a static file's request missing from the scrape that followed it: the count came after the app
    returned, and a static file's close (on a thread) let the client's next request run first. Here the app
    holds on after its last byte, a HEAD included, and the count is already there."""
    import asyncio
    import types

    from prometheus_client import CollectorRegistry, Counter

    from server.app import HeadAsGet, RequestLog

    requests = Counter("r", "", ["route", "status"], registry=CollectorRegistry())
    runtime = types.SimpleNamespace(metrics=types.SimpleNamespace(requests=requests))

    async def run(method: str) -> None:
        sent, release = asyncio.Event(), asyncio.Event()

        async def slow_close(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            sent.set()
            await release.wait()  # the file's close, still to come

        async def receive() -> dict:
            return {"type": "http.request", "body": b""}

        async def send(msg: dict) -> None:
            pass
        scope = {"type": "http", "method": method, "path": "/x", "headers": [], "query_string": b""}

        async def routed(scope, receive, send):  # the router leaves the route it matched in the scope
            scope["route"] = types.SimpleNamespace(path="/x")
            await slow_close(scope, receive, send)
        app = RequestLog(HeadAsGet(routed), lambda: runtime)
        task = asyncio.create_task(app(scope, receive, send))
        await asyncio.wait_for(sent.wait(), 30)
        assert requests.labels("/x", "200")._value.get() == counts[method]
        release.set()
        await asyncio.wait_for(task, 30)
        assert requests.labels("/x", "200")._value.get() == counts[method]  # once, not again as the app returns

    counts = {"GET": 1, "HEAD": 2}
    asyncio.run(run("GET"))
    asyncio.run(run("HEAD"))


def test_a_client_that_reads_nothing_is_cut_off_after_the_send_timeout(checkpoint, redis_url, tmp_path):
    """A stream whose client never read held its run's text and the server's memory for ever (220 MB a
    connection for an echoed prompt with logprobs; found by a helper): past --send-timeout-s with its writes paused
    the connection is aborted, and the request ends as when a client leaves."""
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path, args=("--send-timeout-s", "1")).start()
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel's buffers fill sooner
        sock.connect(("127.0.0.1", srv.port))
        body = json.dumps({"model": MODEL, "prompt": "go", "max_tokens": LONG, "logprobs": 3, "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                     b"x-request-id: stalled-client-1\r\ncontent-length: %d\r\n\r\n" % len(body) + body)

        def logged() -> str | None:
            return next((x for x in srv.log.read_text().splitlines() if "stalled-client-1" in x), None)

        text = wait_for(logged, 120, "the stalled request's log line")  # written as the request ends
        line = json.loads(text[text.index("{"):])
        assert line["finish_reason"] == "cancelled" and line["completion_tokens"] < LONG, line
        sock.settimeout(30)
        got = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 16):
                got += chunk
        assert b"[DONE]" not in got  # the connection ended before the stream did
        # a WebSocket's too: its keepalive's close had waited for a buffer that never drained
        ws_sock = socket.socket()
        ws_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        ws_sock.connect(("127.0.0.1", srv.port))
        with connect(f"ws://127.0.0.1:{srv.port}/v1/ws", sock=ws_sock, close_timeout=1,
                     additional_headers={"x-request-id": "stalled-ws-1"}) as conn:
            conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "go", "max_tokens": LONG,
                                  "logprobs": 3}))

            def ws_logged() -> str | None:
                return next((x for x in srv.log.read_text().splitlines() if "stalled-ws-1" in x), None)

            text = wait_for(ws_logged, 120, "the stalled WebSocket's log line")  # written as it closes
            assert json.loads(text[text.index("{"):])["method"] == "WEBSOCKET"
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    finally:
        sock.close()
        srv.stop()


def test_vllms_serve_flags_name_the_same_settings_and_no_flag_is_taken_by_a_prefix(capsys):
    """vLLM's --model (the model to load), --served-model-name, --api-key and --max-num-seqs are our settings'
    other names; a prefix of a flag is no flag: ``--model PATH`` had been taken as --model-name and served the
    bundled checkpoint under that name (found by a helper)."""
    from server.cli import build_parser

    ns = build_parser().parse_args(["serve", "--model", "ck", "--served-model-name", "m", "--api-key", "k",
                                    "--max-num-seqs", "8"])
    assert (ns.checkpoint, ns.model_name, ns.api_keys, ns.max_batch) == ("ck", "m", ["k"], 8)
    for argv in (["serve", "--model-nam", "m"], ["serve", "--max-bat", "4"],
                 ["generate", "--prompt", "x", "--max-tok", "3"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert "unrecognized arguments" in capsys.readouterr().err

"""One request per session at a time, and sessions that belong to the key that made them."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.live import API_KEYS, LONG, MODEL, LiveServer


def test_second_request_on_a_busy_session_gets_409_at_once(server):
    """The first request streams until the checks are done (LONG tokens at most: the engine does not wait for
    a client that reads slowly, so that is how long the session stays busy, whatever the client does)."""
    sid = httpx.post(server.url + "/v1/sessions", json={"text": "busy "}).json()["id"]
    started, checked = threading.Event(), threading.Event()
    ended: list[float] = []

    def long_stream():
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "go", "max_tokens": LONG, "stream": True, "session_id": sid}) as r:
            for i, line in enumerate(r.iter_lines()):
                if i == 2:
                    started.set()
                if checked.is_set() or line == "data: [DONE]":
                    break
        ended.append(time.monotonic())

    t = threading.Thread(target=long_stream)
    t.start()
    try:
        assert started.wait(30)
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "session_id": sid})
        busy = httpx.post(f"{server.url}/v1/sessions/{sid}/append", json={"text": "x"})
        # its commit writes back the metadata it leased: an update now would be lost
        relabel = httpx.post(f"{server.url}/v1/sessions/{sid}", json={"metadata": {"k": "v"}}, timeout=30)
        # the refusals came while the first stream still ran: they did not wait for its lease
        assert not ended, "the first request ended before the checks: they prove nothing"
    finally:
        checked.set()
        t.join(60)
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy"
    assert busy.status_code == 409
    assert relabel.status_code == 409 and "once that request ends" in relabel.json()["error"]["message"]
    r2 = httpx.post(f"{server.url}/v1/sessions/{sid}", json={"metadata": {"k": "v"}}, timeout=30)  # it ended
    assert r2.status_code == 200 and r2.json()["metadata"] == {"k": "v"}, r2.text
    assert httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=30).json()["metadata"] == {"k": "v"}
    # the OpenAI SDKs retry a 409 unless told not to: the writes were made one after the other behind the user
    assert r.headers["x-should-retry"] == busy.headers["x-should-retry"] == "false"


@pytest.fixture
def keyed(keyed_server):
    return keyed_server.live


def test_api_keys_guard_what_the_readme_says_and_nothing_else(keyed):
    for method, path, body in (("GET", "/v1/models", None), ("GET", "/v1/sessions", None),
                               ("POST", "/v1/sessions", {}), ("POST", "/v1/completions", {"prompt": "x"}),
                               ("POST", "/v1/chat/completions", {}),
                               ("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [1]}),
                               ("GET", "/tokenizer_info", None)):
        assert httpx.request(method, keyed.url + path, json=body).status_code == 401, path
    for path in ("/health", "/ping", "/ready", "/metrics", "/docs", "/openapi.json", "/", "/version"):  # probes,
        assert httpx.get(keyed.url + path).status_code == 200, path  # scrapes, the page, vLLM's version
    from importlib import metadata
    assert httpx.get(keyed.url + "/version").json() == {"version": metadata.version("txlserve")}


def test_a_body_that_does_not_read_is_refused_for_its_key_first(keyed):
    """FastAPI reads a body before the route's key check: malformed JSON (and bytes that are not UTF-8) without a
    key got a 400 about the body where every other request without one gets the 401."""
    json_type = {"Content-Type": "application/json"}
    for path in ("/v1/completions", "/v1/sessions", "/tokenize"):
        for body in (b"{", b"\xff\xfe{}"):
            r = httpx.post(keyed.url + path, content=body, headers=json_type)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (path, body, r.text)
            assert r.headers["www-authenticate"].startswith("Bearer")
            r = httpx.post(keyed.url + path, content=body,
                           headers={**json_type, "Authorization": f"Bearer {API_KEYS[0]}"})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (path, body)


def test_the_openapi_document_says_which_operations_take_a_key_and_what_errors_look_like(keyed):
    """/openapi.json listed FastAPI's 422 and its {"detail": [...]} body for every operation, which the server
    never answers, and neither the keys nor any error it does answer: a client generated from it was wrong."""
    import re

    from server.protocol import ErrorResponse

    doc = httpx.get(keyed.url + "/openapi.json").json()
    assert "HTTPValidationError" not in doc["components"]["schemas"] and '"422"' not in str(doc).replace("'", '"')
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    ids = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids)), ids  # /ping's GET and POST had shared one (a generated client has one name)
    refs = {"#/components/schemas/ErrorResponse"}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            errors = {status: r for status, r in op["responses"].items() if not status.startswith("2")}
            assert all(r["content"]["application/json"]["schema"]["$ref"] in refs for r in errors.values())
            url = keyed.url + re.sub(r"\{[^}]+\}", "x", path)
            got = httpx.request(method.upper(), url, json={} if "requestBody" in op else None)
            if op.get("security"):  # documented as taking a key: refused without one, in the documented shape
                assert "401" in errors and got.status_code == 401, (method, path, got.status_code)
                ErrorResponse.model_validate(got.json())
            else:
                assert got.status_code != 401, (method, path)
    assert {"400", "401", "413", "default"} <= set(doc["paths"]["/v1/completions"]["post"]["responses"])
    bad = httpx.post(keyed.url + "/v1/completions", json={"prompt": 1},
                     headers={"Authorization": f"Bearer {API_KEYS[0]}"})
    assert bad.status_code == 400 and ErrorResponse.model_validate(bad.json()).error.param == "model"


def test_api_keys_isolate_sessions(keyed):
    one, two = {"Authorization": f"Bearer {API_KEYS[0]}"}, {"Authorization": f"Bearer {API_KEYS[1]}"}
    assert httpx.get(keyed.url + "/v1/models").status_code == 401
    r = httpx.get(keyed.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.headers["www-authenticate"].startswith("Bearer")  # RFC 9110: the scheme a 401 wants
    assert httpx.get(keyed.url + "/health").status_code == 200  # probes stay open
    sid = httpx.post(keyed.url + "/v1/sessions", json={"text": "mine"}, headers=one).json()["id"]
    assert httpx.get(f"{keyed.url}/v1/sessions/{sid}", headers=one).status_code == 200
    for method, path, body in (("GET", f"/v1/sessions/{sid}", None), ("DELETE", f"/v1/sessions/{sid}", None),
                               ("POST", f"/v1/sessions/{sid}/append", {"text": "x"}),
                               ("POST", f"/v1/sessions/{sid}/fork", {}),
                               ("POST", f"/v1/sessions/{sid}", {"metadata": {"k": "v"}}),
                               ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "session_id": sid})):
        r = httpx.request(method, keyed.url + path, json=body, headers=two, timeout=30)
        assert r.status_code == 404, (method, path, r.text)
    assert sid in [s["id"] for s in httpx.get(keyed.url + "/v1/sessions", headers=one).json()["data"]]
    assert sid not in [s["id"] for s in httpx.get(keyed.url + "/v1/sessions", headers=two).json()["data"]]
    mine = httpx.get(f"{keyed.url}/v1/sessions/{sid}", headers=one).json()
    assert mine["tokens_seen"] == 4 and mine["metadata"] == {}
    with pytest.raises(InvalidStatus) as refused:
        connect(keyed.url.replace("http", "ws") + "/v1/ws").recv(timeout=5)
    assert refused.value.response.status_code == 401
    assert json.loads(refused.value.response.body)["error"]["type"] == "authentication_error"
    with connect(keyed.url.replace("http", "ws") + f"/v1/ws?api_key={API_KEYS[1]}") as conn:
        conn.send(json.dumps({"type": "completion.create", "model": "txl-test", "prompt": "x", "session_id": sid}))
        assert '"not_found_error"' in conn.recv(timeout=10)


@pytest.mark.parametrize("mode", [(), ("--no-engine-process",)], ids=["engine-process", "in-process"])
def test_a_hot_copy_of_a_version_redis_lost_is_never_served(mode, checkpoint, redis_url, tmp_path):
    """Redis can lose an acknowledged write (an AOF fsynced every second, a failover to a replica behind): replica A
    commits version 2 (text X) and keeps it hot, Redis comes back at version 1, and replica B commits its own version
    2 (text Y). A's hot copy matched by number alone continued X for A's next client, then patched its rows onto
    B's memory in Redis: a record of neither document. A hot copy is matched by its revision (version and time
    written) now, so A reads B's version from Redis."""
    import random

    import redis as redis_py

    text = "".join(random.Random(1).choice("the quick brown fox jumps over a lazy dog ") for _ in range(80))
    x = "".join(random.Random(2).choice("abcdefgh ") for _ in range(60))
    y = "".join(random.Random(3).choice("stuvwxyz\n") for _ in range(60))

    def complete(srv: LiveServer, **body) -> str:
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "max_tokens": 20, "temperature": 0, **body},
                       timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    a = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path / "a", args=mode).launch()
    b = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path / "b", args=mode).launch()
    raw = redis_py.Redis.from_url(redis_url)
    try:
        a.wait_ready()
        b.wait_ready()
        sid = httpx.post(b.url + "/v1/sessions", json={"text": text}, timeout=60).json()["id"]
        saved = {k: raw.dump(k) for k in raw.keys(f"*{sid}*") if not k.endswith(b":lease")}
        assert httpx.post(f"{a.url}/v1/sessions/{sid}/append", json={"text": x}, timeout=60).status_code == 200
        for key, value in saved.items():  # Redis comes back without A's write
            raw.restore(key, 0, value, replace=True)
        appended = httpx.post(f"{b.url}/v1/sessions/{sid}/append", json={"text": y}, timeout=60).json()
        assert appended["tokens_seen"] == len(text + y)  # version 2 again: the number A's hot copy has
        assert complete(a, prompt="", session_id=sid) == complete(b, prompt=text + y)  # the document in Redis
    finally:
        raw.close()
        a.stop()
        b.stop()

"""What API users expect besides completions: vLLM's /tokenize and /detokenize, a request id on every response
with one structured log line per request (never a key, never a prompt), and CORS when asked for."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from websockets.sync.client import connect

from server.protocol import SPLICE_ROWS
from tests.live import MODEL, LiveServer, wait_for
from tests.server.test_lifecycle import _client, running_app

pytestmark = pytest.mark.timeout(120)


def test_tokenize_and_detokenize_round_trip_in_vllms_shapes(server):
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "héllo", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == list("héllo".encode()) and body["count"] == 6 and body["max_model_len"] > 0
    assert len(body["token_strs"]) == 6 and body["token_strs"][0] == "h"
    assert "token_strs" not in httpx.post(server.url + "/tokenize", json={"prompt": "x"}).json()
    back = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "héllo"}


def test_tokenizer_info_lets_lm_evals_remote_tokenizer_use_the_servers(server):
    """lm-evaluation-harness's local-completions (tokenizer_backend auto) takes the server's tokenizer when
    GET /tokenizer_info answers a JSON object with an ``eos_token`` key and POST /tokenize (with
    add_special_tokens false) a token list: its probe, step for step; a byte model had none to load otherwise."""
    info = httpx.get(server.url + "/tokenizer_info")
    assert info.status_code == 200 and isinstance(info.json(), dict) and "eos_token" in info.json()
    assert info.json()["eos_token"] is None and info.json()["tokenizer_class"] == "ByteTokenizer"
    assert info.json()["vocab_size"] == 256 and info.json()["model_max_length"] > 0
    probe = httpx.post(server.url + "/tokenize", json={"prompt": "test", "add_special_tokens": False})
    assert probe.status_code == 200 and probe.json()["tokens"] == list(b"test")


@pytest.mark.parametrize(("path", "body", "status"), [
    ("/tokenize", {"prompt": 5}, 400),
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404),
    ("/tokenize", {"prompt": "x", "extra": 1}, 400),
    ("/detokenize", {"tokens": [256]}, 400),  # outside a byte model's vocabulary
    ("/detokenize", {"tokens": [-1]}, 400),
    ("/detokenize", {"tokens": "abc"}, 400),
    ("/detokenize", {"model": "nope", "tokens": [1]}, 404),
])
def test_tokenizer_endpoints_refuse_bad_input_with_openais_error_shape(server, path, body, status):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_every_response_has_a_request_id_and_one_log_line_without_the_prompt(server):
    secret_prompt = "a-prompt-that-must-never-be-logged"
    sid = httpx.post(server.url + "/v1/sessions", json={"text": "Once"}).json()["id"]
    r = httpx.post(server.url + "/v1/completions", headers={"x-request-id": "req-abc.123"}, timeout=60,
                   json={"model": MODEL, "prompt": secret_prompt, "max_tokens": 5, "session_id": sid})
    assert r.status_code == 200 and r.headers["x-request-id"] == "req-abc.123"
    mine = httpx.get(server.url + "/health", headers={"x-request-id": "bad id with spaces"})
    assert mine.headers["x-request-id"] != "bad id with spaces" and len(mine.headers["x-request-id"]) == 24
    assert httpx.get(server.url + "/nowhere").headers["x-request-id"]  # errors too
    busy = httpx.post(server.url + "/v1/completions", json={"model": "nope", "prompt": "x"},
                      headers={"x-request-id": "req-refused", "x-forwarded-for": "203.0.113.7"})  # a local proxy

    def line_of(request_id: str) -> dict:
        text = wait_for(lambda: next((x for x in server.log.read_text().splitlines()
                                      if f'"request_id":"{request_id}"' in x), None),
                        10, "the request's log line")  # written once the response has ended
        return json.loads(text.split("txlserve.requests: ", 1)[1])
    # who sent it, and (a refusal) which error: a 404 or a 503 said nothing of which it was
    refused = line_of("req-refused")
    assert busy.status_code == 404 and refused["error"] == busy.json()["error"]["code"] == "model_not_found"
    line = line_of("req-abc.123")
    assert line["client"] == "127.0.0.1" and refused["client"] == "203.0.113.7" and "error" not in line
    assert line["route"] == "/v1/completions" and line["status"] == 200 and line["session_id"] == sid
    assert line["prompt_tokens"] == len(secret_prompt) and line["completion_tokens"] == 5
    assert line["cached_tokens"] == 4 and line["total_ms"] >= line["start_ms"] >= 0
    assert secret_prompt not in server.log.read_text()


def test_a_json_log_is_one_object_a_line_from_every_process_and_logger(checkpoint, redis_url, tmp_path, server):
    """--log-format json, for a log collector: the request lines were JSON behind a text prefix, uvicorn's own
    lines had no time, and the engine process's were text (found by a helper). The text log's uvicorn lines carry
    a time now too."""
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path, args=("--log-format", "json")).start()
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                       headers={"x-request-id": "req-json"}, timeout=60)
        assert r.status_code == 200
        wait_for(lambda: "req-json" in srv.log.read_text(), 10, "the request's line")
    finally:
        srv.stop()
    lines = [json.loads(line) for line in srv.log.read_text().splitlines() if line.strip()]  # each one JSON
    assert all({"time", "level", "logger"} <= set(x) and x["time"].endswith("+00:00") for x in lines), lines[:3]
    loggers = {x["logger"] for x in lines}
    assert {"uvicorn.error", "txlserve", "txlserve.requests", "model.decode"} <= loggers, loggers  # the engine's
    (mine,) = [x for x in lines if x.get("request_id") == "req-json"]  # its fields at the top level
    assert mine["route"] == "/v1/completions" and mine["status"] == 200 and mine["completion_tokens"] == 2
    started = next(x for x in server.log.read_text().splitlines() if "Started server process" in x)
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO uvicorn.error: ", started), started


def test_debug_logs_hold_no_prompt_or_completion_text(checkpoint, redis_url, tmp_path):
    """At --log-level debug the websockets library logged every frame (through uvicorn's logger): a prompt's
    and a completion's text in the log (found by a helper trying the product)."""
    secret = "a-ws-prompt-that-must-never-be-logged"
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path, args=("--log-level", "debug")).start()
    try:
        with connect(srv.url.replace("http", "ws", 1) + "/v1/ws") as conn:
            conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": secret, "max_tokens": 8}))
            msgs = []
            while not msgs or msgs[-1]["type"] not in ("completion.done", "error"):
                msgs.append(json.loads(conn.recv(timeout=30)))
        assert msgs[-1]["type"] == "completion.done"
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": secret + "-http", "max_tokens": 8})
        assert r.status_code == 200
    finally:
        srv.stop()
    log = srv.log.read_text()
    assert " DEBUG " in log  # debug lines are written: it is the frames that are not
    assert secret not in log and "completion.create" not in log and "completion.delta" not in log


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_cors_is_off_by_default_and_allows_only_the_configured_origins(redis_url, tmp_path):
    preflight = {"origin": "https://app.example.com", "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization,content-type"}
    async with running_app(redis_url, tmp_path) as (app, _, _), _client(app) as c:
        r = await c.options("/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers
    async with running_app(redis_url, tmp_path, cors_origins=("https://app.example.com",), max_body_bytes=1000) \
            as (app, _, _), _client(app) as c:
        r = await c.options("/v1/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example.com"
        assert r.headers["x-request-id"]  # a preflight is a request like any other: logged, counted, with an id
        r = await c.get("/v1/models", headers={"origin": "https://app.example.com"})
        assert r.headers["access-control-allow-origin"] == "https://app.example.com"
        assert "x-request-id" in r.headers["access-control-expose-headers"]
        r = await c.options("/v1/completions", headers={**preflight, "origin": "https://evil.example.com"})
        assert r.headers.get("access-control-allow-origin") != "https://evil.example.com"
        assert r.status_code == 400 and r.json()["error"]["code"] == "cors_not_allowed"  # OpenAI's shape, not text
        assert "origin" in r.json()["error"]["message"]
        # the body limit's refusal reaches a page on an allowed origin (it sat outside CORS: a bare network error)
        r = await c.post("/v1/completions", content=b"x" * 2000, headers={"origin": "https://app.example.com"})
        assert r.status_code == 413 and r.headers["access-control-allow-origin"] == "https://app.example.com"
        # a POST of another origin, which needs no preflight when simple, never reaches the app
        r = await c.post("/v1/sessions", headers={"origin": "https://evil.example.com", "sec-fetch-site": "cross-site"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"


@pytest.mark.parametrize(("origin", "why"), [
    ("https://app.example.com/", "no path"), ("https://app.example.com/api", "no path"), ("app.example.com", "no path"),
    ("1http://app.example.com", "no path"), ("http://*.example.com", "no wildcards"), ("https://app.*", "no wildcards"),
    ("HTTPS://App.example.com", "'https://app.example.com'"), ("https://app.example.com:443", "'https://app.example.com'"),
    ("http://localhost:80", "'http://localhost'"),
])
def test_a_cors_origin_that_no_browser_sends_is_refused_at_start(origin, why):
    """A trailing slash was accepted and then matched nothing: browsers send an origin without a path. A wildcard
    was accepted and matched nothing too (origins are compared whole). Any scheme is one: a browser extension's
    (chrome-extension://id) and a desktop app's webview (tauri://localhost) had been refused, though they send it."""
    from server.settings import Settings
    from txlserve.errors import ConfigError

    assert Settings(cors_origins=("chrome-extension://abcdefgh", "moz-extension://0b1c-2d", "tauri://localhost",
                                  "vscode-webview://x1")).cors_origins[0] == "chrome-extension://abcdefgh"
    with pytest.raises(ConfigError, match=why):
        Settings(cors_origins=(origin,))


def test_histograms_have_samples_and_the_grafana_dashboard_uses_only_real_metrics(server):
    import re

    from tests.live import REPO

    sid = httpx.post(server.url + "/v1/sessions", json={"text": "Once upon"}).json()["id"]
    for _ in range(2):  # the second finds the session hot
        httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": " a time", "max_tokens": 4, "session_id": sid, "stream": True})
    text = httpx.get(server.url + "/metrics").text

    def value(sample: str) -> float:
        return float(re.search(rf"^{re.escape(sample)} ([0-9.e+]+)$", text, re.M).group(1))

    for name in ("txlserve_request_queue_time_seconds", "txlserve_request_prefill_time_seconds",
                 "txlserve_request_prompt_tokens", "txlserve_request_generation_tokens",
                 "txlserve_time_to_first_token_seconds", "txlserve_inter_token_latency_seconds"):
        assert value(f"{name}_count") >= 2, name
    assert value('txlserve_session_restore_seconds_count{source="hot"}') >= 1
    # the engine loop's time by phase, from the engine process as of this scrape: where its steps ran
    phases = dict(re.findall(r'^txlserve_engine_loop_seconds_total\{phase="([a-z]+)"\} (\S+)$', text, re.M))
    assert len(phases) == 10 and float(phases["forward"]) > 0 and float(phases["accept"]) > 0
    assert value("txlserve_engine_loop_cpu_seconds_total") > 0
    dashboard = json.loads((REPO / "docker" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b(txlserve_[a-z_]+)", e)}
    exposed = set(re.findall(r"^(txlserve_[a-z_]+)", text, re.M))
    assert used and used <= exposed, used - exposed


def test_echo_with_logprobs_scores_the_prompt_as_openai_does(server):
    prompt = "To be, or not"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 2}
    out = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    lp = out["logprobs"]
    assert out["text"].startswith(prompt) and len(lp["tokens"]) == len(prompt) + 5
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing precedes it
    assert all(x <= 0 for x in lp["token_logprobs"][1:])
    tops = list(zip(lp["tokens"], lp["top_logprobs"]))[1:]
    assert all(len(top) in (2, 3) and tok in top for tok, top in tops)  # a prompt token is named even when unlikely
    assert any(len(top) == 3 for _, top in tops[: len(prompt) - 1])  # a random model: some prompt byte is not top-2
    assert lp["text_offset"][: len(prompt)] == list(range(len(prompt)))
    assert lp["text_offset"][len(prompt)] == len(prompt)  # the completion's tokens follow the echoed prompt
    # the prompt's scores are the model's: they add up to what an append of the same text scores
    made = httpx.post(server.url + "/v1/sessions", json={"text": prompt}, timeout=60).json()
    assert sum(lp["token_logprobs"][1:len(prompt)]) == pytest.approx(made["logprob"], abs=1e-4)
    # streamed: the prompt and its scores come first, the same numbers
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"] == prompt and first["logprobs"]["token_logprobs"] == lp["token_logprobs"][:len(prompt)]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == out["text"]
    # continuing a session, the first prompt token has the session's memory before it
    sid = made["id"]
    cont = httpx.post(server.url + "/v1/completions", timeout=60,
                      json={**body, "prompt": " to be", "session_id": sid}).json()["choices"][0]["logprobs"]
    assert cont["token_logprobs"][0] is not None and cont["token_logprobs"][0] <= 0


def test_a_long_scored_prompt_is_the_same_on_every_surface(server):
    """A prompt past SPLICE_ROWS tokens is scored in parts off the event loop (its scores cross from the engine
    process as arrays): JSON, SSE, WebSocket and an append give the same tokens, offsets and scores."""
    prompt = ("Now is the winter of our discontent\nMade glorious summer by this sun of York; " * 20)[:1300]
    assert len(prompt) > 2 * SPLICE_ROWS
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 3}
    got = {"json": httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        got["sse"] = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")][0]["choices"][0]
    with connect(server.url.replace("http://", "ws://") + "/v1/ws", max_size=None) as conn:
        conn.send(json.dumps({"type": "completion.create", **body}))
        got["ws"] = json.loads(conn.recv(timeout=60))
    sid = httpx.post(server.url + "/v1/sessions", json={}, timeout=60).json()["id"]
    got["append"] = httpx.post(f"{server.url}/v1/sessions/{sid}/append", json={"text": prompt, "logprobs": 3},
                               timeout=60).json()
    want = got["json"]["logprobs"]
    assert got["json"]["text"] == got["sse"]["text"] == got["ws"]["text"] == prompt
    assert len(want["tokens"]) == len(prompt) and want["text_offset"] == list(range(len(prompt)))
    assert want["token_logprobs"][0] is None and all(len(top) in (3, 4) for top in want["top_logprobs"][1:])
    for surface in ("sse", "ws", "append"):
        lp = got[surface]["logprobs"]
        assert lp["tokens"] == want["tokens"] and lp["text_offset"] == want["text_offset"], surface
        assert lp["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=1e-5), surface
        assert [sorted(top) for top in lp["top_logprobs"][1:]] == [sorted(top) for top in want["top_logprobs"][1:]]


def test_an_append_returns_per_token_logprobs_when_asked(server):
    sid = httpx.post(server.url + "/v1/sessions", json={"text": "Once upon"}).json()["id"]
    plain = httpx.post(f"{server.url}/v1/sessions/{sid}/append", json={"text": " a time"}, timeout=60).json()
    assert plain["logprobs"] is None
    twin = httpx.post(server.url + "/v1/sessions", json={"text": "Once upon"}).json()["id"]
    got = httpx.post(f"{server.url}/v1/sessions/{twin}/append", json={"text": " a time", "logprobs": 1},
                     timeout=60).json()
    lps = got["logprobs"]["token_logprobs"]
    assert len(lps) == 7 and None not in lps and got["logprobs"]["tokens"][1] == "a"
    assert sum(lps) == pytest.approx(got["logprob"], abs=1e-4) and got["logprob"] == pytest.approx(plain["logprob"],
                                                                                                   abs=1e-4)
    bad = httpx.post(f"{server.url}/v1/sessions/{twin}/append", json={"text": "x", "logprobs": 99})
    assert bad.status_code == 400

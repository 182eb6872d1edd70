"""Sessions that outlive their hidden states, their model and their cluster, over real HTTP: a cold session (its
token window only) is rebuilt to the same continuation; a session written by another checkpoint with the same
tokenizer is rebuilt instead of refused; an exported session continues identically on a server with its own
store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import RedisProcess
from tests.live import MODEL, LiveServer, start_all, tiny_checkpoint, wait_for

pytestmark = pytest.mark.timeout(240)

TEXT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
        "arrows of outrageous fortune, or to take arms against a sea of troubles, and by opposing end them.\n")
COLD = ("--hot-cache-mb", "0", "--cold-after-s", "0.001", "--cold-sweep-s", "0.1")  # everything idle goes cold


@pytest.fixture(scope="module")
def servers(checkpoint: Path, tmp_path_factory) -> Iterator[dict[str, LiveServer]]:
    yield from portable_servers(checkpoint, tmp_path_factory)


def portable_servers(checkpoint: Path, tmp_path_factory, args: tuple[str, ...] = ()) -> Iterator[dict[str, LiveServer]]:
    """``cold``: a Redis of its own (its sweep touches every session there), nothing hot, every idle session
    cold at once; ``upgraded``: another checkpoint (same tokenizer) over that Redis, reading less (mem_len 8: a
    window of 17 tokens, where the first's is 49 and its memory 24); ``elsewhere``: the first
    checkpoint with its own embedded store. ``args``: more flags for all three."""
    other = tiny_checkpoint(tmp_path_factory.mktemp("other-ckpt"), seed=1)
    redis = RedisProcess(tmp_path_factory.mktemp("portable-redis")).start()
    redis_url = redis.url
    started = {
        "cold": LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path_factory.mktemp("cold"),
                           args=(*COLD, *args)),
        "upgraded": LiveServer(other, redis_url=redis_url, data_dir=tmp_path_factory.mktemp("upgraded"),
                               args=("--hot-cache-mb", "0", "--mem-len", "8", *args)),
        "elsewhere": LiveServer(checkpoint, redis_url=None, data_dir=tmp_path_factory.mktemp("elsewhere"),
                                args=args),
    }
    try:
        start_all(*started.values())
        yield started
    finally:
        for srv in started.values():
            srv.stop()
        redis.stop()


def _post(srv: LiveServer, path: str, body: dict, status: int = 200) -> dict:
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def _continue(srv: LiveServer, session_id: str | None = None, prompt: str = "") -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    if session_id:
        body["session_id"] = session_id
    return _post(srv, "/v1/completions", body)


def _wait_for_tier(srv: LiveServer, session_id: str, tier: str, timeout: float = 30) -> dict:
    def there() -> dict | None:
        info = httpx.get(f"{srv.url}/v1/sessions/{session_id}", timeout=10).json()
        return info if info["tier"] == tier else None

    return wait_for(there, timeout, f"session {session_id} to become {tier}")


def test_a_cold_session_is_rebuilt_from_its_window_to_the_same_continuation(servers):
    srv = servers["cold"]
    truth = _continue(srv, prompt=TEXT * 2)["choices"][0]["text"]  # the whole text in one request, no session
    sid = _post(srv, "/v1/sessions", {"text": TEXT * 2}, 201)["id"]
    warm = _post(servers["elsewhere"], "/v1/sessions", {"text": TEXT * 2}, 201)  # same model, never cold
    cold = _wait_for_tier(srv, sid, "cold")
    assert cold["window_tokens"] == warm["window_tokens"] == 2 * 24 + 1  # n_layer * mem_len + 1
    assert cold["bytes"] < warm["bytes"] / 10 and cold["tokens_seen"] == warm["tokens_seen"]
    out = _continue(srv, sid)
    assert out["choices"][0]["text"] == truth
    assert out["session"] == {"id": sid, "tokens_seen": 2 * len(TEXT) + 24, "rebuilt": True}
    metrics = httpx.get(srv.url + "/metrics", timeout=10).text
    assert 'txlserve_session_restores_total{source="rebuild"}' in metrics
    # a cold session scores an append as a warm one does (on a server whose sessions stay hot)
    again = _post(srv, "/v1/sessions", {"text": TEXT * 2}, 201)["id"]
    _wait_for_tier(srv, again, "cold")
    cold_append = _post(srv, f"/v1/sessions/{again}/append", {"text": TEXT})
    hot = servers["elsewhere"]
    hot_append = _post(hot, f"/v1/sessions/{_post(hot, '/v1/sessions', {'text': TEXT * 2}, 201)['id']}/append",
                       {"text": TEXT})
    assert cold_append["rebuilt"] is True and hot_append["rebuilt"] is False
    assert cold_append["logprob"] == pytest.approx(hot_append["logprob"], abs=1e-3)


def test_a_session_of_another_checkpoint_with_the_same_tokenizer_is_rebuilt(servers):
    old, new = servers["cold"], servers["upgraded"]
    sid = _post(old, "/v1/sessions", {"text": TEXT * 2}, 201)["id"]
    truth = _continue(new, prompt=TEXT * 2)["choices"][0]["text"]  # what the new model says after the text
    assert truth != _continue(old, prompt=TEXT * 2)["choices"][0]["text"]  # the models differ
    out = _continue(new, sid)
    assert out["choices"][0]["text"] == truth and out["session"]["rebuilt"] is True
    follow = _continue(new, sid)  # from here on it is the new model's session, continued as usual
    assert follow["session"]["tokens_seen"] == 2 * len(TEXT) + 48
    tier = httpx.get(f"{new.url}/v1/sessions/{sid}", timeout=10).json()["tier"]
    assert tier in ("redis", "cold")  # --hot-cache-mb 0: never hot, whichever process holds the engine (the cold
    # server's sweep, on the same Redis, may have demoted it already)
    assert follow["choices"][0]["text"] == _continue(new, prompt=TEXT * 2 + truth)["choices"][0]["text"]
    # and back (a rollback, or old and new replicas side by side): the new model, which reads less, kept the
    # window the old one rebuilds it from (it cut it to its own 17 tokens, and the old model's answer was a 422)
    back = _continue(old, sid)
    whole = TEXT * 2 + truth + follow["choices"][0]["text"]
    assert back["session"]["rebuilt"] is True and back["session"]["tokens_seen"] == len(whole) + 24
    assert back["choices"][0]["text"] == _continue(old, prompt=whole)["choices"][0]["text"]
    # a young session (its window its whole text, shorter than the old model's 49 tokens): the new model kept
    # its whole text too, not its own 17 tokens of it, which the old model had rebuilt from, inexactly
    young = _post(old, "/v1/sessions", {"text": "Once upon"}, 201)["id"]
    grown = _continue(new, young)  # 9 + 24 tokens: over the new model's window, within the old one's
    info = httpx.get(f"{new.url}/v1/sessions/{young}", timeout=10).json()
    assert info["tokens_seen"] == 33 and info["window_tokens"] == 33, info
    text = "Once upon" + grown["choices"][0]["text"]
    assert _continue(old, young)["choices"][0]["text"] == _continue(old, prompt=text)["choices"][0]["text"]


def test_an_exported_session_continues_identically_on_a_server_with_its_own_store(servers):
    src, dst, upgraded = servers["cold"], servers["elsewhere"], servers["upgraded"]
    sid = _post(src, "/v1/sessions", {"text": TEXT * 3, "metadata": {"doc": "hamlet"}}, 201)["id"]
    doc = httpx.get(f"{src.url}/v1/sessions/{sid}/export", timeout=10).json()
    assert doc["object"] == "session.export" and doc["tokens_seen"] == 3 * len(TEXT)
    assert len(doc["window"]) == 2 * 24 + 1 and doc["metadata"] == {"doc": "hamlet"}
    assert doc["tokenizer"].startswith("byte:")
    made = _post(dst, "/v1/sessions/import", doc, 201)
    assert made["id"] != sid and made["tokens_seen"] == 3 * len(TEXT) and made["metadata"] == {"doc": "hamlet"}
    assert made["rebuilt"] is True
    here, there = _continue(src, sid), _continue(dst, made["id"])
    assert there["choices"][0]["text"] == here["choices"][0]["text"]
    assert there["session"]["tokens_seen"] == here["session"]["tokens_seen"]
    # another model with the same tokenizer takes it too, and keeps the window it reads less of (17 of 49 tokens):
    # carried on from there, the model that wrote it rebuilds it exactly (it was cut to 17 tokens, and the writer
    # refused it with a 422; found by a helper)
    passed = _post(upgraded, "/v1/sessions/import", doc, 201)
    assert passed["tokens_seen"] == 3 * len(TEXT) and passed["window_tokens"] == 2 * 24 + 1
    again = httpx.get(f"{upgraded.url}/v1/sessions/{passed['id']}/export", timeout=10).json()
    assert again["window"] == doc["window"]
    back = _post(dst, "/v1/sessions/import", again, 201)["id"]
    assert _continue(dst, back)["choices"][0]["text"] == here["choices"][0]["text"]


@pytest.mark.parametrize(("change", "status", "code"), [
    ({"tokenizer": "word:0123456789abcdef"}, 422, "session_incompatible"),
    ({"window": [300]}, 400, None),
    ({"window": [-1]}, 400, None),
    ({"tokens_seen": 3}, 400, "invalid_request"),  # fewer than the window holds
    ({"tokens_seen": (1 << 62) + 1}, 400, None),  # more than a header holds
    ({"format": "txlserve.session.v9"}, 400, None),
    ({"window": "abc"}, 400, None),
    ({"extra": 1}, 400, None),
])
def test_bad_imports_are_refused_with_the_right_status(servers, change, status, code):
    srv = servers["elsewhere"]
    sid = _post(srv, "/v1/sessions", {"text": TEXT}, 201)["id"]
    doc = httpx.get(f"{srv.url}/v1/sessions/{sid}/export", timeout=10).json()
    r = httpx.post(srv.url + "/v1/sessions/import", json={**doc, **change}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and (code is None or error["code"] == code)


def test_a_session_imported_at_the_largest_position_keeps_working(servers):
    """An import near the header's limit (2^62) used to be accepted, then its first completion stored a header
    no read accepts: every later request on it was a 422. The store now refuses a commit past it: the request is
    a 400 and the session stays as it was. And whatever a session is exported at imports again: a cap of 2^53 on
    imports refused the export of a session imported there and grown (found by a helper)."""
    srv = servers["elsewhere"]
    sid = _post(srv, "/v1/sessions", {"text": TEXT}, 201)["id"]
    doc = httpx.get(f"{srv.url}/v1/sessions/{sid}/export", timeout=10).json()
    top = 1 << 62
    big = _post(srv, "/v1/sessions/import", {**doc, "tokens_seen": top - 4}, 201)["id"]
    r = httpx.post(srv.url + "/v1/completions", timeout=30, json={"model": MODEL, "prompt": "x", "max_tokens": 4,
                                                                 "session_id": big})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text  # refused before it ran
    assert r.json()["error"]["message"].endswith(f"past {top:,}, the most a session counts; ask for at most 3")
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=30, json={  # it streamed 4 tokens, then the 400
            "model": MODEL, "prompt": "x", "max_tokens": 4, "session_id": big, "stream": True}) as s:
        assert s.status_code == 400 and "choices" not in s.read().decode()
    r = httpx.post(f"{srv.url}/v1/sessions/{big}/append", json={"text": "abcde"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "text", r.text
    out = _post(srv, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3, "session_id": big}, 200)
    assert out["session"]["tokens_seen"] == top
    assert httpx.get(f"{srv.url}/v1/sessions/{big}", timeout=10).json()["tokens_seen"] == top
    exported = httpx.get(f"{srv.url}/v1/sessions/{big}/export", timeout=10).json()
    again = _post(srv, "/v1/sessions/import", exported, 201)
    assert again["tokens_seen"] == top


def test_a_window_too_short_for_this_model_is_refused(servers):
    srv = servers["elsewhere"]
    doc = {"tokenizer": httpx.get(f"{srv.url}/v1/sessions/{_post(srv, '/v1/sessions', {'text': 'x'}, 201)['id']}"
                                  "/export", timeout=10).json()["tokenizer"],
           "tokens_seen": 500, "window": [65] * 10}
    r = httpx.post(srv.url + "/v1/sessions/import", json=doc, timeout=30)
    assert r.status_code == 422 and "window" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "window"  # it was null, where every other import error names its field


def test_client_and_cli_carry_a_session_between_servers(servers, tmp_path):
    import json
    import subprocess
    import sys

    from txlserve_client import Client, UnprocessableEntityError

    src, dst = servers["cold"], servers["elsewhere"]
    with Client(base_url=src.url) as client:
        made = client.sessions.create(text=TEXT * 2)
        doc = client.sessions.export(made.id)
    assert doc["tokens_seen"] == 2 * len(TEXT)
    path = tmp_path / "session.json"
    out = subprocess.run([sys.executable, "-m", "server.cli", "session", "export", made.id, "--url", src.url,
                          "--out", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(path.read_text()) == doc  # the same document either way
    out = subprocess.run([sys.executable, "-m", "server.cli", "session", "import", str(path), "--url", dst.url],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    imported = json.loads(out.stdout)
    with Client(base_url=dst.url) as client:
        got = client.sessions.get(imported["id"])
        assert got.tokens_seen == 2 * len(TEXT) and got.window_tokens == len(doc["window"])
        with pytest.raises(UnprocessableEntityError):
            client.sessions.import_({**doc, "tokenizer": "word:other"})
    bad = subprocess.run([sys.executable, "-m", "server.cli", "session", "import", str(path), "--url",
                          "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "error" in bad.stderr


def test_a_server_on_a_redis_cluster_serves_and_moves_sessions(checkpoint, redis_cluster_url, servers, tmp_path):
    srv = LiveServer(checkpoint, redis_url=redis_cluster_url, data_dir=tmp_path / "on-cluster").start()
    try:
        sid = _post(srv, "/v1/sessions", {"text": TEXT * 2}, 201)["id"]
        here = _continue(srv, sid)
        assert here["session"]["tokens_seen"] == 2 * len(TEXT) + 24
        assert httpx.get(f"{srv.url}/v1/sessions/{sid}", timeout=10).json()["tokens_seen"] == 2 * len(TEXT) + 24
        doc = httpx.get(f"{srv.url}/v1/sessions/{sid}/export", timeout=10).json()
        moved = _post(servers["elsewhere"], "/v1/sessions/import", doc, 201)  # out of the cluster
        assert _continue(servers["elsewhere"], moved["id"])["choices"][0]["text"] == _continue(srv, sid)[
            "choices"][0]["text"]
    finally:
        srv.stop()

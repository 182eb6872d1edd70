"""Two servers over one Redis behind nginx running docker/nginx.conf: routed by session id, a session's requests
reach the replica that holds it hot; routed at random, every answer is the same. The hot-hit rates of both
routings are printed (``-s`` shows them)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.live import MODEL, NGINX, REPO, LiveServer, free_port, nginx, start_all, wait_for

pytestmark = pytest.mark.timeout(240)
TEXT = "Now is the winter of our discontent made glorious summer by this sun of York.\n"


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.M))


def _conf(replicas: list[int], port: int) -> str:
    """docker/nginx.conf, its two replicas and its port made local."""
    conf = (REPO / "docker" / "nginx.conf").read_text()
    conf = conf.replace("server txlserve-a:8000 resolve;", f"server 127.0.0.1:{replicas[0]};")
    conf = conf.replace("server txlserve-b:8000 resolve;", f"server 127.0.0.1:{replicas[1]};")
    return conf.replace("listen 8080;", f"listen 127.0.0.1:{port};")


@pytest.fixture(scope="module")
def balanced(checkpoint: Path, redis_url: str, tmp_path_factory) -> Iterator[tuple[str, list[LiveServer]]]:
    replicas = [LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path_factory.mktemp(f"replica{i}"))
                for i in range(2)]
    prefix = tmp_path_factory.mktemp("nginx")
    port = free_port()
    conf = _conf([replicas[0].port, replicas[1].port], port)
    url = f"http://127.0.0.1:{port}"
    if NGINX is None:  # before the replicas start: they would take seconds for nothing
        pytest.skip("no nginx binary (apt-get install nginx-light): this test needs one")
    try:
        start_all(*replicas)
        with nginx(prefix, conf, url + "/ready"):
            yield url, replicas
    finally:
        for replica in replicas:
            replica.stop()


def _hits(replicas: list[LiveServer]) -> tuple[float, float]:
    return (sum(_metric(r.url, "txlserve_hot_hits") for r in replicas),
            sum(_metric(r.url, "txlserve_hot_misses") for r in replicas))


def _continue(url: str, sid: str, routed: bool) -> str:
    r = httpx.post(url + "/v1/completions", headers={"x-session-id": sid} if routed else {}, timeout=60,
                   json={"model": MODEL, "prompt": " and", "max_tokens": 8, "temperature": 0, "session_id": sid})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_routing_by_session_keeps_sessions_hot_and_never_changes_answers(balanced):
    url, replicas = balanced
    sessions = 8
    made = [httpx.post(url + "/v1/sessions", json={"text": TEXT}, timeout=60).json()["id"] for _ in range(2 * sessions)]
    routed_ids, random_ids = made[:sessions], made[sessions:]
    rates, answers = {}, {}
    for name, ids, routed in (("routed", routed_ids, True), ("random", random_ids, False)):
        hits0, misses0 = _hits(replicas)
        answers[name] = [[_continue(url, sid, routed) for _ in range(3)] for sid in ids]
        hits, misses = _hits(replicas)
        rates[name] = (hits - hits0) / max(1.0, (hits - hits0) + (misses - misses0))
    print(f"hot-hit rate behind nginx: routed by session {rates['routed']:.2f}, at random {rates['random']:.2f}")
    # every session had the same text: whichever replica answered, and whether it was hot or restored from
    # Redis, the continuations are identical
    assert all(a == answers["routed"][0] for a in answers["routed"] + answers["random"])
    # routed: the 2nd and 3rd continuation of each session always find it hot on the replica the 1st reached
    assert rates["routed"] >= 2 / 3


def test_the_playground_opens_its_websocket_through_the_proxy(balanced):
    """A page served through nginx opens /v1/ws with the proxy's origin: the server must see that host (nginx
    passes X-Forwarded-Host), or the playground's WebSocket is refused as another origin's."""
    from websockets.sync.client import connect

    url, _ = balanced
    with connect(url.replace("http://", "ws://") + "/v1/ws", origin=url, open_timeout=30) as conn:
        conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "x", "max_tokens": 2}))
        while (msg := json.loads(conn.recv(timeout=30)))["type"] == "completion.delta":
            pass
    assert msg["type"] == "completion.done", msg


def test_a_body_over_the_proxys_limit_is_refused_in_openais_shape(balanced):
    """Between the server's 10,000,000 bytes and nginx's 10 MiB the server answered in JSON, above them nginx
    in HTML (found by a helper)."""
    url, _ = balanced
    for size in (10_000_100, 10_600_000):
        r = httpx.post(url + "/v1/completions", content=b"x" * size, timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large", (size, r.text[:200])


def test_the_proxy_passes_the_clients_own_address_not_one_it_claims(balanced):
    """nginx passed on a caller's own X-Forwarded-For, which uvicorn trusts from a proxy on loopback: the logs
    showed the address a client claimed (found by a helper)."""
    url, replicas = balanced
    assert httpx.get(url + "/v1/models", headers={"X-Forwarded-For": "6.6.6.6", "X-Request-Id": "xff-probe"},
                     timeout=30).status_code == 200
    line = wait_for(lambda: next((ln for r in replicas for ln in r.log.read_text().splitlines()
                                  if "xff-probe" in ln), None), 30, "the request's log line")
    assert '"client": "127.0.0.1' in line.replace('":"', '": "') and "6.6.6.6" not in line, line
    # a request without an id gets nginx's, which the replica logs and answers with: one id names it everywhere
    r = httpx.get(url + "/v1/models", timeout=30)
    wait_for(lambda: any(r.headers["x-request-id"] in rr.log.read_text() for rr in replicas), 30, "nginx's id logged")


def test_no_replica_answering_is_a_json_502(tmp_path):
    """nginx's own 502 was its HTML page, without a request id (found by a helper)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with nginx(tmp_path, _conf([free_port(), free_port()], port), url + "/ready", ready_status=502):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
            r = httpx.request(method, url + path, json={"model": MODEL, "prompt": "x"}, timeout=30)
            assert r.status_code == 502 and r.headers["content-type"].startswith("application/json"), r.text[:200]
            assert r.json()["error"]["code"] == "bad_gateway" and r.headers.get("x-request-id")
        mine = httpx.get(url + "/v1/models", headers={"X-Request-Id": "mine-123"}, timeout=30)
        assert mine.headers["x-request-id"] == "mine-123"  # the caller's id, as a replica answers with it
        odd = httpx.get(url + "/v1/models", headers={"X-Request-Id": "my id {x}"}, timeout=30)
        assert re.fullmatch(r"[0-9a-f]{32}", odd.headers["x-request-id"])  # one a replica would replace: nginx's

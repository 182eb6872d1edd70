"""Continuous batching as users feel it: long documents do not stall streams; overload is a 429."""

from __future__ import annotations

import threading
import time

import httpx

from tests.live import MODEL, LiveServer, wait_for


def test_long_append_does_not_stall_a_stream(server):
    sid = httpx.post(server.url + "/v1/sessions", json={}).json()["id"]
    doc = "All the world's a stage, and all the men and women merely players. " * 4000  # ~270 KB
    finished = {}

    def append():
        r = httpx.post(f"{server.url}/v1/sessions/{sid}/append", json={"text": doc}, timeout=300)
        finished["append"] = (time.monotonic(), r.status_code)

    t = threading.Thread(target=append)
    t.start()
    wait_gauge(server, "txlserve_requests_waiting", 1)  # the append is prefilling
    t0 = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Quick", "max_tokens": 20},
                   timeout=120)
    done = time.monotonic()
    assert r.status_code == 200
    t.join(300)
    assert finished["append"][1] == 200
    assert done < finished["append"][0], "the completion waited for the whole append"
    assert done - t0 < (finished["append"][0] - t0) / 2
    assert httpx.get(f"{server.url}/v1/sessions/{sid}").json()["tokens_seen"] == len(doc)


def _gauge(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics").text
    return float(next(x for x in text.splitlines() if x.startswith(name + " ")).split()[1])


def wait_gauge(srv, name: str, at_least: float, timeout: float = 120) -> None:
    wait_for(lambda: _gauge(srv, name) >= at_least, timeout, f"{name} to reach {at_least}", every=0.02)


def test_overload_answers_429_with_retry_after(checkpoint, redis_url, tmp_path):
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path,
                     args=("--max-batch", "1", "--max-queue", "1", "--prefill-chunk", "64")).start()
    try:
        doc = "To be, or not to be, that is the question. " * 1500  # 65 KB, read 64 tokens per step
        sids = [httpx.post(srv.url + "/v1/sessions", json={}).json()["id"] for _ in range(2)]
        results = []
        threads = [threading.Thread(target=lambda s=s: results.append(httpx.post(
            f"{srv.url}/v1/sessions/{s}/append", json={"text": doc}, timeout=300).status_code)) for s in sids]
        for t in threads:
            t.start()
        wait_gauge(srv, "txlserve_requests_waiting", 2)
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        assert int(r.headers["retry-after"]) >= 1
        for t in threads:
            t.join(300)
        assert results == [200, 200]
        assert httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "y",
                                                              "max_tokens": 2}).status_code == 200
    finally:
        srv.stop()


def test_requests_wait_beyond_the_batch_at_most_as_many_as_its_memory_holds():
    """Each request waiting beyond the batch holds its session's state: --max-queue of them had taken 800 MB of
    the bundled model's states beside a 2 MB batch, and a model of 354 MB a session would have held 90 GB (found
    by a helper). At most as many wait as --batch-mb holds rows, whatever --max-batch lets generate together."""
    from types import SimpleNamespace

    from server.runtime import Runtime

    def most(batch_mb: int, max_queue: int, row_bytes: int, capacity: int, api_servers: int = 1) -> int:
        rt = SimpleNamespace(settings=SimpleNamespace(batch_mb=batch_mb, max_queue=max_queue,
                                                      api_server_count=api_servers),
                             engine=SimpleNamespace(row_bytes=row_bytes), scheduler=SimpleNamespace(capacity=capacity))
        return Runtime.most_runs.fget(rt)  # type: ignore[attr-defined]

    assert most(1024, 256, 1_600_000, 256) == 256 + 256  # the bundled model: the queue as set
    assert most(2, 256, 1_600_000, 1) == 1 + 1  # its batch of one row: one waits
    assert most(1024, 256, 354 << 20, 2) == 2 + 2  # WikiText-103's model: two wait, not 256
    assert most(1024, 256, 1_600_000, 4) == 4 + 256  # --max-batch 4 with room for 671: the queue as set
    # API servers sharing one engine: each its share of the whole, or 4 of them held 4 times what one may
    assert most(64, 256, 1_600_000, 41, api_servers=4) == (41 + 41) // 4
    assert most(1024, 256, 1_600_000, 256, api_servers=2) == (256 + 512) // 2

"""What a server writes to Redis, over real HTTP: a completion on a stored session writes only the rows it added
to the session's memory; with TXLSERVE_LEGACY_STORE_FORMAT a server writes what older servers read."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import redis
import safetensors.torch

from memory_store.redis_tier import ring_key, session_key
from tests.live import MODEL, LiveServer

pytestmark = pytest.mark.timeout(120)


def complete(url: str, session_id: str, prompt: str, max_tokens: int) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                   "session_id": session_id}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_completion_writes_only_the_rows_it_added(server: LiveServer, redis_url: str) -> None:
    raw = redis.Redis.from_url(redis_url)
    try:
        sid = httpx.post(server.url + "/v1/sessions", json={"text": "Once upon a time"}, timeout=60).json()["id"]
        header = json.loads(raw.hget(session_key(sid), "header"))
        assert header["format_version"] == 3 and header["mem_rows"] == 16
        slot = raw.strlen(ring_key(sid)) // 16  # one position's rows, every layer
        patches = raw.info("commandstats").get("cmdstat_setrange", {}).get("calls", 0)
        complete(server.url, sid, " there", 5)
        assert raw.info("commandstats")["cmdstat_setrange"]["calls"] > patches  # patched, not rewritten
        header = json.loads(raw.hget(session_key(sid), "header"))
        assert header["tokens_seen"] == 16 + 6 + 5 and raw.strlen(ring_key(sid)) == min(27, header["mem_len"]) * slot
        before = httpx.get(f"{server.url}/v1/sessions/{sid}").json()
        assert before["tokens_seen"] == 27 and before["bytes"] > raw.strlen(ring_key(sid))
    finally:
        raw.close()


def test_the_legacy_format_setting(checkpoint: Path, redis_url: str, tmp_path: Path, server: LiveServer) -> None:
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path, env={"TXLSERVE_LEGACY_STORE_FORMAT": "true"})
    raw = redis.Redis.from_url(redis_url)
    try:
        srv.start()
        sid = httpx.post(srv.url + "/v1/sessions", json={"text": "Once upon a time"}, timeout=60).json()["id"]
        complete(srv.url, sid, " there", 5)
        header = json.loads(raw.hget(session_key(sid), "header"))
        assert header["format_version"] == 1 and not raw.exists(ring_key(sid))
        mems = safetensors.torch.load(raw.hget(session_key(sid), "payload"))["mems"]
        assert mems.shape[1] == min(27, header["mem_len"])
        complete(server.url, sid, " and", 3)  # a format-3 server reads it, and writes it back as format 3
        assert json.loads(raw.hget(session_key(sid), "header"))["format_version"] == 3 and raw.exists(ring_key(sid))
    finally:
        raw.close()
        srv.stop()

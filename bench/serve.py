"""`txlserve bench serve`: load over loopback against a real server process, and the engine alone.

For each concurrency N, N clients stream completions, each continuing its own session,
for T seconds; in the same run the engine alone (same checkpoint, same thread count, no
HTTP) generates at batch N with full memories, and the ratio of the two is the server's
share of its engine. Then the product's reason to exist: time to first token when
continuing a long document from its session vs re-sending the whole document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

MODEL = "bench-model"  # the name a spawned server gets; with --url, read from /v1/models


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] * 1e3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Server:
    def __init__(self, checkpoint: str, data_dir: str, extra: list[str]) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "server.cli", "serve", "--checkpoint", checkpoint, "--port", str(self.port),
               "--data-dir", data_dir, "--model-name", MODEL, "--log-level", "warning", *extra]
        self.proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, env={**os.environ})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[float, list[float], int]:
    """Time to first token, inter-token gaps, tokens (from the usage the server reports)."""
    t0 = time.perf_counter()
    ttft, gaps, last, n = None, [], None, 0
    body = {"model": client.headers.get("x-bench-model", MODEL), "stream": True,
            "stream_options": {"include_usage": True}, **body}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"{r.status_code} {r.text[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            if not chunk["choices"] or not chunk["choices"][0]["text"]:
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
    return ttft or 0.0, gaps, n


def _client(url: str, model: str, connections: int, timeout: float = 120) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=timeout, headers={"x-bench-model": model},
                             limits=httpx.Limits(max_connections=connections + 4))


def served_model(url: str) -> str:
    """The model a running server serves (its first in /v1/models)."""
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def engine_tokens_per_s(checkpoint: str, batch: int, tokens: int = 64, repeat: int = 3) -> float:
    """The engine alone: ``batch`` sessions with full memories generating (decode step plus sampling)."""
    import torch

    from model.engine import Engine, Generation
    from model.sampling import SamplingParams

    engine = Engine.from_checkpoint(checkpoint)
    state = engine.new_state(batch)
    ids = torch.randint(32, 127, (batch, engine.mem_len))
    engine.decoder.prefill(state, ids, chunk_size=engine.prefill_chunk)
    gens = [Generation(SamplingParams(max_tokens=repeat * tokens + 1, temperature=0.8), engine.tokenizer)
            for _ in range(batch)]
    best = float("inf")
    for _ in range(repeat):  # the best of a few: the least disturbed by the rest of the machine
        t0 = time.perf_counter()
        for _ in range(tokens):
            logits = state.last_logits.float().cpu()  # [batch, vocab]
            chosen = [g.on_logits(logits[r]).token for r, g in enumerate(gens)]
            engine.decoder.step(state, torch.tensor(chosen)[:, None])
        best = min(best, time.perf_counter() - t0)
    return batch * tokens / best


async def _load(url: str, model: str, concurrency: int, duration: float, max_tokens: int) -> dict[str, Any]:
    ttfts, gaps, tokens, errors, samples = [], [], 0, 0, []
    async with _client(url, model, concurrency) as c:
        sessions = [(await c.post("/v1/sessions", json={"text": f"Client {i} writes: "})).json()["id"]
                    for i in range(concurrency)]
        stop_at = time.perf_counter() + duration

        async def worker(sid: str) -> None:
            nonlocal tokens, errors
            while time.perf_counter() < stop_at:
                try:
                    ttft, g, n = await _stream(c, {"prompt": " and", "max_tokens": max_tokens, "temperature": 0.8,
                                                   "session_id": sid})
                    ttfts.append(ttft)
                    gaps.extend(g)
                    tokens += n
                except Exception as err:
                    errors += 1
                    if len(samples) < 3:
                        samples.append(str(err)[:200])

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(s) for s in sessions))
        elapsed = time.perf_counter() - t0
    return {"concurrency": concurrency, "duration_s": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed,
            "requests": len(ttfts), "errors": errors, "error_samples": samples, "ttft_p50_ms": _pct(ttfts, 0.5),
            "ttft_p99_ms": _pct(ttfts, 0.99),
            "itl_p50_ms": _pct(gaps, 0.5), "itl_p99_ms": _pct(gaps, 0.99)}


async def _continue_vs_resend(url: str, model: str, doc: str, repeats: int) -> dict[str, Any]:
    async with _client(url, model, 1, timeout=600) as c:
        sid = (await c.post("/v1/sessions", json={"text": doc})).json()["id"]
        cont, resend = [], []
        for _ in range(repeats):
            cont.append((await _stream(c, {"prompt": "\n", "max_tokens": 1, "session_id": sid}))[0])
            resend.append((await _stream(c, {"prompt": doc + "\n", "max_tokens": 1}))[0])
    c50, r50 = statistics.median(cont), statistics.median(resend)
    return {"doc_bytes": len(doc.encode()), "continue_ttft_ms": c50 * 1e3, "resend_ttft_ms": r50 * 1e3,
            "continue_speedup": r50 / c50}


def run(checkpoint: str, *, concurrency: tuple[int, ...] = (1, 16, 64), duration: float = 10, max_tokens: int = 64,
        doc_kb: float = 50, url: str | None = None, repeats: int = 3) -> dict[str, Any]:
    from bench.store import _document
    from model.threads import set_threads

    set_threads(None)  # the server's default thread count, for the engine measured here
    doc = _document(int(doc_kb * 1000)).decode("utf-8", errors="replace")
    loads = []
    with tempfile.TemporaryDirectory(prefix="txl-bench-serve-") as data_dir:
        server = None if url else _Server(checkpoint, data_dir, [])
        target = url or server.url
        model = served_model(target)
        try:
            for n in concurrency:
                load = asyncio.run(_load(target, model, n, duration, max_tokens))
                load["engine_tokens_per_s"] = engine_tokens_per_s(checkpoint, n)
                load["server_over_engine"] = load["tokens_per_s"] / load["engine_tokens_per_s"]
                loads.append(load)
            result: dict[str, Any] = {"loads": loads}
            result.update(asyncio.run(_continue_vs_resend(target, model, doc, repeats)))
        finally:
            if server is not None:
                server.stop()
    result.update({"checkpoint": checkpoint, "model": model, "max_tokens": max_tokens, "url": url or "spawned"})
    return result


def _counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=None, help="default: the bundled checkpoint (the engine alone runs it too)")
    p.add_argument("--url", default=None, help="an already running server (default: start one)")
    p.add_argument("--concurrency", type=_counts, default=(1, 16, 64), help="streams, e.g. 1,16,64")
    p.add_argument("--duration", type=float, default=10, help="seconds of load per concurrency")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--doc-kb", type=float, default=50)
    p.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")


def main(ns: argparse.Namespace) -> int:
    from model.bundled import resolve_checkpoint

    print(json.dumps(run(resolve_checkpoint(ns.checkpoint), concurrency=ns.concurrency, duration=ns.duration,
                         max_tokens=ns.max_tokens, doc_kb=ns.doc_kb, url=ns.url)))
    return 0

"""Memory-store latency: put, and get from the hot tier or from Redis, for a large and a small state; and a
request's commit that appended tokens (only their rows written) against the same commit written whole.

The large state is what a 12-layer, d_model 512 model keeps for 1600 memory
tokens in bf16 (~20 MB); the small one is the same model's 32 tokens. With no
URL the embedded Redis is used, whose ``appendfsync always`` puts an fsync in
every write, as in a default deployment.

    python -m bench.store [--iters N] [--state-mb-large MiB] [--url redis://...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from memory_store import MemoryStore, ModelIdentity
from model.config import MEM_LEN_MOST
from txlserve.args import count, real

N_LAYER, D_MODEL, DTYPE = 12, 512, torch.bfloat16
MiB = 1 << 20
_BYTES_PER_TOKEN = N_LAYER * D_MODEL * 2  # bf16


def _stats(samples_s: list[float], nbytes: int) -> dict[str, float]:
    ordered = sorted(samples_s)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    p50 = statistics.median(ordered)
    return {"p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3, "mb_s": nbytes / 1e6 / p50}


async def _time(op: Callable[[], Awaitable[object]], iters: int) -> list[float]:
    await op()  # warm-up: connections, scripts, allocator
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        await op()
        samples.append(time.perf_counter() - start)
    return samples


async def _measure(url: str | None, data_dir: str, mem_tokens: int, iters: int) -> dict[str, Any]:
    identity = ModelIdentity("bench-store", N_LAYER, D_MODEL)
    state = {"mems": torch.randn(N_LAYER, mem_tokens, D_MODEL).to(DTYPE)}
    nbytes = state["mems"].nbytes
    common = {"identity": identity, "data_dir": data_dir, "max_payload_mb": 2 * nbytes / MiB + 1}
    async with (
        MemoryStore.from_url(url, hot_cache_mb=4 * nbytes / MiB, **common) as hot,
        MemoryStore.from_url(url, hot_cache_mb=0, **common) as cold,  # every get goes to Redis
    ):
        session_id = (await hot.create(tensors=state, mem_len=mem_tokens)).session_id
        put = await _time(lambda: hot.put(session_id, state, mem_len=mem_tokens), iters)
        get_hot = await _time(lambda: hot.get(session_id), iters)
        get_redis = await _time(lambda: cold.get(session_id), iters)
        assert hot.metrics.hot_hits >= iters and cold.metrics.redis_hits >= iters
        await hot.delete(session_id)
        commits = await _commits(hot, mem_tokens, iters)
    return {
        "shape": [N_LAYER, mem_tokens, D_MODEL],
        "dtype": str(DTYPE).removeprefix("torch."),
        "mb": nbytes / 1e6,
        "put": _stats(put, nbytes),
        "get_hot": _stats(get_hot, nbytes),
        "get_redis": _stats(get_redis, nbytes),
        **commits,
    }


async def _commits(store: MemoryStore, mem_tokens: int, iters: int) -> dict[str, Any]:
    """A session that reads ``append`` more tokens per request, committed as the server commits it (lease,
    write, release in one round trip), alternately with ``appended=True`` and written whole."""
    append = max(1, min(64, mem_tokens // 2))
    doc = torch.randn(N_LAYER, mem_tokens + append * (2 * iters + 4), D_MODEL).to(DTYPE)  # [n_layer, tokens, d]
    seen = mem_tokens
    session_id = (await store.create(tensors={"mems": doc[:, :seen]}, mem_len=mem_tokens,
                                     tokens_seen=seen)).session_id

    async def commit(appended: bool) -> None:
        nonlocal seen
        async with store.lease(session_id, tensors=False) as lease:
            seen += append
            await store.commit(lease, {"mems": doc[:, seen - mem_tokens:seen]}, tokens_seen=seen,
                               mem_len=mem_tokens, release=True, appended=appended)

    samples: dict[bool, list[float]] = {True: [], False: []}
    for appended in (True, False):
        await commit(appended)  # warm-up
    for _ in range(iters):
        for appended in (True, False):
            start = time.perf_counter()
            await commit(appended)
            samples[appended].append(time.perf_counter() - start)
    await store.delete(session_id)
    rows = N_LAYER * append * D_MODEL * doc.element_size()
    whole, part = _stats(samples[False], N_LAYER * mem_tokens * D_MODEL * doc.element_size()), _stats(samples[True],
                                                                                                       rows)
    return {"append_tokens": append, "commit_whole": whole, "commit_appended": part,
            "appended_speedup": whole["p50_ms"] / part["p50_ms"]}


def parsers(url: str | None, data_dir: str, mem_tokens: int, iters: int) -> dict[str, Any]:
    """Reading one large session's payload with redis-py's pure-Python reply parser and, when the ``hiredis``
    extra is installed, its C parser, in the same run (p50 ms; ``hiredis_speedup``)."""
    import redis.asyncio
    from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser
    from redis.utils import HIREDIS_AVAILABLE

    from memory_store.embedded import EmbeddedRedis
    from memory_store.redis_tier import ring_key

    async def go(url: str) -> dict[str, Any]:
        identity = ModelIdentity("bench-store", N_LAYER, D_MODEL)
        state = {"mems": torch.randn(N_LAYER, mem_tokens, D_MODEL).to(DTYPE)}
        async with MemoryStore.from_url(url, identity=identity, data_dir=data_dir, hot_cache_mb=0,
                                        max_payload_mb=64) as store:
            sid = (await store.create(tensors=state, mem_len=mem_tokens)).session_id
            out: dict[str, Any] = {"memory_mb": state["mems"].nbytes / 1e6, "hiredis_installed": HIREDIS_AVAILABLE}
            kinds = {"python": _AsyncRESP2Parser, **({"hiredis": _AsyncHiredisParser} if HIREDIS_AVAILABLE else {})}
            for name, parser in kinds.items():
                client = redis.asyncio.Redis.from_url(url, parser_class=parser)
                samples = await _time(lambda c=client: c.get(ring_key(sid)), iters)
                await client.aclose()
                out[f"{name}_read_ms"] = statistics.median(samples) * 1e3
            if HIREDIS_AVAILABLE:
                out["hiredis_speedup"] = out["python_read_ms"] / out["hiredis_read_ms"]
            await store.delete(sid)
            return out

    async def main() -> dict[str, Any]:
        if url is not None:
            return await go(url)
        embedded = EmbeddedRedis(data_dir)  # the store below joins this same server
        await asyncio.to_thread(embedded.start)
        try:
            return await go(embedded.url)
        finally:
            await asyncio.to_thread(embedded.stop)

    return asyncio.run(main())


LARGE_MB = 1600 * _BYTES_PER_TOKEN / MiB
SMALL_MB = 32 * _BYTES_PER_TOKEN / MiB


def run(
    *, state_mb_large: float = LARGE_MB, state_mb_small: float = SMALL_MB, iters: int = 50, url: str | None = None
) -> dict[str, Any]:
    """Latencies (p50, p99 in ms) and throughput (MB/s at p50) of put, hot get and Redis get."""

    async def both(data_dir: str) -> dict[str, Any]:
        result: dict[str, Any] = {"url": url or "embedded", "iters": iters}
        for name, mb in (("large", state_mb_large), ("small", state_mb_small)):
            result[name] = await _measure(url, data_dir, max(1, round(mb * MiB / _BYTES_PER_TOKEN)), iters)
        return result

    with tempfile.TemporaryDirectory(prefix="txl-bench-") as data_dir:
        result = asyncio.run(both(data_dir))
        result["parsers"] = parsers(url, data_dir, max(1, round(state_mb_large * MiB / _BYTES_PER_TOKEN)), iters)
        return result


def _document(n_bytes: int) -> bytes:
    """Real prose when ../shared is beside the repo, else deterministic pseudo-words."""
    from pathlib import Path

    corpus = Path(__file__).resolve().parents[2] / "shared" / "data" / "shakespeare" / "hamlet_gut.txt"
    if corpus.is_file():
        text = corpus.read_bytes()
        return (text * (n_bytes // len(text) + 1))[:n_bytes]
    gen = torch.Generator().manual_seed(0)
    words = [b"the", b"memory", b"of", b"a", b"session", b"is", b"fixed", b"size", b"and", b"long"]
    idx = torch.randint(0, len(words), (n_bytes // 3,), generator=gen).tolist()
    return b" ".join(words[i] for i in idx)[:n_bytes]


def restore_vs_recompute(checkpoint: str, *, doc_bytes: int = 100_000, iters: int = 10,
                         url: str | None = None, mem_len: int | None = None) -> dict[str, Any]:
    """What a stored session saves: loading its state from Redis (and rebuilding the key/value
    rings) against recomputing the same state by prefilling the whole document again."""
    from model.engine import Engine

    engine = Engine.from_checkpoint(checkpoint, mem_len=mem_len)
    ids = list(_document(doc_bytes))
    t0 = time.perf_counter()
    state = engine.new_state()
    engine.feed(state, ids)
    recompute_s = time.perf_counter() - t0
    tensors = engine.export_state(state)
    identity = ModelIdentity(engine.fingerprint, engine.config.n_layer, engine.config.d_model)

    async def restore(data_dir: str) -> list[float]:
        async with MemoryStore.from_url(url, identity=identity, data_dir=data_dir, hot_cache_mb=0) as store:
            sid = (await store.create(tensors=tensors, mem_len=engine.mem_len, tokens_seen=len(ids))).session_id

            async def once() -> None:
                session = await store.get(sid)  # hot tier disabled: every get reads Redis
                engine.import_state(session.tensors, tokens_seen=len(ids), fingerprint=engine.fingerprint)

            samples = await _time(once, iters)
            await store.delete(sid)
            return samples

    with tempfile.TemporaryDirectory(prefix="txl-bench-") as data_dir:
        samples = asyncio.run(restore(data_dir))
    restore_s = statistics.median(samples)
    return {"doc_bytes": len(ids), "mem_len": engine.mem_len, "n_layer": engine.config.n_layer,
            "d_model": engine.config.d_model, "state_mb": sum(t.nbytes for t in tensors.values()) / 1e6,
            "recompute_ms": recompute_s * 1e3, "restore_ms": restore_s * 1e3,
            "restore_p99_ms": _stats(samples, 1)["p99_ms"], "restore_speedup": recompute_s / restore_s,
            "threads": torch.get_num_threads()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iters", type=count(1), default=50, help="round trips timed a state size")
    parser.add_argument("--state-mb-large", type=real(0, above=True), default=LARGE_MB,
                        help=f"the large session state, in MiB (2^20 bytes; the results' \"mb\" is 10^6 bytes) "
                             f"(default: {LARGE_MB:.1f})")
    parser.add_argument("--state-mb-small", type=real(0, above=True), default=SMALL_MB,
                        help=f"the small session state, in MiB (default: {SMALL_MB:.2f})")
    parser.add_argument("--url", default=None, help="a redis:// URL (default: the embedded Redis)")
    parser.add_argument("--checkpoint", default=None, help="model for restore vs recompute (default: bundled)")
    parser.add_argument("--doc-kb", type=real(0, above=True), default=100,
                        help="document size for restore vs recompute")
    parser.add_argument("--mem-len", type=count(1, MEM_LEN_MOST), default=None, help="default: the checkpoint's")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    from bench import tiers

    tiers.add_arguments(parser)


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="python -m bench.store", description=__doc__.splitlines()[0])
        add_arguments(parser)
        args = parser.parse_args(args)
    from model.bundled import resolve_checkpoint
    from model.threads import set_threads

    set_threads(args.threads)  # before the first measure: restore against recompute ran at torch's default (a helper)
    result = run(state_mb_large=args.state_mb_large, state_mb_small=args.state_mb_small, iters=args.iters, url=args.url)
    result.update(restore_vs_recompute(resolve_checkpoint(args.checkpoint), doc_bytes=int(args.doc_kb * 1000),
                                       iters=min(args.iters, 20), url=args.url, mem_len=args.mem_len))
    from bench import tiers

    result["tiers"] = tiers.run(args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

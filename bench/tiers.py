"""The three tiers of a session, measured per model shape: bytes a session occupies hot (the engine's rings),
warm (its hidden states in Redis) and cold (its last ``n_layer * mem_len + 1`` tokens in Redis); restoring it
from Redis against rebuilding it from its window; and the idle time after which the cold tier is cheaper.

Break-even: keeping a session warm for an hour costs its extra bytes at a memory price; moving it cold costs,
on its next use, the rebuild's extra compute at a core price. Idle longer than ``break_even_hours`` and cold
is cheaper. Prices are arguments (defaults: on-demand cloud list prices of 2026, memory-optimised RAM and
compute-optimised cores). A rebuild longer than ``--rebuild-max-tokens`` is projected from the prefill rate
measured on a full memory, and marked so.

    txlserve bench store --tiers bundled,12x512,wt103 [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.scale import full_state, random_wt103
from memory_store import MemoryStore, ModelIdentity
from model.checkpoint import save_checkpoint
from model.config import TXLConfig
from model.engine import Engine
from model.threads import set_threads
from model.transformer_xl import MemTransformerLM
from txlserve.args import MAX_THREADS, count, real
from txlserve.args import shape as shape_arg


def _engine(shape: str, work: Path) -> Engine:
    if shape == "bundled":
        from model.bundled import resolve_checkpoint

        return Engine.from_checkpoint(resolve_checkpoint(None))
    if shape == "wt103":
        random_wt103(work / "wt103")
        return Engine.from_checkpoint(work / "wt103")
    layers, d = (int(x) for x in shape.split("x"))
    torch.manual_seed(0)
    cfg = TXLConfig(n_layer=layers, d_model=d, n_head=d // 64, d_head=64, d_inner=4 * d, dropout=0.0,
                    tgt_len=512, mem_len=1600, vocab_size=256)
    save_checkpoint(MemTransformerLM(cfg), work / shape)
    return Engine.from_checkpoint(work / shape)


@torch.no_grad()
def _rebuild_seconds(engine: Engine, window: list[int], max_tokens: int) -> tuple[float, bool]:
    """Seconds to rebuild a session from ``window``; (seconds, projected)."""
    if len(window) <= max_tokens:
        t0 = time.perf_counter()
        engine.rebuild(window, tokens_seen=len(window) + 7)
        return time.perf_counter() - t0, False
    state = full_state(engine)  # steady state: every chunk attends over a full memory
    part = torch.tensor([window[:max_tokens]])
    t0 = time.perf_counter()
    engine.decoder.prefill(state, part, chunk_size=engine.prefill_chunk)
    return (time.perf_counter() - t0) * len(window) / max_tokens, True


def measure(shape: str, work: Path, *, iters: int, rebuild_max_tokens: int, ram_usd_gb_hour: float,
            cpu_usd_core_hour: float) -> dict[str, Any]:
    engine = _engine(shape, work)
    w, cfg = engine.window_len, engine.config
    window = torch.randint(0, cfg.vocab_size, (w,), generator=torch.Generator().manual_seed(0)).tolist()
    seen = w + 7
    state = full_state(engine)
    state.seen.fill_(seen)
    tensors = {**engine.export_state(state), "window": torch.tensor(window, dtype=torch.int32)}
    identity = ModelIdentity(engine.fingerprint, cfg.n_layer, cfg.d_model, tokenizer=engine.tokenizer_id)
    nbytes = sum(t.nbytes for t in tensors.values())

    async def go(data_dir: str) -> tuple[int, int, list[float]]:
        async with MemoryStore.from_url(None, identity=identity, data_dir=data_dir, hot_cache_mb=0, op_timeout_s=60,
                                        max_payload_mb=2 * nbytes / 2**20 + 1) as store:
            sid = (await store.create(tensors=tensors, mem_len=engine.mem_len, tokens_seen=seen)).session_id
            warm = (await store.info(sid)).bytes
            restore = []
            for _ in range(iters):
                t0 = time.perf_counter()
                session = await store.get(sid)  # hot tier off: a Redis read, then the rings re-projected
                engine.import_state(session.tensors, tokens_seen=seen, fingerprint=engine.fingerprint)
                restore.append(time.perf_counter() - t0)
            assert await store.demote(sid)
            cold = (await store.info(sid)).bytes
            await store.delete(sid)
            return warm, cold, restore

    with tempfile.TemporaryDirectory(prefix="txl-tiers-") as data_dir:
        warm, cold, restore = asyncio.run(go(data_dir))
    restore_s = statistics.median(restore)
    rebuild_s, projected = _rebuild_seconds(engine, window, rebuild_max_tokens)
    threads = torch.get_num_threads()
    extra_usd = max(0.0, rebuild_s - restore_s) / 3600 * threads * cpu_usd_core_hour
    saved_usd_hour = (warm - cold) / 1e9 * ram_usd_gb_hour
    return {
        "shape": shape, "n_layer": cfg.n_layer, "d_model": cfg.d_model, "mem_len": engine.mem_len,
        "window_tokens": w, "hot_bytes": state.row_bytes, "warm_bytes": warm, "cold_bytes": cold,
        "warm_over_cold": warm / cold, "restore_ms": 1000 * restore_s, "rebuild_ms": 1000 * rebuild_s,
        "rebuild_projected": projected, "rebuild_over_restore": rebuild_s / restore_s,
        "break_even_hours": extra_usd / saved_usd_hour, "threads": threads,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiers", type=_tiers, default="bundled",
                   help="model shapes for the tier figures, comma-separated: bundled, LxD (mem_len 1600, random "
                        "weights), wt103 (random weights); empty: none")
    p.add_argument("--tier-iters", type=count(1), default=5, help="restores timed per shape (median)")
    p.add_argument("--rebuild-max-tokens", type=count(1), default=4096,
                   help="longer windows: rebuild time projected from the prefill rate on a full memory")
    p.add_argument("--ram-usd-gb-hour", type=real(0), default=0.0066, help="price of a GB of Redis memory for an hour")
    p.add_argument("--cpu-usd-core-hour", type=real(0), default=0.045, help="price of one core for an hour")
    p.add_argument("--threads", type=count(1, MAX_THREADS), default=1, help="torch threads (a rebuild's cores)")


def _tiers(text: str) -> str:
    for name in filter(None, (x.strip().lower() for x in text.split(","))):
        if name not in ("bundled", "wt103"):
            try:
                shape_arg(name)  # LxD
            except argparse.ArgumentTypeError as err:  # it named the LxD form alone
                raise argparse.ArgumentTypeError(str(err).replace("expected ", "expected bundled, wt103 or ", 1)
                                                 ) from None
    return text.lower()


def run(ns: argparse.Namespace) -> dict[str, Any]:
    set_threads(ns.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="txl-tiers-ck-") as tmp:
        for shape in filter(None, (x.strip() for x in ns.tiers.split(","))):
            rows.append(measure(shape, Path(tmp), iters=ns.tier_iters, rebuild_max_tokens=ns.rebuild_max_tokens,
                                ram_usd_gb_hour=ns.ram_usd_gb_hour, cpu_usd_core_hour=ns.cpu_usd_core_hour))
    return {"ram_usd_gb_hour": ns.ram_usd_gb_hour, "cpu_usd_core_hour": ns.cpu_usd_core_hour, "shapes": rows}

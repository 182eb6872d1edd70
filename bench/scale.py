"""`txlserve bench scale`: the published WikiText-103 model's shape on this machine, with random weights.

18 layers, d_model 1024, 16 heads of 64, d_inner 4096, a 267,735-word adaptive softmax (cutoffs
20000/40000/200000, div_val 4), mem_len 1600 as published (1599 here: the same window). Speed does not
depend on the values, so random weights stand in for the 1.14 GB download. Measured in one run:

* **load**: a fresh process loads the checkpoint; its peak RSS over the RSS it had before loading,
  against the size of the weights (the floor: one copy);
* **decode**: batch-1 steps with a full memory, against the read-bandwidth roofline measured here;
* **session**: storing a full session's state in the embedded Redis and restoring it (read + rebuilding
  the key/value rings), against recomputing it by prefill (measured per token here, for the ``mem_len``
  tokens a session holds and for the ``n_layer * mem_len + 1`` tokens that determine it exactly).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.decode import _timed, read_bandwidth, step_bytes
from model.checkpoint import WEIGHTS, read_meta, save_checkpoint
from model.config import TXLConfig
from model.engine import Engine
from model.sampling import rows_logprobs
from model.threads import set_threads
from model.tokenizer import WordTokenizer
from model.transformer_xl import MemTransformerLM
from txlserve.args import MAX_THREADS, count
from txlserve.errors import ConfigError

WT103 = dict(n_layer=18, d_model=1024, n_head=16, d_head=64, d_inner=4096, dropout=0.0, tgt_len=128,
             mem_len=1599, clamp_len=1000, same_length=True, vocab_size=267_735, cutoffs=(20_000, 40_000, 200_000),
             div_val=4, tie_projs=(False, True, True, True))

_LOAD = """
import json, sys, time
from model.checkpoint import load_checkpoint

def status(field):  # this process's own address space (ru_maxrss would start from the parent's peak)
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field + ":"))

before = status("VmRSS")
t0 = time.perf_counter()
ckpt = load_checkpoint(sys.argv[1])
seconds = time.perf_counter() - t0
print(json.dumps({"load_s": seconds, "rss_before": before, "rss_peak": status("VmHWM")}))
"""


def random_wt103(out: Path, **changes: Any) -> TXLConfig:
    cfg = TXLConfig(**{**WT103, **changes})
    torch.manual_seed(0)
    symbols = ["<eos>", "<unk>"] + [f"w{i}" for i in range(2, cfg.vocab_size)]
    save_checkpoint(MemTransformerLM(cfg), out, tokenizer=WordTokenizer(symbols))
    return cfg


def measure_load(ckpt: Path) -> dict[str, Any]:
    weights = (ckpt / WEIGHTS).stat().st_size
    proc = subprocess.run([sys.executable, "-c", _LOAD, str(ckpt.resolve())], capture_output=True, text=True,
                          timeout=1800,  # (resolved: it runs in the repository, where a relative path was not found)
                          cwd=Path(__file__).resolve().parents[1])
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    got = json.loads(proc.stdout)
    extra = got["rss_peak"] - got["rss_before"]
    return {"weights_bytes": weights, "load_s": got["load_s"], "load_peak_rss_over_weights": extra / weights}


def full_state(engine: Engine):
    """A batch-1 session whose memory is full: random keys and values (a step's cost does not depend on them)."""
    state = engine.new_state(1)
    for t in (state.hid, state.k, state.v):
        t.normal_()
    state.seen.fill_(engine.mem_len)
    state.last_logits.normal_()
    return state


@torch.no_grad()
def measure_decode(engine: Engine, tokens: int) -> dict[str, Any]:
    state = full_state(engine)
    step = torch.zeros(1, 1, dtype=torch.long)
    engine.decoder.step(state, step)  # warm-up
    seconds = _timed(lambda: [engine.decoder.step(state, step) for _ in range(tokens)], engine.device, repeat=2)
    bandwidth, nbytes = read_bandwidth(engine.device), step_bytes(engine, 1)
    return {"decode_tokens_per_s": tokens / seconds, "decode_step_ms": 1000 * seconds / tokens,
            "bytes_per_step": nbytes, "read_bandwidth_gb_s": bandwidth / 1e9,
            "roofline_share": nbytes / (seconds / tokens) / bandwidth}


@torch.no_grad()
def measure_prefill(engine: Engine, tokens: int) -> float:
    """Prefill tokens/s after a full memory, in the engine's chunks."""
    state = full_state(engine)
    ids = torch.randint(0, engine.config.vocab_size, (1, tokens))
    return tokens / _timed(lambda: engine.decoder.prefill(state, ids, chunk_size=engine.prefill_chunk), engine.device)


@torch.no_grad()
def measure_scoring(engine: Engine, tokens: int) -> dict[str, Any]:
    """A prompt's scores from its logits over the word vocabulary (echo with logprobs 5), and the same with each
    token's rank in the vocabulary (vLLM's prompt_logprobs), timed alternately in this run (best of 3 each): the
    ranks' count over the whole table is the one cost prompt_logprobs adds."""
    ids = torch.randint(0, engine.config.vocab_size, (tokens + 1,)).tolist()
    logits = engine.logits(engine.feed(engine.new_state(), ids)[:-1])  # [tokens, vocab]: predicts ids[1:]
    plain, ranked = float("inf"), float("inf")
    for _ in range(3):
        plain = min(plain, _timed(lambda: rows_logprobs(logits, ids[1:], 5), engine.device))
        ranked = min(ranked, _timed(lambda: rows_logprobs(logits, ids[1:], 5, ranks=True), engine.device))
    return {"scored_tokens": tokens, "score_ms": 1000 * plain, "score_with_ranks_ms": 1000 * ranked,
            "ranks_over_scores": ranked / plain}


def measure_session(engine: Engine, dtype: torch.dtype, iters: int) -> dict[str, Any]:
    from memory_store import MemoryStore, ModelIdentity

    tensors = engine.export_state(full_state(engine), dtype=dtype)
    seen = engine.mem_len
    identity = ModelIdentity(engine.fingerprint, engine.config.n_layer, engine.config.d_model)
    nbytes = sum(t.nbytes for t in tensors.values())

    async def go(data_dir: str) -> tuple[list[float], list[float]]:
        async with MemoryStore.from_url(None, identity=identity, data_dir=data_dir, hot_cache_mb=0, op_timeout_s=60,
                                        max_payload_mb=2 * nbytes / 2**20 + 1) as store:
            sid = (await store.create(tensors=tensors, mem_len=engine.mem_len, tokens_seen=seen)).session_id
            put, restore = [], []
            for _ in range(iters):
                t0 = time.perf_counter()
                await store.put(sid, tensors, mem_len=engine.mem_len, tokens_seen=seen)
                put.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                session = await store.get(sid)  # hot tier off: a Redis read
                engine.import_state(session.tensors, tokens_seen=seen, fingerprint=engine.fingerprint)
                restore.append(time.perf_counter() - t0)
            await store.delete(sid)
            return put, restore

    with tempfile.TemporaryDirectory(prefix="txl-scale-") as data_dir:
        put, restore = asyncio.run(go(data_dir))
    return {"dtype": str(dtype).removeprefix("torch."), "state_bytes": nbytes,
            "store_ms": 1000 * statistics.median(put), "restore_ms": 1000 * statistics.median(restore)}


def run(*, tokens: int, prefill_tokens: int, iters: int, work_dir: Path, checkpoint: Path | None = None) -> dict:
    ckpt = checkpoint
    if ckpt is None:
        ckpt = work_dir / "wt103-random"
        random_wt103(ckpt)
    else:  # one line for a path that is no checkpoint, before the load is timed in a process of its own
        read_meta(ckpt)
    result: dict[str, Any] = {"checkpoint": str(checkpoint) if checkpoint else "random wt103 shape",
                              "threads": torch.get_num_threads(), "torch": torch.__version__}
    result.update(measure_load(ckpt))
    engine = Engine.from_checkpoint(ckpt)
    cfg = engine.config
    result.update({"n_layer": cfg.n_layer, "d_model": cfg.d_model, "vocab_size": cfg.vocab_size,
                   "mem_len": engine.mem_len, "prefill_chunk": engine.prefill_chunk})
    result.update(measure_decode(engine, tokens))
    rate = measure_prefill(engine, prefill_tokens)
    window = cfg.n_layer * engine.mem_len + 1
    result.update({"prefill_tokens_per_s": rate, "recompute_mem_len_s": engine.mem_len / rate,
                   "recompute_window_tokens": window, "recompute_window_s": window / rate})
    result["scoring"] = measure_scoring(engine, min(256, prefill_tokens))
    result["sessions"] = [measure_session(engine, d, iters) for d in (torch.float32, torch.bfloat16)]
    for s in result["sessions"]:
        s["restore_speedup_vs_mem_len_prefill"] = result["recompute_mem_len_s"] * 1000 / s["restore_ms"]
        s["restore_speedup_vs_window_prefill"] = result["recompute_window_s"] * 1000 / s["restore_ms"]
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=None, help="an imported model (default: random weights, WikiText-103 shape)")
    p.add_argument("--tokens", type=count(1), default=8, help="decode steps to time")
    p.add_argument("--prefill-tokens", type=count(1), default=400, help="prompt tokens prefilled and timed")
    p.add_argument("--iters", type=count(1), default=5, help="store/restore repetitions")
    p.add_argument("--work-dir", default=None, help="where the random checkpoint is written (default: a temp dir)")
    p.add_argument("--threads", type=count(1, MAX_THREADS), default=None,
                   help="torch CPU threads (default: half the usable cores)")
    p.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")


def main(ns: argparse.Namespace) -> int:
    set_threads(ns.threads)
    if ns.work_dir is not None and not Path(ns.work_dir).is_dir():  # (it was named with the temporary directory
        raise ConfigError(f"--work-dir {ns.work_dir} is not a directory")  # made inside it)
    with tempfile.TemporaryDirectory(prefix="txl-scale-", dir=ns.work_dir) as tmp:
        result = run(tokens=ns.tokens, prefill_tokens=ns.prefill_tokens, iters=ns.iters, work_dir=Path(tmp),
                     checkpoint=Path(ns.checkpoint) if ns.checkpoint else None)
    print(json.dumps(result))
    return 0

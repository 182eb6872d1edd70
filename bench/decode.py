"""`txlserve bench decode`: the ring-buffer decoder against the naive one, same weights, same run.

The baseline is the reference model fed one token at a time with its mems (hidden
states), which re-projects every memory token's keys, values and positions at every
step, as HF transformers' TransfoXL does.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from model.checkpoint import load_checkpoint
from model.engine import Engine
from model.train import pick_device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


@torch.no_grad()
def run(checkpoint: str, *, mem_len: int, batch: int, tokens: int, clamp_len: int | None = None,
        device: str = "auto", dtype: str = "float32", prefill_tokens: int | None = None,
        seed: int = 0) -> dict[str, Any]:
    dev = pick_device(device)
    torch_dtype = getattr(torch, dtype)
    engine = Engine.from_checkpoint(checkpoint, device=dev, dtype=torch_dtype, mem_len=mem_len, clamp_len=clamp_len)
    gen = torch.Generator().manual_seed(seed)
    context = torch.randint(0, 256, (batch, mem_len), generator=gen).to(dev)  # fills the memory
    steps = torch.randint(0, 256, (batch, tokens), generator=gen).to(dev)

    state = engine.new_state(batch)
    engine.decoder.prefill(state, context, chunk_size=engine.prefill_chunk)
    engine.decoder.step(state.rows(list(range(batch))), steps[:, :1])  # warm-up on a copy
    fast_s = _timed(lambda: [engine.decoder.step(state, steps[:, i:i + 1]) for i in range(tokens)], dev)

    ref = load_checkpoint(checkpoint, device=dev, dtype=torch_dtype, mem_len=mem_len, same_length=True,
                          clamp_len=engine.clamp_len).model
    _, mems = ref(context, None)

    def naive() -> None:
        m = mems
        for i in range(tokens):
            _, m = ref(steps[:, i:i + 1], m)

    ref(steps[:, :1], mems)  # warm-up
    naive_s = _timed(naive, dev)

    n_prefill = prefill_tokens or max(4 * mem_len, 2048)
    doc = torch.randint(0, 256, (1, n_prefill), generator=gen).to(dev)
    prefill_s = _timed(lambda: engine.decoder.prefill(engine.new_state(1), doc, chunk_size=engine.prefill_chunk), dev)
    return {
        "tokens_per_s": batch * tokens / fast_s,
        "baseline_tokens_per_s": batch * tokens / naive_s,
        "speedup": naive_s / fast_s,
        "prefill_tokens_per_s": n_prefill / prefill_s,
        "step_ms": 1000 * fast_s / tokens,
        "baseline_step_ms": 1000 * naive_s / tokens,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "dtype": dtype, "checkpoint": checkpoint, "mem_len": mem_len, "clamp_len": engine.clamp_len, "batch": batch,
        "tokens": tokens, "prefill_tokens": n_prefill, "prefill_chunk": engine.prefill_chunk,
        "n_layer": engine.config.n_layer, "d_model": engine.config.d_model, "torch": torch.__version__,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=None, help="default: the bundled checkpoint")
    p.add_argument("--mem-len", type=int, default=512)
    p.add_argument("--clamp-len", type=int, default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")


def main(ns: argparse.Namespace) -> int:
    from model.bundled import resolve_checkpoint

    if ns.threads:
        torch.set_num_threads(ns.threads)
    result = run(resolve_checkpoint(ns.checkpoint), mem_len=ns.mem_len, batch=ns.batch, tokens=ns.tokens,
                 clamp_len=ns.clamp_len, device=ns.device, dtype=ns.dtype, prefill_tokens=ns.prefill_tokens)
    print(json.dumps(result))
    return 0

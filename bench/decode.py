"""`txlserve bench decode`: the decoder against the memory-bandwidth roofline and against the reference
model, same weights, same run.

Three measurements share one run and one set of weights:

* **roofline**: a decode step must read every weight, every cached key and value of every session in the batch (or
  every layer input, where the step absorbs the keys and values: ``kv_step_ms`` is then the same step reading them,
  timed in the same run), and the position table, at least once. This machine's read bandwidth is measured here,
  with the same thread count, by summing a buffer far larger than the caches; ``roofline_share`` is the step's bytes
  over its time over that bandwidth. Where the step's bytes fit in the last-level cache (a batch-1 step of a small
  model on a host with hundreds of MB of L3), that share can pass 1, since the step reads from the cache and the
  roofline from memory: ``warm_read_bandwidth_gb_s`` is the rate at which this machine reads a buffer of the step's
  own size again and again (from wherever it stays), and ``warm_roofline_share`` the step against that: the limit
  for those bytes on any host, where a step is long against one call's overhead (a tiny model's few KB are summed in
  about the time of the call itself, so its warm share can pass 1).
* **naive decode**: the reference model fed one token at a time with its mems, which re-projects every
  memory token's keys, values and positions at every step (what HF transformers' TransfoXL does).
* **prefill**: the reference model's segment-by-segment forward with mems at the same ``mem_len``
  (training-style evaluation) against the decoder's chunked prefill of the same document.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from model.checkpoint import load_checkpoint, save_checkpoint
from model.config import CLAMP_LEN_MOST, MEM_LEN_MOST, TXLConfig
from model.decode import Decoder, available_bytes
from model.engine import Engine
from model.threads import set_threads
from model.train import pick_device
from model.transformer_xl import MemTransformerLM
from txlserve.args import MAX_THREADS, count, device, shape
from txlserve.errors import ConfigError

# Each timing of the steps is the best of this many runs of ``tokens`` steps: one run's time varied by up to 20%
# between runs of identical code (a batch-1 step of a small model reads what sits in L3, and whatever else ran
# decides how much of it does).
STEP_REPEATS = 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device, repeat: int = 1) -> float:
    """The best of ``repeat`` timings: the least disturbed by whatever else the machine does."""
    best = float("inf")
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth(device: torch.device, nbytes: int = 1 << 29, repeat: int = 5) -> float:
    """Bytes/s at which this device reads a buffer of ``nbytes`` (a sum touches each byte once): by default one
    much larger than its caches; a smaller one stays in whatever cache holds it between the timed sums."""
    buf = torch.ones(max(nbytes // 4, 1), device=device)
    buf.sum()  # warm-up: page in
    seconds = _timed(lambda: buf.sum(), device, repeat=repeat)
    return buf.nbytes / seconds


def step_bytes(engine: Engine, batch: int) -> int:
    """What one decode step must read at least once: the weights it uses (not ``r_net``: the position table is
    its product with the sinusoids, made once), every session's keys and values (or, where the step absorbs
    them, its layer inputs: ``Decoder.absorbs``), and that table."""
    used = {p.data_ptr(): p for name, p in engine.model.named_parameters() if ".r_net." not in name}
    weights = sum(t.nbytes for t in used.values())
    c, m = engine.config, engine.mem_len
    elem = torch.finfo(engine.decoder.dtype).bits // 8
    rows = c.d_model if engine.decoder.absorbs(batch) else 2 * c.n_head * c.d_head  # floats a slot of a layer
    return weights + c.n_layer * batch * m * rows * elem + engine.decoder.r_head_k.nbytes


def random_checkpoint(shape: str, out: str, mem_len: int) -> str:
    """A random-weight byte model ``LxD`` (heads of 64, d_inner 4D): speed does not depend on the values."""
    n_layer, d_model = (int(x) for x in shape.lower().split("x"))
    torch.manual_seed(0)
    cfg = TXLConfig(n_layer=n_layer, d_model=d_model, n_head=max(1, d_model // 64), d_head=64, d_inner=4 * d_model,
                    dropout=0.0, tgt_len=mem_len, mem_len=mem_len)
    with torch.device("meta"):  # counted before it is built: 64x8192 was the kernel's OOM kill (exit 137, no word)
        weights = 4 * sum(p.numel() for p in MemTransformerLM(cfg).parameters())
    _refuse_past(3 * weights, torch.device("cpu"), f"a random {shape} model's weights (built, saved and loaded: "
                 f"{weights / 2**30:,.1f} GiB each)", "a smaller --shape")
    save_checkpoint(MemTransformerLM(cfg), out)
    return out


def _refuse_past(need: int, device: torch.device, what: str, instead: str) -> None:
    """One line where ``need`` bytes are more than ``device`` has: a lower bound, so a run refused could not fit."""
    free = available_bytes(device)
    if free is not None and need > free:
        raise ConfigError(f"{what} need at least {need / 2**30:,.1f} GiB on {device}, and "
                          f"{free / 2**30:,.1f} GiB is available: use {instead}")


def prefill_macs(cfg: TXLConfig, mem_len: int, n: int, chunk: int) -> tuple[int, int] | None:
    """Multiply-adds of a prefill of ``n`` tokens: (the decoder's in ``chunk``-token calls, the reference's in
    ``mem_len``-token segments with mems), per layer summed over the calls, plus the scores over the vocabulary
    (the decoder's for each call's last token, the reference's for every token). Their ratio bounds the prefill
    speedup where both run their products at the same speed: the decoder saves projecting the memory's keys,
    values and positions again each segment, and attends over ``mem_len + chunk`` keys where the reference
    attends over ``2 * mem_len``. None for an adaptive softmax (its cost depends on the tokens)."""
    if cfg.cutoffs:
        return None
    d, hd, ff = cfg.d_model, cfg.n_head * cfg.d_head, cfg.d_inner

    def layer(q: int, keys: int, dists: int, memory: int, positions: int) -> int:
        return (q * d * 3 * hd + memory * d * 2 * hd + positions * d * hd  # q, k, v; the memory's k, v; W_r R
                + q * (2 * keys + dists) * hd  # (q + u) k, (q + v) W_r R, the values
                + q * hd * d + 2 * q * d * ff)  # o_net, the feed-forward
    ours = sum(cfg.n_layer * layer(q, mem_len + q, mem_len + 1, 0, 0) + d * cfg.vocab_size
               for q in (min(chunk, n - s) for s in range(0, n, chunk)))
    ref, seen = 0, 0
    for s in range(0, n, mem_len):
        q = min(mem_len, n - s)
        mlen = min(seen, mem_len)
        ref += cfg.n_layer * layer(q, mlen + q, mlen + q, mlen, mlen + q) + q * d * cfg.vocab_size
        seen += q
    return ours, ref


@torch.no_grad()
def run(checkpoint: str, *, mem_len: int, batch: int, tokens: int, clamp_len: int | None = None,
        device: str = "auto", dtype: str = "float32", prefill_tokens: int | None = None,
        prefill_chunk: int | None = None, naive: bool = True, cuda_graph: bool = False,
        compile: bool = False, seed: int = 0, prefill_rounds: int = 3) -> dict[str, Any]:
    dev = pick_device(device)
    torch_dtype = getattr(torch, dtype)
    engine = Engine.from_checkpoint(checkpoint, device=dev, dtype=torch_dtype, mem_len=mem_len, clamp_len=clamp_len,
                                    prefill_chunk=prefill_chunk)
    chunk = engine.prefill_chunk
    vocab = engine.config.vocab_size
    cfg = engine.config  # each session's layer inputs, keys and values, and the reference's own copy of them:
    session = cfg.n_layer * mem_len * (cfg.d_model + 2 * cfg.n_head * cfg.d_head) * torch_dtype.itemsize
    _refuse_past(batch * session * (2 if naive else 1), dev, f"{batch:,} sessions of mem_len {mem_len:,} "
                 f"({session / 2**20:,.1f} MiB each{', twice with the reference' if naive else ''})",
                 "a smaller --batch or --mem-len")  # --batch 30000 was the kernel's OOM kill (found by a helper)
    gen = torch.Generator().manual_seed(seed)
    context = torch.randint(0, vocab, (batch, mem_len), generator=gen).to(dev)  # fills the memory
    steps = torch.randint(0, vocab, (batch, tokens), generator=gen).to(dev)

    state = engine.new_state(batch)
    engine.decoder.prefill(state, context, chunk_size=chunk)
    if compile:  # the one-token step only (prefill stays eager): fused kernels, then replayed by the graph
        engine.decoder.traced = False  # torch.compile of the eager step, not of a TorchScript call
        eager_advance = engine.decoder.advance
        compiled = torch.compile(eager_advance, dynamic=False)
        engine.decoder.advance = lambda s, t: compiled(s, t) if t.size(1) == 1 else eager_advance(s, t)
    engine.decoder.warm_up()  # the one-token trace, where there is one
    engine.decoder.step(state.rows(list(range(batch))), steps[:, :1])  # warm-up on a copy
    result: dict[str, Any] = {}
    if engine.decoder.traced:  # the same step op by op, in the same run: what the trace is worth
        s = state.rows(list(range(batch)))
        eager_s = _timed(lambda: [engine.decoder.forward(s.hid, s.k, s.v, s.seen, steps[:, i:i + 1])
                                  for i in range(tokens)], dev, STEP_REPEATS)
    fast_s = _timed(lambda: [engine.decoder.step(state, steps[:, i:i + 1]) for i in range(tokens)], dev, STEP_REPEATS)
    if engine.decoder.traced:
        result.update(eager_step_ms=1000 * eager_s / tokens, traced_step_ms=1000 * fast_s / tokens,
                      traced_speedup=eager_s / fast_s)
    def other_step_s(**kw: Any) -> float:
        """The same steps by another decoder of the same model (on a copy of the state), in the same run."""
        other = Decoder(engine.decoder.model, mem_len=mem_len, clamp_len=engine.clamp_len, **kw)
        other.step_kernels = engine.decoder.step_kernels  # the products the engine chose at load, as it steps
        other.warm_up()
        s = state.rows(list(range(batch)))
        other.step(s, steps[:, :1])
        return _timed(lambda: [other.step(s, steps[:, i:i + 1]) for i in range(tokens)], dev, STEP_REPEATS)

    if engine.decoder.absorbs(batch):  # the same step reading keys and values: what absorbing them is worth
        kv_s = other_step_s(absorb_min_bytes=None)
        result.update(kv_step_ms=1000 * kv_s / tokens, absorbed_speedup=kv_s / fast_s)
    if engine.decoder.fused:  # the same step with the torch attention: what the kernel is worth
        plain_s = other_step_s(fused=False)
        result.update(unfused_step_ms=1000 * plain_s / tokens, fused_speedup=plain_s / fast_s)
    if cuda_graph:
        from model.graphs import GraphedStep

        graphed = GraphedStep(engine.decoder, state)
        graphed(steps[:, :1])  # the first replay
        graph_s = _timed(lambda: [graphed(steps[:, i:i + 1]) for i in range(tokens)], dev)
        result.update(eager_step_ms=1000 * fast_s / tokens, graph_step_ms=1000 * graph_s / tokens,
                      graph_speedup=fast_s / graph_s)
        if engine.decoder.gpu_fused:  # the same graph with the torch attention, same run (a CPU times both eagerly)
            plain = Decoder(engine.decoder.model, mem_len=mem_len, clamp_len=engine.clamp_len, fused=False)
            plain_graph = GraphedStep(plain, state.rows(list(range(batch))))
            plain_graph(steps[:, :1])
            plain_s = _timed(lambda: [plain_graph(steps[:, i:i + 1]) for i in range(tokens)], dev)
            result.update(unfused_step_ms=1000 * plain_s / tokens, fused_speedup=plain_s / graph_s)
        fast_s = min(fast_s, graph_s)
    bandwidth = read_bandwidth(dev)
    nbytes = step_bytes(engine, batch)
    warm = read_bandwidth(dev, nbytes, repeat=20)  # the step's bytes, read as often as the step reads them

    ref = load_checkpoint(checkpoint, device=dev, dtype=torch_dtype, mem_len=mem_len, same_length=True,
                          clamp_len=engine.clamp_len).model
    if naive:
        _, mems = ref(context, None)

        def naive_decode() -> None:
            m = mems
            for i in range(tokens):
                _, m = ref(steps[:, i:i + 1], m)

        ref(steps[:, :1], mems)  # warm-up
        naive_s = _timed(naive_decode, dev)
        result.update(baseline_tokens_per_s=batch * tokens / naive_s, speedup=naive_s / fast_s,
                      baseline_step_ms=1000 * naive_s / tokens)

    n_prefill = prefill_tokens or max(4 * mem_len, 2048)
    doc = torch.randint(0, vocab, (1, n_prefill), generator=gen).to(dev)
    def segments() -> None:
        m = None
        for s in range(0, n_prefill, mem_len):
            _, m = ref(doc[:, s:s + mem_len], m)

    # alternated, the best of each: a run of either takes ~1 s, within which this machine's speed drifts by as
    # much as the ratio measured (the two timed back to back read 1.2-1.8x on identical code)
    prefill_s = ref_prefill_s = float("inf")
    for _ in range(prefill_rounds):
        prefill_s = min(prefill_s, _timed(lambda: engine.decoder.prefill(engine.new_state(1), doc, chunk_size=chunk),
                                          dev))
        ref_prefill_s = min(ref_prefill_s, _timed(segments, dev))
    step_s = fast_s / tokens
    macs = prefill_macs(engine.config, mem_len, n_prefill, chunk)
    return {
        "tokens_per_s": batch * tokens / fast_s,
        "step_ms": 1000 * step_s,
        "bytes_per_step": nbytes,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "roofline_tokens_per_s": batch * bandwidth / nbytes,
        "roofline_share": nbytes / step_s / bandwidth,
        "warm_read_bandwidth_gb_s": warm / 1e9,
        "warm_roofline_share": nbytes / step_s / warm,
        **result,
        "prefill_tokens_per_s": n_prefill / prefill_s,
        "reference_prefill_tokens_per_s": n_prefill / ref_prefill_s,
        "prefill_speedup": ref_prefill_s / prefill_s,
        "prefill_macs_ratio": None if macs is None else macs[1] / macs[0],  # the speedup at equal speed per MAC
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "threads": torch.get_num_threads(), "dtype": dtype, "checkpoint": checkpoint, "mem_len": mem_len,
        "clamp_len": engine.clamp_len, "batch": batch, "tokens": tokens, "prefill_tokens": n_prefill,
        "prefill_chunk": chunk,
        "prefill_products": "kernel" if engine.decoder.kernel_products(chunk) else "torch",
        "step_products": "kernel" if engine.decoder.kernel_products(1) else "torch",  # chosen at load
        "n_layer": engine.config.n_layer, "d_model": engine.config.d_model,
        "torch": torch.__version__, "compiled": compile, "fused": engine.decoder.fused or engine.decoder.gpu_fused,
        "absorbed": engine.decoder.absorbs(batch),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=None, help="default: the bundled checkpoint")
    p.add_argument("--shape", type=shape, default=None, metavar="LxD",
                   help="random weights of n_layer L and d_model D (e.g. 12x512) instead of a checkpoint")
    p.add_argument("--mem-len", type=count(1, MEM_LEN_MOST), default=512, help="the engine's mem_len (default: 512)")
    p.add_argument("--clamp-len", type=count(0, CLAMP_LEN_MOST), default=None, help="default: the checkpoint's")
    p.add_argument("--batch", type=count(1), default=1, help="sessions decoded together (default: 1)")
    p.add_argument("--tokens", type=count(1), default=64, help="decode steps timed (default: 64)")
    p.add_argument("--prefill-tokens", type=count(1), default=None,
                   help="tokens of the timed prefill (default: max(4 x mem_len, 2048))")
    p.add_argument("--prefill-chunk", type=count(1), default=None, help="default: chosen from mem_len")
    p.add_argument("--no-naive", action="store_true", help="skip the slow token-by-token reference decode")
    p.add_argument("--cuda-graph", action="store_true", help="also time the step replayed as a CUDA graph")
    p.add_argument("--compile", action="store_true", help="torch.compile the one-token step (fewer, fused kernels)")
    p.add_argument("--device", type=device, default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the weights' and caches' dtype (default: float32)")
    p.add_argument("--threads", type=count(1, MAX_THREADS), default=None,
                   help="torch CPU threads (default: half the usable cores)")
    p.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")


def main(ns: argparse.Namespace) -> int:
    from model.bundled import resolve_checkpoint

    if ns.shape and ns.checkpoint:  # the shape had won without a word
        raise ConfigError("give --shape (random weights) or --checkpoint, not both")
    set_threads(ns.threads)
    kw = dict(mem_len=ns.mem_len, batch=ns.batch, tokens=ns.tokens, clamp_len=ns.clamp_len, device=ns.device,
              dtype=ns.dtype, prefill_tokens=ns.prefill_tokens, prefill_chunk=ns.prefill_chunk, naive=not ns.no_naive,
              cuda_graph=ns.cuda_graph, compile=ns.compile)
    if ns.shape:
        with tempfile.TemporaryDirectory() as tmp:
            result = run(random_checkpoint(ns.shape, tmp, ns.mem_len), **kw)
        result["checkpoint"] = f"random {ns.shape}"
    else:
        result = run(resolve_checkpoint(ns.checkpoint), **kw)
    print(json.dumps(result))
    return 0

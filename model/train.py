"""`txlserve train`: the paper's training recipe on an ordered byte or word stream.

Adam(W) with linear warmup and cosine decay, gradient clipping and accumulation,
bf16 autocast on CUDA, DDP when started by ``torchrun``, periodic valid bpc with
mems, and exact resume (optimizer, RNG, mems and data position in safetensors).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from model.checkpoint import (
    atomic_write,
    check_out_dir,
    load_checkpoint,
    read_meta,
    save_checkpoint,
    signals_deferred,
)
from model.config import PRESETS, TRAIN_MOST, TXLConfig
from model.data import Corpus, load_corpus
from model.evaluate import evaluate
from model.tokenizer import ByteTokenizer, Tokenizer
from model.train_state import (
    BEST,
    SAVING,
    await_recovery,
    commit_save,
    load_train_state,
    optimizer_from_flat,
    read_train_info,
    recover_save,
    save_train_state,
)
from model.transformer_xl import MemTransformerLM
from txlserve import json_out
from txlserve.errors import CheckpointError, ConfigError, DataError
from txlserve.signals import HeldSignals


@dataclass
class TrainArgs:
    data: str
    out: str
    preset: str = "tiny"
    steps: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    warmup_steps: int | None = None
    tgt_len: int | None = None
    mem_len: int | None = None
    n_layer: int | None = None
    d_model: int | None = None
    eval_every: int | None = None
    eval_tokens: int = 200_000
    save_every: int = 0
    save_best: bool = False  # each evaluation that lowers valid bpc writes the model to OUT/best (overfit guard)
    grad_accum: int = 1
    clip: float | None = None
    weight_decay: float = 0.0
    seed: int = 1111
    device: str = "auto"
    resume: bool = False
    stop_at: int | None = None  # end this run early at that step (time-boxed runs); --resume continues
    progress: bool = True
    command: str = ""
    tokenizer: str = "byte"  # byte | word (a WikiText-style folder; the vocabulary is built from its train split)
    max_vocab: int | None = None  # word: keep the most frequent words only (the rest are <unk>)
    min_freq: int = 1  # word: drop words seen fewer times
    model_overrides: dict[str, Any] = field(default_factory=dict)  # e.g. cutoffs, div_val, d_embed
    # the fields a command line gave: with --resume, the run's saved arguments fill the RUN_FIELDS it did not
    # (None: every field as set, as a caller in Python sets them)
    given: frozenset[str] | None = None


# What a run is: a resumed run takes these from the run's saved arguments unless its command line gives them (a
# `--resume` without `--steps` had trained to the preset's 200 steps, on another learning-rate schedule)
RUN_FIELDS = ("data", "preset", "steps", "batch_size", "lr", "warmup_steps", "tgt_len", "mem_len", "n_layer",
              "d_model", "eval_every", "eval_tokens", "save_every", "save_best", "grad_accum", "clip", "weight_decay",
              "seed", "tokenizer", "max_vocab", "min_freq", "model_overrides")

_RUN_KINDS: dict[str, type | tuple[type, ...]] = {  # what each saved field holds; int for the rest
    "data": str, "preset": str, "tokenizer": str, "save_best": bool, "model_overrides": dict,
    "lr": (int, float), "clip": (int, float), "weight_decay": (int, float)}


def resumed_args(args: TrainArgs) -> TrainArgs:
    """``args`` with the run's saved arguments where a resuming command line gave none."""
    if not args.resume or args.given is None:
        return args
    saved = read_train_info(args.out).get("args") or {}
    changes = {f: saved[f] for f in RUN_FIELDS if f in saved and f not in args.given}
    for f, value in changes.items():  # of the kind the flag gives (a hand edit made a traceback later on)
        kind = _RUN_KINDS.get(f, int)
        wrong = value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool)
        if not wrong and isinstance(value, (int, float)) and not isinstance(value, bool):  # and of its range: an
            wrong = not (math.isfinite(value) and 0 <= value <= TRAIN_MOST.get(f, math.inf)) or f == "lr" and value == 0
        if wrong:  # lr of NaN or -1 failed in AdamW (found by a helper)
            raise CheckpointError(f"--resume: training state in {args.out} is damaged: its {f} is {value!r}")
    if isinstance(changes.get("model_overrides"), dict):  # JSON made its tuples lists
        unknown = sorted(set(changes["model_overrides"]) - {f.name for f in fields(TXLConfig)})
        if unknown:
            raise CheckpointError(f"--resume: training state in {args.out} is damaged: its model_overrides name "
                                  f"{unknown[0]!r}, which is no model setting")
        changes["model_overrides"] = {k: tuple(v) if isinstance(v, list) else v
                                      for k, v in changes["model_overrides"].items()}
    return replace(args, **changes)


def resolve(args: TrainArgs, vocab_size: int = 256) -> tuple[TXLConfig, dict[str, Any]]:
    """Preset, then explicit flags: the model config and the optimisation settings."""
    opt = train_settings(args)  # the preset checked there
    model_kw = {**PRESETS[args.preset]["model"], "vocab_size": vocab_size}
    for key in ("tgt_len", "mem_len", "n_layer"):
        if getattr(args, key) is not None:
            model_kw[key] = getattr(args, key)
    if args.d_model is not None:
        n_head = model_kw.get("n_head", 8)
        model_kw.update(d_model=args.d_model, d_head=max(1, args.d_model // n_head), d_inner=4 * args.d_model)
    model_kw.update(args.model_overrides)
    if args.grad_accum < 1 or opt["batch_size"] < 1 or opt["steps"] < 1:
        raise ConfigError(f"--batch-size, --grad-accum and --steps must be at least 1, not {opt['batch_size']}, "
                          f"{args.grad_accum} and {opt['steps']}")
    if args.save_best and not opt["eval_every"]:
        raise ConfigError("--save-best keeps the weights of the best evaluation, and this run evaluates never: give "
                          "--eval-every N too")
    if opt["batch_size"] % args.grad_accum:
        raise ConfigError(f"--batch-size {opt['batch_size']} is not divisible by --grad-accum {args.grad_accum}")
    return TXLConfig(**model_kw), opt


def train_settings(args: TrainArgs) -> dict[str, Any]:
    """The preset's optimisation settings, then the flags': known before the vocabulary, which the model's config
    needs (a word run's --cutoffs were checked against 256 bytes while its data was chosen, found by a helper)."""
    if args.preset not in PRESETS:
        raise ConfigError(f"unknown preset {args.preset!r}; choose from {', '.join(PRESETS)}")
    opt = {"clip": 0.25, "warmup_steps": 0, **PRESETS[args.preset]["train"]}
    for key in ("steps", "batch_size", "lr", "warmup_steps", "eval_every", "clip"):
        if getattr(args, key) is not None:
            opt[key] = getattr(args, key)
    return opt


def lr_at(step: int, *, lr: float, warmup_steps: int, steps: int) -> float:
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return 0.5 * lr * (1.0 + math.cos(math.pi * min(1.0, progress)))


def pick_device(name: str) -> torch.device:
    """The device named, checked here: torch's own refusal of a device it was not built for (mps, xpu) or an index
    past the last is a traceback, from wherever the first tensor is put there."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    backend = {"cuda": torch.cuda, "xpu": getattr(torch, "xpu", None), "mps": getattr(torch.backends, "mps", None)}
    if device.type in backend:
        module = backend[device.type]
        if module is None or not module.is_available():
            raise ConfigError(f"--device {name} was asked for but no {device.type.upper()} device is available "
                              "(this torch build or this machine has none; --device cpu runs anywhere)")
        count = getattr(module, "device_count", lambda: 1)()
        if device.index is not None and device.index >= count:
            raise ConfigError(f"--device {name}: this machine has {count} {device.type.upper()} device(s)")
    return device


def auto_dtype(device: torch.device) -> torch.dtype:
    """The serving dtype when none is asked for: bf16 on a GPU (half the bytes a decode step reads), fp32 on a CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _dist_setup(device: torch.device) -> tuple[int, int, torch.device]:
    if "RANK" not in os.environ:
        return 0, 1, device
    import torch.distributed as dist

    if device.type == "cuda":  # before the group is made: a rank that cannot run says so at once
        device = rank_device(int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return rank, world, device


def rank_device(local_rank: int, count: int) -> torch.device:
    """A DDP rank's GPU: one per process on a node. More processes than GPUs (``--nproc_per_node 2`` on a
    one-GPU machine, say, or a CPU run resumed without ``--device cpu`` on a GPU machine) failed in a CUDA
    traceback ("invalid device ordinal") on the second rank."""
    if local_rank >= count:
        raise ConfigError(f"this node runs DDP rank {local_rank} but has {count} CUDA device(s): start at most "
                          f"{count} process(es) a node (torchrun --nproc_per_node), or train on CPUs with "
                          "--device cpu", param="device")
    return torch.device("cuda", local_rank)


def load_training_corpus(args: TrainArgs) -> tuple[Corpus, Tokenizer]:
    """Bytes, or words with a vocabulary built from the training split (the checkpoint's when resuming)."""
    if args.resume:  # the run's own, whatever --tokenizer says: a byte run read as words failed in a traceback
        tokenizer = read_meta(args.out).get("tokenizer")
        kind = tokenizer.get("type", "byte") if isinstance(tokenizer, dict) else "byte"
        if kind != args.tokenizer:
            raise ConfigError(f"--resume: the run in {args.out} reads {kind}s, not {args.tokenizer}s (leave "
                              f"--tokenizer out to keep the run's)", param="tokenizer")
    if args.tokenizer == "byte":
        return load_corpus(args.data), ByteTokenizer()
    if args.tokenizer != "word":
        raise ConfigError(f"unknown tokenizer {args.tokenizer!r}; choose byte or word", param="tokenizer")
    from model.words import load_word_corpus

    # the splits a run reads: valid only where it evaluates (a folder of train alone was refused for want of
    # valid, and test, that the run never read); a file stands for every split, so a run that evaluates on one
    # would score its own training text (both found by a helper)
    evaluates = bool(train_settings(args)["eval_every"])
    if evaluates and Path(args.data).expanduser().is_file():
        raise DataError(f"{args.data} is one file, and this run evaluates on a valid split: a file would be its own "
                        "validation. Give a WikiText folder (wiki.train.tokens and wiki.valid.tokens), or "
                        "--eval-every 0")
    known = load_checkpoint(args.out).tokenizer if args.resume else None
    return load_word_corpus(args.data, known, splits=("train", "valid") if evaluates else ("train",),
                            max_vocab=args.max_vocab, min_freq=args.min_freq)


def _load_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], info: dict[str, Any],
                    out: Path) -> None:
    """The run's optimizer state, checked against this model's parameters (one copied from another run loaded,
    and failed at the first step) and its settings against this optimizer's (a hand edit of a group's betas,
    eps or amsgrad loaded, and failed inside the first step)."""
    for saved, fresh in zip(info["param_groups"], optimizer.param_groups):
        wrong = next((k for k, v in fresh.items() if k != "params" and not _same_kind(saved.get(k, _MISSING), v)),
                     None) if isinstance(saved, dict) else "param_groups"
        if wrong is not None:
            value = saved.get(wrong, "nothing") if isinstance(saved, dict) else saved
            raise CheckpointError(f"--resume: training state in {out} is damaged: its optimizer's {wrong} is "
                                  f"{value!r}, where {fresh.get(wrong)!r} was expected")
    try:
        optimizer.load_state_dict(optimizer_from_flat(tensors, info["param_groups"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"--resume: the optimizer state in {out} does not fit this model: {err}") from None
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for name, t in state.items():
                if isinstance(t, torch.Tensor) and t.dim() and t.shape != p.shape:
                    raise CheckpointError(f"--resume: the optimizer state in {out} is another model's ({name} "
                                          f"{list(t.shape)} for a parameter {list(p.shape)})")
            # a parameter Adam has stepped has both moments: without one the run failed at its first step (a
            # parameter no batch reached, an adaptive softmax's rare cluster, has none, and needs none)
            moments = [state.get(k) for k in ("exp_avg", "exp_avg_sq")]
            if state and not all(isinstance(t, torch.Tensor) and t.shape == p.shape for t in moments):
                raise CheckpointError(f"--resume: training state in {out} is damaged: its optimizer has no moments "
                                      f"of the shape {list(p.shape)} for a parameter")
    if info["step"] and not optimizer.state:  # all gone: it went on with fresh moments, unlike the run it resumed
        raise CheckpointError(f"--resume: training state in {out} is damaged: its optimizer has no moments at all")


_MISSING = object()


def _same_kind(saved: Any, fresh: Any) -> bool:
    """Whether a saved optimizer setting can stand for this optimizer's: a number for a number, the same switch
    (amsgrad on where it was off needs moments the run never kept), a pair of numbers for a pair."""
    number = (int, float)
    if isinstance(fresh, bool) or fresh is None:  # a switch another torch version did not save: its default
        return saved is _MISSING or saved == fresh or fresh is None and (saved is None or isinstance(saved, bool))
    if isinstance(fresh, number):
        return isinstance(saved, number) and not isinstance(saved, bool) and math.isfinite(saved)
    if isinstance(fresh, (tuple, list)):
        return isinstance(saved, (tuple, list)) and len(saved) == len(fresh) and all(
            _same_kind(a, b) for a, b in zip(saved, fresh))
    return type(saved) is type(fresh)


def _best_so_far(best: Path) -> float:
    """The valid bpc of the weights in ``best`` (what a resumed ``--save-best`` run must beat): the directory is
    the record, so a run that stopped between writing it and its training state, or that first ran without the
    flag, compares with what is there."""
    try:
        return float(json.loads((best / "config.json").read_text(encoding="utf-8-sig"))["training"]["valid_bpc"])
    except (OSError, ValueError, KeyError, TypeError):
        return math.inf


def _mems_fit(mems: torch.Tensor, cfg: TXLConfig) -> bool:
    """A saved training memory this run can carry on: ``[n_layer, batch, mlen <= mem_len, d_model]`` (a batch
    that is not the run's starts the memory over, as the loop does)."""
    return (mems.dim() == 4 and mems.size(0) == cfg.n_layer and mems.size(2) <= cfg.mem_len
            and mems.is_floating_point())


_FLAGS = ("tgt_len", "mem_len", "n_layer", "d_model", "cutoffs", "div_val", "d_embed")  # the model's train flags


def _differences(saved: TXLConfig, now: TXLConfig) -> str:
    """What a resuming command changes of the run's model, each by its flag where it has one (a bare "use the same
    flags" left the user to guess which)."""
    said = []
    for f in fields(TXLConfig):
        if f.name in ("dropout", "dropatt"):  # a saved config has none: they are training's alone
            continue
        was, now_is = getattr(saved, f.name), getattr(now, f.name)
        if was != now_is:
            name = "--" + f.name.replace("_", "-") if f.name in _FLAGS else f.name
            said.append(f"its {name} is {was!r}, this command's {now_is!r}")
    return "; ".join(said) or "its weights' config differs"


def _check_fits(cfg: TXLConfig, device: torch.device, *, micro_batch: int, stream_len: int) -> None:
    """Refuse a training that cannot fit in this machine's memory, in one line before any allocation: a huge
    --d-model had been torch's allocator traceback, and a huge --tgt-len the kernel's OOM kill (exit 137, no word).
    Parameters are counted on the meta device (nothing is allocated); attention's activations are a lower bound, so
    a run refused could never have fit."""
    with torch.device("meta"):
        n = sum(p.numel() for p in MemTransformerLM(cfg).parameters())
    weights = 16 * n  # fp32 weights, their gradients and AdamW's two moments
    qlen = max(1, min(cfg.tgt_len, stream_len - 1))  # a segment is cut to its stream's end
    klen = qlen + cfg.mem_len
    # each layer keeps at least its scores and probabilities [batch, heads, qlen, klen] for the backward pass
    # (measured on CPU: 2.6 to 4 such tensors a layer); bf16 under CUDA's autocast
    attention = 2 * cfg.n_layer * micro_batch * cfg.n_head * qlen * klen * (2 if device.type == "cuda" else 4)
    have = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
            else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    if weights > have:
        raise ConfigError(f"the model has {n:,} parameters: training it needs about {weights / 2**30:,.1f} GiB "
                          f"(weights, gradients, AdamW's moments), more than this {device.type}'s "
                          f"{have / 2**30:,.1f} GiB")
    if weights + attention > have:
        cut = "" if qlen == cfg.tgt_len else f" {cfg.tgt_len:,}, cut to a stream's length"
        raise ConfigError(f"a segment of {qlen:,} tokens (--tgt-len{cut}) attending to {klen:,} keys (with --mem-len "
                          f"{cfg.mem_len:,}) needs at least {attention / 2**30:,.1f} GiB for attention's scores at "
                          f"a batch of {micro_batch}, more than this {device.type}'s {have / 2**30:,.1f} GiB: "
                          "lower --tgt-len, --mem-len or --batch-size (or raise --grad-accum)")


class StopAtStepEnd(HeldSignals):
    """A Ctrl-C (or SIGTERM) ends the step, and the run saves the checkpoint at it before the signal acts: it lost
    every step since the last ``--save-every``. In one process a second one acts at once. Under DDP (``together``)
    the ranks agree on the step to stop at (the signal rides on each step's loss all-reduce), and none acts at once:
    torchrun forwards the Ctrl-C it got to ranks that got it from the terminal too, and its own deadline (a SIGKILL
    30 s later) is the hard stop. Before, a Ctrl-C under torchrun saved nothing (found by a helper)."""

    def __init__(self, saved: str, *, together: bool = False) -> None:
        super().__init__()
        self.saved = saved  # what the checkpoint directory holds, for the second press's line
        self.step_saved = False  # the step last run is in it (a second press held while its save ran)
        self.together = together

    def _on_signal(self, sig: int, frame: Any) -> None:
        super()._on_signal(sig, frame)
        if len(self.held) > 1 and not self.together:
            lost = "" if self.step_saved else "this step is not saved; "
            print(f"txlserve: interrupted again: {lost}{self.saved}", file=sys.stderr)
            self.release()


def purge_metrics(path: Path, step: int) -> None:
    """Keep the records of ``metrics.jsonl`` up to ``step``, where a resumed run starts (TensorBoard's
    ``purge_step``): a run stopped after its last save had logged steps that the resumed one logs again."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut off by the interruption
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line + "\n")
    atomic_write(path, "".join(kept))


def _gathered(t: torch.Tensor, world: int, *, dim: int) -> torch.Tensor:
    """Every rank's ``t`` joined along ``dim`` in rank order (a collective: every rank calls it)."""
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=dim)


def _mean_over_ranks(value: float, world: int, device: torch.device, flag: bool = False) -> tuple[float, bool]:
    """The mean of ``value`` over the ranks, and whether any rank raised ``flag``: one all-reduce."""
    import torch.distributed as dist

    total = torch.tensor([value, float(flag)], dtype=torch.float64 if device.type == "cpu" else torch.float32,
                         device=device)
    dist.all_reduce(total)
    return float(total[0]) / world, bool(total[1] > 0)


@contextlib.contextmanager
def claimed(out: Path) -> Iterator[None]:
    """``--out``, made if missing, held by this process alone while it trains (an ``flock`` of the directory,
    let go however the process ends): two runs into one directory interleaved their metrics and tore each
    other's saves (found by a helper). A directory made here is removed again, if still empty, when the run
    fails (one too large for memory leaves nothing behind)."""
    import fcntl

    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory")
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"--out {out} is being written by another `txlserve train`: wait for it to end, or "
                              "choose another --out") from None
        try:
            yield
        except BaseException:
            if made:
                with contextlib.suppress(OSError):
                    out.rmdir()
            raise
    finally:
        os.close(fd)


def _ours(out: Path) -> None:
    """Before anything in ``--out`` is touched (a save completed or dropped, metrics started over): it is a
    checkpoint's directory, or a run's (its metrics, its save part way in), or new. A user's directory lost a
    ``.saving`` folder and a ``metrics.jsonl`` of its own that way (found by a helper)."""
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and not _our_metrics(metrics):
        raise ConfigError(f"--out {out} holds a metrics.jsonl that no training wrote: choose a new or empty directory")
    check_out_dir(out, allow_checkpoint=True, ignore=(SAVING, "metrics.jsonl"))


def _our_metrics(path: Path) -> bool:
    """A training's metrics (a JSON record with its step a line), or nothing yet."""
    try:
        with open(path, "rb") as fh:
            first = fh.readline(1 << 16)
        record = json.loads(first) if first.strip() else {"step": 0}
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(record, dict) and "step" in record


def train(args: TrainArgs) -> dict[str, Any]:
    """Train per ``args``; rank 0 (the one process that writes) holds ``--out`` for the whole run."""
    if os.environ.get("RANK", "0") != "0":
        await_recovery(args.out)  # rank 0 completes a save interrupted as it moved in
        return _train(args)
    with claimed(Path(args.out)):
        _ours(Path(args.out))
        if recover_save(args.out):  # the last save, interrupted as it moved in, completed
            print(f"txlserve: completed the save that was interrupted in {args.out}", file=sys.stderr)
        return _train(args)


def _train(args: TrainArgs) -> dict[str, Any]:
    from model.data import OrderedIterator

    if not args.resume and (Path(args.out) / "config.json").exists():  # hours of training, overwritten unasked
        raise ConfigError(f"{args.out} already holds a checkpoint: pass --resume to continue its training, or "
                          "choose another --out")
    out_dir = Path(args.out)
    if args.resume and out_dir.is_dir() and {p.name for p in out_dir.iterdir()} == {"metrics.jsonl"}:
        raise ConfigError(f"--resume: the run in {args.out} stopped before its first save, so there is nothing to "
                          "continue: start it again without --resume (its metrics.jsonl starts over)")
    check_out_dir(args.out, allow_checkpoint=args.resume, ignore=() if args.resume else ("metrics.jsonl",))
    args = resumed_args(args)
    corpus, tokenizer = load_training_corpus(args)
    cfg, opt = resolve(args, tokenizer.vocab_size)
    if opt["eval_every"] and len(corpus.valid) < 2:  # found at the first evaluation, after eval_every steps
        raise DataError(f"the valid split of {args.data} holds {len(corpus.valid)} token"
                        f"{'s' * (len(corpus.valid) != 1)}, and this run evaluates on it every {opt['eval_every']:,} "
                        "steps: give a longer valid split, or --eval-every 0")
    device = pick_device(args.device)
    world_size = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else 1  # torchrun sets both
    _check_fits(cfg, device, micro_batch=opt["batch_size"] // args.grad_accum,
                stream_len=len(corpus.train) // (opt["batch_size"] * world_size))
    rank, world, device = _dist_setup(device)
    out = Path(args.out)
    torch.manual_seed(args.seed + rank)
    model = MemTransformerLM(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt["lr"], weight_decay=args.weight_decay)
    micro = opt["batch_size"] // args.grad_accum
    batches = OrderedIterator(corpus.train, opt["batch_size"], cfg.tgt_len, rank=rank, world_size=world,
                              device=device)
    step, tokens_seen, mems, last_eval = 0, 0, None, {}
    commands: list[str] = []  # every command that trained this run, the first one first (a resume kept only its own)
    best_bpc = _best_so_far(out / BEST) if args.resume and args.save_best else math.inf
    if args.resume:
        ckpt = load_checkpoint(out, device=device)
        before = ckpt.meta.get("training") if isinstance(ckpt.meta.get("training"), dict) else {}
        listed = before.get("commands") if isinstance(before.get("commands"), list) else None  # (5: a traceback)
        commands = [c for c in listed or [before.get("command")] if isinstance(c, str)]
        if ckpt.config != cfg.replace(dropout=0.0, dropatt=0.0):
            raise ConfigError(f"--resume: {out} was trained with another model config: "
                              f"{_differences(ckpt.config, cfg)}; leave those flags out to take the run's")
        model.load_state_dict(ckpt.model.state_dict())
        tensors, info = load_train_state(out)
        saved_at = before.get("steps")  # ("training": [] had been a traceback: found by a helper)
        if saved_at is not None and saved_at != info["step"]:  # saved by a version that wrote its files one by one
            raise CheckpointError(f"--resume: {out} holds weights of step {saved_at} but the training state of step "
                                  f"{info['step']} (a save was cut short): they would resume as neither")
        if args.stop_at is not None and info["step"] >= args.stop_at and info["step"] < opt["steps"]:
            raise ConfigError(f"--resume: {out} is at step {info['step']} already: give a --stop-at above it, or "
                              f"leave it out to train to step {opt['steps']}")
        if info["step"] >= opt["steps"]:  # it saved the run again, as it was
            behind = "" if args.stop_at is None else f" (and a --stop-at above it; {args.stop_at} is not)"
            raise ConfigError(f"--resume: {out} is at step {info['step']} already, its last: give --steps above it "
                              f"to train further{behind}")
        ran_on = info["data"].get("world_size", world)
        if ran_on != world:  # each rank's random state and streams are its own: they do not spread over others
            raise ConfigError(f"--resume: {out} was trained on {ran_on} process(es) and this run has {world}: "
                              f"resume it on {ran_on} (torchrun --nproc-per-node {ran_on}, or none for 1)")
        _load_optimizer(optimizer, tensors, info, out)
        if "mems" in tensors and tensors["mems"].size(-1) != cfg.d_model:
            raise CheckpointError(f"--resume: the training state in {out} is another model's (its memory is "
                                  f"{tensors['mems'].size(-1)} wide, the model {cfg.d_model})")
        if "mems" in tensors and not _mems_fit(tensors["mems"], cfg):
            raise CheckpointError(f"--resume: training state in {out} is damaged: its memory is "
                                  f"{list(tensors['mems'].shape)}, not [{cfg.n_layer}, batch, <= {cfg.mem_len}, "
                                  f"{cfg.d_model}]")
        try:  # DDP: a row each (copied: set_rng_state reads a row at a storage offset as the first)
            own = {k: v[rank].clone() if v.dim() == 2 else v for k, v in tensors.items() if k.startswith("rng.")}
            torch.set_rng_state(own["rng.cpu"])
            if "rng.cuda" in own and device.type == "cuda":
                torch.cuda.set_rng_state(own["rng.cuda"])
        except (KeyError, IndexError, RuntimeError, TypeError) as err:
            why = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise CheckpointError(f"--resume: training state in {out} is damaged: its random state cannot be "
                                  f"restored ({why})") from None
        mems = tensors["mems"].to(device) if "mems" in tensors else None
        if mems is not None and world > 1 and mems.size(1) == opt["batch_size"] * world:  # every rank's streams
            mems = mems.narrow(1, rank * opt["batch_size"], opt["batch_size"])
        try:
            batches.load_state_dict(info["data"])
        except DataError as err:
            if args.given is not None and not args.given & {"data", "batch_size"}:  # the run's own: not the flags
                if info["data"].get("stream_len") not in (None, batches.stream_len):
                    raise ConfigError(f"--resume: {args.data} is not the data {out} was trained on: it has changed "
                                      f"since ({err})") from None
                raise CheckpointError(f"--resume: training state in {out} is damaged: its data position does not "
                                      f"fit the run's data ({err})") from None
            raise ConfigError(f"--resume: this command's --data or --batch-size is not the run's ({err}); leave them "
                              "out to take the run's") from None
        step, tokens_seen, last_eval = info["step"], info["tokens_seen"], info.get("last_eval", {})
        if rank == 0:
            purge_metrics(out / "metrics.jsonl", step)
    elif rank == 0:
        (out / "metrics.jsonl").unlink(missing_ok=True)  # a run that never saved: this one starts over
    ddp = model
    if world > 1 or "RANK" in os.environ:
        from torch.nn.parallel import DistributedDataParallel

        # an adaptive softmax's cluster that a batch does not reach has no gradient on that rank: DDP must expect
        # it, or it stops the run ("parameters that were not used in producing loss")
        ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                      find_unused_parameters=bool(cfg.cutoffs))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def meta() -> dict[str, Any]:
        return {"data": str(args.data), "preset": args.preset, "steps": step, "tokens_seen": tokens_seen,
                "world_size": world, "command": args.command,
                "commands": [*commands, args.command] if args.command else commands, "optim": opt, **last_eval}

    def save() -> None:
        run_mems, rng = mems, None
        if world > 1:  # every rank's own memory of its streams and random state (rank 0 saved its own for all)
            run_mems = None if mems is None else _gathered(mems, world, dim=1)
            rng = {"rng.cpu": _gathered(torch.get_rng_state().to(device).unsqueeze(0), world, dim=0).cpu()}
            if device.type == "cuda":
                rng["rng.cuda"] = _gathered(torch.cuda.get_rng_state().to(device).unsqueeze(0), world, dim=0).cpu()
        if rank == 0:
            with signals_deferred():  # a Ctrl-C mid-save waits: the checkpoint and its training state agree
                stage = out / SAVING  # written whole, then moved in: a kill -9 leaves one save or the other
                shutil.rmtree(stage, ignore_errors=True)
                save_checkpoint(model, stage, training=meta(), tokenizer=tokenizer)
                save_train_state(stage, optimizer=optimizer, mems=run_mems, rng=rng,
                                 info={"step": step, "tokens_seen": tokens_seen, "data": batches.state_dict(),
                                       "last_eval": last_eval,
                                       "args": {k: v for k, v in asdict(args).items() if k != "given"}})
                commit_save(out)
                if stop is not None:  # before a press held by the save acts
                    stop.saved, stop.step_saved = f"{out} holds step {step}", True

    def log(record: dict[str, Any]) -> None:
        if rank == 0:
            with open(out / "metrics.jsonl", "a") as fh:
                fh.write(json_out.dumps(record) + "\n")  # a diverged step's NaN as null: JSON every reader reads

    if opt["warmup_steps"] > opt["steps"] and step == 0 and rank == 0:  # a short try of a preset barely moved
        print(f"txlserve: warning: the run's {opt['steps']:,} steps end inside its warm-up of "
              f"{opt['warmup_steps']:,}: the learning rate never reaches {opt['lr']:g} (--warmup-steps sets it)",
              file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    bar = None
    if args.progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=opt["steps"], initial=step, unit="step", dynamic_ncols=True)
    stream = batches.forever()
    t0, tok0 = time.perf_counter(), tokens_seen
    losses: list[float] = []
    model.train()
    last_step = min(opt["steps"], args.stop_at or opt["steps"])
    held = f"{out} holds step {step}" if args.resume else f"{out} holds no checkpoint"
    stop = (StopAtStepEnd(held, together="RANK" in os.environ)  # None: a signal acts as it always does
            if threading.current_thread() is threading.main_thread() else None)

    def asked() -> bool:  # a stop signal held by this process
        return stop is not None and bool(stop.held)

    stopping = False  # under DDP: every rank's, agreed at a step's all-reduce (alone: asked() at each step's end)

    def stopped() -> bool:
        return stopping or (world == 1 and asked())

    try:
        while step < last_step and not stopped():
            if stop is not None:
                stop.step_saved = False
            inp, tgt = next(stream)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, lr=opt["lr"], warmup_steps=opt["warmup_steps"], steps=opt["steps"])
            if mems is not None and mems.size(1) != inp.size(0):
                mems = None  # defensive: batch size changed between runs
            new_mems, step_loss = [], 0.0
            for i in range(args.grad_accum):
                rows = slice(i * micro, (i + 1) * micro)
                with autocast:
                    nll, m = ddp(inp[rows], None if mems is None else mems[:, rows], targets=tgt[rows])
                    loss = nll.float().mean()
                (loss / args.grad_accum).backward()
                step_loss += float(loss.detach()) / args.grad_accum
                new_mems.append(m)
            mems = None if new_mems[0] is None else torch.cat(new_mems, dim=1).float()
            if world > 1:  # what is logged is the global batch's loss, not rank 0's share of it
                step_loss, stopping = _mean_over_ranks(step_loss, world, device, asked())
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt["clip"])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += inp.numel() * world
            losses.append(step_loss)
            elapsed = time.perf_counter() - t0
            tok_s = (tokens_seen - tok0) / max(elapsed, 1e-9)
            record = {"step": step, "loss": step_loss, "bpc": step_loss / math.log(2),
                      "lr": optimizer.param_groups[0]["lr"], "tokens_seen": tokens_seen, "tokens_per_s": tok_s,
                      "elapsed_s": elapsed}
            if opt["eval_every"] and (step % opt["eval_every"] == 0 or step == opt["steps"]):
                ev = evaluate(model, corpus.valid, tgt_len=cfg.tgt_len, max_tokens=args.eval_tokens, device=device)
                last_eval = {"valid_bpc": ev["bpc"], "valid_ppl": ev["ppl"], "valid_tokens": ev["tokens"],
                             "valid_step": step}
                record.update(last_eval)
                if args.save_best and ev["bpc"] < best_bpc:
                    best_bpc = ev["bpc"]
                    if rank == 0:  # staged and moved in as a save is: two files, replaced one by one, could disagree
                        with signals_deferred():
                            stage = out / SAVING
                            shutil.rmtree(stage, ignore_errors=True)
                            save_checkpoint(model, stage / BEST, training=meta(), tokenizer=tokenizer)
                            commit_save(out)
                model.train()
            log(record)
            if bar is not None:
                bar.set_postfix(loss=f"{step_loss:.3f}", tok_s=f"{tok_s:,.0f}", **(
                    {"valid_bpc": f"{last_eval['valid_bpc']:.3f}"} if last_eval else {}))
                bar.update(1)
            if args.save_every and step % args.save_every == 0:
                save()
        if bar is not None:
            bar.close()
        save()
        if stopped() and rank == 0:  # (under torchrun, its command: `txlserve train` refuses another world size)
            again = f"torchrun --nproc_per_node {world} -m server.cli train" if world > 1 else "txlserve train"
            print(f"txlserve: interrupted: step {step} saved in {out}; `{again} --out {out} --resume` continues",
                  file=sys.stderr)
    finally:
        if stop is not None:
            stop.release()  # the handlers put back; a held signal acts now (Ctrl-C: KeyboardInterrupt, exit 130)
    if "RANK" in os.environ:
        import torch.distributed as dist

        dist.destroy_process_group()
    if stopping:  # another rank's signal stopped this one: an interrupted run, as that rank's (it had printed the
        raise KeyboardInterrupt  # summary of a finished run and exited 0; found by a helper)
    return {"steps": step, "tokens_seen": tokens_seen, "losses": losses, "out": str(out), **last_eval}

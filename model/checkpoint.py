"""Checkpoints: ``model.safetensors`` + ``config.json`` in one directory. No pickle.

``config.json`` = {"model": TXLConfig, "tokenizer": {...}, "training": {...},
"fingerprint": sha256 of the stored weights}. The fingerprint is what a stored
session records, so a session made by another model is refused rather than
silently continued with the wrong weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from model.bundled import not_a_directory
from model.config import TXLConfig
from model.tokenizer import ByteTokenizer, Tokenizer, tokenizer_from_dict
from model.transformer_xl import MemTransformerLM
from txlserve.errors import CheckpointError, ConfigError
from txlserve.pickles import looks_pickled
from txlserve.signals import HeldSignals

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
# names of the plain embedding and softmax before they became the adaptive layers' first cluster
LEGACY_NAMES = {"word_emb.weight": "word_emb.emb_layers.0.weight", "out_layer.weight": "crit.out_layers.0.weight",
                "out_layer.bias": "crit.out_layers.0.bias"}


@dataclass
class Checkpoint:
    model: MemTransformerLM
    config: TXLConfig
    tokenizer: Tokenizer
    fingerprint: str
    path: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def weights_of(model: MemTransformerLM) -> dict[str, torch.Tensor]:
    """The tensors to store: a tied parameter once, under its first name (the embedding's)."""
    state, seen = {}, set()
    for name, p in model.state_dict(keep_vars=True).items():
        if id(p) not in seen:
            seen.add(id(p))
            state[name] = p.detach().contiguous()
    return state


def fingerprint_of(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous().reshape(-1)  # (a 0-dim tensor cannot be viewed as bytes)
        digest.update(f"{name}|{t.dtype}|{tuple(tensors[name].shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy() if t.numel() else b"")  # hashed in place, not copied
    return digest.hexdigest()[:32]


SAVING = ".saving"  # a training's save is written whole here, then moved into place (train_state.commit_save)
COMMITTED = "COMMITTED"  # in SAVING once it is whole: from then on the save is completed, never dropped


def atomic_write(path: Path, data: str) -> None:
    """Readers see the old file or the new one whole (a temp file beside it, renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(data)
    os.replace(tmp, path)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM wait for the block to end, then act. A checkpoint is several files (the weights, the
    config that holds their fingerprint, the training state), each replaced atomically; a Ctrl-C between two of
    them left weights that the config's fingerprint refused: a checkpoint that neither loaded nor resumed (found
    by a helper). Nests; outside the main thread, where no signal handler runs, it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = HeldSignals()
    try:
        yield
    finally:
        held.release()


def check_out_dir(out_dir: str | Path, *, allow_checkpoint: bool = False, ignore: tuple[str, ...] = ()) -> None:
    """A checkpoint is written into a new or empty directory, or (``allow_checkpoint``: to continue its training)
    a checkpoint's own. Any other directory was written into: a user's files mixed with a checkpoint's, or a
    checkpoint replaced without a word (found by a helper). Files named in ``ignore`` do not count (the metrics of
    a run stopped before its first save, which the next run starts over)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory")
    if not out.is_dir() or not any(p.name not in ignore for p in out.iterdir()):
        return
    if not (out / CONFIG).exists():
        raise ConfigError(f"--out {out} is not empty and holds no checkpoint: choose a new or empty directory")
    if not allow_checkpoint:
        raise ConfigError(f"--out {out} already holds a checkpoint: choose a new or empty directory")


def _umask() -> int:
    """This process's umask, read without changing it where Linux shows it (os.umask sets it to read it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_checkpoint(model: MemTransformerLM, out_dir: str | Path, *, training: dict[str, Any] | None = None,
                    tokenizer: Tokenizer | None = None, dtype: torch.dtype | None = None) -> str:
    """Write weights (optionally cast to ``dtype``, e.g. bf16 to ship small) and config; return the fingerprint."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = weights_of(model)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    tensors = {k: v.cpu() for k, v in tensors.items()}
    fingerprint = fingerprint_of(tensors)
    meta = {
        "model": model.cfg.to_dict(),
        "tokenizer": (tokenizer or ByteTokenizer()).to_dict(),
        "training": training or {},
        "fingerprint": fingerprint,
    }
    with signals_deferred():  # the weights and the config that names them: both, or neither
        tmp = out / (WEIGHTS + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "txlserve", "fingerprint": fingerprint})
        os.chmod(tmp, 0o666 & ~_umask())  # as the config beside it: safetensors writes 0600, which another user
        os.replace(tmp, out / WEIGHTS)  # (the image's server, uid 10001) could not read
        atomic_write(out / CONFIG, json.dumps(meta, indent=2, sort_keys=True))
    return fingerprint


def read_meta(ckpt_dir: str | Path) -> dict[str, Any]:
    path = Path(ckpt_dir) / CONFIG
    if not Path(ckpt_dir).is_dir():
        raise CheckpointError(not_a_directory(ckpt_dir))
    try:
        meta = json.loads(path.read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {ckpt_dir} has no {CONFIG}") from None
    except (OSError, ValueError, RecursionError) as err:  # (JSON's syntax, UTF-8, a 5,000-digit number, nesting)
        raise CheckpointError(f"checkpoint {path} is not valid JSON: {err or 'nested too deep'}") from None
    if isinstance(meta, dict) and meta.get("model_type") == "transfo-xl":
        out = str(Path(ckpt_dir)).rstrip("/") + "-txlserve"
        raise CheckpointError(f"{ckpt_dir} is a Hugging Face TransfoXL directory; convert it once with: "
                              f"txlserve import hf {ckpt_dir} --out {out}  (then serve --checkpoint {out})")
    if not isinstance(meta, dict) or "model" not in meta:
        raise CheckpointError(f"{path} has no 'model' section")
    return meta


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def pickle_note(path: Path) -> str:
    """`` (NAME is a pickle ...)`` where ``path`` begins as torch.save's and pickle's files do (a zip archive, or
    a pickle's protocol byte), else "": a pickle saved under a safetensors name read as a "damaged" file."""
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError:
        return ""
    if looks_pickled(head):
        return f" ({path.name} is a pickle, as torch.save writes, which txlserve never loads: it reads safetensors)"
    return ""


def pickles_beside(folder: Path, needed: str) -> str:
    """`` (NAME is a pickle ...; it needs NEEDED)`` for a pickle in ``folder`` where ``needed`` is missing."""
    pickled = next((p.name for p in sorted(folder.glob("*")) if p.suffix in PICKLE_SUFFIXES), None)
    return f" ({pickled} is a pickle, which txlserve never loads; it needs {needed})" if pickled else ""


def load_checkpoint(ckpt_dir: str | Path, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None, **overrides: Any) -> Checkpoint:
    """Rebuild the model from its config alone; ``overrides`` change inference-only
    fields (``mem_len``, ``clamp_len``, ``same_length``, dropout) without touching weights."""
    meta = read_meta(ckpt_dir)
    try:
        config = TXLConfig.from_dict(meta["model"]).replace(**{"dropout": 0.0, "dropatt": 0.0, **overrides})
    except (ConfigError, TypeError) as err:
        raise CheckpointError(f"checkpoint {ckpt_dir}: {err}") from None
    weights_path = Path(ckpt_dir) / WEIGHTS
    if not weights_path.is_file():
        raise CheckpointError(f"checkpoint {ckpt_dir} has no {WEIGHTS}{pickles_beside(Path(ckpt_dir), WEIGHTS)}")
    if not os.access(weights_path, os.R_OK):  # safetensors says "No such file or directory" of it
        raise CheckpointError(f"{weights_path} cannot be read by this user (permission denied: its mode is "
                              f"{stat.filemode(weights_path.stat().st_mode)})")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{weights_path} is not a readable safetensors file"
                              f"{pickle_note(weights_path) or f': {err}'}") from None
    fingerprint = fingerprint_of(tensors)
    if meta.get("fingerprint") and meta["fingerprint"] != fingerprint:
        # a training's save, moved in part way (the run's own directory, or its best beside it)
        run = next((d for d in (Path(ckpt_dir), Path(ckpt_dir).parent) if (d / SAVING / COMMITTED).exists()), None)
        if run is not None:
            raise CheckpointError(f"checkpoint {ckpt_dir}: a save of its training is part way in (it saves now, or "
                                  f"was stopped as it saved: `txlserve train --out {run} --resume` completes "
                                  "the save)")
        raise CheckpointError(f"{weights_path} does not match the fingerprint in {CONFIG} (damaged or replaced)")
    tensors = {LEGACY_NAMES.get(k, k): v for k, v in tensors.items()}
    model = build_from_tensors(config, tensors, ckpt_dir=weights_path, device=device, dtype=dtype)
    tokenizer = tokenizer_from_dict(meta.get("tokenizer", {"type": "byte"}))
    if tokenizer.vocab_size < config.vocab_size:  # a token generated past its symbols could not be written
        raise CheckpointError(f"checkpoint {ckpt_dir}: its tokenizer names {tokenizer.vocab_size:,} symbols, fewer "
                              f"than the model's {config.vocab_size:,} outputs (training and import write them "
                              f"equal)")
    return Checkpoint(model=model, config=config, tokenizer=tokenizer, fingerprint=fingerprint,
                      path=Path(ckpt_dir), meta=meta)


def build_from_tensors(config: TXLConfig, tensors: dict[str, torch.Tensor], *, ckpt_dir: str | Path,
                       device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> MemTransformerLM:
    """The model with ``tensors`` as its parameters: built on the meta device and assigned, so loading holds
    one copy of the weights (a 1 GB checkpoint must not need 2 GB), cast tensor by tensor when asked."""
    with torch.device("meta"):
        model = MemTransformerLM(config)
    expected = weights_of(model)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = sorted(k for k in set(expected) & set(tensors) if expected[k].shape != tensors[k].shape)
    # weights are numbers with fractions: integer ones of the right shape failed in load_state_dict's traceback
    kind = sorted(k for k in set(expected) & set(tensors) if not tensors[k].is_floating_point())
    if missing or unexpected or wrong or kind:
        detail = "; ".join(f"{label}: {', '.join(names[:4])}" for label, names in
                           (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong),
                            ("not floating point", kind)) if names)
        raise CheckpointError(f"{ckpt_dir} does not fit its config ({detail})")
    target = dtype or torch.float32
    for name in list(tensors):  # one tensor at a time: the source copy is freed as its cast is made
        t = tensors[name]
        tensors[name] = t.to(device, target if t.is_floating_point() else t.dtype)
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    for module in model.modules():  # buffers that are not stored (computed) get real storage
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf.is_meta:
                module.register_buffer(name, torch.zeros(buf.shape, dtype=target, device=device), persistent=False)
    return model.eval()

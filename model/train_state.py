"""Exact-resume training state in safetensors + JSON (no pickle).

``train_state/`` beside the checkpoint holds ``state.safetensors`` (optimizer
moments, RNG states, the training mems) and ``state.json`` (step, tokens seen,
data position, optimizer param groups).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from model.checkpoint import COMMITTED, CONFIG, SAVING, WEIGHTS, pickle_note, pickles_beside
from txlserve.errors import CheckpointError, ConfigError

STATE_DIR = "train_state"
BEST = "best"  # --save-best's checkpoint, a folder of the run's


def commit_save(out_dir: str | Path) -> None:
    """Move the save written whole under ``out_dir/.saving`` into place. A save is four files (the weights, the
    config that names their fingerprint, the optimizer's state, the step it is at), each replaced atomically but
    not together: a kill -9 between two left weights no config accepted, or a training state of another step that
    a resume took without a word (found by a helper). Marked whole first, a save interrupted while it moves is
    completed by :func:`recover_save`; one interrupted before is dropped, and the last one stands."""
    stage = Path(out_dir) / SAVING
    marker = stage / COMMITTED
    marker.write_text("")
    _fsync_dir(stage)
    _move_in(stage)


def recover_save(out_dir: str | Path) -> bool:
    """Complete a save that was marked whole (the process died as it moved it in), or drop one that was not; True
    when a save was completed. Only the training command calls it: it alone writes the directory."""
    stage = Path(out_dir) / SAVING
    if not stage.is_dir():
        return False
    foreign = next((p for p in sorted(stage.rglob("*")) if not _saved(p.relative_to(stage))), None)
    if foreign is not None:  # a user's folder of that name lost its files (found by a helper)
        raise ConfigError(f"--out {out_dir} holds {SAVING}/{foreign.relative_to(stage)}, which no save of a "
                          "training writes: move it away (nothing was changed), or choose another --out")
    if (stage / COMMITTED).exists():
        _move_in(stage)
        return True
    shutil.rmtree(stage)
    return False


_SAVED = {COMMITTED, CONFIG, WEIGHTS, WEIGHTS + ".tmp", STATE_DIR, BEST, "state.safetensors",
          "state.safetensors.tmp", "state.json", "state.json.tmp"}


def _saved(rel: Path) -> bool:
    """A path a save writes under ``.saving``: its files, their temporary names, the training state's folder and
    ``--save-best``'s."""
    where = len(rel.parts) == 1 or (len(rel.parts) == 2 and rel.parts[0] in (STATE_DIR, BEST))
    return where and (rel.name in _SAVED or rel.name.startswith(".tmp"))


def await_recovery(out_dir: str | Path, timeout_s: float = 600.0) -> None:
    """For a DDP rank other than 0: wait while rank 0 completes a save interrupted as it moved in, or drops one
    not marked whole (it alone writes), so that no rank reads the run's config or state half moved, or finds the
    directory holding a stage (a rank that did was refused "--out is not empty", 1 restart in 4 after a kill
    during a first save; found by a helper). Rank 0 makes no new stage before every rank has joined it."""
    stage = Path(out_dir) / SAVING
    deadline = time.monotonic() + timeout_s
    while stage.is_dir():  # as recover_save reads it: a file of that name is no stage, and rank 0 leaves it
        if time.monotonic() > deadline:
            raise CheckpointError(f"{out_dir}: rank 0 did not complete the interrupted save in {timeout_s:.0f} s")
        time.sleep(0.05)  # poll, bounded by the deadline: the ranks have not met yet, so no barrier can be had


def _move_in(stage: Path) -> None:
    out = stage.parent
    for path in sorted(p for p in stage.rglob("*") if p.is_file() and p.name != COMMITTED):
        target = out / path.relative_to(stage)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
    _fsync_dir(out)
    shutil.rmtree(stage)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # not every file system syncs a directory
        pass
    finally:
        os.close(fd)


def optimizer_to_flat(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    sd = optimizer.state_dict()
    tensors = {}
    for idx, per_param in sd["state"].items():
        for key, value in per_param.items():
            t = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"optim.{idx}.{key}"] = t.detach().cpu().contiguous()
    return tensors, sd["param_groups"]


def optimizer_from_flat(tensors: dict[str, torch.Tensor], param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name.startswith("optim."):
            _, idx, key = name.split(".", 2)
            state.setdefault(int(idx), {})[key] = t
    return {"state": state, "param_groups": param_groups}


def save_train_state(out_dir: str | Path, *, optimizer: torch.optim.Optimizer, mems: torch.Tensor | None,
                     info: dict[str, Any], rng: dict[str, torch.Tensor] | None = None) -> None:
    """``rng``: the random states to keep (DDP: every rank's, a row each), else this process's."""
    path = Path(out_dir) / STATE_DIR
    path.mkdir(parents=True, exist_ok=True)
    tensors, groups = optimizer_to_flat(optimizer)
    if rng is not None:
        tensors.update(rng)
    else:
        tensors["rng.cpu"] = torch.get_rng_state()
        if torch.cuda.is_available():
            tensors["rng.cuda"] = torch.cuda.get_rng_state()
    if mems is not None:
        tensors["mems"] = mems.detach().float().cpu().contiguous()
    save_file(tensors, str(path / "state.safetensors.tmp"))
    os.replace(path / "state.safetensors.tmp", path / "state.safetensors")
    (path / "state.json.tmp").write_text(json.dumps({**info, "param_groups": groups}, indent=2))
    os.replace(path / "state.json.tmp", path / "state.json")


def read_train_info(out_dir: str | Path) -> dict[str, Any]:
    """The training state's JSON alone (the run's arguments, step and data position), without its tensors."""
    path = Path(out_dir) / STATE_DIR / "state.json"
    try:
        info = json.loads(path.read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise CheckpointError(f"--resume: no training state in {path.parent}") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"--resume: training state in {path.parent} is damaged: {err}") from None
    if not isinstance(info, dict):
        raise CheckpointError(f"--resume: training state in {path.parent} is damaged: not a JSON object")
    checks = (  # a hand edit made each a traceback later on
        (all(type(info.get(k)) is int and info[k] >= 0 for k in ("step", "tokens_seen")),
         "step and tokens_seen must be integers >= 0"),
        (isinstance(info.get("data"), dict), "data must be an object"),
        (isinstance(info.get("data"), dict) and type(info["data"].get("segment")) is int and all(
            type(v) is int for k, v in info["data"].items() if k in _DATA_INTS), "data's positions must be integers"),
        (isinstance(info.get("last_eval", {}), dict) and all(  # at the run's last save: a run's steps lost
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in info.get("last_eval", {}).values()),
         "last_eval must be an object of numbers"),
        (isinstance(info.get("param_groups"), list) and bool(info.get("param_groups")),
         "param_groups must be a non-empty list"),
        (isinstance(info.get("args", {}), dict), "args must be an object"))
    if wrong := next((says for ok, says in checks if not ok), None):
        raise CheckpointError(f"--resume: training state in {path} is damaged: {wrong}")
    return info


_DATA_INTS = ("segment", "epoch", "batch_size", "tgt_len", "stream_len", "world_size")  # OrderedIterator's


def load_train_state(out_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    info = read_train_info(out_dir)
    path = Path(out_dir) / STATE_DIR
    try:
        tensors = load_file(str(path / "state.safetensors"))
    except FileNotFoundError:
        raise CheckpointError(f"--resume: no training state in {path}"
                              f"{pickles_beside(path, 'state.safetensors')}") from None
    except (OSError, ValueError, SafetensorError) as err:
        raise CheckpointError(f"--resume: training state in {path} is damaged"
                              f"{pickle_note(path / 'state.safetensors') or f': {err}'}") from None
    return tensors, info

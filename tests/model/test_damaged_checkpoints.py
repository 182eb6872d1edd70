"""A checkpoint damaged in ways a disk, an editor or a hand-made file can damage it is refused in one line
(CheckpointError), never a traceback from deep inside torch or json (each row was one; found by a helper)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import CONFIG, WEIGHTS, load_checkpoint
from tests.live import tiny_checkpoint
from txlserve.errors import CheckpointError


def _weights(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(ck: Path) -> None:
        tensors = load_file(str(ck / WEIGHTS))
        change(tensors)
        save_file(tensors, str(ck / WEIGHTS))
        meta = json.loads((ck / CONFIG).read_text())
        meta.pop("fingerprint")  # hand-made: no fingerprint to tell it by
        (ck / CONFIG).write_text(json.dumps(meta))
    return damage


def _config(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(ck: Path) -> None:
        meta = json.loads((ck / CONFIG).read_text())
        change(meta)
        (ck / CONFIG).write_text(json.dumps(meta))
    return damage


def _integer_bias(tensors: dict) -> None:
    tensors["crit.out_layers.0.bias"] = tensors["crit.out_layers.0.bias"].to(torch.int32)


def _word_tokenizer(**fields) -> Callable[[dict], None]:
    return lambda meta: meta.update(tokenizer={"type": "word", "symbols": ["<eos>", "a"], **fields})


@pytest.mark.parametrize("damage, says", [
    (_weights(_integer_bias), r"does not fit its config \(not floating point: crit.out_layers.0.bias\)"),
    (_weights(lambda t: t.update(extra=torch.tensor(1.0))), r"does not fit its config \(unexpected: extra\)"),
    (lambda ck: (ck / CONFIG).write_text("[" * 100_000 + "]" * 100_000), "is not valid JSON"),
    (lambda ck: (ck / CONFIG).write_text('{"model": ' + "9" * 5000 + "}"), "is not valid JSON"),
    (_config(_word_tokenizer(eos=["x"])), "eos is a symbol and its unk a symbol or null"),
    (_config(_word_tokenizer(eos="<eos>", unk=5)), "eos is a symbol and its unk a symbol or null"),
], ids=["integer-weights", "0-dim-extra", "nested", "5000-digits", "eos-list", "unk-number"])
def test_a_damaged_checkpoint_is_one_line(tmp_path, damage, says):
    ck = tiny_checkpoint(tmp_path / "ck")
    damage(ck)
    with pytest.raises(CheckpointError, match=says):
        load_checkpoint(ck)



def test_a_config_saved_with_a_bom_loads(tmp_path):
    """An editor that writes a byte order mark (Notepad) made a hand-edited config.json "not valid JSON", where
    `txlserve session import` took the same mark."""
    ck = tiny_checkpoint(tmp_path / "ck")
    text = (ck / CONFIG).read_text()
    (ck / CONFIG).write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert load_checkpoint(ck).meta == json.loads(text)

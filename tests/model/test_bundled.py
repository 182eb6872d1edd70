"""The checkpoint that ships with txlserve: present, loadable, small, and its recorded figure reproduces."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from model.bundled import BUNDLED, resolve_checkpoint
from model.checkpoint import load_checkpoint

SHAKESPEARE = Path(__file__).resolve().parents[3] / "shared" / "data" / "shakespeare"


def test_bundled_checkpoint_is_complete_and_small():
    assert resolve_checkpoint(None) == str(BUNDLED)
    assert (BUNDLED / "model.safetensors").stat().st_size <= 25 * 2**20
    meta = json.loads((BUNDLED / "config.json").read_text())
    t = meta["training"]
    assert t["commands"] and all(c.startswith("txlserve train ") for c in t["commands"])
    assert t["steps"] > 0 and t["tokens_seen"] > 0 and 0 < t["test_bpc"] < 8
    assert t["test_eval"]["command"].startswith("txlserve eval ")
    ckpt = load_checkpoint(BUNDLED)
    assert ckpt.fingerprint == meta["fingerprint"]


def test_a_file_given_as_the_checkpoint_is_named_for_what_it_is(tmp_path):
    """A file where the directory was meant said "directory ... does not exist"; a pickle says it is refused."""
    from txlserve.errors import CheckpointError

    (tmp_path / "model.pt").write_bytes(b"\x80\x04")
    (tmp_path / "notes.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"model\.pt is a pickle, which txlserve never loads.*model\.safetensors"):
        resolve_checkpoint(tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match=r"notes\.json is a file: a checkpoint is a directory"):
        load_checkpoint(tmp_path / "notes.json")
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nothing")


FULL_EVAL = os.environ.get("TXLSERVE_FULL_EVAL") == "1"


@pytest.mark.skipif(not SHAKESPEARE.is_dir(), reason="needs ../shared/data/shakespeare beside the repo")
@pytest.mark.parametrize("recorded", ["test_eval_head", *(["test_eval"] if FULL_EVAL else [])])
def test_recorded_test_bpc_reproduces(recorded):
    """The figures in the bundled config, each recorded by the `txlserve eval` command beside it. The suite checks
    the first 32,768 tokens of the test split (any change to the weights or the model's math moves that figure
    too); ``TXLSERVE_FULL_EVAL=1`` adds the whole split, the figure README quotes (21 s on 2 cores)."""
    from model.data import load_corpus
    from model.evaluate import evaluate

    t = json.loads((BUNDLED / "config.json").read_text())["training"][recorded]
    ckpt = load_checkpoint(BUNDLED, mem_len=t["mem_len"], same_length=t["same_length"])
    result = evaluate(ckpt.model, load_corpus(SHAKESPEARE).test, tgt_len=t["tgt_len"], batch_size=t["batch_size"],
                      max_tokens=t.get("max_tokens"))
    assert result["tokens"] == t["tokens"]
    assert abs(result["bpc"] - t["bpc"]) < 1e-4


def test_loading_a_checkpoint_imports_no_compiler_and_draws_no_random_numbers():
    """The model is built on the meta device and its tensors assigned: nothing is initialised there. Meta's
    ``normal_`` imports torch._dynamo (1.8 s of every server and CLI start) and the default generator would move
    for nothing. A fresh interpreter, since this one may have imported dynamo already."""
    import subprocess
    import sys

    code = ("import sys, torch\nfrom model.checkpoint import load_checkpoint\ntorch.manual_seed(0)\n"
            "before = torch.random.get_rng_state()\nck = load_checkpoint(sys.argv[1])\n"
            "print('torch._dynamo' in sys.modules, torch.equal(before, torch.random.get_rng_state()),"
            " all(not p.is_meta for p in ck.model.parameters()))")
    r = subprocess.run([sys.executable, "-c", code, str(BUNDLED)], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True", "True"], r.stdout

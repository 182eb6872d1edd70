"""Training, checkpoints and evaluation, end to end on small real files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.checkpoint import load_checkpoint, save_checkpoint
from model.train import TrainArgs, rank_device, train
from model.transformer_xl import MemTransformerLM
from tests.model.test_transformer_xl import tiny_config
from txlserve.errors import CheckpointError, ConfigError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "story.txt"
    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "seven", "wizards",
             "quietly", "hum"]
    rng = torch.Generator().manual_seed(0)
    idx = torch.randint(0, len(words), (12_000,), generator=rng).tolist()
    path.write_text(" ".join(words[i] for i in idx) + "\n")
    return path


def test_tiny_model_overfits_repeating_text(tmp_path):
    data = tmp_path / "abc.txt"
    data.write_text("abcdefghij" * 2000)
    result = train(TrainArgs(data=str(data), out=str(tmp_path / "ck"), preset="tiny", steps=300, lr=5e-3,
                             progress=False))
    assert result["losses"][0] > 3.0
    assert sum(result["losses"][-10:]) / 10 < 0.05


def test_save_load_round_trip_identical_logits(tmp_path):
    torch.manual_seed(0)
    model = MemTransformerLM(tiny_config()).eval()
    fp = save_checkpoint(model, tmp_path, training={"steps": 3})
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.fingerprint == fp and ckpt.meta["training"]["steps"] == 3
    x = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        a, ma = model(x)
        b, mb = ckpt.model(x)
    assert torch.equal(a, b) and torch.equal(ma, mb)
    assert ckpt.model.crit.out_layers[0].weight.data_ptr() == ckpt.model.word_emb.emb_layers[0].weight.data_ptr()


def test_a_checkpoints_weights_are_as_readable_as_its_config(tmp_path):
    """safetensors writes 0600: a checkpoint trained by one user could not be read by another (the image's server
    runs as uid 10001), and the load said the file did not exist (found by a helper)."""
    save_checkpoint(MemTransformerLM(tiny_config()), tmp_path)
    weights, config = tmp_path / "model.safetensors", tmp_path / "config.json"
    assert weights.stat().st_mode & 0o777 == config.stat().st_mode & 0o777
    weights.chmod(0)
    if os.access(weights, os.R_OK):  # root reads anything
        return
    with pytest.raises(CheckpointError, match="permission denied"):
        load_checkpoint(tmp_path)


def test_bf16_checkpoint_keeps_fingerprint_of_stored_weights(tmp_path):
    model = MemTransformerLM(tiny_config())
    fp32 = save_checkpoint(model, tmp_path / "a")
    bf16 = save_checkpoint(model, tmp_path / "b", dtype=torch.bfloat16)
    assert fp32 != bf16
    assert load_checkpoint(tmp_path / "b").fingerprint == bf16


def test_resume_matches_uninterrupted_run(corpus, tmp_path):
    common = dict(data=str(corpus), preset="tiny", lr=2e-3, warmup_steps=3, progress=False,
                  model_overrides={"dropout": 0.1})
    full = train(TrainArgs(out=str(tmp_path / "full"), steps=12, **common))
    train(TrainArgs(out=str(tmp_path / "part"), steps=12, stop_at=6, **common))
    # the same command line with --resume continues from step 6
    resumed = train(TrainArgs(out=str(tmp_path / "part"), steps=12, resume=True, **common))
    assert len(resumed["losses"]) == 6
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"][6:]),
                               rtol=1e-5, atol=1e-6)
    a, b = load_checkpoint(tmp_path / "full"), load_checkpoint(tmp_path / "part")
    assert a.fingerprint == b.fingerprint or all(
        torch.allclose(p, q, atol=1e-6) for p, q in zip(a.model.parameters(), b.model.parameters()))
    assert b.meta["training"]["steps"] == 12


def test_resume_refuses_a_different_model(corpus, tmp_path):
    from txlserve.errors import ConfigError

    train(TrainArgs(data=str(corpus), out=str(tmp_path), preset="tiny", steps=2, progress=False))
    with pytest.raises(ConfigError, match="another model config: its --n-layer is 2, this command's 3; its "
                                          "--mem-len is 32, this command's 8; leave those flags out to take the "
                                          "run's$"):  # it said "use the same flags", and not which
        train(TrainArgs(data=str(corpus), out=str(tmp_path), preset="tiny", steps=4, n_layer=3, mem_len=8,
                        resume=True, progress=False))


def test_a_run_without_resume_does_not_overwrite_a_checkpoint(corpus, tmp_path):
    train(TrainArgs(data=str(corpus), out=str(tmp_path), preset="tiny", steps=2, progress=False))
    before = (tmp_path / "model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="--resume"):
        train(TrainArgs(data=str(corpus), out=str(tmp_path), preset="tiny", steps=2, seed=7, progress=False))
    assert (tmp_path / "model.safetensors").read_bytes() == before


def test_a_run_writes_only_into_a_new_or_empty_directory_or_its_own_checkpoint(corpus, tmp_path):
    """Into a directory of other files it had written a checkpoint among them (a helper's --out was the shared
    data folder); onto a file it said "[Errno 17] File exists"."""
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty and holds no checkpoint"):
        train(TrainArgs(data=str(corpus), out=str(tmp_path), preset="tiny", steps=2, progress=False))
    with pytest.raises(ConfigError, match="is a file"):
        train(TrainArgs(data=str(corpus), out=str(tmp_path / "notes.txt"), preset="tiny", steps=2, progress=False))
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("files", [{".saving/keep.txt": "mine", "other.txt": "mine"}, {".saving/keep.txt": "mine"},
                                   {".saving/COMMITTED": "", ".saving/notes/a.txt": "mine"},
                                   {"metrics.jsonl": '{"user": "data"}\n'}, {"metrics.jsonl": "my notes\n"}])
def test_a_users_files_in_out_are_never_moved_or_removed(corpus, tmp_path, files):
    """A run completed or dropped a `.saving` folder, and started `metrics.jsonl` over, before it looked at what
    the directory held: a user's `.saving/keep.txt` was deleted (with `COMMITTED` beside it, moved over the
    directory's files), and a user's `metrics.jsonl` replaced (found by a helper). Now refused, nothing changed."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    for resume in (False, True):
        with pytest.raises(ConfigError, match="no save of a training writes|no training wrote|holds no checkpoint"):
            train(TrainArgs(data=str(corpus), out=str(tmp_path), preset="tiny", steps=2, progress=False,
                            resume=resume))
    assert {str(p.relative_to(tmp_path)): p.read_text() for p in tmp_path.rglob("*") if p.is_file()} == files


def test_out_is_held_by_one_training_at_a_time(corpus, tmp_path):
    """Two runs into one --out interleaved their metrics.jsonl and tore each other's saves (a rename of the other's
    temporary file failed; found by a helper). A run holds the directory (flock) from start to end."""
    import fcntl
    import os

    out = tmp_path / "ck"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as another run's process holds it
        with pytest.raises(ConfigError, match="being written by another `txlserve train`"):
            train(TrainArgs(data=str(corpus), out=str(out), preset="tiny", steps=2, progress=False))
        assert list(out.iterdir()) == []
    finally:
        os.close(fd)  # let go: the next run trains
    train(TrainArgs(data=str(corpus), out=str(out), preset="tiny", steps=2, progress=False))
    assert (out / "config.json").exists()


@pytest.mark.parametrize("size, says", [({"n_layer": 100_000}, "n_layer must be at most 1,024"),
                                        ({"d_model": 10**10}, "d_model must be at most 65,536"),
                                        ({"d_model": 65_536}, "parameters: training it needs about"),
                                        ({"mem_len": 10**6}, r"a segment of 7,341 tokens \(--tgt-len 10,000,000, "
                                         r"cut to a stream's length\) attending to 1,007,341 keys \(with --mem-len "
                                         r"1,000,000\) needs at least [\d,.]+ GiB for attention's scores at a "
                                         r"batch of 4, more than this cpu's"),
                                        ({"mem_len": 10**8}, "mem_len must be at most 1,048,576"),
                                        ({"tgt_len": 10**6, "mem_len": 10**6}, "attention's scores")])
def test_a_model_too_large_is_refused_in_one_line_before_anything_is_allocated(corpus, tmp_path, size, says):
    """--n-layer 100000 had built layers for minutes, --d-model 10^10 ended in the allocator's traceback, and a
    --tgt-len of 10^6 in the kernel's OOM kill (exit 137 and an empty --out, no word)."""
    if "mem_len" in size and "tgt_len" not in size:  # 2 layers x 4 rows x 2 heads x 7,341 x 1,007,341 x 4 B, twice
        size = {"tgt_len": 10**7, "batch_size": 8, "grad_accum": 2, "device": "cpu", **size}
    with pytest.raises(ConfigError, match=says):
        train(TrainArgs(data=str(corpus), out=str(tmp_path / "ck"), preset="tiny", steps=1, progress=False, **size))
    assert not (tmp_path / "ck").exists()


def test_a_ctrl_c_during_a_save_waits_for_it_to_finish(tmp_path, monkeypatch):
    """A checkpoint is its weights and the config that holds their fingerprint, each replaced atomically; a Ctrl-C
    between the two left new weights under the old config, which no load or resume accepted (a helper's Ctrl-C
    during training). Now the interrupt waits for the save, and the checkpoint is the new one whole."""
    import signal

    from model import checkpoint

    torch.manual_seed(0)
    save_checkpoint(MemTransformerLM(tiny_config()), tmp_path)
    newer = MemTransformerLM(tiny_config())
    replace = checkpoint.os.replace

    def replace_then_interrupt(src, dst):  # Ctrl-C right after the new weights are in place
        replace(src, dst)
        if str(dst).endswith("model.safetensors"):
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(checkpoint.os, "replace", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(newer, tmp_path)
    monkeypatch.undo()
    assert load_checkpoint(tmp_path).fingerprint == checkpoint.fingerprint_of(checkpoint.weights_of(newer))


def test_metrics_and_checkpoint_metadata(corpus, tmp_path):
    train(TrainArgs(data=str(corpus), out=str(tmp_path), preset="tiny", steps=4, eval_every=2,
                    eval_tokens=2000, progress=False, command="txlserve train ..."))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    assert "valid_bpc" in lines[1] and lines[1]["valid_bpc"] > 0
    assert all(r["tokens_per_s"] > 0 for r in lines)
    meta = json.loads((tmp_path / "config.json").read_text())
    t = meta["training"]
    assert t["steps"] == 4 and t["tokens_seen"] == 4 * 8 * 32 and t["valid_bpc"] > 0
    assert t["command"] == "txlserve train ..." and len(meta["fingerprint"]) == 32
    assert (tmp_path / "train_state" / "state.safetensors").is_file()


def _cli(*args: str, env: dict | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_cli_train_then_eval_json(corpus, tmp_path, capsys):
    out = tmp_path / "ck"
    r = _cli("train", "--data", str(corpus), "--out", str(out), "--preset", "tiny", "--steps", "3",
             "--no-progress")
    assert r.returncode == 0, r.stderr
    from concurrent.futures import ThreadPoolExecutor

    args = ("eval", "--checkpoint", str(out), "--data", str(corpus), "--split", "valid", "--json",
            "--mem-len", "64", "--same-length")
    with ThreadPoolExecutor(2) as pool:  # two processes side by side, one core each
        r, again = pool.map(lambda _: _cli(*args), range(2))
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["mem_len"] == 64 and result["same_length"] is True and result["split"] == "valid"
    assert result["batch_size"] == 8  # the streams read: the split is long enough for the default 8
    assert result["tokens"] > 1000 and 0 < result["bpc"] < 9
    assert abs(result["ppl"] - 2 ** result["bpc"]) < 1e-6 * result["ppl"]
    assert json.loads(again.stdout)["bpc"] == result["bpc"]  # evaluation is deterministic
    # --split whole: a held-out file scored entire (a byte corpus's one file was only ever read 90/5/5 by split)
    import server.cli as cli

    threads = torch.get_num_threads()
    try:
        assert cli.main(["eval", "--checkpoint", str(out), "--data", str(corpus), "--split", "whole", "--json",
                         "--threads", "1", "--no-progress"]) == 0
    finally:
        torch.set_num_threads(threads)
    whole = json.loads(capsys.readouterr().out)
    streams = whole["batch_size"]  # the file cut into equal streams, each one's first byte unscored
    assert whole["split"] == "whole" and whole["tokens"] == (corpus.stat().st_size // streams - 1) * streams


def test_a_checkpoint_whose_tokenizer_outnumbers_its_model_refuses_what_it_cannot_read(corpus, tmp_path):
    """Made by hand (training and import write them equal): a byte tokenizer over a 100-output model read 'z'
    (122) past the embedding, and generate and eval printed an index error's traceback."""
    from model.config import TXLConfig
    from model.transformer_xl import MemTransformerLM

    torch.manual_seed(0)
    save_checkpoint(MemTransformerLM(TXLConfig(n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=32, vocab_size=100,
                                               tgt_len=8, mem_len=8)), tmp_path / "ck")
    from concurrent.futures import ThreadPoolExecutor

    runs = [("generate", "--prompt", "ABC", "--max-tokens", "4"), ("generate", "--prompt", "zzz", "--max-tokens", "4"),
            ("eval", "--data", str(corpus))]
    with ThreadPoolExecutor(2) as pool:  # three processes, two cores
        ok, *refused = pool.map(lambda args: _cli(args[0], "--checkpoint", str(tmp_path / "ck"), *args[1:]), runs)
    assert ok.returncode == 0, ok.stderr
    for r in refused:
        assert r.returncode == 2 and "past this model's 100 outputs" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_eval_with_longer_memory_than_training(corpus, tmp_path):
    train(TrainArgs(data=str(corpus), out=str(tmp_path), preset="tiny", steps=30, progress=False))
    from model.data import load_corpus
    from model.evaluate import evaluate

    valid = load_corpus(corpus).valid
    short = evaluate(load_checkpoint(tmp_path).model, valid, tgt_len=16)
    long = evaluate(load_checkpoint(tmp_path, mem_len=128).model, valid, tgt_len=16)
    assert short["tokens"] == long["tokens"] and short["bpc"] != long["bpc"]
    # fewer streams than asked where the data holds less than a segment each: the result says how many were read
    # (the eval command reported the number asked for, with another score than that many streams give)
    few = evaluate(load_checkpoint(tmp_path).model, valid, tgt_len=16, batch_size=8, max_tokens=100)
    assert few["batch_size"] == 6 and 0 < few["tokens"] <= 100
    heard: list[int] = []  # what eval's progress bar hears: each segment's tokens, adding up to the score's
    assert evaluate(load_checkpoint(tmp_path).model, valid, tgt_len=16, scored=heard.append) == short
    assert len(heard) > 1 and sum(heard) == short["tokens"]


@pytest.mark.parametrize("damage", ["no_dir", "no_config", "no_weights", "garbage_weights", "bad_json",
                                    "wrong_shape", "replaced_weights", "no_n_head"])
def test_damaged_checkpoint_gives_one_clear_line(tmp_path, damage, capsys):
    ck = tmp_path / "ck"
    save_checkpoint(MemTransformerLM(tiny_config()), ck)
    if damage == "no_dir":
        ck = tmp_path / "missing"
    elif damage == "no_config":
        (ck / "config.json").unlink()
    elif damage == "no_weights":
        (ck / "model.safetensors").unlink()
    elif damage == "garbage_weights":
        (ck / "model.safetensors").write_bytes(b"\x00\x01not safetensors at all")
    elif damage == "bad_json":
        (ck / "config.json").write_text("{not json")
    elif damage == "wrong_shape":
        meta = json.loads((ck / "config.json").read_text())
        meta["model"]["d_inner"] = 48
        (ck / "config.json").write_text(json.dumps(meta))
    elif damage == "no_n_head":  # it was read as the default n_head, and called a shape mismatch
        meta = json.loads((ck / "config.json").read_text())
        del meta["model"]["n_head"]
        (ck / "config.json").write_text(json.dumps(meta))
    elif damage == "replaced_weights":
        save_checkpoint(MemTransformerLM(tiny_config(n_layer=1)), tmp_path / "other")
        (ck / "model.safetensors").write_bytes((tmp_path / "other" / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(ck)
    if damage == "no_n_head":
        assert "no n_head (the weights' shapes depend on it)" in str(err.value)
    if damage not in ("no_dir", "garbage_weights", "wrong_shape"):
        return  # the command line is checked on a few kinds of damage
    import server.cli as cli

    threads = torch.get_num_threads()
    try:  # in this process: an exception the command let through would fail the test with its traceback
        assert cli.main(["eval", "--checkpoint", str(ck), "--data", str(ck), "--json"]) == 2
    finally:
        torch.set_num_threads(threads)  # the command sets its own
    err = capsys.readouterr().err
    assert err.startswith("txlserve: error: ") and err.count("\n") == 1, err


def _dies_after_one_move_in(moves: list):
    """``os.replace`` for a save's move in that lets one file in (recorded in ``moves``), then dies as a kill -9
    would; the renames inside the stage go through."""
    real_replace = os.replace

    def replace(src, dst):
        if ".saving" in Path(src).parts and ".saving" not in Path(dst).parts:  # a move in
            if moves:
                raise SystemExit("killed")
            moves.append(dst)
        real_replace(src, dst)

    return replace


def test_a_save_cut_short_leaves_one_save_or_the_other_and_the_run_resumes_exactly(corpus, tmp_path, monkeypatch):
    """A kill -9 between a save's four files left weights no config accepted, or a training state of another step
    that a resume took without a word (found by a helper). A save is written whole, then moved in: cut short while
    it is written, the last save stands; cut short as it moves in, the next training completes it."""
    import model.train_state as train_state

    def run(out: Path, **kw) -> None:
        train(TrainArgs(data=str(corpus), out=str(out), preset="tiny", steps=4, save_every=1, progress=False, **kw))

    run(tmp_path / "whole")
    out = tmp_path / "cut"
    run(out, stop_at=2)
    moves: list = []  # the process dies once the new config is in, before its weights
    monkeypatch.setattr(train_state.os, "replace", _dies_after_one_move_in(moves))
    with pytest.raises(SystemExit):
        run(out, resume=True, stop_at=3)
    monkeypatch.undo()
    assert [Path(m).name for m in moves] == ["config.json"]
    with pytest.raises(CheckpointError, match="--resume` completes the save"):  # not "damaged or replaced"
        load_checkpoint(out)

    def dies_staging(*args, **kw):  # the next save dies while it is written: nothing of it is moved in
        raise SystemExit("killed")

    monkeypatch.setattr("model.train.save_train_state", dies_staging)
    with pytest.raises(SystemExit):  # completes step 3's save as it starts, then dies saving step 4
        run(out, resume=True)
    monkeypatch.undo()
    assert load_checkpoint(out).meta["training"]["steps"] == 3  # the last save stands
    run(out, resume=True)  # drops the half-written one, resumes from step 3
    whole, cut = load_checkpoint(tmp_path / "whole").model.state_dict(), load_checkpoint(out).model.state_dict()
    assert all(torch.equal(whole[k], cut[k]) for k in whole)


def test_other_ranks_read_a_run_only_once_rank_0_completed_its_interrupted_save(tmp_path):
    """DDP: rank 0 completes a save cut short as it moved in, and the other ranks read the run's config before
    the ranks meet: they could read it half moved. They wait for the stage marked whole to go, within a bound."""
    import threading

    from model.checkpoint import COMMITTED, SAVING
    from model.train_state import await_recovery, recover_save

    (tmp_path / "config.json").write_text("old")
    (tmp_path / SAVING).mkdir()
    (tmp_path / SAVING / "config.json").write_text("new")
    (tmp_path / SAVING / COMMITTED).write_text("")
    with pytest.raises(CheckpointError, match="rank 0 did not complete"):
        await_recovery(tmp_path, timeout_s=0.1)
    read = []
    rank1 = threading.Thread(target=lambda: (await_recovery(tmp_path, timeout_s=60),
                                             read.append((tmp_path / "config.json").read_text())))
    rank1.start()
    recover_save(tmp_path)  # rank 0
    rank1.join(60)
    assert read == ["new"]
    # a stage not marked whole (a kill during a first save) is waited for too, until rank 0 drops it: a rank that
    # went on found --out holding it, and was refused "not empty" (1 restart in 4, found by a helper)
    (tmp_path / SAVING).mkdir()
    (tmp_path / SAVING / "config.json").write_text("half")
    with pytest.raises(CheckpointError, match="rank 0 did not complete"):
        await_recovery(tmp_path, timeout_s=0.1)
    assert not recover_save(tmp_path)  # rank 0 drops it
    await_recovery(tmp_path, timeout_s=0.1)


def test_ddp_with_gloo_on_cpu(corpus, tmp_path):
    """Two ranks, stopped and resumed, train as one process given their global batch does, and log its loss.
    Found by a helper: rank 0 saved its own memory and random state for both ranks (a resume drifted by 2e-3), the
    loss logged was rank 0's share, and an adaptive softmax's cluster that a batch did not reach stopped the run
    (the bytes 250-255 of --cutoffs 100,250 are in no UTF-8 text)."""
    out = tmp_path / "ddp"

    def ddp(*args: str) -> None:
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            "-m", "server.cli", "train", "--out", str(out), "--no-progress", *args],
                           cwd=REPO, capture_output=True, text=True, timeout=240,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr[-3000:]
        assert len(r.stdout.splitlines()) == 1 and json.loads(r.stdout)["out"] == str(out), r.stdout  # once, not
        # once per rank (found by a helper)

    ddp("--data", str(corpus), "--preset", "tiny", "--steps", "4", "--device", "cpu", "--cutoffs", "100,250",
        "--stop-at", "2")
    ddp("--resume", "--device", "cpu")  # a device is the machine's, not the run's: on a GPU machine auto is cuda
    meta = json.loads((out / "config.json").read_text())["training"]
    assert meta["world_size"] == 2 and meta["tokens_seen"] == 4 * 2 * 8 * 32
    one = tmp_path / "one"
    train(TrainArgs(data=str(corpus), out=str(one), preset="tiny", steps=4, batch_size=16, device="cpu",
                    model_overrides={"cutoffs": (100, 250)}, progress=False))
    ranks, alone = load_checkpoint(out).model.state_dict(), load_checkpoint(one).model.state_dict()
    assert max((ranks[k] - alone[k]).abs().max().item() for k in alone) < 1e-5
    losses = {path: [json.loads(x)["loss"] for x in (path / "metrics.jsonl").read_text().splitlines()]
              for path in (out, one)}
    assert len(losses[out]) == 4 and losses[out] == pytest.approx(losses[one], abs=1e-5)


def test_ctrl_c_under_torchrun_saves_the_step_every_rank_stopped_at(corpus, tmp_path):
    """torchrun's Ctrl-C (here sent to it alone, which it forwards to its ranks) saved nothing: each rank raised
    KeyboardInterrupt wherever it was, and the run lost every step since its last --save-every (found by a
    helper). The ranks now agree on a step, save it, and a resume goes on from it."""
    import signal

    from tests.live import wait_for
    from tests.procs import Streamed

    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "server.cli",
           "train", "--out", str(out), "--no-progress", "--data", str(corpus), "--preset", "tiny", "--steps", "100000",
           "--device", "cpu", "--eval-every", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # ranks of a background test run would
    try:  # inherit SIGINT ignored (a shell's background job), and ignore what torchrun forwards
        run = Streamed(cmd, cwd=REPO, env=env)
    finally:
        signal.signal(signal.SIGINT, inherited)
    metrics = out / "metrics.jsonl"

    def stepped() -> bool:
        assert run.proc.poll() is None, "the run ended before it logged a step"
        return metrics.is_file() and metrics.read_text().count("\n") >= 3  # a few steps run

    with run:
        wait_for(stepped, 180, "three logged steps")  # the file is all a test can see of the run
        run.proc.send_signal(signal.SIGINT)
        run.proc.wait(120)
        err = run.proc.stderr.read().decode()
    step = json.loads((out / "config.json").read_text())["training"]["steps"]
    # the way back is torchrun's: `txlserve train --resume` refuses a run of 2 processes (found by a helper)
    assert (f"txlserve: interrupted: step {step} saved in {out}; `torchrun --nproc_per_node 2 -m server.cli train "
            f"--out {out} --resume` continues") in err, err[-3000:]
    assert step >= 3 and metrics.read_text().count("\n") == step
    r = subprocess.run([*cmd[:cmd.index("--data")], "--resume", "--steps", str(step + 2), "--device", "cpu"], cwd=REPO,
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == list(range(1, step + 3))
    # a signal to one rank other than 0 (an orchestrator's, or an out-of-memory killer's SIGTERM): every rank stops
    # at one step and saves it, and rank 0 no longer prints a finished run's summary (it exited 0 beside "interrupted")
    run = Streamed([*cmd[:cmd.index("--data")], "--resume", "--steps", "100000", "--device", "cpu"], cwd=REPO,
                   env=env)
    with run:
        wait_for(lambda: metrics.read_text().count("\n") >= step + 4, 180, "the resumed run's steps")
        os.kill(_rank_pid(run.proc.pid, 1), signal.SIGTERM)
        run.wait(120)
        out_text, err = bytes(run.out).decode(), run.proc.stderr.read().decode()
    assert run.proc.returncode != 0 and "txlserve: interrupted: step" in err, err[-3000:]
    assert '"steps"' not in out_text, out_text  # no summary of a run that did not finish


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun's ranks), read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found.extend(kids := children.get(todo.pop(), []))
        todo.extend(kids)
    return found


def _rank_pid(torchrun: int, rank: int) -> int:
    """The pid of ``torchrun``'s worker of ``rank`` (its environment's RANK)."""
    for pid in _descendants(torchrun):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no rank {rank} under torchrun {torchrun}")


def _valid_curve(out: Path) -> dict[int, float]:
    """Valid bpc by step, from a run's metrics.jsonl."""
    return {r["step"]: r["valid_bpc"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_save_best_keeps_the_lowest_valid_bpc(corpus, tmp_path):
    # lr 0.06 overshoots after its second step (valid bpc ~5.2, 4.5, 4.9, 4.9): the best is not the last
    train(TrainArgs(data=str(corpus), out=str(tmp_path), preset="tiny", steps=12, stop_at=4, lr=0.06,
                    warmup_steps=0, eval_every=1, eval_tokens=2000, save_best=True, progress=False))
    curve = _valid_curve(tmp_path)
    best_step = min(curve, key=curve.get)
    assert best_step != max(curve), "the curve did not rise again; pick an lr that diverges"
    best = json.loads((tmp_path / "best" / "config.json").read_text())["training"]
    assert best["valid_step"] == best_step and best["valid_bpc"] == curve[best_step]
    last = json.loads((tmp_path / "config.json").read_text())["training"]
    assert last["valid_step"] == 4 and last["valid_bpc"] == curve[4]
    first = next(load_checkpoint(tmp_path / "best").model.parameters())
    assert not torch.equal(first, next(load_checkpoint(tmp_path).model.parameters()))


def test_a_best_cut_short_as_it_moves_in_is_named_and_completed(corpus, tmp_path, monkeypatch):
    """--save-best's DIR/best was written as two files, one replaced after the other: a kill -9 between them left
    a config and weights of two steps. It is staged and moved in as a save is, and completed by the next train
    (its first call, here alone)."""
    import model.train_state as train_state

    def run(**kw) -> None:
        train(TrainArgs(data=str(corpus), out=str(tmp_path), preset="tiny", steps=3, lr=0.06, warmup_steps=0,
                        eval_every=1, eval_tokens=2000, save_best=True, progress=False, **kw))

    run(stop_at=1)  # valid bpc ~5.2 at step 1, ~4.5 at step 2: step 2 is a new best
    moved: list = []
    monkeypatch.setattr(train_state.os, "replace", _dies_after_one_move_in(moved))
    with pytest.raises(SystemExit):
        run(resume=True, stop_at=2)
    monkeypatch.undo()
    assert [Path(m).name for m in moved] == ["config.json"]  # step 2's config beside step 1's weights
    with pytest.raises(CheckpointError, match=f"--out {tmp_path} --resume` completes the save"):
        load_checkpoint(tmp_path / "best")
    assert train_state.recover_save(tmp_path)  # as the next train does first
    assert load_checkpoint(tmp_path / "best").meta["training"]["valid_step"] == 2


def test_a_run_that_fails_before_writing_leaves_no_directory(corpus, tmp_path, monkeypatch):
    """A run refused for memory at its first step left its empty --out behind."""
    import model.train as train_module

    def no_memory(*args, **kw):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(train_module.torch.nn.utils, "clip_grad_norm_", no_memory)
    with pytest.raises(RuntimeError):
        train(TrainArgs(data=str(corpus), out=str(tmp_path / "new" / "run"), preset="tiny", steps=2,
                        progress=False))
    assert (tmp_path / "new").is_dir() and not (tmp_path / "new" / "run").exists()


def _steps_logged(out: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_ctrl_c_ends_the_step_and_saves_it(corpus, tmp_path, monkeypatch, capsys):
    """A Ctrl-C lost every step since the last --save-every: now the step ends, the checkpoint is saved at it, and
    then the interrupt acts. A second Ctrl-C acts at once."""
    import signal

    import model.train as train_module

    lr_at = train_module.lr_at
    presses = {5: 1}  # lr_at(step=5) starts the sixth step: one Ctrl-C there

    def lr_at_pressing(step, **kw):
        for _ in range(presses.get(step, 0)):
            signal.raise_signal(signal.SIGINT)
        return lr_at(step, **kw)

    monkeypatch.setattr(train_module, "lr_at", lr_at_pressing)
    handler = signal.getsignal(signal.SIGINT)
    common = dict(data=str(corpus), preset="tiny", progress=False)
    with pytest.raises(KeyboardInterrupt):
        train(TrainArgs(out=str(tmp_path / "ck"), steps=50, **common))
    assert "interrupted: step 6 saved in" in capsys.readouterr().err
    assert load_checkpoint(tmp_path / "ck").meta["training"]["steps"] == 6 and _steps_logged(tmp_path / "ck") == [
        1, 2, 3, 4, 5, 6]
    assert signal.getsignal(signal.SIGINT) is handler  # the handlers put back
    resumed = train(TrainArgs(out=str(tmp_path / "ck"), steps=8, resume=True, **common))
    assert len(resumed["losses"]) == 2 and _steps_logged(tmp_path / "ck") == list(range(1, 9))

    presses[5] = 2  # twice: now, unsaved, and it says so
    with pytest.raises(KeyboardInterrupt):
        train(TrainArgs(out=str(tmp_path / "twice"), steps=50, **common))
    err = capsys.readouterr().err
    assert f"interrupted again: this step is not saved; {tmp_path / 'twice'} holds no checkpoint" in err
    assert "saved in" not in err and not (tmp_path / "twice" / "config.json").exists()
    presses.clear()  # the directory holds only that run's metrics: a new run may start there, and starts them over
    train(TrainArgs(out=str(tmp_path / "twice"), steps=3, **common))
    assert _steps_logged(tmp_path / "twice") == [1, 2, 3]

    presses[5] = 1  # the second press while the step's save runs: the save ends first, and the line says so
    save_train_state = train_module.save_train_state

    def save_pressing(*args, **kw):
        signal.raise_signal(signal.SIGINT)
        return save_train_state(*args, **kw)

    monkeypatch.setattr(train_module, "save_train_state", save_pressing)
    with pytest.raises(KeyboardInterrupt):
        train(TrainArgs(out=str(tmp_path / "during"), steps=50, **common))
    err = capsys.readouterr().err
    assert f"interrupted again: {tmp_path / 'during'} holds step 6" in err and "not saved" not in err
    assert load_checkpoint(tmp_path / "during").meta["training"]["steps"] == 6
    assert signal.getsignal(signal.SIGINT) is handler


def test_an_ignored_sigint_stays_ignored(corpus, tmp_path, monkeypatch):
    """A shell starts a script's background jobs with SIGINT ignored; the step-end stop held it anyway, and such a
    job's training ended early with success at the terminal's Ctrl-C."""
    import signal

    import model.train as train_module

    lr_at = train_module.lr_at

    def lr_at_pressing(step, **kw):
        if step == 5:
            signal.raise_signal(signal.SIGINT)
        return lr_at(step, **kw)

    monkeypatch.setattr(train_module, "lr_at", lr_at_pressing)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        train(TrainArgs(data=str(corpus), out=str(tmp_path), preset="tiny", steps=8, progress=False))
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert load_checkpoint(tmp_path).meta["training"]["steps"] == 8


def test_resume_takes_the_runs_settings_where_the_command_gives_none(corpus, tmp_path, capsys):
    """`train --out DIR --resume` without the first run's flags had trained to the preset's 200 steps on another
    schedule (a helper's run of 20,000 steps "resumed" to none). Now the run's saved arguments fill what the
    command line leaves out, and a flag it gives still wins."""
    import server.cli as cli

    out = tmp_path / "ck"
    threads = torch.get_num_threads()
    try:
        first = ["train", "--data", str(corpus), "--out", str(out), "--steps", "10", "--lr", "0.003",
                 "--stop-at", "4", "--no-progress"]
        assert cli.main(first) == 0
        assert cli.main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0  # no --data, no --steps
        meta = json.loads((out / "config.json").read_text())["training"]
        assert meta["steps"] == 10 and meta["optim"]["steps"] == 10 and meta["optim"]["lr"] == 0.003
        assert _steps_logged(out) == list(range(1, 11))
        assert cli.main(["train", "--out", str(out), "--resume", "--steps", "12", "--no-progress"]) == 0
        assert _steps_logged(out) == list(range(1, 13))
        meta = json.loads((out / "config.json").read_text())["training"]  # every command that trained it, in order
        assert meta["commands"] == ["txlserve " + " ".join(first), f"txlserve train --out {out} --resume --no-progress",
                                    f"txlserve train --out {out} --resume --steps 12 --no-progress"]
        assert meta["command"] == meta["commands"][-1]  # the resume kept only its own (a helper lost the first)
        capsys.readouterr()
        assert cli.main(["train", "--out", str(out), "--resume", "--steps", "14", "--batch-size", "4"]) == 2
        err = capsys.readouterr().err
        assert "--resume: this command's --data or --batch-size is not the run's" in err and err.count("\n") == 1
        assert cli.main(["train", "--out", str(tmp_path / "new")]) == 2
        assert "train needs --data" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("state", [None, "{not json", "[1, 2]"])
def test_a_missing_or_damaged_training_state_is_one_line(corpus, tmp_path, state):
    """A resume reads the run's arguments from state.json before anything else; missing, not JSON, or not an
    object, it says so (both ways in: a command line's, which takes the run's settings, and Python's)."""
    common = dict(data=str(corpus), out=str(tmp_path), preset="tiny", steps=4, progress=False)
    train(TrainArgs(stop_at=2, **common))
    info = tmp_path / "train_state" / "state.json"
    if state is None:
        info.unlink()
    else:
        info.write_text(state)
    says = "no training state" if state is None else "training state in .* is damaged"
    for given in (frozenset(), None):
        with pytest.raises(CheckpointError, match=f"--resume: {says}"):
            train(TrainArgs(resume=True, given=given, **common))


def test_a_resumed_run_logs_each_step_once(corpus, tmp_path):
    """metrics.jsonl held the steps an interrupted run logged after its last save, and the resumed run's again."""
    common = dict(data=str(corpus), out=str(tmp_path), preset="tiny", steps=10, progress=False)
    train(TrainArgs(stop_at=6, **common))
    with open(tmp_path / "metrics.jsonl", "a") as fh:  # logged after the last save, then the process died
        fh.write(json.dumps({"step": 7, "loss": 1.0}) + "\n" + json.dumps({"step": 8, "loss": 1.0}) + "\n")
        fh.write('{"step": 9, "lo')
    train(TrainArgs(resume=True, **common))
    assert _steps_logged(tmp_path) == list(range(1, 11))


def test_a_run_shorter_than_its_warm_up_says_so(corpus, tmp_path, capsys):
    """--preset small --steps 20 barely moved: its learning rate never left the warm-up (found by a helper)."""
    common = dict(data=str(corpus), preset="tiny", steps=2, progress=False)
    train(TrainArgs(out=str(tmp_path / "a"), warmup_steps=5, **common))
    assert "warning: the run's 2 steps end inside its warm-up of 5" in capsys.readouterr().err
    train(TrainArgs(out=str(tmp_path / "b"), warmup_steps=2, **common))
    assert "warm-up" not in capsys.readouterr().err


def test_resuming_a_run_that_never_saved_says_to_start_it_again(corpus, tmp_path):
    """It said the directory "is not empty and holds no checkpoint: choose a new or empty directory", where a run
    started again without --resume is taken (found by a helper)."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")  # killed before a save
    common = dict(data=str(corpus), out=str(tmp_path), preset="tiny", steps=2, progress=False)
    with pytest.raises(ConfigError, match="stopped before its first save.*start it again without --resume"):
        train(TrainArgs(resume=True, **common))
    train(TrainArgs(**common))
    assert _steps_logged(tmp_path) == [1, 2]


def test_the_train_command_saves_on_ctrl_c_and_exits_130(corpus, tmp_path):
    import signal

    from tests.live import wait_for

    out = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "train", "--data", str(corpus), "--out", str(out),
                             "--preset", "tiny", "--steps", "100000"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    def logged() -> bool:
        assert proc.poll() is None, "the run ended before it logged a step"
        return (out / "metrics.jsonl").is_file() and "\n" in (out / "metrics.jsonl").read_text()

    try:
        wait_for(logged, 120, "a logged step")  # the file is all a test can see of the run
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    steps = load_checkpoint(out).meta["training"]["steps"]
    assert steps >= 1 and _steps_logged(out)[-1] == steps and f"interrupted: step {steps} saved" in err


def test_save_best_resumed_keeps_the_best_of_both_runs(corpus, tmp_path):
    # the same curve in two runs (step 2 lowest, steps 3-4 higher): the resumed run must not replace best/
    kw = dict(data=str(corpus), out=str(tmp_path), preset="tiny", steps=12, lr=0.06, warmup_steps=0, eval_every=1,
              eval_tokens=2000, save_best=True, progress=False)
    train(TrainArgs(**kw, stop_at=2))
    first = json.loads((tmp_path / "best" / "config.json").read_text())["training"]
    train(TrainArgs(**kw, stop_at=4, resume=True))
    curve = _valid_curve(tmp_path)
    assert sorted(curve) == [1, 2, 3, 4] and min(curve, key=curve.get) == 2
    best = json.loads((tmp_path / "best" / "config.json").read_text())["training"]
    assert best["valid_step"] == first["valid_step"] == 2 and best["valid_bpc"] == curve[2]


def test_best_so_far_reads_best_and_treats_a_missing_or_damaged_one_as_none(tmp_path):
    from model.train import _best_so_far

    assert _best_so_far(tmp_path / "best") == float("inf")
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "config.json").write_text("{not json")
    assert _best_so_far(tmp_path / "best") == float("inf")
    (tmp_path / "best" / "config.json").write_text(json.dumps({"training": {"valid_bpc": 1.25}}))
    assert _best_so_far(tmp_path / "best") == 1.25


@pytest.mark.parametrize("edit, says", [
    (lambda s: s.update(step="x"), "step and tokens_seen must be integers"),
    (lambda s: s.pop("data"), "data must be an object"),
    (lambda s: s.update(param_groups=[]), "param_groups must be a non-empty list"),
    (lambda s: s.update(args=7), "args must be an object"),
    (lambda s: s["args"].update(steps="many"), "its steps is 'many'"),
    # each of these was a traceback too, inside the first step or the config (found by a helper)
    (lambda s: s["param_groups"][0].update(betas="x"), "its optimizer's betas is 'x'"),
    (lambda s: s["param_groups"][0].update(eps="x"), "its optimizer's eps is 'x'"),
    (lambda s: s["param_groups"][0].update(weight_decay=None), "its optimizer's weight_decay is None"),
    (lambda s: s["param_groups"][0].update(amsgrad=True), "its optimizer's amsgrad is True"),
    (lambda s: s["args"].update(model_overrides={"bogus": 1}), "its model_overrides name 'bogus'"),
    (lambda s: s["data"].update(segment=-3), "its data position does not fit the run's data"),
])
def test_a_hand_edited_training_state_is_one_line(corpus, tmp_path, edit, says):
    """Each of these was a traceback later in the run (a TypeError, a KeyError, torch's ValueError)."""
    common = dict(data=str(corpus), out=str(tmp_path), preset="tiny", steps=4, progress=False)
    train(TrainArgs(stop_at=2, **common))
    info = tmp_path / "train_state" / "state.json"
    state = json.loads(info.read_text())
    edit(state)
    info.write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=f"damaged: {says}"):
        train(TrainArgs(resume=True, given=frozenset(), **common))


def test_a_training_state_whose_memory_or_random_state_is_damaged_is_one_line(corpus, tmp_path):
    """A memory of another shape (only its width was checked) and a random state of ten bytes were torch's
    RuntimeErrors at the first step or at the resume."""
    from safetensors.torch import load_file, save_file

    common = dict(data=str(corpus), out=str(tmp_path), preset="tiny", steps=4, progress=False)
    train(TrainArgs(stop_at=2, **common))
    path = tmp_path / "train_state" / "state.safetensors"
    good = load_file(str(path))
    mems = good["mems"]
    for name, bad, says in (("mems", torch.zeros(mems.size(0) + 1, *mems.shape[1:]), "its memory is"),
                            ("rng.cpu", torch.zeros(10, dtype=torch.uint8), "its random state cannot be restored")):
        save_file({**good, name: bad}, str(path))
        with pytest.raises(CheckpointError, match=f"damaged: {says}"):
            train(TrainArgs(resume=True, given=frozenset(), **common))
    save_file(good, str(path))
    info = tmp_path / "train_state" / "state.json"  # not damaged: another process count, or the data changed
    saved = json.loads(info.read_text())
    for edit, says in (({"world_size": 2}, "trained on 2 process\\(es\\) and this run has 1: resume it on 2"),
                       ({"stream_len": saved["data"]["stream_len"] + 1}, "is not the data .* has changed since")):
        info.write_text(json.dumps({**saved, "data": {**saved["data"], **edit}}))
        with pytest.raises(ConfigError, match=says):
            train(TrainArgs(resume=True, given=frozenset(), **common))
    info.write_text(json.dumps(saved))
    with pytest.raises(ConfigError, match="at step 2 already: give a --stop-at above it, or leave it out"):
        train(TrainArgs(resume=True, given=frozenset(), stop_at=2, **common))  # was: "give --steps above it"
    train(TrainArgs(resume=True, given=frozenset(), **common))  # the good state still resumes


def test_every_damage_a_helper_made_to_a_training_state_is_one_line_before_a_step_runs(corpus, tmp_path):
    """Each was a traceback, at the resume, at the first step, or at the run's last save (its steps lost): a
    config's training record that is no object, data positions or a last evaluation of the wrong type, an lr of
    NaN or -1, Adam's moments missing for one parameter or 0-dim; and with every moment gone the run went on with
    fresh ones, unlike the run it resumed."""
    from safetensors.torch import load_file, save_file

    common = dict(data=str(corpus), out=str(tmp_path), preset="tiny", steps=4, progress=False)
    train(TrainArgs(stop_at=2, **common))
    state, config = tmp_path / "train_state" / "state.json", tmp_path / "config.json"
    tensors = tmp_path / "train_state" / "state.safetensors"
    saved_state, saved_config, good = state.read_text(), config.read_text(), load_file(str(tensors))
    info = json.loads(saved_state)

    def edited(**changes) -> str:
        return json.dumps({**info, **changes})
    moment = next(k for k in good if k.endswith("exp_avg"))
    cases = [
        (state, edited(data={**info["data"], "segment": "x"}), "data's positions must be integers"),
        (state, edited(data={**info["data"], "segment": None}), "data's positions must be integers"),
        (state, edited(data={**info["data"], "epoch": [1]}), "data's positions must be integers"),
        (state, edited(last_eval=[1]), "last_eval must be an object of numbers"),
        (state, edited(args={**info["args"], "lr": float("nan")}), "its lr is nan"),
        (state, edited(args={**info["args"], "lr": -1}), "its lr is -1"),
        (tensors, {k: v for k, v in good.items() if k != moment}, "its optimizer has no moments"),
        (tensors, {**good, moment: torch.tensor(0.0)}, "its optimizer has no moments"),
        (tensors, {k: v for k, v in good.items() if not k.startswith("optim.")}, "its optimizer has no moments"),
    ]
    for path, damaged, says in cases:
        if path == tensors:
            save_file(damaged, str(path))
        else:
            path.write_text(damaged)
        with pytest.raises(CheckpointError, match=f"damaged: {says}"):
            train(TrainArgs(resume=True, given=frozenset(), **common))
        state.write_text(saved_state)
        save_file(good, str(tensors))
    weights = (tmp_path / "model.safetensors").read_bytes()
    # a parameter no batch reached (an adaptive softmax's rare cluster) has no moments at all, and resumes
    unstepped = moment.rsplit(".", 1)[0] + "."
    save_file({k: v for k, v in good.items() if not k.startswith(unstepped)}, str(tensors))
    train(TrainArgs(resume=True, given=frozenset(), stop_at=3, **common))
    assert json.loads(state.read_text())["step"] == 3
    state.write_text(saved_state)
    config.write_text(saved_config)
    save_file(good, str(tensors))
    (tmp_path / "model.safetensors").write_bytes(weights)
    for record in ([], "x", {"commands": 5, "steps": 2}):  # the config's training record: only what it names
        config.write_text(json.dumps({**json.loads(saved_config), "training": record}))
        train(TrainArgs(resume=True, given=frozenset(), stop_at=3, **common))  # read what it can, and train on
        assert json.loads(state.read_text())["step"] == 3
        state.write_text(saved_state)
        save_file(good, str(tensors))
        (tmp_path / "model.safetensors").write_bytes(weights)


def test_a_resume_refuses_another_runs_state_a_finished_run_and_the_other_tokenizer(corpus, tmp_path):
    """Another run's train_state (a wider model) loaded and failed at the first step; a resume at or past the
    run's last step saved the run again as it was (its record rewritten); --tokenizer word on a byte run was an
    AttributeError; --save-best with no evaluations did nothing."""
    common = dict(data=str(corpus), preset="tiny", progress=False)
    train(TrainArgs(out=str(tmp_path / "a"), steps=4, stop_at=2, **common))
    train(TrainArgs(out=str(tmp_path / "wide"), steps=2, d_model=64, **common))
    saved = (tmp_path / "a" / "config.json").read_text()
    with pytest.raises(ConfigError, match="at step 2 already, its last: give --steps above it to train further$"):
        train(TrainArgs(out=str(tmp_path / "a"), steps=2, resume=True, **common))
    with pytest.raises(ConfigError, match="give --steps above it to train further \\(and a --stop-at above it; 1 "
                       "is not\\)"):  # the flag given is named too (found by a helper)
        train(TrainArgs(out=str(tmp_path / "a"), steps=2, stop_at=1, resume=True, **common))
    assert (tmp_path / "a" / "config.json").read_text() == saved  # not saved again
    with pytest.raises(ConfigError, match="reads bytes, not words"):
        train(TrainArgs(out=str(tmp_path / "a"), steps=4, resume=True, tokenizer="word", **common))
    shutil.copy(tmp_path / "wide" / "train_state" / "state.safetensors", tmp_path / "a" / "train_state")
    with pytest.raises(CheckpointError, match="another model's"):
        train(TrainArgs(out=str(tmp_path / "a"), steps=4, resume=True, **common))
    with pytest.raises(ConfigError, match="--save-best keeps the weights of the best evaluation"):
        train(TrainArgs(out=str(tmp_path / "b"), steps=2, save_best=True, eval_every=0, **common))


def test_a_pickle_under_a_safe_name_or_beside_a_missing_one_is_named(corpus, tmp_path):
    """A torch.save file named model.safetensors (or state.safetensors) read as a damaged file, and an
    optimizer.pt where state.safetensors was missing as no training state at all."""
    common = dict(data=str(corpus), out=str(tmp_path), preset="tiny", steps=4, progress=False)
    train(TrainArgs(stop_at=2, **common))
    state = tmp_path / "train_state" / "state.safetensors"
    torch.save({"x": torch.zeros(2)}, state)
    with pytest.raises(CheckpointError, match="state.safetensors is a pickle, as torch.save writes"):
        train(TrainArgs(resume=True, **common))
    state.rename(tmp_path / "train_state" / "optimizer.pt")
    with pytest.raises(CheckpointError, match="optimizer.pt is a pickle, which txlserve never loads; it needs "
                                              "state.safetensors"):
        train(TrainArgs(resume=True, **common))
    torch.save({"x": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors is a pickle"):
        load_checkpoint(tmp_path)


def test_a_word_checkpoint_whose_vocabulary_is_short_of_its_outputs_is_refused_at_load(tmp_path):
    """Every generation crashed (an IndexError naming a token past the symbols), and a server reported ready and
    answered each completion with a 500."""
    from model.tokenizer import WordTokenizer

    cfg = tiny_config().replace(vocab_size=10)
    save_checkpoint(MemTransformerLM(cfg), tmp_path, tokenizer=WordTokenizer(["<eos>", "<unk>", "a", "b"]))
    with pytest.raises(CheckpointError, match="names 4 symbols, fewer than the model's 10 outputs"):
        load_checkpoint(tmp_path)


def test_a_run_resumes_from_another_directory_and_a_memoryless_model_says_how_to_decode(corpus, tmp_path,
                                                                                        monkeypatch, capsys):
    """The run kept --data as typed, relative to where it started: a resume from elsewhere found no corpus. A
    model trained with mem_len 0 decoded nowhere, with a message that did not say --mem-len gives it a memory.
    In this process, the command's own entry point (each subprocess would load torch again)."""
    from model.engine import Engine
    from server.cli import main

    (tmp_path / "here").mkdir()
    shutil.copy(corpus, tmp_path / "here" / "story.txt")
    threads = torch.get_num_threads()
    try:
        monkeypatch.chdir(tmp_path / "here")
        assert main(["train", "--data", "story.txt", "--out", "../run", "--stop-at", "2", "--preset", "tiny",
                     "--steps", "4", "--mem-len", "0", "--no-progress"]) == 0
        monkeypatch.chdir(tmp_path)
        assert main(["train", "--out", "run", "--resume", "--no-progress"]) == 0
    finally:
        torch.set_num_threads(threads)  # the command sets its own
    assert json.loads((tmp_path / "run" / "config.json").read_text())["training"]["steps"] == 4
    with pytest.raises(ConfigError, match=r"decoding needs a memory.*give --mem-len \(its training segment"):
        Engine(load_checkpoint(tmp_path / "run"))
    assert Engine(load_checkpoint(tmp_path / "run"), mem_len=8).mem_len == 8
    capsys.readouterr()


def test_a_rank_past_the_nodes_gpus_is_refused_in_one_line():
    """A GPU machine's second DDP rank with one GPU there (found on a lent H100: a CPU run resumed without
    --device cpu) is told what to change, not a CUDA traceback."""
    assert rank_device(1, 2) == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"rank 1 but has 1 CUDA device\(s\).*--nproc_per_node.*--device cpu"):
        rank_device(1, 1)


def test_a_diverged_run_says_so_and_writes_json_every_reader_reads(corpus, tmp_path, capsys):
    """A run whose loss went to NaN exited 0 and wrote bare NaN into metrics.jsonl and its summary, which no JSON
    reader but Python's takes (found by a helper): null there, and a warning."""
    from server import cli

    def strict(line: str) -> dict:
        return json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in {line}"))

    argv = ["train", "--data", str(corpus), "--out", str(tmp_path / "ck"), "--preset", "tiny", "--steps", "12",
            "--warmup-steps", "0", "--lr", "10", "--weight-decay", "10", "--no-progress"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert strict(out)["final_loss"] is None and "the run diverged" in err
    records = [strict(line) for line in (tmp_path / "ck" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] is None

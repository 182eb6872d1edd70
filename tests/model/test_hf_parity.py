"""Imported Hugging Face TransfoXL models compute what transformers 4.35.2 computes (1e-5, fp32).

Random-weight ``TransfoXLLMHeadModel``s are saved with ``save_pretrained(safe_serialization=True)``
plus a vocabulary file, imported with ``txlserve import hf``'s code, and compared: log-probabilities
over consecutive segments with mems, a greedy continuation, and a session continued across requests.
The reference runs from empty mems, as the original code does (Hugging Face's ``init_mems`` would
start the first segment on ``mem_len`` zero states).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from model.checkpoint import load_checkpoint
from model.engine import Engine
from model.import_hf import import_hf
from model.sampling import SamplingParams
from txlserve.errors import CheckpointError

transformers = pytest.importorskip("transformers", reason="the dev extras install transformers==4.35.2")
warnings.filterwarnings("ignore", category=FutureWarning)

SHAPES = {
    # div_val 1, one shared table sliced per cluster, per-layer u/v, no window
    "div1": dict(vocab_size=90, cutoffs=[20, 50], d_embed=32, div_val=1, untie_r=True, same_length=False,
                 clamp_len=0, mem_len=7),
    # div_val > 1, mixed tie_projs, shared u/v, clamp_len shorter than the context, same_length
    "div2-mixed": dict(vocab_size=90, cutoffs=[20, 50], d_embed=32, div_val=2, untie_r=False, same_length=True,
                       clamp_len=4, mem_len=6, tie_projs=[False, True, False]),
    # d_embed != d_model with div_val 1 (a projection per cluster), pre-LayerNorm, untied tables
    "proj-prelnorm": dict(vocab_size=70, cutoffs=[30], d_embed=24, div_val=1, untie_r=True, same_length=True,
                          clamp_len=0, mem_len=5, pre_lnorm=True, tie_projs=[True, False], tie_word_embeddings=False),
    # the published model's structure in miniature: three tail clusters, div_val 4, wide d_embed
    "wt103-like": dict(vocab_size=120, cutoffs=[10, 40, 80], d_embed=64, div_val=4, untie_r=True, same_length=True,
                       clamp_len=6, mem_len=8),
}


def _hf_model(shape: str, seed: int = 0):
    torch.manual_seed(seed)
    kw = dict(SHAPES[shape])
    tie_projs = kw.pop("tie_projs", None)
    cfg = transformers.TransfoXLConfig(d_model=32, n_head=2, d_head=16, d_inner=48, n_layer=3, dropout=0.0,
                                       dropatt=0.0, **kw)
    if tie_projs is not None:
        cfg.tie_projs = tie_projs
    model = transformers.TransfoXLLMHeadModel(cfg).eval()
    with torch.no_grad():  # weights far from the tiny init, so the distributions are far from uniform
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.4)
    return model


def _export(model, path, vocab_format: str = "txt") -> None:
    model.save_pretrained(path, safe_serialization=True)
    symbols = ["<eos>", "<unk>"] + [f"w{i}" for i in range(2, model.config.vocab_size)]
    if vocab_format == "txt":
        (path / "vocab.txt").write_text("".join(f"{s}\n" for s in symbols))
    else:
        (path / "vocab.json").write_text(json.dumps({"idx2sym": symbols, "sym2idx": {s: i for i, s in
                                                                                     enumerate(symbols)}}))


@pytest.fixture(params=list(SHAPES))
def pair(request, tmp_path):
    hf = _hf_model(request.param)
    _export(hf, tmp_path / "hf", "txt" if request.param != "div2-mixed" else "json")
    import_hf(tmp_path / "hf", tmp_path / "ck")
    return hf, tmp_path / "ck"


def _empty_mems(hf, bsz: int) -> list[torch.Tensor]:
    return [torch.empty(0, bsz, hf.config.d_model) for _ in range(hf.config.n_layer)]


@torch.no_grad()
def test_segments_with_mems_match(pair):
    hf, ck = pair
    ckpt = load_checkpoint(ck)
    x = torch.randint(0, hf.config.vocab_size, (2, 4 * 5))
    hf_mems, mems = _empty_mems(hf, 2), None
    for seg in x.split(5, dim=1):  # 4 consecutive segments, mems carried
        out = hf(input_ids=seg, mems=hf_mems)
        logits, mems = ckpt.model(seg, mems)
        torch.testing.assert_close(logits.log_softmax(-1), out.prediction_scores, atol=1e-5, rtol=1e-5)
        hf_mems = out.mems
    assert mems.size(2) == ckpt.config.mem_len


@torch.no_grad()
def test_targets_scored_without_the_dense_table(pair):
    """The loss (training, eval, scoring) equals the dense log-probabilities at the targets."""
    hf, ck = pair
    ckpt = load_checkpoint(ck)
    x = torch.randint(0, hf.config.vocab_size, (2, 9))
    out = hf(input_ids=x, mems=_empty_mems(hf, 2))
    nll, _ = ckpt.model.loss(x[:, :-1], x[:, 1:])
    want = -out.prediction_scores[:, :-1].gather(-1, x[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(nll, want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_greedy_continuation_matches_greedy_loop(pair):
    hf, ck = pair
    engine = Engine.from_checkpoint(ck)
    prompt = torch.randint(2, hf.config.vocab_size, (12,)).tolist()
    mems = _empty_mems(hf, 1)
    for t in prompt:  # token by token with mems: every query sees itself and the mem_len tokens before it
        out = hf(input_ids=torch.tensor([[t]]), mems=mems)
        mems = out.mems
    want = []
    for _ in range(10):
        t = int(out.prediction_scores[0, -1].argmax())
        want.append(t)
        out = hf(input_ids=torch.tensor([[t]]), mems=out.mems)
    got = [e.token for e in engine.generate(engine.new_state(), prompt, SamplingParams(max_tokens=10,
                                                                                      temperature=0))]
    assert got == want


@torch.no_grad()
def test_session_across_three_requests_equals_one(pair):
    hf, ck = pair
    engine = Engine.from_checkpoint(ck)
    ids = torch.randint(0, hf.config.vocab_size, (23,)).tolist()
    whole = engine.new_state()
    engine.feed(whole, ids)
    state, seen = engine.new_state(), 0
    for piece in (ids[:5], ids[5:6], ids[6:]):  # each request: restore the stored state, feed, store again
        engine.feed(state, piece)
        seen += len(piece)
        stored = {k: v.clone() for k, v in engine.export_state(state).items()}
        state = engine.import_state(stored, tokens_seen=seen, fingerprint=engine.fingerprint)
    a, b = engine.export_state(whole), engine.export_state(state)
    torch.testing.assert_close(b["mems"], a["mems"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b["last_logits"], a["last_logits"], atol=1e-5, rtol=1e-5)
    mems = _empty_mems(hf, 1)  # and the next-token distribution is the reference's
    for t in ids:
        out = hf(input_ids=torch.tensor([[t]]), mems=mems)
        mems = out.mems
    torch.testing.assert_close(b["last_logits"].log_softmax(-1), out.prediction_scores[0, -1], atol=1e-5,
                               rtol=1e-5)


def test_mem_len_mapping_recorded(pair):
    hf, ck = pair
    cfg = load_checkpoint(ck).config
    assert cfg.original_mem_len == hf.config.mem_len
    meta = json.loads((ck / "config.json").read_text())
    assert meta["training"]["original_mem_len"] == hf.config.mem_len
    assert meta["tokenizer"]["type"] == "word" and len(meta["tokenizer"]["symbols"]) == hf.config.vocab_size


def test_pickled_files_are_refused(tmp_path):
    hf = _hf_model("div1")
    src = tmp_path / "hf"
    _export(hf, src)
    (src / "model.safetensors").rename(src / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin is a pickle.*fetch model\.safetensors"):
        import_hf(src, tmp_path / "out")
    (src / "pytorch_model.bin").rename(src / "model.safetensors")
    (src / "vocab.txt").rename(src / "vocab.pkl")
    with pytest.raises(CheckpointError, match=r"vocab\.pkl is a pickle.*fetch vocab\.json"):
        import_hf(src, tmp_path / "out")
    # the pickle itself given (it said "has no config.json"), and a pickled folder whose config lacks a field (it
    # named the field first); and vocab.txt serves beside a vocab.pkl (it was refused for want of vocab.json)
    import pickle

    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps({"w": 1}))
    with pytest.raises(CheckpointError, match=r"is a file \(pytorch_model\.bin is a pickle.*give the Hugging Face"):
        import_hf(tmp_path / "pytorch_model.bin", tmp_path / "out")
    (src / "model.safetensors").rename(src / "pytorch_model.bin")
    (src / "config.json").write_text(json.dumps({"model_type": "transfo-xl"}))
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin is a pickle.*fetch model\.safetensors"):
        import_hf(src, tmp_path / "out")
    _export(hf, src)  # whole again, a vocab.txt written
    assert (src / "vocab.pkl").exists() and (src / "vocab.txt").exists()
    import_hf(src, tmp_path / "out")
    # files an editor saved with a byte order mark: config.json was "not valid JSON", and vocab.txt's first symbol
    # silently became "\ufeff<eos>"
    for name in ("config.json", "vocab.txt"):
        (src / name).write_bytes(b"\xef\xbb\xbf" + (src / name).read_bytes())
    import_hf(src, tmp_path / "bom")
    assert load_checkpoint(tmp_path / "bom").tokenizer.symbols == load_checkpoint(tmp_path / "out").tokenizer.symbols


def test_a_malformed_vocabulary_or_config_is_named(tmp_path):
    """A pickle saved as vocab.json was "not valid JSON: 'utf-8' codec can't decode byte 0x80"; cutoffs given as a
    string were read as its characters; an eos_token_id past the vocabulary was silently <eos> (found by a
    helper)."""
    import pickle

    hf = _hf_model("div1")
    src = tmp_path / "hf"
    _export(hf, src, "json")
    good = (src / "vocab.json").read_bytes()
    (src / "vocab.json").write_bytes(pickle.dumps({"idx2sym": ["<eos>"]}))
    with pytest.raises(CheckpointError, match=r"vocab\.json is not JSON \(vocab\.json is a pickle.*vocab\.txt"):
        import_hf(src, tmp_path / "out")
    (src / "vocab.json").write_bytes(good)
    config = json.loads((src / "config.json").read_text())
    for field, value, says in (("cutoffs", "2000", "'cutoffs' is \"2000\", not a list"),
                               ("eos_token_id", 99999, "eos_token_id 99999 is not an id")):
        (src / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(CheckpointError, match=says):
            import_hf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_source_that_does_not_exist_says_so(tmp_path):
    """A hub name given as the source (``import hf transfo-xl/transfo-xl-wt103``) said it "has no config.json"."""
    with pytest.raises(CheckpointError, match=r"transfo-xl-wt103 does not exist: give a Hugging Face TransfoXL "
                                              r"directory on disk, downloaded first \(huggingface-cli download"):
        import_hf(tmp_path / "transfo-xl" / "transfo-xl-wt103", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_import_never_writes_over_a_checkpoint_or_among_other_files(tmp_path):
    """It replaced a trained checkpoint's weights and config without a word, leaving its training state behind."""
    from txlserve.errors import ConfigError

    hf = _hf_model("div1")
    _export(hf, tmp_path / "hf")
    fingerprint = import_hf(tmp_path / "hf", tmp_path / "ck")
    with pytest.raises(ConfigError, match="already holds a checkpoint"):
        import_hf(tmp_path / "hf", tmp_path / "ck")
    assert load_checkpoint(tmp_path / "ck").fingerprint == fingerprint
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty and holds no checkpoint"):
        import_hf(tmp_path / "hf", tmp_path / "notes")
    assert [p.name for p in (tmp_path / "notes").iterdir()] == ["todo.txt"]


def test_serving_a_hf_directory_names_the_command(tmp_path):
    hf = _hf_model("div1")
    _export(hf, tmp_path / "hf")
    with pytest.raises(CheckpointError, match=r"txlserve import hf .*hf --out .*hf-txlserve"):
        load_checkpoint(tmp_path / "hf")


def test_import_command_converts_and_refuses_in_one_line(tmp_path):
    import subprocess
    import sys

    hf = _hf_model("wt103-like")
    src = tmp_path / "hf"
    _export(hf, src, "json")
    cmd = [sys.executable, "-m", "server.cli", "import", "hf", str(src), "--out", str(tmp_path / "ck")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["fingerprint"] == load_checkpoint(tmp_path / "ck").fingerprint
    (src / "vocab.json").rename(src / "vocab.pkl")
    refused = subprocess.run(cmd[:-1] + [str(tmp_path / "ck2")], capture_output=True, text=True, timeout=240)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "vocab.pkl is a pickle" in refused.stderr and "vocab.json" in refused.stderr

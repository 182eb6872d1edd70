"""Word-level models: the WikiText tokenizer, adaptive layers, training and evaluation on WikiText-style files."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from model.checkpoint import load_checkpoint, save_checkpoint
from model.config import TXLConfig
from model.engine import Engine
from model.sampling import SamplingParams
from model.tokenizer import START, WordTokenizer, tokenizer_from_dict
from model.train import TrainArgs, train
from model.transformer_xl import MemTransformerLM
from model.words import load_word_corpus
from server.cli import main as cli_main
from txlserve.errors import CheckpointError, ConfigError, DataError, InvalidRequestError

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext-2"
SYMBOLS = ["<eos>", "<unk>", "the", "cat", "do", "n't", ",", "1", "000", "@,@", "@-@", "@.@", "well", "known", ".",
           "(", ")", "U.S.", "'s", "=", "Valkyria", "3", "5"]


def test_word_tokenizer_wikitext_conventions():
    tok = WordTokenizer(SYMBOLS)
    ids = tok.encode("the cat don't, 1,000 well-known (the) U.S., dog.\nthe cat's 3.5")
    assert [tok.symbols[i] for i in ids] == [
        "the", "cat", "do", "n't", ",", "1", "@,@", "000", "well", "@-@", "known", "(", "the", ")", "U.S.", ",",
        "<unk>", ".", "<eos>", "the", "cat", "'s", "3", "@.@", "5"]
    assert tok.decode(ids) == "the cat don't, 1,000 well-known (the) U.S., <unk>.\nthe cat's 3.5"
    assert tok.encode(tok.decode(ids)) == ids  # display text reads back to the same words
    # text already in WikiText form reads word for word
    assert [tok.symbols[i] for i in tok.encode(" = Valkyria = \n")] == ["=", "Valkyria", "=", "<eos>"]


def test_word_offsets_point_at_each_tokens_source_in_the_text_as_sent():
    """OpenAI's text_offset for a prompt echoed as it was sent: each word where it stands, a joiner at its mark,
    <eos> at its newline, an unknown word at the word it replaced; one offset a token, whatever the spacing."""
    tok = WordTokenizer(SYMBOLS)
    text = "  the\tcat don't,  1,000 \r\n(the) dog's\n\n = U.S. ="
    ids, offsets = tok.encode(text), tok.offsets(text)
    assert len(offsets) == len(ids) and offsets == sorted(offsets)
    source = {"<unk>": "dog", "<eos>": "\n", **{j: j[1] for j in ("@,@", "@-@", "@.@")}}
    for i, at in zip(ids, offsets):
        assert text.startswith(source.get(tok.symbols[i], tok.symbols[i]), at), (tok.symbols[i], text[at:])
    assert tok.offsets("1 @,@ 000") == [0, 2, 6] and tok.offsets("") == [] and tok.offsets("\n") == [0]


def test_word_tokens_released_one_by_one_join_to_the_decoded_text():
    tok = WordTokenizer(SYMBOLS)
    ids = tok.encode("the cat don't, 1,000\nthe (cat)")
    pieces, prev = [], START
    for t in ids:
        pieces.append(tok.token_bytes(t, prev))
        prev = t
    assert b"".join(pieces).decode() == tok.decode(ids)
    assert tok.token_bytes(tok.index["cat"], None) == b" cat"  # continuing unknown text: after a word
    assert tok.token_name(tok.index["@-@"]) == "@-@"


def test_word_tokenizer_round_trips_through_json_and_refuses_bad_vocabularies():
    tok = WordTokenizer(SYMBOLS)
    again = tokenizer_from_dict(json.loads(json.dumps(tok.to_dict())))
    assert again.encode("the cat") == tok.encode("the cat") and again.vocab_size == len(SYMBOLS)
    with pytest.raises(CheckpointError, match="twice"):
        WordTokenizer(["<eos>", "a", "a"])
    with pytest.raises(CheckpointError, match="end-of-line"):
        WordTokenizer(["a", "b"])
    with pytest.raises(InvalidRequestError, match="no unknown-word"):
        WordTokenizer(["<eos>", "a"], unk=None).encode("b")
    with pytest.raises(InvalidRequestError, match="not valid Unicode"):
        tok.encode("\ud800")


def test_vocabulary_is_frequency_ordered_as_the_original_builds_it():
    tok = WordTokenizer.build(["b a b", "c b a", "d"])
    assert tok.symbols == ["<eos>", "b", "a", "c", "d"]  # specials first, then by count, ties first-seen
    capped = WordTokenizer.build(["b a b", "c b a", "d"], max_size=2)
    assert capped.symbols == ["<eos>", "<unk>", "b", "a"] and capped.encode("d") == [capped.unk_id]


def test_adaptive_config_is_validated():
    with pytest.raises(ConfigError, match="cutoffs"):
        TXLConfig(vocab_size=100, cutoffs=(50, 20))
    with pytest.raises(ConfigError, match="cutoffs"):
        TXLConfig(vocab_size=100, cutoffs=(20, 100))
    with pytest.raises(ConfigError, match="tie_projs"):
        TXLConfig(vocab_size=100, cutoffs=(20,), tie_projs=(True,))
    with pytest.raises(ConfigError, match="div_val"):
        TXLConfig(vocab_size=100, d_model=32, d_embed=4, cutoffs=(20, 50), div_val=4)
    cfg = TXLConfig.from_dict(json.loads(TXLConfig(vocab_size=100, cutoffs=(20, 50), div_val=2).to_json()))
    assert cfg.cutoffs == (20, 50) and cfg.tie_projs == (False, False, False) and cfg.d_embed == cfg.d_model


def _adaptive(**kw) -> MemTransformerLM:
    torch.manual_seed(0)
    cfg = TXLConfig(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, dropout=0.0, tgt_len=8, mem_len=8,
                    vocab_size=60, cutoffs=(10, 30), div_val=2, tie_projs=(False, True, True), **kw)
    return MemTransformerLM(cfg).eval()


def test_adaptive_log_probabilities_normalise_and_match_the_loss():
    model = _adaptive()
    x = torch.randint(0, 60, (2, 7))
    with torch.no_grad():
        logp, _ = model(x)
        nll, _ = model(x, targets=x)
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(2, 7))
    torch.testing.assert_close(nll, -logp.gather(-1, x[..., None]).squeeze(-1))


def test_adaptive_layers_train_under_bf16_autocast():
    """Training on a GPU runs under bf16 autocast; CPU autocast takes the same path through the embedding's
    per-cluster projections (a bf16 piece copied into the embedding must not meet an fp32 buffer)."""
    model = _adaptive().train()
    x = torch.randint(0, 60, (2, 7))
    with torch.no_grad():
        want, _ = model(x, targets=x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        nll, _ = model(x, targets=x)
    nll.mean().backward()
    assert all(p.grad is not None for p in model.word_emb.parameters())
    torch.testing.assert_close(nll.float(), want, atol=0.1, rtol=0.05)  # bf16 rounding, same model


def test_adaptive_checkpoint_round_trip_keeps_ties(tmp_path):
    model = _adaptive(d_embed=48)
    save_checkpoint(model, tmp_path, tokenizer=WordTokenizer(["<eos>"] + [f"w{i}" for i in range(59)]))
    ckpt = load_checkpoint(tmp_path)
    crit, emb = ckpt.model.crit, ckpt.model.word_emb
    assert crit.out_projs[1] is emb.emb_projs[1] and crit.out_projs[0] is not emb.emb_projs[0]
    assert all(o.weight is e.weight for o, e in zip(crit.out_layers, emb.emb_layers))
    x = torch.randint(0, 60, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(ckpt.model(x)[0], model(x)[0], atol=0, rtol=0)


def test_prefill_and_scoring_never_build_a_dense_table(tmp_path):
    """A long prompt computes next-token scores for its last token only; scoring reads the targets cluster
    by cluster. (A 267,735-word vocabulary makes [tokens, vocab] tables gigabytes.)"""
    model = _adaptive()
    save_checkpoint(model, tmp_path, tokenizer=WordTokenizer(["<eos>"] + [f"w{i}" for i in range(59)]))
    engine = Engine.from_checkpoint(tmp_path, prefill_chunk=16)
    rows = []
    dense = engine.model.crit.logits
    engine.model.crit.logits = lambda h: rows.append(h.reshape(-1, h.size(-1)).size(0)) or dense(h)
    ids = torch.randint(0, 60, (100,)).tolist()
    score = engine.score(engine.new_state(), ids)
    assert max(rows) == 1 and score.tokens == 99
    events = list(engine.generate(engine.new_state(), ids, SamplingParams(max_tokens=3, temperature=0)))
    assert len(events) == 3 and max(rows) == 1
    again = Engine.from_checkpoint(tmp_path)
    whole = again.logits(again.feed(again.new_state(), ids))  # the dense table, for the check only
    want = whole[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None]).sum()
    assert abs(score.logprob - float(want)) < 1e-3


def _wikitext(folder: Path, seed: int = 0) -> Path:
    """A tiny WikiText-style corpus: a few hundred lines of a repetitive grammar, train/valid/test."""
    rng = random.Random(seed)
    nouns, verbs = ["the cat", "a dog", "the U.S.", "Valkyria"], ["saw", "ate", "won", "lost"]
    folder.mkdir()
    for split, n in (("train", 600), ("valid", 60), ("test", 60)):
        lines = [" = Title = \n", " \n"] + [f" {rng.choice(nouns)} {rng.choice(verbs)} {rng.choice(nouns)} @-@ "
                                            f"{rng.randint(1, 9)} @,@ 000 . \n" for _ in range(n)]
        path = folder / f"wiki.{split}.tokens"
        if split == "test":
            with gzip.open(str(path) + ".gz", "wt") as fh:
                fh.writelines(lines)
        else:
            path.write_text("".join(lines))
    return folder


def test_word_corpus_reads_the_wikitext_layout(tmp_path):
    corpus, tok = load_word_corpus(_wikitext(tmp_path / "wt"))
    assert tok.symbols[0] == "<eos>" and tok.unk_id is None  # no <unk> in the data, no word left out
    n_lines = 602
    assert int((corpus.train == tok.eos_id).sum()) == n_lines and corpus.test.size > 0  # .gz read too
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no train split"):
        load_word_corpus(tmp_path / "empty", tok)
    with pytest.raises(DataError, match="not a file or a folder: /dev/null"):
        load_word_corpus("/dev/null", tok)
    # a gzipped split not named .gz is read by its bytes (it was refused as "not UTF-8")
    folder = tmp_path / "wt"
    (folder / "wiki.test.tokens.gz").rename(folder / "wiki.test.tokens")
    again, _ = load_word_corpus(folder, tok)
    assert np.array_equal(again.test, corpus.test)


def test_a_word_run_reads_the_splits_it_uses(tmp_path, capsys, monkeypatch):
    """A folder of wiki.train.tokens alone was refused for want of a valid split that a run with no evaluations
    never reads (and a test split no run reads); a single file, which stands for every split, was taken for a run
    that evaluates, whose validation then scored its own training text (both found by a helper)."""
    data = _wikitext(tmp_path / "wt")
    (data / "wiki.valid.tokens").unlink()
    (data / "wiki.test.tokens.gz").unlink()
    common = dict(preset="tiny", steps=2, progress=False, tokenizer="word")
    train(TrainArgs(data=str(data), out=str(tmp_path / "a"), eval_every=0, **common))
    assert load_checkpoint(tmp_path / "a").tokenizer.name == "word"
    with pytest.raises(DataError, match="no valid split"):
        train(TrainArgs(data=str(data), out=str(tmp_path / "b"), eval_every=1, **common))
    one = data / "wiki.train.tokens"
    with pytest.raises(DataError, match="a file would be its own validation"):
        train(TrainArgs(data=str(one), out=str(tmp_path / "c"), eval_every=1, **common))
    train(TrainArgs(data=str(one), out=str(tmp_path / "d"), eval_every=0, **common))
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    # eval on one file: its figures once, as the whole file (--split all printed them three times, as three splits)
    for split in ("all", "test", "whole"):
        assert cli_main(["eval", "--checkpoint", str(tmp_path / "d"), "--data", str(one), "--split", split,
                         "--max-tokens", "200", "--no-progress"]) == 0
        rows = capsys.readouterr().out.splitlines()
        assert len(rows) == 1 and rows[0].startswith("whole  ppl "), rows
    # --split all on a folder of held-out splits alone (WikiText-2's valid and test): each it has (it was refused
    # for want of a train split); an empty split is said in one line before any other is scored
    held = tmp_path / "held"
    held.mkdir()
    (held / "wiki.test.tokens").write_text(one.read_text()[:2000])
    (held / "wiki.valid.tokens").write_text(one.read_text()[2000:4000])
    assert cli_main(["eval", "--checkpoint", str(tmp_path / "d"), "--data", str(held), "--split", "all",
                     "--no-progress"]) == 0
    assert [row.split()[0] for row in capsys.readouterr().out.splitlines()] == ["valid", "test"]
    (held / "wiki.test.tokens").write_text("")  # the later split: none is scored first (hours, then lost)
    import model.evaluate

    scored = []
    real = model.evaluate.evaluate
    monkeypatch.setattr(model.evaluate, "evaluate", lambda *a, **k: scored.append(1) or real(*a, **k))
    assert cli_main(["eval", "--checkpoint", str(tmp_path / "d"), "--data", str(held), "--split", "all"]) == 2
    out, err = capsys.readouterr()
    assert not out and f"the test split of {held} holds 0 tokens: nothing to score" in err, err
    assert scored == []
    # a run that evaluates on an empty valid split is refused before its first step (it failed at its first
    # evaluation, eval_every steps in, with no word of which text was short)
    (data / "wiki.valid.tokens").write_text("\n")  # one line: its <eos> alone
    with pytest.raises(DataError, match=r"valid split of .* holds 1 token, and this run evaluates on it every 1 "):
        train(TrainArgs(data=str(data), out=str(tmp_path / "e"), eval_every=1, **common))
    assert not (tmp_path / "e").exists()


def test_a_word_runs_cutoffs_are_checked_against_its_vocabulary(tmp_path):
    """Any cutoff past 255 was refused, checked against a byte model's vocabulary while the run chose the splits it
    reads: the README's --cutoffs 20000,40000,200000 could never run (found by a helper)."""
    (tmp_path / "wt").mkdir()
    words = [f"w{i}" for i in range(400)]
    (tmp_path / "wt" / "wiki.train.tokens").write_text("\n".join(" ".join(words[i:i + 20]) for i in range(0, 400, 20)))
    common = dict(data=str(tmp_path / "wt"), preset="tiny", steps=1, progress=False, tokenizer="word", eval_every=0)
    train(TrainArgs(out=str(tmp_path / "a"), model_overrides={"cutoffs": (300, 350)}, **common))
    assert load_checkpoint(tmp_path / "a").config.cutoffs == (300, 350)
    with pytest.raises(ConfigError, match=r"within \(0, vocab_size 401\), got \[300, 500\]"):  # the words and <eos>
        train(TrainArgs(out=str(tmp_path / "b"), model_overrides={"cutoffs": (300, 500)}, **common))


def test_tiny_word_model_with_adaptive_softmax_learns(tmp_path, capsys):
    data = _wikitext(tmp_path / "wt")
    result = train(TrainArgs(data=str(data), out=str(tmp_path / "ck"), preset="tiny", steps=120, lr=5e-3,
                             progress=False, tokenizer="word", eval_every=60,
                             model_overrides={"cutoffs": (6, 12), "div_val": 2}))
    first, last = sum(result["losses"][:5]) / 5, sum(result["losses"][-10:]) / 10
    assert last < first - 1.0, (first, last)
    ckpt = load_checkpoint(tmp_path / "ck")
    assert ckpt.tokenizer.name == "word" and ckpt.config.cutoffs == (6, 12) and ckpt.config.div_val == 2
    assert result["valid_ppl"] < ckpt.config.vocab_size / 2  # far better than uniform
    engine = Engine(ckpt)
    text = "".join(e.text for e in engine.generate(engine.new_state(), "the cat saw",
                                                   SamplingParams(max_tokens=8, temperature=0)))
    assert text.startswith(" ") and "@" not in text  # words, spaced and joined for display
    out = subprocess.run([sys.executable, "-m", "server.cli", "eval", "--checkpoint", str(tmp_path / "ck"),
                          "--data", str(data), "--split", "test", "--json"], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["tokens"] > 0 and 1 < report["ppl"] < ckpt.config.vocab_size / 2
    # --split whole: a folder's splits in order as one text, a file read once, a folder of none said in one line
    import server.cli as cli

    threads = torch.get_num_threads()
    scored = {}
    try:
        for where in (data, data / "wiki.test.tokens.gz"):
            assert cli.main(["eval", "--checkpoint", str(tmp_path / "ck"), "--data", str(where), "--split", "whole",
                             "--json", "--threads", "1"]) == 0
            scored[where] = json.loads(capsys.readouterr().out)["tokens"]
        (tmp_path / "none").mkdir()
        assert cli.main(["eval", "--checkpoint", str(tmp_path / "ck"), "--data", str(tmp_path / "none"), "--split",
                         "whole"]) == 2
        assert "has no split to read" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)
    assert scored[data / "wiki.test.tokens.gz"] == report["tokens"]  # the file whole, once: the test split's
    assert scored[data] > 10 * scored[data / "wiki.test.tokens.gz"]  # train, valid and test


@pytest.mark.skipif(not (SHARED / "wiki.valid.tokens.gz").is_file(), reason="../shared/data/wikitext-2 is absent")
def test_wikitext2_reads_the_published_token_count():
    corpus, tok = load_word_corpus(SHARED, WordTokenizer.build(["<unk>"]), splits=("valid",))
    assert corpus.valid.size == 217_646  # words plus one <eos> per line, the published count


def test_an_unknown_word_beside_a_joiner_reads_back_as_it_was_written():
    """``<unk> @-@ class`` decodes to "<unk>-class", which read back as one <unk>: a session's text re-sent lost two
    tokens, so its scores and continuation differed (found by a helper)."""
    tok = WordTokenizer(["<eos>", "<unk>", "@-@", "@,@", "class", "the", "of", "1"])
    for text in ("of the <unk> @-@ class", "the class @-@ <unk>", "1 @,@ <unk>", "<unk> @-@ <unk>"):
        ids = tok.encode(text)
        assert tok.encode(tok.decode(ids)) == ids, (text, tok.decode(ids))


MOSES = ["<eos>", "<unk>", "I", "don", "'t", "know", ",", "they", "can", "didn", "from", "2000", "\u2013", "2005",
         "km", "/", "h", "3", ":", "04", "\u201c", "\u201d", "yes", "at", "90", "1", "@,@", "000", "a", "."]


def test_text_is_split_as_wikitext_splits_it():
    """WikiText writes "don't" as ``don 't`` (Moses), not ``do n't``, and sets apart en dashes, slashes, colons
    and curly quotes: each became one <unk> (found by a helper). A vocabulary with ``n't`` keeps that split."""
    tok = WordTokenizer(MOSES)
    names = [tok.symbols[i] for i in tok.encode("I don't know, they can't from 2000\u20132005 at 90 km/h at 3:04 "
                                                  "\u201cyes\u201d 1,000")]
    assert names == ["I", "don", "'t", "know", ",", "they", "can", "'t", "from", "2000", "\u2013", "2005", "at", "90",
                     "km", "/", "h", "at", "3", ":", "04", "\u201c", "yes", "\u201d", "1", "@,@", "000"]
    ids = [tok.index[w] for w in ("I", "didn", "'t", "know")]
    assert tok.decode(ids) == "I didn't know" and tok.encode(tok.decode(ids)) == ids
    assert [SYMBOLS[i] for i in WordTokenizer(SYMBOLS).encode("don't")] == ["do", "n't"]  # Penn Treebank's


def test_a_long_chunk_looks_up_no_piece_longer_than_a_word():
    """Punctuation stripped one character at a time looked the rest up each time: a 300,000-character chunk took
    14 s of a server thread (found by a helper). Only pieces as short as the vocabulary's longest are looked up."""
    looked: list[int] = []

    class Counting(dict):
        def __contains__(self, key: object) -> bool:
            looked.append(len(key))  # type: ignore[arg-type]
            return super().__contains__(key)

        def get(self, key: object, default: object = None) -> object:
            looked.append(len(key))  # type: ignore[arg-type]
            return super().get(key, default)

    tok = WordTokenizer(MOSES)
    tok.index = Counting(tok.index)
    assert len(tok.encode("a" + "." * 20_000)) == 20_001 and len(tok.encode("(" * 20_000 + "a")) == 20_001
    assert max(looked) <= tok.longest and len(looked) < 3 * 40_002, (max(looked), len(looked))


def test_a_symbol_holding_white_space_is_refused():
    with pytest.raises(CheckpointError, match="white space"):
        WordTokenizer(["<eos>", "<unk>", "a b"])

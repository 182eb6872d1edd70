"""Word-level corpora in the WikiText layout, read as the original code reads them.

A folder holds ``wiki.train.tokens``, ``wiki.valid.tokens`` and ``wiki.test.tokens``
(each optionally ``.gz``; ``train.txt``/``valid.txt``/``test.txt`` also work); a single
file stands for whichever split is asked of it. Every line is its whitespace-separated
words plus ``<eos>``, exactly (no further splitting), a word outside the vocabulary is
``<unk>``. Splits are int32 arrays of token ids, which the ordered iterator reads like
the byte corpora.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from model.data import SPLITS, Corpus, corpus_path, gzipped
from model.tokenizer import WordTokenizer
from txlserve.errors import DataError

_NAMES = ("wiki.{}.tokens", "wiki.{}.tokens.gz", "{}.txt", "{}.txt.gz", "{}.tokens", "{}.tokens.gz")


def split_path(path: str | Path, split: str) -> Path | None:
    """The file holding ``split`` (a file stands for every split); None when the folder has none."""
    src = corpus_path(path)
    if src.is_file():
        return src
    return next((src / n.format(split) for n in _NAMES if (src / n.format(split)).is_file()), None)


def read_lines(path: Path) -> Iterator[str]:
    try:
        opener = gzip.open if gzipped(path) else open  # by its bytes: a gzipped file need not be named .gz
        with opener(path, "rt", encoding="utf-8", newline="\n") as fh:
            yield from fh
    except (OSError, UnicodeDecodeError, EOFError) as err:
        raise DataError(f"cannot read {path} as UTF-8 text: {err}") from None


def encode_lines(lines: Iterator[str], tokenizer: WordTokenizer) -> np.ndarray:
    """Token ids of every line's words plus ``<eos>``: [n_tokens] int32."""
    index, unk, eos = tokenizer.index, tokenizer.unk_id, tokenizer.eos_id
    out: list[int] = []
    for line in lines:
        for word in line.split():
            i = index.get(word, unk)
            if i is None:
                raise DataError(f"the word {word[:40]!r} is not in the vocabulary, which has no <unk>")
            out.append(i)
        out.append(eos)
    return np.asarray(out, dtype=np.int32)


def load_word_corpus(path: str | Path, tokenizer: WordTokenizer | None = None, *,
                     splits: tuple[str, ...] = SPLITS, max_vocab: int | None = None,
                     min_freq: int = 1) -> tuple[Corpus, WordTokenizer]:
    """The asked ``splits`` as token ids (others empty); without a ``tokenizer``, one is built from the
    training split (frequency order, as the original code builds its vocabulary)."""
    paths = {name: split_path(path, name) for name in SPLITS}
    for name in splits:
        if paths[name] is None:
            raise DataError(f"{path} has no {name} split (expected wiki.{name}.tokens or {name}.txt, either "
                            "optionally .gz)")
    if tokenizer is None:
        if paths["train"] is None:
            raise DataError(f"{path} has no train split to build a vocabulary from")
        tokenizer = WordTokenizer.build(read_lines(paths["train"]), min_freq=min_freq, max_size=max_vocab)
    arrays = {name: encode_lines(read_lines(paths[name]), tokenizer) if name in splits
              else np.zeros(0, dtype=np.int32) for name in SPLITS}
    return Corpus("words", **arrays), tokenizer

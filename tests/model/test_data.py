"""Tests for model.data: paper splits, caching, text corpora and the ordered iterator."""

from __future__ import annotations

import gzip
import hashlib
import itertools
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from model import data as data_mod
from model.data import PAPER_HELDOUT, Corpus, OrderedIterator, load_corpus
from txlserve.errors import DataError

TOTAL = 2 * PAPER_HELDOUT + 2_000_000  # 12 MB: 2 MB train, 5 MB valid, 5 MB test
ENWIK8_HEAD = b'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.3/"'


def _write_variants(folder: Path, name: str, payload: np.ndarray) -> dict[str, Path]:
    """Write ``payload`` as raw, .zip (one member ``name``) and .gz; fast settings, streamed."""
    folder.mkdir(parents=True, exist_ok=True)
    raw = folder / name
    payload.tofile(raw)
    with zipfile.ZipFile(folder / f"{name}.zip", "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        zf.write(raw, arcname=name)
    with open(raw, "rb") as f, gzip.open(folder / f"{name}.gz", "wb", compresslevel=1) as g:
        shutil.copyfileobj(f, g, 1 << 20)
    return {"raw": raw, "zip": folder / f"{name}.zip", "gz": folder / f"{name}.gz"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    rng = np.random.default_rng(0)
    enwik8 = rng.integers(0, 256, TOTAL, dtype=np.uint8)  # [TOTAL]
    enwik8[: len(ENWIK8_HEAD)] = np.frombuffer(ENWIK8_HEAD, dtype=np.uint8)
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", dtype=np.uint8)
    text8 = alphabet[rng.integers(0, len(alphabet), TOTAL)]  # [TOTAL]
    root = tmp_path_factory.mktemp("paper")
    return {
        "enwik8": _write_variants(root / "enwik8", "enwik8", enwik8),
        "text8": _write_variants(root / "text8", "text8", text8),
    }


def _assert_paper_split(corpus: Corpus, raw: Path) -> None:
    src = np.memmap(raw, dtype=np.uint8, mode="r")  # [TOTAL]
    assert corpus.sizes == {"train": TOTAL - 2 * PAPER_HELDOUT, "valid": PAPER_HELDOUT, "test": PAPER_HELDOUT}
    for part in (corpus.train, corpus.valid, corpus.test):
        assert isinstance(part, np.memmap) and part.dtype == np.uint8 and part.ndim == 1
    assert np.array_equal(corpus.train, src[: TOTAL - 2 * PAPER_HELDOUT])
    assert np.array_equal(corpus.valid, src[TOTAL - 2 * PAPER_HELDOUT : TOTAL - PAPER_HELDOUT])
    assert np.array_equal(corpus.test, src[TOTAL - PAPER_HELDOUT :])


@pytest.mark.parametrize("kind", ["enwik8", "text8"])
@pytest.mark.parametrize("fmt", ["raw", "zip", "gz"])
def test_paper_splits(sources, tmp_path: Path, kind: str, fmt: str) -> None:
    corpus = load_corpus(sources[kind][fmt], cache_dir=tmp_path / "cache")
    assert corpus.kind == kind
    _assert_paper_split(corpus, sources[kind]["raw"])
    assert corpus.split("valid") is corpus.valid
    cached = list((tmp_path / "cache").glob("*")) if (tmp_path / "cache").exists() else []
    assert len(cached) == (0 if fmt == "raw" else 1)  # raw files are mapped in place
    if kind == "enwik8":
        assert bytes(corpus.train[: len(ENWIK8_HEAD)]) == ENWIK8_HEAD


def test_cache_reused_and_refreshed_on_change(sources, tmp_path: Path, monkeypatch) -> None:
    calls = []
    real = data_mod._decompress
    monkeypatch.setattr(data_mod, "_decompress", lambda *a: (calls.append(a[0]), real(*a))[1])
    src, cache = tmp_path / "enwik8.gz", tmp_path / "cache"
    shutil.copy(sources["enwik8"]["gz"], src)
    load_corpus(src, cache_dir=cache)
    (first,) = cache.glob("*.bin")
    stamp = first.stat().st_mtime_ns
    _assert_paper_split(load_corpus(src, cache_dir=cache), sources["enwik8"]["raw"])
    assert len(calls) == 1 and first.stat().st_mtime_ns == stamp

    shutil.copy(sources["text8"]["gz"], src)  # same name, new content and mtime
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    corpus = load_corpus(src, kind="enwik8", cache_dir=cache)
    assert len(calls) == 2 and len(list(cache.glob("*.bin"))) == 2
    _assert_paper_split(corpus, sources["text8"]["raw"])


def test_env_var_sets_default_cache(sources, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TXLSERVE_DATA_CACHE", str(tmp_path / "envcache"))
    load_corpus(sources["text8"]["zip"])
    assert len(list((tmp_path / "envcache").glob("*.bin"))) == 1


def test_broken_archive_leaves_no_cache(sources, tmp_path: Path) -> None:
    src, cache = tmp_path / "enwik8.gz", tmp_path / "cache"
    with open(sources["enwik8"]["gz"], "rb") as f:
        src.write_bytes(f.read(1_000_000))  # truncated download
    with pytest.raises(DataError, match="cannot decompress"):
        load_corpus(src, cache_dir=cache)
    assert list(cache.iterdir()) == []  # neither a partial .bin nor a leftover temp file


def test_paper_errors(tmp_path: Path) -> None:
    short = tmp_path / "enwik8"
    with open(short, "wb") as f:
        f.truncate(2 * PAPER_HELDOUT)  # sparse: one byte too short
    with pytest.raises(DataError, match="truncated"):
        load_corpus(short)
    wrong = tmp_path / "text8.zip"
    with zipfile.ZipFile(wrong, "w") as zf:
        zf.writestr("other", b"x")
    with pytest.raises(DataError, match="one member named 'text8'"):
        load_corpus(wrong, cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match="not found"):
        load_corpus(tmp_path / "missing.txt")
    with pytest.raises(DataError, match="unknown corpus kind"):
        load_corpus(short, kind="wikitext")


def test_text_file_split(tmp_path: Path) -> None:
    payload = ("héllo wörld, " * 200).encode()[:2000]
    src = tmp_path / "book.txt"
    src.write_bytes(payload)
    corpus = load_corpus(src)
    assert corpus.kind == "text"
    assert corpus.sizes == {"train": 1800, "valid": 100, "test": 100}
    assert bytes(corpus.train) + bytes(corpus.valid) + bytes(corpus.test) == payload
    assert bytes(corpus.valid) == payload[1800:1900]
    with pytest.raises(DataError, match="unknown split"):
        corpus.split("dev")
    for name in ("book.txt.gz", "book-gzipped.txt"):  # gzip data, whatever the name: decompressed once, then the same
        with gzip.open(tmp_path / name, "wb") as g:
            g.write(payload)
        packed = load_corpus(tmp_path / name, cache_dir=tmp_path / "cache")
        assert bytes(packed.train) + bytes(packed.valid) + bytes(packed.test) == payload
        assert packed.sizes == corpus.sizes
    with gzip.open(tmp_path / "latin1.gz", "wb") as g:
        g.write("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.gz is not valid UTF-8; re-encode"):  # the file named, not the copy
        load_corpus(tmp_path / "latin1.gz", cache_dir=tmp_path / "cache")


def _members(data: bytes) -> bytes:
    """``data`` as bgzip writes it: several gzip members, the last one empty (its trailer counts 0 bytes)."""
    return gzip.compress(data[:len(data) // 2]) + gzip.compress(data[len(data) // 2:]) + gzip.compress(b"")


def _make_folder(folder: Path, n: int, gzipped: bool | str = False) -> dict[str, bytes]:
    folder.mkdir()
    rng = np.random.default_rng(1)
    works = {}
    for i in range(n):
        name = f"work{i:02d}.txt"
        k = int(rng.integers(50, 500))  # odd works random letters, even ones one letter: compressed, sizes differ
        body = bytes(rng.integers(97, 123, k, dtype=np.uint8)) if i % 2 else b"x" * k
        works[name] = f"<{name}>".encode() + body + f"</{name}>".encode()
        data = works[name]
        (folder / name).write_bytes(_members(data) if gzipped == "members" else gzip.compress(data) if gzipped
                                    else data)
    (folder / "notes.md").write_text("ignored")
    (folder / "sub").mkdir()
    (folder / "sub" / "nested.txt").write_text("not recursive")
    return works


@pytest.mark.parametrize("gzipped", [False, True, "members"])  # gzipped: split by the text's bytes, not the files'
def test_text_folder_whole_files_per_split(tmp_path: Path, gzipped: bool | str) -> None:
    works = _make_folder(tmp_path / "books", 20, gzipped)
    corpus = load_corpus(tmp_path / "books", cache_dir=tmp_path / "c1")
    again = load_corpus(tmp_path / "books", cache_dir=tmp_path / "c2")  # fresh cache: recomputed
    total = sum(len(w) for w in works.values())
    owner = {}
    for split in ("train", "valid", "test"):
        blob = bytes(corpus.split(split))
        assert blob == bytes(again.split(split))
        mine = sorted(name for name, w in works.items() if w in blob)
        assert blob == b"\n".join(works[name] for name in mine)  # whole files, sorted, "\n"-separated
        owner.update({name: split for name in mine})
    assert sorted(owner) == sorted(works)  # every work in exactly one split (names are unique)
    assert sum(corpus.sizes.values()) == total + len(works) - 3

    # the documented rule: sha1(name) order fills test to >= 5%, then valid, then train
    order = sorted(works, key=lambda n: hashlib.sha1(n.encode()).hexdigest())
    expected, i = {}, 0
    for split in ("test", "valid"):
        got = 0
        while got * 20 < total:
            expected[order[i]], got, i = split, got + len(works[order[i]]), i + 1
    expected.update({name: "train" for name in order[i:]})
    assert owner == expected


def test_text_folder_cache_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _make_folder(tmp_path / "books", 5, gzipped=True)
    load_corpus(tmp_path / "books", cache_dir=tmp_path / "c")
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "c").glob("*.bin")}
    assert len(stamps) == 3

    def inflated(path: Path) -> int:
        raise AssertionError(f"{path} inflated again to be counted")

    monkeypatch.setattr(data_mod, "_text_bytes", inflated)  # the splits are cached: nothing is read to size them
    load_corpus(tmp_path / "books", cache_dir=tmp_path / "c")
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "c").glob("*.bin")} == stamps


def test_text_folder_few_files_falls_back_to_byte_split(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "b.txt").write_bytes(b"B" * 1000)
    (tmp_path / "b" / "a.txt").write_bytes(b"A" * 999)
    corpus = load_corpus(tmp_path / "b", cache_dir=tmp_path / "c")
    joined = b"A" * 999 + b"\n" + b"B" * 1000
    assert corpus.sizes == {"train": 1800, "valid": 100, "test": 100}
    assert bytes(corpus.train) + bytes(corpus.valid) + bytes(corpus.test) == joined


def test_text_errors(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="empty corpus"):
        load_corpus(tmp_path / "empty.txt")
    (tmp_path / "none").mkdir()
    with pytest.raises(DataError, match=r"no \.txt \(or \.txt\.gz\) files"):
        load_corpus(tmp_path / "none")
    os.mkfifo(tmp_path / "pipe")  # as `--data <(zcat ...)` gives: it was read as a folder of no .txt files
    for odd in (tmp_path / "pipe", Path(os.devnull)):
        with pytest.raises(DataError, match=f"not a file or a folder: {odd} .*write a pipe's text to a file"):
            load_corpus(odd)
    (tmp_path / "empty-gz").mkdir()
    for name in ("a.txt.gz", "b.txt.gz", "c.txt"):  # gzip files of no text: not counted by their own bytes
        (tmp_path / "empty-gz" / name).write_bytes(gzip.compress(b""))
    with pytest.raises(DataError, match="empty corpus: the .* files in .*empty-gz hold no text"):
        load_corpus(tmp_path / "empty-gz", cache_dir=tmp_path / "c0")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match="latin1.txt is not valid UTF-8"):
        load_corpus(tmp_path / "latin1.txt")
    folder = tmp_path / "mixed"
    folder.mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (folder / name).write_text("fine text " * 10)
    (folder / "d.txt").write_bytes(b"ok \xff\xfe")
    with pytest.raises(DataError, match="d.txt is not valid UTF-8; re-encode"):
        load_corpus(folder, cache_dir=tmp_path / "c")
    (folder / "d.txt").write_bytes(gzip.compress("caf\xe9".encode("latin-1")))  # gzipped, and not UTF-8 inside
    with pytest.raises(DataError, match="d.txt is not valid UTF-8; re-encode"):
        load_corpus(folder, cache_dir=tmp_path / "c")
    (folder / "d.txt").write_bytes(gzip.compress(b"gzipped <d> text"))  # a folder's files are read by their bytes
    (folder / "e.txt.gz").write_bytes(gzip.compress(b"and <e> as .txt.gz"))  # it skipped these without a word
    corpus = load_corpus(folder, cache_dir=tmp_path / "c")
    text = b"".join(bytes(corpus.split(n)) for n in ("train", "valid", "test"))
    assert b"gzipped <d> text" in text and b"and <e> as .txt.gz" in text and b"\x1f\x8b" not in text
    (folder / "e.txt.gz").write_bytes(gzip.compress(b"cut off")[:-6])
    with pytest.raises(DataError, match="cannot read .*e.txt.gz"):
        load_corpus(folder, cache_dir=tmp_path / "c2")
    assert not any(p.suffix == ".tmp" for p in (tmp_path / "c").iterdir())


# -- OrderedIterator ------------------------------------------------------------------------------


def _positions(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int32)  # token value == position, so every slice is checkable


def test_iterator_streams_continue_and_last_segment_is_short() -> None:
    B, L = 4, 7
    data = _positions(B * 53 + 3)  # stream_len 53, 3-token remainder dropped
    it = OrderedIterator(data, B, L)
    batches = list(it)
    assert len(it) == it.n_batches == len(batches) == 8  # ceil(52 / 7)
    assert [inp.shape[1] for inp, _ in batches] == [7] * 7 + [3]
    streams = torch.from_numpy(data[: B * 53].astype(np.int64)).view(B, 53)  # [B, stream_len]
    inp_all = torch.cat([inp for inp, _ in batches], dim=1)  # [B, 52]
    tgt_all = torch.cat([tgt for _, tgt in batches], dim=1)  # [B, 52]
    assert torch.equal(inp_all, streams[:, :-1]) and torch.equal(tgt_all, streams[:, 1:])
    for (inp, tgt), (nxt, _) in zip(batches, batches[1:], strict=False):
        assert inp.dtype == torch.int64 and inp.shape == tgt.shape and inp.shape[0] == B
        assert torch.equal(tgt[:, :-1], inp[:, 1:])  # tgt is inp shifted by one
        assert torch.equal(nxt[:, 0], tgt[:, -1])  # row b of batch k+1 continues row b of batch k


def test_iterator_on_uint8_memmap(tmp_path: Path) -> None:
    path = tmp_path / "bytes"
    (np.arange(1000) % 256).astype(np.uint8).tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    inp, tgt = next(iter(OrderedIterator(mm, 2, 10)))
    assert inp.dtype == torch.int64 and inp.shape == (2, 10)
    assert inp[1, 0].item() == 500 % 256 and tgt[0, -1].item() == 10


def test_iterator_resume_matches_uninterrupted() -> None:
    data = _positions(3 * 100)
    full = list(OrderedIterator(data, 3, 8))
    it = OrderedIterator(data, 3, 8)
    head = list(itertools.islice(it, 5))
    state = it.state_dict()
    assert state["segment"] == 5
    resumed = OrderedIterator(data, 3, 8)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(head) + len(rest) == len(full)
    for (a, b), (c, d) in zip(head + rest, full, strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)
    from_five = list(OrderedIterator(data, 3, 8).iter_from(5))
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(from_five, rest, strict=True))
    with pytest.raises(DataError, match="batch_size=3"):
        OrderedIterator(data, 2, 8).load_state_dict(state)


def test_iterator_forever_wraps_and_resumes() -> None:
    data = _positions(2 * 30)
    it = OrderedIterator(data, 2, 10)  # stream_len 30 -> segments of 10, 10, 9
    gen = it.forever()
    seen = [next(gen) for _ in range(5)]
    assert [s[0].shape[1] for s in seen] == [10, 10, 9, 10, 10]
    assert torch.equal(seen[3][0], seen[0][0])
    assert it.state_dict()["segment"] == 2 and it.epoch == 1
    resumed = OrderedIterator(data, 2, 10)
    resumed.load_state_dict(it.state_dict())
    assert torch.equal(next(resumed.forever())[0], next(gen)[0])
    assert resumed.epoch == 2


def test_iterator_shards_are_disjoint_and_cover_world() -> None:
    B, W, L = 2, 3, 5
    data = _positions(B * W * 41 + 5)
    whole = list(OrderedIterator(data, B * W, L))
    shards = [list(OrderedIterator(data, B, L, rank=r, world_size=W)) for r in range(W)]
    assert all(len(s) == len(whole) for s in shards)
    for k, (inp, tgt) in enumerate(whole):
        assert torch.equal(torch.cat([s[k][0] for s in shards]), inp)
        assert torch.equal(torch.cat([s[k][1] for s in shards]), tgt)
    firsts = [set(s[0][0][:, 0].tolist()) for s in shards]
    assert all(a.isdisjoint(b) for i, a in enumerate(firsts) for b in firsts[i + 1 :])


def test_iterator_errors() -> None:
    with pytest.raises(DataError, match="cannot fill"):
        OrderedIterator(_positions(7), 4, 5)
    with pytest.raises(DataError, match="rank=2"):
        OrderedIterator(_positions(100), 2, 5, rank=2, world_size=2)
    with pytest.raises(DataError, match="outside"):
        OrderedIterator(_positions(100), 2, 5).iter_from(99)


def test_a_folder_of_other_text_files_names_them(tmp_path):
    """A WikiText folder given to a byte model's eval said only "no .txt (or .txt.gz) files" (found by a helper):
    any one of its files is a corpus."""
    for name in ("wiki.valid.tokens.gz", "wiki.test.tokens.gz", ".hidden"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(DataError, match=r"no \.txt \(or \.txt\.gz\) files in .*; it holds wiki\.test\.tokens\.gz, "
                                        r"wiki\.valid\.tokens\.gz: give one file as the data"):
        load_corpus(tmp_path, cache_dir=tmp_path / "cache")

"""Byte-level corpora (enwik8, text8, plain text) and the paper's ordered segment iterator.

Every split is a read-only ``np.memmap`` of uint8 bytes: a 100 MB corpus costs page
cache, not process memory, and several workers share it. Compressed sources are
decompressed once, streaming, into a cache file keyed on the source's name, size and
mtime, written under a temporary name and renamed so that an interrupted extraction
never leaves a truncated cache behind.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import hashlib
import math
import os
import shutil
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from txlserve.errors import DataError

SPLITS = ("train", "valid", "test")
PAPER_HELDOUT = 5_000_000  # bytes in each of valid and test for enwik8 / text8 (Dai et al., 2019)
_PAPER_KINDS = ("enwik8", "text8")
_CHUNK = 1 << 20  # streaming copy / validation block size
_CACHE_VERSION = "v1"  # bump when the layout of cached text splits changes

_GEOMETRY = ("batch_size", "tgt_len", "world_size", "stream_len")  # what a saved position depends on
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, eq=False)
class Corpus:
    """The three splits of a byte corpus, each a 1-D uint8 array (memory-mapped)."""

    kind: str
    train: np.ndarray
    valid: np.ndarray
    test: np.ndarray

    def split(self, name: str) -> np.ndarray:
        """Return one split by name; a typo must fail loudly, not train on the wrong data."""
        if name not in SPLITS:
            raise DataError(f"unknown split {name!r}; expected one of train, valid, test")
        return getattr(self, name)

    @property
    def sizes(self) -> dict[str, int]:
        return {name: int(self.split(name).size) for name in SPLITS}


def corpus_path(path: str | Path) -> Path:
    """A corpus is a file or a folder: a device or a pipe (``--data /dev/null``, ``<(zcat ...)``) was read as a
    folder holding no .txt files, and a file is memory-mapped, which neither can be."""
    src = Path(path).expanduser()
    if not src.exists():
        raise DataError(f"corpus not found: {src}")
    if not (src.is_file() or src.is_dir()):
        raise DataError(f"not a file or a folder: {src} (a corpus is read from a file, or a folder of them: "
                        "write a pipe's text to a file first)")
    return src


def load_corpus(path: str | Path, kind: str = "auto", cache_dir: str | Path | None = None) -> Corpus:
    """Open a corpus as memory-mapped train/valid/test byte arrays.

    ``kind`` "auto" picks enwik8 / text8 when the file name (minus .zip/.gz) says so,
    otherwise "text". ``cache_dir`` (default $TXLSERVE_DATA_CACHE or
    ~/.cache/txlserve/data) holds extracted and concatenated files.
    """
    src = corpus_path(path)
    if kind == "auto":
        kind = _detect_kind(src)
    if kind in _PAPER_KINDS:
        return _load_paper(src, kind, cache_dir)
    if kind == "text":
        return _load_text(src, cache_dir)
    raise DataError(f"unknown corpus kind {kind!r}; expected auto, enwik8, text8 or text")


def _detect_kind(src: Path) -> str:
    name = src.name.removesuffix(".zip").removesuffix(".gz")
    return name if src.is_file() and name in _PAPER_KINDS else "text"


def _cache_root(cache_dir: str | Path | None) -> Path:
    default = Path.home() / ".cache" / "txlserve" / "data"
    root = Path(cache_dir or os.environ.get("TXLSERVE_DATA_CACHE") or default).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create data cache folder {root}: {e.strerror}") from e
    return root


def _map(path: Path) -> np.ndarray:
    """Memory-map a byte file read-only (mmap refuses empty files, hence the special case)."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")  # [n_bytes]


def _write_atomic(dest: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write via a temp file in the same folder and rename: readers see all or nothing."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _load_paper(src: Path, kind: str, cache_dir: str | Path | None) -> Corpus:
    """The paper's split: the last 5M bytes are test, the 5M before them valid, the rest train."""
    if not src.is_file():
        raise DataError(f"{kind} corpus must be a file (raw, .zip or .gz), got {src}")
    with open(src, "rb") as f:
        magic = f.read(4)
    fmt = "zip" if magic.startswith(b"PK\x03\x04") else "gz" if magic.startswith(b"\x1f\x8b") else "raw"
    data_path = src if fmt == "raw" else _extract(src, fmt, kind, _cache_root(cache_dir))
    data = _map(data_path)  # [n_bytes]
    n = int(data.size)
    if n <= 2 * PAPER_HELDOUT:
        raise DataError(f"{src} holds {n} bytes, the {kind} split needs > {2 * PAPER_HELDOUT}: truncated?")
    a, b = n - 2 * PAPER_HELDOUT, n - PAPER_HELDOUT
    return Corpus(kind, data[:a], data[a:b], data[b:])


def _extract(src: Path, fmt: str, kind: str, root: Path) -> Path:
    """Return the cached decompressed file, extracting it first if this source is new."""
    st = src.stat()
    dest = root / f"{src.name}-{st.st_size}-{st.st_mtime_ns}.bin"
    if dest.is_file():
        return dest
    try:
        _write_atomic(dest, lambda out: _decompress(src, fmt, kind, out))
    except (OSError, EOFError, zlib.error, zipfile.BadZipFile) as e:
        raise DataError(f"cannot decompress {src}: {e}; the file is damaged (download or compress it again)") from e
    return dest


def _decompress(src: Path, fmt: str, kind: str, out: BinaryIO) -> None:
    """Stream-decompress ``src`` into ``out`` in fixed-size blocks (never the whole file in RAM)."""
    if fmt == "gz":
        with gzip.open(src, "rb") as f:
            shutil.copyfileobj(f, out, _CHUNK)
        return
    with zipfile.ZipFile(src) as zf:
        members = [i for i in zf.infolist() if Path(i.filename).name == kind]
        if len(members) != 1:
            names = ", ".join(zf.namelist()[:5])
            raise DataError(f"{src} should hold one member named {kind!r}; it holds: {names or 'nothing'}")
        with zf.open(members[0]) as f:
            shutil.copyfileobj(f, out, _CHUNK)


def gzipped(path: Path) -> bool:
    """Whether a file is gzip data, whatever its name says (a corpus is read by what it holds)."""
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"\x1f\x8b"
    except OSError:
        return False


def _text_bytes(path: Path) -> int:
    """The bytes of text a file holds, so that a folder is split by its text whether its files are gzipped or
    not. A gzip file is inflated to count them: its trailer's count is the last member's alone, modulo 2**32, and
    `cat a.gz b.gz` or bgzip writes several members (bgzip's last one empty). A damaged one counts what reads;
    :func:`_copy_utf8` says what is wrong with it."""
    if not gzipped(path):
        return path.stat().st_size
    n, buf = 0, bytearray(_CHUNK)
    with contextlib.suppress(OSError, EOFError, zlib.error), gzip.open(path, "rb") as f:
        while got := f.readinto(buf):
            n += got
    return n


def _load_text(src: Path, cache_dir: str | Path | None) -> Corpus:
    """A file is split 90/5/5 by bytes (a gzipped one once decompressed into the cache, as enwik8's zip is); a
    folder's .txt files go whole to one split each."""
    if src.is_file():
        text = _extract(src, "gz", "text", _cache_root(cache_dir)) if gzipped(src) else src
        _copy_utf8(text, None, src, unwrap=False)  # the bytes mapped below
        return _byte_split(_map(text), src)
    files = sorted((p for p in (*src.glob("*.txt"), *src.glob("*.txt.gz")) if p.is_file()), key=lambda p: p.name)
    if not files:  # a folder of other text (WikiText's .tokens.gz): any one file is a corpus
        others = sorted(p.name for p in src.iterdir() if p.is_file() and not p.name.startswith("."))
        held = f"; it holds {', '.join(others[:3])}{' ...' if len(others) > 3 else ''}: give one file as the data " \
            "(any text file, gzipped or not)" if others else ""
        raise DataError(f"no .txt (or .txt.gz) files in {src}{held}")
    root, key = _cache_root(cache_dir), _folder_key(src, files)
    names = ("all",) if len(files) < 3 else SPLITS  # too few files to keep works apart: the byte split
    dests = {name: root / f"{key}.{name}.bin" for name in names}
    if not all(dest.is_file() for dest in dests.values()):  # else split before: no file is inflated again
        sizes = {p: _text_bytes(p) for p in files}
        total = sum(sizes.values())
        if total == 0:
            raise DataError(f"empty corpus: the .txt (or .txt.gz) files in {src} hold no text")
        groups = {"all": files} if len(files) < 3 else _assign(files, sizes, total)
        for name, dest in dests.items():
            if not dest.is_file():
                _write_atomic(dest, lambda out, fs=groups[name]: _concat(fs, out))
    if len(files) < 3:
        return _byte_split(_map(dests["all"]), src)
    return Corpus("text", **{name: _map(dest) for name, dest in dests.items()})  # [split_bytes] each


def _byte_split(data: np.ndarray, src: Path) -> Corpus:
    """Contiguous 90/5/5 by bytes: train first, so valid/test are the unseen tail."""
    if (n := int(data.size)) == 0:
        raise DataError(f"empty corpus: {src}")
    a, b = n * 90 // 100, n * 90 // 100 + n * 5 // 100
    return Corpus("text", data[:a], data[a:b], data[b:])


def _folder_key(src: Path, files: list[Path]) -> str:
    """Cache name from the folder's name, total size, newest mtime and a hash of its listing."""
    h = hashlib.sha1(_CACHE_VERSION.encode())
    total, newest = 0, 0
    for p in files:
        st = p.stat()
        total, newest = total + st.st_size, max(newest, st.st_mtime_ns)
        h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return f"{src.resolve().name}-{total}-{newest}-{h.hexdigest()[:12]}"


def _assign(files: list[Path], sizes: dict[Path, int], total: int) -> dict[str, list[Path]]:
    """Files in sha1(name) order fill test to >= 5% of bytes, then valid, then the rest is train.

    Hash order is deterministic yet unrelated to naming (test is not "the authors starting
    with A"); each split keeps at least one file so none is empty.
    """
    order = sorted(files, key=lambda p: hashlib.sha1(p.name.encode("utf-8", "surrogateescape")).hexdigest())
    groups: dict[str, list[Path]] = {"test": [], "valid": []}
    i = 0
    for name, still_to_fill in (("test", 2), ("valid", 1)):
        got = 0
        while got * 20 < total and len(order) - i > still_to_fill:
            groups[name].append(order[i])
            got, i = got + sizes[order[i]], i + 1
    groups["train"] = order[i:]
    return {name: sorted(fs, key=lambda p: p.name) for name, fs in groups.items()}


def _concat(files: list[Path], out: BinaryIO) -> None:
    for i, p in enumerate(files):
        if i:
            out.write(b"\n")
        _copy_utf8(p, out)


def _copy_utf8(src: Path, out: BinaryIO | None, name: Path | None = None, unwrap: bool = True) -> None:
    """Stream ``src`` (decompressed, where ``unwrap`` and it is gzip data: a folder's file may be) into ``out``
    (or nowhere), failing on the first invalid UTF-8 sequence (of the file ``name``, where ``src`` is its
    decompressed copy)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with (gzip.open if unwrap and gzipped(src) else open)(src, "rb") as f:
            while chunk := f.read(_CHUNK):
                decoder.decode(chunk)
                if out is not None:
                    out.write(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:
        raise DataError(f"{name or src} is not valid UTF-8; re-encode it or remove it from the corpus") from e
    except (OSError, EOFError, zlib.error) as e:  # a damaged gzip file
        raise DataError(f"cannot read {name or src}: {e}") from e


class OrderedIterator:
    """The paper's LMOrderedIterator, batch-first, sharded by rank, with exact resume.

    The data is cut into ``batch_size * world_size`` equal contiguous streams (the tail
    is dropped); rank r owns streams [r*B, (r+1)*B). Segment k covers stream positions
    [k*tgt_len, k*tgt_len + seq] so consecutive batches continue every row exactly and
    Transformer-XL memories carry over. Iteration continues from the current position
    (``state_dict``) to the end of the epoch; ``forever`` wraps around.
    """

    def __init__(
        self,
        data: np.ndarray,
        batch_size: int,
        tgt_len: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device = "cpu",
    ) -> None:
        if min(batch_size, tgt_len, world_size) < 1 or not 0 <= rank < world_size or data.ndim != 1:
            settings = f"batch_size={batch_size} tgt_len={tgt_len} rank={rank} world_size={world_size}"
            raise DataError(f"bad iterator settings {settings} for data of shape {tuple(data.shape)}")
        n_streams = batch_size * world_size
        self.batch_size, self.tgt_len, self.world_size, self.rank = batch_size, tgt_len, world_size, rank
        self.device = torch.device(device)
        self.stream_len = int(data.shape[0]) // n_streams
        if self.stream_len < 2:
            fix = "lower the batch size" if n_streams > 1 else "the text is too short for it"
            raise DataError(f"{data.shape[0]} tokens cannot fill {n_streams} stream(s) of at least 2 tokens; {fix}")
        grid = data[: n_streams * self.stream_len].reshape(n_streams, -1)  # [n_streams, stream_len]
        self._streams = grid[rank * batch_size : (rank + 1) * batch_size]  # [batch, stream_len] (a view)
        self.n_batches = math.ceil((self.stream_len - 1) / tgt_len)
        self._next = 0  # index of the next segment to yield
        self._epoch = 0

    def __len__(self) -> int:
        return self.n_batches

    @property
    def epoch(self) -> int:
        return self._epoch

    def segment(self, k: int) -> Batch:
        """Segment ``k`` as (inp, tgt) int64 tensors; only this slice is converted from uint8."""
        self._check_position(k)
        start = k * self.tgt_len
        seq = min(self.tgt_len, self.stream_len - 1 - start)
        window = np.array(self._streams[:, start : start + seq + 1], dtype=np.int64)  # [batch, seq+1]
        chunk = torch.from_numpy(window).to(self.device)  # [batch, seq+1]
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()  # [batch, seq], [batch, seq]

    def __iter__(self) -> Iterator[Batch]:
        return self._run_epoch()

    def iter_from(self, position: int) -> Iterator[Batch]:
        """Iterate from segment ``position`` to the end of the epoch."""
        self._check_position(position)
        self._next = position
        return self._run_epoch()

    def forever(self) -> Iterator[Batch]:
        """Yield batches endlessly from the current position, restarting at segment 0 each epoch."""
        while True:
            yield from self._run_epoch()

    def _run_epoch(self) -> Iterator[Batch]:
        while True:
            batch = self.segment(self._next)
            # Advance before yielding: state_dict() taken while a batch is in use points past it.
            self._next += 1
            wrapped = self._next == self.n_batches
            if wrapped:
                self._next, self._epoch = 0, self._epoch + 1
            yield batch
            if wrapped:
                return

    def state_dict(self) -> dict[str, int]:
        """Position of the next segment plus the geometry it is only valid for."""
        geometry = {key: getattr(self, key) for key in _GEOMETRY}
        return {"segment": self._next, "epoch": self._epoch, **geometry}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume exactly; refuses a state saved under another batch geometry (it would misalign)."""
        for key in _GEOMETRY:
            if key in state and int(state[key]) != getattr(self, key):
                mine = getattr(self, key)
                raise DataError(f"saved iterator state has {key}={state[key]}, this iterator {key}={mine}")
        self._check_position(int(state.get("segment", -1)))
        self._next, self._epoch = int(state["segment"]), int(state.get("epoch", 0))

    def _check_position(self, k: int) -> None:
        if not 0 <= k < self.n_batches:
            raise DataError(f"segment {k} is outside 0..{self.n_batches - 1}")

"""A CPU decode step's attention as one C call (``kernels/attend_one.c``), for the model's one attention.

On a CPU a one-token step of a small model spent most of its time not reading weights but running some
twenty small torch ops per layer (two products with the ring, the position product and its gather, the
mask, the softmax, the ring stores), each costing microseconds (BENCHMARKS.md, "The one-token attention
fused"). The kernel does a layer's attention in one pass over the ring (and one over the position table for
every 16 queries of a head, which the batch's rows share), then stores the token's key and value (rows and
heads split over torch's intra-op threads), as
:class:`model.transformer_xl.RelPartialLearnableMultiHeadAttn` computes it with torch ops (tests compare the
two to float rounding). Its few-row products with the weights go through a second kernel,
``kernels/linear_rows.c``: torch's read a weight at half the bandwidth for one row, and took four times as
long for five rows as for one.

They are the C++ torch ops ``txlserve::attend_one`` and ``txlserve::linear_rows`` (``kernels/ops.cpp``), so a
traced step calls them without taking the GIL. A third, ``txlserve::sample_rows`` (``kernels/sample_rows.c``),
draws the next token of every plain-temperature row in one call (:func:`model.sampling.sample_rows`). A fourth,
``txlserve::chunk_softmax`` (``kernels/chunk_softmax.c``), turns a prefill chunk's scores into its attention
probabilities in one pass a query, where torch made five over the whole score tensor. And where a batch's keys
and values come from DRAM, ``attend_one`` and ``attend_rows`` read the rings of layer inputs in their place
(``kernels/attend_absorbed.c``, keys and values absorbed into the query and the output: half the bytes).

Built on first use with the system compilers against the installed torch's headers (about 8 s) and kept in a
per-user cache keyed by the sources, torch, the compilers and this CPU; where there is no compiler, or the
build fails, :func:`available` is False and the step runs as torch ops.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["MAX_CHUNK", "MAX_D_HEAD", "attend_one", "attend_rows", "available", "chunk_softmax", "linear_rows",
           "matmul", "sample_rows"]

log = logging.getLogger(__name__)

MAX_D_HEAD = 1024  # kernels/attend_one.c
MAX_CHUNK = 8  # kernels/attend_one.c: new tokens per call (a decode step's one, a short prompt's few)
ABSORB_MAX_HEADS = 4  # kernels/ops.cpp: keys and values absorbed only for models of at most this many heads,
# and steps whose keys and values of a layer come to at least this many bytes (measured: kernels/ops.cpp, absorbs)
ABSORB_MIN_BYTES = 24 << 20
KERNELS = Path(__file__).with_name("kernels")
C_SOURCES = (KERNELS / "attend_one.c", KERNELS / "attend_absorbed.c", KERNELS / "linear_rows.c",
             KERNELS / "chunk_softmax.c", KERNELS / "sample_rows.c")
SOURCES = (*C_SOURCES, KERNELS / "ops.cpp")
HEADERS = (KERNELS / "vec.h",)
# -ffast-math lets the sums of the dot products vectorise; the kernels never form an infinity. The library
# is linked without it: GCC would add crtfastmath.o, which flushes denormals to zero in the whole process.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC"]
# -fopenmp: torch's at::parallel_for is an inline `omp parallel` in OpenMP builds, a serial loop without it. The
# library is not linked to an OpenMP runtime of its own: its GOMP calls resolve to the one torch loaded, so they
# share torch's threads and set_num_threads.
CXXFLAGS = ["-O2", "-std=c++20", "-fPIC", "-fopenmp",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]

_lock = threading.Lock()
_loaded: bool | None = None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "txlserve" / "kernels"


def _this_cpu() -> str:
    """-march=native code runs only where it was built: the CPU's flags go into the cache key."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    return os.uname().machine


def _command(var: str, default: str) -> list[str]:
    """``$CC``/``$CXX`` as make reads them: a command and its arguments (``CC="ccache gcc"``)."""
    try:
        return shlex.split(os.environ.get(var, "")) or [default]
    except ValueError:  # an unbalanced quote: one word, which then names no compiler
        return [os.environ[var]]


def _cached(cc: list[str], cxx: list[str]) -> Path | None:
    """Where the library built by these compilers from these sources for this torch and CPU is cached (whether
    or not it is there yet); None (logged) where a compiler is missing or cannot say its version."""
    missing = [" ".join(c) for c in (cc, cxx) if shutil.which(c[0]) is None]
    if missing:
        log.info("the fused decode attention is off: no C/C++ compiler (%s) on this machine", ", ".join(missing))
        return None
    torch_dir = Path(torch.__file__).parent
    try:
        versions = [subprocess.run([*c, "--version"], capture_output=True, timeout=30).stdout for c in (cc, cxx)]
        parts = [*(s.read_bytes() for s in SOURCES + HEADERS), *versions,
                 " ".join(cc + cxx + CFLAGS + CXXFLAGS).encode(), torch.__version__.encode(), str(torch_dir).encode(),
                 _this_cpu().encode()]
        key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:24]
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("the fused decode attention is off: %s", err)
        return None
    return _cache_dir() / f"txlserve_kernels-{key}.so"


def _run_together(commands: list[list[str]], timeout_s: float) -> None:
    """Run the commands at once; raise as ``subprocess.run(check=True)`` would for the first that fails (the
    last command is waited for last, so a quick one's failure stops the slow first one at once)."""
    deadline = time.monotonic() + timeout_s
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
             for cmd in commands]  # a group each: a compiler driver's own children (cc1plus) are stopped with it
    try:
        for cmd, proc in [*zip(commands, procs)][1:] + [(commands[0], procs[0])]:
            _, err = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            if proc.returncode:
                raise subprocess.CalledProcessError(proc.returncode, cmd, stderr=err)
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def _build() -> Path | None:
    """The op's shared library, from the cache or built now; None (logged once) where it cannot be built."""
    cc, cxx = _command("CC", "cc"), _command("CXX", "c++")
    target = _cached(cc, cxx)
    if target is None:
        return None
    if target.exists():
        return target
    cache, torch_dir = target.parent, Path(torch.__file__).parent
    started = time.monotonic()
    log.info("building the fused decode attention for this CPU (up to a minute, once: it is cached in %s)", cache)
    with tempfile.TemporaryDirectory(prefix="txlserve-kernel-") as tmp:
        objects = [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
        lib = Path(tmp) / "kernels.so"
        # the C++ file (torch's headers) takes most of the time: the C files compile beside it
        compiles = [[*cxx, *CXXFLAGS, "-I", str(torch_dir / "include"), "-c", str(SOURCES[-1]), "-o", str(objects[-1])]]
        compiles += [[*cc, *CFLAGS, "-c", str(src), "-o", str(obj)] for src, obj in zip(C_SOURCES, objects)]
        link = [*cxx, "-shared", *map(str, objects), "-o", str(lib), "-L", str(torch_dir / "lib"),
                "-lc10", "-ltorch_cpu", "-lm", f"-Wl,-rpath,{torch_dir / 'lib'}"]
        try:
            _run_together(compiles, timeout_s=600)
            subprocess.run(link, check=True, capture_output=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as err:
            lines = (getattr(err, "stderr", b"") or b"").decode(errors="replace").strip().splitlines()
            detail = [line for line in lines if "error" in line.lower()] or lines  # the first error, not a caret
            log.warning("the fused decode attention is off: building it failed (%s)%s", type(err).__name__,
                        f": {detail[0][:300]}" if detail else "")
            return None
        try:  # another process may be doing the same: each renames its own file into place
            cache.mkdir(parents=True, exist_ok=True, mode=0o700)
            staged = cache / f".{target.name}.{os.getpid()}"
            shutil.copyfile(lib, staged)
            os.replace(staged, target)
        except OSError as err:  # no cache: this process loads it from a directory of its own
            log.info("the fused decode attention is not cached (%s)", err)
            own = Path(tempfile.mkdtemp(prefix="txlserve-kernel-")) / target.name
            shutil.copyfile(lib, own)
            target = own
    log.info("built the fused decode attention in %.1f s: %s", time.monotonic() - started, target)
    return target


def available() -> bool:
    """Whether ``txlserve::attend_one`` is loaded (building or loading it on the first call)."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = False
            try:
                path = _build()
                if path is not None:
                    torch.ops.load_library(str(path))
                    _loaded = True
            except Exception as err:  # any failure leaves the torch ops, which are exact
                log.warning("the fused decode attention is off: loading it failed (%s: %s)", type(err).__name__, err)
        return _loaded


def attend_one(qkv: Tensor, u: Tensor, vb: Tensor, k: Tensor, v: Tensor, table: Tensor, seen: Tensor,
               scale: float, hid: Tensor | None = None, kv: Tensor | None = None,
               absorb_min_bytes: int = ABSORB_MIN_BYTES) -> Tensor:
    """Up to MAX_CHUNK new tokens per row: ``qkv [bsz, L, 3*H*Dh]`` (their queries, keys, values) attend, each
    to itself, the row's earlier new tokens and the rings ``k``, ``v`` ``[bsz, H, mem_len, Dh]`` within its
    window, with biases ``u``, ``vb`` ``[H, Dh]`` and the position table ``W_r R [H, mem_len+1, Dh]``; ``seen
    [bsz]`` tokens came before them. Stores their keys and values into slots ``(seen + i) % mem_len`` and returns
    the attention's output ``[bsz, L, H*Dh]`` (before ``o_net``).

    With the rings of layer inputs ``hid [bsz, mem_len, d_model]`` (row-major; the caller stores the new inputs
    afterwards) and the key and value weights ``kv [2*H*Dh, d_model]`` (``W_k``, ``W_v``, applied to ``hid``
    unnormalised), a step of one token a row whose key and value rings come to ``absorb_min_bytes`` or more, of a
    model of at most ``ABSORB_MAX_HEADS`` heads, reads ``hid`` instead (``kernels/attend_absorbed.c``: half the
    bytes, H times the multiply-adds; the op decides, so one traced step serves every batch size)."""
    return torch.ops.txlserve.attend_one(qkv, u, vb, k, v, table, seen, scale, hid, kv, absorb_min_bytes)


def attend_rows(qkv: Tensor, start: Tensor, u: Tensor, vb: Tensor, rows: Tensor, h: Tensor, table: Tensor,
                seen: Tensor, scale: float, ring: tuple[int, int, int], kv: Tensor | None = None,
                absorb_min_bytes: int = ABSORB_MIN_BYTES) -> Tensor:
    """:func:`attend_one` for sessions decoded where they lie (:class:`model.cache.RowTable`), each with its own
    number of new tokens (1 to MAX_CHUNK: a decode step's one beside a joining prompt's few, in one call): row
    ``b``'s are tokens ``start[b]`` to ``start[b+1]`` of ``qkv [N, L, 3*H*Dh]`` read as ``[N*L, 3*H*Dh]``
    (``start``: int64 ``[bsz+1]``), its layer input ring ``[mem_len, d_model]`` and key and value rings ``[H,
    mem_len, Dh]`` (element strides ``ring``) are at the addresses ``rows[:, b]`` (int64 ``[3, bsz]``). Also
    stores each row's last layer inputs of ``h [N, L, d_model]``; returns ``[N, L, H*Dh]``. The addresses are
    trusted: the table keeps every session alive and checked its layout as it joined. ``kv``: as
    :func:`attend_one`'s (a step of one token a row may read the rings of layer inputs instead)."""
    return torch.ops.txlserve.attend_rows(qkv, start, u, vb, rows, h, table, seen, scale, list(ring), kv,
                                          absorb_min_bytes)


def linear_rows(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)`` for float32 on a CPU, by ``kernels/linear_rows.c``: a decode step's few rows
    stream the weight once (torch's few-row products read it at half the bandwidth, or slower), and a prefill
    chunk's many rows go through register tiles (twice torch's multiply-adds a second on this machine's CPU). Any
    other product is torch's own, so a traced step may call this at every batch size."""
    return torch.ops.txlserve.linear_rows(x, weight, bias)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for ``a [..., R, K]`` and ``b [..., K, N]``: with the same leading sizes, float32 on a CPU, each
    product by ``kernels/linear_rows.c`` with ``b`` as a column-major weight (a chunked prefill's attention, twice
    torch's bmm on this machine's CPU) or torch's bmm; other leading sizes are torch.matmul's (it broadcasts them
    or refuses them, where flattening both would pair entries up silently)."""
    lead = a.shape[:-2]
    if b.shape[:-2] != lead:
        return torch.matmul(a, b)
    out = torch.ops.txlserve.bmm_rows(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))  # [B, R, N]
    return out.view(*lead, a.size(-2), b.size(-1))


def chunk_softmax(ring: Tensor, own: Tensor, pos: Tensor, seen: Tensor) -> None:
    """A prefill chunk's attention probabilities, in place, in one pass per query (``kernels/chunk_softmax.c``):
    given the content scores of its queries against the ring, ``ring [bsz, H, chunk, mem_len]``, and against the
    chunk's own keys, ``own [bsz, H, chunk, chunk]``, and the position scores ``pos [H, bsz, chunk, mem_len+1]``
    of sessions that had seen ``seen [bsz]`` tokens (int64 on the CPU, none negative), both become the softmax
    over each query's window (ring slot ``s`` holding the latest position ``p < seen`` with ``p = s mod
    mem_len``). Float32, contiguous, none overlapping another. What torch did in
    five passes over the scores (join, gather by distance, add, mask, softmax) a chunk's query does here while its
    row is in L1."""
    torch.ops.txlserve.chunk_softmax(ring, own, pos, seen)


def sample_rows(logits: Tensor, temperature: Tensor, u: Tensor, greedy_below: float) -> Tensor:
    """One token per row of ``logits [rows, vocab]`` (float32): drawn from ``softmax(logits / temperature)`` by
    inverse CDF with the row's ``u`` in [0, 1), or the first most likely where ``temperature < greedy_below``
    (``temperature``, ``u``: float64 [rows]); int64 [rows]. One pass over a row in ``kernels/sample_rows.c``."""
    return torch.ops.txlserve.sample_rows(logits, temperature, u, greedy_below)

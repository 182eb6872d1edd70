"""A GPU decode step's attention in two kernel launches (``kernels/decode_attention.py``, Triton), for the model's
one attention.

Replayed as a CUDA graph, a GPU step of 12 layers / 512 at mem_len 1600 took 1.07 ms at batch 1 (3.4% of the
H200's bandwidth roofline) and 2.73 ms at batch 64 (25%): the torch ops of one layer's attention are some twenty
small kernels (two products with the ring, the position product and its gather, the mask, the softmax in float32,
the ring stores), each with its own launch latency and its own pass over a [batch, heads, mem_len] score tensor
(BENCHMARKS.md, "Third lease"). These kernels read each ring once, keep the scores in registers, and store the
token's key and value; the layer's projections stay torch's. Where Triton is not installed (a CPU build of
torch), :func:`available` is False and steps run as torch ops, which the tests compare these to.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch import Tensor

__all__ = ["KernelFailed", "attend_step", "available", "usable"]

log = logging.getLogger(__name__)

# Chosen on an H100 by timing the kernels replayed as CUDA graphs over 108 settings, for 12 layers / 512 at
# mem_len 1600 and the bundled model (BENCHMARKS.md): within 10% of each shape's best setting at batch 1 to 64.
BLOCK_N = 64  # ring slots a program reads at a time
PROGRAMS_PER_SM = 8  # spans are cut until there are this many programs per multiprocessor
NUM_WARPS = 4

_failed: list[str] = []  # why the kernels stopped being used in this process, once they failed in a step


class KernelFailed(RuntimeError):
    """The kernels failed inside a step (a Triton that cannot compile a new variant, say): that call fails, and
    every later one runs the torch ops (:func:`usable`), as a traced step that fails leaves the eager path."""


@functools.cache
def _kernels():  # noqa: ANN202 - the Triton module, or None
    try:
        from model.kernels import decode_attention
    except Exception as err:  # no Triton (a CPU build of torch), or one that cannot compile these
        log.info("the GPU decode attention is off: %s: %s", type(err).__name__, err)
        return None
    return decode_attention


def usable() -> bool:
    """False once the kernels failed in a step of this process."""
    return not _failed


def available(device: torch.device, dtype: torch.dtype, n_head: int, d_head: int, mem_len: int) -> bool:
    """Whether :func:`attend_step` runs for a model on ``device`` in ``dtype``: a CUDA device with Triton, whose
    kernels for these heads compiled and ran, at batch 1 (several spans a row) and at a batch of one span a row,
    on rings whose strides fall in the same classes as ``mem_len``'s (Triton specialises on a stride's being a
    multiple of 16), so that the variant serving compiles is the one tried. Once per process and shape, at load:
    a Triton that cannot compile them leaves the torch ops instead of failing a step."""
    if device.type != "cuda" or dtype not in (torch.float32, torch.bfloat16, torch.float16) or d_head > 256:
        return False
    return _kernels() is not None and _runs(device, dtype, n_head, d_head, mem_len)


@functools.cache
def _runs(device: torch.device, dtype: torch.dtype, n_head: int, d_head: int, mem_len: int) -> bool:
    try:
        with torch.cuda.device(device):
            g = torch.Generator(device).manual_seed(0)
            m = 160 + mem_len % 16  # three blocks of slots, strides of mem_len's classes
            table = torch.randn(n_head, m + 1, d_head, generator=g, device=device).to(dtype)
            u = torch.zeros(n_head, d_head, device=device, dtype=dtype)
            for batch in (1, max(1, _cdiv(_programs(device), n_head))):
                k, v = (torch.randn(batch, n_head, m, d_head, generator=g, device=device).to(dtype)
                        for _ in range(2))
                qkv = torch.randn(batch, 1, 3 * n_head * d_head, generator=g, device=device).to(dtype)
                seen = torch.arange(batch, device=device) * 7 + m // 2
                out = _launch(qkv, u, u, k, v, table, seen, 0.125)
                if not bool(out.isfinite().all()):
                    raise RuntimeError("non-finite output")
    except Exception as err:
        log.warning("the GPU decode attention is off: its kernels failed on %s (%s: %s)", device,
                    type(err).__name__, err)
        return False
    return True


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _programs(device: torch.device) -> int:
    """Programs that keep every multiprocessor of ``device`` busy (8 off a GPU: Triton's interpreter)."""
    return PROGRAMS_PER_SM * _multiprocessors(device) if device.type == "cuda" else 8


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def attend_step(qkv: Tensor, u: Tensor, vb: Tensor, k: Tensor, v: Tensor, table: Tensor, seen: Tensor,
                scale: float) -> Tensor:
    """One new token per row: ``qkv [bsz, 1, 3*H*Dh]`` (its query, key and value) attends to itself and the rings
    ``k``, ``v`` ``[bsz, H, mem_len, Dh]`` within its window, with biases ``u``, ``vb`` ``[H, Dh]`` and the position
    table ``W_r R [H, mem_len+1, Dh]``; ``seen [bsz]`` (int64) tokens came before it. Stores its key and value into
    slot ``seen % mem_len`` and returns the attention's output ``[bsz, 1, H*Dh]`` (before ``o_net``), as
    :func:`model.fused.attend_one` does on a CPU. A failure here is a step's: it turns the kernels off for the
    process (:func:`usable`) and raises :class:`KernelFailed`."""
    try:
        return _launch(qkv, u, vb, k, v, table, seen, scale)
    except Exception as err:
        _failed.append(f"{type(err).__name__}: {err}")
        log.warning("the GPU decode attention is off from now on: it failed in a step (%s)", _failed[0])
        raise KernelFailed(_failed[0]) from err


def _launch(qkv: Tensor, u: Tensor, vb: Tensor, k: Tensor, v: Tensor, table: Tensor, seen: Tensor,
            scale: float) -> Tensor:
    """The two launches of :func:`attend_step`, on the tensors' device, whichever is current."""
    kern = _kernels()
    bsz, H, M, D = k.shape
    if qkv.shape != (bsz, 1, 3 * H * D) or qkv.stride(2) != 1:
        raise ValueError(f"qkv must be [batch, 1, 3*heads*d_head] with unit stride, not {tuple(qkv.shape)}")
    dev = qkv.device
    out = torch.empty(bsz, 1, H * D, device=dev, dtype=qkv.dtype)  # [bsz, 1, H*Dh]
    if bsz == 0:
        return out
    u, vb = u.contiguous(), vb.contiguous()
    # spans per (row, head): enough programs for the GPU, each reading at least one block of slots
    spans = max(1, min(_cdiv(M, BLOCK_N), _cdiv(_programs(dev), bsz * H)))
    span = _cdiv(_cdiv(M, spans), BLOCK_N) * BLOCK_N  # slots a span, a whole number of blocks
    spans = _cdiv(M, span)
    block_d = _pow2(D)
    m_s = torch.empty(bsz * H * spans, device=dev, dtype=torch.float32)  # [bsz*H*spans]: each span's maximum,
    l_s = torch.empty_like(m_s)  # its sum of exponentials,
    acc_s = torch.empty(bsz * H * spans * block_d, device=dev, dtype=torch.float32)  # its weighted values [.., Dh]
    rings = (k, v, *k.stride(), *v.stride(), table, *table.stride(), seen)
    # Triton launches on the current device: on cuda:N it must be N's
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        kern.spans[(bsz * H, spans)](qkv, qkv.stride(0), u, vb, *rings, m_s, l_s, acc_s, scale, M, H, spans, span,
                                     D=D, BLOCK_N=BLOCK_N, BLOCK_D=block_d, num_warps=NUM_WARPS)
        kern.join[(bsz * H,)](qkv, qkv.stride(0), u, vb, *rings, m_s, l_s, acc_s, out, out.stride(0), scale, M, H,
                              spans, D=D, BLOCK_D=block_d, BLOCK_S=_pow2(_cdiv(M, BLOCK_N)))
    return out

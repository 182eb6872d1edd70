"""A GPU decode step's attention in Triton's kernels (model.gpu_attention): the same scores and the same rings as
the model's torch ops, with rows at different points of their rings, as eager steps and replayed as CUDA graphs.
The kernels' arithmetic is also checked off a GPU by Triton's interpreter, where Triton is installed."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from model import gpu_attention
from model.cache import SlotTable
from model.decode import Decoder
from tests.model.test_traced_step import _model

ROOT = Path(__file__).resolve().parents[2]
no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_off_without_a_gpu_or_triton():
    """A CPU decoder never takes the GPU kernels (its steps are the C kernels' or torch's)."""
    assert not gpu_attention.available(torch.device("cpu"), torch.float32, 4, 64, 6)
    assert not Decoder(_model(), mem_len=6).gpu_fused


def test_kernels_that_fail_in_a_step_are_not_used_again(monkeypatch):
    """The call fails with KernelFailed (its rows are the engine loop's to fail) and usable() turns False, which
    every later decode step reads before taking the kernels."""
    class Broken:
        def __getattr__(self, name):
            raise RuntimeError("no compiler for this variant")

    monkeypatch.setattr(gpu_attention, "_failed", [])
    monkeypatch.setattr(gpu_attention, "_kernels", lambda: Broken())
    k = torch.zeros(2, 1, 8, 4)
    with pytest.raises(gpu_attention.KernelFailed, match="no compiler"):
        gpu_attention.attend_step(torch.zeros(2, 1, 12), torch.zeros(1, 4), torch.zeros(1, 4), k, k.clone(),
                                  torch.zeros(1, 9, 4), torch.tensor([0, 3]), 0.5)
    assert not gpu_attention.usable()


def test_a_failed_trial_at_load_only_declines_that_shape(monkeypatch, caplog):
    """A trial whose kernels fail says so and answers False, without turning the kernels off for the process as
    a failure inside a step does (run off a GPU: the trial's device switch is made a no-op)."""
    class Broken:
        def __getattr__(self, name):
            raise RuntimeError("no compiler for this variant")

    monkeypatch.setattr(gpu_attention, "_failed", [])
    monkeypatch.setattr(gpu_attention, "_kernels", lambda: Broken())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    with caplog.at_level("WARNING", logger="model.gpu_attention"):
        assert not gpu_attention._runs.__wrapped__(torch.device("cpu"), torch.float32, 2, 4, 8)
    assert "no compiler" in caplog.text and "in a step" not in caplog.text
    assert gpu_attention.usable()


def _sessions(decoder: Decoder, lengths: list[int]) -> SlotTable:
    """A table whose rows saw ``lengths`` tokens: empty rings, half-full ones and wrapped ones side by side."""
    table = SlotTable(decoder.empty, len(lengths))
    g = torch.Generator().manual_seed(3)
    for n in lengths:
        one = decoder.empty(1)
        decoder.prefill(one, torch.randint(0, 256, (1, n), generator=g).to(decoder.device), chunk_size=4)
        table.join(one)
    return table


def _steps(decoder: Decoder, lengths: list[int], steps: int = 9) -> tuple[list[torch.Tensor], SlotTable]:
    """Every row's scores over ``steps`` one-token steps (every row past its ring's wrap), and the table after."""
    table = _sessions(decoder, lengths)
    g = torch.Generator().manual_seed(5)
    scores = []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (len(lengths), 1), generator=g).to(decoder.device)
        view = table.active()
        decoder.advance(view, tokens)
        table.stepped(view)
        scores.append(view.last_logits.float())
    return scores, table


LENGTHS = [0, 1, 5, 6, 7, 23]  # empty rings, half-full ones and wrapped ones side by side


@pytest.mark.cuda
@no_cuda
@pytest.mark.parametrize("cfg,mem_len,lengths", [
    (dict(), 6, LENGTHS), (dict(clamp_len=3), 6, LENGTHS),
    (dict(), 200, [0, 150, 437]),  # rings of several spans a row, joined by the second kernel
    (dict(), 200, [437]),  # batch 1: as many spans as blocks of the ring
])
def test_steps_equal_the_torch_attention(cfg, mem_len, lengths):
    model = _model(**cfg).cuda()
    fast, plain = Decoder(model, mem_len=mem_len), Decoder(model, mem_len=mem_len, fused=False)
    assert fast.gpu_fused and not plain.gpu_fused
    (a, ta), (b, tb) = _steps(fast, lengths), _steps(plain, lengths)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    for r in range(len(lengths)):
        x, y = ta.export(r), tb.export(r)
        assert torch.equal(x.seen, y.seen)
        for name in ("hid", "k", "v"):
            torch.testing.assert_close(getattr(x, name), getattr(y, name), atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@no_cuda
def test_bf16_steps_are_as_close_to_float32_as_the_torch_attentions():
    """In bf16 the kernels score in float32 where the torch ops round the scores to bf16: both are compared
    with the float32 model, and the kernels' error may not be the larger (beyond rounding's own noise)."""
    model = _model().cuda()
    want, _ = _steps(Decoder(model, mem_len=6), LENGTHS)
    half = _model().to("cuda", torch.bfloat16)
    fast, plain = Decoder(half, mem_len=6), Decoder(half, mem_len=6, fused=False)
    assert fast.gpu_fused
    (a, _), (b, _) = _steps(fast, LENGTHS), _steps(plain, LENGTHS)
    err_fast = max(float((x - w).abs().max()) for x, w in zip(a, want))
    err_plain = max(float((x - w).abs().max()) for x, w in zip(b, want))
    assert 0 < err_fast <= 1.25 * err_plain + 1e-2, (err_fast, err_plain)


@pytest.mark.cuda
@no_cuda
def test_a_step_whose_kernels_fail_fails_and_the_next_runs_the_torch_ops(monkeypatch):
    model = _model().cuda()
    fast, plain = Decoder(model, mem_len=6), Decoder(model, mem_len=6, fused=False)
    assert fast.gpu_fused
    a, b = _sessions(fast, [3, 11]).table.rows([0, 1]), _sessions(plain, [3, 11]).table.rows([0, 1])
    tokens = torch.tensor([[5], [7]]).cuda()

    class Broken:
        def __getattr__(self, name):
            raise RuntimeError("no compiler for this variant")

    monkeypatch.setattr(gpu_attention, "_failed", [])
    monkeypatch.setattr(gpu_attention, "_kernels", lambda: Broken())
    with pytest.raises(gpu_attention.KernelFailed):
        fast.step(a.rows([0, 1]), tokens)  # on a copy: the engine loop drops a failed step's rows
    torch.testing.assert_close(fast.step(a, tokens), plain.step(b, tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@no_cuda
def test_a_graphed_step_replays_the_kernels():
    from model.graphs import GraphedStep

    model = _model().cuda()
    fast, plain = Decoder(model, mem_len=6), Decoder(model, mem_len=6, fused=False)
    a, b = _sessions(fast, [3, 11]).table.rows([0, 1]), _sessions(plain, [3, 11]).table.rows([0, 1])
    graphed = GraphedStep(fast, a)
    g = torch.Generator().manual_seed(9)
    for _ in range(8):
        tokens = torch.randint(0, 256, (2, 1), generator=g).cuda()
        got = graphed(tokens)
        want = plain.step(b, tokens)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.k, b.k, atol=1e-5, rtol=1e-5)


INTERPRETED = textwrap.dedent("""
    import torch
    from model import gpu_attention

    def reference(qkv, u, vb, k, v, tab, seen, scale):  # the window written out, slot by slot
        B, H, M, D = k.shape
        out = torch.empty(B, 1, H * D)
        for b in range(B):
            q, kn, vn = qkv[b, 0].view(3, H, D)
            last = int(seen[b]) - 1
            back = (last - torch.arange(M)) % M
            ring = ((q + u)[:, None] * k[b]).sum(-1) + ((q + vb)[:, None] * tab[:, back + 1]).sum(-1)
            own = ((q + u) * kn).sum(-1) + ((q + vb) * tab[:, 0]).sum(-1)
            p = (torch.cat([ring.masked_fill(back > last, float("-inf")), own[:, None]], 1) * scale).softmax(-1)
            out[b, 0] = (p[:, :, None] * torch.cat([v[b], vn[:, None]], 1)).sum(1).reshape(-1)
        return out

    gpu_attention._programs = lambda device: 64  # as a GPU would: several spans a row (3 of 128 slots here)
    torch.manual_seed(0)
    B, H, M, D = 5, 3, 333, 48  # spans of several blocks, a head narrower than its block
    qkv, u, vb = torch.randn(B, 1, 3 * H * D), torch.randn(H, D), torch.randn(H, D)
    k, v, tab = torch.randn(B, H, M, D), torch.randn(B, H, M, D), torch.randn(H, M + 1, D)
    seen = torch.tensor([0, 1, 200, 333, 1000])  # empty, one token, part full, just full, wrapped
    want = reference(qkv, u, vb, k, v, tab, seen, 0.125)
    k2, v2 = k.clone(), v.clone()
    got = gpu_attention.attend_step(qkv, u, vb, k2, v2, tab, seen, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for b in range(B):
        slot = int(seen[b]) % M
        assert torch.equal(k2[b, :, slot], qkv[b, 0].view(3, H, D)[1])
        assert torch.equal(v2[b, :, slot], qkv[b, 0].view(3, H, D)[2])
        k2[b, :, slot], v2[b, :, slot] = k[b, :, slot], v[b, :, slot]
    assert torch.equal(k2, k) and torch.equal(v2, v)  # no other slot written
    print("ok")
""")


def _interpretable() -> bool:
    """Triton's interpreter runs these kernels from 3.9 (3.6's cannot take a loop bound made from a program id)."""
    if importlib.util.find_spec("triton") is None:
        return False
    from importlib.metadata import version

    return tuple(int(x) for x in version("triton").split(".")[:2]) >= (3, 9)


@pytest.mark.skipif(not _interpretable(), reason="needs Triton 3.9 or later")
def test_kernels_interpreted_on_the_cpu_equal_the_window_written_out():
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]

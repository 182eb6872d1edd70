"""Reduced precision and CUDA paths of the engine (CUDA tests skip without a GPU)."""

from __future__ import annotations

import pytest
import torch

from model.engine import Engine
from model.sampling import SamplingParams
from tests.model.test_engine import make_engine, reference_logits


def _bf16_engine(tmp_path, device: str) -> tuple[Engine, Engine]:
    fp32 = make_engine(tmp_path)
    return fp32, Engine.from_checkpoint(tmp_path / "ck", device=device, dtype=torch.bfloat16)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_bf16_engine_tracks_fp32_reference(tmp_path, device):
    fp32, bf16 = _bf16_engine(tmp_path, device)
    x = torch.randint(0, 256, (2, 40))
    want = reference_logits(fp32, x)
    state = bf16.new_state(2)
    got = bf16.logits(bf16.decoder.prefill(state, x.to(device), chunk_size=7)).cpu()
    assert state.k.dtype == torch.bfloat16
    assert (got.softmax(-1) - want.softmax(-1)).abs().max() < 0.05
    # split invariance holds within the dtype's own arithmetic too
    again = bf16.new_state(2)
    steps = torch.cat([bf16.decoder.step(again, x[:, i:i + 1].to(device)) for i in range(40)], 1).cpu()
    assert (steps.softmax(-1) - got.softmax(-1)).abs().max() < 0.05
    events = list(bf16.generate(bf16.new_state(), "abc", SamplingParams(max_tokens=5, temperature=0)))
    assert len(events) == 5


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp32_matches_reference(tmp_path):
    fp32 = make_engine(tmp_path)
    cuda = Engine.from_checkpoint(tmp_path / "ck", device="cuda")
    x = torch.randint(0, 256, (3, 30))
    got = cuda.logits(cuda.decoder.prefill(cuda.new_state(3), x.cuda(), chunk_size=4)).cpu()
    torch.testing.assert_close(got, reference_logits(fp32, x), atol=1e-3, rtol=1e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_equals_eager_decode(tmp_path, dtype):
    from model.graphs import GraphedStep

    make_engine(tmp_path)
    engine = Engine.from_checkpoint(tmp_path / "ck", device="cuda", dtype=dtype)
    x = torch.randint(0, 256, (4, 40), device="cuda")
    state = engine.new_state(4)
    engine.decoder.prefill(state, x[:, :20], chunk_size=8)
    eager = state.rows([0, 1, 2, 3])
    graphed = GraphedStep(engine.decoder, state)
    assert torch.equal(state.last_logits, eager.last_logits)  # before any replay: the scores it had
    for i in range(20, 40):  # past mem_len: the ring wraps under the graph too
        want = engine.decoder.step(eager, x[:, i:i + 1])
        got = graphed(x[:, i:i + 1])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(state.seen, eager.seen)
    torch.testing.assert_close(state.k, eager.k)
    torch.testing.assert_close(state.last_logits, eager.last_logits)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_one_attention_trains_in_bf16_on_cuda(tmp_path):
    """The training/evaluation path of the same module under CUDA in bf16 tracks fp32 on the CPU."""
    from model.checkpoint import load_checkpoint

    fp32 = make_engine(tmp_path)
    x = torch.randint(0, 256, (2, 40))
    want = reference_logits(fp32, x)
    model = load_checkpoint(tmp_path / "ck", device="cuda", dtype=torch.bfloat16, same_length=True).model
    mems, out = None, []
    with torch.no_grad():
        for s in range(0, 40, 5):
            logits, mems = model(x[:, s:s + 5].cuda(), mems)
            out.append(logits.float().cpu())
    assert (torch.cat(out, 1).softmax(-1) - want.softmax(-1)).abs().max() < 0.05
    model.train()
    loss, _ = model.loss(x[:, :10].cuda(), x[:, 1:11].cuda())
    loss.mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad.float()).all() for p in model.parameters()
               if p.requires_grad)

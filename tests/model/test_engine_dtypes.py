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
    got = bf16.decoder.prefill(state, x.to(device), chunk_size=7).cpu()
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
    got = cuda.decoder.prefill(cuda.new_state(3), x.cuda(), chunk_size=4).cpu()
    torch.testing.assert_close(got, reference_logits(fp32, x), atol=1e-3, rtol=1e-3)

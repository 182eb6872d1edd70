"""The sampling kernel (``txlserve::sample_rows``) against the torch ops it stands in for, and its refusals.

Apart from test_sampling.py, whose every test runs on both paths: these compare the two paths, so they run once,
where the kernels are built."""

from __future__ import annotations

import pytest
import torch

from model import fused
from model.sampling import GREEDY_BELOW, SamplingParams, _torch_rows

pytestmark = pytest.mark.skipif(not fused.available(), reason="no C/C++ compilers here: the kernels are not built")


def test_the_kernel_and_the_torch_ops_draw_the_same_token_away_from_the_cdf_boundaries():
    """Both paths invert the same CDF: a draw in the middle of a token's interval picks that token on both,
    across a large vocabulary (the published WikiText-103 model's 267,735 words, not a multiple of the kernel's
    blocks), temperatures and greedy rows; only rounding at an interval's edge may tell them apart."""
    gen = torch.Generator().manual_seed(11)
    for vocab in (256, 267_735):
        logits = 4 * torch.randn(4, vocab, generator=gen)
        temps = torch.tensor([1.0, 0.7, 1.6, 0.0], dtype=torch.float64)
        cdf = torch.softmax(logits.double() / temps.clamp(min=GREEDY_BELOW)[:, None], -1).cumsum(-1)  # [4, vocab]
        for trial in range(20):
            token = int(torch.randint(0, vocab, (1,), generator=gen)) if trial else int(logits[0].argmax())
            lo = torch.where(torch.tensor(token) > 0, cdf[:, token - 1], torch.zeros(4, dtype=torch.float64))
            mid = (lo + cdf[:, token]) / 2  # [4]: inside each row's interval for `token`
            wide = (cdf[:, token] - lo) > 1e-4 * cdf[:, -1]
            u = (mid / cdf[:, -1]).tolist()
            kernel = fused.sample_rows(logits, temps, torch.tensor(u, dtype=torch.float64), GREEDY_BELOW).tolist()
            ops = _torch_rows(logits, [SamplingParams(temperature=float(t)) for t in temps], u)
            assert kernel[3] == ops[3] == int(logits[3].argmax())  # greedy
            for r in range(3):
                if wide[r]:
                    assert kernel[r] == ops[r] == token, (vocab, r, token)


@pytest.mark.parametrize("bad", ["float64 logits", "one dim", "temperature float32", "short u"])
def test_the_sampling_op_refuses_what_it_was_not_written_for(bad):
    logits, t, u = torch.randn(2, 8), torch.ones(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    if bad == "float64 logits":
        logits = logits.double()
    elif bad == "one dim":
        logits = logits[0]
    elif bad == "temperature float32":
        t = t.float()
    else:
        u = u[:1]
    with pytest.raises(ValueError, match="txlserve::sample_rows"):
        fused.sample_rows(logits, t, u, GREEDY_BELOW)

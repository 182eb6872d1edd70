"""``same_length``: txlserve's window (the token and exactly ``mem_len`` before it) against the original
code's (``mem_len`` keys including the token), written out plainly here from kimiyoung/transformer-xl's
``MemTransformerLM._forward``: txlserve at M equals the original at M + 1."""

from __future__ import annotations

import pytest
import torch

import model.transformer_xl as txl
from model.config import TXLConfig
from model.transformer_xl import MemTransformerLM
from tests.model.test_transformer_xl import tiny_config


def original_mask(qlen: int, mlen: int, mem_len: int) -> torch.Tensor:
    """The original ``dec_attn_mask`` with ``same_length`` (True = masked), [qlen, klen]."""
    klen = mlen + qlen
    all_ones = torch.ones(qlen, klen)
    mask_len = klen - mem_len
    mask_shift_len = qlen - mask_len if mask_len > 0 else qlen
    return (torch.triu(all_ones, 1 + mlen) + torch.tril(all_ones, -mask_shift_len)).bool()


def run_segments(model: MemTransformerLM, x: torch.Tensor, seg: int) -> torch.Tensor:
    mems, out = None, []
    for s in range(0, x.size(1), seg):
        logits, mems = model(x[:, s:s + seg], mems)
        out.append(logits)
    return torch.cat(out, 1)


@pytest.mark.parametrize("mem_len,seg,clamp_len", [(5, 3, 0), (5, 7, 0), (8, 4, 3), (1, 2, 0), (12, 6, 0)])
def test_txlserve_at_m_equals_the_original_at_m_plus_1(monkeypatch, mem_len, seg, clamp_len):
    torch.manual_seed(0)
    cfg = tiny_config(mem_len=mem_len, tgt_len=seg, clamp_len=clamp_len, same_length=True).replace(dropout=0.0)
    ours = MemTransformerLM(cfg).double().eval()
    x = torch.randint(0, 256, (2, 4 * seg + 1))
    want = run_segments(ours, x, seg)

    original = MemTransformerLM(cfg.replace(mem_len=cfg.original_mem_len)).double().eval()
    original.load_state_dict(ours.state_dict())
    # the original code's mask, fed the original mem_len, in place of txlserve's window
    monkeypatch.setattr(txl, "attn_mask", lambda qlen, mlen, window, device=None: original_mask(qlen, mlen, window))
    got = run_segments(original, x, seg)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)

    at_m = MemTransformerLM(cfg).double().eval()  # the original at the same M sees one key fewer: different
    at_m.load_state_dict(ours.state_dict())
    assert not torch.allclose(run_segments(at_m, x, seg), want, atol=1e-6)


def test_the_mapping_both_ways():
    cfg = TXLConfig(n_layer=1, d_model=8, n_head=1, d_head=8, d_inner=8, mem_len=1600, same_length=True)
    assert cfg.original_mem_len == 1601
    assert TXLConfig.from_original_mem_len(1600, same_length=True) == 1599
    assert TXLConfig.from_original_mem_len(1600, same_length=False) == 1600
    assert cfg.replace(same_length=False).original_mem_len == 1600

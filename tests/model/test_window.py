"""A session's state is a function of its last ``n_layer * mem_len + 1`` tokens: rebuilding it from that window
(prefill from an empty state, then the rings rotated to the session's positions) gives the state it had."""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import save_checkpoint
from model.engine import Engine
from model.transformer_xl import MemTransformerLM
from tests.model.test_transformer_xl import tiny_config
from txlserve.errors import SessionIncompatible

SHAPES = {
    "plain": dict(),
    "tied-r": dict(untie_r=False),
    "clamp": dict(clamp_len=3),
    "pre-lnorm": dict(pre_lnorm=True, same_length=True),
    "adaptive-words": dict(vocab_size=60, cutoffs=(10, 30), div_val=2, d_embed=16),
}


def _engine(tmp_path, dtype=torch.float32, **kw) -> Engine:
    torch.manual_seed(0)
    model = MemTransformerLM(tiny_config(mem_len=5, **kw))
    for p in model.parameters():
        p.data.normal_(0, 0.3) if p.dim() > 1 else None
    save_checkpoint(model, tmp_path / "ck")
    return Engine.from_checkpoint(tmp_path / "ck", dtype=dtype)


def _same(a, b, eng: Engine, tol: float) -> None:
    ea, eb = eng.export_state(a), eng.export_state(b)
    assert int(a.seen[0]) == int(b.seen[0])
    torch.testing.assert_close(eb["mems"], ea["mems"], atol=tol, rtol=tol)
    torch.testing.assert_close(eb["last_logits"], ea["last_logits"], atol=tol, rtol=tol)
    torch.testing.assert_close(b.k, a.k, atol=tol, rtol=tol)  # the rings, slot by slot
    torch.testing.assert_close(b.v, a.v, atol=tol, rtol=tol)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("extra", [-7, 0, 13])  # shorter than the window, exactly it, and past it (rings wrapped)
def test_a_state_rebuilt_from_its_window_equals_the_original(tmp_path, shape, extra):
    eng = _engine(tmp_path, **SHAPES[shape])
    w = eng.window_len
    assert w == 2 * 5 + 1
    torch.manual_seed(1)
    ids = torch.randint(0, eng.config.vocab_size, (w + extra,)).tolist()
    original = eng.new_state()
    for start in range(0, len(ids), 4):  # the session was built across requests
        eng.feed(original, ids[start:start + 4])
    rebuilt = eng.rebuild(ids[-w:], tokens_seen=len(ids))
    _same(original, rebuilt, eng, 1e-4)
    nxt = torch.randint(0, eng.config.vocab_size, (6,)).tolist()  # and they go on alike
    eng.feed(original, nxt)
    eng.feed(rebuilt, nxt)
    _same(original, rebuilt, eng, 1e-4)


def test_in_float64_the_window_is_exact_and_one_token_less_is_not(tmp_path):
    eng = _engine(tmp_path, dtype=torch.float64)
    w = eng.window_len
    torch.manual_seed(2)
    ids = torch.randint(0, eng.config.vocab_size, (3 * w,)).tolist()
    original = eng.new_state()
    eng.feed(original, ids)
    _same(original, eng.rebuild(ids[-w:], tokens_seen=len(ids)), eng, 1e-12)
    short = eng.rebuild(ids[-(w - 1):], tokens_seen=len(ids))
    gap = (eng.export_state(short)["last_logits"] - eng.export_state(original)["last_logits"]).abs().max()
    assert gap > 1e-9  # the oldest token of the window still reaches the next-token scores


def test_a_window_shorter_than_the_memory_is_refused(tmp_path):
    eng = _engine(tmp_path)
    with pytest.raises(SessionIncompatible, match="window"):
        eng.rebuild([1, 2], tokens_seen=40)  # 2 tokens cannot stand for a 5-token memory
    state = eng.rebuild([], tokens_seen=0)
    assert int(state.seen[0]) == 0

"""The one-token step traced as one graph: the same numbers as the eager step, for every batch it serves."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.overrides import TorchFunctionMode

import model.decode as decode
from model.cache import DecodeState, RowTable, SlotTable
from model.decode import Decoder
from model.fused import available as fused_available
from model.transformer_xl import MemTransformerLM
from tests.model.test_transformer_xl import tiny_config


def _model(**kw) -> MemTransformerLM:
    torch.manual_seed(0)
    model = MemTransformerLM(tiny_config(**kw))
    for p in model.parameters():  # larger weights than init, so attention patterns matter
        p.data.normal_(0, 0.3) if p.dim() > 1 else None
    return model


TABLES = [SlotTable, pytest.param(RowTable, marks=pytest.mark.skipif(not fused_available(), reason="no C compiler"))]


def _table(decoder: Decoder, lengths: list[int], kind: type = SlotTable) -> SlotTable | RowTable:
    """A decode table as the server's (a slot table's rows are views of a larger table; a row table's are the
    sessions' own states) of sessions fed ``lengths`` tokens."""
    table = kind(decoder.empty, capacity=max(16, len(lengths)))
    g = torch.Generator().manual_seed(1)
    for n in lengths:
        one = decoder.empty(1)
        decoder.prefill(one, torch.randint(0, 256, (1, n), generator=g), chunk_size=5)
        table.join(one)
    return table


def _sessions(table: SlotTable | RowTable) -> DecodeState:
    """Every row's session, as one state."""
    if isinstance(table, SlotTable):
        return table.table.span(0, table.n)
    return DecodeState.cat([table.export(r) for r in range(table.n)])


def _same_sessions(a: SlotTable | RowTable, b: SlotTable | RowTable) -> None:
    sa, sb = _sessions(a), _sessions(b)
    for name in ("hid", "k", "v", "seen", "last_logits"):
        assert torch.equal(getattr(sa, name), getattr(sb, name)), name


class _Count(TorchFunctionMode):
    """Torch functions called from Python: each one gives the GIL up and takes it back."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", TABLES)
@pytest.mark.parametrize("cfg", [dict(), dict(clamp_len=3), dict(pre_lnorm=True, untie_r=False),
                                 dict(vocab_size=300, cutoffs=(100, 200), div_val=1, d_embed=32)])  # adaptive softmax
def test_traced_steps_equal_eager_steps_at_every_batch_size(cfg, kind):
    """Traced once on a batch of 2 (a row table's graph: two rows fed 1 and 2 tokens), the graph serves batches
    of 1, 3 and 9 (sizes stay symbolic), on rows of a slot table (or sessions where they lie, whose addresses
    are the graph's input), with rings wrapped (mem_len 6) and not yet full, exactly as the eager step does."""
    model = _model(**cfg)
    eager, traced = Decoder(model, mem_len=6, traced=False), Decoder(model, mem_len=6, traced=True)
    for lengths in ([9], [0, 4, 17], [1, 2, 3, 5, 6, 7, 11, 30, 2]):
        a, b = _table(eager, lengths, kind), _table(traced, lengths, kind)
        g = torch.Generator().manual_seed(len(lengths))
        for _ in range(8):  # past a wrap of every ring
            tokens = torch.randint(0, 256, (len(lengths), 1), generator=g)  # [batch, 1]
            va, vb = a.active(), b.active()
            ha, hb = eager.advance(va, tokens), traced.advance(vb, tokens)
            a.stepped(va)
            b.stepped(vb)
            assert torch.equal(ha, hb) and torch.equal(va.last_logits, vb.last_logits)
        _same_sessions(a, b)
    assert traced.one_token_graph() is not None and eager.one_token_graph() is None


@pytest.mark.parametrize("cfg", [dict(), dict(clamp_len=3), dict(pre_lnorm=True, untie_r=False)])
def test_short_chunks_traced_per_length_equal_eager_calls(cfg):
    """A request's short prompt (up to MAX_TRACED_CHUNK tokens) runs as a graph traced for its length: on rows
    at every stage (empty, part-filled, wrapped), at batch sizes other than the trace's, with chunks shorter and
    longer than the ring (mem_len 6), the same numbers as the eager call; longer chunks stay eager."""
    model = _model(**cfg)
    eager, traced = Decoder(model, mem_len=6, traced=False), Decoder(model, mem_len=6, traced=True)
    g = torch.Generator().manual_seed(5)
    for lengths in ([9], [0, 4, 17], [1, 2, 3, 5, 6, 7, 11]):
        a, b = _table(eager, lengths), _table(traced, lengths)
        for chunk in (2, 3, 7, decode.MAX_TRACED_CHUNK, decode.MAX_TRACED_CHUNK + 1, 1, 4):
            tokens = torch.randint(0, 256, (len(lengths), chunk), generator=g)  # [batch, chunk]
            va, vb = a.active(), b.active()
            ha, hb = eager.step(va, tokens), traced.step(vb, tokens)
            a.stepped(va)
            b.stepped(vb)
            assert torch.equal(ha, hb) and torch.equal(va.last_logits, vb.last_logits), chunk
        _same_sessions(a, b)
    lengths = {n for n, _, _ in traced._graphs}
    assert {2, 3, 7, decode.MAX_TRACED_CHUNK} <= lengths  # one graph per length (5: the prefills')
    assert max(lengths) == decode.MAX_TRACED_CHUNK and not eager._graphs  # none longer; none when eager


def test_a_traced_step_is_one_python_call():
    """Eagerly a step dispatches hundreds of torch functions from Python; traced, none inside the step."""
    model = _model()
    counts = {}
    for traced in (False, True):
        decoder = Decoder(model, mem_len=6, traced=traced, fused=False)  # the fused kernel's own: test_fused.py
        decoder.warm_up()
        state, tokens = decoder.empty(3), torch.zeros(3, 1, dtype=torch.long)
        with _Count() as count:
            decoder.advance(state, tokens)
        counts[traced] = count.calls
    assert counts[True] <= 3 < 100 <= counts[False], counts


def test_cpu_decoders_trace_by_default_but_not_adaptive_inputs():
    """Which clusters of an adaptive input embedding run depends on the tokens: a trace would fix them."""
    assert Decoder(_model(), mem_len=6).traced
    adaptive = _model(vocab_size=300, cutoffs=(100, 200), div_val=2, d_embed=32)
    decoder = Decoder(adaptive, mem_len=6, traced=True)
    assert not decoder.traced and decoder.one_token_graph() is None


def test_a_failed_trace_leaves_eager_steps_with_one_warning(monkeypatch, caplog):
    def broken(decoder, chunk, rows=False):
        raise RuntimeError("no TorchScript here")

    monkeypatch.setattr(decode, "trace_step", broken)
    model = _model()
    decoder, eager = Decoder(model, mem_len=6, traced=True), Decoder(model, mem_len=6, traced=False)
    with caplog.at_level(logging.WARNING, logger="model.decode"):
        decoder.warm_up()
    assert not decoder.traced and "no TorchScript here" in caplog.text
    a, b = decoder.empty(2), eager.empty(2)
    tokens = torch.tensor([[3], [4]])
    assert torch.equal(decoder.step(a, tokens), eager.step(b, tokens))


def test_a_traced_step_that_fails_fails_its_call_and_leaves_eager_steps(monkeypatch, caplog):
    def failing(*tensors):
        raise RuntimeError("graph broke")

    monkeypatch.setattr(decode, "trace_step", lambda decoder, chunk, rows=False: failing)
    model = _model()
    decoder, eager = Decoder(model, mem_len=6, traced=True), Decoder(model, mem_len=6, traced=False)
    with caplog.at_level(logging.WARNING, logger="model.decode"):
        decoder.warm_up()  # meets the failure, logs it, does not raise
    assert not decoder.traced and "graph broke" in caplog.text
    # a graph that breaks only later, on a real step
    decoder.traced, decoder._graphs[1, False, decoder.step_kernels] = True, failing
    a, b, tokens = decoder.empty(2), eager.empty(2), torch.tensor([[3], [4]])
    with pytest.raises(RuntimeError, match="graph broke"):  # the failing call's rows are its caller's to drop
        decoder.step(a, tokens)
    assert not decoder.traced
    a = decoder.empty(2)
    assert torch.equal(decoder.step(a, tokens), eager.step(b, tokens))


def test_an_engine_can_be_held_to_eager_steps(tmp_path):
    """``--enforce-eager`` reaches the decoder: no trace and no fused attention, and the same results (to float
    rounding where the other engine's attention is the fused kernel)."""
    from model.checkpoint import save_checkpoint
    from model.engine import Engine

    save_checkpoint(_model(), tmp_path / "ck")
    eager, traced = (Engine.from_checkpoint(tmp_path / "ck", enforce_eager=e) for e in (True, False))
    assert not eager.decoder.traced and eager.decoder.one_token_graph() is None and traced.decoder.traced
    assert not eager.decoder.fused and traced.decoder.fused == fused_available()
    a, b = eager.new_state(), traced.new_state()
    for state, engine in ((a, eager), (b, traced)):
        engine.feed(state, engine.encode("Once upon a time"))
        engine.decoder.step(state, torch.tensor([[7]]))
    torch.testing.assert_close(a.last_logits, b.last_logits, rtol=1e-5, atol=1e-5)
    assert traced.decoder.one_token_graph() is not None


def test_the_slot_tables_view_of_every_row_is_made_once_per_batch_composition():
    """A step's views of rows [0, n) are kept while no row joins or leaves (five slicing ops a step saved), and
    after a step on some rows alone the kept views' scores would be stale: they are made again."""
    decoder = Decoder(_model(), mem_len=6, traced=True)
    table = _table(decoder, [3, 9])
    view = table.active()
    decoder.advance(view, torch.tensor([[1], [2]]))
    table.stepped(view)
    assert table.active() is view and torch.equal(view.last_logits, table.table.last_logits[:2])
    part = table.active(1, 2)
    decoder.advance(part, torch.tensor([[3]]))
    table.stepped(part, 1)
    fresh = table.active()
    assert fresh is not view and torch.equal(fresh.last_logits, table.table.last_logits[:2])
    table.join(decoder.empty(1))
    assert table.active() is not fresh and table.active().batch == 3
    kept = table.active()
    table.leave(0)
    assert table.active() is not kept and table.active().batch == 2

"""Sessions decoded where they lie (model.cache.RowTable): the same numbers as a slot table that copies them in,
and no copy of a session's rings as it joins, steps and leaves."""

from __future__ import annotations

import pytest
import torch

import model.fused as fused
from model.cache import DecodeState, RowBatch, RowTable, SlotTable
from model.decode import Decoder
from tests.model.test_traced_step import _model, _same_sessions

pytestmark = pytest.mark.skipif(not fused.available(), reason="no C/C++ compilers here: the kernel is not built")


def _session(decoder: Decoder, n: int, seed: int) -> DecodeState:
    one = decoder.empty(1)
    decoder.prefill(one, torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed)), chunk_size=5)
    return one


def _step(decoder: Decoder, table: SlotTable | RowTable, tokens: torch.Tensor,
          start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [start, start + len(tokens)) fed ``tokens``: the last layer's outputs and the next-token scores."""
    view = table.active(start, start + tokens.size(0))
    h = decoder.advance(view, tokens)
    table.stepped(view, start)
    return h, view.last_logits


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("cfg", [dict(), dict(clamp_len=3), dict(pre_lnorm=True, untie_r=False)])
def test_sessions_decoded_where_they_lie_equal_a_slot_table(cfg, traced):
    """The same joins, steps (one token, short prompts of a few tokens, a group of rows alone) and leaves on a
    slot table and on a row table give the same bits: outputs, scores, and every session's rings afterwards."""
    decoder = Decoder(_model(**cfg), mem_len=6, traced=traced)
    tables = [SlotTable(decoder.empty, 8), RowTable(decoder.empty, 8)]
    assert isinstance(decoder.table(8), RowTable)
    g = torch.Generator().manual_seed(7)
    for i, n in enumerate([0, 4, 17, 9]):
        for t in tables:
            t.join(_session(decoder, n, i))

    def same(tokens: torch.Tensor, start: int = 0) -> None:
        (ha, la), (hb, lb) = (_step(decoder, t, tokens, start) for t in tables)
        assert torch.equal(ha, hb) and torch.equal(la, lb)

    for _ in range(8):  # past every ring's wrap
        same(torch.randint(0, 256, (4, 1), generator=g))
    same(torch.randint(0, 256, (4, 3), generator=g))
    same(torch.randint(0, 256, (2, fused.MAX_CHUNK), generator=g), start=1)  # two rows' prompts, alone
    for t in tables:
        t.leave(1)  # the last row takes its place
        t.join(_session(decoder, 2, 9))
    for _ in range(3):
        same(torch.randint(0, 256, (4, 1), generator=g))
    _same_sessions(*tables)


def test_a_session_leaves_as_the_state_it_joined_as_and_no_ring_is_copied():
    """Joining, stepping and leaving move addresses, never rings: the state that comes out is the object that
    went in, its rings where they were, advanced in place; a leave leaves every other session untouched."""
    decoder = Decoder(_model(), mem_len=6)
    table = RowTable(decoder.empty, 4)
    states = [_session(decoder, n, i) for i, n in enumerate([3, 8, 5])]
    where = [(s.hid.data_ptr(), s.k.data_ptr(), s.v.data_ptr()) for s in states]
    for s in states:
        table.join(s)
    before = states[0].k.clone()
    _step(decoder, table, torch.tensor([[1], [2], [3]]))
    assert not torch.equal(states[0].k, before)  # advanced where it lies
    others = [(s.hid.clone(), s.k.clone(), s.v.clone()) for s in states[1:]]
    out = table.export(0)
    table.leave(0)
    assert out is states[0] and int(out.seen[0]) == 4 and table.n == 2
    for s, (hid, k, v) in zip(states[1:], others):
        assert torch.equal(s.hid, hid) and torch.equal(s.k, k) and torch.equal(s.v, v)
    assert [(s.hid.data_ptr(), s.k.data_ptr(), s.v.data_ptr()) for s in states] == where
    assert table.states == [states[2], states[1]]  # the last row moved into the freed one


def test_a_session_alone_and_in_a_row_table_compute_the_same():
    """A session stepped alone (its own batch-1 state) and the same session stepped in a row table beside others:
    the same rings to the bit (below four rows the C products run the one-row loops, as alone), the same scores
    to float rounding (torch's output layer blocks a batch of 3 otherwise than one row)."""
    decoder = Decoder(_model(), mem_len=6)
    alone, joined = _session(decoder, 11, 3), _session(decoder, 11, 3)
    table = RowTable(decoder.empty, 4)
    table.join(_session(decoder, 2, 1))
    table.join(joined)
    table.join(_session(decoder, 30, 2))
    for tok in (5, 6, 7, 8, 9, 10, 11):
        decoder.advance(alone, torch.tensor([[tok]]))
        _step(decoder, table, torch.tensor([[1], [tok], [2]]))
    out = table.export(1)
    for name in ("hid", "k", "v", "seen"):
        assert torch.equal(getattr(out, name), getattr(alone, name)), name
    torch.testing.assert_close(out.last_logits, alone.last_logits, rtol=1e-5, atol=1e-5)


def test_a_state_laid_out_otherwise_is_copied_once_and_decodes_the_same():
    """A session whose rings are row-major (as a GPU keeps them) cannot be read in place by the CPU layout's
    strides: it joins as a copy, and computes what the same session in the CPU layout computes."""
    decoder = Decoder(_model(), mem_len=6)
    native = _session(decoder, 9, 4)
    other = DecodeState(native.hid.clone(), native.k.contiguous(), native.v.contiguous(), native.seen.clone(),
                        native.last_logits.clone())
    assert other.k.stride() != native.k.stride()
    table = RowTable(decoder.empty, 2)
    table.join(native)
    table.join(other)
    assert table.states[0] is native and table.states[1] is not other
    _step(decoder, table, torch.tensor([[3], [3]]))
    assert torch.equal(table.last_logits[0], table.last_logits[1])


def test_a_session_is_never_in_two_rows_and_a_full_table_refuses_more():
    decoder = Decoder(_model(), mem_len=6)
    table = RowTable(decoder.empty, 2)
    s = _session(decoder, 3, 0)
    table.join(s)
    with pytest.raises(RuntimeError, match="already in the batch"):
        table.join(s)
    with pytest.raises(RuntimeError, match="already in the batch"):  # another state object over the same rings
        table.join(DecodeState(s.hid, s.k, s.v, s.seen.clone(), s.last_logits.clone()))
    table.join(_session(decoder, 3, 1))
    with pytest.raises(RuntimeError, match="full"):
        table.join(_session(decoder, 3, 2))
    table.leave(0)
    table.join(s)  # free again once it left


def test_rows_take_only_what_the_kernel_reads():
    """Only the fused attention reads rings by address: a longer call on a row batch is refused before it runs,
    and a decoder without the kernel batches sessions in a slot table."""
    decoder = Decoder(_model(), mem_len=6)
    table = RowTable(decoder.empty, 2)
    table.join(_session(decoder, 3, 0))
    with pytest.raises(ValueError, match=f"1 to {fused.MAX_CHUNK} tokens"):
        decoder.advance(table.active(), torch.zeros(1, fused.MAX_CHUNK + 1, dtype=torch.long))
    assert decoder.traced  # refused before any graph ran
    assert isinstance(Decoder(_model(), mem_len=6, fused=False).table(4), SlotTable)
    assert isinstance(table.active(), RowBatch)


@pytest.mark.parametrize("bad", ["dtype", "shape", "null", "strides", "h", "start", "long_row", "empty_row"])
def test_the_rows_op_refuses_what_it_was_not_written_for(bad):
    """The op trusts addresses (the table checked each session as it joined) but checks every number it can:
    a ValueError before it runs, never a wild write."""
    decoder = Decoder(_model(), mem_len=6)
    table = RowTable(decoder.empty, 2)
    for n in (3, 5):
        table.join(_session(decoder, n, n))
    layer = decoder.model.layers[0].dec_attn
    heads, dh, d = layer.n_head, layer.d_head, decoder.cfg.d_model
    view = table.active()
    args = dict(qkv=torch.randn(1, 3, 3 * heads * dh), start=torch.tensor([0, 1, 3]), u=torch.zeros(heads, dh),
                vb=torch.zeros(heads, dh), rows=view.rows[:, 0], h=torch.randn(1, 3, d), table=decoder.r_head_k[0],
                seen=view.seen.clone(), scale=1.0, ring=decoder.ring)
    assert fused.attend_rows(**args).shape == (1, 3, heads * dh)  # as they are, the op runs
    if bad == "dtype":
        args["rows"] = args["rows"].int()
    elif bad == "shape":
        args["rows"] = args["rows"][:2]
    elif bad == "null":
        args["rows"] = torch.zeros_like(args["rows"])
    elif bad == "strides":
        args["ring"] = (1, 1, 1)  # overlapping: not a ring of [heads, mem_len, d_head]
    elif bad == "h":
        args["h"] = torch.randn(1, 2, d)  # two tokens' inputs for three tokens' queries
    elif bad == "start":
        args["start"] = torch.tensor([0, 1, 4])  # past the last token
    elif bad == "long_row":
        n = fused.MAX_CHUNK + 1
        args.update(qkv=torch.randn(1, n + 1, 3 * heads * dh), h=torch.randn(1, n + 1, d),
                    start=torch.tensor([0, 1, n + 1]))
    else:
        args["start"] = torch.tensor([0, 0, 3])  # a row with no token
    with pytest.raises(ValueError, match="attend_rows"):
        fused.attend_rows(**args)


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("cfg", [dict(), dict(clamp_len=3), dict(pre_lnorm=True, untie_r=False)])
def test_rows_fed_their_own_number_of_tokens_in_one_call_equal_each_fed_alone(cfg, traced):
    """One packed call feeds each session of a row table its own tokens (a generating row's one beside joining
    prompts of up to MAX_CHUNK, rings empty, part-filled and wrapped, mem_len 6): every session ends as it does
    fed the same tokens alone (to float rounding: the products tile many rows otherwise than one), and the
    outputs are each row's, in order."""
    decoder = Decoder(_model(**cfg), mem_len=6, traced=traced)
    alone_dec = Decoder(decoder.model, mem_len=6, traced=False)
    g = torch.Generator().manual_seed(11)
    history = [0, 3, 9, 17, 5]
    for counts in ([1, 4, fused.MAX_CHUNK, 2, 1], [3, 1, 1, 7, 6], [1, 1, 1, 1, 1]):
        table, alone = RowTable(decoder.empty, 8), []
        for i, n in enumerate(history):
            table.join(_session(decoder, n, i))
            alone.append(_session(alone_dec, n, i))
        feeds = [torch.randint(0, 256, (n,), generator=g) for n in counts]
        start = torch.tensor([0, *counts]).cumsum(0)  # [batch+1]
        view = table.active()
        h = decoder.advance_rows(view, torch.cat(feeds)[None], start)  # [1, T, d]
        table.stepped(view)
        for r, (state, feed) in enumerate(zip(alone, feeds)):
            want = alone_dec.advance(state, feed[None])  # [1, n, d]
            torch.testing.assert_close(h[0, start[r]:start[r + 1]], want[0], rtol=1e-5, atol=1e-5)
            out = table.export(r)
            assert int(out.seen[0]) == int(state.seen[0]) == history[r] + counts[r]
            for name in ("hid", "k", "v", "last_logits"):
                torch.testing.assert_close(getattr(out, name), getattr(state, name), rtol=1e-5, atol=1e-5,
                                           msg=f"{counts} row {r} {name}")


def test_no_address_outlives_its_row_and_views_stay_within_the_table():
    """A leave clears the moved row's old addresses (the op refuses 0), and a view past the rows in use is an
    error, not a step on freed sessions."""
    decoder = Decoder(_model(), mem_len=6)
    table = RowTable(decoder.empty, 4)
    for i in range(3):
        table.join(_session(decoder, 2, i))
    table.leave(0)
    assert table.rows[:, :, 2].eq(0).all() and table.rows[:, :, :2].ne(0).all()
    with pytest.raises(IndexError):
        table.active(0, 3)
    assert table.active(1, 2).batch == 1


def test_sessions_whose_rings_overlap_are_copied_not_read_in_place():
    """The kernel writes a row's layer inputs, keys and values, layer by layer: a state whose keys are its values,
    or whose layers share memory, would write over itself, so it joins as a copy of its own."""
    decoder = Decoder(_model(), mem_len=6)
    s = _session(decoder, 4, 0)
    same_kv = DecodeState(s.hid.clone(), s.k, s.k, s.seen.clone(), s.last_logits.clone())
    one_layer = DecodeState(s.hid[:1].expand_as(s.hid), s.k.clone(), s.v.clone(), s.seen.clone(),
                            s.last_logits.clone())
    table = RowTable(decoder.empty, 3)
    for state in (s, same_kv, one_layer):
        table.join(state)
    assert table.states[0] is s and table.states[1] is not same_kv and table.states[2] is not one_layer


def test_a_bad_packing_is_refused_before_the_graph_and_keeps_it():
    decoder = Decoder(_model(), mem_len=6, traced=True)
    table = RowTable(decoder.empty, 2)
    for i in range(2):
        table.join(_session(decoder, 3, i))
    with pytest.raises(ValueError, match="1 to"):
        decoder.advance_rows(table.active(), torch.zeros(1, 3, dtype=torch.long), torch.tensor([0, 0, 3]))
    assert decoder.traced
    decoder.advance_rows(table.active(), torch.zeros(1, 3, dtype=torch.long), torch.tensor([0, 1, 3]))
    assert int(table.seen[0]) == 4 and int(table.seen[1]) == 5

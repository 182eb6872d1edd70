"""A GPU server's decode batch (model.graphs.GraphedTable): steps of n rows run the smallest captured batch size
that holds them, rows beyond n stepping on nobody's session, and every session computes what it does in a plain
slot table. Without a GPU the same padded steps run eagerly (``capture=False``); with one, as CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from model.cache import DecodeState, SlotTable
from model.decode import Decoder
from model.graphs import GraphedTable, capture_sizes
from tests.model.test_traced_step import _model

needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_capture_sizes_are_vllms_and_end_at_the_capacity():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    assert capture_sizes(256)[-3:] == [240, 248, 256] and len(capture_sizes(256)) == 3 + 32


def _session(decoder: Decoder, n: int, seed: int) -> DecodeState:
    one = decoder.empty(1)
    ids = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed)).to(decoder.device)
    decoder.prefill(one, ids, chunk_size=5)
    return one


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("cfg", [dict(), dict(clamp_len=3)])
def test_padded_steps_equal_a_slot_table_as_sessions_join_and_leave(device, cfg):
    """The same joins, one-token steps at 3, 5 and 2 rows (run as 4, 8 and 2), a two-token step (eager), and
    leaves on a plain slot table and on a graphed one: the same scores every step and the same sessions after,
    a session joining a row that padded steps had advanced included."""
    decoder = Decoder(_model(**cfg).to(device), mem_len=6, traced=False, fused=False)
    plain, graphed = SlotTable(decoder.empty, 10), GraphedTable(decoder, 10, capture=device == "cuda")
    assert graphed.sizes == [1, 2, 4, 8, 10] and graphed.table.batch == 10  # allocated once, whole
    table_ptr = graphed.table.hid.data_ptr()
    g = torch.Generator().manual_seed(7)

    def join(n: int, seed: int) -> None:
        for t in (plain, graphed):
            t.join(_session(decoder, n, seed))

    def step(chunk: int = 1) -> None:
        tokens = torch.randint(0, 256, (plain.n, chunk), generator=g).to(device)
        a, b = plain.active(), graphed.active()
        decoder.advance(a, tokens)
        graphed.advance(b, tokens)
        for t, view in ((plain, a), (graphed, b)):
            t.stepped(view)
        _close(b.last_logits, a.last_logits)
        _close(graphed.table.last_logits[:plain.n], plain.table.last_logits[:plain.n])

    for i, n in enumerate([0, 4, 17]):
        join(n, i)
    for _ in range(8):  # 3 rows as 4: past every ring's wrap
        step()
    join(9, 3)
    join(2, 4)
    for _ in range(3):  # 5 rows as 8, then a prompt's two tokens a row, eagerly
        step()
    step(2)
    for t in (plain, graphed):
        t.leave(0)
        t.leave(1)
        t.leave(2)
    join(11, 5)  # into row 2, which padded steps had advanced
    for _ in range(4):  # 3 rows as 4
        step()
    for r in range(plain.n):
        a, b = plain.export(r), graphed.export(r)
        for name in ("hid", "k", "v", "seen", "last_logits"):
            _close(getattr(b, name), getattr(a, name))
    assert graphed.table.hid.data_ptr() == table_ptr  # the rows never moved
    if device == "cuda":
        assert sorted(graphed.graphs) == [4, 8]  # the sizes it stepped, each captured once


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_a_decoder_gives_graphed_tables_on_a_gpu_unless_eager(device):
    model = _model().to(device)
    on_gpu = device == "cuda"
    assert isinstance(Decoder(model, mem_len=6, fused=False).table(4), GraphedTable) == on_gpu
    assert not isinstance(Decoder(model, mem_len=6, fused=False, cuda_graphs=False).table(4), GraphedTable)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_capture_all_captures_every_size_and_a_failed_capture_falls_back_to_eager(monkeypatch):
    decoder = Decoder(_model().to("cuda"), mem_len=6)
    table = GraphedTable(decoder, 10)
    table.capture_all()
    assert sorted(table.graphs) == [1, 2, 4, 8, 10]
    assert int(table.table.seen.max()) > 0  # warmed up on its own rows, nobody's yet
    table.join(_session(decoder, 4, 0))
    assert int(table.table.seen[0]) == 4  # a joining session's row is all its own

    plain, broken = SlotTable(decoder.empty, 10), GraphedTable(decoder, 10)
    advance = decoder.advance

    def host_read(state, tokens):  # reads a value back to the host: not allowed while a graph is captured
        int(tokens.sum())
        return advance(state, tokens)

    monkeypatch.setattr(decoder, "advance", host_read)
    for t in (plain, broken):
        t.join(_session(decoder, 4, 0))
        t.join(_session(decoder, 9, 1))
    for i in range(3):
        tokens = torch.full((2, 1), 65 + i, device="cuda")
        a, b = plain.active(), broken.active()
        decoder.advance(a, tokens)
        broken.advance(b, tokens)  # the capture fails inside the step; it runs eagerly, the same step
        plain.stepped(a)
        broken.stepped(b)
        _close(b.last_logits, a.last_logits)
    assert not broken.capture and broken.graphs == {}
    assert broken.table.seen[:2].tolist() == [7, 12]
    torch.nn.functional.dropout(torch.ones(8, device="cuda"), 0.5)  # the device's random ops still work

"""The fused one-token attention (model/fused.py): the same numbers as the model's torch ops, or not used at all."""

from __future__ import annotations

import logging

import pytest
import torch

import model.fused as fused
from model.cache import RingCache, RowTable, SlotTable, column_major
from model.decode import Decoder
from tests.model.test_traced_step import _model, _table

pytestmark = pytest.mark.skipif(not fused.available(), reason="no C/C++ compilers here: the kernel is not built")


def _same_steps(plain: Decoder, fast: Decoder, lengths: list[int], steps: int, chunk: int = 1) -> None:
    """Slot tables of rows prefilled to ``lengths``, fed ``chunk`` tokens a call alike by both decoders: next-token
    scores, outputs and every stored tensor match to float rounding."""
    a, b = _table(plain, lengths), _table(fast, lengths)
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        tokens = torch.randint(0, 256, (len(lengths), chunk), generator=g)  # [batch, chunk]
        va, vb = a.active(), b.active()
        ha, hb = plain.advance(va, tokens), fast.advance(vb, tokens)
        a.stepped(va)
        b.stepped(vb)
        torch.testing.assert_close(hb, ha, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vb.last_logits, va.last_logits, rtol=1e-5, atol=1e-5)
    for name in ("hid", "k", "v", "seen"):
        torch.testing.assert_close(getattr(b.table, name), getattr(a.table, name), rtol=1e-5, atol=1e-5, msg=name)


_CFGS = [dict(), dict(clamp_len=3), dict(pre_lnorm=True, untie_r=False), dict(n_head=3, d_head=8, d_model=24)]


# Every model eagerly; traced (a second or more each: a trace per call length), the first and the last only: the
# traced graph calls the same kernel, and what a trace could change is the call, not the model.
@pytest.mark.parametrize(("cfg", "traced"), [(c, False) for c in _CFGS] + [(_CFGS[0], True), (_CFGS[-1], True)])
def test_fused_steps_equal_the_torch_attention(cfg, traced):
    """Rows at every stage (empty, part-filled, wrapped several times) of a slot table, 14 steps past every
    ring's wrap, batch 7 (the C products' rows): the kernels match the torch ops to float rounding."""
    model = _model(**cfg)
    plain, fast = Decoder(model, mem_len=6, traced=traced, fused=False), Decoder(model, mem_len=6, traced=traced)
    assert fast.fused and not plain.fused
    _same_steps(plain, fast, [0, 1, 5, 6, 7, 13, 30], steps=14)


@pytest.mark.parametrize("mem_len", [40, 64, 150])
def test_long_rings_are_read_in_chunks_and_prefetched_exactly(mem_len):
    """Rings longer than the kernel's 64-slot passes (and not a multiple of them: the table has mem_len + 1
    rows), where it prefetches along each row's keys and values and into the next row's: the same numbers."""
    model = _model()
    plain, fast = Decoder(model, mem_len=mem_len, fused=False), Decoder(model, mem_len=mem_len)
    _same_steps(plain, fast, [0, 1, mem_len - 1, mem_len, mem_len + 1, 3 * mem_len + 5], steps=3)


@pytest.mark.parametrize(("chunk", "traced"), [(c, False) for c in (2, 3, 5, 6, 7, fused.MAX_CHUNK)]
                         + [(3, True), (fused.MAX_CHUNK, True)])
def test_short_prompts_read_in_one_kernel_call_equal_the_torch_attention(chunk, traced):
    """A short prompt's tokens attend in one call, reading the ring once: each sees itself, the prompt's tokens
    before it and exactly the ring slots within its window (fewer for later tokens, none for a token mem_len
    into the chunk: chunks 6..8 with mem_len 6), on rows at every stage; the same numbers as the torch ops."""
    model = _model(clamp_len=4) if chunk == 5 else _model()
    plain = Decoder(model, mem_len=6, traced=traced, fused=False)
    fast = Decoder(model, mem_len=6, traced=traced)
    _same_steps(plain, fast, [0, 1, 4, 5, 6, 7, 13, 30], steps=4, chunk=chunk)


def test_long_rings_read_once_for_a_short_prompt_equal_the_torch_attention():
    model = _model()
    plain, fast = Decoder(model, mem_len=150, fused=False), Decoder(model, mem_len=150)
    _same_steps(plain, fast, [0, 3, 149, 150, 151, 455], steps=2, chunk=4)


def test_a_traced_fused_step_calls_the_kernel_once_per_layer():
    """The trace records the registered op, so a traced step is still one graph, with one kernel call per layer."""
    decoder = Decoder(_model(n_layer=3), mem_len=6, traced=True)
    decoder.warm_up()
    nodes = [n.kind() for n in decoder.one_token_graph().inlined_graph.nodes()]
    assert nodes.count("txlserve::attend_one") == 3
    assert nodes.count("txlserve::linear_rows") == 3 * 4  # query/key/value, output, and the two feed-forward
    assert "aten::softmax" not in nodes and "aten::gather" not in nodes  # the torch attention is not in it


def test_rows_in_any_ring_layout_give_the_same_result():
    """The kernel takes strides: a row-major ring (as on a GPU) and the CPU's column-major one agree."""
    torch.manual_seed(0)
    bsz, heads, m, dh = 3, 2, 7, 5
    qkv, u, vb = torch.randn(bsz, 1, 3 * heads * dh), torch.randn(heads, dh), torch.randn(heads, dh)
    table = torch.randn(heads, m + 1, dh)
    k, v = torch.randn(bsz, heads, m, dh), torch.randn(bsz, heads, m, dh)
    seen = torch.tensor([0, 4, 23])
    k2, v2 = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (k, v))
    out = fused.attend_one(qkv, u, vb, k, v, table, seen, 0.5)
    out2 = fused.attend_one(qkv, u, vb, k2, v2, table.transpose(-1, -2).contiguous().transpose(-1, -2), seen, 0.5)
    torch.testing.assert_close(out2, out, rtol=1e-6, atol=1e-6)
    assert torch.equal(k, k2) and torch.equal(v, v2)
    _, key, value = qkv.view(bsz, 3, heads, dh).unbind(1)
    for row, n in enumerate(seen.tolist()):  # the token's key and value went to slot seen % mem_len
        assert torch.equal(k[row, :, n % m], key[row]) and torch.equal(v[row, :, n % m], value[row])


@pytest.mark.parametrize(("bsz", "heads", "m", "dh", "chunk"), [(5, 3, 9, 4, 1), (20, 3, 150, 16, 1),
                                                                (20, 3, 150, 16, 3)])
def test_rows_split_across_threads_give_the_same_bits(bsz, heads, m, dh, chunk):
    """The op splits (row, head) pairs over torch's intra-op threads, which groups a head's rows differently for
    their shared pass over the position table (60 rows: one thread groups rows 20-35 of head 1, the second of two
    threads starts at row 30): two threads give one thread's result, bit for bit."""
    torch.manual_seed(1)
    qkv, u, vb = torch.randn(bsz, chunk, 3 * heads * dh), torch.randn(heads, dh), torch.randn(heads, dh)
    table = column_major(torch.randn(heads, m + 1, dh))
    seen = torch.arange(bsz) * 7 % (3 * m)
    rings = torch.randn(2, bsz, heads, m, dh)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            k, v = (column_major(t) for t in rings.clone().unbind(0))
            results.append((fused.attend_one(qkv, u, vb, k, v, table, seen, 0.3), k, v))
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        assert torch.equal(one, two)


def test_batches_larger_than_a_position_group_equal_the_torch_attention():
    """A head's rows share one pass over its position table, 16 queries at a time: 19 rows (a group, then three),
    and short prompts of 3 tokens (groups of five rows), at every ring stage, give the torch ops' numbers."""
    model = _model()
    plain, fast = Decoder(model, mem_len=150, fused=False), Decoder(model, mem_len=150)
    lengths = [0, 1, 3, 70, 149, 150, 151, 299, 300, 455, 2, 5, 80, 120, 148, 160, 200, 310, 600]
    _same_steps(plain, fast, lengths, steps=2)
    _same_steps(plain, fast, lengths, steps=2, chunk=3)


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 64, 65, 130])
@pytest.mark.parametrize("layout", ["row-major", "column-major", "strided"])
@pytest.mark.parametrize("shape", [(768, 256), (256, 1024), (5, 7), (130, 2)])
def test_few_row_products_equal_torch_linear(rows, layout, shape):
    """``linear_rows`` is ``F.linear``: the C loops on either weight layout (odd sizes: a column pass takes four
    at a time, threads split outputs in blocks of 64, rows go in blocks of 64 with 1 or 2 left over), torch's own
    product for a weight with no unit stride."""
    torch.manual_seed(rows)
    out, inp = shape
    w = torch.randn(out, inp) / inp ** 0.5
    if layout == "column-major":
        w = column_major(w)
    elif layout == "strided":
        w = torch.randn(out, 2 * inp)[:, ::2]
    x, bias = torch.randn(rows, 1, inp), torch.randn(out)
    for b in (bias, None):
        got, want = fused.linear_rows(x, w, b), torch.nn.functional.linear(x, w, b)
        assert got.shape == want.shape == (rows, 1, out)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused.linear_rows(x.double(), w.double(), None), torch.nn.functional.linear(x.double(),
                                                                                              w.double()))


@pytest.mark.parametrize("rows", [1, 3, 64, 130])
@pytest.mark.parametrize("n", [5, 64, 641])
def test_batched_products_equal_torch_matmul(rows, n):
    """``matmul`` (a chunked prefill's attention products) is ``a @ b`` for each leading entry, whatever b's
    strides (the keys and the position table come transposed, a slice of the probabilities is not contiguous), and
    gives the same bits on one thread or two; float64 and mismatched sizes are torch's own."""
    torch.manual_seed(rows + n)
    a, b = torch.randn(2, 3, rows, 70), torch.randn(2, 3, n, 70).transpose(-1, -2)  # b [2, 3, 70, n], strided
    got = fused.matmul(a, b)
    torch.testing.assert_close(got, a @ b, rtol=1e-5, atol=1e-5)
    wide = torch.randn(2, 3, rows, n + 9)[..., 4:n + 4]  # a slice of a wider row
    torch.testing.assert_close(fused.matmul(wide, b.transpose(-1, -2)), wide @ b.transpose(-1, -2),
                               rtol=1e-5, atol=1e-4)  # sums of up to 641 products near 1: a few ulps of 25
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(fused.matmul(a, b), got)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(fused.matmul(a.double(), b.double()), a.double() @ b.double())
    shared = torch.randn(3, 70, n)  # broadcast over a's first size, as torch.matmul does
    assert torch.equal(fused.matmul(a, shared), a @ shared)
    with pytest.raises(RuntimeError):
        fused.matmul(a, torch.randn(2, 3, 71, n))
    with pytest.raises(RuntimeError):  # six entries, but not a's [2, 3]: never paired up by flattening
        fused.matmul(a, torch.randn(6, 70, n))


@pytest.mark.parametrize("bad", ["in", "bias", "weight-dims"])
def test_few_row_products_refuse_what_torch_linear_refuses(bad):
    """Sizes that do not fit go to torch's product, which raises its own error: never a C read out of bounds."""
    x, w, b = torch.randn(2, 8), torch.randn(5, 8), torch.randn(5)
    if bad == "in":
        w = torch.randn(5, 7)
    elif bad == "bias":
        b = torch.randn(4)
    else:
        w = torch.randn(5, 8, 1)
    with pytest.raises(RuntimeError) as want:
        torch.nn.functional.linear(x, w, b)
    with pytest.raises(RuntimeError) as got:
        fused.linear_rows(x, w, b)
    assert type(got.value) is type(want.value)


@pytest.mark.parametrize("rows", [2, 9])
def test_few_row_products_split_across_threads_give_the_same_bits(rows):
    """Threads split the outputs at multiples of 64, so each output is computed by the same instructions (the
    streaming loops below 4 rows, register tiles from 4 on, with rows left over)."""
    torch.manual_seed(2)
    w, x = column_major(torch.randn(1000, 70)), torch.randn(rows, 70)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append([fused.linear_rows(x, w, None), fused.linear_rows(x, w.contiguous(), None)])
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        assert torch.equal(one, two)


def test_a_row_with_nothing_before_it_attends_to_itself():
    """An empty ring: the output is the token's own value, whatever the ring holds."""
    heads, m, dh = 2, 4, 3
    qkv = torch.randn(1, 1, 3 * heads * dh)
    k, v = torch.full((1, heads, m, dh), 1e3), torch.full((1, heads, m, dh), 1e3)
    out = fused.attend_one(qkv, torch.zeros(heads, dh), torch.zeros(heads, dh), k, v,
                           torch.randn(heads, m + 1, dh), torch.tensor([0]), 1.0)
    torch.testing.assert_close(out, qkv[..., 2 * heads * dh:])


@pytest.mark.parametrize("bad", ["float64", "table", "qkv", "seen", "d_head", "chunk"])
def test_the_op_refuses_tensors_it_was_not_written_for(bad):
    """The C code trusts pointers and strides: a mismatch is a ValueError before it runs, never a wild write."""
    heads, m, dh = 2, 4, 3
    args = dict(qkv=torch.randn(2, 1, 3 * heads * dh), u=torch.zeros(heads, dh), vb=torch.zeros(heads, dh),
                k=torch.zeros(2, heads, m, dh), v=torch.zeros(2, heads, m, dh), table=torch.zeros(heads, m + 1, dh),
                seen=torch.tensor([1, 2]))
    if bad == "float64":
        args["k"] = args["k"].double()
    elif bad == "table":
        args["table"] = torch.zeros(heads, m, dh)  # one row short: the kernel would read past it
    elif bad == "qkv":
        args["qkv"] = torch.randn(2, 1, 6 * heads * dh)[..., ::2]  # every other float: the kernel reads them in a row
    elif bad == "seen":
        args["seen"] = torch.tensor([1, 2], dtype=torch.int32)
    elif bad == "chunk":
        args["qkv"] = torch.randn(2, fused.MAX_CHUNK + 1, 3 * heads * dh)  # the kernel keeps MAX_CHUNK queries
    else:
        args.update(k=torch.zeros(2, heads, m, 2000), v=torch.zeros(2, heads, m, 2000),
                    table=torch.zeros(heads, m + 1, 2000), u=torch.zeros(heads, 2000), vb=torch.zeros(heads, 2000),
                    qkv=torch.zeros(2, 1, 3 * heads * 2000))
    with pytest.raises(ValueError, match="attend_one"):
        fused.attend_one(**args, scale=1.0)


def test_decoders_use_the_kernel_only_where_it_applies():
    """Float32 on a CPU by default; asked not to, or for another dtype, the torch ops (which are exact)."""
    assert Decoder(_model(), mem_len=6).fused
    assert not Decoder(_model(), mem_len=6, fused=False).fused
    assert not Decoder(_model().double(), mem_len=6).fused


def test_without_a_compiler_the_kernel_is_off_and_says_why(monkeypatch, caplog):
    """No compiler, or one that fails: no kernel (the attention runs as torch ops), and one log line why."""
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.INFO, logger="model.fused"):
        assert fused._build() is None
    assert "no C/C++ compiler (/nonexistent/cc)" in caplog.text
    monkeypatch.delenv("CC")
    monkeypatch.setenv("CXX", "/nonexistent/c++")  # the op's C++ half needs one too
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="model.fused"):
        assert fused._build() is None
    assert "no C/C++ compiler (" in caplog.text and "/nonexistent/c++)" in caplog.text
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("CC", "false")  # exists, always fails
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="model.fused"):
        assert fused._build() is None
    assert "building it failed" in caplog.text


def test_compilers_are_read_as_make_reads_them(monkeypatch, tmp_path):
    """``CC``/``CXX`` may carry arguments (``CC="ccache gcc"``); they are part of the cache key, and the cache
    follows ``XDG_CACHE_HOME``. (The next test builds with such a ``CC``.)"""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "cc -DTXL_TEST_ARG=1")
    assert fused._command("CC", "cc") == ["cc", "-DTXL_TEST_ARG=1"]
    with_arg = fused._cached(fused._command("CC", "cc"), fused._command("CXX", "c++"))
    assert with_arg is not None and with_arg.parent == tmp_path / "txlserve" / "kernels"
    plain = fused._cached(["cc"], ["c++"])
    assert plain is not None and plain.name != with_arg.name  # another command, another library
    monkeypatch.setenv("CC", "  ")
    assert fused._command("CC", "cc") == ["cc"]


def test_the_library_is_built_once_per_machine_and_without_a_cache_still_built(monkeypatch, tmp_path, caplog):
    """The cache is keyed by sources, torch, compilers and CPU: a second process loads the same file. Where the
    cache cannot be written, the library goes to a directory of this process's own. The build here runs with a
    ``CC`` that carries an argument (so it is a new build, and the argument reaches the compiler as a word)."""
    cached = fused._build()
    assert cached is not None and cached.parent == fused._cache_dir() and fused._build() == cached
    # the second build is of small sources of its own (the first built the real ones: theirs took 15 s here); its C
    # file compiles only if the argument in CC reached the compiler
    (tmp_path / "k.c").write_text("#ifndef TXL_TEST_ARG\n#error CC's argument did not arrive\n#endif\n"
                                  "int txl_test_kernel(void) { return TXL_TEST_ARG; }\n")
    (tmp_path / "ops.cpp").write_text("extern \"C\" int txl_test_kernel(void);\n"
                                      "extern \"C\" int txl_test_op() { return txl_test_kernel(); }\n")
    monkeypatch.setattr(fused, "C_SOURCES", (tmp_path / "k.c",))
    monkeypatch.setattr(fused, "SOURCES", (tmp_path / "k.c", tmp_path / "ops.cpp"))
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # a file: no directory can be made under it
    monkeypatch.setenv("CC", "cc -DTXL_TEST_ARG=1")
    with caplog.at_level(logging.INFO, logger="model.fused"):
        own = fused._build()
    expected = fused._cached(fused._command("CC", "cc"), fused._command("CXX", "c++"))
    assert own is not None and expected is not None and own.name == expected.name != cached.name
    assert own.parent != cached.parent and own.parent != expected.parent
    assert "not cached" in caplog.text and "built the fused decode attention" in caplog.text
    own.unlink()
    own.parent.rmdir()


def test_loading_the_kernel_leaves_the_process_floating_point_mode_alone():
    """Built with -ffast-math but linked without it: denormals still exist for Python and torch after loading
    (GCC links a -ffast-math shared library with code that flushes them to zero process-wide)."""
    assert fused.available()
    assert 5e-324 > 0.0 and (torch.tensor(1e-40) * torch.tensor(1.0)).item() > 0.0


def test_a_model_in_training_mode_keeps_the_torch_attention(monkeypatch):
    """The kernel has no attention dropout: a decoder whose model is put back in training mode uses the torch ops."""
    model = _model(dropatt=0.5)
    decoder = Decoder(model, mem_len=6, traced=False)
    assert decoder.fused
    state, tokens = decoder.empty(2), torch.zeros(2, 1, dtype=torch.long)
    calls = []
    monkeypatch.setattr(fused, "attend_one", lambda *a, **k: calls.append(1) or pytest.fail("kernel in training"))
    model.train()
    decoder.forward(state.hid, state.k, state.v, state.seen, tokens)
    assert calls == []
    model.eval()
    with pytest.raises(pytest.fail.Exception):
        decoder.forward(state.hid, state.k, state.v, state.seen, tokens)
    assert calls == [1]


@pytest.mark.parametrize("chunk_kernels", [True, False])
def test_long_calls_equal_the_torch_decoder_with_either_products(chunk_kernels, monkeypatch):
    """Calls longer than MAX_CHUNK tokens (a prefill's chunks, a restored session's keys and values) take their
    products from the C tiles or from torch, as tune_products chose: the same numbers either way, and the choice
    is the one taken, by the projections and the attention's products alike."""
    model = _model()
    plain, fast = Decoder(model, mem_len=6, fused=False), Decoder(model, mem_len=6, traced=False)  # eager: seen
    fast.chunk_kernels = chunk_kernels
    calls: list[tuple[str, torch.Size]] = []
    for name in ("linear_rows", "matmul", "chunk_softmax"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, name=name, real=real: calls.append((name, a[0].shape)) or real(*a))
    long = fused.MAX_CHUNK + 3
    _same_steps(plain, fast, [0, 1, 5, 13], steps=3, chunk=long)
    # the probabilities in one C pass either way
    assert {n for n, shape in calls if long in shape} == ({"linear_rows", "matmul"} if chunk_kernels else set()) | {
        "chunk_softmax"}
    calls.clear()
    hid = torch.randn(model.cfg.n_layer, long, model.cfg.d_model)  # [n_layer, m, d_model]
    for got, want in zip(fast.project_kv(hid), plain.project_kv(hid)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert bool(calls) == chunk_kernels
    calls.clear()
    fast.advance(fast.empty(2), torch.zeros(2, 1, dtype=torch.long))  # a decode step: the tiles either way
    assert calls


@pytest.mark.parametrize("chunk_kernels", [True, False])
def test_a_young_rings_chunks_score_only_its_written_slots(chunk_kernels, monkeypatch):
    """A prefill chunk of a session that has not filled its ring scores the slots written so far and the
    distances they reach, not the whole ring (mem_len 1,048,576: a 3,000-token prompt took 109 s, 60 s now): the
    rest are never read. The same numbers as scoring the whole ring, to the rounding of a narrower product."""
    import model.cache as cache_mod

    model, m, chunk = _model(), 24, fused.MAX_CHUNK + 3
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 5 * chunk), generator=torch.Generator().manual_seed(1))
    filled: list[int | None] = []
    made = cache_mod.RingCache.__init__

    def run(rows: int, whole: bool = False) -> torch.Tensor:  # every chunk's outputs and the last scores
        def init(self, *args, **kw) -> None:
            made(self, *args, **kw)
            filled.append(self.filled)
            if whole:
                self.filled = None

        monkeypatch.setattr(cache_mod.RingCache, "__init__", init)
        decoder = Decoder(model, mem_len=m, traced=False)
        decoder.chunk_kernels = chunk_kernels
        state = decoder.empty(rows)
        outs = [decoder.advance(state, tokens[:rows, s:s + chunk]) for s in range(0, tokens.size(1), chunk)]
        return torch.cat([torch.cat(outs, 1).flatten(1), state.last_logits], 1)  # [rows, outputs and scores]

    young = run(1)
    assert filled == [0, chunk, 2 * chunk, m, m]  # two young calls, then the ring's
    filled.clear()
    assert torch.equal(run(1), young)  # a session's own numbers, every time
    torch.testing.assert_close(run(1, whole=True), young, rtol=1e-5, atol=1e-5)
    filled.clear()
    both = run(2)  # several sessions: the slots any of them wrote
    assert filled == [0, chunk, 2 * chunk, m, m]
    torch.testing.assert_close(both, run(2, whole=True), rtol=1e-5, atol=1e-5)


def _chunk_scores(n: int, heads: int, chunk: int, m: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    ring = 3 * torch.randn(n, heads, chunk, m, generator=g)  # [n, H, chunk, m]
    own = 3 * torch.randn(n, heads, chunk, chunk, generator=g)  # [n, H, chunk, chunk]
    pos = 3 * torch.randn(heads, n, chunk, m + 1, generator=g)  # [H, n, chunk, m+1]
    return ring, own, pos


def _torch_chunk_probs(ring, own, pos, seen) -> torch.Tensor:
    """What the torch attention makes of the same scores: joined, gathered by distance, added, masked, softmax."""
    n, heads, chunk, m = ring.shape
    cache = RingCache(torch.zeros(n, m, 1), torch.zeros(n, heads, m, 1), torch.zeros(n, heads, m, 1), seen,
                      torch.zeros(1, heads, m + 1, 1), chunk, fused=False)
    dist, blocked = cache.positions.dist, cache.positions.blocked  # [n, 1, chunk, m+chunk]
    bd = pos.transpose(0, 1).gather(-1, dist.expand(n, heads, chunk, -1))  # [n, H, chunk, m+chunk]
    return torch.softmax(torch.cat([ring, own], -1).add(bd).masked_fill(blocked, float("-inf")), -1)


@pytest.mark.parametrize(("m", "chunk", "seen"), [
    (8, 16, [0]),  # an empty ring: each query sees the chunk's tokens within 8 of it
    (8, 16, [3]),  # a part-filled one
    (32, 20, [0, 45, 32]),  # empty, wrapped, full and unwrapped, in one batch
    (16, 40, [5, 16, 17]),  # a chunk longer than the ring: its later queries see nothing of the ring
    (7, 9, [13, 6]),  # a ring length of no special size
    (512, 256, [512, 1000]),  # a prefill chunk of 6 x 256 at mem_len 512
])
def test_a_chunks_probabilities_in_one_pass_equal_the_torch_attention(m, chunk, seen):
    """The five passes of the torch attention (join, gather by distance, add, mask, softmax) and the kernel's one
    give the same probabilities for every query: each window (ring slots in view, the chunk up to itself, nothing
    more than mem_len back) and every blocked score 0."""
    seen = torch.tensor(seen)
    ring, own, pos = _chunk_scores(len(seen), 3, chunk, m)
    want = _torch_chunk_probs(ring, own, pos, seen)
    fused.chunk_softmax(ring, own, pos, seen)
    torch.testing.assert_close(torch.cat([ring, own], -1), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.cat([ring, own], -1) == 0, want == 0)


def test_a_chunks_probabilities_split_across_threads_give_the_same_bits():
    seen = torch.tensor([0, 70, 301])
    ring, own, pos = _chunk_scores(3, 4, 37, 64, seed=1)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            r, o = ring.clone(), own.clone()
            fused.chunk_softmax(r, o, pos, seen)
            results.append((r, o))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("bad", ["float64", "own", "own-heads", "pos", "pos-heads", "strided", "seen-dtype",
                                 "seen-length", "seen-negative", "overlap"])
def test_the_chunk_softmax_refuses_tensors_it_was_not_written_for(bad):
    ring, own, pos = _chunk_scores(2, 2, 5, 6)
    seen = torch.tensor([0, 9])
    if bad == "own-heads":
        own = own[:, :1].contiguous()
    elif bad == "pos-heads":
        pos = pos[:1].contiguous()
    elif bad == "seen-length":
        seen = torch.tensor([0, 9, 3])
    elif bad == "overlap":
        own = ring.view(-1)[:own.numel()].view(own.shape)  # the same memory as the ring's first rows
    elif bad == "float64":
        ring = ring.double()
    elif bad == "own":
        own = own[..., :4].contiguous()
    elif bad == "pos":
        pos = pos[..., :6].contiguous()
    elif bad == "strided":
        ring = ring.transpose(2, 3).contiguous().transpose(2, 3)
    elif bad == "seen-dtype":
        seen = seen.int()
    else:
        seen = torch.tensor([0, -1])
    refused = (RuntimeError, "single memory location") if bad == "overlap" else (ValueError, "txlserve::chunk_softmax")
    with pytest.raises(refused[0], match=refused[1]):
        fused.chunk_softmax(ring, own, pos, seen)


@pytest.mark.parametrize(("m", "chunk", "seen"), [(6, 11, [0, 3, 5, 17]), (8, 3, [6, 7]), (5, 5, [0]),
                                                  (16, 40, [13])])
def test_ring_stores_as_slices_equal_the_indexed_stores(m, chunk, seen):
    """A CPU call's stores by slices (one run of the ring a row, two where it wraps) and the indexed ones give the
    same rings, column-major ones too."""
    n, heads, dh, d = len(seen), 2, 4, 3
    g = torch.Generator().manual_seed(5)
    h, k, v = (torch.randn(n, chunk, d, generator=g), torch.randn(n, heads, chunk, dh, generator=g),
               torch.randn(n, heads, chunk, dh, generator=g))
    seen_t = torch.tensor(seen)
    hid, kr, vr = torch.zeros(n, m, d), column_major(torch.zeros(n, heads, m, dh)), torch.zeros(n, heads, m, dh)
    cache = RingCache(hid[None], kr[None], vr[None], seen_t, torch.zeros(1, heads, m + 1, dh), chunk,
                      fused=False).layer(0)  # one layer's
    cache.store(h, k, v)
    want = torch.zeros(n, m, d), torch.zeros(n, heads, m, dh), torch.zeros(n, heads, m, dh)  # the indexed stores
    keep = cache.slots.size(1)
    want[0][cache.rows, cache.slots] = h[:, -keep:]
    want[1][cache.rows, :, cache.slots] = k[:, :, -keep:].transpose(1, 2)
    want[2][cache.rows, :, cache.slots] = v[:, :, -keep:].transpose(1, 2)
    rings = [(hid, kr, vr), want]
    for got, want in zip(*rings):
        assert torch.equal(got, want)


@pytest.mark.parametrize("which", ["chunk", "step"])
def test_tuning_keeps_torchs_products_only_where_clearly_faster_and_decides_once(which, monkeypatch, caplog):
    """A prefill chunk's products (tune_products) and a decode step's (tune_step_products) are timed both ways and
    torch's kept only where clearly faster; once per shape and thread count in a process (engines agree)."""
    from model import decode

    monkeypatch.setattr(decode, "_TUNED", {})
    model = _model()
    chunk = which == "chunk"
    tune = (lambda d: d.tune_products(32)) if chunk else (lambda d: d.tune_step_products(rows=4))
    kept = (lambda d: d.chunk_kernels) if chunk else (lambda d: d.step_kernels)
    first = Decoder(model, mem_len=6)
    with caplog.at_level(logging.INFO, logger="model.decode"):
        tuned = tune(first)
    assert tuned["kernel_ms"] > 0 and tuned["torch_ms"] > 0
    assert kept(first) == (not tuned["torch_ms"] < decode.TORCH_MARGIN * tuned["kernel_ms"])
    assert ("a prefill chunk's products (32 tokens)" if chunk else "a decode step's products (4 rows)") in caplog.text
    (key,) = decode._TUNED
    second = Decoder(model, mem_len=6)
    for kernel_ms, torch_ms, kernels in ((2.0, 1.0, False), (1.0, 2.0, True), (1.0, 0.97, True)):
        decode._TUNED[key] = {"kernel_ms": kernel_ms, "torch_ms": torch_ms}
        assert tune(second) == decode._TUNED[key] and kept(second) == kernels
        assert second.kernel_products(32 if chunk else fused.MAX_CHUNK) == kernels
    if chunk:
        assert second.tune_products(fused.MAX_CHUNK) is None  # calls that short are a step's
    assert tune(Decoder(model, mem_len=6, fused=False)) is None  # no kernels, nothing to choose
    assert len(decode._TUNED) == 1


@pytest.mark.parametrize("which", ["chunk", "step"])
def test_tuning_times_a_ring_of_at_most_tune_ring_slots(which, monkeypatch):
    """The products were timed against a full ring of mem_len slots, 16 of them for a step: at mem_len 65,536 the
    bundled model's start-up took 40 s and 13 GB, and the tiny model's at 1,048,576 did not end. The attention both
    ways grows alike with the ring past a few thousand slots, so a ring of TUNE_RING slots decides as well."""
    from model import decode

    monkeypatch.setattr(decode, "_TUNED", {})
    monkeypatch.setattr(decode, "TUNE_RING", 8)
    rings = []
    empty = Decoder.empty

    def spy(self, batch=1, **kw):
        state = empty(self, batch, **kw)
        rings.append(state.k.size(3))
        return state

    monkeypatch.setattr(Decoder, "empty", spy)
    for mem_len, ring in ((40, 8), (6, 6)):
        decoder = Decoder(_model(), mem_len=mem_len)
        rings.clear()
        tuned = decoder.tune_products(32) if which == "chunk" else decoder.tune_step_products(rows=4)
        assert tuned["kernel_ms"] > 0 and tuned["torch_ms"] > 0  # the C kernels ran on the shorter ring
        assert rings == [ring]


def test_engine_prefill_products_setting(tmp_path, monkeypatch):
    from model import decode
    from model.checkpoint import save_checkpoint
    from model.engine import Engine
    from txlserve.errors import ConfigError

    monkeypatch.setattr(decode, "_TUNED", {})
    save_checkpoint(_model(), tmp_path / "ck")
    assert not Engine.from_checkpoint(tmp_path / "ck", prefill_products="torch").decoder.chunk_kernels
    assert Engine.from_checkpoint(tmp_path / "ck", prefill_products="kernel").decoder.chunk_kernels
    assert not decode._TUNED  # fixed: nothing timed
    Engine.from_checkpoint(tmp_path / "ck")
    assert len(decode._TUNED) == 2  # auto: timed at load, a prefill chunk's products and a decode step's
    with pytest.raises(ConfigError, match="prefill_products"):
        Engine.from_checkpoint(tmp_path / "ck", prefill_products="mkl")


# Keys and values absorbed (kernels/attend_absorbed.c): d_model a multiple of 64, at most four heads
ABSORBABLE = dict(d_model=64, n_head=4, d_head=8, d_inner=64)


def _wide_model(**kw) -> torch.nn.Module:
    """``_model`` at d_model 64 or more, its weights scaled to keep activations of _model's size (at 0.3 a
    d_model of 128 made keys of 45, whose products' rounding alone passed 1e-4 before any attention ran)."""
    model = _model(**(ABSORBABLE | kw))
    for p in model.parameters():
        p.data.mul_((16 / model.cfg.d_model) ** 0.5) if p.dim() > 1 else None
    return model


def _poisoned_step(plain: Decoder, fast: Decoder, kind: type, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of rows prefilled to ``lengths``, with ``fast``'s key and value rings overwritten by NaN first: the
    scores of ``plain`` (intact rings) and ``fast``. An absorbed step reads the layer inputs alone, so its scores
    are plain's; a step that reads keys or values is NaN."""
    a, b = _table(plain, lengths), _table(fast, lengths, kind)  # the torch attention reads no row table
    for state in (b.states if isinstance(b, RowTable) else [b.table]):
        state.k.fill_(float("nan"))
        state.v.fill_(float("nan"))
    tokens = torch.randint(0, 256, (len(lengths), 1), generator=torch.Generator().manual_seed(5))
    va, vb = a.active(), b.active()
    plain.advance(va, tokens)
    fast.advance(vb, tokens)
    return va.last_logits, vb.last_logits


_WIDE_CFGS = [dict(), dict(clamp_len=3), dict(n_head=1, d_head=16), dict(n_head=3, d_head=8),
              dict(d_model=128, n_head=2, d_head=32)]


@pytest.mark.parametrize(("cfg", "traced"), [(c, False) for c in _WIDE_CFGS] + [(_WIDE_CFGS[0], True),
                                                                                 (_WIDE_CFGS[-1], True)])
def test_absorbed_steps_equal_the_torch_attention(cfg, traced):
    """A step that reads the layer inputs' ring for its keys and values (``W_k h``, ``W_v h`` absorbed into the
    query and the output) gives the torch attention's numbers: rows empty, part-filled, full and wrapped at every
    offset, rings longer than the kernel's 64-slot tiles and not a multiple of them, one to four heads, three
    steps (each stores its key, value and input for the next)."""
    model = _wide_model(**cfg)
    plain = Decoder(model, mem_len=70, traced=traced, fused=False)
    fast = Decoder(model, mem_len=70, traced=traced, absorb_min_bytes=0)
    _same_steps(plain, fast, [0, 1, 63, 64, 69, 70, 71, 135, 200], steps=3)


@pytest.mark.parametrize("kind", [SlotTable, RowTable])
def test_an_absorbed_step_reads_the_layer_inputs_and_not_the_keys_and_values(kind):
    """Both tables (a batch tensor's rows, sessions where they lie): with the threshold met, the step's scores
    do not depend on the key and value rings at all; one byte short of it, they do (the kernel that reads them)."""
    model = _wide_model()
    plain = Decoder(model, mem_len=40, fused=False)
    lengths = [0, 5, 40, 93]
    at = len(lengths) * 40 * 2 * 4 * 8 * 4  # the step's keys and values of a layer, in bytes
    fast = Decoder(model, mem_len=40, absorb_min_bytes=at)
    want, got = _poisoned_step(plain, fast, kind, lengths)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert fast.absorbs(len(lengths)) and not fast.absorbs(len(lengths) - 1)  # what bench decode reports
    for short in (Decoder(model, mem_len=40, absorb_min_bytes=at + 1), Decoder(model, mem_len=40,
                                                                                  absorb_min_bytes=None)):
        _, got = _poisoned_step(plain, short, kind, lengths)
        assert got.isnan().all() and not short.absorbs(len(lengths))


@pytest.mark.parametrize("cfg", [dict(n_head=5, d_head=8), dict(d_model=48, d_head=12), dict(pre_lnorm=True)])
def test_models_the_absorbed_kernel_cannot_serve_keep_the_keys_and_values(cfg):
    """Five heads (five times the multiply-adds), a d_model not a multiple of 64, and pre_lnorm (keys come from
    the normalised input, not the ring's): the step reads the keys and values, and is right."""
    model = _wide_model(**cfg)
    plain, fast = Decoder(model, mem_len=40, fused=False), Decoder(model, mem_len=40, absorb_min_bytes=0)
    _, got = _poisoned_step(plain, fast, SlotTable, [3, 50])
    assert got.isnan().all() and not fast.absorbs(2)
    _same_steps(plain, fast, [0, 3, 50], steps=2)


def test_absorbed_rows_split_across_threads_give_the_same_bits():
    """The op splits a batch's rows over torch's intra-op threads: two threads give one thread's result."""
    torch.manual_seed(2)
    bsz, heads, m, dh, d = 9, 4, 100, 16, 128
    qkv, u, vb = torch.randn(bsz, 1, 3 * heads * dh), torch.randn(heads, dh), torch.randn(heads, dh)
    table, hid = column_major(torch.randn(heads, m + 1, dh)), torch.randn(bsz, m, d)
    kv = column_major(torch.randn(2 * heads * dh, d) / 8)
    seen = torch.arange(bsz) * 37 % (3 * m)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            k, v = column_major(torch.zeros(bsz, heads, m, dh)), column_major(torch.zeros(bsz, heads, m, dh))
            results.append((fused.attend_one(qkv, u, vb, k, v, table, seen, 0.25, hid, kv, 0), k, v))
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        assert torch.equal(one, two)


@pytest.mark.parametrize("kv_layout", ["row", "column"])
@pytest.mark.parametrize("table_layout", ["row", "column"])
def test_the_absorbed_op_equals_the_keys_and_values_for_weights_and_tables_stored_either_way(kv_layout, table_layout):
    """The products around the kernel (queries through W_k, the position scores, the output through W_v) are the
    register tiles', which read a weight by its strides: row- and column-major weights and position tables give
    the keys' and values' answer, with rings holding W_k h and W_v h."""
    torch.manual_seed(3)
    bsz, heads, m, dh, d = 5, 3, 70, 16, 64
    qkv, u, vb = torch.randn(bsz, 1, 3 * heads * dh), torch.randn(heads, dh), torch.randn(heads, dh)
    hid, kv = torch.randn(bsz, m, d), torch.randn(2 * heads * dh, d) / 8
    table = torch.randn(heads, m + 1, dh)
    seen = torch.tensor([0, 1, 69, 70, 171])
    k = (hid @ kv[: heads * dh].T).view(bsz, m, heads, dh).transpose(1, 2).contiguous()  # [B, H, M, Dh]
    v = (hid @ kv[heads * dh:].T).view(bsz, m, heads, dh).transpose(1, 2).contiguous()
    want = fused.attend_one(qkv, u, vb, k.clone(), v.clone(), table, seen, 0.25)
    layout = {"row": lambda t: t.contiguous(), "column": column_major}
    got = fused.attend_one(qkv, u, vb, k.clone(), v.clone(), layout[table_layout](table), seen, 0.25, hid,
                           layout[kv_layout](kv), 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_absorbed_op_refuses_a_ring_of_inputs_of_another_shape():
    heads, m, dh, d = 2, 4, 3, 64
    args = dict(qkv=torch.randn(2, 1, 3 * heads * dh), u=torch.zeros(heads, dh), vb=torch.zeros(heads, dh),
                k=torch.zeros(2, heads, m, dh), v=torch.zeros(2, heads, m, dh), table=torch.zeros(heads, m + 1, dh),
                seen=torch.tensor([1, 2]), scale=1.0, kv=torch.zeros(2 * heads * dh, d), absorb_min_bytes=0)
    with pytest.raises(ValueError, match="hid must be"):
        fused.attend_one(**args, hid=torch.zeros(2, m + 1, d))  # one slot more than the rings: a read past them
    with pytest.raises(ValueError, match="hid must be"):
        fused.attend_one(**args, hid=torch.zeros(2, m, d).transpose(1, 2).contiguous().transpose(1, 2))
    fused.attend_one(**args, hid=torch.zeros(2, m, d))  # and the right one runs


@pytest.mark.parametrize(("heads", "d"), [(5, 64), (2, 48)])
def test_the_op_itself_keeps_keys_and_values_for_what_the_absorbed_kernel_cannot_serve(heads, d):
    """The op checks the kernel's limits too (a Decoder already passes no weights for such a model): five heads,
    or a d_model not a multiple of 64, read the key and value rings (here NaN), whatever the threshold."""
    m, dh = 8, 4
    args = dict(qkv=torch.randn(2, 1, 3 * heads * dh), u=torch.zeros(heads, dh), vb=torch.zeros(heads, dh),
                k=torch.full((2, heads, m, dh), float("nan")), v=torch.full((2, heads, m, dh), float("nan")),
                table=torch.zeros(heads, m + 1, dh), seen=torch.tensor([3, 20]), scale=1.0,
                hid=torch.randn(2, m, d), kv=torch.randn(2 * heads * dh, d), absorb_min_bytes=0)
    assert fused.attend_one(**args).isnan().all()


@pytest.mark.parametrize("step_kernels", [True, False])
def test_steps_equal_the_torch_decoder_with_either_products_and_the_trace_follows_the_choice(step_kernels,
                                                                                             monkeypatch):
    """A decode step's products come from the C kernel or from torch's, as tune_step_products chose (an
    AVX2-only host ran the C tiles 10-20x slower than torch's at 8-64 rows): the same numbers either way, the
    attention the C kernel's both ways, and a traced step records the choice in force when it runs."""
    model = _model()
    plain, fast = Decoder(model, mem_len=6, fused=False), Decoder(model, mem_len=6, traced=False)
    fast.step_kernels = step_kernels
    calls: list[str] = []
    for name in ("linear_rows", "attend_one"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, name=name, real=real: calls.append(name) or real(*a))
    _same_steps(plain, fast, [0, 1, 5, 13], steps=3)
    assert ("linear_rows" in calls) == step_kernels and "attend_one" in calls
    calls.clear()  # sessions decoded where they lie (the engine loop's row table on a CPU): the same choice
    real_rows = fused.attend_rows
    monkeypatch.setattr(fused, "attend_rows", lambda *a: calls.append("attend_rows") or real_rows(*a))
    lengths = [0, 5, 13]
    a, b = _table(plain, lengths), _table(fast, lengths, RowTable)
    tokens = torch.randint(0, 256, (len(lengths), 1), generator=torch.Generator().manual_seed(4))
    va, vb = a.active(), b.active()
    plain.advance(va, tokens)
    fast.advance(vb, tokens)
    torch.testing.assert_close(vb.last_logits, va.last_logits, rtol=1e-5, atol=1e-5)
    assert ("linear_rows" in calls) == step_kernels and "attend_rows" in calls
    traced = Decoder(model, mem_len=6, traced=True)
    traced.step_kernels = step_kernels
    one = traced.one_token_graph()
    traced.step_kernels = not step_kernels
    assert traced.one_token_graph() is not one  # another trace for the other products, not the stale one
    traced.step_kernels = step_kernels
    assert traced.one_token_graph() is one

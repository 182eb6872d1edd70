"""The engine against the reference model: same numbers however text is split, batched or stored."""

from __future__ import annotations

import random

import pytest
import torch

from model.checkpoint import load_checkpoint, save_checkpoint
from model.decode import DecodeState
from model.engine import Engine, Generation
from model.sampling import SamplingParams
from model.streaming import TextStreamer
from model.transformer_xl import MemTransformerLM
from tests.model.test_transformer_xl import tiny_config
from txlserve.errors import InvalidRequestError, StateIncompatible

TOL = dict(atol=1e-4, rtol=1e-4)


def make_engine(tmp_path, mem_len=None, clamp_len=None, **cfg_kw) -> Engine:
    torch.manual_seed(0)
    model = MemTransformerLM(tiny_config(**cfg_kw))
    for p in model.parameters():  # larger weights than init, so attention patterns matter
        p.data.normal_(0, 0.3) if p.dim() > 1 else None
    save_checkpoint(model, tmp_path / "ck")
    return Engine.from_checkpoint(tmp_path / "ck", mem_len=mem_len, clamp_len=clamp_len)


def reference_logits(engine: Engine, tokens: torch.Tensor, seg: int = 5) -> torch.Tensor:
    """The reference forward in segments with mems, same_length, at the engine's mem_len/clamp_len."""
    ck = load_checkpoint(engine.ckpt.path, mem_len=engine.mem_len, clamp_len=engine.clamp_len, same_length=True)
    mems, out = None, []
    with torch.no_grad():
        for s in range(0, tokens.size(1), seg):
            logits, mems = ck.model(tokens[:, s:s + seg], mems)
            out.append(logits)
    return torch.cat(out, 1)


@pytest.mark.parametrize("cfg", [dict(), dict(clamp_len=3), dict(pre_lnorm=True), dict(untie_r=False)])
def test_incremental_decoding_matches_reference(tmp_path, cfg):
    engine = make_engine(tmp_path, **cfg)
    x = torch.randint(0, 256, (2, 37))
    want = reference_logits(engine, x)
    state = engine.new_state(2)
    got = torch.stack([engine.decoder.step(state, x[:, i:i + 1])[:, 0] for i in range(x.size(1))], 1)
    torch.testing.assert_close(got, want, **TOL)
    assert state.seen.tolist() == [37, 37]


def test_mem_len_larger_than_training(tmp_path):
    engine = make_engine(tmp_path, mem_len=17)  # training mem_len is 5
    assert engine.mem_len == 17
    x = torch.randint(0, 256, (1, 40))
    got = engine.logits(engine.feed(engine.new_state(), x[0].tolist()))
    torch.testing.assert_close(got[None], reference_logits(engine, x), **TOL)
    short = make_engine(tmp_path / "b")
    assert not torch.allclose(short.logits(short.feed(short.new_state(), x[0].tolist())), got, atol=1e-3)


def _pieces(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = [0, *cuts, len(ids)]
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("cuts,chunk", [([], 512), ([7, 20], 512), ([1, 2, 3, 10, 11, 30], 4), ([], 1), ([13], 3)])
def test_split_invariance(tmp_path, cuts, chunk):
    engine = make_engine(tmp_path)
    ids = torch.randint(0, 256, (41,)).tolist()
    whole = engine.new_state()
    want = engine.feed(whole, ids)
    engine.prefill_chunk = chunk
    state = engine.new_state()
    got = torch.cat([engine.feed(state, p) for p in _pieces(ids, cuts)])
    torch.testing.assert_close(got, want, **TOL)
    a, b = engine.export_state(whole), engine.export_state(state)
    torch.testing.assert_close(a["mems"], b["mems"], **TOL)
    torch.testing.assert_close(a["last_logits"], b["last_logits"], **TOL)


def test_batched_decode_equals_one_by_one(tmp_path):
    engine = make_engine(tmp_path)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (3, 11, 26)]
    singles = []
    for ids in prompts:
        st = engine.new_state()
        engine.feed(st, ids)
        singles.append(st)
    batch = DecodeState.cat([s.rows([0]) for s in singles])  # copies: the singles stay untouched
    feed = torch.randint(0, 256, (3, 9))
    batched = torch.stack([engine.decoder.step(batch, feed[:, i:i + 1])[:, 0] for i in range(9)], 1)
    for r, st in enumerate(singles):
        one = torch.stack([engine.decoder.step(st, feed[r:r + 1, i:i + 1])[0, 0] for i in range(9)])
        torch.testing.assert_close(batched[r], one, **TOL)
        torch.testing.assert_close(engine.export_state(batch, r)["mems"], engine.export_state(st)["mems"], **TOL)


def test_batched_generation_equals_single_with_seeds(tmp_path):
    engine = make_engine(tmp_path)
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.9, seed=s) for s in (1, 2, 3)]
    prompts = ["abc", "a much longer prompt here", "x"]
    singles = [[e.token for e in engine.generate(engine.new_state(), p, sp)] for p, sp in zip(prompts, params)]
    states = []
    for p in prompts:
        st = engine.new_state()
        engine.feed(st, engine.encode(p))
        states.append(st)
    batch, gens = DecodeState.cat(states), [Generation(sp) for sp in params]
    for _ in range(12):
        toks = [g.on_logits(batch.last_logits[r]).token for r, g in enumerate(gens)]
        engine.decoder.step(batch, torch.tensor(toks)[:, None])
    assert [g.tokens for g in gens] == singles


def test_seed_determinism(tmp_path):
    engine = make_engine(tmp_path)

    def run(seed):
        return [e.token for e in engine.generate(engine.new_state(), "Once", SamplingParams(
            max_tokens=20, temperature=1.0, seed=seed))]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_persisted_nbytes_is_the_size_of_a_full_export(tmp_path):
    """The server encodes small exports on its event loop and large ones in a thread, by this size."""
    engine = make_engine(tmp_path)
    st = engine.new_state()
    engine.feed(st, torch.randint(0, 256, (engine.mem_len + 3,)).tolist())
    for dtype in (None, torch.bfloat16):
        exported = engine.export_state(st, dtype=dtype)
        assert engine.persisted_nbytes(dtype) == sum(t.nbytes for t in exported.values())


def test_row_bytes_is_what_one_session_holds(tmp_path):
    """The hot set's byte budget counts each session by it: one row's rings, scores and count, in any batch."""
    engine = make_engine(tmp_path)
    one = engine.new_state()
    held = sum(t.nbytes for t in (one.hid, one.k, one.v, one.last_logits)) + 8  # and its int64 count
    assert one.row_bytes == held
    assert DecodeState.cat([one, engine.new_state(), engine.new_state()]).row_bytes == held


def test_state_round_trip_continues_identically(tmp_path):
    engine = make_engine(tmp_path)
    greedy = SamplingParams(max_tokens=15, temperature=0)
    ids = torch.randint(0, 256, (23,)).tolist()
    st = engine.new_state()
    engine.feed(st, ids)
    for _ in range(2):  # a restored state restores again identically
        tensors = engine.export_state(st)
        assert set(tensors) == {"mems", "last_logits"}
        copy = engine.import_state({k: v.clone() for k, v in tensors.items()}, tokens_seen=23,
                                   fingerprint=engine.fingerprint)
        torch.testing.assert_close(copy.k, st.k, **TOL)  # recomputed keys equal the cached ones
        a = [e.token for e in engine.generate(copy, "", greedy)]
        b = [e.token for e in engine.generate(st.rows([0]), "", greedy)]
        assert a == b
    compact = engine.export_state(st, dtype=torch.bfloat16)
    assert compact["mems"].dtype == torch.bfloat16
    restored = engine.import_state(compact, tokens_seen=23, fingerprint=engine.fingerprint)
    assert restored.hid.dtype == torch.float32


def test_cancel_keeps_every_seen_token_in_state(tmp_path):
    engine = make_engine(tmp_path)
    st = engine.new_state()
    it = engine.generate(st, "hello", SamplingParams(max_tokens=50, temperature=0))
    got = [next(it).token for _ in range(4)]
    it.close()
    assert int(st.seen[0]) == 5 + 4
    ref = engine.new_state()
    engine.feed(ref, engine.encode("hello") + got)
    torch.testing.assert_close(engine.export_state(st)["mems"], engine.export_state(ref)["mems"], **TOL)


def test_finished_generation_state_holds_prompt_and_completion(tmp_path):
    engine = make_engine(tmp_path)
    st = engine.new_state()
    events = list(engine.generate(st, "abc", SamplingParams(max_tokens=6, temperature=0)))
    assert [e.finish_reason for e in events] == [None] * 5 + ["length"]
    assert int(st.seen[0]) == 3 + 6
    # continuing the session equals one request with the whole text
    ref = engine.new_state()
    engine.feed(ref, engine.encode("abc") + [e.token for e in events])
    torch.testing.assert_close(st.last_logits, ref.last_logits, **TOL)


def test_stop_strings(tmp_path):
    engine = make_engine(tmp_path)
    free = list(engine.generate(engine.new_state(), "The", SamplingParams(max_tokens=40, temperature=0)))
    raw = bytes(e.token for e in free)
    at = next(i for i in range(4, len(raw)) if raw[i] < 128)  # an ASCII byte to stop on
    stop = raw[at:at + 1].decode()
    st = engine.new_state()
    events = list(engine.generate(st, "The", SamplingParams(max_tokens=40, temperature=0, stop=["\u2603", stop])))
    text = "".join(e.text for e in events)
    assert events[-1].finish_reason == "stop" and len(events) == raw.find(stop.encode()) + 1
    assert text == raw[: raw.find(stop.encode())].decode("utf-8", errors="replace")
    assert int(st.seen[0]) == 3 + len(events)  # the stop string itself is in memory


def test_text_streamer_holds_back_partial_stops_and_utf8():
    s = TextStreamer(["END"])
    pieces = [s.push(b) for b in [b"ab", b"E", b"N", b"x", b"E", b"N", b"D", b"zz"]]
    assert pieces[:3] == ["ab", "", ""] and pieces[3] == "ENx"
    assert s.stopped_by == "END" and "".join(pieces[:7]) == "abENx"
    euro = "€".encode()  # 3 bytes
    s = TextStreamer()
    assert [s.push(euro[:1]), s.push(euro[1:2]), s.push(euro[2:])] == ["", "", "€"]
    s = TextStreamer()
    assert s.push(euro[:2]) == "" and s.flush() == "\ufffd"
    s = TextStreamer(["€"])  # a multi-byte stop string
    assert s.push(b"a" + euro[:2]) == "a" and s.push(euro[2:]) == "" and s.stopped_by == "€"


def test_generated_pieces_are_valid_utf8_at_char_boundaries(tmp_path):
    engine = make_engine(tmp_path)
    for seed in range(5):
        events = list(engine.generate(engine.new_state(), "x", SamplingParams(max_tokens=40, temperature=1.5,
                                                                                seed=seed)))
        joined = "".join(e.text for e in events)
        assert joined == bytes(e.token for e in events).decode("utf-8", errors="replace")


def test_fed_text_split_inside_a_character(tmp_path):
    engine = make_engine(tmp_path)
    data = "naïve €uro".encode()
    cut = data.index("€".encode()) + 1  # inside the 3-byte euro sign
    a, b = engine.new_state(), engine.new_state()
    engine.feed(a, list(data))
    engine.feed(b, list(data[:cut]))
    engine.feed(b, list(data[cut:]))
    torch.testing.assert_close(a.last_logits, b.last_logits, **TOL)


def test_score_matches_reference_log_likelihood(tmp_path):
    engine = make_engine(tmp_path)
    ids = torch.randint(0, 256, (30,))
    logits = reference_logits(engine, ids[None])[0]
    want = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).sum()
    st = engine.new_state()
    first = engine.score(st, ids[:10].tolist())
    second = engine.score(st, ids[10:].tolist())
    assert first.tokens + second.tokens == 29
    assert abs(first.logprob + second.logprob - float(want)) < 1e-3
    assert second.bpc > 0


@pytest.mark.parametrize("kw,param", [
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(top_k=-3), "top_k"), (dict(logprobs=99), "logprobs"),
    (dict(stop=[""]), "stop"), (dict(temperature=float("nan")), "temperature"), (dict(max_tokens=2.5), "max_tokens"),
])
def test_bad_sampling_params(kw, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kw)
    assert info.value.param == param


def test_empty_prompt_on_empty_state(tmp_path):
    engine = make_engine(tmp_path)
    with pytest.raises(InvalidRequestError, match="nothing to continue from"):
        next(engine.generate(engine.new_state(), "", SamplingParams()))


def test_state_from_another_model_is_refused(tmp_path):
    engine = make_engine(tmp_path)
    st = engine.new_state()
    engine.feed(st, [1, 2, 3])
    tensors = engine.export_state(st)
    with pytest.raises(StateIncompatible, match="another model"):
        engine.import_state(tensors, tokens_seen=3, fingerprint="someone-else:m5:c0")
    other = make_engine(tmp_path / "o", n_layer=3)
    with pytest.raises(StateIncompatible):
        other.import_state(tensors, tokens_seen=3, fingerprint=engine.fingerprint)
    with pytest.raises(StateIncompatible, match="shape"):
        other.import_state(tensors, tokens_seen=3, fingerprint=other.fingerprint)
    wide = make_engine(tmp_path / "w", d_model=24, d_head=4)
    with pytest.raises(StateIncompatible, match="shape"):
        wide.import_state(tensors, tokens_seen=3, fingerprint=wide.fingerprint)
    longer = make_engine(tmp_path / "l", mem_len=9)
    with pytest.raises(StateIncompatible):
        longer.import_state(tensors, tokens_seen=3, fingerprint=engine.fingerprint.replace("m5", "m9") + "x")
    assert longer.fingerprint != engine.fingerprint


def test_a_state_computed_in_another_precision_is_not_imported_as_this_ones(tmp_path):
    """A bf16 server's stored memory was continued as it was by an fp32 server: its scores moved by 1e-2 and greedy
    text changed with the server a session happened to reach (found by a helper). The precision is part of what a
    state must match, so such a session is rebuilt from its window; fp32's fingerprint is what it always was."""
    from server.session_state import importable

    engine = make_engine(tmp_path)
    half = Engine.from_checkpoint(tmp_path / "ck", dtype=torch.bfloat16)
    assert engine.fingerprint == f"{engine.ckpt.fingerprint}:m{engine.mem_len}:c{engine.clamp_len}"
    assert half.fingerprint == engine.fingerprint + ":bfloat16"
    st = half.new_state()
    half.feed(st, [1, 2, 3])
    tensors = half.export_state(st)
    assert importable(half, tensors, half.fingerprint) and not importable(engine, tensors, half.fingerprint)
    with pytest.raises(StateIncompatible, match="another model"):
        engine.import_state(tensors, tokens_seen=3, fingerprint=half.fingerprint)


def test_exported_state_owns_its_memory(tmp_path):
    """Exported tensors must not keep the step's whole logits alive (what Redis stores is counted by them)."""
    engine = make_engine(tmp_path)
    st = engine.new_state()
    engine.feed(st, list(range(40)))
    for name, t in engine.export_state(st).items():
        assert t.untyped_storage().nbytes() == t.nbytes, name


def test_tiny_temperature_is_greedy(tmp_path):
    engine = make_engine(tmp_path)
    def run(temperature: float) -> list[int]:
        params = SamplingParams(max_tokens=8, temperature=temperature)
        return [e.token for e in engine.generate(engine.new_state(), "abc", params)]

    assert run(1e-40) == run(0)


def test_an_empty_session_round_trips(tmp_path):
    """A session created with no text (0 tokens, empty mems) is exported, imported and continued."""
    engine = make_engine(tmp_path)
    state = engine.new_state()
    tensors = {k: v for k, v in engine.export_state(state).items() if not k.startswith("_")}
    assert tensors["mems"].shape[1] == 0
    again = engine.import_state(tensors, tokens_seen=0, fingerprint=engine.fingerprint)
    x = [5, 6, 7, 8]
    torch.testing.assert_close(engine.logits(engine.feed(again, x)), engine.logits(engine.feed(engine.new_state(), x)),
                               **TOL)


def test_slot_table_joins_and_leaves_without_moving_the_others(tmp_path):
    """Sessions generating together in a slot table compute what each computes alone; a leave moves only the
    last row into the freed one, and the table is never reallocated below its capacity."""
    from model.cache import SlotTable

    engine = make_engine(tmp_path)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (3, 9, 14, 6)]
    alone = []
    for p in prompts:
        st = engine.new_state()
        engine.feed(st, p)
        alone.append(st)
    table = SlotTable(engine.decoder.empty, capacity=4)
    for p in prompts:
        st = engine.new_state()
        engine.feed(st, p)
        table.join(st)
    storage = table.table.k.data_ptr()
    rows = [0, 1, 2, 3]  # which session each row holds

    def step(tokens: list[int]) -> None:
        view = table.active()
        engine.decoder.step(view, torch.tensor(tokens)[:, None])
        table.stepped(view)
        for r, tok in zip(rows, tokens):
            engine.decoder.step(alone[r], torch.tensor([[tok]]))

    step([1, 2, 3, 4])
    before = table.table.k[:, 1].clone()
    table.leave(0)  # session 3 moves into row 0
    rows = [3, 1, 2]
    assert torch.equal(table.table.k[:, 1], before) and table.n == 3
    step([5, 6, 7])
    for r, session in enumerate(rows):
        torch.testing.assert_close(table.table.last_logits[r], alone[session].last_logits[0], **TOL)
        assert int(table.table.seen[r]) == int(alone[session].seen[0])
    assert table.table.k.data_ptr() == storage and table.free == 1


def test_cpu_decoding_keeps_its_column_major_layouts(tmp_path):
    """The rings, the position table and the widening weights are stored column-major on a CPU (same values:
    one-row products stream long rows; see ``model.cache.column_major``). Every way a state is made or moved
    keeps that layout, so no session silently decodes at the slow layout, and the model still saves."""
    engine = make_engine(tmp_path)
    dec = engine.decoder

    def columns(t: torch.Tensor) -> bool:
        return t.stride(-2) == 1

    assert columns(dec.r_head_k)
    qkv, ff1, ff2 = (engine.model.layers[0].dec_attn.qkv_net.weight, engine.model.layers[0].pos_ff.core_net[0].weight,
                     engine.model.layers[0].pos_ff.core_net[3].weight)
    assert columns(qkv) and columns(ff1) and not columns(ff2)  # narrowing weights stay row-major
    st = engine.new_state(2)
    engine.decoder.prefill(st, torch.randint(0, 256, (2, 11)))
    made = [st, st.rows([1]), DecodeState.cat([st.rows([0]), st.rows([1])]),
            engine.import_state(engine.export_state(st, 1), tokens_seen=11, fingerprint=engine.fingerprint)]
    for s in made:
        assert columns(s.k) and columns(s.v)
    torch.testing.assert_close(made[3].last_logits, st.last_logits[1:], **TOL)
    save_checkpoint(engine.model, tmp_path / "again")  # safetensors needs contiguous tensors: the saver makes them
    again = load_checkpoint(tmp_path / "again").model
    torch.testing.assert_close(again.layers[0].dec_attn.qkv_net.weight, qkv, atol=0, rtol=0)


def test_the_sampling_kernel_is_built_with_the_model_not_in_the_first_request(tmp_path, monkeypatch):
    # An engine whose decode uses no C kernel (a GPU's, here one that enforces eager) still samples with one;
    # building it lazily put seconds of compiling into a CUDA server's first request.
    from model import fused

    save_checkpoint(MemTransformerLM(tiny_config()), tmp_path / "ck")
    calls, real = [], fused.available
    monkeypatch.setattr(fused, "available", lambda: calls.append(1) or real())
    engine = Engine.from_checkpoint(tmp_path / "ck", enforce_eager=True)
    assert not engine.decoder.fused
    assert calls  # built or loaded (or found unbuildable) before any request


def test_a_gpus_prefill_chunk_is_long_and_a_cpus_follows_the_memory():
    from model.decode import default_prefill_chunk

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert [default_prefill_chunk(m, gpu) for m in (128, 512, 1600, 4096)] == [2048, 2048, 1600, 2048]
    assert [default_prefill_chunk(m, cpu) for m in (128, 512, 1600, 4096)] == [256, 256, 400, 512]


def test_a_stop_token_ends_a_generation_without_its_text_and_releases_what_was_held_before_it():
    """vLLM's stop_token_ids: the token is generated (a session holds it) but its text is not given; the start
    of a stop string held back before it is released, since the generation ends there."""
    gen = Generation(SamplingParams(max_tokens=10, stop=("xyz",), stop_token_ids=[101]))
    assert gen.params.stop_token_ids == (101,)
    assert [gen.accept(t, None).text for t in b"hx"] == ["h", ""]  # "x" held: it may begin "xyz"
    last = gen.accept(101, None)
    assert (last.text, last.finish_reason, gen.tokens) == ("x", "stop", [104, 120, 101])
    plain = Generation(SamplingParams(max_tokens=3))
    assert "".join(plain.accept(t, None).text for t in b"hex") == "hex"  # 101 is a token like any other there


def test_include_stop_str_in_output_gives_the_stop_string_or_the_stop_tokens_text():
    """vLLM's include_stop_str_in_output: the text ends with what stopped it."""
    gen = Generation(SamplingParams(max_tokens=10, stop=("xy",), include_stop_str_in_output=True))
    assert [gen.accept(t, None).text for t in b"axyz"[:3]] == ["a", "", "xy"] and gen.finish_reason == "stop"
    words = Generation(SamplingParams(max_tokens=10, stop_token_ids=(101,), include_stop_str_in_output=True))
    assert "".join(words.accept(t, None).text for t in b"he") == "he" and words.finish_reason == "stop"


def test_a_stop_token_that_completes_a_stop_string_keeps_it_with_include_stop_str_in_output():
    """vLLM checks the stop token first and keeps the stop string it completed (found by a helper)."""
    for include, want in ((True, "sea-"), (False, "sea")):
        gen = Generation(SamplingParams(max_tokens=10, stop=("a-",), stop_token_ids=(45,),
                                        include_stop_str_in_output=include))
        assert "".join(gen.accept(t, None).text for t in b"sea-") == want and gen.finish_reason == "stop"


def test_min_tokens_matches_no_stop_string_through_it_and_one_that_ends_after_it():
    """vLLM's min_tokens (its V1 engine's rule): a stop string that ends in the first min_tokens tokens does not
    stop (its text is given), one that ends in a later token does, even when it began before; meanwhile the
    streamer still holds back a tail that may grow into a stop string, so such a match is cut where it began. A
    stop token is allowed from the same token on: at least min_tokens tokens come before either kind of stop."""
    def run(min_tokens: int, tokens: bytes, stop: tuple[str, ...]) -> tuple[str, str | None]:
        gen = Generation(SamplingParams(max_tokens=len(tokens), stop=stop, min_tokens=min_tokens))
        text = ""
        for t in tokens:
            if gen.finish_reason is None:
                text += gen.accept(t, None).text
        return text, gen.finish_reason

    assert run(0, b"abcb", ("b",)) == ("a", "stop")
    assert run(1, b"abcb", ("b",)) == ("a", "stop")  # the 2nd token may stop
    assert run(2, b"abcb", ("b",)) == ("abc", "stop")  # the first "b" is token 2, not past the 2nd
    assert run(2, b"axyz", ("xy",)) == ("a", "stop")  # began at token 2, ended at token 3
    assert run(3, b"axyz", ("xy",)) == ("axyz", "length")  # ended at token 3, not past the 3rd
    assert run(3, b"xyxy", ("xy",)) == ("xy", "stop")  # the second, ending at token 4
    assert run(4, b"xyxy", ("xy",)) == ("xyxy", "length")


def test_min_tokens_keeps_stop_tokens_from_being_drawn_until_it_is_reached():
    """As vLLM's min-tokens logits processor: a stop token is banned while fewer than min_tokens tokens have been
    generated (so the (min_tokens+1)-th may be one), greedy and sampled."""
    from model.sampling import sample_rows

    logits = torch.zeros(2, 8)
    logits[:, 5] = 50.0  # the stop token, by far the likeliest
    params = [SamplingParams(temperature=t, stop_token_ids=(5,), min_tokens=3) for t in (0.0, 1.0)]
    rngs = [random.Random(0), random.Random(1)]
    for so_far, banned in ((0, True), (2, True), (3, False)):
        chosen = sample_rows(logits, params, rngs, [[1] * so_far] * 2)
        assert all((token != 5) == banned for token in chosen), (so_far, chosen)
    gen = Generation(SamplingParams(max_tokens=10, stop_token_ids=(5,), min_tokens=2, temperature=0))
    assert gen.on_logits(logits[0]).token != 5 and gen.on_logits(logits[0]).token != 5
    assert gen.on_logits(logits[0]).finish_reason == "stop" and len(gen.tokens) == 3


def test_min_tokens_is_checked():
    for bad in (-1, 17, 1.5, True):
        with pytest.raises(InvalidRequestError, match="min_tokens") as info:
            SamplingParams(max_tokens=16, min_tokens=bad)
        assert info.value.param == "min_tokens"
    assert SamplingParams(max_tokens=16, min_tokens=16).min_tokens == 16

"""The engine loop with a real (tiny) model: whatever path a request takes into the decode batch, it generates
what the model generates alone."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path

import pytest
import torch

from model.cache import SlotTable
from model.checkpoint import load_checkpoint, save_checkpoint
from model.engine import Engine, TokenEvent
from model.fused import available as fused_available
from model.graphs import GraphedTable
from model.sampling import SamplingParams
from model.transformer_xl import MemTransformerLM
from server.scheduler import Finished, Scheduler
from tests.model.test_transformer_xl import tiny_config

pytestmark = pytest.mark.timeout(120)

# a request that keeps the batch busy until the test cancels (or fails) it: 400 tokens of the tiny model took
# 0.12-0.25 s here, which a loaded machine could let end before the next request joined
UNTIL_STOPPED = SamplingParams(max_tokens=100_000)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    torch.manual_seed(0)
    model = MemTransformerLM(tiny_config(mem_len=12))
    for p in model.parameters():
        p.data.normal_(0, 0.3) if p.dim() > 1 else None
    path = tmp_path_factory.mktemp("ck")
    save_checkpoint(model, path)
    return Engine.from_checkpoint(path)


@contextlib.asynccontextmanager
async def _busy(scheduler: Scheduler, engine: Engine):
    """A request generating until the block ends, then cancelled and drained: the batch is busy inside it (left
    as it is if the block fails, so that a failure never waits on a stream)."""
    busy = scheduler.submit(engine.new_state(), engine.encode("xyz"), UNTIL_STOPPED)
    it = busy.__aiter__()
    assert isinstance(await it.__anext__(), TokenEvent)  # generating: the batch is busy from here on
    yield busy
    busy.cancel()
    async for _ in it:
        pass


def _counting_passes(engine):
    """The decoder's ``advance``, recording the shape of every call that reads more than one token a row (a
    prompt's pass of its own), and the list it records into."""
    passes: list[tuple[int, int]] = []
    advance = engine.decoder.advance

    def counted(state, tokens):
        if tokens.size(1) > 1:
            passes.append(tuple(tokens.shape))
        return advance(state, tokens)

    return passes, counted


def test_a_short_prompt_read_as_it_joins_a_busy_batch_generates_what_the_model_does_alone(engine):
    greedy = SamplingParams(max_tokens=20, temperature=0)
    prompt = engine.encode(" and")
    history = engine.encode("Once upon a time")
    alone = engine.new_state()
    engine.feed(alone, history)
    want = [e.token for e in engine.generate(alone, prompt, greedy)]

    async def main() -> tuple[list[int], Finished]:
        scheduler = Scheduler(engine, prefill_chunk=64)
        scheduler.start()
        try:
            async with _busy(scheduler, engine):
                before = scheduler.prompt_tokens_in_batch
                state = engine.new_state()
                engine.feed(state, history)
                got, done = [], None
                async for item in scheduler.submit(state, prompt, greedy):
                    if isinstance(item, TokenEvent):
                        got.append(item.token)
                    else:
                        done = item
                assert scheduler.prompt_tokens_in_batch - before == len(prompt)  # read in the table, in place
            return got, done
        finally:
            scheduler.stop()

    got, done = asyncio.run(main())
    assert got == want
    assert done.tokens_seen == len(history) + len(prompt) + 20


@pytest.mark.skipif(not fused_available(), reason="no C/C++ compilers here: sessions are copied into a slot table")
def test_a_session_leaves_the_batch_as_the_state_it_joined_as(engine):
    """With the fused attention the engine loop decodes sessions where they lie: a request's Finished holds the
    very state it was given (none of its rings copied in or out), advanced by its prompt and every generated
    token, beside another request in the batch; and it continues exactly as the model alone does."""
    greedy = SamplingParams(max_tokens=9, temperature=0)
    history, prompt = engine.encode("Once upon a time"), engine.encode(" and")
    alone = engine.new_state()
    engine.feed(alone, history)
    want = [e.token for e in engine.generate(alone, prompt, greedy)]
    want += [e.token for e in engine.generate(alone, prompt, greedy)]

    async def main() -> tuple[object, list[Finished], list[int]]:
        scheduler = Scheduler(engine, prefill_chunk=64)
        scheduler.start()
        try:
            async with _busy(scheduler, engine):
                state = engine.new_state()
                engine.feed(state, history)
                ptr, dones, got = state.k.data_ptr(), [], []
                for _ in range(2):  # the next request continues the state the first handed back
                    async for item in scheduler.submit(dones[-1].state if dones else state, prompt, greedy):
                        (got.append(item.token) if isinstance(item, TokenEvent) else dones.append(item))
            return (state, ptr), dones, got
        finally:
            scheduler.stop()

    (state, ptr), dones, got = asyncio.run(main())
    assert all(d.state is state for d in dones) and state.k.data_ptr() == ptr
    assert [d.tokens_seen for d in dones] == [len(history) + len(prompt) + 9, len(history) + 2 * len(prompt) + 18]
    assert int(state.seen[0]) == dones[-1].tokens_seen
    assert got == want


def test_a_short_prompt_joining_a_busy_batch_rides_along_in_its_steps(engine):
    """With rows generating, a joining prompt is fed in the decode steps, with the batch (whole, in the next
    step, where sessions are decoded where they lie; else a token a step), and not read in a pass of its own
    that would hold every generating row up (a load whose requests end at different steps had such a pass
    almost every step); it still generates what the model does alone."""
    greedy = SamplingParams(max_tokens=8, temperature=0)
    history, prompts = engine.encode("Once upon a time"), [engine.encode(" and"), engine.encode(" so it")]
    want = _alone(engine, [history, history], prompts, greedy)
    states = [engine.new_state() for _ in prompts]
    for state in states:
        engine.feed(state, history)
    passes, counted = _counting_passes(engine)
    packed: list[list[int]] = []  # each row's tokens in every step of sessions where they lie
    advance_rows = engine.decoder.advance_rows

    def counted_rows(state, tokens, start):
        packed.append(start.diff().tolist())
        return advance_rows(state, tokens, start)

    async def main() -> list[list[int]]:
        scheduler = Scheduler(engine, prefill_chunk=64)
        engine.decoder.advance, engine.decoder.advance_rows = counted, counted_rows
        scheduler.start()
        try:
            async with _busy(scheduler, engine):
                # its own prompt, read in one pass: the batch was empty (packed where sessions lie where they are)
                assert (packed, passes) == (([[3]], []) if ragged else ([], [(1, 3)]))

                async def tokens(state, prompt):
                    return [item.token async for item in scheduler.submit(state, prompt, greedy)
                            if isinstance(item, TokenEvent)]

                # together: prompts of two lengths ride at once, and the shorter one samples beside a row still
                # reading
                got = list(await asyncio.gather(*(tokens(s, p) for s, p in zip(states, prompts))))
            return got
        finally:
            scheduler.stop()
            del engine.decoder.advance, engine.decoder.advance_rows  # the class's methods again

    ragged = engine.decoder.table(1).ragged
    got = asyncio.run(main())
    assert got == want
    assert passes == ([] if ragged else [(1, 3)])  # the joining prompts (4 and 6 tokens): no pass of their own
    if ragged:  # each read whole in one step beside the generating rows
        counts = sorted(n for step in packed if len(step) > 1 for n in step if n > 1)  # beside the busy row
        assert counts == sorted(len(p) for p in prompts), packed


def test_a_request_cancelled_while_its_prompt_is_fed_stores_nothing(engine):
    async def main() -> Finished:
        scheduler = Scheduler(engine, prefill_chunk=64)
        scheduler.start()
        try:
            async with _busy(scheduler, engine):
                request = scheduler.submit(engine.new_state(), engine.encode("abcdefg"), SamplingParams(max_tokens=5))
                request.cancel()  # before or while its prompt is fed: no partial prompt may be committed
                items = [item async for item in request]
            return items[-1]
        finally:
            scheduler.stop()

    done = asyncio.run(main())
    assert isinstance(done, Finished) and done.state is None and done.finish_reason == "cancelled"


def test_a_row_that_fails_mid_step_costs_the_others_nothing(engine):
    """One row's sampling raises in the very step in which another row's short prompt was read as it joined:
    the failing request gets its error, and the others neither lose a prompt token nor drop a sampled one."""
    greedy = SamplingParams(max_tokens=12, temperature=0)
    history, prompt = engine.encode("Once upon a time"), engine.encode(" and")
    alone = engine.new_state()
    engine.feed(alone, history)
    want_short = [e.token for e in engine.generate(alone, prompt, greedy)]
    want_long = [e.token for e in engine.generate(engine.new_state(), engine.encode("a longer prompt"), greedy)]

    async def main():
        scheduler = Scheduler(engine, prefill_chunk=64)
        scheduler.start()
        try:
            bad = scheduler.submit(engine.new_state(), engine.encode("xyz"), UNTIL_STOPPED)
            bad_items = bad.__aiter__()
            await bad_items.__anext__()  # generating: the batch is busy
            before = scheduler.prompt_tokens_in_batch
            long_run = scheduler.submit(engine.new_state(), engine.encode("a longer prompt"), greedy)
            accept = bad.job.generation.accept

            def fail_while_a_prompt_is_fed(token, logits, row=None):  # on the engine thread, inside a decode step
                if scheduler.prompt_tokens_in_batch > before:  # the short prompt joined, in this step
                    raise RuntimeError("sampling failed")
                return accept(token, logits, row)

            bad.job.generation.accept = fail_while_a_prompt_is_fed
            state = engine.new_state()
            engine.feed(state, history)
            short_run = scheduler.submit(state, prompt, greedy)

            async def tokens(request):
                return [item.token async for item in request if isinstance(item, TokenEvent)]

            got_long, got_short = await asyncio.gather(tokens(long_run), tokens(short_run))
            with pytest.raises(RuntimeError, match="sampling failed"):
                async for _ in bad_items:
                    pass
            return got_long, got_short, scheduler.prompt_tokens_in_batch - before
        finally:
            scheduler.stop()

    got_long, got_short, fed_in_batch = asyncio.run(main())
    assert fed_in_batch == len(prompt)  # the short prompt was read in the slot table, before the failing step
    assert got_short == want_short
    assert got_long == want_long


def _alone(engine, histories, prompts, params) -> list[list[int]]:
    """What each (history, prompt) generates with the model alone."""
    want = []
    for history, prompt in zip(histories, prompts):
        alone = engine.new_state()
        engine.feed(alone, history)
        want.append([e.token for e in engine.generate(alone, prompt, params)])
    return want


def _arriving_together(engine, histories, prompts, params, advance=None, advance_rows=None) -> list:
    """Every request is waiting before the engine loop starts (they arrive together), the decoder's ``advance``
    and ``advance_rows`` replaced by those given; each request's tokens, or the error it ended with."""

    async def main() -> list:
        scheduler = Scheduler(engine, prefill_chunk=64)
        requests = []
        for history, prompt in zip(histories, prompts):
            state = engine.new_state()
            engine.feed(state, history)
            requests.append(scheduler.submit(state, prompt, params))
        engine.decoder.advance = advance or engine.decoder.advance
        engine.decoder.advance_rows = advance_rows or engine.decoder.advance_rows
        scheduler.start()
        try:
            async def tokens(request):
                return [item.token async for item in request if isinstance(item, TokenEvent)]

            return list(await asyncio.gather(*(tokens(r) for r in requests), return_exceptions=True))
        finally:
            scheduler.stop()
            del engine.decoder.advance, engine.decoder.advance_rows  # the class's methods again

    return asyncio.run(main())


@pytest.fixture(params=["rows", "slots", "graphed"])
def table(request, engine, monkeypatch) -> str:
    """The engine loop's decode batch: the decoder's own (sessions decoded where they lie, where the fused
    attention runs), a slot table, which copies sessions in and feeds every row of a call as many tokens, or a
    GPU's slot table, whose one-token steps run the captured batch size above theirs (eagerly here)."""
    if request.param == "rows" and not engine.decoder.table(1).ragged:
        pytest.skip("the fused attention is not available here")
    if request.param == "slots":
        monkeypatch.setattr(engine.decoder, "table", lambda capacity: SlotTable(engine.decoder.empty, capacity))
    if request.param == "graphed":
        monkeypatch.setattr(engine.decoder, "table", lambda capacity: GraphedTable(engine.decoder, capacity,
                                                                                   capture=False))
    return request.param


def test_short_prompts_arriving_together_are_read_in_one_pass(engine, table):
    """Requests that arrive together (every stream of a load continuing at once) join the batch and their
    prompts are read in one forward pass, packed (or one per prompt length, where every row of a call takes
    as many tokens), not one each; each generates what it does alone."""
    greedy = SamplingParams(max_tokens=6, temperature=0)
    histories = [engine.encode(f"Speaker {i} says") for i in range(6)]
    prompts = [engine.encode(p) for p in (" and", " but", " so", " yes", " nor", " or")]  # lengths 4,4,3,4,4,3
    passes, counted = _counting_passes(engine)
    packed: list[list[int]] = []
    advance_rows = engine.decoder.advance_rows

    def counted_rows(state, tokens, start):
        if int(start.diff().max()) > 1:
            packed.append(start.diff().tolist())
        return advance_rows(state, tokens, start)

    got = _arriving_together(engine, histories, prompts, greedy, counted, counted_rows)
    assert got == _alone(engine, histories, prompts, greedy)
    if table == "rows":
        assert (packed, passes) == ([[3, 3, 4, 4, 4, 4]], [])  # one pass, each row its own length
    else:
        assert (packed, sorted(passes)) == ([], [(2, 3), (4, 4)])  # the 3-token prompts, then the 4-token ones


def test_on_graphed_steps_short_prompts_ride_the_steps_even_into_an_idle_batch(engine, monkeypatch):
    """A GPU's graphed table reads joining prompts a token a replay even when the batch was idle: an eager pass of
    a few tokens costs several replays there (GraphedTable.prompts_in_steps). Eagerly here, with the flag set as a
    capture sets it: no pass of more than one token a row runs, and each request generates what it does alone."""
    def graphed(capacity):
        table = GraphedTable(engine.decoder, capacity, capture=False)
        table.prompts_in_steps = True  # as with its graphs captured
        return table

    monkeypatch.setattr(engine.decoder, "table", graphed)
    greedy = SamplingParams(max_tokens=6, temperature=0)
    histories = [engine.encode(f"Speaker {i} says") for i in range(3)]
    prompts = [engine.encode(p) for p in (" and", " so", " nor")]
    passes, counted = _counting_passes(engine)
    got = _arriving_together(engine, histories, prompts, greedy, counted)
    assert got == _alone(engine, histories, prompts, greedy)
    assert passes == []  # every prompt token went through a one-token step


def test_a_sampled_token_reaches_its_stream_before_the_step_that_feeds_it(engine, monkeypatch):
    """The token is known once sampled: its stream hears it while the batch steps, not a step later."""
    stepping, gate = threading.Event(), threading.Event()
    real_advance = engine.decoder.advance

    def held_step(state, tokens):
        if tokens.size(1) == 1:  # a decode step (the prompt is read in one call of its length)
            stepping.set()
            gate.wait(30)  # bounded: a failing test must not hang
        return real_advance(state, tokens)

    monkeypatch.setattr(engine.decoder, "advance", held_step)
    monkeypatch.setattr(engine.decoder, "warm_up", lambda: None)  # its steps are not the request's

    async def main() -> list:
        scheduler = Scheduler(engine, prefill_chunk=64)
        scheduler.start()
        try:
            it = scheduler.submit(engine.new_state(), engine.encode("xyz"), SamplingParams(max_tokens=3)).__aiter__()
            first = await asyncio.wait_for(it.__anext__(), 20)  # arrives with the gate shut: the step waits on it
            held = await asyncio.to_thread(stepping.wait, 20) and not gate.is_set()  # the step did start (after
            # the token was handed over, so it may start just after this loop heard the token)
            gate.set()
            return [first, held] + [item async for item in it]
        finally:
            gate.set()
            scheduler.stop()

    first, held, *rest = asyncio.run(main())
    assert isinstance(first, TokenEvent) and held
    assert [type(x) for x in rest] == [TokenEvent, TokenEvent, Finished]


def test_a_prompt_pass_that_fails_fails_only_its_own_requests(engine, table):
    """If the pass reading joining prompts raises, the requests it read get the error and every other request
    generates what it does alone: one packed pass reads them all on a row table, one pass per length on a slot
    table (a failing 3-token pass there spares the 4-token prompts)."""
    greedy = SamplingParams(max_tokens=5, temperature=0)
    histories = [engine.encode(f"Speaker {i} says") for i in range(4)]
    prompts = [engine.encode(p) for p in (" and", " so", " but", " or")]  # lengths 4, 3, 4, 3
    advance, advance_rows = engine.decoder.advance, engine.decoder.advance_rows

    def failing(state, tokens):
        if tokens.size(1) == 3:
            raise RuntimeError("the 3-token pass failed")
        return advance(state, tokens)

    def failing_rows(state, tokens, start):
        if 3 in start.diff().tolist():
            raise RuntimeError("the packed pass failed")
        return advance_rows(state, tokens, start)

    got = _arriving_together(engine, histories, prompts, greedy, failing, failing_rows)
    want = _alone(engine, histories, prompts, greedy)
    spared, failed = ([], got) if table == "rows" else ([0, 2], [got[1], got[3]])
    assert all(got[i] == want[i] for i in spared)
    for error in failed:
        assert isinstance(error, RuntimeError) and "pass failed" in str(error)


def test_with_a_stream_every_token_but_the_last_goes_straight_to_it(engine):
    """A run streams tokens to its client through one queue and holds the last back until its commit: the engine
    loop puts the others there itself, so the event loop pays one hop per token."""
    greedy = SamplingParams(max_tokens=6, temperature=0)
    want = [e.token for e in engine.generate(engine.new_state(), engine.encode("abc"), greedy)]

    async def main():
        scheduler = Scheduler(engine, prefill_chunk=64)
        scheduler.start()
        try:
            stream: asyncio.Queue = asyncio.Queue()
            request = scheduler.submit(engine.new_state(), engine.encode("abc"), greedy, stream=stream)
            items = [item async for item in request]
            return [stream.get_nowait() for _ in range(stream.qsize())], items
        finally:
            scheduler.stop()

    streamed, items = asyncio.run(main())
    assert [type(item) for item in items] == [TokenEvent, Finished]
    assert all(ev.finish_reason is None for ev in streamed) and items[0].finish_reason == "length"
    assert [ev.token for ev in streamed] + [items[0].token] == want


def test_the_loops_time_adds_up_to_its_wall_time_and_names_where_it_went(engine):
    """Every moment of the loop's thread after its warm-up is in one phase: the phases add up to the time since,
    a generation's steps show up where they run, and a loop waiting for work is idle as it waits (not only once a
    request wakes it). The tokens it counts are the tokens it generated."""
    import time

    from server.scheduler import PHASES

    async def main():
        scheduler = Scheduler(engine, prefill_chunk=64)
        scheduler.start()
        try:
            await asyncio.to_thread(scheduler.warmed.wait, 60)
            started = time.perf_counter()
            generated, readings = 0, []
            for n in (5, 7):
                request = scheduler.submit(engine.new_state(), engine.encode("abc"), SamplingParams(max_tokens=n))
                items = []
                async for item in request:
                    items.append(item)
                    readings.append(scheduler.loop_seconds())  # while the loop laps: a counter never goes back
                generated += items[-1].completion_tokens
            assert all(b[k] >= a[k] for a, b in zip(readings, readings[1:]) for k in PHASES)
            busy = scheduler.loop_seconds()
            await asyncio.sleep(0.3)  # nothing to do: blocked for a request, and counted idle while it waits
            idle = scheduler.loop_seconds()
            return (started, time.perf_counter(), generated, busy, idle, scheduler.steps, scheduler.generated,
                    scheduler.cpu_seconds())
        finally:
            scheduler.stop()

    started, ended, generated, busy, idle, steps, counted, cpu = asyncio.run(main())
    assert tuple(busy) == PHASES
    assert sum(idle.values()) <= ended - started + 0.05  # the phases count from the end of the warm-up
    assert sum(idle.values()) >= (ended - started) / 2  # and cover everything since (less the loop's start)
    assert idle["idle"] - busy["idle"] >= 0.25
    assert busy["forward"] > 0 and busy["accept"] > 0 and busy["handoff"] > 0 and busy["sample"] > 0
    assert counted == generated == 12 and steps >= 12
    if Path("/proc/self/task").is_dir():  # the thread's CPU time, from the kernel
        assert cpu is not None and cpu >= 0
    assert Scheduler(engine).cpu_seconds() is None  # a loop not started has no thread to read


def _deliveries(monkeypatch) -> list[list]:
    """Every hand-over from the engine thread to the event loop, as the list of items it carried."""
    import server.scheduler as scheduler_module

    calls: list[list] = []
    deliver = scheduler_module._deliver

    def recorded(items):
        calls.append([item for _, item in items])
        deliver(items)

    monkeypatch.setattr(scheduler_module, "_deliver", recorded)
    return calls


@pytest.mark.parametrize("interval", [1, 4])
def test_stream_interval_hands_tokens_over_in_groups_after_the_first(engine, monkeypatch, interval):
    """With ``stream_interval`` N, the first token is handed over at once and the rest N at a time (one wake-up
    of the event loop per N steps); the token that ends the request takes the waiting ones with it. The stream
    gets the same tokens, in order, whatever N."""
    greedy = SamplingParams(max_tokens=11, temperature=0)
    prompt = engine.encode(" and")
    want = [e.token for e in engine.generate(engine.new_state(), prompt, greedy)]
    calls = _deliveries(monkeypatch)

    async def main() -> tuple[list[int], list[int]]:
        scheduler = Scheduler(engine, prefill_chunk=64, stream_interval=interval)
        scheduler.start()
        try:
            stream: asyncio.Queue = asyncio.Queue()
            last = []
            async for item in scheduler.submit(engine.new_state(), prompt, greedy, stream=stream):
                if isinstance(item, TokenEvent):
                    last.append(item.token)
            streamed = [stream.get_nowait().token for _ in range(stream.qsize())]
            return streamed, last
        finally:
            scheduler.stop()

    streamed, last = asyncio.run(main())
    assert streamed + last == want and len(last) == 1
    groups = [sum(isinstance(item, TokenEvent) for item in call) for call in calls]
    groups = [g for g in groups if g]
    assert groups == ([1] * 11 if interval == 1 else [1, 4, 4, 2])  # the last group: the 10th token and the 11th


def test_stream_interval_a_cancelled_request_hands_over_every_token_before_it_ends(engine):
    """Tokens still waiting for their group when a request is cancelled reach its stream before its Finished,
    so the client has everything the stored session holds."""

    async def main() -> tuple[int, Finished]:
        scheduler = Scheduler(engine, prefill_chunk=64, stream_interval=1000)
        scheduler.start()
        try:
            stream: asyncio.Queue = asyncio.Queue()
            request = scheduler.submit(engine.new_state(), engine.encode("xyz"), UNTIL_STOPPED, stream=stream)
            await stream.get()  # the first token comes at once; the next thousand would wait for their group
            steps = scheduler.steps
            while scheduler.steps < steps + 5:  # a few more are made and held (bounded by the test's timeout)
                await asyncio.sleep(0.001)
            assert stream.empty()
            request.cancel()
            done = None
            async for item in request:
                done = item
            return 1 + stream.qsize(), done
        finally:
            scheduler.stop()

    streamed, done = asyncio.run(main())
    assert done.finish_reason == "cancelled"
    assert streamed == done.completion_tokens >= 5  # the first, and at least the four held after it


def test_a_cancelled_request_releases_the_text_its_stop_strings_held_back(engine):
    """Text held back because it could still grow into a stop string belongs to tokens already in the session;
    a request cancelled then hands it over with its Finished, so the text a client got is the session's."""
    stops = tuple(chr(c) + "\x00\x01\x02" for c in range(1, 128))  # every ASCII byte may start one: it is held

    async def main(seed: int) -> tuple[list[str], Finished]:
        stream: asyncio.Queue = asyncio.Queue()
        params = SamplingParams(max_tokens=100_000, temperature=1.0, seed=seed, stop=stops)
        request = scheduler.submit(engine.new_state(), engine.encode("xyz"), params, stream=stream)
        texts = []
        while len(texts) < 8:  # bounded by the test's timeout
            texts.append((await stream.get()).text)
        request.cancel()
        done = None
        async for item in request:
            if isinstance(item, TokenEvent):
                texts.append(item.text)
            done = item
        while not stream.empty():
            texts.append(stream.get_nowait().text)
        return texts, done

    scheduler = Scheduler(engine, prefill_chunk=64)
    scheduler.start()
    try:
        held = []
        for seed in range(12):  # whether the last byte is held depends on it (ASCII: held); some of these are
            texts, done = asyncio.run(main(seed))
            assert done.finish_reason == "cancelled"
            generated = b"".join(engine.tokenizer.token_bytes(t, None) for t in done.generated)
            assert "".join(texts) + done.text == generated.decode("utf-8", errors="replace"), seed
            held.append(done.text)
    finally:
        scheduler.stop()
    assert any(held), held


def test_stream_interval_must_be_positive(engine):
    with pytest.raises(ValueError, match="stream_interval"):
        Scheduler(engine, stream_interval=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_engine_loop_replays_cuda_graphs_and_generates_what_the_model_does_alone(tmp_path):
    """Six requests arriving together, then leaving at different steps (6 to 1 rows: sizes 8, 4, 2 and 1), each
    generating what it does alone, eagerly; every size was captured before the first request."""
    torch.manual_seed(0)
    model = MemTransformerLM(tiny_config(mem_len=12))
    for p in model.parameters():
        p.data.normal_(0, 0.3) if p.dim() > 1 else None
    save_checkpoint(model, tmp_path)
    engine = Engine.from_checkpoint(tmp_path, device="cuda")
    replays = []
    replay = torch.cuda.CUDAGraph.replay

    def counted(graph):
        replays.append(graph)
        return replay(graph)

    histories = [engine.encode(f"Speaker {i} says") for i in range(6)]
    prompts = [engine.encode(p) for p in (" and", " but", " so", " yes", " nor", " or")]
    torch.cuda.CUDAGraph.replay = counted
    try:
        async def main() -> list:
            scheduler = Scheduler(engine, prefill_chunk=64, max_batch=16)
            assert isinstance(scheduler.slots, GraphedTable)
            scheduler.start()
            try:  # as the server does, nothing else runs on the GPU while the engine thread captures its steps
                assert await asyncio.to_thread(scheduler.warmed.wait, 120)  # (a copy to it during one raises)
                assert sorted(scheduler.slots.graphs) == [1, 2, 4, 8, 16]
                requests = []
                for i, (history, prompt) in enumerate(zip(histories, prompts)):
                    state = engine.new_state()
                    engine.feed(state, history)
                    requests.append(scheduler.submit(state, prompt, SamplingParams(max_tokens=4 + i,
                                                                                   temperature=0)))

                async def tokens(request):
                    return [item.token async for item in request if isinstance(item, TokenEvent)]

                return list(await asyncio.gather(*(tokens(r) for r in requests)))
            finally:
                scheduler.stop()

        got = asyncio.run(main())
    finally:
        torch.cuda.CUDAGraph.replay = replay
    want = [_alone(engine, [h], [p], SamplingParams(max_tokens=4 + i, temperature=0))[0]
            for i, (h, p) in enumerate(zip(histories, prompts))]
    assert got == want
    assert len(replays) >= 5  # the steps ran as graphs


def test_a_failed_step_fails_its_requests_and_the_loop_serves_the_next_ones(engine, table):
    """A step that raises fails every request in the batch (the loop survives it); the decode table is emptied
    (a GPU's graphed table kept, with its rows and graphs, a new one of the others), and the next request
    generates what the model does alone."""
    greedy = SamplingParams(max_tokens=5, temperature=0)
    history, prompt = engine.encode("Speaker 0 says"), engine.encode(" and")
    advance = engine.decoder.advance
    fail = threading.Event()

    def failing(state, tokens):
        if fail.is_set() and tokens.size(1) == 1:
            fail.clear()
            raise RuntimeError("the step failed")
        return advance(state, tokens)

    async def main():
        scheduler = Scheduler(engine, prefill_chunk=64)
        engine.decoder.advance = failing
        scheduler.start()
        try:
            async def run():
                state = engine.new_state()
                engine.feed(state, history)
                return [item.token async for item in scheduler.submit(state, prompt, greedy)
                        if isinstance(item, TokenEvent)]

            assert await asyncio.to_thread(scheduler.warmed.wait, 60)  # its warm-up steps are not the one to fail
            first_table = scheduler.slots
            fail.set()
            with pytest.raises(RuntimeError, match="the step failed"):
                await run()
            kept = scheduler.slots is first_table
            return kept, scheduler.slots.n, await run()
        finally:
            scheduler.stop()
            del engine.decoder.advance

    kept, rows, tokens = asyncio.run(main())
    assert kept == (table == "graphed") and rows == 0
    assert tokens == _alone(engine, [history], [prompt], greedy)[0]


def test_warmed_is_set_once_the_engine_thread_has_warmed_up_even_if_that_failed(engine, monkeypatch):
    """The server listens once ``Scheduler.warmed`` is set (runtime.open_runtime): only after the warm-up (on a
    GPU, the captures) has run, and also when it failed, since the loop then runs eagerly."""
    release = threading.Event()

    def blocked_then_failing():
        assert release.wait(30)
        raise RuntimeError("warm-up failed")

    monkeypatch.setattr(engine.decoder, "warm_up", blocked_then_failing)
    scheduler = Scheduler(engine, prefill_chunk=64)
    scheduler.start()
    try:
        assert not scheduler.warmed.wait(0.2)  # the warm-up is blocked: not warmed, however long one waits
        release.set()
        assert scheduler.warmed.wait(30)
    finally:
        release.set()
        scheduler.stop()


def _varied_load(engine, overlap: bool) -> tuple[list[Finished], list[list[int]], int]:
    """A varied load on a GPU's graphed table (eagerly here): prompts of 0 to 5 tokens (0: a session continued
    from its memory alone), seeded temperatures and greedy rows, stop strings, requests ending at different steps,
    a second wave joining a busy batch (one with ``top_k``, whose steps draw every token on the host while it
    runs) and one request cancelled mid-stream. Each request's Finished, the tokens its stream saw, and how many
    steps ran overlapped."""
    overlapped = []

    async def main():
        scheduler = Scheduler(engine, prefill_chunk=64, max_batch=8, overlap=overlap)
        assert isinstance(scheduler.slots, GraphedTable)
        scheduler.start()
        assert await asyncio.to_thread(scheduler.warmed.wait, 120)  # captured (on a GPU) before anything runs
        launch = scheduler.slots.launch

        def counted(*args):
            overlapped.append(scheduler.slots.n)
            return launch(*args)

        scheduler.slots.launch = counted
        specs = [(f"Speaker {i} says", " and so"[:i], SamplingParams(max_tokens=4 + 3 * i, temperature=0.9,
                                                                       seed=i, stop=("e",) if i == 3 else ()))
                 for i in range(6)]
        specs[1] = (specs[1][0], specs[1][1], SamplingParams(max_tokens=9, temperature=0))
        later = [("Later 0", " yes", SamplingParams(max_tokens=6, temperature=0.7, seed=10, top_k=5)),
                 ("Later 1", "", SamplingParams(max_tokens=12, temperature=0.8, seed=11)),
                 ("Later 2", " no", SamplingParams(max_tokens=100_000, temperature=1.0, seed=12))]

        def submit(history, prompt, params):
            state = engine.new_state()
            engine.feed(state, engine.encode(history))
            return scheduler.submit(state, engine.encode(prompt), params)

        async def collect(request, cancel_after=None):
            seen, done = [], None
            async for item in request:
                if isinstance(item, TokenEvent):
                    seen.append(item.token)
                    if len(seen) == cancel_after:
                        request.cancel()
                elif isinstance(item, Finished):
                    done = item
            return done, seen

        try:
            first = [submit(*spec) for spec in specs]
            tasks = [asyncio.create_task(collect(r)) for r in first]
            while scheduler.steps < 3:  # the first wave is generating
                await asyncio.sleep(0.001)
            tasks += [asyncio.create_task(collect(submit(*spec), cancel_after=7 if i == 2 else None))
                      for i, spec in enumerate(later)]
            return await asyncio.wait_for(asyncio.gather(*tasks), 60)
        finally:
            scheduler.stop()

    results = asyncio.run(main())
    return [done for done, _ in results], [seen for _, seen in results], len(overlapped)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_overlapped_steps_generate_what_host_drawn_steps_do_and_store_exactly_what_was_streamed(engine, device,
                                                                                                monkeypatch):
    """On a graphed table every row's next token is drawn on the device at the end of its step and the next step
    is queued before the host has it (SGLang's overlap scheduler). The same varied load with and without it: each
    request draws the same tokens (a seeded request's draw per token is the same either way), and every
    session ends holding exactly its history, prompt and the tokens its stream was sent, no more: a request that
    ends, or is cancelled, while its row has drawn one more token stores none of it."""
    if device == "cuda":  # the same weights, its steps and token draws replayed as CUDA graphs
        engine = Engine(load_checkpoint(engine.ckpt.path, device="cuda"))
    else:
        monkeypatch.setattr(engine.decoder, "table", lambda capacity: GraphedTable(engine.decoder, capacity,
                                                                                   capture=False))
        monkeypatch.setattr(engine.decoder, "warm_up", lambda: None)
    done_on, seen_on, overlapped = _varied_load(engine, overlap=True)
    done_off, seen_off, none = _varied_load(engine, overlap=False)
    assert overlapped > 10 and none == 0
    cancelled = len(seen_on) - 1
    for i, (a, b) in enumerate(zip(seen_on, seen_off)):
        if i == cancelled:  # stopped after 7 tokens, give or take the step in flight: one draws a prefix of the other
            assert a[:7] == b[:7] and len(a) >= 7 and len(b) >= 7
        else:
            assert a == b, i
    histories = [f"Speaker {i} says" for i in range(6)] + [f"Later {i}" for i in range(3)]
    prompts = [" and so"[:i] for i in range(6)] + [" yes", "", " no"]
    for done, seen, history, prompt in zip(done_on + done_off, seen_on + seen_off, histories * 2, prompts * 2):
        assert done.generated == seen
        ids = engine.encode(history) + engine.encode(prompt) + seen
        assert done.tokens_seen == len(ids)
        alone = engine.new_state()
        engine.feed(alone, ids)
        torch.testing.assert_close(done.state.last_logits, alone.last_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(done.state.hid, alone.hid, atol=1e-5, rtol=1e-5)
    assert done_on[-1].finish_reason == "cancelled" and done_on[3].finish_reason in ("stop", "length")


def test_on_a_graphed_table_a_request_is_drawn_where_it_always_is_whatever_its_batch_mates_ask(engine,
                                                                                               monkeypatch):
    """The device's draw and the host's C kernel round apart (about 1e-3 of tokens of a 32k vocabulary on an H100),
    so a request whose tokens can be drawn on the device is drawn there in every step, also while a batch mate
    asking for ``top_k`` makes the step wait for the host's draws: its tokens do not depend on who it shares the
    batch with. Here the device's draw is made to differ every time (the token after the one drawn), so a single
    token drawn on the host would show."""
    import model.graphs

    real = model.graphs.sample_on_device
    monkeypatch.setattr(model.graphs, "sample_on_device", lambda *a: (real(*a) + 1) % engine.config.vocab_size)
    monkeypatch.setattr(engine.decoder, "table", lambda capacity: GraphedTable(engine.decoder, capacity,
                                                                               capture=False))
    monkeypatch.setattr(engine.decoder, "warm_up", lambda: None)
    plain = SamplingParams(max_tokens=12, temperature=0.9, seed=5)
    mate = SamplingParams(max_tokens=20, temperature=0.9, seed=6, top_k=4)  # drawn on the host: outlives plain

    async def main(with_mate: bool) -> tuple[list[int], int]:
        scheduler = Scheduler(engine, prefill_chunk=64)
        requests = []
        for history, params in [("Speaker 0 says", plain)] + ([("Speaker 1 says", mate)] if with_mate else []):
            state = engine.new_state()
            engine.feed(state, engine.encode(history))
            requests.append(scheduler.submit(state, engine.encode(" and"), params))
        steps = []
        step = scheduler._step
        scheduler._step = lambda on_device: (steps.append(on_device), step(on_device))
        scheduler.start()
        try:
            got = []
            for r in requests:
                got.append([item.token async for item in r if isinstance(item, TokenEvent)])
        finally:
            scheduler.stop()
        return got[0], len(steps)

    alone, waited_alone = asyncio.run(main(False))
    together, waited = asyncio.run(main(True))
    assert waited_alone == 0 and waited >= 12  # alone every step overlapped; with its mate every step waited
    assert together == alone


# -- a prompt's n choices read it once (Job.followers) ------------------------------------------------------------
LONG = "A prompt long enough to be read in several chunks of prefill, not in the decode batch. " * 2


def _choices(engine, ids, params, *, together: bool, start_first: bool = True, cancel=(), feed=None, copy=None,
             **kw):
    """Each of ``params``' runs of prompt ``ids``: all submitted together (the first with the rest as its
    ``copies``) or one after another, on a new scheduler; each run's items (or the error it ended with), and the
    prompt tokens the loop read. ``cancel``: the runs cancelled before the loop starts; ``feed``, ``copy``: the
    engine's prefill, its copy of a state, replaced."""

    async def main():
        scheduler = Scheduler(engine, prefill_chunk=64)
        if start_first:
            scheduler.start()
        if feed is not None:
            engine.feed = feed
        if copy is not None:
            engine.copy_state = copy
        try:
            if together:
                first = scheduler.submit(engine.new_state(), ids, params[0], copies=[(p, None) for p in params[1:]],
                                         **kw)
                requests = [first, *first.copies]
                for i in cancel:
                    requests[i].cancel()
                if not start_first:
                    scheduler.start()
                got = await asyncio.gather(*(_items(r) for r in requests), return_exceptions=True)
            else:
                got = [await _items(scheduler.submit(engine.new_state(), ids, p, **kw)) for p in params]
            return got, scheduler.prompt_tokens
        finally:
            scheduler.stop()
            if feed is not None:
                del engine.feed
            if copy is not None:
                del engine.copy_state

    return asyncio.run(main())


def _tokens(items) -> list[int]:
    return [item.token for item in items if isinstance(item, TokenEvent)]


def test_a_prompts_choices_read_it_once_and_each_generates_what_it_alone_does(engine, table):
    """A request's n choices of one prompt: the loop reads the prompt once (not n times) and copies the state
    into each; every choice draws, token for token, what its own request draws (sampled with its seed, and
    greedy), on every kind of decode table."""
    ids = engine.encode(LONG)
    assert len(ids) > 2 * 64  # read in chunks, by prefill
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=5 + j) for j in range(3)]
    params.append(SamplingParams(max_tokens=10, temperature=0, logprobs=2))
    alone, read_alone = _choices(engine, ids, params, together=False)
    together, read_together = _choices(engine, ids, params, together=True)
    assert read_alone == 4 * len(ids) and read_together == len(ids)
    assert [_tokens(items) for items in together] == [_tokens(items) for items in alone]
    assert len({tuple(_tokens(items)) for items in together[:3]}) > 1  # the seeds made different samples
    for got, want in zip(together, alone):
        assert got[-1].finish_reason == want[-1].finish_reason == "length" and got[-1].state is not None
        assert int(got[-1].state.seen[0]) == len(ids) + 10
        got_top, want_top = got[-2].top_logprobs, want[-2].top_logprobs  # the greedy run's alternatives too
        assert (got_top is None) == (want_top is None)
        if got_top is not None:  # (rows decoded together differ from one alone in the last bits)
            assert [t for t, _ in got_top] == [t for t, _ in want_top]
            assert [lp for _, lp in got_top] == pytest.approx([lp for _, lp in want_top], abs=1e-5)
    assert together[1][-1].state is not together[0][-1].state  # each choice its own copy


def test_a_copy_holds_no_copy_of_the_prompt_until_it_takes_the_state(engine):
    """127 copies of a million-token prompt were a gigabyte, made on the event loop (found by a review): a copy
    is given what it still has to read when it takes the state, and shares the prompt's tokens for
    repetition_penalty."""
    async def main():
        scheduler = Scheduler(engine)  # not started: the jobs stay as submit made them
        ids = engine.encode(LONG)
        penalized = SamplingParams(repetition_penalty=1.5)
        first = scheduler.submit(engine.new_state(), ids, penalized, copies=[(penalized, None), (None, None)])
        assert scheduler.waiting == 3  # every choice counts as waiting from its submit on (copies had not, here)
        scheduler._drain(block=False)
        assert scheduler.waiting == 3 and len(scheduler.prefilling) == 1
        return ids, first.job, [c.job for c in first.copies]

    ids, job, copies = asyncio.run(main())
    assert [c.pending for c in copies] == [[], []] and copies[0].state is None
    assert copies[0].prompt is job.prompt == set(ids) and copies[1].prompt == set()


def test_choices_waiting_for_a_row_share_one_state_and_take_their_own_as_they_join(engine):
    """n choices beyond the free rows had each held a state while they waited: they share one copy of the
    prompt's state until each takes a row, and then generate what they do alone."""
    ids, greedy = engine.encode(LONG), SamplingParams(max_tokens=6, temperature=0)
    want = _tokens(_choices(engine, ids, [greedy], together=False)[0][0])

    async def main():
        scheduler = Scheduler(engine, max_batch=1, prefill_chunk=64)  # one row: the first choice holds it
        scheduler.start()
        try:
            first = scheduler.submit(engine.new_state(), ids, UNTIL_STOPPED, copies=[(greedy, None)] * 2)
            it = first.__aiter__()
            assert isinstance(await it.__anext__(), TokenEvent)  # generating in the only row
            waiting = list(scheduler.ready)
            assert [j.state for j in waiting] == [None, None] and waiting[0].source is waiting[1].source
            assert int(waiting[0].source.state.seen[0]) == len(ids) and waiting[0].source.waiting == 2
            first.cancel()
            async for _ in it:
                pass
            return [_tokens(await _items(c)) for c in first.copies]
        finally:
            scheduler.stop()

    assert asyncio.run(main()) == [want, want]


def test_the_last_choice_to_take_the_shared_state_takes_it_without_a_copy(engine):
    """The prompt's state is copied once for its choices; each but the last copies that as it takes a row, and
    the last takes it itself (it had been copied for nobody), waiting choices that left counted out; scored
    choices (max_tokens 0) end with the prompt's own state, and nothing is copied for them."""
    ids, greedy = engine.encode(LONG), SamplingParams(max_tokens=4, temperature=0)
    want = _tokens(_choices(engine, ids, [greedy], together=False)[0][0])
    calls, copy_state = [], engine.copy_state

    def counted(state):
        calls.append(state)
        return copy_state(state)

    got, _ = _choices(engine, ids, [greedy] * 4, together=True, copy=counted)
    assert [_tokens(g) for g in got] == [want] * 4 and len(calls) == 3  # 1 shared + 2 (it was 1 + 3)
    assert len({id(g[-1].state) for g in got}) == 4  # still each its own
    calls.clear()
    got, _ = _choices(engine, ids, [greedy] * 3, together=True, copy=counted, cancel=(1,))
    assert [_tokens(g) for g in (got[0], got[2])] == [want] * 2 and len(calls) == 1  # the one left counted out
    calls.clear()
    scored, _ = _choices(engine, ids, [None] * 3, together=True, copy=counted, prompt_logprobs=0, scored=False)
    assert calls == [] and all(int(done.state.seen[0]) == len(ids) for _, done in scored)


def test_a_choice_whose_own_state_cannot_be_made_as_it_joins_fails_alone(engine):
    ids, greedy = engine.encode(LONG), SamplingParams(max_tokens=6, temperature=0)
    want = _tokens(_choices(engine, ids, [greedy], together=False)[0][0])
    calls, copy_state = [], engine.copy_state

    def second_fails(state):  # the first copies the prompt's state for the choices; the second is one's own
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory (simulated)")
        return copy_state(state)

    got, _ = _choices(engine, ids, [greedy] * 3, together=True, copy=second_fails)
    assert _tokens(got[0]) == want and sum(isinstance(g, RuntimeError) for g in got[1:]) == 1
    assert [_tokens(g) for g in got[1:] if not isinstance(g, RuntimeError)] == [want]


def test_a_prompts_choices_scored_share_the_scores_of_one_read(engine):
    """Echo with logprobs and max_tokens 0 (lm-eval's scoring) with n: each choice gets the prompt's scores
    and its end; the prompt was read once."""
    ids = engine.encode(LONG)
    alone, _ = _choices(engine, ids, [None], together=False, prompt_logprobs=2, scored=False)
    together, read = _choices(engine, ids, [None] * 3, together=True, prompt_logprobs=2, scored=False)
    assert read == len(ids)
    for items in together:
        scores, done = items
        assert scores == alone[0][0] and len(scores) == len(ids)
        assert isinstance(done, Finished) and done.finish_reason is None and int(done.state.seen[0]) == len(ids)
    assert len(alone[0][0].ranks) == 0  # counted only when asked for
    ranked, _ = _choices(engine, ids, [None] * 2, together=True, prompt_logprobs=2, prompt_ranks=True, scored=False)
    for scores, _done in ranked:  # vLLM's prompt_logprobs: each choice gets the ranks with the same scores
        assert list(scores.ranks) == list(engine.token_scores(engine.new_state(), ids, 0, ranks=True).ranks)
        assert scores.ranks[0] == 0 and min(scores.ranks[1:]) >= 1 and len(scores.ranks) == len(ids)
        assert list(scores.entries()) == list(alone[0][0].entries())


def test_a_short_prompts_choices_each_read_it_in_the_batch(engine):
    """A prompt the batch reads as it joins (a few tokens): its choices join as requests of their own."""
    ids = engine.encode(" and")
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=j) for j in range(3)]
    alone, _ = _choices(engine, ids, params, together=False)
    together, read = _choices(engine, ids, params, together=True)
    assert [_tokens(items) for items in together] == [_tokens(items) for items in alone]
    assert read == 3 * len(ids)


def test_a_prompts_choices_cancelled_while_it_is_read(engine):
    """Every choice cancelled before the prompt is read: none reads it, each ends cancelled with nothing
    stored. The first alone cancelled: the prompt is still read for the others, which generate in full, and the
    first ends cancelled with the prompt read."""
    ids = engine.encode(LONG)
    params = [SamplingParams(max_tokens=5, temperature=0)] * 3
    got, read = _choices(engine, ids, params, together=True, start_first=False, cancel=(0, 1, 2))
    assert read == 0
    assert all(items == [Finished(None, 0, "cancelled", ended=items[0].ended)] for items in got)
    got, read = _choices(engine, ids, params, together=True, start_first=False, cancel=(0,))
    assert read == len(ids)
    assert got[0][-1].finish_reason == "cancelled" and int(got[0][-1].state.seen[0]) == len(ids)
    assert [len(_tokens(items)) for items in got[1:]] == [5, 5]


def test_a_prompt_read_that_fails_fails_each_of_its_choices(engine):
    def failing(state, tokens):
        raise RuntimeError("the prefill failed")

    params = [SamplingParams(max_tokens=5, temperature=0)] * 3
    got, _ = _choices(engine, engine.encode(LONG), params, together=True, feed=failing)
    assert all(isinstance(error, RuntimeError) and "prefill failed" in str(error) for error in got)


@pytest.mark.parametrize("prompt", [LONG, " and"])  # copied once it is read; copied as it joins
def test_a_copy_of_a_prompts_state_that_fails_fails_that_request_alone(engine, prompt):
    """Copies are new device memory (up to 127 of them): one that fails (out of memory, say) fails the request's
    choices, and a request generating beside them goes on (it had failed with them: found by a review)."""
    def failing(state):
        raise RuntimeError("out of memory (simulated)")

    async def main():
        scheduler = Scheduler(engine, prefill_chunk=64)
        scheduler.start()
        try:
            async with _busy(scheduler, engine) as busy:
                engine.copy_state = failing
                first = scheduler.submit(engine.new_state(), engine.encode(prompt), SamplingParams(max_tokens=4),
                                         copies=[(SamplingParams(max_tokens=4), None)] * 2)
                got = await asyncio.gather(*(_items(r) for r in (first, *first.copies)), return_exceptions=True)
                assert not busy.job.cancelled and busy.job in scheduler.active  # still generating
            return got
        finally:
            scheduler.stop()
            del engine.copy_state

    got = asyncio.run(main())
    assert all(isinstance(error, RuntimeError) and "simulated" in str(error) for error in got), got


async def _items(request) -> list:
    return [item async for item in request]

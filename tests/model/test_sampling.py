"""Batched sampling: every row as if alone, the right distribution, and nothing outside top_k / top_p."""

from __future__ import annotations

import random

import pytest
import torch

from model import fused
from model.sampling import (
    SamplingParams,
    ScoredTokens,
    drawn_on_device,
    rows_logprobs,
    sample_on_device,
    sample_rows,
    token_logprobs,
)
from txlserve.errors import InvalidRequestError

MIXED = [SamplingParams(temperature=0.8), SamplingParams(temperature=0), SamplingParams(temperature=1.3, top_k=5),
         SamplingParams(temperature=0.7, top_p=0.6), SamplingParams(temperature=1.0, top_k=40, top_p=0.9),
         SamplingParams(temperature=1e-7)]


class Fixed(random.Random):
    """A generator that always draws ``u``: the ends of [0, 1) on purpose."""

    def __init__(self, u: float) -> None:
        super().__init__(0)
        self.u = u

    def random(self) -> float:
        return self.u


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def path(request, monkeypatch) -> str:
    """Every test runs on both paths: plain rows in one C call where the kernels are built, and torch ops."""
    if request.param == "torch":
        monkeypatch.setattr(fused, "available", lambda: False)
    elif not fused.available():
        pytest.skip("no C/C++ compilers here: the kernels are not built")
    return request.param


def test_a_row_draws_the_same_token_alone_and_in_any_batch():
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        rows = [MIXED[(trial + i) % len(MIXED)] for i in range(7)]
        logits = 3 * torch.randn(len(rows), 256, generator=gen)
        seeds = [trial * 100 + i for i in range(len(rows))]
        together = sample_rows(logits, rows, [random.Random(s) for s in seeds])
        alone = [sample_rows(logits[r:r + 1], [rows[r]], [random.Random(seeds[r])])[0] for r in range(len(rows))]
        assert together == alone


def test_draws_follow_the_softmax_of_the_scaled_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    params = SamplingParams(temperature=0.7)
    draws = sample_rows(logits.expand(20_000, 5), [params] * 20_000, [random.Random(1)] * 20_000)
    counts = torch.bincount(torch.tensor(draws), minlength=5).float()
    want = torch.softmax(logits[0] / 0.7, -1)
    assert torch.allclose(counts / counts.sum(), want, atol=0.015), (counts / counts.sum(), want)


def test_greedy_rows_take_the_most_likely_token():
    logits = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    got = sample_rows(logits, [SamplingParams(temperature=0)] * 4, [random.Random(i) for i in range(4)])
    assert got == logits.argmax(-1).tolist()


def test_top_k_and_top_p_never_choose_outside_their_set_even_at_the_ends_of_the_draw():
    logits = torch.randn(1, 256, generator=torch.Generator().manual_seed(5))
    order = logits[0].argsort(descending=True).tolist()
    probs = torch.softmax(logits[0], -1)[order]
    nucleus = int((probs.cumsum(-1) - probs < 0.5).sum())  # the smallest prefix reaching 0.5
    for params, allowed in ((SamplingParams(top_k=3), set(order[:3])),
                            (SamplingParams(top_p=0.5), set(order[:nucleus])),
                            (SamplingParams(top_p=1e-9), {order[0]})):
        for u in (0.0, 0.5, 1 - 2**-53):
            assert sample_rows(logits, [params], [Fixed(u)])[0] in allowed
        seen = {sample_rows(logits, [params], [random.Random(s)])[0] for s in range(300)}
        assert seen <= allowed and (len(allowed) == 1 or len(seen) > 1)


def test_a_seed_fixes_the_draws():
    logits = torch.randn(3, 256, generator=torch.Generator().manual_seed(7))
    params = [SamplingParams(seed=11)] * 3

    def draws(seed_rngs):
        return [sample_rows(logits, params, seed_rngs) for _ in range(10)]

    assert draws([p.generator() for p in params]) == draws([p.generator() for p in params])
    assert draws([p.generator() for p in params]) != draws([SamplingParams(seed=12).generator() for _ in params])
    # a negative seed is its own (random.Random takes an integer's absolute value: -11 drew what 11 draws)
    assert draws([p.generator() for p in params]) != draws([SamplingParams(seed=-11).generator() for _ in params])
    for bad in (1 << 63, -(1 << 63) - 1, 2**70):  # vLLM's range: a 64-bit signed integer
        with pytest.raises(InvalidRequestError, match="64-bit"):
            SamplingParams(seed=bad)


def test_plain_rows_stay_in_the_vocabulary_at_the_ends_of_the_draw():
    gen = torch.Generator().manual_seed(9)
    for vocab in (1, 5, 256, 257, 1000):
        logits = torch.randn(3, vocab, generator=gen)
        logits[1, -1] = 30.0  # one token holds almost all the mass: the far end of the CDF
        for u in (0.0, 0.5, 1 - 2**-53):
            got = sample_rows(logits, [SamplingParams(temperature=t) for t in (1.0, 0.5, 2.0)], [Fixed(u)] * 3)
            assert all(0 <= t < vocab for t in got)
            assert got[1] == vocab - 1 or u == 0.0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_tokens_drawn_on_the_device_are_the_hosts_for_the_same_draws(device, path):
    """A GPU's overlapped steps draw each row's token where its scores lie, from the draw the request's generator
    gave the host (sample_on_device): for rows of temperature alone it takes the host's token, greedy rows
    included, at the ends of the draw too, in any batch; what it cannot draw (top_k, top_p, logprobs) the host
    does."""
    if path == "torch" and device == "cpu":
        pytest.skip("the host's torch ops are these ops on a CPU: the C kernel is the other host path")
    gen = torch.Generator().manual_seed(13)
    temps = [0.8, 0.0, 1.3, 1e-7, 2.0, 0.5]
    params = [SamplingParams(temperature=t) for t in temps]
    t = torch.tensor(temps, dtype=torch.float64, device=device)
    for trial in range(20):
        logits = 3 * torch.randn(len(temps), 257, generator=gen)
        draws = [random.Random(trial * 10 + i).random() for i in range(len(temps))]
        host = sample_rows(logits, params, [Fixed(x) for x in draws])
        dev, d = logits.to(device), torch.tensor(draws, dtype=torch.float64, device=device)
        assert sample_on_device(dev, t, d).tolist() == host
        assert [int(sample_on_device(dev[r:r + 1], t[r:r + 1], d[r:r + 1])) for r in range(len(temps))] == host
    # at the very ends of the draw the two may part by rounding (the C kernel sums in float64), never leaving the
    # tokens that carry the mass
    logits = 3 * torch.randn(len(temps), 257, generator=gen)
    logits[:, -1] = -1e4  # a last token of no mass (in float32): no draw takes it, at the far end either
    for u in (0.0, 1 - 2**-53):
        got = sample_on_device(logits.to(device), t, torch.full((len(temps),), u, dtype=torch.float64, device=device))
        assert all(0 <= x < 256 for x in got.tolist())
    assert [drawn_on_device(p, 257) for p in MIXED] == [True, True, False, False, False, True]
    assert not drawn_on_device(SamplingParams(logprobs=0), 257) and drawn_on_device(SamplingParams(top_k=257), 257)


def test_logprobs_of_many_rows_are_each_rows_own():
    """A scored prompt's rows in one pass, into arrays: each row's chosen log-probability and alternatives as
    scoring it alone (the chosen token appended where it is not among the top ones, as OpenAI gives it), for
    top_n 0, 1 and 20; and the arrays' bytes read back the same."""
    gen = torch.Generator().manual_seed(5)
    logits = 4 * torch.randn(64, 300, generator=gen)  # [rows, vocab]
    tokens = torch.randint(0, 300, (64,), generator=gen).tolist()
    tokens[3] = int(logits[3].argmax())  # one chosen token that is the top one
    for top_n in (0, 1, 20):
        got = rows_logprobs(logits, tokens, top_n)
        assert ScoredTokens.from_bytes(got.to_bytes()) == got and len(got) == 64
        for row, token, (lp, alts) in zip(logits, tokens, got.entries(), strict=True):
            logp = torch.log_softmax(row, -1)  # [vocab]
            assert lp == pytest.approx(float(logp[token]), abs=1e-6)
            top = torch.topk(logp, top_n)
            want = list(zip(top.indices.tolist(), top.values.tolist()))
            assert [t for t, _ in alts[:top_n]] == [t for t, _ in want]
            assert [v for _, v in alts[:top_n]] == pytest.approx([v for _, v in want], abs=1e-6)
            assert alts[top_n:] == ([] if token in top.indices.tolist() else [(token, lp)])
    assert list(got.entries())[3][1][0][0] == tokens[3] and list(got.counts)[3] == 20 and list(got.counts)[4] == 21
    assert token_logprobs(logits[7], tokens[7], 5) == next(rows_logprobs(logits[7:8], tokens[7:8], 5).entries())
    entries = [(None, []), (-0.5, [(3, -0.25), (7, -1.5)]), (-1.0, [])]  # a first token, and one of top_n 0
    first = ScoredTokens.of(entries)
    assert list(first.entries()) == entries and first.known() == (2, -1.5)
    first.extend(got)
    assert len(first) == 67 and list(first.entries())[3:] == list(got.entries())


def test_ranks_count_the_tokens_at_least_as_likely_and_only_when_asked_for():
    """vLLM's prompt_logprobs rank: 1 + the tokens strictly likelier, ties counted against the token (vLLM counts
    ``logprobs >= the token's``); the scores are the same with or without ranks, and ranks cross the wire too."""
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(40, 257, generator=gen)  # [rows, vocab]
    logits[5, :3] = logits[5, 3]  # a tie of four at row 5's token 3
    tokens = torch.randint(0, 257, (40,), generator=gen).tolist()
    tokens[5], tokens[9] = 3, int(logits[9].argmax())
    plain, ranked = rows_logprobs(logits, tokens, 2), rows_logprobs(logits, tokens, 2, ranks=True)
    assert len(plain.ranks) == 0 and ScoredTokens(**{**vars(ranked), "ranks": plain.ranks}) == plain
    for row, token, rank in zip(logits, tokens, ranked.ranks, strict=True):
        assert rank == 1 + sorted(row.tolist(), reverse=True).index(float(row[token])) + (
            row == row[token]).sum().item() - 1
    assert ranked.ranks[9] == 1 and ranked.ranks[5] == 4 + int((logits[5] > logits[5, 3]).sum())
    assert ScoredTokens.from_bytes(ranked.to_bytes()) == ranked
    first = ScoredTokens.of([(None, [])], [0])
    first.extend(ranked)
    assert list(first.ranks) == [0, *ranked.ranks] and ScoredTokens.from_bytes(first.to_bytes()) == first


def test_logit_bias_bans_and_forces_tokens_and_leaves_the_other_rows_and_the_scores_as_they_were():
    import dataclasses
    import json

    torch.manual_seed(0)
    logits = torch.randn(1, 50).repeat(4, 1)  # [4, 50]: one row's scores, four requests
    before = logits.clone()
    top = int(logits[0].argmax())
    plain = SamplingParams(temperature=0)
    banned = SamplingParams(temperature=0, logit_bias=((top, -100),))
    forced = SamplingParams(temperature=1.5, seed=3, logit_bias=[[7, 100], [top, -100]])  # as JSON gives it back
    sampled = SamplingParams(temperature=1.5, seed=3)
    params = [plain, banned, forced, sampled]
    got = sample_rows(logits, params, [p.generator() for p in params])
    second = int(logits[0].masked_fill(torch.arange(50) == top, float("-inf")).argmax())
    assert got[:3] == [top, second, 7]
    assert got[3] == sample_rows(logits[:1], [sampled], [sampled.generator()])[0]  # a row without bias: as alone
    assert torch.equal(logits, before)  # the model's scores (a request's logprobs) are not biased
    assert forced.logit_bias == ((7, 100), (top, -100))
    assert drawn_on_device(sampled, 50) and not drawn_on_device(forced, 50)  # a GPU's rows draw it on the host
    assert SamplingParams(**json.loads(json.dumps(dataclasses.asdict(forced)))) == forced  # the engine process's trip
    for bad, said in ((((1, 101),), "bias 101 of token 1"), (((1, True),), "bias True"),
                      (((1, 1), (1, 2)), "token 1 twice"), (((-1, 1),), "token ids"),
                      (tuple((t, 1) for t in range(1025)), "at most 1024")):
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(logit_bias=bad)
        assert err.value.param == "logit_bias" and said in err.value.message, err.value.message


def test_allowed_token_ids_are_the_only_tokens_drawn_and_the_scores_stay_the_models():
    """vLLM's allowed_token_ids: greedy takes the likeliest allowed token, sampling draws only allowed ones, with
    the other fields applied among them; the C sampler and a GPU's draw leave such rows to the torch ops."""
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    before = logits.clone()
    allowed = (3, 7, 11)
    greedy = SamplingParams(temperature=0, allowed_token_ids=list(allowed))  # a list once through JSON
    want = max(allowed, key=lambda t: float(logits[0, t]))
    assert sample_rows(logits, [greedy], [greedy.generator()]) == [want] and greedy.allowed_token_ids == allowed
    banned = SamplingParams(temperature=0, allowed_token_ids=allowed, logit_bias=((want, -100),))
    assert sample_rows(logits, [banned], [banned.generator()])[0] in set(allowed) - {want}
    draws = {sample_rows(logits, [p], [p.generator()])[0]
             for p in (SamplingParams(temperature=2.0, seed=s, allowed_token_ids=allowed) for s in range(60))}
    assert draws == set(allowed)
    assert torch.equal(logits, before) and not drawn_on_device(greedy, 50)
    assert SamplingParams(allowed_token_ids=[7, 3] * 50).allowed_token_ids == (3, 7)  # each once: the mask's size
    for bad in ((1, -2), (1,) * 4097):  # a body-sized list had built a million-entry mask every step (a review)
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(allowed_token_ids=bad)
        assert err.value.param == "allowed_token_ids"


def test_a_bias_of_minus_100_bans_a_token_whatever_penalties_do_to_the_others():
    """Added, -100 was outweighed once a penalty passed it (found by a helper): it is -inf."""
    logits = torch.zeros(1, 8)
    p = SamplingParams(temperature=1.0, logit_bias=tuple((t, -100) for t in range(1, 8)), frequency_penalty=2.0)
    draws = {sample_rows(logits, [p], [random.Random(s)], [[0] * 60])[0] for s in range(50)}
    assert draws == {0}


def test_frequency_and_presence_penalties_count_the_tokens_generated_so_far():
    """OpenAI's: a token's logit less frequency_penalty x its count and presence_penalty once it has come."""
    logits = torch.zeros(1, 10)
    logits[0, 3], logits[0, 5] = 3.0, 0.5  # greedy takes 3 until its penalty passes 2.5
    for kw, history, want in (({"frequency_penalty": 1.0}, [3, 3], 3), ({"frequency_penalty": 1.0}, [3, 3, 3], 5),
                              ({"presence_penalty": 2.0}, [], 3), ({"presence_penalty": 2.0}, [3], 3),
                              ({"presence_penalty": 2.0, "frequency_penalty": 1.0}, [3], 5),
                              ({"frequency_penalty": -1.0}, [5, 5, 5], 5)):
        p = SamplingParams(temperature=0, **kw)
        assert not drawn_on_device(p, 10)
        assert sample_rows(logits, [p], [p.generator()], [history]) == [want], (kw, history)
    assert torch.equal(logits[0, :6], torch.tensor([0, 0, 0, 3.0, 0, 0.5]))  # the scores themselves unchanged
    for bad in ({"frequency_penalty": 2.5}, {"presence_penalty": -3}, {"presence_penalty": True}):
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(**bad)
        assert err.value.param == next(iter(bad))


def test_min_p_drops_the_tokens_under_its_share_of_the_likeliest():
    """vLLM's: after temperature, a token less likely than min_p x the likeliest is never drawn."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))  # [1, 4]
    for min_p, allowed in ((0.0, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.5, {0, 1}), (1.0, {0})):
        p = SamplingParams(temperature=1.0, min_p=min_p)
        assert drawn_on_device(p, 4) is (min_p == 0)
        seen = {sample_rows(logits, [p], [random.Random(s)])[0] for s in range(400)}
        assert seen == allowed, (min_p, seen)
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(min_p=1.5)
    assert err.value.param == "min_p"


def test_repetition_penalty_divides_a_seen_tokens_positive_logit_and_multiplies_a_negative_one():
    """vLLM's (Hugging Face's): on the prompt's and the generated tokens, after the bias, before the others."""
    logits = torch.tensor([[0.0, -1.0, 0.0, 3.0, 0.0, 2.0]])  # [1, 6]
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample_rows(logits, [p], [p.generator()], [[]], [set()]) == [3]
    assert sample_rows(logits, [p], [p.generator()], [[]], [{3}]) == [5]  # 3 / 2 < 2
    assert sample_rows(logits, [p], [p.generator()], [[]], [{3, 5}]) == [3]  # 1.5 > 1
    neg = torch.tensor([[-0.5, -1.0]])
    gentle = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert sample_rows(neg, [gentle], [random.Random(0)], [[]], [{0}]) == [0]  # -0.5 x 1.5 = -0.75 > -1
    assert sample_rows(neg, [SamplingParams(temperature=0, repetition_penalty=3.0)], [random.Random(0)], [[]],
                       [{0}]) == [1]  # -1.5 < -1
    assert not drawn_on_device(p, 6) and torch.equal(logits[0, 3], torch.tensor(3.0))
    for bad in (0, -1, True):
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(repetition_penalty=bad)
        assert err.value.param == "repetition_penalty"


def test_a_generation_keeps_the_tokens_its_repetition_penalty_applies_to():
    from model.engine import Generation

    gen = Generation(SamplingParams(max_tokens=5, repetition_penalty=1.3), prompt=[1, 2, 2])
    gen.accept(7, None)
    assert gen.seen == {1, 2, 7}
    assert Generation(SamplingParams(max_tokens=5), prompt=[1, 2]).seen == set()  # none kept without it

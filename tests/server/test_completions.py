"""/v1/completions over a real socket: shapes, SSE, the official OpenAI SDK, sessions and invariance."""

from __future__ import annotations

import codecs
import json
import re
import time

import httpx
import pytest
from websockets.sync.client import connect

from server.protocol import CompletionObject
from tests.live import LONG, MODEL, wait_for

TEXT_A = "It was the best of times, it was the worst of times, "
TEXT_B = "it was the age of wisdom, it was the age of foolishness, "
TEXT_C = "it was the epoch of belief"


def complete(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(server, **body) -> list:
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json={"model": MODEL, "stream": True, **body},
                      timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        buf = ""
        for chunk in r.iter_text():
            buf += chunk
        for block in buf.split("\n\n"):
            if block:
                assert block.startswith("data: "), block
                payload = block[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_completion_shape(server):
    out = complete(server, prompt="Hello", max_tokens=7, temperature=0)
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-") and out["model"] == MODEL
    assert isinstance(out["created"], int)
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert len(choice["text"].encode()) == 7 and choice["text"].isascii()
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    assert "session" not in out
    # the shape the OpenAPI document gives its 200 (it gave none: a generated client read "string")
    doc = httpx.get(server.url + "/openapi.json").json()
    ok = doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"] == "#/components/schemas/CompletionObject"
    assert "text/event-stream" in ok
    assert CompletionObject.model_validate(out).dump() == out


def test_sse_exact_shape(server):
    events = sse_events(server, prompt="Hello", max_tokens=6, temperature=0,
                        stream_options={"include_usage": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    ids = {c["id"] for c in chunks}
    created = {c["created"] for c in chunks}
    assert len(ids) == 1 and len(created) == 1
    for c in chunks:
        assert c["object"] == "text_completion" and c["model"] == MODEL
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    final = chunks[-2]
    assert final["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])  # OpenAI's: null before the usage chunk
    assert text == complete(server, prompt="Hello", max_tokens=6, temperature=0)["choices"][0]["text"]


def test_without_usage_no_usage_chunk(server):
    events = sse_events(server, prompt="Hi", max_tokens=3, temperature=0)
    assert all("usage" not in e for e in events[:-1]) and events[-1] == "[DONE]"


def test_logprobs_zero_names_the_sampled_token_alone(server):
    lp = complete(server, prompt="Once", max_tokens=6, temperature=1.0, seed=7, logprobs=0)["choices"][0]["logprobs"]
    assert [list(top) for top in lp["top_logprobs"]] == [[tok] for tok in lp["tokens"]]  # was [{}, {}, ...]
    assert [top[tok] for tok, top in zip(lp["tokens"], lp["top_logprobs"])] == lp["token_logprobs"]


def test_seed_determinism_and_logprobs(server):
    a = complete(server, prompt="Once", max_tokens=12, temperature=1.0, seed=42, logprobs=2)
    b = complete(server, prompt="Once", max_tokens=12, temperature=1.0, seed=42, logprobs=2)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    lp = a["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 12
    assert all(v <= 0 for v in lp["token_logprobs"])
    # OpenAI's rule: the 2 most likely, and the sampled token too when it is not one of them (temperature 1)
    assert all(len(top) in (2, 3) and tok in top and top[tok] == v
               for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))


def test_stop_and_echo(server):
    free = complete(server, prompt="The", max_tokens=30, temperature=0)["choices"][0]["text"]
    stop = free[5:7]
    out = complete(server, prompt="The", max_tokens=30, temperature=0, stop=["\u2603", stop])
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["text"] == free[: free.index(stop)]
    echoed = complete(server, prompt="The", max_tokens=5, temperature=0, echo=True)
    assert echoed["choices"][0]["text"].startswith("The")


def test_text_offsets_count_the_tokens_held_back_for_a_stop_string(server):
    """A generated token's text_offset is where its text starts: the text released so far lagged while the start
    of a stop string was held back, and tokens shared an offset (found by a helper). The test model writes ASCII,
    one character a token, so the offsets run one by one from the echoed prompt's end, in every surface."""
    stops = [c + "\x00\x01" for c in " ea\n"]  # each of these characters is held until the next token
    body = dict(prompt="ROMEO.", max_tokens=30, temperature=0.8, seed=3, logprobs=0, stop=stops)
    for echo in (False, True):
        got = complete(server, **body, echo=echo)["choices"][0]
        generated = got["logprobs"]["text_offset"][len("ROMEO.") if echo else 0:]
        start = len("ROMEO.") if echo else 0
        assert generated == list(range(start, start + 30)), generated
        assert got["text"][start:] == "".join(got["logprobs"]["tokens"][-30:])
    chunks = [e["choices"][0] for e in sse_events(server, **body) if isinstance(e, dict) and e["choices"]]
    streamed = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert streamed == list(range(30))


def test_a_stray_byte_moves_the_next_tokens_offset_past_its_replacement(server):
    """A byte that begins no character becomes U+FFFD only once the next token shows it cannot complete: that token
    was given the U+FFFD's offset (found by a helper). A byte that completes a character keeps its start."""
    ids = [195, 65, 0xE2, 0x82, 0xAC, 66]  # a stray lead byte, "A", "€" in three bytes, "B"
    got = complete(server, prompt=ids, max_tokens=0, echo=True, logprobs=0)["choices"][0]
    assert got["text"] == "\ufffdA€B"
    assert got["logprobs"]["text_offset"] == [0, 1, 2, 2, 2, 3]


def test_a_scored_prompt_too_large_to_answer_is_refused_before_it_is_read(server):
    """20 alternatives for each token of a 400 KB prompt made a 200 MB response and held 2 GB while it was built;
    an 800 KB append, 4 GB (found by a helper). Past --max-logprobs-values (1,000,000) it is a 400 at once."""
    text = "a" * 50_000  # 50,000 tokens x 21 = 1,050,000
    for body in ({"echo": True, "logprobs": 20, "max_tokens": 0}, {"echo": True, "logprobs": 20, "max_tokens": 1}):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": text, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
        assert "over this server's limit of 1,000,000 (--max-logprobs-values): score at most 47,619 tokens" in \
            r.json()["error"]["message"]
    sid = httpx.post(server.url + "/v1/sessions", json={"text": "Begin "}, timeout=30).json()["id"]
    r = httpx.post(f"{server.url}/v1/sessions/{sid}/append", json={"text": text, "logprobs": 20}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    assert httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=30).json()["tokens_seen"] == len("Begin ")
    ok = complete(server, prompt=text[:1000], echo=True, logprobs=20, max_tokens=0)  # within it
    assert len(ok["choices"][0]["logprobs"]["tokens"]) == 1000


def test_max_tokens_zero_with_echo_scores_the_prompt(server):
    """OpenAI's and vLLM's way to score a prompt: max_tokens 0 with echo gives the prompt back (with logprobs, its
    tokens' scores) and generates nothing; it was a 400. A session keeps the prompt, as an append would."""
    one = complete(server, prompt="ROMEO.", max_tokens=1, echo=True, logprobs=2, temperature=0)["choices"][0]
    zero = complete(server, prompt="ROMEO.", max_tokens=0, echo=True, logprobs=2)
    got = zero["choices"][0]
    assert got["text"] == "ROMEO." and got["finish_reason"] == "length" and zero["usage"]["completion_tokens"] == 0
    for key in ("tokens", "text_offset"):
        assert got["logprobs"][key] == one["logprobs"][key][:6], key
    assert got["logprobs"]["token_logprobs"][1:] == pytest.approx(one["logprobs"]["token_logprobs"][1:6], abs=1e-5)
    assert [sorted(t) for t in got["logprobs"]["top_logprobs"][1:]] == [
        sorted(t) for t in one["logprobs"]["top_logprobs"][1:6]]
    events = [e for e in sse_events(server, prompt="ROMEO.", max_tokens=0, echo=True) if isinstance(e, dict)]
    assert "".join(e["choices"][0]["text"] for e in events) == "ROMEO."
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    sid = httpx.post(server.url + "/v1/sessions", json={"text": "Begin "}).json()["id"]
    assert complete(server, prompt="ROMEO.", max_tokens=0, echo=True, session_id=sid)["session"]["tokens_seen"] == 12
    for bad in ({"max_tokens": 0}, {"max_tokens": -1, "echo": True}):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", **bad}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_openais_four_prompt_forms(server):
    """Text, token ids, and a batch of one of either (what LangChain and the OpenAI SDK send) read the same; an
    empty batch, ids outside the vocabulary and lists of other things are refused by name."""
    ids = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "Hello"}).json()["tokens"]
    want = complete(server, prompt="Hello", max_tokens=8, temperature=0, logprobs=1)["choices"][0]
    for form in (ids, ["Hello"], [ids]):
        got = complete(server, prompt=form, max_tokens=8, temperature=0, logprobs=1)
        assert got["choices"][0]["text"] == want["text"] and got["usage"]["prompt_tokens"] == len(ids), form
        assert got["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
            want["logprobs"]["token_logprobs"], abs=1e-5)
    echoed = complete(server, prompt=ids, max_tokens=3, temperature=0, echo=True)["choices"][0]["text"]
    assert echoed == "Hello" + want["text"][:3]
    events = sse_events(server, prompt=[0xE2, 0x98], max_tokens=2, temperature=0, echo=True)  # half a character
    assert events[0]["choices"][0]["text"] == "\ufffd"  # echoed as the decoder reads those bytes
    for bad, said in (([["a"]], "token ids"), ([], "empty list"), ([[1], [256]], "prompt[1]: token id 256"),
                      ([256], "token id 256"), ([-1], "token id -1"), ([True], "token ids"), ([1.5], "token ids"),
                      (["a", [1]], "token ids"), (7, "token ids")):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": bad}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "prompt" and said in err["message"], (bad, err)


def test_a_batch_of_prompts_and_n_samples_are_choices_in_openais_order(server):
    """``prompt`` as a list and ``n`` give prompts x n choices, choice p x n + j the j-th sample of prompt p,
    drawn from seed + j: each equals the request for that prompt alone with that seed (text and logprobs), in
    the JSON body and in the SSE stream (chunks told apart by ``index``), and usage counts each prompt once."""
    ids = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "The "}).json()["tokens"]
    prompts, sampling = ["Hello", "The "], {"max_tokens": 6, "temperature": 1.0, "seed": 11, "logprobs": 1}
    alone = [complete(server, prompt=p, **{**sampling, "seed": 11 + j}, echo=True)["choices"][0]
             for p in prompts for j in range(3)]
    assert alone[0]["text"] != alone[1]["text"]  # seed + j: n samples differ
    got = complete(server, prompt=prompts, n=3, echo=True, **sampling)
    assert [c["index"] for c in got["choices"]] == list(range(6))
    for want, choice in zip(alone, got["choices"]):
        assert choice["text"] == want["text"] and choice["finish_reason"] == want["finish_reason"]
        assert choice["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-5)
    assert [c["text"][:len(p)] for c, p in zip(got["choices"], ["Hello"] * 3 + ["The "] * 3)] == ["Hello"] * 3 + [
        "The "] * 3  # each choice echoes its own prompt
    generated = sum(len(c["logprobs"]["tokens"]) for c in alone) - 3 * (5 + len(ids))
    assert got["usage"] == {"prompt_tokens": 5 + len(ids), "completion_tokens": generated,
                            "total_tokens": 5 + len(ids) + generated, "prompt_tokens_details": {"cached_tokens": 0}}

    events = sse_events(server, prompt=prompts, n=3, echo=True, stream_options={"include_usage": True}, **sampling)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"] == got["usage"]
    chunks = events[:-2]
    assert len({c["id"] for c in chunks}) == 1 and all(len(c["choices"]) == 1 for c in chunks)
    for i, want in enumerate(alone):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == want["text"]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [want["finish_reason"]]
        assert mine[-1]["finish_reason"] is not None  # nothing of a choice after its end


def _prompt_tokens_read(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    return float(re.search(r"^txlserve_engine_loop_prompt_tokens_total (\S+)$", text, re.M).group(1))


def _read_since(server, before: float, at_least: int) -> float:
    """The prompt tokens read since ``before``, once the engine's figures show ``at_least`` (a scrape whose refresh
    of an engine process's figures timed out on a loaded machine keeps the last ones)."""
    wait_for(lambda: _prompt_tokens_read(server) - before >= at_least, 30, "the engine's figures to come")
    return _prompt_tokens_read(server) - before


def test_a_prompts_n_choices_read_it_once(server):
    """n samples of a long prompt: the engine reads it once (its loop's prompt tokens grow by the prompt's
    length, not n times it), and each choice is still what its own request with seed + j gives; with echo and
    logprobs (lm-eval's scoring) each choice gets the prompt's scores. A prompt none of the choices can start
    from (empty, with no session) fails every one: the request is a 400."""
    prompt = (TEXT_A + TEXT_B) * 3
    ids = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": prompt}).json()["tokens"]
    sampling = {"max_tokens": 8, "temperature": 1.0, "seed": 3}
    alone = [complete(server, prompt=prompt, **{**sampling, "seed": 3 + j})["choices"][0]["text"] for j in range(4)]
    before = _prompt_tokens_read(server)
    got = complete(server, prompt=prompt, n=4, **sampling)
    assert _read_since(server, before, len(ids)) == len(ids)  # once, not 4 times
    assert [c["text"] for c in got["choices"]] == alone and len(set(alone)) > 1
    assert got["usage"]["prompt_tokens"] == len(ids) and got["usage"]["completion_tokens"] == 4 * 8

    body = {"echo": True, "logprobs": 1, "max_tokens": 0}
    want = complete(server, prompt=ids, **body)["choices"][0]
    before = _prompt_tokens_read(server)
    got = complete(server, prompt=ids, n=3, **body)
    assert _read_since(server, before, len(ids)) == len(ids)
    for choice in got["choices"]:
        assert choice["text"] == prompt and choice["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert choice["logprobs"]["token_logprobs"] == want["logprobs"]["token_logprobs"]

    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "", "n": 3, "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 400 and "nothing to continue from" in r.json()["error"]["message"], r.text


def test_prompt_logprobs_are_vllms_and_the_reference_forwards(server, checkpoint):
    """vLLM's prompt_logprobs in a JSON body: for each prompt token but the first (null), its own entry first,
    with the log-probability and the rank in the vocabulary the reference forward gives it (rank 1: the
    likeliest; ties count against it, as vLLM counts), then its k likeliest alternatives ranked 1..k, keyed by
    token id. Every choice of n carries them, and with echo and logprobs the two agree (each its own number of
    alternatives); max_tokens 0 asks for them alone; a session's prompt has something before its first token; a
    stream takes 0 and gives none; without them a choice is OpenAI's shape."""
    import torch

    from model.engine import Engine
    from tests.model.test_engine import reference_logits

    prompt = "ROMEO. But soft, what light"
    ids = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": prompt}).json()["tokens"]
    engine = Engine.from_checkpoint(checkpoint)
    logp = torch.log_softmax(reference_logits(engine, torch.tensor([ids]))[0].double(), -1)  # [tokens, vocab]
    got = complete(server, prompt=prompt, max_tokens=3, seed=1, n=2, echo=True, logprobs=1, prompt_logprobs=3)
    first = got["choices"][0]
    ranked = first["prompt_logprobs"]
    assert len(ranked) == len(ids) and ranked[0] is None
    assert got["choices"][1]["prompt_logprobs"] == ranked and got["usage"]["prompt_tokens"] == len(ids)
    for i in range(1, len(ids)):
        row, entry, token = logp[i - 1], ranked[i], str(ids[i])
        v = float(row[ids[i]])
        own = entry[token]
        assert list(entry)[0] == token and own["logprob"] == pytest.approx(v, abs=1e-4)
        top = torch.topk(row, 3)
        assert set(entry) == {token, *map(str, top.indices.tolist())}
        alts = sorted(((k, e) for k, e in entry.items() if k != token or e["rank"] <= 3), key=lambda a: a[1]["rank"])
        assert [e["rank"] for _, e in alts] == [1, 2, 3]
        assert [e["logprob"] for _, e in alts] == pytest.approx(top.values.tolist(), abs=1e-4)
        if own["rank"] > 3:  # not among them: its rank counts the tokens at least as likely
            assert int((row > v + 1e-4).sum()) + 1 <= own["rank"] <= int((row >= v - 1e-4).sum())
        assert own["decoded_token"] == prompt[i]  # the token decoded alone (one byte a token here)
        assert first["logprobs"]["token_logprobs"][i] == own["logprob"]  # one scoring serves both
        assert len(first["logprobs"]["top_logprobs"][i]) == (1 if own["rank"] == 1 else 2)  # logprobs 1's own

    alone = complete(server, prompt=prompt, max_tokens=0, prompt_logprobs=0)["choices"][0]  # scoring alone
    assert alone["text"] == "" and "logprobs" in alone and alone["logprobs"] is None
    assert [e and list(e.items()) for e in alone["prompt_logprobs"]] == [
        e and [(str(t), e[str(t)])] for t, e in zip(ids, ranked)]
    as_ids = complete(server, prompt=prompt, max_tokens=0, prompt_logprobs=3, return_tokens_as_token_ids=True)
    assert as_ids["choices"][0]["prompt_logprobs"] == ranked  # vLLM's decoded_token is text either way
    plain = complete(server, prompt=prompt, max_tokens=2)["choices"][0]
    assert "prompt_logprobs" not in plain  # OpenAI's shape

    sid = httpx.post(server.url + "/v1/sessions", json={"text": "Begin "}).json()["id"]
    continued = complete(server, prompt="ROMEO.", max_tokens=1, session_id=sid, prompt_logprobs=1)["choices"][0]
    assert len(continued["prompt_logprobs"]) == 6 and all(continued["prompt_logprobs"])  # "Begin " came before
    empty = complete(server, prompt="", max_tokens=1, session_id=sid, prompt_logprobs=1)["choices"][0]
    assert empty["prompt_logprobs"] == []

    events = [e for e in sse_events(server, prompt=prompt, max_tokens=2, prompt_logprobs=0) if isinstance(e, dict)]
    assert events and not any("prompt_logprobs" in c for e in events for c in e["choices"])


def _released_by_their_ids(chunks: list[dict]) -> bool:
    """Each chunk's text is what its ids release after those before them (a byte model: UTF-8 decoded as it
    comes), whether a chunk carries one token or the several that were waiting."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    return all(c["text"] == decoder.decode(bytes(c.get("token_ids", []))) for c in chunks)


def test_return_token_ids_gives_the_prompts_and_the_generated_ids_on_every_surface(server):
    """vLLM's return_token_ids: a JSON choice has its prompt's ids and the ids generated (a stop token's too, its
    text left out); a stream's choice has the prompt's on its first chunk and each token's own on its chunk, so
    that they add up to the body's, for every choice of n; a WebSocket's deltas alike."""
    ids = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "ROMEO."}).json()["tokens"]
    body = {"prompt": "ROMEO.", "max_tokens": 8, "temperature": 0}
    plain = complete(server, **body)["choices"][0]
    got = complete(server, **body, return_token_ids=True)["choices"][0]
    assert got["prompt_token_ids"] == ids and len(got["token_ids"]) == 8 and got["text"] == plain["text"]
    assert bytes(got["token_ids"]).decode() == got["text"]  # one byte a token here
    stop = got["token_ids"][3]
    cut = complete(server, **body, return_token_ids=True, stop_token_ids=[stop])["choices"][0]
    assert cut["token_ids"] == got["token_ids"][:got["token_ids"].index(stop) + 1] and cut["stop_reason"] == stop
    assert bytes(cut["token_ids"][:-1]).decode() == cut["text"]  # the stop token is generated, its text left out

    sampled = {"prompt": "ROMEO.", "max_tokens": 6, "n": 2, "seed": 4, "return_token_ids": True}
    whole = complete(server, **sampled)["choices"]
    events = [e for e in sse_events(server, **sampled) if isinstance(e, dict)]
    for j in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == j]
        assert mine[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c.get("token_ids", [])] == whole[j]["token_ids"]
        assert _released_by_their_ids(mine)  # a chunk: the tokens waiting as one was read (one, or several)
        assert all(c.get("token_ids") for c in mine if c["finish_reason"] is None)  # none without a token
    with connect(server.url.replace("http://", "ws://") + "/v1/ws") as conn:
        conn.send(json.dumps({"type": "completion.create", "model": MODEL, **body, "return_token_ids": True}))
        deltas = []
        while (msg := json.loads(conn.recv(timeout=60)))["type"] == "completion.delta":
            deltas.append(msg)
    assert msg["type"] == "completion.done" and deltas[0]["prompt_token_ids"] == ids
    assert [t for d in deltas for t in d["token_ids"]] == got["token_ids"]

    # a character's first bytes release no text of their own: their ids still come, each on its chunk (a review)
    split = {"prompt": "x", "max_tokens": 6, "seed": 2, "allowed_token_ids": [0xC3, 0xA9], "return_token_ids": True}
    whole = complete(server, **split)["choices"][0]
    held = [e["choices"][0] for e in sse_events(server, **split) if isinstance(e, dict) and e["choices"]]
    assert [t for c in held for t in c.get("token_ids", [])] == whole["token_ids"] and len(whole["token_ids"]) == 6
    assert _released_by_their_ids(held)  # ids whose text waits for the next byte: "" on their chunk, if alone
    with connect(server.url.replace("http://", "ws://") + "/v1/ws") as conn:  # the WebSocket's deltas alike
        conn.send(json.dumps({"type": "completion.create", "model": MODEL, **split}))
        deltas = []
        while (msg := json.loads(conn.recv(timeout=60)))["type"] == "completion.delta":
            deltas.append(msg)
    assert [t for d in deltas for t in d["token_ids"]] == whole["token_ids"] and _released_by_their_ids(deltas)
    scored = complete(server, prompt=["ROMEO.", "Hi"], max_tokens=2, echo=True, logprobs=1, return_token_ids=True)
    for choice, prompt in zip(scored["choices"], ("ROMEO.", "Hi")):  # each its own prompt's; echo is text, not ids
        assert choice["prompt_token_ids"] == list(prompt.encode()) and len(choice["token_ids"]) == 2
    many = {"model": MODEL, "prompt": "x" * 600, "n": 2, "max_tokens": 1, "return_token_ids": True}
    r = httpx.post(server.url + "/v1/completions", json=many, timeout=60)  # every choice carries the prompt's ids
    assert r.status_code == 200 and len(r.json()["choices"][1]["prompt_token_ids"]) == 600


def test_a_batch_scored_as_lm_eval_scores_it(server):
    """lm-evaluation-harness's ``local-completions`` scores a batch of token-id prompts in one request (echo,
    logprobs 1, max_tokens 0): each choice is that prompt's scores alone, the batch's usage their sum."""
    texts = ["It was the best of times", "it was the worst", "of times"]
    ids = [httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": t}).json()["tokens"] for t in texts]
    body = {"echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    got = complete(server, prompt=ids, **body)
    for one, choice, text in zip(ids, got["choices"], texts):
        want = complete(server, prompt=one, **body)["choices"][0]
        assert choice["text"] == text and choice["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-5)
    assert got["usage"]["prompt_tokens"] == sum(map(len, ids)) and got["usage"]["completion_tokens"] == 0
    sent = complete(server, prompt=ids, **{**body, "max_tokens": 1, "seed": 1234})  # as lm-eval sends it
    for zero, one in zip(got["choices"], sent["choices"]):  # and reads it: token_logprobs[ctxlen:-1]
        assert one["logprobs"]["token_logprobs"][1:-1] == pytest.approx(zero["logprobs"]["token_logprobs"][1:],
                                                                         abs=1e-5)


def test_choices_are_refused_where_they_cannot_be_had(server):
    """n below 1, more than 128 choices, best_of other than n, and a session given more than one choice are
    400s naming the field, choices reading more than one prompt's limit together a 413; a WebSocket completion has
    one choice."""
    from websockets.sync.client import connect

    sid = httpx.post(server.url + "/v1/sessions", json={"text": "stable"}).json()["id"]
    for body, param, said in (({"n": 0}, "n", "at least 1"), ({"n": 129}, "n", "at most 128"),
                              ({"prompt": ["a"] * 65, "n": 2}, "n", "130 choices"),
                              ({"prompt": ["a"] * 129}, "prompt", "at most 128"),
                              ({"n": 2, "best_of": 3}, "best_of", "n's value"),
                              ({"n": 2, "session_id": sid}, "n", "fork"),
                              ({"prompt": ["a", "b"], "session_id": sid}, "prompt", "one prompt")):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "a", **body}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and said in err["message"], (body, r.text)
    assert httpx.get(f"{server.url}/v1/sessions/{sid}").json()["tokens_seen"] == 6
    half = "a" * 600_000
    for body, param, said in (({"prompt": half, "n": 2, "echo": True}, "n", "come to 1,200,000+"),
                              ({"prompt": half, "n": 2, "return_token_ids": True}, "n", "gives it back"),
                              ({"prompt": [half, half], "truncate_prompt_tokens": 4}, "prompt", "come to 1,200,000+")):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)
        err = r.json()["error"]  # prompts as sent (echoed ones for each choice) within the one prompt's limit
        assert r.status_code == 413 and err["param"] == param and said in err["message"], err
    ok = complete(server, prompt="a", n=2, best_of=2, max_tokens=2)  # best_of at n's value changes nothing
    assert len(ok["choices"]) == 2
    with connect(server.url.replace("http://", "ws://") + "/v1/ws", open_timeout=30) as ws:
        for body, param in (({"n": 2}, "n"), ({"prompt": ["a", "b"]}, "prompt")):
            ws.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "a", **body}))
            msg = json.loads(ws.recv(timeout=30))
            assert msg["type"] == "error" and msg["error"]["param"] == param and "one choice" in msg["error"][
                "message"], msg
            assert (msg["status"], msg["error"]["code"]) == (400, "invalid_request")  # as HTTP's own checks say


def test_frequency_penalty_counts_what_the_request_generated(server):
    """A token pushed up by logit_bias comes every time; with frequency_penalty its count pulls it back down."""
    body = {"prompt": "Hello", "max_tokens": 12, "temperature": 0, "logit_bias": {"101": 8}}
    assert complete(server, **body)["choices"][0]["text"] == "e" * 12
    text = complete(server, **body, frequency_penalty=2)["choices"][0]["text"]
    assert text[0] == "e" and 1 < text.count("e") < 12, text
    assert complete(server, **body, frequency_penalty=2, presence_penalty=0)["choices"][0]["text"] == text
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body, "presence_penalty": 3}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "presence_penalty", r.text


def test_a_stop_token_ends_the_text_before_it_and_the_session_holds_it(server):
    """vLLM's stop_token_ids: finish_reason "stop", the token's text left out, the token counted and kept."""
    text = complete(server, prompt="Hello", max_tokens=12, temperature=0)["choices"][0]["text"]
    cut = next(i for i in range(1, len(text)) if text[i] not in text[:i])  # a byte that first comes there
    sid = new_session(server, "Hello")["id"]
    got = complete(server, prompt="", session_id=sid, max_tokens=12, temperature=0, stop_token_ids=[ord(text[cut])])
    choice = got["choices"][0]
    assert (choice["text"], choice["finish_reason"], got["usage"]["completion_tokens"]) == (text[:cut], "stop", cut + 1)
    assert got["session"]["tokens_seen"] == 5 + cut + 1  # the stop token is in the session's memory
    assert choice["stop_reason"] == ord(text[cut])  # vLLM's: the stop token's id
    for stop in ({"stop_token_ids": [ord(text[cut])]}, {"stop": text[cut - 1:cut + 1]}):  # vLLM's: with its text
        shown = complete(server, prompt="Hello", max_tokens=12, temperature=0, include_stop_str_in_output=True, **stop)
        assert (shown["choices"][0]["text"], shown["choices"][0]["finish_reason"]) == (text[:cut + 1], "stop"), stop
        want = stop["stop_token_ids"][0] if "stop_token_ids" in stop else stop["stop"]  # what ended it
        assert shown["choices"][0]["stop_reason"] == want, shown
        ends = [e for e in sse_events(server, prompt="Hello", max_tokens=12, temperature=0, **stop)
                if isinstance(e, dict)]
        assert ends[-1]["choices"][0]["stop_reason"] == shown["choices"][0]["stop_reason"]  # on the finishing chunk
        assert all("stop_reason" not in e["choices"][0] for e in ends[:-1])
    plain = complete(server, prompt="Hello", max_tokens=3)["choices"][0]
    assert plain["finish_reason"] == "length" and "stop_reason" not in plain  # OpenAI's shape where none ended it
    for ids, said in (([256], "token id 256"), ([-1], "token id -1"), (list(range(256)) * 5, "at most 1024")):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "stop_token_ids": ids},
                       timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "stop_token_ids" and said in err["message"], (ids, r.text)


def test_min_tokens_holds_back_stop_tokens_and_strings_until_it_is_reached(server):
    """vLLM's min_tokens: a stop token cannot be drawn before the min_tokens-th token is generated, and a stop
    string ending before it does not stop; the greedy text is the model's either way, cut where it may stop."""
    text = complete(server, prompt="Hello", max_tokens=16, temperature=0)["choices"][0]["text"]
    first = text[0]  # greedy, so the first token of every such request, which a stop token would end at once
    for k in (3, 6):
        got = complete(server, prompt="Hello", max_tokens=16, temperature=0, min_tokens=k, stop=[first])
        cut = text.find(first, k)  # the first match ending after the k-th token (a byte model: a character each)
        want = (text, "length") if cut < 0 else (text[:cut], "stop")
        assert (got["choices"][0]["text"], got["choices"][0]["finish_reason"]) == want, (k, got)
    got = complete(server, prompt="Hello", max_tokens=16, temperature=0, min_tokens=4, stop_token_ids=[ord(first)])
    assert got["usage"]["completion_tokens"] >= 5 and len(got["choices"][0]["text"]) >= 4
    assert first not in got["choices"][0]["text"][:4]  # banned for the first 4 tokens
    sampled = complete(server, prompt="Hello", max_tokens=16, temperature=1.0, seed=2, min_tokens=16,
                       stop_token_ids=[ord(c) for c in "aeiou "])
    assert sampled["usage"]["completion_tokens"] == 16 and not set("aeiou ") & set(sampled["choices"][0]["text"])
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "min_tokens": 20}, timeout=60)
    err = r.json()["error"]  # a vLLM client sending min_tokens alone meets OpenAI's default max_tokens
    assert r.status_code == 400 and err["param"] == "min_tokens" and "defaults to 16" in err["message"], err


def test_truncate_prompt_tokens_reads_the_prompts_last_tokens(server):
    """vLLM's truncate_prompt_tokens: a prompt (text or token ids) is read from its last k tokens on, as if only
    they were sent (the continuation, usage, echo); -1 reads it whole (no model here has a context to fill); 0,
    which would read nothing, is refused as vLLM refuses it."""
    body = {"max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 1}
    want = complete(server, prompt="ghij", **body)
    ids = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "abcdefghij"}).json()["tokens"]
    for prompt in ("abcdefghij", ids):
        got = complete(server, prompt=prompt, truncate_prompt_tokens=4, **body)
        assert got["choices"][0]["text"] == want["choices"][0]["text"] and got["choices"][0]["text"][:4] == "ghij"
        assert got["choices"][0]["logprobs"] == want["choices"][0]["logprobs"] and got["usage"] == want["usage"]
    whole = complete(server, prompt="abcdefghij", **body)
    assert complete(server, prompt="abcdefghij", truncate_prompt_tokens=-1, **body)["choices"] == whole["choices"]
    assert complete(server, prompt="abcdefghij", truncate_prompt_tokens=40, **body)["choices"] == whole["choices"]
    sid = new_session(server, "Hello")["id"]
    got = complete(server, prompt=" more", session_id=sid, truncate_prompt_tokens=2, max_tokens=3, temperature=0)
    assert got["usage"]["prompt_tokens"] == 2 and got["session"]["tokens_seen"] == 5 + 2 + 3
    for keep in (0, -2):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "abc",
                                                             "truncate_prompt_tokens": keep}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "truncate_prompt_tokens" and ">= 1" in err["message"], err


def test_return_tokens_as_token_ids_names_every_logprobs_token_by_its_id(server):
    """vLLM's: generated tokens, their alternatives and an echoed prompt's, JSON and SSE alike."""
    body = {"prompt": "Hi", "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True}
    named = complete(server, **body)["choices"][0]["logprobs"]
    ids = complete(server, **body, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    assert ids["tokens"] == [f"token_id:{ord(c)}" for c in "Hi"] + [f"token_id:{ord(t)}" for t in named["tokens"][2:]]
    assert all(k.startswith("token_id:") for top in ids["top_logprobs"][1:] for k in top)
    assert ids["token_logprobs"] == named["token_logprobs"] and ids["text_offset"] == named["text_offset"]
    events = sse_events(server, **body, return_tokens_as_token_ids=True)
    streamed = [t for e in events[:-1] if e["choices"] and e["choices"][0]["logprobs"]
                for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed == ids["tokens"]


def test_repetition_penalty_changes_a_greedy_text_and_one_is_none(server):
    body = {"prompt": "the the the the ", "max_tokens": 24, "temperature": 0}
    plain = complete(server, **body)["choices"][0]["text"]
    assert complete(server, **body, repetition_penalty=1)["choices"][0]["text"] == plain
    assert complete(server, **body, repetition_penalty=3)["choices"][0]["text"] != plain
    for bad in (0, -1.5):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body, "repetition_penalty": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text


def test_min_p_one_draws_the_likeliest_token_as_greedy_does(server):
    greedy = complete(server, prompt="Hello", max_tokens=10, temperature=0)["choices"][0]["text"]
    assert complete(server, prompt="Hello", max_tokens=10, temperature=1.5, seed=4)["choices"][0]["text"] != greedy
    assert complete(server, prompt="Hello", max_tokens=10, temperature=1.5, seed=4, min_p=1)["choices"][0][
        "text"] == greedy


def test_logit_bias_bans_and_forces_tokens_as_openai_does(server):
    """OpenAI's logit_bias (token ids as string keys, -100 to 100) added to the logits before sampling: +100 on a
    token all but forces it, -100 on greedy's choice bans it; the logprobs stay the model's (vLLM's default); keys
    that are not token ids of the vocabulary, too many keys and biases out of range are 400s."""
    greedy = complete(server, prompt="Hello", max_tokens=1, temperature=0, logprobs=1)["choices"][0]
    top = greedy["text"].encode()[0]  # a byte model: a token id is a byte
    banned = complete(server, prompt="Hello", max_tokens=1, temperature=0, logit_bias={str(top): -100})
    assert banned["choices"][0]["text"] != greedy["text"]
    forced = complete(server, prompt="Hello", max_tokens=6, temperature=1.0, seed=1, logit_bias={"101": 100},
                      logprobs=0)["choices"][0]
    assert forced["text"] == "eeeeee"
    scored = complete(server, prompt="Hello" + forced["text"], max_tokens=0, echo=True, logprobs=0)["choices"][0]
    assert forced["logprobs"]["token_logprobs"] == pytest.approx(scored["logprobs"]["token_logprobs"][5:], abs=1e-4)
    assert max(forced["logprobs"]["token_logprobs"]) < -0.01  # the model's, not the biased distribution's ~0
    for bias, said in (({"abc": 1}, "not a token id"), ({"256": 1}, "[0, 256)"), ({"-1": 1}, "not a token id"),
                       ({"1": 101}, "[-100, 100]"), ({"1": True}, None), ({str(t): 1 for t in range(256)} | {
                           **{f"0{t}": 1 for t in range(800)}}, "at most 1024"),
                       ({str(t): -100 for t in range(256)}, "bans every token")):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "logit_bias": bias},
                       timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"].startswith("logit_bias"), (bias, r.text)  # pydantic's: .1
        assert said is None or said in err["message"], err


def test_allowed_token_ids_are_the_only_tokens_generated(server):
    """vLLM's allowed_token_ids: every generated token is one of them, sampled or greedy, streamed or not; an
    empty list, an id past the vocabulary, more than 4,096 ids, or ids every one of which is banned is a 400 naming
    the field."""
    allowed = [ord(c) for c in "ab "]
    for body in ({"temperature": 1.0, "seed": 4}, {"temperature": 0}):
        got = complete(server, prompt="Hello", max_tokens=24, allowed_token_ids=allowed, **body)["choices"][0]
        assert len(got["text"]) == 24 and set(got["text"]) <= set("ab "), got
        events = sse_events(server, prompt="Hello", max_tokens=24, allowed_token_ids=allowed, **body)
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == got["text"]
    for bad, said in (({"allowed_token_ids": []}, "at least one"), ({"allowed_token_ids": [256]}, "token id 256"),
                      ({"allowed_token_ids": [97] * 4097}, "at most 4096"),
                      ({"allowed_token_ids": [97], "logit_bias": {"97": -100}}, "is banned"),
                      ({"allowed_token_ids": [97], "stop_token_ids": [97], "min_tokens": 1}, "is banned")):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "a", **bad}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "allowed_token_ids" and said in err["message"], (bad, err)


def test_openai_sdk_plain_and_streaming(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8
    pieces = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == out.choices[0].text
    assert pieces[-1].usage.completion_tokens == 8
    batch = client.completions.create(model=MODEL, prompt=["Hello", "Bye"], n=2, max_tokens=3, seed=5)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3] and batch.usage.completion_tokens == 12
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", temperature=9)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=MODEL, prompt="x", extra_body={"session_id": "no-such-session"})


def new_session(server, text: str = "", **kw) -> dict:
    r = httpx.post(server.url + "/v1/sessions", json={"text": text, **kw}, timeout=60)
    assert r.status_code == 201, r.text
    return r.json()


def test_vllm_benchs_body_is_served_as_the_plain_request_is(server):
    """`vllm bench serve` sends repetition_penalty 1.0 on every request (and ignore_eos with --ignore-eos): they
    were refused as unknown arguments. vLLM's extensions at the values that change nothing are now the plain
    request; other values are a 400 naming them (test_bad_inputs)."""
    plain = sse_events(server, prompt="To be", max_tokens=6, temperature=0, stream_options={"include_usage": True})
    vllm = sse_events(server, prompt="To be", max_tokens=6, temperature=0, stream_options={"include_usage": True},
                      repetition_penalty=1.0, logprobs=None, ignore_eos=True, min_p=0.0, min_tokens=0,
                      presence_penalty=0.0, frequency_penalty=0, best_of=1)
    text = ["".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) for events in (plain, vllm)]
    assert text[0] == text[1] and len(text[0]) > 0
    assert vllm[-2]["usage"]["completion_tokens"] == 6 and vllm[-1] == "[DONE]"
    assert complete(server, prompt="To be", max_tokens=6, temperature=0, ignore_eos=False)["choices"][0]["text"] == \
        text[0]
    # the rest of vLLM's at their defaults, as a vLLM client may send them: they were "unrecognized" (found by a
    # helper); and every response names the backend configuration as OpenAI's does (system_fingerprint)
    defaults = dict(add_special_tokens=True, use_beam_search=False, include_stop_str_in_output=False,
                    skip_special_tokens=True, spaces_between_special_tokens=True, return_tokens_as_token_ids=False,
                    stop_token_ids=[], truncate_prompt_tokens=None, prompt_logprobs=None, response_format=None,
                    priority=0, length_penalty=1.0, return_token_ids=False, structured_outputs=None,
                    logits_processors=None, prompt_embeds=None, kv_transfer_params=None, vllm_xargs={},
                    cache_salt="a-salt-of-43-characters-or-so")  # (no cache is shared between requests here)
    out = complete(server, prompt="To be", max_tokens=6, temperature=0, **defaults)
    assert out["choices"][0]["text"] == text[0] and "prompt_logprobs" not in out["choices"][0]
    named = complete(server, prompt="To be", max_tokens=2, n=2, request_id="my-request-7")  # vLLM's request_id
    assert named["id"] == "cmpl-my-request-7"
    chunks = [e for e in sse_events(server, prompt="To be", max_tokens=2, request_id="r8") if isinstance(e, dict)]
    assert chunks and {e["id"] for e in chunks} == {"cmpl-r8"}
    fingerprint = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["fingerprint"]
    assert out["system_fingerprint"] == fingerprint == vllm[0]["system_fingerprint"] == vllm[-2]["system_fingerprint"]


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(server):
    """vLLM's stream option, which benchmark clients send to count the tokens a chunk holds: it was refused."""
    plain = sse_events(server, prompt="To be", max_tokens=8, temperature=0)
    events = sse_events(server, prompt="To be", max_tokens=8, temperature=0,
                        stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(
        e["choices"][0]["text"] for e in plain[:-1] if e["choices"])
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 8, counts
    assert all(c["usage"]["prompt_tokens"] == 5 and c["usage"]["total_tokens"] == 5 + n
               for c, n in zip(chunks, counts))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 8
    assert all("usage" not in e for e in plain[:-1])  # without the option, nothing changes


def test_split_invariance_through_http(server):
    whole = complete(server, prompt=TEXT_A + TEXT_B + TEXT_C, max_tokens=40, temperature=0)
    sid = new_session(server, TEXT_A)["id"]
    r = httpx.post(f"{server.url}/v1/sessions/{sid}/append", json={"text": TEXT_B}, timeout=60)
    assert r.status_code == 200 and r.json()["tokens_seen"] == len(TEXT_A + TEXT_B)
    split = complete(server, prompt=TEXT_C, max_tokens=40, temperature=0, session_id=sid)
    assert split["choices"][0]["text"] == whole["choices"][0]["text"]
    assert split["usage"]["prompt_tokens_details"]["cached_tokens"] == len(TEXT_A + TEXT_B)
    assert split["session"] == {"id": sid, "tokens_seen": len(TEXT_A + TEXT_B + TEXT_C) + 40}


def test_three_completions_equal_one(server):
    """Generated tokens join the session: A, then B, then C continue exactly where one request would."""
    sid = new_session(server)["id"]
    a = complete(server, prompt=TEXT_A, max_tokens=5, temperature=0, session_id=sid)["choices"][0]["text"]
    b = complete(server, prompt=TEXT_B, max_tokens=5, temperature=0, session_id=sid)["choices"][0]["text"]
    c = complete(server, prompt=TEXT_C, max_tokens=20, temperature=0, session_id=sid)
    once = complete(server, prompt=TEXT_A + a + TEXT_B + b + TEXT_C, max_tokens=20, temperature=0)
    assert c["choices"][0]["text"] == once["choices"][0]["text"]


def test_fork_independence(server):
    sid = new_session(server, TEXT_A, metadata={"title": "tale"})["id"]
    fork = httpx.post(f"{server.url}/v1/sessions/{sid}/fork", json={}, timeout=30)
    assert fork.status_code == 201
    fid = fork.json()["id"]
    assert fid != sid and fork.json()["tokens_seen"] == len(TEXT_A)
    complete(server, prompt=TEXT_B, max_tokens=3, temperature=0, session_id=fid)
    assert httpx.get(f"{server.url}/v1/sessions/{sid}").json()["tokens_seen"] == len(TEXT_A)
    assert httpx.get(f"{server.url}/v1/sessions/{fid}").json()["tokens_seen"] == len(TEXT_A + TEXT_B) + 3
    x = complete(server, prompt=TEXT_C, max_tokens=10, temperature=0, session_id=sid)
    y = complete(server, prompt=TEXT_C, max_tokens=10, temperature=0, session_id=fid)
    assert x["session"]["tokens_seen"] != y["session"]["tokens_seen"]


def test_session_crud(server):
    s = new_session(server, "abc", metadata={"k": "v"})
    got = httpx.get(f"{server.url}/v1/sessions/{s['id']}").json()
    assert got["object"] == "session" and got["tokens_seen"] == 3 and got["metadata"] == {"k": "v"}
    assert got["mem_len"] == 24 and got["bytes"] > 0 and got["tier"] in ("hot", "redis")
    assert len(s["id"]) >= 22  # >= 128 random bits
    listed = httpx.get(f"{server.url}/v1/sessions", params={"limit": 100, "order": "desc"}).json()
    assert listed["object"] == "list" and s["id"] in [x["id"] for x in listed["data"]]
    page = httpx.get(f"{server.url}/v1/sessions", params={"limit": 1}).json()
    assert len(page["data"]) == 1 and page["has_more"] is True and page["next_cursor"]
    newest = httpx.get(f"{server.url}/v1/sessions", params={"limit": 1, "order": "desc"}).json()
    assert [x["id"] for x in newest["data"]] == [s["id"]]  # the one just made, as the playground lists them
    assert httpx.get(f"{server.url}/v1/sessions", params={"order": "sideways"}).status_code == 400
    r = httpx.delete(f"{server.url}/v1/sessions/{s['id']}")
    assert r.json() == {"id": s["id"], "object": "session.deleted", "deleted": True}
    assert httpx.get(f"{server.url}/v1/sessions/{s['id']}").status_code == 404


def test_session_metadata_update_merges_keys_and_leaves_the_memory_hot(server):
    """OpenAI's modify (POST /v1/threads/{id}): the keys given are set, a null removes one, the others stay. The
    memory is untouched and still hot: what the session generates next is what a session never updated does."""
    sid = new_session(server, TEXT_A, metadata={"title": "tale", "tag": "x"})["id"]
    twin = new_session(server, TEXT_A)["id"]
    before = httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=30).json()
    assert before["tier"] == "hot"
    r = httpx.post(f"{server.url}/v1/sessions/{sid}", json={"metadata": {"tag": None, "lang": "en"}}, timeout=30)
    assert r.status_code == 200, r.text
    after = r.json()
    assert after["metadata"] == {"title": "tale", "lang": "en"}
    assert {k: v for k, v in after.items() if k != "metadata"} == {k: v for k, v in before.items() if k != "metadata"}
    assert httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=30).json() == after
    for unchanged in (None, {}, {"metadata": {}}, {"metadata": None}):  # a body that changes nothing: the session
        r = httpx.post(f"{server.url}/v1/sessions/{sid}", json=unchanged, timeout=30)
        assert r.status_code == 200 and r.json() == after, r.text
    x = complete(server, prompt=TEXT_B, max_tokens=12, temperature=0, session_id=sid)
    y = complete(server, prompt=TEXT_B, max_tokens=12, temperature=0, session_id=twin)
    assert x["choices"][0]["text"] == y["choices"][0]["text"]
    lines = [line for line in server.log.read_text().splitlines() if "/v1/completions" in line and sid in line]
    assert len(lines) == 1 and '"restored_from":"hot"' in lines[0], lines  # not read back from Redis
    got = httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=30).json()
    assert got["metadata"] == {"title": "tale", "lang": "en"} and got["tokens_seen"] == x["session"]["tokens_seen"]
    too_many = {f"k{i}": "v" for i in range(15)}  # 2 kept + 15 new: over OpenAI's 16
    r = httpx.post(f"{server.url}/v1/sessions/{sid}", json={"metadata": too_many}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata", r.text
    assert "17 keys, over 16" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/sessions/{sid}", json={"metadata": {**too_many, "title": None}}, timeout=30)
    assert r.status_code == 200 and len(r.json()["metadata"]) == 16
    every = {**{k: None for k in r.json()["metadata"]}, **{f"n{i}": "v" for i in range(16)}}  # 32: 16 out, 16 in
    r = httpx.post(f"{server.url}/v1/sessions/{sid}", json={"metadata": every}, timeout=30)
    assert r.status_code == 200 and r.json()["metadata"] == {f"n{i}": "v" for i in range(16)}, r.text
    r = httpx.post(f"{server.url}/v1/sessions/{sid}", json={"metadata": {"n0": "w", "x": "y"}}, timeout=30)
    assert r.status_code == 400 and "17 keys, over 16" in r.json()["error"]["message"], r.text  # one message


def test_memory_is_fixed_size(server):
    """The product's promise: a session's stored size stops growing once it holds its window
    (n_layer * mem_len + 1 tokens: its hidden states stop growing at mem_len, its token window there)."""
    sid = new_session(server, "x" * 30)["id"]
    small = httpx.get(f"{server.url}/v1/sessions/{sid}").json()
    assert small["window_tokens"] == 30
    httpx.post(f"{server.url}/v1/sessions/{sid}/append", json={"text": "y" * 5000}, timeout=60)
    info = httpx.get(f"{server.url}/v1/sessions/{sid}").json()
    window = info["window_tokens"]
    assert info["tokens_seen"] == 5030 and 30 < window < 5030
    httpx.post(f"{server.url}/v1/sessions/{sid}/append", json={"text": "z" * 5000}, timeout=60)
    later = httpx.get(f"{server.url}/v1/sessions/{sid}").json()
    assert later["tokens_seen"] == 10030 and later["bytes"] == info["bytes"] and later["window_tokens"] == window


def test_a_model_is_retrieved_by_name_as_openais_models_retrieve_does(server):
    listed = httpx.get(server.url + "/v1/models").json()["data"]
    got = httpx.get(f"{server.url}/v1/models/{MODEL}")
    assert got.status_code == 200 and [got.json()] == listed
    assert time.time() - 3600 < listed[0]["created"] <= time.time()  # when the server loaded it, as vLLM's (was 0)
    assert listed[0]["root"] == MODEL and "max_model_len" not in listed[0]  # vLLM's card; no context length here
    assert listed[0]["max_tokens_limit"] == LONG  # --max-tokens-limit: what a client checks first
    missing = httpx.get(server.url + "/v1/models/org/other-model")  # a name may hold '/': still this route
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_health_ready_metrics_docs(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    for ping in (httpx.get, httpx.post):  # vLLM's /ping (SageMaker's probe), both methods
        assert ping(server.url + "/ping").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").status_code == 200
    for path in ("/health", "/ready", "/v1/models", "/v1/sessions?limit=3", "/metrics", "/"):  # HEAD: no body
        head, get = httpx.head(server.url + path), httpx.get(server.url + path)
        assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) > 0
        assert head.headers["content-type"] == get.headers["content-type"]
    assert httpx.head(server.url + "/v1/sessions/no-such-session").status_code == 404
    assert httpx.head(server.url + "/v1/completions").status_code == 405

    def counted() -> float:  # HEAD requests are counted (and logged) under their routes, not as "unmatched"
        line = re.search(r'^txlserve_requests_total\{route="/v1/sessions/\{session_id\}",status="404"\} (\S+)$',
                         httpx.get(server.url + "/metrics").text, re.M)
        return float(line.group(1)) if line else 0.0

    before = counted()
    for _ in range(3):
        httpx.head(server.url + "/v1/sessions/no-such-session")
    assert counted() >= before + 3
    # Starlette's own routes too: the schema, and a static mount (under its prefix)
    assert httpx.head(server.url + "/openapi.json").status_code == 200
    assert httpx.head(server.url + "/static/playground.js").status_code == 200
    def both_counted() -> str | None:  # counted at their last byte: after the client has it
        text = httpx.get(server.url + "/metrics").text
        return text if 'route="/openapi.json",status="200"' in text and 'route="/static/{path}",status="200"' in text \
            else None
    heads = wait_for(both_counted, 10, "the HEAD requests counted under their routes")
    assert 'route="unmatched",status="200"' not in heads
    complete(server, prompt="metrics", max_tokens=2)
    r = httpx.post(server.url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and float(r.headers["x-process-time-ms"]) >= 0
    text = httpx.get(server.url + "/metrics").text
    assert 'txlserve_requests_total{route="/v1/completions",status="200"}' in text
    assert 'txlserve_requests_total{route="/v1/completions",status="404"}' in text
    for name in ("txlserve_requests_total", "txlserve_time_to_first_token_seconds", "txlserve_hot_bytes",
                 "txlserve_requests_running", "txlserve_requests_waiting", "txlserve_hot_hits_total",
                 "txlserve_evictions_total", "txlserve_store_errors_total", "txlserve_client_disconnects_total",
                 "txlserve_prompt_tokens_total", "txlserve_generation_tokens_total",
                 "txlserve_e2e_request_latency_seconds", "txlserve_inter_token_latency_seconds",
                 "process_resident_memory_bytes", "process_cpu_seconds_total"):
        assert name in text, name
    fingerprint = httpx.get(server.url + "/v1/models").json()["data"][0]["fingerprint"]
    build = re.search(r'^txlserve_build_info\{(.*)\} 1\.0$', text, re.M)  # which build serves which model
    assert build and f'model="{MODEL}"' in build[1] and f'fingerprint="{fingerprint}"' in build[1], text[-500:]
    assert re.search(r'version="[^"]+"', build[1])
    from prometheus_client.parser import text_string_to_metric_families  # a vLLM dashboard's series: ours, renamed
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text)
               for s in f.samples}
    for ours, theirs in (("txlserve_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
                         ("txlserve_inter_token_latency_seconds_sum", "vllm:time_per_output_token_seconds_sum"),
                         ("txlserve_request_prompt_tokens_bucket", "vllm:request_prompt_tokens_bucket"),
                         ("txlserve_generation_tokens_total", "vllm:generation_tokens_total")):
        mine = {labels: v for (name, labels), v in samples.items() if name == ours}
        twin = {tuple(p for p in labels if p[0] != "model_name"): v for (name, labels), v in samples.items()
                if name == theirs and ("model_name", MODEL) in labels}
        assert mine and twin == mine, (ours, theirs)
    for gauge, most in (("vllm:num_requests_running", 64), ("vllm:num_requests_waiting", 64),
                        ("vllm:kv_cache_usage_perc", 1)):  # vLLM's: a fraction of the cache
        assert 0 <= samples[(gauge, (("model_name", MODEL),))] <= most, gauge
    assert httpx.get(server.url + "/docs").status_code == 200
    schema = httpx.get(server.url + "/openapi.json").json()
    assert schema["info"]["title"] == "txlserve"
    for body in ("CompletionRequest", "StreamOptions", "SessionCreate", "SessionAppend", "SessionFork"):
        fields = schema["components"]["schemas"][body]["properties"]  # /docs describes every field a client sends
        assert [name for name, f in fields.items() if not f.get("description")] == [], body
    assert len(schema["components"]["schemas"]["CompletionRequest"]["properties"]) > 30
    assert httpx.get(server.url + "/static/playground.js").status_code == 200
    text = httpx.get(server.url + "/metrics").text  # Starlette's own routes are named too, a mount by its prefix
    for route in ("/openapi.json", "/static/{path}", "/docs"):
        series = rf'^txlserve_requests_total{{route="{re.escape(route)}",status="200"}} [1-9]'
        assert re.search(series, text, re.M), route


def test_error_mid_stream_is_an_error_event_then_done(server):
    """The session is deleted while a stream on it runs: the request stops (a helper saw 3,296 more tokens
    streamed for a deleted session), its commit fails, and the stream says so."""
    sid = new_session(server, "doomed ")["id"]
    lines, after = [], None
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "x", "max_tokens": 4000, "stream": True, "session_id": sid}) as r:
        assert r.status_code == 200
        for i, line in enumerate(r.iter_lines()):
            if i == 1:
                assert httpx.delete(f"{server.url}/v1/sessions/{sid}").status_code == 200
                after = len(lines)
            if line:
                lines.append(line)
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][len("data: "):])["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "session_not_found"
    assert len(lines) - after < 2000, len(lines) - after  # stopped within steps of the DELETE, not at 4,000
    assert httpx.get(f"{server.url}/v1/sessions/{sid}").status_code == 404


def _scrape(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {name: float(value) for name, value in re.findall(r"^(txlserve_\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def test_every_surface_counts_in_the_metrics_alike(server):
    """The WebSocket's completions were in none of the latency histograms or token totals, a JSON body's in no
    time to first token, and sessions' reads in the prompt histogram alone (found by a helper). Now each of the
    three surfaces adds one sample of each latency, and the token totals are the per-request histograms' sums."""
    from websockets.sync.client import connect

    from tests.server.test_ws import collect, ws_url

    before = _scrape(server)
    complete(server, prompt="Hello", max_tokens=5)
    sse_events(server, prompt="Hello", max_tokens=5)
    with connect(ws_url(server)) as conn:
        conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "Hello", "max_tokens": 5}))
        assert collect(conn)[-1]["type"] == "completion.done"
    httpx.post(server.url + "/v1/sessions", json={"text": "Twelve bytes"}, timeout=60)
    after = _scrape(server)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    for latency in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert grew(f"txlserve_{latency}_count") == 3, latency
    assert grew("txlserve_inter_token_latency_seconds_count") == 3 * 4
    assert grew("txlserve_generation_tokens_total") == grew("txlserve_request_generation_tokens_sum") == 15
    assert grew("txlserve_prompt_tokens_total") == grew("txlserve_request_prompt_tokens_sum") == 3 * 5 + 12


def test_a_requests_lifecycle_phases_are_counted_once_each_and_fit_in_its_latency(server):
    """``txlserve_request_lifecycle_seconds``: each request's run, split where its time went (the lease and
    restore, the engine, the hand-over of its end and state, the commit), one sample a phase; the phases of a run
    lie inside its request, so they cannot add up to more than its end-to-end latency."""
    from server.metrics import LIFECYCLE

    sid = httpx.post(server.url + "/v1/sessions", json={"text": "Once upon"}, timeout=60).json()["id"]
    before = _scrape(server)
    complete(server, prompt=" a time", max_tokens=6, session_id=sid)  # a session: leased, committed
    sse_events(server, prompt=" there", max_tokens=6, session_id=sid)
    complete(server, prompt="Hello", max_tokens=6)  # none: nothing to lease or commit
    after = _scrape(server)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    phase = 'txlserve_request_lifecycle_seconds_{}{{phase="{}"}}'
    assert [grew(phase.format("count", p)) for p in LIFECYCLE] == [3] * len(LIFECYCLE)
    seconds = {p: grew(phase.format("sum", p)) for p in LIFECYCLE}
    assert all(s >= 0 for s in seconds.values()) and seconds["engine"] > 0, seconds
    e2e = grew("txlserve_e2e_request_latency_seconds_sum")
    assert 0 < sum(seconds.values()) <= e2e, (seconds, e2e)

"""The response models render OpenAI's shapes; the per-token SSE fast path renders the same bytes."""

from __future__ import annotations

import json

import pytest

from model.sampling import ScoredTokens
from server import completion, protocol
from server.completion import Completion
from server.protocol import CompletionChoice, CompletionLogprobs, CompletionObject, CompletionRequest, pydantic_dumps
from server.routes.completions import _dumps, _sse
from server.routes.ws import _dumps as ws_dumps
from server.scheduler import Finished, PromptScores
from server.service import Final


@pytest.mark.parametrize("text", ["a", " the", "\n", 'quote " and \\ backslash', "é ü 中文 🎉", "\u0000", "\t\r",
                                  "txl-text", "\u2028"])
def test_text_event_is_the_rendered_chunk(text):
    comp = Completion(CompletionRequest(model="m", prompt="x"), "m")
    assert comp.text_event(text) == _sse(comp.chunk(text).dump())
    assert comp.text_event(text + text) == _sse(comp.chunk(text + text).dump())  # the template is reused
    # with return_token_ids: the first chunk (the prompt's ids) rendered, then the template, one id or several
    comp = Completion(CompletionRequest(model="m", prompt="x", return_token_ids=True), "m", prompt_ids=[120])
    assert json.loads(comp.text_event(text, [5])[6:])["choices"][0]["prompt_token_ids"] == [120]
    for ids in ([7], [7, 8, 300]):
        assert comp.text_event(text, ids) == _sse(comp.chunk(text, token_ids=ids).dump())
    assert comp.text_event(text, None) == _sse(comp.chunk(text).dump())  # held-back text: no ids of its own


def test_chunk_shapes():
    comp = Completion(CompletionRequest(model="m", prompt="x"), "m", system_fingerprint="f:m24:c0")
    chunk = json.loads(comp.text_event("hi")[6:])
    assert set(chunk) == {"id", "object", "created", "model", "system_fingerprint", "choices"}  # no usage, no
    assert chunk["system_fingerprint"] == "f:m24:c0"  # session mid-stream; OpenAI's backend configuration
    assert chunk["choices"] == [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}]


def _scores(n: int) -> tuple[list[int], PromptScores]:
    ids = [(7 * i) % 256 for i in range(n)]
    entries = [(None, [])] + [(-0.5 - i * 1e-6, [((3 * i) % 256, -1e-5), (ids[i], -0.5 - i * 1e-6)])
                              for i in range(1, n)]
    return ids, PromptScores(**vars(ScoredTokens.of(entries)))


@pytest.mark.parametrize("dumps", [pydantic_dumps, _dumps, ws_dumps], ids=["json", "sse", "websocket"])
def test_long_logprobs_rendered_in_parts_are_the_whole_rendering(dumps, monkeypatch):
    """Each surface's JSON, its logprobs rendered a few entries at a time (off the event loop), is the same text as
    rendered in one call: keys and strings that look like the marker, floats as each writer writes them."""
    monkeypatch.setattr(protocol, "SPLICE_ROWS", 3)
    logprobs = CompletionLogprobs(tokens=['{"tokens":[]', "é", '"'] * 3, token_logprobs=[None, -1e-5, -2.5] * 3,
                                  top_logprobs=[None, {'"x': -1e-5, "é": -3.0}, {}] * 3, text_offset=list(range(9)))
    obj = CompletionObject(id="x", created=1, model="m", choices=[
        CompletionChoice(text='{"tokens":[],"token_logprobs":[]', logprobs=logprobs)])

    def shell(empty: CompletionLogprobs) -> str:
        copy = obj.model_copy(deep=True)
        copy.choices[0].logprobs = empty
        return dumps(copy.model_dump()) if dumps is not pydantic_dumps else copy.dump_json().decode()
    whole = dumps(obj.model_dump()) if dumps is not pydantic_dumps else obj.dump_json().decode()
    assert protocol.spliced(shell, logprobs, dumps) == whole


def test_a_long_scored_prompt_renders_as_the_short_path_and_is_freed(monkeypatch):
    """The echoed prompt's first SSE chunk and WebSocket delta, and the JSON body, rendered in parts: the bytes the
    one-call rendering gives; the body's lists are emptied on the rendering thread (freed there, not on the event
    loop), and a stream keeps nothing of them."""
    monkeypatch.setattr(protocol, "SPLICE_ROWS", 4)
    monkeypatch.setattr(completion, "SPLICE_ROWS", 4)
    ids, scores = _scores(11)
    req = CompletionRequest(model="m", prompt=bytes(ids).decode("latin-1"), echo=True, logprobs=1, max_tokens=0)
    comp = Completion(req, "m")
    comp.echoed = req.prompt
    want = completion.prompt_logprobs(comp.tokenizer, ids, scores, req.prompt)
    assert comp.prompt_piece(ids, scores, _dumps) == _dumps(comp.piece(comp.echoed, None, want))
    assert comp.lps == comp.tops == comp.tokens == []  # sent, not kept
    ids, scores = _scores(11)
    assert comp.prompt_piece(ids, scores, ws_dumps, delta=True) == ws_dumps(comp.delta(comp.echoed, want).dump())
    ids, scores = _scores(11)
    comp.add_prompt(ids, scores)
    assert len(comp.lps) == 11
    other = Completion(req, "m", id=comp.id, created=comp.created, index=1, pieces=["short"])  # a second choice
    final = Final(Finished(None, 11, "length"), None, None, 0)
    whole = comp.chunk(comp.text, "length", comp.logprobs())
    whole.choices.append(other.chunk("short", "length", other.logprobs()).choices[0])
    whole.usage = completion.usage_of([final, final], 11)
    want = whole.dump_json()
    assert completion.completion_json([comp, other], [final, final], 11) == want  # the same bytes
    assert comp.lps == comp.tops == comp.offsets == []


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_only_a_long_response_is_built_off_the_event_loop():
    import threading
    here = threading.get_ident()
    assert await completion.off_loop(protocol.SPLICE_ROWS, threading.get_ident) == here
    assert await completion.off_loop(protocol.SPLICE_ROWS + 1, threading.get_ident) != here
    items = list(range(protocol.SPLICE_ROWS * 3 + 1))
    completion.free(items)
    assert items == []


def test_prompt_logprobs_rendered_in_parts_are_the_typed_models_rendering(monkeypatch):
    """vLLM's prompt_logprobs as a JSON body's choice carries them, rendered a few tokens at a time (off the event
    loop), is what the response model renders whole; the token's own entry comes first and, when it is also
    an alternative, takes that rank in place; logprobs asked for with fewer alternatives get only theirs; a body
    that did not ask for them has no such key."""
    monkeypatch.setattr(completion, "SPLICE_ROWS", 4)
    ids, scores = _scores(11)
    scores.ranks.extend([0] + [5 + i for i in range(1, 11)])
    req = CompletionRequest(model="m", prompt=bytes(ids).decode("latin-1"), echo=True, logprobs=0, max_tokens=0,
                            prompt_logprobs=2)
    comp = Completion(req, "m")
    comp.echoed = req.prompt
    comp.add_prompt(ids, scores)
    final = Final(Finished(None, 11, "length"), None, None, 0)
    def name(t: int) -> str:  # the token decoded alone, as vLLM's decoded_token: not logprobs' names
        return comp.tokenizer.decode([t])
    want = [None] + [{str(ids[i]): protocol.PromptLogprob(logprob=lp, rank=5 + i, decoded_token=name(ids[i]))}
                     for i, (lp, _) in enumerate(scores.entries()) if i]
    for i, entry in enumerate(want[1:], 1):  # its two alternatives: (3i, rank 1), then the token itself (rank 2)
        entry[str((3 * i) % 256)] = protocol.PromptLogprob(logprob=-1e-5, rank=1, decoded_token=name((3 * i) % 256))
        entry[str(ids[i])] = protocol.PromptLogprob(logprob=scores.logprobs[i], rank=2, decoded_token=name(ids[i]))
    whole = comp.chunk(comp.text, "length", comp.logprobs())
    whole.choices[0].prompt_logprobs = want
    whole.usage = completion.usage_of([final], 11)
    want_bytes = whole.dump_json()
    body = completion.completion_json([comp], [final], 11)
    assert body == want_bytes  # the same bytes
    got = json.loads(body)
    assert [list(e) for e in got["choices"][0]["prompt_logprobs"][1:3]] == [[str(ids[1]), "3"], [str(ids[2]), "6"]]
    assert got["choices"][0]["prompt_logprobs"][10]["70"]["decoded_token"] == "F"
    odd = PromptScores(**vars(ScoredTokens.of([(None, []), (float("-inf"), [(3, -0.1)])], [0, 256])))
    assert json.loads(b"".join(completion.ranked_json([1, 0xE9], odd, 1, comp.tokenizer))) == [None, {
        "233": {"logprob": -9999.0, "rank": 256, "decoded_token": "\ufffd"},  # vLLM's floor; a byte decoded alone
        "3": {"logprob": -0.1, "rank": 1, "decoded_token": "\x03"}}]
    assert all(len(top) == 1 for top in got["choices"][0]["logprobs"]["top_logprobs"][1:])  # logprobs 0: its own
    chosen = [completion.Choice(0, req.prompt, ids, None)]
    assert completion.body_rows(req, [Completion(req, "m", tokens=[1, 2])], chosen) == 2 + 11  # off_loop's measure
    assert completion.body_rows(req.model_copy(update={"logprobs": None, "prompt_logprobs": None}), [comp], chosen) == 0
    plain = Completion(CompletionRequest(model="m", prompt="x", echo=True, logprobs=2), "m")
    plain.add_prompt(ids, scores)
    assert plain.ranked is None and "prompt_logprobs" not in json.loads(
        completion.completion_json([plain], [final], 11))["choices"][0]


def test_return_token_ids_gives_a_choices_prompt_ids_once_on_whichever_message_comes_first():
    """A stream's first chunk (or WebSocket delta) carries the prompt's ids; a WebSocket completion that ends with
    no delta (cancelled before its first token) carries them on its completion.done instead, and never twice."""
    req = CompletionRequest(model="m", prompt="ab", return_token_ids=True)
    final = Final(Finished(None, 2, "cancelled"), None, None, 0)
    alone = Completion(req, "m", prompt_ids=[97, 98])
    assert alone.done(final, 2).dump()["prompt_token_ids"] == [97, 98]
    streamed = Completion(req, "m", prompt_ids=[97, 98])
    assert streamed.delta("x", None, [120]).dump()["prompt_token_ids"] == [97, 98]
    assert "prompt_token_ids" not in streamed.delta("y", None, [121]).dump()
    assert "prompt_token_ids" not in streamed.done(final, 2).dump()
    plain = Completion(CompletionRequest(model="m", prompt="ab"), "m", prompt_ids=[])
    assert "prompt_token_ids" not in plain.done(final, 2).dump() and "token_ids" not in plain.delta("x", None).dump()

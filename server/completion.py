"""Completions shared by the HTTP and WebSocket surfaces: validate a request, start its run,
and shape OpenAI's ``text_completion`` objects and chunks."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from model.engine import TokenEvent
from model.sampling import LOGIT_BIAS_TOKENS, SamplingParams, after_space
from model.tokenizer import START, ByteTokenizer, Tokenizer
from server.protocol import (
    SPLICE_ROWS,
    VLLM_CHOICE_FIELDS,
    CompletionChoice,
    CompletionDelta,
    CompletionDone,
    CompletionLogprobs,
    CompletionObject,
    CompletionRequest,
    FinishReason,
    PromptTokensDetails,
    SessionRef,
    Usage,
    pydantic_dumps,
    pydantic_json,
    spliced,
)
from server.runtime import Runtime
from server.scheduler import PromptScores
from server.service import Failed, Final, Run, Shared, first_item
from txlserve.errors import InvalidRequestError, ModelNotFound, Overloaded, PayloadTooLarge


def check_model(rt: Runtime, model: str) -> None:
    if model != rt.settings.model_name:
        raise ModelNotFound(f"the model {model!r} does not exist; this server serves {rt.settings.model_name!r}",
                            param="model")


# OpenAI's and vLLM's parameters this server takes at the value that changes nothing, and only there
_NEUTRAL = (("use_beam_search", False), ("skip_special_tokens", True),
            ("spaces_between_special_tokens", True), ("response_format", None), ("priority", 0),
            ("length_penalty", 1.0), ("structured_outputs", None),
            ("logits_processors", None), ("prompt_embeds", None), ("kv_transfer_params", None), ("vllm_xargs", {}))


MAX_CHOICES = 128  # OpenAI's most for ``n``; here for all a request's choices (prompts x n)


def sampling_params(rt: Runtime, req: CompletionRequest) -> SamplingParams | None:
    """The request's sampling, checked (each choice's seed and prompt set later: :func:`choices`); None for
    ``max_tokens: 0`` with ``echo``: the prompt is read (and with ``logprobs`` scored) and given back, nothing
    generated, as OpenAI and vLLM answer it (how a prompt is scored)."""
    s = rt.settings
    for name, neutral in _NEUTRAL:
        if getattr(req, name) not in (None, neutral):
            only = "" if neutral is None else f" (only {json.dumps(neutral)})"
            raise InvalidRequestError(f"{name} is not supported{only}", param=name)
    if req.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    if max_tokens > s.max_tokens_limit:
        raise InvalidRequestError(f"max_tokens must be at most {s.max_tokens_limit}", param="max_tokens")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > s.max_stop:
        raise InvalidRequestError(f"at most {s.max_stop} stop strings are allowed (this server's --max-stop), got "
                                  f"{len(stop)}", param="stop")
    for x in stop:  # stop strings match the generated text's bytes, whatever the tokenizer
        try:
            too_long = isinstance(x, str) and len(x.encode("utf-8")) > s.max_stop_bytes
        except UnicodeEncodeError as err:
            raise InvalidRequestError(f"stop: text is not valid Unicode: {err.reason} at position {err.start}",
                                      param="stop") from None
        if too_long:
            raise InvalidRequestError(f"a stop string may be at most {s.max_stop_bytes} bytes", param="stop")
    if max_tokens < 0:
        raise InvalidRequestError(f"max_tokens must be >= 0 (0 with echo scores the prompt), got {max_tokens}",
                                  param="max_tokens")
    if req.min_tokens is not None and not 0 <= req.min_tokens <= max_tokens:
        sent = req.max_tokens is not None and "max_tokens" in req.model_fields_set
        larger = max_tokens < req.min_tokens <= rt.settings.max_tokens_limit  # a larger max_tokens would do
        default = " (max_tokens defaults to 16, OpenAI's: send a larger one)" if larger and not sent else ""
        raise InvalidRequestError(f"min_tokens must be in [0, max_tokens {max_tokens}], got {shown(req.min_tokens)}"
                                  f"{default}", param="min_tokens")
    if req.prompt_logprobs == -1:  # vLLM's "every token", refused past its --max-logprobs (20) as here
        raise InvalidRequestError(f"prompt_logprobs -1 asks for all {vocabulary(rt):,} tokens of the vocabulary at "
                                  f"every prompt token; at most 20 alternatives are given", param="prompt_logprobs")
    if req.stream and req.prompt_logprobs:  # 0 is taken, and gives nothing in a stream, as vLLM's
        raise InvalidRequestError("prompt_logprobs are not available in a stream (SSE or WebSocket): they come in a "
                                  "JSON body's choices; echo with logprobs streams the prompt's scores",
                                  param="prompt_logprobs")
    if max_tokens == 0 and not req.echo and prompt_ranked(req) is None:
        raise InvalidRequestError("max_tokens 0 generates nothing: it is for scoring a prompt, with echo true (and "
                                  "logprobs for its tokens' scores)" + ("" if req.stream else " or prompt_logprobs"),
                                  param="max_tokens")
    params = SamplingParams(max_tokens=max_tokens or 1, temperature=1.0 if req.temperature is None else
                            req.temperature, top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                            seed=req.seed, stop=tuple(stop), logprobs=req.logprobs,  # each field checked
                            logit_bias=logit_bias(rt, req.logit_bias), frequency_penalty=req.frequency_penalty or 0.0,
                            presence_penalty=req.presence_penalty or 0.0, min_p=req.min_p or 0.0,
                            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                            stop_token_ids=tuple(in_vocabulary(rt, req.stop_token_ids or [], "stop_token_ids",
                                                               "stop_token_ids")),  # sampling checks how many
                            include_stop_str_in_output=bool(req.include_stop_str_in_output),
                            min_tokens=req.min_tokens or 0, allowed_token_ids=tuple(allowed(rt, req.allowed_token_ids)))
    held = set(params.stop_token_ids) if params.min_tokens else set()  # until min_tokens: banned too
    banned = {t for t, b in params.logit_bias if b <= -100} | held
    left = set(params.allowed_token_ids) - banned if params.allowed_token_ids else vocabulary(rt) - len(banned)
    if not left:  # a ban is -inf: there would be nothing left to draw
        if params.allowed_token_ids:
            raise InvalidRequestError("every token of allowed_token_ids is banned (by logit_bias -100, or as a stop "
                                      "token min_tokens holds back)", param="allowed_token_ids")
        if held:
            raise InvalidRequestError("min_tokens holds back the stop_token_ids, and they (with logit_bias's bans) "
                                      "are every token of the vocabulary", param="min_tokens")
        raise InvalidRequestError("logit_bias bans every token of the vocabulary (-100 bans one)", param="logit_bias")
    return None if max_tokens == 0 else params


def prompt_ranked(req: CompletionRequest) -> int | None:
    """vLLM's ``prompt_logprobs`` as this request gets them (alternatives a token), None if it does not: a
    stream has none (its 0 is taken, as vLLM takes it)."""
    return None if req.stream else req.prompt_logprobs


def vocabulary(rt: Runtime) -> int:
    """The token ids a request may name are [0, this): a hand-made checkpoint's tokenizer and model may differ."""
    return min(rt.engine.tokenizer.vocab_size, rt.engine.config.vocab_size)


def in_vocabulary(rt: Runtime, ids: list[int], name: str, param: str) -> list[int]:
    """``ids``, each a token id of the model: one past the vocabulary would index past the embedding or logits."""
    vocab = vocabulary(rt)
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"{name}: token id {bad} is not in this model's vocabulary [0, {vocab})",
                                  param=param)
    return ids


def allowed(rt: Runtime, ids: list[int] | None) -> list[int]:
    """vLLM's ``allowed_token_ids``, each a token id of the model; an empty list would leave nothing to draw."""
    if ids == []:
        raise InvalidRequestError("allowed_token_ids must name at least one token (leave it out to allow every "
                                  "token)", param="allowed_token_ids")
    return in_vocabulary(rt, ids or [], "allowed_token_ids", "allowed_token_ids")


def logit_bias(rt: Runtime, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token ids as JSON's string keys) as sampling's (id, bias) pairs, each id in the
    vocabulary: one past it would index past the logits."""
    vocab, bias = vocabulary(rt), bias or {}
    if len(bias) > LOGIT_BIAS_TOKENS:  # before a body's worth of keys is read
        raise InvalidRequestError(f"logit_bias names {len(bias):,} tokens; at most {LOGIT_BIAS_TOKENS} are allowed",
                                  param="logit_bias")
    pairs = []
    for key, value in bias.items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= 19 else -1
        if not 0 <= token < vocab:
            raise InvalidRequestError(f"logit_bias: {key[:40]!r} is not a token id of this model's vocabulary "
                                      f"[0, {vocab}) (keys are token ids, as /tokenize gives them)", param="logit_bias")
        pairs.append((token, value))
    return tuple(pairs)  # each bias's range is SamplingParams's to check; bans of every token: sampling_params


def the_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """OpenAI's four forms of ``prompt`` as a list of prompts: one text or token-id list, or a batch of either."""
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("prompt: an empty list holds no prompt; send \"\" for an empty one",
                                  param="prompt")
    return list(prompt)


def how_many(req: CompletionRequest, prompts: int, held: int) -> int:
    """``n``, checked against the request (a session continues one text, so its request has one choice) and
    the server (``held``: the most requests it holds at once, which a request's choices are)."""
    n = 1 if req.n is None else req.n
    if n < 1:
        raise InvalidRequestError(f"n must be at least 1, got {n}", param="n")
    if req.best_of not in (None, n):  # best_of == n returns every sampled choice: vLLM's neutral value
        raise InvalidRequestError("best_of is supported only at n's value (every sampled choice is returned)",
                                  param="best_of")
    if req.session_id is not None and prompts * n > 1:
        raise InvalidRequestError("a session continues one text: with session_id send one prompt and n 1 (fork the "
                                  "session for other continuations)", param="n" if n > 1 else "prompt")
    if prompts * n > min(MAX_CHOICES, held):
        why = f"a request may have at most {MAX_CHOICES}" if prompts * n > MAX_CHOICES else (
            f"this server holds at most {held} requests at once (the batch, and beyond it --max-queue, at most as "
            f"many as --batch-mb holds)")
        raise InvalidRequestError(f"{prompts} prompt(s) x n {n} is {prompts * n} choices; {why}",
                                  param="n" if n > 1 else "prompt")
    return n


@dataclass
class Choice:
    """One choice of a request, ready to run: its index (prompt's index x n + its own), its prompt as sent and as
    token ids, its sampling, and (with ``echo``) the prompt's text. Everything that can refuse a request is
    checked before any choice runs."""

    index: int
    prompt: str | list[int]
    ids: list[int]
    params: SamplingParams | None
    echoed: str = ""
    sample: int = 0  # which of its prompt's n samples


def shown(value: int) -> str:
    """A number as an error message quotes it: a body's 4,000-digit one was the whole message."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"


def truncated_to(tokens: int | None) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: how many of a prompt's last tokens are read (None: all). Its -1 is "the
    model's context", which a Transformer-XL does not have (its memory is fixed-size): the whole prompt."""
    if tokens is not None and tokens < 1 and tokens != -1:  # 0 would read nothing of the prompt: vLLM refuses it
        raise InvalidRequestError(f"truncate_prompt_tokens must be -1 (the whole prompt) or a number of tokens >= 1, "
                                  f"got {shown(tokens)}", param="truncate_prompt_tokens")
    return None if tokens is None or tokens == -1 else tokens


def _seed(seed: int | None, j: int) -> int | None:
    """The ``j``-th sample of a prompt draws from seed + j (in int64's range): n samples of one seed differ, and a
    request's first choice is what the same request with n 1 gives."""
    return None if seed is None else (seed + j + (1 << 63)) % (1 << 64) - (1 << 63)


async def choices(rt: Runtime, req: CompletionRequest) -> list[Choice]:
    """The request's choices, in ``index`` order, every check made; each is started with :func:`launch`."""
    check_model(rt, req.model)
    if req.stream_options is not None and not req.stream:  # OpenAI refuses it too
        raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
    params = sampling_params(rt, req)
    prompts = the_prompts(req)
    n, limit = how_many(req, len(prompts), rt.most_runs), rt.settings.max_prompt_bytes
    keep = truncated_to(req.truncate_prompt_tokens)
    out, values, read, ranked = [], 0, 0, 0
    inline = sum(len(p) for p in prompts) <= _ENCODE_INLINE  # texts' characters, or ids
    for p, prompt in enumerate(prompts):
        name = f"prompt[{p}]" if len(prompts) > 1 else "prompt"  # which of a batch's
        ids = (await prompt_ids(rt, prompt, limit, name=name, inline=inline) if isinstance(prompt, str)
               else checked_ids(rt, prompt, limit, name))
        carried = req.echo or req.return_token_ids  # each choice gives the prompt back (its text, or its ids)
        read += (n if carried else 1) * len(ids)  # a prompt's n choices read it once; as sent
        cut = keep is not None and len(ids) > keep
        ids = ids[len(ids) - keep:] if cut else ids  # vLLM's truncation side: the prompt's last tokens stay
        if read > limit and n * len(prompts) > 1:  # a request reads (and echoes) at most the limit
            how = ("a prompt counts once, and once more for each other choice that gives it back (echo, "
                   "return_token_ids)" if carried else "a prompt counts once, however many choices read it")
            raise PayloadTooLarge(f"{n * len(prompts)} choices' prompts come to {read:,}+ tokens as sent; the limit "
                                  f"is {limit:,} a request ({how})", param="n" if n > 1 else "prompt")
        echoed = (prompt if isinstance(prompt, str) and not cut else await ids_text(rt, ids)) if req.echo else ""
        spaced = params and replace(params, after_space=isinstance(prompt, str) and after_space(prompt))
        values += n * ((len(ids) if req.echo else 0) + (params.max_tokens if params else 0))
        ranked += n * len(ids)  # every choice carries its prompt's prompt_logprobs
        out += [Choice(len(out) + j, prompt, ids, spaced and replace(spaced, seed=_seed(spaced.seed, j)), echoed, j)
                for j in range(n)]
    check_logprobs_values(rt, values, req.logprobs, ranked, prompt_ranked(req))
    return out


def launch(rt: Runtime, req: CompletionRequest, choice: Choice, owner: str | None,
           shared: Shared | None = None) -> Run:
    """Start a choice's run: it reads the prompt (scored with ``echo`` and ``logprobs``) and generates;
    ``shared`` by its prompt's other choices, it reads the prompt once for all of them."""
    asked = (req.logprobs if req.echo else None, ranked := prompt_ranked(req))  # one scoring serves both
    top = max((k for k in asked if k is not None), default=None)
    return Run(rt, ids=choice.ids, params=choice.params, owner=owner, session_id=req.session_id,
               prompt_logprobs=top if choice.ids else None, prompt_ranks=ranked is not None,
               session_param="session_id", scored=choice.params is not None,  # max_tokens 0: no log-likelihood wanted
               shared=shared)


_ENCODE_INLINE = 16_384  # characters; a longer text is tokenized off the event loop (a word tokenizer is slow)


async def prompt_ids(rt: Runtime, text: str, limit: int, param: str = "prompt", name: str | None = None,
                     inline: bool | None = None) -> list[int]:
    """``text``'s ids; its errors say ``name`` (default ``param``: a batch's say which prompt, ``prompt[4]``).
    Tokenized on the event loop when short (``inline``; a batch decides by its whole length: 128 short prompts
    held the loop as one long one would), else on a thread."""
    name = name or param
    inline = len(text) <= _ENCODE_INLINE if inline is None else inline
    try:
        ids = rt.engine.encode(text) if inline else await asyncio.to_thread(rt.engine.encode, text)
    except InvalidRequestError as err:
        raise InvalidRequestError(f"{name}: {err.message}", param=param) from None
    if len(ids) > limit:
        raise PayloadTooLarge(f"{name} is {len(ids)} tokens; the limit is {limit}", param=param)
    return ids


async def ids_text(rt: Runtime, ids: list[int]) -> str:
    """What ``echo`` gives back of a token-id prompt: its text (decoded off the event loop when long, as long
    texts are tokenized)."""
    decode = rt.engine.tokenizer.decode
    return decode(ids) if len(ids) <= _ENCODE_INLINE else await asyncio.to_thread(decode, ids)


def checked_ids(rt: Runtime, ids: list[int], limit: int, name: str = "prompt") -> list[int]:
    """A token-id prompt the model can read, within ``limit``."""
    in_vocabulary(rt, ids, name, "prompt")
    if len(ids) > limit:
        raise PayloadTooLarge(f"{name} is {len(ids)} tokens; the limit is {limit}", param="prompt")
    return list(ids)


def check_logprobs_values(rt: Runtime, tokens: int, logprobs: int | None, prompt_tokens: int = 0,
                          prompt_logprobs: int | None = None) -> None:
    """Refuse a response of more log-probabilities than ``--max-logprobs-values``, before anything is read: 20
    alternatives for each token of a long scored prompt made a response 500 times the request's size, gigabytes
    held while it was built and sent (found by a helper). ``prompt_tokens`` with ``prompt_logprobs``: vLLM's, in
    every choice too; the larger part is named."""
    limit = rt.settings.max_logprobs_values
    asked = [(name, k, t) for name, k, t in (("logprobs", logprobs, tokens),
                                             ("prompt_logprobs", prompt_logprobs, prompt_tokens)) if k is not None]
    total = sum(t * (1 + k) for _, k, t in asked)
    if total <= limit:
        return
    name, k, t = max(asked, key=lambda a: a[2] * (1 + a[1]))
    both = f" ({total:,} with {'prompt_logprobs' if name == 'logprobs' else 'logprobs'}'s)" if len(asked) > 1 else ""
    raise InvalidRequestError(
        f"{name} {k} for {t:,} tokens is {t * (1 + k):,} log-probabilities{both}, over this server's limit of "
        f"{limit:,} (--max-logprobs-values): score at most {t * limit // total:,} tokens at a time (append a long "
        f"text in parts), or ask for fewer alternatives", param=name)


def text_start(decoder: codecs.IncrementalDecoder, data: bytes, chars: int) -> tuple[int, int]:
    """Where a token's text starts, given the ``chars`` characters its predecessors decoded to, and that count
    after it (``decoder``, errors="replace", is fed its bytes). A token that completes a character begun before it
    starts where that character does; one after bytes that begin no character it can complete starts after the
    U+FFFD they become: a stray lead byte, then "A", gave "A" the offset of the U+FFFD before it."""
    held = decoder.getstate()[0]
    start = chars
    if held and data:
        try:
            codecs.getincrementaldecoder("utf-8")().decode(held + data[:1])
        except UnicodeDecodeError:  # the held bytes end as they are: their U+FFFD comes first
            start += len(held.decode("utf-8", errors="replace"))
    return start, chars + len(decoder.decode(data))


def prompt_logprobs(tokenizer: Tokenizer, ids: list[int], scores: PromptScores,
                    text: str | None = None, name: Callable[[int], str] | None = None,
                    top: int | None = None) -> CompletionLogprobs:
    """Scored prompt (or appended) tokens in OpenAI's logprobs shape: the first entry is null when nothing
    precedes it; offsets count characters from the start of ``text``, the text the ids were read from (echoed as
    it was sent), else of the ids' decoded text (a token-id prompt's echo). ``name``: a token's (default: the
    tokenizer's). ``top``: the alternatives to give, when the scores have more (vLLM's ``prompt_logprobs`` asked
    for more than ``logprobs``)."""
    name = name or tokenizer.token_name
    out = CompletionLogprobs.model_construct(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token, (lp, alts) in zip(ids, scores.entries(), strict=True):
        out.tokens.append(name(token))
        out.token_logprobs.append(lp)
        if lp is not None and top is not None and len(alts) > top:  # the token itself stays among them
            alts = alts[:top] + ([] if any(t == token for t, _ in alts[:top]) else [(token, lp)])
        out.top_logprobs.append(None if lp is None else {name(t): v for t, v in alts})
    if text is not None and len(offsets := tokenizer.offsets(text)) == len(ids):
        out.text_offset = offsets
        return out
    decoder, offset, prev = codecs.getincrementaldecoder("utf-8")(errors="replace"), 0, START
    for token in ids:
        start, offset = text_start(decoder, tokenizer.token_bytes(token, prev), offset)
        out.text_offset.append(start)
        prev = token
    return out


LOGPROB_FLOOR = -9999.0  # vLLM's clamp_prompt_logprobs: JSON has no -inf (pydantic would write null)


def ranked_json(ids: list[int], scores: PromptScores, top: int, tokenizer: Tokenizer) -> list[bytes]:
    """vLLM's ``prompt_logprobs`` as parts of JSON, to be joined once: for each token (null for a first one), its
    own entry (log-probability, rank, text) then its ``top`` likeliest alternatives' (ranks 1 to ``top``), keyed
    by token id; an alternative that is the token itself takes its place, as vLLM's dict does. ``decoded_token``
    is the token decoded alone, as vLLM's (not logprobs' names). Rendered :data:`SPLICE_ROWS` tokens at a time
    (call it through :func:`off_loop`): the same JSON as ``CompletionChoice.prompt_logprobs`` renders whole. Joined
    as str or bytes with ``+`` its ~10 copies of a 60 MB answer had held the GIL, and every stream, for 0.2-0.8 s
    (found by a review)."""
    names: dict[int, str] = {}

    def entry(token: int, lp: float, rank: int) -> dict[str, Any]:
        name = names.get(token)
        if name is None:
            name = names[token] = tokenizer.decode([token])
        return {"logprob": max(lp, LOGPROB_FLOOR), "rank": rank, "decoded_token": name}

    parts, at, entries = [b"["], 0, scores.entries()
    while at < len(ids):
        rows: list[dict[str, dict[str, Any]] | None] = []
        for i in range(at, min(at + SPLICE_ROWS, len(ids))):
            lp, alts = next(entries)
            if lp is None:
                rows.append(None)
                continue
            row = {str(ids[i]): entry(ids[i], lp, scores.ranks[i])}
            for rank, (t, v) in enumerate(alts[:top], 1):
                row[str(t)] = entry(t, v, rank)
            rows.append(row)
        parts += [b"," if at else b"", pydantic_json(rows)[1:-1]]
        at += len(rows)
    return [*parts, b"]"]


async def off_loop(rows: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, on a thread when it builds or renders more than :data:`SPLICE_ROWS` logprobs entries (in
    parts: :func:`~server.protocol.spliced`), so that the event loop serves every other request meanwhile."""
    return fn(*args, **kwargs) if rows <= SPLICE_ROWS else await asyncio.to_thread(fn, *args, **kwargs)


def free(*lists: list) -> None:
    """Empty ``lists`` a part at a time, on the thread that rendered them: a long scored prompt's logprobs are
    a million small objects, and freed at once, where the last reference dropped (the event loop, as the request
    ended), they held the GIL for a quarter of a second."""
    for items in lists:
        while items:
            del items[-SPLICE_ROWS:]


def body_bytes(dump: Callable[[], bytes], logprobs: CompletionLogprobs | None,
               put: Callable[[CompletionLogprobs], None]) -> bytes:
    """A JSON body that holds ``logprobs`` (``dump`` renders it; ``put`` sets its logprobs): past
    :data:`SPLICE_ROWS` of them rendered in parts (:func:`~server.protocol.spliced`) and freed here, a part at a
    time (:func:`free`). Call it through :func:`off_loop`."""
    if logprobs is None or len(logprobs.tokens) <= SPLICE_ROWS:
        return dump()

    def shell(empty: CompletionLogprobs) -> str:
        put(empty)
        return dump().decode()
    out = spliced(shell, logprobs, pydantic_dumps).encode()
    free(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, logprobs.text_offset)
    return out


_MARKER = "\u0000txl-text\u0000"  # cannot occur in generated text: JSON escapes it as \\u0000
_ID_MARKER = -7  # no token's id


@dataclass
class Completion:
    """Accumulates one choice; renders the full object or stream chunks."""

    req: CompletionRequest
    model: str
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)  # names the tokens in logprobs
    system_fingerprint: str | None = None
    id: str = field(default_factory=lambda: "cmpl-" + secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
    index: int = 0  # of the choice, among the request's (prompts x n)
    text_prompt: bool = True  # its prompt came as text: the echoed prompt's offsets are that text's
    echoed: str = ""  # the prompt's text, given back first with ``echo``
    pieces: list[str] = field(default_factory=list)  # the text generated: joined once (a long echo was copied a token)
    tokens: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    tops: list[dict[str, float]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    prev: int | None = None  # the prompt's last token, as the engine's generation had it (a word's spacing)
    ranked: list[bytes] | None = None  # vLLM's prompt_logprobs, as JSON's parts (:func:`ranked_json`), once scored
    stop_reason: int | str | None = None  # vLLM's: the stop string or token that ended it
    prompt_ids: list[int] = field(default_factory=list)  # the prompt's ids as read, for return_token_ids
    token_ids: list[int] = field(default_factory=list)  # the ids generated (self.tokens has the echoed prompt's too)
    _prompt_ids_due: bool = True  # a stream's first chunk of this choice carries prompt_token_ids
    _template: tuple[str, str, str] | None = field(default=None, repr=False)
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"), repr=False)
    _chars: int = 0  # characters the generated tokens decode to so far, text held back (a stop string's start) too

    @classmethod
    def of(cls, rt: Runtime, req: CompletionRequest, choice: Choice, first: Completion | None = None) -> Completion:
        """A choice's; the request's other choices share the ``first``'s id and time."""
        out = cls(req, rt.settings.model_name, rt.engine.tokenizer, rt.engine.fingerprint, index=choice.index,
                  text_prompt=isinstance(choice.prompt, str), echoed=choice.echoed,
                  prev=choice.ids[-1] if choice.ids else None, prompt_ids=choice.ids if req.return_token_ids else [])
        if first is not None:
            out.id, out.created = first.id, first.created
        elif req.request_id is not None:  # vLLM's
            out.id = "cmpl-" + req.request_id
        return out

    @property
    def text(self) -> str:
        """The choice's text: the echoed prompt, then what was generated."""
        return self.echoed + "".join(self.pieces)

    def add(self, ev: TokenEvent) -> CompletionLogprobs | None:
        """Record a token; its logprobs piece for a stream chunk (or None without logprobs). Its text offset
        counts the characters of the tokens before it, as the prompt's do (prompt_logprobs): the text released
        so far lags them while a stop string's start is held back, and gave tokens the same offset."""
        self.tokens.append(ev.token)
        self.pieces.append(ev.text)
        if self.req.return_token_ids:
            self.token_ids.append(ev.token)
        if ev.stop_reason is not None:
            self.stop_reason = ev.stop_reason
        if self.req.logprobs is None:
            return None
        if ev.prev is not None:  # the first token's: a session's last when the prompt was empty
            self.prev = ev.prev
        start, self._chars = text_start(self._decoder, self.tokenizer.token_bytes(ev.token, self.prev), self._chars)
        start += len(self.echoed)
        self.prev = ev.token
        name = self.token_name
        top = {name(t): lp for t, lp in (ev.top_logprobs or [])}
        self.lps.append(ev.logprob)
        self.tops.append(top)
        self.offsets.append(start)
        return CompletionLogprobs(tokens=[name(ev.token)], token_logprobs=[ev.logprob], top_logprobs=[top],
                                  text_offset=[start])

    def add_text(self, text: str) -> None:
        """Text released without a token of its own (what a cancelled generation held back)."""
        self.pieces.append(text)

    def add_prompt(self, ids: list[int], scores: PromptScores) -> None:
        """The prompt's scores: vLLM's ``prompt_logprobs``, and with ``echo`` the prompt's logprobs, first in the
        choice. Call it through :func:`off_loop`."""
        if (top := prompt_ranked(self.req)) is not None:
            self.ranked = ranked_json(ids, scores, top, self.tokenizer)
        if not self.req.echo or self.req.logprobs is None:
            return
        piece = self._scored_prompt(ids, scores)
        self.lps[:0], self.tops[:0], self.offsets[:0] = piece.token_logprobs, piece.top_logprobs, piece.text_offset
        self.tokens[:0] = ids

    def _scored_prompt(self, ids: list[int], scores: PromptScores) -> CompletionLogprobs:
        return prompt_logprobs(self.tokenizer, ids, scores, self.echoed if self.text_prompt else None,
                               self.token_name, self.req.logprobs)

    def token_name(self, token: int) -> str:
        """A token as logprobs name it: the tokenizer's name, or with vLLM's ``return_tokens_as_token_ids``
        ``token_id:{id}``, which any client can map back (a byte model's ``bytes:\\xNN`` are names only)."""
        return f"token_id:{token}" if self.req.return_tokens_as_token_ids else self.tokenizer.token_name(token)

    def logprobs(self) -> CompletionLogprobs | None:
        if self.req.logprobs is None:
            return None
        return CompletionLogprobs.model_construct(  # these lists, not copies (validated, the dicts were copied)
            tokens=[self.token_name(t) for t in self.tokens], token_logprobs=self.lps,
            top_logprobs=self.tops, text_offset=self.offsets)

    def text_event(self, text: str, token_ids: list[int] | None = None) -> str:
        """``data: {chunk}\n\n`` for a chunk of text (with ``return_token_ids`` its ids) alone, the case of
        nearly every chunk: the model is rendered once per completion with markers and the text and ids are
        spliced in, the same bytes as rendering it each time (tested), at a fraction of the event loop's time with
        many concurrent streams. A choice's first chunk with ``return_token_ids`` (the prompt's ids) is rendered."""
        if self.req.return_token_ids and (self._prompt_ids_due or token_ids is None):
            return f"data: {json.dumps(self.piece(text, token_ids=token_ids), ensure_ascii=False)}\n\n"
        ids = self.req.return_token_ids
        if self._template is None:  # (data: head) text (middle) ids (tail): the text comes before the ids
            marker = json.dumps(_MARKER)[1:-1]
            head, rest = json.dumps(self.piece(_MARKER, token_ids=[_ID_MARKER] if ids else None),
                                    ensure_ascii=False).rsplit(marker, 1)
            middle, tail = rest.rsplit(f"[{_ID_MARKER}]", 1) if ids else (rest, "")
            self._template = ("data: " + head, middle, tail + "\n\n")
        head, middle, tail = self._template
        return head + json.dumps(text, ensure_ascii=False)[1:-1] + middle + (json.dumps(token_ids) if ids else "") \
            + tail

    def chunk(self, text: str, finish_reason: FinishReason | None = None, logprobs: CompletionLogprobs | None = None,
              *, session: SessionRef | None = None, token_ids: list[int] | None = None) -> CompletionObject:
        """A chunk (or the body's shell); the one that ends the choice carries its stop_reason, and with
        ``return_token_ids`` the first of the choice the prompt's ids, each its own ``token_ids``."""
        return CompletionObject(id=self.id, created=self.created, model=self.model,
                                system_fingerprint=self.system_fingerprint, session=session, choices=[
                                    CompletionChoice(index=self.index, text=text, logprobs=logprobs,
                                                     finish_reason=finish_reason,
                                                     stop_reason=self.stop_reason if finish_reason else None,
                                                     token_ids=token_ids, prompt_token_ids=self._prompt_ids())])

    def prompt_rows(self) -> int:
        """How many prompt ids this choice's next stream chunk carries (its first, with ``return_token_ids``):
        :func:`off_loop`'s measure, as a million of them take the event loop ~0.1 s to render."""
        return len(self.prompt_ids) if self.req.return_token_ids and self._prompt_ids_due else 0

    def _prompt_ids(self) -> list[int] | None:
        """The prompt's ids for this stream chunk: on the choice's first, with ``return_token_ids``."""
        if not self.req.return_token_ids or not self._prompt_ids_due:
            return None
        self._prompt_ids_due = False
        return self.prompt_ids

    def piece(self, text: str, finish_reason: FinishReason | None = None, logprobs: CompletionLogprobs | None = None,
              *, session: SessionRef | None = None, usage: dict[str, int] | None = None,
              token_ids: list[int] | None = None) -> dict[str, Any]:
        """A stream chunk's JSON object; with ``stream_options.include_usage`` it says ``"usage": null``, as
        OpenAI's chunks before the usage chunk do, or (``continuous_usage_stats``) the ``usage`` so far."""
        options = self.req.stream_options
        out = self.chunk(text, finish_reason, logprobs, session=session, token_ids=token_ids).dump(
            usage_null=bool(options and options.include_usage))
        if usage is not None:
            out["usage"] = usage
        return out

    @staticmethod
    def usage_so_far(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        """vLLM's ``continuous_usage_stats``: a chunk's counts, the prompt's and the tokens generated so far."""
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    @staticmethod
    def usage(final: Final, prompt_tokens: int) -> Usage:
        return usage_of([final], prompt_tokens)

    @staticmethod
    def session(final: Final) -> SessionRef | None:
        if final.info is None:
            return None
        return SessionRef(id=final.info.session_id, tokens_seen=final.info.tokens_seen,
                          rebuilt=True if final.source == "rebuild" else None)

    @staticmethod
    def finish(final: Final) -> FinishReason:
        return final.done.finish_reason or "length"

    def choice_json(self, final: Final) -> list[bytes | memoryview]:
        """The choice's JSON in the body, in parts to be joined once (:func:`body_bytes`: call it through
        :func:`off_loop`)."""
        asked = bool(self.req.return_token_ids)
        choice = CompletionChoice(index=self.index, text=self.text, logprobs=self.logprobs(),
                                  finish_reason=self.finish(final), stop_reason=self.stop_reason,
                                  token_ids=self.token_ids if asked else None,
                                  prompt_token_ids=self.prompt_ids if asked else None)
        unset = {name for name in VLLM_CHOICE_FIELDS if getattr(choice, name) is None}  # prompt_logprobs: spliced in
        body = body_bytes(lambda: choice.model_dump_json(exclude=unset).encode(), choice.logprobs,
                          lambda empty: setattr(choice, "logprobs", empty))
        if prompt_ranked(self.req) is None:
            return [body]
        # the last field; a choice with no prompt tokens (a session's empty one) scored none
        ranked, self.ranked = self.ranked or [b"[]"], None
        return [memoryview(body)[:-1], b',"prompt_logprobs":', *ranked, b"}"]

    def prompt_piece(self, ids: list[int], scores: PromptScores, dumps: Callable[[Any], str], *,
                     usage: dict[str, int] | None = None, delta: bool = False) -> str:
        """The stream's first event of an echo with logprobs, the prompt and its scores, as ``dumps`` writes JSON:
        an SSE chunk, or (``delta``) a WebSocket delta. Sent, not kept: its lists are emptied (:func:`free`).
        Call it through :func:`off_loop`."""
        logprobs = self._scored_prompt(ids, scores)

        def shell(lp: CompletionLogprobs) -> str:
            return dumps(self.delta(self.echoed, lp).dump() if delta else self.piece(self.echoed, None, lp,
                                                                                      usage=usage))
        out = spliced(shell, logprobs, dumps)
        free(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, logprobs.text_offset)
        return out

    def usage_chunk(self, finals: list[Final], prompt_tokens: int) -> CompletionObject:
        """The extra last SSE chunk of ``stream_options.include_usage``: no choices, the request's usage."""
        return CompletionObject(id=self.id, created=self.created, model=self.model,
                                system_fingerprint=self.system_fingerprint, choices=[],
                                usage=usage_of(finals, prompt_tokens))

    def delta(self, text: str, logprobs: CompletionLogprobs | None,
              token_ids: list[int] | None = None) -> CompletionDelta:
        return CompletionDelta(id=self.id, text=text, logprobs=logprobs, token_ids=token_ids,
                               prompt_token_ids=self._prompt_ids())

    def done(self, final: Final, prompt_tokens: int) -> CompletionDone:
        return CompletionDone(id=self.id, text=self.text, finish_reason=self.finish(final),
                              usage=self.usage(final, prompt_tokens), session=self.session(final),
                              stop_reason=self.stop_reason, prompt_token_ids=self._prompt_ids())


MERGED_TOKENS = 256  # the most tokens one stream chunk or delta carries (with 20 logprobs each: ~180 KB)


class Deltas:
    """A choice's tokens read but not yet sent. The tokens already waiting when one is read leave with it, in one
    chunk (SSE) or ``completion.delta`` (WebSocket): their text, logprobs and ids in order, as vLLM merges a slow
    consumer's outputs. With a message per token (a tiny model's 10,000 a second) a client that reads slower than
    the model generates fell further behind for as long as it streamed: a browser's page spent a third more of its
    time on them, and on a busy machine the OpenAI SDK took 1.6 times the generation's time to read 50,000 chunks
    of ~270 bytes."""

    def __init__(self, ids: bool) -> None:
        self.with_ids = ids  # vLLM's ``token_ids``: every token's
        self._clear()

    def _clear(self) -> None:
        self.tokens = 0
        self.text: list[str] = []
        self.logprobs: CompletionLogprobs | None = None
        self.ids: list[int] | None = [] if self.with_ids else None

    def full(self) -> bool:
        return self.tokens >= MERGED_TOKENS

    @property
    def rows(self) -> int:
        """The logprobs entries waiting: :func:`off_loop`'s measure."""
        return len(self.logprobs.tokens) if self.logprobs is not None else 0

    def add(self, token: TokenEvent, logprobs: CompletionLogprobs | None) -> None:
        """A token, and its logprobs piece (:meth:`Completion.add`'s: lists of its own, extended here)."""
        self.tokens += 1
        self.text.append(token.text)
        if self.ids is not None:
            self.ids.append(token.token)
        if logprobs is None:
            return
        if self.logprobs is None:
            self.logprobs = logprobs
            return
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self.logprobs, name).extend(getattr(logprobs, name))

    def add_text(self, text: str) -> None:
        """Text released without a token of its own (what a cancelled generation held back)."""
        self.text.append(text)

    def pop(self) -> tuple[str, CompletionLogprobs | None, list[int] | None] | None:
        """(text, logprobs, ids) of the tokens waiting, which are then sent (ids None where none came: only text a
        cancelled generation held back); None where there is nothing to send: no token yet, or tokens that
        released no text yet (a stop string's start held back)."""
        due = any(self.text) or self.logprobs is not None or bool(self.ids)
        taken = "".join(self.text), self.logprobs, self.ids or None
        self._clear()
        return taken if due else None


async def events(run: Run, first: Any, since: float | None = None
                 ) -> AsyncIterator[PromptScores | TokenEvent | str | Final]:
    """The run's (PromptScores, then) TokenEvents, then (a cancelled run) the text its generation still held
    back, as a str, then its Final (with the last token folded in); raises a Failed's error. ``first``: its first
    event, already read (:func:`open_runs`), or None. Every surface (SSE,
    JSON, WebSocket) reads a completion here, so the time to each token and to the end is observed here, from
    ``since`` (the request's arrival; default: its run's start): the WebSocket's and the JSON body's went
    unobserved."""
    m, start = run.rt.metrics, since if since is not None else run.started
    last_t: float | None = None

    def timed(token: TokenEvent) -> TokenEvent:
        nonlocal last_t
        now = time.monotonic()
        (m.ttft if last_t is None else m.itl).observe(now - (start if last_t is None else last_t))
        last_t = now
        return token

    item = first if first is not None else await run.events.get()
    while True:
        if isinstance(item, Failed):
            raise item.error
        if isinstance(item, Final):
            if item.last is not None:
                yield timed(item.last)  # held back for the commit: it arrives with the end
            if item.done.text:
                yield item.done.text
            m.e2e.observe(time.monotonic() - start)
            yield item
            return
        yield timed(item) if isinstance(item, TokenEvent) else item
        item = await run.events.get()


def usage_of(finals: list[Final], prompt_tokens: int) -> Usage:
    """A request's usage: each prompt's tokens counted once (``prompt_tokens``), every choice's generated ones."""
    n = sum(final.done.completion_tokens for final in finals)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=n, total_tokens=prompt_tokens + n,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(f.cached_tokens for f in finals)))


def prompt_tokens(chosen: list[Choice]) -> int:
    """The request's prompt tokens: each prompt's once, however many choices sample it (OpenAI's, vLLM's)."""
    return sum(len(choice.ids) for choice in chosen if choice.sample == 0)


def body_rows(req: CompletionRequest, comps: list[Completion], chosen: list[Choice]) -> int:
    """The logprobs entries a JSON body renders, :func:`off_loop`'s measure: each choice's tokens with
    ``logprobs``, its prompt's with ``prompt_logprobs`` (left out, a 60 MB body had been rendered on the event
    loop: found by a review), and its ids with ``return_token_ids`` (128 choices of a long prompt: 384 MB)."""
    return (sum(len(c.tokens) for c in comps) if req.logprobs is not None else 0) + (
        sum(len(choice.ids) for choice in chosen) if prompt_ranked(req) is not None else 0) + (
        sum(len(c.prompt_ids) + len(c.token_ids) for c in comps) if req.return_token_ids else 0)


def completion_json(comps: list[Completion], finals: list[Final], prompt_tokens: int) -> bytes:
    """The JSON body of a request's choices: each choice rendered by itself (a long scored prompt's in parts);
    call it through :func:`off_loop`. The same bytes as ``CompletionObject.dump_json`` of the whole (tested), but
    that each choice leaves out its own unset vLLM fields (stop_reason), not only those no choice has."""
    first = comps[0]
    body = first.chunk("", session=first.session(finals[0]))
    body.choices, body.usage = [], usage_of(finals, prompt_tokens)
    head, tail = body.dump_json().split(b'"choices":[]')  # a string's quotes are escaped: only the key matches
    parts: list[bytes | memoryview] = [head, b'"choices":[']
    for i, (comp, final) in enumerate(zip(comps, finals)):
        parts += [b"," if i else b"", *comp.choice_json(final)]
    return b"".join([*parts, b"]", tail])  # one copy (a bytes join of large parts lets go of the GIL)


async def collect(comp: Completion, run: Run, first: Any, since: float) -> Final:
    """A choice's events gathered into ``comp`` (the JSON body's path); its Final."""
    async for item in events(run, first, since):
        if isinstance(item, TokenEvent):
            comp.add(item)
        elif isinstance(item, str):
            comp.add_text(item)
        elif isinstance(item, PromptScores):
            await off_loop(len(item), comp.add_prompt, run.ids, item)
        else:
            return item
    raise AssertionError("a run's events end with its Final")  # pragma: no cover


async def open_runs(rt: Runtime, req: CompletionRequest, chosen: list[Choice], owner: str | None,
                    started: Callable[[Run], None]) -> list[tuple[Run, Any]]:
    """Start every choice's run and wait for the first one's first event, so that a refusal (a busy session, a
    full queue) is the response's status; on any, every run started is cancelled. The other choices' first events
    are read with the rest (None here): a stream begins as its first choice does, not once its last has begun
    (which waits for a place in the batch when n is larger than the places free)."""
    runs: list[Run] = []
    # refused before any starts: runs started and then cancelled hold their places until they end (a helper saw
    # other requests refused meanwhile)
    if len(chosen) > 1 and len(rt.runs) + len(chosen) > rt.most_runs:
        raise Overloaded("too many requests are waiting for this request's choices; retry shortly")
    shared: Shared | None = None
    try:
        for i, choice in enumerate(chosen):  # a prompt's n choices read it once (a session's request has one)
            if choice.sample == 0:
                several = i + 1 < len(chosen) and chosen[i + 1].sample == 1 and req.session_id is None
                shared = Shared() if several else None
            runs.append(launch(rt, req, choice, owner, shared))
            started(runs[-1])
        return list(zip(runs, [await first_item(runs[0])] + [None] * (len(runs) - 1)))
    except BaseException:
        for run in runs:
            run.cancel()
        raise


class Interleaved:
    """A request's choices' events as one stream of ``(index, event)``, each choice's in its order (the SSE
    path). One choice is read directly; several, each by a task of its own into one queue. :meth:`idle` says
    nothing more is in hand, so that what was read leaves in one write."""

    def __init__(self, opened: list[tuple[Run, Any]], since: float) -> None:
        self.runs = [run for run, _ in opened]
        self._streams = [events(run, first, since) for run, first in opened]
        self._queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    def idle(self) -> bool:
        if len(self.runs) == 1:  # every token of a stream asks
            return self.runs[0].events.empty()
        return self._queue.empty() and all(run.events.empty() for run in self.runs)

    async def _pump(self, i: int) -> None:
        try:
            async for item in self._streams[i]:
                self._queue.put_nowait((i, item, None))
        except Exception as err:
            self._queue.put_nowait((i, None, err))

    async def __aiter__(self) -> AsyncIterator[tuple[int, Any]]:
        if len(self._streams) == 1:
            async for item in self._streams[0]:
                yield 0, item
            return
        self._tasks = [asyncio.create_task(self._pump(i)) for i in range(len(self._streams))]
        try:
            ended = 0
            while ended < len(self._streams):
                i, item, err = await self._queue.get()
                if err is not None:
                    raise err
                ended += isinstance(item, Final)
                yield i, item
        finally:
            self.close()

    def close(self) -> None:
        """Stop reading (the client left, or a choice failed); the runs are the caller's to cancel."""
        for task in self._tasks:
            task.cancel()


@contextlib.asynccontextmanager
async def cancel_on_disconnect(receive: Callable[[], Awaitable[dict]],
                               on_disconnect: Callable[[], None] = lambda: None
                               ) -> AsyncIterator[Callable[[Run], None]]:
    """While the body of the block runs, a client that closes its connection cancels the run, so a request
    nobody waits for stops within a step (or commits nothing while its prompt is being read). Yields
    ``attach(run)``: a run attached after the client left (its prompt was tokenized meanwhile) is cancelled
    at once."""
    runs: list[Run] = []
    left = False

    def attach(run: Run) -> None:
        runs.append(run)
        if left:
            run.cancel()

    async def watch() -> None:
        nonlocal left
        while (await receive())["type"] != "http.disconnect":
            pass
        left = True
        on_disconnect()
        for run in runs:
            run.cancel()

    task = asyncio.create_task(watch())
    try:
        yield attach
    finally:
        task.cancel()

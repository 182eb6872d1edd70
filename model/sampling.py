"""Sampling parameters and the choice of the next token; the same for every serving path."""

from __future__ import annotations

import math
import random
import secrets
import struct
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from model import fused
from txlserve.errors import InvalidRequestError

MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily, as vLLM does
LOGIT_BIAS_MOST = 100.0  # OpenAI's range for a token's bias: -100 bans it, 100 all but forces it
LOGIT_BIAS_TOKENS = 1024  # biased tokens a request may name: each is an add on every step's row
STOP_TOKEN_IDS = 1024  # as many stop tokens
ALLOWED_TOKEN_IDS = 4096  # allowed tokens: a mask each step builds from them (a body-sized list stalled every stream)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI's completion knobs plus ``top_k`` (vLLM's meaning: 0 or -1 = off)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: also the top n alternatives
    # the prompt's text ends in white space: a word model's first generated word comes unspaced (it had a second
    # space, "The cat  sat", spaced from the prompt's last word as if the space were not there)
    after_space: bool = False
    # OpenAI's logit_bias as (token id, bias) pairs, added to the model's logits before sampling, -100 a ban
    # (logprobs stay the model's, as vLLM's default raw logprobs do)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # OpenAI's penalties on the tokens this request generated so far: a token's logit less frequency_penalty times
    # its count, and presence_penalty once it has come at all (vLLM's: the output's tokens, before temperature)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0  # vLLM's: tokens less likely than min_p times the likeliest (after temperature) are dropped
    # vLLM's (and Hugging Face's): every token of the prompt or generated so far has its logit divided by this when
    # positive, multiplied when not; a session's prompt is the request's text, not the whole history before it
    repetition_penalty: float = 1.0
    # vLLM's: a generated token among these ends the generation ("stop"); it is generated (the session holds it, as a
    # stop string's tokens) but its text is not given, as vLLM leaves it out
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False  # vLLM's: the stop string (or stop token's text) ends the text given
    # vLLM's: until this many tokens are generated nothing stops the generation: stop_token_ids cannot be drawn, and
    # stop strings are not matched (one that ends in a later token does, even if it began before: vLLM's V1 rule)
    min_tokens: int = 0
    # vLLM's: only these tokens may be drawn (empty: every token); logprobs stay the model's, as with logit_bias
    allowed_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
                                      param="max_tokens")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InvalidRequestError(f"temperature must be a number >= 0, got {t!r}", param="temperature")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {p!r}", param="top_p")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}",
                                      param="top_k")
        if self.seed is not None and (not _is_int(self.seed) or not -(1 << 63) <= self.seed < 1 << 63):
            raise InvalidRequestError(f"seed must be a 64-bit signed integer, got {self.seed!r}", param="seed")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        ids = tuple(self.stop_token_ids)  # a list once through JSON
        if len(ids) > STOP_TOKEN_IDS or any(not _is_int(t) or t < 0 for t in ids):
            raise InvalidRequestError(f"stop_token_ids must be at most {STOP_TOKEN_IDS} token ids",
                                      param="stop_token_ids")
        object.__setattr__(self, "stop_token_ids", ids)
        allowed = tuple(self.allowed_token_ids)  # a list once through JSON
        if len(allowed) > ALLOWED_TOKEN_IDS or any(not _is_int(t) or t < 0 for t in allowed):
            raise InvalidRequestError(f"allowed_token_ids must be at most {ALLOWED_TOKEN_IDS} token ids",
                                      param="allowed_token_ids")
        object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(allowed))))  # each once
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be an integer in [0, max_tokens {self.max_tokens}], got "
                                      f"{self.min_tokens!r}", param="min_tokens")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < math.inf:
            raise InvalidRequestError(f"repetition_penalty must be a number > 0 (1: none), got {r!r}",
                                      param="repetition_penalty")
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {m!r}", param="min_p")
        for name in ("frequency_penalty", "presence_penalty"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not -2 <= x <= 2:
                raise InvalidRequestError(f"{name} must be a number in [-2, 2], got {x!r}", param=name)
        bias = tuple((t, b) for t, b in self.logit_bias)  # pairs: a list of lists once through JSON
        if len(bias) > LOGIT_BIAS_TOKENS or any(not _is_int(t) or t < 0 for t, _ in bias):
            raise InvalidRequestError(f"logit_bias must map at most {LOGIT_BIAS_TOKENS} token ids to biases",
                                      param="logit_bias")
        for t, b in bias:
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -LOGIT_BIAS_MOST <= b <= LOGIT_BIAS_MOST:
                raise InvalidRequestError(f"logit_bias: the bias {b!r} of token {t} is not in [-100, 100]",
                                          param="logit_bias")
        seen: set[int] = set()
        for t, _ in bias:
            if t in seen:  # "65" and "065" as JSON keys
                raise InvalidRequestError(f"logit_bias names token {t} twice", param="logit_bias")
            seen.add(t)
        object.__setattr__(self, "logit_bias", bias)
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be a non-empty string or a list of non-empty strings", param="stop")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise InvalidRequestError("include_stop_str_in_output must be true or false",
                                      param="include_stop_str_in_output")
        if not isinstance(self.after_space, bool):
            raise InvalidRequestError(f"after_space must be true or false, got {self.after_space!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
                                      param="logprobs")

    def generator(self) -> random.Random:
        """A private RNG per request: results depend on the seed, never on other requests in the batch."""
        # modulo 2**64: random.Random seeds with an integer's absolute value, and -3 drew what 3 draws
        return random.Random(self.seed % (1 << 64) if self.seed is not None else secrets.randbits(63))


def sample_rows(logits: Tensor, params: Sequence[SamplingParams], rngs: Sequence[random.Random],
                generated: Sequence[Sequence[int]] | None = None, seen: Sequence[set[int]] | None = None
                ) -> list[int]:
    """One token per row of ``logits [rows, vocab]`` (float32, CPU), each row with its own parameters and
    generator; greedy at temperature 0. Inverse-CDF sampling with one uniform draw per row, whatever the row's
    parameters, so a seeded request draws the same tokens in any batch (tested): a row's token depends only on
    its logits, its parameters and its draw. Rows with plain temperature (the usual case) are drawn in one C
    call (``kernels/sample_rows.c``) where the kernels are built; rows with ``top_k`` or ``top_p``, and every row
    where they are not, by a fixed handful of batched torch ops. Sampling row by row had cost ~6 ms per step at
    batch 64 (five small ops a row, each handing the GIL back and forth with the server's event loop), and
    those torch ops ~85 us for one row, an eighth of a batch-1 step of the bundled model. ``generated``: each
    row's tokens so far, which its penalties count; ``seen``: the tokens its repetition penalty applies to."""
    rows, vocab = logits.shape
    u = [rng.random() for rng in rngs]  # [rows] in [0, 1): one draw per row, used or not
    plain = [r for r, p in enumerate(params) if _plain(p, vocab)]
    if not plain or not fused.available():
        return _torch_rows(logits, params, u, generated, seen)
    chosen = [0] * rows
    temps = torch.tensor([params[r].temperature for r in plain], dtype=torch.float64)  # [n]
    x = logits if len(plain) == rows else logits[plain]  # [n, vocab]
    drawn = fused.sample_rows(x.contiguous(), temps, torch.tensor([u[r] for r in plain], dtype=torch.float64),
                              GREEDY_BELOW)
    for r, token in zip(plain, drawn.tolist()):
        chosen[r] = token
    if len(plain) < rows:
        drawn_here = set(plain)
        rest = [r for r in range(rows) if r not in drawn_here]
        for r, token in zip(rest, _torch_rows(logits[rest], [params[r] for r in rest], [u[r] for r in rest],
                                              generated and [generated[r] for r in rest],
                                              seen and [seen[r] for r in rest])):
            chosen[r] = token
    return chosen


def _torch_rows(logits: Tensor, params: Sequence[SamplingParams], u: Sequence[float],
                generated: Sequence[Sequence[int]] | None = None, seen: Sequence[set[int]] | None = None) -> list[int]:
    """:func:`sample_rows` as torch ops, for rows of any parameters with their draws ``u`` (and tokens so far)."""
    rows, vocab = logits.shape
    held = [bool(p.min_tokens and p.stop_token_ids and generated is not None and len(generated[r]) < p.min_tokens)
            for r, p in enumerate(params)]  # stop tokens not yet allowed (min_tokens)
    biased = [r for r, p in enumerate(params) if p.logit_bias or _penalized(p) or held[r] or p.allowed_token_ids]
    if biased:
        logits = logits.clone()  # [rows, vocab]: the caller's scores (its logprobs) stay the model's
        for r in biased:
            p = params[r]
            if p.allowed_token_ids:  # first, as vLLM masks them: whatever comes after changes only these
                allowed = torch.tensor([t for t in p.allowed_token_ids if t < vocab], dtype=torch.long)  # [n]
                kept = logits[r, allowed]  # [n]
                logits[r] = float("-inf")
                logits[r, allowed] = kept
            if p.logit_bias:
                ids, values = zip(*p.logit_bias)
                logits[r, list(ids)] += torch.tensor(values, dtype=logits.dtype)
                banned = [t for t, b in p.logit_bias if b <= -LOGIT_BIAS_MOST]
                logits[r, banned] = float("-inf")  # -100 bans, as OpenAI says, whatever penalties come after
            if held[r]:  # as vLLM's min_tokens bans them
                logits[r, [t for t in p.stop_token_ids if t < vocab]] = float("-inf")
            if p.repetition_penalty != 1 and seen and seen[r]:  # after the bias, then the others: vLLM's order
                at = torch.tensor(sorted(t for t in seen[r] if t < vocab))  # [n]
                row = logits[r, at]  # [n]
                logits[r, at] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            if (p.frequency_penalty or p.presence_penalty) and generated and generated[r]:
                counts = torch.bincount(torch.tensor(generated[r]), minlength=vocab)[:vocab].to(logits.dtype)  # [vocab]
                logits[r] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    temps = [p.temperature for p in params]
    greedy = [t < GREEDY_BELOW for t in temps]  # dividing by ~0 would overflow to inf/NaN
    x = logits / torch.tensor([1.0 if g else t for g, t in zip(greedy, temps)])[:, None]  # [rows, vocab]
    floored = [r for r, p in enumerate(params) if p.min_p > 0]
    if floored:  # before top_k and top_p, after temperature, as vLLM applies it
        at = torch.tensor(floored)
        probs = torch.softmax(x[at], -1)  # [n, vocab]
        floor = torch.tensor([params[r].min_p for r in floored])[:, None] * probs.amax(-1, keepdim=True)  # [n, 1]
        x[at] = x[at].masked_fill(probs < floor, float("-inf"))  # the likeliest always stays
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(ks) < vocab:
        top = torch.topk(x, max(k for k in ks if k < vocab), dim=-1).values  # [rows, k_max], descending
        kth = top.gather(1, torch.tensor([min(k, top.shape[1]) - 1 for k in ks])[:, None])  # [rows, 1]
        kth[torch.tensor([k == vocab for k in ks])] = float("-inf")  # rows without top_k keep every token
        x = x.masked_fill(x < kth, float("-inf"))
    nucleus = [r for r, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        at = torch.tensor(nucleus)
        probs, order = torch.sort(torch.softmax(x[at], -1), descending=True, stable=True)  # [n, vocab]
        drop = probs.cumsum(-1) - probs >= torch.tensor([params[r].top_p for r in nucleus])[:, None]
        drop[:, 0] = False  # the most likely token always stays: a top_p below float32's range rounds to 0
        x[at] = x[at].masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    chosen = _inverse_cdf(x, torch.tensor(list(u), dtype=torch.float64))  # [rows]
    if any(greedy):
        chosen = torch.where(torch.tensor(greedy), torch.argmax(logits, -1), chosen)
    return chosen.tolist()


def _plain(params: SamplingParams, vocab: int) -> bool:
    """Temperature alone: no ``top_k`` below the vocabulary, ``top_p``, ``min_p``, bias, penalty, stop tokens
    held back by ``min_tokens`` or ``allowed_token_ids``."""
    return (not 0 < params.top_k < vocab and params.top_p >= 1.0 and params.min_p == 0 and not params.logit_bias
            and not _penalized(params) and not (params.min_tokens and params.stop_token_ids)
            and not params.allowed_token_ids)


def _penalized(params: SamplingParams) -> bool:
    return params.frequency_penalty != 0 or params.presence_penalty != 0 or params.repetition_penalty != 1


def _inverse_cdf(x: Tensor, u: Tensor) -> Tensor:
    """Each row's token where the CDF of ``softmax(x [rows, vocab])`` passes ``u [rows]`` (float64, in [0, 1))
    of its total: [rows] int64. The host's torch ops and the device's draw share it."""
    cdf = torch.softmax(x, -1).cumsum(-1)  # [rows, vocab]
    total = cdf[:, -1:]  # [rows, 1]
    below = torch.minimum((u[:, None] * total).float(), torch.nextafter(total, torch.zeros_like(total)))  # < total
    return torch.searchsorted(cdf, below, right=True)[:, 0].clamp_(max=x.shape[-1] - 1)  # [rows]: cdf passes there


def drawn_on_device(params: SamplingParams, vocab: int) -> bool:
    """Whether a request's tokens can be drawn by :func:`sample_on_device`: temperature alone (:func:`_plain`)
    and no logprobs (which need the scores on the host)."""
    return _plain(params, vocab) and params.logprobs is None


def sample_on_device(logits: Tensor, temps: Tensor, u: Tensor) -> Tensor:
    """One token per row of ``logits [rows, vocab]`` where the scores lie (a GPU's decode batch, so that the next
    step can be queued before this one's tokens reach the host), from each row's temperature ``temps [rows]``
    and draw ``u [rows]`` (float64): the inverse CDF of :func:`sample_rows`'s torch ops for rows without
    ``top_k`` or ``top_p``, so a seeded request draws the same tokens in any batch here too. Fixed shapes and no
    host reads: it can be captured in a CUDA graph."""
    greedy = temps < GREEDY_BELOW  # [rows]
    x = logits.float() / torch.where(greedy, torch.ones_like(temps), temps).float()[:, None]  # [rows, vocab]
    return torch.where(greedy, logits.argmax(-1), _inverse_cdf(x, u))  # [rows] int64


def token_logprobs(logits: Tensor, token: int, top_n: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log-probability under the model and the ``top_n`` most likely tokens, plus the chosen
    one when it is not among them: OpenAI's rule ("always the logprob of the sampled token, so up to logprobs+1
    elements"), which vLLM follows too. Per generated token, so its own few ops: through
    :func:`rows_logprobs`'s arrays it took 36 us a token, not 4."""
    logp = torch.log_softmax(logits.float(), -1)  # [vocab]
    top = torch.topk(logp, top_n) if top_n > 0 else None
    alts = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))
    chosen = float(logp[token])
    if all(t != token for t, _ in alts):
        alts.append((token, chosen))
    return chosen, alts


def after_space(prompt: str) -> bool:
    """Whether a prompt's text ends in its own space (a newline is a word model's token): its continuation's first
    word then comes unspaced (:attr:`SamplingParams.after_space`)."""
    return prompt[-1:].isspace() and prompt[-1:] != "\n"


@dataclass
class ScoredTokens:
    """Scored tokens (``echo`` with ``logprobs``, an append asking for them) as flat arrays: each token's
    log-probability and its alternatives, ``counts[i]`` of them (-1: a first token with nothing before it). As
    Python objects a 47,000-token prompt at 20 alternatives was two million tuples and lists: the garbage
    collector's full passes over them held the engine's steps (every stream's) for up to 45 ms each, and as JSON
    they crossed to the API server in 1.1 s. ``ranks`` (vLLM's ``prompt_logprobs``), only when asked for: each
    token's rank in the vocabulary, the number of tokens at least as likely (0 for a first token): a count over
    the whole vocabulary for every token (+14% on a word model's scoring: :func:`vocabulary_ranks`)."""

    counts: array = field(default_factory=lambda: array("i"))  # [n]
    logprobs: array = field(default_factory=lambda: array("d"))  # [n]
    ids: array = field(default_factory=lambda: array("i"))  # [sum of counts >= 0]
    values: array = field(default_factory=lambda: array("d"))  # [sum of counts >= 0]
    ranks: array = field(default_factory=lambda: array("i"))  # [n] when asked for, else []

    def __len__(self) -> int:
        return len(self.counts)

    def extend(self, other: ScoredTokens) -> None:
        for name in ("counts", "logprobs", "ids", "values", "ranks"):
            getattr(self, name).extend(getattr(other, name))

    def known(self) -> tuple[int, float]:
        """How many tokens have a log-probability (one had something before it), and their sum."""
        lps = [lp for count, lp in zip(self.counts, self.logprobs) if count >= 0]
        return len(lps), sum(lps)

    def entries(self) -> Iterator[tuple[float | None, list[tuple[int, float]]]]:
        """Each token's ``(logprob, [(id, logprob), ...])``, made as it is read; ``(None, [])`` for a first one."""
        at = 0
        for count, lp in zip(self.counts, self.logprobs):
            if count < 0:
                yield None, []
                continue
            yield lp, list(zip(self.ids[at:at + count], self.values[at:at + count]))
            at += count

    @classmethod
    def of(cls, entries: Iterable[tuple[float | None, list[tuple[int, float]]]],
           ranks: Iterable[int] | None = None) -> ScoredTokens:
        out = cls()
        for lp, alts in entries:
            out.counts.append(-1 if lp is None else len(alts))
            out.logprobs.append(0.0 if lp is None else lp)
            out.ids.extend(t for t, _ in alts)
            out.values.extend(v for _, v in alts)
        out.ranks.extend(ranks or ())
        return out

    def to_bytes(self) -> bytes:
        return struct.pack("<II", len(self), len(self.ranks)) + b"".join(
            getattr(self, n).tobytes() for n in ("counts", "logprobs", "ranks", "ids", "values"))

    @classmethod
    def from_bytes(cls, blob: bytes) -> ScoredTokens:
        n, ranked = struct.unpack_from("<II", blob)
        out, at = cls(), 8
        for arr, size in ((out.counts, n), (out.logprobs, n), (out.ranks, ranked)):
            arr.frombytes(blob[at:at + size * arr.itemsize])
            at += size * arr.itemsize
        m = (len(blob) - at) // (out.ids.itemsize + out.values.itemsize)
        out.ids.frombytes(blob[at:at + m * out.ids.itemsize])
        out.values.frombytes(blob[at + m * out.ids.itemsize:])
        return out


def vocabulary_ranks(logp: Tensor, chosen: Tensor) -> array:
    """Each row's rank of its ``chosen [rows, 1]`` value in ``logp [rows, vocab]``: the values at least as large
    (vLLM's count). On a CPU a megabyte of comparisons at a time, which stays in the cache, summed in int32: over
    a word model's whole [256, 267,735] at once (and int64's sum) it took 296 ms, in parts 30-50 ms."""
    step = len(logp) if logp.is_cuda else max(1, (1 << 20) // logp.size(1))
    return array("i", torch.cat([(logp[i:i + step] >= chosen[i:i + step]).sum(1, dtype=torch.int32)  # [step]
                                 for i in range(0, len(logp), step)]).tolist())


def rows_logprobs(logits: Tensor, tokens: list[int], top_n: int, ranks: bool = False) -> ScoredTokens:
    """:func:`token_logprobs` for each row of ``logits [rows, vocab]`` and its token, in one pass and into
    arrays: a scored prompt's rows one at a time cost ~11 us each in torch's dispatch, and made Python objects.
    ``ranks``: each token's rank too, vLLM's (the tokens at least as likely, itself among them)."""
    logp = torch.log_softmax(logits.float(), -1)  # [rows, vocab]
    token = torch.tensor(tokens, device=logp.device)[:, None]  # [rows, 1]
    chosen = logp.gather(1, token)  # [rows, 1]
    rank = vocabulary_ranks(logp, chosen) if ranks else array("i")  # [rows]
    top = torch.topk(logp, top_n) if top_n > 0 else None
    ids = token[:, :0] if top is None else top.indices  # [rows, top_n]
    values = chosen[:, :0] if top is None else top.values  # [rows, top_n]
    missing = ~(ids == token).any(1)  # [rows]: the chosen token is not among the top ones, so it is added
    keep = torch.cat([torch.ones_like(ids, dtype=torch.bool), missing[:, None]], 1)  # [rows, top_n + 1]
    return ScoredTokens(array("i", (missing.int() + top_n).tolist()), array("d", chosen[:, 0].double().tolist()),
                        array("i", torch.cat([ids, token], 1)[keep].tolist()),
                        array("d", torch.cat([values, chosen], 1)[keep].double().tolist()), rank)

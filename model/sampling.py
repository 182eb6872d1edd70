"""Sampling parameters and the choice of the next token; the same for every serving path."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

import torch
from torch import Tensor

from txlserve.errors import InvalidRequestError

MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily, as vLLM does


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
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}", param="seed")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be a non-empty string or a list of non-empty strings", param="stop")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
                                      param="logprobs")

    def generator(self) -> torch.Generator:
        """A private RNG per request: results depend on the seed, never on other requests in the batch."""
        seed = self.seed if self.seed is not None else secrets.randbits(63)
        return torch.Generator().manual_seed(seed % (2**63))


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick a token from ``logits [vocab]`` (float32, CPU): greedy at temperature 0."""
    if params.temperature < GREEDY_BELOW:  # dividing by ~0 would overflow to inf/NaN
        return int(torch.argmax(logits))
    x = logits / params.temperature  # [vocab]
    if params.top_k > 0 and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        probs, order = torch.sort(torch.softmax(x, -1), descending=True)  # [vocab]
        drop = probs.cumsum(-1) - probs >= params.top_p  # keep the smallest prefix reaching top_p
        drop[0] = False  # the most likely token always stays: a top_p below float32's range rounds to 0
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(torch.softmax(x, -1), 1, generator=generator))


def token_logprobs(logits: Tensor, token: int, top_n: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log-probability under the model and the ``top_n`` most likely tokens."""
    logp = torch.log_softmax(logits.float(), -1)  # [vocab]
    top = torch.topk(logp, top_n) if top_n > 0 else None
    alts = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))
    return float(logp[token]), alts

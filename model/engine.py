"""The inference engine: a checkpoint, its decoder, and the session-state and generation API.

The engine does no I/O: a session's state leaves it as plain tensors
(``export_state``) and comes back through ``import_state``, which refuses a state
built by another model or with other ``mem_len``/``clamp_len`` settings.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from model import fused
from model.checkpoint import Checkpoint, load_checkpoint
from model.decode import Decoder, DecodeState, check_fits, default_prefill_chunk
from model.sampling import SamplingParams, ScoredTokens, rows_logprobs, sample_rows, token_logprobs
from model.streaming import TextStreamer
from model.tokenizer import START, ByteTokenizer, Tokenizer, tokenizer_id
from txlserve.errors import ConfigError, InvalidRequestError, SessionIncompatible, StateIncompatible


@dataclass
class TokenEvent:
    token: int
    text: str  # text released by this token (may be empty while bytes are held back)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | None while generating
    prev: int | None = None  # on a generation's first token: the token before it, where known (a word's spacing)
    stop_reason: int | str | None = None  # vLLM's: the stop token or stop string that ended the generation


@dataclass
class Generation:
    """One request's sampling, stop strings and text assembly; every serving loop drives one per request."""

    params: SamplingParams
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)
    prev: int | None = None  # the token before the first generated one, when known (a word's spacing needs it)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt: Iterable[int] = ()  # the request's prompt: its tokens are repetition_penalty's too

    def __post_init__(self) -> None:
        self.rng = self.params.generator()
        self.streamer = TextStreamer(self.params.stop)
        # the tokens repetition_penalty applies to, kept as they come (a prompt is read into it once)
        self.seen: set[int] = set(self.prompt) if self.params.repetition_penalty != 1 else set()
        if self.params.after_space:  # the text so far ends in its own space: the first word comes as a text's first
            self.prev = START

    @staticmethod
    def choose(gens: Sequence[Generation], logits: Tensor) -> list[int]:
        """The next token of each generation, row ``r`` of ``logits [rows, vocab]`` for ``gens[r]``, sampled
        together; record each with :meth:`accept`."""
        return sample_rows(logits.float().cpu(), [g.params for g in gens], [g.rng for g in gens],
                           [g.tokens for g in gens], [g.seen for g in gens])

    def on_logits(self, logits: Tensor) -> TokenEvent:
        """Choose the next token from ``logits [vocab]`` and say what text it releases."""
        return self.accept(Generation.choose([self], logits[None])[0], logits)

    def accept(self, token: int, logits: Tensor | None, row: int | None = None) -> TokenEvent:
        """Record ``token``, chosen from ``logits [vocab]`` (or row ``row`` of ``logits [rows, vocab]``: a batch's
        scores are indexed only where logprobs are asked for, 0.8 us a row saved on every step otherwise), and say
        what text it releases."""
        p = self.params
        stops = len(self.tokens) >= p.min_tokens  # vLLM's min_tokens: that many came before, so this may end it
        stop_token = stops and token in p.stop_token_ids
        # a stop token's text is given only with include_stop_str_in_output; what was held before it, always
        data = self.tokenizer.token_bytes(token, self.prev)
        text = self.streamer.push(data, stops) if not stop_token or p.include_stop_str_in_output else ""
        if stop_token:
            text += self.streamer.flush()
        if p.include_stop_str_in_output and self.streamer.stopped_by is not None:
            text += self.streamer.stopped_by  # the stop string, cut from what push released (vLLM keeps it)
        stopped = stop_token or self.streamer.stopped_by is not None
        event = TokenEvent(token, text)
        if not self.tokens:  # a server's offsets space the first word as this did
            event.prev = self.prev
        self.tokens.append(token)
        self.prev = token
        if p.repetition_penalty != 1:
            self.seen.add(token)
        if self.params.logprobs is not None:
            scores = logits if row is None else logits[row]  # [vocab]
            event.logprob, event.top_logprobs = token_logprobs(scores.float().cpu(), token, self.params.logprobs)
        if stopped:
            self.finish_reason = "stop"
            event.stop_reason = token if stop_token else self.streamer.stopped_by
        elif len(self.tokens) >= self.params.max_tokens:
            self.finish_reason = "length"
            event.text += self.streamer.flush()
        event.finish_reason = self.finish_reason
        return event

    def release(self) -> str:
        """The text still held back (the start of a possible stop string, an incomplete character) when the
        request ends before its generation does (cancelled): its tokens are in the session, so the client gets
        their text too, or its copy of the document and the session's would differ."""
        return self.streamer.flush()


@dataclass
class Score:
    tokens: int  # tokens that had a prediction (the first token of an empty state has none)
    logprob: float  # natural log-likelihood of those tokens

    @property
    def bpc(self) -> float:
        """Bits per token: bits per character for a byte model."""
        return -self.logprob / math.log(2) / self.tokens if self.tokens else float("nan")

    @property
    def perplexity(self) -> float:
        """exp of the mean negative log-likelihood: a word model's measure."""
        if not self.tokens:
            return float("nan")
        nll = -self.logprob / self.tokens
        return math.exp(nll) if nll < 709 else float("inf")  # math.exp raises past ~709.78


def readable_ids(ids: list[int], vocab_size: int, tokenizer_size: int) -> list[int]:
    """``ids`` if the model can read them all. A checkpoint whose tokenizer names more symbols than the model has
    outputs (made by hand: training and import write them equal) indexed past its embedding, a traceback deep in
    the first forward pass; only such a checkpoint pays for the scan."""
    if tokenizer_size > vocab_size and ids and max(ids) >= vocab_size:
        bad = next(t for t in ids if t >= vocab_size)
        raise InvalidRequestError(f"token {bad} is past this model's {vocab_size:,} outputs (its checkpoint's "
                                  f"tokenizer names {tokenizer_size:,} symbols)")
    return ids


class Engine:
    """Loads once; feeds text into session states and generates from them."""

    def __init__(self, ckpt: Checkpoint, *, mem_len: int | None = None, clamp_len: int | None = None,
                 prefill_chunk: int | None = None, enforce_eager: bool = False,
                 prefill_products: str = "auto") -> None:
        self.ckpt, self.model, self.tokenizer, self.config = ckpt, ckpt.model, ckpt.tokenizer, ckpt.config
        self.mem_len = ckpt.config.mem_len if mem_len is None else mem_len
        self.clamp_len = ckpt.config.clamp_len if clamp_len is None else clamp_len
        if self.mem_len < 1:  # trained without a memory (a vanilla Transformer's segments): decoding keeps one
            raise ConfigError(f"decoding needs a memory, and this model's mem_len is {self.mem_len}: give --mem-len "
                              f"(its training segment, {ckpt.config.tgt_len}, say)", param="mem_len")
        weight = next(ckpt.model.parameters())  # the decoder's device and dtype are its weights'
        self.prefill_chunk = prefill_chunk or default_prefill_chunk(self.mem_len, weight.device)
        check_fits(ckpt.config, self.mem_len, weight.device, weight.dtype, self.prefill_chunk)  # before it allocates
        self.decoder = Decoder(ckpt.model, mem_len=self.mem_len, clamp_len=self.clamp_len,
                               traced=False if enforce_eager else None, fused=False if enforce_eager else None,
                               cuda_graphs=False if enforce_eager else None)
        if prefill_products not in ("auto", "kernel", "torch"):
            raise ConfigError(f"prefill_products must be auto, kernel or torch, not {prefill_products!r}")
        if prefill_products == "auto":
            self.decoder.tune_products(self.prefill_chunk)
            self.decoder.tune_step_products()
        else:
            self.decoder.chunk_kernels = prefill_products == "kernel"
        # Tokens are drawn on the CPU by a C kernel on every device, and building it takes seconds: build (or
        # load) it with the model, not inside the first request (a CUDA server's first request took 9 s).
        fused.available()
        # what a stored state must match: the weights, the attention window and the precision it was computed in
        # (a bf16 server's memory continued by an fp32 one moved its scores by 1e-2: it is rebuilt instead); fp32
        # is unnamed, as before precisions were, so that the sessions stored then are imported as they were
        computed = "" if weight.dtype == torch.float32 else f":{str(weight.dtype).removeprefix('torch.')}"
        self.fingerprint = f"{ckpt.fingerprint}:m{self.mem_len}:c{self.clamp_len}{computed}"
        self.tokenizer_id = tokenizer_id(self.tokenizer)
        # Every layer's query sees itself and exactly mem_len tokens before it, so the state after token t
        # (mems at every layer, the next-token scores) depends on tokens t - n_layer * mem_len .. t alone.
        self.window_len = self.config.n_layer * self.mem_len + 1

    @classmethod
    def from_checkpoint(cls, path: str | Path, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype | None = None, **kw: int | bool | str | None) -> Engine:
        return cls(load_checkpoint(path, device=device, dtype=dtype), **kw)

    @property
    def device(self) -> torch.device:
        return self.decoder.device

    def new_state(self, batch: int = 1) -> DecodeState:
        return self.decoder.empty(batch)

    def copy_state(self, state: DecodeState) -> DecodeState:
        """A batch-1 session of its own holding what ``state`` (batch 1) holds, laid out as a new one: a prompt
        read once serves each of a request's ``n`` choices (the server's scheduler)."""
        copy = self.decoder.empty(1, zeroed=False)
        copy.copy_row(0, state)
        return copy

    @property
    def row_bytes(self) -> int:
        """Device bytes one session's state takes, counted on shapes alone (a state made to be measured took
        them for a moment: 13 GB at mem_len 1,048,576 on the bundled model, which ran a 24 GB host out)."""
        return self.decoder.empty(1, meta=True).row_bytes

    def encode(self, text: str | bytes) -> list[int]:
        return readable_ids(self.tokenizer.encode(text), self.config.vocab_size, self.tokenizer.vocab_size)

    def feed(self, state: DecodeState, tokens: list[int]) -> Tensor:
        """Prefill one session (``state.batch == 1``) with ``tokens``; the last layer's outputs [n, d_model]."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, n]
        return self.decoder.prefill(state, ids, chunk_size=self.prefill_chunk)[0]

    def logits(self, h: Tensor) -> Tensor:
        """Next-token scores [..., vocab] for outputs of :meth:`feed` (dense: for tests and short spans)."""
        return self.decoder.logits(h)

    # -- session state <-> plain tensors -------------------------------------------------------
    def renumber(self, state: DecodeState, tokens_seen: int) -> None:
        """Make a batch-1 ``state`` read as if it had seen ``tokens_seen`` tokens. Attention depends only on
        distances, so a state rebuilt from a session's last tokens equals the original once its rings sit
        at the original positions (slot = position % mem_len): a rotation of each ring."""
        seen = int(state.seen[0])
        if tokens_seen < seen:
            raise StateIncompatible(f"tokens_seen {tokens_seen} is less than the {seen} tokens the state holds")
        shift = (tokens_seen - seen) % self.mem_len if self.mem_len else 0
        if shift:
            state.hid.copy_(state.hid.roll(shift, dims=2))  # [n_layer, 1, mem_len, d_model]
            state.k.copy_(state.k.roll(shift, dims=3))  # [n_layer, 1, H, mem_len, Dh]
            state.v.copy_(state.v.roll(shift, dims=3))
        state.seen[0] = tokens_seen

    def check_window(self, window: list[int], tokens_seen: int, *, every_id: bool = False) -> list[int]:
        """The part of a session's token window this model reads (its last ``window_len``), or why it cannot.
        ``every_id``: the ids it does not read are checked too (an import keeps a window longer than it reads,
        for a model that reads more; a stored session's older ids are that model's business)."""
        if len(window) > tokens_seen:
            raise InvalidRequestError(f"the window holds {len(window)} tokens, more than tokens_seen "
                                      f"({tokens_seen})", param="tokens_seen")
        read = window[-self.window_len:]  # older tokens cannot reach this model's state: never read
        checked = window if every_id else read
        if checked and not 0 <= min(checked) <= max(checked) < self.config.vocab_size:
            raise InvalidRequestError(f"the window holds token ids outside 0..{self.config.vocab_size - 1}",
                                      param="window")
        window = read
        if len(window) < min(tokens_seen, self.mem_len):  # the ring would hold empty slots as real positions
            why = "every token it has seen" if tokens_seen < self.mem_len else "a full memory of this model"
            raise SessionIncompatible(f"the session's window holds {len(window)} tokens; rebuilding it needs "
                                      f"{min(tokens_seen, self.mem_len)} ({why}): it cannot be rebuilt here")
        return window

    def rebuild(self, window: list[int], tokens_seen: int) -> DecodeState:
        """A session's state from its last ``window_len`` tokens (all of them if it has fewer): equal to the
        state it had, within the split-invariance tolerance, when the window is complete."""
        window = self.check_window(window, tokens_seen)
        state = self.new_state(1)
        if window:
            self.feed(state, window)
        self.renumber(state, tokens_seen)
        return state

    def _ring_slots(self, seen: int) -> Tensor:
        m = min(seen, self.mem_len)
        return torch.arange(seen - m, seen, device=self.device).remainder(self.mem_len)  # [m]

    def persisted_nbytes(self, dtype: torch.dtype | None = None) -> int:
        """The size of what :meth:`export_state` returns for a full memory (mems in ``dtype``)."""
        cfg = self.config
        item = (dtype or self.decoder.dtype).itemsize
        return cfg.n_layer * self.mem_len * cfg.d_model * item + cfg.vocab_size * 4

    def export_state(self, state: DecodeState, row: int = 0, *, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """What a session persists: ``mems [n_layer, m, d_model]`` (oldest first) and ``last_logits [vocab]``.
        The keys and values are not: they are recomputed from mems on import (hot sessions keep the whole
        state in the server, see ``server/hot_states.py``)."""
        slots = self._ring_slots(int(state.seen[row]))
        cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
        # index_select, not hid[:, row, slots]: a third of the advanced index's time (a commit's every request)
        return {"mems": cast(state.hid[:, row].index_select(1, slots)).contiguous(),  # [n_layer, m, d_model]
                "last_logits": state.last_logits[row].float().clone()}  # [vocab], not a view of the step's logits

    def import_state(self, tensors: dict[str, Tensor], *, tokens_seen: int, fingerprint: str) -> DecodeState:
        """Rebuild a session's state (batch 1) from what it persisted, projecting its keys and values again."""
        if fingerprint != self.fingerprint:
            raise StateIncompatible("this session was built by another model or with another mem_len/clamp_len "
                                    f"(state {fingerprint!r}, server {self.fingerprint!r})")
        cfg, m = self.config, min(tokens_seen, self.mem_len)
        mems, last = tensors.get("mems"), tensors.get("last_logits")
        if mems is None or tuple(mems.shape) != (cfg.n_layer, m, cfg.d_model):
            got = None if mems is None else tuple(mems.shape)
            raise StateIncompatible(f"session mems have shape {got}, this model needs "
                                    f"{(cfg.n_layer, m, cfg.d_model)} (n_layer, min(tokens_seen, mem_len), d_model)")
        if last is None or tuple(last.shape) != (cfg.vocab_size,):
            raise StateIncompatible(f"session last_logits must have shape ({cfg.vocab_size},)")
        state = self.new_state(1)
        slots = self._ring_slots(tokens_seen)
        hid = mems.to(self.device, self.decoder.dtype)  # [n_layer, m, d_model]
        state.hid[:, 0, slots] = hid
        k, v = self.decoder.project_kv(hid)  # [n_layer, H, m, Dh] each
        state.k[:, 0, :, slots] = k.to(self.device, self.decoder.dtype)
        state.v[:, 0, :, slots] = v.to(self.device, self.decoder.dtype)
        state.seen[0] = tokens_seen
        state.last_logits[0] = last.to(self.device, torch.float32)
        return state

    # -- generation and scoring ----------------------------------------------------------------
    def generate(self, state: DecodeState, prompt: str | bytes | list[int],
                 params: SamplingParams) -> Iterator[TokenEvent]:
        """Continue one session: feed ``prompt``, then yield one event per generated token.

        Every yielded token is fed into ``state`` before the next is chosen, and the last one
        when the iterator ends or is closed early, so the state always holds prompt plus every
        token the caller has seen."""
        ids = prompt if isinstance(prompt, list) else self.encode(prompt)
        if not ids and int(state.seen[0]) == 0:
            raise InvalidRequestError("nothing to continue from: the prompt is empty and the session has no "
                                      "memory yet", param="prompt")
        if ids:
            self.feed(state, ids)
        gen = Generation(params, self.tokenizer, ids[-1] if ids else None, prompt=ids)
        while gen.finish_reason is None:
            event = gen.on_logits(state.last_logits[0])
            try:
                yield event
            finally:
                self.decoder.step(state, torch.tensor([[event.token]], device=self.device))

    @torch.no_grad()
    def token_scores(self, state: DecodeState, ids: list[int], top_n: int, rows: int = 256,
                     ranks: bool = False) -> ScoredTokens:
        """Feed ``ids`` and score each one as OpenAI's ``echo`` with ``logprobs`` does: its log-probability
        given everything before it and the ``top_n`` likeliest tokens there; none for a first token with nothing
        before it. Scores are computed ``rows`` positions at a time (a word model's table is wide). ``ranks``:
        each token's rank in the vocabulary too (vLLM's ``prompt_logprobs``)."""
        if not ids:
            return ScoredTokens()
        prev = state.last_logits[0].clone() if int(state.seen[0]) > 0 else None  # [vocab]
        h = self.feed(state, ids)  # [n, d_model]
        out = (ScoredTokens.of([(None, [])], [0] if ranks else None) if prev is None
               else rows_logprobs(prev[None], ids[:1], top_n, ranks))
        for lo in range(0, len(ids) - 1, rows):
            logits = self.logits(h[lo:lo + rows][: len(ids) - 1 - lo])  # [r, vocab]: predicts ids[lo+1 ..]
            out.extend(rows_logprobs(logits, ids[lo + 1:lo + 1 + len(logits)], top_n, ranks))
        return out

    @torch.no_grad()
    def score(self, state: DecodeState, text: str | bytes | list[int]) -> Score:
        """Log-likelihood of ``text`` continuing ``state``; the state advances past it."""
        ids = text if isinstance(text, list) else self.encode(text)
        if not ids:
            return Score(0, 0.0)
        had_context = int(state.seen[0]) > 0
        prev = state.last_logits[0].clone()
        h = self.feed(state, ids)  # [n, d_model]
        targets = torch.tensor(ids, device=h.device)  # [n]
        logp = self.model.crit.target_logprob(h[:-1], targets[1:]).sum() if len(ids) > 1 else 0.0
        if had_context:
            logp = logp + torch.log_softmax(prev.float(), -1)[ids[0]]
        return Score(len(ids) if had_context else len(ids) - 1, float(logp))

"""Request and response models of the HTTP API: OpenAI's completions plus the sessions extension."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic_core import PydanticCustomError

from model.sampling import ALLOWED_TOKEN_IDS, STOP_TOKEN_IDS

# Request bodies: no unknown fields, no coercion, and no NaN or infinity (JSON parsers accept ``NaN``; it failed
# the bounds checks with a message about the bounds)
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, use_attribute_docstrings=True)
DESCRIBED = ConfigDict(use_attribute_docstrings=True)  # a field's docstring is its description in /docs


METADATA_KEYS = 16  # OpenAI's bound on an object's metadata


def _utf8_text(metadata: dict[str, str | None] | None) -> dict[str, str | None] | None:
    """JSON admits lone surrogates (``"\\ud800"``), which no response could carry back: refuse them here."""
    for text in (metadata or {}).items():
        for part in text:
            try:
                part is None or part.encode()
            except UnicodeEncodeError:
                raise ValueError("keys and values must be valid Unicode text (no lone surrogates)") from None
    return metadata


def _named_keys(metadata: dict[str, str | None] | None) -> dict[str, str | None] | None:
    """An empty key could be set, and never told apart from none in a form; one an older server stored (or an
    import brought) can still be removed, with a null."""
    if metadata and metadata.get("") is not None:
        raise ValueError("a key is empty: keys are 1 or more characters")
    return metadata


Metadata = Annotated[dict[str, str] | None, Field(default=None, max_length=METADATA_KEYS),
                     AfterValidator(_utf8_text), AfterValidator(_named_keys)]
# what an export holds: a session's metadata as any version of the server let it be written (an empty key too)
ExportedMetadata = Annotated[dict[str, str] | None, Field(default=None, max_length=METADATA_KEYS),
                             AfterValidator(_utf8_text)]


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    """A last chunk, before data: [DONE], with the request's usage."""
    continuous_usage_stats: bool = False
    """vLLM's: with include_usage, every chunk carries the usage so far."""


class CompletionRequest(BaseModel):
    """OpenAI's legacy completions body; ``top_k`` and ``session_id`` are txlserve extensions. Each field's
    docstring is its description in /docs and /openapi.json."""

    model_config = STRICT
    model: str
    """The served model's name, as GET /v1/models lists it."""
    prompt: str | list[int] | list[str] | list[list[int]] = ""
    """Text, token ids, or a list of either (a batch: a choice for each prompt, times n); with session_id, the text
    that continues the session."""
    max_tokens: int | None = Field(default=16)
    """Tokens to generate, at most the server's --max-tokens-limit; 0 with echo or prompt_logprobs scores the prompt
    alone."""
    temperature: float | None = Field(default=1.0, ge=0.0, le=2.0)
    """0 draws the likeliest token; higher draws more freely."""
    top_p: float | None = Field(default=1.0, gt=0.0, le=1.0)
    """Draw from the likeliest tokens whose probabilities add up to this (1: every token)."""
    top_k: int | None = Field(default=0, ge=-1)
    """Draw from the k likeliest tokens (0 or -1: every token)."""
    n: int | None = 1
    """Samples of each prompt, sample j drawn from seed + j; a prompt's samples read it once. One with session_id."""
    stream: bool | None = False
    """Server-sent events: a chunk as text comes, then data: [DONE]."""
    stream_options: StreamOptions | None = None
    """include_usage: a last chunk with the usage; continuous_usage_stats (vLLM's): the usage so far on every chunk."""
    stop: str | list[str] | None = None
    """Strings that end the text (left out of it), at most the server's --max-stop."""
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 63)
    """The same seed draws the same text (a 64-bit signed integer, vLLM's range)."""
    logprobs: int | None = Field(default=None, ge=0, le=20)
    """Each token's log-probability and its N likeliest alternatives (0-20)."""
    echo: bool | None = False
    """The prompt comes back before the text (with logprobs, scored too)."""
    user: str | None = Field(default=None, max_length=256)
    """Your end user's id: taken, as OpenAI takes it, and not used."""
    session_id: str | None = Field(default=None, min_length=1, max_length=128)
    """txlserve's: continue this session (POST /v1/sessions); the prompt and the generated text join its memory."""
    best_of: int | None = None
    """Only at n's value: every sampled choice is returned."""
    frequency_penalty: float | None = None
    """A token's logit less this times its count among the tokens generated (-2 to 2)."""
    presence_penalty: float | None = None
    """A token's logit less this once it has been generated (-2 to 2)."""
    logit_bias: dict[str, float] | None = None
    """Token ids (as strings) to biases in [-100, 100] added to their logits; -100 bans a token."""
    suffix: str | None = None
    """Not supported."""
    repetition_penalty: float | None = None
    """vLLM's: a positive logit divided by this, a negative one multiplied, for every token of the prompt or
    generated (above 0; 1: none)."""
    min_p: float | None = None
    """vLLM's: tokens less likely than this times the likeliest are not drawn (0 to 1)."""
    min_tokens: int | None = None
    """vLLM's: no stop string or stop token ends the text before this many tokens (at most max_tokens)."""
    ignore_eos: bool | None = None
    """vLLM's; either value: no model here has an end-of-text token to stop on."""
    add_special_tokens: bool | None = None
    """vLLM's; either value: no tokenizer here adds any."""
    use_beam_search: bool | None = None
    """vLLM's; false only."""
    include_stop_str_in_output: bool | None = None
    """vLLM's: the text ends with the stop string (or the stop token's text) that ended it."""
    skip_special_tokens: bool | None = None
    """vLLM's; true only."""
    spaces_between_special_tokens: bool | None = None
    """vLLM's; true only."""
    return_tokens_as_token_ids: bool | None = None
    """vLLM's: logprobs name each token token_id:{id}."""
    stop_token_ids: list[int] | None = Field(default=None, max_length=STOP_TOKEN_IDS)
    """vLLM's: a generated token among these ends the generation (its text left out)."""
    allowed_token_ids: list[int] | None = Field(default=None, max_length=ALLOWED_TOKEN_IDS)
    """vLLM's: only these tokens may be generated (logprobs stay the model's)."""
    truncate_prompt_tokens: int | None = None
    """vLLM's: each prompt is read from its last k tokens on (k >= 1; -1: the whole prompt)."""
    prompt_logprobs: int | None = Field(default=None, ge=-1, le=20)
    """vLLM's: each prompt token's log-probability and rank, with its N likeliest alternatives (0-20), in a JSON
    body's choices (not in streams, as vLLM's)."""
    response_format: dict[str, Any] | None = None
    """Null only."""
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    """vLLM's: the completion's id is cmpl-{request_id} (printable ASCII, no spaces; default: a random one). Over
    HTTP only: a WebSocket's cancels name the server's ids."""
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    """vLLM's; taken and not needed: no cache is shared between requests here (a session's memory is its key's)."""
    priority: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 63)
    """vLLM's; 0 only (no priority scheduling: vLLM's default refuses others too)."""
    length_penalty: float | None = None
    """vLLM's (beam search's); 1 only."""
    return_token_ids: bool | None = None
    """vLLM's: each choice's token ids too, the prompt's and those generated (a stream: the prompt's on a choice's
    first chunk, each chunk its own)."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's; null only."""
    logits_processors: list[Any] | None = None
    """vLLM's; null only."""
    prompt_embeds: str | list[str] | None = None
    """vLLM's; null only."""
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's; null only."""
    vllm_xargs: dict[str, Any] | None = None
    """vLLM's; null or {} only."""

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_of_openais_forms(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """One message for a prompt of none of the four forms (pydantic's first is "a valid string", whatever
        was sent), found by the list's shape first: a union tries every member on every element, which took
        seconds of the event loop for a body-sized list of floats."""
        refused = PydanticCustomError("prompt_type", "must be text, token ids (a list of integers), or a list "
                                      "holding one of those")
        if isinstance(value, list) and not _all_of(value, type(value[0]) if value else int):
            raise refused  # none of the forms, known without trying each member on each element
        try:
            return handler(value)
        except ValidationError:
            raise refused from None

    @field_validator("request_id")
    @classmethod
    def _printable(cls, value: str | None) -> str | None:
        """An id a client reads back in every chunk: printable ASCII with no spaces (a control character could
        meet the SSE template's marker, and broke the stream: found by a review)."""
        if value is not None and not (value.isascii() and value.isprintable() and " " not in value):
            raise PydanticCustomError("request_id_chars", "must be printable ASCII with no spaces")
        return value

    @field_validator("stop", mode="wrap")
    @classmethod
    def _texts(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """A list of anything but strings is refused at once, not element by element."""
        if isinstance(value, list) and not _all_of(value, str):
            raise PydanticCustomError("stop_type", "must be a string or a list of strings")
        return handler(value)


def _all_of(items: list, kind: type) -> bool:
    """Every item is exactly ``kind`` (so no bool for int), and lists are lists of integers."""
    if kind is list:
        return all(type(x) is list and _all_of(x, int) for x in items)
    return kind in (int, str) and all(type(x) is kind for x in items)


class SessionCreate(BaseModel):
    model_config = STRICT
    text: str = ""
    """The session's first text, read into its memory."""
    metadata: Metadata = None
    """Up to 16 string keys and values, kept with the session."""


class SessionAppend(BaseModel):
    model_config = STRICT
    text: str
    """Text read into the session's memory after what it holds, and scored."""
    logprobs: int | None = Field(default=None, ge=0, le=20)
    """Each token's log-probability and its N likeliest alternatives (0-20)."""


class SessionFork(BaseModel):
    model_config = STRICT
    metadata: Metadata = None
    """The new session's metadata (default: the parent's)."""


class SessionUpdate(BaseModel):
    model_config = STRICT
    # bounded by what the change leaves (16 keys), checked against the stored keys: a change may remove 16 and set 16
    metadata: Annotated[dict[str, str | None] | None, Field(default=None, max_length=2 * METADATA_KEYS),
                        AfterValidator(_utf8_text), AfterValidator(_named_keys)] = None
    """Keys to set (a string) or remove (null); the keys not named stay. At most 16 keys after the change."""


class SessionObject(BaseModel):
    model_config = DESCRIBED
    id: str
    object: Literal["session"] = "session"
    model: str
    tokens_seen: int
    """Tokens read into the session so far: its whole history, however long."""
    mem_len: int
    """Tokens the memory keeps at every layer: its fixed size."""
    bytes: int
    """Its record in Redis: hidden states (warm), or the token window alone (cold)."""
    tier: Literal["hot", "redis", "cold"]
    """hot: on a server's device; redis: hidden states in Redis; cold: the token window only (rebuilt on use)."""
    window_tokens: int = 0
    """Its last tokens kept in the record: enough to rebuild it, with any model of the same tokenizer."""
    created_at: int
    last_used_at: int
    metadata: dict[str, Any] = {}


class SessionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SessionObject]
    has_more: bool
    next_cursor: str | None = None


class AppendResult(SessionObject):
    appended_tokens: int
    rebuilt: bool = False  # the session's state was rebuilt from its token window (cold, or another checkpoint's)
    logprob: float | None = None
    bpc: float | None = None  # bits per token: per character for a byte model
    perplexity: float | None = None  # per token: a word model's measure
    logprobs: CompletionLogprobs | None = None  # per token, when the append asked for ``logprobs``


# -- responses: one set of models for JSON bodies, SSE chunks and WebSocket messages ------------------------------
FinishReason = Literal["stop", "length", "cancelled"]
"""``stop``: a stop string; ``length``: max_tokens; ``cancelled``: the client cancelled or left, or the server
drained, and what was generated was committed. The same on every surface."""


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


_NO_LOGPROBS = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
SPLICE_ROWS = 512  # logprobs entries rendered at a time (~4 ms with 20 alternatives each)
_ANY = TypeAdapter(Any)


def pydantic_dumps(value: Any) -> str:
    """JSON as a model's ``model_dump_json`` writes it (compact; floats as pydantic writes them)."""
    return _ANY.dump_json(value).decode()


def pydantic_json(value: Any) -> bytes:
    """:func:`pydantic_dumps` as bytes."""
    return _ANY.dump_json(value)


def spliced(shell: Callable[[CompletionLogprobs], str], logprobs: CompletionLogprobs,
            dumps: Callable[[Any], str]) -> str:
    """An object's JSON with its (long) ``logprobs`` rendered :data:`SPLICE_ROWS` entries at a time: ``shell``
    renders the object (as ``dumps`` would) around an empty CompletionLogprobs. One call over a scored prompt's
    47,000 tokens held the GIL, and every stream and /health with it, for a tenth of a second; on a thread
    (:func:`server.completion.off_loop`) the event loop runs between these parts. Same JSON as rendering it whole."""
    head, tail = shell(CompletionLogprobs(**_NO_LOGPROBS)).split(dumps(_NO_LOGPROBS))  # once: a string escapes '"'
    sep = dumps([0, 0])[2:-2]  # "," or ", "
    parts = [head, "{"]
    for i, name in enumerate(_NO_LOGPROBS):
        values = getattr(logprobs, name)
        parts.append((sep if i else "") + dumps({name: []})[1:-3] + "[")  # '"tokens":['
        parts.append(sep.join(dumps(values[lo:lo + SPLICE_ROWS])[1:-1] for lo in range(0, len(values), SPLICE_ROWS)))
        parts.append("]")
    parts.append("}" + tail)
    return "".join(parts)


class PromptLogprob(BaseModel):
    """vLLM's entry of ``prompt_logprobs``: a token's log-probability where it stood, its rank in the vocabulary
    there (1: the likeliest) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    # vLLM's, only where one ended the choice: the stop string, or the stop token's id
    stop_reason: int | str | None = None
    # vLLM's return_token_ids: the tokens generated (a chunk's own), and the prompt's (a choice's first chunk)
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    # vLLM's, only when asked for: for each prompt token (null for a first one with nothing before it), its own
    # entry then its alternatives', keyed by token id
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # tokens already in the session's memory: never re-read


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class SessionRef(BaseModel):
    id: str
    tokens_seen: int
    rebuilt: bool | None = None  # true when its state was rebuilt from its token window; absent otherwise


def _exclude(choices: list[CompletionChoice] | None = None, **fields: Any) -> dict[str, Any]:
    """``exclude=`` for model_dump: the top-level fields that are None, a session's ``rebuilt`` unless set, and
    the ``choices``' vLLM fields that none of them has (OpenAI's shape has none)."""
    out: dict[str, Any] = {k: True for k, v in fields.items() if v is None}
    if fields.get("session") is not None and fields["session"].rebuilt is None:
        out["session"] = {"rebuilt": True}
    unset = {name for name in VLLM_CHOICE_FIELDS if all(getattr(c, name) is None for c in choices or ())}
    if choices is not None and unset:
        out["choices"] = {"__all__": unset}
    return out


# a choice's fields beyond OpenAI's: left out where unset
VLLM_CHOICE_FIELDS = ("stop_reason", "token_ids", "prompt_token_ids", "prompt_logprobs")


class CompletionObject(BaseModel):
    """OpenAI's ``text_completion``: the JSON body, and (``usage`` None until the end) each SSE chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    # OpenAI's "backend configuration the model runs with": the checkpoint's fingerprint, with mem_len and clamp_len
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None
    session: SessionRef | None = None  # txlserve: the session after this request

    def dump(self, *, usage_null: bool = False) -> dict[str, Any]:
        """OpenAI's shape: ``session`` only when there is one, ``usage`` only when known (or, ``usage_null``, as
        null: a stream's chunks with ``include_usage``, as OpenAI sends them)."""
        return self.model_dump(exclude=_exclude(self.choices, session=self.session,
                                                usage=self.usage or usage_null or None))

    def dump_json(self) -> bytes:
        """:meth:`dump` as JSON, by pydantic's serializer in Rust: a dict returned to FastAPI is walked value by
        value in Python first (``jsonable_encoder``), which held the event loop 4.4 s for the logprobs of a
        50,000-token echoed prompt (every stream and /health waited)."""
        return self.model_dump_json(exclude=_exclude(self.choices, session=self.session, usage=self.usage)).encode()


class CompletionDelta(BaseModel):
    """WebSocket: a piece of text (and its logprobs and token ids when asked)."""

    type: Literal["completion.delta"] = "completion.delta"
    id: str
    text: str
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None

    def dump(self) -> dict[str, Any]:
        return self.model_dump(exclude={k for k in ("logprobs", "token_ids", "prompt_token_ids")
                                        if getattr(self, k) is None})


class CompletionDone(BaseModel):
    """WebSocket: the end of a completion, with the whole text."""

    type: Literal["completion.done"] = "completion.done"
    id: str
    text: str
    finish_reason: FinishReason
    usage: Usage
    session: SessionRef | None = None
    stop_reason: int | str | None = None  # vLLM's, as a choice has it
    prompt_token_ids: list[int] | None = None  # return_token_ids: here if no delta carried them (none came)

    def dump(self) -> dict[str, Any]:
        return self.model_dump(exclude=_exclude(session=self.session, stop_reason=self.stop_reason,
                                                prompt_token_ids=self.prompt_token_ids))


# -- portable sessions -------------------------------------------------------------------------------------------
SESSION_FORMAT = "txlserve.session.v1"


class SessionExport(BaseModel):
    """A session as a small self-describing document: its last tokens and what they mean. Any server whose
    tokenizer has the same id rebuilds it exactly (up to the window its own model needs)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    object: Literal["session.export"] = "session.export"
    format: Literal["txlserve.session.v1"] = SESSION_FORMAT
    tokenizer: str = Field(min_length=1, max_length=200)
    tokens_seen: int = Field(ge=0, le=1 << 62)  # what a header holds: whatever a session was exported at imports
    # (a cap of 2^53 refused the export of a session imported there and grown, found by a helper); a request that
    # would take a session past it is a 400 (the store refuses the commit)
    window: list[Annotated[int, Field(ge=0, lt=1 << 31)]] = Field(max_length=1 << 20)
    metadata: ExportedMetadata = None
    model: str | None = Field(default=None, max_length=256)  # informative: the exporting server's model name
    created_at: int | None = None


# -- tokenizer endpoints (vLLM's shapes) --------------------------------------------------------------------------
class TokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    """vLLM's; either value: txlserve's tokenizers add none."""
    return_token_strs: bool = False
    """Each token's name too, as logprobs name it."""


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int  # the most tokens one request may carry (a session's history is unbounded)
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, lt=1 << 31)]] = Field(max_length=1 << 22)


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error the API answers, HTTP and WebSocket alike: OpenAI's shape (``server/errors.py``)."""

    error: ErrorDetail

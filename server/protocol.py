"""Request and response models of the HTTP API: OpenAI's completions plus the sessions extension."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

STRICT = ConfigDict(extra="forbid", strict=True)


def _utf8_text(metadata: dict[str, str] | None) -> dict[str, str] | None:
    """JSON admits lone surrogates (``"\\ud800"``), which no response could carry back: refuse them here."""
    for text in (metadata or {}).items():
        for part in text:
            try:
                part.encode()
            except UnicodeEncodeError:
                raise ValueError("keys and values must be valid Unicode text (no lone surrogates)") from None
    return metadata


Metadata = Annotated[dict[str, str] | None, Field(default=None, max_length=16), AfterValidator(_utf8_text)]


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """OpenAI's legacy completions body; ``top_k`` and ``session_id`` are txlserve extensions."""

    model_config = STRICT
    model: str
    prompt: str = ""
    max_tokens: int | None = Field(default=16)
    temperature: float | None = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=0, ge=-1)
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = False
    user: str | None = Field(default=None, max_length=256)
    session_id: str | None = Field(default=None, min_length=1, max_length=128)
    # accepted for compatibility at their neutral values only
    best_of: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None


class SessionCreate(BaseModel):
    model_config = STRICT
    text: str = ""
    metadata: Metadata = None


class SessionAppend(BaseModel):
    model_config = STRICT
    text: str


class SessionFork(BaseModel):
    model_config = STRICT
    metadata: Metadata = None


class SessionObject(BaseModel):
    id: str
    object: Literal["session"] = "session"
    model: str
    tokens_seen: int
    mem_len: int
    bytes: int
    tier: str
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
    logprob: float | None = None
    bpc: float | None = None  # bits per token: per character for a byte model
    perplexity: float | None = None  # per token: a word model's measure

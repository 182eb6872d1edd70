"""Typed results. Each ``from_dict`` reads the server's JSON and ignores fields it does not know,
so a newer server does not break an older client."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0  # tokens the session's memory already held: not recomputed

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Usage:
        details = d.get("prompt_tokens_details") or {}
        return cls(d["prompt_tokens"], d["completion_tokens"], d["total_tokens"], details.get("cached_tokens", 0))


@dataclass(frozen=True)
class SessionRef:
    """The session a completion ran in, after it: ``tokens_seen`` counts prompt and completion."""

    id: str
    tokens_seen: int
    rebuilt: bool = False  # its state was rebuilt from its token window (a cold session, or another model's)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SessionRef | None:
        return None if d is None else cls(d["id"], d["tokens_seen"], bool(d.get("rebuilt")))


@dataclass(frozen=True)
class Logprobs:
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Logprobs | None:
        if d is None:
            return None
        return cls(d["tokens"], d["token_logprobs"], d["top_logprobs"], d["text_offset"])


@dataclass(frozen=True)
class Choice:
    """One of a completion's choices: ``index`` is prompt x n + sample, for a list of prompts or ``n`` above 1."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: Logprobs | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (None: none did)
    # vLLM's ``return_token_ids`` (``extra_body={"return_token_ids": True}``): the ids generated, and the prompt's
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Choice:
        return cls(d.get("index", 0), d["text"], d.get("finish_reason"), Logprobs.from_dict(d.get("logprobs")),
                   d.get("stop_reason"), d.get("token_ids"), d.get("prompt_token_ids"))


@dataclass(frozen=True)
class Completion:
    """A completion; ``text``, ``finish_reason`` and ``logprobs`` are its first choice's, ``choices`` all of them
    (several for a list of prompts or ``n`` above 1)."""

    _request_id: ClassVar[str | None] = None  # the answer's x-request-id, set on each (openai-python's)

    id: str
    created: int
    model: str
    text: str
    finish_reason: str | None
    usage: Usage
    session: SessionRef | None = None
    logprobs: Logprobs | None = None
    system_fingerprint: str | None = None  # the checkpoint's, with its mem_len and clamp_len (absent: older servers)
    choices: tuple[Choice, ...] = ()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Completion:
        choices = tuple(Choice.from_dict(c) for c in d["choices"])
        first = choices[0]
        return cls(d["id"], d["created"], d["model"], first.text, first.finish_reason, Usage.from_dict(d["usage"]),
                   SessionRef.from_dict(d.get("session")), first.logprobs, d.get("system_fingerprint"), choices)


@dataclass(frozen=True)
class CompletionChunk:
    """One piece of a streamed completion (SSE or WebSocket). The piece with ``finish_reason`` has
    ``session``; ``usage`` comes on that piece over a WebSocket, and over SSE on a last piece of its
    own, with empty text and no session, when ``stream_options={"include_usage": True}`` (with
    ``"continuous_usage_stats": True`` too, every piece carries the usage so far)."""

    id: str
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    session: SessionRef | None = None
    logprobs: Logprobs | None = None
    index: int = 0  # the choice it belongs to (a list of prompts, or n above 1, streams several over SSE)
    stop_reason: int | str | None = None  # on the piece with finish_reason: the stop string or token that ended it
    # with vLLM's ``return_token_ids``: this piece's tokens' ids (a piece carries the tokens that were waiting when
    # the server wrote it: one, or several for a client behind), and on a choice's first piece the prompt's
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    usage_only: bool = field(default=False, repr=False)  # SSE's last piece of include_usage: no choice in it

    @property
    def choices(self) -> list[Choice]:
        """The piece's choice as OpenAI's chunk holds it (``chunk.choices[0].text``), so that code written for
        openai-python reads it unchanged; empty for the usage's own last piece, as there."""
        if self.usage_only:
            return []
        return [Choice(self.index, self.text, self.finish_reason, self.logprobs, self.stop_reason, self.token_ids,
                       self.prompt_token_ids)]

    @classmethod
    def from_sse(cls, d: dict[str, Any]) -> CompletionChunk:
        choice = d["choices"][0] if d.get("choices") else {}
        usage = d.get("usage")
        return cls(d["id"], choice.get("text", ""), choice.get("finish_reason"),
                   Usage.from_dict(usage) if usage else None, SessionRef.from_dict(d.get("session")),
                   Logprobs.from_dict(choice.get("logprobs")), choice.get("index", 0), choice.get("stop_reason"),
                   choice.get("token_ids"), choice.get("prompt_token_ids"), usage_only=not d.get("choices"))

    @classmethod
    def from_ws(cls, d: dict[str, Any]) -> CompletionChunk:
        """A ``completion.delta``, or the ``completion.done`` that ends it (text already sent: empty here)."""
        if d["type"] == "completion.delta":
            return cls(d["id"], d["text"], logprobs=Logprobs.from_dict(d.get("logprobs")), token_ids=d.get("token_ids"),
                       prompt_token_ids=d.get("prompt_token_ids"))
        return cls(d["id"], "", d["finish_reason"], Usage.from_dict(d["usage"]), SessionRef.from_dict(d.get("session")),
                   stop_reason=d.get("stop_reason"), prompt_token_ids=d.get("prompt_token_ids"))


@dataclass(frozen=True)
class Session:
    """A session's persistent memory, as the server describes it (times are Unix seconds)."""

    _request_id: ClassVar[str | None] = None  # the answer's x-request-id, set on each (openai-python's)

    id: str
    model: str
    tokens_seen: int
    mem_len: int
    bytes: int
    tier: str  # "hot" (on the device), "redis" (hidden states) or "cold" (its token window only)
    created_at: int
    last_used_at: int
    metadata: dict[str, Any] = field(default_factory=dict)
    window_tokens: int = 0  # its last tokens kept with it: what an export carries

    @classmethod
    def _fields(cls, d: dict[str, Any]) -> dict[str, Any]:
        return {"id": d["id"], "model": d["model"], "tokens_seen": d["tokens_seen"], "mem_len": d["mem_len"],
                "bytes": d["bytes"], "tier": d["tier"], "created_at": d["created_at"],
                "last_used_at": d["last_used_at"], "metadata": d.get("metadata") or {},
                "window_tokens": d.get("window_tokens", 0)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Session:
        return cls(**cls._fields(d))


@dataclass(frozen=True)
class AppendResult(Session):
    """What ``sessions.create`` and ``sessions.append`` return: the session after the text was fed,
    and how well the model predicted that text (None when no token of it had one before it: an empty text, or
    one token that began an empty session)."""

    appended_tokens: int = 0
    logprob: float | None = None
    bpc: float | None = None
    perplexity: float | None = None
    rebuilt: bool = False  # its state was rebuilt from its token window first (cold, imported, another model's)
    logprobs: Logprobs | None = None  # each appended token's, when asked for

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AppendResult:
        return cls(**cls._fields(d), appended_tokens=d.get("appended_tokens", 0), logprob=d.get("logprob"),
                   bpc=d.get("bpc"), perplexity=d.get("perplexity"), rebuilt=bool(d.get("rebuilt")),
                   logprobs=Logprobs.from_dict(d.get("logprobs")))


@dataclass(frozen=True)
class SessionDeleted:
    _request_id: ClassVar[str | None] = None  # the answer's x-request-id, set on each (openai-python's)

    id: str
    deleted: bool

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SessionDeleted:
        return cls(d["id"], d["deleted"])


@dataclass(frozen=True)
class Model:
    id: str
    owned_by: str
    mem_len: int | None = None
    max_tokens_limit: int | None = None  # the largest max_tokens the server takes (None: it does not say)
    fingerprint: str | None = None  # the checkpoint's, with mem_len and clamp_len: a completion's system_fingerprint

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Model:
        return cls(d["id"], d.get("owned_by", ""), d.get("mem_len"), d.get("max_tokens_limit"), d.get("fingerprint"))


@dataclass(frozen=True)
class SessionPage:
    """One page of ``sessions.list``; ``iter_all()`` walks this page and every later one."""

    data: list[Session]
    has_more: bool
    next_cursor: str | None
    _fetch: Callable[[str], SessionPage] | None = field(default=None, repr=False, compare=False)

    def next_page(self) -> SessionPage | None:
        if not self.has_more or self.next_cursor is None or self._fetch is None:
            return None
        return self._fetch(self.next_cursor)

    def iter_all(self) -> Iterator[Session]:
        page: SessionPage | None = self
        while page is not None:
            yield from page.data
            page = page.next_page()

    def __iter__(self) -> Iterator[Session]:
        """Every session, this page's and the later pages' (OpenAI's SDK iterates a page so); ``data`` is this
        page's alone."""
        return self.iter_all()


@dataclass(frozen=True)
class AsyncSessionPage:
    """One page of ``AsyncClient.sessions.list``; ``async for s in page.iter_all()`` walks every later one too."""

    data: list[Session]
    has_more: bool
    next_cursor: str | None
    _fetch: Callable[[str], Awaitable[AsyncSessionPage]] | None = field(default=None, repr=False, compare=False)

    async def next_page(self) -> AsyncSessionPage | None:
        if not self.has_more or self.next_cursor is None or self._fetch is None:
            return None
        return await self._fetch(self.next_cursor)

    async def iter_all(self) -> AsyncIterator[Session]:
        page: AsyncSessionPage | None = self
        while page is not None:
            for session in page.data:
                yield session
            page = await page.next_page()

    def __aiter__(self) -> AsyncIterator[Session]:
        """As ``SessionPage.__iter__``."""
        return self.iter_all()


class AsyncSessionPager:
    """What ``AsyncClient.sessions.list`` returns, as OpenAI's SDK's ``AsyncPaginator``: ``await`` it for the first
    page, or ``async for`` over it for every session of every page."""

    def __init__(self, first: Callable[[], Awaitable[AsyncSessionPage]]) -> None:
        self._first = first

    def __await__(self) -> Generator[Any, None, AsyncSessionPage]:
        return self._first().__await__()

    async def __aiter__(self) -> AsyncIterator[Session]:
        async for session in await self._first():
            yield session

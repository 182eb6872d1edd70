"""What the store hands back: a session's header fields, and its tensors when they were loaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from memory_store.codec import MEMS, WINDOW_FORM, Header, record_nbytes
from txlserve.errors import InvalidRequestError

Tier = Literal["hot", "redis", "cold"]


@dataclass(frozen=True)
class SessionInfo:
    """Header fields of one session; ``bytes`` is the size of its persisted record (payload and memory).

    ``tier`` is "hot" when this store holds the current version on its device,
    "redis" when the next ``get`` has to load it, "cold" when Redis holds only its
    token window and its next use rebuilds it.
    """

    session_id: str
    owner: str | None
    version: int
    tokens_seen: int
    mem_len: int
    bytes: int
    tier: Tier
    created_at: float
    updated_at: float
    metadata: dict[str, Any]
    fingerprint: str = ""  # of the model (and window) that wrote this session: what a restore must match
    tokenizer: str = ""  # what its token window means
    window_tokens: int = 0  # how many of its last tokens it keeps (0: written before windows)
    window_span: int = 0  # the longest window of the models that wrote it (what its window is cut to, at least)

    @property
    def revision(self) -> tuple[int, float]:
        """What a copy of this session kept elsewhere (a server's hot set) must match to stand for it: its version
        and when it was written. A version number alone can come back: Redis that loses an acknowledged write
        (an AOF fsynced every second, a failover to a replica behind) lets another replica write the same version
        with other contents, and a copy matched by number continued the lost one, then patched its rows onto the
        other's memory."""
        return self.version, self.updated_at

    @classmethod
    def from_header(cls, session_id: str, header: Header, *, tier: Tier) -> SessionInfo:
        return cls(
            session_id=session_id,
            owner=header.owner,
            version=header.version,
            tokens_seen=header.tokens_seen,
            mem_len=header.mem_len,
            bytes=record_nbytes(header),
            tier="cold" if header.form == WINDOW_FORM and tier != "hot" else tier,
            created_at=header.created_at,
            updated_at=header.updated_at,
            metadata=header.metadata,
            fingerprint=header.fingerprint,
            tokenizer=header.tokenizer,
            window_tokens=header.window_tokens,
            window_span=header.window_span,
        )


@dataclass(frozen=True)
class Session:
    """A loaded session. Its tensors may be the hot tier's own: treat them as read-only."""

    info: SessionInfo
    tensors: dict[str, torch.Tensor]

    @property
    def session_id(self) -> str:
        return self.info.session_id

    @property
    def version(self) -> int:
        return self.info.version

    @property
    def mems(self) -> torch.Tensor:
        """The memory, where it was loaded. A cold session keeps only its token window (``tensors["window"]``)
        and a lease taken with ``tensors=False`` loads nothing, so both say so instead of a bare ``KeyError``."""
        if MEMS not in self.tensors:
            why = ("its memory is not stored, only its last tokens (tensors['window']): rebuild it from them"
                   if self.info.tier == "cold" else "no tensors were loaded (leased with tensors=False?)")
            raise InvalidRequestError(f"session {self.session_id} has no mems here: {why}", param="mems")
        return self.tensors[MEMS]

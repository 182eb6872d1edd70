"""Hot sessions in the engine's own form: a batch-1 ``DecodeState`` (the rings of keys and values, the layer
inputs, the next-token scores) by session id and revision (its version and the time it was written:
``SessionInfo.revision``), least recently used first out, under a byte budget.

A request takes its session's state out (it will advance it in place) and the committed state goes back in
under the new revision, so a hot hit costs no copy and no re-projection; a state whose revision is not the one
in Redis is never served. The store persists and restores only what it must (mems and header).

A session deleted while a request ran on it is remembered (ids are never reused), so that request's state does
not come back in afterwards; a session that expired in Redis only waits here for eviction, since its lease fails.
Hot and restored states agree exactly when the storage dtype is the model's; a narrower storage dtype (bf16)
rounds what Redis keeps, so a restored session then differs from the hot one by that rounding.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from model.cache import DecodeState

Revision = tuple[int, float]  # a stored session's version and the time it was written (SessionInfo.revision)


@dataclass
class _Entry:
    revision: Revision
    state: DecodeState
    window: list[int] | None  # the session's last tokens, as its store record keeps them
    nbytes: int


class HotStates:
    DELETED_REMEMBERED = 4096
    def __init__(self, budget_bytes: int, *, report_evictions: bool = False) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._deleted: OrderedDict[str, None] = OrderedDict()  # recently deleted ids, most recent last
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0
        self.report_evictions = report_evictions
        self.evicted: list[str] = []  # with report_evictions: ids evicted since the owner last emptied it (the engine
        # process tells the server, whose copy of the hot set's keys says which sessions are hot)

    def __len__(self) -> int:
        return len(self._entries)

    def revision(self, session_id: str) -> Revision | None:
        entry = self._entries.get(session_id)
        return None if entry is None else entry.revision

    def take(self, session_id: str, revision: Revision) -> tuple[DecodeState, list[int] | None] | None:
        """The state (and token window) of exactly ``revision``, removed (the caller owns it now); None on a
        miss."""
        entry = self._pop(session_id)
        if entry is None or entry.revision != revision:
            self.misses += 1
            return None
        self.hits += 1
        return entry.state, entry.window

    def put(self, session_id: str, revision: Revision, state: DecodeState, window: list[int] | None = None) -> bool:
        """Keep ``state`` as ``revision``, evicting the least recently used; False if it cannot fit at all."""
        self._pop(session_id)
        nbytes = state.row_bytes * state.batch
        if nbytes > self.budget_bytes or session_id in self._deleted:
            return False
        while self.nbytes + nbytes > self.budget_bytes:
            oldest = next(iter(self._entries))
            self._pop(oldest)
            self.evictions += 1
            if self.report_evictions:
                self.evicted.append(oldest)
        self._entries[session_id] = _Entry(revision, state, window, nbytes)
        self.nbytes += nbytes
        return True

    def discard(self, session_id: str) -> None:
        """Drop the session (another replica wrote it, or it is wanted from Redis)."""
        self._pop(session_id)

    def deleted(self, session_id: str) -> None:
        """The session was deleted: drop it, and refuse it if a request still running on it puts it back."""
        self._pop(session_id)
        self._deleted[session_id] = None
        if len(self._deleted) > self.DELETED_REMEMBERED:
            self._deleted.popitem(last=False)

    def _pop(self, session_id: str) -> _Entry | None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
        return entry

"""The hot tier: session tensors kept resident on the device, in LRU order, under a byte budget.

Evicting loses nothing durable, because every write goes through to Redis first;
it only loses the hot-only tensors (``_k``, ``_v``, ...), which is why a leased
session is pinned and never evicted. An entry carries the revision it was read
or written at (version and time written: a version number can come back after
Redis loses a write), and the store uses it only while Redis still holds that revision.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from memory_store.codec import state_nbytes
from memory_store.metrics import StoreMetrics


@dataclass(frozen=True)
class HotEntry:
    revision: tuple[int, float]
    tensors: dict[str, torch.Tensor]
    nbytes: int


class HotTier:
    """LRU map of session id to :class:`HotEntry`; its total ``nbytes`` never exceeds the budget."""

    def __init__(self, budget_bytes: int, metrics: StoreMetrics) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, HotEntry] = OrderedDict()
        self._pins: Counter[str] = Counter()
        self._nbytes = 0
        self._metrics = metrics

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def get(self, session_id: str, revision: tuple[int, float]) -> HotEntry | None:
        """The entry if it holds exactly ``revision``; another copy is dropped, never served."""
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        if entry.revision != revision:
            self.discard(session_id)
            return None
        self._entries.move_to_end(session_id)
        return entry

    def revision(self, session_id: str) -> tuple[int, float] | None:
        entry = self._entries.get(session_id)
        return None if entry is None else entry.revision

    def put(self, session_id: str, revision: tuple[int, float], tensors: dict[str, torch.Tensor]) -> bool:
        """Cache a state, evicting least recently used unpinned entries; False if it cannot fit.

        A newer copy already cached wins: a slow read racing a commit must not
        replace the committed state (and its hot-only tensors) with an older one.
        """
        current = self._entries.get(session_id)
        if current is not None and current.revision > revision:
            return False
        self.discard(session_id)
        nbytes = state_nbytes(tensors)
        if not self._make_room(nbytes):
            return False
        self._entries[session_id] = HotEntry(revision, tensors, nbytes)
        self._nbytes += nbytes
        self._update_gauges()
        return True

    def discard(self, session_id: str) -> None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._nbytes -= entry.nbytes
            self._update_gauges()

    def pin(self, session_id: str) -> None:
        self._pins[session_id] += 1

    def unpin(self, session_id: str) -> None:
        self._pins[session_id] -= 1
        if self._pins[session_id] <= 0:
            del self._pins[session_id]

    def _make_room(self, nbytes: int) -> bool:
        pinned = sum(e.nbytes for sid, e in self._entries.items() if sid in self._pins)
        if pinned + nbytes > self.budget_bytes:
            return False
        for session_id in [sid for sid in self._entries if sid not in self._pins]:
            if self._nbytes + nbytes <= self.budget_bytes:
                break
            self.discard(session_id)
            self._metrics.evictions += 1
        return True

    def _update_gauges(self) -> None:
        self._metrics.hot_bytes = self._nbytes
        self._metrics.hot_sessions = len(self._entries)

"""The hot tier alone: LRU order, the byte budget as a hard ceiling, pins and versions."""

from __future__ import annotations

import pytest
import torch

from memory_store.hot import HotTier
from memory_store.metrics import StoreMetrics

pytestmark = pytest.mark.timeout(60)

KB = 1024


def state(kb: int) -> dict[str, torch.Tensor]:
    return {"mems": torch.zeros(kb * KB, dtype=torch.uint8)}


def test_lru_eviction_never_exceeds_the_budget() -> None:
    metrics = StoreMetrics()
    hot = HotTier(10 * KB, metrics)
    for i in range(4):
        assert hot.put(f"s{i}", 1, state(3))
        assert hot.nbytes <= 10 * KB
    assert "s0" not in hot and all(sid in hot for sid in ("s1", "s2", "s3"))
    assert hot.get("s1", 1) is not None  # s1 is now the most recent; s2 is next out
    assert hot.put("s4", 1, state(3))
    assert "s2" not in hot and "s1" in hot
    assert metrics.evictions == 2
    assert (metrics.hot_bytes, metrics.hot_sessions) == (9 * KB, 3)


def test_state_larger_than_the_budget_is_not_cached() -> None:
    hot = HotTier(4 * KB, StoreMetrics())
    assert hot.put("small", 1, state(2))
    assert not hot.put("huge", 1, state(5))
    assert "huge" not in hot and "small" in hot  # and nothing was evicted for it


def test_pinned_entries_are_never_evicted() -> None:
    hot = HotTier(6 * KB, StoreMetrics())
    hot.put("leased", 1, state(3))
    hot.pin("leased")
    hot.put("a", 1, state(3))
    hot.put("b", 1, state(3))
    assert "leased" in hot and "b" in hot and "a" not in hot
    assert not hot.put("c", 1, state(4))  # only 3 KB are not pinned
    hot.unpin("leased")
    assert hot.put("c", 1, state(4))
    assert "leased" not in hot


def test_versions() -> None:
    hot = HotTier(10 * KB, StoreMetrics())
    hot.put("s", 2, state(1))
    assert not hot.put("s", 1, state(1)), "an older read must not replace a newer commit"
    assert hot.get("s", 2) is not None
    assert hot.get("s", 3) is None, "a copy older than Redis's is never served"
    assert "s" not in hot and hot.nbytes == 0

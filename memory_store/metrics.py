"""Counters and gauges of one store, kept as plain attributes for the server to export.

No metrics library here: the server decides the exposition format, this module
only counts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class OpStats:
    count: int = 0
    errors: int = 0
    total_s: float = 0.0


@dataclass
class StoreMetrics:
    """``hot_*`` count hot-tier lookups, ``redis_*`` the loads that went to Redis."""

    hot_hits: int = 0
    hot_misses: int = 0
    redis_hits: int = 0
    redis_misses: int = 0
    evictions: int = 0
    hot_bytes: int = 0
    hot_sessions: int = 0
    redis_errors: int = 0
    demotions: int = 0  # sessions moved to the cold tier (token window only)
    ops: dict[str, OpStats] = field(default_factory=dict)

    @contextmanager
    def timed(self, op: str) -> Iterator[None]:
        """Count one call of ``op`` and its wall time, failed calls included."""
        stats = self.ops.setdefault(op, OpStats())
        start = time.perf_counter()
        try:
            yield
        except BaseException:
            stats.errors += 1
            raise
        finally:
            stats.count += 1
            stats.total_s += time.perf_counter() - start

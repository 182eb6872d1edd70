"""The tunables of a MemoryStore, validated once so that a bad setting fails at startup."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from txlserve.errors import ConfigError

MiB = 1 << 20


@dataclass(frozen=True)
class StoreConfig:
    """``ttl_s`` is the idle TTL of every key (0: never expire); sizes are in MiB (fractions allowed).
    ``legacy_format`` writes records as servers before format 3 read them (the memory inside the payload)."""

    device: str | torch.device = "cpu"
    hot_cache_mb: float = 1024
    ttl_s: int = 7 * 86400
    data_dir: str = "./.txlserve"
    lease_ttl_ms: int = 30_000
    op_timeout_s: float = 2.0
    max_payload_mb: float = 256
    legacy_format: bool = False

    def __post_init__(self) -> None:
        for name in ("hot_cache_mb", "ttl_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}", param=name)
        for name in ("lease_ttl_ms", "op_timeout_s", "max_payload_mb"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}", param=name)

    @property
    def hot_cache_bytes(self) -> int:
        return int(self.hot_cache_mb * MiB)

    @property
    def max_payload_bytes(self) -> int:
        return int(self.max_payload_mb * MiB)

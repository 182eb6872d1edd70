"""The server's one settings object: defaults, then ``TXLSERVE_*`` environment variables, then CLI flags."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any

from model.errors import ConfigError


@dataclass(frozen=True)
class Settings:
    checkpoint: str | None = None  # None: the bundled checkpoint
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    mem_len: int | None = None  # None: the checkpoint's
    clamp_len: int | None = None
    redis_url: str | None = None  # None: an embedded Redis under data_dir
    data_dir: str = "./.txlserve"
    hot_cache_mb: int = 1024
    session_ttl_s: int = 7 * 86400  # idle TTL of a stored session; 0 keeps sessions forever
    storage_dtype: str = "float32"  # dtype of mems written to Redis: float32 | bfloat16 | float16
    api_keys: tuple[str, ...] = field(default_factory=tuple)
    model_name: str = "txl-shakespeare-small"
    max_batch: int = 32  # sessions advanced together per decode step
    max_queue: int = 256  # waiting requests before 429
    max_tokens_limit: int = 4096  # the largest max_tokens a request may ask for
    max_prompt_bytes: int = 1_000_000
    max_append_bytes: int = 8_000_000
    max_body_bytes: int = 10_000_000
    max_stop: int = 4
    max_stop_bytes: int = 64
    prefill_chunk: int = 512  # tokens per prefill slice; decode steps run between slices
    lease_ttl_ms: int = 30_000
    store_timeout_s: float = 2.0
    shutdown_timeout_s: float = 30.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.storage_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"storage_dtype must be float32, bfloat16 or float16, not {self.storage_dtype!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}")
        for name in ("max_batch", "max_queue", "max_tokens_limit", "prefill_chunk", "port"):
            if getattr(self, name) < 1 and name != "port":
                raise ConfigError(f"{name} must be >= 1")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> Settings:
        """``TXLSERVE_<NAME>`` for every field; explicit ``overrides`` (CLI flags, not None) win."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(f"TXLSERVE_{f.name.upper()}")
            if raw is not None:
                values[f.name] = _parse(f, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)
        except TypeError as err:
            raise ConfigError(str(err)) from None

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def env_names() -> list[str]:
    return [f"TXLSERVE_{f.name.upper()}" for f in fields(Settings)]


def _parse(f: dataclasses.Field, raw: str) -> Any:
    kind = str(f.type)
    try:
        if f.name == "api_keys":
            return tuple(k.strip() for k in raw.split(",") if k.strip())
        if raw == "" and "None" in kind:
            return None
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
    except ValueError:
        raise ConfigError(f"TXLSERVE_{f.name.upper()}={raw!r} is not a valid {kind}") from None
    return raw

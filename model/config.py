"""The model config: one frozen dataclass that travels with the weights as JSON."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.errors import ConfigError


@dataclass(frozen=True)
class TXLConfig:
    """Hyper-parameters of a Transformer-XL; names follow the paper's code.

    ``clamp_len`` 0 means no clamping. ``same_length`` makes every query attend to
    itself and exactly the ``mem_len`` tokens before it (the evaluation setting
    the inference engine always uses, so that splitting a stream never changes
    a result).

    That window is one key wider than the original code's (kimiyoung/transformer-xl,
    and Hugging Face's TransfoXL), whose ``same_length`` mask gives each query
    ``mem_len`` keys *including itself*: txlserve at ``mem_len = M`` computes exactly
    what the original computes at ``M + 1`` (:meth:`from_original_mem_len`,
    :attr:`original_mem_len`; tested in ``tests/model/test_same_length.py``).
    Without ``same_length`` the two agree at the same ``mem_len``.
    """

    n_layer: int = 12
    d_model: int = 512
    n_head: int = 8
    d_head: int = 64
    d_inner: int = 2048
    dropout: float = 0.1
    dropatt: float = 0.0
    tgt_len: int = 512
    mem_len: int = 512
    clamp_len: int = 0
    same_length: bool = True
    pre_lnorm: bool = False
    untie_r: bool = True
    vocab_size: int = 256
    tie_weight: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        positive = ("n_layer", "d_model", "n_head", "d_head", "d_inner", "tgt_len", "vocab_size")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"config.{name} must be a positive integer, got {value!r}", param=name)
        for name in ("mem_len", "clamp_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"config.{name} must be an integer >= 0, got {value!r}", param=name)
        for name in ("dropout", "dropatt"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ConfigError(f"config.{name} must be in [0, 1), got {value!r}", param=name)
        if self.d_model % 2:
            raise ConfigError("config.d_model must be even (sin and cos halves)", param="d_model")
        if not self.init_std > 0:
            raise ConfigError(f"config.init_std must be > 0, got {self.init_std!r}", param="init_std")

    @property
    def original_mem_len(self) -> int:
        """The original code's ``mem_len`` that computes what this config computes."""
        return self.mem_len + 1 if self.same_length else self.mem_len

    @staticmethod
    def from_original_mem_len(mem_len: int, same_length: bool) -> int:
        """txlserve's ``mem_len`` for a model the original code runs at ``mem_len`` (importers use this)."""
        if same_length and mem_len < 1:
            raise ConfigError("the original code's same_length needs mem_len >= 1", param="mem_len")
        return mem_len - 1 if same_length else mem_len

    def replace(self, **changes: Any) -> TXLConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TXLConfig:
        if not isinstance(data, dict):
            raise ConfigError("model config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown model config field(s): {', '.join(unknown)}")
        try:
            return cls(**data)
        except TypeError as err:  # pragma: no cover - dataclass arity
            raise ConfigError(f"invalid model config: {err}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json_file(cls, path: str | Path) -> TXLConfig:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"cannot read model config {path}: {err}") from None

    @property
    def n_params_estimate(self) -> int:
        attn = self.d_model * self.n_head * self.d_head * 5  # qkv + r_net + o_net
        ff = 2 * self.d_model * self.d_inner
        return self.n_layer * (attn + ff) + self.vocab_size * self.d_model


# Presets for `txlserve train --preset`. `small` is sized for about an hour on 2 CPU cores.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        model=dict(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, dropout=0.0,
                   tgt_len=32, mem_len=32),
        train=dict(steps=200, batch_size=8, lr=3e-3, warmup_steps=20, eval_every=0),
    ),
    "small": dict(
        model=dict(n_layer=4, d_model=256, n_head=4, d_head=64, d_inner=1024, dropout=0.1,
                   tgt_len=128, mem_len=128),
        train=dict(steps=3500, batch_size=16, lr=1e-3, warmup_steps=200, eval_every=500),
    ),
    "enwik8-base": dict(
        model=dict(n_layer=12, d_model=512, n_head=8, d_head=64, d_inner=2048, dropout=0.1,
                   dropatt=0.0, tgt_len=512, mem_len=512, same_length=False),
        train=dict(steps=400_000, batch_size=22, lr=2.5e-4, warmup_steps=0, eval_every=4000,
                   clip=0.25),
    ),
}

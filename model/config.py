"""The model config: one frozen dataclass that travels with the weights as JSON."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from txlserve.errors import ConfigError

# The largest sizes accepted: 10-100x the largest published Transformer-XL (18 layers, d_model 1024, d_inner 4096)
_MOST = {"n_layer": 1024, "d_model": 65536, "n_head": 4096, "d_head": 65536, "d_inner": 1 << 20}
# past these torch's int64 positions (and Redis's millisecond times) overflow: every flag and config is bounded so
MEM_LEN_MOST, CLAMP_LEN_MOST = 1 << 20, 1 << 40
# a training's flags past which AdamW overflows, or torch's seed does not hold them (the flags' and a resume's)
TRAIN_MOST = {"lr": 10, "weight_decay": 10, "seed": (1 << 63) - 1}
# The fields a saved config must state (from_dict): each sets the shape of some weight
SHAPE_FIELDS = ("n_layer", "d_model", "n_head", "d_head", "d_inner", "vocab_size")


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
    # adaptive input and softmax (Baevski & Auli; Grave et al.), as the paper's word-level models use them:
    # clusters [0, c0), [c0, c1), ..., [c_last, vocab_size); cluster i embeds in d_embed // div_val**i
    # dimensions, projected to d_model. No cutoffs and d_embed == d_model is a plain embedding and softmax.
    d_embed: int = 0  # 0: d_model
    cutoffs: tuple[int, ...] = ()
    div_val: int = 1
    tie_projs: tuple[bool, ...] = ()  # per cluster: the softmax's projection is the embedding's
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        positive = ("n_layer", "d_model", "n_head", "d_head", "d_inner", "tgt_len", "vocab_size", "div_val")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"config.{name} must be a positive integer, got {value!r}", param=name)
        for name, most in _MOST.items():  # past these no model here is meant: a typo (or a hang building one)
            if getattr(self, name) > most:
                raise ConfigError(f"config.{name} must be at most {most:,}, got {getattr(self, name):,}", param=name)
        for name, most in (("mem_len", MEM_LEN_MOST), ("clamp_len", CLAMP_LEN_MOST)):  # past them a traceback
            value = getattr(self, name)  # in eval, generate and serve (found by a helper)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"config.{name} must be an integer >= 0, got {value!r}", param=name)
            if value > most:
                raise ConfigError(f"config.{name} must be at most {most:,}, got {value:,}", param=name)
        for name in ("dropout", "dropatt"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ConfigError(f"config.{name} must be in [0, 1), got {value!r}", param=name)
        for name in ("same_length", "pre_lnorm", "untie_r", "tie_weight"):  # "false" (a string) read as true
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"config.{name} must be true or false, got {getattr(self, name)!r}", param=name)
        if self.d_model % 2:
            raise ConfigError("config.d_model must be even (sin and cos halves)", param="d_model")
        if not self.init_std > 0:
            raise ConfigError(f"config.init_std must be > 0, got {self.init_std!r}", param="init_std")
        if not isinstance(self.layer_norm_eps, (int, float)) or not self.layer_norm_eps > 0:
            raise ConfigError(f"config.layer_norm_eps must be > 0, got {self.layer_norm_eps!r}", param="layer_norm_eps")
        if not isinstance(self.d_embed, int) or isinstance(self.d_embed, bool) or self.d_embed < 0:
            raise ConfigError(f"config.d_embed must be an integer >= 0, got {self.d_embed!r}", param="d_embed")
        object.__setattr__(self, "d_embed", self.d_embed or self.d_model)
        self._check_clusters()

    def _check_clusters(self) -> None:
        try:
            cutoffs, tie_projs = tuple(self.cutoffs), tuple(self.tie_projs)
        except TypeError:
            raise ConfigError("config.cutoffs and config.tie_projs must be lists", param="cutoffs") from None
        object.__setattr__(self, "cutoffs", cutoffs)
        ints = all(isinstance(c, int) and not isinstance(c, bool) for c in cutoffs)
        if not ints or list(cutoffs) != sorted(set(cutoffs)) or \
                (cutoffs and not 0 < cutoffs[0] <= cutoffs[-1] < self.vocab_size):
            raise ConfigError(f"config.cutoffs must increase strictly within (0, vocab_size {self.vocab_size:,}), got "
                              f"{list(cutoffs)}",
                              param="cutoffs")
        if any(self.d_embed // self.div_val**i < 1 for i in range(len(cutoffs) + 1)):
            raise ConfigError(f"config.div_val {self.div_val} leaves a cluster with no embedding dimensions",
                              param="div_val")
        tie_projs = tie_projs or (False,) * (len(cutoffs) + 1)
        if len(tie_projs) != len(cutoffs) + 1 or any(not isinstance(t, bool) for t in tie_projs):
            raise ConfigError(f"config.tie_projs needs one boolean per cluster ({len(cutoffs) + 1}), got "
                              f"{list(tie_projs)}", param="tie_projs")
        object.__setattr__(self, "tie_projs", tie_projs)

    @property
    def n_clusters(self) -> int:
        """Tail clusters of the adaptive softmax (0: a plain softmax)."""
        return len(self.cutoffs)

    @property
    def adaptive(self) -> bool:
        """Whether the input and output layers are the adaptive (clustered or projected) kind."""
        return bool(self.cutoffs) or self.d_embed != self.d_model

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
        missing = [f for f in SHAPE_FIELDS if f not in data]
        if missing:  # a default there would surface later as a weight of the wrong shape
            raise ConfigError(f"model config has no {', '.join(missing)} (the weights' shapes depend on it)",
                              param=missing[0])
        try:
            return cls(**data)
        except TypeError as err:  # pragma: no cover - dataclass arity
            raise ConfigError(f"invalid model config: {err}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json_file(cls, path: str | Path) -> TXLConfig:
        try:
            return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8-sig")))
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"cannot read model config {path}: {err}") from None

    @property
    def n_params_estimate(self) -> int:
        attn = self.d_model * self.n_head * self.d_head * 5  # qkv + r_net + o_net
        ff = 2 * self.d_model * self.d_inner
        ends = [0, *self.cutoffs, self.vocab_size]
        dims = [self.d_embed // self.div_val**i for i in range(len(ends) - 1)] if self.div_val > 1 else \
            [self.d_embed] * (len(ends) - 1)
        emb = sum((r - lo) * d for lo, r, d in zip(ends, ends[1:], dims))
        return self.n_layer * (attn + ff) + emb


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

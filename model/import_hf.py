"""`txlserve import hf`: a Hugging Face TransfoXL directory (the published WikiText-103 model) as a checkpoint.

Reads ``config.json``, ``model.safetensors`` and ``vocab.json`` (or the original code's
``vocab.txt``, one symbol per line) and writes a txlserve checkpoint that computes what
the reference computes:

- weights map one to one (``transformer.`` dropped, ``CoreNet`` -> ``core_net``); tables and
  projections the reference ties are stored once and tied again on load;
- ``same_length``: the reference gives each query ``mem_len`` keys including itself,
  txlserve gives it itself plus ``mem_len`` earlier tokens, so the imported ``mem_len`` is one
  less (:meth:`TXLConfig.from_original_mem_len`); ``original_mem_len`` in the checkpoint's
  ``training`` section records the published value.

A session starts with no memory, as in the original code; Hugging Face's ``init_mems``
instead starts the first segment on ``mem_len`` zero states (the parity tests pass it
empty mems, the original's behaviour). Pickled files are refused, never opened.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from model.checkpoint import build_from_tensors, check_out_dir, pickle_note, save_checkpoint
from model.config import TXLConfig
from model.tokenizer import WordTokenizer
from txlserve.errors import CheckpointError, ConfigError

PICKLED = {"pytorch_model.bin": "model.safetensors", "tf_model.h5": "model.safetensors",
           "vocab.pkl": "vocab.json", "vocab.bin": "vocab.json"}


def is_hf_dir(path: str | Path) -> bool:
    """A Hugging Face TransfoXL directory (its config.json names the model type)."""
    try:
        data = json.loads((Path(path) / "config.json").read_text(encoding="utf-8-sig"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("model_type") == "transfo-xl"


def refuse_pickles(src: Path, wanted: str, safe: str, also: str | None = None) -> None:
    """One line naming the safe file when only a pickled form of ``wanted`` is there (``also``: another safe
    form that serves as well)."""
    if (src / safe).is_file() or also is not None and (src / also).is_file():
        return
    for name, instead in PICKLED.items():
        if instead == safe and (src / name).is_file():
            raise CheckpointError(f"{src / name} is a pickle, which txlserve never loads; fetch {safe} from the "
                                  f"same model repository instead (for the {wanted})")


def hf_config(data: dict[str, Any]) -> TXLConfig:
    """A TransfoXL config.json as txlserve's config; a field of the wrong kind (``"cutoffs": 5``, ``null`` where a
    number goes) is one line, not the TypeError of the comparison it broke."""
    try:
        return _hf_config(data)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"config.json has a field of the wrong type: {err}") from None


def _hf_config(data: dict[str, Any]) -> TXLConfig:
    if "model_type" not in data:
        raise CheckpointError("config.json has no model_type; txlserve imports Transformer-XL (model_type "
                              "\"transfo-xl\") configs")
    if data["model_type"] != "transfo-xl":
        raise CheckpointError(f"config.json is a {data['model_type']!r} model, not a Transformer-XL (transfo-xl)")
    numbers = ("n_layer", "d_model", "n_head", "d_head", "d_inner", "tgt_len", "mem_len", "clamp_len", "vocab_size",
               "n_token", "d_embed", "div_val", "attn_type", "sample_softmax", "init_std", "layer_norm_epsilon")
    for name in numbers:  # named, not the TypeError of the comparison it broke (found by a helper)
        value = data.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise CheckpointError(f"config.json's {name!r} is {json.dumps(value)[:60]}, not a number")
    if data.get("attn_type", 0) != 0:
        raise CheckpointError(f"attn_type {data['attn_type']!r} is not supported; txlserve serves the paper's "
                              "relative attention (attn_type 0, the integer)")
    if data.get("sample_softmax", -1) > 0:
        raise CheckpointError("sample_softmax models are not supported")
    flags = ("same_length", "pre_lnorm", "untie_r", "tie_word_embeddings", "tie_weight", "proj_share_all_but_first")
    for name in flags:  # bool() read the string "false" as true, and such a model computed otherwise (a helper)
        if name in data and not isinstance(data[name], bool):
            raise CheckpointError(f"config.json's {name!r} is {json.dumps(data[name])[:60]}, not true or false")
    tie_projs = data.get("tie_projs")
    if tie_projs is not None and (not isinstance(tie_projs, list) or not all(isinstance(t, bool) for t in tie_projs)):
        raise CheckpointError(f"config.json's 'tie_projs' is {json.dumps(tie_projs)[:60]}, not a list of true or "
                              "false")
    # a key the config leaves out takes TransfoXLConfig's default, as transformers reads it (same_length and
    # clamp_len change the window silently)
    same_length = data.get("same_length", True)
    cutoffs = data.get("cutoffs") or []
    if not isinstance(cutoffs, list):  # a string was read as its characters: "got ['2', '0', '0', '0']"
        raise CheckpointError(f"config.json's 'cutoffs' is {json.dumps(cutoffs)[:60]}, not a list of numbers")
    n_clusters = len(cutoffs)
    tie_weight = data.get("tie_word_embeddings", data.get("tie_weight", True))  # older configs say tie_weight
    vocab_size = data.get("vocab_size", data.get("n_token"))
    if tie_projs is None:  # TransfoXLConfig derives it from proj_share_all_but_first
        tie_projs = [False] + [data.get("proj_share_all_but_first", True)] * n_clusters
    try:
        return TXLConfig(
            n_layer=data["n_layer"], d_model=data["d_model"], n_head=data["n_head"], d_head=data["d_head"],
            d_inner=data["d_inner"], dropout=0.0, dropatt=0.0, tgt_len=data.get("tgt_len", 128),
            mem_len=TXLConfig.from_original_mem_len(data.get("mem_len", 1600) or 0, same_length),
            clamp_len=max(0, data.get("clamp_len", 1000) or 0), same_length=same_length,
            pre_lnorm=data.get("pre_lnorm", False), untie_r=data.get("untie_r", True),
            vocab_size=vocab_size, tie_weight=tie_weight,
            init_std=data.get("init_std", 0.02), d_embed=data.get("d_embed") or data["d_model"], cutoffs=tuple(cutoffs),
            div_val=data.get("div_val", 1), tie_projs=tuple(tie_projs),
            layer_norm_eps=data.get("layer_norm_epsilon", 1e-5))
    except KeyError as err:
        raise CheckpointError(f"config.json has no {err.args[0]!r}") from None
    except ConfigError as err:
        raise CheckpointError(f"config.json: {err.message}") from None
    except (TypeError, ValueError) as err:  # a field of the wrong type
        raise CheckpointError(f"config.json has a field of the wrong type: {err}") from None


def read_vocab(src: Path) -> list[str]:
    """Symbols in id order from ``vocab.json`` (a list, ``{"idx2sym": [...]}``, or ``{symbol: id}``,
    also under ``"sym2idx"``) or ``vocab.txt`` (the original code's: the first field of each line)."""
    refuse_pickles(src, "vocabulary", "vocab.json", also="vocab.txt")
    if (src / "vocab.json").is_file():
        try:
            data = json.loads((src / "vocab.json").read_text(encoding="utf-8-sig"))
        except (OSError, ValueError, RecursionError) as err:  # (a 5,000-digit number, nesting too deep)
            if note := pickle_note(src / "vocab.json"):  # a pickle under a JSON name: say so, and what to give
                raise CheckpointError(f"{src / 'vocab.json'} is not JSON{note}: give the vocabulary as vocab.json "
                                      "(JSON) or vocab.txt") from None
            raise CheckpointError(f"{src / 'vocab.json'} is not valid JSON: {err or 'nested too deep'}") from None
        if isinstance(data, dict) and isinstance(data.get("idx2sym"), list) and data["idx2sym"]:
            return data["idx2sym"]
        mapping = data.get("sym2idx", data) if isinstance(data, dict) else None
        if isinstance(data, list):
            return data
        if isinstance(mapping, dict) and all(isinstance(v, int) for v in mapping.values()):
            symbols = sorted(mapping, key=mapping.__getitem__)
            if [mapping[s] for s in symbols] != list(range(len(symbols))):
                raise CheckpointError(f"{src / 'vocab.json'}: ids are not 0..n-1")
            return symbols
        raise CheckpointError(f"{src / 'vocab.json'}: expected a list of symbols or a symbol-to-id object")
    if (src / "vocab.txt").is_file():
        try:
            lines = (src / "vocab.txt").read_text(encoding="utf-8-sig").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{src / 'vocab.txt'} cannot be read as UTF-8 text: {err}") from None
        return [line.split()[0] for line in lines if line.strip()]
    raise CheckpointError(f"{src} has no vocab.json or vocab.txt (the word vocabulary)")


def hf_tensors(src: Path, cfg: TXLConfig) -> dict[str, torch.Tensor]:
    """The reference's weights under txlserve's names, each tied table or projection once."""
    refuse_pickles(src, "weights", "model.safetensors")
    path = src / "model.safetensors"
    if not path.is_file():
        raise CheckpointError(f"{src} has no model.safetensors")
    try:
        raw = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{path} is not a readable safetensors file{pickle_note(path) or f': {err}'}") from None
    tensors = {}
    for name in list(raw):
        new = name.removeprefix("transformer.").replace(".CoreNet.", ".core_net.")
        new = new.replace(".dec_attn.r_w_bias", ".r_w_bias").replace(".dec_attn.r_r_bias", ".r_r_bias")
        tensor = raw.pop(name)
        if new != "pos_emb.inv_freq":  # computed, not learned
            tensors[new] = tensor
    for i, tied in enumerate(cfg.tie_projs):  # a file written without deduplication stores tied copies too
        if tied:
            tensors.pop(f"crit.out_projs.{i}", None)
    if cfg.tie_weight:
        for i in range(len(cfg.cutoffs) + 1):
            tensors.pop(f"crit.out_layers.{i}.weight", None)
    return tensors


def import_hf(src: str | Path, out: str | Path, *, dtype: torch.dtype | None = None) -> str:
    """Convert ``src`` into a checkpoint at ``out``; the fingerprint of the written weights."""
    src, out = Path(src), Path(out)
    check_out_dir(out)  # never over a checkpoint, or into a directory of other files
    if not src.exists():  # a hub name, say: the import reads a folder on disk
        raise CheckpointError(f"{src} does not exist: give a Hugging Face TransfoXL directory on disk, downloaded "
                              f"first (huggingface-cli download transfo-xl/transfo-xl-wt103 config.json "
                              f"model.safetensors vocab.json --local-dir DIR)")
    if src.is_file():
        raise CheckpointError(f"{src} is a file{pickle_note(src)}; give the Hugging Face TransfoXL directory "
                              "(config.json, model.safetensors, vocab.json)")
    refuse_pickles(src, "weights", "model.safetensors")  # first: a pickled model's folder says that, not what its
    refuse_pickles(src, "vocabulary", "vocab.json", also="vocab.txt")  # config lacks
    if not (src / "config.json").is_file():
        raise CheckpointError(f"{src} has no config.json (expected a Hugging Face TransfoXL directory)")
    try:
        data = json.loads((src / "config.json").read_text(encoding="utf-8-sig"))
    except (OSError, ValueError, RecursionError) as err:  # (a 5,000-digit number, nesting too deep)
        raise CheckpointError(f"{src / 'config.json'} is not valid JSON: {err or 'nested too deep'}") from None
    cfg = hf_config(data if isinstance(data, dict) else {})
    symbols = read_vocab(src)
    if len(symbols) != cfg.vocab_size:
        raise CheckpointError(f"the vocabulary has {len(symbols)} symbols, config.json says {cfg.vocab_size}")
    eos_id = data.get("eos_token_id")
    if eos_id is not None and not (isinstance(eos_id, int) and 0 <= eos_id < len(symbols)):  # was <eos>, unsaid
        raise CheckpointError(f"config.json's eos_token_id {json.dumps(eos_id)[:40]} is not an id of its "
                              f"{len(symbols)}-symbol vocabulary")
    eos = symbols[eos_id] if eos_id is not None else "<eos>"
    tokenizer = WordTokenizer(symbols, eos=eos, unk="<unk>")
    model = build_from_tensors(cfg, hf_tensors(src, cfg), ckpt_dir=src, dtype=dtype)
    training = {"imported_from": "huggingface transfo-xl", "source": str(src.resolve()),
                "original_mem_len": data.get("mem_len"), "same_length": cfg.same_length}
    return save_checkpoint(model, out, training=training, tokenizer=tokenizer)

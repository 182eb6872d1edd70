"""Bits per character with mems, as the paper evaluates."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from model.transformer_xl import MemTransformerLM


@torch.no_grad()
def evaluate(model: MemTransformerLM, data: np.ndarray, *, tgt_len: int, batch_size: int = 8,
             max_tokens: int | None = None, device: str | torch.device = "cpu",
             scored: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Mean NLL over ``data`` cut into ``batch_size`` streams read in ``tgt_len`` segments,
    mems carried from segment to segment (each stream starts with empty mems). Fewer streams where the data
    holds less than a segment each: the result's ``batch_size`` says how many were read (the streams change
    the score, since each starts with empty mems). ``scored`` hears each segment's count of tokens (a progress
    bar: a whole WikiText-2 file takes minutes on a CPU)."""
    from model.data import OrderedIterator

    was_training = model.training
    model.eval()
    if max_tokens is not None and len(data) > max_tokens + 1:
        data = data[: max_tokens + 1]
    batch_size = max(1, min(batch_size, (len(data) - 1) // max(tgt_len, 1)))
    total_nll, total_tokens, mems = 0.0, 0, None
    for inp, tgt in OrderedIterator(data, batch_size, tgt_len, device=device):
        nll, mems = model.loss(inp, tgt, mems)
        total_nll += float(nll.double().sum())
        total_tokens += tgt.numel()
        if scored is not None:
            scored(tgt.numel())
    model.train(was_training)
    if total_tokens == 0:
        return {"bpc": float("nan"), "ppl": float("nan"), "tokens": 0, "loss": float("nan"), "batch_size": batch_size}
    loss = total_nll / total_tokens
    return {"bpc": loss / math.log(2), "ppl": math.exp(loss), "tokens": total_tokens, "loss": loss,
            "batch_size": batch_size}

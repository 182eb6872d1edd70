"""Tiny states and helpers shared by the memory_store tests."""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
from pathlib import Path
from typing import Any

import torch

from memory_store import ModelIdentity

N_LAYER, MEM, D_MODEL = 2, 8, 16
IDENTITY = ModelIdentity(fingerprint="txl-test-v1", n_layer=N_LAYER, d_model=D_MODEL)


def make_state(
    m: int = MEM, *, dtype: torch.dtype = torch.float32, seed: int = 0, hot_only: bool = False
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {"mems": torch.randn(N_LAYER, m, D_MODEL, generator=gen).to(dtype)}
    if hot_only:
        state["_k"] = torch.randn(N_LAYER, m, D_MODEL, generator=gen)
    return state


def state_bytes(m: int = MEM, dtype: torch.dtype = torch.float32) -> int:
    return N_LAYER * m * D_MODEL * torch.tensor([], dtype=dtype).element_size()


def new_owner() -> str:
    """Tests share one Redis; a fresh owner keeps each test's listing to itself."""
    return "owner-" + secrets.token_hex(6)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bit-exact equality (dtype, shape and every bit), not closeness."""
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name].cpu().view(torch.uint8), b[name].cpu().view(torch.uint8)), name


ROOT = Path(__file__).resolve().parents[2]


async def start_holder(*args: str) -> tuple[asyncio.subprocess.Process, dict[str, Any]]:
    """Run ``tests.memory_store.holder`` in a new process and wait for its report line."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.memory_store.holder", *args, cwd=ROOT, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
        return proc, json.loads(line)
    except BaseException:
        proc.kill()
        await proc.wait()
        raise

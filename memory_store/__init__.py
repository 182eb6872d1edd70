"""Persistent per-session state of txlserve: a hot tier on the device over Redis.

async with MemoryStore.from_url(url, identity=identity) as store:
    info = await store.create(owner=owner, tensors={"mems": mems}, mem_len=512)
    async with store.lease(info.session_id, owner=owner) as lease:
        mems = lease.session.mems
        ...
        await store.commit(lease, {"mems": new_mems}, tokens_seen=n, appended=True)  # writes only new rows

The names below load on first use (PEP 562), so a torch-free part (``memory_store.redis_tier``: the URL check
``txlserve serve`` makes before importing torch) does not import the store and torch with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memory_store.codec import ModelIdentity
    from memory_store.config import StoreConfig
    from memory_store.lease import Lease
    from memory_store.metrics import OpStats, StoreMetrics
    from memory_store.session import Session, SessionInfo
    from memory_store.store import MemoryStore

_HOMES = {
    "Lease": "lease",
    "MemoryStore": "store",
    "ModelIdentity": "codec",
    "OpStats": "metrics",
    "Session": "session",
    "SessionInfo": "session",
    "StoreConfig": "config",
    "StoreMetrics": "metrics",
}

__all__ = [
    "Lease",
    "MemoryStore",
    "ModelIdentity",
    "OpStats",
    "Session",
    "SessionInfo",
    "StoreConfig",
    "StoreMetrics",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'memory_store' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"memory_store.{home}"), name)
    globals()[name] = value  # once
    return value

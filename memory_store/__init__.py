"""Persistent per-session state of txlserve: a hot tier on the device over Redis.

async with MemoryStore.from_url(url, identity=identity) as store:
    info = await store.create(owner=owner, tensors={"mems": mems}, mem_len=512)
    async with store.lease(info.session_id, owner=owner) as lease:
        mems = lease.session.mems
        ...
        await store.commit(lease, {"mems": new_mems}, tokens_seen=n, appended=True)  # writes only new rows
"""

from memory_store.codec import ModelIdentity
from memory_store.config import StoreConfig
from memory_store.lease import Lease
from memory_store.metrics import OpStats, StoreMetrics
from memory_store.session import Session, SessionInfo
from memory_store.store import MemoryStore

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

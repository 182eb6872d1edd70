from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from memory_store import MemoryStore
from tests.memory_store.support import IDENTITY


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[MemoryStore]:
    async with MemoryStore.from_url(redis_url, identity=IDENTITY, op_timeout_s=2.0) as s:
        yield s


@pytest.fixture
async def other_store(redis_url: str) -> AsyncIterator[MemoryStore]:
    """A second server process's view of the same Redis (its own hot tier and leases)."""
    async with MemoryStore.from_url(redis_url, identity=IDENTITY, op_timeout_s=2.0) as s:
        yield s

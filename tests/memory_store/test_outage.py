"""Redis going away: every operation fails fast with StoreUnavailable, and the store recovers by itself."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from memory_store import MemoryStore
from tests.conftest import RedisProcess
from tests.memory_store.support import IDENTITY, assert_same, make_state
from txlserve.errors import StoreUnavailable

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

OP_TIMEOUT_S = 0.5


async def fails_fast(op: Callable[[], Awaitable[object]], within_s: float) -> None:
    start = time.perf_counter()
    with pytest.raises(StoreUnavailable):
        await op()
    assert time.perf_counter() - start < within_s


async def test_killed_redis_fails_fast_then_recovers_with_its_aof(
    redis_server: Callable[..., RedisProcess], tmp_path: Path
) -> None:
    server = redis_server(tmp_path / "aof")
    async with MemoryStore.from_url(server.url, identity=IDENTITY, op_timeout_s=OP_TIMEOUT_S) as store:
        info = await store.create(owner="u", tensors=make_state(seed=1), mem_len=8)
        async with store.lease(info.session_id, owner="u") as lease:
            await store.commit(lease, make_state(seed=2), tokens_seen=8)

        server.kill()
        sid = info.session_id
        await fails_fast(lambda: store.get(sid, owner="u"), within_s=2)
        await fails_fast(lambda: store.info(sid, owner="u"), within_s=2)
        await fails_fast(lambda: store.list(owner="u"), within_s=2)
        await fails_fast(lambda: store.create(owner="u", tensors=make_state(), mem_len=8), within_s=2)
        await fails_fast(lambda: store.lease(sid, owner="u"), within_s=2)
        await fails_fast(store.ping, within_s=2)
        assert store.metrics.redis_errors >= 6

        redis_server(server.data_dir, server.port)  # same files, same port
        got = await store.get(sid, owner="u")  # the pool reconnects on its own
        assert got.version == 2  # served hot only because Redis still holds that version
        assert_same(got.tensors, make_state(seed=2))
        async with store.lease(sid, owner="u") as lease:
            await store.commit(lease, make_state(seed=3), tokens_seen=16)


async def test_hung_redis_times_out(redis_server: Callable[..., RedisProcess]) -> None:
    server = redis_server()
    async with MemoryStore.from_url(server.url, identity=IDENTITY, op_timeout_s=OP_TIMEOUT_S) as store:
        info = await store.create(tensors=make_state(), mem_len=8)
        server.pause()
        try:
            await fails_fast(lambda: store.get(info.session_id), within_s=4 * OP_TIMEOUT_S)
            await fails_fast(lambda: store.lease(info.session_id), within_s=4 * OP_TIMEOUT_S)
        finally:
            server.resume()
        assert (await store.get(info.session_id)).version == 1


async def test_unreachable_redis_at_start(redis_server: Callable[..., RedisProcess]) -> None:
    server = redis_server()
    server.kill()
    store = MemoryStore.from_url(server.url, identity=IDENTITY, op_timeout_s=OP_TIMEOUT_S)
    await fails_fast(store.start, within_s=2)
    await fails_fast(store.ping, within_s=1)  # and it stays a clean, closed store

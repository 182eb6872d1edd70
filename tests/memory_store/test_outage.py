"""Redis going away: every operation fails fast with StoreUnavailable, and the store recovers by itself."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis

from memory_store import MemoryStore, codec
from tests.conftest import RedisProcess
from tests.memory_store.support import IDENTITY, assert_same, make_state
from txlserve.errors import SessionBusy, StoreUnavailable

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


async def test_a_lease_released_while_redis_was_away_is_released_once_it_is_back(
    redis_server: Callable[..., RedisProcess], tmp_path: Path
) -> None:
    """Redis restored the lease key from its append-only file: the session was a 409 to everyone for the rest of
    the lease's TTL (30 s), with no request running (found by a helper). The busy error says when it frees."""
    server = redis_server(tmp_path / "aof")
    async with MemoryStore.from_url(server.url, identity=IDENTITY, op_timeout_s=OP_TIMEOUT_S,
                                    lease_ttl_ms=60_000) as store, \
            MemoryStore.from_url(server.url, identity=IDENTITY, op_timeout_s=OP_TIMEOUT_S) as other:
        sid = (await store.create(tensors=make_state(seed=1), mem_len=8)).session_id
        lease = await store.lease(sid)
        with pytest.raises(SessionBusy, match=r"free within (59|60) s"):
            await other.lease(sid)
        server.kill()
        await lease.release()  # Redis is away: the release is owed
        redis_server(server.data_dir, server.port)  # the lease key is back, 60 s long
        deadline = time.monotonic() + 20
        while True:
            try:
                async with other.lease(sid):
                    break
            except (SessionBusy, StoreUnavailable):
                assert time.monotonic() < deadline, "the owed release never came"
                await asyncio.sleep(0.1)


async def test_a_redis_that_evicts_sessions_is_warned_of_at_start(
    redis_server: Callable[..., RedisProcess], caplog: pytest.LogCaptureFixture
) -> None:
    """With a maxmemory and an LRU policy, a full Redis deleted sessions silently (404s) where noeviction fails
    commits with a 503 (found by a helper): the store says so as it starts, not at the first lost session."""
    server = redis_server()
    async with MemoryStore.from_url(server.url, identity=IDENTITY):
        pass
    assert "evicts keys" not in caplog.text  # the default: no limit
    with redis.Redis.from_url(server.url) as admin:
        admin.config_set("maxmemory", "64mb")
        admin.config_set("maxmemory-policy", "allkeys-lru")
    async with MemoryStore.from_url(server.url, identity=IDENTITY):
        pass
    assert "evicts keys when full (maxmemory-policy allkeys-lru)" in caplog.text


async def test_a_policy_that_evicts_set_while_the_store_runs_is_warned_of_once(
    redis_server: Callable[..., RedisProcess], caplog: pytest.LogCaptureFixture
) -> None:
    """Set while the servers ran, it went unsaid (found by a helper): the cold-tier sweep asks again."""
    server = redis_server()
    async with MemoryStore.from_url(server.url, identity=IDENTITY) as store:
        with redis.Redis.from_url(server.url) as admin:
            admin.config_set("maxmemory", "64mb")
            admin.config_set("maxmemory-policy", "allkeys-random")
            for _ in range(2):
                await store.check_eviction_policy()
            assert caplog.text.count("maxmemory-policy allkeys-random") == 1  # once per change, not per sweep
            admin.config_set("maxmemory-policy", "noeviction")
            await store.check_eviction_policy()
            admin.config_set("maxmemory-policy", "allkeys-random")
            await store.check_eviction_policy()
    assert caplog.text.count("maxmemory-policy allkeys-random") == 2  # set again after a fix


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


async def test_a_lease_refused_by_a_hung_redis_costs_one_store_timeout(redis_server: Callable[..., RedisProcess]
                                                                      ) -> None:
    """The lease it may have taken is given back behind the caller's error: awaited, the give-back waited a
    second store timeout (a 503 after 4 s of a 2 s timeout; found by a helper). It still lands once Redis
    answers."""
    server = redis_server()
    async with MemoryStore.from_url(server.url, identity=IDENTITY, op_timeout_s=2) as store, \
            MemoryStore.from_url(server.url, identity=IDENTITY) as other:
        info = await store.create(tensors=make_state(), mem_len=8)
        await store.get(info.session_id)  # the scripts loaded
        server.pause()
        try:
            await fails_fast(lambda: store.lease(info.session_id), within_s=3.5)  # one timeout of 2 s, not two
        finally:
            server.resume()
        deadline = time.monotonic() + 10  # the lease Redis took as it resumed is given back in the background
        while (await other._redis.lease_state(info.session_id))[0]:
            assert time.monotonic() < deadline, "the lease taken as Redis resumed was never given back"
            await asyncio.sleep(0.05)  # poll, bounded by the deadline
        async with other.lease(info.session_id) as lease:
            assert lease.version == 1


def _scripts_run(server: RedisProcess) -> int:
    client = redis.Redis(port=server.port, socket_timeout=5)
    try:
        return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
    finally:
        client.close()


async def test_a_commit_that_timed_out_is_refused_when_redis_resumes(
    redis_server: Callable[..., RedisProcess]
) -> None:
    """A commit sent to a Redis that stalls reaches it all the same once it resumes; the request that made it
    failed (503) by then, so Redis must refuse it (the commit's deadline, on Redis's clock), or a client that
    retries writes its text twice."""
    server = redis_server()
    async with (
        MemoryStore.from_url(server.url, identity=IDENTITY, op_timeout_s=OP_TIMEOUT_S, lease_ttl_ms=60_000) as store,
        MemoryStore.from_url(server.url, identity=IDENTITY, hot_cache_mb=0) as reader,
    ):
        info = await store.create(tensors=make_state(seed=1), mem_len=8, tokens_seen=8)
        async with store.lease(info.session_id) as lease:
            await store.commit(lease, make_state(seed=2), tokens_seen=16)  # the script is loaded: one EVALSHA next
            before = _scripts_run(server)
            server.pause()
            try:
                await fails_fast(lambda: store.commit(lease, make_state(seed=3), tokens_seen=24), within_s=3)
            finally:
                server.resume()
            deadline = time.monotonic() + 10
            while _scripts_run(server) == before:  # Redis runs the commit it had buffered as it resumes
                assert time.monotonic() < deadline, "the buffered commit never ran"
                await asyncio.sleep(0.01)  # poll, bounded by the deadline; the loop stays free
        got = await reader.get(info.session_id)
        assert got.version == 2 and got.info.tokens_seen == 16  # the failed commit did not land
        assert_same(got.tensors, make_state(seed=2))
        async with store.lease(info.session_id) as lease:  # and the session goes on from there
            await store.commit(lease, make_state(seed=4), tokens_seen=24)
        assert (await reader.get(info.session_id)).version == 3


async def test_a_commit_refused_by_a_clock_that_is_off_is_sent_again_on_the_refusing_nodes_clock(
    redis_server: Callable[..., RedisProcess]
) -> None:
    """A lease's clock can be off for a later write (another node after a slot migration or failover, a clock
    step): a refusal that comes back at all came from a Redis that answers, so the commit goes again, once, on
    the clock of the node that refused it."""
    from memory_store.redis_tier import RedisClock

    server = redis_server()
    async with MemoryStore.from_url(server.url, identity=IDENTITY, op_timeout_s=OP_TIMEOUT_S) as store:
        info = await store.create(tensors=make_state(seed=1), mem_len=8, tokens_seen=8)
        async with store.lease(info.session_id) as lease:
            assert lease.clock is not None
            lease.clock = RedisClock(lease.clock.redis_ms - 60_000, lease.clock.at)  # a node 60 s ahead
            before = _scripts_run(server)
            await store.commit(lease, make_state(seed=2), tokens_seen=16)
            assert _scripts_run(server) == before + 2  # refused once, then written
        got = await store.get(info.session_id)
        assert got.version == 2 and got.info.tokens_seen == 16


async def test_unreachable_redis_at_start(redis_server: Callable[..., RedisProcess]) -> None:
    server = redis_server()
    server.kill()
    store = MemoryStore.from_url(server.url, identity=IDENTITY, op_timeout_s=OP_TIMEOUT_S)
    await fails_fast(store.start, within_s=2)
    await fails_fast(store.ping, within_s=1)  # and it stays a clean, closed store


async def test_a_lease_that_expired_while_redis_was_away_is_an_outage_not_a_conflict(
    redis_server: Callable[..., RedisProcess], tmp_path: Path
) -> None:
    """Redis away for longer than a lease lasts: its holder's commit was a SessionConflict (a 409, "expired or was
    taken", as if another request had it), where nothing but the outage happened. It is StoreUnavailable (503)."""
    server = redis_server(tmp_path / "aof")
    async with MemoryStore.from_url(server.url, identity=IDENTITY, op_timeout_s=OP_TIMEOUT_S,
                                    lease_ttl_ms=900) as store:  # renewed every 0.3 s
        sid = (await store.create(tensors=make_state(seed=1), mem_len=8)).session_id
        lease = await store.lease(sid)
        server.kill()
        await asyncio.sleep(1.2)  # past the lease's TTL, on Redis's clock too: renewals fail meanwhile
        redis_server(server.data_dir, server.port)  # the lease key comes back from the AOF, expired
        deadline = time.monotonic() + 20
        while not lease.lost:  # the next renewal finds it gone
            assert time.monotonic() < deadline, "the lease was never found lost"
            await asyncio.sleep(0.05)
        assert lease.lost_to_outage
        with pytest.raises(StoreUnavailable, match="longer than the lease"):
            await store.commit(lease, make_state(seed=2), tokens_seen=16)
        await lease.release()
        async with store.lease(sid) as again:  # and the session is whole
            assert again.version == 1


async def test_a_burst_past_the_connection_pool_is_a_429_not_an_outage(redis_url: str) -> None:
    """Every pooled connection busy past the store's timeout: Redis answers, the server has more requests at once
    than connections. It was a 503 "Redis ... is unavailable: No connection available" (found by a helper with
    2,000 concurrent creates); it is a 429 to retry, and still a StoreUnavailable to what retries those."""
    import redis.asyncio

    from memory_store.metrics import StoreMetrics
    from memory_store.redis_tier import RedisTier
    from txlserve.errors import StoreOverloaded

    pool = redis.asyncio.BlockingConnectionPool.from_url(redis_url, max_connections=1, timeout=0.2, socket_timeout=10)
    client = redis.asyncio.Redis.from_pool(pool)
    watcher = redis.asyncio.Redis.from_url(redis_url)
    tier = RedisTier(client, where="test", ttl_s=60, lease_ttl_ms=1000, metrics=StoreMetrics())
    try:
        held = asyncio.ensure_future(client.blpop(["txl-test-never-pushed"], timeout=3))  # the one connection
        deadline = time.monotonic() + 10
        while not any(c.get("cmd") == "blpop" for c in await watcher.client_list()):
            assert time.monotonic() < deadline, "the blocking command never reached Redis"
            await asyncio.sleep(0.01)  # poll, bounded by the deadline
        with pytest.raises(StoreOverloaded) as err:
            await tier.ping()
        assert isinstance(err.value, StoreUnavailable) and err.value.status == 429
        assert err.value.type == "rate_limit_error" and "retry" in err.value.message
        await watcher.lpush("txl-test-never-pushed", "x")  # frees the connection
        assert await held is not None
        await tier.ping()
    finally:
        await watcher.delete("txl-test-never-pushed")
        await watcher.aclose()
        await client.aclose()


class ReplyDropper:
    """A TCP proxy between a store and Redis that passes every byte both ways, until armed with a marker (a
    script's sha): the connection whose request carries it is then cut as Redis's answer comes, the answer unsent.
    The script ran; only its reply was lost, as when a connection is reset (CLIENT KILL, a proxy, a failover)."""

    def __init__(self, redis_url: str) -> None:
        self.port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
        self.marker: bytes | None = None
        self.cut = 0  # connections cut so far
        self.seen_after_cut = 0  # requests carrying the last marker after its connection was cut: sent again
        self._last: bytes | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        doomed = asyncio.Event()

        async def requests() -> None:
            while data := await reader.read(1 << 16):
                if self._last is not None and self._last in data:
                    self.seen_after_cut += 1
                if self.marker is not None and self.marker in data:
                    self._last, self.marker = self.marker, None
                    doomed.set()
                up_writer.write(data)
                await up_writer.drain()

        async def replies() -> None:
            while data := await up_reader.read(1 << 16):
                if doomed.is_set():  # the marked request's answer: never delivered
                    self.cut += 1
                    writer.transport.abort()
                    up_writer.close()
                    return
                writer.write(data)
                await writer.drain()

        tasks = [asyncio.create_task(requests()), asyncio.create_task(replies())]
        self._tasks.update(tasks)
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        writer.transport.abort()
        up_writer.close()


async def test_a_script_whose_reply_was_lost_to_a_broken_connection_stands_when_sent_again(redis_url: str) -> None:
    """redis-py sends a command again on a new connection when the first broke. A write whose reply alone was lost
    had run, and the script sent again was answered for its own effects: a commit that landed was a 409 'changed
    since it was leased' (a client that retried wrote its text twice), a creation 'already exists', and a lease
    taken was BUSY to its taker, then to everyone for its TTL (found by a helper, with CLIENT KILL). Each script
    that writes now finds its own write and stands."""
    dropper = ReplyDropper(redis_url)
    async with dropper as url, MemoryStore.from_url(url, identity=IDENTITY, op_timeout_s=2) as store:
        tier = store._redis
        await tier.load_scripts()
        info = await store.create(owner="u", tensors=make_state(seed=1), mem_len=8, tokens_seen=8)
        dropper.marker = tier._write.sha.encode()
        made = await store.create(owner="u", tensors=make_state(seed=2), mem_len=8, tokens_seen=8)  # no 409
        assert (await store.info(made.session_id, owner="u")).version == 1
        assert [dropper.cut, dropper.seen_after_cut] == [1, 1]  # cut, and sent again
        for step in range(2):  # a commit that keeps its lease, then one that gives it back with its write
            dropper.marker = tier._acquire.sha.encode()
            async with store.lease(info.session_id, owner="u") as lease:  # not BUSY to its own taker
                dropper.marker = tier._write.sha.encode()
                done = await store.commit(lease, make_state(seed=3 + step), tokens_seen=16 + 8 * step,
                                          release=step == 1)
                assert done.version == 2 + step
        assert dropper.cut == 5 and dropper.seen_after_cut >= 5
        async with store.lease(info.session_id, owner="u") as lease:  # free: no lease left behind
            assert lease.version == 3
        got = await store.get(info.session_id, owner="u")
        assert got.info.tokens_seen == 24
        assert_same(got.tensors, make_state(seed=4))
        raw = await tier.read(info.session_id, "u", payload=False)
        renamed = codec.encode_header(dataclasses.replace(codec.decode_header(raw[0]), metadata={"k": "v"}))
        dropper.marker = tier._set_header.sha.encode()
        assert await tier.set_header(info.session_id, header=renamed, expected=raw[0]) == "OK"  # not CONFLICT
        assert (await store.info(info.session_id, owner="u")).metadata == {"k": "v"}
        assert dropper.cut == 6


async def test_a_connection_redis_py_closed_under_a_call_is_an_outage_not_a_500(store: MemoryStore) -> None:
    """redis-py's cluster client closes a connection another coroutine still uses as a slot moves or a node
    fails: that call raises RuntimeError or AttributeError from inside redis-py or asyncio (a 500, and a lease's
    background release died of it; found by a helper). Raised there, it is the store's outage; raised in our own
    code, it stays what it is."""
    tier = store._redis
    inside: dict[str, object] = {"__name__": "redis.asyncio.connection"}
    exec("def send():\n    raise RuntimeError('unable to perform operation on <TCPTransport closed=True>')\n"
         "def write():\n    None.writelines([])", inside)
    for call in (inside["send"], inside["write"]):
        with pytest.raises(StoreUnavailable, match="dropped a connection in use"), tier._translate():
            call()  # type: ignore[operator]
    with pytest.raises(RuntimeError, match="ours"), tier._translate():
        raise RuntimeError("ours")
    exec("def misused():\n    [].items()", inside)  # ours, failing inside redis-py: not an outage
    with pytest.raises(AttributeError, match="'list' object"), tier._translate():
        inside["misused"]()  # type: ignore[operator]

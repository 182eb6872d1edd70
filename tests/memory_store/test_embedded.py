"""The embedded Redis: start, join, stale sockets, and commits that survive kill -9."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from memory_store import MemoryStore
from memory_store.embedded import EmbeddedRedis
from tests.memory_store import holder
from tests.memory_store.support import IDENTITY, assert_same, make_state, start_holder
from tests.procs import pid_alive
from txlserve.errors import SessionBusy, StoreUnavailable

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    """A data dir whose redis-server, if one is left running (an orphan), is killed at the end."""
    yield tmp_path
    pidfile = tmp_path / "redis.pid"
    if pidfile.exists():
        pid = int(pidfile.read_text())
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


async def test_start_join_and_stop(data_dir: Path) -> None:
    first = MemoryStore.from_url(None, identity=IDENTITY, data_dir=str(data_dir))
    async with first:
        assert (data_dir / "redis.sock").exists()
        info = await first.create(tensors=make_state(seed=1), mem_len=8)
        async with MemoryStore.from_url(None, identity=IDENTITY, data_dir=str(data_dir)) as second:
            assert_same((await second.get(info.session_id)).tensors, make_state(seed=1))
        await first.ping()  # the joiner did not stop the server it did not start
        pid = int((data_dir / "redis.pid").read_text())
    assert not pid_alive(pid) and not (data_dir / "redis.sock").exists()

    async with MemoryStore.from_url(None, identity=IDENTITY, data_dir=str(data_dir)) as again:
        assert_same((await again.get(info.session_id)).tensors, make_state(seed=1))


async def test_a_data_dir_of_any_name(tmp_path: Path) -> None:
    """Redis's config read JSON's escapes of the path: a data dir named with a letter outside ASCII (or a quote, a
    backslash) named another directory, and Redis exited at start."""
    data_dir = tmp_path / 'données "q" \\ é'
    try:
        async with MemoryStore.from_url(None, identity=IDENTITY, data_dir=str(data_dir)) as store:
            info = await store.create(tensors=make_state(seed=2), mem_len=8)
            assert (data_dir / "redis.sock").exists() and (data_dir / "redis.pid").exists()
        async with MemoryStore.from_url(None, identity=IDENTITY, data_dir=str(data_dir)) as again:  # durable there
            assert_same((await again.get(info.session_id)).tensors, make_state(seed=2))
        # sessions hold users' text: the directory and Redis's files are the owner's alone (its files were 0644)
        written = [p for p in (data_dir, *data_dir.rglob("*")) if p.name not in ("redis.conf", "redis.lock",
                                                                                   "redis.starter")]  # no text
        assert any("appendonly" in p.name for p in written), written
        assert all(p.stat().st_mode & 0o077 == 0 for p in written), {str(p): oct(p.stat().st_mode) for p in written}
    finally:
        pidfile = data_dir / "redis.pid"
        if pidfile.exists() and pid_alive(pid := int(pidfile.read_text())):
            os.kill(pid, signal.SIGKILL)


async def test_the_starter_leaves_the_server_running_for_a_process_that_joined_it(data_dir: Path) -> None:
    """Two servers on one data dir: stopping the one that started Redis stopped it under the other, whose every
    request was then a 503 for good."""
    first = MemoryStore.from_url(None, identity=IDENTITY, data_dir=str(data_dir))
    await first.start()
    pid = int((data_dir / "redis.pid").read_text())
    proc, report = await start_holder("--data-dir", str(data_dir))  # another process joins and holds a lease
    try:
        await first.aclose()
        assert pid_alive(pid)  # left running for the holder
        async with MemoryStore.from_url(None, identity=IDENTITY, data_dir=str(data_dir)) as again:
            assert int((data_dir / "redis.pid").read_text()) == pid  # joined, not restarted
            got = await again.get(report["session_id"], owner=holder.OWNER)
            assert_same(got.tensors, make_state(seed=holder.COMMITTED_SEED))
    finally:
        proc.kill()
        await proc.wait()


def test_concurrent_starts_make_one_server(data_dir: Path) -> None:
    starters = [EmbeddedRedis(data_dir) for _ in range(4)]
    with ThreadPoolExecutor(len(starters)) as pool:
        list(pool.map(lambda e: e.start(), starters))
    try:
        assert sum(e.owned for e in starters) == 1
    finally:
        for embedded in starters:
            embedded.stop()


def test_stale_socket_is_replaced(data_dir: Path) -> None:
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(data_dir / "redis.sock"))  # a socket file nobody listens on
    stale.close()
    embedded = EmbeddedRedis(data_dir)
    embedded.start()
    try:
        assert embedded.owned
    finally:
        embedded.stop()


def test_a_silent_live_server_is_never_doubled(data_dir: Path) -> None:
    embedded = EmbeddedRedis(data_dir)
    embedded.start()
    pid = int((data_dir / "redis.pid").read_text())
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(StoreUnavailable, match="does not answer"):
            EmbeddedRedis(data_dir, start_timeout_s=5).start()
    finally:
        os.kill(pid, signal.SIGCONT)
        embedded.stop()


def test_too_long_a_data_dir_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreUnavailable, match="too long"):
        EmbeddedRedis(tmp_path / ("d" * 120)).start()


async def test_commits_survive_kill_9_of_the_starting_process(data_dir: Path) -> None:
    proc, report = await start_holder("--data-dir", str(data_dir), "--lease-ttl-ms", "500")
    proc.kill()  # SIGKILL: no cleanup of any kind
    await proc.wait()
    session_id = report["session_id"]

    # The orphaned server is still running: a new process joins it, and the dead holder's lease expires.
    orphan = int((data_dir / "redis.pid").read_text())
    async with MemoryStore.from_url(None, identity=IDENTITY, data_dir=str(data_dir)) as store:
        deadline = time.monotonic() + 30
        while True:
            try:
                lease = await store.lease(session_id, owner=holder.OWNER)
                break
            except SessionBusy:
                assert time.monotonic() < deadline, "the killed holder's lease never expired"
                await asyncio.sleep(0.05)  # poll
        async with lease:
            assert lease.version == report["version"]
            assert_same(lease.session.tensors, make_state(seed=holder.COMMITTED_SEED))

    # The joiner, its last user, stopped the orphan as it left (every later server joined it and left it running,
    # so it ran for good: found by a helper); the next store starts a new one from the AOF.
    assert not pid_alive(orphan)
    async with MemoryStore.from_url(None, identity=IDENTITY, data_dir=str(data_dir)) as store:
        got = await store.get(session_id, owner=holder.OWNER)
        assert got.version == report["version"]
        assert_same(got.tensors, make_state(seed=holder.COMMITTED_SEED))
        assert int((data_dir / "redis.pid").read_text()) != orphan

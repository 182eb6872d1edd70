"""The store on a real three-primary Redis Cluster (``redis+cluster://``): every key of a session in one slot,
the whole session lifecycle, compare-and-set between two stores, the cold tier across primaries, and a session's
slot migrated to another primary while a lease on it is held."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

import pytest
import redis
import torch

from memory_store import MemoryStore
from memory_store.redis_tier import lease_key, ring_key, session_key
from tests.memory_store.support import IDENTITY, assert_same, make_state, new_owner
from txlserve.errors import SessionBusy, SessionConflict, SessionNotFound

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]
TOKENIZED = dataclasses.replace(IDENTITY, tokenizer="byte:test")


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    return {**make_state(seed=seed), "window": torch.arange(10, dtype=torch.int32)}


@pytest.fixture
async def stores(redis_cluster_url: str) -> AsyncIterator[tuple[MemoryStore, MemoryStore]]:
    async with (
        MemoryStore.from_url(redis_cluster_url, identity=TOKENIZED, hot_cache_mb=0) as a,
        MemoryStore.from_url(redis_cluster_url, identity=TOKENIZED, hot_cache_mb=0) as b,
    ):
        yield a, b


def _nodes(url: str) -> redis.RedisCluster:
    host, port = url.removeprefix("redis+cluster://").split(":")
    return redis.RedisCluster(host=host, port=int(port), socket_timeout=5)


async def test_a_session_lives_in_one_slot_and_its_lifecycle_works(stores, redis_cluster_url) -> None:
    a, b = stores
    owner = new_owner()
    infos = [await a.create(tensors=_state(i), mem_len=8, tokens_seen=20, owner=owner) for i in range(12)]
    cluster = _nodes(redis_cluster_url)
    try:
        slots = {cluster.keyslot(session_key(i.session_id)) for i in infos}
        assert all(cluster.keyslot(session_key(i.session_id)) == cluster.keyslot(lease_key(i.session_id))
                   == cluster.keyslot(ring_key(i.session_id)) for i in infos)
        owners = {cluster.nodes_manager.get_node_from_slot(s).name for s in slots}
        assert len(owners) > 1  # the sessions are spread over the primaries
    finally:
        cluster.close()
    listed, _ = await a.list(owner=owner, limit=100)
    assert {i.session_id for i in listed} == {i.session_id for i in infos}
    sid = infos[0].session_id
    assert_same((await b.get(sid, owner=owner)).tensors, {k: v for k, v in _state(0).items()})
    async with a.lease(sid, owner=owner) as lease:
        with pytest.raises(SessionBusy):
            await b.lease(sid, owner=owner)
        await a.commit(lease, _state(7), tokens_seen=21)
        await b.put(sid, _state(9), mem_len=8, tokens_seen=22, owner=owner)  # a write that bypasses the lease
        with pytest.raises(SessionConflict):  # so the holder's next commit is refused, not silently undone
            await a.commit(lease, _state(8), tokens_seen=23)
    assert (await b.info(sid, owner=owner)).version == 3
    async with a.lease(sid, owner=owner):  # a metadata update: one script on the session's slot
        with pytest.raises(SessionBusy):
            await b.update_metadata(sid, {"k": "v"}, owner=owner)
    assert (await b.update_metadata(sid, {"k": "v"}, owner=owner)).version == 3
    assert await a.sweep(idle_s=0) >= len(infos)  # every primary is swept
    assert {(await b.info(i.session_id, owner=owner)).tier for i in infos} == {"cold"}
    assert (await a.info(sid, owner=owner)).metadata == {"k": "v"}
    await b.delete(sid, owner=owner)
    with pytest.raises(SessionNotFound):
        await a.get(sid, owner=owner)


def _migrate(cluster: redis.RedisCluster, slot: int) -> None:
    """Move ``slot`` to another primary as redis-cli --cluster reshard does: IMPORTING, MIGRATING, MIGRATE each
    key, then SETSLOT NODE on every primary."""
    src = cluster.nodes_manager.get_node_from_slot(slot)
    dst = next(n for n in cluster.get_primaries() if n.name != src.name)
    src_id = cluster.execute_command("CLUSTER", "MYID", target_nodes=src).decode()
    dst_id = cluster.execute_command("CLUSTER", "MYID", target_nodes=dst).decode()
    cluster.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id, target_nodes=dst)
    cluster.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id, target_nodes=src)
    while keys := cluster.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100, target_nodes=src):
        cluster.execute_command("MIGRATE", dst.host, dst.port, "", 0, 5000, "KEYS", *keys, target_nodes=src)
    # the destination first (it bumps its config epoch), then the source, then the others, as the CLUSTER
    # SETSLOT docs prescribe: in another order a node could take stale gossip from the source (its older epoch
    # still the highest) and send MOVED back to it, and a client bounced between them gave up ("TTL exhausted")
    others = [n for n in cluster.get_primaries() if n.name not in (src.name, dst.name)]
    for node in (dst, src, *others):
        cluster.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id, target_nodes=node)


async def test_a_slot_migrated_mid_lease_keeps_the_session_and_its_lease(stores, redis_cluster_url) -> None:
    a, b = stores
    info = await a.create(tensors=_state(1), mem_len=8, tokens_seen=20)
    sid = info.session_id
    cluster = _nodes(redis_cluster_url)
    try:
        slot = cluster.keyslot(session_key(sid))
        before = cluster.nodes_manager.get_node_from_slot(slot).name
        async with a.lease(sid) as lease:
            _migrate(cluster, slot)  # the session and its lease move to another primary
            with pytest.raises(SessionBusy):  # the lease moved with it
                await b.lease(sid)
            await a.commit(lease, _state(2), tokens_seen=21)  # redis-py follows MOVED to the new primary
        cluster.nodes_manager.initialize()
        assert cluster.nodes_manager.get_node_from_slot(slot).name != before
    finally:
        cluster.close()
    got = await b.get(sid)
    assert got.version == 2 and got.info.tokens_seen == 21
    assert_same(got.tensors, _state(2))


async def test_a_lease_stands_while_the_owner_indexs_primary_does_not_answer(tmp_path) -> None:
    """In a cluster the owner index lives on another primary, touched beside the lease script: with that primary
    paused, the touch's timeout failed the lease call after the script had taken the lease, and nothing gave it
    back (the session was busy to everyone for the lease's TTL). The touch is best effort now, and its timeout is
    not retried (each lease waited for it twice, then twice more for the read's own touch)."""
    import secrets

    from memory_store.redis_tier import owner_key
    from tests.conftest import RedisClusterProcesses

    cluster = RedisClusterProcesses(tmp_path / "cluster").start()
    nodes = _nodes(cluster.url)
    try:
        async with MemoryStore.from_url(cluster.url, identity=TOKENIZED, hot_cache_mb=0, op_timeout_s=1.0) as a, \
                MemoryStore.from_url(cluster.url, identity=TOKENIZED, hot_cache_mb=0, op_timeout_s=1.0) as b:
            while True:  # an owner whose index is on another primary than the session
                owner = "o-" + secrets.token_hex(4)
                info = await a.create(tensors=_state(), mem_len=8, tokens_seen=20, owner=owner)
                node_of = [nodes.nodes_manager.get_node_from_slot(nodes.keyslot(key)).port
                           for key in (session_key(info.session_id), owner_key(owner))]
                if node_of[0] != node_of[1]:
                    break
            async with a.lease(info.session_id, owner=owner):  # the scripts are loaded on every primary
                pass
            paused = next(node for node in cluster.nodes if node.port == node_of[1])
            paused.pause()
            try:
                started = time.monotonic()
                async with a.lease(info.session_id, owner=owner) as lease:
                    # the touch's timeout, and the map re-read after it: not retried (it was, and took 4 s)
                    assert time.monotonic() - started < 3.5
                    assert lease.version == 1
                    with pytest.raises(SessionBusy):
                        await b.lease(info.session_id, owner=owner)
            finally:
                paused.resume()
            async with b.lease(info.session_id, owner=owner):  # released as always
                pass
    finally:
        nodes.close()
        cluster.stop()


async def test_a_primary_that_stops_answering_fails_cleanly_and_what_it_missed_is_done_after(tmp_path) -> None:
    """Found by a helper on a cluster of six: a listing that met a node which did not answer decoded the error as
    a header (a 500); a session made while its owner's index's primary failed over was never listed, though its
    201 was given; a delete whose index entry could not be dropped was a 503 (its retry a 404); and /ready said
    200 while a slot had no node (every session in it a 503)."""
    import asyncio
    import contextlib
    import secrets

    from memory_store.redis_tier import owner_key
    from tests.conftest import RedisClusterProcesses
    from txlserve.errors import StoreUnavailable

    cluster = RedisClusterProcesses(tmp_path / "cluster").start()
    nodes = _nodes(cluster.url)

    def port_of(key: str) -> int:
        return nodes.nodes_manager.get_node_from_slot(nodes.keyslot(key)).port

    try:
        async with MemoryStore.from_url(cluster.url, identity=TOKENIZED, hot_cache_mb=0, op_timeout_s=1.0) as a:
            while True:  # an owner whose index is on another primary than its first session
                owner = "o-" + secrets.token_hex(4)
                first = await a.create(tensors=_state(), mem_len=8, tokens_seen=20, owner=owner)
                if port_of(session_key(first.session_id)) != port_of(owner_key(owner)):
                    break
            await a.list(owner=owner)  # every node's connection made
            node = {n.port: n for n in cluster.nodes}
            node[port_of(session_key(first.session_id))].pause()
            try:
                with pytest.raises(StoreUnavailable):  # not a TypeError from decoding the node's error
                    await a.list(owner=owner)
            finally:
                node[port_of(session_key(first.session_id))].resume()

            index_node = node[port_of(owner_key(owner))]
            index_node.kill()  # gone for a moment (a failover's few seconds): what is sent it is lost, not delayed
            try:
                made = []
                while len(made) < 2:  # sessions on the primaries that answer: stored, their listing owed
                    with contextlib.suppress(StoreUnavailable):  # its id fell in the killed primary's slots
                        made.append((await a.create(tensors=_state(), mem_len=8, tokens_seen=20,
                                                    owner=owner)).session_id)
                await a.delete(made[1], owner=owner)  # done, though its entry in the list could not be dropped
            finally:
                index_node.start()  # its append-only file and nodes.conf: back in the cluster

            async def listed() -> set[str]:
                with contextlib.suppress(StoreUnavailable):  # the node back says "cluster down" a moment
                    return {i.session_id for i in (await a.list(owner=owner, limit=100))[0]}
                return set()

            deadline = time.monotonic() + 30
            while made[0] not in await listed():
                assert time.monotonic() < deadline, "a session made while its owner's list was away is not listed"
                await asyncio.sleep(0.1)  # poll, bounded by the deadline
            assert await listed() == {first.session_id, made[0]}  # the deleted one not among them

            await a.ping()
            slot = nodes.keyslot(session_key(first.session_id))
            holder = redis.Redis(port=port_of(session_key(first.session_id)), socket_timeout=5)
            try:
                holder.execute_command("CLUSTER", "DELSLOTS", slot)  # a slot with no node: the cluster is down
                deadline = time.monotonic() + 10
                while holder.execute_command("CLUSTER", "INFO").decode().find("cluster_state:fail") < 0:
                    assert time.monotonic() < deadline, "the cluster never said it was down"
                    await asyncio.sleep(0.05)  # poll, bounded by the deadline
                with pytest.raises(StoreUnavailable, match="cluster_state"):
                    await a.ping()
            finally:
                holder.execute_command("CLUSTER", "ADDSLOTS", slot)
                holder.close()
    finally:
        nodes.close()
        cluster.stop()

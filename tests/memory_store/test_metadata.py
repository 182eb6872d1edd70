"""Metadata updates against a real Redis: merged key by key, header only, the memory's version and hot copy kept,
refused under a lease, never undone by a sweep or another writer."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio
import torch

from memory_store import MemoryStore, codec
from memory_store.redis_tier import ring_key, session_key
from tests.memory_store.support import IDENTITY, assert_same, make_state, new_owner
from txlserve.errors import InvalidRequestError, PayloadTooLarge, SessionBusy, SessionNotFound

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

TOKENIZED = dataclasses.replace(IDENTITY, tokenizer="byte:test")


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def _with_window(n: int = 20, seed: int = 0) -> dict[str, torch.Tensor]:
    return {**make_state(seed=seed), "window": torch.arange(n, dtype=torch.int32)}


async def test_an_update_merges_keys_and_keeps_the_memory_and_its_hot_copy(store: MemoryStore,
                                                                           other_store: MemoryStore) -> None:
    owner, state = new_owner(), make_state(seed=5)
    made = await store.create(owner=owner, tensors=state, mem_len=8, tokens_seen=5,
                              metadata={"a": "1", "b": "2"})
    got = await store.update_metadata(made.session_id, {"b": None, "c": "3"}, owner=owner)
    assert got.metadata == {"a": "1", "c": "3"}
    assert (got.version, got.updated_at, got.tier, got.tokens_seen) == (made.version, made.updated_at, "hot", 5)
    hits, misses = store.metrics.hot_hits, store.metrics.hot_misses
    hot = await store.get(made.session_id, owner=owner)  # its hot copy still stands for it: no load from Redis
    assert (store.metrics.hot_hits, store.metrics.hot_misses) == (hits + 1, misses)
    assert hot.info.metadata == {"a": "1", "c": "3"} and hot.info.tier == "hot"
    far = await other_store.get(made.session_id, owner=owner)  # and Redis holds the new header over the old memory
    assert far.info.metadata == {"a": "1", "c": "3"} and far.info.tier == "redis"
    assert_same(far.tensors, state)
    assert (await store.update_metadata(made.session_id, {"a": None, "c": None}, owner=owner)).metadata == {}


async def test_an_update_that_changes_nothing_writes_nothing(store: MemoryStore, raw: redis.asyncio.Redis) -> None:
    made = await store.create(tensors=make_state(), mem_len=8, metadata={"a": "1"})
    before = await raw.hget(session_key(made.session_id), "header")
    for same in ({}, {"a": "1"}, {"gone": None}):
        assert (await store.update_metadata(made.session_id, same)).metadata == {"a": "1"}
        assert await raw.hget(session_key(made.session_id), "header") == before


async def test_the_next_commit_keeps_the_updated_metadata(store: MemoryStore, other_store: MemoryStore) -> None:
    made = await store.create(tensors=make_state(m=3), mem_len=8, tokens_seen=3, metadata={"title": "old"})
    await other_store.update_metadata(made.session_id, {"title": "new"})  # another replica's update
    async with store.lease(made.session_id) as lease:
        assert lease.session.info.tier == "hot"  # the update left this replica's copy current
        info = await store.commit(lease, make_state(m=4), tokens_seen=4)
    assert info.metadata == {"title": "new"} and info.version == made.version + 1
    assert (await other_store.info(made.session_id)).metadata == {"title": "new"}


async def test_a_leased_session_refuses_an_update(store: MemoryStore) -> None:
    made = await store.create(tensors=make_state(), mem_len=8, metadata={"k": "v"})
    async with store.lease(made.session_id) as lease:
        with pytest.raises(SessionBusy, match="once that request ends"):
            await store.update_metadata(made.session_id, {"k": "w"})
        await store.commit(lease, make_state(seed=1), tokens_seen=1)  # writes the header it leased, as ever
    assert (await store.info(made.session_id)).metadata == {"k": "v"}
    assert (await store.update_metadata(made.session_id, {"k": "w"})).metadata == {"k": "w"}


async def test_updates_at_once_each_land(store: MemoryStore, other_store: MemoryStore) -> None:
    made = await store.create(tensors=make_state(), mem_len=8)
    stores = [store, other_store] * 4
    await asyncio.gather(*(s.update_metadata(made.session_id, {f"k{i}": str(i)}) for i, s in enumerate(stores)))
    assert (await store.info(made.session_id)).metadata == {f"k{i}": str(i) for i in range(8)}


async def test_a_sweep_that_read_the_old_header_does_not_write_it_back(redis_url: str) -> None:
    """A demotion compares the header it read: a version compared alone let it write back metadata changed since
    (an update keeps the version)."""
    async with MemoryStore.from_url(redis_url, identity=TOKENIZED) as store:
        made = await store.create(tensors=_with_window(), mem_len=8, tokens_seen=30, metadata={"v": "1"})
        tier = store._redis
        read, payload, _ = await tier.read(made.session_id, None, payload=True)
        header = codec.decode_header(read)
        cold = dataclasses.replace(header, form=codec.WINDOW_FORM, format_version=2)
        await store.update_metadata(made.session_id, {"v": "2"})
        assert await tier.demote(made.session_id, header=codec.encode_header(cold), payload=payload,
                                 expected=read) == "CONFLICT"
        assert (await store.info(made.session_id)).metadata == {"v": "2"}
        assert await store.demote(made.session_id)  # the sweep's next look reads the new header
        after = await store.info(made.session_id)
        assert after.tier == "cold" and after.metadata == {"v": "2"}
        assert (await store.update_metadata(made.session_id, {"v": "3"})).tier == "cold"  # a cold one's too
        assert (await store.get(made.session_id)).info.metadata == {"v": "3"}


async def test_an_update_starts_the_idle_ttl_again(redis_url: str, raw: redis.asyncio.Redis) -> None:
    async with MemoryStore.from_url(redis_url, identity=IDENTITY, ttl_s=60) as store:
        made = await store.create(tensors=make_state(), mem_len=8)
        for key in (session_key(made.session_id), ring_key(made.session_id)):
            await raw.pexpire(key, 50_000)  # within the read's slack: its touch leaves it
        started = time.monotonic()
        await store.update_metadata(made.session_id, {"k": "v"})
        for key in (session_key(made.session_id), ring_key(made.session_id)):
            assert await raw.pttl(key) > 60_000 - 1000 * (time.monotonic() - started) - 50
    async with MemoryStore.from_url(redis_url, identity=IDENTITY, ttl_s=0) as forever:
        made = await forever.create(tensors=make_state(), mem_len=8)
        await raw.pexpire(session_key(made.session_id), 50_000)
        await forever.update_metadata(made.session_id, {"k": "v"})
        assert await raw.pttl(session_key(made.session_id)) == -1


async def test_updates_refused(store: MemoryStore, raw: redis.asyncio.Redis) -> None:
    owner = new_owner()
    made = await store.create(owner=owner, tensors=make_state(), mem_len=8, metadata={"a": "1", "b": "2"})
    before = await raw.hget(session_key(made.session_id), "header")
    with pytest.raises(SessionNotFound):  # another owner's does not exist
        await store.update_metadata(made.session_id, {"k": "v"}, owner="someone else")
    with pytest.raises(SessionNotFound):
        await store.update_metadata("no-such-session", {"k": "v"})
    with pytest.raises(InvalidRequestError, match="3 keys, over 2: remove keys by setting them to null"):
        await store.update_metadata(made.session_id, {"c": "3"}, owner=owner, max_keys=2)
    assert await raw.hget(session_key(made.session_id), "header") == before  # nothing written by the refusals
    assert (await store.update_metadata(made.session_id, {"a": None, "c": "3"}, owner=owner, max_keys=2)).metadata \
        == {"b": "2", "c": "3"}  # the bound is on the result: one removed, one added
    before = await raw.hget(session_key(made.session_id), "header")
    with pytest.raises(PayloadTooLarge):
        await store.update_metadata(made.session_id, {"big": "x" * (codec.MAX_METADATA_BYTES + 1)}, owner=owner)
    for bad in (["k", "v"], {1: "v"}, "k=v"):
        with pytest.raises(InvalidRequestError, match="JSON object"):
            await store.update_metadata(made.session_id, bad, owner=owner)  # type: ignore[arg-type]
    assert await raw.hget(session_key(made.session_id), "header") == before
    assert json.loads(before)["metadata"] == {"b": "2", "c": "3"}

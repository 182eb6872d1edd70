"""Commits that only appended tokens write only their rows of the stored memory (the ring), and read back
exactly as whole writes do; a stored record the rows do not apply to is written whole."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator

import pytest
import redis.asyncio
import safetensors.torch
import torch

from memory_store import MemoryStore
from memory_store.redis_tier import ring_key, session_key
from tests.memory_store.support import D_MODEL, IDENTITY, N_LAYER, assert_same
from txlserve.errors import PayloadTooLarge, SessionCorrupt

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

MEM_LEN = 64
ROW_BYTES = N_LAYER * D_MODEL * 4  # one position's slot: every layer's row
RING_BYTES = MEM_LEN * ROW_BYTES


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def document(tokens: int, seed: int = 0) -> torch.Tensor:
    """Hidden states of a document, one row per token: [n_layer, tokens, d_model]."""
    return torch.randn(N_LAYER, tokens, D_MODEL, generator=torch.Generator().manual_seed(seed))


def state_after(doc: torch.Tensor, seen: int) -> dict[str, torch.Tensor]:
    """The session after ``seen`` tokens of ``doc``: its last mem_len rows, oldest first."""
    return {"mems": doc[:, max(0, seen - MEM_LEN):seen].clone(), "last_logits": doc[0, seen - 1, :5].clone()}


async def sent_bytes(raw: redis.asyncio.Redis) -> int:
    return (await raw.info("stats"))["total_net_input_bytes"]


async def test_appending_commits_send_only_new_rows_and_read_back_exactly(
    store: MemoryStore, other_store: MemoryStore, raw: redis.asyncio.Redis
) -> None:
    doc = document(400)
    info = await store.create(tensors=state_after(doc, 60), mem_len=MEM_LEN, tokens_seen=60)
    seen = 60
    for n in (3, 10, 1, 50, 63, 7):  # 60 + 3 + 10 wraps the ring's end; 63 rewrites all but one slot
        async with store.lease(info.session_id, tensors=False) as lease:
            before = await sent_bytes(raw)
            await store.commit(lease, state_after(doc, seen + n), tokens_seen=seen + n, appended=True)
            sent = await sent_bytes(raw) - before
        seen += n
        rows = n * ROW_BYTES
        assert rows <= sent < rows + 3000, (n, sent)  # the new rows, a header and the scores; not the ring
        got = await other_store.get(info.session_id)  # no hot copy there: read from Redis
        assert got.info.tier == "redis" and got.info.tokens_seen == seen
        assert_same(got.tensors, state_after(doc, seen))
        other_store._hot.discard(info.session_id)
    async with store.lease(info.session_id, tensors=False) as lease:  # a whole write, for comparison
        before = await sent_bytes(raw)
        await store.commit(lease, state_after(doc, seen + 2), tokens_seen=seen + 2)
        assert await sent_bytes(raw) - before > RING_BYTES


async def test_more_new_tokens_than_the_ring_holds_are_written_whole(store: MemoryStore,
                                                                     other_store: MemoryStore) -> None:
    doc = document(300, seed=1)
    info = await store.create(tensors=state_after(doc, 10), mem_len=MEM_LEN, tokens_seen=10)
    async with store.lease(info.session_id, tensors=False) as lease:
        await store.commit(lease, state_after(doc, 10 + MEM_LEN + 5), tokens_seen=10 + MEM_LEN + 5, appended=True)
    assert_same((await other_store.get(info.session_id)).tensors, state_after(doc, 10 + MEM_LEN + 5))


async def test_a_record_the_rows_do_not_apply_to_is_written_whole(
    store: MemoryStore, other_store: MemoryStore, raw: redis.asyncio.Redis
) -> None:
    """An older server's record (mems in the payload), or one stored in another dtype: the patch is refused in
    Redis (nothing written) and the commit writes the whole ring."""
    doc = document(200, seed=2)
    info = await store.create(tensors=state_after(doc, 30), mem_len=MEM_LEN, tokens_seen=30)
    key = session_key(info.session_id)
    header = json.loads(await raw.hget(key, "header"))
    old = safetensors.torch.save(state_after(doc, 30))  # format 1: mems in the payload, no ring
    header.update(format_version=1, payload_bytes=len(old))
    del header["mem_rows"]
    await raw.hset(key, mapping={"header": json.dumps(header), "payload": old})
    await raw.delete(ring_key(info.session_id))
    store._hot.discard(info.session_id)
    assert_same((await other_store.get(info.session_id)).tensors, state_after(doc, 30))  # still reads
    other_store._hot.discard(info.session_id)

    async with store.lease(info.session_id, tensors=False) as lease:
        await store.commit(lease, state_after(doc, 34), tokens_seen=34, appended=True)
    assert await raw.strlen(ring_key(info.session_id)) == 34 * ROW_BYTES  # 34 tokens: 34 slots so far
    assert b"mems" not in await raw.hget(key, "payload")
    assert_same((await other_store.get(info.session_id)).tensors, state_after(doc, 34))
    other_store._hot.discard(info.session_id)

    half = {name: t.to(torch.bfloat16) if name == "mems" else t for name, t in state_after(doc, 40).items()}
    async with store.lease(info.session_id, tensors=False) as lease:  # stored in bf16 (a storage_dtype setting)
        await store.commit(lease, half, tokens_seen=40, appended=True)
    async with store.lease(info.session_id, tensors=False) as lease:  # then fp32 again: same length, new dtype
        await store.commit(lease, state_after(doc, 42), tokens_seen=42, appended=True)
    assert_same((await other_store.get(info.session_id)).tensors, state_after(doc, 42))


async def test_the_ring_lives_and_dies_with_its_session(redis_url: str, raw: redis.asyncio.Redis) -> None:
    doc = document(100, seed=3)
    async with MemoryStore.from_url(redis_url, identity=IDENTITY, ttl_s=60) as store:
        info = await store.create(tensors=state_after(doc, 20), mem_len=MEM_LEN, tokens_seen=20)
        ring = ring_key(info.session_id)
        assert 0 < await raw.pttl(ring) <= 60_000 and await raw.strlen(ring) == 20 * ROW_BYTES
        await raw.persist(ring)
        async with store.lease(info.session_id, tensors=False) as lease:  # a lease refreshes both TTLs
            assert 0 < await raw.pttl(ring) <= 60_000
            await raw.persist(ring)
            await store.commit(lease, state_after(doc, 25), tokens_seen=25, appended=True)
        assert 0 < await raw.pttl(ring) <= 60_000  # and so does a commit
        await raw.pexpire(ring, 1000)  # a ring whose TTL lags its record's (an older replica touched only that)
        await store.info(info.session_id)  # a use refreshes each key that needs it
        assert await raw.pttl(ring) > 50_000
        await store.delete(info.session_id)
        assert not await raw.exists(ring, session_key(info.session_id))


async def test_a_missing_or_truncated_ring_is_corrupt_not_a_crash(
    store: MemoryStore, other_store: MemoryStore, raw: redis.asyncio.Redis
) -> None:
    info = await store.create(tensors=state_after(document(50), 20), mem_len=MEM_LEN, tokens_seen=20)
    ring = ring_key(info.session_id)
    await raw.setrange(ring, 20 * ROW_BYTES, b"\x00")  # one byte too many
    with pytest.raises(SessionCorrupt, match="declares"):
        await other_store.get(info.session_id)
    await raw.delete(ring)
    with pytest.raises(SessionCorrupt, match="missing"):
        await other_store.get(info.session_id)


async def test_a_demoted_session_drops_its_ring(redis_url: str, raw: redis.asyncio.Redis) -> None:
    tokenized = dataclasses.replace(IDENTITY, tokenizer="byte:test")
    async with MemoryStore.from_url(redis_url, identity=tokenized) as store:
        state = {**state_after(document(40), 30), "window": torch.arange(30, dtype=torch.int32)}
        info = await store.create(tensors=state, mem_len=MEM_LEN, tokens_seen=30)
        assert await raw.exists(ring_key(info.session_id))
        assert await store.demote(info.session_id)
        assert not await raw.exists(ring_key(info.session_id))
        assert (await store.info(info.session_id)).bytes < info.bytes / 4


async def test_a_lost_ring_is_rebuilt_from_the_window_not_refused(store: MemoryStore, other_store: MemoryStore,
                                                                  raw: redis.asyncio.Redis) -> None:
    window = torch.arange(30, dtype=torch.int32)
    info = await store.create(tensors={**state_after(document(40), 30), "window": window}, mem_len=MEM_LEN,
                              tokens_seen=30)
    await raw.delete(ring_key(info.session_id))  # expired beside its record, say
    got = await other_store.get(info.session_id)
    assert set(got.tensors) == {"last_logits", "window"} and torch.equal(got.tensors["window"].cpu(), window)
    payload = await raw.hget(session_key(info.session_id), "payload")
    assert (got.info.tier, got.info.bytes) == ("cold", len(payload))  # counted and shown as what it now is


async def test_short_sessions_store_their_rows_and_the_stored_size_is_bounded(redis_url: str,
                                                                            raw: redis.asyncio.Redis) -> None:
    async with MemoryStore.from_url(redis_url, identity=IDENTITY, max_payload_mb=16 * ROW_BYTES / (1 << 20)) as st:
        info = await st.create(tensors=state_after(document(10), 10), mem_len=1600, tokens_seen=10)
        assert await raw.strlen(ring_key(info.session_id)) == 10 * ROW_BYTES  # not 1600 slots
        one_row = {"mems": document(1)[:, :1]}  # 1 row, but 20 positions: a ring of 20 slots, over the limit
        with pytest.raises(PayloadTooLarge, match="as stored"):
            await st.create(tensors=one_row, mem_len=20, tokens_seen=20)


async def test_the_legacy_format_is_what_older_servers_read(redis_url: str, other_store: MemoryStore,
                                                            raw: redis.asyncio.Redis) -> None:
    """During a rolling upgrade (TXLSERVE_LEGACY_STORE_FORMAT) records keep the memory in the payload, as format 1,
    and every commit writes it whole; a format-3 server reads them."""
    doc = document(80, seed=4)
    async with MemoryStore.from_url(redis_url, identity=IDENTITY, legacy_format=True) as st:
        info = await st.create(tensors=state_after(doc, 20), mem_len=MEM_LEN, tokens_seen=20)
        async with st.lease(info.session_id, tensors=False) as lease:
            await st.commit(lease, state_after(doc, 30), tokens_seen=30, appended=True)
    header = json.loads(await raw.hget(session_key(info.session_id), "header"))
    assert header["format_version"] == 1 and not await raw.exists(ring_key(info.session_id))
    assert safetensors.torch.load(await raw.hget(session_key(info.session_id), "payload"))["mems"].shape[1] == 30
    assert_same((await other_store.get(info.session_id)).tensors, state_after(doc, 30))



async def test_a_ring_filled_by_appends_takes_its_bytes_in_redis_not_its_growth(store: MemoryStore,
                                                                               raw: redis.asyncio.Redis) -> None:
    """A string grown by SETRANGE keeps Redis's doubling allocation for good: a ring filled a few tokens at a time
    (a chat) took 1.5-1.7x its bytes, which --warm-budget-mb does not see (found by a helper). Once filled it is
    set again whole, and takes its bytes."""
    doc = document(MEM_LEN + 20)
    info = await store.create(tensors=state_after(doc, 1), mem_len=MEM_LEN, tokens_seen=1)
    seen = 1
    while seen < MEM_LEN + 20:
        async with store.lease(info.session_id, tensors=False) as lease:
            n = 3 if seen < 40 else 1
            await store.commit(lease, state_after(doc, seen + n), tokens_seen=seen + n, appended=True)
        seen += n
        if seen == 31:  # still filling: what the patches allocate
            growing = await raw.memory_usage(ring_key(info.session_id))
    assert await raw.strlen(ring_key(info.session_id)) == RING_BYTES
    used = await raw.memory_usage(ring_key(info.session_id))
    assert used <= RING_BYTES * 1.1 + 256, (used, RING_BYTES, growing)
    got = await store.get(info.session_id)  # and it reads back as written
    assert_same(got.tensors, state_after(doc, seen))
    ring_ttl, record_ttl = await raw.pttl(ring_key(info.session_id)), await raw.pttl(session_key(info.session_id))
    assert (ring_ttl > 0) == (record_ttl > 0) and ring_ttl != -2  # set again, it keeps its record's TTL

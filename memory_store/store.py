"""MemoryStore: persistent per-session state, a hot tier on the device composed over Redis.

Redis is the truth, and every write goes through to it before the hot tier is
touched, so evicting a hot copy never loses a commit. A hot copy is served
only while its version equals the one in Redis, which costs one small header
read per ``get`` and makes several servers over one Redis safe. Leases and
compare-and-set commits (one Lua script each) let exactly one request at a
time advance a session. A commit that only appended tokens (``appended=True``)
rewrites only their rows of the stored memory (:func:`codec.ring_patch`).

Ownership is checked on every call: a session of another owner behaves exactly
like one that does not exist. ``owner=None`` is the anonymous owner, not a
wildcard.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import secrets
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import torch

from memory_store import codec
from memory_store.codec import Header, ModelIdentity
from memory_store.config import StoreConfig
from memory_store.embedded import EmbeddedRedis
from memory_store.hot import HotTier
from memory_store.lease import Lease, LeaseRequest
from memory_store.metrics import StoreMetrics
from memory_store.redis_tier import (
    ABSENT,
    ANY_VERSION,
    RedisClock,
    RedisTier,
    client_name,
    connect_checked,
    redact_url,
    timed_out,
)
from memory_store.session import Session, SessionInfo
from txlserve.errors import (
    CommitUnknown,
    InvalidRequestError,
    PayloadTooLarge,
    SessionBusy,
    SessionConflict,
    SessionCorrupt,
    SessionIncompatible,
    SessionNotFound,
    StoreOverloaded,
    StoreUnavailable,
)

log = logging.getLogger(__name__)

_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_CURSOR_SCORE = re.compile(r"[0-9]{1,19}")  # ASCII digits only: str.isdigit() also accepts '²'
_PUT_ATTEMPTS = 5
_UPDATE_ATTEMPTS = 16  # each try loses only to another write that landed: n updaters at once need n tries
_RELEASE_RETRY_S = 0.25  # how often a release (or a listing) Redis missed is tried again while it is away
_INDEX_RETRY_FOR_S = 120.0  # how long a new session's listing is tried again: a cluster's failover, a restart
_UNLISTED_MAX = 100_000  # new sessions' listings tried again at once, at most (a few hundred bytes each)
_RELIST_FAILURES = 32  # listings tried again that fail before a round of them ends


class MemoryStore:
    """Sessions by id, for one model identity. Open with ``async with MemoryStore.from_url(...)``."""

    def __init__(self, url: str | None, *, identity: ModelIdentity, config: StoreConfig | None = None) -> None:
        self.url = url
        self.identity = identity
        self.config = config or StoreConfig()
        self.device = torch.device(self.config.device)
        self.metrics = StoreMetrics()
        self._hot = HotTier(self.config.hot_cache_bytes, self.metrics)
        self._tier: RedisTier | None = None
        self._embedded: EmbeddedRedis | None = None
        self._leases: set[Lease] = set()
        self._owed: set[asyncio.Task] = set()  # releases Redis missed, retried until it answers (_release_later)
        # sessions made whose owner's list Redis missed: session id -> (owner, created at, given up at); one task
        # lists them again (_relist)
        self._unlisted: dict[str, tuple[str | None, float, float]] = {}
        self._relisting: asyncio.Task | None = None
        self._closed = False
        self._last_created_ms = 0  # see _creation_time
        self._evicting: str | None = None  # Redis's eviction policy, where it evicts (check_eviction_policy)

    @classmethod
    def from_url(
        cls,
        url: str | None,
        *,
        identity: ModelIdentity,
        device: str | torch.device = "cpu",
        hot_cache_mb: float = 1024,
        ttl_s: int = 7 * 86400,
        data_dir: str = "./.txlserve",
        lease_ttl_ms: int = 30_000,
        op_timeout_s: float = 2.0,
        max_payload_mb: float = 256,
        legacy_format: bool = False,
    ) -> MemoryStore:
        """A store over a ``redis://``, ``rediss://`` or ``unix://`` URL, a ``redis+cluster://`` node of a Redis
        Cluster, or (None) the embedded Redis.

        Nothing is opened until ``start()`` (or ``async with``); see :class:`StoreConfig`.
        """
        config = StoreConfig(
            device=device,
            hot_cache_mb=hot_cache_mb,
            ttl_s=ttl_s,
            data_dir=data_dir,
            lease_ttl_ms=lease_ttl_ms,
            op_timeout_s=op_timeout_s,
            max_payload_mb=max_payload_mb,
            legacy_format=legacy_format,
        )
        return cls(url, identity=identity, config=config)

    # -- lifecycle ---------------------------------------------------------

    @property
    def where(self) -> str:
        """Where sessions are kept, fit for a log line: the embedded Redis's directory, or the URL without
        its credentials."""
        if self.url is None:
            return f"embedded Redis under {self.config.data_dir}"
        return f"Redis at {redact_url(self.url)}"

    async def start(self) -> None:
        """Connect (starting or joining the embedded Redis if no URL) and check Redis answers."""
        if self._tier is not None:
            return
        url = self.url
        if url is None:
            self._embedded = EmbeddedRedis(self.config.data_dir)
            await asyncio.to_thread(self._embedded.start)
            url = self._embedded.url
        # named on the embedded Redis, whose starter counts the other processes' connections when it stops
        client = connect_checked(url, self.config.op_timeout_s, client_name() if self._embedded is not None else None)
        self._tier = RedisTier(
            client,
            where=redact_url(url),  # never log a password
            ttl_s=self.config.ttl_s,
            lease_ttl_ms=self.config.lease_ttl_ms,
            metrics=self.metrics,
        )
        try:
            await self._tier.ping()
        except BaseException:
            await self.aclose()
            raise
        try:
            await self._tier.load_scripts()
        except StoreUnavailable as err:  # an ACL user without SCRIPT, where they were loaded for it: NOSCRIPT says
            log.debug("scripts not loaded at start: %s", err)
        await self.check_eviction_policy()

    async def check_eviction_policy(self) -> None:
        """Warn where Redis evicts keys when full, which deletes sessions silently: as the store starts, and again
        whenever the server's cold-tier sweep finds it changed to such a policy (one set while the servers ran
        went unsaid; found by a helper)."""
        policy = await self._redis.evicts()
        if policy is not None and policy != self._evicting:
            log.warning("Redis at %s evicts keys when full (maxmemory-policy %s): sessions will disappear (404) "
                        "instead of commits failing (503); set maxmemory-policy noeviction", self._redis.where, policy)
        self._evicting = policy

    @staticmethod
    async def check_reachable(url: str | None, op_timeout_s: float = 2.0) -> None:
        """Connect and PING a configured Redis as :meth:`start` would, then close: the server does this before
        loading its model (seconds to minutes), so an unreachable Redis is one line at once. (The embedded Redis
        is started with the store.)"""
        if url is not None:
            probe = MemoryStore.from_url(url, identity=ModelIdentity("", 0, 0), op_timeout_s=op_timeout_s)
            await probe.start()
            await probe.aclose()

    def on_embedded_exit(self, callback: Callable[[str], None]) -> None:
        """Have ``callback`` told why (on a thread of the store's) if the embedded Redis this store started dies:
        nothing starts it again, so what runs on a session can no longer be stored."""
        if self._embedded is not None:
            self._embedded.on_exit = callback

    @property
    def embedded_exited(self) -> str | None:
        """Why the embedded Redis this store started is gone, else None (a liveness probe's business)."""
        return None if self._embedded is None else self._embedded.exited

    async def aclose(self) -> None:
        """Release held leases, close connections, stop the embedded Redis if this store started it."""
        for lease in list(self._leases):
            await lease.release()
        self._closed = True  # nothing is retried from here (a create still under way had started a retry after)
        for task in [*self._owed, *([self._relisting] if self._relisting else [])]:
            task.cancel()  # a Redis still away: the leases expire by themselves
        if self._unlisted:
            log.warning("%d session(s) made while their owner's list was unreachable stay unlisted (read by id, "
                        "they are there)", len(self._unlisted))
        tier, self._tier = self._tier, None
        if tier is not None:
            await tier.aclose()
        embedded, self._embedded = self._embedded, None
        if embedded is not None:
            await asyncio.to_thread(embedded.stop)

    async def __aenter__(self) -> MemoryStore:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    @property
    def _redis(self) -> RedisTier:
        if self._tier is None:
            raise StoreUnavailable("the memory store is not open (use `async with` or `await store.start()`)")
        return self._tier

    async def ping(self) -> None:
        with self.metrics.timed("ping"):
            await self._redis.ping()

    # -- reads -------------------------------------------------------------

    async def get(self, session_id: str, *, owner: str | None = None) -> Session:
        """The session's header and tensors on the device: the hot copy if current, else from Redis."""
        with self.metrics.timed("get"):
            return await self._load(_checked_id(session_id), owner)

    async def window(self, session_id: str, *, owner: str | None = None) -> tuple[SessionInfo, list[int] | None]:
        """A session's header and token window (None: stored before windows), whichever model wrote it: giving a
        document away needs no model, so a replica of another model or tokenizer exports it as it is (a 422
        before). Read from Redis without its memory's ring (a WikiText-103 session's is tens of MB)."""
        with self.metrics.timed("get"):
            session_id = _checked_id(session_id)
            raw, payload, _ = await self._redis.read(session_id, owner, payload=True, ring=False)
            header = self._header(session_id, raw, owner, compatible=False)
            info = SessionInfo.from_header(session_id, header, tier="redis")
            if not header.window_tokens:  # an empty session's window is empty; an old one's, absent
                return info, [] if header.tokens_seen == 0 else None
            tensors = await asyncio.to_thread(codec.decode_payload, payload or b"", header, None)
            return info, tensors[codec.WINDOW].tolist()

    async def info(self, session_id: str, *, owner: str | None = None) -> SessionInfo:
        """Header fields only; no tensors are read."""
        with self.metrics.timed("info"):
            session_id = _checked_id(session_id)
            raw, _, _ = await self._redis.read(session_id, owner, payload=False)
            header = self._header(session_id, raw, owner, compatible=False)
            return self._info(session_id, header)

    async def lease_state(self, session_id: str) -> tuple[bool, bool]:
        """Whether a request (of any replica) holds the session's lease, and whether it said it is ending: its
        client left, and it commits what it made. A read waits for such a commit (the server's ``settled``)."""
        with self.metrics.timed("lease_state"):
            return await self._redis.lease_state(_checked_id(session_id))

    async def list(
        self, *, owner: str | None = None, limit: int = 20, after: str | None = None, order: str = "asc"
    ) -> tuple[list[SessionInfo], str | None]:
        """One page of the owner's sessions, oldest first (``order="desc"``: newest first), and the cursor of the
        next page (or None).

        Index entries whose session expired or was deleted are skipped, then pruned.
        """
        with self.metrics.timed("list"):
            if not isinstance(limit, int) or not 1 <= limit <= 1000:
                raise InvalidRequestError(f"limit must be in 1..1000, got {limit!r}", param="limit")
            if order not in ("asc", "desc"):
                raise InvalidRequestError(f"order must be asc or desc, got {order!r}", param="order")
            rows = await self._redis.scan_index(owner, after=await self._cursor(owner, after), count=limit + 1,
                                                newest_first=order == "desc")
            page = rows[:limit]
            infos = []
            for _, session_id, raw in page:
                try:
                    header = codec.decode_header(raw)
                except SessionCorrupt as err:
                    log.warning("listing skips session %s: %s", session_id, err)
                    continue
                except SessionIncompatible as err:  # a newer server's, as during a rollback: not a fault, and
                    log.debug("listing skips session %s: %s", session_id, err)  # said at every list call
                    continue
                if header.owner == owner:
                    infos.append(self._info(session_id, header))
            next_cursor = f"{page[-1][0]}.{page[-1][1]}" if len(rows) > limit else None
            return infos, next_cursor

    async def _cursor(self, owner: str | None, after: str | None) -> tuple[int, str] | None:
        """A page's ``next_cursor``, or (OpenAI's form) the id of the session the page starts after."""
        if after is None or not _SESSION_ID.fullmatch(after):
            return _parse_cursor(after)
        score = await self._redis.index_score(owner, after)
        if score is None:
            raise InvalidRequestError(f"after names no session in this list: {shown(after)} (a page's next_cursor "
                                      f"also holds its place once that session is gone)", param="after")
        return score, after

    # -- writes ------------------------------------------------------------

    async def create(
        self,
        *,
        owner: str | None = None,
        tensors: Mapping[str, torch.Tensor],
        mem_len: int,
        tokens_seen: int = 0,
        metadata: Mapping[str, Any] | None = None,
    ) -> SessionInfo:
        """A new session under a fresh random 128-bit id."""
        with self.metrics.timed("create"):
            return await self._create(owner, tensors, mem_len, tokens_seen, codec.check_metadata(metadata))

    async def put(
        self,
        session_id: str,
        tensors: Mapping[str, torch.Tensor],
        *,
        owner: str | None = None,
        mem_len: int,
        tokens_seen: int = 0,
        metadata: Mapping[str, Any] | None = None,
    ) -> SessionInfo:
        """Write a session unconditionally (create or overwrite), bypassing any lease.

        The version still advances, so a lease holder's next commit fails with
        ``SessionConflict`` rather than silently undoing this write. A session of
        another owner is not overwritten (``SessionConflict``); a corrupt one is.
        """
        with self.metrics.timed("put"):
            if not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id):
                raise InvalidRequestError("session id must be 1-128 of [A-Za-z0-9_-]", param="session_id")
            fresh, payload, ring = await self._encode(
                tensors, mem_len=mem_len, tokens_seen=tokens_seen, metadata=codec.check_metadata(metadata), owner=owner
            )
            for _ in range(_PUT_ATTEMPTS):
                raw, _, _ = await self._redis.read(session_id, owner, payload=False)
                header = fresh
                expected: int | str = ABSENT
                if raw is not None:
                    try:
                        prev = codec.decode_header(raw)
                    except SessionCorrupt:
                        expected = ANY_VERSION
                    else:
                        if prev.owner != owner:
                            raise SessionConflict(f"session id {session_id!r} is taken")
                        expected = prev.version
                        header = dataclasses.replace(fresh, version=prev.version + 1, created_at=prev.created_at)
                status = await self._redis.write(
                    session_id, header=codec.encode_header(header), payload=payload, expected=expected, ring=ring
                )
                if status == "OK":
                    await self._index(owner, session_id, header.created_at)
                    return self._cache(session_id, header, self._on_device(tensors))
            raise SessionConflict(f"session {session_id!r} kept changing during put; try again")

    async def fork(
        self, session_id: str, *, owner: str | None = None, metadata: Mapping[str, Any] | None = None
    ) -> SessionInfo:
        """A new session with a copy of this one's tensors (hot-only ones too, while hot). A session another model
        wrote is forked cold, its token window alone: its hidden states are that model's, and a copy written with
        this model's fingerprint would have been continued from them as this model's own."""
        with self.metrics.timed("fork"):
            source = await self._load(_checked_id(session_id), owner)
            foreign = source.info.fingerprint != self.identity.fingerprint
            tensors = {name: t.clone() for name, t in source.tensors.items() if not foreign or name == codec.WINDOW}
            metadata = source.info.metadata if metadata is None else metadata
            info = source.info
            return await self._create(owner, tensors, info.mem_len, info.tokens_seen, codec.check_metadata(metadata))

    async def update_metadata(
        self, session_id: str, metadata: Mapping[str, Any], *, owner: str | None = None, max_keys: int | None = None
    ) -> SessionInfo:
        """Merge ``metadata`` into the session's: the keys given are set, a key given as None is removed, the
        others stay (OpenAI's modify, Stripe's update; RFC 7396 at the top level), so that two writers of
        different keys do not undo each other. ``max_keys`` bounds the merged result (an API's policy; the store's
        own bound is its size).

        Only the header is written. The version stays: it names the memory's state, which a hot copy and a
        lease's compare-and-set stand for, and metadata is no part of it, so a hot session stays hot. What this
        write compares instead is the header read, byte for byte. ``SessionBusy`` while a request holds the
        session, since its commit writes back the header it leased."""
        with self.metrics.timed("update"):
            session_id = _checked_id(session_id)
            if not isinstance(metadata, Mapping) or not all(isinstance(k, str) for k in metadata):
                raise InvalidRequestError("metadata must be a JSON object", param="metadata")
            for _ in range(_UPDATE_ATTEMPTS):
                raw, _, _ = await self._redis.read(session_id, owner, payload=False)
                header = self._header(session_id, raw, owner, compatible=False)
                merged = {k: v for k, v in {**header.metadata, **metadata}.items() if v is not None}
                if max_keys is not None and len(merged) > max_keys:
                    raise InvalidRequestError(f"metadata would hold {len(merged)} keys, over {max_keys}: remove "
                                              "keys by setting them to null", param="metadata")
                new = dataclasses.replace(header, metadata=codec.check_metadata(merged))
                if new == header:  # nothing changes: no write, and no TTL started again
                    return self._info(session_id, header)
                status = await self._redis.set_header(session_id, header=codec.encode_header(new), expected=raw)
                if status == "OK":
                    return self._info(session_id, new)
                if status == "NOT_FOUND":
                    raise SessionNotFound(f"session {session_id!r} not found")
                if status == "BUSY":
                    raise SessionBusy(f"session {session_id!r} is in use by a request: its metadata can be "
                                      "changed once that request ends")
            raise SessionConflict(f"session {session_id!r} kept changing during the update; try again")

    async def delete(self, session_id: str, *, owner: str | None = None) -> None:
        """Remove a session and its lease. A corrupt session can be deleted by anyone who knows its id."""
        with self.metrics.timed("delete"):
            session_id = _checked_id(session_id)
            try:
                raw, _, _ = await self._redis.read(session_id, owner, payload=False)
                self._header(session_id, raw, owner, compatible=False)
            except SessionCorrupt:
                log.warning("deleting corrupt session %s", session_id)
            except SessionIncompatible:  # a newer server's record, after a rollback: its owner is all a delete
                if codec.header_owner(raw) != owner:  # needs (a user could not delete their own sessions)
                    raise SessionNotFound(f"session {session_id!r} not found") from None
            await self._redis.delete(session_id, owner)
            self._hot.discard(session_id)

    async def demote(self, session_id: str) -> bool:
        """Move a session to the cold tier: keep only its token window (same version, same TTL), to be rebuilt
        on its next use. False, and nothing written, if it is leased, changed meanwhile, already cold, or has
        no window."""
        session_id = _checked_id(session_id)
        raw, payload, ring = await self._redis.read(session_id, None, payload=True, touch=False)
        if raw is None:
            return False
        header = codec.decode_header(raw)
        if header.form != codec.STATE_FORM or not header.window_tokens:
            return False
        tensors = await asyncio.to_thread(codec.decode_payload, payload or b"", header, ring)
        cold = {codec.WINDOW: tensors[codec.WINDOW]}
        small = await asyncio.to_thread(codec.encode_payload, cold, max_bytes=self.config.max_payload_bytes)
        new = dataclasses.replace(header, form=codec.WINDOW_FORM, format_version=2, payload_bytes=len(small),
                                  dtype=str(cold[codec.WINDOW].dtype))
        status = await self._redis.demote(session_id, header=codec.encode_header(new), payload=small, expected=raw)
        if status == "OK":
            self._hot.discard(session_id)
            self.metrics.demotions += 1
        return status == "OK"

    async def sweep(self, *, idle_s: float | None = None, warm_budget_bytes: int | None = None) -> int:
        """Apply the cold-tier policy to every session in this Redis: those idle for ``idle_s`` go cold, then
        the least recently updated until the warm (hidden-state) records fit ``warm_budget_bytes``. The number
        moved. Every replica may sweep: a demotion is a compare-and-set that skips leased sessions."""
        now, warm = time.time(), []
        async for session_id, raw in self._redis.scan_sessions():
            try:
                header = codec.decode_header(raw)
            except (SessionCorrupt, SessionIncompatible):
                continue
            if header.form == codec.STATE_FORM and header.window_tokens:
                warm.append((header.updated_at, codec.record_nbytes(header), session_id))
        warm.sort()
        total, moved = sum(nbytes for _, nbytes, _ in warm), 0
        for updated_at, nbytes, session_id in warm:
            idle = idle_s is not None and now - updated_at >= idle_s
            over = warm_budget_bytes is not None and total > warm_budget_bytes
            if not (idle or over):
                continue
            with contextlib.suppress(SessionCorrupt):  # changed or broken meanwhile: the next sweep sees it
                if await self.demote(session_id):
                    total -= nbytes
                    moved += 1
        return moved

    # -- leases ------------------------------------------------------------

    def lease(self, session_id: str, *, owner: str | None = None, tensors: bool = True) -> LeaseRequest:
        """Take the session's lease, or fail at once with ``SessionBusy`` if anyone holds it.

        ``await store.lease(...)`` or ``async with store.lease(...) as lease:``
        (which releases on exit). The lease carries the session read after it
        was taken; a commit succeeds only against that version. With ``tensors=False``
        only the header is read (a caller that may already hold this version in its
        own form): :meth:`read_tensors` fetches them when it does not.
        """
        return LeaseRequest(lambda: self._acquire(_checked_id(session_id), owner, tensors))

    async def read_tensors(self, lease: Lease) -> dict[str, torch.Tensor]:
        """The leased version's tensors (hot tier or Redis), for a lease taken with ``tensors=False``."""
        session = await self._load(lease.session_id, lease.session.info.owner)
        if session.version != lease.version:
            raise SessionConflict(f"session {lease.session_id!r} was overwritten while leased")
        return session.tensors

    async def _acquire(self, session_id: str, owner: str | None, tensors: bool = True) -> Lease:
        with self.metrics.timed("lease"):
            token = secrets.token_hex(16)
            try:
                status, raw, clock, unlisted = await self._redis.acquire(session_id, owner, token)
            except BaseException as err:  # the script may have taken it before the reply was lost: give it back,
                # or the session is busy to everyone until the lease's TTL. Not awaited where Redis stopped
                # answering: the release waited a second store timeout before the caller heard of the first
                if isinstance(err, StoreOverloaded):  # no connection to send it on: nothing was taken
                    raise
                if timed_out(err):  # (found by a helper)
                    self._release_later(session_id, token, at_once=True)
                else:
                    await self._give_back(session_id, token)
                raise
            if status == "NOT_FOUND":
                raise SessionNotFound(f"session {session_id!r} not found")
            if status == "BUSY":  # a holder that died (or lost Redis as it released) holds it until its TTL
                ms, ending = raw if isinstance(raw, tuple) else (None, False)
                left = (" (if you stopped reading a stream of it without closing the stream, it still generates: "
                        "close it)" + (
                    f"; if none of yours runs, its holder has gone and it is free within {ms / 1000:.0f} s"
                    if ms is not None and ms > 0 else ""))
                raise SessionBusy(f"session {session_id!r} is in use by another request{left}", ending=ending)
            if status == "CORRUPT":
                raise SessionCorrupt(f"session {session_id!r} has an unreadable header")
            self._hot.pin(session_id)
            try:
                if tensors:  # the lease's script refreshed the session's TTLs, its owner's index beside it
                    session = await self._load(session_id, owner, touch=False)
                else:  # the header came with the lease
                    session = Session(self._info(session_id, self._header(session_id, raw, owner)), {})
            except BaseException:
                self._hot.unpin(session_id)
                await self._give_back(session_id, token)
                raise
            lease = Lease(
                session, token, tier=self._redis, lease_ttl_ms=self.config.lease_ttl_ms, on_release=self._on_release,
                clock=clock, on_unreleased=self._release_later,
            )
            self._leases.add(lease)
            if unlisted:  # its owner's index was gone: listed again (else it was never listed again)
                await self._index(owner, session_id, session.info.created_at)
            return lease

    async def _give_back(self, session_id: str, token: str) -> None:
        """Release a lease a failed call may hold; if Redis does not answer, it is released once Redis is back (the
        first error is the caller's to raise)."""
        try:
            await asyncio.shield(self._redis.release(session_id, token))
        except StoreUnavailable:
            self._release_later(session_id, token)

    def _release_later(self, session_id: str, token: str, *, at_once: bool = False) -> None:
        """A lease Redis did not hear released (it was away): released as soon as it answers again, within the
        lease's TTL (past it the lease is gone anyway). A Redis back from a restart restores the lease key from its
        append-only file: the session was a 409 to everyone for the rest of the TTL, with no request running.
        ``at_once``: the first try now (a lease that may have been taken as its reply was lost)."""
        if self._closed:
            return

        async def retry() -> None:
            deadline = time.monotonic() + self.config.lease_ttl_ms / 1000
            wait = 0.0 if at_once else _RELEASE_RETRY_S
            while time.monotonic() < deadline:
                await asyncio.sleep(min(wait, max(0.0, deadline - time.monotonic())))
                wait = _RELEASE_RETRY_S
                try:
                    await self._redis.release(session_id, token)
                    return
                except StoreUnavailable:
                    pass
                except Exception as err:  # never out of the retry unseen ("Task exception was never retrieved")
                    log.warning("releasing session %s's lease failed (%s: %s)", session_id, type(err).__name__, err)
                    return

        task = asyncio.create_task(retry(), name=f"txl-lease-release-{session_id}")
        self._owed.add(task)
        task.add_done_callback(self._owed.discard)

    def _on_release(self, lease: Lease) -> None:
        self._leases.discard(lease)
        self._hot.unpin(lease.session_id)

    async def commit(
        self,
        lease: Lease,
        tensors: Mapping[str, torch.Tensor],
        *,
        tokens_seen: int,
        metadata: Mapping[str, Any] | None = None,
        mem_len: int | None = None,
        release: bool = False,
        appended: bool = False,
    ) -> SessionInfo:
        """Write a new version if the lease still holds and nobody wrote since it was read.

        Otherwise ``SessionConflict`` (``SessionNotFound`` if it was deleted).
        ``metadata=None`` keeps the current metadata; ``mem_len=None`` the current
        memory length (a session rebuilt by another model takes that model's).
        ``release=True`` gives the lease back with a successful write, in the same
        round trip (a failed one keeps it until released). ``appended=True`` says
        that ``tensors`` are the leased state with tokens appended and its older
        rows unchanged: only the new rows of the memory are written (the whole
        memory where the stored record is not one they patch).
        """
        with self.metrics.timed("commit"):
            if lease not in self._leases:
                raise SessionConflict(f"the lease on session {lease.session_id!r} is not held by this store")
            prev = lease.session.info
            metadata = prev.metadata if metadata is None else codec.check_metadata(metadata)
            mem_len = prev.mem_len if mem_len is None else mem_len
            header, payload, ring = await self._encode(
                tensors,
                mem_len=mem_len,
                tokens_seen=tokens_seen,
                metadata=metadata,
                owner=prev.owner,
                version=prev.version + 1,
                created_at=prev.created_at,
                ring=not appended,
                window_span=prev.window_span,
            )
            ringed = appended and codec.MEMS in tensors and header.format_version >= codec.RING_FORMAT
            patch = codec.ring_patch(tensors[codec.MEMS], before=prev.tokens_seen, tokens_seen=tokens_seen,
                                     mem_len=mem_len) if ringed else None
            encoded = codec.encode_header(header)

            def refresh(clock: RedisClock) -> None:
                lease.clock = clock

            async def write(**ring: Any) -> str:
                """The write, refused by Redis past a deadline: one op timeout after this call, on Redis's clock,
                which is no later than this process gives up on it (every wait in the call is bounded by an op
                timeout, the one for the reply starting after the send), so a stalled Redis that resumes cannot
                apply a commit whose request failed. A refusal that comes back at all came from a Redis that
                answers: the time went to a pool wait or the upload, or the lease's clock is off (another node
                after a slot migration or failover, a clock step); the write is sent once more, on the clock of
                the node that refused it."""
                for _ in range(2):
                    deadline = None if lease.clock is None else lease.clock.now_ms() + self.config.op_timeout_s * 1000
                    try:
                        status = await self._redis.write(
                            lease.session_id, header=encoded, payload=payload, expected=prev.version,
                            token=lease.token, release=release, deadline_ms=deadline, on_expired=refresh, **ring)
                    except StoreOverloaded:  # never sent
                        raise
                    except StoreUnavailable as err:  # no reply: the script may have run before Redis stalled
                        if await self._landed(lease.session_id, encoded, final=deadline is not None, error=err):
                            return "OK"
                        raise
                    if status != "EXPIRED":
                        break
                return status

            if patch is None:
                if ringed:  # every slot is new, or not a session's memory: the ring is written whole
                    ring = await self._ring(tensors, tokens_seen=tokens_seen, mem_len=mem_len)
                status = await write(ring=ring)
            else:
                status = await write(guard=(header.format_version, header.fingerprint, header.n_layer,
                                            header.d_model, header.dtype, mem_len, prev.tokens_seen,
                                            patch.least_rows, patch.before_nbytes, patch.full_nbytes),
                                     runs=patch.runs)
            if status == "RESHAPE":  # the stored record is not the state the rows were appended to
                status = await write(ring=await self._ring(tensors, tokens_seen=tokens_seen, mem_len=mem_len))
            if status == "NOT_FOUND":
                raise SessionNotFound(f"session {lease.session_id!r} was deleted")
            if status == "EXPIRED":
                raise StoreUnavailable(f"Redis at {self._redis.where} took longer than the store timeout to commit "
                                       f"session {lease.session_id!r}; nothing was written")
            if status == "LEASE_LOST":
                if lease.lost_to_outage:
                    raise StoreUnavailable(f"Redis at {self._redis.where} could not be reached for longer than the "
                                           f"lease on session {lease.session_id!r} lasts; nothing was written")
                raise SessionConflict(f"the lease on session {lease.session_id!r} expired or was taken")
            if status != "OK":
                raise SessionConflict(
                    f"session {lease.session_id!r} changed since it was leased (version {prev.version})"
                )
            on_device = self._on_device(tensors)
            info = self._cache(lease.session_id, header, on_device)
            lease.session = Session(info, on_device)
            if release:
                lease.released_by_commit()
            return info

    # -- helpers -----------------------------------------------------------

    async def _landed(self, session_id: str, header: bytes, *, final: bool, error: StoreUnavailable) -> bool:
        """Whether a commit whose reply never came was stored (a 503 for a commit that had landed, retried as the
        README says, continued the session twice; found by helpers). The commit gave the lease back as it wrote,
        so the session may have changed since: see :func:`_verdict`. A write Redis had not yet run is refused once
        its deadline passes on Redis's clock, which the wait for the reply outlasted, so "not stored" is final
        (``final``: the write carried a deadline). ``CommitUnknown`` where Redis does not answer this either, where
        the session was written since, or where "not stored" is not final."""
        try:
            raw, _, _ = await self._redis.read(session_id, None, payload=False, touch=False)
        except StoreUnavailable:
            verdict = None
        else:
            verdict = False if raw is None else _verdict(raw, header)
            if verdict:
                log.warning("session %s: the reply to its commit was lost (%s), and the commit had landed",
                            session_id, error)
                return True
            if verdict is False and final:
                return False
        raise CommitUnknown(f"Redis at {self._redis.where} stopped answering as session {session_id!r} was "
                            "committed, and it is not known whether the commit landed: read the session "
                            "(its tokens_seen) before sending the request again") from error

    async def _ring(self, tensors: Mapping[str, torch.Tensor], *, tokens_seen: int, mem_len: int) -> bytes:
        """The whole ring of a state's mems, encoded in a thread unless small."""
        mems = tensors[codec.MEMS]
        if codec.ring_size(mems, tokens_seen=tokens_seen, mem_len=mem_len) <= codec.INLINE_BYTES:
            return codec.encode_ring(mems, tokens_seen=tokens_seen, mem_len=mem_len)
        return await asyncio.to_thread(codec.encode_ring, mems, tokens_seen=tokens_seen, mem_len=mem_len)

    async def _load(self, session_id: str, owner: str | None, *, touch: bool = True) -> Session:
        """``touch``: refresh the idle TTLs as the session is read (False where the caller just refreshed them)."""
        if session_id in self._hot:
            raw, _, _ = await self._redis.read(session_id, owner, payload=False, touch=touch)
            header = self._header(session_id, raw, owner)
            entry = self._hot.get(session_id, header.revision)
            if entry is not None:
                self.metrics.hot_hits += 1
                return Session(SessionInfo.from_header(session_id, header, tier="hot"), entry.tensors)
        self.metrics.hot_misses += 1
        raw, payload, ring = await self._redis.read(session_id, owner, payload=True, touch=touch)
        header = self._header(session_id, raw, owner)
        try:
            tensors = await asyncio.to_thread(self._decode, payload or b"", header, ring)
        except SessionCorrupt:
            self._hot.discard(session_id)
            raise
        if header.form == codec.STATE_FORM and codec.MEMS not in tensors:  # its ring was lost: its window is left
            log.warning("session %s lost its memory (its ring key is gone, or holds values that are not finite): "
                        "it is rebuilt from its window",
                        session_id)
            header = dataclasses.replace(header, form=codec.WINDOW_FORM)  # what it is now: cold
        self.metrics.redis_hits += 1
        self._hot.put(session_id, header.revision, tensors)
        return Session(SessionInfo.from_header(session_id, header, tier="redis"), tensors)

    def _decode(self, payload: bytes, header: Header, ring: bytes | None) -> dict[str, torch.Tensor]:
        return self._on_device(codec.decode_payload(payload, header, ring))

    def _header(self, session_id: str, raw: bytes | None, owner: str | None, *, compatible: bool = True) -> Header:
        """The decoded header, or the error the caller should see (others' sessions do not exist)."""
        if raw is None:
            self.metrics.redis_misses += 1
            self._hot.discard(session_id)
            raise SessionNotFound(f"session {session_id!r} not found")
        try:
            header = codec.decode_header(raw)
        except SessionCorrupt:
            self._hot.discard(session_id)
            raise
        if header.owner != owner:
            raise SessionNotFound(f"session {session_id!r} not found")
        if compatible:
            codec.check_compatible(header, self.identity)
        return header

    async def _create(
        self,
        owner: str | None,
        tensors: Mapping[str, torch.Tensor],
        mem_len: int,
        tokens_seen: int,
        metadata: dict[str, Any],
    ) -> SessionInfo:
        header, payload, ring = await self._encode(
            tensors, mem_len=mem_len, tokens_seen=tokens_seen, metadata=metadata, owner=owner
        )
        session_id = _new_id()
        status = await self._redis.write(
            session_id, header=codec.encode_header(header), payload=payload, expected=ABSENT, ring=ring
        )
        if status != "OK":  # 128 random bits: never seen in practice
            raise SessionConflict(f"new session id {session_id!r} already exists")
        await self._index(owner, session_id, header.created_at)
        return self._cache(session_id, header, self._on_device(tensors))

    async def _index(self, owner: str | None, session_id: str, created_at: float) -> None:
        """List a session just written. It exists whether or not this lands: an error here (a burst that held
        every connection, say) answered a 429 or 503 for a session that was made, so a client's retry made it
        twice. It is logged and tried again in the background (:meth:`_relist`): a cluster's failover (a few
        seconds) had left every session made meanwhile unlisted for good, their 201s given (found by a helper)."""
        try:
            await self._redis.index(owner, session_id, created_at)
        except StoreUnavailable as err:
            if self._closed or len(self._unlisted) >= _UNLISTED_MAX:  # closing, or a flood while Redis is away
                log.warning("session %s was stored, but its owner's list could not be updated: it stays unlisted "
                            "(read by id, it is there): %s", session_id, err)
                return
            log.warning("session %s was stored, but its owner's list could not be updated yet (tried again until "
                        "Redis answers, for %.0f s): %s", session_id, _INDEX_RETRY_FOR_S, err)
            self._unlisted[session_id] = (owner, created_at, time.monotonic() + _INDEX_RETRY_FOR_S)
            if self._relisting is None or self._relisting.done():
                self._relisting = asyncio.create_task(self._relist(), name="txl-relist")

    async def _relist(self) -> None:
        """List again the sessions whose listing Redis missed, one at a time in one task (a task each had piled up
        under a burst: 200 creations, 1,590 calls in 2 s; a reviewer's), backing off while none lands."""
        wait = _RELEASE_RETRY_S
        while self._unlisted and not self._closed:
            await asyncio.sleep(wait)
            landed, failed = False, 0
            for session_id, (owner, created_at, until) in list(self._unlisted.items()):
                if self._closed or failed >= _RELIST_FAILURES:  # a round's tries end after that many failures:
                    break  # 100,000 waiting on a Redis that refuses had cost seconds of CPU a round (a reviewer's)
                if time.monotonic() > until:
                    del self._unlisted[session_id]
                    log.warning("session %s stays unlisted: its owner's list was unreachable for %.0f s", session_id,
                                _INDEX_RETRY_FOR_S)
                    continue
                try:
                    await self._redis.index(owner, session_id, created_at, prune=0)
                except StoreUnavailable:
                    failed += 1  # to the back: the next round tries the others first (another node may answer)
                    self._unlisted[session_id] = self._unlisted.pop(session_id)
                    continue
                except Exception as err:  # never out of the task unseen
                    log.warning("session %s stays unlisted (%s: %s)", session_id, type(err).__name__, err)
                del self._unlisted[session_id]
                landed = True
            wait = _RELEASE_RETRY_S if landed else min(2 * wait, 5.0)

    def _creation_time(self, now: float) -> float:
        """``now``, or a millisecond after the last session this store created: the owner index lists sessions
        oldest first by their creation in whole milliseconds, and two made within one millisecond came out in
        the order of their random ids."""
        self._last_created_ms = max(int(now * 1000), self._last_created_ms + 1)
        return (self._last_created_ms + 0.5) / 1000  # mid-millisecond: int(x * 1000) gives it back exactly

    async def _encode(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        mem_len: int,
        tokens_seen: int,
        metadata: dict[str, Any],
        owner: str | None,
        version: int = 1,
        created_at: float | None = None,
        ring: bool = True,
        window_span: int = 0,
    ) -> tuple[Header, bytes, bytes | None]:
        """Validate and serialise a state (in a thread unless small: it is CPU-bound) and describe it in a
        header: (header, payload, the whole ring unless ``ring`` is False or the state has no mems)."""
        codec.check_state(tensors, identity=self.identity, mem_len=mem_len, tokens_seen=tokens_seen)
        limit, mems, legacy = self.config.max_payload_bytes, tensors.get(codec.MEMS), self.config.legacy_format
        ring_bytes = 0 if mems is None or legacy else codec.ring_size(mems, tokens_seen=tokens_seen, mem_len=mem_len)
        if ring_bytes > limit:
            raise PayloadTooLarge(f"session memory is {ring_bytes} bytes as stored, over the {limit}-byte limit")

        def encode() -> tuple[bytes, bytes | None]:
            if legacy:
                return codec.encode_payload(tensors, max_bytes=limit, ring=False), None
            whole = None if mems is None or not ring else codec.encode_ring(mems, tokens_seen=tokens_seen,
                                                                             mem_len=mem_len)
            return codec.encode_payload(tensors, max_bytes=limit), whole

        if max(codec.state_nbytes(tensors), ring_bytes) <= codec.INLINE_BYTES:
            payload, whole = encode()
        else:
            payload, whole = await asyncio.to_thread(encode)
        now = time.time()
        if created_at is None:  # a new session: made and last updated at the same moment
            now = created_at = self._creation_time(now)
        form, window = codec.form_of(tensors), tensors.get(codec.WINDOW)
        header = Header(
            fingerprint=self.identity.fingerprint,
            n_layer=self.identity.n_layer,
            d_model=self.identity.d_model,
            mem_len=mem_len,
            dtype=str(tensors[codec.MEMS].dtype if form == codec.STATE_FORM else window.dtype),
            tokens_seen=tokens_seen,
            version=version,
            owner=owner,
            created_at=created_at,
            updated_at=now,
            metadata=metadata,
            payload_bytes=len(payload),
            format_version=2 if form == codec.WINDOW_FORM else 1 if legacy else codec.RING_FORMAT,
            form=form,
            tokenizer=self.identity.tokenizer,
            window_tokens=0 if window is None else window.numel(),
            window_span=max(self.identity.window_len, window_span, 0 if window is None else window.numel()),
            mem_rows=0 if mems is None or legacy else mems.size(1),
        )
        return header, payload, whole

    def _cache(self, session_id: str, header: Header, tensors: dict[str, torch.Tensor]) -> SessionInfo:
        """Put a state just written (already on the device) into the hot tier, if it fits, and describe it."""
        cached = self._hot.put(session_id, header.revision, tensors)
        return SessionInfo.from_header(session_id, header, tier="hot" if cached else "redis")

    def _info(self, session_id: str, header: Header) -> SessionInfo:
        tier = "hot" if self._hot.revision(session_id) == header.revision else "redis"
        return SessionInfo.from_header(session_id, header, tier=tier)

    def _on_device(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: t.detach().to(self.device) for name, t in tensors.items()}


def _verdict(raw: bytes, header: bytes) -> bool | None:
    """Whether the commit whose header is ``header`` is the one stored as ``raw``: True where the stored record is
    that commit's memory (its version and time written: a metadata update and a demotion to the cold tier keep
    both), False where it is older, None where another write came since (a commit through another lease, which
    may have followed this one or taken its place once its lease expired)."""
    if raw == header:
        return True
    try:
        stored, ours = codec.decode_header(raw), codec.decode_header(header)
    except (SessionCorrupt, SessionIncompatible):
        return None
    if stored.revision == ours.revision:
        return True
    return None if stored.version >= ours.version else False


def shown(session_id: object) -> str:
    """An id as an error message quotes it: whatever a client sent, at most ~80 characters of it."""
    text = repr(session_id)
    return text if len(text) <= 80 else f"{text[:64]}... ({len(str(session_id))} characters)"


def _new_id() -> str:
    """128 random bits, URL-safe, never starting with ``-``: an id a command line would take for an option
    (``txlserve-chat --session -x...`` was an argparse error for one session in 64)."""
    while (session_id := secrets.token_urlsafe(16)).startswith("-"):
        pass
    return session_id


def _checked_id(session_id: str) -> str:
    """An id that could not have been issued names no session (and must not reach a Redis key)."""
    if not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id):  # whatever a client sent
        raise SessionNotFound(f"session {shown(session_id)} not found")
    return session_id


def _parse_cursor(after: str | None) -> tuple[int, str] | None:
    if after is None:
        return None
    score, _, session_id = after.partition(".")
    if not _CURSOR_SCORE.fullmatch(score) or not _SESSION_ID.fullmatch(session_id):
        raise InvalidRequestError(f"invalid pagination cursor {after!r}: pass a page's next_cursor, or the id of "
                                  f"the session to start after", param="after")
    return int(score), session_id

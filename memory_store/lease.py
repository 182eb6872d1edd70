"""Leases: the exclusive right to commit to one session, kept alive while its holder lives.

The lease is a Redis key holding a random token with a short TTL. A background
task renews it while the holder runs; a holder that dies stops renewing and the
lease expires by itself, so no crashed process can block a session for longer
than ``lease_ttl_ms``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Generator
from types import TracebackType

from memory_store.redis_tier import RedisClock, RedisTier
from memory_store.session import Session
from txlserve.errors import StoreUnavailable, TxlError

log = logging.getLogger(__name__)


class Lease:
    """A held lease and the session as read when it was taken.

    ``session`` (and so ``version``) advances with every successful commit made
    under this lease; ``lost`` turns True when a renewal found the lease gone, and ``lost_to_outage`` too when
    it expired while Redis could not be reached (no other request need have taken it: a 503, not a 409).
    """

    def __init__(
        self,
        session: Session,
        token: str,
        *,
        tier: RedisTier,
        lease_ttl_ms: int,
        on_release: Callable[[Lease], None],
        clock: RedisClock | None = None,
        on_unreleased: Callable[[str, str], None] | None = None,
    ) -> None:
        self.session = session
        self.token = token
        self.clock = clock  # Redis's clock as the lease was taken: its commits' deadlines
        # called once a renewal finds the lease gone, with whether the session went with it (deleted)
        self.on_lost: Callable[[bool], None] | None = None
        self.lost = False
        self.lost_to_outage = False
        self._tier = tier
        self._on_release = on_release
        self._on_unreleased = on_unreleased  # (session id, token) of a release Redis did not hear: retried later
        self._released = False
        self._renewer = asyncio.create_task(
            self._renew_forever(lease_ttl_ms / 3000), name=f"txl-lease-renew-{session.session_id}"
        )

    @property
    def session_id(self) -> str:
        return self.session.session_id

    @property
    def version(self) -> int:
        return self.session.version

    @property
    def released(self) -> bool:
        return self._released

    async def _renew_forever(self, every_s: float) -> None:
        unreachable = False  # since the last renewal
        while True:
            await asyncio.sleep(every_s)
            try:
                renewed = await self._tier.renew(self.session_id, self.token, self.session.info.owner)
            except StoreUnavailable as err:
                # Keep trying: if Redis is back before the TTL runs out, nothing was lost.
                log.warning("could not renew the lease on session %s: %s", self.session_id, err)
                unreachable = True
                continue
            if renewed <= 0:
                self.lost, self.lost_to_outage = True, renewed == 0 and unreachable
                log.warning("lease on session %s %s", self.session_id,
                            "ended: the session was deleted" if renewed < 0 else
                            "expired while Redis was unreachable" if unreachable else "expired or was taken over")
                if self.on_lost is not None:  # its holder stops working for a commit that cannot land
                    self.on_lost(renewed < 0)
                return
            unreachable = False

    async def ending(self) -> None:
        """Tell the other replicas that this holder's client left and it is committing what it made: a request
        there for the session then waits the milliseconds that takes rather than answering 409 ("stop
        generating, then continue" behind a load balancer). An optimisation only: never raises for Redis."""
        if self._released or self.lost:
            return
        try:
            await self._tier.ending(self.session_id, self.token)
        except TxlError as err:  # Redis away, or a key of the wrong type: the commit meets it and says so
            log.debug("could not mark the lease on session %s ending: %s", self.session_id, err)

    async def release(self) -> None:
        """Give the lease back (only if still ours); idempotent, and never raises for Redis.

        If Redis cannot be reached the release is retried until it answers
        (``on_unreleased``), or the lease expires after its TTL. The release is
        shielded so that a holder being cancelled (a client that disconnected)
        still frees the session at once.
        """
        if self._released:
            return
        self._released = True
        self._renewer.cancel()
        try:
            await asyncio.shield(self._tier.release(self.session_id, self.token))
        except StoreUnavailable as err:
            log.warning("could not release the lease on session %s (retried until Redis answers, within its TTL): "
                        "%s", self.session_id, err)
            if self._on_unreleased is not None:
                self._on_unreleased(self.session_id, self.token)
        finally:
            self._on_release(self)

    def released_by_commit(self) -> None:
        """The commit that gave the lease back in Redis: stop renewing it, and make :meth:`release` a no-op."""
        if not self._released:
            self._released = True
            self._renewer.cancel()
            self._on_release(self)

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.release()


class LeaseRequest:
    """What ``store.lease(...)`` returns: awaitable (``lease = await ...``) and ``async with``-able."""

    def __init__(self, acquire: Callable[[], Awaitable[Lease]]) -> None:
        self._acquire = acquire
        self._lease: Lease | None = None

    def __await__(self) -> Generator[object, None, Lease]:
        return self._acquire().__await__()

    async def __aenter__(self) -> Lease:
        self._lease = await self._acquire()
        return self._lease

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._lease is not None:
            await self._lease.release()

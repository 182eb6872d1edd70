"""The Redis tier: key layout, the Lua scripts that make writes and leases atomic, error translation.

Layout (every key carries a hash tag, so a session, its ring and its lease share
one Redis Cluster slot and a script may touch all three)::

    txl:{<session id>}          hash: header (JSON), payload (safetensors bytes)
    txl:{<session id>}:ring     string: the memory's raw ring (format 3, :mod:`memory_store.codec`)
    txl:{<session id>}:lease    string: the holder's random token, PX lease_ttl_ms
    txl:{<session id>}:ending   string: the token of a holder whose client left (it commits what it made and
                                lets go), PX lease_ttl_ms; meaningful only while that token holds the lease
    txl:owner:{<owner hash>}    sorted set: session id -> created_at in ms

Every key has an idle TTL. Writes reset it; reads refresh it only once a tenth
of it (at most an hour) has passed, so that a read stays a read and never waits
for an fsync of the append-only file.

The owner index lives in another slot, so it is updated after the session is
written: a crash in between leaves a session that ``list`` misses until it
expires, never an index entry that ``list`` cannot skip.

This module speaks bytes and status strings; :mod:`memory_store.store` gives
them meaning. Any Redis or socket failure leaves here as ``StoreUnavailable``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis.asyncio
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from memory_store.metrics import StoreMetrics
from txlserve.errors import ConfigError, SessionCorrupt, StoreOverloaded, StoreUnavailable, TxlError

log = logging.getLogger(__name__)

ANY_VERSION = "*"
POOL_EXHAUSTED = "No connection available."  # redis-py's BlockingConnectionPool, once its wait for one ran out
ABSENT = -1

# Compare-and-set write. KEYS: the session, its lease, its ring, its ending mark. ARGV[1] is the
# version the caller read ('-1': must not exist, '*': overwrite whatever is
# there); ARGV[2] the lease token that must still be held ('' when the write is
# not under a lease); ARGV[7] '1' gives the lease back with the write (a
# request's last write: one round trip, not two). ARGV[8] is a deadline on this
# Redis's clock in ms ('' for none): a write that runs later is refused,
# {'EXPIRED', seconds, microseconds} with this node's clock (its sender may have
# given up on it by then: a Redis that stalls and resumes must not apply a
# commit behind a reported failure). ARGV[9] says what becomes of the
# ring: 'set' to ARGV[10]; 'del'; or 'patch': ARGV[10..18] are the format,
# fingerprint, n_layer, d_model, dtype, mem_len, tokens_seen, least rows and ring
# length the stored record must have (the state the patch was computed against),
# ARGV[19] the ring's full length, then (offset, bytes) pairs; a record that does not
# match is left alone: 'RESHAPE', and the caller writes it whole.
#
# Every script that writes is safe to run twice: redis-py sends a command again on a new
# connection when the first broke, and a reply lost after the script ran would otherwise be answered for the
# script's own effects: a commit that landed was a 409 'changed since it was leased', a creation 'already
# exists', and a lease taken was BUSY to its own taker for its whole TTL (found by a helper). A header is
# unique to its write (its version and its time), and a lease token to its taker.
_WRITE = """
local h = redis.call('HGET', KEYS[1], 'header')
if h == ARGV[3] then return 'OK' end  -- this very write, sent again
if ARGV[8] ~= '' then
  if redis.replicate_commands then redis.replicate_commands() end  -- TIME before writes: Redis 3.2-4 need it
  local t = redis.call('TIME')
  if tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000 > tonumber(ARGV[8]) then return {'EXPIRED', t[1], t[2]} end
end
local doc
if h then
  local ok
  ok, doc = pcall(cjson.decode, h)
  if not ok or type(doc) ~= 'table' then doc = nil end
end
if ARGV[1] ~= '*' then
  local expected = tonumber(ARGV[1])
  if not h then
    if expected >= 0 then return 'NOT_FOUND' end
  else
    if not doc or type(doc.version) ~= 'number' then return 'CORRUPT' end
    if doc.version ~= expected then return 'CONFLICT' end
  end
end
if ARGV[2] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[2] then return 'LEASE_LOST' end
if ARGV[9] == 'patch' then
  if not doc or doc.format_version ~= tonumber(ARGV[10]) or doc.form ~= 'state' or doc.fingerprint ~= ARGV[11]
     or doc.n_layer ~= tonumber(ARGV[12]) or doc.d_model ~= tonumber(ARGV[13]) or doc.dtype ~= ARGV[14]
     or doc.mem_len ~= tonumber(ARGV[15]) or doc.tokens_seen ~= tonumber(ARGV[16])
     or type(doc.mem_rows) ~= 'number' or doc.mem_rows < tonumber(ARGV[17])
     or redis.call('STRLEN', KEYS[3]) ~= tonumber(ARGV[18]) then
    return 'RESHAPE'
  end
  for i = 20, #ARGV, 2 do redis.call('SETRANGE', KEYS[3], tonumber(ARGV[i]), ARGV[i + 1]) end
  if tonumber(ARGV[18]) < tonumber(ARGV[19]) and redis.call('STRLEN', KEYS[3]) == tonumber(ARGV[19]) then
    -- filled to its last length by this write: set again whole, as Redis holds its bytes and no more (a string
    -- grown by SETRANGE keeps its doubling allocation for good: 1.5-1.7x a ring's bytes; found by a helper)
    redis.call('SET', KEYS[3], redis.call('GET', KEYS[3]))
  end
elseif ARGV[9] == 'set' then
  redis.call('SET', KEYS[3], ARGV[10])
else
  redis.call('DEL', KEYS[3])
end
if ARGV[2] ~= '' then
  if ARGV[7] == '1' then redis.call('DEL', KEYS[2], KEYS[4]) else redis.call('PEXPIRE', KEYS[2], ARGV[6]) end
end
redis.call('HSET', KEYS[1], 'header', ARGV[3], 'payload', ARGV[4])
for _, key in ipairs({KEYS[1], KEYS[3]}) do
  if ARGV[5] == '0' then redis.call('PERSIST', key) else redis.call('PEXPIRE', key, ARGV[5]) end
end
return 'OK'
"""

# A record read whole, in one command so that no write lands between its header, payload and ring.
_READ = """
local h = redis.call('HMGET', KEYS[1], 'header', 'payload')
return {h[1], h[2], redis.call('GET', KEYS[2])}
"""

# Take the lease only on an existing session of this owner, so that another
# owner learns 'not found' rather than 'busy'. Returns {status}, {'BUSY', the
# lease's milliseconds left, 1 if its holder is ending} or {'OK', header,
# seconds, microseconds}: the holder reads the header it leased, and this Redis's
# clock (for its commits' deadlines), in the same round trip.
_ACQUIRE = """
local h = redis.call('HGET', KEYS[1], 'header')
if not h then return 'NOT_FOUND' end
local ok, doc = pcall(cjson.decode, h)
if not ok or type(doc) ~= 'table' then return 'CORRUPT' end
local mine
if ARGV[3] == '1' then
  mine = (doc.owner == nil or doc.owner == cjson.null)
else
  mine = (doc.owner == ARGV[4])
end
if not mine then return 'NOT_FOUND' end
if redis.call('GET', KEYS[2]) == ARGV[1] then  -- taken by this very call, sent again
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
elseif not redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {'BUSY', redis.call('PTTL', KEYS[2]), redis.call('GET', KEYS[4]) == redis.call('GET', KEYS[2]) and 1 or 0}
end
if ARGV[5] ~= '0' then redis.call('PEXPIRE', KEYS[1], ARGV[5]); redis.call('PEXPIRE', KEYS[3], ARGV[5]) end
local t = redis.call('TIME')
return {'OK', h, t[1], t[2]}
"""

# Refresh an idle TTL only once a slice of it has passed: a PEXPIRE is a write,
# and with appendfsync always every write costs an fsync, which a read must not.
# Every key given (a session and its ring) is looked at on its own.
# The number of keys that were gone: an owner's index gone while one of its sessions is used is written again.
# A TTL is never shortened here, and ARGV[1] '0' (a server that keeps sessions forever) makes a key persistent:
# an owner's index must outlive every session in it, whatever TTL each server that wrote one had.
_TOUCH = """
local gone = 0
for _, key in ipairs(KEYS) do
  local left = redis.call('PTTL', key)
  if left == -2 then gone = gone + 1 end
  if ARGV[1] == '0' then
    if left >= 0 then redis.call('PERSIST', key) end
  elseif left >= 0 and left < tonumber(ARGV[1]) - tonumber(ARGV[2]) then
    redis.call('PEXPIRE', key, ARGV[1])
  end
end
return gone
"""

# List a session in its owner's index: ARGV[2] its score (created at, ms), ARGV[3] its id. The index's TTL only
# grows (ARGV[1] ms; '0': persistent), as _TOUCH's: a server of a shorter TTL, or of none, had cut it under the
# TTL of sessions other servers wrote, and they were never listed again once it expired (found by a helper).
_LIST = """
local existed = redis.call('EXISTS', KEYS[1])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
if ARGV[1] == '0' then
  redis.call('PERSIST', KEYS[1])
else
  local left = redis.call('PTTL', KEYS[1])
  if existed == 0 or (left >= 0 and left < tonumber(ARGV[1])) then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
end
return 1
"""

# The cold tier: rewrite a session in place, keeping its version and TTL, only if nobody holds its lease and
# nobody wrote since it was read. ARGV[1] the header read, byte for byte (a metadata update keeps the version, so
# a version compared alone let a sweep write back the metadata it had read), ARGV[2] header, ARGV[3] payload.
_DEMOTE = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 'BUSY' end
local h = redis.call('HGET', KEYS[1], 'header')
if not h then return 'NOT_FOUND' end
if h == ARGV[2] then return 'ALREADY' end  -- sent again, or another replica's sweep did the same first
if h ~= ARGV[1] then return 'CONFLICT' end
redis.call('HSET', KEYS[1], 'header', ARGV[2], 'payload', ARGV[3])
redis.call('DEL', KEYS[3])
return 'OK'
"""

# A header-only write (a metadata update): only if nobody holds the lease (its commit would write back the header
# it leased) and the header is still the one read, byte for byte. A write: the idle TTLs start again (ARGV[3],
# '0': none). KEYS: the session, its lease, its ring. ARGV[1] the header read, ARGV[2] the new one.
_SET_HEADER = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 'BUSY' end
local h = redis.call('HGET', KEYS[1], 'header')
if not h then return 'NOT_FOUND' end
if h == ARGV[2] and h ~= ARGV[1] then return 'OK' end  -- sent again
if h ~= ARGV[1] then return 'CONFLICT' end
redis.call('HSET', KEYS[1], 'header', ARGV[2])
for _, key in ipairs({KEYS[1], KEYS[3]}) do
  if ARGV[3] == '0' then redis.call('PERSIST', key) else redis.call('PEXPIRE', key, ARGV[3]) end
end
return 'OK'
"""

# 1: renewed; 0: the lease is gone (expired, taken); -1: and so is the session (deleted). KEYS: lease, session,
# ring. A leased session is not idle: its TTL is held at least a lease's (ARGV[3], '0': it has none), or a request
# running longer than --session-ttl-s lost the session it was making (found by a helper).
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if ARGV[3] ~= '0' then
    redis.call('PEXPIRE', KEYS[2], ARGV[3]); redis.call('PEXPIRE', KEYS[3], ARGV[3])
  end
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
return 0
"""

# A holder marks that it is ending (its client left; it commits and lets go), only while it holds the lease.
# KEYS: lease, ending.
_ENDING = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2]) and 1 end
return 0
"""

# KEYS: lease, ending mark (its holder's, gone with it).
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[2]); return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclasses.dataclass(frozen=True)
class RedisClock:
    """A lower bound on a Redis server's clock: its TIME as a lease was taken, and this process's monotonic clock
    once that reply was in (Redis read its clock before then). A commit's deadline is set on it, so that Redis
    refuses a commit that reaches it after this process stopped waiting for it."""

    redis_ms: float
    at: float  # time.monotonic() when the reply arrived

    @classmethod
    def read(cls, seconds: bytes | int, micros: bytes | int) -> RedisClock:
        """From a TIME reply just arrived."""
        return cls(int(seconds) * 1000 + int(micros) / 1000, time.monotonic())

    def now_ms(self) -> float:
        """At most what Redis's clock reads now (the clocks assumed to run at one rate)."""
        return self.redis_ms + (time.monotonic() - self.at) * 1000


def _dropped_connection(err: BaseException) -> bool:
    """Whether ``err`` is one of the two ways redis-py's cluster client fails a call whose connection another call
    closed: the transport's "unable to perform operation on <TCPTransport closed=True>" (asyncio's or uvloop's), or
    a connection's writer or reader already None in redis-py. Anything else keeps its traceback: matched by the
    module alone, a misuse of redis-py of ours (a list where it takes a mapping) read as an outage (a reviewer's)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    module = ("" if tb is None else tb.tb_frame.f_globals.get("__name__", "")).split(".")[0]
    if isinstance(err, RuntimeError):
        return module in ("asyncio", "uvloop", "redis") and "unable to perform operation on" in str(err)
    return module == "redis" and str(err).startswith("'NoneType' object has no attribute")


def timed_out(err: BaseException) -> bool:
    """Whether ``err`` is Redis not answering within the store's timeout (not a refused or broken connection)."""
    return isinstance(err, StoreUnavailable) and isinstance(err.__cause__, (redis.exceptions.TimeoutError,
                                                                             TimeoutError))


def session_key(session_id: str) -> str:
    return f"txl:{{{session_id}}}"


def ending_key(session_id: str) -> str:
    return f"txl:{{{session_id}}}:ending"


def ring_key(session_id: str) -> str:
    return f"txl:{{{session_id}}}:ring"


def lease_key(session_id: str) -> str:
    return f"txl:{{{session_id}}}:lease"


def owner_key(owner: str | None) -> str:
    """An owner may contain any character (``}`` too), so its index key uses a digest."""
    name = "anonymous" if owner is None else "o:" + owner
    return f"txl:owner:{{{hashlib.sha256(name.encode()).hexdigest()[:32]}}}"


CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


def redact_url(url: str) -> str:
    """A Redis URL fit for logs and error messages: scheme, host, port and path only. redis-py takes a password
    from ``user:password@`` and from the query (``?password=``), so both the user part and the query go; the
    user part up to the last ``@``, since a password written raw may hold ``/``, ``?`` or ``#``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<unparseable Redis URL>"
    return f"{scheme}://{re.split(r'[?#]', rest.rpartition('@')[2], maxsplit=1)[0]}"


def client_name() -> str:
    """What this process's connections to the embedded Redis are called in ``CLIENT LIST``: how its starter tells
    its own connections from those of the processes that joined it (the host name too: containers sharing a
    data dir may have the same pid)."""
    return f"txlserve-{socket.gethostname()}-{os.getpid()}".replace(" ", "_")


class _Cluster(redis.asyncio.RedisCluster):
    """redis-py's cluster client, with a timeout not retried, as :func:`connect` does for one server: the retry
    re-reads the cluster's map and asks the same primary again, so a primary that hangs cost every command on
    its slots twice ``op_timeout_s`` (and a best-effort touch of an owner's index on it held up every lease).
    A refused connection is still retried on the new map: a primary that failed over."""

    ERRORS_ALLOW_RETRY = tuple(e for e in redis.asyncio.RedisCluster.ERRORS_ALLOW_RETRY
                               if e is not redis.exceptions.TimeoutError)


def connect(url: str, *, op_timeout_s: float, max_connections: int = 64,
            name: str | None = None) -> redis.asyncio.Redis:
    """A client that fails fast: bounded socket waits, one immediate retry, a bounded wait for a connection.

    The single retry, on connection errors only, lets a pooled connection that
    died with a restarted server be replaced without the caller seeing an error;
    a timeout is not retried, so a hung server costs one ``op_timeout_s``. Under
    a burst, callers queue up to ``op_timeout_s`` for a pooled connection rather
    than failing at once as the default pool does when it is exhausted.

    ``redis+cluster://host:port`` (or ``rediss+cluster://``) names any node of a
    Redis Cluster: redis-py's cluster client finds the others and routes each key
    to its slot's primary (every key of one session shares a slot: the hash tag).
    """
    if url.startswith(CLUSTER_SCHEMES):
        return _Cluster.from_url(
            url.replace("+cluster", "", 1),
            socket_timeout=op_timeout_s,
            socket_connect_timeout=op_timeout_s,
            max_connections=max_connections,
            retry=Retry(NoBackoff(), 1),
        )
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url,
        client_name=name,  # only where asked: an ACL user without CLIENT SETNAME could not connect at all
        max_connections=max_connections,
        timeout=op_timeout_s,
        socket_timeout=op_timeout_s,
        socket_connect_timeout=op_timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
    )
    return redis.asyncio.Redis.from_pool(pool)


def connect_checked(url: str, op_timeout_s: float,
                    name: str | None) -> redis.asyncio.Redis | redis.asyncio.RedisCluster:
    """:func:`connect`, with a URL redis-py cannot parse refused in one line that quotes no password."""
    try:
        client = connect(url, op_timeout_s=op_timeout_s, name=name)
        if not isinstance(client, redis.asyncio.RedisCluster):
            client.connection_pool.make_connection()  # made, not opened: its options fail here, not at first use
        return client
    except TypeError as err:  # a query option no connection takes (redis-py passes each on as a keyword)
        option = re.search(r"keyword argument '(\w+)'", str(err))
        raise ConfigError(f"the Redis URL {redact_url(url)} has a query option redis-py does not take"
                          + (f": {option[1]}" if option else "") + " (ssl_* options need rediss://)") from None
    except redis.exceptions.RedisClusterException:  # a cluster URL's own rules (database 0 only)
        raise ConfigError(f"the Redis Cluster URL {redact_url(url)} could not be used (check its options, and that its "
                          "path is empty or /0: a cluster has only database 0)") from None
    except ValueError:  # redis-py's message may quote part of the password
        scheme = url.split("://", 1)[0] if "://" in url else ""
        if scheme not in ("redis", "rediss", "unix", *(s.removesuffix("://") for s in CLUSTER_SCHEMES)):
            raise ConfigError(f"the Redis URL {redact_url(url)} must start with redis://, rediss://, unix:// or "
                              "redis+cluster://") from None
        raise ConfigError(f"the Redis URL {redact_url(url)} could not be parsed (check that its port is a "
                          "number from 1 to 65535, its query options, and that any '/', '?', '#' or '@' in its "
                          "password is percent-encoded)") from None


def check_url(url: str | None) -> None:
    """Refuse a Redis URL that cannot be parsed, as the store's start would, without connecting: ``txlserve serve``
    checks it before importing torch and loading its model (seconds), so a mistyped URL is one line at once."""
    if url is not None:
        connect_checked(url, 1.0, None)  # a client connects on its first command, never here


class RedisTier:
    """Session hashes, leases and owner indexes in one Redis database."""

    def __init__(
        self, client: redis.asyncio.Redis, *, where: str, ttl_s: int, lease_ttl_ms: int, metrics: StoreMetrics
    ) -> None:
        self._client = client
        self._cluster = isinstance(client, redis.asyncio.RedisCluster)
        self.where = where
        self._ttl_ms = ttl_s * 1000
        self._touch_slack_ms = min(self._ttl_ms // 10, 3_600_000)
        self._lease_ttl_ms = lease_ttl_ms
        # a leased session's TTL, renewed with its lease: whichever is longer (0: sessions never expire)
        self._held_ttl_ms = max(self._ttl_ms, lease_ttl_ms) if self._ttl_ms else 0
        # an owner's index outlives any session of it used at the same moment: touched only once a slice of its
        # TTL had passed, it had the session's TTL, so a session used within that slice outlived its index and was
        # never listed again (found by a helper)
        self._index_ttl_ms = self._held_ttl_ms + self._touch_slack_ms if self._ttl_ms else 0
        self._metrics = metrics
        self._write = client.register_script(_WRITE)
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._ending = client.register_script(_ENDING)
        self._touch_script = client.register_script(_TOUCH)
        self._list = client.register_script(_LIST)
        self._demote = client.register_script(_DEMOTE)
        self._set_header = client.register_script(_SET_HEADER)
        self._read = client.register_script(_READ)

    @contextmanager
    def _translate(self) -> Iterator[None]:
        try:
            yield
        except (RuntimeError, AttributeError) as err:
            if not _dropped_connection(err):  # ours (or redis-py's of another kind): a defect to see as it is
                raise
            # redis-py's cluster client closes a connection another coroutine is using as a slot moves or a node
            # fails ("unable to perform operation on <TCPTransport closed=True>", "'NoneType' object has no
            # attribute 'writelines'"): an outage of the moment, not a 500 (found by a helper)
            self._metrics.redis_errors += 1
            raise StoreUnavailable(f"Redis at {self.where} dropped a connection in use: {type(err).__name__}") from err
        except redis.exceptions.ResponseError as err:
            if "WRONGTYPE" in str(err):  # a pipeline or script prefixes the server's text
                raise SessionCorrupt("a key of the session has the wrong Redis type") from None
            self._metrics.redis_errors += 1
            raise StoreUnavailable(f"Redis at {self.where} refused a command: {err}") from err
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError, TimeoutError) as err:
            self._metrics.redis_errors += 1
            if isinstance(err, redis.exceptions.ConnectionError) and str(err) == POOL_EXHAUSTED:
                raise StoreOverloaded(f"every connection to Redis at {self.where} stayed busy for the store's timeout "
                                      "(more requests at once than connections); retry shortly") from err
            raise StoreUnavailable(f"Redis at {self.where} is unavailable: {err}") from err

    def _touch(self, pipe: redis.asyncio.client.Pipeline, *keys: str) -> None:
        if self._ttl_ms:
            pipe.evalsha(self._touch_script.sha, len(keys), *keys, self._ttl_ms, self._touch_slack_ms)

    def _touch_index(self, pipe: redis.asyncio.client.Pipeline, owner: str | None) -> None:
        """Also where sessions never expire, for a lease (its commit makes the session persistent): the index is
        made persistent once (an earlier server's TTL on it)."""
        pipe.evalsha(self._touch_script.sha, 1, owner_key(owner), self._index_ttl_ms, self._touch_slack_ms)

    def _touch_index_now(self, owner: str | None) -> Awaitable[Any]:
        return self._touch_script(keys=[owner_key(owner)], args=[self._index_ttl_ms, self._touch_slack_ms])

    async def _pipeline(self, build: Callable[[redis.asyncio.client.Pipeline], None]) -> list:
        """Run a (non-transactional) pipeline whose scripts ``build`` calls by sha. redis-py sends a SCRIPT EXISTS
        round trip before every pipeline that carries scripts; here a Redis that lost them (restarted, flushed)
        answers NOSCRIPT and gets them loaded. Only a NOSCRIPT for the first command (the one whose answer
        matters) runs the pipeline again, since that command then did nothing; the others are TTL touches, which
        the next use repeats, so their errors are not raised (the lease or read beside one stands)."""
        for attempt in range(2):
            async with self._client.pipeline(transaction=False) as pipe:
                build(pipe)
                results = await pipe.execute(raise_on_error=False)
            missing = [isinstance(r, redis.exceptions.NoScriptError) for r in results]
            if any(missing):
                await self.load_scripts()
            if not missing[0] or attempt:
                break
        if isinstance(results[0], Exception) and not missing[0]:  # the touches' errors: theirs to repeat
            raise results[0]
        if missing[0]:
            raise redis.exceptions.NoScriptError("the script was not found after loading it")
        return results

    async def ping(self) -> None:
        """A cluster is asked its state too: every node answers PING while a slot has no node (CLUSTERDOWN), when
        every session in that slot is a 503 (/ready had said 200; found by a helper)."""
        with self._translate():
            await self._client.ping()
            if self._cluster:
                info = await self._client.cluster_info(target_nodes=redis.asyncio.RedisCluster.PRIMARIES)
                states = {i.get("cluster_state") for i in info.values()} if all(
                    isinstance(i, dict) for i in info.values()) else {info.get("cluster_state")}
                if states != {"ok"}:
                    raise StoreUnavailable(f"the Redis Cluster at {self.where} is down (cluster_state: "
                                           f"{', '.join(sorted(str(s) for s in states))})")

    async def load_scripts(self) -> None:
        """Load the scripts pipelines call by sha (a cluster's are sent whole where missing): at start, so that
        the first uses' TTL touches are not lost to NOSCRIPT on a Redis that never ran them."""
        if not self._cluster:
            with self._translate():
                for script in (self._acquire, self._touch_script, self._read, self._list):
                    await self._client.script_load(script.script)

    async def evicts(self) -> str | None:
        """The eviction policy of a Redis that may drop keys when full (a maxmemory and a policy other than
        noeviction), else None; None too where CONFIG is not allowed (a managed Redis, an ACL user)."""
        try:
            conf = await self._client.config_get("maxmemory*")
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError):
            return None
        if not isinstance(conf, dict):
            return None
        policy, limit = conf.get("maxmemory-policy"), conf.get("maxmemory")
        return str(policy) if policy not in (None, "noeviction") and str(limit or "0") != "0" else None

    async def read(self, session_id: str, owner: str | None, *, payload: bool, ring: bool = True,
                   touch: bool = True) -> tuple[bytes | None, bytes | None, bytes | None]:
        """(header, payload, ring) of a session (only the header unless ``payload``; no ring unless ``ring``),
        refreshing its TTL and its owner's index TTL (unless ``touch`` is False: the cold-tier sweep reads without
        making a session look used)."""
        record = [session_key(session_id), ring_key(session_id)]
        fields = ("header", "payload") if payload else ("header",)
        whole = payload and ring
        with self._translate():
            if self._cluster:  # a cluster pipeline cannot carry scripts: the touches run beside the read
                touches = [self._touch_script(keys=record, args=[self._ttl_ms, self._touch_slack_ms]),
                           self._touch_index_now(owner)] if touch and self._ttl_ms else []
                read = (self._read(keys=record) if whole
                        else self._client.hmget(session_key(session_id), fields))
                values, *_ = await asyncio.gather(read, *touches, return_exceptions=True)
                if isinstance(values, BaseException):  # a touch that failed is the next use's to repeat
                    raise values
            else:
                def build(pipe: redis.asyncio.client.Pipeline) -> None:
                    if whole:
                        pipe.evalsha(self._read.sha, len(record), *record)
                    else:
                        pipe.hmget(session_key(session_id), fields)
                    if touch and self._ttl_ms:  # where sessions never expire, a read leaves the index as it is:
                        self._touch(pipe, *record)  # the session read keeps its TTL (a lease's commit drops it)
                        self._touch_index(pipe, owner)

                values = (await self._pipeline(build))[0]
        return (values[0], values[1], values[2] if whole else None) if payload else (values[0], None, None)

    async def write(
        self, session_id: str, *, header: bytes, payload: bytes, expected: int | str, token: str = "",
        release: bool = False, ring: bytes | None = None, guard: Sequence[str | int] | None = None,
        runs: Sequence[tuple[int, bytes]] = (), deadline_ms: float | None = None,
        on_expired: Callable[[RedisClock], None] | None = None,
    ) -> str:
        """Run the compare-and-set write (and with ``release``, give the lease ``token`` back if it wrote);
        returns OK, NOT_FOUND, CONFLICT, LEASE_LOST, CORRUPT, EXPIRED (it ran after ``deadline_ms`` on Redis's
        clock: nothing written; ``on_expired`` gets that node's clock as it refused), or with a ``guard`` RESHAPE
        (nothing written: the stored record is not the one the patch applies to). The ring becomes ``ring``; or
        with a ``guard`` (format, fingerprint, n_layer, d_model, dtype, mem_len, tokens_seen, least rows and length
        the stored record must have, then the ring's full length) it is patched with ``runs`` of (byte offset,
        bytes); or with neither (a record without one) it is removed."""
        keys = [session_key(session_id), lease_key(session_id), ring_key(session_id), ending_key(session_id)]
        args = [str(expected), token, header, payload, self._ttl_ms, self._lease_ttl_ms, "1" if release else "0",
                "" if deadline_ms is None else str(int(deadline_ms))]
        if guard is not None:
            args += ["patch", *guard, *(x for run in runs for x in run)]
        else:
            args += ["del"] if ring is None else ["set", ring]
        with self._translate():
            reply = await self._write(keys=keys, args=args)
        if isinstance(reply, list):  # EXPIRED, with the clock of the node that ran it
            if on_expired is not None:
                on_expired(RedisClock.read(reply[1], reply[2]))
            return reply[0].decode()
        return reply.decode()

    async def index(self, owner: str | None, session_id: str, created_at: float, *, prune: int = 2) -> None:
        """List a session in its owner's index, and drop up to ``prune`` entries, drawn at random, whose session
        has expired: those stayed for good in an index kept alive by its owner's other sessions (300,000 of them
        made a listing's first page take 3 s, found by a helper). Each creation adds one and removes twice the
        dead share, so dead entries stay under half of an index."""
        key = owner_key(owner)
        args = [self._index_ttl_ms, int(created_at * 1000), session_id]
        with self._translate():
            if self._cluster:  # a cluster pipeline cannot carry scripts
                await self._list(keys=[key], args=args)
                drawn = await self._client.zrandmember(key, prune) if prune else []
            else:
                def build(pipe: redis.asyncio.client.Pipeline) -> None:
                    pipe.evalsha(self._list.sha, 1, key, *args)
                    if prune:
                        pipe.zrandmember(key, prune)

                results = await self._pipeline(build)
                drawn = results[-1] if prune else []
            if isinstance(drawn, Exception):  # the draw failed: the next creation prunes
                drawn = []
            drawn = [m.decode() for m in drawn or [] if m.decode() != session_id]
            if drawn:
                async with self._client.pipeline(transaction=False) as pipe:
                    for sid in drawn:
                        pipe.exists(session_key(sid))
                    alive = await pipe.execute()
                if dead := [sid for sid, n in zip(drawn, alive, strict=True) if not n]:
                    await self._client.zrem(key, *dead)

    async def index_score(self, owner: str | None, session_id: str) -> int | None:
        """When ``session_id`` was made (its place in the owner's index, milliseconds), or None if not there."""
        with self._translate():
            score = await self._client.zscore(owner_key(owner), session_id)
        return None if score is None else int(score)

    async def scan_index(
        self, owner: str | None, *, after: tuple[int, str] | None, count: int, newest_first: bool = False
    ) -> list[tuple[int, str, bytes]]:
        """Up to ``count`` (created_ms, session id, header) of live sessions after the cursor, oldest first (or
        newest first: "after" then means older).

        Entries whose session key is gone (expired or deleted) are skipped and
        removed from the index.
        """
        live: list[tuple[int, str, bytes]] = []
        dead: list[str] = []
        key, cursor = owner_key(owner), after
        with self._translate():
            while len(live) < count:
                # Each batch starts from the last entry read, by key, not by an offset: a session made or dropped
                # between batches shifts offsets (a listing saw one twice, or skipped one for good). Entries that
                # share the cursor's score (sessions made in one millisecond by two processes) come first, so the
                # batch asks for that many more.
                ties = 0 if cursor is None else await self._client.zcount(key, cursor[0], cursor[0])
                if newest_first:  # score, then id, both descending: the ascending order reversed
                    rows = await self._client.zrevrangebyscore(
                        key, "+inf" if cursor is None else cursor[0], "-inf", start=0, num=count + ties,
                        withscores=True)
                else:
                    rows = await self._client.zrangebyscore(
                        key, "-inf" if cursor is None else cursor[0], "+inf", start=0, num=count + ties,
                        withscores=True)
                entries = [(int(score), member.decode()) for member, score in rows]
                entries = [e for e in entries if cursor is None or (e < cursor if newest_first else e > cursor)]
                if not entries:
                    break
                cursor = entries[-1]
                async with self._client.pipeline(transaction=False) as pipe:
                    for _, session_id in entries:
                        pipe.hget(session_key(session_id), "header")
                    headers = await pipe.execute(raise_on_error=False)
                for (score, session_id), header in zip(entries, headers, strict=True):
                    if isinstance(header, redis.exceptions.ResponseError) and "WRONGTYPE" in str(header):
                        header = b""  # not a session hash: listed as corrupt, so skipped
                    elif isinstance(header, BaseException):  # a node that timed out, failed over or moved the slot:
                        raise header  # said as the store's outage (it was decoded as a header: a 500; a helper's)
                    if header is None:
                        dead.append(session_id)
                    elif len(live) < count:
                        live.append((score, session_id, header))
            if dead:
                await self._client.zrem(owner_key(owner), *dead)
        return live

    async def scan_sessions(self, batch: int = 256) -> AsyncIterator[tuple[str, bytes]]:
        """(session id, header) of every session in this Redis (every primary of a cluster), in no order. SCAN
        never blocks the server for long; a session written during the scan may or may not be seen."""
        ids: list[str] = []
        with self._translate():
            async for key in self._client.scan_iter(match="txl:{*}", count=batch):
                name = key.decode()
                if name.startswith("txl:{") and name.endswith("}"):  # not a lease or an owner index
                    ids.append(name[5:-1])
        for start in range(0, len(ids), batch):
            chunk = ids[start:start + batch]
            with self._translate():
                async with self._client.pipeline(transaction=False) as pipe:
                    for session_id in chunk:
                        pipe.hget(session_key(session_id), "header")
                    headers = await pipe.execute(raise_on_error=False)
            for session_id, header in zip(chunk, headers, strict=True):
                if isinstance(header, bytes):
                    yield session_id, header

    async def demote(self, session_id: str, *, header: bytes, payload: bytes, expected: bytes) -> str:
        """Rewrite a session in place if unleased and its header is still ``expected``: OK, BUSY, NOT_FOUND,
        CONFLICT, or ALREADY (it holds ``header``: this call's own write, sent again, or another sweep's)."""
        keys = [session_key(session_id), lease_key(session_id), ring_key(session_id)]
        with self._translate():
            return (await self._demote(keys=keys, args=[expected, header, payload])).decode()

    async def set_header(self, session_id: str, *, header: bytes, expected: bytes) -> str:
        """Replace a session's header alone if unleased and still ``expected``, starting its idle TTLs again: OK,
        BUSY, NOT_FOUND or CONFLICT."""
        keys = [session_key(session_id), lease_key(session_id), ring_key(session_id)]
        with self._translate():
            return (await self._set_header(keys=keys, args=[expected, header, self._ttl_ms])).decode()

    async def delete(self, session_id: str, owner: str | None) -> bool:
        """Drop a session and its lease (a holder's next commit then fails); True if it existed."""
        with self._translate():
            removed = await self._client.delete(session_key(session_id), lease_key(session_id), ring_key(session_id),
                                                ending_key(session_id))
        try:  # the index lives on another node of a cluster: a listing drops an entry whose session is gone, so a
            with self._translate():  # failure here is no failure of the delete (it was a 503 inviting a retry that
                await self._client.zrem(owner_key(owner), session_id)  # then found a 404; found by a helper)
        except StoreUnavailable as err:
            log.warning("session %s deleted; its owner's list keeps it until a listing drops it: %s", session_id, err)
        return removed > 0

    async def acquire(self, session_id: str, owner: str | None,
                      token: str) -> tuple[str, bytes | tuple[int, bool] | None, RedisClock | None, bool]:
        """Try to take the lease: (OK, the session's header, Redis's clock, unlisted), (BUSY, (the milliseconds the
        holder's lease has left, whether its holder is ending), None, False), or (NOT_FOUND or CORRUPT, None, None,
        False). The owner's index TTL is refreshed in the same round trip, as a read refreshes it; ``unlisted``:
        the index was gone (it expired, or a crash came between a creation's two writes), for the caller to list
        the session again."""
        keys = [session_key(session_id), lease_key(session_id), ring_key(session_id), ending_key(session_id)]
        args = [token, self._lease_ttl_ms, "1" if owner is None else "0", owner or "", self._held_ttl_ms]
        with self._translate():
            if self._cluster:  # the index lives in another slot: its touch runs beside
                reply, *touched = await asyncio.gather(self._acquire(keys=keys, args=args),
                                                       self._touch_index_now(owner), return_exceptions=True)
                if isinstance(reply, BaseException):  # a touch that failed is the next use's to repeat
                    raise reply
            else:
                def build(pipe: redis.asyncio.client.Pipeline) -> None:
                    pipe.evalsha(self._acquire.sha, len(keys), *keys, *args)
                    self._touch_index(pipe, owner)

                reply, *touched = await self._pipeline(build)
        if isinstance(reply, bytes):
            return reply.decode(), None, None, False
        if reply[0] == b"BUSY":
            return "BUSY", (int(reply[1]), len(reply) > 2 and int(reply[2]) == 1), None, False
        unlisted = bool(touched) and touched[0] == 1
        return reply[0].decode(), reply[1], RedisClock.read(reply[2], reply[3]), unlisted

    async def renew(self, session_id: str, token: str, owner: str | None = None) -> int:
        """Extend the lease if ``token`` still holds it, and hold the session's TTL and its ``owner``'s list's (a
        session in use is not idle: a request longer than the TTL kept its session but left its owner's list)."""
        with self._translate():
            renewed = int(await self._renew(keys=[lease_key(session_id), session_key(session_id),
                                                  ring_key(session_id)],
                                            args=[token, self._lease_ttl_ms, self._held_ttl_ms]))
        if renewed > 0:  # best effort, as a read's touch: the next renewal repeats it
            try:
                with self._translate():
                    await self._touch_index_now(owner)
            except TxlError as err:  # never out of the renewer: the lease must go on being renewed
                log.debug("renewing session %s's lease: its owner's list was not touched: %s", session_id, err)
        return renewed

    async def lease_state(self, session_id: str) -> tuple[bool, bool]:
        """Whether the session's lease is held, and whether its holder said it is ending (one MGET: the two keys
        share the session's hash slot)."""
        with self._translate():
            lease, ending = await self._client.mget(lease_key(session_id), ending_key(session_id))
        return lease is not None, lease is not None and ending == lease

    async def ending(self, session_id: str, token: str) -> bool:
        """Mark the lease ``token`` holds as ending; False if it no longer holds it."""
        with self._translate():
            return bool(await self._ending(keys=[lease_key(session_id), ending_key(session_id)],
                                           args=[token, self._lease_ttl_ms]))

    async def release(self, session_id: str, token: str) -> bool:
        with self._translate():
            return bool(await self._release(keys=[lease_key(session_id), ending_key(session_id)], args=[token]))

    async def aclose(self) -> None:
        await self._client.aclose()

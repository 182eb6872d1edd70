"""A separate process for the crash tests: commit a session, keep its lease, report, wait to be killed.

    python -m tests.memory_store.holder (--url URL | --data-dir DIR) [--lease-ttl-ms N]

Prints one JSON line {"session_id", "version", "pid"} once the commit returned.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

from memory_store import MemoryStore
from tests.memory_store.support import IDENTITY, make_state

OWNER = "holder"
COMMITTED_SEED = 2


async def hold(url: str | None, data_dir: str, lease_ttl_ms: int) -> None:
    store = MemoryStore.from_url(url, identity=IDENTITY, data_dir=data_dir, lease_ttl_ms=lease_ttl_ms)
    await store.start()
    info = await store.create(owner=OWNER, tensors=make_state(seed=1), mem_len=8)
    lease = await store.lease(info.session_id, owner=OWNER)
    committed = await store.commit(lease, make_state(seed=COMMITTED_SEED), tokens_seen=8)
    print(json.dumps({"session_id": info.session_id, "version": committed.version, "pid": os.getpid()}), flush=True)
    await asyncio.sleep(3600)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url")
    parser.add_argument("--data-dir", default="./.txlserve")
    parser.add_argument("--lease-ttl-ms", type=int, default=30_000)
    args = parser.parse_args()
    asyncio.run(hold(args.url, args.data_dir, args.lease_ttl_ms))


if __name__ == "__main__":
    main()

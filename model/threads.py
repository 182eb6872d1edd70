"""torch's CPU thread count, set deliberately by every command.

torch's default uses every core, and its worker threads spin while they wait for
each other: when another process keeps a core busy, a decode step waits for a
thread that is not running, and throughput collapses (on 2 cores under load,
`bench decode` fell from 212 to 5.5 tokens/s). Half the usable cores leaves room
for the server's event loop, Redis and neighbours; see BENCHMARKS.md.
"""

from __future__ import annotations

import os

import torch


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_threads(processes: int | None = None) -> int:
    """Half the usable cores, shared among ``processes`` (a server's ``--workers``; by default the processes
    torchrun started on this machine)."""
    share = processes or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, usable_cores() // 2 // share)


def set_threads(threads: int | None, processes: int | None = None) -> int:
    """Set torch's intra-op threads (``None``: :func:`default_threads` of ``processes``); the number in force."""
    n = default_threads(processes) if threads is None else threads
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    return n

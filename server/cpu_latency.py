"""A Linux CPU-latency QoS request held while requests run (``--cpu-latency-qos-us``).

Each token the engine thread makes is handed to the event loop's thread, and a stream's
request passes through Redis and back: every hand-off wakes a thread whose CPU went idle.
Where an idle CPU halts at once (a KVM guest whose ``guest_halt_poll_ns`` is 0, or bare
metal in a deep C-state), the waker pays for the wake-up: on a 2-vCPU VM measured here
~10% of a batch-1 decode step (BENCHMARKS.md, "The hand-off's floor").

Linux lets a process bound how long an idle CPU may take to wake: it writes a latency in
microseconds to ``/dev/cpu_dma_latency`` and the bound holds while the file stays open
(the kernel's PM QoS "CPU latency" request, as tuned's latency profiles and DPDK hold it;
the kernel drops it when the process exits, however it exits). With 0 idle CPUs poll
instead of halting. It is machine-wide and costs the idle CPUs' power, so the server holds
it only while requests run and for ``LINGER_S`` after the last one ends (a client's next
request on the same stream finds it still held), and only when asked: the file is root's
(a udev rule can give the service's group write access instead). llama.cpp's server polls
its own threads for the same reason (``--poll``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import struct
from collections.abc import Callable
from pathlib import Path

from txlserve.errors import ConfigError

log = logging.getLogger("txlserve")

DEVICE = "/dev/cpu_dma_latency"
NO_BOUND = 2_000_000_000  # the kernel's value for "no bound" (PM_QOS_CPU_LATENCY_DEFAULT_VALUE), in microseconds
HALT_POLL = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
LINGER_S = 1.0  # held this long after the last request ends: one stream's requests come back within milliseconds


def guest_halt_poll_ns() -> int | None:
    """How long this machine's idle CPUs poll before halting, where it is a KVM guest that says (Linux's haltpoll
    driver; None elsewhere). With 0, every hand-off of a token to a waiting thread wakes a halted CPU."""
    try:
        return int(HALT_POLL.read_text())
    except (OSError, ValueError):
        return None


class CpuLatencyQos:
    """Hold ``limit_us`` on ``path`` while :meth:`busy` outnumbers :meth:`idle`, and ``linger_s`` longer; call
    both on one event loop. ``limit_us`` None: never hold anything (the default)."""

    def __init__(self, limit_us: int | None, *, path: str = DEVICE, linger_s: float = LINGER_S,
                 opener: Callable[[str, int], int] = os.open) -> None:
        self.limit_us, self.path, self.linger_s, self._open = limit_us, path, linger_s, opener
        self.users = 0  # requests running
        self.fd: int | None = None  # the open request, while held
        self.holds = 0  # times a request was opened (a metric, and what the tests count)
        self._release: asyncio.TimerHandle | None = None
        self._warned = False  # a failure to hold is logged once until a hold succeeds again

    @property
    def held(self) -> bool:
        return self.fd is not None

    def check(self) -> None:
        """At start-up, before the model loads: a setting that cannot be honoured is one line, not a surprise later.
        It writes the kernel's "no bound", a request that changes nothing and is dropped as the file closes."""
        if self.limit_us is None:
            return
        try:
            self._write(NO_BOUND)
        except OSError as err:
            why = ("run the server as root or give its user write access to the file (a udev rule), or leave the "
                   "setting unset") if err.errno in (errno.EACCES, errno.EPERM) else (
                "it must be Linux's CPU latency QoS device, writable here; leave the setting unset elsewhere")
            raise ConfigError(f"cpu_latency_qos_us needs to write {self.path} ({err.strerror}): {why}") from None

    def _write(self, limit_us: int) -> int:
        """The open file holding ``limit_us``, or OSError with nothing left open."""
        fd = self._open(self.path, os.O_WRONLY)
        try:
            os.write(fd, struct.pack("i", limit_us))  # the kernel reads a native int32 of microseconds
        except OSError:
            os.close(fd)
            raise
        return fd

    def busy(self) -> None:
        """A request started: every hand-off it makes from now on should find the CPUs awake. Pair each call with
        one :meth:`idle`, or the request is held for good."""
        self.users += 1
        if self._release is not None:
            self._release.cancel()
            self._release = None
        if self.limit_us is not None and self.fd is None:
            try:
                fd = self._write(self.limit_us)
            except OSError as err:  # checked at start-up; if it fails now, requests run as they would without it
                if not self._warned:
                    log.warning("could not hold the CPU latency QoS request on %s: %s", self.path, err)
                    self._warned = True
                return
            self.fd, self.holds, self._warned = fd, self.holds + 1, False

    def idle(self) -> None:
        """A request ended. The last one lets the request go ``linger_s`` later rather than at once: one stream's
        next request comes back within milliseconds, and should not find the CPUs halted again."""
        self.users = max(0, self.users - 1)
        if self.users == 0 and self.fd is not None and self._release is None:
            self._release = asyncio.get_running_loop().call_later(self.linger_s, self._let_go)

    def _let_go(self) -> None:
        self._release = None
        if self.users == 0:
            self.close()

    def close(self) -> None:
        """Let the request go now (shutdown)."""
        if self._release is not None:
            self._release.cancel()
            self._release = None
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

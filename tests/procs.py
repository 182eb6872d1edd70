"""A child process whose output a test reads while it runs: every wait has a bound, and teardown
cannot deadlock (the process is killed before its pipes are closed, so no reader is left blocked)."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import subprocess
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest


def pid_alive(pid: int) -> bool:
    """Running, and not a zombie: an orphan's exit is reaped by whatever init this machine has."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_exit(pids: Iterable[int], timeout: float) -> bool:
    """Wait until every process of ``pids`` has exited (children or not: the kernel makes a pidfd readable when
    its process ends), at most ``timeout`` seconds; whether they all did."""
    fds = []
    try:
        for pid in pids:
            try:
                fds.append(os.pidfd_open(pid))
            except ProcessLookupError:  # gone and reaped already
                continue
            except OSError as err:
                if err.errno == errno.ENOSYS:
                    pytest.skip("this kernel has no pidfd_open")
                raise
        deadline, pending = time.monotonic() + timeout, set(fds)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select(list(pending), [], [], left)
            pending -= set(ready)
        return True
    finally:
        for fd in fds:
            os.close(fd)


class Streamed:
    def __init__(self, cmd: Sequence[str], **popen) -> None:
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     **popen)
        self.out = bytearray()
        self._changed = threading.Condition()
        self._eof = False
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        try:
            while data := self.proc.stdout.read1(4096):
                with self._changed:
                    self.out.extend(data)
                    self._changed.notify_all()
        except (OSError, ValueError):  # the pipe was closed under us
            pass
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    def wait_until(self, done, timeout: float, what: str):
        """Wait (on output events, not a clock) until ``done(out)`` returns a truthy value; return it."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not (result := done(bytes(self.out))):
                left = deadline - time.monotonic()
                if left <= 0 or self._eof:
                    raise AssertionError(f"{what}: not seen in {timeout} s (exit code {self.proc.poll()}); "
                                         f"output so far: {bytes(self.out)[-2000:]!r}")
                self._changed.wait(left)
            return result

    def wait_for(self, pattern: bytes, timeout: float = 120) -> int:
        return self.wait_until(lambda out: out.find(pattern) + 1, timeout, repr(pattern)) - 1

    def write(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def close_stdin(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    def wait(self, timeout: float = 60) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(timeout)
        return rc

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self._reader.join(30)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def __enter__(self) -> Streamed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

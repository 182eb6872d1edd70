"""Starting the engine process (server/engine_core.py) before this process imports torch and FastAPI.

Why: the engine process spends its first seconds importing torch, and so does the server. Started once the
server had imported everything, the two imports ran one after the other; started from ``txlserve serve`` as
soon as its settings are read, they run side by side (BENCHMARKS.md, "Start-up": with the meta-device load that
imports nothing more, the bundled checkpoint's server answers /ready after 3.6 s instead of 7.1 s on 2 cores).
The process waits for its settings on stdin, so nothing about
it is decided early: :meth:`EngineCore.start` takes it (or spawns one, where none was started early) and sends
them. One nobody takes is stopped when this process exits; if this process dies, the engine process reads the
end of its stdin and exits without a word.

With ``--api-server-count N`` the supervisor spawns one engine process with N connections (:func:`spawn`) and
hands each API server process one of them; that process :func:`attach`-es it, and its :meth:`EngineCore.start`
takes it instead of spawning an engine of its own.

Only the standard library here: importing this module must cost nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.settings import Settings

_lock = threading.Lock()
_early: tuple[subprocess.Popen[bytes], socket.socket] | None = None
_attached: socket.socket | None = None  # an API server's end of a shared engine process's connection


def spawn() -> tuple[subprocess.Popen[bytes], socket.socket]:
    """An engine process importing its modules, and this side's end of its connection."""
    proc, (ours,) = spawn_shared(1)
    return proc, ours


def spawn_shared(count: int) -> tuple[subprocess.Popen[bytes], list[socket.socket]]:
    """An engine process serving ``count`` connections (one per API server process), and their ends here."""
    pairs = [socket.socketpair() for _ in range(count)]
    fds = tuple(theirs.fileno() for _, theirs in pairs)
    try:
        proc = subprocess.Popen([sys.executable, "-c", "from server.engine_core import core_main; core_main()",
                                 ",".join(map(str, fds))], stdin=subprocess.PIPE, pass_fds=fds,
                                start_new_session=True)  # Ctrl-C reaches the server, which stops it
    except BaseException:
        for ours, _ in pairs:
            ours.close()
        raise
    finally:
        for _, theirs in pairs:
            theirs.close()
    return proc, [ours for ours, _ in pairs]


def attach(fd: int) -> None:
    """This process is an API server of a shared engine process: ``fd`` is its connection to it."""
    global _attached
    _attached = socket.socket(fileno=fd)


def take_attached() -> socket.socket | None:
    """The shared engine process's connection :func:`attach` was given, if any (once)."""
    global _attached
    with _lock:
        sock, _attached = _attached, None
    return sock


def spawn_early() -> None:
    """Start the engine process now, for :func:`take` to hand to the server once it has loaded."""
    global _early
    with _lock:
        if _early is None:
            _early = spawn()
            atexit.register(discard)


def take() -> tuple[subprocess.Popen[bytes], socket.socket] | None:
    """The process :func:`spawn_early` started, if any and still running (once)."""
    global _early
    with _lock:
        early, _early = _early, None
    if early is not None and early[0].poll() is not None:  # it died meanwhile: a new one says why
        _close(*early)
        return None
    return early


def discard() -> None:
    """Stop an early engine process nobody took (a server that failed before its model loaded)."""
    early = take()
    if early is not None:
        _close(*early)


def _close(proc: subprocess.Popen[bytes], ours: socket.socket) -> None:
    ours.close()
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: nothing else is in its group
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()
    proc.wait()


def core_settings(s: Settings, checkpoint: object = None, device: object = None, dtype: object = None
                  ) -> dict[str, Any]:
    """What the engine process is told: nothing secret (no keys, no Redis URL). ``checkpoint``, ``device`` and
    ``dtype`` as the server resolved them (a path, a torch device and dtype), or left to the engine process to
    resolve from the settings (a supervisor's, which imports no torch)."""
    return {"checkpoint": s.checkpoint if checkpoint is None else str(checkpoint),
            "device": str(s.device if device is None else device),
            "dtype": str(s.dtype if dtype is None else dtype).removeprefix("torch."),
            "mem_len": s.mem_len, "clamp_len": s.clamp_len, "prefill_chunk": s.prefill_chunk,
            "enforce_eager": s.enforce_eager, "prefill_products": s.prefill_products,
            "storage_dtype": s.storage_dtype, "max_batch": s.max_batch, "batch_bytes": s.batch_mb << 20,
            "stream_interval": s.stream_interval, "overlap": not s.disable_overlap_schedule,
            "hot_bytes": s.hot_cache_mb << 20, "threads": s.threads,
            "processes": s.workers if s.workers > 1 else None, "log_level": s.log_level, "log_format": s.log_format,
            "switch_interval_ms": s.switch_interval_ms,
            "stall_timeout_s": s.engine_timeout_s}  # a shared engine drops an API server that reads nothing this long

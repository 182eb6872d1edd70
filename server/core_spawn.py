"""Starting the engine process (server/engine_core.py) before this process imports torch and FastAPI.

Why: the engine process spends its first seconds importing torch, and so does the server. Started once the
server had imported everything, the two imports ran one after the other; started from ``txlserve serve`` as
soon as its settings are read, they run side by side (BENCHMARKS.md, "Start-up": with the meta-device load that
imports nothing more, the bundled checkpoint's server answers /ready after 3.6 s instead of 7.1 s on 2 cores).
The process waits for its settings on stdin, so nothing about
it is decided early: :meth:`EngineCore.start` takes it (or spawns one, where none was started early) and sends
them. One nobody takes is stopped when this process exits; if this process dies, the engine process reads the
end of its stdin and exits without a word.

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

_lock = threading.Lock()
_early: tuple[subprocess.Popen[bytes], socket.socket] | None = None


def spawn() -> tuple[subprocess.Popen[bytes], socket.socket]:
    """An engine process importing its modules, and this side's end of its connection."""
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-c", "from server.engine_core import core_main; core_main()",
                             str(theirs.fileno())], stdin=subprocess.PIPE, pass_fds=(theirs.fileno(),),
                            start_new_session=True)  # Ctrl-C reaches the server, which stops it
    theirs.close()
    return proc, ours


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

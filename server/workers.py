"""``txlserve serve --workers N``: N server processes on one port, sharing one store.

One process's event loop streams ~16,000 tokens/s at most (BENCHMARKS.md, "Fifth lease"): on a GPU the bundled
model's engine alone makes ~170,000 at batch 64, so one process serves a tenth of it. Workers are uvicorn's and
gunicorn's answer (``--workers``): each worker is a whole server (its engine, its event loop, its hot sessions)
and they share the store as replicas behind a load balancer do, so a session moves between them through Redis
under its lease and compare-and-set commits, and a hot copy in one worker is never used once another committed
a newer version (hot sessions are keyed by version).

The supervisor (this module, in the process ``txlserve serve`` started) holds the port, starts the embedded
Redis when no ``--redis-url`` is given (so that it outlives every worker and stops after the last), spawns the
workers, each with a listening socket of its own in the port's ``SO_REUSEPORT`` group (one shared socket where
there is none) and its settings, and passes SIGTERM and SIGINT on to them. A worker that exits on
its own stops the rest, and the supervisor exits non-zero, as vLLM's API server does when its engine dies: an
orchestrator restarts the whole server. A worker whose supervisor dies drains and exits (its stdin, the
supervisor's pipe, reaches its end).

``--api-server-count N`` runs the same way, but its workers are API servers of one engine process: the
supervisor spawns that process first (its model, batch and hot sessions), with a connection for each worker
(``server.core_spawn.spawn_shared``), and each worker serves HTTP, streams and leases and commits its requests'
sessions over its connection. The engine process dying stops the workers, as a worker dying does; it exits once
the last worker has stopped.

Each connection stays with the worker that accepted it; the kernel spreads new connections over the workers'
sockets by their addresses. ``/ready`` and ``/health`` answer for the worker that got the connection;
``/metrics`` for all of them: each worker shares its metrics on a unix socket in a directory of the supervisor's,
and the one scraped reads the others' and labels every sample with its ``worker``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from server import logs
from server.listen import REUSE_PORT, bind
from server.metrics import merge_workers
from server.settings import LISTS, Settings
from txlserve.errors import ConfigError, TxlError

if TYPE_CHECKING:
    from memory_store.embedded import EmbeddedRedis
    from server.runtime import Runtime

log = logging.getLogger("txlserve")

STOP_MARGIN_S = 20.0  # beyond a worker's own drain (shutdown_timeout_s; its cancelled runs get 10 s more, and the
# runtime's close comes after), before it is killed
ENGINE = -2  # the shared engine process's index among what the supervisor watches (the embedded Redis: -1)
ROOT = Path(__file__).resolve().parents[1]  # the folder holding this ``server`` package
# a worker imports the supervisor's own code: ``python -m`` would put the current directory first on its path,
# where a folder named ``server`` or ``model`` would replace ours in the workers alone
WORKER = f"import sys; sys.path[0] = {str(ROOT)!r}; from server.workers import main; sys.exit(main(sys.argv[1:]))"


def worker_settings(settings: Settings, redis_url: str | None) -> dict[str, Any]:
    """As JSON, for the worker's stdin: the supervisor's settings, on the Redis it started for them all."""
    return asdict(settings.replace(redis_url=redis_url or settings.redis_url))


def serve_workers(settings: Settings, sock: socket.socket) -> int:
    """Supervise ``settings.workers`` workers on ``sock`` (the port, held) until they stop; the exit status.
    The signal handlers cover the embedded Redis's start and stop too: a SIGTERM then must not orphan it."""
    from memory_store import MemoryStore
    from memory_store.embedded import EmbeddedRedis

    # a Redis that does not answer is one line, now, as one server says it: each worker said it once its model
    # had loaded, and the supervisor then a line more
    asyncio.run(MemoryStore.check_reachable(settings.redis_url, settings.store_timeout_s))
    supervisor = _Supervisor(settings, sock)
    with supervisor.handling_signals(), tempfile.TemporaryDirectory(prefix="txlserve-metrics-") as metrics:
        embedded = None if settings.redis_url else EmbeddedRedis(settings.data_dir)
        try:
            if embedded is not None:
                embedded.start()  # the workers join it; it stops after them
            code = supervisor.run(embedded.url if embedded else None, metrics, embedded)
        finally:
            supervisor.stop_all()
            if embedded is not None:
                embedded.stop()
    if code == 0 and supervisor.stopped_by is not None:  # stopped cleanly, the signal acts as on one server:
        signal.raise_signal(supervisor.stopped_by)  # a Ctrl-C exits 130, a SIGTERM as SIGTERM (it exited 0)
    return code


class _Supervisor:
    def __init__(self, settings: Settings, sock: socket.socket) -> None:
        self.settings, self.sock = settings, sock
        self.procs: list[subprocess.Popen[bytes]] = []
        self.engine: subprocess.Popen[bytes] | None = None  # with --api-server-count: the shared engine process
        self.engine_socks: list[socket.socket] = []  # its connections' ends, one per worker, until each is handed
        self.stopping = threading.Event()
        self.signalled: set[int] = set()  # workers already asked to stop
        self.stopped_by: int | None = None  # the first stop signal

    @contextlib.contextmanager
    def handling_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def run(self, redis_url: str | None, metrics: str, embedded: EmbeddedRedis | None = None) -> int:
        """Start the workers (``metrics``: the directory of their metrics sockets) and wait; the exit status. The
        embedded Redis the supervisor started is watched as a worker is: its death stops the workers (they joined
        it, so their /health could not tell, and nothing restarted it), for whatever supervises us to restart."""
        config = json.dumps(worker_settings(self.settings, redis_url)).encode() + b"\n"
        if self.settings.api_server_count > 1 and not self.stopping.is_set():
            self._spawn_engine()
        for index in range(self.settings.server_processes):
            if not self.stopping.is_set():
                self._spawn(index, config, metrics)
        for proc in self.procs:  # a signal that came while one was starting did not reach it
            if self.stopping.is_set() and proc.pid not in self.signalled:
                self._signal(proc, signal.SIGTERM)
        if not self.procs:  # stopped before the first started
            return 0
        shared = "" if self.engine is None else f", API servers of engine process {self.engine.pid}"
        log.info("started %d workers on port %d (pids %s%s)", len(self.procs), self.sock.getsockname()[1],
                 ", ".join(str(p.pid) for p in self.procs), shared)
        index, code = self._wait_first_exit(embedded.process if embedded is not None else None)
        if index == ENGINE and not self.stopping.is_set():
            return self._engine_exited(code)
        if index < 0 and not self.stopping.is_set():
            log.error("%s; stopping the workers", embedded.exited if embedded is not None else "Redis exited")
            self.stop_all()
            return 1
        if not self.stopping.is_set():
            log.error("worker %d (pid %d) exited with status %s; stopping the others", index, self.procs[index].pid,
                      code)
            self.stop_all()
            return code if code > 0 else 1  # a worker's own status (2: its one-line error), else 1
        self.stop_all()
        # uvicorn raises the signal it stopped on again once it has drained (a second Ctrl-C can land as its
        # handler is put back: -SIGINT)
        clean = (0, -signal.SIGTERM, 130, -signal.SIGINT)
        engine_clean = self.engine is None or self.engine.returncode == 0  # it exits 0 after its last server
        return 0 if engine_clean and all(p.returncode in clean for p in self.procs) else 1

    def _spawn_engine(self) -> None:
        """The engine process the API servers share, told its settings (the engine resolves the checkpoint, device
        and dtype itself: this process imports no torch)."""
        from server.core_spawn import core_settings, spawn_shared

        self.engine, self.engine_socks = spawn_shared(self.settings.api_server_count)
        assert self.engine.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it died at once: its workers hear of it, and waiting says how
            self.engine.stdin.write(json.dumps(core_settings(self.settings)).encode() + b"\n")
            self.engine.stdin.close()

    def _engine_exited(self, code: int) -> int:
        """The shared engine process exited on its own. One that could not load (status 2) told every worker
        why, and each says it in one line as it exits: they are waited for, so that line is the server's."""
        if code == 2:
            deadline = time.monotonic() + STOP_MARGIN_S
            for proc in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.0, deadline - time.monotonic()))
        else:
            log.error("the engine process (pid %d) exited with status %s; stopping the workers", self.engine.pid,
                      code)
        self.stop_all()
        return 2 if code == 2 else 1

    def _spawn(self, index: int, config: bytes, metrics: str) -> None:
        own = None
        if REUSE_PORT:  # a socket of its own in the port's group, listened on once the worker can serve
            own = bind(self.settings.host, self.sock.getsockname()[1], group=True, listen=False)
        fd = (own or self.sock).fileno()
        core = self.engine_socks[index] if self.engine_socks else None  # its connection to the shared engine
        fds = (fd,) if core is None else (fd, core.fileno())
        try:
            proc = subprocess.Popen([sys.executable, "-c", WORKER, str(fd), str(index), metrics,
                                     *([] if core is None else [str(core.fileno())])],
                                    stdin=subprocess.PIPE, pass_fds=fds,
                                    start_new_session=True)  # Ctrl-C reaches this process only
        finally:
            if own is not None:  # the worker has its copy
                own.close()
            if core is not None:
                core.close()
        self.procs.append(proc)
        assert proc.stdin is not None
        try:
            proc.stdin.write(config)  # never on a command line or in the environment: it may hold API keys
            proc.stdin.flush()  # and kept open: the worker drains and exits when it reaches its end (we died)
        except BrokenPipeError:  # it died at once; waiting for it says how
            pass

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        """Pass the signal on, as if each worker were the one server: SIGTERM or a first Ctrl-C drains, a second
        Ctrl-C stops without waiting (uvicorn's rule)."""
        if not self.stopping.is_set():
            log.info("stopping %d workers (%s)", len(self.procs), signal.Signals(sig).name)
            self.stopped_by = sig
        self.stopping.set()
        for proc in self.procs:
            self._signal(proc, sig)

    def _signal(self, proc: subprocess.Popen[bytes], sig: int) -> None:
        self.signalled.add(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)

    def _wait_first_exit(self, redis: subprocess.Popen[bytes] | None = None) -> tuple[int, int]:
        """Block until a worker (or ``redis``: index -1, the shared engine process: ``ENGINE``) exits, on pidfds
        where the kernel has them (no polling); its index and status."""
        watched = list(enumerate(self.procs)) + ([(-1, redis)] if redis is not None else []) + (
            [(ENGINE, self.engine)] if self.engine is not None else [])
        fds = {}
        if hasattr(os, "pidfd_open"):
            for i, proc in watched:
                with contextlib.suppress(OSError):
                    fds[os.pidfd_open(proc.pid)] = i
        try:
            while True:
                for i, proc in watched:
                    if proc.poll() is not None:
                        return i, proc.returncode
                if fds:
                    select.select(list(fds), [], [], 5.0)  # a pidfd turns readable when its process exits
                else:
                    time.sleep(0.2)  # no pidfds (not Linux): look again shortly
        finally:
            for fd in fds:
                os.close(fd)

    def stop_all(self) -> None:
        """SIGTERM every live worker not yet asked (each drains its requests), wait for them, then kill what is
        left: every worker is reaped before the embedded Redis stops."""
        live = [p for p in self.procs if p.poll() is None]
        for proc in live:
            if proc.pid not in self.signalled:  # a second SIGTERM would make it drain no faster
                self._signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.shutdown_timeout_s + STOP_MARGIN_S
        for proc in live:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker pid %d did not stop within %.0f s; killing it", proc.pid,
                            self.settings.shutdown_timeout_s + STOP_MARGIN_S)
                proc.kill()
                proc.wait()
        for proc in self.procs:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        for sock in self.engine_socks:  # connections never handed to a worker (stopped while starting them)
            sock.close()
        self.engine_socks = []
        if self.engine is not None:  # it exits once its last worker's connection has closed
            try:
                self.engine.wait(STOP_MARGIN_S)
            except subprocess.TimeoutExpired:
                log.warning("the engine process (pid %d) did not stop within %.0f s; killing it", self.engine.pid,
                            STOP_MARGIN_S)
                self.engine.kill()
                self.engine.wait()


def _metrics_socket(directory: str, index: int) -> str:
    return os.path.join(directory, f"worker-{index}.sock")


async def share_metrics(rt: Runtime, directory: str) -> asyncio.AbstractServer:
    """This worker's metrics on a unix socket in the supervisor's private directory, for the others' /metrics."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(await rt.render_metrics())
            await writer.drain()
        finally:
            writer.close()

    return await asyncio.start_unix_server(answer, path=_metrics_socket(directory, rt.worker or 0))


async def all_metrics(rt: Runtime, directory: str, timeout_s: float = 2.0) -> bytes:
    """Every worker's metrics, each sample labelled with its worker (:func:`server.metrics.merge_workers`), so
    that a scrape through the port counts them all whichever worker it reaches. A worker still loading, or
    gone, is left out of this scrape."""
    async def read(index: int) -> str:
        reader, writer = await asyncio.open_unix_connection(_metrics_socket(directory, index))
        try:
            return (await reader.read()).decode()  # to its end: the worker closes after writing
        finally:
            writer.close()

    parts = {rt.worker or 0: (await rt.render_metrics()).decode()}
    for index in range(rt.settings.server_processes):
        if index not in parts:
            try:
                parts[index] = await asyncio.wait_for(read(index), timeout_s)
            except (OSError, asyncio.TimeoutError):
                continue
    return merge_workers(parts)


def _read_settings(fd: int) -> Settings:
    """The supervisor's one JSON line, read from the descriptor itself: a buffered ``sys.stdin`` that a thread
    still blocks in aborts the interpreter at exit."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            raise ConfigError("a worker's settings ended early: start workers with txlserve serve --workers N")
        line += chunk
    values = json.loads(line)
    for name in LISTS:
        values[name] = tuple(values[name])
    return Settings(**values)


def _watch_supervisor(fd: int) -> None:
    """Drain and exit once the supervisor is gone (its pipe at its end), even if it was killed."""
    def watch() -> None:
        while os.read(fd, 4096):
            pass
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful exit, as the supervisor would ask

    threading.Thread(target=watch, name="txlserve-supervisor-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    """A worker (:data:`WORKER`, arguments FD INDEX METRICS_DIR [ENGINE_FD]: its connection to a shared engine
    process), its settings as one JSON line on stdin."""
    fd, index, metrics = int(argv[0]), int(argv[1]), argv[2] if len(argv) > 2 else None
    engine_fd = int(argv[3]) if len(argv) > 3 else None
    sock = None
    try:
        settings = _read_settings(sys.stdin.fileno())
        sock = socket.socket(fileno=fd)
        logs.configure(settings.log_level, settings.log_format, worker=index)
        _watch_supervisor(sys.stdin.fileno())
        from server import core_spawn
        if engine_fd is not None:  # an API server of the supervisor's engine process
            core_spawn.attach(engine_fd)
        elif settings.engine_process:  # its imports run beside this process's next ones
            core_spawn.spawn_early()
        from server.serve import serve

        return serve(settings, sock, worker=index, peers=metrics)
    except (TxlError, OSError) as err:  # a bad checkpoint, an unreachable Redis: one line, as `txlserve serve`
        print(f"txlserve: error: [worker {index}] {err}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as err:  # settings that no supervisor wrote
        print(f"txlserve: error: [worker {index}] unreadable settings ({err}): start workers with txlserve serve "
              "--workers N", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        # served: the worker leaves. A Ctrl-C pressed again (the supervisor passes each on) that landed in the
        # interpreter's teardown printed torch's atexit traceback, and the worker exited 1
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if sock is not None:
            sock.close()

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

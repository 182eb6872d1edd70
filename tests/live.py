"""A real `txlserve serve` process on a real socket, over a tiny checkpoint written by the tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import torch

from model.checkpoint import save_checkpoint
from model.transformer_xl import MemTransformerLM

REPO = Path(__file__).resolve().parents[1]
MODEL = "txl-test"
# max_tokens of a generation that a test stops (a disconnect, a cancel, a shutdown) and must never see end by
# itself: the tiny model streams ~2,800 tokens/s on a 2-core VM, so one left running would take over a minute.
# A 4,000-token stream ended in ~1.4 s there, which a faster machine could beat before the test's stop arrived.
LONG = 200_000
# The shared keyed server's API keys (tests/conftest.py ``keyed_server``). The third is test_client's
# test_list_pages's alone: its list is exactly the sessions that test made.
API_KEYS = ("key-alpha-123", "key-bravo-456", "key-charlie-789")


T = TypeVar("T")


def wait_for(probe: Callable[[], T], timeout: float, what: str, every: float = 0.05) -> T:
    """``probe()``'s first truthy value, asked every ``every`` s: for what a test can only see by looking (a
    log line, a gauge, a stored session). Fails with ``what`` after ``timeout`` s, however loaded the machine."""
    import pytest

    deadline = time.monotonic() + timeout
    while not (value := probe()):
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout:g} s for {what}")
        time.sleep(every)  # poll, bounded by the deadline
    return value


def stop_then_continue(stop_at: httpx.Client, go_on: httpx.Client, session_id: str, max_tokens: int) -> None:
    """"Stop generating, then continue at once", three times: a stream on ``stop_at`` closed after a few events, and
    the next request sent through ``go_on`` (the same server, or another replica) the moment it closed, which must
    wait for the stopped run's commit, never be a 409. The clients are made beforehand: a new one takes ms."""
    for _ in range(3):
        body = {"model": MODEL, "prompt": " go", "max_tokens": max_tokens, "stream": True, "session_id": session_id}
        with stop_at.stream("POST", "/v1/completions", json=body) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i == 4:
                    break
        r = go_on.post("/v1/completions", json={"model": MODEL, "prompt": " on", "max_tokens": 2,
                                                "session_id": session_id})
        assert r.status_code == 200, r.text


def stop_then_read(stop_at: httpx.Client, read_at: httpx.Client, session_id: str, max_tokens: int) -> None:
    """"Stop generating, then save or branch at once": a stream on ``stop_at`` closed after a few events, then the
    session read through ``read_at`` (the same server, or another replica) the moment it closed, its fork, export
    and info each first in turn. Each must see what the stopped stream committed, which a request sent next (it
    waits for that commit) confirms: they read the session as it stood before the stream, 4 times in 6 (found by
    a helper)."""
    at = f"/v1/sessions/{session_id}"
    paths = {"fork": ("POST", f"{at}/fork"), "export": ("GET", f"{at}/export"), "info": ("GET", at)}
    for first in paths:
        body = {"model": MODEL, "prompt": " go", "max_tokens": max_tokens, "stream": True, "session_id": session_id}
        with stop_at.stream("POST", "/v1/completions", json=body) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i == 4:
                    break
        seen = {}
        for what in (first, *(p for p in paths if p != first)):
            r = read_at.request(*paths[what])
            assert r.status_code in (200, 201), r.text
            seen[what] = r.json()["tokens_seen"]
        r = read_at.post("/v1/completions", json={"model": MODEL, "prompt": "", "max_tokens": 1,
                                                   "session_id": session_id})
        assert r.status_code == 200, r.text
        assert seen == dict.fromkeys(paths, r.json()["session"]["tokens_seen"] - 1), first


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)


@contextlib.contextmanager
def nginx(prefix: Path, conf: str, ready_url: str, ready_status: int = 200) -> Iterator[subprocess.Popen]:
    """nginx running ``conf`` in ``prefix`` (its pid file, temp paths and stderr), once ``ready_url`` answers
    ``ready_status`` through it (within 30 s, else the test fails with nginx's stderr); stopped on the way out."""
    import pytest

    if NGINX is None:
        pytest.skip("no nginx binary (apt-get install nginx-light): this test needs one")
    (prefix / "nginx.conf").write_text(conf)
    with open(prefix / "stderr", "wb") as err:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([NGINX, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-g", "daemon off;"],
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(ready_url, timeout=1).status_code == ready_status:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"nginx did not start: {(prefix / 'stderr').read_text()[-2000:]}")
            time.sleep(0.05)  # poll, bounded by the deadline
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tiny_checkpoint(path: Path, seed: int = 0) -> Path:
    """A small random model with weights large enough that its text varies with context; it writes
    printable ASCII and newlines."""
    from model.config import TXLConfig

    torch.manual_seed(seed)
    model = MemTransformerLM(TXLConfig(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, dropout=0.0,
                                       tgt_len=16, mem_len=24))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.25)
        model.crit.out_layers[0].bias[128:] = -30.0  # generate ASCII, so texts compare exactly after a round trip
        model.crit.out_layers[0].bias[:32] = -30.0
        model.crit.out_layers[0].bias[10] = 0.0
    save_checkpoint(model, path)
    return path


class LiveServer:
    def __init__(self, checkpoint: Path, *, redis_url: str | None, data_dir: Path, port: int | None = None,
                 env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> None:
        self.checkpoint, self.redis_url, self.data_dir = checkpoint, redis_url, data_dir
        self.port = port or free_port()
        self.env, self.args = env or {}, args
        self.proc: subprocess.Popen | None = None
        self.log = data_dir / f"server-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> LiveServer:
        """Start the process without waiting for it (see ``start_all``)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "server.cli", "serve", "--checkpoint", str(self.checkpoint), "--port",
               str(self.port), "--model-name", MODEL, "--data-dir", str(self.data_dir),
               "--max-tokens-limit", str(LONG), *self.args]  # a test's own limit comes later, and wins
        if self.redis_url:
            cmd += ["--redis-url", self.redis_url]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **self.env}
        with open(self.log, "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout: float = 60) -> LiveServer:
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=1) as http:  # one for every poll: each new one builds a TLS context (37 ms of CPU)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
                try:
                    if http.get(self.url + "/ready").status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)  # poll, bounded by the deadline
        self.stop()
        raise RuntimeError(f"server did not become ready:\n{self.log.read_text()[-3000:]}")

    def start(self, timeout: float = 60) -> LiveServer:
        return self.launch().wait_ready(timeout)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def terminate(self, timeout: float = 30) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            try:
                self.terminate(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


def start_all(*servers: LiveServer, timeout: float = 90) -> tuple[LiveServer, ...]:
    """Start several servers side by side (each spends seconds importing torch, one core each); if one fails,
    every one is stopped before the error propagates."""
    try:
        for srv in servers:
            srv.launch()
        for srv in servers:
            srv.wait_ready(timeout)
    except BaseException:
        for srv in servers:
            srv.stop()
        raise
    return servers


def stream_deleted_midway(url: str, sid: str) -> list[dict]:
    """The events of a long streamed completion on session ``sid`` whose session is deleted (on a new connection)
    once three events have come: a DELETE wins over a running request, which ends with a 404 event."""
    import json

    import httpx

    events: list[dict] = []
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "go", "max_tokens": 4000, "stream": True, "session_id": sid}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 3:
                    assert httpx.delete(f"{url}/v1/sessions/{sid}", timeout=30).status_code == 200
    return events

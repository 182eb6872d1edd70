"""`txlserve serve --workers N`: real server processes on one port, sharing one store (server.workers)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.live import MODEL, REPO, LiveServer, stream_deleted_midway, wait_for
from tests.procs import pid_alive, wait_exit

WORKERS = ("--workers", "2", "--threads", "1")


def _children(pid: int) -> set[int]:
    """The live processes whose parent is ``pid`` (from /proc: no psutil)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.add(int(entry.name))
    return out


def _workers_of(srv: LiveServer) -> set[int]:
    """The worker pids of ``srv``'s supervisor: read once both have answered /ready, so both exist."""
    pids = set()
    for p in _children(srv.proc.pid):
        with contextlib.suppress(OSError):  # gone meanwhile
            if "server.workers" in Path(f"/proc/{p}/cmdline").read_text():
                pids.add(p)
    assert len(pids) == 2, f"the supervisor's children: {_children(srv.proc.pid)}"
    return pids


def _answered_by(url: str, path: str, timeout: float = 60) -> set[int]:
    """Ask ``path`` on fresh connections until both workers have answered (each connection stays with the one
    that accepted it, and the kernel hands new ones to either). Called once ``srv.start()`` saw one answer, so a
    worker listens and no connection is refused; a request that times out is asked again."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(seen) < 2 and time.monotonic() < deadline:
        with contextlib.suppress(httpx.TimeoutException):
            seen.add(httpx.get(url + path, timeout=10).json()["worker"])
    return seen


def _stop_drains_all(srv: LiveServer, sig: int, codes: tuple[int, ...], pids: set[int]) -> None:
    """``sig`` to the supervisor: it exits with one of ``codes`` once both workers have drained and ``pids`` (its
    workers, and the embedded Redis or the engine process it started) have exited."""
    srv.proc.send_signal(sig)
    assert srv.proc.wait(60) in codes
    assert wait_exit(pids, 30), "a worker, the embedded Redis or the engine process outlived the supervisor"
    assert srv.log.read_text().count("Finished server process") == 2  # each drained (uvicorn's last line)


pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists() or not hasattr(os, "pidfd_open"),
                                reason="reads /proc, waits on pidfds")


def test_workers_share_the_port_the_sessions_and_the_embedded_redis(checkpoint: Path, tmp_path: Path):
    """Two workers on one port share sessions, metrics and the embedded Redis; a second server cannot join the
    port; Ctrl-C drains both and stops the Redis they started."""
    srv = LiveServer(checkpoint, redis_url=None, data_dir=tmp_path / "data", args=WORKERS).start(timeout=120)
    try:
        assert _answered_by(srv.url, "/ready") == {0, 1}
        workers = _workers_of(srv)
        sid = httpx.post(srv.url + "/v1/sessions", json={"text": "Once"}, timeout=30).json()["id"]
        seen, texts, generated = 4, [], 0
        for i in range(60):  # each request on a new connection: the session goes from worker to worker
            r = httpx.post(srv.url + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": " and", "max_tokens": 3, "temperature": 0, "session_id": sid})
            assert r.status_code == 200, r.text
            body = r.json()
            seen += 4 + body["usage"]["completion_tokens"]
            generated += body["usage"]["completion_tokens"]
            assert body["session"]["tokens_seen"] == seen  # no request lost or repeated another's tokens
            texts.append(body["choices"][0]["text"])
            served = {w for w in (0, 1) for line in srv.log.read_text().splitlines()
                      if f"[worker {w}]" in line and "/v1/completions" in line and sid in line}
            if served == {0, 1} and i >= 3:
                break
        assert served == {0, 1}, "one worker served every continuation"
        info = httpx.get(f"{srv.url}/v1/sessions/{sid}", timeout=30).json()
        assert info["tokens_seen"] == seen
        for _ in range(4):  # whichever worker a scrape reaches, it counts every worker's tokens, each labelled
            text = httpx.get(srv.url + "/metrics", timeout=30).text
            assert text.count("# TYPE txlserve_generation_tokens_total counter") == 1  # one family, both workers'
            counts = {line.split('worker="')[1][0]: float(line.split()[-1]) for line in text.splitlines()
                      if line.startswith("txlserve_generation_tokens_total{")}
            assert set(counts) == {"0", "1"} and sum(counts.values()) == generated
        for extra in (WORKERS, ()):  # a second supervisor, or one server, on the same port: refused at once
            r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", str(srv.port), "--checkpoint",
                                str(checkpoint), "--data-dir", str(tmp_path / "other"), *extra], cwd=REPO,
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 2 and "cannot listen" in r.stderr and "Traceback" not in r.stderr, r.stderr
        redis_pid = int((tmp_path / "data" / "redis.pid").read_text())
        # Ctrl-C (SIGTERM takes the same handler): every worker drains, and it exits as one server does (it was 0)
        _stop_drains_all(srv, signal.SIGINT, (130,), workers | {redis_pid})
    finally:
        srv.stop()


def test_a_second_ctrl_c_stops_the_workers_at_once_and_quietly(checkpoint: Path, redis_url: str, tmp_path: Path):
    """The supervisor passes each Ctrl-C on. A second one, as a worker's stream drained, printed tracebacks: a
    worker raised both again, and one that landed in asyncio's or the interpreter's teardown was a KeyboardInterrupt
    there (torch's atexit; 1 stop in 6), or killed the worker (-SIGINT), which the supervisor called a failure."""
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path,
                     args=(*WORKERS, "--shutdown-timeout-s", "60")).start(timeout=120)
    try:
        workers = _workers_of(srv)
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "go", "max_tokens": 200_000, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # held: a generator of it, closed, would close the stream
            next(line for line in lines if line.startswith("data: "))  # the drain waits for it
            srv.proc.send_signal(signal.SIGINT)
            wait_for(lambda: "draining: waiting up to 60 s" in srv.log.read_text(), 60, "a worker's drain")
            srv.proc.send_signal(signal.SIGINT)
            assert srv.proc.wait(60) == 130
        assert wait_exit(workers, 30)
        log = srv.log.read_text()
        assert "Traceback" not in log and "exited with status" not in log, log[-3000:]
        assert "stopped at once (a second signal): 1 request(s) still running" in log, log[-3000:]
    finally:
        srv.stop()


def test_a_worker_that_dies_stops_the_server(checkpoint: Path, redis_url: str, tmp_path: Path):
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path, args=WORKERS).start(timeout=120)
    try:
        assert _answered_by(srv.url, "/ready") == {0, 1}
        first, *rest = sorted(_workers_of(srv))
        os.kill(first, signal.SIGKILL)
        assert srv.proc.wait(60) == 1
        assert wait_exit(set(rest), 30)
        assert "exited with status -9; stopping the others" in srv.log.read_text()
    finally:
        srv.stop()


def test_the_embedded_redis_dying_stops_the_workers(checkpoint: Path, tmp_path: Path):
    """The workers joined the Redis their supervisor started, so their /health could not tell it had died, and
    nothing watched it: every session request was a 503 for good behind a healthy server (found by a helper)."""
    srv = LiveServer(checkpoint, redis_url=None, data_dir=tmp_path / "data", args=WORKERS).start(timeout=120)
    try:
        workers = _workers_of(srv)
        os.kill(int((tmp_path / "data" / "redis.pid").read_text()), signal.SIGKILL)
        assert srv.proc.wait(60) == 1
        assert wait_exit(workers, 30)
        assert "embedded Redis server was killed by SIGKILL" in srv.log.read_text()
        assert "stopping the workers" in srv.log.read_text()
    finally:
        srv.stop()


def test_workers_drain_and_exit_when_their_supervisor_is_killed(checkpoint: Path, redis_url: str, tmp_path: Path):
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path, args=WORKERS).start(timeout=120)
    workers: set[int] = set()
    try:
        assert _answered_by(srv.url, "/ready") == {0, 1}  # both serving: a loading worker has nothing to drain
        workers = _workers_of(srv)
        srv.kill()
        assert wait_exit(workers, 60), "orphaned workers kept serving"
        assert srv.log.read_text().count("Finished server process") == 2  # each drained (uvicorn's last line)
    finally:
        for pid in workers:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


API_SERVERS = ("--api-server-count", "2", "--threads", "1")


def _engines_of(pid: int) -> set[int]:
    """The engine processes among ``pid``'s children."""
    found = set()
    for p in _children(pid):
        with contextlib.suppress(OSError):  # gone meanwhile
            if "core_main" in Path(f"/proc/{p}/cmdline").read_text():
                found.add(p)
    return found


def _served_by(lines: list[str], *needles: str) -> set[int]:
    """The workers whose request log lines among ``lines`` hold every one of ``needles``."""
    return {w for w in (0, 1) for line in lines if all(n in line for n in (f"[worker {w}]", *needles))}


def _a_delete_through_the_other_server_stops_a_stream(srv: LiveServer, tries: int = 16) -> bool:
    """A session deleted through one API server while the other streams on it: the stream ends at once with a
    404, as when both requests reach one server (the engine tells every server; else only the running request's
    next lease renewal would find out). Tried on fresh connections until the two requests reached different
    servers; whether they did."""
    for _ in range(tries):
        sid = httpx.post(srv.url + "/v1/sessions", json={"text": "Story: "}, timeout=30).json()["id"]
        mark = len(srv.log.read_text().splitlines())
        events = stream_deleted_midway(srv.url, sid)
        assert events[-1]["error"]["code"] == "session_not_found" and len(events) < 4000, events[-1]

        def logged_lines(mark: int = mark) -> list[str] | None:  # a request's line is written once its response
            lines = srv.log.read_text().splitlines()[mark:]  # has ended: the client may read the end first
            done = all(any(n in line for line in lines) for n in ('"route":"/v1/completions"', '"method":"DELETE"'))
            return lines if done else None

        lines = wait_for(logged_lines, 30, "the stream's and the DELETE's request log lines")
        (logged,) = [line for line in lines if '"route":"/v1/completions"' in line]
        for field in (sid, '"error":"session_not_found"', '"error_status":404'):  # its log line (a 200: the
            assert field in logged, logged  # stream had begun) says how it ended
        stream, delete = _served_by(lines, '"route":"/v1/completions"'), _served_by(lines, '"method":"DELETE"')
        if len(stream) == len(delete) == 1 and stream != delete:
            return True
    return False


def test_api_servers_share_one_engine_process_and_its_hot_sessions(checkpoint: Path, tmp_path: Path):
    """``--api-server-count 2``: two API servers on one port, one engine process between them, so a session
    continued by either is hot (with --workers the other worker reads it from Redis); the engine's figures are
    counted once in /metrics; a SIGTERM drains both servers and the engine process ends after them."""
    srv = LiveServer(checkpoint, redis_url=None, data_dir=tmp_path / "data",  # leases renewed every 200 s: only
                     args=(*API_SERVERS, "--lease-ttl-ms", "600000")).start(timeout=120)  # the engine tells of a DELETE
    try:
        assert _answered_by(srv.url, "/ready") == {0, 1}
        workers, (engine,) = _workers_of(srv), _engines_of(srv.proc.pid)
        assert not any(_engines_of(w) for w in workers), "an API server started an engine of its own"
        sid = httpx.post(srv.url + "/v1/sessions", json={"text": "Once"}, timeout=30).json()["id"]
        seen, served = 4, set()
        for i in range(60):  # each request on a new connection: either server, the same engine
            r = httpx.post(srv.url + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": " and", "max_tokens": 3, "temperature": 0, "session_id": sid})
            assert r.status_code == 200, r.text
            seen += 4 + r.json()["usage"]["completion_tokens"]
            assert r.json()["session"]["tokens_seen"] == seen
            lines = [line for line in srv.log.read_text().splitlines() if "/v1/completions" in line and sid in line]
            assert all('"restored_from":"hot"' in line for line in lines), lines  # never read back from Redis
            served = {w for w in (0, 1) for line in lines if f"[worker {w}]" in line}
            if served == {0, 1} and i >= 3:
                break
        assert served == {0, 1}, "one server served every continuation"
        tiers = {httpx.get(f"{srv.url}/v1/sessions/{sid}", timeout=30).json()["tier"] for _ in range(6)}
        assert tiers == {"hot"}  # whichever server answers
        text = httpx.get(srv.url + "/metrics", timeout=30).text
        hot = [line for line in text.splitlines() if line.startswith("txlserve_hot_sessions{")]
        assert len(hot) == 1 and 'worker="0"' in hot[0] and float(hot[0].split()[-1]) == 1.0, hot
        assert _a_delete_through_the_other_server_stops_a_stream(srv), "no DELETE reached the other server"
        _stop_drains_all(srv, signal.SIGTERM, (0, -signal.SIGTERM), workers | {engine})
    finally:
        srv.stop()


def test_the_shared_engine_process_dying_stops_the_api_servers(checkpoint: Path, redis_url: str, tmp_path: Path):
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path, args=API_SERVERS).start(timeout=120)
    try:
        workers, (engine,) = _workers_of(srv), _engines_of(srv.proc.pid)
        os.kill(engine, signal.SIGKILL)
        assert srv.proc.wait(60) == 1
        assert wait_exit(workers, 30)
        assert f"the engine process (pid {engine}) exited with status -9; stopping the workers" in srv.log.read_text()
    finally:
        srv.stop()


def test_api_servers_of_an_engine_that_cannot_load_say_why_in_one_line(tmp_path: Path):
    (tmp_path / "ckpt").mkdir()  # a directory, as the command line checks, but no checkpoint in it
    r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", "0", "--checkpoint",
                        str(tmp_path / "ckpt"), "--data-dir", str(tmp_path / "data"), *API_SERVERS], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "txlserve: error: [worker 0]" in r.stderr and "config.json" in r.stderr, r.stderr


def test_an_unreachable_redis_is_one_line_before_any_worker_starts(checkpoint: Path, tmp_path: Path):
    """Each worker said it after loading its model, and the supervisor a line more (four lines, seconds later);
    one server says it in one line before the model loads, and so does a supervisor now (of workers, or of API
    servers: the same supervisor)."""
    r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", "0", "--checkpoint", str(checkpoint),
                        "--data-dir", str(tmp_path), "--redis-url", "redis://127.0.0.1:1/0", *WORKERS], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines() == [line for line in r.stderr.splitlines() if "txlserve: error: Redis at" in line]
    assert len(r.stderr.splitlines()) == 1 and "is unavailable" in r.stderr, r.stderr


def test_a_worker_refuses_settings_not_from_a_supervisor():
    r = subprocess.run([sys.executable, "-m", "server.workers", "0", "0"], cwd=REPO, input=b"", capture_output=True,
                       timeout=60)
    assert r.returncode == 2 and b"Traceback" not in r.stderr, r.stderr
    assert b"--workers" in r.stderr


def test_each_worker_gets_its_share_of_the_cores():
    from model.threads import default_threads, usable_cores

    assert default_threads(processes=2) == max(1, usable_cores() // 2 // 2)
    from server.settings import Settings
    from txlserve.errors import ConfigError
    with pytest.raises(ConfigError, match="workers"):
        Settings(workers=0)
    for refused in ({"workers": 2}, {"engine_process": False}):  # a shared engine process, or none to share
        with pytest.raises(ConfigError, match="api_server_count"):
            Settings(api_server_count=2, **refused)


def test_a_lone_server_names_no_worker(server: LiveServer):
    assert httpx.get(server.url + "/ready", timeout=30).json() == {"status": "ready", "model": MODEL}

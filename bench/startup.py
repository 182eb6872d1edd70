"""`txlserve bench startup`: seconds from launching `txlserve serve` to its first 200 from /ready, against the
floor of any Python process that uses torch (``python -c "import torch"``), the two alternated in one run.

Why: a replica an orchestrator restarts, or a test suite that starts dozens of servers, waits this long. Most of
it was imports run one after the other; the ratio says how much is left above importing torch once."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.serve import _free_port
from txlserve.args import count
from txlserve.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def torch_import_s() -> float:
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=300, cwd=REPO)
    return time.monotonic() - started


def ready_s(checkpoint: str, extra: list[str], timeout_s: float = 300) -> float:
    """One server, embedded Redis in a fresh directory: launch, poll /ready every 20 ms, stop it (SIGTERM)."""
    port = _free_port()
    # one client for every poll: a new one each time built a TLS context, 37 ms of CPU every 20 ms, taken from
    # the server being timed
    with tempfile.TemporaryDirectory(prefix="txl-bench-startup-") as data_dir, \
            tempfile.TemporaryFile() as log, httpx.Client(timeout=1, trust_env=False) as http:
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--checkpoint", checkpoint, "--port",
                                 str(port), "--data-dir", data_dir, "--log-level", "warning", *extra], cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=log)
        try:
            while True:
                if proc.poll() is not None or time.monotonic() - started > timeout_s:
                    log.seek(0)
                    tail = log.read().decode(errors="replace").strip().splitlines()[-5:]
                    raise ConfigError("the server did not become ready; its log ends: " + " | ".join(tail))
                try:
                    if http.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                        return time.monotonic() - started
                except httpx.HTTPError:
                    pass
                time.sleep(0.02)  # poll, bounded by timeout_s
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # not SIGINT: a script's background job ignores it, as its child
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run(checkpoint: str, *, repeats: int = 3, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    ready, floor = [], []  # the first of each may read files from disk: the medians leave it out (repeats >= 3)
    for _ in range(repeats):
        floor.append(torch_import_s())
        ready.append(ready_s(checkpoint, list(extra)))
    return {"checkpoint": checkpoint, "repeats": repeats, "server_args": list(extra), "cpus": os.cpu_count(),
            "ready_s": ready, "ready_s_median": statistics.median(ready),
            "torch_import_s": floor, "torch_import_s_median": statistics.median(floor),
            "ready_over_torch_import": statistics.median(ready) / statistics.median(floor)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=None, help="default: the bundled checkpoint")
    p.add_argument("--repeats", type=count(1), default=3, help="server starts, each beside one torch import")
    p.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    p.add_argument("server_args", nargs="*", help="more `txlserve serve` flags, after --")


def main(ns: argparse.Namespace) -> int:
    from model.bundled import resolve_checkpoint

    checkpoint = str(resolve_checkpoint(ns.checkpoint))
    result = run(checkpoint, repeats=ns.repeats, extra=tuple(ns.server_args))
    print(json.dumps(result))  # one JSON object, as every benchmark prints (it printed a sentence without --json)
    return 0

"""torch's thread count is set deliberately: half the usable cores by default, or what the user asks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.threads import default_threads, set_threads, usable_cores

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_default_is_half_the_usable_cores(restore_threads, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_threads() == max(1, usable_cores() // 2)
    assert set_threads(None) == torch.get_num_threads() == default_threads()
    assert set_threads(1) == torch.get_num_threads() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(max(1, usable_cores())))  # torchrun: the cores are shared
    assert default_threads() == 1
    with pytest.raises(ValueError):
        set_threads(0)


def _run(code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


PROBE = """
import sys, torch
import server.cli as cli
cli._cmd_generate = lambda ns: (cli._set_threads(ns), print(torch.get_num_threads()), 0)[-1]
sys.exit(cli.main(["generate", "--prompt", "x", *sys.argv[1:]]))
"""


@pytest.mark.parametrize("args,env,want", [((), {}, str(default_threads())), (("--threads", "1"), {}, "1"),
                                           ((), {"TXLSERVE_THREADS": "1"}, "1"),
                                           (("--threads", "1"), {"TXLSERVE_THREADS": "7"}, "1")])
def test_cli_sets_the_thread_count(args, env, want):
    r = _run(PROBE, *args, env={"LOCAL_WORLD_SIZE": "1", **env})
    assert r.returncode == 0 and r.stdout.strip() == want, r.stderr


@pytest.mark.parametrize("args,env", [(("--threads", "0"), {}), ((), {"TXLSERVE_THREADS": "many"})])
def test_bad_thread_counts_are_one_line(args, env):
    r = _run(PROBE, *args, env=env)
    assert r.returncode == 2 and "threads" in r.stderr.lower() and "Traceback" not in r.stderr, r.stderr

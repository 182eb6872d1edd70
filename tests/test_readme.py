"""The README stays true: its test command is what CI runs, and it documents every setting."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from server.settings import Settings, env_names
from tests.live import MODEL

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_every_setting_is_documented_with_its_default():
    for name in env_names():
        assert f"`{name}`" in README, f"{name} is missing from the README's configuration table"
    assert "TXLSERVE_HOT_CACHE_MB` | `1024`" in README and Settings().hot_cache_mb == 1024


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "<!-- ci:test -->" in ci
    block = README.split("<!-- ci:test -->", 1)[1].split("```", 2)[1]
    command = block.split("\n", 1)[1].strip()
    # the same .venv as the serve command, never wiped: the test command must not destroy what the first made
    assert command.startswith("python3 -m venv .venv &&") and "--clear" not in command
    assert command.endswith("pytest -q")
    assert "pip install torch==2.13.0 &&" in command  # torch first, before anything that depends on it


def python_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.S)


def test_the_readme_has_the_snippets_users_need():
    snippets = python_snippets()
    assert any("from openai import OpenAI" in s and "extra_body" in s for s in snippets)
    assert any("AsyncClient" in s for s in snippets) and any("from txlserve_client import Client" in s
                                                               for s in snippets)


@pytest.mark.parametrize("index", range(len(python_snippets())))
def test_python_snippet_runs_as_written(server, index):
    """Each snippet, with only the address and model name of the test server swapped in."""
    code = python_snippets()[index].replace("http://127.0.0.1:8000", server.url).replace(
        "txl-shakespeare-small", MODEL)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "clients" / "python"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip(), "a snippet prints what it got"

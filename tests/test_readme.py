"""The README stays true: its test command is what CI runs, and it documents every setting."""

from __future__ import annotations

from pathlib import Path

from server.settings import Settings, env_names

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
    assert command.startswith("python3 -m venv --clear .venv") and command.endswith("pytest -q")
    assert "pip install torch==2.13.0 &&" in command  # torch first, before anything that depends on it

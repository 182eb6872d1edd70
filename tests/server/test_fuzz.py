"""A fuzzer driven by the server's own /openapi.json: schemathesis generates requests for every operation
against a live server, bounded in time, and no answer may be a 5xx. The suite gives it 12 s;
``TXLSERVE_FUZZ_SECONDS`` gives a release run longer."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.live import LiveServer

pytest.importorskip("schemathesis")


SECONDS = os.environ.get("TXLSERVE_FUZZ_SECONDS", "12")


@pytest.mark.timeout(int(float(SECONDS)) + 240)  # the suite's 300 s would cut a longer release run
def test_no_generated_request_gets_a_server_error(fuzz_server: LiveServer, tmp_path: Path):
    cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or shutil.which("schemathesis")
    assert cli, "schemathesis is a dev dependency"
    cmd = [cli, "run", fuzz_server.url + "/openapi.json", "--checks", "not_a_server_error",
           "--phases", "examples,fuzzing,stateful", "--max-time", SECONDS, "--workers", "2",
           "--request-timeout", "60", "--suppress-health-check", "all", "--seed", "1122"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=float(SECONDS) + 200, cwd=tmp_path,
                       env={**os.environ, "NO_COLOR": "1"})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[out.find("FAILURES"):][:6000] or out[-6000:]
    generated = int(re.search(r"(\d+) generated", out).group(1))
    assert generated >= 100, out[-2000:]  # it really ran
    assert httpx.get(fuzz_server.url + "/ready").status_code == 200

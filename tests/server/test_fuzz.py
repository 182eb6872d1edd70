"""A fuzzer driven by the server's own /openapi.json: schemathesis generates requests for every operation
against a live server, and no answer may be a 5xx.

The suite bounds the run by a number of cases per operation (``--max-examples``), not by time, so that a slow or
busy machine runs the same cases, only slower (a 12 s budget gave 562 cases on one machine and 47 on CI's).
``TXLSERVE_FUZZ_SECONDS`` turns it into a release run: fuzzing and stateful scenarios repeat for that long."""

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


SECONDS = os.environ.get("TXLSERVE_FUZZ_SECONDS")
EXAMPLES = 8  # per operation, in each of the fuzzing and stateful phases


@pytest.mark.timeout(int(float(SECONDS or 0)) + 280)  # the suite's 300 s would cut a longer release run
def test_no_generated_request_gets_a_server_error(fuzz_server: LiveServer, tmp_path: Path):
    cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or shutil.which("schemathesis")
    assert cli, "schemathesis is a dev dependency"
    budget = ["--max-time", SECONDS] if SECONDS else ["--max-examples", str(EXAMPLES)]
    cmd = [cli, "run", fuzz_server.url + "/openapi.json", "--checks", "not_a_server_error",
           "--phases", "examples,fuzzing,stateful", *budget, "--workers", "2",
           "--request-timeout", "60", "--suppress-health-check", "all", "--seed", "1122"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=float(SECONDS or 0) + 240, cwd=tmp_path,
                       env={**os.environ, "NO_COLOR": "1"})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[out.find("FAILURES"):][:6000] or out[-6000:]
    operations = int(re.search(r"Tested: (\d+)", out).group(1))
    generated = int(re.search(r"(\d+) generated", out).group(1))
    assert operations >= 16 and generated >= 4 * operations, out[-2000:]  # it really ran, every operation
    assert httpx.get(fuzz_server.url + "/ready").status_code == 200

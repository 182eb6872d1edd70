"""The test suite's own subprocess helper: its teardown cannot deadlock on a blocked reader (the
txlserve-chat test once hung for 11 minutes closing a pipe that a reader thread sat in)."""

from __future__ import annotations

import sys
import threading

import pytest

from tests.procs import Streamed


def test_close_returns_while_the_reader_is_blocked():
    silent = "import time; print('up', flush=True); time.sleep(600)"  # bounded: the test closes it
    proc = Streamed([sys.executable, "-c", silent])
    proc.wait_for(b"up", timeout=60)  # the reader is now blocked in read1 on a silent pipe
    closer = threading.Thread(target=proc.close)
    closer.start()
    closer.join(60)
    assert not closer.is_alive(), "close() deadlocked"
    assert proc.proc.returncode is not None


def test_wait_for_fails_with_the_output_when_the_process_ends_first():
    with Streamed([sys.executable, "-c", "print('partial output')"]) as proc, \
            pytest.raises(AssertionError, match="partial output"):
        proc.wait_for(b"never printed", timeout=60)

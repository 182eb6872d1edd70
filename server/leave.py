"""A process that has done its work leaves without Python's finalization."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from typing import NoReturn


def leave_without_finalizing(code: int = 0) -> NoReturn:
    """Exit now, after what the process says (logging, stdout, stderr) is flushed (status 120 where that failed,
    as Python's own exit). Once torch is loaded, the
    interpreter's teardown is slow and can crash, and nothing a finished process still needs happens in it:

    - an engine process's teardown took ~0.4 s (torch's C++ objects, every module's garbage), and every server's
      stop waited for it;
    - a torchrun worker's gloo threads drop their last collective's work object after the main thread has moved
      on, and that needs the GIL: a thread that asks for it once the interpreter is finalizing is killed
      mid-destructor and the process aborts ("terminate called without an active exception", 1 run in 6 of a
      2-rank CPU run). The process group cannot be freed first: torch keeps references to it until exit
      (pytorch#109478).

    A Ctrl-C from here on is ignored: the process is leaving already, and one pressed again during
    ``logging.shutdown``'s lock waits printed a KeyboardInterrupt traceback over the run's last line.
    """
    with contextlib.suppress(ValueError):  # only the main thread sets handlers
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.shutdown()
    failed = False
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # started without it (``>&-``): nothing was written there to lose
            continue
        try:
            stream.flush()
        except Exception:  # a full disk, a closed pipe: what it printed is lost, so it did not succeed
            failed = True
    if failed:  # as Python's own exit says it (status 120), not a success whose output is gone
        with contextlib.suppress(OSError):
            os.write(2, b"txlserve: error: the output could not be written\n")
        code = code or 120
    os._exit(code)

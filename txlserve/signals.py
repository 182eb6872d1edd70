"""SIGINT and SIGTERM held for a while, then acted on. Neutral, as :mod:`txlserve.errors`: a checkpoint's save
(model) and the server's start (server) both hold them."""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class HeldSignals:
    """From construction on, SIGINT and SIGTERM are recorded (or, once :attr:`forward` is set, handed to it);
    :meth:`release` puts back the handlers found and raises the recorded signals into them, once: a later call
    does nothing. A signal found ignored stays ignored: a shell starts a script's background jobs with SIGINT
    ignored, and a held one would have ended such a job's training early, with success. Main thread only, where
    Python runs signal handlers."""

    def __init__(self) -> None:
        self.held: list[int] = []
        self.released = False
        self.forward: Callable[[int, FrameType | None], object] | None = None
        self.previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS
                         if signal.getsignal(sig) is not signal.SIG_IGN}

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if self.forward is None:
            self.held.append(sig)
        else:
            self.forward(sig, frame)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        for sig, handler in self.previous.items():
            if handler is not None:  # None: one installed outside Python, which cannot be put back
                signal.signal(sig, handler)
        for sig in self.held:
            signal.raise_signal(sig)

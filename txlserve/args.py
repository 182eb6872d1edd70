"""Argument types for every command's flags: a bad number or device is refused by argparse in one line, before
torch loads, instead of failing later inside torch with a traceback (``--device banana``, ``--batch 0``,
``--lr nan``). Neutral, as :mod:`txlserve.errors`: the CLI and the benchmarks import it, it imports neither."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

_DEVICE = re.compile(r"(auto|cpu|mps|(cuda|xpu)(:\d+)?)")


def count(least: int = 1, most: int | None = None) -> Callable[[str], int]:
    """A whole number from ``least`` (to ``most``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < least or (most is not None and value > most):
            raise argparse.ArgumentTypeError(f"expected a whole number from {least}"
                                             + (f" to {most}" if most is not None else " up") + f", got {text}")
        return value

    return parse


def real(least: float, most: float | None = None, *, above: bool = False,
         below: bool = False) -> Callable[[str], float]:
    """A finite number from ``least`` (or above it, with ``above``) to ``most`` (or below it, with ``below``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        low_ok = value > least if above else value >= least
        high_ok = most is None or (value < most if below else value <= most)
        if not (math.isfinite(value) and low_ok and high_ok):
            bound = f"above {least:g}" if above else f"from {least:g}"
            top = "" if most is None else f" {'to below' if below else 'to'} {most:g}"
            raise argparse.ArgumentTypeError(f"expected a number {bound}{top}, got {text}")
        return value

    return parse


def device(text: str) -> str:
    """auto, cpu, cuda, cuda:N (mps, xpu where torch has them): torch's own message for anything else is a
    traceback from deep inside the model's loading."""
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def shape(text: str) -> str:
    """``LxD``: layers by d_model, e.g. 12x512."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts) or int(parts[1]) % 64:
        raise argparse.ArgumentTypeError(f"expected LAYERSxD_MODEL such as 12x512 (d_model a multiple of 64, the "
                                         f"heads' width), got {text!r}")
    return text.lower()

# The most torch threads a command or the server takes: 100,000 crashed torch's thread pool (SIGSEGV, found by a
# helper), and no machine this runs on has a thousand cores.
MAX_THREADS = 1024

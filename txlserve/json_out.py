"""JSON that every reader reads: Python writes a float that is not finite as bare ``NaN`` or ``Infinity``, which is
no JSON (jq, JavaScript and Go refuse the line). A diverged training's loss and perplexity are written ``null``."""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every float that is not finite (in dicts and lists, however nested) as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(value: Any) -> str:
    """One line of JSON, non-finite numbers as null."""
    return json.dumps(finite(value), allow_nan=False)

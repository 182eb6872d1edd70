"""A session's state between the engine's own form and what the store keeps, the same whether the engine runs in
the server's process or its own (``server/engine_core.py``): what is persisted, what a stored record restores
to, and the window a state is rebuilt from."""

from __future__ import annotations

import logging

import torch

from memory_store.codec import MEMS, WINDOW
from model.decode import DecodeState
from model.engine import Engine
from txlserve.errors import SessionCorrupt, StateIncompatible

log = logging.getLogger("txlserve.sessions")


def extend_window(window: list[int] | None, fed: list[int], tokens_before: int, size: int,
                  span: int = 0) -> list[int] | None:
    """A session's last ``size`` tokens (this model's window) after ``fed`` joined it, or as many as ``span`` (the
    longest window of the models that wrote it, its header's) or its stored ``window`` held, where that is more:
    a model that reads less context must not cut the window that a model reading more rebuilds it from (a
    rollback, or old and new replicas side by side, left such sessions a 422 for the old model after one request
    on the new; and a young session's window, its whole text, was cut to the reader's). The window stays bounded
    by the largest window of the models that wrote it (an import's, by ``IMPORT_WINDOW_TOKENS``). None while unknown (a
    session stored before windows existed gets one once ``size`` new tokens have passed)."""
    if window is None and tokens_before > 0:
        return fed[-size:] if len(fed) >= size else None
    return ((window or []) + fed)[-max(size, span, len(window or [])):]


def persisted(engine: Engine, state: DecodeState, window: list[int] | None, dtype: torch.dtype
              ) -> dict[str, torch.Tensor]:
    """What Redis keeps of a session: its mems and next-token scores in the storage dtype, and its last tokens
    (enough to rebuild it, with this model or another that reads text the same way)."""
    tensors = engine.export_state(state, dtype=dtype)
    if window is not None:
        tensors[WINDOW] = torch.tensor(window, dtype=torch.int32)
    return tensors


def stored_window(tensors: dict[str, torch.Tensor]) -> list[int] | None:
    return tensors[WINDOW].tolist() if WINDOW in tensors else None


def importable(engine: Engine, tensors: dict[str, torch.Tensor], fingerprint: str | None) -> bool:
    """Whether a stored record's hidden states are this engine's to import; else it is rebuilt from its window
    (a cold session, or one another checkpoint or attention window wrote)."""
    return MEMS in tensors and fingerprint == engine.fingerprint


def restore(engine: Engine, tensors: dict[str, torch.Tensor], tokens_seen: int, fingerprint: str) -> DecodeState:
    """The stored hidden states, imported (:func:`importable`). Written by this very model, a memory it cannot
    hold is a damaged record: the model's 400 (state_incompatible) had blamed the client for it (found by a
    helper)."""
    try:
        return engine.import_state(tensors, tokens_seen=tokens_seen, fingerprint=fingerprint)
    except StateIncompatible as err:
        raise SessionCorrupt(f"the stored session does not fit the model that wrote it: {err.message}") from None


def rebuild_window(engine: Engine, window: list[int], tokens_seen: int, session_id: str | None) -> list[int]:
    """The part of ``window`` a rebuild reads, or the error that it cannot be rebuilt here."""
    window = engine.check_window(window, tokens_seen)
    if len(window) < min(tokens_seen, engine.window_len):  # written by a model that reads less context
        log.info("session %s is rebuilt from a window of %d tokens, shorter than this model's %d: it continues "
                 "close to, not exactly as, the whole document would", session_id, len(window), engine.window_len)
    return window

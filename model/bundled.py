"""Where the checkpoint that ships with txlserve lives, so every command has a default model."""

from __future__ import annotations

from pathlib import Path

from txlserve.errors import CheckpointError

BUNDLED = Path(__file__).resolve().parent.parent / "checkpoints" / "shakespeare-small"


def resolve_checkpoint(path: str | Path | None) -> str:
    if path is not None:
        if not Path(path).is_dir():  # as read_meta says it, but before anything imports torch
            raise CheckpointError(f"checkpoint directory {path} does not exist")
        return str(path)
    if not (BUNDLED / "config.json").is_file():
        raise CheckpointError(f"no --checkpoint given and the bundled checkpoint is not at {BUNDLED} (it ships in "
                              "the repository: install with 'pip install -e .', or pass --checkpoint / set "
                              "TXLSERVE_CHECKPOINT)")
    return str(BUNDLED)

"""Where the checkpoint that ships with txlserve lives, so every command has a default model."""

from __future__ import annotations

from pathlib import Path

from txlserve.errors import CheckpointError

BUNDLED = Path(__file__).resolve().parent.parent / "checkpoints" / "shakespeare-small"


def not_a_directory(ckpt_dir: str | Path) -> str:
    """Why ``ckpt_dir`` is no checkpoint directory, in one line: a file given where the directory was meant (a
    pickle above all, which txlserve never loads) is not "a directory that does not exist"."""
    path = Path(ckpt_dir)
    if not path.exists():
        return f"checkpoint directory {ckpt_dir} does not exist"
    if path.suffix.lower() in (".bin", ".pt", ".pth", ".pkl", ".ckpt"):
        return (f"{ckpt_dir} is a pickle, which txlserve never loads: a checkpoint is a directory holding config.json "
                "and model.safetensors (a Hugging Face download converts with 'txlserve import hf')")
    return f"{ckpt_dir} is a file: a checkpoint is a directory holding config.json and model.safetensors"


def resolve_checkpoint(path: str | Path | None) -> str:
    if path is not None:
        if not Path(path).is_dir():  # as read_meta says it, but before anything imports torch
            raise CheckpointError(not_a_directory(path))
        return str(path)
    if not (BUNDLED / "config.json").is_file():
        raise CheckpointError(f"no --checkpoint given and the bundled checkpoint is not at {BUNDLED} (it ships in "
                              "the repository: install with 'pip install -e .', or pass --checkpoint / set "
                              "TXLSERVE_CHECKPOINT)")
    return str(BUNDLED)

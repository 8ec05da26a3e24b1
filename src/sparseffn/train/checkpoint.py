"""Checkpoints written atomically: the state goes to a temporary file in the same folder,
is flushed to disk, and is renamed over the old checkpoint, so a crash or Ctrl-C during the
write leaves the previous checkpoint intact."""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_atomic(state: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    return path


class CheckpointError(ValueError):
    """A file that is not a readable sparseffn checkpoint (truncated, empty, another format)."""


_KEYS = ("config", "model", "step")


def load(path: str | Path) -> dict:
    """The state saved by :func:`save_atomic`; a missing file is a FileNotFoundError, and
    anything else that is not a whole checkpoint of ours a :class:`CheckpointError`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        # our own files: they hold numpy RNG state and plain dicts besides tensors
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:   # truncated, empty, not a torch file, unpickling failure
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path} is not a readable checkpoint ({reason[:200]})") from None
    if not isinstance(state, dict) or any(key not in state for key in _KEYS):
        raise CheckpointError(f"{path} is not a sparseffn checkpoint (no "
                              f"{'/'.join(_KEYS)} in it)")
    return state

"""Checkpoints written atomically: the state goes to a temporary file in the same folder,
is flushed to disk, and is renamed over the old checkpoint, so a crash or Ctrl-C during the
write leaves the previous checkpoint intact.

A checkpoint holds tensors, numbers, strings and containers only (the RNG states as
tensors and numbers), so ``torch.load(path, weights_only=True)`` opens it, and so does
:func:`load`, which never unpickles arbitrary objects.

A run with experts sharded across N processes writes, beside ``checkpoint.pt``, one shard
per rank (``checkpoint.pt.experts-step{S}-rank{r}-of-{N}``: that rank's rows of every expert
parameter and of their optimizer state). The shards are written first; ``checkpoint.pt``,
written last and atomically, names them (``expert_shards``), so a crash in between leaves the
previous checkpoint and its shards whole. :func:`load` puts them back together: the state is
the one a single process would have written."""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import torch


def rng_state() -> dict:
    """The torch (CPU, and every CUDA device's once CUDA is in use), NumPy and Python RNG
    states, in types ``weights_only`` loading accepts."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    cuda = {"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_initialized() else {}
    return {"torch": torch.get_rng_state(), **cuda,
            "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)),
                      "position": int(position), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached_gaussian)},
            "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    """Restore :func:`rng_state` (or the NumPy tuple that checkpoints held before)."""
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():   # as many devices as both runs have
        for device, cuda_state in enumerate(cuda[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        numpy_state = (numpy_state["name"], numpy_state["keys"].numpy().astype(np.uint32),
                       numpy_state["position"], numpy_state["has_gauss"],
                       numpy_state["cached_gaussian"])
    np.random.set_state(numpy_state)
    random.setstate(state["python"])


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path in ``path``'s folder to write to; renamed over ``path`` when the block
    ends normally, deleted when it raises (or is interrupted), so ``path`` is never left half
    written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        yield Path(temp)
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise


def save_atomic(state: dict, path: str | Path) -> Path:
    with atomic_path(path) as temp, open(temp, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())
    return Path(path)


class CheckpointError(ValueError):
    """A file that is not a readable sparseffn checkpoint (truncated, empty, another format)."""


_KEYS = ("config", "model", "step")
# What checkpoints written before the RNG states were tensors need besides: the NumPy
# array of the NumPy RNG state (as the PyTorch documentation allows for NumPy arrays).
_numpy_core = getattr(np, "_core", None) or np.core
_OLD_NUMPY_RNG = [_numpy_core.multiarray._reconstruct, np.ndarray, np.dtype,
                  type(np.dtype(np.uint32))]


def shard_name(path: str | Path, step: int, rank: int, world: int) -> str:
    """The file name of rank ``rank``'s expert shard of the checkpoint ``path`` at ``step``."""
    return f"{Path(path).name}.experts-step{step}-rank{rank}-of-{world}"


def shard_files(path: str | Path) -> list[Path]:
    """Every expert shard file beside the checkpoint ``path``."""
    path = Path(path)
    return sorted(path.parent.glob(f"{path.name}.experts-*"))


def remove_stale_shards(path: str | Path, state: dict) -> None:
    """Delete the shard files beside ``path`` that its checkpoint ``state`` does not name."""
    keep = set((state.get("expert_shards") or {}).get("files", []))
    for file in shard_files(path):
        if file.name not in keep:
            file.unlink(missing_ok=True)


def _merge_expert_shards(state: dict, folder: Path) -> dict:
    """The one-process state from a checkpoint that names expert shards: each expert tensor
    is its shards' rows in rank order."""
    names = state.pop("expert_shards")["files"]
    shards = []
    for name in names:
        try:
            shards.append(torch.load(folder / name, map_location="cpu", weights_only=True))
        except FileNotFoundError:
            raise CheckpointError(f"{folder / name} is missing: the checkpoint in {folder} "
                                  f"keeps its experts in {len(names)} shard files") from None
        except Exception as error:
            raise CheckpointError(f"{folder / name} is not a readable expert shard "
                                  f"({str(error).strip()[:200]})") from None
    for key in shards[0]["model"]:
        state["model"][key] = torch.cat([shard["model"][key] for shard in shards])
    for i, rows in enumerate(shards[0]["optimizers"]):
        for index, entries in rows.items():
            for key in entries:
                state["optimizers"][i]["state"][index][key] = torch.cat(
                    [shard["optimizers"][i][index][key] for shard in shards])
    return state


def load(path: str | Path) -> dict:
    """The state saved by :func:`save_atomic` (with the expert shards of a sharded run put
    back together); a missing file is a FileNotFoundError, and anything else that is not a
    whole checkpoint of ours a :class:`CheckpointError`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        with torch.serialization.safe_globals(_OLD_NUMPY_RNG):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:   # truncated, empty, not a torch file, unpickling failure
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path} is not a readable checkpoint ({reason[:200]})") from None
    if not isinstance(state, dict) or any(key not in state for key in _KEYS):
        raise CheckpointError(f"{path} is not a sparseffn checkpoint (no "
                              f"{'/'.join(_KEYS)} in it)")
    if "expert_shards" in state:
        state = _merge_expert_shards(state, path.parent)
    return state

"""One process at a time per run folder: an advisory lock that the OS drops when its holder
exits, however it exits (so no stale lock survives a crash or a kill)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from .config import ConfigError

try:
    import fcntl
except ImportError:       # Windows: no flock; runs there are not protected from each other
    fcntl = None  # type: ignore[assignment]

LOCK = ".lock"            # holds the pid of the process that holds the lock


@contextlib.contextmanager
def folder_lock(folder: Path, what: str) -> Iterator[None]:
    """Hold ``folder/.lock`` exclusively while the block runs (creating ``folder``). Another
    process asking for it gets a ConfigError naming the holder's pid instead of writing into
    the same files; ``what`` names the asker in that message ("compare", "training run")."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / LOCK, "a+") if fcntl is not None else None
    except OSError as error:
        raise ConfigError(f"cannot write the run folder {folder}: "
                          f"{error.strerror or error}") from None
    if handle is None:
        yield
        return
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise ConfigError(f"cannot start this {what}: {folder} is in use by process "
                              f"{holder} (a compare or training run writing there); wait for it "
                              f"to finish, or write to another folder") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        try:
            yield
        finally:
            handle.seek(0)
            handle.truncate()
            fcntl.flock(handle, fcntl.LOCK_UN)
    finally:
        handle.close()

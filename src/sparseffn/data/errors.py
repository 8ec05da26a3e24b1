"""The one error a missing dataset raises."""

from __future__ import annotations


class MissingDataset(RuntimeError):
    """A dataset that is not on this machine. ``command`` is the exact shell command that gets
    it; the CLI prints the message and exits non-zero, without a traceback."""

    def __init__(self, name: str, detail: str, command: str | None) -> None:
        self.name, self.detail, self.command = name, detail, command
        message = f"dataset {name!r} is missing: {detail}"
        if command:
            message += f"\n  get it with:\n    {command}"
        super().__init__(message)

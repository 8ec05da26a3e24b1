"""A one-line progress bar on stderr: step, loss, tokens (or examples) per second and ETA.

On a terminal the line is redrawn in place; otherwise (CI logs, pipes) a plain line is printed
every ``every_fraction`` of the run, so logs stay short.
"""

from __future__ import annotations

import sys
import time


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60:02d}:{rest % 60:02d}"


class ProgressBar:
    def __init__(self, total: int, start: int = 0, label: str = "", unit: str = "tok",
                 stream=None, every_fraction: float = 0.1, width: int = 24) -> None:
        self.total, self.step, self.label, self.unit = total, start, label, unit
        self.stream = stream if stream is not None else sys.stderr
        self.live = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = max(1, int(total * every_fraction))
        self.width = width
        self.start_step, self.start_time = start, time.perf_counter()
        self.items = 0

    def update(self, step: int, items: int, note: str | None = None, **values: float) -> None:
        """``step`` steps are done; ``items`` tokens/examples were processed since the last call;
        ``note``: a warning shown at the end of the line (e.g. the collapse monitor's)."""
        self.step = step
        self.items += items
        if not self.live and step % self.every and step != self.total:
            return
        elapsed = time.perf_counter() - self.start_time
        rate = self.items / elapsed if elapsed > 0 else 0.0
        steps_done = step - self.start_step
        eta = (self.total - step) * elapsed / steps_done if steps_done else 0.0
        filled = int(self.width * step / max(1, self.total))
        bar = "#" * filled + "." * (self.width - filled)
        shown = " ".join(f"{k} {v:.4g}" for k, v in values.items())
        line = (f"{self.label} [{bar}] {step}/{self.total} {shown} | {rate:,.0f} {self.unit}/s | "
                f"{_duration(elapsed)} < {_duration(eta)}" + (f" | {note}" if note else ""))
        self.stream.write(("\r" + line + "\033[K") if self.live else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.live:
            self.stream.write("\n")
            self.stream.flush()

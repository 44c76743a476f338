"""A dependency-free progress bar on stderr: redrawn in place on a tty, a line per step in logs."""

from __future__ import annotations

import sys
import time

BAR_WIDTH = 24


class ProgressBar:
    """Shows `done/total`, elapsed time and what runs now."""

    def __init__(self, total: int, stream=sys.stderr) -> None:
        self.total = total
        self.done = 0
        self.stream = stream
        self.started = time.perf_counter()
        self.interactive = stream.isatty()

    def show(self, what: str) -> None:
        filled = BAR_WIDTH * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        elapsed = time.perf_counter() - self.started
        line = f"[{bar}] {self.done}/{self.total} {elapsed:6.1f}s {what}"
        if self.interactive:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def advance(self) -> None:
        self.done += 1

    def close(self) -> None:
        self.show("done")
        if self.interactive:
            self.stream.write("\n")
        self.stream.flush()

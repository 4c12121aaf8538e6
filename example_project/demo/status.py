"""A one-line progress display that suits a terminal and a log file alike.

On a terminal the line is rewritten in place; otherwise (``make demo > log``,
CI, a test capturing output) it is printed as a new line every few seconds,
so logs stay short and readable. Messages printed in between never collide
with the status line.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["StatusLine"]


class StatusLine:
    """The demo's status line on ``stream``."""

    def __init__(self, stream: TextIO | None = None, interactive: bool | None = None,
                 log_every: float = 5.0) -> None:
        self.stream = stream or sys.stdout
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self.log_every = log_every
        self._shown = False  # a status line is on screen (interactive only)
        self._last_logged = float("-inf")

    def update(self, text: str, force: bool = False) -> None:
        """Show ``text`` as the current status."""
        if self.interactive:
            self.stream.write("\r\x1b[K" + text)
            self._shown = True
        elif force or time.monotonic() - self._last_logged >= self.log_every:
            self.stream.write(text + "\n")
            self._last_logged = time.monotonic()
        self.stream.flush()

    def message(self, text: str) -> None:
        """Print a line of its own; the status line comes back on the next update."""
        self.clear()
        self.stream.write(text + "\n")
        self.stream.flush()

    def clear(self) -> None:
        """Remove the status line from a terminal."""
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False

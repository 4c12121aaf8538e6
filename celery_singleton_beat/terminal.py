"""How ``celery -A proj singleton`` writes: aligned tables (whole, or streamed row by row as
the keys are walked), JSON lists streamed the same way, and a progress line on stderr
that only a terminal gets. Presentation only; the commands are :mod:`.cli`."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

from .admin import ScanProgress

__all__ = ["JsonList", "Pending", "Progress", "StreamedTable", "as_json_text", "duration", "plural", "table",
           "utc"]


def utc(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.fromtimestamp(timestamp, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "never expires"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def table_cells(row: Sequence[Any]) -> list[str]:
    return ["-" if c is None else str(c) for c in row]


def table_line(cells: Sequence[str], widths: Sequence[int], numeric: Iterable[int]) -> str:
    right = set(numeric)
    return "  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                     for i, (cell, w) in enumerate(zip(cells, widths, strict=False))).rstrip()


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], numeric: Iterable[int] = ()) -> str:
    """A plain text table; columns in ``numeric`` are right-aligned."""
    cells = [[str(h) for h in headers]] + [table_cells(row) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(table_line(row, widths, numeric) for row in cells)


class StreamedTable:
    """A :func:`table` written while its rows come (``write`` gets text with its newlines):
    the first :data:`SIZED` rows (all of them when there are fewer) set the column widths and
    are written together; each later row as it comes, with those widths (a longer cell shifts
    the rest of its own row)."""

    SIZED = 100

    def __init__(self, write: Callable[[str], None], headers: Sequence[str], numeric: Iterable[int] = ()) -> None:
        self.write, self.headers, self.numeric = write, [str(h) for h in headers], tuple(numeric)
        self.rows: list[list[str]] = []
        self.widths: list[int] | None = None
        self.count = 0

    def add(self, row: Sequence[Any]) -> None:
        self.count += 1
        if self.widths is not None:
            self.write(table_line(table_cells(row), self.widths, self.numeric) + "\n")
            return
        self.rows.append(table_cells(row))
        if len(self.rows) >= self.SIZED:
            self.close()

    def close(self) -> None:
        """Write the rows held back (with the header), if any."""
        if self.widths is None and self.rows:
            cells = [self.headers, *self.rows]
            self.widths = [max(len(row[i]) for row in cells) for i in range(len(self.headers))]
            self.write("".join(table_line(row, self.widths, self.numeric) + "\n" for row in cells))
            self.rows = []


class JsonList:
    """A JSON list written item by item, as ``json.dumps(items, indent=2)`` prints it whole."""

    def __init__(self, write: Callable[[str], None]) -> None:
        self.write = write
        self.count = 0

    def add(self, item: Any) -> None:
        self.write(("[\n  " if not self.count else ",\n  ") + as_json_text(item).replace("\n", "\n  "))
        self.count += 1

    def close(self) -> None:
        self.write("\n]\n" if self.count else "[]\n")


class Pending:
    """Text for stdout held until the next SCAN call ends (:meth:`flush`), then written at once
    (one write per call rather than per row), with the progress line erased first."""

    def __init__(self, echo: Callable[..., None], progress: Progress) -> None:
        self.echo, self.progress = echo, progress
        self.parts: list[str] = []

    def write(self, text: str) -> None:
        self.parts.append(text)

    def flush(self) -> None:
        if self.parts:
            self.progress.clear()
            self.echo("".join(self.parts), nl=False)
            self.parts = []

    def after_each_call(self, status: ScanProgress) -> None:
        """The ``progress`` callback: what the call found, then the progress line."""
        self.flush()
        self.progress(status)


def plural(count: int, noun: str, nouns: str) -> str:
    return f"{count:,} {noun if count == 1 else nouns}"


class Progress:
    """``scanned ~420,000 of 1,000,000 keys: 12 locks`` on stderr while a command walks the keys,
    redrawn in place at most every :data:`REDRAW` seconds; only when stderr is a terminal, so
    that a pipe, a log or ``--json`` output gets none of it. It is a ``progress`` callback of
    the admin functions; :meth:`clear` before printing anything else to the terminal."""

    REDRAW = 0.1

    def __init__(self, noun: str, nouns: str, *, count_matched: bool = False) -> None:
        self.noun, self.nouns, self.count_matched = noun, nouns, count_matched
        try:
            self.enabled = sys.stderr.isatty()
        except (AttributeError, ValueError):  # replaced or closed
            self.enabled = False
        self.found = 0
        self.shown = False
        self.drawn_at: float | None = None

    def __call__(self, status: ScanProgress) -> None:
        if self.count_matched:
            self.found = status.matched
        now = time.monotonic()
        if self.enabled and not status.done and (self.drawn_at is None or now - self.drawn_at >= self.REDRAW):
            self.drawn_at = now
            of = "" if status.total is None else f" of {status.total:,}"
            self._write(f"scanned ~{status.scanned:,}{of} keys: {plural(self.found, self.noun, self.nouns)}")
            self.shown = True

    def clear(self) -> None:
        if self.shown:
            self._write("")
            self.shown = False

    def _write(self, line: str) -> None:
        sys.stderr.write(f"\r\x1b[K{line}")
        sys.stderr.flush()


def as_json_text(data: Any) -> str:
    return json.dumps(data, indent=2)

"""What waits, unread, in the pipes another process reads: seen from outside, without reading it.

A prefork pool process gets its jobs (and, at a shutdown, the end-of-work sentinel)
through a pipe its main process writes. A test that stopped the pool process
(SIGSTOP) can tell when the main process has written into it, and when it wrote
more, by the bytes waiting there: :func:`bytes_waiting`. Linux only (``/proc``).
"""

from __future__ import annotations

import array
import fcntl
import os
import stat
import termios
from pathlib import Path

__all__ = ["bytes_waiting"]


def _read_ends(pid: int) -> list[Path]:
    """The pipe ends process ``pid`` holds open for reading."""
    ends = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if not stat.S_ISFIFO(fd.stat().st_mode):
                continue
            flags = next(line for line in (Path(f"/proc/{pid}/fdinfo") / fd.name).read_text().splitlines()
                         if line.startswith("flags:"))
        except (OSError, StopIteration):  # closed meanwhile
            continue
        if int(flags.split()[1], 8) & os.O_ACCMODE == os.O_RDONLY:
            ends.append(fd)
    return ends


def bytes_waiting(pid: int) -> int:
    """Bytes written into the pipes process ``pid`` reads and not read yet (all of them summed).

    Each pipe is opened again through ``/proc`` for reading, never read: ``FIONREAD``
    only counts what is there.
    """
    total = 0
    for end in _read_ends(pid):
        try:
            fd = os.open(end, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:  # closed meanwhile
            continue
        try:
            count = array.array("i", [0])
            fcntl.ioctl(fd, termios.FIONREAD, count)
            total += count[0]
        finally:
            os.close(fd)
    return total

"""The history of a chaos run: what every process saw, one JSON line per event.

Each process appends to a file of its own in the run's history directory,
``<who>.<pid>.jsonl`` (``who``: ``worker-w1``, ``beat-b2``, ``submitter``,
``control``...), opened with ``O_APPEND`` and written with one ``write`` per
line: a line written before a SIGKILL is in the file, and the lines of one
process are in the order it wrote them. A forked pool child notices its new
pid and opens a file of its own.

Every line has ``ev`` (the event), ``m`` (``time.monotonic()``: one clock for
every process of the machine, what the checker orders by) and ``t`` (the wall
clock, for people and for beat slots); the file's first line (``ev: "proc"``)
names the process. :func:`load` reads a directory back, each event tagged
with the ``who`` and ``pid`` of its file, sorted by ``m``.

The events, by writer:

* task bodies (``app.py``): ``start`` (task id, key, fencing token, beat slot),
  ``chk`` (an ``ensure_held()``: ``m0`` taken before the call, ``ok``), ``end``
  (``how``: ``done``, ``lost``, ``error:<exception>``);
* workers' signals: ``prerun``, ``outcome`` (postrun: state and what it means),
  ``revoked`` (discarded or terminated), ``worker-up``;
* beats: ``beat-up``, ``sent`` (each slot message published: task id, entry, slot);
* any publisher of a task message that is not a beat slot (the submitter, a
  worker's retry): ``pub`` (task id, retries, ``m0`` when the publish began);
* the submitter: ``submit`` (task id, key, length, whether ``apply_async`` returned);
* the controller: ``phase``, ``fault`` (``inject`` / ``heal``), ``proc`` (starts,
  exits, signals), ``term`` (a SIGTERM and how long the exit took), ``keys``,
  ``counters``, ``result`` (each submission's state in the result backend).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ENV_DIR", "ENV_ROOT", "ENV_WHO", "Event", "History", "Recorder", "load", "recorder"]

#: Environment variables naming the history directory and the process's role.
ENV_DIR = "CHAOS_HISTORY"
ENV_WHO = "CHAOS_WHO"
#: The pid of a process that records under its own name without leading a session (the controller).
ENV_ROOT = "CHAOS_ROOT_PID"
#: The run's settings and plan, written by the controller.
META = "meta.json"


def _leads_session(pid: int) -> bool:
    try:
        return os.getsid(0) == pid
    except OSError:
        return True


class Recorder:
    """Appends events to this process's history file (one ``write`` per line)."""

    def __init__(self, directory: Path, who: str) -> None:
        self.directory = Path(directory)
        self.who = who
        self._pid = -1
        self._fd = -1
        self._lock = threading.Lock()

    def _open(self) -> int:
        pid = os.getpid()
        if pid != self._pid:  # first use, or a forked child
            # The processes the controller starts lead their own session; their pool
            # children do not. The controller names itself (ENV_ROOT).
            root = _leads_session(pid) or os.environ.get(ENV_ROOT) == str(pid)
            who = self.who if root else f"{self.who}-child"
            self.directory.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.directory / f"{who}.{pid}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._pid = pid
            self._write({"ev": "proc", "who": who, "pid": pid, "ppid": os.getppid(),
                         "t": time.time(), "m": time.monotonic()})
        return self._fd

    def _write(self, event: dict[str, Any]) -> None:
        os.write(self._fd, (json.dumps(event, separators=(",", ":"), default=str) + "\n").encode())

    def __call__(self, ev: str, **fields: Any) -> None:
        """Record event ``ev`` now (``m``/``t`` added unless given)."""
        event = {"ev": ev, "m": fields.pop("m", None) or time.monotonic(), "t": fields.pop("t", None) or time.time(),
                 **fields}
        with self._lock:
            self._open()
            self._write(event)


_recorder: Recorder | None = None


def recorder() -> Recorder | None:
    """This process's recorder, from ``CHAOS_HISTORY`` / ``CHAOS_WHO``; None outside a chaos run.

    A new one when they name another directory or role (a second run in one process).
    """
    global _recorder
    directory = os.environ.get(ENV_DIR)
    if not directory:
        return None
    who = os.environ.get(ENV_WHO) or "process"
    if _recorder is None or _recorder.directory != Path(directory) or _recorder.who != who:
        _recorder = Recorder(Path(directory), who)
    return _recorder


@dataclass(frozen=True)
class Event:
    """One line of the history, with the process that wrote it."""

    ev: str
    m: float
    t: float
    who: str
    pid: int
    data: dict[str, Any] = field(repr=False)

    def get(self, name: str, default: Any = None) -> Any:
        return self.data.get(name, default)

    def __getitem__(self, name: str) -> Any:
        return self.data[name]


@dataclass
class History:
    """A whole run: its settings (``meta``) and every event, in ``m`` order."""

    meta: dict[str, Any]
    events: list[Event]

    def of(self, *kinds: str) -> Iterator[Event]:
        """The events of these kinds, in order."""
        wanted = set(kinds)
        return (e for e in self.events if e.ev in wanted)

    def wall(self, m: float) -> float:
        """The wall-clock time of monotonic time ``m`` (from the controller's pair at start)."""
        anchor = self.meta.get("clock", {"t": 0.0, "m": 0.0})
        return float(anchor["t"]) + (m - float(anchor["m"]))

    def mono(self, t: float) -> float:
        """The monotonic time of wall-clock time ``t``."""
        anchor = self.meta.get("clock", {"t": 0.0, "m": 0.0})
        return float(anchor["m"]) + (t - float(anchor["t"]))


def load(directory: Path) -> History:
    """Read a history directory back (``meta.json`` and every ``*.jsonl``).

    A last line cut short (its process was killed in the middle of the write)
    is skipped; any other unreadable line is an error.
    """
    directory = Path(directory)
    meta_path = directory / META
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    events: list[Event] = []
    for path in sorted(directory.glob("*.jsonl")):
        who, pid = path.stem.rsplit(".", 1)[0], int(path.stem.rsplit(".", 1)[1])
        lines = path.read_text().split("\n")
        for number, line in enumerate(lines):
            if not line:
                continue
            try:
                data = json.loads(line)
            except ValueError:
                if number >= len(lines) - 2:  # the last line, cut by a kill
                    continue
                raise ValueError(f"{path}:{number + 1}: not a JSON line: {line[:80]!r}") from None
            events.append(Event(data.pop("ev"), float(data.pop("m")), float(data.pop("t")), who, pid, data))
    events.sort(key=lambda e: e.m)
    return History(meta, events)


def write(directory: Path, meta: dict[str, Any], events: list[dict[str, Any]], who: str = "synthetic",
          pid: int = 1) -> Path:
    """Write ``meta`` and ``events`` (dicts with ``ev``, ``m``, ``t``; the writing process's
    ``_who`` / ``_pid`` optional) as a history directory: the checker's self-tests build
    histories with it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / META).write_text(json.dumps(meta, indent=1, sort_keys=True))
    files: dict[tuple[str, int], list[str]] = {}
    for event in events:
        event = dict(event)
        key = (str(event.pop("_who", who)), int(event.pop("_pid", pid)))
        event.setdefault("t", event["m"])
        files.setdefault(key, []).append(json.dumps(event, separators=(",", ":")))
    for (name, number), lines in files.items():
        (directory / f"{name}.{number}.jsonl").write_text("\n".join(lines) + "\n")
    return directory

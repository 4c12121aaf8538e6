"""When the sentinels moved the lock Redis's primary, read from their logs into the history.

With ``LOCK=sentinel`` the primary changes with every failover, whatever caused it: a
``failover`` or ``reelect-primary`` fault, but also a ``restart-lock``, a ``busy-script``
or a ``pause-lock`` that kept the primary silent longer than the sentinels' down-after
time (1 s). A switch can lose writes (replication is asynchronous, and a former primary
elected again lacks everything written on the primary in between), done markers
included: the checker excuses a completed task run again after a switch (see
:func:`.checker.check`).

Each sentinel logs ``+switch-master <name> <old ip> <old port> <new ip> <new port>``
with its wall clock; :func:`record_switches` writes one ``switch`` event per line into
the history (``sentinels.0.jsonl``, rewritten each time, so a saved run can be read
again), its ``m`` from the run's clock pair.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from .history import META

__all__ = ["SWITCHES", "record_switches"]

#: The history file the switches go to (``who`` ``sentinels``).
SWITCHES = "sentinels.0.jsonl"

_LINE = re.compile(r"^\d+:X (?P<when>\d+ \w+ \d+ [\d:.]+) # \+switch-master \S+ (?P<old>\S+ \d+) (?P<new>\S+ \d+)")


def record_switches(run_dir: Path) -> int:
    """Write every ``+switch-master`` of the run's sentinel logs into its history; return how many."""
    history = Path(run_dir) / "history"
    meta_path = history / META
    if not meta_path.exists():
        return 0
    clock = json.loads(meta_path.read_text()).get("clock", {})
    if "t" not in clock or "m" not in clock:
        return 0
    lines = []
    for log in sorted(Path(run_dir).glob("sentinel*/sentinel*.log")):
        for text in log.read_text(errors="replace").splitlines():
            found = _LINE.match(text)
            if found is None:
                continue
            # Sentinel logs local time with milliseconds, as this machine's clock tells it.
            t = datetime.strptime(found["when"], "%d %b %Y %H:%M:%S.%f").timestamp()
            lines.append({"ev": "switch", "m": float(clock["m"]) + t - float(clock["t"]), "t": t,
                          "sentinel": log.parent.name, "old": found["old"].replace(" ", ":"),
                          "new": found["new"].replace(" ", ":")})
    target = history / SWITCHES
    if lines or target.exists():
        ordered = sorted(lines, key=lambda e: e["m"])
        target.write_text("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in ordered))
    return len(lines)

"""What a history says happened: runs, submissions and their fates, windows of faults.

The checker (:mod:`.checker`) judges these; the controller uses
:func:`open_submissions` to know when every submission has an end. Times are
monotonic seconds (``m``) unless named wall.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .history import Event, History

__all__ = ["TERMINAL", "Run", "Submission", "Window", "beat_down_windows", "fates", "fault_spans", "lock_gone_windows",
           "open_submissions", "runs"]

#: Postrun outcomes after which nothing more happens to a delivery (``waiting`` and
#: ``retry`` publish the same task id again).
TERMINAL = frozenset({"success", "failure", "skipped", "completed-copy", "revoked", "ignored"})
#: Result-backend states that are ends.
READY_STATES = frozenset({"SUCCESS", "FAILURE", "REVOKED"})
#: Faults after which the lock Redis has lost data (done markers, locks, records): an
#: empty restart, a failover (replication is asynchronous; a Cluster shard's primary
#: killed and failed over too), a former primary elected again with its older data.
DATA_LOSS = frozenset({"restart-lock-empty", "failover", "kill-primary", "reelect-primary"})


@dataclass
class Run:
    """One body run: from its ``start`` to its ``end`` (or its last event, if it died)."""

    id: str
    key: str
    who: str
    pid: int
    start: float
    fence: int | None
    slot: str | None = None
    entry: str | None = None
    note: str | None = None
    end: float | None = None
    how: str | None = None
    passes: list[float] = field(default_factory=list)
    fails: list[float] = field(default_factory=list)
    last: float = 0.0
    events: list[Event] = field(default_factory=list, repr=False)

    @property
    def until(self) -> float:
        """When the run last did anything: its end, else its last event."""
        return self.end if self.end is not None else self.last

    def passes_after(self, m: float) -> list[float]:
        return [p for p in self.passes if p > m]

    def fails_after(self, m: float) -> list[float]:
        return [f for f in self.fails if f > m]


def runs(history: History) -> list[Run]:
    """Every run, in start order (``start`` / ``chk`` / ``end`` matched by process and task id)."""
    open_runs: dict[tuple[int, str], Run] = {}
    out: list[Run] = []
    for event in history.of("start", "chk", "end"):
        key = (event.pid, str(event.get("id")))
        if event.ev == "start":
            run = Run(str(event["id"]), str(event["key"]), event.who, event.pid, event.m, event.get("fence"),
                      event.get("slot"), event.get("entry"), event.get("note"), last=event.m, events=[event])
            open_runs[key] = run
            out.append(run)
            continue
        current = open_runs.get(key)
        if current is None:
            continue
        run = current
        run.last = event.m
        if event.ev == "chk":
            (run.passes if event.get("ok") else run.fails).append(float(event["m0"]))
            run.events.append(event)
        else:
            run.end, run.how = event.m, str(event.get("how"))
            run.events.append(event)
            del open_runs[key]
    return out


@dataclass
class Submission:
    """A published run (by the submitter or the nemesis) and everything that befell its task id."""

    id: str
    key: str
    at: float
    note: str
    outcomes: list[Event] = field(default_factory=list)
    starts: list[Run] = field(default_factory=list)
    revoked: list[Event] = field(default_factory=list)
    result: str | None = None

    @property
    def ended(self) -> bool:
        """An end anyone can see: a terminal outcome, a revoke, a ready result state."""
        return (any(o.get("kind") in TERMINAL for o in self.outcomes) or bool(self.revoked)
                or self.result in READY_STATES)

    @property
    def fate(self) -> str:
        kinds = [o.get("kind") for o in self.outcomes if o.get("kind") in TERMINAL]
        if kinds:
            return str(kinds[-1])
        if self.revoked:
            return "revoked"
        if self.result in READY_STATES:
            return f"result {self.result}"
        return "ran, no end" if self.starts else "no trace"


def fates(history: History) -> dict[str, Submission]:
    """Every submission whose ``apply_async`` returned, by task id, with its outcomes."""
    subs: dict[str, Submission] = {}
    for event in history.of("submit"):
        if event.get("ok") and event.get("id"):
            subs.setdefault(str(event["id"]), Submission(str(event["id"]), str(event["key"]), event.m,
                                                          str(event.get("note"))))
    for event in history.of("outcome"):
        sub = subs.get(str(event.get("id")))
        if sub is not None:
            sub.outcomes.append(event)
    for event in history.of("revoked"):
        sub = subs.get(str(event.get("id")))
        if sub is not None:
            sub.revoked.append(event)
    for run in runs(history):
        sub = subs.get(run.id)
        if sub is not None:
            sub.starts.append(run)
    for event in history.of("results"):
        for task_id, state in (event.get("states") or {}).items():
            if task_id in subs:
                subs[task_id].result = state
    return subs


def broker_losses(history: History) -> list[float]:
    """When the broker lost its data (its server restarted empty): only when it is the lock Redis."""
    if history.meta.get("settings", {}).get("variant") != "same":
        return []
    return [e.m for e in history.of("fault") if e.get("kind") == "restart-lock-empty" and e.get("action") == "inject"]


def open_submissions(history: History) -> list[Submission]:
    """Submissions with no end yet, except those the broker may have lost with its data."""
    losses = broker_losses(history)
    return [s for s in fates(history).values() if not s.ended and not any(s.at < m for m in losses)]


@dataclass(frozen=True)
class Window:
    """A stretch of time (monotonic) and why it excuses what it excuses."""

    start: float
    end: float
    why: str

    def covers(self, m: float) -> bool:
        return self.start <= m <= self.end


def fault_spans(history: History) -> list[tuple[Event, float]]:
    """Each injected fault and the time of its heal (end of history if never healed)."""
    last = history.events[-1].m if history.events else 0.0
    heals = {e.get("n"): e.m for e in history.of("fault") if e.get("action") == "heal"}
    return [(e, heals.get(e.get("n"), last)) for e in history.of("fault") if e.get("action") == "inject"]


#: Faults during which the lock Redis answers no beat (down, paused, busy).
LOCK_GONE = frozenset({"restart-lock", "restart-lock-empty", "pause-lock", "busy-script", "soft-limit", "revoke",
                       "failover", "kill-primary", "reelect-primary"})


def lock_gone_windows(history: History) -> list[Window]:
    """When beats could not claim: the lock Redis down, paused or busy; widened by the
    beat's back-off after it (1 s doubling: up to twice the outage, plus a second)."""
    out = []
    for inject, healed in fault_spans(history):
        if inject.get("kind") in LOCK_GONE:
            length = healed - inject.m
            out.append(Window(inject.m - 1.0, healed + min(30.0, 2 * length + 2.0),
                              f"lock Redis {inject.get('kind')} (fault {inject.get('n')})"))
    return out


def beat_down_windows(history: History, pending_lease: float) -> list[Window]:
    """When every beat was down: from the last one's stop to the first one's start-up,
    widened by a pending lease before (a claim the last beat made and did not send) and
    2 s after (its scheduler starting)."""
    beats = list(history.meta.get("settings", {}).get("beats") or [])
    if not beats:
        return []
    down: dict[str, float | None] = dict.fromkeys(beats)
    pids: dict[int, str] = {}
    out = []
    all_down_since: float | None = None
    for event in history.of("proc", "beat-up"):
        if event.ev == "proc":
            name = event.get("name")
            if name not in down:
                continue
            if event.get("action") == "start":
                pids[int(event["pid"])] = name
            elif event.get("action") in ("SIGKILL", "SIGTERM", "exit") and down[name] is None:
                down[name] = event.m
        else:
            name = _beat_of(event, pids)
            if name is None:
                continue
            if all_down_since is not None:
                out.append(Window(all_down_since - pending_lease - 1.0, event.m + 2.0, "every beat down"))
                all_down_since = None
            down[name] = None
            continue
        if all_down_since is None and all(v is not None for v in down.values()):
            all_down_since = max(v for v in down.values() if v is not None)
    if all_down_since is not None:
        out.append(Window(all_down_since - pending_lease - 1.0, float("inf"), "every beat down"))
    return out


def _beat_of(event: Event, pids: dict[int, str]) -> str | None:
    return pids.get(event.pid) or (event.who[len("beat-"):] if event.who.startswith("beat-") else None)


def by_key(items: list[Run]) -> dict[str, list[Run]]:
    out: dict[str, list[Run]] = defaultdict(list)
    for run in items:
        out[run.key].append(run)
    return out


def excerpt(events: list[Event], limit: int = 12) -> list[dict[str, Any]]:
    """History lines for a report: what, when, who."""
    return [{"ev": e.ev, "m": round(e.m, 3), "who": e.who, "pid": e.pid, **e.data} for e in events[:limit]]

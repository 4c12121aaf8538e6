"""The checker: judges a whole history (a finished run, or one saved long ago).

Each rule below is a function of the history alone; :func:`check` runs them all.
A **violation** fails the run; a **report** is something the documented
guarantees allow, counted and shown (a paused run told ``LockLost`` at its
first check after resuming; a submission the broker lost with its own data).

* ``overlap``: run A of a key started before run B, and one of A's
  ``ensure_held()`` calls *began* after B had started yet passed: both believed
  they held the key. (B's start is recorded after its acquire returned, A's
  check time before the call: the comparison errs towards passing.) A that
  was told instead (its first check after B's start raised) is reported.
* ``fence``: a run started after another got a fencing token no larger than it,
  unless that run never passed a check (it was paused between its acquire and
  its start, and its lease was gone when it looked).
* ``lost``: a submission whose ``apply_async`` returned, with no visible end after
  the quiet phase: no terminal outcome, no revoke, no ready result state. A
  run cut short and never run to an end counts too. Excused (reported): the
  broker restarted empty after the publish (the ``same`` variant); lost in
  kombu's Redis transport: no worker received the last publish, the broker
  no longer held it at the end, and a worker's broker connection died after
  that publish began (a worker SIGKILLed, from the signal until its exit was
  seen: a dying process's sockets stay open until it has exited; a crash
  seen; the broker restarted). BRPOP takes a message off the queue before the
  worker records it as unacknowledged, so a reply lost with its connection
  loses the message. A delivery whose worker died before its outcome was never
  acknowledged: kombu puts the message back on the queue once the visibility
  timeout has passed since the delivery, a publish the history does not show;
  the same rule then applies from then on (no worker received it since, a
  connection died after that).
* ``rerun``: a run of a task id that had already completed (its body ended, the
  run's outcome SUCCESS or FAILURE, so its done marker was written). Excused
  (reported): the lock Redis lost data in between (a fault that loses it, or a
  switch of primaries the sentinels logged: ``switch`` events, see
  :mod:`.switches`), or the done marker's TTL passed, or the three faults of the
  guarantees' done-marker limit met: the completed run's release cannot have
  reached the lock Redis (from the run's end until its process was SIGKILLed --
  its worker's whole group, or the pool process alone -- the lock Redis was
  paused, busy or down, or, for a worker behind the proxy, the proxy was cut)
  and its acknowledgement was lost (the broker exited between the delivery and
  the run's outcome: kombu acknowledges on the channel of the broker connection
  that died).
* ``slot``: a beat slot due during the chaos phase that was never sent, outside
  the windows when every beat was down or the lock Redis gone (see :mod:`.model`),
  and not held back by a beat for a recovery window after which its entry sent a later
  slot (an entry due more often than the window sends only the latest).
* ``hang``: a SIGTERMed process that did not exit within its bound.
* ``keys``: in the idle phase, a run lock still in Redis (every run ended more
  than ``lock_ttl`` before), or a key without a TTL that the library does not
  document as such.
* ``counters``: in the audit phase the counters' difference is not exactly the
  history's (acquired = starts, skipped = skips, released = runs ended); over
  the whole run a counter above what the history allows. Not applied (reported)
  when the app keeps no counters (``singleton_stats`` off, as on Redis Cluster).

Nothing here depends on the lock store: faults are read by kind from the
history (:mod:`.model`: which kinds take the lock Redis away, which lose its
data), and the keys read at the end are every key of the lock data, each
Cluster primary's included.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter
from datetime import datetime, timezone
from typing import Any

from .history import Event, History
from .model import (
    DATA_LOSS,
    LOCK_GONE,
    Run,
    Window,
    beat_down_windows,
    broker_losses,
    by_key,
    excerpt,
    fates,
    fault_spans,
    lock_gone_windows,
    open_submissions,
    runs,
)
from .report import figures
from .verdict import Finding, Verdict

__all__ = ["check", "open_submissions"]

TASK = "harness.chaos.app.work"


def check(history: History) -> Verdict:
    """Judge ``history`` by every rule of the module docstring."""
    verdict = Verdict()
    all_runs = runs(history)
    before = _previous_outcome(history)
    _overlaps(all_runs, verdict, before)
    _fences(all_runs, verdict, before)
    _lost(history, verdict)
    _reruns(history, all_runs, verdict)
    _slots(history, all_runs, verdict)
    _hangs(history, verdict)
    _keys(history, verdict)
    _counters(history, all_runs, verdict)
    verdict.figures = figures(history, all_runs, verdict)
    return verdict


# ------------------------------------------------------------------ runs of one key


def _previous_outcome(history: History) -> Any:
    """``before(run)``: the outcome recorded last in the run's process before the run started
    (the evidence of what that process went through just before: a soft time limit...)."""
    by_pid: dict[int, list[Event]] = {}
    for event in history.of("outcome"):
        by_pid.setdefault(event.pid, []).append(event)

    def before(run: Run) -> list[Event]:
        earlier = [e for e in by_pid.get(run.pid, []) if e.m < run.start]
        return earlier[-1:]

    return before


def _overlaps(all_runs: list[Run], verdict: Verdict, before: Any) -> None:
    for key, items in by_key(all_runs).items():
        items.sort(key=lambda r: r.start)
        starts = [r.start for r in items]
        for i, a in enumerate(items):
            for b in items[i + 1:bisect.bisect_right(starts, a.until)]:
                late = a.passes_after(b.start)
                if late:
                    verdict.violations.append(Finding(
                        "overlap", f"{key}: run {a.id} ({a.who}) passed ensure_held() {len(late)} time(s) after run "
                        f"{b.id} ({b.who}) started holding the key, first {late[0] - b.start:.3f}s after",
                        b.start, excerpt([*before(b), a.events[0], b.events[0],
                                          *[e for e in a.events if e.ev == "chk" and e.get("ok")
                                            and e["m0"] > b.start]])))
                elif a.fails_after(b.start):
                    told = a.fails_after(b.start)[0]
                    verdict.reports.append(Finding(
                        "overlap-told", f"{key}: run {a.id} ({a.who}) ran on after run {b.id} started and was told "
                        f"LockLost at its first check after it, {told - b.start:.3f}s later", b.start,
                        excerpt([a.events[0], b.events[0],
                                 *[e for e in a.events if e.ev != "start" and e.m > b.start]])))
                elif a.until > b.start:
                    verdict.reports.append(Finding(
                        "overlap-unchecked", f"{key}: run {a.id} ({a.who}) ended {a.until - b.start:.3f}s after run "
                        f"{b.id} started, with no check in between (its last check passed before)", b.start,
                        excerpt([a.events[0], a.events[-1], b.events[0]])))


def _fences(all_runs: list[Run], verdict: Verdict, before: Any) -> None:
    for key, items in by_key(all_runs).items():
        items.sort(key=lambda r: r.start)
        best: Run | None = None
        for run in items:
            if run.fence is None:
                verdict.violations.append(Finding("fence", f"{key}: run {run.id} ({run.who}) ran without a fencing "
                                                  f"token (no lock)", run.start, excerpt([run.events[0]])))
                continue
            if best is not None and run.fence <= best.fence:  # type: ignore[operator]
                finding = Finding("fence", f"{key}: run {run.id} ({run.who}) started after run {best.id} "
                                  f"({best.who}) with fencing token {run.fence} <= {best.fence}", run.start,
                                  excerpt([*before(run), best.events[0], run.events[0]]))
                if run.passes or run.fence == best.fence:
                    verdict.violations.append(finding)
                else:
                    finding.kind, finding.what = "fence-stale", finding.what + " (it never passed a check)"
                    verdict.reports.append(finding)
            if best is None or run.fence > best.fence:  # type: ignore[operator]
                best = run


# ------------------------------------------------------------------ submissions


def _lost(history: History, verdict: Verdict) -> None:
    losses = broker_losses(history)
    scans = list(history.of("broker"))
    held = {i for e in scans for i in e.get("ids") or []}
    seen: dict[str, float] = {}  # when a worker last received a delivery of each task id
    for event in history.of("prerun", "revoked", "start"):
        seen[str(event.get("id"))] = event.m
    published = _last_publish(history)
    given_back = _given_back(history)
    disruptions = _transport_disruptions(history)
    for sub in fates(history).values():
        if sub.ended:
            continue
        finished = [r for r in sub.starts if r.how is not None]
        what = f"submission {sub.id} of {sub.key} ({sub.note}) "
        evidence = excerpt([*sub.outcomes, *[r.events[0] for r in sub.starts]])
        evidence.insert(0, {"ev": "submit", "m": round(sub.at, 3), "id": sub.id, "key": sub.key})
        if finished:  # the work was done; the process died before Celery's postrun
            verdict.reports.append(Finding("ended-unrecorded", what + "ran to an end, but no outcome was "
                                           "recorded (its process died before Celery's postrun)", sub.at, evidence))
            continue
        what += (f"has no end: {len(sub.starts)} run(s) started, each cut short, none ran again to an end"
                 if sub.starts else "has no end: it never ran and was not skipped")
        if sub.id in held:
            where = {"unacked": "unacknowledged (not delivered again)", "queued": "queued"}
            found = [where[k] for k in where for e in scans if sub.id in (e.get(k) or [])]
            what += f"; the broker still held it at the end{' ' + found[0] if found else ''}"
        began = published.get(sub.id, sub.at)
        unreceived = seen.get(sub.id, 0.0) < began
        since = f"no worker received its last publish (begun at m={began:.3f}; no prerun since)"
        back = given_back.get(sub.id)
        if back is not None and back[0] > began:
            unreceived = seen.get(sub.id, 0.0) < back[0]  # nothing received since it went back
            if back[2]:
                # Its run's pool process was killed under a living worker: Celery gives the
                # message back to the queue at once (acks_late with reject_on_worker_lost).
                began = back[0]
                since = (f"its run's pool process was SIGKILLed (m={back[0]:.3f}), its worker gave the message "
                         "back to the queue (acks_late, reject_on_worker_lost), and no worker received it since")
            else:
                # Its last delivery died unacknowledged: kombu puts it back on the queue, not
                # before the visibility timeout has passed since that delivery (after the publish).
                visibility = float(history.meta.get("settings", {}).get("visibility", 12.0))
                began = max(back[0], began + visibility)
                since = (f"its last delivery (m={back[1]:.3f}) died unacknowledged, kombu gave it back to the "
                         f"queue (not before m={began:.3f}), and no worker received it since")
        disruption = next((w for w in disruptions if w.end > began), None)
        if any(sub.at < m and seen.get(sub.id, 0.0) < m for m in losses):
            verdict.reports.append(Finding("lost-with-broker", what + "; the broker (the lock Redis) restarted "
                                           "empty after it was published, and no worker saw it since",
                                           sub.at, evidence))
        elif scans and sub.id not in held and unreceived and disruption is not None:
            verdict.reports.append(Finding(
                "lost-in-transport", what + f"; {since}, the broker no longer holds it (neither queued nor "
                f"unacknowledged), and a broker connection died after that ({disruption.why}): kombu's Redis "
                "transport takes a message off the queue (BRPOP) before it records it as unacknowledged, and a "
                "reply lost with its connection loses the message", sub.at, evidence))
        else:
            verdict.violations.append(Finding("lost", what, sub.at, evidence))


def _last_publish(history: History) -> dict[str, float]:
    """When the last publish of each task id began: a submission's ``apply_async`` (``m0``), a
    re-publish's ``before_task_publish`` (``m0`` of its ``pub``). A ``pub`` recorded without its
    start (older histories) inside a submission's ``apply_async`` of the same process is that
    submission's publish; any other starts no later than it was recorded."""
    calls = [(e.pid, str(e.get("id")), float(e.get("m0", e.m)), e.m) for e in history.of("submit")]
    began: dict[str, float] = {}
    for event in history.of("submit", "pub"):
        task_id = str(event.get("id"))
        if event.ev == "submit" or "m0" in event.data:
            start = float(event.get("m0", event.m))
        else:
            start = next((m0 for pid, i, m0, m in calls if pid == event.pid and i == task_id and m0 <= event.m <= m),
                         event.m)
        began[task_id] = max(began.get(task_id, start), start)
    return began


def _given_back(history: History) -> dict[str, tuple[float, float, bool]]:
    """Task id -> (when it went back, when it was received, at once) for a last delivery that
    ended without an outcome because its process died.

    Its worker died (SIGKILL of its group or its main process, which takes the pool with
    it; a crash; an exit): never acknowledged, the message goes back to the broker's queue
    after kombu's visibility timeout (``at once`` False). Its pool process was SIGKILLed
    under a living worker (``kill-child``): the chaos app runs ``acks_late`` with
    ``task_reject_on_worker_lost``, so the worker rejects the message with requeue as it
    sees the process gone (``at once`` True)."""
    workers = {w["name"] for w in history.meta.get("settings", {}).get("workers", [])}
    open_on: dict[str, dict[str, tuple[float, int]]] = {}  # worker -> task id -> (received, pid)
    back: dict[str, tuple[float, float, bool]] = {}
    for event in history.of("prerun", "outcome", "revoked", "proc", "fault"):
        if event.ev == "fault":
            if event.get("kind") == "kill-child" and event.get("action") == "inject":
                deliveries = open_on.get(str(event.get("target")), {})
                for task_id, (received, pid) in list(deliveries.items()):
                    if pid == event.get("child"):
                        back[task_id] = (event.m, received, True)
                        del deliveries[task_id]
            continue
        if event.ev == "proc":
            name = event.get("name")
            if name in workers and event.get("action") in ("SIGKILL", "crash", "exit"):
                for task_id, (received, _) in open_on.pop(str(name), {}).items():
                    back[task_id] = (event.m, received, False)
            continue
        task_id = str(event.get("id"))
        for deliveries in open_on.values():
            deliveries.pop(task_id, None)
        back.pop(task_id, None)
        if event.ev == "prerun":
            worker = event.who.removeprefix("worker-").removesuffix("-child")
            open_on.setdefault(worker, {})[task_id] = (event.m, event.pid)
    return back


def _transport_disruptions(history: History) -> list[Window]:
    """When a message on its way from the broker to a worker could be lost by the transport: a
    worker SIGKILLed (from the signal until its exit was seen: until then its connection, blocked
    in BRPOP, is open and the broker may hand it a message), a worker's crash seen, the broker
    restarted (the lock Redis, when it is the broker)."""
    workers = {w["name"] for w in history.meta.get("settings", {}).get("workers", [])}
    broker = "lock-redis" if history.meta.get("settings", {}).get("variant") == "same" else "broker-redis"
    out: list[Window] = []
    dying: dict[tuple[str, Any], Event] = {}  # SIGKILLed workers whose exit is not seen yet
    for event in history.of("proc"):
        name, action = event.get("name"), event.get("action")
        if name in workers and action == "SIGKILL":
            dying.setdefault((name, event.get("pid")), event)
        elif name in workers and action == "exit" and (name, event.get("pid")) in dying:
            kill = dying.pop((name, event.get("pid")))
            out.append(Window(kill.m, event.m, f"{name} SIGKILLed at m={kill.m:.3f}, its exit seen at "
                              f"m={event.m:.3f}"))
        elif name in workers and action == "crash":
            out.append(Window(event.m, event.m, f"{name} crashed, seen at m={event.m:.3f}"))
        elif name == broker and action == "exit":
            out.append(Window(event.m, event.m, f"the broker ({name}) exited at m={event.m:.3f}"))
    out.extend(Window(kill.m, kill.m, f"{kill.get('name')} SIGKILLed at m={kill.m:.3f} (no exit seen)")
               for kill in dying.values())
    return out


def _reruns(history: History, all_runs: list[Run], verdict: Verdict) -> None:
    # The lock Redis's data is lost from the fault's start (a SIGKILL, then an empty start)
    # to its heal: nothing written in between survives, nor anything written before it.
    losses = [(inject.m, healed) for inject, healed in fault_spans(history) if inject.get("kind") in DATA_LOSS]
    losses += [(switch.m, switch.m) for switch in history.of("switch")]  # the sentinels moved the primary
    done_ttl = 2 * float(history.meta.get("settings", {}).get("visibility", 12.0))
    ended = {(r.pid, r.id): r for r in all_runs if r.how is not None}
    ended_in = set(ended)
    completed: dict[str, Event] = {}
    for event in history.of("outcome"):
        if event.get("kind") in ("success", "failure") and (event.pid, event.get("id")) in ended_in:
            completed.setdefault(str(event["id"]), event)
    for run in all_runs:
        done = completed.get(run.id)
        if done is None or run.start <= done.m:
            continue
        what = (f"task {run.id} ({run.key}) ran again on {run.who} {run.start - done.m:.2f}s after it completed "
                f"on {done.who}")
        evidence = excerpt([done, run.events[0]])
        if any(start < run.start and done.m < healed for start, healed in losses):
            verdict.reports.append(Finding("rerun-after-data-loss", what + " (the lock Redis lost its done marker "
                                           "in between)", run.start, evidence))
        elif run.start - done.m > done_ttl:
            verdict.reports.append(Finding("rerun-after-done-ttl", what + " (after the done marker's TTL)",
                                           run.start, evidence))
        elif (why := _release_and_ack_lost(history, done, ended.get((done.pid, run.id)), run.start)) is not None:
            verdict.reports.append(Finding("rerun-after-lost-release", what + f" ({why})", run.start, evidence))
        else:
            verdict.violations.append(Finding("rerun", what, run.start, evidence))


def _release_and_ack_lost(history: History, done: Event, original: Run | None, rerun_at: float) -> str | None:
    """Why the completed run's done marker and acknowledgement were both lost, or None.

    The guarantees' done-marker limit: a process that dies after its run's body returned
    and before its release reached Redis leaves no done marker, and a copy of the message
    whose acknowledgement was lost too runs again. All three must show in the history:

    * its process SIGKILLed after the run's end (the worker's main process or its group, the
      first thing that befell that worker since: Celery gives prefork children SIGKILL as
      their parent-death signal; or ``kill-child`` of that very process), before the re-run;
    * the lock Redis out of that process's reach the whole time from the run's end to the
      kill (faults that pause, busy or stop it; the proxy cut, for a proxied worker): the
      release and every sending of it again went unanswered;
    * the broker gone between the delivery and the run's outcome: the acknowledgement is
      sent on the channel of a connection that died, and is lost.
    """
    if original is None or original.end is None:
        return None
    settings = history.meta.get("settings", {})
    worker = done.who.removeprefix("worker-").removesuffix("-child")
    proxied = any(w.get("name") == worker and w.get("proxied") for w in settings.get("workers", []))
    kill: Event | None = None
    for event in history.of("proc", "fault"):
        if event.m <= original.end or event.m >= rerun_at:
            continue
        if event.ev == "proc" and event.get("name") == worker:
            if event.get("action") == "SIGKILL":
                kill = event
            break  # any other change to that worker first (a stop, an exit): not this case
        if (event.ev == "fault" and event.get("kind") == "kill-child" and event.get("action") == "inject"
                and event.get("child") == done.pid):
            kill = event
            break
    if kill is None:
        return None
    gone = sorted((inject.m, healed) for inject, healed in fault_spans(history)
                  if inject.get("kind") in LOCK_GONE or (proxied and inject.get("kind") == "proxy-cut"))
    reached = original.end
    for start, healed in gone:
        if start <= reached:
            reached = max(reached, healed)
    if reached < kill.m:
        return None
    broker = "lock-redis" if settings.get("variant") == "same" else "broker-redis"
    delivered = max((e.m for e in history.of("prerun") if e.pid == done.pid and e.get("id") == done.get("id")
                     and e.m <= original.start), default=original.start)
    exits = [e for e in history.of("proc") if e.get("name") == broker and e.get("action") == "exit"
             and delivered <= e.m <= done.m]
    if not exits:
        return None
    return (f"its release cannot have reached the lock Redis, out of its process's reach from the run's end "
            f"at m={original.end:.3f} until the process was SIGKILLed at m={kill.m:.3f}, and its "
            f"acknowledgement was lost with the broker's connection, the broker exited at m={exits[0].m:.3f}: "
            f"the guarantees' done-marker limit")


# ------------------------------------------------------------------ beat slots


def expected_slots(entry: dict[str, Any], start: float, end: float) -> list[float]:
    """Wall-clock instants of an entry's slots in ``[start, end]`` (every N s, or every minute)."""
    if "every" in entry:
        period = float(entry["every"])
    elif entry.get("cron") == "* * * * *":
        period = 60.0
    else:
        raise ValueError(f"the checker knows interval and every-minute entries, not {entry}")
    first = (int(start // period) + 1) * period
    out, at = [], first
    while at <= end:
        out.append(at)
        at += period
    return out


def slot_label(at: float) -> str:
    from celery_singleton_beat.beat.slots import format_slot

    return format_slot(datetime.fromtimestamp(at, timezone.utc))


def _superseded_after_window(history: History, seen: dict[tuple[str, str], list[Event]], name: str,
                             label: str) -> Window | None:
    """A slot a beat held back for the lock Redis's recovery window (a ``slot-window``
    event) while a later slot of its entry was sent: after a window an entry due more often
    than the window sends only its latest slot, as after an outage (the guarantees)."""
    waits = [e for e in history.of("slot-window") if e.get("entry") == name and e.get("slot") == label]
    if not waits:
        return None
    later = [events[0] for (entry, slot), events in seen.items() if entry == name and slot > label
             and any(e.ev == "sent" for e in events)]
    if not later:
        return None
    return Window(waits[0].m, waits[0].m, f"held back for the lock Redis's recovery window at m={waits[0].m:.3f}; "
                                          f"the entry sent a later slot after it")


def _superseded_in_broker_outage(history: History, seen: dict[tuple[str, str], list[Event]], name: str,
                                 label: str, due: float) -> Window | None:
    """A slot due while the broker was down (from its exit until a beat sent again: the
    beats' publishes wait out the outage) of an entry that sent a later slot after it:
    an entry due more than once while a publish waits sends the latest (the guarantees,
    as after any outage)."""
    broker = "lock-redis" if history.meta.get("settings", {}).get("variant") == "same" else "broker-redis"
    procs = [e for e in history.of("proc") if e.get("name") == broker and e.get("action") in ("exit", "start")]
    sends = sorted(e.m for e in history.of("sent"))
    for exit_event in (e for e in procs if e.get("action") == "exit" and e.m <= due):
        started = next((e.m for e in procs if e.get("action") == "start" and e.m > exit_event.m), None)
        if started is None:
            continue
        resumed = next((m for m in sends if m > started), None)
        if resumed is None or due > resumed:
            continue
        later = [s for (entry, s), events in seen.items() if entry == name and s > label
                 and any(e.ev == "sent" and e.m >= started for e in events)]
        if later:
            why = (f"due while the broker was down (m={exit_event.m:.3f} until a beat sent again at "
                   f"m={resumed:.3f}); the entry sent a later slot after it")
            return Window(exit_event.m, resumed, why)
    return None


def _slots(history: History, all_runs: list[Run], verdict: Verdict) -> None:
    phases = {e.get("name"): e.m for e in history.of("phase")}
    if "chaos" not in phases or "quiesce" not in phases:
        return
    pending = float(history.meta.get("settings", {}).get("pending_lease", 2.0))
    windows = [*beat_down_windows(history, pending), *lock_gone_windows(history)]
    seen: dict[tuple[str, str], list[Event]] = {}
    for event in history.of("sent", "prerun", "start", "outcome"):
        if event.get("slot"):
            seen.setdefault((str(event.get("entry")), str(event["slot"])), []).append(event)
    counts: Counter[str] = Counter()
    for name, entry in (history.meta.get("entries") or {}).items():
        for at in expected_slots(entry, history.wall(phases["chaos"]), history.wall(phases["quiesce"])):
            label = slot_label(at)
            counts["expected"] += 1
            if (name, label) in seen:
                counts["sent"] += 1
                continue
            due = history.mono(at)
            excuse = next((w for w in windows if w.covers(due)), None) or _superseded_after_window(
                history, seen, name, label) or _superseded_in_broker_outage(history, seen, name, label, due)
            if excuse is not None:
                counts["excused"] += 1
                verdict.reports.append(Finding("slot-excused", f"{name} slot {label} not sent: {excuse.why}", due))
            else:
                counts["missing"] += 1
                verdict.violations.append(Finding("slot", f"{name} slot {label} was never sent (no beat down, lock "
                                                  f"Redis up)", due, _near(history, due)))
    sends = Counter((str(e.get("entry")), str(e.get("slot"))) for e in history.of("sent"))
    counts["sent twice"] = sum(1 for n in sends.values() if n > 1)
    ran = Counter((r.entry, r.slot) for r in all_runs if r.slot)
    counts["run twice"] = sum(1 for n in ran.values() if n > 1)
    verdict.figures["slots"] = dict(counts)


def _near(history: History, m: float, seconds: float = 3.0) -> list[dict[str, Any]]:
    """The controller's and beats' events around ``m`` (for a missing slot's report)."""
    return excerpt([e for e in history.events if abs(e.m - m) <= seconds
                    and (e.who.startswith("beat") or e.ev in ("fault", "proc", "sent"))], limit=25)


# ------------------------------------------------------------------ processes and keys


def _hangs(history: History, verdict: Verdict) -> None:
    for event in history.of("term"):
        if event.get("exited") is None:
            verdict.violations.append(Finding("hang", f"{event.get('name')} (pid {event.get('pid')}) did not exit "
                                              f"within {event.get('bound')}s of SIGTERM", event.m, excerpt([event])))


#: Keys the library keeps without a TTL (README, Monitoring; docs/beat.md): the record of
#: the server serving the data (one per shard on Redis Cluster), the beat's history.
NO_TTL = (re.compile(r"^[^:]+:server$"), re.compile(r"^[^:]+:server:\{\d+\}$"),
          re.compile(r"^[^:]+:\{beat\}:history$"))


def _keys(history: History, verdict: Verdict) -> None:
    prefix = str(history.meta.get("settings", {}).get("prefix", "chaos"))
    run_lock = re.compile(rf"^{re.escape(prefix)}:\{{{re.escape(TASK)}:[0-9a-f]+\}}$")
    for event in history.of("keys"):
        for key in event.get("keys") or []:
            name, pttl = str(key["key"]), int(key["pttl"])
            if run_lock.match(name):
                verdict.violations.append(Finding("keys", f"run lock {name} still held {pttl} ms after every run "
                                                  f"had ended for longer than its lease", event.m, [key]))
            elif pttl == -1 and name.startswith(prefix + ":") and not any(p.match(name) for p in NO_TTL):
                verdict.violations.append(Finding("keys", f"{name} ({key['type']}) has no TTL", event.m, [key]))


def _counters(history: History, all_runs: list[Run], verdict: Verdict) -> None:
    snapshots = {e.get("when"): e for e in history.of("counters")}
    off = next((e for e in snapshots.values() if (e.get("counters") or {}).get("stats") is False), None)
    if off is not None:  # nothing counted, nothing to compare
        verdict.reports.append(Finding("counters-off", "the app keeps no counters (singleton_stats is off, as it "
                                       "must be on Redis Cluster): the counters rule does not apply", off.m))
        return
    skips = [e for e in history.of("outcome") if e.get("kind") == "skipped"]
    begin, end = snapshots.get("audit-start"), snapshots.get("audit-end")
    if begin is not None and end is not None:
        before, after = _task_counts(begin), _task_counts(end)
        window = [r for r in all_runs if begin.m < r.start < end.m]
        wanted = {"acquired": len(window), "skipped": sum(1 for e in skips if begin.m < e.m < end.m),
                  "released": sum(1 for r in window if r.how == "done"), "lost": 0}
        for name, count in wanted.items():
            delta = after.get(name, 0) - before.get(name, 0)
            if delta != count:
                verdict.violations.append(Finding("counters", f"audit: counter {name} grew by {delta}, the history "
                                                  f"shows {count}", end.m, [{"before": before, "after": after}]))
    final = snapshots.get("final")
    if final is not None:
        counts = _task_counts(final)
        slack = _interruptions(history)
        for name, seen in (("acquired", len(all_runs)), ("skipped", len(skips))):
            if counts.get(name, 0) > seen + slack:
                verdict.violations.append(Finding(
                    "counters", f"counter {name} is {counts.get(name, 0)}, above the {seen} the history shows plus "
                    f"{slack} interrupted runs", final.m, [{"counters": counts}]))


def _task_counts(event: Event) -> dict[str, int]:
    return dict((event.get("counters") or {}).get("tasks", {}).get(TASK, {}))


def _interruptions(history: History) -> int:
    """Faults that can end a process between a counted outcome and its history line."""
    count = 0
    for event in history.of("fault"):
        if event.get("action") != "inject":
            continue
        kind = event.get("kind")
        if kind in ("kill-worker", "kill-worker-main", "kill-child", "term-worker"):
            count += 3
        elif kind in ("soft-limit", "revoke"):
            count += int(event.get("burst") or 0)
    return count

"""The chaos checker (``harness/chaos/checker.py``) on synthetic histories: one per violation.

Each test writes a small history (the format every process of a chaos run
writes, see ``harness/chaos/history.py``) in which exactly one rule is broken,
and checks that the checker finds that violation and nothing else; the
baseline history breaks none. So the checker is known to fail when it should,
and to pass what the guarantees allow (a paused run told at its first check,
a submission the broker lost with its own data, a slot due while every beat was
down). The checker also reads a saved history from disk (``python -m
harness.chaos check DIR``), and a history saved from a real run that hit a
stale lock reply (an overlap) is still judged an overlap.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.chaos.checker import check, slot_label
from harness.chaos.history import load, write
from harness.chaos.verdict import Verdict

from .support.paths import ROOT

#: Wall-clock time of m = 0 in these histories: a whole minute, so slots fall on round m values.
EPOCH = 1_800_000_000.0
TASK = "harness.chaos.app.work"


class Story:
    """A history under construction: events at monotonic times, then judged."""

    def __init__(self, **settings: Any) -> None:
        self.meta: dict[str, Any] = {
            "settings": {"variant": "separate", "seed": 0, "beats": ["b1", "b2"], "prefix": "chaos",
                         "workers": [{"name": "w1", "pool": "prefork", "concurrency": 2}],
                         "visibility": 12.0, "pending_lease": 2.0, "lock_ttl": 4.0, **settings},
            "seconds": 20, "clock": {"t": EPOCH, "m": 0.0}, "entries": {}}
        self.events: list[dict[str, Any]] = []
        self.phase("chaos", 10.0)
        self.phase("quiesce", 30.0)

    def add(self, ev: str, m: float, who: str = "control", writer: int = 1, **data: Any) -> Story:
        """An event written at ``m`` by process ``writer`` (named ``who``)."""
        self.events.append({"ev": ev, "m": m, "t": EPOCH + m, "_who": who, "_pid": writer, **data})
        return self

    def phase(self, name: str, m: float) -> Story:
        return self.add("phase", m, name=name)

    def submit(self, task_id: str, key: str, m: float, note: str = "sub") -> Story:
        return self.add("submit", m, "submitter", 2, id=task_id, key=key, ok=True, note=note)

    def run(self, task_id: str, key: str, start: float, end: float, fence: int, *, pid: int = 10,
            checks: list[tuple[float, bool]] | None = None, how: str = "done", outcome: str | None = "success",
            **extra: Any) -> Story:
        """A body run in process ``pid``: start, its checks (``(m0, passed)``), end, outcome."""
        who = f"worker-w{pid}-child"
        self.add("start", start, who, pid, id=task_id, key=key, fence=fence, **extra)
        for m0, ok in checks if checks is not None else [(start, True)]:
            self.add("chk", m0, who, pid, id=task_id, key=key, m0=m0, ok=ok)
        if how:
            self.add("end", end, who, pid, id=task_id, key=key, how=how)
        if outcome:
            self.add("outcome", end + 0.001, who, pid, id=task_id, key=key, kind=outcome,
                     state={"success": "SUCCESS", "skipped": "IGNORED", "failure": "FAILURE"}[outcome], **extra)
        return self

    def drop_slot(self, m: float) -> Story:
        """The slot due at ``m`` was never sent (nor run, so one acquisition fewer)."""
        label = slot_label(EPOCH + m)
        self.events = [e for e in self.events if e.get("slot") != label]
        for event in self.events:
            if event.get("when") == "final":
                event["counters"]["tasks"][TASK]["acquired"] -= 1
        return self

    def judge(self, tmp_path: Path) -> Verdict:
        return check(load(write(tmp_path / "history", self.meta, self.events)))


def baseline() -> Story:
    """Two runs of ``k`` one after the other, a skipped duplicate, a beat entry every 5 s
    sent on time, beats stopped cleanly, no key left, counters that match."""
    story = Story()
    story.meta["entries"] = {"every-5s": {"every": 5.0, "key": "beat:e", "seconds": 0.1}}
    story.submit("a", "k", 11.0).run("a", "k", 11.1, 12.0, 100, checks=[(11.1, True), (11.5, True), (11.9, True)])
    story.submit("b", "k", 11.2).add("outcome", 11.25, "worker-w2", 20, id="b", key="k", kind="skipped",
                                      state="IGNORED")
    story.submit("c", "k", 12.5).run("c", "k", 12.6, 13.0, 200, pid=11, checks=[(12.6, True), (12.9, True)])
    for m in (15.0, 20.0, 25.0, 30.0):
        slot = slot_label(EPOCH + m)
        story.add("sent", m + 0.01, "beat-b1", 3, id=f"slot-{m}", entry="every-5s", slot=slot)
        story.run(f"slot-{m}", "beat:e", m + 0.02, m + 0.1, int(m * 1000), pid=12, slot=slot, entry="every-5s")
    story.add("term", 31.0, name="b1", pid=3, sent=31.0, exited=31.2, code=0, bound=15.0)
    story.add("keys", 32.0, keys=[{"key": "chaos:server", "type": "string", "pttl": -1},
                                  {"key": "chaos:{beat}:history", "type": "list", "pttl": -1},
                                  {"key": f"chaos:{{{TASK}:ab12}}:done:c", "type": "string", "pttl": 9000}])
    before = {"acquired": 6, "skipped": 1, "released": 6, "lost": 0}
    after = {**before, "acquired": 7, "released": 7}
    story.add("counters", 30.5, when="audit-start", counters={"tasks": {TASK: before}})
    story.submit("x", "k", 30.6, note="audit").run("x", "k", 30.7, 30.8, 900)
    story.add("counters", 31.5, when="audit-end", counters={"tasks": {TASK: after}})
    story.add("counters", 33.0, when="final", counters={"tasks": {TASK: dict(after)}})
    return story


def kinds(verdict: Verdict) -> list[str]:
    return sorted(v.kind for v in verdict.violations)


def test_the_baseline_history_breaks_no_rule(tmp_path: Path) -> None:
    verdict = baseline().judge(tmp_path)
    assert kinds(verdict) == [], verdict.violations
    assert verdict.figures["runs"] == 7 and verdict.figures["slots"]["sent"] == 4


def test_a_check_that_passes_after_a_later_run_started_is_an_overlap(tmp_path: Path) -> None:
    story = baseline()
    # d holds k2 from 14.0; e starts at 14.5 (its acquire returned); d's check at 14.6 passes.
    story.submit("d", "k2", 13.9).run("d", "k2", 14.0, 15.0, 300, checks=[(14.0, True), (14.6, True)])
    story.submit("e", "k2", 14.4).run("e", "k2", 14.5, 14.8, 400, pid=11)
    verdict = story.judge(tmp_path)
    assert kinds(verdict) == ["overlap"]
    assert "run d" in verdict.violations[0].what and "run e" in verdict.violations[0].what


def test_a_paused_run_told_at_its_first_check_after_resuming_is_reported_not_failed(tmp_path: Path) -> None:
    story = baseline()
    story.submit("d", "k2", 13.9).run("d", "k2", 14.0, 19.0, 300, checks=[(14.0, True), (19.0, False)],
                                      how="lost")
    story.submit("e", "k2", 14.4).run("e", "k2", 17.5, 18.0, 400, pid=11)
    verdict = story.judge(tmp_path)
    assert kinds(verdict) == []
    assert [r.kind for r in verdict.reports] == ["overlap-told"]


def test_a_later_run_with_a_smaller_fencing_token_is_a_violation(tmp_path: Path) -> None:
    story = baseline()
    story.submit("d", "k2", 13.9).run("d", "k2", 14.0, 14.5, 300)
    story.submit("e", "k2", 14.6).run("e", "k2", 14.7, 15.0, 299, pid=11)
    assert kinds(story.judge(tmp_path)) == ["fence"]


def test_a_stale_start_that_never_passed_a_check_is_reported_not_failed(tmp_path: Path) -> None:
    story = baseline()
    story.submit("d", "k2", 13.9).run("d", "k2", 14.0, 14.5, 300)
    story.submit("e", "k2", 13.5).run("e", "k2", 14.7, 14.8, 299, pid=11, checks=[(14.7, False)], how="lost")
    verdict = story.judge(tmp_path)
    assert kinds(verdict) == [] and [r.kind for r in verdict.reports] == ["fence-stale"]


def test_a_submission_that_never_ran_and_was_not_skipped_is_lost(tmp_path: Path) -> None:
    story = baseline().submit("z", "k3", 20.0)
    verdict = story.judge(tmp_path)
    assert kinds(verdict) == ["lost"] and "never ran" in verdict.violations[0].what


def test_a_run_cut_short_and_never_run_again_is_lost(tmp_path: Path) -> None:
    story = baseline().submit("z", "k3", 20.0).run("z", "k3", 20.1, 0, 500, how="", outcome=None)
    assert kinds(story.judge(tmp_path)) == ["lost"]


def test_a_ready_result_state_is_an_end(tmp_path: Path) -> None:
    story = baseline().submit("z", "k3", 20.0).add("results", 32.5, states={"z": "REVOKED"})
    assert kinds(story.judge(tmp_path)) == []


def test_a_submission_the_broker_lost_with_its_data_is_reported_not_failed(tmp_path: Path) -> None:
    story = baseline()
    story.meta["settings"]["variant"] = "same"
    story.submit("z", "k3", 20.0).add("fault", 21.0, n=1, kind="restart-lock-empty", action="inject")
    verdict = story.judge(tmp_path)
    assert kinds(verdict) == [] and [r.kind for r in verdict.reports] == ["lost-with-broker"]


@pytest.mark.parametrize("held", [False, True])
def test_a_message_a_killed_worker_took_off_the_queue_is_lost_in_the_transport(tmp_path: Path, held: bool) -> None:
    """Published, a worker SIGKILLed just after, no trace of it anywhere: kombu's Redis transport
    lost it between its BRPOP and its record of unacknowledged messages (reported). Still in
    the broker at the end, it is lost to the workers (a violation)."""
    story = baseline().submit("z", "k3", 20.0).add("proc", 20.01, name="w1", action="SIGKILL", pid=7)
    story.add("broker", 32.6, ids=["z"] if held else [])
    verdict = story.judge(tmp_path)
    if held:
        assert kinds(verdict) == ["lost"]
    else:
        assert kinds(verdict) == [] and [r.kind for r in verdict.reports] == ["lost-in-transport"]


def test_a_retry_taken_off_the_queue_by_a_killed_worker_is_lost_in_the_transport(tmp_path: Path) -> None:
    """A delivery that deferred its run (fail closed) published its retry; a worker SIGKILLed
    just after took that retry off the queue: no worker ever received it (reported)."""
    story = baseline().submit("z", "k3", 20.0)
    story.add("prerun", 20.1, "worker-w2", 20, id="z", key="k3").add("pub", 20.2, "worker-w2", 20, id="z")
    story.add("outcome", 20.21, "worker-w2", 20, id="z", key="k3", kind="retry", state="RETRY")
    story.add("proc", 20.3, name="w1", action="SIGKILL", pid=7).add("broker", 32.6, ids=[], queued=[], unacked=[])
    verdict = story.judge(tmp_path)
    assert kinds(verdict) == [] and [r.kind for r in verdict.reports] == ["lost-in-transport"]


@pytest.mark.parametrize(("exited", "lost"), [(20.03, False), (19.99, True)])
def test_a_worker_dying_when_the_publish_began_can_take_the_message_off_the_queue(
        tmp_path: Path, exited: float, lost: bool) -> None:
    """SIGKILLed before the publish, a worker's connection, blocked in BRPOP, is open until its
    exit: the broker may hand it the message, which goes with it (reported, the chaos run of
    2026-12-02: signal 72 ms before the publish began, exit seen 10 ms after it). A worker whose
    exit was seen before the publish began could not take it (a violation)."""
    story = baseline().add("proc", 19.9, name="w1", action="SIGKILL", group=True, pid=7)
    story.add("proc", exited, name="w1", action="exit", pid=7, code=-9)
    story.add("pub", 20.04, "submitter", 2, id="z", retries=0)
    story.add("submit", 20.05, "submitter", 2, id="z", key="k3", ok=True, note="sub", m0=20.0)
    story.add("broker", 32.6, ids=[], queued=[], unacked=[])
    verdict = story.judge(tmp_path)
    if lost:
        assert kinds(verdict) == ["lost"] and not [r for r in verdict.reports if r.kind.startswith("lost")]
    else:
        assert kinds(verdict) == [] and [r.kind for r in verdict.reports] == ["lost-in-transport"]
        assert "w1 SIGKILLed at m=19.900, its exit seen at m=20.030" in verdict.reports[0].what


def test_a_retry_received_after_its_publish_began_is_not_lost_in_the_transport(tmp_path: Path) -> None:
    """A worker received the last publish (its prerun after the publish began, before the
    publisher recorded it): the transport delivered it, so no end after that is a loss."""
    story = baseline().submit("z", "k3", 20.0)
    story.add("prerun", 20.1, "worker-w2", 20, id="z", key="k3")
    story.add("prerun", 20.25, "worker-w2", 20, id="z", key="k3")
    story.add("pub", 20.3, "worker-w2", 20, id="z", m0=20.2)
    story.add("proc", 20.4, name="w1", action="SIGKILL", pid=7).add("broker", 32.6, ids=[], queued=[], unacked=[])
    assert kinds(story.judge(tmp_path)) == ["lost"]


@pytest.mark.parametrize(("restored_lost", "lost"), [(True, False), (False, True)])
def test_a_delivery_whose_worker_died_goes_back_to_the_queue_and_can_be_lost_there(
        tmp_path: Path, restored_lost: bool, lost: bool) -> None:
    """A worker received the last publish and died (its main process SIGKILLed: the pool
    goes with it) before any outcome: the message was never acknowledged, and kombu puts it
    back on the queue once the visibility timeout (12 s) has passed, a publish the history
    does not show. Another worker SIGKILLed after that can take it off the queue and lose it
    (reported, the Sentinel chaos run of 2026-12-02: the broker's append-only file shows the
    restore's RPUSH, then an RPOP with no record as unacknowledged, as the worker died). A
    worker killed before the message could be back is no such loss (a violation)."""
    story = baseline().submit("z", "k3", 20.0)
    story.add("prerun", 20.1, "worker-w1-child", 21, id="z", key="k3")
    story.add("proc", 20.5, name="w1", action="SIGKILL", group=False, pid=7)
    story.add("proc", 20.51, name="w1", action="exit", pid=7, code=-9)
    died = 32.3 if restored_lost else 25.0
    story.add("proc", died, name="w2", action="SIGKILL", group=True, pid=8)
    story.add("proc", died + 0.02, name="w2", action="exit", pid=8, code=-9)
    story.add("broker", 32.6, ids=[], queued=[], unacked=[])
    story.meta["settings"]["workers"].append({"name": "w2", "pool": "threads", "concurrency": 3})
    verdict = story.judge(tmp_path)
    if lost:
        assert kinds(verdict) == ["lost"]
    else:
        assert kinds(verdict) == [] and [r.kind for r in verdict.reports] == ["lost-in-transport"]
        assert "died unacknowledged" in verdict.reports[0].what


@pytest.mark.parametrize("taken", [True, False])
def test_a_run_whose_pool_process_was_killed_goes_back_to_the_queue_at_once_and_can_be_lost_there(
        tmp_path: Path, taken: bool) -> None:
    """A run's pool process SIGKILLed under a living worker (``kill-child``): the chaos app runs
    ``acks_late`` with ``task_reject_on_worker_lost``, so the worker gives the message back to
    the queue at once, no visibility timeout. A worker SIGKILLed just after can take it off the
    queue and lose it (reported, the standalone chaos run of 2026-12-02: the broker's
    append-only file shows the requeue's LPUSH, an RPOP, and no record as unacknowledged). With
    no broker connection lost after the give-back, nothing excuses the loss (a violation)."""
    story = baseline().submit("z", "k3", 20.0)
    story.add("prerun", 20.1, "worker-w1-child", 21, id="z", key="k3")
    story.add("start", 20.12, "worker-w1-child", 21, id="z", key="k3", fence=99)
    story.add("chk", 20.12, "worker-w1-child", 21, id="z", key="k3", m0=20.12, ok=True)
    story.add("fault", 23.0, kind="kill-child", action="inject", step="SIGKILL child 21", targets=["w1"],
              target="w1", child=21, n=1)
    if taken:
        story.add("proc", 24.0, name="w2", action="SIGKILL", group=True, pid=8)
        story.add("proc", 24.02, name="w2", action="exit", pid=8, code=-9)
    story.add("broker", 32.6, ids=[], queued=[], unacked=[])
    story.meta["settings"]["workers"].append({"name": "w2", "pool": "threads", "concurrency": 3})
    verdict = story.judge(tmp_path)
    if taken:
        assert kinds(verdict) == [] and [r.kind for r in verdict.reports] == ["lost-in-transport"]
        assert "pool process was SIGKILLed (m=23.000)" in verdict.reports[0].what
    else:
        assert kinds(verdict) == ["lost"]


def test_a_rerun_after_the_sentinels_switched_primaries_is_reported_not_failed(tmp_path: Path) -> None:
    """With Sentinel, the primary can move without a fault meant to move it (a restart or a
    busy script longer than the down-after time): a done marker written on the old primary
    just before the switch is not on the new one (asynchronous replication, or a former
    primary elected again), and a copy of the message runs again (reported, the Sentinel
    chaos run of 2026-12-02: marker written 0.05 s before the switch). The same re-run with
    the switch before the completion is a violation."""
    for switch_at, excused in ((14.0, True), (12.5, False)):
        story = baseline().add("switch", switch_at, "sentinels", 0, sentinel="sentinel0",
                               old="127.0.0.1:1", new="127.0.0.1:2")
        story.run("c", "k", 16.0, 16.2, 600, pid=12)
        verdict = story.judge(tmp_path / str(switch_at))
        if excused:
            assert kinds(verdict) == [] and "rerun-after-data-loss" in [r.kind for r in verdict.reports]
        else:
            assert kinds(verdict) == ["rerun"]


def test_a_run_after_its_task_completed_is_a_rerun(tmp_path: Path) -> None:
    story = baseline().run("c", "k", 16.0, 16.2, 600, pid=12)
    verdict = story.judge(tmp_path)
    assert kinds(verdict) == ["rerun"] and "task c" in verdict.violations[0].what


def test_a_rerun_after_the_lock_redis_lost_its_data_is_reported_not_failed(tmp_path: Path) -> None:
    story = baseline().add("fault", 15.0, n=1, kind="restart-lock-empty", action="inject")
    story.add("fault", 15.5, n=1, kind="restart-lock-empty", action="heal")
    story.run("c", "k", 16.0, 16.2, 600, pid=12)
    verdict = story.judge(tmp_path)
    assert kinds(verdict) == [] and "rerun-after-data-loss" in [r.kind for r in verdict.reports]


def test_a_rerun_after_the_lock_redis_died_as_the_run_ended_and_came_back_empty_is_reported_not_failed(
        tmp_path: Path) -> None:
    """The lock Redis is SIGKILLed (and wiped) between the run's end and its outcome's record:
    the release found it gone, and the server came back empty, without the done marker or
    the slot's claim. The data was lost after the run completed (at the restart), although
    the fault was injected a moment before the completion was recorded."""
    story = baseline().add("fault", 13.0005, n=1, kind="restart-lock-empty", action="inject")
    story.add("fault", 14.0, n=1, kind="restart-lock-empty", action="heal")
    story.run("c", "k", 16.0, 16.2, 600, pid=12)
    verdict = story.judge(tmp_path)
    assert kinds(verdict) == [] and "rerun-after-data-loss" in [r.kind for r in verdict.reports]


@pytest.mark.parametrize("missing", [None, "main-only", "broker-exit", "cut-off", "kill"])
def test_a_rerun_whose_release_and_acknowledgement_were_both_lost_is_reported_not_failed(
        tmp_path: Path, missing: str | None) -> None:
    """The guarantees' done-marker limit, three faults at once (the standalone chaos run of
    2026-12-02, seed 3): the run's process was cut off from the lock Redis (its proxy cut)
    from the run's end until its worker was SIGKILLed, so its release and done marker never
    reached Redis, and the broker had died while the run held the message, so its
    acknowledgement was lost too: the redelivered copy runs again (reported). Without any
    one of the three (the broker up throughout, Redis answering before the kill, no kill),
    the re-run is a violation. A SIGKILL of the worker's main process alone kills the run's
    pool process as well (Celery gives prefork children SIGKILL as their parent-death
    signal): the same limit (the Sentinel chaos run of 2026-12-03, seed 4, a lock Redis
    busy with a script from the run's end to the kill)."""
    story = baseline().submit("z", "k3", 20.0)
    story.meta["settings"]["workers"][0]["proxied"] = True
    story.add("prerun", 20.1, "worker-w1-child", 21, id="z", key="k3")
    story.add("start", 20.12, "worker-w1-child", 21, id="z", key="k3", fence=99)
    story.add("chk", 20.12, "worker-w1-child", 21, id="z", key="k3", m0=20.12, ok=True)
    if missing != "broker-exit":
        story.add("proc", 21.0, name="broker-redis", action="exit", pid=5, code=-9)
    story.add("fault", 23.0, n=1, kind="proxy-cut", action="inject", targets=["proxy"])
    story.add("end", 24.0, "worker-w1-child", 21, id="z", key="k3", how="done")
    story.add("outcome", 25.0, "worker-w1-child", 21, id="z", key="k3", kind="success", state="SUCCESS")
    story.add("fault", 25.5 if missing == "cut-off" else 27.0, n=1, kind="proxy-cut", action="heal",
              targets=["proxy"])
    if missing != "kill":
        story.add("proc", 26.0, name="w1", action="SIGKILL", group=missing != "main-only", pid=7)
        story.add("proc", 26.05, name="w1", action="exit", pid=7, code=-9)
    story.add("prerun", 32.0, "worker-w2", 30, id="z", key="k3")
    story.run("z", "k3", 32.1, 32.5, 990, pid=30, redelivered=True)
    story.meta["settings"]["workers"].append({"name": "w2", "pool": "threads", "concurrency": 3})
    verdict = story.judge(tmp_path)
    if missing in (None, "main-only"):
        assert kinds(verdict) == [], verdict.violations
        assert [r.kind for r in verdict.reports if r.kind.startswith("rerun")] == ["rerun-after-lost-release"]
        assert verdict.figures["re-runs excused"] == 1
    else:
        assert kinds(verdict) == ["rerun"]


def test_a_slot_never_sent_while_a_beat_and_redis_were_up_is_a_violation(tmp_path: Path) -> None:
    story = baseline().drop_slot(20.0)
    verdict = story.judge(tmp_path)
    assert kinds(verdict) == ["slot"] and slot_label(EPOCH + 20.0) in verdict.violations[0].what


@pytest.mark.parametrize("outage", ["beats", "redis"])
def test_a_slot_due_while_every_beat_or_the_lock_redis_was_down_is_excused(tmp_path: Path, outage: str) -> None:
    story = baseline().drop_slot(20.0)
    if outage == "beats":
        story.add("proc", 1.0, name="b1", action="start", pid=3).add("proc", 1.0, name="b2", action="start", pid=4)
        story.add("proc", 18.0, name="b1", action="SIGKILL", pid=3)
        story.add("proc", 19.0, name="b2", action="SIGTERM", pid=4)
        story.add("beat-up", 22.5, "beat-b1", 5)
    else:
        story.add("fault", 19.0, n=1, kind="restart-lock", action="inject")
        story.add("fault", 20.5, n=1, kind="restart-lock", action="heal")
    verdict = story.judge(tmp_path)
    assert kinds(verdict) == [] and [r.kind for r in verdict.reports] == ["slot-excused"]


@pytest.mark.parametrize("case", ["outage", "broker up", "due after the beats sent again"])
def test_a_slot_due_while_a_publish_waited_out_a_broker_outage_and_superseded_is_excused(
        tmp_path: Path, case: str) -> None:
    """Every beat's publish waited for the broker (down from 17 s to 22 s): the slot due at
    20 s came due meanwhile, and the entry sent its latest slot once the publish returned
    (the standalone chaos run of 2026-12-03, seed 3: a 6 s broker restart, an entry every
    2 s). Excused as a superseded slot; not when the broker was up, nor for a slot due once
    the beats were sending again."""
    story = baseline().drop_slot(20.0)
    if case != "broker up":
        story.add("proc", 17.0, name="broker-redis", action="exit", pid=5, code=-9)
        story.add("proc", 19.0 if case == "due after the beats sent again" else 22.0, name="broker-redis",
                  action="start", pid=6)
    if case == "due after the beats sent again":
        story.add("sent", 19.5, "beat-b1", 3, id="other", entry="other", slot=slot_label(EPOCH + 19.5))
    verdict = story.judge(tmp_path)
    if case == "outage":
        assert kinds(verdict) == [] and [r.kind for r in verdict.reports] == ["slot-excused"], verdict.violations
    else:
        assert kinds(verdict) == ["slot"]


@pytest.mark.parametrize("waited", ["this slot", "another slot", "last slot"])
def test_a_slot_held_back_for_a_recovery_window_and_superseded_is_excused(tmp_path: Path, waited: str) -> None:
    """A beat held the slot back for the lock Redis's recovery window (a resharding that
    moved a shard's record opens one, not only a restart) and the entry sent a later slot
    after it: the guarantees' "an entry due more often than the window sends the latest".
    A wait logged for another slot excuses nothing, nor a wait with no later slot sent."""
    story = baseline()
    dropped = 30.0 if waited == "last slot" else 20.0
    story.drop_slot(dropped)
    label = slot_label(EPOCH + (dropped if waited != "another slot" else 15.0))
    story.add("slot-window", dropped + 0.2, "beat-b1", 3, entry="every-5s", slot=label)
    verdict = story.judge(tmp_path)
    if waited == "this slot":
        assert kinds(verdict) == [] and [r.kind for r in verdict.reports] == ["slot-excused"]
        assert "recovery window" in verdict.reports[0].what
    else:
        assert kinds(verdict) == ["slot"]


def test_a_process_that_outlives_its_sigterm_bound_hangs(tmp_path: Path) -> None:
    story = baseline().add("term", 31.5, name="w1", pid=7, sent=31.5, exited=None, code=None, bound=30.0)
    assert kinds(story.judge(tmp_path)) == ["hang"]


@pytest.mark.parametrize(("key", "pttl"), [(f"chaos:{{{TASK}:ab12}}", 3000), ("chaos:{beat:e}:x", -1)])
def test_a_run_lock_left_when_idle_or_a_key_without_ttl_is_a_violation(tmp_path: Path, key: str, pttl: int) -> None:
    story = baseline()
    story.add("keys", 32.1, keys=[{"key": key, "type": "string", "pttl": pttl}])
    assert kinds(story.judge(tmp_path)) == ["keys"]


def test_the_records_of_cluster_shards_keep_no_ttl_by_design(tmp_path: Path) -> None:
    """On Redis Cluster each shard has its server record, ``<prefix>:server:{<n>}``, kept
    without a TTL as the single server's (docs/monitoring.md)."""
    story = baseline()
    story.add("keys", 32.1, keys=[{"key": "chaos:server:{1234}", "type": "string", "pttl": -1},
                                  {"key": "chaos:server:{x}", "type": "string", "pttl": -1}])
    verdict = story.judge(tmp_path)
    assert kinds(verdict) == ["keys"] and "chaos:server:{x}" in verdict.violations[0].what


def test_counters_are_not_compared_when_the_app_keeps_none(tmp_path: Path) -> None:
    """``singleton_stats`` off (as on Redis Cluster): nothing is counted, so the counters
    rule does not apply; the report says so."""
    story = baseline()
    for event in story.events:
        if event["ev"] == "counters":
            event["counters"] = {"tasks": {}, "beat": {"entries": {}, "total": {}}, "stats": False}
    verdict = story.judge(tmp_path)
    assert kinds(verdict) == [] and "counters-off" in {r.kind for r in verdict.reports}


@pytest.mark.parametrize("when", ["audit-end", "final"])
def test_counters_that_disagree_with_the_history_are_a_violation(tmp_path: Path, when: str) -> None:
    story = baseline()
    for event in story.events:
        if event.get("when") == when:
            event["counters"] = {"tasks": {TASK: {"acquired": 60, "skipped": 1, "released": 7, "lost": 0}}}
    verdict = story.judge(tmp_path)
    assert kinds(verdict) == ["counters"] and "acquired" in verdict.violations[0].what


def test_the_checker_judges_a_saved_history_from_the_command_line(tmp_path: Path) -> None:
    story = baseline().submit("z", "k3", 20.0)
    write(tmp_path / "run" / "history", story.meta, story.events)
    done = subprocess.run([sys.executable, "-m", "harness.chaos", "check", str(tmp_path / "run")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "**lost**" in done.stdout and (tmp_path / "run" / "verdict.json").exists()


@pytest.mark.parametrize(("name", "kind", "names"), [
    # A soft time limit ended a run of k2 while its acquire waited on a paused Redis; the
    # next run on that pool process, of k1, read that acquire's reply as its own ("taken"),
    # while another run held k1 and went on passing its checks.
    ("stale-reply-overlap", "overlap", ["run c34386a2", "run adf029f0", "13 time(s)"]),
    # A completed run's release got no reply (-BUSY) and was not sent again: no done marker;
    # its acknowledgement lost too (the same busy Redis), its message ran again.
    ("release-lost-rerun", "rerun", ["task c36724b9", "2.66s after it completed"]),
    # The lock Redis (appendonly yes) restarted with its data directory lost: a run of k4
    # acquired 15 ms later, while the run that held k4 before the restart still passed.
    ("empty-restart-overlap", "overlap", ["run 6ad7e205", "run 7677e7ef"]),
])
def test_histories_saved_from_real_runs_are_judged_as_they_were(name: str, kind: str, names: list[str]) -> None:
    """Histories saved (trimmed) from chaos runs that found a violation: the checker still finds it."""
    verdict = check(load(ROOT / "tests" / "chaos_histories" / name / "history"))
    assert kinds(verdict) == [kind]
    assert all(part in verdict.violations[0].what for part in names), verdict.violations[0].what


def test_a_message_a_dying_worker_took_off_the_queue_in_a_real_run_is_lost_in_the_transport() -> None:
    """Saved (trimmed) from the 40 s CI run of 2026-12-02 on a loaded 2-core machine: w1 was
    SIGKILLed (group) at m=15249.173 and its exit seen at 15249.246; the submitter's publish
    began at 15249.236. The broker's AOF shows the LPUSH, at once an RPOP (the BRPOP served to
    w1's still open connection), and no HSET of ``unacked``: the message went with w1. The
    checker once read the kill as before the publish (a violation); it is lost in the transport."""
    verdict = check(load(ROOT / "tests" / "chaos_histories" / "kill-before-publish-lost" / "history"))
    assert kinds(verdict) == [], verdict.violations
    assert [r.kind for r in verdict.reports] == ["lost-in-transport"]
    assert "327879f7" in verdict.reports[0].what and "w1 SIGKILLed at m=15249.173" in verdict.reports[0].what

"""``celery_singleton_beat.contrib.redbeat.SingletonRedBeatScheduler`` on RedBeat's own keys.

* in-process schedulers (sends recorded, real time): what RedBeat's API does
  reaches the beat at its next tick; ``last_run_at`` is the slot; nothing is
  written between claims won ahead and their publish;
* three real beats on one Redis beside three beats of RedBeat's own
  ``RedBeatScheduler``, entries created and edited through RedBeat's API while
  they run, one beat of each SIGKILLed: one run per slot and no gap for ours,
  and what RedBeat's lock hand-over costs, measured side by side and printed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import pytest

from .support import LOCK_DB, CeleryProcess, Owner, RedisServer, importorskip, owning, soak, wait_for, wait_for_phase
from .support.beat import (
    already_scheduled,
    assert_once_per_slot,
    fresh_beat_state,
    logged_sends,
    module_beat_worker,
    read_runs,
    runs_of,
    wait_between_sends,
)
from .support.dbbeat import all_running, assert_follows_edit, assert_no_errors, assert_took_part, stop_and_drain
from .support.extras import assert_needs_extra
from .support.redbeat import (
    OURS,
    PLAIN,
    api_app,
    as_epoch,
    create_entry,
    figures,
    logged_at,
    meta_of,
    recording_scheduler,
    set_every,
    start_redbeat_beats,
)
from .support.slots import UTC, parse_slot, slot_floor

importorskip("redbeat")


def sent_names(scheduler: Any) -> list[str]:
    return [sent["args"][0] for sent in scheduler.sent]


def runs_of_entry(runs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [run for run in runs if run["entry"] == name]


def test_base_install_does_not_import_redbeat() -> None:
    """The package imports without RedBeat; the contrib module names the extra."""
    assert_needs_extra("redbeat", ("redbeat",), "redbeat")


def test_what_redbeats_api_does_reaches_the_beat_at_its_next_tick(redis_db: Any, redis_server: RedisServer) -> None:
    """Created, edited, disabled, enabled and deleted through RedBeat's API: each is in the
    beat's schedule after its next tick. Neither an entry there at the first start nor one
    created later sends anything before its next slot."""
    from redbeat import RedBeatSchedulerEntry

    api = api_app(redis_server)
    create_entry(api, "before-start", 3600)
    scheduler = recording_scheduler(redis_server)
    try:
        scheduler.tick()
        assert list(scheduler.schedule) == ["before-start"]
        RedBeatSchedulerEntry(name="before-start", app=api).delete()
        scheduler.tick()
        assert scheduler.schedule == {}
        create_entry(api, "hourly", 3600)
        scheduler.tick()
        assert list(scheduler.schedule) == ["hourly"]
        assert scheduler.schedule["hourly"].schedule.run_every == timedelta(hours=1)
        set_every(api, "hourly", 7200)
        scheduler.tick()
        assert scheduler.schedule["hourly"].schedule.run_every == timedelta(hours=2)
        key = RedBeatSchedulerEntry.generate_key(api, "hourly")
        entry = RedBeatSchedulerEntry.from_key(key, app=api)
        entry.enabled = False
        entry.save()
        scheduler.tick()
        assert scheduler.schedule == {}
        entry.enabled = True
        entry.save()
        scheduler.tick()
        assert list(scheduler.schedule) == ["hourly"]
        entry.delete()
        scheduler.tick()
        assert scheduler.schedule == {}
        assert scheduler.sent == []
    finally:
        scheduler.close()


def test_last_run_at_is_the_slot_written_once_by_the_beat_that_sent_it(
        redis_db: Any, redis_server: RedisServer) -> None:
    """Two beats; the entry's latest slot was missed (catch-up): one sends it, and RedBeat's
    ``meta`` says ``last_run_at`` = the slot (not the send time), one run, and its score in
    RedBeat's schedule is the next slot."""
    api = api_app(redis_server)
    already_scheduled(redis_server.client(LOCK_DB), {"hourly": {}})
    create_entry(api, "hourly", 3600)
    first, second = recording_scheduler(redis_server), recording_scheduler(redis_server)
    try:
        for scheduler in (first, second):
            wait_for(lambda scheduler=scheduler: scheduler.tick() > 0, timeout=10, message="the due slot handled")
        assert sent_names(first) + sent_names(second) == ["hourly"]
        sent = (first.sent + second.sent)[0]
        slot = parse_slot(sent["slot"])
        assert slot == slot_floor(datetime.now(UTC).timestamp(), 3600)
        meta = meta_of(api, "hourly")
        assert meta["last_run_at"] == slot
        assert meta["total_run_count"] == 1
        assert meta["score"] == (slot + timedelta(hours=1)).timestamp()
    finally:
        first.close()
        second.close()


def test_nothing_is_written_between_claims_won_ahead_and_their_send(
        redis_db: Any, redis_server: RedisServer) -> None:
    """Two entries due at once: the first send leaves the second's slot claimed ahead;
    ``meta`` is written only once both are sent. The entry deleted in between through
    RedBeat's API is not written back (no ``meta``, not in RedBeat's schedule)."""
    from redbeat.schedulers import get_redis

    api = api_app(redis_server)
    names = ["burst-a", "burst-b"]
    already_scheduled(redis_server.client(LOCK_DB), {name: {} for name in names})
    for name in names:
        create_entry(api, name, 3600)
    as_created = {name: meta_of(api, name) for name in names}
    scheduler = recording_scheduler(redis_server)
    try:
        assert scheduler.tick() == 0
        assert len(scheduler.sent) == 1
        assert scheduler.claims_in_flight
        first, other = sent_names(scheduler)[0], next(n for n in names if n not in sent_names(scheduler))
        assert meta_of(api, first) == as_created[first]  # not written while a claim is unsent
        from redbeat import RedBeatSchedulerEntry

        RedBeatSchedulerEntry(first, app=api).delete()
        assert scheduler.tick() == 0
        assert sent_names(scheduler) == [first, other]
        assert not scheduler.claims_in_flight
        assert meta_of(api, other)["total_run_count"] == 1
        client = get_redis(api)
        key = RedBeatSchedulerEntry.generate_key(api, first)
        assert not client.exists(key)
        assert client.zscore(api.redbeat_conf.schedule_key, key) is None
    finally:
        scheduler.close()


class StopSignal(SystemExit):
    """What ``celery beat``'s SIGTERM handler raises, wherever the tick is."""


def _stop_once(target: Any, name: str, after: bool) -> None:
    """Make ``target.name`` raise :class:`StopSignal` once, before or after doing its work:
    a stop signal arriving inside it."""
    original = getattr(target, name)
    fired = []

    def stopped(*args: Any, **kwargs: Any) -> Any:
        if fired:
            return original(*args, **kwargs)
        fired.append(True)
        if after:
            original(*args, **kwargs)
        raise StopSignal()

    setattr(target, name, stopped)


@pytest.mark.parametrize("where", ["meta write", "publish"])
def test_a_stop_signal_inside_a_send_or_its_meta_write_leaves_last_run_at_on_the_slot(
        redis_db: Any, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """The beat's stop handler raises ``SystemExit`` in the middle of the tick: inside the
    write of RedBeat's ``meta`` (nothing written yet), or inside the publish once the message
    is out. Beat's service then closes the scheduler: ``last_run_at`` is the slot sent."""
    import celery_singleton_beat.contrib.redbeat as contrib

    api = api_app(redis_server)
    already_scheduled(redis_server.client(LOCK_DB), {"hourly": {}})
    create_entry(api, "hourly", 3600)
    as_created = meta_of(api, "hourly")
    scheduler = recording_scheduler(redis_server)
    if where == "meta write":
        monkeypatch.setattr(contrib, "evalsha_pipelined", contrib.evalsha_pipelined)
        _stop_once(contrib, "evalsha_pipelined", after=False)
    else:
        _stop_once(scheduler, "send_task", after=True)
    with pytest.raises(StopSignal):
        scheduler.tick()
    assert sent_names(scheduler) == ["hourly"]
    assert meta_of(api, "hourly") == as_created  # the stop came before the write
    scheduler.close()
    meta = meta_of(api, "hourly")
    slot = parse_slot(scheduler.sent[0]["slot"])
    assert meta["last_run_at"] == slot
    assert meta["total_run_count"] == 1
    assert meta["score"] == (slot + timedelta(hours=1)).timestamp()


def test_an_entry_the_beat_cannot_schedule_is_logged_and_skipped(
        redis_db: Any, redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """A definition with a bad ``singleton`` option does not stop the beat: the other entries run."""
    api = api_app(redis_server)
    scheduler = recording_scheduler(redis_server)
    try:
        create_entry(api, "bad", 3600, options={"singleton": "yes"})
        create_entry(api, "good", 3600)
        scheduler.tick()
        assert list(scheduler.schedule) == ["good"]
        assert f"RedBeat entry {OURS}bad not scheduled" in caplog.text
    finally:
        scheduler.close()


# ----------------------------------------------------------------- real beats, side by side


@dataclass(frozen=True)
class SideBySide:
    """What the beats of the scenario did (see :func:`side_by_side`)."""

    ours: list[CeleryProcess]
    plain: list[CeleryProcess]
    names: dict[str, str]  # role -> entry name
    edited: float
    settled: float
    killed_at: float
    stopped: float
    runs: list[dict[str, Any]]
    last_meta: dict[str, Any]
    our_victim: CeleryProcess
    plain_victim: CeleryProcess
    seen_after: list[float]  # per beat of ours: seconds from the edit to its log line


@pytest.fixture(scope="module")
def redbeat_worker(redis_server: RedisServer) -> Iterator[CeleryProcess]:
    yield from module_beat_worker(redis_server, "redbeat")


@pytest.fixture(scope="module")
def side_by_side(redis_server: RedisServer, redbeat_worker: CeleryProcess) -> Iterator[SideBySide]:
    """Three of our beats and three of RedBeat's own on one Redis, each kind on its own
    RedBeat prefix; the same entries created through RedBeat's API while they run (1 s and
    2 s), the 2 s one set to 1 s; then the beat that sent the latest slot (ours) and the lock
    holder (RedBeat's) SIGKILLed at the same moment, half-way between two slots. Ends 5 s
    after the kill, and at least 2 s after RedBeat's own beats sent again; the beats are
    stopped and the queue drained."""
    prefix = fresh_beat_state(redis_server, redbeat_worker, "rb")
    names = {f"{kind}-{role}": f"{prefix}{kind}-{role}" for kind in ("ours", "plain") for role in ("1s", "edited")}
    apis = {"ours": api_app(redis_server, OURS), "plain": api_app(redis_server, PLAIN)}
    owner = Owner("redbeat beats")
    try:
        with owning(owner):
            ours = start_redbeat_beats(redis_server, ["a", "b", "c"])
            plain = start_redbeat_beats(redis_server, ["a", "b", "c"], plain=True)
            everyone = ours + plain
            for kind, api in apis.items():
                create_entry(api, names[f"{kind}-1s"], 1)
                create_entry(api, names[f"{kind}-edited"], 2)
            wait_for(lambda: all(len(runs_of(redis_server, names[f"{kind}-1s"])) >= 3 for kind in apis),
                     timeout=30, message="three runs of each 1 s entry")
            wait_for_phase(2.0, 0.4, 0.6)  # between the slots of both grids
            for kind, api in apis.items():
                set_every(api, names[f"{kind}-edited"], 1)
            edited = time.time()
            wait_for(lambda: all(f"beat: {names['ours-edited']}: schedule changed" in beat.output() for beat in ours),
                     timeout=30, message="every beat of ours to see the edit")
            settled = time.time()
            seen_after = [logged_at(beat, f"beat: {names['ours-edited']}: schedule changed") - edited
                          for beat in ours]
            wait_for(lambda: len([run for run in runs_of(redis_server, names["ours-edited"])
                                  if run["at"] > settled]) >= 2, timeout=30, message="runs on the new grid")
            plain_victim = next(beat for beat in plain if "beat: Acquired lock" in beat.output())
            wait_between_sends(redis_server, names["ours-1s"], 1, 1.0, 0.45, 0.55)  # no send of ours in flight
            winner = runs_of(redis_server, names["ours-1s"])[-1]["instance"]
            our_victim = next(beat for beat in ours if f":{beat.pid}:" in winner)
            our_victim.kill_group()
            plain_victim.kill_group()
            killed_at = time.time()
            survivors = [beat for beat in everyone if beat not in (our_victim, plain_victim)]
            wait_for(lambda: all_running(survivors)() and any(
                (run["sent_at"] or 0) > killed_at for run in runs_of(redis_server, names["plain-1s"])),
                timeout=60, message="RedBeat's own beats to send again after the kill")
            # Ours: 5 s after the kill; RedBeat's: two more sends after its hand-over.
            soak(max(killed_at + 5, time.time() + 2) - time.time(), check=all_running(survivors),
                 what="beats after the kill")
            stopped = stop_and_drain(redis_server, everyone)
            last_meta = meta_of(apis["ours"], names["ours-1s"])
    except BaseException:
        owner.close()
        raise
    yield SideBySide(ours, plain, names, edited, settled, killed_at, stopped, read_runs(redis_server),
                     last_meta, our_victim, plain_victim, seen_after)
    owner.close()


def _our_sends(run: SideBySide) -> list[float]:
    """The slots of our 1 s entry, once per send the beats logged, up to a second before they
    were stopped."""
    slots = [as_epoch(slot) for slot in logged_sends(run.ours, run.names["ours-1s"]).elements()]
    return [at for at in slots if at <= run.stopped - 1]


def _plain_sends(run: SideBySide) -> list[float]:
    """When RedBeat's own beats sent the 1 s entry (its messages carry no slot), up to a
    second before they were stopped."""
    return [r["sent_at"] for r in runs_of_entry(run.runs, run.names["plain-1s"]) if r["sent_at"] <= run.stopped - 1]


def test_three_beats_on_redbeat_send_each_slot_once_and_lose_none_to_a_kill(side_by_side: SideBySide) -> None:
    """Ours: one run per slot and no gap for the entry created while the beats ran, across
    the SIGKILL; the entry edited through RedBeat's API follows the edit on every beat (old
    grid before, every slot of the new grid after); every beat took part (no lock); RedBeat's
    ``last_run_at`` is the latest slot."""
    run = side_by_side
    one_second, edited = run.names["ours-1s"], run.names["ours-edited"]
    slots = assert_once_per_slot(run.runs, one_second, timedelta(seconds=1), slot_floor(run.stopped - 1, 1))
    assert slots[0].timestamp() < run.killed_at < slots[-1].timestamp() - 4
    assert_follows_edit(run.runs, edited, 2, 1, run.edited, run.settled, slot_floor(run.stopped - 1.5, 1))
    after = {r["instance"] for r in runs_of_entry(run.runs, one_second) if as_epoch(r["slot"]) > run.killed_at}
    assert after and not any(f":{run.our_victim.pid}:" in instance for instance in after)
    survivors = [beat for beat in run.ours if beat is not run.our_victim]
    assert_took_part(survivors, one_second, minimum=8)
    assert_no_errors(run.ours)
    ours = figures(_our_sends(run), 1.0)
    assert (ours.per_slot, ours.missed) == (1.0, 0)
    assert {as_epoch(r["slot"]) for r in runs_of_entry(run.runs, one_second)
            if as_epoch(r["slot"]) <= run.stopped - 1} == set(_our_sends(run))
    assert run.last_meta["last_run_at"] == slots[-1]


def test_redbeats_own_lock_hand_over_loses_slots_measured_beside_ours(
        side_by_side: SideBySide, capsys: pytest.CaptureFixture[str]) -> None:
    """RedBeat's own ``RedBeatScheduler`` in the same run: the lock holder SIGKILLed, nothing is
    sent until its lock expires (5 x ``beat_max_loop_interval``) and a standby takes it:
    slots lost. Both kinds measured on the 1 s entry and printed side by side."""
    run = side_by_side
    ours = figures(_our_sends(run), 1.0)
    plain = figures(_plain_sends(run), 1.0)
    with capsys.disabled():
        print(f"\n{'1 s entry, 3 beats, one SIGKILLed':<34} {'sends':>5} {'slots':>5} {'per slot':>8} "
              f"{'missed':>6} {'gap (s)':>8}")
        print(ours.row("SingletonRedBeatScheduler"))
        print(plain.row("RedBeatScheduler (lock, 5 s)"))
        print("edit seen by our beats after " + ", ".join(f"{s:.2f} s" for s in sorted(run.seen_after))
              + " (beat_max_loop_interval 1 s)")
    assert plain.missed >= 1, plain
    assert plain.longest_gap > 2, plain
    assert (ours.per_slot, ours.missed) == (1.0, 0)

"""Slot math: interval, crontab (with DST in Europe/Berlin), solar and other schedules.

No Redis here: slots are a pure function of the schedule and the clock.
"""

from __future__ import annotations

import random
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.schedules import BaseSchedule, crontab, schedule

from celery_singleton_beat.beat import (
    EARLY_TOLERANCE,
    Slot,
    SlotError,
    crontab_slot,
    current_slot,
    entry_spec,
    format_slot,
    interval_slot,
    slot_key,
    solar_slot,
)
from celery_singleton_beat.beat.slots import _wall_to_utc

from .support.skips import importorskip
from .support.slots import UTC, utc


def tz_app(tz: str = "UTC") -> Celery:
    app = Celery("slots", set_as_current=False)
    app.conf.timezone = tz
    return app


def all_slots(sched: Any, start: datetime, end: datetime, step: timedelta,
              hints: bool = True) -> list[Slot]:
    """Sweep the clock from start to end, as a beat would see it; distinct slots in order."""
    found: list[Slot] = []
    hint = None
    moments = [start + i * step for i in range(int((end - start) / step) + 1)] + [end]
    for now in moments:
        slot = current_slot(sched, now, hint if hints else None)
        assert slot is not None
        assert slot.at <= now + EARLY_TOLERANCE
        assert slot.next is None or slot.next > now
        if not found or found[-1].at != slot.at:
            assert not found or slot.at > found[-1].at, "slots went backwards"
            found.append(slot)
        hint = slot.at
    return found


# ----------------------------------------------------------------- interval

@pytest.mark.parametrize("period", [1, 2, 7, 60, 3600, 86400, 0.25])
def test_interval_slots_are_epoch_aligned(period: float) -> None:
    rng = random.Random(period)
    for _ in range(200):
        now = utc(2024, 5, 1) + timedelta(seconds=rng.uniform(0, 10 * 86400))
        slot = interval_slot(timedelta(seconds=period), now)
        elapsed = (slot.at - utc(1970, 1, 1)).total_seconds()
        assert elapsed / period == pytest.approx(round(elapsed / period))
        assert slot.at <= now + EARLY_TOLERANCE < slot.next
        assert slot.next - slot.at == timedelta(seconds=period)


def test_interval_slot_does_not_depend_on_start_time_or_timezone() -> None:
    """Beats started at different times, with different zones, name the same instants."""
    period = timedelta(seconds=5)
    fire = utc(2024, 5, 1, 12, 0, 10)
    for started in (utc(2024, 5, 1, 11, 59, 58, 123000), utc(2024, 4, 30, 7, 1, 2)):
        assert started < fire
        for tz in ("UTC", "Europe/Berlin", "America/New_York"):
            local = fire.astimezone(tz_app(tz).timezone)
            assert interval_slot(period, local).at == fire


def fire_skewed_beat(skew: float, period: timedelta, start: datetime,
                     end: datetime) -> list[tuple[datetime, datetime]]:
    """(true time, slot named) of each send of a beat whose clock reads true time + ``skew``.

    Like beat, it sleeps until *its own* clock reaches the next slot and wakes a
    hair early or late (``wake_up(slot)``); it names the slot from its clock at
    that moment, and the slot's ``next`` is when it fires again.
    """
    offset = timedelta(seconds=skew)
    fired: list[tuple[datetime, datetime]] = []
    due = interval_slot(period, start + offset).next
    while due is not None:
        true_time = due + wake_up(due) - offset  # when its clock reads due + wake_up
        if true_time > end:
            break
        slot = interval_slot(period, true_time + offset)
        fired.append((true_time, slot.at))
        if slot.next is not None and slot.next <= due:
            raise AssertionError(f"woke at {true_time + offset} (its clock) for {due} and named {slot.at}: "
                                 f"it would send {slot.at} again")
        due = slot.next
    return fired


#: How late each slot's wake-up is, by slot: a hair early, on time, late, very late.
WAKE_UPS = [-EARLY_TOLERANCE / 2, timedelta(0), timedelta(milliseconds=30), timedelta(seconds=0.9)]


def wake_up(slot: datetime) -> timedelta:
    return WAKE_UPS[int(slot.timestamp()) // 2 % len(WAKE_UPS)]


@pytest.mark.parametrize("skew", [-0.4, -0.2, 0.2, 0.4])
def test_interval_slot_tolerates_clock_skew(skew: float) -> None:
    """A beat whose clock is ``skew`` s off (up to +/-0.4 s on a 2 s period) sends every
    slot once, naming each as a beat on time does, though ``skew`` s apart in true time.

    Each names the slot from its own clock at its own firing moment, a hair early
    (within EARLY_TOLERANCE) or late: so all of them claim the same keys.
    """
    period = timedelta(seconds=2)
    start, end = utc(2024, 5, 1, 12), utc(2024, 5, 1, 12, 3, 20)
    on_time = fire_skewed_beat(0.0, period, start, end)
    skewed = fire_skewed_beat(skew, period, start, end)
    for sends in (on_time, skewed):
        slots = [slot for _, slot in sends]
        assert slots == [slots[0] + k * period for k in range(len(slots))], "each slot once, none missed"
    expected = [start + k * period for k in range(1, 99)]  # 12:00:02 .. 12:03:16
    on_time_at, skewed_at = dict((slot, at) for at, slot in on_time), dict((slot, at) for at, slot in skewed)
    assert set(expected) <= set(on_time_at) and set(expected) <= set(skewed_at), "the same keys claimed"
    for slot in expected:
        # The same slot fired ``skew`` s earlier (clock ahead) or later (behind) in true time.
        assert skewed_at[slot] - on_time_at[slot] == timedelta(seconds=-skew), slot
    # In true time, a beat ahead that wakes on time fires before the slot begins:
    # naming the slot from true time instead of its own clock would name the previous one.
    if skew > 0:
        early = [slot for slot in expected if wake_up(slot) <= timedelta(0)]
        assert early and all(interval_slot(period, skewed_at[slot]).at < slot for slot in early)


def test_interval_slot_rejects_a_non_positive_period() -> None:
    with pytest.raises(SlotError):
        interval_slot(timedelta(0), utc(2024, 1, 1))
    with pytest.raises(SlotError):
        current_slot(schedule(timedelta(seconds=-1)), utc(2024, 1, 1))


# ----------------------------------------------------------------- crontab

def test_crontab_slot_utc_matches_celery() -> None:
    app = tz_app("UTC")
    cron = crontab(minute="*/15", app=app)
    slot = crontab_slot(cron, utc(2024, 5, 1, 12, 7, 30))
    assert slot == Slot(utc(2024, 5, 1, 12, 0), utc(2024, 5, 1, 12, 15))
    slot = crontab_slot(cron, utc(2024, 5, 1, 12, 15))
    assert slot.at == utc(2024, 5, 1, 12, 15)
    # Celery agrees on the next run after the slot, asked at the slot as beat asks it
    # (before 5.7 its answer depends on the day of its clock: celery/celery#10494).
    at_slot = crontab(minute="*/15", app=app, nowfun=lambda: slot.at)
    last, delta, _ = at_slot.remaining_delta(slot.at, tz=cron.tz)
    assert (last + delta).astimezone(UTC) == slot.next


def test_crontab_slot_is_the_same_from_any_hint() -> None:
    """Beats with different histories (hints) agree on the latest instant."""
    app = tz_app("Europe/Berlin")
    cron = crontab(minute="5,35", hour="*/3", app=app)
    rng = random.Random(7)
    for _ in range(200):
        now = utc(2024, 1, 1) + timedelta(minutes=rng.uniform(0, 365 * 1440))
        plain = crontab_slot(cron, now)
        assert plain is not None
        stale = crontab_slot(cron, now - timedelta(days=rng.uniform(1, 40)))
        assert crontab_slot(cron, now, stale.at) == plain
        assert crontab_slot(cron, now, plain.at) == plain


def test_crontab_slot_walks_far_from_a_stale_hint_quickly() -> None:
    app = tz_app("UTC")
    cron = crontab(minute="*", app=app)  # one instant a minute
    now = utc(2024, 5, 1, 12, 0, 30)
    hint = utc(2024, 2, 1)  # 130,000 instants behind: bisection, not a walk
    assert crontab_slot(cron, now, hint) == Slot(utc(2024, 5, 1, 12), utc(2024, 5, 1, 12, 1))


def test_crontab_rare_instants_are_found() -> None:
    app = tz_app("UTC")
    leap = crontab(minute=0, hour=0, day_of_month=29, month_of_year=2, app=app)
    slot = crontab_slot(leap, utc(2027, 6, 1))
    assert slot == Slot(utc(2024, 2, 29), utc(2028, 2, 29))
    monday = crontab(minute="*", hour="*", day_of_week="mon", app=app)
    slot = crontab_slot(monday, utc(2024, 6, 2, 12))  # a Sunday
    assert slot == Slot(utc(2024, 5, 27, 23, 59), utc(2024, 6, 3))


def test_wall_to_utc_maps_gaps_to_the_jump_and_repeats_to_the_first_occurrence() -> None:
    berlin = tz_app("Europe/Berlin").timezone
    # 2024-03-31: 02:00 CET -> 03:00 CEST (01:00 UTC). 02:xx does not exist.
    assert _wall_to_utc(datetime(2024, 3, 31, 1, 59), berlin) == utc(2024, 3, 31, 0, 59)
    assert _wall_to_utc(datetime(2024, 3, 31, 2, 0), berlin) == utc(2024, 3, 31, 1, 0)
    assert _wall_to_utc(datetime(2024, 3, 31, 2, 30), berlin) == utc(2024, 3, 31, 1, 0)
    assert _wall_to_utc(datetime(2024, 3, 31, 3, 0), berlin) == utc(2024, 3, 31, 1, 0)
    # 2024-10-27: 03:00 CEST -> 02:00 CET (01:00 UTC). 02:xx happens twice.
    assert _wall_to_utc(datetime(2024, 10, 27, 2, 30), berlin) == utc(2024, 10, 27, 0, 30)
    assert _wall_to_utc(datetime(2024, 10, 27, 3, 0), berlin) == utc(2024, 10, 27, 2, 0)


def test_crontab_daily_in_berlin_fires_once_per_day_across_both_dst_changes() -> None:
    app = tz_app("Europe/Berlin")
    cron = crontab(minute=30, hour=2, app=app)
    spring = all_slots(cron, utc(2024, 3, 29, 12), utc(2024, 4, 2, 12), timedelta(minutes=10))
    assert [s.at for s in spring] == [
        utc(2024, 3, 29, 1, 30),   # 02:30 CET
        utc(2024, 3, 30, 1, 30),   # 02:30 CET
        utc(2024, 3, 31, 1, 0),    # 02:30 does not exist: fires when clocks jump to 03:00 CEST
        utc(2024, 4, 1, 0, 30),    # 02:30 CEST
        utc(2024, 4, 2, 0, 30),
    ]
    autumn = all_slots(cron, utc(2024, 10, 25, 12), utc(2024, 10, 29, 12), timedelta(minutes=10))
    assert [s.at for s in autumn] == [
        utc(2024, 10, 25, 0, 30),
        utc(2024, 10, 26, 0, 30),
        utc(2024, 10, 27, 0, 30),  # 02:30 happens twice: only its first occurrence (CEST)
        utc(2024, 10, 28, 1, 30),  # 02:30 CET
        utc(2024, 10, 29, 1, 30),
    ]


def test_crontab_every_minute_in_berlin_across_spring_forward() -> None:
    """Every real minute gets exactly one slot; the hour that does not exist folds into one."""
    app = tz_app("Europe/Berlin")
    cron = crontab(minute="*", app=app)
    slots = all_slots(cron, utc(2024, 3, 31, 0, 55), utc(2024, 3, 31, 1, 5), timedelta(seconds=7))
    assert [s.at for s in slots] == [utc(2024, 3, 31, 0, 55) + timedelta(minutes=i) for i in range(11)]
    assert all(s.next == s.at + timedelta(minutes=1) for s in slots)


def test_crontab_every_minute_in_berlin_across_fall_back_follows_celery() -> None:
    """Like a single Celery beat: the repeated hour's wall times already ran (first occurrence)."""
    app = tz_app("Europe/Berlin")
    cron = crontab(minute="*", app=app)
    slots = all_slots(cron, utc(2024, 10, 27, 0, 58), utc(2024, 10, 27, 2, 2), timedelta(seconds=13))
    assert [s.at for s in slots] == [
        utc(2024, 10, 27, 0, 58), utc(2024, 10, 27, 0, 59),  # 02:58, 02:59 CEST
        utc(2024, 10, 27, 2, 0), utc(2024, 10, 27, 2, 1), utc(2024, 10, 27, 2, 2),  # 03:00 CET ...
    ]
    # Any clock reading inside the repeated hour names the last slot before it.
    for minutes in (0, 17, 59):
        now = utc(2024, 10, 27, 1, minutes, 30)
        assert crontab_slot(cron, now) == Slot(utc(2024, 10, 27, 0, 59), utc(2024, 10, 27, 2, 0))


def test_crontab_dst_slots_agree_across_instances_with_random_hints() -> None:
    app = tz_app("Europe/Berlin")
    cron = crontab(minute="*/20", app=app)
    rng = random.Random(3)
    for day in (utc(2024, 3, 31), utc(2024, 10, 27)):
        for _ in range(300):
            now = day + timedelta(seconds=rng.uniform(0, 4 * 3600))
            plain = crontab_slot(cron, now)
            earlier = crontab_slot(cron, now - timedelta(minutes=rng.uniform(0, 600)))
            assert crontab_slot(cron, now, earlier.at) == plain
            assert plain.at <= now < plain.next


# ----------------------------------------------------------------- solar

def test_solar_slots_agree_whatever_the_search_start() -> None:
    importorskip("ephem")  # a declared test dependency
    from celery.schedules import solar

    app = tz_app("Europe/Berlin")
    sunrise = solar("sunrise", 52.52, 13.40, app=app)
    slots = all_slots(sunrise, utc(2024, 6, 1), utc(2024, 6, 5), timedelta(minutes=37))
    assert len(slots) == 5  # the one before June 1 plus four sunrises
    for slot in slots:
        assert slot.at.microsecond == 0
        assert timedelta(hours=23, minutes=50) < slot.next - slot.at < timedelta(hours=24, minutes=10)
    # Berlin sunrise on 2024-06-01 is at about 04:49 CEST (02:49 UTC).
    assert utc(2024, 6, 1, 2, 45) < slots[1].at < utc(2024, 6, 1, 2, 55)
    # Instances that searched from different starts (or none) name the same slot.
    rng = random.Random(11)
    for _ in range(50):
        now = utc(2024, 6, 2) + timedelta(seconds=rng.uniform(0, 3 * 86400))
        plain = solar_slot(sunrise, now)
        assert solar_slot(sunrise, now, plain.at) == plain
        stale = solar_slot(sunrise, now - timedelta(hours=rng.uniform(1, 80)))
        assert solar_slot(sunrise, now, stale.at) == plain


def test_solar_slot_is_close_to_celery_own_due_time() -> None:
    importorskip("ephem")  # a declared test dependency
    from celery.schedules import solar

    app = tz_app("UTC")
    fixed = {"now": utc(2024, 6, 1, 12)}
    noon = solar("solar_noon", 48.85, 2.35, app=app, nowfun=lambda: fixed["now"])
    slot = solar_slot(noon, fixed["now"])
    # Celery, asked at the slot, finds the next noon where we do.
    fixed["now"] = slot.at
    assert abs((fixed["now"] + noon.remaining_estimate(slot.at + timedelta(seconds=1))
                - slot.next).total_seconds()) < 1


# ----------------------------------------------------------------- other schedules

class EveryTenMinutesPlusThree(BaseSchedule):
    """A custom schedule: 00:03, 00:13, ... (only remaining_estimate is needed)."""

    def remaining_estimate(self, last_run_at: datetime) -> timedelta:
        base = last_run_at.replace(second=0, microsecond=0)
        following = base + timedelta(minutes=(3 - base.minute) % 10 or 10)
        return following - self.now()

    def is_due(self, last_run_at: datetime) -> tuple[bool, float]:  # pragma: no cover
        remaining = self.remaining_estimate(last_run_at).total_seconds()
        return (remaining <= 0, max(remaining, 1.0))


class OneOff(BaseSchedule):
    """Like django-celery-beat's ``clocked``: a single instant."""

    def __init__(self, at: datetime, **kwargs: Any) -> None:
        self.at = at
        super().__init__(**kwargs)

    def remaining_estimate(self, last_run_at: datetime) -> timedelta:
        return self.at - self.now()


def test_generic_schedule_slots() -> None:
    app = tz_app("UTC")
    custom = EveryTenMinutesPlusThree(app=app)
    slot = current_slot(custom, utc(2024, 5, 1, 12, 20))
    assert slot == Slot(utc(2024, 5, 1, 12, 13), utc(2024, 5, 1, 12, 23))
    assert current_slot(custom, utc(2024, 5, 1, 12, 24), slot.at).at == utc(2024, 5, 1, 12, 23)

    once = OneOff(utc(2024, 5, 1, 12), app=app)
    assert current_slot(once, utc(2024, 5, 1, 11)) is None
    slot = current_slot(once, utc(2024, 5, 1, 13))
    assert slot == Slot(utc(2024, 5, 1, 12), None)
    assert slot.period == timedelta(days=1)  # claim lifetime of a non-repeating slot


def test_unsupported_schedule_is_an_error() -> None:
    with pytest.raises(SlotError):
        current_slot(object(), utc(2024, 1, 1))


# ----------------------------------------------------------------- keys and options

def test_slot_format_and_key() -> None:
    assert format_slot(utc(2024, 3, 31, 1)) == "2024-03-31T01:00:00Z"
    assert format_slot(utc(2024, 3, 31, 1, 0, 0, 250000)) == "2024-03-31T01:00:00.250000Z"
    berlin = tz_app("Europe/Berlin").timezone
    assert format_slot(datetime(2024, 3, 31, 3, 0, tzinfo=berlin)) == "2024-03-31T01:00:00Z"
    assert slot_key("app1", "nightly report", utc(2024, 3, 31, 1)) == \
        "app1:{beat:nightly report}:2024-03-31T01:00:00Z"


def entry(name: str = "e", args: Any = (), kwargs: Any = None, **options: Any) -> SimpleNamespace:
    return SimpleNamespace(name=name, args=args, kwargs=kwargs or {}, options=options)


def test_entry_spec_options() -> None:
    assert entry_spec(entry("a")).name == "a"
    assert entry_spec(entry("a", singleton=True)).name == "a"
    assert entry_spec(entry("a", singleton=False)) is None
    assert entry_spec(entry("a", singleton={"key": "shared"})).name == "shared"

    one = entry_spec(entry("a", args=[1], singleton={"key": "sync", "include_args": True}))
    two = entry_spec(entry("b", args=[2], singleton={"key": "sync", "include_args": True}))
    same = entry_spec(entry("c", args=(1,), singleton={"key": "sync", "include_args": True}))
    assert one.name.startswith("sync:") and one.name != two.name and one.name == same.name
    kw1 = entry_spec(entry("a", kwargs={"x": 1, "y": 2}, singleton={"include_args": True}))
    kw2 = entry_spec(entry("a", kwargs={"y": 2, "x": 1}, singleton={"include_args": True}))
    assert kw1 == kw2


@pytest.mark.parametrize("option", [
    "yes", {"keys": "x"}, {"key": ""}, {"include_args": "true"},
])
def test_entry_spec_rejects_bad_options(option: Any) -> None:
    with pytest.raises(ValueError):
        entry_spec(entry("a", singleton=option))


def test_entry_spec_include_args_needs_json_arguments() -> None:
    with pytest.raises(ValueError, match="JSON"):
        entry_spec(entry("a", args=[object()], singleton={"include_args": True}))

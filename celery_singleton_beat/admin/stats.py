"""Counters kept in Redis by the lock scripts and the beats, per task and per beat entry."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery import Celery

from ..beat import stats_key as beat_totals_key
from ..connection.client import RedisClient
from ..lease.counters import flush as flush_counters
from ..task.keys import beat_stats_key, task_stats_key
from ._common import connect, glob_escape, read, scan, text

__all__ = ["BEAT_COUNTERS", "TASK_COUNTERS", "Counters", "read_counters"]

#: Task counters always present (0 when never bumped); others (refused,
#: deferred, claimed, publish_deduplicated, force_released, ...) appear once bumped.
TASK_COUNTERS = ("acquired", "skipped", "released", "renewed", "lost", "reclaimed", "taken_over",
                 "redelivered")
#: Beat counters: slot claims won and lost (another beat held the slot), unsent
#: slots of a dead beat taken over and sent, second copies dropped by workers.
#: A claim won ahead of its turn in a burst and handed back unsent still counts as won.
BEAT_COUNTERS = ("won", "lost", "taken_over", "duplicates_dropped")


@dataclass(frozen=True)
class Counters:
    """Counters by task and by beat entry, with the beat totals over all entries.

    Counters expire 30 days after their last update. ``stats_enabled`` is the
    app's ``singleton_stats``: when False, tasks keep no counters.
    """

    tasks: Mapping[str, Mapping[str, int]]
    beat_entries: Mapping[str, Mapping[str, int]]
    #: Empty when no beat recorded any.
    beat_total: Mapping[str, int]
    stats_enabled: bool = True

    @property
    def empty(self) -> bool:
        """True when nothing was counted."""
        return not self.tasks and not self.beat_entries and not self.beat_total

    def as_json(self) -> dict[str, Any]:
        """``{"tasks": {task: {counter: n}}, "beat": {"entries": {...}, "total": {...}}}``."""
        return {
            "tasks": {name: dict(counts) for name, counts in self.tasks.items()},
            "beat": {
                "entries": {name: dict(counts) for name, counts in self.beat_entries.items()},
                "total": dict(self.beat_total),
            },
        }


def _counters(raw: Mapping[Any, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for field, value in raw.items():
        try:
            out[text(field)] = int(value)
        except (TypeError, ValueError):
            continue
    return out


def _hashes(client: RedisClient, match: str, name_from: int) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for batch in scan(client, match):
        for key, (raw,) in zip(batch, read(client, batch, "hgetall"), strict=True):
            if isinstance(raw, dict) and raw:
                out[key[name_from:]] = _counters(raw)
    return dict(sorted(out.items()))


def _filled(counts: Mapping[str, int], names: Sequence[str]) -> dict[str, int]:
    return {**{name: 0 for name in names}, **counts}


def read_counters(app: Celery) -> Counters:
    """The counters under the app's prefix; :data:`TASK_COUNTERS` and
    :data:`BEAT_COUNTERS` are always present (0 when never bumped).

    Workers count in their own process and write every second (see
    :mod:`~celery_singleton_beat.lease.counters`); this process's own counts are
    written first. Raises :class:`InvalidSettings`, :class:`RedisUnavailable`
    or :class:`AdminRedisError`.
    """
    flush_counters()
    target = connect(app)
    prefix = target.prefix
    task_base = task_stats_key(prefix, "")
    beat_base = beat_stats_key(prefix, "")
    with target.guard():
        tasks = _hashes(target.client, glob_escape(task_base) + "*", len(task_base))
        entries = _hashes(target.client, glob_escape(beat_base) + "*", len(beat_base))
        raw_total: Mapping[Any, Any] = target.client.hgetall(beat_totals_key(prefix))
    total = _counters(raw_total)
    return Counters(
        tasks={name: _filled(c, TASK_COUNTERS) for name, c in tasks.items()},
        beat_entries={name: _filled(c, BEAT_COUNTERS) for name, c in entries.items()},
        beat_total=_filled(total, BEAT_COUNTERS) if total else {},
        stats_enabled=target.settings.stats,
    )

"""Counters kept in Redis by the lock scripts and the beats, per task and per beat entry."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from celery import Celery

from ..beat import stats_key as beat_totals_key
from ..lease.counters import flush as flush_counters
from ..task.keys import beat_stats_key, task_stats_key
from ._common import KeySpace, Progress, Target, connect, text, walk

__all__ = ["BEAT_COUNTERS", "TASK_COUNTERS", "CounterHash", "Counters", "iter_counters", "read_counters"]

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


@dataclass(frozen=True)
class CounterHash:
    """The counters of one task or beat entry, as read from its hash (only those bumped)."""

    #: ``task`` or ``beat`` (a beat entry).
    kind: Literal["task", "beat"]
    #: The task's registered name, or the beat entry's name.
    name: str
    counts: Mapping[str, int]


def _walk_counters(target: Target, progress: Progress | None) -> Iterator[CounterHash]:
    bases: tuple[tuple[Literal["task", "beat"], str], ...] = (
        ("task", task_stats_key(target.prefix, "")), ("beat", beat_stats_key(target.prefix, "")))

    def pick(key: str) -> tuple[Literal["task", "beat"], str] | None:
        return next(((kind, key[len(base):]) for kind, base in bases if key.startswith(base)), None)

    with target.guard():
        for found in walk(target.client, KeySpace(target.prefix).stats_pattern, pick, ("hgetall",), progress):
            for _, (kind, name), (raw,) in found:
                if isinstance(raw, dict) and raw:
                    yield CounterHash(kind, name, _counters(raw))


def iter_counters(app: Celery, *, progress: Progress | None = None) -> Iterator[CounterHash]:
    """The counter hash of each task and beat entry, yielded as soon as it is read, in the order found.

    One SCAN walk (``MATCH <prefix>:{stats}:*``, never KEYS); each SCAN call's hashes are read
    (``HGETALL``) in the same round trip as the next call. Counts are those bumped (see
    :func:`read_counters` for the totals and the counters always present). ``progress`` as for
    :func:`iter_locks`. The call raises :class:`InvalidSettings`; the iteration
    :class:`RedisUnavailable` or :class:`AdminRedisError`.
    """
    return _walk_counters(connect(app), progress)


def _filled(counts: Mapping[str, int], names: Sequence[str]) -> dict[str, int]:
    return {**{name: 0 for name in names}, **counts}


def read_counters(app: Celery, *, progress: Progress | None = None) -> Counters:
    """The counters under the app's prefix; :data:`TASK_COUNTERS` and
    :data:`BEAT_COUNTERS` are always present (0 when never bumped).

    Workers count in their own process and write every second (see
    :mod:`~celery_singleton_beat.lease.counters`); this process's own counts are
    written first. The hashes are found in one SCAN walk (:func:`iter_counters`, which
    ``progress`` is passed to). Raises :class:`InvalidSettings`, :class:`RedisUnavailable`
    or :class:`AdminRedisError`.
    """
    flush_counters()
    target = connect(app)
    tasks: dict[str, dict[str, int]] = {}
    entries: dict[str, dict[str, int]] = {}
    for found in _walk_counters(target, progress):
        (tasks if found.kind == "task" else entries)[found.name] = dict(found.counts)
    with target.guard():
        raw_total: Mapping[Any, Any] = target.client.hgetall(beat_totals_key(target.prefix))
    total = _counters(raw_total)
    return Counters(
        tasks={name: _filled(c, TASK_COUNTERS) for name, c in sorted(tasks.items())},
        beat_entries={name: _filled(c, BEAT_COUNTERS) for name, c in sorted(entries.items())},
        beat_total=_filled(total, BEAT_COUNTERS) if total else {},
        stats_enabled=target.settings.stats,
    )

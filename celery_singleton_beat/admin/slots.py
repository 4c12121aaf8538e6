"""Recent beat slot claims: which beat instance won the right to send each slot."""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from celery import Celery

from ..beat import history_key as beat_history_key
from ._common import BATCH, KeySpace, Progress, Target, connect, read, scan

__all__ = ["SlotClaim", "SlotHistory", "SlotSource", "recent_slots"]

#: Where claims were read: the beat's capped ``history`` list, or the live
#: ``claims`` keys when there is no history (no beat recorded any yet).
SlotSource = Literal["history", "claims"]


@dataclass(frozen=True)
class SlotClaim:
    """One beat slot claim."""

    #: The entry name (from live claim keys: the key's entry part, which is
    #: the entry's ``singleton`` key option when it has one, and ends with
    #: ``:<digest>`` for entries with ``include_args``).
    entry: str
    #: The slot (UTC, ISO 8601).
    slot: str
    #: The beat instance that won it.
    winner: str | None
    #: When it was claimed (epoch seconds).
    claimed_at: float | None
    key: str | None
    #: The task sent (history only).
    task: str | None

    def as_json(self) -> dict[str, Any]:
        """The ``slots --json`` object of this claim."""
        return {"entry": self.entry, "slot": self.slot, "winner": self.winner,
                "claimed_at": self.claimed_at, "key": self.key, "task": self.task}


@dataclass(frozen=True)
class SlotHistory:
    """Claims newest first, and where they were read (see :data:`SlotSource`)."""

    claims: tuple[SlotClaim, ...]
    source: SlotSource


def _claim_from_history(record: Any) -> SlotClaim | None:
    if not isinstance(record, dict) or "entry" not in record or "slot" not in record:
        return None
    return SlotClaim(str(record["entry"]), str(record["slot"]), record.get("winner"),
                     record.get("at"), record.get("key"), record.get("task"))


def _slot_instant(slot: str) -> float:
    try:
        return datetime.fromisoformat(slot.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return float("-inf")


def _from_history(target: Target, history: str, entry: str | None, last: int) -> list[SlotClaim]:
    found: list[SlotClaim] = []
    start = 0
    while len(found) < last:
        page: list[Any] = target.client.lrange(history, start, start + BATCH - 1)
        if not page:
            break
        start += len(page)
        for raw in page:
            try:
                claim = _claim_from_history(json.loads(raw))
            except ValueError:
                continue
            if claim is not None and (entry is None or claim.entry == entry):
                found.append(claim)
    return found[:last]


def _from_claim_keys(target: Target, entry: str | None, last: int, progress: Progress | None) -> list[SlotClaim]:
    """The ``last`` newest claim keys: only the keys of the newest slots are kept while walking
    (a slot's instant is in its key) and only theirs are read."""
    space = KeySpace(target.prefix)
    newest: list[tuple[float, str, str, str]] = []  # (instant, key, entry, slot); the newest `last`, and ties
    limit = 2 * last + BATCH
    for batch in scan(target.client, space.slot_pattern(entry), progress):
        for key in batch:
            parsed = space.slot(key)
            # entries with include_args claim under "<name>:<digest>"
            if parsed and (entry is None or parsed[0] == entry or parsed[0].startswith(entry + ":")):
                newest.append((_slot_instant(parsed[1]), key, *parsed))
        if len(newest) > limit:
            newest = _newest(newest, last)
            limit = max(limit, 2 * len(newest))  # many claims of one slot: prune less often
    newest = _newest(newest, last)
    claims: list[SlotClaim] = []
    for start in range(0, len(newest), BATCH):
        chunk = newest[start:start + BATCH]
        for (_, key, name, slot), (value,) in zip(chunk, read(target.client, [c[1] for c in chunk], "get"),
                                                  strict=True):
            if not isinstance(value, (bytes, str)):
                continue  # expired since the SCAN
            try:
                data = json.loads(value)
            except ValueError:
                data = {}
            data = data if isinstance(data, dict) else {}
            claims.append(SlotClaim(name, slot, data.get("instance"), data.get("at"), key, None))
    claims.sort(key=lambda c: (_slot_instant(c.slot), c.claimed_at or 0.0), reverse=True)
    return claims[:last]


def _newest(found: list[tuple[float, str, str, str]], last: int) -> list[tuple[float, str, str, str]]:
    """The entries of the ``last`` newest instants in ``found``, with any others of the oldest of those."""
    if len(found) <= last:
        return found
    floor = heapq.nlargest(last, (instant for instant, *_ in found))[-1]
    return [one for one in found if one[0] >= floor]


def recent_slots(app: Celery, *, entry: str | None = None, last: int = 20,
                 progress: Progress | None = None) -> SlotHistory:
    """The ``last`` most recent slot claims (of ``entry`` only, if given), newest first.

    Read from the beat's capped history list, which names entries and tasks;
    without one (no beat recorded any yet, or an older scheduler), from the
    live claim keys with SCAN (``MATCH <prefix>:{beat:<entry>*``, never KEYS; ``progress``
    as for :func:`iter_locks`): they name the claim key's entry part and disappear when they
    expire. Only the ``last`` newest claim keys are kept and read (a slot's instant is in its
    key). Raises :class:`InvalidSettings`, :class:`RedisUnavailable` or
    :class:`AdminRedisError`.
    """
    if last < 1:
        raise ValueError("last must be at least 1")
    target = connect(app)
    history = beat_history_key(target.prefix)
    with target.guard():
        if target.client.exists(history):
            return SlotHistory(tuple(_from_history(target, history, entry, last)), "history")
        return SlotHistory(tuple(_from_claim_keys(target, entry, last, progress)), "claims")

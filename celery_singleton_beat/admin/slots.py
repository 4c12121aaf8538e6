"""Recent beat slot claims: which beat instance won the right to send each slot."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from celery import Celery

from ..beat import history_key as beat_history_key
from ._common import BATCH, KeySpace, Target, connect, glob_escape, read, scan

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


def _slot_instant(claim: SlotClaim) -> float:
    try:
        return datetime.fromisoformat(claim.slot.replace("Z", "+00:00")).timestamp()
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


def _from_claim_keys(target: Target, entry: str | None, last: int) -> list[SlotClaim]:
    space = KeySpace(target.prefix)
    name_glob = glob_escape(entry) if entry is not None else ""
    claims: list[SlotClaim] = []
    for batch in scan(target.client, f"{glob_escape(target.prefix)}:{{beat:{name_glob}*"):
        keys: list[tuple[str, str, str]] = []
        for key in batch:
            parsed = space.slot(key)
            # entries with include_args claim under "<name>:<digest>"
            if parsed and (entry is None or parsed[0] == entry or parsed[0].startswith(entry + ":")):
                keys.append((key, *parsed))
        for (key, name, slot), (value,) in zip(keys, read(target.client, [k for k, _, _ in keys], "get"), strict=True):
            if not isinstance(value, (bytes, str)):
                continue
            try:
                data = json.loads(value)
            except ValueError:
                data = {}
            data = data if isinstance(data, dict) else {}
            claims.append(SlotClaim(name, slot, data.get("instance"), data.get("at"), key, None))
    claims.sort(key=lambda c: (_slot_instant(c), c.claimed_at or 0.0), reverse=True)
    return claims[:last]


def recent_slots(app: Celery, *, entry: str | None = None, last: int = 20) -> SlotHistory:
    """The ``last`` most recent slot claims (of ``entry`` only, if given), newest first.

    Read from the beat's capped history list, which names entries and tasks;
    without one (no beat recorded any yet, or an older scheduler), from the
    live claim keys with SCAN: they name the claim key's entry part and
    disappear when they expire. Raises :class:`InvalidSettings`,
    :class:`RedisUnavailable` or :class:`AdminRedisError`.
    """
    if last < 1:
        raise ValueError("last must be at least 1")
    target = connect(app)
    history = beat_history_key(target.prefix)
    with target.guard():
        if target.client.exists(history):
            return SlotHistory(tuple(_from_history(target, history, entry, last)), "history")
        return SlotHistory(tuple(_from_claim_keys(target, entry, last)), "claims")

"""Active-active ``celery beat``: every instance ticks, one sends each slot.

* :mod:`.slots`: pure slot math (which instant an entry fires for);
* :mod:`.entries`: what an entry claims under, message headers, slot task ids;
* :mod:`.scripted`: script calls in one round trip per server (the claims' compare-and-set);
* :mod:`.claims`: claims in Redis (claim, pending -> sent, swaps, write-backs, receive,
  history, counters), written on each server layout by :mod:`.claim_writes`;
* :mod:`.history`: the record of a claim round;
* :mod:`.handover`: this beat's claims to mark and slots to take over;
* :mod:`.records`: since when each entry is scheduled (what makes a slot missed);
* :mod:`.recovery`: the claims confirmed by their beats after a restart or failover;
* :mod:`.breaker`: back-off while Redis is unreachable;
* :mod:`.scheduler`: :class:`SingletonSchedulerMixin` wiring them into Celery's
  ``Scheduler`` hooks, with its parts: :mod:`.anchoring` (the start-up rule: which slot
  an entry continues after), :mod:`.sending` (a slot's publish), :mod:`.claiming` (claim
  rounds and sent marks), :mod:`.claim_handback` (hand-backs and take-overs),
  :mod:`.probing` (the claims Redis looked at between ticks), :mod:`.holding` (entries
  held back) and :mod:`.stopping` (close and the stop signals);
* :mod:`.persistent`: :class:`SingletonScheduler`, Celery's shelve-backed scheduler with it;
* :mod:`.following`: for schedulers whose entries change while they run;
* :mod:`.embedded`: beat inside a worker (``-B``): ``-S`` refused, a foreign beat warned.

See ``docs/beat.md`` for the rules and guarantees.
"""

from __future__ import annotations

from ..task.slot_delivery import CLAIM_HEADER, ENTRY_HEADER, INSTANCE_HEADER, SLOT_HEADER
from . import embedded  # noqa: F401 (connects the worker's start-up checks)
from .claims import read_history
from .entries import ENTRY_OPTION, SlotSpec, entry_spec, history_key, slot_key, slot_task_id, stats_key
from .persistent import SingletonScheduler
from .records import entry_record_key
from .scheduler import SingletonSchedulerMixin
from .slots import (
    EARLY_TOLERANCE,
    Slot,
    SlotError,
    crontab_slot,
    current_slot,
    format_slot,
    interval_slot,
    slot_before,
    solar_slot,
)

__all__ = [
    "CLAIM_HEADER",
    "EARLY_TOLERANCE",
    "ENTRY_HEADER",
    "ENTRY_OPTION",
    "INSTANCE_HEADER",
    "SLOT_HEADER",
    "SingletonScheduler",
    "SingletonSchedulerMixin",
    "Slot",
    "SlotError",
    "SlotSpec",
    "crontab_slot",
    "current_slot",
    "entry_record_key",
    "entry_spec",
    "format_slot",
    "history_key",
    "interval_slot",
    "read_history",
    "slot_before",
    "slot_key",
    "slot_task_id",
    "solar_slot",
    "stats_key",
]

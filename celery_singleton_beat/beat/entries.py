"""What a beat entry claims under, and how its messages name their slot.

An entry's claim key is ``<prefix>:{beat:<name>}:<slot>``: ``<name>`` is the
entry name, or what its ``singleton`` option says (see :func:`entry_spec`).
Each message sent for a slot carries headers naming the slot, the sending
beat instance and the claim key, and a task id derived from the claim key
(:func:`slot_task_id`): every beat that sends a slot sends the same task id,
and a worker can tell a second delivery of a slot from the first.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .slots import Slot, format_slot

__all__ = [
    "ENTRY_OPTION",
    "SlotSpec",
    "entry_spec",
    "history_key",
    "slot_key",
    "slot_task_id",
    "stats_key",
]

#: The entry option (``options={"singleton": ...}``) read by the scheduler.
ENTRY_OPTION = "singleton"

#: Namespace of slot task ids (uuid5 of the claim key).
_SLOT_NAMESPACE = uuid.UUID("6f1c7f0e-2b7a-5d4e-9a43-5f0c1b8e7d21")


def slot_task_id(claim_key: str) -> str:
    """The task id of every message sent for the slot ``claim_key`` names.

    A pure function of the key (so of prefix, entry and slot instant): two
    beats sending one slot send one task id, and its result is one result.
    """
    return str(uuid.uuid5(_SLOT_NAMESPACE, claim_key))


@dataclass(frozen=True)
class SlotSpec:
    """How one entry is claimed: the name part of its slot keys."""

    name: str

    def key(self, prefix: str, slot: Slot) -> str:
        return slot_key(prefix, self.name, slot.at)


def slot_key(prefix: str, name: str, at: datetime) -> str:
    """``<prefix>:{beat:<name>}:<slot>``; the hash tag keeps an entry's slots in one Cluster slot."""
    return f"{prefix}:{{beat:{name}}}:{format_slot(at)}"


def history_key(prefix: str) -> str:
    """Capped list of recent claims won, newest first (JSON records)."""
    return f"{prefix}:{{beat}}:history"


def stats_key(prefix: str) -> str:
    """Hash of counters over all entries and instances: ``won`` and ``lost`` slot claims.

    Per-entry counters are in :func:`celery_singleton_beat.task.keys.beat_stats_key`.
    """
    return f"{prefix}:{{beat}}:stats"


def entry_spec(entry: Any) -> SlotSpec | None:
    """Read an entry's ``singleton`` option; None when the entry opted out.

    Accepted values: absent or ``True`` (claim by entry name), ``False`` (send
    from every beat, as plain Celery does), or a dict with ``key`` (the name
    to claim under instead of the entry name) and/or ``include_args`` (add a
    digest of the entry's args and kwargs to the key). Raises ``ValueError``.
    """
    option = (entry.options or {}).get(ENTRY_OPTION, True)
    if option is True:
        return SlotSpec(entry.name)
    if option is False:
        return None
    if not isinstance(option, dict):
        raise ValueError(f"options['{ENTRY_OPTION}'] must be True, False or a dict, got {option!r}")
    unknown = set(option) - {"key", "include_args"}
    if unknown:
        raise ValueError(f"unknown options['{ENTRY_OPTION}'] field(s) {sorted(unknown)}; "
                         "known: 'key', 'include_args'")
    name = option.get("key", entry.name)
    if not isinstance(name, str) or not name:
        raise ValueError(f"options['{ENTRY_OPTION}']['key'] must be a non-empty string, got {name!r}")
    include_args = option.get("include_args", False)
    if not isinstance(include_args, bool):
        raise ValueError(f"options['{ENTRY_OPTION}']['include_args'] must be True or False, "
                         f"got {include_args!r}")
    if include_args:
        try:
            encoded = json.dumps([list(entry.args or ()), dict(entry.kwargs or {})],
                                 sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"include_args needs JSON-encodable args and kwargs: {exc}") from exc
        name = f"{name}:{hashlib.sha256(encoded.encode()).hexdigest()[:16]}"
    return SlotSpec(name)

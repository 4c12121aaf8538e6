"""Slot claims in Redis: claim, pending -> sent, hand back, take over, receive.

A claim is the key ``<prefix>:{beat:<name>}:<slot>`` holding a small JSON
value ``{"instance": <beat>, "at": <epoch s>, "state": <state>}``:

``pending``
    written by ``SET NX PX`` when a beat wins the slot; only that beat may
    send it for now.
``sent``
    the winner published the message (marked in batches, within a fraction
    of ``singleton_beat_pending_lease``).
``released``
    the winner gave the slot back unsent (clean stop mid-burst, publish
    failed): any other beat may take it over at once, and a beat whose
    publish failed looks at it again after a back-off to send it itself. A
    worker runs a copy of a ``released`` slot from any instance (one that
    published before the take-over and died) and pins the claim to it.
``received``
    a worker accepted a message of this slot from the claim's instance
    (:data:`.task.slot_delivery.RECEIVE_SCRIPT`); messages of the slot from any other instance are
    dropped from then on.

A beat that lost a slot to a ``pending`` (or ``released``) claim looks again
when the pending lease would have ended; if the value is still exactly the one
it saw, it takes the slot over with a compare-and-set (:data:`.scripted.SWAP_SCRIPT`) and
sends it. A dead beat's unsent slots are therefore sent within about one lease,
and a slot its winner did publish before dying is executed once anyway: both
messages carry one task id, and the worker accepts only the claim's instance.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import redis

from ..connection.lending import borrow
from ..lease.scripts import STATS_TTL_MS
from ..log import logger
from ..recovery.server import server_of
from ..task.keys import beat_stats_key
from ..task.slot_delivery import parse_claim
from .claim_writes import ClaimWrites
from .entries import history_key, stats_key
from .history import history_record, record_calls
from .recovery import KeptClaims
from .scripted import evalsha_pipelined, swap_many
from .slots import Slot

__all__ = [
    "PENDING",
    "RECEIVED",
    "RELEASED",
    "SENT",
    "Claim",
    "ClaimStore",
    "claim_value",
    "read_history",
]

PENDING, SENT, RELEASED, RECEIVED = "pending", "sent", "released", "received"
#: States in which the claim's beat has not (provably) sent the slot.
UNSENT = (PENDING, RELEASED)


def claim_value(instance: str, at: float, state: str) -> str:
    """The JSON value of a claim (compact, fixed key order: compared byte for byte)."""
    return json.dumps({"instance": instance, "at": at, "state": state}, separators=(",", ":"))


@dataclass
class Claim:
    """What happened to one slot of one entry in this beat."""

    name: str  # the entry name
    slot: Slot
    key: str
    won: bool | None  # None: Redis could not be asked
    value: str | None = None  # our value, when won
    holder: str | None = None  # the instance holding it
    holder_value: bytes | None = None  # the holder's exact value, when lost
    error: str | None = None
    #: Not claimed yet: the lock Redis's recovery window is open for that many more
    #: seconds (the slot is claimed once it is over).
    deferred: float = 0.0

    @property
    def holder_state(self) -> str | None:
        parsed = parse_claim(self.holder_value)
        return None if parsed is None else parsed.get("state")


class ClaimStore(ClaimWrites):
    """The Redis side of one beat's claims: one round trip per batch of slots.

    This decides what a round claims and what the replies mean; its base,
    :class:`~.claim_writes.ClaimWrites`, writes the round on each server layout.
    """

    def __init__(self, client_of: Any, prefix: str, instance_id: str, *, margin: timedelta,
                 wait_replicas: int = 0, wait_timeout: float = 1.0, stats: bool = True,
                 history_size: int = 1000) -> None:
        self._client_of = client_of  # called each time: the app's client may be replaced
        self.prefix = prefix
        self.instance_id = instance_id
        self.margin = margin
        self.wait_replicas = wait_replicas
        self.wait_timeout = wait_timeout
        self.stats = stats
        self.history_size = history_size
        #: False once the server refused ``SET NX GET`` (Redis < 7).
        self.use_set_get = True
        #: True once a ``SET NX GET`` worked: until then the record does not ride along (a
        #: refused claim round would have it count every claim of the round as lost).
        self.set_get_works = False
        #: The claims this beat holds, to write back into a server that lost them.
        self.kept = KeptClaims()
        self._epoch = 0
        #: Monotonic time of the last :meth:`reach`.
        self.reached = 0.0

    # ----------------------------------------------------------------- claiming

    def claim(self, batch: Sequence[Claim], at: float, marks: Sequence[tuple[str, str, str, int]] = (),
              tasks: Sequence[str] | None = None) -> tuple[list[tuple[bool, bytes | None]], bool]:
        """``SET NX PX`` every claim of ``batch`` as ``pending``; fill in who won.

        ``marks`` (swaps of earlier claims to ``sent``) ride in the same round
        trip when no replica wait is asked for; their outcomes are returned, with
        whether the round was recorded too: given ``tasks`` (the task name of each
        claim's entry), the record (:mod:`.history`) rides along where one server
        holds every key, once the server's answer to this beat's claims is known
        (not in its first round). Else the caller records it (:meth:`record`).
        """
        value = claim_value(self.instance_id, at, PENDING)
        server = server_of(self.client)
        epoch = server.epoch
        record = (None if tasks is None or (self.use_set_get and not self.set_get_works) else
                  record_calls(self.prefix, self.instance_id, value, at, batch, tasks, self.history_size, self.stats))
        try:
            replies, marked, recorded = self._set(batch, value, marks, record)
            self.set_get_works = self.use_set_get
        except redis.ResponseError as exc:
            if not (self.use_set_get and "syntax" in str(exc).lower()):
                raise
            self.use_set_get = False  # Redis < 7 cannot combine NX and GET
            replies, marked, recorded = self._set(batch, value, marks, None)
        for claim, reply in zip(batch, replies, strict=True):
            won, holder = reply
            claim.won = won
            claim.value = value if won else None
            claim.holder_value = None if won else holder
            if won:
                claim.holder = self.instance_id
                self.kept.wrote(claim.key, value, None, self.ttl_ms(claim.slot), epoch)
            else:
                parsed = parse_claim(holder)
                claim.holder = None if parsed is None else parsed.get("instance")
        self._keep(marks, marked, epoch)
        self._write_back(server)
        return marked, recorded

    # ----------------------------------------------------------------- afterwards

    def swap(self, swaps: Sequence[tuple[str, bytes | str, str, int]]) -> list[tuple[bool, bytes | None]]:
        """Compare-and-set claims (mark sent, hand back, take over) in one round trip."""
        server = server_of(self.client)
        epoch = server.epoch
        outcomes = swap_many(self.client, swaps)
        self._keep(swaps, outcomes, epoch)
        self._write_back(server)
        return outcomes

    def _keep(self, swaps: Sequence[tuple[str, bytes | str, str, int]],
              outcomes: Sequence[tuple[bool, bytes | None]], epoch: int) -> None:
        """Note what this beat's compare-and-sets wrote; forget the claims another beat holds now."""
        for (key, old, new, ttl_ms), (swapped, current) in zip(swaps, outcomes, strict=True):
            if swapped:
                self.kept.wrote(key, new, old, ttl_ms, epoch)
            elif current is not None:
                self.kept.forget(key)

    def reach(self) -> float:
        """Make sure this process talks to the server now serving the claims, and write back
        what it lost; the seconds of recovery window still open (0.0: claim away).

        Takes a connection from the pool and gives it back: a Sentinel pool follows the
        primary (:mod:`..sentinel`), a connection the server closed is made again, and a
        new connection is looked at (:mod:`..window`) -- no command when nothing changed.
        """
        client = self.client
        pool = getattr(client, "connection_pool", None)
        if pool is not None:  # not on Cluster (each node's connections are looked at as they connect)
            follow = getattr(pool, "follow", None)
            if follow is not None:
                follow()  # Sentinel: ask for the primary now, not within half a second
            pool.release(borrow(pool))
        self.reached = time.monotonic()
        server = server_of(client)
        self._write_back(server)
        return self.window_left()

    def window_left(self) -> float:
        """Seconds of the lock Redis's recovery window still open, as this process knows it."""
        return server_of(self.client).recovery().left()

    def _write_back(self, server: Any) -> None:
        """Once this process finds the data on a server that may lack it (a restart without
        an append-only file, a promoted replica), write back the claims this beat still
        keeps from before (see :mod:`.recovery`)."""
        if server.epoch == self._epoch:
            return
        self._epoch = server.epoch
        try:
            self.kept.put_back(lambda script, calls: evalsha_pipelined(self.client, script, calls),
                               server.epoch, server.recovery_reason or "restarted or failed over")
        except redis.RedisError as exc:
            self._epoch = -1  # try again with the next round trip
            logger.warning("beat: could not write back recent slot claims: %s", exc)

    def record(self, won: Sequence[tuple[Claim, Any]], lost: Sequence[tuple[Claim, Any]],
               taken_over: Sequence[tuple[Claim, Any]], at: float) -> None:
        """Append claims won (or taken over) to the capped history; bump the counters.

        Counters (best effort): ``won`` / ``lost`` / ``taken_over`` per entry
        and in total, kept for the library's stats TTL after their last update.
        """
        sent = [*won, *taken_over][-self.history_size:]
        records = [history_record(entry.name, claim.key, entry.task, claim.slot.label, self.instance_id, at)
                   for claim, entry in sent]
        commands: list[tuple[Any, ...]] = []
        if records:
            commands.append((b"LPUSH", history_key(self.prefix), *records))
            commands.append((b"LTRIM", history_key(self.prefix), 0, self.history_size - 1))
        counted: list[str] = []  # per entry hash, in the order of their HINCRBY replies
        if self.stats:
            totals = stats_key(self.prefix)
            for field, items in (("won", won), ("lost", lost), ("taken_over", taken_over)):
                for _, entry in items:
                    counted.append(beat_stats_key(self.prefix, entry.name))
                    commands.append((b"HINCRBY", counted[-1], field, 1))
                if items:
                    commands.append((b"HINCRBY", totals, field, len(items)))
            commands.append((b"PEXPIRE", totals, STATS_TTL_MS))
        replies = self._run(commands)
        # An entry's hash gets its TTL when a field is created and every 64th update
        # (as the lock scripts do): one command per claim, not two.
        counts = replies[2:] if records else replies
        stale = {key for key, count in zip(counted, _per_entry(counts, won, lost, taken_over), strict=True)
                 if count % 64 == 1}
        if stale:
            self._run([(b"PEXPIRE", key, STATS_TTL_MS) for key in stale])


def _per_entry(replies: Sequence[Any], *groups: Sequence[Any]) -> list[int]:
    """The per-entry HINCRBY replies of :meth:`ClaimStore.record`, without the totals'."""
    counts: list[int] = []
    position = 0
    for items in groups:
        counts.extend(int(reply) for reply in replies[position:position + len(items)])
        position += len(items) + (1 if items else 0)  # the group's total follows its items
    return counts


def read_history(client: redis.Redis, prefix: str, limit: int = 100) -> list[dict[str, Any]]:
    """The latest ``limit`` claims won (newest first), as written by the scheduler."""
    records = []
    for raw in client.lrange(history_key(prefix), 0, max(limit, 1) - 1):
        try:
            records.append(json.loads(raw))
        except ValueError:
            continue
    return records

"""How a round of slot claims goes on the wire: ``SET NX PX`` per claim, and what rides along.

:class:`ClaimWrites` is the base of :class:`~.claims.ClaimStore`, which decides what a
round claims and what its replies mean (who won, what this beat keeps); this writes it,
for each server layout:

* one server: the claims, then the round's record (:data:`.history.RECORD_SCRIPT`) and
  the ``sent`` marks of earlier sends (:data:`.scripted.SWAP_SCRIPT`), in one pipeline;
* Redis Cluster: the library's own requests, one per node
  (:func:`.connection.pooled.run_by_node`);
* ``singleton_wait_replicas``: the claims followed by ``WAIT`` on each server's
  connection, taken back when too few replicas acknowledged them;
* Redis < 7, which refuses ``SET NX GET``: a ``GET`` after each ``SET NX``.

The record written apart (:meth:`.claims.ClaimStore.record`) goes the same way, one
pipeline or one request per node (:meth:`ClaimWrites._run`).

Apart from the store because these are commands and server layouts, not what a claim means.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import redis
from redis.exceptions import NoScriptError

from ..connection.client import ReplicasNotAcknowledged, cluster_moved, group_by_node, is_cluster
from ..connection.pooled import run_by_node
from ..lease.behalf import release_value
from ..log import logger
from .history import RECORD_SCRIPT
from .scripted import SWAP_SCRIPT, swap_calls, swap_many, swap_outcome
from .slots import Slot

__all__ = ["ClaimWrites", "Keyed"]


class Keyed(Protocol):
    """What a write needs of a :class:`~.claims.Claim` (not imported: claims.py builds on this module)."""

    @property
    def key(self) -> str: ...

    @property
    def slot(self) -> Slot: ...


class ClaimWrites:
    """The commands of a round of claims (see the module docstring); the base of ``ClaimStore``."""

    # Set by ClaimStore.__init__.
    _client_of: Any
    margin: timedelta
    wait_replicas: int
    wait_timeout: float
    use_set_get: bool

    @property
    def client(self) -> Any:
        return self._client_of()

    def ttl_ms(self, slot: Slot) -> int:
        """Lifetime of a claim key: the entry's period plus the margin."""
        return max(1, (slot.period + self.margin) // timedelta(milliseconds=1))

    def _set(self, batch: Sequence[Keyed], value: str, marks: Sequence[tuple[str, str, str, int]],
             record: Sequence[tuple[list[str], list[Any]]] | None = None
             ) -> tuple[list[tuple[bool, bytes | None]], list[tuple[bool, bytes | None]], bool]:
        """The claims (then the record's calls, then the marks' swaps) in one round trip;
        their outcomes, the marks' and whether the record was written."""
        client = self.client
        if self.wait_replicas > 0 or is_cluster(client):  # scripts cannot ride along there
            marked = swap_many(client, marks)
            if self.wait_replicas > 0:
                return self._set_acknowledged(batch, value), marked, False
            # The library's own requests, one per node: redis-py's cluster pipeline cannot follow
            # an -ASK to a node being added (see .connection.pooled.run_by_node).
            return self._outcomes(_raising(run_by_node(client, self._set_commands(batch, value)))), marked, False
        pipe = client.pipeline(transaction=False)
        self._add_sets(pipe, batch, value)
        record = record or []
        calls = swap_calls(marks)
        for script, script_calls in ((RECORD_SCRIPT, record), (SWAP_SCRIPT, calls)):
            for keys, args in script_calls:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
        replies = pipe.execute(raise_on_error=False)
        sets_end = len(replies) - len(calls) - len(record)
        tail_start = sets_end + len(record)
        sets, recorded, tail = replies[:sets_end], replies[sets_end:tail_start], replies[tail_start:]
        for reply in sets:
            if isinstance(reply, Exception):
                raise reply
        if any(isinstance(reply, Exception) for reply in tail):
            marked = swap_many(client, marks)  # loads the script on NOSCRIPT, raises the rest
        else:
            marked = [swap_outcome(item) for reply in tail for item in reply]
        return self._outcomes(sets), marked, bool(record) and self._recorded(client, recorded)

    def _recorded(self, client: Any, replies: Sequence[Any]) -> bool:
        """Whether every :data:`.history.RECORD_SCRIPT` call of a round worked. Not loaded on
        this server yet (NOSCRIPT): loaded now for the next round, and this round's record
        is left to the caller; another error: a warning (the record is best effort)."""
        errors = [reply for reply in replies if isinstance(reply, Exception)]
        if not errors:
            return True
        if len(errors) == len(replies) and any(isinstance(error, NoScriptError) for error in errors):
            # No call ran: the caller records the round.
            try:
                client.script_load(RECORD_SCRIPT.source)
            except redis.RedisError as exc:
                logger.debug("beat: could not load the record script: %s", exc)
            return False
        logger.warning("beat: could not record a round of claims in the history: %s", errors[0])
        return True

    def _set_commands(self, batch: Iterable[Keyed], value: str) -> list[tuple[Any, ...]]:
        """The commands of :meth:`_add_sets`, for :func:`.connection.pooled.run_by_node`."""
        commands: list[tuple[Any, ...]] = []
        for claim in batch:
            commands.append((b"SET", claim.key, value, b"NX", b"PX", self.ttl_ms(claim.slot),
                             *((b"GET",) if self.use_set_get else ())))
            if not self.use_set_get:
                commands.append((b"GET", claim.key))
        return commands

    def _add_sets(self, pipe: Any, batch: Iterable[Keyed], value: str) -> None:
        for claim in batch:
            pipe.set(claim.key, value, nx=True, px=self.ttl_ms(claim.slot), get=self.use_set_get)
            if not self.use_set_get:
                pipe.get(claim.key)

    def _outcomes(self, replies: Sequence[Any]) -> list[tuple[bool, bytes | None]]:
        """``(won, holder value)`` per claim from the raw SET (and GET) replies."""
        if self.use_set_get:
            return [(reply is None, reply) for reply in replies]
        pairs = zip(replies[0::2], replies[1::2], strict=True)
        return [(bool(won), None if won else holder) for won, holder in pairs]

    def _set_acknowledged(self, batch: Sequence[Keyed], value: str) -> list[tuple[bool, bytes | None]]:
        """Claims followed by ``WAIT`` on each server's connection.

        Fewer replicas in time: the claims this call won are deleted again and
        :class:`ReplicasNotAcknowledged` is raised, a ``RedisError``, so the
        slots are handled as with Redis down (fail closed unless
        ``singleton_beat_fail_open``).
        """
        client = self.client
        keys = [claim.key for claim in batch]
        outcomes: list[tuple[bool, bytes | None]] = [(False, None)] * len(batch)
        won: list[str] = []
        try:
            for group in group_by_node(client, keys):
                server = (client.get_redis_connection(client.get_node_from_key(keys[group[0]]))
                          if is_cluster(client) else client)
                pipe = server.pipeline(transaction=False)
                self._add_sets(pipe, (batch[i] for i in group), value)
                pipe.execute_command("WAIT", self.wait_replicas, max(1, round(self.wait_timeout * 1000)))
                *sets, acknowledged = pipe.execute()
                for index, outcome in zip(group, self._outcomes(sets), strict=True):
                    outcomes[index] = outcome
                    if outcome[0]:
                        won.append(keys[index])
                if int(acknowledged) < self.wait_replicas:
                    raise ReplicasNotAcknowledged(keys[group[0]], int(acknowledged),
                                                  self.wait_replicas, self.wait_timeout)
        except redis.RedisError as exc:
            cluster_moved(client, exc)  # a node's own pipeline does not follow -MOVED: the next attempt will
            for key in won:  # an unacknowledged claim must not block the slot: as if never made
                with contextlib.suppress(redis.RedisError):  # else it expires after its period
                    release_value(client, key, value)
            raise
        return outcomes

    def _run(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """``commands`` in one pipeline (on Cluster, one request per node, following
        ``-ASK`` to any node: see :func:`.connection.pooled.run_by_node`); their replies, or
        the first error reply raised."""
        client = self.client
        if is_cluster(client):
            return _raising(run_by_node(client, commands))
        pipe = client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        replies: list[Any] = pipe.execute()
        return replies


def _raising(replies: list[Any]) -> list[Any]:
    """``replies``, or the first error among them raised (as a pipeline's ``execute()``)."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies

"""Redis Cluster by hand: its layout as ``CLUSTER NODES`` tells it, and a hash slot moved.

Shared by the tests' Cluster topologies and resharding (``tests/support/topologies.py``,
``tests/support/resharding.py``) and the chaos run's Cluster lock store
(``harness/chaos/shards.py``). Everything talks to the nodes with plain
``redis.Redis`` clients, one per node: no cluster client's slot map is involved,
so a layout that is changing (a node being added, a slot half moved) is seen as
each node has it.

A slot moves as ``redis-cli --cluster reshard`` moves it (:class:`SlotMove`):

1. ``CLUSTER SETSLOT <slot> IMPORTING <source id>`` on the target, ``MIGRATING
   <target id>`` on the source. The source still serves the keys it has and answers
   ``-ASK <slot> <target>`` for any other key of the slot; the target serves a key of
   the slot only to a client that sent ``ASKING`` just before.
2. ``MIGRATE`` of some keys (each atomically) to the target.
3. The keys left migrated, then ``CLUSTER SETSLOT <slot> NODE <target id>`` on the
   target, the source, and every other primary: the source answers ``-MOVED`` from then on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

__all__ = ["NodeLine", "SlotMove", "cluster_nodes", "node_id", "parse_nodes", "slot_list"]


@dataclass(frozen=True)
class NodeLine:
    """One line of ``CLUSTER NODES``: a node as the node asked knows it."""

    id: str
    host: str
    port: int
    flags: frozenset[str]
    #: The id of the primary it replicates (None: a primary).
    primary_id: str | None
    #: ``connected`` or ``disconnected`` (the asked node's link to it).
    link: str
    #: The slot ranges it serves (``low``, ``high``, both included); migrating and
    #: importing entries (``[slot->-id]``) left out.
    slots: tuple[tuple[int, int], ...]

    @property
    def is_primary(self) -> bool:
        return "master" in self.flags

    @property
    def failing(self) -> bool:
        """Marked failing (``fail``) or suspected (``fail?``) by the asked node."""
        return bool(self.flags & {"fail", "fail?"})

    @property
    def is_self(self) -> bool:
        return "myself" in self.flags

    @property
    def slot_count(self) -> int:
        return sum(high - low + 1 for low, high in self.slots)

    def serves(self, slot: int) -> bool:
        return any(low <= slot <= high for low, high in self.slots)


def parse_nodes(raw: Any) -> list[NodeLine]:
    """The lines of a ``CLUSTER NODES`` reply (bytes or text)."""
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    out = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        address = fields[1].split("@")[0]
        host, _, port = address.rpartition(":")
        ranges = []
        for item in fields[8:]:
            if item.startswith("["):
                continue
            low, _, high = item.partition("-")
            ranges.append((int(low), int(high or low)))
        out.append(NodeLine(fields[0], host, int(port or 0), frozenset(fields[2].split(",")),
                            None if fields[3] == "-" else fields[3], fields[7], tuple(ranges)))
    return out


def cluster_nodes(client: redis.Redis) -> list[NodeLine]:
    """The layout as the node ``client`` talks to knows it."""
    return parse_nodes(client.execute_command("CLUSTER", "NODES"))


def node_id(client: redis.Redis) -> str:
    """The id of the node ``client`` talks to (``CLUSTER MYID``)."""
    raw = client.execute_command("CLUSTER", "MYID")
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def slot_list(ranges: Iterable[tuple[int, int]]) -> list[int]:
    """Every slot of ``ranges``, in order."""
    return [slot for low, high in ranges for slot in range(low, high + 1)]


class SlotMove:
    """Hash slot ``slot`` moving from the node ``source`` to the node ``target``, whose
    address (as the cluster knows it) is ``target_address``; step by step (see the module
    docstring), so that a caller can act between the steps."""

    def __init__(self, slot: int, source: redis.Redis, target: redis.Redis, target_address: tuple[str, int], *,
                 ids: tuple[str, str] | None = None) -> None:
        self.slot = slot
        self.source = source
        self.target = target
        self.target_address = target_address
        #: The source's and the target's node ids (asked when not given).
        self.source_id, self.target_id = ids or (node_id(source), node_id(target))

    def start(self) -> SlotMove:
        """``IMPORTING`` on the target, then ``MIGRATING`` on the source."""
        self.target.execute_command("CLUSTER", "SETSLOT", self.slot, "IMPORTING", self.source_id)
        self.source.execute_command("CLUSTER", "SETSLOT", self.slot, "MIGRATING", self.target_id)
        return self

    def on_target(self, *command: Any) -> Any:
        """A command run on the target for keys of the slot (behind ``ASKING``: it is importing)."""
        pipe = self.target.pipeline(transaction=False)
        pipe.execute_command("ASKING")
        pipe.execute_command(*command)
        return pipe.execute()[1]

    def keys_on(self, node: redis.Redis, count: int = 1000) -> list[str]:
        """The keys of the slot a node holds (at most ``count``)."""
        return [k.decode() if isinstance(k, bytes) else str(k)
                for k in node.execute_command("CLUSTER", "GETKEYSINSLOT", self.slot, count)]

    def migrate(self, *keys: str, timeout_ms: int = 5000) -> Any:
        """``MIGRATE`` these keys of the slot from the source to the target, in one command.
        Returns the reply: ``OK``, or ``NOKEY`` when none of them was left on the source (they
        expired or were deleted meanwhile); nothing is sent without keys."""
        if not keys:
            return None
        host, port = self.target_address
        return self.source.execute_command("MIGRATE", host, port, "", 0, timeout_ms, "KEYS", *keys)

    def migrate_rest(self, batch: int = 100) -> int:
        """Migrate every key the source still holds in the slot; how many were sent."""
        sent = 0
        while keys := self.keys_on(self.source, batch):
            self.migrate(*keys)
            sent += len(keys)
        return sent

    def finish(self, others: Sequence[redis.Redis] = ()) -> None:
        """Migrate what is left, then give the slot to the target: ``SETSLOT NODE`` on the
        target first, then the source, then each of ``others`` (the other primaries; neither
        the target nor the source). The order matters: a node told before the target may
        answer ``-MOVED`` to a target that has not taken the slot yet."""
        self.migrate_rest()
        for node in (self.target, self.source, *others):
            node.execute_command("CLUSTER", "SETSLOT", self.slot, "NODE", self.target_id)

    def abort(self) -> None:
        """Leave the slot where it is now owned (``STABLE`` on both sides)."""
        for node in (self.source, self.target):
            node.execute_command("CLUSTER", "SETSLOT", self.slot, "STABLE")

    def state(self) -> dict[str, Any]:
        return {"slot": self.slot, "source": self.keys_on(self.source), "target": self.keys_on(self.target)}

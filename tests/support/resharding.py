"""Moving one hash slot of a real Redis Cluster by hand, as ``redis-cli --cluster reshard`` does.

:class:`SlotMove` takes the slot of a key from the primary that serves it (the
source) to another primary (the target), one step at a time, so that a test can
act between the steps. The steps are :class:`harness.redis_cluster.SlotMove`'s (the
chaos run moves slots with them too); this one finds the nodes with a cluster client:

1. :meth:`~SlotMove.start`: ``CLUSTER SETSLOT <slot> IMPORTING`` on the target,
   ``MIGRATING`` on the source. The source still serves the keys it has, and
   answers ``-ASK <slot> <target>`` for any other key of the slot; the target
   serves a key of the slot only to a client that sent ``ASKING`` just before.
2. :meth:`~SlotMove.migrate`: ``MIGRATE`` some keys (atomically, each) to the target.
3. :meth:`~SlotMove.finish`: every key left, then ``CLUSTER SETSLOT <slot> NODE
   <target>`` on the target, the source and every other primary: the source answers
   ``-MOVED`` from then on.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster

from harness.redis_cluster import SlotMove as HandSlotMove

__all__ = ["SlotMove", "monitored"]


@contextmanager
def monitored(node: redis.Redis) -> Iterator[list[dict[str, Any]]]:
    """Every command ``node`` executes while inside (``MONITOR``), in its order."""
    seen: list[dict[str, Any]] = []
    ready = threading.Event()
    end = "monitored: end"

    def watch() -> None:
        with node.monitor() as monitor:
            ready.set()
            while (command := monitor.next_command())["command"] != f"ECHO {end}":
                seen.append(command)

    watcher = threading.Thread(target=watch, daemon=True, name="monitor")
    watcher.start()
    assert ready.wait(10), "MONITOR did not start"
    node.ping()  # MONITOR answers before it listens: one command of ours, seen or not, before
    try:
        yield seen
    finally:
        node.echo(end)
        watcher.join(10)


class SlotMove(HandSlotMove):
    """The slot of ``key`` moving from its primary to another (see the module docstring):
    ``target``, e.g. a node being added that ``admin``'s slot map does not list, or else
    another primary. The steps are :class:`harness.redis_cluster.SlotMove`'s."""

    def __init__(self, admin: RedisCluster, key: str, target: ClusterNode | None = None) -> None:
        self.admin = admin
        source = admin.get_node_from_key(key)
        if target is None:
            target = next(node for node in admin.get_primaries() if node.name != source.name)
        self.source_node, self.target_node = source, target
        super().__init__(admin.keyslot(key), admin.get_redis_connection(source), admin.get_redis_connection(target),
                         (target.host, target.port))

    def start(self) -> SlotMove:
        super().start()
        return self

    def migrate(self, *keys: str, timeout_ms: int = 5000) -> Any:
        """``MIGRATE`` these keys (each must be of the slot and on the source) to the target."""
        reply = super().migrate(*keys, timeout_ms=timeout_ms)
        assert reply in (None, b"OK", "OK", True), reply
        return reply

    def finish(self, others: Sequence[redis.Redis] = ()) -> None:
        """Migrate what is left and give the slot to the target on every primary (a node
        being added, not among them yet, first)."""
        ends = {self.source_node.name, self.target_node.name}
        super().finish([self.admin.get_redis_connection(node) for node in self.admin.get_primaries()
                        if node.name not in ends])

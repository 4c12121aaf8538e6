"""Moving one hash slot of a real Redis Cluster by hand, as ``redis-cli --cluster reshard`` does.

:class:`SlotMove` takes the slot of a key from the primary that serves it (the
source) to another primary (the target), one step at a time, so that a test can
act between the steps:

1. :meth:`~SlotMove.start`: ``CLUSTER SETSLOT <slot> IMPORTING`` on the target,
   ``MIGRATING`` on the source. The source still serves the keys it has, and
   answers ``-ASK <slot> <target>`` for any other key of the slot; the target
   serves a key of the slot only to a client that sent ``ASKING`` just before.
2. :meth:`~SlotMove.migrate`: ``MIGRATE`` some keys (atomically, each) to the target.
3. :meth:`~SlotMove.finish`: every key left, then ``CLUSTER SETSLOT <slot> NODE
   <target>`` on every primary: the source answers ``-MOVED`` from then on.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster

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


class SlotMove:
    """The slot of ``key`` moving from its primary to another (see the module docstring):
    ``target``, e.g. a node being added that ``admin``'s slot map does not list, or else
    another primary."""

    def __init__(self, admin: RedisCluster, key: str, target: ClusterNode | None = None) -> None:
        self.admin = admin
        self.slot = admin.keyslot(key)
        source = admin.get_node_from_key(key)
        if target is None:
            target = next(node for node in admin.get_primaries() if node.name != source.name)
        self.source_node, self.target_node = source, target
        self.source: redis.Redis = admin.get_redis_connection(source)
        self.target: redis.Redis = admin.get_redis_connection(target)
        self.source_id = self.source.execute_command("CLUSTER", "MYID").decode()
        self.target_id = self.target.execute_command("CLUSTER", "MYID").decode()

    def start(self) -> SlotMove:
        self.target.execute_command("CLUSTER", "SETSLOT", self.slot, "IMPORTING", self.source_id)
        self.source.execute_command("CLUSTER", "SETSLOT", self.slot, "MIGRATING", self.target_id)
        return self

    def on_target(self, *command: Any) -> Any:
        """A command run on the target for keys of the slot (behind ``ASKING``: it is importing)."""
        pipe = self.target.pipeline(transaction=False)
        pipe.execute_command("ASKING")
        pipe.execute_command(*command)
        return pipe.execute()[1]

    def keys_on(self, node: redis.Redis) -> list[str]:
        """The keys of the slot a node holds (at most 1000)."""
        return [k.decode() for k in node.execute_command("CLUSTER", "GETKEYSINSLOT", self.slot, 1000)]

    def migrate(self, *keys: str) -> None:
        """``MIGRATE`` these keys (each must be of the slot and on the source) to the target."""
        if keys:
            reply = self.source.execute_command("MIGRATE", self.target_node.host, self.target_node.port, "", 0,
                                                5000, "KEYS", *keys)
            assert reply in (b"OK", "OK", True), reply

    def finish(self) -> None:
        """Migrate what is left and give the slot to the target on every primary."""
        self.migrate(*self.keys_on(self.source))
        primaries = self.admin.get_primaries()
        if all(node.name != self.target_node.name for node in primaries):  # a node being added: the target first
            self.target.execute_command("CLUSTER", "SETSLOT", self.slot, "NODE", self.target_id)
        for node in primaries:
            self.admin.get_redis_connection(node).execute_command("CLUSTER", "SETSLOT", self.slot, "NODE",
                                                                  self.target_id)

    def abort(self) -> None:
        """Leave the slot where it is now owned (``STABLE`` on both sides): tests' clean-up."""
        for node in (self.source, self.target):
            node.execute_command("CLUSTER", "SETSLOT", self.slot, "STABLE")

    def state(self) -> dict[str, Any]:
        return {"slot": self.slot, "source": self.keys_on(self.source), "target": self.keys_on(self.target)}

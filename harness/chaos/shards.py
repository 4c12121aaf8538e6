"""The Redis Cluster lock store of a chaos run (``LOCK=cluster``): three shards, nodes added and removed.

* Six cluster-enabled servers (:class:`.redis_node.Redis`: an append-only file synced on
  every write, ``-BUSY`` after 100 ms of another client's script, as the other lock
  stores), ``lock-n0`` to ``lock-n5``: ``n0``-``n2`` primaries serving a third of the
  hash slots each, ``n3``-``n5`` a replica of each. Formed by hand as ``redis-cli
  --cluster create`` forms one (``ADDSLOTS``, ``SET-CONFIG-EPOCH``, ``MEET``, ``REPLICATE``).
* ``cluster-node-timeout`` 2 s: a primary silent for longer (killed, or blocked by a
  script) is failed over to its replica by the cluster itself.
* ``cluster-allow-replica-migration no``: a primary emptied of its slots (being removed)
  stays a primary instead of turning into a replica of the node that took them.
* Workers and beats get ``redis+cluster://`` and the six first nodes (the library's
  Cluster URL; any reachable node is enough, and these are never removed).
* Nodes the nemesis adds (:meth:`LockCluster.add_node`) are ``lock-n6``, ``lock-n7``...:
  primaries without a replica; a removed one (:meth:`LockCluster.remove`) is forgotten
  by every other node and stopped, never started again.

Which node is what is asked of the nodes themselves (:meth:`LockCluster.layout`): each
running node's own line of ``CLUSTER NODES`` (its role, its slots, whom it replicates),
which is what it acts on, whatever the others still think of it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from ..redis_cluster import NodeLine, cluster_nodes, node_id
from ..waiting import wait_until
from .history import Recorder
from .redis_node import Redis

__all__ = ["NODE_TIMEOUT_MS", "LockCluster", "NodeState"]

#: ``cluster-node-timeout``: a primary silent this long is failed over to its replica.
NODE_TIMEOUT_MS = 2000
#: Primaries and replicas each of them has when the run starts.
PRIMARIES, REPLICAS = 3, 1
SLOTS = 16384


@dataclass(frozen=True)
class NodeState:
    """One running node as it sees itself."""

    node: Redis
    line: NodeLine
    #: The node it replicates (None: a primary, or one it names that is not ours).
    primary: Redis | None

    @property
    def is_primary(self) -> bool:
        return self.line.is_primary


class LockCluster:
    """The lock store's nodes (see the module docstring), started by :meth:`start`."""

    def __init__(self, run_dir: Path, rec: Recorder, extra: dict[str, str]) -> None:
        self.run_dir = run_dir
        self.rec = rec
        self.options = {"cluster-enabled": "yes", "cluster-config-file": "nodes.conf",
                        "cluster-node-timeout": str(NODE_TIMEOUT_MS), "cluster-allow-replica-migration": "no",
                        **extra}
        #: Every node ever started (removed ones included: stopped with the run).
        self.nodes: list[Redis] = [self._node(i) for i in range(PRIMARIES * (1 + REPLICAS))]
        self.originals = list(self.nodes)
        self.removed: list[Redis] = []
        #: Node id -> node (ids are kept across restarts, in ``nodes.conf``).
        self.ids: dict[str, Redis] = {}

    def _node(self, index: int) -> Redis:
        name = f"lock-n{index}"
        return Redis(name, self.run_dir / name, self.rec, self.options, cluster_bus=True)

    # ------------------------------------------------------------ addresses

    @property
    def url(self) -> str:
        """The library's Cluster URL (database 0 only), naming the nodes the run started with."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.originals)

    @property
    def current(self) -> list[Redis]:
        """The nodes in the cluster (running or not): not removed."""
        return [n for n in self.nodes if n not in self.removed]

    def added(self) -> list[Redis]:
        """Nodes added during the run and not removed since."""
        return [n for n in self.current if n not in self.originals]

    # ------------------------------------------------------------ start

    def start(self, timeout: float = 60.0) -> None:
        """Start the six nodes and form the cluster; return once it is :meth:`healthy`."""
        for node in self.nodes:
            node.start()
        clients = [n.client(0) for n in self.nodes]
        try:
            per = SLOTS // PRIMARIES
            for index in range(PRIMARIES):
                high = SLOTS - 1 if index == PRIMARIES - 1 else (index + 1) * per
                low = index * per + (1 if index else 0)
                clients[index].execute_command("CLUSTER", "ADDSLOTS", *range(low, high + 1))
            for index, client in enumerate(clients):
                client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", index + 1)
                self.ids[node_id(client)] = self.nodes[index]
            for node in self.nodes[1:]:
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, node.bus_port)
            wait_until(lambda: all(self._knows(n, len(self.nodes)) for n in self.nodes), timeout,
                       "every lock node knowing every other", interval=0.1)
            for index in range(PRIMARIES, len(self.nodes)):
                primary = self.nodes[(index - PRIMARIES) % PRIMARIES]
                clients[index].execute_command("CLUSTER", "REPLICATE", self.id_of(primary))
        finally:
            for client in clients:
                client.close()
        wait_until(self.healthy, timeout, "the lock cluster ok on every node, every replica in sync", interval=0.1)

    def id_of(self, node: Redis) -> str:
        return next(i for i, n in self.ids.items() if n is node)

    # ------------------------------------------------------------ what is what

    def _ask(self, node: Redis, *command: Any, timeout: float = 2.0) -> Any:
        with node.client(0, timeout) as client:
            return client.execute_command(*command)

    def _knows(self, node: Redis, count: int, *, ok: bool = False) -> bool:
        """``node`` knows ``count`` nodes (and, with ``ok``, says ``cluster_state:ok``)."""
        try:
            info = self._ask(node, "CLUSTER", "INFO")
        except (redis.RedisError, OSError):
            return False
        text = info.decode() if isinstance(info, bytes) else str(info)
        return f"cluster_known_nodes:{count}\r" in text and (not ok or "cluster_state:ok" in text)

    def layout(self) -> list[NodeState]:
        """Each running node of the cluster as it sees itself (nodes that do not answer left out)."""
        out = []
        for node in self.current:
            if not node.running:
                continue
            try:
                with node.client(0, 2.0) as client:
                    lines = cluster_nodes(client)
            except (redis.RedisError, OSError):
                continue
            me = next((line for line in lines if line.is_self), None)
            if me is not None:
                out.append(NodeState(node, me, self.ids.get(me.primary_id or "")))
        return out

    def primaries(self) -> list[Redis]:
        """Running nodes that see themselves as primaries serving slots."""
        return [s.node for s in self.layout() if s.is_primary and s.line.slot_count]

    def shards(self) -> list[tuple[Redis, list[Redis]]]:
        """Each primary serving slots and the running nodes that replicate it."""
        states = self.layout()
        return [(p.node, [s.node for s in states if s.primary is p.node])
                for p in states if p.is_primary and p.line.slot_count]

    def role_of(self, node: Redis) -> str | None:
        """``master`` or ``slave`` as the node says (None: it does not answer)."""
        if not node.running:
            return None
        try:
            with node.client(0, 2.0) as client:
                return str(client.info("replication").get("role"))
        except (redis.RedisError, OSError):
            return None

    def healthy(self) -> bool:
        """The cluster is whole: every node of it runs, says ``cluster_state:ok``, knows every
        other and flags none failing; every replica's link to its primary is up; and every node
        sees the same layout (who is a primary, of which slots; whom each replica follows), so
        that a primary that lost its slots to its replica has turned into its replica."""
        count = len(self.current)
        views = []
        for node in self.current:
            if not node.running:
                return False
            try:
                with node.client(0, 2.0) as client:
                    info = client.cluster("info")
                    if info.get("cluster_state") != "ok" or int(info.get("cluster_known_nodes", 0)) != count:
                        return False
                    lines = cluster_nodes(client)
                    replication = client.info("replication")
            except (redis.RedisError, OSError):
                return False
            if any(line.failing for line in lines):
                return False
            if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
                return False
            views.append({line.id: (line.is_primary, line.primary_id, line.slots) for line in lines})
        return all(view == views[0] for view in views)

    def summary(self) -> dict[str, Any]:
        """Who is what (for the history): primaries and their slot counts, replicas and
        whom they replicate, nodes that do not answer."""
        states = self.layout()
        answered = {s.node.name for s in states}
        return {"primaries": {s.node.name: s.line.slot_count for s in states if s.is_primary},
                "replicas": {s.node.name: s.primary.name if s.primary else s.line.primary_id
                             for s in states if not s.is_primary},
                "silent": sorted(n.name for n in self.current if n.name not in answered)}

    # ------------------------------------------------------------ growing and shrinking

    def add_node(self) -> Redis:
        """Start one more node and have the cluster meet it (it serves no slot yet)."""
        node = self._node(len(self.nodes))
        self.nodes.append(node)
        node.start()
        with node.client(0) as client:
            self.ids[node_id(client)] = node
        meets = next(n for n in self.current if n.running and n is not node)
        self._ask(meets, "CLUSTER", "MEET", "127.0.0.1", node.port, node.bus_port)
        return node

    def known_everywhere(self, node: Redis) -> bool:
        """Every running node of the cluster (``node`` included) knows all the others and
        says the cluster is ok (a node just met says ``fail`` until it learnt the slots, and
        refuses a ``MIGRATE`` meanwhile)."""
        count = len(self.current)
        return all(self._knows(n, count, ok=True) for n in self.current if n.running)

    def serves_nothing(self, node: Redis) -> bool:
        """No running node (``node`` itself included) sees ``node`` serving a slot."""
        wanted = self.id_of(node)
        for each in self.current:
            if not each.running:
                continue
            try:
                with each.client(0, 2.0) as client:
                    lines = cluster_nodes(client)
            except (redis.RedisError, OSError):
                return False
            if any(line.id == wanted and line.slots for line in lines):
                return False
        return True

    def remove(self, node: Redis) -> None:
        """``CLUSTER FORGET`` it on every other node, then stop it (as ``redis-cli --cluster
        del-node``): the cluster no longer has it."""
        wanted = self.id_of(node)
        for each in self.current:
            if each is not node and each.running:
                self._ask(each, "CLUSTER", "FORGET", wanted)
        self.removed.append(node)
        node.server.stop(timeout=10)
        self.rec("proc", name=node.name, action="exit", pid=node.server.pid, code=node.server.returncode)

    # ------------------------------------------------------------ watching

    def watch(self, stop: threading.Event, interval: float = 0.5) -> threading.Thread:
        """Record a ``cluster`` event (:meth:`summary`) each time who is what changes, until
        ``stop`` is set (a thread of its own: a paused node never holds the nemesis up)."""

        def loop() -> None:
            last: dict[str, Any] | None = None
            while not stop.wait(interval):
                try:
                    now = self.summary()
                except Exception as exc:  # the watch goes on; recorded
                    self.rec("cluster", error=f"{type(exc).__name__}: {exc}"[:200])
                    continue
                if now != last:
                    self.rec("cluster", **now)
                    last = now

        thread = threading.Thread(target=loop, name="cluster-watch", daemon=True)
        thread.start()
        return thread

"""Faults of the Redis Cluster lock store (``LOCK=cluster``, :mod:`.shards`): the cluster
grown and shrunk under held locks, shards failed over.

* ``add-node``: a new node started and met by the cluster (``CLUSTER MEET``); once every
  node knows it, hash slots of one primary move to it (:class:`~harness.redis_cluster.SlotMove`):
  the slots of every run lock that primary holds, a few more of its keys' slots and a run
  of empty ones. ``IMPORTING`` / ``MIGRATING`` on all of them, then 0.3-1.5 s later about
  half of each slot's keys ``MIGRATE``-d (the slot's keys split between the two nodes),
  then 0.3-1.5 s later the rest and ``SETSLOT NODE`` on every primary. At most
  :data:`MAX_ADDED` nodes added and not removed at a time.
* ``remove-node``: a node added earlier gives every slot it serves to the other primaries
  (each to one chosen at random: ``IMPORTING`` / ``MIGRATING``, then 0.3-1.5 s later its
  keys and ``SETSLOT NODE``); once no node sees it serving a slot, ``CLUSTER FORGET`` on
  every other node, and it is stopped.
* ``failover``: ``CLUSTER FAILOVER`` (the replica waits for its primary's writes first)
  or ``CLUSTER FAILOVER TAKEOVER`` (it does not) sent to a shard's replica; done once the
  replica says it is the primary.
* ``kill-primary``: a shard's primary SIGKILLed; the cluster fails it over to its replica
  (after ``cluster-node-timeout``); it is started again after the fault's length (and once
  the replica took over), and comes back as the new primary's replica.

Every kind (and the lock-store kinds of :mod:`.faults`, with the Cluster store) lasts
until the cluster is whole again (:meth:`~.faults._Builder._until_settled`). A step that
waits for the cluster (the meet, a promotion, slots given away) gives up after
:data:`BOUND` s and the next step runs all the same (its error, if any, recorded).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis
from redis.crc import key_slot

from ..redis_cluster import SlotMove, slot_list
from .faults import LOCK, POLL, Fault, _Builder, every
from .redis_node import Redis
from .shards import LockCluster, NodeState

__all__ = ["BOUND", "MAX_ADDED", "ShardFaults"]

#: Nodes added and not removed yet, at most.
MAX_ADDED = 2
#: Seconds a step waits for the cluster before it runs all the same.
BOUND = 30.0
#: A slot on its way, and clients of the primaries told of it after its target and its source.
Move = tuple[SlotMove, list[redis.Redis]]
#: The task whose run locks the harness's runs take (their keys' hash tags start with it).
TASK = "harness.chaos.app.work"


class ShardFaults(_Builder):
    """The Cluster lock store's own fault kinds (see the module docstring)."""

    def _store(self, busy: set[str]) -> LockCluster | None:
        store = self.cluster.store
        return None if store is None or LOCK in busy else store

    def _gated(self, fault: Fault, gates: dict[str, Callable[[], bool]]) -> Fault:
        """``fault`` goes on to a step named in ``gates`` only once its gate says so (asked at
        most every :data:`~.faults.POLL` s), or :data:`BOUND` s after the step before ran."""
        gates = {name: every(POLL, gate) for name, gate in gates.items()}
        since = [time.monotonic()]
        previous = fault.ready

        def ready() -> bool:
            gate = gates.get(fault.steps[0][2]) if fault.steps else None
            if gate is None:
                return previous()
            if gate() or time.monotonic() - since[0] > BOUND:
                since[0] = time.monotonic()
                return True
            return False

        fault.ready = ready
        return fault

    def _note(self, fault: Fault, **data: Any) -> None:
        self.rec("fault-note", n=fault.number, kind=fault.kind, **data)

    # ------------------------------------------------------------ add-node

    def _add_node(self, length: float, busy: set[str]) -> Fault | None:
        store = self._store(busy)
        if store is None or len(store.added()) >= MAX_ADDED or not store.primaries():
            return None
        gaps = [round(self.rng.uniform(0.3, 1.5), 2) for _ in range(2)]
        held: dict[str, Any] = {"moves": [], "clients": []}

        def add() -> None:
            held["node"] = store.add_node()

        def start_moves() -> None:
            held["moves"] = self._moves_to(fault, store, held["node"], held)
            for move, _ in held["moves"]:
                move.start()
            held["at"] = time.monotonic()

        def migrate_some() -> None:
            split = 0
            for move, _ in held["moves"]:
                keys = move.keys_on(move.source)
                some = self.rng.sample(keys, (len(keys) + 1) // 2)
                move.migrate(*some)
                split += len(some)
            self._note(fault, step="MIGRATE", keys=split)
            held["at"] = time.monotonic()

        def finish() -> None:
            _finish_and_close(held)

        fault = self._fault("add-node", {LOCK}, [
            (0, add, "start a node + CLUSTER MEET"), (0, start_moves, "SETSLOT IMPORTING / MIGRATING"),
            (0, migrate_some, "MIGRATE some keys"), (0, finish, "MIGRATE the rest + SETSLOT NODE")],
            gaps=gaps)
        self._gated(fault, {
            "SETSLOT IMPORTING / MIGRATING": lambda: "node" in held and store.known_everywhere(held["node"]),
            "MIGRATE some keys": lambda: time.monotonic() >= held.get("at", 0.0) + gaps[0],
            "MIGRATE the rest + SETSLOT NODE": lambda: time.monotonic() >= held.get("at", 0.0) + gaps[1]})
        return self._until_settled(fault)

    def _moves_to(self, fault: Fault, store: LockCluster, node: Redis, held: dict[str, Any]) -> list[Move]:
        """The slots moving to ``node`` (see the module docstring), as :meth:`_moves` gives them."""
        states = [s for s in store.layout() if s.is_primary and s.line.slot_count and s.node is not node]
        prefix = self.cluster.settings.prefix
        lock_tag = f"{prefix}:{{{TASK}:"
        keys: dict[str, list[str]] = {}
        for state in states:
            with state.node.client(0, 5.0) as client:
                keys[state.node.name] = [k.decode() for k in client.scan_iter(match=f"{prefix}:*", count=1000)]
        holding = [s for s in states if any(k.startswith(lock_tag) for k in keys[s.node.name])]
        source = self.rng.choice(holding or states)
        mine = keys[source.node.name]
        locks = {key_slot(k.encode()) for k in mine if k.startswith(lock_tag)}
        others = sorted({key_slot(k.encode()) for k in mine} - locks)
        chosen = locks | set(self.rng.sample(others, min(len(others), self.rng.randint(1, 4))))
        low, high = self.rng.choice(source.line.slots)
        first = self.rng.randint(low, high)
        chosen |= set(range(first, min(high, first + self.rng.randint(0, 31)) + 1))
        chosen = {slot for slot in chosen if source.line.serves(slot)}
        return self._moves(fault, store, held, [(slot, source, node) for slot in sorted(chosen)], states)

    def _moves(self, fault: Fault, store: LockCluster, held: dict[str, Any],
               plan: list[tuple[int, NodeState, Redis]], primaries: list[NodeState]) -> list[Move]:
        """One :class:`SlotMove` per ``(slot, source, target)`` of ``plan``, each with clients of
        the other ``primaries`` (told of the move after the target and the source), recorded;
        ``held["clients"]`` gets every client opened (closed once the moves are done)."""
        clients: dict[str, redis.Redis] = {}

        def client_of(node: Redis) -> redis.Redis:
            if node.name not in clients:
                clients[node.name] = node.client(0, 10.0)
                held["clients"].append(clients[node.name])
            return clients[node.name]

        moves = []
        for slot, source, target in plan:
            move = SlotMove(slot, client_of(source.node), client_of(target), ("127.0.0.1", target.port),
                            ids=(store.id_of(source.node), store.id_of(target)))
            moves.append((move, [client_of(p.node) for p in primaries
                                 if p.node is not source.node and p.node is not target]))
        self._note(fault, step="slots", sources=sorted({s.node.name for _, s, _ in plan}),
                   targets=sorted({t.name for _, _, t in plan}), slots=[slot for slot, _, _ in plan])
        return moves

    # ------------------------------------------------------------ remove-node

    def _remove_node(self, length: float, busy: set[str]) -> Fault | None:
        store = self._store(busy)
        added = [n for n in store.added() if n.running] if store is not None else []
        if store is None or not added:
            return None
        node = self.rng.choice(added)
        gap = round(self.rng.uniform(0.3, 1.5), 2)
        held: dict[str, Any] = {"moves": [], "clients": []}

        def start_moves() -> None:
            states = store.layout()
            own = next((s for s in states if s.node is node), None)
            targets = [s for s in states if s.is_primary and s.line.slot_count and s.node is not node]
            if own is None or not targets:
                raise RuntimeError(f"{node.name}: no answer, or no other primary to take its slots")
            plan = [(slot, own, self.rng.choice(targets).node) for slot in slot_list(own.line.slots)]
            held["moves"] = self._moves(fault, store, held, plan, targets)
            for move, _ in held["moves"]:
                move.start()
            held["at"] = time.monotonic()

        def finish() -> None:
            _finish_and_close(held)

        fault = self._fault("remove-node", {LOCK}, [
            (0, start_moves, "SETSLOT IMPORTING / MIGRATING"), (0, finish, "MIGRATE + SETSLOT NODE"),
            (0, lambda: store.remove(node), "CLUSTER FORGET + stop")], node=node.name, gap=gap)
        self._gated(fault, {"MIGRATE + SETSLOT NODE": lambda: time.monotonic() >= held.get("at", 0.0) + gap,
                            "CLUSTER FORGET + stop": lambda: store.serves_nothing(node)})
        return self._until_settled(fault)

    # ------------------------------------------------------------ failovers

    def _a_shard(self, busy: set[str]) -> tuple[LockCluster, Redis, Redis] | None:
        """A shard with a replica: the store, its primary, one of its replicas."""
        store = self._store(busy)
        shards = [(p, r) for p, r in store.shards() if r] if store is not None else []
        if store is None or not shards:
            return None
        primary, replicas = self.rng.choice(shards)
        return store, primary, self.rng.choice(replicas)

    def _shard_failover(self, length: float, busy: set[str], mode: str | None = None) -> Fault | None:
        """``mode``: ``""`` (``CLUSTER FAILOVER``) or ``"TAKEOVER"``; chosen when None."""
        found = self._a_shard(busy)
        if found is None:
            return None
        store, primary, replica = found
        mode = self.rng.choice(["", "TAKEOVER"]) if mode is None else mode

        def failover() -> None:
            with replica.client(0, 10.0) as client:
                client.execute_command("CLUSTER", "FAILOVER", *([mode] if mode else []))

        def settled() -> None:
            self._note(fault, primary_before=primary.name, replica_role=store.role_of(replica),
                       old_primary_role=store.role_of(primary))

        fault = self._fault("failover", {LOCK}, [
            (0, failover, f"CLUSTER FAILOVER {mode or '(default)'} on {replica.name}"),
            (max(length, 3.0), settled, "settled")], primary=primary.name, replica=replica.name,
            mode=mode or "default")
        self._gated(fault, {"settled": lambda: store.role_of(replica) == "master"
                            and store.role_of(primary) in ("slave", None)})
        return self._until_settled(fault)

    def _kill_primary(self, length: float, busy: set[str]) -> Fault | None:
        found = self._a_shard(busy)
        if found is None:
            return None
        store, primary, replica = found
        fault = self._fault("kill-primary", {LOCK}, [
            (0, primary.kill, "SIGKILL"), (length, primary.start, "start (to be a replica)")],
            primary=primary.name, replica=replica.name)
        self._gated(fault, {"start (to be a replica)": lambda: store.role_of(replica) == "master"})
        return self._until_settled(fault)


def _finish_and_close(held: dict[str, Any]) -> None:
    """A resharding fault's last step: every move of ``held`` finished, its clients closed."""
    try:
        _finish_all(held["moves"])
    finally:
        _close_all(held["clients"])


def _finish_all(moves: list[Move]) -> None:
    """Finish every move (the keys left, then ``SETSLOT NODE`` on the target, the source and
    the other primaries); one that fails does not stop the others: the errors are raised
    together at the end (and recorded with the step)."""
    errors = []
    for move, others in moves:
        try:
            move.finish(others)
        except redis.RedisError as exc:
            errors.append(f"slot {move.slot}: {exc}")
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(moves)} slot(s) not moved: " + "; ".join(errors[:5]))


def _close_all(clients: list[redis.Redis]) -> None:
    for client in clients:
        client.close()

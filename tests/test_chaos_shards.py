"""The chaos run's Redis Cluster lock store and its faults (``make chaos LOCK=cluster``), step by step.

The lock store of ``harness/chaos/shards.py`` (six real cluster-enabled servers on loopback:
three primaries with a replica each) under leases taken by the library, held by hand
(nothing else runs: no worker, beat or broker). Each fault of ``harness/chaos/shard_faults.py``
is built by the nemesis, injected and driven to its end as a run drives it, and must
leave the cluster whole, with every fault step done without an error and recorded in the
history, and every lease still the holder's (renewed where its key now lives):

* ``add-node``: while the slots of held run locks migrate to the node being added, with
  about half their keys moved (``-ASK`` for the rest), every lease renews; once the slots
  are the new node's, the moved locks are there;
* ``remove-node``: the node added is emptied, forgotten by every other node and stopped;
* ``failover`` (``CLUSTER FAILOVER``, and with ``TAKEOVER``) and ``kill-primary``: the replica
  is the shard's primary, the old primary its replica;
* ``delete-liveness``: the liveness keys of every slot, on every primary.

The whole cluster under these faults with workers and beats is ``make chaos LOCK=cluster``
(benchmarks/results.md), too long for the suite.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.crc import key_slot

from celery_singleton_beat.connection.client import redis_from_url
from celery_singleton_beat.lease.lease import Lease
from celery_singleton_beat.recovery.window import mark_in_use
from harness.chaos.cluster import Cluster, Settings
from harness.chaos.faults import Fault
from harness.chaos.history import Recorder, load
from harness.chaos.nemesis import Nemesis
from harness.chaos.shards import LockCluster

from .support.locking import renew, take_lock
from .support.skips import require

#: Run-lock keys as the chaos app's runs name them (prefix ``chaos``, the task's hash tag).
KEYS = [f"chaos:{{harness.chaos.app.work:k{i}}}" for i in range(9)]


@pytest.fixture
def chaos_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A chaos run's cluster with the Cluster lock store started (nothing else)."""
    require("redis-server")
    cluster = Cluster(Settings(lock="cluster"), tmp_path / "run", Recorder(tmp_path / "run" / "history", "control"))
    try:
        assert cluster.store is not None
        cluster.store.start()
        for node in cluster.store.primaries():
            with node.client(0) as client:  # a store of the test's own: no recovery window
                mark_in_use(client)
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def leases(chaos_cluster: Cluster) -> Iterator[dict[str, Lease]]:
    """A 30 s lease on each of :data:`KEYS`, taken by the library's Cluster client."""
    assert chaos_cluster.store is not None
    client = redis_from_url(chaos_cluster.store.url)
    held = {}
    for number, key in enumerate(KEYS):
        result = take_lock(client, key, 30, task="harness.chaos.app.work", task_id=f"run-{number}",
                           node="w1@host", boot="b1")
        assert result.lease is not None, f"{key} taken"
        held[key] = result.lease
    yield held
    client.close()


def inject(nemesis: Nemesis, kind: str, **options: Any) -> Fault:
    """Build a fault of ``kind`` (with ``options``, the Cluster failover's ``mode``) and inject it
    (its first step), as ``Nemesis.inject_one`` does."""
    builder = "_shard_failover" if kind == "failover" else "_" + kind.replace("-", "_")
    fault = getattr(nemesis, builder)(2.0, nemesis.busy_targets(), **options)
    assert fault is not None, f"{kind} applies"
    nemesis.count += 1
    fault.number = nemesis.count
    _, first, name = fault.steps.pop(0)
    nemesis.active.append(fault)
    first()
    nemesis.rec("fault", n=fault.number, kind=kind, action="inject", step=name, targets=sorted(fault.targets),
                error=None, **fault.params)
    return fault


def drive_to(nemesis: Nemesis, fault: Fault, step: str, timeout: float = 60.0) -> None:
    """Run the fault's steps, each when due, until ``step`` is the next one."""
    from .support import wait_for

    def reached() -> bool:
        nemesis.advance()
        return not fault.steps or fault.steps[0][2] == step

    wait_for(reached, timeout=timeout, interval=0.02, message=f"{fault.kind} before its step {step!r}")
    assert fault.steps, f"{fault.kind} ended before {step!r}"


def steps_of(cluster: Cluster, number: int) -> list[dict[str, Any]]:
    """The fault's history lines (inject, steps, heal; a fault of one step has its inject only),
    each checked to have raised nothing."""
    lines = [dict(e.data) for e in load(cluster.history_dir).of("fault") if e.get("n") == number]
    assert lines and lines[0]["action"] == "inject", lines
    assert len(lines) == 1 or lines[-1]["action"] == "heal", lines  # one step: injected and done
    assert all(line.get("error") is None for line in lines), lines
    return lines


def all_renew(leases: dict[str, Lease]) -> None:
    for key, lease in leases.items():
        assert renew(lease), f"the lease of {key} is still its holder's"


def node_of(store: LockCluster, key: str) -> str:
    """The name of the primary serving ``key``'s slot (as that primary says)."""
    slot = key_slot(key.encode())
    return next(s.node.name for s in store.layout() if s.is_primary and s.line.serves(slot))


def test_a_node_added_under_held_locks_then_removed(chaos_cluster: Cluster, leases: dict[str, Lease]) -> None:
    store = chaos_cluster.store
    assert store is not None
    nemesis = Nemesis(chaos_cluster, 3, chaos_cluster.rec)
    added = inject(nemesis, "add-node")
    drive_to(nemesis, added, "MIGRATE the rest + SETSLOT NODE")
    (node,) = store.added()
    notes = [e for e in load(chaos_cluster.history_dir).of("fault-note") if e.get("n") == added.number]
    moved = next(e for e in notes if e.get("step") == "slots")
    held_slots = {key_slot(k.encode()) for k in KEYS}
    assert held_slots & set(moved["slots"]), "slots of held run locks are migrating"
    assert any(e.get("step") == "MIGRATE" and e.get("keys") for e in notes), [e.data for e in notes]
    all_renew(leases)  # the slots' keys split between the source and the new node (-ASK)

    nemesis.heal_all()
    steps_of(chaos_cluster, added.number)
    assert store.healthy()
    on_new = [k for k in KEYS if key_slot(k.encode()) in moved["slots"]]
    assert on_new and all(node_of(store, k) == node.name for k in on_new), "the moved slots are the new node's"
    with node.client(0) as client:
        assert all(client.exists(k) for k in on_new), "the moved locks are on the new node"
    all_renew(leases)

    removed = inject(nemesis, "remove-node")
    nemesis.heal_all()
    steps_of(chaos_cluster, removed.number)
    assert store.added() == [] and not node.running and store.healthy()
    assert all(node_of(store, k) != node.name for k in KEYS)
    all_renew(leases)


@pytest.mark.parametrize(("kind", "options"), [("failover", {"mode": ""}), ("failover", {"mode": "TAKEOVER"}),
                                               ("kill-primary", {})], ids=["failover", "takeover", "kill-primary"])
def test_a_shard_failed_over_under_held_locks(chaos_cluster: Cluster, leases: dict[str, Lease], kind: str,
                                             options: dict[str, str]) -> None:
    store = chaos_cluster.store
    assert store is not None
    nemesis = Nemesis(chaos_cluster, 3, chaos_cluster.rec)
    fault = inject(nemesis, kind, **options)
    nemesis.heal_all()
    lines = steps_of(chaos_cluster, fault.number)
    primary = next(n for n in store.nodes if n.name == lines[0]["primary"])
    replica = next(n for n in store.nodes if n.name == lines[0]["replica"])
    assert store.role_of(replica) == "master" and store.role_of(primary) == "slave", "the roles swapped"
    assert store.healthy()
    all_renew(leases)


def test_the_liveness_keys_are_deleted_on_every_primary(chaos_cluster: Cluster) -> None:
    """``delete-liveness`` on the Cluster store: every worker's liveness key, whatever its
    hash slot, on every primary (a node refuses one ``DEL`` across slots)."""
    store = chaos_cluster.store
    assert store is not None
    keys = [f"chaos:live:w{i}@host:{i}" for i in range(12)]
    client = redis_from_url(store.url)
    try:
        for key in keys:
            client.set(key, "1", px=60_000)
        assert len({node_of(store, k) for k in keys}) == 3, "keys on every primary"
        nemesis = Nemesis(chaos_cluster, 3, chaos_cluster.rec)
        fault = inject(nemesis, "delete-liveness")
        nemesis.heal_all()
        steps_of(chaos_cluster, fault.number)
        assert not any(client.exists(k) for k in keys)
    finally:
        client.close()

"""Redis Cluster resharding: a slot migrating while leases renew and new locks are taken.

A real 3-primary Cluster on loopback (``start_cluster``); the slot of the locks
is moved by hand (:class:`.support.resharding.SlotMove`): ``IMPORTING`` /
``MIGRATING``, some keys ``MIGRATE``-d, then the slot given to the target. While
it migrates, the source answers ``-ASK`` for every key of the slot it no longer
has (and for new keys): the library must send ``ASKING`` and the request to the
target, and must not re-send to the source what the source already served.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from redis.cluster import RedisCluster

from celery_singleton_beat.lease.holder import done_key
from celery_singleton_beat.lease.keeper import KeptLease, get_keeper
from celery_singleton_beat.lease.lock import AcquireResult

from .support import wait_for
from .support.locking import take_lock
from .support.resharding import SlotMove, monitored
from .support.topologies import Topology

_tags = itertools.count()


def tag() -> str:
    """A hash tag no other test uses: its slot is moved by this test only."""
    return f"demo.task:migrating-{next(_tags)}"


def take(client: Any, key: str, task_id: str, ttl: float = 30, **spec: Any) -> AcquireResult:
    return take_lock(client, key, ttl, task="demo.task", task_id=task_id, node="w1@host", boot="b1", **spec)


def task_id_in(raw: bytes | None) -> str | None:
    return None if raw is None else str(json.loads(raw)["task_id"])


def kept_renewing(kept: KeptLease, at_least: int) -> bool:
    assert not kept.lost, f"the lease was lost: {kept.lost_reason}"
    return kept.renewals >= at_least


def test_a_lease_keeps_renewing_and_new_locks_follow_ask_while_their_slot_migrates(
        cluster: Topology, cluster_client: RedisCluster) -> None:
    client = cluster_client
    admin = cluster.admin
    assert isinstance(admin, RedisCluster)
    t = tag()
    kept_key, stays, free, done_owner = (f"singleton:{n}:{{{t}}}" for n in ("kept", "stays", "free", "done"))
    lease = take(client, kept_key, "kept", ttl=3).lease  # renewed every second by the keeper
    assert lease is not None
    assert take(client, stays, "stays").acquired
    assert take(client, done_owner, "finished").acquired
    marker = done_key(done_owner, "finished")
    admin.set(marker, "1")
    move = SlotMove(admin, kept_key).start()
    kept = get_keeper().keep(lease)
    try:
        move.migrate(kept_key, marker)  # the lease's key and a done marker: on the target now
        assert move.keys_on(move.source) == sorted([stays, done_owner])

        # The kept lease is renewed on the target (ASK, then ASKING there).
        at = kept.renewals
        wait_for(lambda: kept_renewing(kept, at + 3), timeout=20,
                 message="three renewals of the lease whose key migrated")
        assert 0 < move.on_target("PTTL", kept_key) <= 3000 and kept_key not in move.keys_on(move.source)

        # New acquisitions of the slot: a free key is created on the target, a key the source
        # still has is answered there, a key that moved is answered by the target.
        with monitored(move.target) as on_target:
            new = take(client, free, "new")
        assert new.acquired and task_id_in(move.on_target("GET", free)) == "new"
        # Its fencing token is the target's clock read right behind the SET there (TIME sent along).
        sets = [i for i, c in enumerate(on_target) if c["command"].startswith(f"SET {free} ")]
        assert len(sets) == 1 and on_target[sets[0] + 1]["command"] == "TIME", on_target
        assert free not in move.keys_on(move.source)
        for key, holder in ((stays, "stays"), (kept_key, "kept")):
            contender = take(client, key, "contender")
            assert not contender.acquired and contender.holder is not None and contender.holder.task_id == holder
        # The lock on the source, its done marker on the target: each command answered where its key is.
        copy = take(client, done_owner, "finished", check_done=True)
        assert copy.completed and task_id_in(move.source.get(done_owner)) == "finished"
        # A copy's acquire (acks_late, redelivered) names the lock and its done marker: the
        # migrating slot answers that script -TRYAGAIN, and it is sent as separate commands.
        late_key = f"singleton:late:{{{t}}}"
        late = take(client, late_key, "late", check_done=True, copy=True)
        assert late.acquired and task_id_in(move.on_target("GET", late_key)) == "late"
        assert late.lease is not None and late.lease.release()

        move.finish()  # the slot is the target's: the source answers MOVED
        at = kept.renewals
        wait_for(lambda: kept_renewing(kept, at + 2), timeout=20, message="renewals after the slot moved")
        assert task_id_in(move.target.get(kept_key)) == "kept" and task_id_in(move.target.get(stays)) == "stays"
        assert not take(client, stays, "contender").acquired
        assert new.lease is not None and new.lease.release()
    finally:
        get_keeper().forget(kept)
    assert lease.release(), "the lease was ours all along"
    assert not admin.exists(kept_key)

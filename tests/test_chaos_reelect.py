"""The chaos nemesis's ``reelect-primary`` fault does what it says (``harness/chaos/reelect.py``).

On the chaos cluster's own Sentinel group (a primary P1 with an append-only file,
its replica P2, three sentinels), without workers: a process of the library holds a
lock taken on P2 while P2 serves; after the fault, the sentinels name P1 again, P1
never replicated from P2 (its replication id is the one it had) and lacks both the
fault's marker and that lock, and the library's client follows the sentinels to P1:
the holder's next renewal reaches P1 and puts its lock back there.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from redis.sentinel import MasterNotFoundError

from celery_singleton_beat.config import clear_settings_cache
from celery_singleton_beat.lease.holder import parse_holder
from celery_singleton_beat.recovery.lock_redis import get_redis, reset_clients
from celery_singleton_beat.recovery.window import mark_in_use
from harness.chaos.cluster import Cluster, Settings
from harness.chaos.history import Recorder, load
from harness.chaos.nemesis import Nemesis

from .support.locking import renew, take_lock

#: The lock database of the chaos cluster.
DB = 2
#: Bound on the whole fault (it has bounds of its own on each gate; see the module).
FAULT_BOUND = 120.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    settings = Settings(lock="sentinel")
    group = Cluster(settings, tmp_path / "run", Recorder(tmp_path / "run" / "history", "control"))
    try:
        group.start_servers()
        yield group
    finally:
        group.close()


@pytest.fixture
def app(cluster: Cluster) -> Iterator[Celery]:
    """A process of the library on the group (as the chaos cluster's workers see it)."""
    clear_settings_cache()
    reset_clients()
    app = Celery("reelect", broker="memory://", set_as_current=False)
    app.conf.update(singleton_redis_url=cluster.lock_url, singleton_key_prefix=cluster.settings.prefix,
                    singleton_liveness_ttl=1.5,
                    singleton_redis_options={"socket_timeout": 1.0, "socket_connect_timeout": 1.0})
    yield app
    reset_clients()
    clear_settings_cache()


def notes(cluster: Cluster, stage: str) -> list[dict[str, Any]]:
    return [e.data for e in load(cluster.history_dir).of("fault-note")
            if e.get("kind") == "reelect-primary" and e.get("stage") == stage]


@pytest.mark.timeout(180)
def test_the_reelected_former_primary_lacks_what_was_written_on_the_interim_one(
        cluster: Cluster, app: Celery) -> None:
    p1, p2 = cluster.lock_nodes
    assert cluster.named_primary() is p1
    with p1.client(DB) as direct:
        mark_in_use(direct, cluster.settings.prefix)  # a Redis in use: no first-deploy window
    key = f"{cluster.settings.prefix}:{{chaos.run:{'a' * 64}}}"

    nemesis = Nemesis(cluster, 1, cluster.rec)
    fault = nemesis._reelect_primary(0.3, set())
    assert fault is not None, "the group is whole: the fault applies"
    fault.number = 1
    _, cut_off, _ = fault.steps.pop(0)
    cut_off()
    nemesis.active.append(fault)

    held = None
    deadline = time.monotonic() + FAULT_BOUND
    while nemesis.active and time.monotonic() < deadline:
        nemesis.advance()
        if held is None and cluster.named_primary() is p2:
            # P2 serves: the library follows the sentinels there, waits the failover's
            # window, and takes the lock on P2. The sentinel the harness asked names P2;
            # the library's client asks them all and takes no answer from one that still
            # flags the primary down: until they agree it finds no primary (an outage to
            # it, as to a worker), and the lock is taken at a later step.
            try:
                held = take_lock(get_redis(app), key, 30.0, task="chaos.run", task_id="held-on-p2")
            except MasterNotFoundError:
                held = None
            else:
                assert held.lease is not None, f"the lock is taken on P2: {held}"
        time.sleep(0.02)
    assert not nemesis.active, f"the fault ended within {FAULT_BOUND}s: left {fault.steps}"
    assert held is not None and held.lease is not None

    elected = notes(cluster, "elected")
    assert len(elected) == 1, "the fault recorded what the re-elected primary is"
    seen = elected[0]
    assert seen["elected"] and seen["role"] == "master", f"the sentinels named P1 again: {seen}"
    assert seen["replid_kept"], f"P1 never replicated from P2: {seen}"
    assert seen["lacks_marker"], f"P1 lacks the marker written on P2: {seen}"
    assert seen["locks_taken_on_p2"] >= 1 and seen["of_them_on_p1"] == 0, f"P1 lacks P2's locks: {seen}"
    assert cluster.named_primary() is p1
    with p1.client(DB) as direct:
        assert not direct.exists(key), "P1 lacks the lock the library took on P2"

        assert renew(held.lease), "the holder's renewal follows the sentinels to P1 and puts its lock back"
        holder = parse_holder(direct.get(key))
        assert holder is not None and holder.task_id == "held-on-p2", "the lock is back on P1, its holder's"

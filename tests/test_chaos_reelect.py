"""The chaos nemesis's ``reelect-primary`` fault does what it says (``harness/chaos/reelect.py``).

On the chaos cluster's own Sentinel group (a primary P1 with an append-only file,
its replica P2, three sentinels), without workers: a process of the library holds a
lock taken on P2 while P2 serves; after the fault, the sentinels name P1 again, P1
never replicated from P2 (its replication id is the one it had) and lacks both the
fault's marker and that lock, and the library's client follows the sentinels to P1:
the holder's next renewal reaches P1 and puts its lock back there. A process that
never used P2 and reaches P1 first opens a recovery window there (the Sentinel failover
epoch of P1's record is below the sentinels'), so that the holder has time to put its
lock back before a fresh process can take the key.
"""

from __future__ import annotations

import json
import subprocess
import sys
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
from celery_singleton_beat.recovery.records import recovery_key
from celery_singleton_beat.recovery.window import FAILED_OVER, mark_in_use
from harness.chaos.cluster import Cluster, Settings
from harness.chaos.history import Recorder, load
from harness.chaos.nemesis import Nemesis
from harness.chaos.redis_node import Redis

from .support.locking import renew, take_lock

ROOT = Path(__file__).resolve().parent.parent
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


#: A fresh process of the library: ``look`` checks its first connection and prints the
#: window it found; ``take`` tries to acquire the key and prints who holds it.
FRESH_PROCESS = """
import json, logging, sys
from celery import Celery
from celery_singleton_beat.recovery.lock_redis import get_redis
from celery_singleton_beat.recovery.server import server_of
from tests.support.locking import take_lock

action, key, conf = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
app = Celery("fresh", broker="memory://", set_as_current=False)
app.conf.update(conf)
client = get_redis(app)
if action == "look":
    client.ping()
    window = server_of(client).recovery()
    print(json.dumps({"open": window.open, "reason": window.reason}))
else:
    result = take_lock(client, key, 30.0, task="chaos.run", task_id="fresh")
    server = server_of(client)
    window = server.recovery()
    print(json.dumps({"holder": "fresh" if result.lease else getattr(result.holder, "task_id", None),
                      "taken_over": getattr(result.taken_over, "task_id", None), "window": window.reason,
                      "since_ms": server.data_lost_since_ms()}))
"""


def fresh_process(app: Celery, action: str, key: str) -> dict[str, Any]:
    """Run :data:`FRESH_PROCESS` with ``app``'s lock settings; what it printed."""
    conf = {name: app.conf[name] for name in ("singleton_redis_url", "singleton_key_prefix",
                                              "singleton_liveness_ttl", "singleton_redis_options")}
    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS, action, key, json.dumps(conf)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert done.returncode == 0, f"the fresh process failed: {done.stderr[-2000:]}"
    seen = dict(json.loads(done.stdout.strip().splitlines()[-1]))
    seen["log"] = done.stderr[-3000:]  # its warnings: the windows it found, a lock it freed
    return seen


def never_promoted(node: Redis) -> None:
    """Before ``node`` (stopped) starts again: the sentinels never promote it
    (``replica-priority 0`` in the configuration file it starts from)."""
    config = node.workdir / "redis.conf"
    lines = [line for line in config.read_text().splitlines()
             if not line.startswith(("replica-priority ", "slave-priority "))]
    config.write_text("\n".join([*lines, "replica-priority 0"]) + "\n")


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
    # P2 comes back as a replica that the sentinels never promote: with a down-after of
    # 1 s, sentinels that lose sight of the re-elected P1 for a second (a busy machine)
    # would otherwise fail over once more, to P2, in the middle of the checks below. That
    # is another fault (a replica promoted: a window every live holder answers, which the
    # hand-renewed holder here does not), not the one this test looks at.
    delay, come_back, what = fault.steps[-1]
    fault.steps[-1] = (delay, lambda: (never_promoted(p2), come_back()), what)
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
    with p2.client(DB) as back:
        assert back.config_get("replica-priority") == {"replica-priority": "0"}, "P2 is never promoted again"
    with p1.client(DB) as direct:
        assert not direct.exists(key), "P1 lacks the lock the library took on P2"

        # A process that never used P2 (a worker started during the episode) reaches P1
        # first: P1's record names P1 itself, but at a failover epoch below the sentinels'.
        looked = fresh_process(app, "look", key)
        assert looked["open"] and looked["reason"] == FAILED_OVER, \
            f"a fresh process on the re-elected primary opens a window: {looked}"
        assert direct.pttl(recovery_key(cluster.settings.prefix)) > 0, "every client finds it"

        assert renew(held.lease), "the holder's renewal follows the sentinels to P1 and puts its lock back"
        holder = parse_holder(direct.get(key))
        assert holder is not None and holder.task_id == "held-on-p2", "the lock is back on P1, its holder's"
        taken = fresh_process(app, "take", key)
        assert taken["holder"] == "held-on-p2", f"another fresh process finds the key held: {taken}"

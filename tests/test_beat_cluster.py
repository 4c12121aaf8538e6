"""Beats on a Redis Cluster: found by ``make chaos LOCK=cluster``.

* A real ``celery beat`` stopped (SIGTERM) while it builds its scheduler: a beat SIGTERMed
  3.5 s after it started, while the lock store's writes were paused, never exited
  (SIGKILLed 15 s later). A Cluster client talks to the cluster while it is built (the
  slot map, the command table), and each new connection is looked at by the library
  (``INFO`` and the server record's script, which waits while writes are paused).
  Celery's beat answers SIGTERM by closing its scheduler, and builds it first when it is
  not built yet: inside the signal handler, on the thread the signal interrupted, in the
  middle of building the first one. Both ask for the app's lock Redis client. The stop
  must still end the process, however long the first client takes to build. (A real
  beat, ``tests.apps.beat_app``; a 3-primary Cluster of the test's own, its primaries'
  writes paused by ``CLIENT PAUSE WRITE``; the session's redis-server as the broker.)
* A beat whose claims' shard fails over: the claims of a sent slot are marked on the
  node the client's slot map names, through that node's own connection; after a failover
  that node answers ``-MOVED``, which nothing followed, and the beat sent no slot of the
  entry again until it was restarted (61 s in the chaos run). (An in-process scheduler on
  a clock of its own; a Cluster of 3 primaries with a replica each.)
"""

from __future__ import annotations

import signal
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from celery_singleton_beat.recovery.lock_redis import reset_clients
from celery_singleton_beat.recovery.window import mark_in_use

from .support import RedisServer, wait_for
from .support.beat import ManualClock, RecordingScheduler, beat_app, run_ticks, sent_slots, start_beat
from .support.fixtures import prepared_cluster
from .support.topologies import fail_over_shard, start_cluster

#: The in-process beat's clock.
START = datetime(2024, 5, 1, 12, 0, 0, 300000, tzinfo=timezone.utc)



def waiting_clients(node: redis.Redis) -> list[dict[str, Any]]:
    """Clients of ``node`` blocked (``CLIENT LIST`` flag ``b``): a paused command waits so."""
    return [c for c in node.client_list() if "b" in str(c.get("flags", ""))]


@pytest.mark.slow
def test_a_beat_stopped_while_its_cluster_client_is_built_exits(redis_server: RedisServer, tmp_path: Path) -> None:
    cluster = prepared_cluster()
    try:
        primaries = cluster.primaries()
        for node in primaries:
            node.execute_command("CLIENT", "PAUSE", 120_000, "WRITE")
        beat = start_beat(redis_server, tmp_path, "cluster-stop", {"e": {"every": 3600}},
                          settings={"singleton_redis_url": cluster.url})
        # Building its scheduler, the beat builds the app's Cluster client; its first
        # connection's look at the server record waits on the paused writes.
        wait_for(lambda: any(waiting_clients(node) for node in primaries), timeout=60,
                 message="the beat's first connection check waiting on the paused writes")
        assert "singleton scheduler" not in beat.output(), "the scheduler is not built yet"
        beat.send(signal.SIGTERM)
        for node in primaries:
            node.execute_command("CLIENT", "UNPAUSE")
        wait_for(lambda: beat.returncode is not None, timeout=60,
                 message="the beat to exit after SIGTERM (it hangs if the stop waits for the client being built)")
        assert beat.returncode == 0, beat.tail(40)
    finally:
        cluster.stop()


def test_a_beat_keeps_sending_after_the_shard_of_its_claims_fails_over() -> None:
    cluster = start_cluster(primaries=3, replicas=1)
    beat: RecordingScheduler | None = None
    try:
        for node in cluster.primaries():
            mark_in_use(node)  # a Cluster of the test's own: no recovery window
        clock = ManualClock(START)
        beat = RecordingScheduler(app=beat_app(clock, {"e": {"task": "fo.e", "schedule": 1.0}}, cluster.url))
        run_ticks([beat], clock, 2, 0.5)
        assert sent_slots(beat, task="fo.e"), "slots sent before the failover"
        fail_over_shard(cluster, key_slot(b"singleton:{beat:e}"))
        before = len(sent_slots(beat, task="fo.e"))

        def sending() -> bool:
            assert beat is not None
            run_ticks([beat], clock, 1, 0.5)  # the beat's back-off after a failed claim runs on real time
            return len(sent_slots(beat, task="fo.e")) > before

        wait_for(sending, timeout=30, interval=0.2, message="a slot of the entry sent after the failover")
    finally:
        if beat is not None:
            beat.close()
        reset_clients()
        cluster.stop()

"""A real ``celery beat`` on a Redis Cluster, stopped (SIGTERM) while it builds its scheduler.

Found by ``make chaos LOCK=cluster``: a beat SIGTERMed 3.5 s after it started, while the
lock store's writes were paused, never exited (SIGKILLed 15 s later). A Cluster client
talks to the cluster while it is built (the slot map, the command table), and each new
connection is looked at by the library (``INFO`` and the server record's script, which
waits while writes are paused). Celery's beat answers SIGTERM by closing its scheduler,
and builds it first when it is not built yet: inside the signal handler, on the thread
the signal interrupted, in the middle of building the first one. Both ask for the app's
lock Redis client. The stop must still end the process, however long the first client
takes to build.

Real processes: the beat (``tests.apps.beat_app``), a 3-primary Cluster of the test's own
(its primaries' writes paused by ``CLIENT PAUSE WRITE``), the session's redis-server as
the broker.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import redis

from .support import RedisServer, wait_for
from .support.beat import start_beat
from .support.fixtures import prepared_cluster

pytestmark = pytest.mark.slow


def waiting_clients(node: redis.Redis) -> list[dict[str, Any]]:
    """Clients of ``node`` blocked (``CLIENT LIST`` flag ``b``): a paused command waits so."""
    return [c for c in node.client_list() if "b" in str(c.get("flags", ""))]


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

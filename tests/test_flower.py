"""Skips and lost leases as Flower shows them: a real worker, a real ``celery flower``.

The worker (``-E``) sends ``task-skipped`` / ``task-lock-lost`` task events on
the test Redis broker; Flower turns them into task states and Prometheus
counters, read back through its HTTP API (``FLOWER_UNAUTHENTICATED_API=true``).
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from types import ModuleType
from typing import Any

import requests

from .support import (
    LOCK_DB,
    RECORD_DB,
    CeleryProcess,
    RedisServer,
    child_env,
    free_port,
    importorskip,
    run_command,
    start_worker,
    wait_for,
)
from .support.tasks import counts_when

importorskip("flower")  # the [flower] extra, which `make test` installs
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402 (comes with flower)

APP = "tests.apps.ops_app"
HOLD = "tests.apps.ops_app.hold"
PUBLISH_ONCE = "tests.apps.ops_app.publish_once"


class Flower:
    """A ``celery flower`` process on a free loopback port, read through its HTTP API."""

    def __init__(self, redis_server: RedisServer, *, unauthenticated_api: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = child_env(redis_server, FLOWER_UNAUTHENTICATED_API="true")
        if not unauthenticated_api:
            del env["FLOWER_UNAUTHENTICATED_API"]
        self.process = CeleryProcess(
            ["-A", APP, "--broker", redis_server.url(0), "flower", f"--port={self.port}",
             "--address=127.0.0.1", "--tasks_columns=name,uuid,state,result,received,worker"],
            env, name="flower",
        ).start()

        def healthy() -> bool:
            try:
                return requests.get(f"{self.url}/healthcheck", timeout=2).text == "OK"
            except requests.ConnectionError:
                return False

        wait_for(healthy, timeout=60, interval=0.2, message="flower answering /healthcheck")

    def tasks(self, **params: str) -> dict[str, dict[str, Any]]:
        response = requests.get(f"{self.url}/api/tasks", params=params, timeout=10)
        response.raise_for_status()
        return response.json()

    def task(self, task_id: str) -> dict[str, Any] | None:
        response = requests.get(f"{self.url}/api/task/info/{task_id}", timeout=10)
        return response.json() if response.status_code == 200 else None

    def events(self, event_type: str, task: str) -> float:
        """``flower_events_total{type=..., task=...}`` summed over workers, from ``/metrics``."""
        text = requests.get(f"{self.url}/metrics", timeout=10).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text) if family.name == "flower_events"
            for sample in family.samples
            if sample.name == "flower_events_total" and sample.labels.get("type") == event_type
            and sample.labels.get("task") == task
        )


def test_flower_shows_skipped_duplicates_and_lost_leases(
    ops: ModuleType, redis_server: RedisServer, processes: list[CeleryProcess],
) -> None:
    flower = Flower(redis_server)
    processes.append(flower.process)
    worker = start_worker(redis_server, APP, "w1", concurrency=2)
    processes.append(worker)
    records = redis_server.client(RECORD_DB)
    locks = redis_server.client(LOCK_DB)

    # Flower only sees events sent after its receiver is bound: probe until it
    # sees one (another task, distinct keys: probes are never skipped).
    probes = itertools.count()

    def flower_listening() -> bool:
        if flower.tasks(taskname=PUBLISH_ONCE):
            return True
        ops.publish_once.delay(f"probe-{next(probes)}")
        return False

    wait_for(flower_listening, timeout=60, interval=0.5, message="flower receiving task events")

    holder = ops.hold.delay("A")
    wait_for(lambda: records.get("running:A"), timeout=30, message="the holder running")
    duplicates = [ops.hold.delay("A", note=str(i)) for i in range(3)]
    wait_for(lambda: all(d.state == "REVOKED" for d in duplicates), timeout=30,
             message="duplicates stored as skipped (REVOKED) in the result backend")
    [key] = [k.decode() for k in locks.scan_iter(match="singleton:{tests.apps.ops_app.hold:*")
             if not k.endswith(b":fence")]

    ids = {d.id for d in duplicates}
    skipped = wait_for(lambda: (found := flower.tasks(state="SKIPPED")) and set(found) >= ids and found,
                       timeout=30, message="flower listing the SKIPPED tasks")
    for task_id in ids:
        task = skipped[task_id]
        assert task["state"] == "SKIPPED" and task["name"] == HOLD
        assert task["worker"].startswith("w1@")
        assert holder.id in task["result"] and key in task["result"], task["result"]
        assert flower.task(task_id)["state"] == "SKIPPED"
    assert set(flower.tasks(search="state:SKIPPED")) == ids, "Flower's search finds them"
    wait_for(lambda: flower.events("task-skipped", HOLD) == 3, timeout=30,
             message="flower_events_total{type='task-skipped'} == 3")

    # An operator force-releases the lock of the running holder: warned, then
    # the run learns that its lease is gone and says so (task-lock-lost).
    released = run_command(
        [sys.executable, "-m", "celery", "-A", APP, "singleton", "release", key, "--yes"],
        env=child_env(redis_server), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
    )
    assert released.returncode == 0, released.stderr
    assert f"task {holder.id} is RUNNING on w1@" in released.stderr
    records.set("go:A", "1")
    assert holder.get(timeout=30) == "A"
    worker.wait_for_line(holder.id, "lost its lock", key)
    wait_for(lambda: flower.events("task-lock-lost", HOLD) == 1, timeout=30,
             message="flower_events_total{type='task-lock-lost'} == 1")
    wait_for(lambda: (flower.task(holder.id) or {}).get("state") == "SUCCESS", timeout=30,
             message="the holder's final state in flower")
    counts_when(locks, HOLD, lambda c: c.get("skipped") == 3 and c.get("force_released") == 1
                and c.get("lost") == 1)


def test_flower_api_needs_auth_or_unauthenticated_api(redis_server: RedisServer,
                                                      processes: list[CeleryProcess]) -> None:
    """docs/monitoring.md: `/api/tasks?state=SKIPPED` answers only with authentication or
    ``FLOWER_UNAUTHENTICATED_API=true``; without either it is 401 (``/metrics`` is not)."""
    flower = Flower(redis_server, unauthenticated_api=False)
    processes.append(flower.process)
    response = requests.get(f"{flower.url}/api/tasks", params={"state": "SKIPPED"}, timeout=10)
    assert response.status_code == 401 and "FLOWER_UNAUTHENTICATED_API" in response.text
    assert requests.get(f"{flower.url}/metrics", timeout=10).status_code == 200

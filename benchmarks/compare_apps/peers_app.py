"""The app of ``benchmarks/bench_peers.py``: one no-op task, its base class set by the variant.

Configured by environment (set by the benchmark for every process it starts):

* ``CMP_REDIS``: base URL of the measured redis-server: broker on db 0, the
  locks of every library on db 1, the result backend on db 2.
* ``CMP_CONTROL``: base URL of a second redis-server that only carries the
  benchmark's own signals (ready / go / done), so they cost the measured
  server nothing.
* ``CMP_VARIANT``: the task's base class: ``plain`` (``celery.Task``),
  ``ours`` (``SingletonTask``, default lock mode), ``celery_singleton``
  (``celery_singleton.Singleton``), ``celery_once`` (``celery_once.QueueOnce``).
  Each library with its default options, only its Redis URL set. A
  ``_acks_late`` suffix (``ours_acks_late``, ``plain_acks_late``) sets
  ``acks_late=True`` on the no-op task: the message is acknowledged after the
  run, and ours then checks and writes the run's done marker. An
  ``_ignore_result`` suffix (``ours_ignore_result``, ``plain_ignore_result``)
  sets ``ignore_result=True``: nothing is stored, so nobody sees the run's end
  and ours does not wait for its release's reply (read with the next acquire).

``python -m benchmarks.compare_apps.peers_app publish N`` queues a *gate* task
and then N no-op tasks with distinct arguments. The worker runs the gate
first: it says ``ready`` on the control server and blocks until the
benchmark says ``go`` (the benchmark reads the measured server's counters in
between), then the no-op tasks run. The solo worker counts them in its own
memory (no Redis command per task); once the last one has run (its result
stored, its lock released: ``task_postrun``), it pushes to ``done`` the time
from the first task's start to the last task's end, and the CPU time the
worker process (all its threads) used meanwhile.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import redis
from celery import Celery, Task
from celery.signals import task_postrun

from benchmarks.compare_apps.bases import task_base

BASE = os.environ["CMP_REDIS"]
CONTROL = os.environ["CMP_CONTROL"]
VARIANT = os.environ["CMP_VARIANT"]
ACKS_LATE = VARIANT.endswith("_acks_late")
IGNORE_RESULT = VARIANT.endswith("_ignore_result")
LOCKS_URL = f"{BASE}/1"
QUEUE = "peers"
GATE_TIMEOUT = 600

app = Celery("peers", broker=f"{BASE}/0", backend=f"{BASE}/2")
app.conf.update(
    task_default_queue=QUEUE,
    worker_prefetch_multiplier=64,  # as benchmarks/task_app.py
    broker_connection_retry_on_startup=True,
)

base: type[Task] = task_base(app, VARIANT.removesuffix("_acks_late").removesuffix("_ignore_result"), LOCKS_URL)

_control: redis.Redis | None = None
_state: dict[str, Any] = {"done": 0, "first": None}


def control() -> redis.Redis:
    """The connection to the control server (opened by the gate, before the measured window)."""
    global _control
    if _control is None:
        _control = redis.Redis.from_url(CONTROL)
    return _control


@app.task(base=Task, name="peers.gate", ignore_result=True)
def gate() -> None:
    """Hold the worker until the benchmark has read the server's counters."""
    control().rpush("ready", "1")
    if control().blpop(["go"], timeout=GATE_TIMEOUT) is None:
        raise RuntimeError("no 'go' from the benchmark")
    _state.update(done=0, first=None)


@app.task(base=base, name="peers.noop", acks_late=ACKS_LATE, ignore_result=IGNORE_RESULT)
def noop(i: int, target: int) -> None:
    """A no-op that counts itself; the last one notes the time from the first start to its end."""
    now, cpu = time.perf_counter(), time.process_time()
    if _state["first"] is None:
        _state.update(first=now, first_cpu=cpu)
    _state["done"] += 1
    if _state["done"] == target:
        _state["report"] = {"tasks": target, "seconds": time.perf_counter() - _state["first"],
                            "cpu_seconds": time.process_time() - _state["first_cpu"]}


@task_postrun.connect(sender=noop)
def _report(**_: Any) -> None:
    """After the last task's whole run (result stored, lock released): tell the benchmark."""
    report = _state.pop("report", None)
    if report is not None:
        control().rpush("done", json.dumps(report))


def publish(tasks: int) -> None:
    """Queue the gate, then ``tasks`` no-op tasks with distinct arguments."""
    gate.apply_async()
    for i in range(tasks):
        noop.apply_async((i, tasks))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "publish":
        sys.exit("usage: python -m benchmarks.compare_apps.peers_app publish N")
    publish(int(sys.argv[2]))

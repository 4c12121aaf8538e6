"""What the keeps-lock tests (``test_keeps_lock*.py``, issue 20) share.

Real workers of ``tests.apps.keeps_lock_app`` (each on a queue of its own, so a
test says which worker gets a submission), their run records, and
:class:`KeyWatch`, which proves that a key was absent during a whole interval.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import redis
from celery.result import AsyncResult

from celery_singleton_beat.config import clear_settings_cache
from celery_singleton_beat.recovery.lock_redis import reset_clients

from .processes import CeleryProcess, start_worker
from .servers import RedisServer
from .waiting import wait_for

APP = "tests.apps.keeps_lock_app"
#: Environment variables the app reads (cleared after each test).
KNOBS = ("CSB_BROKER", "CSB_LOCK_REDIS", "CSB_LOCK_TTL", "CSB_LIVENESS_TTL", "CSB_VISIBILITY",
         "CSB_SOCKET_TIMEOUT")


def load_app(redis_server: RedisServer, **env: str) -> ModuleType:
    """``tests.apps.keeps_lock_app`` for this test's figures (re-imported: it reads them at import)."""
    os.environ["CSB_TEST_REDIS"] = f"redis://127.0.0.1:{redis_server.port}"
    for name in KNOBS:
        os.environ.pop(name, None)
    os.environ.update(env)
    sys.modules.pop(APP, None)
    clear_settings_cache()
    reset_clients()
    return importlib.import_module(APP)


def knobs() -> Iterator[dict[str, str]]:
    """Body of the test modules' ``app_env`` fixture: the workers' environment (the test
    fills it in); the app's knobs are cleared afterwards."""
    env: dict[str, str] = {}
    yield env
    for name in KNOBS:
        os.environ.pop(name, None)
    clear_settings_cache()
    reset_clients()


def worker(redis_server: RedisServer, name: str, env: dict[str, str], *, pool: str = "prefork",
           concurrency: int = 1, queues: str | None = None) -> CeleryProcess:
    """A worker of the app consuming ``queues`` (comma-separated; default: the queue named like it)."""
    return start_worker(redis_server, APP, name, pool=pool, concurrency=concurrency,
                        extra=["-Q", queues or name], env=env)


def entries(records: redis.Redis, name: str) -> list[dict[str, Any]]:
    return [json.loads(item) for item in records.lrange(name, 0, -1)]


def started_run(records: redis.Redis, key: str, task_id: str) -> dict[str, Any] | None:
    """The start record of ``task_id``'s run of ``key``, once it started."""
    return next((e for e in entries(records, f"started:{key}") if e["task_id"] == task_id), None)


def ended_run(records: redis.Redis, key: str, task_id: str) -> dict[str, Any] | None:
    """The end record of ``task_id``'s run of ``key``, once it ended."""
    return next((e for e in entries(records, f"runs:{key}") if e["task_id"] == task_id), None)


def call_of(records: redis.Redis, key: str, task_id: str) -> dict[str, Any] | None:
    """The delivery record (prerun/postrun) of ``task_id`` for ``key``, once it ended."""
    return next((e for e in entries(records, f"calls:{key}") if e["task_id"] == task_id), None)


def wait_started(records: redis.Redis, key: str, result: AsyncResult, timeout: float = 30) -> dict[str, Any]:
    return wait_for(lambda: started_run(records, key, result.id), timeout=timeout,  # type: ignore[no-any-return]
                    message=f"the run {result.id} of {key} started")


def wait_called(records: redis.Redis, key: str, result: AsyncResult, timeout: float = 30) -> dict[str, Any]:
    return wait_for(lambda: call_of(records, key, result.id), timeout=timeout,  # type: ignore[no-any-return]
                    message=f"the delivery {result.id} of {key} ended")


def decision(records: redis.Redis, key: str, task_id: str) -> tuple[float, float]:
    """When the delivery ``task_id`` of ``key`` decided whether to run: from its prerun
    until its body started (it ran) or its postrun (it did not). Once it ended."""
    call = call_of(records, key, task_id)
    assert call is not None, f"the delivery {task_id} of {key} ended"
    run = started_run(records, key, task_id)
    return call["prerun"], run["start"] if run is not None else call["postrun"]


def live_key_of(process: CeleryProcess) -> str:
    """The liveness key the worker's main process keeps (``<prefix>:live:<boot>``), from its start-up line."""
    line = process.wait_for_line("liveness key", timeout=10)
    found = re.search(r"liveness key (\S+:live:[0-9a-f]+)", line)
    assert found, f"no liveness key in {line!r}"
    return found.group(1)


def run_id(client: redis.Redis) -> str:
    """The server's run id: a new one after every restart."""
    return str(client.info("server")["run_id"])


@contextmanager
def replica_cut_off(replica: Any, primary: redis.Redis) -> Iterator[None]:
    """Inside the block the replica receives nothing more from ``primary`` (SIGSTOPped,
    its replication link killed): writes made meanwhile exist on the primary alone."""
    replica.send(signal.SIGSTOP)
    try:
        primary.client_kill_filter(_type="replica")
        yield
    finally:
        replica.send(signal.SIGCONT)


def assert_never_beside(records: redis.Redis, key: str, original: str) -> list[dict[str, Any]]:
    """Runs of ``key`` never overlapped, and every other run started after ``original``'s ended.

    Returns the runs of ``key`` (end records).
    """
    done = entries(records, f"runs:{key}")
    first = next(e for e in done if e["task_id"] == original)
    others = [e for e in entries(records, f"started:{key}") if e["task_id"] != original]
    beside = [e for e in others if e["start"] < first["end"]]
    assert records.get(f"overlap:{key}") is None and not beside, (
        f"a run of {key} ran beside the original {original} "
        f"({first['start']:.3f}-{first['end']:.3f}): {beside}")
    return done


class KeyWatch:
    """Looks at one key every few milliseconds from a thread, to prove it was absent
    during a whole interval (e.g. while another worker decided a run).

    ``delete=True`` deletes it at each look instead (``DEL`` answers whether it
    was there): the key is then kept absent although its owner writes it again.
    A key written with a TTL longer than the gap between two looks cannot come
    and go unseen, so consecutive looks that found nothing prove absence between them.
    """

    def __init__(self, client: redis.Redis, key: str, *, delete: bool = False) -> None:
        self.client, self.key, self.delete = client, key, delete
        #: (began, ended, found) of each look.
        self.looks: list[tuple[float, float, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{key}", daemon=True)

    def __enter__(self) -> KeyWatch:
        self._thread.start()
        wait_for(lambda: len(self.looks) >= 2, timeout=10, message=f"{self.key} watched")
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        look = self.client.delete if self.delete else self.client.exists
        while not self._stop.is_set():
            began = time.time()
            found = bool(look(self.key))
            self.looks.append((began, time.time(), found))
            self._stop.wait(0.002)

    def absent_throughout(self, start: float, end: float, ttl: float) -> bool:
        """True if the key provably did not exist at any moment of ``[start, end]``.

        ``ttl``: the shortest TTL the key is ever written with (a write cannot
        expire between two looks closer than that).
        """
        looks = list(self.looks)
        before = [i for i, (_, ended, _) in enumerate(looks) if ended <= start]
        after = [i for i, (began, _, _) in enumerate(looks) if began >= end]
        if not before or not after:
            return False
        first, last = before[-1], after[0]
        span = looks[first:last + 1]
        gaps = [b[0] - a[1] for a, b in itertools.pairwise(span)]
        if max(gaps, default=0) >= ttl:
            return False
        # Deleting looks: the first may have found (and deleted) it; no later one may.
        seen = [found for _, _, found in (span[1:] if self.delete else span)]
        return not any(seen)

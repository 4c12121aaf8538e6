"""Adversary test of the soft time limit guard in a real prefork pool process (soft-hold).

``SIGUSR1`` (what the worker's main process sends a pool process whose run passed its
soft time limit, and ``revoke(terminate=True, signal="SIGUSR1")``) is sent by the test to
the worker's one pool process at random moments while it runs many short singleton runs
back to back: the signals land wherever that process is (a run's body, the library's part
of a run, Celery's tracer, the pool's own code between runs). Afterwards every run has an
outcome (its result or ``SoftTimeLimitExceeded``), every run lock is freed (none left to
its TTL, none renewed for ever by the keeper), and the same pool process goes on working:
**held**.

Not the library's part, and not changed by it (billiard's own handler raises there too): a
signal landing while Celery's tracer stores a run's result (``mark_as_done``, in the
middle of writing it to the result backend) goes through Celery's internal-error path: the
run's result is stored as an ``EncodeError`` or, at times, not at all (the caller waits
for ever). Such runs are counted here, not failed on.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from collections.abc import Iterator
from types import ModuleType

import celery.exceptions
import pytest
from billiard.exceptions import SoftTimeLimitExceeded

from .support import RECORD_DB, CeleryProcess, RedisServer, wait_for
from .support.processes import module_worker
from .support.tasks import clear_runs, lock_keys, started

APP = "tests.apps.tasks_app"
RUNS = 200
#: Runs signalled once their body is seen running (a long body): each must end on its soft limit.
IN_BODY = 10
#: Seconds a run's result is waited for (a run takes milliseconds).
STORED_WITHIN = 15
QUEUE = "adv-soft-hold"


@pytest.fixture(scope="module")
def worker(redis_server: RedisServer) -> Iterator[CeleryProcess]:
    redis_server.flushall()
    yield from module_worker(redis_server, APP, "adv-soft-hold", concurrency=1, extra=["-Q", QUEUE])


@pytest.fixture
def tasks_app(worker: CeleryProcess, redis_server: RedisServer) -> ModuleType:
    return clear_runs(redis_server)


def test_sigusr1_at_random_moments_of_many_short_runs_leaves_no_lock_and_a_working_process(
        tasks_app: ModuleType, redis_server: RedisServer, worker: CeleryProcess) -> None:
    pid = int(tasks_app.pid_of.apply_async(queue=QUEUE).get(timeout=30))
    locks = redis_server.client()
    jitter = random.Random(0)  # the same moments each run (where they land varies with the machine)
    moment = threading.Event()  # never set: its wait() is the random moment's delay
    outcomes: dict[str, int] = {}
    for n in range(RUNS):
        key = f"adv-soft-{n}"
        result = tasks_app.work.apply_async((key,), queue=QUEUE)
        # One signal per run, as the main process sends one to a run past its soft limit, at a
        # random moment: before the pool process got the run, in any part of it, or after it.
        moment.wait(jitter.uniform(0.0, 0.006))
        os.kill(pid, signal.SIGUSR1)
        try:
            kind = "returned" if result.get(timeout=STORED_WITHIN) == key else "returned otherwise"
        except SoftTimeLimitExceeded:
            kind = "soft limit"
        except celery.exceptions.TimeoutError:
            kind = "no result stored"  # landed as Celery's tracer stored the result: see above
        except Exception as exc:  # (an EncodeError stored for the result: see above)
            kind = f"{type(exc).__name__} stored"
        outcomes[kind] = outcomes.get(kind, 0) + 1
    assert outcomes.get("returned otherwise") is None, outcomes
    # Where the random moments landed depends on the machine; these land in a body for sure.
    records = redis_server.client(RECORD_DB)
    for n in range(IN_BODY):
        key = f"adv-soft-body-{n}"
        result = tasks_app.work.apply_async((key, 5.0), queue=QUEUE)
        wait_for(lambda: started(records, key), timeout=30, message="the long body running")  # noqa: B023
        os.kill(pid, signal.SIGUSR1)
        with pytest.raises(SoftTimeLimitExceeded):
            result.get(timeout=STORED_WITHIN)
    wait_for(lambda: not [key for key in lock_keys(locks) if "adv-soft" in key or "tasks_app.work" in key],
             timeout=30, message="every run lock freed")
    assert int(tasks_app.pid_of.apply_async(queue=QUEUE).get(timeout=30)) == pid, "the pool process lives"
    assert tasks_app.work.apply_async(("adv-soft-after",), queue=QUEUE).get(timeout=30) == "adv-soft-after"
    out = worker.output()
    assert "Pool process" not in out and "Unrecoverable error" not in out, out[-3000:]

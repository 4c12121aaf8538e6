"""Adversarial attacks on the per-run cost changes, each against a real redis-server.

A reviewer who did not write the changes tried to break them: the body of a traced run
called as ``run`` on the tracer's request (:meth:`.SingletonTask.__call__`), the usual
replies read in one step (:meth:`.wire.SocketLink.read_short`: acquire, release,
counters), counters spelt as raw RESP, and the heartbeat on its own connection.

What broke (each test failed before its fix):

* a call nested in a run of the same task (``self(...)`` in the body) in a real worker
  saw the *outer* run's request (its args and kwargs): the run no longer went through
  Celery's ``Task.__call__``, so the worker's stack protection (which runs the body on
  the tracer's request the first time it is called with one request on the stack)
  fired at the nested call instead, and pushed no request of its own for it.
"""

from __future__ import annotations

import json
from types import ModuleType

import redis

from .support import RedisServer, wait_for
from .support.processes import start_worker

APP = "tests.apps.tasks_app"


def test_a_call_nested_in_a_worker_run_sees_its_own_request(
    tasks: ModuleType, redis_server: RedisServer, records: redis.Redis,
) -> None:
    start_worker(redis_server, APP, "w1", pool="solo", concurrency=1)
    result = tasks.nesting.delay("outer")
    assert result.get(timeout=30)[0] == "outer"
    wait_for(lambda: records.llen("nesting") == 2, timeout=30)
    outer, inner = (json.loads(item) for item in records.lrange("nesting", 0, -1))
    assert outer[:4] == ["outer", False, ["outer"], {}]
    assert inner[:4] == ["outer-inner", True, ["outer-inner"], {"inner": True}], \
        "the nested call's body sees its own arguments in self.request"
    assert inner[4] != outer[4], "each call holds the lock of its own key"

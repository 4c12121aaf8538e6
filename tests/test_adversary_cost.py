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
  fired at the nested call instead, and pushed no request of its own for it;
* (older than these changes) after such a nested call returned, the outer body's
  ``self.singleton`` was the nested call's lock (key and fencing token), released already:
  the nested call set its lock on the outer run's request.

Attacks that held, kept because they reach the new paths:

* a soft time limit raised while a release (behind its done marker) and a counter batch
  wait in their one-step read: the connection is dropped, the next acquire reads its own
  replies;
* counters whose hash and field names hold CRLF, RESP markers, ``%``, non-ASCII or 100k
  characters, and a batch with an error reply between two integers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded

from celery_singleton_beat import SingletonTask
from celery_singleton_beat.connection.channels import channel_for
from celery_singleton_beat.connection.wire import Request
from celery_singleton_beat.lease import counters
from celery_singleton_beat.lease.behalf import read_holder
from celery_singleton_beat.lease.commands import raise_errors
from celery_singleton_beat.recovery.lock_redis import reset_clients

from .support import LOCK_DB, RedisServer, wait_for
from .support.interrupts import RaiseInto, blocked_on, when
from .support.locking import take_lock
from .support.processes import start_worker

APP = "tests.apps.tasks_app"


@pytest.mark.parametrize("pool", ["solo", "prefork", "threads"])
def test_a_call_nested_in_a_worker_run_sees_its_own_request(
    tasks: ModuleType, redis_server: RedisServer, records: redis.Redis, pool: str,
) -> None:
    start_worker(redis_server, APP, f"w-{pool}", pool=pool, concurrency=1)
    result = tasks.nesting.delay("outer")
    assert result.get(timeout=30)[0] == "outer"
    wait_for(lambda: records.llen("nesting") == 2, timeout=30)
    outer, inner = (json.loads(item) for item in records.lrange("nesting", 0, -1))
    assert outer[:4] == ["outer", False, ["outer"], {}]
    assert inner[:4] == ["outer-inner", True, ["outer-inner"], {"inner": True}], \
        "the nested call's body sees its own arguments in self.request"
    assert inner[4] != outer[4], "each call holds the lock of its own key"


# -------------------------------------------------------------------- one-step reads cut short


def raise_while_paused(admin: redis.Redis, command: str, call: Callable[[], Any]) -> None:
    """``call()`` on a server paused for writes; a soft time limit is raised into this thread
    once the server holds ``command`` back (the one-step read waits in its ``recv``)."""
    admin.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    try:
        with RaiseInto() as interrupt:
            interrupt.arm(SoftTimeLimitExceeded)
            with when(lambda: blocked_on(admin, command), interrupt.fire,
                      otherwise=lambda: admin.execute_command("CLIENT", "UNPAUSE")), \
                    pytest.raises(SoftTimeLimitExceeded):
                call()
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")


def test_a_release_or_a_counter_batch_cut_short_in_its_one_step_read_leaves_no_reply_behind(
        make_redis: Callable[..., RedisServer]) -> None:
    """Held: a soft time limit lands while the release (and then a counter batch) waits for
    its usual reply; the next acquire on the same thread's channel reads its own replies (the
    key another holds is reported held). (The connection is dropped with the release unread:
    a paused server never runs a closed client's commands, so the lock stays until its TTL,
    as on the general path.)"""
    server = make_redis()
    client, admin, other = server.client(), server.client(), server.client()
    assert take_lock(other, "t:{cost:held}", 30, task="t", task_id="theirs").acquired
    lease = take_lock(client, "t:{cost:mine}", 30, task="t", task_id="mine").lease
    assert lease is not None and lease.release() is True  # the channel is up, the script loaded
    lease = take_lock(client, "t:{cost:mine}", 30, task="t", task_id="mine-2").lease
    assert lease is not None
    raise_while_paused(admin, "set", lambda: lease.release(done_ttl=60.0))
    result = take_lock(client, "t:{cost:held}", 30, task="t", task_id="next")
    assert not result.acquired and result.holder is not None and result.holder.task_id == "theirs"

    channel = channel_for(client)
    batch = Request(None, raise_errors, data=b"*4\r\n$7\r\nHINCRBY\r\n$2\r\nh1\r\n$1\r\nf\r\n$1\r\n1\r\n", count=1,
                    short=counters._integers(1))
    raise_while_paused(admin, "hincrby", lambda: channel.call(batch))
    result = take_lock(client, "t:{cost:held}", 30, task="t", task_id="next")
    assert not result.acquired and result.holder is not None and result.holder.task_id == "theirs"


# -------------------------------------------------------------------- counters spelt as raw RESP


def test_counters_of_any_name_are_written_and_an_error_reply_in_a_batch_spares_the_next(
        redis_db: redis.Redis) -> None:
    """Held: counter hashes and fields whose names hold spaces, CRLF, RESP markers, ``%``,
    non-ASCII or 100k characters are written exactly (lengths in bytes, not characters); a
    batch that meets an error reply in its middle (a hash key holding a string) is read to
    its end through the general reader, and the next batch on the same channel is counted."""
    names = ["k with space", "k\r\n*3\r\n$4\r\nnewline", "ключ-é-😀", "L" * 100_000, "%s%d%%"]
    fields = {"acquired": 1, "f\r\n:1": 2, "é": -3, "big": 2**62}
    for name in names:
        for field, amount in fields.items():
            counters.count(redis_db, name, field, amount)
    counters.flush()
    written = {field.encode(): str(amount).encode() for field, amount in fields.items()}
    for name in names:
        assert redis_db.hgetall(name) == written, f"counters of {name[:20]!r}"
        assert redis_db.pttl(name) > 0
    redis_db.set("a string", "x")
    for name in ("first", "a string", "last"):
        counters.count(redis_db, name, "n")
    counters.flush()  # -WRONGTYPE between two integers: logged, best effort
    counters.count(redis_db, "first", "m")
    counters.flush()
    assert redis_db.hgetall("first") == {b"n": b"1", b"m": b"1"}
    assert redis_db.hgetall("last") == {b"n": b"1"}


# -------------------------------------------------------------------- a nested call's lock


def test_after_a_nested_call_the_run_still_sees_its_own_lock(redis_server: RedisServer, locks: redis.Redis) -> None:
    """A call nested in a run (``self(...)`` in the body) takes the lock of its own key; once it
    returned, the outer body's ``self.singleton`` is the outer run's lock again (its key and
    fencing token), not the nested call's, which was released."""
    app = Celery("nested", broker="memory://", set_as_current=False)
    app.conf.update(task_always_eager=True, task_eager_propagates=True,
                    singleton_redis_url=redis_server.url(LOCK_DB))

    @app.task(base=SingletonTask, bind=True, shared=False, unique_on=["x"])
    def job(self: SingletonTask, x: int, inner: bool = False) -> Any:
        if inner:
            return self.singleton_run.key, self.singleton_run.fence
        before = self.singleton_run.key, self.singleton_run.fence
        nested = self(x + 1, inner=True)
        after = self.singleton_run.key, self.singleton_run.fence
        return before, nested, after, read_holder(locks, before[0]) is not None

    try:
        before, nested, after, held = job.delay(1).get()
    finally:
        reset_clients()
    assert nested[0] != before[0], "the nested call held its own key"
    assert after == before, "the outer body sees its own lock again"
    assert held

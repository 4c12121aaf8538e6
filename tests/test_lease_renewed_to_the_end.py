"""A run's lease is renewed until its release is sent, however long the release waits (real redis-server).

In a gevent worker the runs share the lock client's pool (``max_connections``): a run
that ends while every connection is lent waits for one before its release is written.
The keeper used to stop renewing the lease as the run ended (``forget``), before that
wait: a wait longer than what was left of the lease's TTL let the lock expire, and the
release found it gone and counted the run lost, though it had held its lock to the end.
(A gevent worker holding about 3,000 leases under load lost hundreds that way.)

``test_a_release_that_waits_for_a_pooled_connection_finds_its_lock_held`` runs an eager
``SingletonTask`` in a gevent-patched child process whose lock pool has one connection.
The body lends that connection to another greenlet, which keeps it until either the lock
is gone from Redis (not renewed while the release waited: the old behaviour) or the
keeper renewed the lease twice more after the body returned; only then can the release
be written. The run must end released, not lost.

``test_a_lease_kept_late_is_due_one_interval_after_its_confirmation``: the same worker
may read an acquire's reply seconds after Redis set the key; the lease's first renewal
must be due a renewal interval after the acquire started, not after it was handed to
the keeper (a lease scheduled from then could expire before its first renewal).
"""

from __future__ import annotations

import os
import sys
import time

import redis
from celery import Celery

from celery_singleton_beat.lease.keeper import LeaseKeeper
from celery_singleton_beat.recovery.lock_redis import get_redis

from .support import TestProcess, importorskip
from .support.locking import take_leases
from .support.paths import ROOT
from .support.waiting import wait_for

CHILD = r"""
from gevent import monkey
monkey.patch_all()

import sys

import gevent
import redis
from celery import Celery

from celery_singleton_beat import SingletonTask
from celery_singleton_beat.connection.lending import borrow
from celery_singleton_beat.recovery.lock_redis import get_redis

url = sys.argv[1]
app = Celery("ending-renewed", set_as_current=False)
app.conf.update(singleton_redis_url=url, singleton_redis_options={"max_connections": 1},
                task_always_eager=True)
looker = redis.Redis.from_url(url)
seen = {}


def lend_the_pool(run, kept):
    # The pool's only connection, kept while the run's release waits for it: until the
    # lock is gone, or renewed twice after the run's end.
    pool = get_redis(app).connection_pool
    connection = borrow(pool)
    seen["lent"] = True
    renewals = kept.renewals
    while looker.exists(run.key) and kept.renewals < renewals + 2:
        gevent.sleep(0.01)
    seen["gone_while_waiting"] = not looker.exists(run.key)
    seen["renewed_while_waiting"] = kept.renewals - renewals
    pool.release(connection)


@app.task(base=SingletonTask, bind=True, lock_ttl=3)
def held(self):
    run = self.singleton_run
    kept = run  # the run is its lease's keeper entry
    seen["kept"] = kept
    gevent.spawn(lend_the_pool, run, kept)
    while not seen.get("lent"):
        gevent.sleep(0.01)
    seen["key"] = run.key


held.apply()
kept = seen["kept"]
print(f"RESULT lost={kept.lost} reason={kept.lost_reason!r} gone_while_waiting={seen['gone_while_waiting']} "
      f"renewed_while_waiting={seen['renewed_while_waiting']} left={looker.exists(seen['key'])}", flush=True)
"""


def test_a_release_that_waits_for_a_pooled_connection_finds_its_lock_held(redis_db: redis.Redis) -> None:
    importorskip("gevent")
    kwargs = redis_db.connection_pool.connection_kwargs
    url = f"redis://{kwargs['host']}:{kwargs['port']}/0"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = TestProcess("ending-renewed", [sys.executable, "-c", CHILD, url], env=env).start()
    try:
        line = child.wait_for_line("RESULT", timeout=120)
    finally:
        child.close()
    assert "lost=False" in line and "gone_while_waiting=False" in line, (
        f"the lease expired while the run's release waited for a pooled connection: {line}")
    assert "left=0" in line, f"the release did not free the lock: {line}"


def test_a_lease_kept_late_is_due_one_interval_after_its_confirmation(redis_db: redis.Redis) -> None:
    """A lease handed to the keeper some time after its acquire (its reply read late: a busy
    hub) is due for renewal one interval after the acquire's start, not one after ``keep``.

    The keeper's thread is kept from starting (marked running), so that its queue can be
    read as ``keep`` left it."""
    app = Celery("kept-late", set_as_current=False)
    kwargs = redis_db.connection_pool.connection_kwargs
    app.conf.singleton_redis_url = f"redis://{kwargs['host']}:{kwargs['port']}/0"
    [lease] = take_leases(get_redis(app), "kept-late", [3.0])
    keeper = LeaseKeeper()
    keeper._running = True  # no thread: its queue stays as keep() left it
    wait_for(lambda: time.monotonic() > lease.confirmed_at, timeout=5, message="the clock moved on")
    keeper.keep(lease)
    [(due, _, kept)] = keeper._queue
    assert kept.lease is lease
    assert due <= lease.confirmed_at + lease.renew_every, (
        f"first renewal due {due - lease.confirmed_at:.6f}s after the acquire started, "
        f"more than its renewal interval ({lease.renew_every}s)")

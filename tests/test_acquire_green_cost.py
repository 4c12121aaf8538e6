"""What an acquire does in a gevent worker besides its round trip, counted (real redis-server).

In a gevent worker every run's acquire goes through the hub thread's shared connection
(:mod:`celery_singleton_beat.connection.green`), one after another as the worker takes in
its messages; under eventlet, and for the other requests, through a pooled connection.
Python work per acquire is time added to every start (the leases benchmark's start
spread against plain Celery).
A py-spy profile of a 5,000-lease round showed per-acquire work that answers the same
question every time: ``isinstance`` against ``RedisCluster`` (``typing``'s protocol
check, twice per acquire), redis-py's deprecated-arguments wrapper around
``get_connection`` (which inspects the arguments of each call; none is passed), and the
look-up of the thread's own channel, which in a patched process is a greenlet's local,
new for each run, filled in only to find that green processes have no channel. So this is
counted, not timed: a gevent-patched child process takes locks through the library's
pooled path (the shared connection turned off, as under eventlet) or its shared
connection, and reports what the acquires called.
"""

from __future__ import annotations

import os
import sys

import pytest
import redis

from .support import TestProcess, importorskip
from .support.paths import ROOT

CHILD = r"""
from gevent import monkey
monkey.patch_all()

import collections
import sys
import uuid

import gevent
from celery import Celery

from celery_singleton_beat.connection import channels
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.lock_redis import get_redis

url, path = sys.argv[1], sys.argv[2]
if path == "pooled":  # the shared connection turned off: every acquire borrows from the pool
    import celery_singleton_beat.lease.lock as lock_module
    lock_module.green_channel_or_none = lambda client: None
app = Celery("acquire-green-cost", set_as_current=False)
app.conf.singleton_redis_url = url
client = get_redis(app)
spec = LockSpec(task="acquire-green-cost", ttl=60.0)
prefix = uuid.uuid4().hex
for n in range(5):  # the pool's connections made, the scripts and the server looked at
    assert acquire(client, f"singleton:{prefix}:warm:{n}", spec, f"warm-{n}").lease

calls = collections.Counter()


def profile(frame, event, arg):
    if event == "call":
        code = frame.f_code
        calls[(code.co_filename.replace("\\", "/"), code.co_name)] += 1


N = 50
sys.setprofile(profile)
taken = [acquire(client, f"singleton:{prefix}:counted:{n}", spec, f"run-{n}").lease for n in range(N)]
sys.setprofile(None)
assert all(taken)


def per_acquire(test):
    return sum(count for (path, name), count in calls.items() if test(path, name)) / N


def run_local():
    # a run's greenlet: a new greenlet-local, as for every task a gevent worker starts
    found = channels.channel_or_none(client)
    return found is None, getattr(channels._local, "channels", None) is not None


no_channel, local_filled = gevent.spawn(run_local).get()
print("RESULT "
      f"calls={per_acquire(lambda path, name: True):.2f} "
      f"deprecation_wrapper={per_acquire(lambda path, name: path.endswith('redis/utils.py')):.2f} "
      f"instance_checks={per_acquire(lambda path, name: name in ('__instancecheck__', '__subclasscheck__')):.2f} "
      f"reads={per_acquire(lambda path, name: '/redis/' in path and 'read_response' in name):.2f} "
      f"pool_calls={per_acquire(lambda path, name: '/redis/' in path and path.endswith('connection.py')):.2f} "
      f"no_channel={int(no_channel)} local_filled={int(local_filled)}", flush=True)
"""


def count_acquires(redis_db: redis.Redis, path: str) -> dict[str, float]:
    """The counts of one gevent-patched child's 50 acquires (after 5 not counted) on ``path``."""
    importorskip("gevent")
    kwargs = redis_db.connection_pool.connection_kwargs
    url = f"redis://{kwargs['host']}:{kwargs['port']}/0"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = TestProcess(f"acquire-green-cost-{path}", [sys.executable, "-c", CHILD, url, path], env=env).start()
    try:
        line = child.wait_for_line("RESULT", timeout=120)
        return {name: float(value) for name, value in (part.split("=") for part in line.split()[1:])}
    finally:
        child.close()


@pytest.fixture(params=["pooled", "shared"])
def counts(redis_db: redis.Redis, request: pytest.FixtureRequest) -> dict[str, float]:
    """The counts of one gevent-patched child's acquires, on either path."""
    return count_acquires(redis_db, request.param)


def test_an_acquire_on_the_shared_connection_skips_the_pools_lending(redis_db: redis.Redis) -> None:
    """On the shared connection an acquire makes no call into redis-py's pool (lending and
    giving back a connection): fewer Python calls than the pooled path's by that much."""
    pooled, shared = count_acquires(redis_db, "pooled"), count_acquires(redis_db, "shared")
    assert pooled["pool_calls"] >= 10, f"the pooled path borrows from redis-py's pool: {pooled}"
    assert shared["pool_calls"] == 0, f"an acquire on the shared connection borrowed a pooled one: {shared}"
    assert shared["calls"] < pooled["calls"] - pooled["pool_calls"] / 2, (pooled, shared)


def test_a_green_acquire_asks_no_class_question_again(counts: dict[str, float]) -> None:
    """Whether the client is a Cluster one is judged once per client class, and redis-py's
    argument check around ``get_connection`` is skipped (the library passes no argument)."""
    assert counts["instance_checks"] == 0, (
        f"each acquire made {counts['instance_checks']} isinstance protocol checks: {counts}")
    assert counts["deprecation_wrapper"] == 0, (
        f"each acquire went through redis-py's deprecated-arguments wrapper ({counts['deprecation_wrapper']} "
        f"calls of redis/utils.py per acquire): {counts}")


def test_a_run_in_a_green_process_makes_no_channel_state(counts: dict[str, float]) -> None:
    """In a patched process no client has a channel, and the thread-local is the greenlet's own:
    the look-up answers None without filling in a new greenlet's local for every run."""
    assert counts["no_channel"] == 1, counts
    assert counts["local_filled"] == 0, (
        f"channel_or_none filled in the run greenlet's local to find no channel: {counts}")


def test_a_green_acquire_reads_its_reply_without_redis_pys_parser(counts: dict[str, float]) -> None:
    """Acquires on borrowed connections make no call into redis-py's reply parser: their
    replies are read off the socket as a thread's channel reads its own (see
    ``tests/test_pooled_reads.py``)."""
    assert counts["reads"] == 0, (
        f"each green acquire read {counts['reads']} replies through redis-py's read_response: {counts}")

"""What an acquire does in a gevent worker besides its round trip, counted (real redis-server).

In a gevent worker every run's acquire goes through a pooled connection on the hub's
thread, one after another as the worker takes in its messages: Python work per acquire
is time added to every start (the leases benchmark's start spread against plain Celery).
A py-spy profile of a 5,000-lease round showed per-acquire work that answers the same
question every time: ``isinstance`` against ``RedisCluster`` (``typing``'s protocol
check, twice per acquire), redis-py's deprecated-arguments wrapper around
``get_connection`` (which inspects the arguments of each call; none is passed), and the
look-up of the thread's own channel, which in a patched process is a greenlet's local,
new for each run, filled in only to find that green processes have no channel. So this is
counted, not timed: a gevent-patched child process takes locks through the library's
pooled path and reports what the acquires called.
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

url = sys.argv[1]
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
      f"no_channel={int(no_channel)} local_filled={int(local_filled)}", flush=True)
"""


@pytest.fixture
def counts(redis_db: redis.Redis) -> dict[str, float]:
    """The counts of one gevent-patched child's 50 acquires (after 5 not counted)."""
    importorskip("gevent")
    kwargs = redis_db.connection_pool.connection_kwargs
    url = f"redis://{kwargs['host']}:{kwargs['port']}/0"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = TestProcess("acquire-green-cost", [sys.executable, "-c", CHILD, url], env=env).start()
    try:
        line = child.wait_for_line("RESULT", timeout=120)
        return {name: float(value) for name, value in (part.split("=") for part in line.split()[1:])}
    finally:
        child.close()


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

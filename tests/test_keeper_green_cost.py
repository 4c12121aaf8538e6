"""What the keeper does per lease it renews in a gevent worker, counted (real redis-server).

In a gevent worker the keeper is a real OS thread beside the hub (see
``celery_singleton_beat.native``): the two share the interpreter lock, so every
bit of Python work the keeper does per lease it renews is work the hub waits for
while the worker takes in its next messages and starts their runs. A worker
holding a thousand leases renews a thousand a second: work that is constant per
renewed lease, but grows with the leases held, slowed every start. So this is
counted, not timed: each test runs a gevent-patched child process that holds
leases and renews them through the keeper, and reports counts.

* ``test_the_keeper_looks_up_the_original_thread_functions_once_not_per_lease``: the
  keeper's own client in a green process is found from the OS thread's identity
  (the unpatched ``_thread.get_ident``); it must be looked up once, not for every lease
  of every renewal (gevent's ``monkey.get_original``, which built a class each time:
  most of the keeper's time at 5,000 leases).
* ``test_the_keepers_python_calls_per_renewed_lease_stay_within_a_budget``: the Python
  calls the keeper makes per lease in a shared renewal after the lease's first one (the
  difference between a batch of 200 and one of 20, over 180) stay under
  :data:`CALLS_PER_LEASE`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import redis

from .support import TestProcess, importorskip
from .support.paths import ROOT

#: Python calls (``sys.setprofile`` "call" events) the keeper may make per lease it renews
#: in a shared request: building its command, judging its reply, confirming it, counting it
#: and scheduling it again. Today's code makes about 24 (the code of 2026-12-02 made about 71).
CALLS_PER_LEASE = 30

CHILD = r"""
from gevent import monkey
monkey.patch_all()

import sys

from celery import Celery

from celery_singleton_beat.lease.keeper import KeptLease, LeaseKeeper
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.lock_redis import get_redis

url = sys.argv[1]
app = Celery("green-cost", set_as_current=False)
app.conf.singleton_redis_url = url
client = get_redis(app)
leases = [acquire(client, f"singleton:green-cost:{n}", LockSpec(task="green-cost", ttl=60.0), f"run-{n}").lease
          for n in range(221)]
assert all(leases)
keeper = LeaseKeeper()
kept = [KeptLease(lease, None) for lease in leases]


def renew_round(batch):
    # One renewal round of the keeper over batch (as tests.support.locking.renew_round).
    buckets = []
    done = keeper.renewer.renew_round(batch, buckets)
    return done + [(each, due) for due, group in buckets for each in group]


renew_round(kept)  # two first rounds, not counted: the keeper's own client is made,
renew_round(kept)  # and each lease's renewal spelt for the server it learnt of

looked_up = [0]
original_get_original = monkey.get_original


def counting_get_original(*args, **kwargs):
    looked_up[0] += 1
    return original_get_original(*args, **kwargs)


monkey.get_original = counting_get_original
calls = [0]


def profile(frame, event, arg):
    if event == "call":
        calls[0] += 1


def counted(batch):
    before = calls[0]
    sys.setprofile(profile)
    try:
        renew_round(batch)
    finally:
        sys.setprofile(None)
    return calls[0] - before


small = counted(kept[1:21])
large = counted(kept[21:221])
print(f"RESULT small={small} large={large} looked_up={looked_up[0]} "
      f"renewed={sum(k.renewals for k in kept)} lost={sum(k.lost for k in kept)} batches={keeper.batches}",
      flush=True)
"""


@pytest.fixture
def counts(redis_db: redis.Redis) -> Iterator[dict[str, int]]:
    """The counts of one child process's renewals: 221 leases renewed twice, then 20 of them and
    the 200 others again, counted (the leases of a worker are renewed every few seconds)."""
    importorskip("gevent")
    kwargs = redis_db.connection_pool.connection_kwargs
    url = f"redis://{kwargs['host']}:{kwargs['port']}/0"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = TestProcess("green-cost", [sys.executable, "-c", CHILD, url], env=env).start()
    try:
        line = child.wait_for_line("RESULT", timeout=120)
        yield {name: int(value) for name, value in (part.split("=") for part in line.split()[1:])}
    finally:
        child.close()


def test_the_keeper_looks_up_the_original_thread_functions_once_not_per_lease(counts: dict[str, int]) -> None:
    assert counts["renewed"] == 2 * 221 + 220 and counts["lost"] == 0, counts
    assert counts["batches"] == 4, "the 221 (twice), the 20 and the 200 leases each went out in one request"
    assert counts["looked_up"] == 0, (
        f"the keeper looked up gevent's original thread functions {counts['looked_up']} times while it "
        f"renewed 220 leases: it should have kept them from its first round")


def test_the_keepers_python_calls_per_renewed_lease_stay_within_a_budget(counts: dict[str, int]) -> None:
    per_lease = (counts["large"] - counts["small"]) / 180
    assert per_lease <= CALLS_PER_LEASE, (
        f"the keeper made {per_lease:.1f} Python calls per lease it renewed (budget {CALLS_PER_LEASE}); "
        f"{counts}")

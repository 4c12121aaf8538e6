"""Adversarial attacks on releases sent again (:mod:`.releases`, the keeper) and on the
release at a run's end, each against a real redis-server.

A reviewer who did not write the change tried to break its promises. Two broke (both
fixed since; each test failed before):

* a release whose ``-BUSY`` reply is read only as the process ends (a run whose end no
  one sees writes its release and reads the reply later) was handed to the keeper *after*
  the exit's sending of pending releases ran: it was never sent, the lock stayed until its
  TTL and the done marker was never written, although a process that ends is promised to
  keep sending for up to ``EXIT_PATIENCE`` seconds (at ``atexit`` and at a prefork
  child's ``worker_process_shutdown`` alike);
* an ending process whose lock Redis is stopped (SIGSTOP: a frozen VM, a paused
  container) blocked its exit a full socket timeout per pending release, past
  ``EXIT_PATIENCE``: the patience was looked at only between sendings.

Attacks that held, kept because they reach paths no other test reaches:

* a release sent again after its lease ended, while the next holder holds the key: that
  holder's lock stays, and the done marker is still written;
* a release sent again across a restart that lost the data (no append-only file): the
  process's epoch grows and its holders are asked to put their locks back, but the run
  that released (its lease forgotten) never gets its lock back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_singleton_beat.lease.behalf import read_holder
from celery_singleton_beat.lease.holder import done_key
from celery_singleton_beat.lease.keeper import LeaseKeeper
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.server import server_of
from celery_singleton_beat.recovery.window import mark_in_use

from .support import ROOT, RedisServer, wait_for

KEY = "singleton:{adversary-release:k}"


def quick_client(server: RedisServer, timeout: float = 1.0) -> redis.Redis:
    """A client whose every attempt fails within ``timeout`` (no redis-py retries)."""
    return server.client(socket_connect_timeout=timeout, socket_timeout=timeout, retry=Retry(NoBackoff(), 0))


# -------------------------------------------------------------------- 1. a -BUSY reply read at exit

#: A process that ends right after a run's release was written (``release_soon``, the
#: path of a run whose end no one sees), its reply unread: at ``atexit`` (``sys.exit``)
#: or as a prefork child does (``worker_process_shutdown``, then ``os._exit``). The
#: flusher thread is kept from reading the reply first (it would after FLUSH_AFTER).
ENDING = """
import logging, os, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
import celery_singleton_beat.connection.flusher as flusher
flusher.FLUSH_AFTER = 3600.0
from celery_singleton_beat.task import worker
from celery_singleton_beat.lease.keeper import get_keeper
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.task.task import SingletonTask
import redis
url, key, how = sys.argv[1:]
lease = acquire(redis.Redis.from_url(url), key, LockSpec(task="t", ttl=30.0), "run-1").lease
kept = get_keeper().keep(lease)
sys.stdin.readline()  # the lock Redis is busy now
get_keeper().forget(kept)  # the run ends (SingletonTask._end)
def on_result(released, error):
    if error is not None:
        SingletonTask._release_again("t", "run-1", kept, 60.0, error)
assert lease.release_soon(on_result, done_ttl=60.0)
if how == "prefork":
    worker._flush_at_child_exit()
    os._exit(0)
sys.exit(0)
"""


@pytest.mark.parametrize("how", ["atexit", "prefork"])
def test_a_release_answered_busy_and_read_only_at_exit_is_still_sent_again_before_the_process_ends(
        how: str, make_redis: Callable[..., RedisServer],
        busy_script: Callable[[RedisServer], Callable[[], None]]) -> None:
    """The lock Redis stays busy through the whole exit: a process that keeps sending its
    pending releases for ``EXIT_PATIENCE`` seconds ends with "gave up releasing" (or
    "released lock", had Redis answered); one that never sends it again says neither."""
    server = make_redis()
    mark_in_use(server.client())
    locks = server.client()
    child = subprocess.Popen([sys.executable, "-c", ENDING, server.url(0), KEY, how], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_for(lambda: locks.exists(KEY) or child.poll() is not None, timeout=30, message="the child's lock")
        kill = busy_script(server)
        _, err = child.communicate("go\n", timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    kill()
    assert child.returncode == 0, err
    assert "could not release" in err and "BUSY" in err, f"the -BUSY reply read as the process ended:\n{err}"
    assert "gave up releasing lock" in err or "released lock" in err, (
        f"the release that got -BUSY was never sent again before the process ended:\n{err}")


# -------------------------------------------------------------------- 2. an exit on a stopped server


def test_an_ending_process_never_waits_past_its_patience_for_a_stopped_lock_redis(
        make_redis: Callable[..., RedisServer]) -> None:
    """Each sending to a stopped server cannot return before its socket timeout: the exit
    is bounded by the patience only if a sending is cut at the deadline."""
    server = make_redis()
    mark_in_use(server.client())
    timeout, patience = 1.0, 0.5
    client = quick_client(server, timeout)
    leases = [acquire(client, f"singleton:{{adversary-release:{i}}}", LockSpec(task="t", ttl=30.0), f"run-{i}").lease
              for i in range(3)]
    keeper = LeaseKeeper()
    os.kill(server.pid, signal.SIGSTOP)
    try:
        for lease in leases:
            assert lease is not None
            keeper.retry_release(lease, done_ttl=60.0)
        started = time.monotonic()
        keeper.send_pending_releases(patience=patience)
        waited = time.monotonic() - started
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert not keeper.pending_releases
    assert waited < patience + timeout, f"the exit waited {waited:.1f}s for a patience of {patience}s"


# -------------------------------------------------------------------- 3. the next holder's lock


def test_a_release_sent_again_after_its_lease_ended_leaves_the_next_holders_lock_and_writes_the_done_marker(
        make_redis: Callable[..., RedisServer]) -> None:
    """Run ``run-1``'s release got no answer; its lease (1 s) ended, the lock expired and
    ``run-2`` holds the key when the keeper sends it again: ``run-2``'s lock stays
    (the compare-and-delete sees another value) and ``run-1``'s done marker is written
    (it is still owed to a copy of its message)."""
    server = make_redis()
    mark_in_use(server.client())
    locks = server.client()
    spec = LockSpec(task="t", ttl=1.0)
    first = acquire(locks, KEY, spec, "run-1").lease
    assert first is not None
    wait_for(lambda: not locks.exists(KEY), timeout=10, message="run-1's lock expired")
    second = acquire(locks, KEY, LockSpec(task="t", ttl=30.0), "run-2").lease
    assert second is not None and time.monotonic() > first.valid_until
    keeper = LeaseKeeper()
    pending = keeper.retry_release(first, done_ttl=60.0)
    wait_for(lambda: not pending.active, timeout=10, message="the keeper sending run-1's release again")
    assert pending.attempts >= 1
    holder = read_holder(locks, KEY)
    assert holder is not None and holder.raw == second.value, "run-2's lock left in place"
    assert locks.exists(done_key(KEY, "run-1")), "run-1's done marker written"
    assert not keeper.pending_releases


# -------------------------------------------------------------------- 4. a restart that lost the data


def test_a_release_sent_again_across_a_restart_that_lost_the_data_never_puts_the_released_lock_back(
        make_redis: Callable[..., RedisServer]) -> None:
    """The run ends and forgets its lease; its release fails (the lock Redis is down) and the
    keeper sends it again. The server comes back empty (no append-only file): the
    keeper's own connection finds the data lost (the epoch grows: every kept lease of
    the process is renewed at once, put back where gone). The release then runs (the
    lock gone already, the done marker written), and the run that released never gets
    its lock back."""
    server = make_redis()
    mark_in_use(server.client())
    client = quick_client(server)
    keeper = LeaseKeeper()
    lease = acquire(client, KEY, LockSpec(task="t", ttl=30.0), "run-1").lease
    assert lease is not None
    kept = keeper.keep(lease)
    epoch = server_of(client).epoch
    server.kill()
    keeper.forget(kept)  # the run ends (SingletonTask._end), then releases
    with pytest.raises(redis.ConnectionError):
        lease.release(done_ttl=60.0)
    pending = keeper.retry_release(lease, done_ttl=60.0)
    server.start()
    locks = server.client()
    wait_for(lambda: not pending.active, timeout=20, message="the release sent once the server is back")
    assert server_of(client).epoch > epoch, "the process found its data lost (its holders put locks back)"
    assert locks.exists(done_key(KEY, "run-1")), "the done marker written"
    wakeups = keeper.wakeups
    wait_for(lambda: keeper.wakeups >= wakeups + 2, timeout=10, message="the keeper looking at its queue again")
    assert not locks.exists(KEY), "the released lock was put back"
    assert kept.renewals == 0 and not kept.lost

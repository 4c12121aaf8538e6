"""Adversarial attacks on the lock core, each against a real redis-server.

Each test names one attack, by a reviewer who did not write the lock core. The first
two broke a promise of ``docs/guarantees.md`` (both fixed since; each failed before):

* a done marker written by a run that a cold shutdown cut short (billiard raises
  ``SystemExit`` into the body): the redelivered message was then never run;
* a restart of a server with an append-only file that came back empty (AOF switched
  on at the restart, or its files lost): only the first process to reach it put its
  locks back, every other one trusted the append-only file.

The others are attacks that held, kept because they reach a path no other test reaches:

* an exception raised asynchronously into a thread (``PyThreadState_SetAsyncExc``, as
  thread-pool time limits and debuggers do) that lands once the reply has arrived,
  between the socket read and the parser;
* a release the keeper sends again while the lock Redis is down: it gives up at the
  lease's end and never writes anything afterwards;
* a contender whose wall clock is two days ahead and runs ten times too fast, against
  a live holder whose liveness key is gone.
"""

from __future__ import annotations

import ctypes
import json
import linecache
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_singleton_beat.connection.channels import channel_for
from celery_singleton_beat.lease.behalf import read_holder
from celery_singleton_beat.lease.commands import look_request
from celery_singleton_beat.lease.executor import execute
from celery_singleton_beat.lease.keeper import LeaseKeeper
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.server import server_of
from celery_singleton_beat.recovery.window import NEW_OR_EMPTIED, mark_in_use

from .support import ROOT, RedisServer, require, wait_for
from .support.keeps_lock import entries, knobs, load_app, wait_started, worker
from .support.locking import renew

KEY = "singleton:{adversary:k}"
HELD = "singleton:{adversary:held}"


def worker_spec(boot: str, *, ttl: float = 30.0, liveness_ttl: float = 10.0) -> LockSpec:
    """A worker's run lock: live, take-overs of dead holders allowed."""
    return LockSpec(task="adversary", ttl=ttl, boot=boot, live=True, liveness_ttl=liveness_ttl,
                    liveness_prefix="singleton")


@pytest.fixture
def app_env() -> Iterator[dict[str, str]]:
    yield from knobs()


# -------------------------------------------------------------------- 1. a cold shutdown's done marker


def test_a_run_cut_short_by_a_cold_shutdown_runs_again_when_its_message_comes_back(
        redis_db: redis.Redis, redis_server: RedisServer, records: redis.Redis, locks: redis.Redis,
        app_env: dict[str, str]) -> None:
    """``docs/guarantees.md``: "A run cut short (its worker killed mid-run) runs again from the
    start when its message is redelivered (``acks_late``)". An ``acks_late`` run is mid-body
    when its worker gets a cold shutdown; the worker gives the message back (the log says
    so), and a new worker must run it."""
    app = load_app(redis_server, **app_env)
    first = worker(redis_server, "cold", app_env)
    records.set("hold:cold-k", "1")  # the body runs until this key goes
    result = app.hold.apply_async(("cold-k",), queue="cold")
    wait_started(records, "cold-k", result)
    first.signal(signal.SIGQUIT)  # Celery's cold shutdown: the pool child is terminated mid-run
    first.wait_for_log("Restoring 1 unacknowledged message", timeout=30)
    wait_for(lambda: not first.running, timeout=30, message="the first worker gone")
    # The body ends only once hold:cold-k is gone, and it is still there: the run was cut short.
    first.wait_for_line(result.id, "terminated", timeout=10)
    records.delete("hold:cold-k")
    deliveries = len(entries(records, "calls:cold-k"))
    worker(redis_server, "cold2", app_env, queues="cold")
    wait_for(lambda: len(entries(records, "calls:cold-k")) > deliveries, timeout=30,
             message="the redelivered message decided whether to run")
    done = [key for key in locks.scan_iter("*:done:*") if key.decode().endswith(result.id)]
    runs = [e for e in entries(records, "started:cold-k") if e["task_id"] == result.id]
    assert len(runs) == 2, (f"the run cut short was not run again: its redelivery found the done marker "
                            f"{done} written by the interrupted run and ended 'already completed'")


# -------------------------------------------------------------------- 2. an AOF server back empty


def test_a_server_with_an_append_only_file_back_empty_gets_every_holders_lock_back(
        make_redis: Callable[..., RedisServer]) -> None:
    """Two processes (each client has its own record of the servers it saw, as a process
    has): the holder ``a`` and a contender ``b``. The server has an append-only file;
    it is killed and comes back with none (a new volume), so it holds no lock. ``b``
    reaches it first (its check opens the window: no record of the server); then the
    holder renews. The holder must put its lock back, and ``b`` must be refused."""
    server = make_redis("--appendonly", "yes")
    a, b = server.client(), server.client()
    lease = acquire(a, KEY, worker_spec("a-boot"), "a").lease
    assert lease is not None
    warm = acquire(b, HELD, worker_spec("b-boot"), "warm").lease  # b has seen this server too
    assert warm is not None and warm.release() is True
    server.kill()
    shutil.rmtree(server.dir / "appendonlydir")  # the append-only file is gone with its volume
    server.start()
    assert server.client().info("persistence")["aof_enabled"] == 1
    assert execute(b, KEY, lambda info: look_request(KEY)).current is None  # b's check: the lock is gone
    assert server_of(b).recovery().open and server_of(b).recovery().reason == NEW_OR_EMPTIED
    put_back = renew(lease)  # the holder's keeper, at its next renewal (within the window)
    taken = acquire(b, KEY, worker_spec("b-boot"), "b")  # waits for the window, then asks
    assert not taken.acquired, (f"b took the key while the holder runs (put back: {put_back}; holder's "
                                f"epoch {server_of(a).epoch}, lease's {lease.epoch})")
    assert put_back and read_holder(server.client(), KEY).raw == lease.value


# -------------------------------------------------------------------- 3. an asynchronous exception


class Interrupted(Exception):
    """Raised into a thread by PyThreadState_SetAsyncExc."""


def innermost(exc: BaseException) -> str:
    """Where ``exc`` was raised: the innermost frame's module and function."""
    tb = exc.__traceback__
    assert tb is not None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"{os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_frame.f_code.co_name}"


def blocked_in_recv(thread: threading.Thread) -> bool:
    """Whether ``thread`` is blocked in the lock connection's socket read (its innermost
    frame is ``wire.py``'s ``_receive``, on the line of the ``recv`` call)."""
    assert thread.ident is not None
    frame = sys._current_frames().get(thread.ident)
    if frame is None or frame.f_code.co_name != "_receive" or not frame.f_code.co_filename.endswith("wire.py"):
        return False
    return "recv(" in linecache.getline(frame.f_code.co_filename, frame.f_lineno)


def raise_in(thread: threading.Thread, error: type[BaseException]) -> None:
    assert thread.ident is not None
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(error))
    assert done == 1, "the exception was set in exactly one thread"


def test_an_async_exception_landing_after_the_reply_arrived_leaves_no_reply_to_the_next_request(
        make_redis: Callable[..., RedisServer]) -> None:
    """A thread's acquire waits on a paused server (``CLIENT PAUSE WRITE``); an exception is
    set into it with ``PyThreadState_SetAsyncExc``, which cannot interrupt the blocking
    ``recv``: it lands on the first bytecode after the reply arrived, in the channel's
    socket read, with the reply's bytes taken from the socket and not parsed (or parsed
    and not counted). The thread's next acquire, of a key another holds, must be told
    so, not read a stale reply; and the interrupted acquire's own key is not left held
    by a value nobody renews without it being known: the caller got the exception."""
    server = make_redis()
    admin, other = server.client(), server.client()
    mark_in_use(admin)  # a server of this test's own: no recovery window to wait for
    assert acquire(other, HELD, worker_spec("other"), "theirs").acquired
    client = server.client()
    outcomes: list[Any] = []
    ready, paused, go_on = threading.Event(), threading.Event(), threading.Event()

    def thread_body() -> None:
        assert acquire(client, "singleton:{adversary:warm}", worker_spec("t"), "warm").acquired  # channel up
        ready.set()
        paused.wait(30)
        try:
            acquire(client, KEY, worker_spec("t"), "interrupted")
            outcomes.append("returned")
        except Interrupted as exc:
            outcomes.append(innermost(exc))
        go_on.wait(30)
        result = acquire(client, HELD, worker_spec("t"), "next")
        outcomes.append((result.acquired, result.holder.task_id if result.holder else None))
        outcomes.append(channel_for(client).outstanding)

    thread = threading.Thread(target=thread_body, daemon=True)
    thread.start()
    assert ready.wait(30)
    admin.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    try:
        paused.set()
        wait_for(lambda: any(c.get("cmd") == "set" and "b" in c.get("flags", "") for c in admin.client_list()),
                 timeout=10, interval=0.005, message="the acquire held back by the pause")
        # The server holding the command back does not mean the thread has reached its read
        # (on a loaded machine it may still be in the bytecode behind the write).
        wait_for(lambda: blocked_in_recv(thread), timeout=10, interval=0.005,
                 message="the acquiring thread blocked in its socket read")
        raise_in(thread, Interrupted)  # pending: lands once recv returns
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    try:
        wait_for(lambda: outcomes, timeout=10, message="the interrupted acquire to end")
    finally:
        go_on.set()  # the thread ends within the test, whatever happened
        thread.join(30)
    # It landed in the lock connection's read, the reply's bytes received: in the socket
    # read itself, or in the parsing right behind it (with hiredis, a C parser: no bytecode).
    assert outcomes[0] in ("wire.py:_receive", "wire.py:read_many"), f"landed elsewhere: {outcomes[0]}"
    assert outcomes[1] == (False, "theirs"), f"the next acquire read a reply that was not its own: {outcomes}"
    assert outcomes[2] == 0


# -------------------------------------------------------------------- 4. the keeper's release gives up


def test_a_release_sent_again_while_redis_is_down_gives_up_at_the_leases_end_and_writes_nothing_later(
        make_redis: Callable[..., RedisServer], caplog: pytest.LogCaptureFixture) -> None:
    """The run's release (no done marker owed: not ``acks_late``) got no answer and the lock
    Redis stays down: the keeper sends it again until the lease's ``valid_until``, then
    gives up (an error line says so), and when the server is back later the keeper sends
    nothing more. (A release that owes a done marker is sent for longer:
    ``tests/test_release_retry.py``.)"""
    server = make_redis("--appendonly", "yes")
    mark_in_use(server.client())  # a server of this test's own: no recovery window to wait for
    # Each attempt fails at once (redis-py's own connect retries would take seconds).
    client = server.client(socket_connect_timeout=1, socket_timeout=1, retry=Retry(NoBackoff(), 0))
    lease = acquire(client, KEY, worker_spec("a", ttl=2.0), "a").lease
    assert lease is not None
    server.kill()
    keeper = LeaseKeeper()
    caplog.set_level(logging.ERROR, logger="celery_singleton_beat")
    pending = keeper.retry_release(lease, done_ttl=None)
    wait_for(lambda: not pending.active, timeout=30, message="the keeper giving the release up")
    gave_up = [r for r in caplog.records if "gave up releasing lock" in r.getMessage()]
    assert gave_up and pending.attempts >= 2, f"sent again until the lease's end: {pending.attempts} attempt(s)"
    assert not keeper.pending_releases
    server.start()
    check = server.client()
    attempts = pending.attempts
    # The keeper wakes on its own at least every IDLE_LOOK: give it two looks with Redis up.
    wakeups = keeper.wakeups
    wait_for(lambda: keeper.wakeups >= wakeups + 2, timeout=10, message="the keeper looking at its queue again")
    assert pending.attempts == attempts, "nothing sent after the give-up"
    assert check.ping()


# -------------------------------------------------------------------- 5. a contender with a skewed, fast clock


#: Run under faketime: try to take KEY (a worker's spec with take-overs) until told to stop.
CONTENDER = """
import json, sys, time
import redis
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
client = redis.Redis.from_url(sys.argv[1])
spec = LockSpec(task="adversary", ttl=30.0, boot="skewed", live=True, liveness_ttl=3.0,
                liveness_prefix="singleton")
tries, taken = 0, []
while not client.exists("adversary:stop"):
    result = acquire(client, sys.argv[2], spec, f"skewed-{tries}")
    tries += 1
    client.set("adversary:tries", tries)
    if result.acquired:
        taken.append(result.lease.fence)
        result.lease.release()
print(json.dumps({"tries": tries, "taken": taken, "wall": time.time()}))
"""


def test_a_contender_whose_clock_is_ahead_and_fast_never_takes_over_a_renewing_holder(
        make_redis: Callable[..., RedisServer]) -> None:
    """The holder renews (every second: liveness TTL 3 s) but its liveness key never exists,
    the first condition of a take-over. A contender runs under ``faketime '+2d x10'``: its
    wall clock two days ahead and every clock, monotonic included, ten times too fast, so
    its watch of :data:`TAKEOVER_WAIT` lasts a tenth of a second. The take-over rests on the
    lock's remaining TTL on the server's clock: it never takes the lock."""
    faketime = require("faketime")
    server = make_redis()
    client = server.client()
    mark_in_use(client)  # a server of this test's own: no recovery window to wait for
    lease = acquire(client, KEY, worker_spec("holder", liveness_ttl=3.0), "holder").lease
    assert lease is not None
    keeper = LeaseKeeper()
    kept = keeper.keep(lease)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("FAKETIME_DONT_FAKE_MONOTONIC", None)
    contender = subprocess.Popen([faketime, "-f", "+2d x10", sys.executable, "-c", CONTENDER,
                                  server.url(), KEY], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
    try:
        # Three renewals while the contender tries, or the lock lost (taken): either way it is
        # decided. Counted from the contender's first try: a Python started under faketime on
        # a loaded machine can take longer to import than three renewals.
        wait_for(lambda: client.exists("adversary:tries") or contender.poll() is not None, timeout=60,
                 message="the contender's first try")
        renewed = kept.renewals
        wait_for(lambda: kept.renewals >= renewed + 3 or kept.lost, timeout=30, message="three renewals or a loss")
        client.set("adversary:stop", "1")
        out, err = contender.communicate(timeout=30)
    finally:
        keeper.forget(kept)
        if contender.poll() is None:
            contender.kill()
            contender.wait()
    assert contender.returncode == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["wall"] > time.time() + 86_400, "the contender's clock was skewed"
    assert seen["tries"] > 3, "the contender tried all along"
    assert seen["taken"] == [], f"the contender took a renewing holder's lock {len(seen['taken'])} time(s)"
    assert not kept.lost and read_holder(client, KEY).raw == lease.value

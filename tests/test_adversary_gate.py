"""Adversarial review of the opening gate of :func:`.connection.lending.borrow` (commit
9dc4445): a request that finds no idle connection while another's opening is young waits
for a connection instead of opening its own. Real redis-servers; faults from connection
subclasses, a silent listener (accepts, never answers) and injected exceptions.

Attacks, and what they found:

1. A silent server (TCP accepted, no reply: a stopped or frozen redis-server): **BROKE**
   (left as a strict xfail: a tuning choice for the maintainers). Openings are paced, one
   per :data:`~.lending.OPEN_PATIENCE` from the latest one's start, so the k-th waiter opens
   after k x 50 ms, or once the first opening times out: every request beyond the first
   ``socket_timeout / 50 ms`` waits for the first opening's full timeout, then opens its own
   and waits a full timeout again. 40 requests, 0.2 s connect and 1 s read timeouts (a
   request bound of 1.2 s): before, each one was answered after about 1.0 s; now 20 of them
   after about 2.0 s, past the bound. With the default options (5 s and 5 s) a burst of runs
   against a frozen Redis is told "Redis unavailable" after about 10 s instead of 5 s.
   ``test_requests_behind_a_silent_server_start_their_openings_before_the_first_times_out``.
2. A burst after the pool's idle connections were dropped (a Redis restart, an outage's
   end: every request that failed gave its connection back disconnected; redis-py 8.2 puts
   a connection whose connect failed back among the idle ones too): **BROKE**, fixed. The
   gate looked only at whether an idle connection existed, not whether it was connected:
   each request took an idle, disconnected one and opened it, ungated: 40 openings at once
   where a fresh pool's burst opened about 5. Now a request whose pick would be a
   disconnected connection goes through the gate (that is an opening).
   ``test_a_burst_after_the_idle_connections_were_dropped_opens_them_one_after_another``.
3. An exception raised by a signal handler (a prefork soft time limit, SIGINT) at a call's
   return inside ``_open``: **BROKE**, fixed. It could land after ``count += 1`` and before
   the ``try`` (at ``time.monotonic()``'s return), or in the failure handler before the
   decrement (at ``pool_is_full()``'s return): the count stayed up for the life of the pool,
   so after every later opening the gate held requests back for 50 ms with nothing being
   opened. Now the count is raised right before the ``try`` and lowered first thing.
   ``test_an_exception_at_any_call_return_in_an_opening_leaves_no_opening_counted``.
4. ``gevent.Timeout``/a kill raised into the opener mid-connect while others wait: held
   (the count comes back down, the waiters open their own).
   ``test_a_greenlet_killed_while_opening_releases_the_waiting_ones``.
5. OS threads hammering one small pool (``max_connections`` reached, the gate and the
   full-pool wait mixed): held (every request answered, nothing left counted).
   ``test_threads_on_a_full_pool_leave_no_opening_counted``.
6. ``BlockingConnectionPool`` (no ``_available_connections``): held, never gated.
7. A fork while another thread of the parent is opening a connection of a pool:
   **BROKE**, fixed. The child inherited the count (and the module's lock and conditions,
   as held as they were): redis-py's pool starts afresh in the child, but the gate stayed up
   for its whole life, so the child, one thread, waited for an opening nobody was making
   (twice in two borrowings). The library's own clients are rebuilt per pid (so their pools
   are new in a child); a pool a user's code keeps across a fork is not. Now the lending
   state starts afresh in a forked child.
   ``test_a_child_forked_while_a_thread_opens_waits_for_no_opening``.
8. A burst after a Redis restart while the pool's connections were idle: **BROKE** (left
   as a strict xfail). Those connections keep their socket (holding the server's EOF), so
   they look ready to the gate; redis-py finds each dead as it lends it and reopens it, outside
   the gate: 40 threads reopened 40 connections at once where a fresh pool's burst opened 2.
   (Attack 2's fix covers connections dropped on our side, not these.) A fix would have to
   tell a dead idle connection before lending it (``can_read()`` of the pool's next idle
   connection: a poll per borrowing, only worth it while the gate is up) or count every
   lending as an opening until redis-py's check of it is done.
   ``test_a_burst_after_a_restart_reopens_the_idle_connections_one_after_another``.
9. A full pool (``max_connections`` lent) under gevent: **BROKE**, fixed. A request that
   finds no idle connection goes through ``_open``; the pool-full error there woke *every*
   waiter (as a failed opening does), each of which looked again, found the pool full and
   woke every other: a storm of looks for as long as the pool stays full. 100 greenlets
   on 4 connections, each held 0.1 s: 133,665 looks at the pool for 204 reasons to look
   (give-backs, openings, first looks; no wait ever timed out), the hub busy the whole
   2.6 s (2.58 s of CPU against 0.12 s before the change: heartbeats and lease renewals of
   the worker's other greenlets starve). Now a full pool wakes nobody (a give-back wakes
   one) and leaves ``failed`` as it was (nothing was opened).
   ``test_waiters_of_a_full_pool_look_again_only_when_woken_for_a_reason``.
10. A Sentinel pool (the library's, asking the sentinels as it lends): held, gated and
    answered. ``test_a_burst_on_a_sentinel_pool_is_gated_and_answered``.
11. Held by reading: the lease keeper's native thread in a gevent worker borrows from a
    client of its own (``thread_client``), never from the greenlets' pool; a waiter is never
    left unwoken (each wait is at most 50 ms); a waiter that is interrupted holds no count.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_singleton_beat.connection import lending

from .support import RedisServer, TestProcess, importorskip, wait_for
from .support.loopback import close_socket
from .support.paths import ROOT


class SilentServer:
    """A listener that accepts connections and never answers (a frozen redis-server)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
        self.port: int = self.listener.getsockname()[1]
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, name="silent-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.accepted.append(sock)

    def close(self) -> None:
        close_socket(self.listener)
        for sock in self.accepted:
            close_socket(sock)


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.close()


# ----------------------------------------------------------------- 1. a silent server

#: Requests borrowing at once from the silent server's pool.
BEHIND_SILENCE = 40


class StampedOpening(redis.Connection):
    """A connection noting when each opening of the test begins."""

    began: list[float]

    def connect(self) -> None:
        if self._sock is None:
            StampedOpening.began.append(time.monotonic())
        super().connect()


@pytest.mark.xfail(strict=True, reason=(
    "openings are paced one per OPEN_PATIENCE behind a silent server: requests beyond the "
    "first socket_timeout/50ms wait for the first opening's full timeout, then open their own "
    "(about twice the request bound); see attack 1 of the module"))
def test_requests_behind_a_silent_server_start_their_openings_before_the_first_times_out(
        silent: SilentServer) -> None:
    """40 threads borrow at once from a pool of a server that accepts and never answers
    (1 s read timeout, 0.2 s connect timeout: a request bound of 1.2 s). Each one's request
    fails on the server's silence; none should have waited for another's opening to time out
    before starting its own (which then takes a full timeout more)."""
    StampedOpening.began = []
    pool = redis.ConnectionPool(connection_class=StampedOpening, port=silent.port, socket_connect_timeout=0.2,
                                socket_timeout=1.0, max_connections=64)
    answered: list[tuple[float, Any]] = []

    def request() -> None:
        try:
            lending.borrow(pool)
        except Exception as exc:  # the outcome under test
            answered.append((time.monotonic(), exc))

    threads = [threading.Thread(target=request, name=f"silent-{i}", daemon=True) for i in range(BEHIND_SILENCE)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    pool.disconnect()
    assert len(answered) == BEHIND_SILENCE
    assert all(isinstance(exc, redis.TimeoutError) for _, exc in answered), answered
    first_answer = min(at for at, _ in answered)
    late = [began for began in StampedOpening.began if began > first_answer]
    assert not late, (f"{len(late)} of {BEHIND_SILENCE} requests began their opening only after the first "
                      "opening timed out (each then waits a full timeout more)")


# ----------------------------------------------------------------- 2. a burst after the connections dropped

#: Greenlets in each burst.
BURST = 40

RECONNECT_BURST = r"""
from gevent import monkey
monkey.patch_all()

import sys
import gevent
import redis
from celery_singleton_beat.connection import lending

port, N = int(sys.argv[1]), int(sys.argv[2])
opened = []

class Far(redis.Connection):
    "A server some 10 ms away: an opening takes a while."
    def connect(self):
        if self._sock is None:
            opened.append(1)
            gevent.sleep(0.01)
        super().connect()

pool = redis.ConnectionPool(connection_class=Far, port=port, max_connections=64)

def request():
    connection = lending.borrow(pool)
    connection.send_command("PING")
    connection.read_response()
    gevent.sleep(0.002)
    lending.give_back(pool, connection, None)

def burst():
    opened.clear()
    gevent.joinall([gevent.spawn(request) for _ in range(N)], raise_error=True)
    return len(opened)

print("FRESH", burst(), flush=True)
lent = [lending.borrow(pool) for _ in range(N)]  # N idle connections
for connection in lent:
    lending.give_back(pool, connection, None)
pool.disconnect()  # the server restarted: each idle connection dropped, kept in the pool
assert len(pool._available_connections) == N
print("AFTER", burst(), flush=True)
"""


def test_a_burst_after_the_idle_connections_were_dropped_opens_them_one_after_another(
        redis_server: RedisServer) -> None:
    """gevent: a burst of 40 requests on a fresh pool opens a few connections (the gate);
    the same burst once the pool holds 40 idle connections, all dropped (a Redis restart:
    requests that failed gave theirs back disconnected), must not open 40 at once: taking a
    disconnected idle connection is an opening like any other."""
    importorskip("gevent")
    child = TestProcess("adversary-gate-reconnect", [sys.executable, "-c", RECONNECT_BURST, str(redis_server.port),
                                                      str(BURST)],
                        env={**os.environ, "PYTHONPATH": str(ROOT)}).start()
    try:
        after = child.wait_for_line("AFTER", timeout=60)
        fresh = child.wait_for_line("FRESH", timeout=5)
    finally:
        child.close()
    fresh_count, after_count = int(fresh.split()[1]), int(after.split()[1])
    assert fresh_count <= BURST // 2, f"a fresh pool's burst opened {fresh_count} connections"
    assert after_count <= BURST // 2, (f"a burst after a restart reopened {after_count} of {BURST} connections at once "
                                       f"(a fresh pool's burst opened {fresh_count})")


# ----------------------------------------------------------------- 3. a signal's exception in an opening


class Interrupted(BaseException):
    """What a signal handler raises into the running code: a soft time limit, SIGINT."""


def _interrupt_at(nth: int) -> tuple[list[int], Any]:
    """A profile function raising :class:`Interrupted` at the ``nth`` return of a call made
    by ``lending._open`` (a C function's or a Python one's, counted from 0): where a signal
    handler's exception can land (the interpreter runs handlers as a call returns)."""
    seen = [0]
    target = lending._open.__code__

    def profile(frame: Any, event: str, arg: Any) -> None:
        caller = frame if event == "c_return" else frame.f_back
        if event in ("c_return", "return") and caller is not None and caller.f_code is target:
            seen[0] += 1
            if seen[0] - 1 == nth:
                raise Interrupted(f"at the return of call {nth} in _open")

    return seen, profile


@pytest.mark.parametrize("fail", [False, True], ids=["opening-succeeds", "opening-fails"])
def test_an_exception_at_any_call_return_in_an_opening_leaves_no_opening_counted(
        redis_server: RedisServer, fail: bool) -> None:
    """An exception raised at each call return inside ``_open`` in turn (one borrowing each):
    whatever it interrupts, no opening stays counted afterwards (a count left up gates the
    pool after every later opening, with nothing being opened)."""
    port = free_port_refusing() if fail else redis_server.port
    nth = 0
    while True:
        pool = redis.ConnectionPool(port=port, socket_connect_timeout=5, socket_timeout=5, max_connections=8)
        seen, profile = _interrupt_at(nth)
        sys.setprofile(profile)
        try:
            lending.borrow(pool)
        except (Interrupted, redis.ConnectionError):
            pass
        finally:
            sys.setprofile(None)
        openings = lending._openings_of(pool)
        assert openings is not None
        assert openings.count == 0, f"an exception at call return {nth} of _open left {openings.count} opening counted"
        pool.disconnect()
        if seen[0] <= nth:  # every call return was tried
            break
        nth += 1
    assert nth >= 2, f"only {nth} call returns seen in _open"


def free_port_refusing() -> int:
    """A local port nothing listens on: connections refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ----------------------------------------------------------------- 4. a greenlet killed mid-opening

KILLED_OPENER = r"""
from gevent import monkey
monkey.patch_all()

import sys
import gevent
import redis
from celery_singleton_beat.connection import lending

silent_port, port = int(sys.argv[1]), int(sys.argv[2])

class FirstSilent(redis.Connection):
    "The first opening goes to a server that never answers; every other one to Redis."
    first = [True]
    def connect(self):
        if self._sock is None:
            self.port = silent_port if FirstSilent.first[0] else port
            FirstSilent.first[0] = False
        super().connect()

class Killed(BaseException):
    "What a gevent.Timeout or a soft time limit raises into the opener."

pool = redis.ConnectionPool(connection_class=FirstSilent, port=port, socket_timeout=30, max_connections=16)
waits = []
wait = lending._wait_for_return
def counted(pool, timeout):
    waits.append(gevent.getcurrent())
    wait(pool, timeout)
lending._wait_for_return = counted

def request():
    connection = lending.borrow(pool)
    connection.send_command("PING")
    reply = connection.read_response()
    lending.give_back(pool, connection, None)
    return reply

opener = gevent.spawn(request)
gevent.sleep(0.01)
others = [gevent.spawn(request) for _ in range(8)]
while not set(others) <= set(waits):
    gevent.sleep(0.001)
opener.kill(Killed, block=True)
gevent.joinall(others, timeout=30)
openings = lending._openings_of(pool)
print("OPENER", type(opener.exception).__name__, flush=True)
print("OTHERS", sorted({str(g.value) for g in others}), flush=True)
print("RESULT", openings.count, openings.failed, flush=True)
"""


def test_a_greenlet_killed_while_opening_releases_the_waiting_ones(silent: SilentServer,
                                                                   redis_server: RedisServer) -> None:
    """gevent: the first request's opening hangs on a silent server, 8 others wait for it;
    the opener is killed (a ``gevent.Timeout``, a soft time limit). The others open their
    own and are answered; nothing stays counted, the pool is not taken for a failing one."""
    importorskip("gevent")
    child = TestProcess("adversary-gate-killed", [sys.executable, "-c", KILLED_OPENER, str(silent.port),
                                                   str(redis_server.port)],
                        env={**os.environ, "PYTHONPATH": str(ROOT)}).start()
    try:
        result = child.wait_for_line("RESULT", timeout=60)
        output = child.output()
    finally:
        child.close()
    assert "OPENER Killed" in output, output
    assert "OTHERS ['PONG']" in output or "OTHERS [\"b'PONG'\"]" in output, output
    assert result.split()[1:] == ["0", "False"], result


# ----------------------------------------------------------------- 5. threads on a full pool


def test_threads_on_a_full_pool_leave_no_opening_counted(redis_server: RedisServer) -> None:
    """16 OS threads, 100 requests each, on a pool of 4 connections: each request answered,
    and no opening counted afterwards."""
    pool = redis.ConnectionPool(port=redis_server.port, socket_timeout=10, max_connections=4)
    assert len(_answers_of_a_burst(pool, 16, each=100)) == 1600
    openings = lending._openings_of(pool)
    assert openings is not None and openings.count == 0
    assert getattr(pool, "_created_connections", 0) <= 4
    pool.disconnect()


# ----------------------------------------------------------------- 6. a blocking pool


def test_a_blocking_pool_is_never_gated(redis_server: RedisServer) -> None:
    """``BlockingConnectionPool`` keeps no list of idle connections: never gated, lends as before."""
    pool = redis.BlockingConnectionPool(port=redis_server.port, socket_timeout=10, max_connections=2)
    assert lending._openings_of(pool) is None
    connection = lending.borrow(pool)
    connection.send_command("PING")
    assert connection.read_response() in (b"PONG", "PONG")
    lending.give_back(pool, connection, None)
    pool.disconnect()


# ----------------------------------------------------------------- 7. a fork while another thread opens


class HeldInParent(redis.Connection):
    """A connection whose opening in the parent waits for ``go`` (a thread mid-opening at the fork)."""

    go = threading.Event()
    parent = os.getpid()

    def connect(self) -> None:
        if self._sock is None and os.getpid() == HeldInParent.parent:
            assert HeldInParent.go.wait(30), "the test never let the parent's opening go on"
        super().connect()


def test_a_child_forked_while_a_thread_opens_waits_for_no_opening(redis_server: RedisServer) -> None:
    """A thread of the parent is opening a connection of a pool (counted) when the main
    thread forks. redis-py's pool starts afresh in the child; the child, one thread, takes
    one connection, then another: nothing is being opened in the child, so the second must
    not wait for an opening (an inherited count held the pool's gate up for its whole life,
    after every opening the child made)."""
    HeldInParent.go.clear()
    HeldInParent.parent = os.getpid()
    pool = redis.ConnectionPool(connection_class=HeldInParent, port=redis_server.port, socket_timeout=10,
                                max_connections=8)
    opener = threading.Thread(target=lambda: lending.give_back(pool, lending.borrow(pool), None), daemon=True)
    opener.start()
    openings = lending._openings_of(pool)
    assert openings is not None
    wait_for(lambda: openings.count == 1, timeout=10, message="the parent's opening under way")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one thread, nothing opening
        code = 2
        try:
            waits = [0]
            wait = lending._wait_for_return

            def counted(pool: Any, timeout: float) -> None:
                waits[0] += 1
                wait(pool, timeout)

            lending._wait_for_return = counted  # type: ignore[assignment]
            first, second = lending.borrow(pool), lending.borrow(pool)
            os.write(write, f"{waits[0]}\n".encode())
            first.disconnect()
            second.disconnect()
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    try:
        _, status = wait_for(lambda: (lambda done: done if done[0] else None)(os.waitpid(pid, os.WNOHANG)),
                             timeout=30, message="the child's two borrowings")
        reply = os.read(read, 100).decode().strip()
    finally:
        os.close(read)
        HeldInParent.go.set()
        opener.join(30)
        pool.disconnect()
    assert os.waitstatus_to_exitcode(status) == 0
    assert reply == "0", f"the child waited {reply} times for an opening nobody in it was making"


# ----------------------------------------------------------------- 8. a burst after a restart


class FarOpening(redis.Connection):
    """A server some 10 ms away: each opening takes a while; openings counted."""

    opened: list[str]

    def connect(self) -> None:
        if self._sock is None:
            FarOpening.opened.append(threading.current_thread().name)
            time.sleep(0.01)  # the opening's round trips, not a wait for a condition
        super().connect()


def _answers_of_a_burst(pool: Any, size: int, each: int = 1) -> list[Any]:
    """``size`` threads each borrow, ask ``PING`` and give back (``each`` times), at once:
    their answers (every one answered, none failed)."""
    answers: list[Any] = []
    errors: list[BaseException] = []
    together = threading.Barrier(size)

    def request() -> None:
        together.wait(30)
        for _ in range(each):
            try:
                connection = lending.borrow(pool)
                connection.send_command("PING")
                answers.append(connection.read_response())
                lending.give_back(pool, connection, None)
            except Exception as exc:  # the outcome under test
                errors.append(exc)

    threads = [threading.Thread(target=request, name=f"burst-{i}", daemon=True) for i in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors[:3]
    assert len(answers) == size * each
    return answers


def _thread_burst(pool: redis.ConnectionPool, size: int) -> int:
    """``size`` threads each borrow, ask ``PING`` and give back, at once; the openings made."""
    FarOpening.opened = []
    _answers_of_a_burst(pool, size)
    return len(FarOpening.opened)


@pytest.mark.xfail(strict=True, reason=(
    "after a restart the idle connections look connected (their socket holds the server's EOF): "
    "each request takes one and redis-py reopens it outside the gate; see attack 8 of the module"))
def test_a_burst_after_a_restart_reopens_the_idle_connections_one_after_another() -> None:
    """40 threads at once on a fresh pool open a few connections (the gate). The pool then
    holds 40 idle connections and the server restarts: the same burst must not reopen 40 at
    once (each idle connection's socket ends with the server's EOF: redis-py reopens it)."""
    server = RedisServer(name="adv-gate-restart").start()
    try:
        pool = redis.ConnectionPool(connection_class=FarOpening, port=server.port, socket_timeout=10,
                                    max_connections=64)
        fresh = _thread_burst(pool, BURST)
        lent = [lending.borrow(pool) for _ in range(BURST)]
        for connection in lent:
            lending.give_back(pool, connection, None)
        server.restart()
        after = _thread_burst(pool, BURST)
        pool.disconnect()
    finally:
        server.close()
    assert fresh <= BURST // 2, f"a fresh pool's burst opened {fresh} connections"
    assert after <= BURST // 2, (f"a burst after a restart reopened {after} of {BURST} connections at once "
                                 f"(a fresh pool's burst opened {fresh})")


# ----------------------------------------------------------------- 10. a Sentinel pool


@pytest.mark.timeout(180)
def test_a_burst_on_a_sentinel_pool_is_gated_and_answered() -> None:
    """The library's Sentinel pool (it asks the sentinels as it lends): 40 threads at once
    borrow, each is answered, fewer than 40 connections are opened, nothing stays counted."""
    from .support.topologies import start_sentinels

    group = start_sentinels(down_after_ms=5000)
    try:
        group.wait_ready()
        client = group.lock_client()
        pool = client.connection_pool
        assert lending._openings_of(pool) is not None, "a Sentinel pool is gated"
        _answers_of_a_burst(pool, BURST)
        openings = lending._openings_of(pool)
        assert openings is not None and openings.count == 0
        assert len(pool._available_connections) < BURST, f"{len(pool._available_connections)} connections opened"
        client.close()
    finally:
        group.close()


# ----------------------------------------------------------------- 9. a full pool's waiters

FULL_POOL = r"""
from gevent import monkey
monkey.patch_all()

import sys
import gevent
import redis
from celery_singleton_beat.connection import lending

port, N = int(sys.argv[1]), int(sys.argv[2])
pool = redis.ConnectionPool(port=port, max_connections=4, socket_timeout=30)
tally = {"takes": 0, "notified": 0, "timed_out": 0, "given_back": 0, "opened": 0}

take = lending._take
def counted_take(pool):
    tally["takes"] += 1
    return take(pool)
lending._take = counted_take

def counted_wait(pool, timeout):  # lending._wait_for_return, telling a notify from a timeout
    condition = lending._condition(pool)
    with condition:
        tally["notified" if condition.wait(timeout) else "timed_out"] += 1
lending._wait_for_return = counted_wait

class Counted(redis.Connection):
    def connect(self):
        if self._sock is None:
            tally["opened"] += 1
        super().connect()
pool.connection_class = Counted

def request():
    connection = lending.borrow(pool)
    connection.send_command("PING")
    connection.read_response()
    gevent.sleep(0.1)  # a request holding its connection a while (a slow server, a window's wait)
    tally["given_back"] += 1
    lending.give_back(pool, connection, None)

gevent.joinall([gevent.spawn(request) for _ in range(N)], raise_error=True)
print("RESULT", " ".join(f"{k}={v}" for k, v in tally.items()), flush=True)
"""


def test_waiters_of_a_full_pool_look_again_only_when_woken_for_a_reason(redis_server: RedisServer) -> None:
    """gevent: 100 requests on a pool of 4 connections, each holding its connection 0.1 s.
    A request that finds the pool full waits; it looks again when a connection is given
    back, an opening ends, or its wait times out (each look another pool-full error while
    all 4 are lent). Every look must have one of those reasons: a request finding the pool
    full must not wake the others (they would find it full too, and wake the others...)."""
    importorskip("gevent")
    child = TestProcess("adversary-gate-full", [sys.executable, "-c", FULL_POOL, str(redis_server.port), "100"],
                        env={**os.environ, "PYTHONPATH": str(ROOT)}).start()
    try:
        result = child.wait_for_line("RESULT", timeout=120)
    finally:
        child.close()
    tally = {key: int(value) for key, value in (part.split("=") for part in result.split()[1:])}
    assert tally["given_back"] == 100, tally
    reasons = 100 + tally["given_back"] + tally["opened"] + tally["timed_out"]
    assert tally["takes"] <= reasons, (f"{tally['takes']} looks at the pool for {reasons} reasons to look "
                                       f"(first looks, give-backs, openings, timed-out waits): {tally}")

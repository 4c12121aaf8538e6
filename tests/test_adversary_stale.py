"""Attacks on the rule that frees locks not confirmed after a data loss (``lease/stale.py``
``take_unconfirmed``, dc2d5e0), each against real redis-servers, by a reviewer who did not
write it.

The rule: once this process's recovery window has closed, an acquire that finds a run
lock whose expiry on the server's clock (``look.server_ms + look.pttl``) comes before
``since_ms + its ttl`` takes it with the take-over's compare-and-replace. ``since_ms`` is
when the latest window opened, on the clock of the server that opened it, as this
process's memory (``ServerMemory.records``) keeps it: the largest it ever learnt.
Each "process" here is a client with a ``LockServer`` (a memory) of its own
(:func:`process`); a holder is renewed by a real ``LeaseKeeper`` thread, or by hand
(``support.locking.renew``, as the keeper does) where its schedule is the subject.

Breaks found, both fixed since (each failed before its fix; the assertion is the promise,
a live holder that still vouches for its lock keeps it; a scenario that is not reached
fails through ``pytest.fail``). The rule now decides on what the server says in one
transaction (the lock, its TTL, the clock, the record's ``since_ms``, the window's key)
and gives a replace back when its connection found another loss:

* 1. ``test_a_window_start_remembered_from_a_server_whose_clock_ran_ahead``: ``since_ms``
  is the largest this process ever learnt, from any server: one read on the clock of a
  server running ahead (the data then restored on a server whose clock is right: a
  restart from its snapshot on another host, a failover to a replica) makes every lock on
  the new server look unconfirmed, the ones its live holders renew in the window
  included, for as long as the skew: a live holder's lock is taken while it vouches.
* 2. ``test_a_restart_between_the_acquire_and_its_look``: the rule decides from this
  process's memory (``since_ms``, window closed) before its look, and the look (and the
  compare-and-replace) may reach a server that restarted from an older snapshot in
  between: the check of the look's new connection opens a window, the rule takes the
  lock anyway, inside that window, from a live holder that still vouches for it.

Held (each provably reaches the rule: the rule looked at the lock it left, past its gates
of a known window, closed, within a ttl; or another lock of the same snapshot was freed by
it, counted as ``unconfirmed_freed``):

* ``test_a_holder_on_a_longer_liveness_keeps_its_locks``: a holder whose
  ``singleton_liveness_ttl`` is 4x the acquirer's (renewals every 2 s, the acquirer's own
  window 2 s): its need in the server record (kept in the snapshot) makes the window
  3.5 s; its two leases are renewed in one batched request (Lua ``RENEW``: Redis 7.0 has no
  ``SET ... IFEQ``) and stay held; the ended run's lock beside them is freed.
* ``test_claims_and_values_without_a_ttl_are_left_alone``: a publish-time claim and a
  value written by 0.2 (no ``ttl``), back from a snapshot, are left (the rule's first
  gate); the ended run's lock beside them is freed by it.
* ``test_a_put_back_at_the_end_of_the_window_counts_as_confirmed``: a holder that cannot
  vouch up to the loss puts its lock back 0.5 s before the window closes
  (``Lease.late_put_back_at``); an acquisition waiting for the window's end finds it,
  looks, and leaves it.

Tried, not kept as tests (the outcome follows from the vouch arithmetic, and a script showed it):

* a holder whose every request reaches Redis 0.8 s late (``DelayProxy``): its renewal in the
  window arrives after the window closed and the rule frees its lock, but its
  ``vouched_until`` (last renewal's start + ``grace``, ``grace`` <= its window) had passed
  1.7 s before: ``ensure_held()`` already raised. The same holds for a keeper thread
  delayed past the window's slack, or a holder that had not reconnected yet.
* ``since_ms`` from an older window while a newer one is open: every acquire's own
  connection is checked on a new server before it writes, so the memory is current at the
  acquire (break 2 is the gap between the acquire and the look). Two windows in quick
  succession: each check of a new server opens a window of full length from then (and
  bumps ``since_ms``), so holders renew again in it.

Not reachable here: the native ``SET ... IFEQ`` renewal (Redis 8.4+ / Valkey 8.1+; it
also sets ``PX`` to the full ttl, as ``RENEW`` does); Redis Cluster (the rule is off).
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_singleton_beat.lease import counters
from celery_singleton_beat.lease import stale as stale_module
from celery_singleton_beat.lease.commands import look_request
from celery_singleton_beat.lease.executor import execute
from celery_singleton_beat.lease.holder import parse_holder
from celery_singleton_beat.lease.keeper import LeaseKeeper
from celery_singleton_beat.lease.lease import Lease
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.server import LockServer, server_of
from celery_singleton_beat.recovery.window import mark_in_use

from .support import RedisServer, redis_server_binary, register, require, scratch, wait_for
from .support.locking import renew
from .support.loopback import QuietRelay, close_socket

KEY = "singleton:{stale:k}"
ENDED = "singleton:{stale:ended}"
SECOND = "singleton:{stale:second}"
CLAIM = "singleton:{stale:claim}"
OLD = "singleton:{stale:old}"
WARM = "singleton:{stale:warm}"
STATS = "singleton:{stats}:task:stale"


def reached(condition: Any, what: str) -> None:
    """The scenario got where it must: else a plain failure (never counted as the xfail)."""
    if not condition:
        pytest.fail(f"scenario not reached: {what}; the rule's requests answered {LOOKS}")


@contextlib.contextmanager
def setting_up(what: str) -> Iterator[None]:
    """A step of the scenario: its AssertionError (a wait that timed out, a server that did
    not start) is a plain failure, never the expected one."""
    try:
        yield
    except AssertionError as exc:
        pytest.fail(f"scenario not reached: {what}: {exc}")


def until(condition: Callable[[], Any], what: str, timeout: float = 30.0) -> None:
    with setting_up(what):
        wait_for(condition, timeout=timeout, message=what)


def process(port: int, liveness: float = 1.5, timeout: float = 30.0) -> redis.Redis:
    """A process of its own: one client, one memory of the servers it saw."""
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout)
    client.csb_server = LockServer("singleton", liveness)  # type: ignore[attr-defined]
    return client


def spec(liveness: float = 1.5, *, ttl: float = 60.0, claim: bool = False, live: bool = False,
         boot: str = "boot") -> LockSpec:
    """A run's lock (counted in ``STATS``); an acquirer takes no dead worker's lock over
    (no liveness prefix): only the rule under attack can free a held lock."""
    return LockSpec(task="stale", ttl=ttl, boot=boot, live=live, liveness_ttl=liveness, claim=claim,
                    liveness_prefix="singleton" if live else None, stats_key=STATS)


def vouched(lease: Lease) -> bool:
    """What ``ensure_held()`` checks on the lease: no other holder can have the lock yet."""
    return time.monotonic() < lease.vouched_until


def warm(client: Any) -> None:
    """A lock request of ``client``'s process (its connection checked; waits for a window)."""
    lease = acquire(client, WARM, spec(), "warm").lease
    reached(lease is not None and lease.release(), "a warm-up lock taken and released")


def freed(direct: redis.Redis) -> int:
    """``unconfirmed_freed`` in the counter hash, written now."""
    counters.flush()
    return int(direct.hget(STATS, "unconfirmed_freed") or 0)


#: What the rule's requests answered in the running test, with the process's remembered
#: window start and epoch then: shown when a scenario is not reached.
LOOKS: list[tuple[str, Any, int, int]] = []


@pytest.fixture
def looked(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Keys the rule looked at (it passed its gates: a window known, closed, within a ttl)."""
    keys: list[str] = []
    real = stale_module.execute

    def spy(client: Any, key: str, build: Any, **options: Any) -> Any:
        keys.append(key)
        result = real(client, key, build, **options)
        LOOKS.append((key, result, server_of(client).data_lost_since_ms(), server_of(client).epoch))
        return result

    LOOKS.clear()
    monkeypatch.setattr(stale_module, "execute", spy)
    return keys


# ---------------------------------------------------------------------------- a clock ahead

#: An LD_PRELOAD library moving a process's wall clock (``CLOCK_REALTIME``, ``gettimeofday``,
#: ``time``) by ``CSB_CLOCK_OFFSET_MS``; the monotonic clock is left alone. (libfaketime
#: recurses at start-up in a redis-server built with jemalloc.)
_SKEW_C = r"""
#define _GNU_SOURCE
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static long long offset_ns;

__attribute__((constructor)) static void skew_init(void) {
    const char *text = getenv("CSB_CLOCK_OFFSET_MS");
    offset_ns = text ? atoll(text) * 1000000LL : 0;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    int result = (int)syscall(SYS_clock_gettime, id, ts);
    if (result == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) {
        long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + offset_ns;
        ts->tv_sec = ns / 1000000000LL;
        ts->tv_nsec = ns % 1000000000LL;
    }
    return result;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    struct timespec ts;
    int result = clock_gettime(CLOCK_REALTIME, &ts);
    if (result == 0 && tv) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return result;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out) *out = ts.tv_sec;
    return ts.tv_sec;
}
"""


@pytest.fixture(scope="module")
def skew_library() -> Path:
    gcc = require("gcc")
    where = scratch("skew")
    (where / "skew.c").write_text(_SKEW_C)
    subprocess.run([gcc, "-shared", "-fPIC", "-O2", "-o", str(where / "libskew.so"), str(where / "skew.c")],
                   check=True, capture_output=True, timeout=120)
    return where / "libskew.so"


class SkewedRedis(RedisServer):
    """A redis-server whose wall clock is :attr:`offset_ms` off, read at each start: the same
    data directory (its snapshot) served by a server on another clock after a restart."""

    def __init__(self, library: Path) -> None:
        self._offset = scratch("skewed-clock") / "offset_ms"
        self.offset_ms = 0
        wrapper = self._offset.parent / "redis-server"
        wrapper.write_text(f'#!/bin/sh\nexec env LD_PRELOAD="{library}" CSB_CLOCK_OFFSET_MS="$(cat {self._offset})" '
                           f'"{redis_server_binary()}" "$@"\n')
        wrapper.chmod(0o755)
        super().__init__(name="redis-skewed", binary=str(wrapper))

    def start(self) -> RedisServer:
        self._offset.write_text(str(self.offset_ms))
        return super().start()


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_a_window_start_remembered_from_a_server_whose_clock_ran_ahead(skew_library: Path) -> None:
    """The lock Redis runs on a host whose clock is five minutes fast; it is new, so the
    first check opens a window (``since_ms`` on that clock, learnt by ``a`` and ``h``). ``h``
    takes ``k``, its keeper renews it every 0.5 s. The data moves to a server whose clock
    is right (a restart from the snapshot on the same directory, the host's clock now
    corrected; the same with a replica on another host promoted). ``h``'s keeper renews
    ``k`` in the new window, on the new clock; once the window has closed, ``a`` acquires
    ``k``: its memory keeps ``max(since_ms)``, the first server's, five minutes ahead of
    the new clock, so ``k``'s expiry (renewed a moment ago) comes "before since + ttl",
    and ``a`` takes it while ``h``'s keeper renews on schedule and ``h`` vouches for it:
    two runs of ``k``. Every lock on the new server is "unconfirmed" so for the skew plus
    a ttl. Fix: never compare a ``since_ms`` with another server's clock: read the record's
    ``since_ms`` (and the recovery key's PTTL) in the look's own ``MULTI`` and decide on
    that server's answer, or forget the remembered ``since_ms`` whenever the record names
    another server (keep only what the current record says)."""
    server = register(SkewedRedis(skew_library))
    server.offset_ms = 5 * 60 * 1000
    with setting_up("the skewed server started"):
        server.start()
    direct = server.client()
    a, h = process(server.port), process(server.port)
    warm(a)  # a new Redis: the first check opened a window; a waited for it
    held = acquire(h, KEY, spec(), "h").lease
    reached(held is not None, "h took k")
    reached(server_of(a).data_lost_since_ms() > 0, "a learnt when the first server's window opened")
    keeper = LeaseKeeper()
    kept = keeper.keep(held)
    try:
        direct.save()
        with setting_up("the data on a server whose clock is right"):
            server.kill()
            server.offset_ms = 0
            server.start()
        renewals = kept.renewals
        until(lambda: server_of(h).epoch > 0 and kept.renewals > renewals + 1,
              "h's keeper renewed k on the new server")
        result = acquire(a, KEY, spec(), "a")  # waits for the new window first
        reached(not server_of(a).recovery().open, "a acquired after the window closed")
        if result.acquired:  # h vouched at the moment a took k (h's renewals after it fail)
            reached(held.vouched_until > result.lease.confirmed_at, "h vouched for k when a took it")
        else:
            reached(not kept.lost and vouched(held), "h's keeper renews k on schedule and h vouches for it")
        reached(server_of(a).data_lost_since_ms() > server_ms(direct) + 60_000,
                "a remembers a window opening minutes ahead of the new server's clock")
        assert not result.acquired, (f"a took k from its live holder h (renewed {kept.renewals - renewals} times "
                                     f"on the new server): the new server's lock was judged against the old "
                                     f"server's clock")
    finally:
        keeper.forget(kept)


# ---------------------------------------------------------------------------- a restart in between


class Gate(QuietRelay):
    """Relays ``a``'s connections to the server. :meth:`stop_at` arms it: the first request
    naming ``text`` is kept from the server, :attr:`stopped` is set, and once the test has
    restarted the server (from the main thread: a server's parent thread must outlive it)
    and set :attr:`cut`, that connection ends: the server went away just as the request was
    written, which never ran."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port, "gate")
        self._lock = threading.Lock()
        self._armed: bytes | None = None
        self.stopped = threading.Event()
        self.cut = threading.Event()
        register(self)
        self._start_accepting()

    def stop_at(self, text: bytes) -> None:
        with self._lock:
            self._armed = text

    def close(self) -> None:
        self.cut.set()
        super().close()

    def connected(self, client: socket.socket, upstream: socket.socket) -> None:
        stopping = threading.Event()

        def up(data: bytes) -> bool:
            with self._lock:
                stop = self._armed is not None and self._armed in data
                if stop:
                    self._armed = None
            if stop:
                stopping.set()  # the client sees its connection end only once the server is back
                self.stopped.set()
                self.cut.wait(60)
                close_socket(upstream)
                close_socket(client)
                return False
            self.forward(upstream, data)
            return True

        def down_ended() -> None:
            if not stopping.is_set():
                close_socket(client)

        self.spawn(self.relay, client, up, lambda: close_socket(upstream), name="gate-up")
        self.spawn(self.relay, upstream, lambda data: self.forward(client, data) or True, down_ended,
                   name="gate-down")


def test_a_restart_between_the_acquire_and_its_look(make_redis: Callable[..., RedisServer]) -> None:
    """``h`` (liveness 6 s: renewals every 2 s, a window of 3.5 s, which its need in the
    record makes everyone's) holds ``k``; the server snapshots (``SAVE``: the RDB file
    holds ``k`` as then) and restarts from it: window 1, ``h`` renews in it, ``a`` learns
    its ``since_ms``; it closes; ``h`` renews again (it vouches 3.5 s from then). ``a``
    acquires ``k``: found held, the rule passes its gates (window 1 closed, within a ttl of
    it) and sends its look; the server restarts from the same RDB file just then (a crash
    loop, an operator's restart). The look goes again on a new connection, whose check
    opens window 2 ("older": ``a`` saw a later generation); the look finds ``k`` as the
    snapshot had it, expiry before window 1's ``since + ttl``, and the take-over's
    compare-and-replace takes it, inside window 2, while ``h`` vouches for ``k`` (its
    keeper would renew it within the window, finding ``a``'s value, a second later). Fix:
    decide on what the server answers to the look itself: read the record's ``since_ms``
    and the recovery key's PTTL in the look's ``MULTI`` (and have ``TAKE_OVER`` refuse while
    the recovery key exists), or re-check ``recovery().open`` and ``since_ms`` after the
    look and before the compare-and-replace (an epoch that moved means: give up)."""
    server = make_redis()
    mark_in_use(server.client())
    direct = server.client()
    gate = Gate(server.port)
    a, h = process(gate.port), process(server.port, 6.0)
    warm(a)
    held = acquire(h, KEY, spec(6.0), "h").lease
    reached(held is not None, "h took k")
    direct.save()  # the RDB file: k as now, the record naming this server
    with setting_up("the server restarted from its snapshot"):
        server.kill()
        server.start()
    execute(a, WARM, lambda info: look_request(WARM))  # a's check opens window 1 (3.5 s: h's need)
    reached(server_of(a).recovery().open, "window 1 open")
    reached(renew(held), "h renewed k in window 1")
    until(lambda: not server_of(a).recovery().open, "window 1 closed")
    reached(server_of(a).data_lost_since_ms() > 0, "a knows when window 1 opened")
    reached(renew(held), "h renewed k after window 1")
    gate.stop_at(b"MULTI")  # the rule's look: MULTI TIME GET PTTL EXEC
    results: list[Any] = []
    acquirer = threading.Thread(target=lambda: results.append(acquire(a, KEY, spec(), "a")))
    acquirer.start()
    try:
        reached(gate.stopped.wait(30), "a found k held and sent the rule's look")
        reached(not server_of(a).recovery().open, "a decided with window 1 closed")
        with setting_up("the server restarted from the same snapshot"):
            server.kill()
            server.start()
    finally:
        gate.cut.set()
        acquirer.join(60)
    reached(results, "a's acquire returned")
    reached(server_of(a).recovery().open, "window 2 is open (the look's own connection found it)")
    reached(vouched(held), "h still vouches for k")
    assert not results[0].acquired, "a took k inside window 2 from h, which vouches for it"


# ---------------------------------------------------------------------------- held


def test_a_holder_on_a_longer_liveness_keeps_its_locks(make_redis: Callable[..., RedisServer],
                                                       looked: list[str]) -> None:
    """``h`` runs with ``singleton_liveness_ttl`` 6 s (renewals every 2 s, a need of 3.5 s),
    ``a`` with 1.5 s (its own window 2 s). ``h`` holds ``k`` and ``second`` (renewed
    together); an ended run's lock is in the snapshot too. After the restart from it, the
    window lasts ``h``'s need (the record kept it), ``h``'s keeper renews both leases in one
    batched request within it, and ``a``, once it closed, finds them confirmed; the ended
    run's lock is freed."""
    server = make_redis()
    mark_in_use(server.client())
    direct = server.client()
    a, h = process(server.port), process(server.port, 6.0)
    warm(a)
    leases = [acquire(h, key, spec(6.0), f"h-{n}").lease for n, key in enumerate((KEY, SECOND))]
    ended = acquire(a, ENDED, spec(), "ended").lease
    reached(all(leases) and ended is not None, "h took k and second, the ended run its lock")
    keeper = LeaseKeeper()
    kept = [keeper.keep(lease) for lease in leases if lease is not None]
    try:
        direct.save()
        reached(ended.release(), "the ended run released after the snapshot")
        before = freed(direct)
        server.kill()
        server.start()
        reached(json.loads(direct.get("singleton:server"))["need_ms"] == 3500, "the record keeps h's need")
        batches, renewals = keeper.batches, [k.renewals for k in kept]
        until(lambda: server_of(h).epoch > 0 and keeper.batches > batches
              and all(k.renewals > n for k, n in zip(kept, renewals, strict=True)),
              "h's keeper renewed both leases together on the restarted server")
        taken = acquire(a, ENDED, spec(), "next")  # waits for the window
        reached(taken.acquired and freed(direct) == before + 1, "the rule freed the ended run's lock")
        for key in (KEY, SECOND):
            result = acquire(a, key, spec(), "a")
            assert key in looked, f"the rule did not look at {key}"
            assert not result.acquired, f"a took {key} from h, which renews it"
        assert not any(k.lost for k in kept)
        assert freed(direct) == before + 1
    finally:
        for k in kept:
            keeper.forget(k)


def test_claims_and_values_without_a_ttl_are_left_alone(make_redis: Callable[..., RedisServer],
                                                         looked: list[str]) -> None:
    """A publish-time claim (never renewed: its message waits in the queue) and a value
    written by 0.2 (no ``ttl``) come back from a snapshot beside an ended run's lock; after
    the window the rule frees the run's lock and leaves both, which wait for their TTL."""
    server = make_redis()
    mark_in_use(server.client())
    direct = server.client()
    a = process(server.port)
    warm(a)
    claim = acquire(a, CLAIM, spec(ttl=3600.0, claim=True), "queued").lease
    ended = acquire(a, ENDED, spec(), "ended").lease
    reached(claim is not None and ended is not None, "the claim and the run's lock taken")
    reached(parse_holder(direct.get(CLAIM)).claim, "a claim value")
    old = json.dumps({"task_id": "old", "task": "stale", "node": "n", "pid": 1, "fence": 7, "claim": False})
    direct.set(OLD, old, px=60_000)  # as 0.2 wrote it: no ttl, no every
    direct.save()
    reached(ended.release(), "the ended run released after the snapshot")
    server.kill()
    server.start()
    # The rule's own evidence, not the counter: a count written by the process's batch
    # writer can be dropped with a write that met the restart.
    reached(acquire(a, ENDED, spec(), "next").acquired and ENDED in looked
            and parse_holder(direct.get(ENDED)).task_id == "next", "the rule freed the ended run's lock")
    for key in (CLAIM, OLD):
        result = acquire(a, key, spec(), "a")
        assert not result.acquired, f"a took {key}"
    assert direct.get(OLD).decode() == old
    assert parse_holder(direct.get(CLAIM)).task_id == "queued"
    assert looked.count(ENDED) == 1 and CLAIM not in looked and OLD not in looked


def test_a_put_back_at_the_end_of_the_window_counts_as_confirmed(make_redis: Callable[..., RedisServer],
                                                                  looked: list[str]) -> None:
    """``h`` (a worker's run: a take-over possible 2 s after a renewal) was last confirmed
    longer ago than that when the server restarts empty: it may not put its lock back at
    once, only 0.5 s before the window closes (its keeper is told ``Later``). ``a`` waits
    for the window and acquires at once: it finds ``h``'s lock, put back in the window,
    and leaves it; a second acquisition finds it too."""
    server = make_redis()
    mark_in_use(server.client())
    direct = server.client()
    a, h = process(server.port), process(server.port)
    warm(a)
    held = acquire(h, KEY, spec(live=True, boot="h-boot"), "h").lease
    reached(held is not None, "h took k")
    until(lambda: time.monotonic() > held.put_back_until, "h unconfirmed past a possible take-over")
    server.kill()
    server.start()
    keeper = LeaseKeeper()
    kept = keeper.keep(held)  # its first renewal finds the restart (and opens the window)
    try:
        until(lambda: kept.put_back_at is not None or kept.lost, "h's keeper found k gone")
        reached(kept.put_back_at is not None, "h's put-back waits for the window's end")
        with setting_up("h put k back before the window's end"):
            wait_for(lambda: direct.get(KEY) is not None or not server_of(h).recovery().open, timeout=30)
        reached(direct.get(KEY) is not None and direct.get(KEY).decode() == held.value, "h put k back")
        for task_id in ("a", "again"):
            result = acquire(a, KEY, spec(), task_id)
            assert not result.acquired, "a took the lock h put back in the window"
        assert KEY in looked
        assert not kept.lost and vouched(held)
    finally:
        keeper.forget(kept)

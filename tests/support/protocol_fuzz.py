"""The protocol fuzz test: lock operations through a fault-injecting proxy, each one judged.

:func:`run` drives the library's real API (``acquire``, ``Lease.release``,
``Lease.release_soon``, ``release_value``, ``Lease.renew_once``, ``Lease.put_back``,
``Channel.flush``) from the main thread, with a client whose every connection
(the thread's lock channel and the pool's) goes through a :class:`.FaultProxy`,
and raises exceptions into the main thread at random moments (as billiard's soft
time limit does). After every operation a separate, fault-free connection reads
what the server holds, and a model of each attempt's lock value decides whether
the operation's reported result agrees with it.

Releases go through ``Lease.release`` (the channel), ``Lease.release_soon`` (the
channel, its reply read later) and the pool (the library's release request run by
``run_pooled``, as the keeper's client and the tools do).

The model knows what only this test can change. Each acquire attempt ``n`` uses
task id ``a<n>`` (so every lock value names its attempt) and each attempt's value
is in one state:

* ``held``: in Redis for sure (reported acquired or put back, not released since);
  nothing but this test's own requests can remove it (the TTL is an hour);
* ``lost``: not in Redis for sure (this test deleted it behind the lease's back, to
  simulate a server that lost it); it comes back only by ``put_back``;
* ``releasing``: a release of it may or may not have run (interrupted, or its reply
  not read yet); it may vanish at any moment, never come back;
* ``gone``: not in Redis, for good;
* ``maybe``: a write of it may have run, or may still arrive (an interrupted
  acquire or put-back); it may appear or vanish;
* ``none``: reported not acquired: never written.

Judged (any breach is a disagreement): an acquire reported taken finds its value
in Redis, no other value was ``held`` on the key, and its fencing token is above
every earlier one of the key; an acquire reported held names an attempt whose value
could be there (``held``, ``releasing`` or ``maybe``), and the ``held`` one if there
is one; a release or renewal of a ``held`` value reports it ours; one reported ours
concerns a value that could be there; a value reported released or not ours is not
in Redis afterwards; a put-back reported done is in Redis. An exception other than
a Redis error or an injected interruption is a disagreement too (a reply read by
the wrong request shows up as a ``TypeError`` as often as a wrong answer).
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from celery.exceptions import SoftTimeLimitExceeded

from celery_singleton_beat.connection.channels import channel_for
from celery_singleton_beat.connection.pooled import run_pooled
from celery_singleton_beat.lease.commands import Renewal, release_request
from celery_singleton_beat.lease.lease import Lease
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.server import PORTABLE

from .fault_proxy import FaultProxy, Rates

__all__ = ["FuzzReport", "Interrupted", "run"]


class Interrupted(BaseException):
    """An exception raised into the main thread by the fuzz test (besides Celery's and Python's)."""


#: What is raised into the main thread, in turn.
INTERRUPTIONS: tuple[type[BaseException], ...] = (SoftTimeLimitExceeded, SystemExit, KeyboardInterrupt, Interrupted)

#: Compare-and-delete of the test's own (admin) connection.
_DELETE_IF = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"

CERTAIN = ("held", "lost", "gone", "none")


@dataclass
class Attempt:
    n: int
    key: str
    state: str = "maybe"
    lease: Lease | None = None
    value: str | None = None
    #: A release of it was sent without waiting; its reply is still to be judged.
    awaiting: bool = False
    #: This test deleted its value (an attempt no live lease stands for), as a TTL would.
    swept: bool = False


#: A library call (the only code interruptions are raised into) and the judge of its result.
Operation = tuple[Callable[[], Any], Callable[[Any], None]]


@dataclass
class FuzzReport:
    operations: int = 0
    seconds: float = 0.0
    disagreements: list[str] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    interruptions: int = 0
    connections: int = 0

    @property
    def failed(self) -> int:
        """Operations that raised (a Redis error or an interruption), replies read later included."""
        return sum(self.errors.values())

    def summary(self) -> str:
        return (f"{self.operations} operations in {self.seconds:.1f}s, {len(self.disagreements)} disagreements; "
                f"faults {dict(self.faults)}; interruptions {self.interruptions}; proxy connections "
                f"{self.connections}; outcomes {dict(sorted(self.outcomes.items()))}; errors "
                f"{dict(self.errors.most_common(12))}")


class _Interrupter:
    """Raises one of :data:`INTERRUPTIONS` into the main thread ``delay`` seconds after :meth:`arm`,
    if the operation it was armed for is still running (a SIGUSR1 handler raises it)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._main = threading.main_thread().ident
        self._raise: type[BaseException] | None = None
        self._due: deque[tuple[int, float]] = deque()
        self._wake = threading.Condition()
        self._current = -1
        self.raised = 0
        self._stop = False
        self._previous: Any = None

    def __enter__(self) -> _Interrupter:
        self._previous = signal.signal(signal.SIGUSR1, self._handle)
        self._thread = threading.Thread(target=self._run, name="fuzz-interrupter", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(5)
        self._raise = None
        signal.signal(signal.SIGUSR1, self._previous)

    def arm(self, operation: int, delay: float) -> None:
        self._raise = self._rng.choice(INTERRUPTIONS)
        self._current = operation
        with self._wake:
            self._due.append((operation, time.monotonic() + delay))
            self._wake.notify()

    def disarm(self) -> None:
        self._raise = None
        self._current = -1

    def _handle(self, signum: int, frame: Any) -> None:
        make, self._raise = self._raise, None
        if make is not None:
            self.raised += 1
            raise make()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._due and not self._stop:
                    self._wake.wait()
                if self._stop:
                    return
                operation, at = self._due.popleft()
            wait = at - time.monotonic()
            if wait > 0:
                time.sleep(wait)  # the fault's own timing: a random moment inside the operation
            if self._current == operation and self._raise is not None and self._main is not None:
                signal.pthread_kill(self._main, signal.SIGUSR1)


class _Fuzz:
    def __init__(self, client: redis.Redis, admin: redis.Redis, proxy: FaultProxy, rng: random.Random,
                 keys: int) -> None:
        self.client = client
        self.admin = admin
        self.proxy = proxy
        self.rng = rng
        self.keys = [f"fuzz:{{fuzz.task:{i}}}" for i in range(keys)]
        self.spec = LockSpec(task="fuzz.task", ttl=3600)
        self.attempts: dict[int, Attempt] = {}
        #: Per key, the attempts whose value may be in Redis; the attempts with a lease.
        self.by_key: dict[str, dict[int, Attempt]] = {}
        self.leased: dict[int, Attempt] = {}
        #: The attempt of the release_soon under way.
        self.sending: Attempt | None = None
        self.tokens: dict[str, int] = {}
        self.replies: deque[tuple[Attempt, str, Any, BaseException | None]] = deque()
        self.report = FuzzReport()
        self.delete_if = admin.register_script(_DELETE_IF)

    # ----------------------------------------------------------------- the model

    def disagree(self, what: str) -> None:
        self.report.disagreements.append(what)

    def actual(self, key: str) -> int | None:
        """The attempt whose value the server holds now (a fault-free connection), None if free."""
        raw = self.admin.get(key)
        if raw is None:
            return None
        return int(json.loads(raw)["task_id"][1:])

    def on_key(self, key: str) -> dict[int, Attempt]:
        """The attempts of ``key`` whose value may still be in Redis (or whose lease is alive)."""
        entries = self.by_key.setdefault(key, {})
        for m in [m for m, a in entries.items() if a.lease is None and a.state in ("gone", "none")]:
            del entries[m]
        return entries

    def held_on(self, key: str) -> Attempt | None:
        held = [a for a in self.on_key(key).values() if a.state == "held"]
        if len(held) > 1:
            self.disagree(f"model: {len(held)} attempts held on {key}")
        return held[0] if held else None

    def leases(self, *states: str) -> list[Attempt]:
        for n in [n for n, a in self.leased.items() if a.lease is None]:
            del self.leased[n]
        return [a for a in self.leased.values() if a.state in states]

    def pick(self, *states: str) -> tuple[Attempt, Lease, str] | None:
        """An attempt in one of ``states`` whose lease this test still has, the lease, the state."""
        candidates = self.leases(*states)
        if not candidates:
            return None
        attempt = self.rng.choice(candidates)
        assert attempt.lease is not None
        return attempt, attempt.lease, attempt.state

    # ----------------------------------------------------------------- operations
    # Each returns (call, judge): ``call`` is the library's call, the only code an interruption
    # is raised into; ``judge(result)`` checks its result against Redis. What must change in
    # the model whatever happens is changed before ``call``.

    def acquire(self, n: int) -> Operation:
        key = self.rng.choice(self.keys)
        attempt = self.attempts[n] = self.on_key(key)[n] = Attempt(n, key)  # "maybe" until its result is read
        before = self.held_on(key)
        states = {m: a.state for m, a in self.on_key(key).items()}

        def judge(result: Any) -> None:
            now = self.actual(key)
            if result.lease is not None:
                attempt.lease, attempt.value, attempt.state = result.lease, result.lease.value, "held"
                self.leased[n] = attempt
                self.report.outcomes["acquire taken"] += 1
                if before is not None:
                    self.disagree(f"op {n}: acquire of {key} reported taken while a{before.n} held it")
                if now != n:
                    self.disagree(f"op {n}: acquire of {key} reported taken, Redis holds a{now}")
                fence = result.lease.fence
                if fence <= self.tokens.get(key, 0):
                    self.disagree(f"op {n}: fencing token {fence} not above {self.tokens[key]} on {key}")
                self.tokens[key] = max(fence, self.tokens.get(key, 0))
                return
            attempt.state = "none"
            if result.completed:
                self.disagree(f"op {n}: acquire of {key} reported a done marker (none exists)")
                return
            holder = result.holder
            m = int(holder.task_id[1:]) if holder is not None and holder.task_id else None
            self.report.outcomes["acquire held"] += 1
            if m is None or states.get(m) not in ("held", "releasing", "maybe"):
                known = states.get(m, "gone, not acquired or never of this key") if m is not None else holder
                self.disagree(f"op {n}: acquire of {key} reported held by a{m} ({known})")
            elif before is not None and m != before.n:
                self.disagree(f"op {n}: acquire of {key} reported held by a{m}, a{before.n} held it")

        return lambda: acquire(self.client, key, self.spec, f"a{n}", node="fuzz@host"), judge

    def release(self, n: int, how: str) -> Operation | None:
        picked = self.pick("held", "releasing", "lost", "maybe")
        if picked is None:
            return None
        attempt, lease, before = picked
        attempt.lease = None  # released once
        if before in ("held", "releasing"):
            attempt.state = "releasing"  # may run or not, from now on
        elif before == "lost":
            attempt.state = "gone"  # not in Redis, and a release never writes it

        if how == "soon":
            attempt.awaiting = True  # its reply decides (never swept meanwhile)
            self.sending = attempt

            def replied(released: Any, error: BaseException | None) -> None:
                self.replies.append((attempt, before, released, error))

            def judge_sent(sent: Any) -> None:
                self.report.outcomes["release_soon sent"] += 1

            return lambda: lease.release_soon(replied), judge_sent

        def call() -> Any:
            if how == "call":
                return lease.release()
            # The pool's path (the keeper's client, tools): the library's release request, run there.
            return run_pooled(self.client, lease.key, release_request(PORTABLE, lease.key, lease.value))

        return call, lambda released: self.judge_release(attempt, before, released, f"op {n}: release ({how})")

    def judge_release(self, attempt: Attempt, before: str, released: bool | None, what: str) -> None:
        self.report.outcomes[f"release {released}"] += 1
        if released is None:
            return
        if released and before in ("lost", "gone", "none"):
            self.disagree(f"{what}: a{attempt.n} reported released, its value was not in Redis ({before})")
        if not released and before == "held" and not attempt.swept:
            self.disagree(f"{what}: a{attempt.n} reported not ours, its value was in Redis")
        if self.actual(attempt.key) == attempt.n:
            self.disagree(f"{what}: a{attempt.n} reported {'released' if released else 'not ours'}, "
                          f"its value is in Redis")
        attempt.state = "maybe" if attempt.state == "maybe" else "gone"

    def take_replies(self) -> None:
        while self.replies:
            attempt, before, released, error = self.replies.popleft()
            attempt.awaiting = False
            if error is not None:
                self.report.errors[f"release_soon reply: {type(error).__name__}"] += 1
                self.report.outcomes["release None"] += 1
                continue
            self.judge_release(attempt, before, released, f"a{attempt.n}'s release read later")

    def renew(self, n: int) -> Operation | None:
        picked = self.pick("held", "lost", "releasing", "maybe")
        if picked is None:
            return None
        attempt, lease, before = picked

        def judge(outcome: Any) -> None:
            self.report.outcomes[f"renew {outcome.value}"] += 1
            if outcome is Renewal.RENEWED:
                if before in CERTAIN and before != "held":
                    self.disagree(f"op {n}: renewal of a{attempt.n} reported renewed, its value was not "
                                  f"in Redis ({before})")
                if before == "held" and self.actual(attempt.key) != attempt.n:
                    self.disagree(f"op {n}: renewal of a{attempt.n} reported renewed, Redis does not hold it")
                return
            if before == "held":
                self.disagree(f"op {n}: renewal of a{attempt.n} reported {outcome.value}, its value was in Redis")
            if attempt.state == "releasing":
                attempt.state = "gone"

        return lambda: lease.renew_once(), judge

    def lose(self, n: int) -> Operation | None:
        picked = self.pick("held")
        if picked is None:
            return None
        attempt, lease, _ = picked

        def lost(deleted: Any) -> None:  # behind the library's back: as a server that lost the lock
            if deleted != 1:
                self.disagree(f"op {n}: a{attempt.n} was held, yet not in Redis")
            attempt.state = "lost"
            self.report.outcomes["lost by the server"] += 1

        return lambda: self.delete_if(keys=[lease.key], args=[lease.value]), lost

    def put_back(self, n: int) -> Operation | None:
        picked = self.pick("lost")
        if picked is None:
            return None
        attempt, lease, _ = picked
        attempt.state = "maybe"  # until its reply says

        def judge(put: Any) -> None:
            self.report.outcomes[f"put back {put}"] += 1
            now = self.actual(attempt.key)
            attempt.state = "held" if put else "lost"
            if put and now != attempt.n:
                self.disagree(f"op {n}: a{attempt.n} reported put back, Redis holds a{now}")
            if not put and now == attempt.n:
                self.disagree(f"op {n}: a{attempt.n} reported not put back, Redis holds it")

        return lambda: lease.put_back(), judge

    def flush(self, n: int) -> Operation:
        return lambda: channel_for(self.client).flush(), lambda _: None

    def sweep(self) -> None:
        """Check every key, and delete values no live attempt stands for (interrupted
        acquires and releases), as their TTL would."""
        for key in self.keys:
            now = self.actual(key)
            if now is None:
                continue
            attempt = self.attempts.get(now)
            if attempt is None or attempt.state in ("gone", "none", "lost"):
                self.disagree(f"{key} holds a{now}, which is {attempt.state if attempt else 'unknown'}")
                continue
            if attempt.state in ("maybe", "releasing") and attempt.lease is None and not attempt.awaiting:
                raw = self.admin.get(key)
                if raw is not None and self.delete_if(keys=[key], args=[raw]) == 1:
                    attempt.swept = True
                    self.report.outcomes["swept"] += 1
                    if attempt.state == "releasing":
                        attempt.state = "gone"

    # ----------------------------------------------------------------- the loop

    def one(self, n: int, interrupter: _Interrupter, interrupt_rate: float, delay_max: float) -> None:
        self.take_replies()
        draw = self.rng.random()
        operation: Operation | None
        if draw < 0.34:
            name, operation = "acquire", self.acquire(n)
        elif draw < 0.48:
            name, operation = "release", self.release(n, "call")
        elif draw < 0.62:
            name, operation = "release_soon", self.release(n, "soon")
        elif draw < 0.68:
            name, operation = "release_value", self.release(n, "pooled")
        elif draw < 0.84:
            name, operation = "renew", self.renew(n)
        elif draw < 0.88:
            name, operation = "lose", self.lose(n)
        elif draw < 0.94:
            name, operation = "put_back", self.put_back(n)
        elif draw < 0.995:
            name, operation = "flush", self.flush(n)
        else:
            self.admin.script_flush()
            self.report.outcomes["script flush"] += 1
            return
        if operation is None:
            return
        call, judge = operation
        self.report.operations += 1
        faults_before = Counter(self.proxy.faults)
        self.current = n
        if name != "lose" and self.rng.random() < interrupt_rate:
            interrupter.arm(n, self.rng.uniform(0, delay_max))
        try:
            try:
                result = call()
            finally:
                interrupter.disarm()
        except (redis.RedisError, *INTERRUPTIONS) as exc:
            self.report.errors[f"{name}: {type(exc).__name__}"] += 1
            if name == "release_soon" and self.sending is not None:  # its reply may never come:
                self.sending.awaiting = False  # the sweep may free the key (then "not ours" is no lie)
            return
        except Exception as exc:  # a crash: a reply read by the wrong request, most often
            self.disagree(f"op {n}: {name} raised {type(exc).__name__}: {exc}")
            return
        found = len(self.report.disagreements)
        judge(result)
        if len(self.report.disagreements) > found:
            self.report.disagreements[-1] += f" [faults during it: {dict(Counter(self.proxy.faults) - faults_before)}]"


def run(server_port: int, admin: redis.Redis, *, operations: int, seed: int, rates: Rates,
        interrupt_rate: float = 0.02, keys: int = 6, timeout: float = 0.25,
        progress: Callable[[int, FuzzReport], None] | None = None) -> FuzzReport:
    """Run ``operations`` operations through a fault proxy in front of ``server_port``; the report."""
    rng = random.Random(seed)
    started = time.monotonic()
    with FaultProxy(server_port, rates, seed=rng.randrange(2**32)) as proxy:
        client = redis.Redis(connection_pool=redis.ConnectionPool(
            host="127.0.0.1", port=proxy.port, socket_timeout=timeout, socket_connect_timeout=1))
        fuzz = _Fuzz(client, admin, proxy, rng, keys)
        with _Interrupter(random.Random(rng.randrange(2**32))) as interrupter:
            n = 0
            while fuzz.report.operations < operations:
                n += 1
                fuzz.one(n, interrupter, interrupt_rate, delay_max=0.0015)
                if n % 50 == 0:
                    fuzz.sweep()
                if progress is not None and n % 10_000 == 0:
                    progress(n, fuzz.report)
            fuzz.report.interruptions = interrupter.raised
        with proxy.pause():  # the end: every reply read, every lease judged and released
            channel_for(client).flush()
            fuzz.take_replies()
            fuzz.sweep()
            for attempt in fuzz.leases("held"):
                assert attempt.lease is not None
                if not attempt.lease.release():
                    fuzz.disagree(f"the end: a{attempt.n} was held, its release reported not ours")
        fuzz.report.faults = Counter(proxy.faults)
        fuzz.report.connections = proxy.connections
        client.close()
    fuzz.report.seconds = time.monotonic() - started
    return fuzz.report

"""Freezes of the test process itself, and the worker log lines only such a freeze explains.

A whole machine can stand still: the host pauses the VM (the kernel then logs ``random:
crng reseeded due to virtual machine fork``), or it is too busy to schedule anything for
seconds. A worker's liveness key (TTL 10 s by default) can run out meanwhile, and the
worker then logs, as documented, ``liveness key ... had expired (last renewed X s ago,
TTL T s)`` at ``ERROR``. A test that asserts a worker logged no error reads that line as
a bug unless it knows the machine froze.

:class:`StallMonitor` is a daemon thread of the pytest process ticking on a short
``Event.wait``: every gap between two ticks longer than the tick plus :data:`BOUND` is a
span in which this process ran no Python at all (its VM paused, the machine starved it,
or, rarely, a C call held the GIL). :func:`unexplained_errors` excuses a worker's
liveness-expired line only when this process was itself frozen, during the test, long
enough for the worker's key to expire; every other error line stays an error.

The same loop watches for **steps of the wall clock**: the wall clock moving more (or
less) than the monotonic clock between two ticks, by more than :data:`BOUND`. The host
can set the VM's wall clock forward after a pause its monotonic clock did not count (no
freeze shows then: only ``time.time()`` jumps, for every process of the machine at
once). Redis keeps TTLs on its wall clock: a forward step expires at once every key whose
TTL left is shorter than the step, however punctually its holder renewed it on its
monotonic clock (a 1 s lease is reported lost, a heartbeat logs its liveness key
expired "last renewed 0.7 s ago", below its TTL), and each sentinel, seeing its timer
move more than 2 s, enters TILT mode for 30 s (no failover, no reconfiguration of the
old primary). :meth:`StallMonitor.stepped` says how far the wall clock stepped forward
within a window: a test can tell such a loss from one the library caused.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

__all__ = ["BOUND", "TICK", "Stall", "StallMonitor", "StallWindow", "Step", "monitor", "stalls", "unexplained_errors"]

#: Seconds between two ticks of the monitor.
TICK = 0.05
#: A gap longer than the tick by more than this is recorded as a freeze.
BOUND = 0.25

#: The heartbeat's line when it finds its key expired (``lease/liveness.py``).
EXPIRED = re.compile(r"liveness key \S+ had expired \(last renewed (?P<ago>\d+(?:\.\d+)?) s ago, "
                     r"TTL (?P<ttl>\d+(?:\.\d+)?) s\)")


@dataclass(frozen=True)
class Stall:
    """A gap between two ticks (``time.monotonic()`` of the tick before it and after it)."""

    start: float
    end: float


@dataclass(frozen=True)
class Step:
    """The wall clock moved ``seconds`` more than the monotonic clock (negative: less) between
    the tick before ``at`` and the tick at ``at`` (``time.monotonic()``)."""

    at: float
    seconds: float


class StallMonitor:
    """Records each span in which its thread could not run, and each step of the wall clock
    (see the module's docstring).

    ``wait`` (``Event.wait``-like: True means stop), ``clock`` and ``wall`` are injectable so
    that a unit test can drive the loop (:meth:`run`) tick by tick.
    """

    def __init__(self, tick: float = TICK, bound: float = BOUND, *,
                 wait: Callable[[float], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.tick = tick
        self.bound = bound
        self._stop = threading.Event()
        self._wait = wait or self._stop.wait
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._stalls: list[Stall] = []
        self._steps: list[Step] = []
        self._last: float | None = None  # the latest tick
        #: When the loop began (monotonic); a window starting earlier is not covered.
        self.started: float | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> StallMonitor:
        self._thread = threading.Thread(target=self.run, name="stall-monitor", daemon=True)
        self._thread.start()
        while self.started is None:  # so that a window opened after start() is covered
            self._stop.wait(0.001)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def run(self) -> None:
        """The loop: tick until ``wait`` says stop, recording the gaps past ``tick + bound`` and
        the wall clock's moves off the monotonic clock past ``bound`` (from tick to tick: a
        clock slewed by NTP, a few hundred microseconds a second at most, never adds up to one)."""
        last = self._last = self.started = self._clock()
        offset = self._wall() - last
        while not self._wait(self.tick):
            now = self._clock()
            moved = self._wall() - now - offset
            with self._lock:
                if now - last > self.tick + self.bound:
                    self._stalls.append(Stall(last, now))
                if abs(moved) > self.bound:
                    self._steps.append(Step(now, moved))
                offset += moved
                last = self._last = now

    @property
    def stalls(self) -> list[Stall]:
        """The freezes seen, and the one under way: the thread has not ticked for longer than
        tick + bound (asked from another thread of this process, just resumed from a freeze
        the monitor's thread has not woken from yet)."""
        now = self._clock()
        with self._lock:
            seen = list(self._stalls)
            if self._last is not None and now - self._last > self.tick + self.bound:
                seen.append(Stall(self._last, now))
        return seen

    @property
    def steps(self) -> list[Step]:
        """The steps of the wall clock seen."""
        with self._lock:
            return list(self._steps)

    def stepped(self, start: float, end: float) -> float:
        """How far the wall clock stepped forward within ``[start, end]`` (monotonic), in
        seconds: the sum of the forward steps seen there (backward ones let keys live longer,
        and do not count). 0.0 when there is none, or when the monitor did not run from
        ``start`` on (what it did not watch proves nothing)."""
        if self.started is None or self.started > start:
            return 0.0
        return sum(s.seconds for s in self.steps if start <= s.at <= end and s.seconds > 0)

    def frozen_for(self, start: float, end: float) -> float:
        """The longest freeze seen within ``[start, end]`` (monotonic), in seconds: a gap clipped
        to the window, less the tick the thread waited on purpose. 0.0 when there is none, or
        when the monitor did not run from ``start`` on (what it did not watch proves nothing)."""
        if self.started is None or self.started > start:
            return 0.0
        return max((min(s.end, end) - max(s.start, start) - self.tick
                    for s in self.stalls if s.end > start and s.start < end), default=0.0)


@dataclass
class StallWindow:
    """One test's view of the session's monitor: freezes from ``began`` until now."""

    monitor: StallMonitor
    began: float

    def frozen_for(self) -> float:
        """The longest freeze of this process since the test began, in seconds."""
        return self.monitor.frozen_for(self.began, time.monotonic())


_monitor: StallMonitor | None = None


def monitor() -> StallMonitor:
    """The monitor of this process, started on first use (one per xdist worker)."""
    global _monitor
    if _monitor is None:
        _monitor = StallMonitor().start()
    return _monitor


@pytest.fixture
def stalls() -> Iterator[StallWindow]:
    """Freezes of the test process during this test (:func:`unexplained_errors` reads them)."""
    yield StallWindow(monitor(), time.monotonic())


def _explained(line: str, frozen: float) -> bool:
    """A liveness-expired line that a freeze of ``frozen`` seconds explains.

    The line's figure at or past its TTL says the key ran out of time (below it, Redis lost
    the key: no freeze explains that). A heartbeat writes every third of the TTL, so a
    freeze of the whole machine lets the key expire only if it lasts at least the other
    two thirds: that much this process must have been frozen too.
    """
    found = EXPIRED.search(line)
    if found is None:
        return False
    ago, ttl = float(found["ago"]), float(found["ttl"])
    return ago >= ttl and frozen >= ttl - ttl / 3


def unexplained_errors(log: str, window: StallWindow | None, marker: str = "ERROR") -> list[str]:
    """The lines of ``log`` with ``marker`` except a liveness-expired line that a freeze of
    the test process (seen in ``window``; None: no window, nothing excused) explains."""
    bad = [line for line in log.splitlines() if marker in line]
    if not bad or window is None:
        return bad
    frozen = window.frozen_for()
    return [line for line in bad if not _explained(line, frozen)]

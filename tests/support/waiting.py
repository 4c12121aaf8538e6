"""Waiting on conditions with deadlines, and soaks (time a scenario needs, on purpose).

Tests never sleep a fixed time to *wait for* something: they poll a condition
until a deadline (:func:`wait_for`). When a scenario itself needs time to
pass (beats must run for 20 s to show that no slot is missed), that is a
:func:`soak`: named as such, and checking an invariant while it lasts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from harness.waiting import wait_until


def wait_for(condition: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05,
             message: str = "condition") -> Any:
    """Poll ``condition`` until it returns a truthy value (returned); AssertionError
    after ``timeout`` seconds."""
    return wait_until(condition, timeout, message, interval=interval, error=AssertionError)


def soak(seconds: float, *, check: Callable[[], Any] | None = None, interval: float = 0.1,
         what: str = "the soak") -> int:
    """Let ``seconds`` pass on purpose, calling ``check`` every ``interval``.

    ``check`` is an invariant: it raises, or returns a falsy value, the moment
    something goes wrong (a process exits, a lease is lost), which fails the
    soak at once. Returns how many times the invariant was checked.
    """
    end = time.monotonic() + seconds
    checks = 0
    while True:
        if check is not None:
            if not check():
                raise AssertionError(f"{what}: the invariant broke after "
                                     f"{seconds - max(end - time.monotonic(), 0):.1f}s")
            checks += 1
        remaining = end - time.monotonic()
        if remaining <= 0:
            return checks
        time.sleep(min(interval, remaining))


def wait_for_phase(period: float, low: float, high: float, timeout: float | None = None) -> float:
    """Wait until the wall clock is in ``[low, high)`` modulo ``period`` (e.g. half-way
    between two 1 s slots); return the epoch time seen."""
    def now_in_phase() -> float | None:
        now = time.time()
        return now if low <= now % period < high else None

    return wait_for(now_in_phase, timeout=timeout or period + 1, interval=0.005,
                    message=f"the clock to be in [{low}, {high}) modulo {period}")

"""Waiting for a condition, with a deadline (never a fixed sleep)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.05,
               error: type[Exception] = TimeoutError) -> Any:
    """Poll ``condition`` until it returns a truthy value, and return that value.

    After ``timeout`` seconds without one, raise ``error("timed out after
    <timeout>s waiting for <what>")``. Exceptions raised by ``condition``
    propagate at once (a condition can fail fast, e.g. when a process exits).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise error(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)

"""The submitter: publishes direct submissions of :func:`~.app.work` until SIGTERM.

``python -m harness.chaos.submitter`` (started by the controller). Keys come
from ``CHAOS_KEYS`` (comma-separated), the random choices from
``CHAOS_SEED``; the mean pause between two submissions is ``CHAOS_RATE``
seconds (exponential). Lengths are mixed: most runs are short, some span
several renewals of their lease. Each submission is recorded (``submit``) with
whether ``apply_async`` returned: a publish that raised may or may not have
reached the broker, and the checker asks nothing of it.
"""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

from .app import record, work

#: (weight, shortest, longest) seconds of a run.
LENGTHS = ((55, 0.02, 0.3), (30, 0.5, 2.0), (15, 3.0, 6.0))


def length(rng: random.Random) -> float:
    """A run length drawn from :data:`LENGTHS`."""
    _, low, high = rng.choices(LENGTHS, weights=[w for w, _, _ in LENGTHS])[0]
    return round(rng.uniform(low, high), 3)


def submit(key: str, seconds: float, note: str, **options: Any) -> str | None:
    """Publish one run of ``key``; record it; the task id (None when the publish raised)."""
    t0 = time.monotonic()
    try:
        result = work.apply_async((key, seconds), {"note": note}, **options)
    except Exception as exc:  # the broker is down: kombu's publish retries gave up
        record("submit", id=options.get("task_id"), key=key, seconds=seconds, note=note, ok=False, m0=t0,
               error=f"{type(exc).__name__}: {exc}"[:200], **options)
        return None
    record("submit", id=result.id, key=key, seconds=seconds, note=note, ok=True, m0=t0,
           **{k: v for k, v in options.items() if k != "task_id"})
    return str(result.id)


def main() -> None:
    keys = os.environ.get("CHAOS_KEYS", "k0,k1,k2,k3,k4").split(",")
    rng = random.Random(int(os.environ.get("CHAOS_SEED", "1")))
    pause = float(os.environ.get("CHAOS_RATE", "0.3"))
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    record("submitter-up", keys=keys)
    while not stopping:
        submit(rng.choice(keys), length(rng), "sub")
        deadline = time.monotonic() + rng.expovariate(1 / pause)
        while not stopping and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    record("submitter-stop")


if __name__ == "__main__":
    main()

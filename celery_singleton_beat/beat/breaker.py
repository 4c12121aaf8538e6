"""Back-off while the claims Redis is unreachable, and the log lines that go with it."""

from __future__ import annotations

import time

from ..log import logger
from .slots import Slot

__all__ = ["Breaker"]


#: Seconds between two looks at the claims Redis while a back-off longer than that runs.
PROBE_EVERY = 1.0


class Breaker:
    """Doubling back-off after Redis failures; one ERROR when it goes, one INFO when back.

    Slots that cannot be claimed are reported once each (WARNING), however
    many ticks they stay unclaimable. A beat that fails closed looks at the
    server every :data:`PROBE_EVERY` seconds while the back-off runs
    (:meth:`probe_due`): the back-off doubles through an outage (16 s after
    15 s), and every beat that saw the same outage backs off in step, so
    without a look all of them would stay silent that long after Redis answers.
    """

    def __init__(self, fails_open: bool, minimum: float = 1.0, maximum: float = 30.0) -> None:
        self.fails_open = fails_open
        self.minimum = minimum
        self.maximum = maximum
        self._until = 0.0
        self._delay = 0.0
        self._down_since: float | None = None
        self._reported: set[tuple[str, object]] = set()
        self._next_probe = 0.0

    def is_open(self) -> bool:
        """True while the back-off runs: Redis is not asked."""
        return time.monotonic() < self._until

    def remaining(self) -> float:
        return max(self._until - time.monotonic(), 0.05)

    def probe_due(self) -> bool:
        """True once per :data:`PROBE_EVERY` while the back-off runs, for a beat that fails
        closed: time to look whether the server answers again (a fail-open beat sends
        meanwhile, and a look at a server that does not answer would hold its sends)."""
        now = time.monotonic()
        if self.fails_open or now >= self._until or now < self._next_probe:
            return False
        self._next_probe = now + PROBE_EVERY
        return True

    def next_probe_in(self) -> float | None:
        """Seconds until the next look (None: no look is due while the back-off runs)."""
        now = time.monotonic()
        if self.fails_open or now >= self._until:
            return None
        return max(min(self._next_probe, self._until) - now, 0.05)

    def failed(self, exc: BaseException) -> None:
        self._delay = min(max(self._delay * 2, self.minimum), self.maximum)
        self._until = time.monotonic() + self._delay
        self._next_probe = time.monotonic() + PROBE_EVERY
        if self._down_since is None:
            self._down_since = time.monotonic()
            logger.error("beat: Redis for slot claims unavailable (%s: %s); due slots are %s; "
                         "retrying with back-off", type(exc).__name__, exc,
                         "sent unclaimed (fail open)" if self.fails_open else "not sent (fail closed)")
        else:
            logger.debug("beat: Redis still unavailable (%s); next attempt in %.1fs", exc, self._delay)

    def ok(self) -> None:
        if self._down_since is not None:
            logger.info("beat: Redis for slot claims is back after %.1fs",
                        time.monotonic() - self._down_since)
            self._down_since = None
            self._reported.clear()
        self._delay = 0.0
        self._until = 0.0

    def report_unsent(self, name: str, slot: Slot, error: str | None) -> None:
        """Log once per slot that it was not sent because it could not be claimed."""
        if (name, slot.at) in self._reported:
            logger.debug("beat: %s: slot %s still not claimable: %s", name, slot.label, error)
            return
        if len(self._reported) > 100_000:
            self._reported.clear()
        self._reported.add((name, slot.at))
        logger.warning("beat: %s: slot %s NOT sent: cannot claim it (fail closed): %s",
                       name, slot.label, error)

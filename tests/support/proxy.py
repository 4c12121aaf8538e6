"""The tests' delaying proxy: :class:`harness.proxy.DelayProxy`, its log in the session's
scratch directory, registered with the current owner (see :mod:`.owners`) and closed with it.

It listens on a free loopback port and forwards every connection to an upstream
port (a redis-server), both ways, each chunk of bytes ``delay`` seconds after
the proxy read it; ``hold()``/``resume()`` keep client-to-server bytes back
(see the harness module for the details).
"""

from __future__ import annotations

from harness.proxy import DelayProxy as _HarnessProxy

from .owners import register
from .paths import scratch_file

__all__ = ["DelayProxy"]


class DelayProxy(_HarnessProxy):
    """``127.0.0.1:port`` -> ``127.0.0.1:upstream_port``, every chunk ``delay`` seconds late."""

    error = AssertionError

    def __init__(self, upstream_port: int, delay: float, name: str = "delay-proxy") -> None:
        super().__init__(upstream_port, delay, log=scratch_file(name), name=name)

    def start(self) -> DelayProxy:
        """Listen on ``port`` (returns once it does); registered with the current owner first."""
        register(self)
        super().start()
        return self

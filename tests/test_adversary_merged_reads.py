"""Attacks on the merged pooled reads: lock requests on a borrowed plain-pool connection read
off its socket (:class:`.pooled.BorrowedLink`), ``-LOADING`` read as an outage
(``BusyLoadingError``, a ``ConnectionError``) by every lock connection's reader, and the
Sentinel re-connect after a recovery window's wait in :func:`.pooled.run_pooled`.

Real redis-servers only; the ``-LOADING`` replies come from a proxy in front of one that
answers a chosen command with the exact bytes a loading Redis sends (a server behind a
proxy that forwards commands one by one, or a write reaching it in two segments, answers
a done marker ``-LOADING`` and runs the compare-and-delete behind it once its load ended).
"""

from __future__ import annotations

from typing import Any

import redis

from celery_singleton_beat.lease.commands import acquire_request, release_request
from celery_singleton_beat.lease.executor import execute

from . import test_adversary_pooled_reads as attacks
from .support import RedisServer
from .support.fault_proxy import Rates
from .test_adversary_pooled_reads import RefusingProxy, assert_told_held

LOADING = b"-LOADING Redis is loading the dataset in memory\r\n"
NO_FAULTS = Rates(0, 0, 0, 0, 0, 0)

#: The fixtures of those attacks: the protocol, and the session's server with ``HELD`` held.
protocol = attacks.protocol
held = attacks.held


class LoadingProxy(RefusingProxy):
    """A fault proxy whose forced refusals are a loading server's reply."""

    reply = LOADING


def acquire(client: redis.Redis, key: str, value: str, *, pooled: bool = True) -> Any:
    return execute(client, key, lambda info: acquire_request(info, key, value, 60_000, None), pooled=pooled)


def release_marked(client: redis.Redis, key: str, value: str, *, pooled: bool = True) -> Any:
    """A run's release with its done marker written ahead (``acks_late``)."""
    return execute(client, key, lambda info: release_request(info, key, value, f"{key}:done", 60_000),
                   pooled=pooled)


# ----------------------------------------------------------------- -LOADING for the marker only


def test_a_marker_refused_loading_ahead_of_a_release_that_ran_is_never_told_lost(held: RedisServer,
                                                                                 protocol: int) -> None:
    """A release whose done marker is answered ``-LOADING`` while the compare-and-delete behind
    it ran (the lock deleted): the release is sent again (the marker must be written) and
    finds nothing. That is unknown (None), never "not ours" (False: counted lost, the run
    told its lock was gone). redis-py's parser raised at the marker's reply, replies left
    unread, so the pool sent it again as a repeat; read off the socket, every reply is read
    before ``finish`` raises the outage, and the request went again as a first attempt."""
    with LoadingProxy(held.port, NO_FAULTS, seed=3) as proxy:
        client = redis.Redis(port=proxy.port, socket_timeout=10, protocol=protocol, max_connections=1)
        key = "t:{demo.task:marked}"
        assert type(acquire(client, key, "mine")) is int
        proxy.force(b"SET", "refuse")  # the marker: the release's first command
        released = release_marked(client, key, "mine")
        assert proxy.faults["refuse"] == 1
        direct = held.client()
        assert direct.get(key) is None and direct.get(f"{key}:done") == b"1"  # ran; marker written the 2nd time
        assert released is None, f"a release that deleted its own lock was reported {released!r}"
        assert_told_held(client)


def test_a_marker_refused_loading_on_the_channel_is_unknown_too(held: RedisServer, protocol: int) -> None:
    """The same on a thread's channel (which sends the request again, as a repeat, on a
    connection it had used): unknown (None), never False."""
    with LoadingProxy(held.port, NO_FAULTS, seed=4) as proxy:
        client = redis.Redis(port=proxy.port, socket_timeout=10, protocol=protocol)
        key = "t:{demo.task:marked-channel}"
        assert type(acquire(client, key, "mine", pooled=False)) is int
        proxy.force(b"SET", "refuse")
        released = release_marked(client, key, "mine", pooled=False)
        assert proxy.faults["refuse"] == 1
        assert held.client().get(key) is None
        assert released is None, released

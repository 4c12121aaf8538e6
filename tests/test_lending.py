"""Connections lent for one request: one opened at a time, and an opening that fails.

Requests that find no idle connection of the pool while another request opens one
wait for a connection instead of opening their own (:mod:`.connection.lending`).
Here OS threads borrow from one real pool of a real redis-server; a connection class
of the test's makes the first opening wait, then succeed or fail, once the others
are waiting on it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_singleton_beat.connection import lending

from .support import RedisServer, wait_for

#: Requests borrowing at once.
BORROWERS = 6


class HeldOpening(redis.Connection):
    """A connection whose first opening in a test waits for ``release``, then fails if told."""

    gate: threading.Event
    fail_first: bool
    opened: list[str]

    def connect(self) -> None:
        first = not HeldOpening.opened
        HeldOpening.opened.append(threading.current_thread().name)
        if first:
            assert HeldOpening.gate.wait(30), "the test never let the first opening go on"
            if HeldOpening.fail_first:
                raise redis.ConnectionError("refused (the test's first opening)")
        super().connect()


@pytest.fixture
def held_pool(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[redis.ConnectionPool]:
    """A pool of ``redis_server`` whose first opening waits; waits for a connection counted."""
    HeldOpening.gate, HeldOpening.opened, HeldOpening.fail_first = threading.Event(), [], False
    pool = redis.ConnectionPool(connection_class=HeldOpening, port=redis_server.port, max_connections=16)
    yield pool
    HeldOpening.gate.set()
    pool.disconnect()


def waiting(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the threads that waited for a connection, once per wait."""
    waits: list[str] = []
    wait = lending._wait_for_return

    def counted(pool: Any, timeout: float) -> None:
        waits.append(threading.current_thread().name)
        wait(pool, timeout)

    monkeypatch.setattr(lending, "_wait_for_return", counted)
    return waits


def borrow_all(pool: redis.ConnectionPool, outcomes: dict[str, Any]) -> list[threading.Thread]:
    """``BORROWERS`` threads borrowing from ``pool`` at once; each one's connection or error
    in ``outcomes`` (the connection given back once all have one)."""
    def borrow(name: str) -> None:
        try:
            connection = lending.borrow(pool)
            connection.send_command("PING")
            outcomes[name] = connection.read_response()
            lending.give_back(pool, connection, None)
        except Exception as exc:  # the outcome under test
            outcomes[name] = exc

    threads = [threading.Thread(target=borrow, args=(f"b{i}",), name=f"b{i}") for i in range(BORROWERS)]
    threads[0].start()
    wait_for(lambda: bool(HeldOpening.opened), timeout=10, message="the first opening under way")
    for thread in threads[1:]:
        thread.start()
    return threads


def test_requests_wait_for_the_connection_being_opened_instead_of_opening_their_own(
        held_pool: redis.ConnectionPool, monkeypatch: pytest.MonkeyPatch) -> None:
    waits = waiting(monkeypatch)
    outcomes: dict[str, Any] = {}
    threads = borrow_all(held_pool, outcomes)
    wait_for(lambda: set(waits) >= {f"b{i}" for i in range(1, BORROWERS)}, timeout=10,
             message="the other requests waiting for the connection being opened")
    assert HeldOpening.opened == ["b0"], "a request opened its own while one was being opened"
    HeldOpening.gate.set()
    for thread in threads:
        thread.join(30)
    assert all(outcome in (b"PONG", "PONG") for outcome in outcomes.values()), outcomes
    assert len(outcomes) == BORROWERS


def test_an_opening_that_fails_fails_its_own_request_alone_and_the_waiting_ones_open_theirs(
        held_pool: redis.ConnectionPool, monkeypatch: pytest.MonkeyPatch) -> None:
    HeldOpening.fail_first = True
    waits = waiting(monkeypatch)
    outcomes: dict[str, Any] = {}
    threads = borrow_all(held_pool, outcomes)
    wait_for(lambda: set(waits) >= {f"b{i}" for i in range(1, BORROWERS)}, timeout=10,
             message="the other requests waiting for the connection being opened")
    HeldOpening.gate.set()
    for thread in threads:
        thread.join(30)
    assert isinstance(outcomes.pop("b0"), redis.ConnectionError)
    assert all(outcome in (b"PONG", "PONG") for outcome in outcomes.values()), outcomes
    assert len(outcomes) == BORROWERS - 1
    openings = lending._openings_of(held_pool)
    assert openings is not None and openings.count == 0

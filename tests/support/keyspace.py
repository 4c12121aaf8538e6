"""Redis' own record of the writes to some keys: keyspace events, read up to a barrier."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis

from .waiting import wait_for

__all__ = ["keyspace_events"]


@contextmanager
def keyspace_events(client: redis.Redis, pattern: str) -> Iterator[Callable[[], list[tuple[str, str]]]]:
    """Every write Redis makes to a key of ``client``'s database that matches ``pattern``
    while inside, as ``(key, event)`` pairs (``set``, ``expire``, ``del``...).

    Yields ``events()``: the pairs so far. It publishes a barrier message and
    reads up to it: Redis delivers a subscriber's messages in the order it
    generated them, so every write made before the call is in the list.
    Keyspace events are switched on for the server while inside (string and
    generic commands), and off again after.
    """
    db = client.connection_pool.connection_kwargs.get("db", 0)
    prefix = f"__keyspace@{db}__:"
    barrier = f"test:barrier:{uuid.uuid4().hex}"
    client.config_set("notify-keyspace-events", "K$g")
    subscriber = client.pubsub()
    seen: list[tuple[str, str]] = []
    try:
        subscriber.psubscribe(prefix + pattern)
        subscriber.subscribe(barrier)
        confirmed: set[str] = set()

        def subscribed() -> bool:
            message = subscriber.get_message(timeout=0.1)
            if message is not None and message["type"] in ("subscribe", "psubscribe"):
                confirmed.add(message["type"])
            return confirmed == {"subscribe", "psubscribe"}

        wait_for(subscribed, timeout=10, interval=0, message="the keyspace subscription")

        def events() -> list[tuple[str, str]]:
            client.publish(barrier, "barrier")

            def reached() -> bool:
                message = subscriber.get_message(timeout=0.1)
                if message is None or message["type"] not in ("message", "pmessage"):
                    return False
                if message["channel"].decode() == barrier:
                    return True
                seen.append((message["channel"].decode()[len(prefix):], message["data"].decode()))
                return False

            wait_for(reached, timeout=10, interval=0, message="the barrier message")
            return list(seen)

        yield events
    finally:
        subscriber.close()
        client.config_set("notify-keyspace-events", "")

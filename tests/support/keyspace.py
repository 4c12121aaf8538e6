"""Redis' own record of the writes to some keys: keyspace events, read up to a barrier."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis

from .waiting import wait_for

__all__ = ["Write", "keyspace_events", "keyspace_writes"]

#: One write: the database, the key, the event (``set``, ``expire``, ``del``...).
Write = tuple[int, str, str]


@contextmanager
def keyspace_events(client: redis.Redis, pattern: str) -> Iterator[Callable[[], list[tuple[str, str]]]]:
    """Every write Redis makes to a key of ``client``'s database that matches ``pattern``
    while inside, as ``(key, event)`` pairs (``set``, ``expire``, ``del``...).

    Yields ``events()``: the pairs so far (see :func:`keyspace_writes`).
    """
    db = client.connection_pool.connection_kwargs.get("db", 0)
    with keyspace_writes(client, {db: pattern}) as writes:
        yield lambda: [(key, event) for _, key, event in writes()]


@contextmanager
def keyspace_writes(client: redis.Redis, patterns: dict[int, str]) -> Iterator[Callable[[], list[Write]]]:
    """Every write Redis makes, while inside, to a key matching ``patterns[db]`` in each
    database ``db``, as ``(db, key, event)`` in the order the server made them: one
    subscriber sees every database's events in one stream.

    Yields ``events()``: the writes so far. It publishes a barrier message and reads
    up to it: Redis delivers a subscriber's messages in the order it generated them,
    so every write made before the call is in the list. Keyspace events are switched
    on for the server while inside (string and generic commands), and off again after.
    """
    channels = {f"__keyspace@{db}__:": db for db in patterns}
    barrier = f"test:barrier:{uuid.uuid4().hex}"
    client.config_set("notify-keyspace-events", "K$g")
    subscriber = client.pubsub()
    seen: list[Write] = []
    try:
        subscriber.psubscribe(*(prefix + patterns[db] for prefix, db in channels.items()))
        subscriber.subscribe(barrier)
        confirmed: list[str] = []

        def subscribed() -> bool:
            message = subscriber.get_message(timeout=0.1)
            if message is not None and message["type"] in ("subscribe", "psubscribe"):
                confirmed.append(message["type"])
            return len(confirmed) == len(patterns) + 1

        wait_for(subscribed, timeout=10, interval=0, message="the keyspace subscription")

        def events() -> list[Write]:
            client.publish(barrier, "barrier")

            def reached() -> bool:
                message = subscriber.get_message(timeout=0.1)
                if message is None or message["type"] not in ("message", "pmessage"):
                    return False
                channel = message["channel"].decode()
                if channel == barrier:
                    return True
                prefix = channel[:channel.index(":") + 1]
                seen.append((channels[prefix], channel[len(prefix):], message["data"].decode()))
                return False

            wait_for(reached, timeout=10, interval=0, message="the barrier message")
            return list(seen)

        yield events
    finally:
        subscriber.close()
        client.config_set("notify-keyspace-events", "")

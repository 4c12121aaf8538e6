"""Adversary: the gevent greenlets' shared acquire connection (:mod:`.connection.green`).

Each scenario runs in a gevent-patched child process (as ``test_green_channel``) that takes
locks through :func:`.lease.lock.acquire` and prints what it saw as one JSON line. Bursts are
*mixed*: half of the keys are free (the acquire must take it: the key's value in Redis is the
lease's) and half are held by a value of their own (the acquire must name THAT holder), so a
reply handed to the wrong greenlet shows as a wrong outcome, not just as a key taken. Every
wait has a deadline: a greenlet still waiting at the end is counted as hung.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from .support import Owner, TestProcess, importorskip, owning, start_worker, wait_for
from .support.cutting_proxy import CuttingProxy
from .support.fault_proxy import FaultProxy, Rates
from .support.processes import child_env
from .support.servers import RedisServer
from .support.tasks import clear_runs, lock_keys, started

CHILD = r"""
from gevent import monkey
monkey.patch_all()

import collections
import gc
import json
import os
import random
import sys
import time
import traceback
import uuid

import gevent
import redis
from celery import Celery

from celery_singleton_beat import native
from celery_singleton_beat.connection.green import green_channel_or_none
from celery_singleton_beat.connection.wire import Request
from celery_singleton_beat.lease.holder import lock_value
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery import lock_redis
from celery_singleton_beat.recovery.server import server_of

url, scenario, direct, extra = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
extra_flag = extra.pop("flag", None)
extra_scripted = extra.pop("scripted", False)
app = Celery("green-adversary", set_as_current=False)
app.conf.singleton_redis_url = url
app.conf.singleton_redis_options = {"socket_timeout": 1.0, "max_connections": 8, "client_name": "green-child",
                                    **extra}
client = lock_redis.get_redis(app)
watcher = redis.Redis.from_url(direct)  # the server seen directly (not through a proxy)
spec = LockSpec(task="green-adversary", ttl=60.0)
prefix = uuid.uuid4().hex
out = {}


def key(name):
    return f"singleton:{prefix}:{name}"


copy_spec = LockSpec(task="green-adversary", ttl=60.0, check_done=True)
scripted = []  # set: acquires as copies of acks_late messages (one Lua script, loaded per connection)


def take(name, on=None):
    if scripted:
        return acquire(on or client, key(name), copy_spec, f"run-{name}", copy=True)
    return acquire(on or client, key(name), spec, f"run-{name}")


def holder(name):
    value = watcher.get(key(name))
    return value.decode() if value is not None else None


def until(condition, seconds=30):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        gevent.sleep(0.002)
    return True


def mixed(tag, n):
    # Names of a burst; every other key held by a value of its own (set directly).
    names = [f"{tag}{i}" for i in range(n)]
    held = {name for i, name in enumerate(names) if i % 2}
    pipe = watcher.pipeline(transaction=False)
    for name in held:
        pipe.set(key(name), lock_value(spec, f"pre-{name}", None), px=120000)
    pipe.execute()
    return names, held


def right(name, held, result):
    if name in held:
        return result.lease is None and result.holder is not None and result.holder.task_id == f"pre-{name}"
    return result.lease is not None and holder(name) == result.lease.value


def spawn(names, wrap=None, on=None):
    return [gevent.spawn(wrap or take, name, on) if on is not None else gevent.spawn(wrap or take, name)
            for name in names]


def written_while_paused(names, then):
    # Acquires of names written while the server holds writes back; then() once all wait,
    # before writes go on. Their greenlets.
    watcher.execute_command("CLIENT", "PAUSE", "60000", "WRITE")
    try:
        greenlets = spawn(names)
        assert until(lambda: len(channel._pending) == len(names))
        then()
    finally:
        watcher.execute_command("CLIENT", "UNPAUSE")
    return greenlets


def judge(label, names, held, greenlets, allowed=(), seconds=30):
    gevent.joinall(greenlets, timeout=seconds)
    ok, wrong, errors, hung = 0, [], collections.Counter(), 0
    for name, g in zip(names, greenlets):
        if not g.ready():
            hung += 1
        elif isinstance(g.value, BaseException):  # killed: gevent counts GreenletExit a success
            errors[type(g.value).__name__] += 1
        elif g.successful():
            if right(name, held, g.value):
                ok += 1
            else:
                wrong.append(f"{name}: {g.value!r} (in redis: {holder(name)})")
        else:
            kind = type(g.exception).__name__
            errors[kind if kind in allowed else f"{kind}: {g.exception}"] += 1
    out[label] = {"n": len(names), "ok": ok, "wrong": wrong[:5], "wrongs": len(wrong), "errors": dict(errors),
                  "hung": hung}


def burst(label, n, allowed=(), on=None, prepared=None):
    names, held = prepared or mixed(label, n)
    judge(label, names, held, spawn(names, on=on), allowed)


def green_connections():
    return sum(1 for c in watcher.client_list() if c.get("name") == "green-child")


def kill_green_connections():
    for c in watcher.client_list():
        if c.get("name") == "green-child":
            watcher.execute_command("CLIENT", "KILL", "ID", c["id"])


assert take("warm").lease  # the server looked at, the channel's connection used
channel = green_channel_or_none(client)
out["channel"] = type(channel).__name__

if scenario == "kill_mid_reply":
    # The leader is killed after reading the first of its request's two replies (SET's; the
    # test's proxy holds TIME's back): 20 followers wait behind it.
    names, held = mixed("m", 20)
    if extra_scripted:  # a copy's script: its SCRIPT LOAD's reply read, the EVALSHA's held back
        scripted.append(1)
    print("READY", flush=True)
    assert until(lambda: os.path.exists(extra_flag))
    doomed = gevent.spawn(take, "doomed")
    assert until(lambda: channel._pending and len(channel._pending[0].replies) == 1)
    greenlets = spawn(names)
    assert until(lambda: len(channel._pending) == 21)
    doomed.kill()
    out["doomed_dead"] = doomed.dead
    judge("after", names, held, greenlets)
    out["same_connection"] = channel._link is not None
    burst("again", 40)

elif scenario == "kill_connecting":
    # The greenlet connecting (the new connection's check waits: writes paused) is killed with
    # others waiting to write: the next one connects, and every acquire gets its own outcome.
    names, held = mixed("n", 20)
    kill_green_connections()
    assert until(lambda: green_connections() == 0)
    watcher.execute_command("CLIENT", "PAUSE", "60000", "WRITE")
    try:
        doomed = gevent.spawn(take, "doomed")
        assert until(lambda: channel._writing.locked() and channel._link is None and green_connections() == 1)
        greenlets = spawn(names)
        gevent.sleep(0)  # they start, and wait for the writing lock
        doomed.kill()
        out["doomed_dead"] = doomed.dead
    finally:
        watcher.execute_command("CLIENT", "UNPAUSE")
    judge("after", names, held, greenlets, allowed=("ConnectionError",))
    burst("again", 40)

elif scenario == "acl":
    # The child's user loses SET while 40 acquires wait (writes paused): each is refused or
    # gets its own outcome, none hangs; with SET given back, every acquire works.
    names, held = mixed("a", 40)
    greenlets = written_while_paused(names, lambda: watcher.acl_setuser("green", enabled=True, commands=["-set"]))
    judge("refused", names, held, greenlets, allowed=("ResponseError", "ReplyError", "NoPermissionError"))
    watcher.acl_setuser("green", enabled=True, commands=["+@all"])
    burst("after", 40)

elif scenario == "interrupts":
    # Timeouts and kills thrown at greenlets at random points of their acquires, while the
    # server keeps pausing writes for a moment; then every later acquire gets its own reply.
    rng = random.Random(7)
    names, held = mixed("i", 600)
    stop = []

    def pauser():
        while not stop:
            watcher.execute_command("CLIENT", "PAUSE", "15", "WRITE")
            gevent.sleep(rng.uniform(0.005, 0.03))

    def bounded(name):
        with gevent.Timeout(rng.uniform(0.0, 0.04)):
            return take(name)

    def killer(greenlets):
        for g in rng.sample(greenlets, 150):
            gevent.sleep(rng.uniform(0.0, 0.002))
            g.kill(block=False)

    p = gevent.spawn(pauser)
    greenlets = []
    for name in names:
        greenlets.append(gevent.spawn(bounded if rng.random() < 0.5 else take, name))
        if len(greenlets) % 50 == 0:
            gevent.sleep(0)
    k = gevent.spawn(killer, greenlets)
    judge("storm", names, held, greenlets, allowed=("Timeout", "GreenletExit"))
    stop.append(1)
    gevent.joinall([p, k], timeout=10)
    out["drained"] = until(lambda: not channel._pending)
    out["reader_left"] = channel._reader is not None
    burst("after", 200)
    out["same_channel"] = green_channel_or_none(client) is channel

elif scenario == "client_kill":
    # The shared connection killed by the server while a burst waits on it (writes paused).
    names, held = mixed("c", 40)

    def kill():
        kill_green_connections()
        assert until(lambda: not channel._pending or channel._link is None)

    greenlets = written_while_paused(names, kill)
    judge("killed", names, held, greenlets)
    burst("after", 40)

elif scenario == "oom":
    OOM = ("ResponseError", "ReplyError", "OutOfMemoryError")
    # Every write refused (-OOM) on the shared connection, native then scripted commands; the
    # connection stays in step, and once memory is allowed again every acquire works.
    first, second = mixed("native_oom", 20), mixed("scripted_oom", 20)
    watcher.config_set("maxmemory-policy", "noeviction")
    watcher.config_set("maxmemory", "1")
    try:
        burst("native_oom", 20, allowed=OOM, prepared=first)
        scripted.append(1)
        burst("scripted_oom", 20, allowed=OOM + ("NoScriptError", "_NoScript"), prepared=second)
    finally:
        watcher.config_set("maxmemory", "0")
    burst("after", 40)

elif scenario == "busy":
    # A script runs for ever (-BUSY to every other command) while a burst is written; the
    # scripted acquires' SCRIPT LOAD is refused too. SCRIPT KILL: every acquire works again.
    watcher.config_set("busy-reply-threshold", "50")
    blocker = redis.Redis.from_url(direct, socket_timeout=60)

    def busy():
        try:
            blocker.eval("while true do end", 0)
        except redis.ResponseError:
            pass

    def is_busy():
        try:
            watcher.ping()
        except redis.exceptions.BusyLoadingError:
            return False
        except redis.ResponseError as exc:
            return "BUSY" in str(exc)
        return False

    def end_busy(b):
        deadline = time.monotonic() + 30
        while not b.ready() and time.monotonic() < deadline:
            try:
                watcher.execute_command("SCRIPT", "KILL")
            except redis.ResponseError:
                pass
            b.join(timeout=0.05)
        return b.ready()

    first, second = mixed("native_busy", 20), mixed("scripted_busy", 20)
    b = gevent.spawn(busy)
    assert until(is_busy)
    burst("native_busy", 20, allowed=("ResponseError", "ReplyError", "BusyError", "TimeoutError"), prepared=first)
    out["ended1"] = end_busy(b)
    scripted.append(1)
    watcher.script_flush()
    b = gevent.spawn(busy)
    assert until(is_busy)
    burst("scripted_busy", 20, allowed=("ResponseError", "ReplyError", "BusyError", "TimeoutError"), prepared=second)
    out["ended2"] = end_busy(b)
    burst("after", 40)

elif scenario == "flush_storm":
    # SCRIPT FLUSH again and again while scripted acquires run: each either gets its own
    # outcome or NoScriptError (a script missing twice in a row), never another's reply.
    scripted.append(1)
    stop = []
    flusher_client = redis.Redis.from_url(direct)

    def flusher():
        while not stop:
            flusher_client.script_flush()
            gevent.sleep(0.002)

    f = gevent.spawn(flusher)
    names, held = mixed("f", 500)

    judge("storm", names, held, spawn(names), allowed=("NoScriptError", "_NoScript"))
    stop.append(1)
    f.join(timeout=10)
    burst("after", 100)

elif scenario == "resp3_pushes":
    # RESP3, and the shared connection tracking keys (CLIENT TRACKING ON): invalidation push
    # frames arrive between the replies of a burst.
    out["tracking"] = channel.call(Request([(b"CLIENT", b"TRACKING", b"ON")], lambda r: repr(r[0])))
    stop = []
    pushed = [0]

    def baiter():
        i = 0
        while not stop:
            bait = f"bait:{prefix}:{i % 20}"
            channel.call(Request([(b"GET", bait)], lambda r: r[0]))
            watcher.set(bait, i)
            pushed[0] += 1
            i += 1
            gevent.sleep(0)

    bs = [gevent.spawn(baiter) for _ in range(4)]
    burst("burst", 600)
    stop.append(1)
    gevent.joinall(bs, timeout=10)
    out["baits"] = pushed[0]
    out["bait_errors"] = [repr(g.exception) for g in bs if g.ready() and not g.successful()]
    burst("after", 100)

elif scenario == "thread_reuse":
    # Native OS threads one after the other (an ident is reused once a thread ended): each
    # acquire must work, whichever thread made the channel it finds.
    results = []

    def in_thread(n):
        def run():
            ident = native.get_ident()
            own_watcher = redis.Redis.from_url(direct)  # a gevent socket is of one thread's hub
            try:
                right = True
                for m in range(3):
                    lease = take(f"thread{n}-{m}").lease
                    value = own_watcher.get(key(f"thread{n}-{m}"))
                    right = right and lease is not None and value == lease.value.encode()
                results.append((n, ident, right, None))
            except BaseException as exc:
                results.append((n, ident, False, repr(exc) + "".join(traceback.format_tb(exc.__traceback__)[-4:])))
            finally:
                own_watcher.close()
        return run

    for n in range(8):
        native.start_thread(in_thread(n), f"green-adversary-{n}")
        if not until(lambda: len(results) > n, seconds=15):
            break
    out["threads"] = results
    out["idents"] = len({r[1] for r in results})

elif scenario == "reset":
    # reset_clients() while acquires are in flight, five times: the acquires end (their own
    # outcome, or a connection error) and the dropped clients' shared connections are closed.
    base = green_connections()
    ports = []  # the local port of each dropped client's shared connection
    for round in range(5):
        current = lock_redis.get_redis(app)
        ch = green_channel_or_none(current)
        assert take(f"r{round}-warm", current).lease
        ports.append(ch._connection._sock.getsockname()[1])
        names, held = mixed(f"r{round}-", 30)
        watcher.execute_command("CLIENT", "PAUSE", "200", "WRITE")
        greenlets = [gevent.spawn(take, name, current) for name in names]
        until(lambda: len(ch._pending) > 0, seconds=5)
        lock_redis.reset_clients()
        judge(f"round{round}", names, held, greenlets, allowed=("ConnectionError",))
    client = lock_redis.get_redis(app)
    assert take("after-resets").lease
    del current, ch

    def open_shared():
        addrs = {c["addr"] for c in watcher.client_list()}
        return sum(1 for port in ports if f"127.0.0.1:{port}" in addrs)

    out["connections"] = green_connections() - base
    out["shared_open"] = open_shared()
    gc.collect()
    out["connections_after_gc"] = green_connections() - base
    out["shared_open_after_gc"] = open_shared()

elif scenario == "cut_resend":
    # The connection cut after the server ran a burst's requests, and cut once more during the
    # resend (the test re-arms its proxy): each acquire gets its own outcome or a connection
    # error, none hangs, and the next burst works.
    names = [f"cut-me-{n}" for n in range(40)]
    judge("cut", names, set(), spawn(names), allowed=("ConnectionError",))
    burst("after", 40)

elif scenario == "loading_refusal":
    # The scripted acquire's SCRIPT LOAD is answered -LOADING (the test's proxy) and its
    # EVALSHA -NOSCRIPT (a server that finished loading between the two): the refusal is
    # raised for the request; the greenlet must get an outcome, not wait for ever.
    scripted.append(1)
    watcher.script_flush()
    print("READY", flush=True)
    assert until(lambda: os.path.exists(extra_flag))
    out["loaded_before"] = len(channel._link.loaded) if channel._link else None
    g = gevent.spawn(take, "loading")
    g.join(timeout=30)
    out["hung"] = not g.ready()
    out["outcome"] = (repr(g.exception) if not g.successful() else repr(g.value)[:300]) if g.ready() else None
    out["pending"] = len(channel._pending)
    burst("after", 20)

elif scenario == "big":
    # 1,500 greenlets at once with a pool of 8 (mixed: half find their key held).
    burst("big", 1500)
    out["pool_made"] = client.connection_pool._created_connections

print("RESULT " + json.dumps(out), flush=True)
"""


def run_child(redis_server: RedisServer, scenario: str, port: int | None = None,
              extra: dict[str, Any] | None = None, timeout: float = 180,
              when_ready: Callable[[], Any] | None = None, flag: Path | None = None) -> dict[str, Any]:
    """Run ``scenario`` in a gevent-patched child taking locks on ``port`` (the server's by default).

    ``when_ready``: called once the child printed READY, then ``flag`` is made (the child waits for it).
    """
    importorskip("gevent")
    url = f"redis://127.0.0.1:{port or redis_server.port}/0"
    direct = f"redis://127.0.0.1:{redis_server.port}/0"
    child = TestProcess(f"green-adversary-{scenario}",
                        [sys.executable, "-c", CHILD, url, scenario, direct,
                         json.dumps({**(extra or {}), "flag": str(flag) if flag else None})],
                        env=child_env(redis_server)).start()
    try:
        if when_ready is not None:
            assert flag is not None
            child.wait_for_line("READY", timeout=timeout)
            when_ready()
            flag.touch()
        line = child.wait_for_line("RESULT", timeout=timeout)
        result: dict[str, Any] = json.loads(line.split(" ", 1)[1])
        return result
    finally:
        child.close()


def clean(part: dict[str, Any], allowed: tuple[str, ...] = ()) -> bool:
    """No wrong outcome, no hang, no error but the ``allowed`` kinds."""
    return not part["wrongs"] and not part["hung"] and all(kind in allowed for kind in part["errors"])


def perfect(part: dict[str, Any]) -> bool:
    return part["ok"] == part["n"] and clean(part)


@pytest.fixture
def own_server() -> Any:
    """A redis-server of this test's own (its settings are changed)."""
    server = RedisServer(name="green-adversary").start()
    server.flushall()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.parametrize("held_back", ["TIME", "EVALSHA"])
def test_a_leader_killed_between_the_replies_of_its_request(redis_db: redis.Redis, redis_server: RedisServer,
                                                            tmp_path: Path, held_back: str) -> None:
    """The reading greenlet is killed with its request half answered (the acquire's ``SET`` reply
    read, its ``TIME`` reply held back by a proxy) and 20 followers waiting: a reader takes over
    from the reply it stopped at; each follower gets its own outcome on the same connection."""
    # Only the next TIME meets a fate: its reply (and every one behind it) held back 3 s.
    rates = Rates(refuse=0, delay=0, close_before=0, close_after=0, cut=0, silence=0, delay_max=0,
                  long_delay=3.0, long_delay_every=1)
    with FaultProxy(redis_server.port, rates, seed=1) as proxy:
        try:
            result = run_child(redis_server, "kill_mid_reply", port=proxy.port,
                               extra={"socket_timeout": 10.0, "scripted": held_back == "EVALSHA"},
                               when_ready=lambda: proxy.force(held_back.encode(), "delay"), flag=tmp_path / "go")
        finally:
            proxy.close()
    assert result["doomed_dead"], result
    assert perfect(result["after"]) and perfect(result["again"]), result
    assert result["same_connection"], result


def test_timeouts_and_kills_at_random_points_leave_the_stream_in_step(redis_db: redis.Redis,
                                                                     redis_server: RedisServer) -> None:
    """600 acquires, half under a short ``gevent.Timeout``, 150 killed at random moments, the
    server pausing writes now and then: none hangs, none gets another's outcome; afterwards
    nothing is left pending and 200 more acquires all get their own."""
    result = run_child(redis_server, "interrupts")
    assert clean(result["storm"], ("Timeout", "GreenletExit")), result
    storm = result["storm"]
    assert storm["ok"] and storm["errors"], f"both outcomes were seen: {result}"
    assert result["drained"] and not result["reader_left"], result
    assert perfect(result["after"]) and result["same_channel"], result


def test_the_shared_connection_killed_by_the_server_with_a_burst_waiting(redis_db: redis.Redis,
                                                                         redis_server: RedisServer) -> None:
    """``CLIENT KILL`` of the shared connection while 40 acquires wait on it: each is written
    again on a new connection (it had served before) and gets its own outcome."""
    result = run_child(redis_server, "client_kill")
    assert perfect(result["killed"]) and perfect(result["after"]), result


def test_out_of_memory_refusals_keep_the_connection_in_step(redis_db: redis.Redis, own_server: RedisServer) -> None:
    """Every write refused with ``-OOM`` (native, then scripted acquires): each acquire fails
    with the refusal or gets its own outcome, none hangs; with memory back, all work."""
    result = run_child(own_server, "oom")
    oom = ("ResponseError", "ReplyError", "OutOfMemoryError")
    assert clean(result["native_oom"], oom), result
    assert clean(result["scripted_oom"], (*oom, "NoScriptError", "_NoScript")), result
    assert perfect(result["after"]), result


def test_a_busy_script_refusing_acquires_and_script_loads(redis_db: redis.Redis, own_server: RedisServer) -> None:
    """A script running for ever answers every acquire ``-BUSY`` (the scripted ones' SCRIPT
    LOAD too): the refused ones fail, none hangs or gets another's outcome; after SCRIPT KILL
    every acquire works (the script loaded again where its load was refused)."""
    result = run_child(own_server, "busy")
    assert clean(result["native_busy"], ("ResponseError", "ReplyError", "BusyError", "TimeoutError")), result
    assert clean(result["scripted_busy"], ("ResponseError", "ReplyError", "BusyError", "TimeoutError")), result
    assert result["ended1"] and result["ended2"], result
    assert perfect(result["after"]), result


def test_script_flushes_during_a_burst_of_scripted_acquires(redis_db: redis.Redis,
                                                            redis_server: RedisServer) -> None:
    """SCRIPT FLUSH every few milliseconds during 500 scripted acquires: each gets its own
    outcome or ``NoScriptError`` (missing twice in a row); then 100 more all get their own."""
    result = run_child(redis_server, "flush_storm")
    assert clean(result["storm"], ("NoScriptError", "_NoScript")), result
    assert perfect(result["after"]), result


def test_resp3_push_frames_between_the_replies_of_a_burst(redis_db: redis.Redis,
                                                          redis_server: RedisServer) -> None:
    """On RESP3 with ``CLIENT TRACKING ON`` on the shared connection, invalidation pushes arrive
    between the replies of 600 acquires: they are skipped, every acquire gets its own."""
    result = run_child(redis_server, "resp3_pushes", extra={"protocol": 3})
    assert result["baits"] > 0 and result["bait_errors"] == [], result
    assert perfect(result["burst"]) and perfect(result["after"]), result


def test_many_greenlets_with_a_small_pool(redis_db: redis.Redis, redis_server: RedisServer) -> None:
    """1,500 greenlets at once, a pool of 8: each gets its own outcome, no pooled connection made."""
    result = run_child(redis_server, "big")
    assert perfect(result["big"]), result


def test_native_threads_one_after_the_other(redis_db: redis.Redis, redis_server: RedisServer) -> None:
    """Native OS threads started one after the other each acquire once; a thread's ident may
    be one an ended thread had (and its channel, made on that thread's hub, still cached)."""
    result = run_child(redis_server, "thread_reuse")
    assert [r[2] for r in result["threads"]] == [True] * 8, result


def test_reset_clients_with_acquires_in_flight(redis_db: redis.Redis, redis_server: RedisServer) -> None:
    """reset_clients() while acquires wait, five times: every acquire ends (own outcome or a
    connection error), and the dropped clients' shared connections do not stay open."""
    result = run_child(redis_server, "reset")
    for round in range(5):
        assert clean(result[f"round{round}"], ("ConnectionError",)), result
    assert result["shared_open"] == 0, result


def test_a_cut_during_the_resend_of_a_cut_burst(redis_db: redis.Redis, redis_server: RedisServer) -> None:
    """The connection is cut after the server ran a burst, then cut again during the resend:
    every acquire gets its own outcome or a connection error, none hangs; the next burst works."""
    proxy = CuttingProxy(redis_server.port)

    def rearm() -> None:
        if proxy.cut_done.wait(60):
            proxy.cut_after(b"cut-me-")

    try:
        proxy.cut_after(b"cut-me-7")
        rearming = threading.Thread(target=rearm, daemon=True)
        rearming.start()
        result = run_child(redis_server, "cut_resend", port=proxy.port)
        rearming.join(10)
    finally:
        proxy.close()
    assert clean(result["cut"], ("ConnectionError",)), result
    assert perfect(result["after"]), result


GREEN_QUEUE = "adv-green-worker"


@pytest.mark.slow
def test_a_gevent_worker_runs_each_key_once_at_a_time(redis_server: RedisServer, records: redis.Redis,
                                                      locks: redis.Redis) -> None:
    """``celery worker -P gevent -c 200``: 20 keys, 10 copies of each sent at once. No key ever
    runs twice at once, each runs, the lock Redis is never reported unavailable, and once all
    ended one more run of each key runs (every lock was freed)."""
    importorskip("gevent")
    redis_server.flushall()
    with owning(Owner("adv-green worker")) as owner:
        worker = start_worker(redis_server, "tests.apps.tasks_app", "adv-green", pool="gevent", concurrency=200,
                              extra=["-Q", GREEN_QUEUE])
    try:
        tasks_app = clear_runs(redis_server)
        keys = [f"green-{n}" for n in range(20)]
        results = [tasks_app.work.apply_async((key, 0.3), queue=GREEN_QUEUE) for _ in range(10) for key in keys]
        wait_for(lambda: all(result.ready() for result in results), timeout=60, message="every copy ended")
        assert all(started(records, key) for key in keys), "each key ran"
        assert not any(records.get(f"overlap:{key}") for key in keys), "a key ran twice at once"
        assert lock_keys(locks) == [], "every lock freed"
        again = [tasks_app.work.apply_async((key,), queue=GREEN_QUEUE) for key in keys]
        wait_for(lambda: all(result.ready() for result in again), timeout=60, message="the second runs ended")
        assert all(len(started(records, key)) >= 2 for key in keys), "each key ran again once freed"
        log = worker.log.read_text()
        assert "unavailable" not in log and "Traceback" not in log, worker.tail(40)
    finally:
        owner.close()


def test_a_script_load_refused_loading_with_its_script_missing(redis_db: redis.Redis, redis_server: RedisServer,
                                                               tmp_path: Path) -> None:
    """A scripted acquire's (a copy of an ``acks_late`` message) ``SCRIPT LOAD`` answered
    ``-LOADING`` (redis-py's BusyLoadingError, a ConnectionError) and its ``EVALSHA``
    ``-NOSCRIPT``: the request ends with an outcome, its greenlet does not wait for ever
    (it did: the reply was taken for a lost connection after its request was dequeued);
    later acquires work."""
    rates = Rates(refuse=0, delay=0, close_before=0, close_after=0, cut=0, silence=0)
    with FaultProxy(redis_server.port, rates, seed=1) as proxy:  # seed 1: the first refusal is -LOADING
        try:
            with proxy.pause():  # no random draw but the forced refusal's
                result = run_child(redis_server, "loading_refusal", port=proxy.port,
                                   when_ready=lambda: proxy.force(b"SCRIPT", "refuse"), flag=tmp_path / "go")
            faults = dict(proxy.faults)
        finally:
            proxy.close()
    assert faults.get("refuse") == 1, f"the SCRIPT LOAD was refused: {faults}"
    assert not result["hung"], result
    assert perfect(result["after"]), result


def test_a_greenlet_killed_while_connecting(redis_db: redis.Redis, redis_server: RedisServer) -> None:
    """The greenlet making the shared connection is killed during the new connection's check
    (writes paused) with 20 others waiting to write: one of them connects, each gets its own
    outcome (a connection error at worst), none hangs."""
    result = run_child(redis_server, "kill_connecting", extra={"socket_timeout": 10.0})
    assert result["doomed_dead"], result
    assert clean(result["after"], ("ConnectionError",)) and perfect(result["again"]), result


def test_a_permission_taken_away_while_a_burst_waits(redis_db: redis.Redis, own_server: RedisServer) -> None:
    """``ACL SETUSER <user> -set`` while 40 acquires wait on the shared connection: each is
    refused or gets its own outcome, none hangs or gets another's; with SET given back (the
    library may have moved to its portable commands meanwhile) every acquire works."""
    admin = own_server.client()
    admin.acl_setuser("green", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"], commands=["+@all"])
    try:
        result = run_child(own_server, "acl", extra={"username": "green", "password": "pw"})
    finally:
        admin.close()
    assert clean(result["refused"], ("ResponseError", "ReplyError", "NoPermissionError")), result
    assert perfect(result["after"]), result

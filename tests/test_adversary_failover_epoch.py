"""Attacks on the Sentinel failover epoch in the server record (``recovery/window.py``),
against real redis-servers and real sentinels on loopback.

The scenario every test builds (:func:`reelect`): a primary ``A`` in use (its record at
some failover epoch), its replica ``B`` and three sentinels. ``A`` is stopped (SIGSTOP:
it keeps its data and answers nothing); the sentinels promote ``B``; a holder ``h`` (a
process of its own, liveness 1.5 s) takes ``k`` on ``B``. ``A`` resumes and a
``SENTINEL FAILOVER`` elects it again before the sentinels turn it into ``B``'s replica
(they wait 8 s): ``A`` is a primary already, keeps its data and history (it never
replicated from ``B``) and lacks ``k``; ``B`` resynchronises from it. This is the
``reelect-primary`` chaos fault, with the second failover forced instead of waited for.

What must hold there: a process that reaches ``A`` and never used ``B`` does not
acquire ``k`` without waiting for a recovery window (in which ``h`` puts its lock back).

Open breaks (``xfail(strict=True, raises=AssertionError)``):

* ``test_a_sentinel_that_heard_of_no_failover_is_asked_first``: the stated limit, shown
  end to end: one sentinel cut off from the others (it never hears their hello messages)
  names ``A`` at the epoch it had; a process whose first answer comes from it acquires.
* ``test_the_window_of_a_failover_is_as_long_as_the_interim_holders_need``: the window a
  fresh process opens lasts what it and ``A``'s record know of; a holder that published
  a longer need only on ``B`` (a worker started during the episode with a longer
  liveness TTL) needs more than that to put its lock back.

Held (each asserts something the rule alone provides: with the script's ``told ~= epoch``
condition made false, each fails):

* ``test_a_new_sentinel_fleet_starts_its_epochs_again``: the sentinels' epochs are not
  monotone across sentinel deployments (sentinels started on a fresh configuration count
  from 0 again): a record written under an earlier fleet is above every epoch of the new
  one. Broke while the window opened only for a higher epoch; it opens for another one.

* ``test_an_idle_pooled_connection_from_before_the_episode``: a process that used ``A``
  before the episode and was idle throughout (its pooled connection to ``A`` kept, never
  re-checked by the pool since ``A``'s address never changed for it) opens the window on
  its next request; it holds because the sentinels' promotion of ``A`` (``SLAVEOF NO
  ONE`` with ``CLIENT KILL TYPE normal``) closes every client connection of ``A``.
* ``test_a_beat_started_during_the_episode_claims_after_the_window``: a beat's claim
  round reaches the primary through its own path (``ClaimStore.reach``: the pool follows
  the sentinels, lends a connection, which is checked) and finds the window.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_singleton_beat.beat.claims import ClaimStore
from celery_singleton_beat.connection.client import redis_from_url
from celery_singleton_beat.lease.commands import look_request
from celery_singleton_beat.lease.executor import execute
from celery_singleton_beat.lease.lease import Lease
from celery_singleton_beat.recovery.server import LockServer, server_of
from celery_singleton_beat.recovery.window import FAILED_OVER, ServerRecord, mark_in_use, server_key
from harness.sentinel import MASTER_NAME, sentinel_args

from .support import wait_for
from .support.breaks import documented_break
from .support.locking import renew, take_lock
from .support.topologies import SentinelGroup, ServerProcess, start_sentinels
from .test_adversary_putback import breaks, reached, spec
from .test_adversary_renewal_epoch import take

PREFIX = "singleton"
KEY = "singleton:{epoch:k}"
#: A key no test contends for: a request on it makes a process connect (and check).
WARM = "singleton:{epoch:warm}"
#: Bound on each gate of the re-election (each waits on a condition, never a fixed time).
GATE = 30.0


def process(url: str, liveness: float = 1.5) -> Any:
    """A process of the library of its own: one client (its own sentinel manager, so its
    own failover epoch), one memory of the servers it saw, its ``singleton_liveness_ttl``."""
    server = LockServer(PREFIX, liveness)
    # As the library builds its client (recovery/lock_redis.py): every connection is
    # checked as it connects, whatever path lends it.
    client = redis_from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0, redis_connect_func=server.on_connect)
    client.csb_server = server  # type: ignore[union-attr]
    return client


def touch(client: Any) -> None:
    """One lock request of ``client``'s process (it connects, and its connection is checked)."""
    execute(client, WARM, lambda info: look_request(WARM))


def gate(condition: Any, message: str, interval: float = 0.05) -> None:
    """Wait for a step of the scenario; past :data:`GATE`, the scenario was not reached (a
    plain failure, never counted as an expected one)."""
    try:
        wait_for(condition, timeout=GATE, interval=interval, message=message)
    except AssertionError as exc:
        pytest.fail(f"scenario not reached: {exc}")


def named(sentinel: redis.Redis) -> tuple[int, str, int]:
    """What ``sentinel`` says of the primary: its port, flags and failover epoch."""
    state: Any = sentinel.sentinel_master(MASTER_NAME)
    return int(state["port"]), str(state["flags"]), int(state["config-epoch"])


def all_name(group: SentinelGroup, port: int, sentinels: int = 3) -> bool:
    """Every sentinel of ``group`` names the server on ``port`` as a primary that is up."""
    try:
        states = [named(group.sentinel(i)) for i in range(sentinels)]
    except redis.RedisError:
        return False
    return all(p == port and "down" not in flags for p, flags, _ in states)


def role(server: ServerProcess) -> str:
    """``server``'s replication role ('' when it does not answer)."""
    try:
        with server.client() as direct:
            return str(direct.info("replication").get("role"))
    except redis.RedisError:
        return ""


@dataclass
class Episode:
    """What :func:`reelect` left: the group, ``A`` and ``B``, and ``h``'s lease of ``k``."""

    group: SentinelGroup
    a: ServerProcess
    b: ServerProcess
    held: Lease


@pytest.fixture
def group() -> Iterator[SentinelGroup]:
    group = start_sentinels(down_after_ms=1000)
    try:
        yield group
    finally:
        for server in group.servers:
            if server.running:
                server.send(signal.SIGCONT)
        group.stop()


def reelect(group: SentinelGroup, h: Any, sentinels: int = 3) -> Episode:
    """The episode of the module docstring, ``h`` the holder; the first ``sentinels`` of the
    group's are up."""
    _, port = group.master_address()
    a = group.server_on(port)
    b = next(s for s in group.servers[:2] if s is not a)
    a.send(signal.SIGSTOP)
    try:
        gate(lambda: all_name(group, b.port or 0, sentinels) and role(b) == "master", "the sentinels promote B")
        held = take(h, KEY, spec("h-boot"), "h", "h takes k on B")
        with b.client() as on_b:
            reached(on_b.get(KEY) == held.value.encode(), "h's lock is on B")
    finally:
        a.send(signal.SIGCONT)

    def replica_up() -> bool:
        replicas: Any = group.sentinel().sentinel_slaves(MASTER_NAME)
        return any(int(r["port"]) == a.port and "down" not in str(r["flags"]) for r in replicas)

    gate(replica_up, "the sentinels see A up again (as B's replica)")

    def forced() -> bool:
        try:
            return bool(group.sentinel().execute_command("SENTINEL FAILOVER", MASTER_NAME))
        except redis.ResponseError:  # INPROG, NOGOODSLAVE: not yet
            return False

    gate(forced, "a SENTINEL FAILOVER is accepted", interval=0.2)
    gate(lambda: all_name(group, a.port or 0, sentinels) and role(a) == "master", "the sentinels name A again")
    with a.client() as direct:
        reached(direct.get(KEY) is None, "A, elected again, lacks h's lock taken on B")
    return Episode(group, a, b, held)


def record_on(server: ServerProcess) -> ServerRecord:
    """The server record on ``server`` (a plain failure if there is none)."""
    with server.client() as direct:
        record = ServerRecord.decode(direct.get(server_key(PREFIX)))
    if record is None:
        pytest.fail(f"scenario not reached: no record on {server.name}")
    return record


def epoch_of(client: Any) -> int:
    """The failover epoch of the latest answer ``client``'s sentinel manager took."""
    return int(client.connection_pool.sentinel_manager.answers.get(MASTER_NAME, (None, 0))[1])


@pytest.mark.timeout(120)
def test_an_idle_pooled_connection_from_before_the_episode(group: SentinelGroup) -> None:
    """``m`` used ``A`` before the episode (its connection checked, at epoch 0) and was idle
    throughout: its pool never saw ``B``, so ``A``'s address never changed for it and
    nothing in the pool re-checks the connection it keeps. After ``A``'s re-election,
    ``m``'s next request must still open the failover's window (its old connection was
    closed by the promotion, and its new one is checked at epoch 2), and its acquisition
    of ``k`` waits for it while ``h``'s renewal puts its lock back on ``A``."""
    with group.servers[0].client() as direct:
        mark_in_use(direct, PREFIX)
    m, h = process(group.url), process(group.url)
    touch(m)
    idle = {"{}:{}".format(*c._sock.getsockname()) for c in m.connection_pool._available_connections if c._sock}
    with group.servers[0].client() as direct:
        reached(idle and idle <= {str(c["addr"]) for c in direct.client_list()}, "m keeps an idle connection to A")
    episode = reelect(group, h)
    with episode.a.client() as direct:
        clients = {str(c["addr"]) for c in direct.client_list()}
    reached(not idle & clients, "the promotion of A (SLAVEOF NO ONE, CLIENT KILL TYPE normal) closed m's connection")
    touch(m)
    assert epoch_of(m) >= 2, "m's pool asked the sentinels again before lending"
    assert server_of(m).recovery().reason == FAILED_OVER, "m, idle through the episode, opens the window on A"
    assert record_on(episode.a).epoch == epoch_of(m), "the record on A is at the sentinels' epoch now"
    assert renew(episode.held), "h's renewal reaches A and puts its lock back"
    taken = take_lock(m, KEY, 30.0, task="putback", task_id="m")
    assert taken.lease is None and server_of(m).resumed() > 0, \
        f"m's acquisition waited for the window and found h's lock: {taken}"


@pytest.mark.timeout(120)
def test_a_beat_started_during_the_episode_claims_after_the_window(group: SentinelGroup) -> None:
    """A beat started once ``A`` is elected again (it never used ``B``) reaches the primary
    before its first claim round (the pool asks the sentinels now, a connection is lent
    and checked): it must open the failover's window there and hold its claims for it,
    while a beat that claimed slots on ``B`` gets there and writes them back."""
    with group.servers[0].client() as direct:
        mark_in_use(direct, PREFIX)
    episode = reelect(group, process(group.url))
    beat = process(group.url)
    store = ClaimStore(lambda: beat, PREFIX, "beat-started-late", margin=timedelta(seconds=3))
    left = store.reach()
    assert server_of(beat).recovery().reason == FAILED_OVER, "the beat opened the failover's window"
    assert left > 0 or server_of(beat).recovery().left() <= 0, "its claims wait for what is left of it"
    assert record_on(episode.a).epoch == epoch_of(beat) >= 2


@pytest.mark.timeout(120)
def test_a_new_sentinel_fleet_starts_its_epochs_again(group: SentinelGroup) -> None:
    """The record on ``A`` was written by processes an earlier sentinel deployment told
    epoch 10 (its own failovers); the sentinels were then replaced by ones started on a
    fresh configuration (a Kubernetes StatefulSet without a volume, a rebuilt VM), whose
    ``config-epoch`` starts at 0. After the episode they name ``A`` at epoch 2: a fresh
    process ``p`` finds the record above that, opens no window and takes ``k`` on ``A``
    beside ``h``, which still runs (its renewal is then refused), when the window opens
    only for a higher epoch. It opens for another one."""
    with group.servers[0].client() as direct:
        mark_in_use(direct, PREFIX, failover_epoch=10)
    h = process(group.url)
    episode = reelect(group, h)
    before = record_on(episode.a).epoch
    p = process(group.url)
    touch(p)
    reached(epoch_of(p) == 2 and before == 10, "the sentinels name A at 2, the record was at 10")
    window = server_of(p).recovery().open
    taken = take_lock(p, KEY, 30.0, task="putback", task_id="p")
    put_back = renew(episode.held)
    assert window, f"a fresh process on the re-elected former primary waits for a window (p took k: " \
                   f"{taken.lease is not None}; h's renewal afterwards: {put_back})"


def isolated_sentinel(group: SentinelGroup, primary_port: int) -> ServerProcess:
    """A fourth sentinel watching ``A``, cut off from the others: the commands it would
    send and hear hello messages with (PUBLISH, SUBSCRIBE) are renamed to ones that do
    not exist, and so are those it would reconfigure servers with: the others never learn
    of it, it never learns of their failovers, and it changes nothing. It goes on naming
    ``A`` at epoch 0 (a sentinel on the far side of a partition, or one restarted with an
    old configuration file, as long as it hears no hello)."""
    workdir = Path(group.workdir) / "isolated"

    def args_for(port: int) -> list[str]:
        config = workdir / "sentinel.conf"
        args = sentinel_args(config, port, primary_port, down_after_ms=1000)
        renamed = [f"sentinel rename-command {MASTER_NAME} {command} CSB-NO-{command}"
                   for command in ("PUBLISH", "SUBSCRIBE", "SLAVEOF", "REPLICAOF", "CONFIG", "CLIENT")]
        config.write_text(config.read_text() + "\n".join(renamed) + "\n")
        return args

    workdir.mkdir(parents=True, exist_ok=True)
    sentinel = ServerProcess("isolated-sentinel", args_for, workdir).start()
    group.servers.append(sentinel)  # stopped with the group
    return sentinel


@breaks("stated limit: a sentinel that heard of no failover names the former primary at its old epoch")
@pytest.mark.timeout(120)
def test_a_sentinel_that_heard_of_no_failover_is_asked_first(group: SentinelGroup) -> None:
    """``p``'s URL lists the isolated sentinel first (or it answered ``p`` first once: redis-py
    then keeps asking it first). After the episode it still names ``A``, at epoch 0, and
    ``p`` opens no window on ``A``, where ``h``'s lock is missing.

    Fix (a cost): take the highest ``config-epoch`` of every sentinel's answer, not the
    first passing one (one ``SENTINEL MASTERS`` per sentinel, every half second of use), or
    hold the first answer's epoch against a second sentinel's before a new connection's
    check."""
    _, port = group.master_address()
    with group.server_on(port).client() as direct:
        mark_in_use(direct, PREFIX)
    lag = isolated_sentinel(group, port)
    h = process(group.url)
    episode = reelect(group, h)
    with redis.Redis(host="127.0.0.1", port=lag.port or 0, socket_timeout=5) as sentinel:
        reached(named(sentinel) == (episode.a.port, "master", 0), "the isolated sentinel names A at epoch 0")
    p = process(f"sentinel://127.0.0.1:{lag.port};{group.url}")
    touch(p)
    reached(epoch_of(p) == 0, "p's first answer came from the isolated sentinel")
    window = server_of(p).recovery().open
    taken = take_lock(p, KEY, 30.0, task="putback", task_id="p")
    with documented_break():
        assert window, f"a fresh process on the re-elected former primary waits for a window (p took k: " \
                       f"{taken.lease is not None})"


@breaks("a failover's window lasts what the processes that used A need, not what B's holders need "
        "(within the documented 'the slowest one the noticing process knows of', but the rule's very case)")
@pytest.mark.timeout(120)
def test_the_window_of_a_failover_is_as_long_as_the_interim_holders_need(group: SentinelGroup) -> None:
    """The processes that used ``A`` run with a liveness TTL of 1.5 s (need: 2 s, in ``A``'s
    record). ``h``, a worker started during the episode with a liveness TTL of 6 s (it
    renews every 2 s, needs 3.5 s), took ``k`` on ``B`` and published its need in ``B``'s
    record only. A fresh process ``p`` opens the failover's window on ``A`` with what it
    can know: its own need and ``A``'s record, 2 s. ``h`` may renew 2 s after the episode
    ended, and put its lock back 1.5 s later at worst: ``p`` (and any process) acquires
    ``k`` once those 2 s have passed. (A window of the generation rule is opened by a
    process that used ``B``, which remembers ``B``'s record and its need.) The guarantees
    hedge the window's length ("as long as the slowest one the noticing process knows of
    needs"), but for this rule the noticing process can never know the holders it exists
    for.

    Fix (a cost): a window opened on a history the noticing process cannot know (a
    missing record, a failover since the record was written) lasts at least an upper
    bound of every process's need, e.g. a setting for the longest liveness TTL in use, or
    the longest need any record of that Sentinel service was seen with, kept where every
    process reads it (on the sentinels: ``SENTINEL CONFIG`` cannot; so a setting)."""
    with group.servers[0].client() as direct:
        mark_in_use(direct, PREFIX)
    touch(process(group.url))  # a process that used A: A's record needs 2 s
    h = process(group.url, liveness=6.0)
    episode = reelect(group, h)
    p = process(group.url)
    touch(p)
    reached(server_of(p).recovery().reason == FAILED_OVER, "the fresh process opened the failover's window")
    need = server_of(h).window
    opened = record_on(episode.a).need
    with documented_break():
        assert opened >= need, f"the window p opened on A lasts {opened}s; h, the holder on B, needs {need}s"

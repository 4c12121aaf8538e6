"""Adversary tests of the keeper's split (keeper.py: the queue and the thread; rounds.py: the
:class:`.rounds.Renewer`, which renews and judges; kept.py: :func:`.kept.take_due`), and of
the many-lease call written with :func:`.wire.bulk` and :func:`.wire.command_head` (real
redis-servers, no mocks of Redis). Each attack ran against the split and against the code
before it (the keeper in one module) where it applies; each held on both:

* Every kind of argument (empty, non-ASCII, ``\\r\\n``, NUL bytes, long, negative and huge
  ints, bytes, a ``bytes`` subclass) spelled by ``bulk`` behind ``command_head`` is the
  command :func:`.wire.pack` writes: HELD.
  ``test_bulk_and_command_head_spell_every_kind_of_argument_as_pack``.
* The head of the many-lease call for every width of its count (1, 9, 10, 99, 100, 512
  leases) is the one written by hand before: HELD.
  ``test_the_many_lease_call_head_is_the_hand_written_one_for_every_count_width``.
* A data loss signalled (``renew_all_soon``) while a round has its leases in flight: the
  round's leases are scheduled again and moved forward with the rest; nothing lost: HELD.
  ``test_renew_all_soon_during_a_round_moves_its_leases_forward_too``.
* A lease forgotten while its renewal is in flight, renewed by the many-lease script (its
  queue entry shared with the others): never taken by a later round: HELD.
  ``test_a_lease_forgotten_while_its_renewal_is_in_flight_is_not_taken_again``.
* A soft time limit (``SIGUSR1``, raised by its handler wherever the run is) landing inside
  :meth:`.keeper.LeaseKeeper.keep` as the keeper starts its thread (the first run of a
  process): the run abandoned its lease as it should, but the keeper was left marked
  running with no thread, and no lease of that process was ever renewed again. **BROKE**,
  on main too (older than the split); fixed since: a soft limit landing in ``keep`` (now
  anywhere in ``SingletonTask._begin``) is held until the lease is kept
  (:mod:`.task.soft_limit`), then raised. The test is
  ``test_adversary_merge.py::test_a_soft_limit_as_the_keeper_starts_its_thread_leaves_later_leases_renewed``.
* A fork while the parent's keeper holds its mutex (a round's put-back): the child's keeper
  renews with a mutex of its own, its :class:`~.rounds.Renewer`'s too: HELD.
  ``test_a_child_forked_while_the_parents_keeper_holds_its_mutex_renews``.

Also run on both: the soft time limit tests of ``test_adversary_merge`` in the combination where
they failed under load (six test files, two workers, load 7-9): their failure was the tests'
own (the pattern they waited on matched the task's counter hash), not the keeper's.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest
import redis

from celery_singleton_beat.connection.wire import bulk, command_head, pack
from celery_singleton_beat.lease import keeper as keeper_module
from celery_singleton_beat.lease.keeper import LeaseKeeper, get_keeper
from celery_singleton_beat.lease.lease import Lease
from celery_singleton_beat.lease.scripts import RENEW_MANY

from .support import RedisServer
from .support.locking import round_in_flight, take_leases, take_lock
from .test_adversary_scripted import own_server, scripted_only

TTLS = [3.0, 30.0, 7.0, 11.0, 19.0, 5.0]


def take(client: redis.Redis, task_id: str, ttl: float = 5.0, key: str = "fork") -> Lease:
    """The lock ``key`` (the fork test's by default), won by ``task_id``."""
    lease = take_lock(client, f"singleton:{{adv.split:{key}}}", ttl, task="adv.split", task_id=task_id).lease
    assert lease is not None
    return lease


class _Bytes(bytes):
    """A bytes subclass (an argument the encoder writes as its bytes)."""


@pytest.mark.parametrize("argument", [
    "", "\u00e9t\u00e9\r\n$5\r\n", "k" * 20_000, b"", b"\x00\r\n*1\r\n", _Bytes(b"sub"),
    0, -1, 10 ** 30, 7_500])
def test_bulk_and_command_head_spell_every_kind_of_argument_as_pack(argument: bytes | str | int) -> None:
    assert command_head(3, b"EVALSHA", "x") + bulk(argument) == pack(b"EVALSHA", "x", argument)
    assert command_head(2) + bulk(argument) + bulk(argument) == pack(argument, argument)


@pytest.mark.parametrize("count", [1, 9, 10, 99, 100, 512])
def test_the_many_lease_call_head_is_the_hand_written_one_for_every_count_width(count: int) -> None:
    hand_written = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n$%d\r\n%d\r\n" % (
        3 + 3 * count, RENEW_MANY.sha.encode(), len(str(count)), count)
    assert command_head(3 + 3 * count, b"EVALSHA", RENEW_MANY.sha, count) == hand_written


def test_renew_all_soon_during_a_round_moves_its_leases_forward_too(
        make_redis: Callable[..., RedisServer]) -> None:
    """Six leases in flight (the round took them); a data loss is signalled meanwhile. The
    round schedules them again; the thread's next look moves every entry to now, the round's
    included: all six are taken again at once, none lost."""
    server, _ = own_server(make_redis)
    leases = take_leases(server.client(), "soon", TTLS)
    keeper, kept, lost, taken = round_in_flight(leases)
    assert len(taken) == 6

    keeper.renew_all_soon()  # the data-loss listener, while the round is on its way
    keeper._handle(taken)

    assert keeper._renew_all, "the flag waits for the thread's next look"
    now = time.monotonic()
    with keeper._mutex:
        keeper._move_all_forward(now)
        again = keeper._take_due(now)
    assert sorted(id(k) for k in again) == sorted(id(k) for k in kept), "the round's leases moved forward too"
    keeper._handle(again)
    assert lost == [] and all(k.renewals == 2 for k in kept)


def test_a_lease_forgotten_while_its_renewal_is_in_flight_is_not_taken_again(
        make_redis: Callable[..., RedisServer]) -> None:
    """Six leases renewed by one script call; run 3 ends (forgotten) while the call is on its
    way, its lock still there (its release is the run's). The script renews it with the others
    and they share a queue entry; no later round takes it, and it is not counted kept."""
    server, direct = own_server(make_redis)
    leases = take_leases(server.client(), "forgotten", TTLS)
    scripted_only(direct)
    keeper = LeaseKeeper()
    keeper._running = True
    kept = [keeper.keep(lease) for lease in leases]
    with keeper._mutex:
        taken = keeper._take_due(float("inf"))
    keeper.forget(kept[3])

    keeper._handle(taken)

    for _ in range(2):
        with keeper._mutex:
            keeper._move_all_forward(float("-inf"))
            again = keeper._take_due(float("inf"))
        assert kept[3] not in again and len(again) == 5, "the forgotten lease was taken again"
        keeper._handle(again)
    assert keeper._active == 5
    assert all(k.renewals == 3 for n, k in enumerate(kept) if n != 3)


def test_a_child_forked_while_the_parents_keeper_holds_its_mutex_renews(redis_db: redis.Redis) -> None:
    """The parent's keeper holds its mutex (a put-back under way in its round) as the process
    forks: the child's keeper, and the renewer of its rounds, use a mutex of the child's own."""
    parent = get_keeper()
    lease = take(redis_db, "fork-0")
    parent.forget(parent.keep(lease))  # the parent's keeper thread is started
    assert lease.release()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with parent._mutex:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(30)
    read, write = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            ok = False
            try:
                keeper = get_keeper()
                kept = keeper.keep(take(redis_db, "fork-1", ttl=0.3))
                deadline = time.monotonic() + 10
                while kept.renewals < 2 and not kept.lost and time.monotonic() < deadline:
                    time.sleep(0.01)
                ok = (keeper is not parent and keeper.renewer._mutex is keeper._mutex
                      and kept.renewals >= 2 and not kept.lost)
            finally:
                os.write(write, b"1" if ok else b"0")
                os._exit(0)
    finally:
        release.set()
        holder.join(30)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1", "the child's lease was renewed by a keeper (and renewer) of its own"
    assert keeper_module._keeper is parent

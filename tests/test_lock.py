"""The lease against a real redis-server: acquire, renew, release, fence, keeper."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_singleton_beat.keeper import LeaseKeeper
from celery_singleton_beat.lock import acquire, fence_key, read_holder, release_task

from .support import RedisServer, soak, wait_for

KEY = "t:{demo.task:abc}"


def take(client: redis.Redis, task_id: str = "id-1", ttl: float = 5.0, **kw):
    return acquire(client, KEY, ttl, task="demo.task", task_id=task_id, node="w1@host", boot="b1", **kw)


def test_acquire_is_exclusive_and_reports_the_holder(redis_db: redis.Redis) -> None:
    first = take(redis_db)
    second = take(redis_db, "id-2")
    assert first.acquired and not second.acquired
    assert second.holder is not None and second.holder.task_id == "id-1"
    assert second.holder.node == "w1@host" and second.holder.task == "demo.task"
    assert 0 < (second.holder_ttl or 0) <= 5.0
    assert redis_db.pttl(KEY) > 0, "a lock always expires on its own"


def test_release_and_renew_only_by_the_holder(redis_db: redis.Redis) -> None:
    lease = take(redis_db, ttl=1.0).lease
    assert lease is not None
    redis_db.delete(KEY)
    successor = take(redis_db, "id-2").lease
    assert successor is not None
    # The old holder's late renew and release must leave the new holder alone.
    assert lease.renew() is False
    assert lease.release() is False
    assert read_holder(redis_db, KEY).task_id == "id-2"
    assert successor.renew() is True and redis_db.pttl(KEY) > 1000
    assert successor.release() is True and not redis_db.exists(KEY)


def test_fencing_token_grows_even_after_its_counter_expired(redis_db: redis.Redis) -> None:
    fences = []
    for i in range(3):
        lease = take(redis_db, f"id-{i}").lease
        fences.append(lease.fence)
        lease.release()
    assert fences == sorted(fences) and len(set(fences)) == 3
    redis_db.delete(fence_key(KEY))  # as if the counter expired during a long idle time
    after = take(redis_db, "id-9").lease
    assert after.fence > fences[-1]
    assert read_holder(redis_db, KEY).fence == after.fence


def test_scripts_are_reloaded_after_script_flush(redis_db: redis.Redis) -> None:
    take(redis_db).lease.release()
    redis_db.script_flush()
    assert take(redis_db).acquired


def test_release_task_frees_only_that_tasks_lock(redis_db: redis.Redis) -> None:
    take(redis_db, "id-1")
    assert release_task(redis_db, KEY, "someone-else") is False
    assert release_task(redis_db, KEY, "id-1") is True
    assert not redis_db.exists(KEY)


def test_a_run_adopts_its_own_publish_claim_only(redis_db: redis.Redis) -> None:
    assert take(redis_db, "id-1", claim=True).acquired
    assert not take(redis_db, "id-2", adopt_claim_of="id-2").acquired
    adopted = take(redis_db, "id-1", adopt_claim_of="id-1")
    assert adopted.acquired and adopted.lease.holder.claim is False
    # A run lease is never adopted, even by the same task id (acks_late redelivery).
    assert not take(redis_db, "id-1", adopt_claim_of="id-1").acquired


def test_keeper_keeps_a_lease_alive_for_five_times_its_ttl(redis_db: redis.Redis) -> None:
    lease = take(redis_db, ttl=0.5).lease
    kept = LeaseKeeper().keep(lease)

    def still_held() -> bool:
        holder = read_holder(redis_db, KEY)
        return not kept.lost and holder is not None and holder.task_id == "id-1"

    # A soak: five TTLs must pass; the lease is checked held all along.
    assert soak(2.5, check=still_held, what="the kept lease") >= 20
    assert kept.renewals >= 4


def test_keeper_does_not_hold_on_to_forgotten_leases(redis_db: redis.Redis) -> None:
    """Short runs end long before their first renewal: the keeper must not keep each
    ended run's lease (and its callbacks) until that renewal time (60 s leases at 700
    runs/s were 14,000 dead entries)."""
    keeper = LeaseKeeper()
    lease = take(redis_db, ttl=60.0).lease
    for _ in range(1000):
        keeper.forget(keeper.keep(lease))
    running = keeper.keep(lease)
    assert keeper.tracked <= 64, f"{keeper.tracked} entries kept for 1 running lease"
    keeper.forget(running)


def test_keeper_is_not_woken_by_each_short_run(redis_db: redis.Redis) -> None:
    """A run that ends before its first renewal must not cost a thread wake-up.

    Each such wake-up (a futex call, a switch to the keeper thread and back, the
    GIL handed over twice) cost a solo worker about 8 system calls per no-op task.
    Between runs the worker does I/O, which lets the keeper thread run: a PING stands for it.
    """
    keeper = LeaseKeeper()
    lease = take(redis_db, ttl=60.0).lease
    keeper.forget(keeper.keep(lease))  # starts the thread
    wait_for(lambda: keeper.waiting, timeout=10, message="the keeper thread to wait")
    before = keeper.wakeups
    for _ in range(200):  # a no-op body: forgotten before any I/O, as in a worker
        keeper.forget(keeper.keep(lease))
        redis_db.ping()
    assert keeper.wakeups - before <= 5, f"the keeper woke {keeper.wakeups - before} times for 200 short runs"


def test_keeper_reports_a_deleted_lease(redis_db: redis.Redis) -> None:
    lease = take(redis_db, ttl=0.6).lease
    reasons: list[str] = []
    kept = LeaseKeeper().keep(lease, on_lost=lambda _k, reason: reasons.append(reason))
    redis_db.delete(KEY)
    wait_for(lambda: kept.lost, timeout=10, message="loss reported")
    assert reasons and "deleted" in reasons[0]


def test_keeper_reports_loss_when_redis_is_gone_past_the_ttl(make_redis: Callable[..., RedisServer]) -> None:
    server = make_redis()
    client = server.client(socket_timeout=0.2, socket_connect_timeout=0.2)
    lease = acquire(client, KEY, 0.6, task="demo.task", task_id="id-1").lease
    kept = LeaseKeeper().keep(lease)
    server.kill()
    wait_for(lambda: kept.lost, timeout=10, message="loss reported")
    assert "unreachable" in (kept.lost_reason or "")


def requests_of(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on, the name of every command this process writes to a Redis connection
    (one request each; the lock's own connection included)."""
    sent: list[str] = []
    send = redis.connection.AbstractConnection.send_packed_command

    def recorded(self: Any, command: Any, *args: Any, **options: Any) -> Any:
        first = command if isinstance(command, (bytes, str)) else command[0]
        first = first.encode() if isinstance(first, str) else bytes(first)
        sent.append(first.split(b"\r\n")[2].decode().upper())  # *<n> $<len> NAME ...
        return send(self, command, *args, **options)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", recorded)
    return sent


def test_counters_are_kept_in_the_same_round_trip(redis_db: redis.Redis, redis_server: RedisServer,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each operation is one request (EVALSHA) and its counter has moved when it returns."""
    stats = "t:{stats}:task:demo.task"
    warm = take(redis_db, "warm-up", stats_key="t:{stats}:warm-up").lease  # every script loaded first
    assert warm is not None and warm.renew() and warm.release()
    release_task(redis_db, KEY, "nobody", stats_key="t:{stats}:warm-up")
    observer = redis_server.client()

    def counts() -> dict[str, int]:
        return {k.decode(): int(v) for k, v in observer.hgetall(stats).items()}

    observer.ping()  # connected before the recording starts
    sent = requests_of(monkeypatch)

    def one_request(operation: Callable[[], Any], expected: dict[str, int]) -> Any:
        sent.clear()
        result = operation()
        assert sent == ["EVALSHA"], f"one request, the script: {sent}"
        assert counts() == expected, "the counter moved in that same request"
        return result

    lease = one_request(lambda: take(redis_db, stats_key=stats).lease, {"acquired": 1})
    one_request(lambda: take(redis_db, "id-2", stats_key=stats, counters=("acquired", "refused")),
                {"acquired": 1, "refused": 1})
    one_request(lease.renew, {"acquired": 1, "refused": 1, "renewed": 1})
    one_request(lease.release, {"acquired": 1, "refused": 1, "renewed": 1, "released": 1})
    one_request(lambda: take(redis_db, "id-3", stats_key=stats),
                {"acquired": 2, "refused": 1, "renewed": 1, "released": 1})
    observer.delete(KEY)
    assert one_request(lambda: release_task(redis_db, KEY, "id-3", stats_key=stats),
                       {"acquired": 2, "refused": 1, "renewed": 1, "released": 1}) is False  # nothing held
    assert observer.pttl(stats) > 0, "counters expire when no longer updated"


def test_counter_hash_ttl_is_refreshed_on_creation_and_every_64th_update(redis_db: redis.Redis) -> None:
    """The counters keep a TTL without a PEXPIRE per lock operation (docs/monitoring.md)."""
    stats = "t:{stats}:task:demo.task"

    def one_run(i: int) -> None:
        result = take(redis_db, f"id-{i}", stats_key=stats)
        assert result.lease is not None and result.lease.release()

    one_run(0)
    assert redis_db.pttl(stats) > 0, "a new counter field sets the TTL"
    redis_db.persist(stats)  # as if the TTL had been lost
    for i in range(1, 63):  # acquired/released reach 63: no refresh yet
        one_run(i)
    assert redis_db.pttl(stats) == -1
    one_run(63)
    one_run(64)  # the 65th update of each field refreshes it
    assert int(redis_db.hget(stats, "acquired")) == 65
    assert redis_db.pttl(stats) > 0

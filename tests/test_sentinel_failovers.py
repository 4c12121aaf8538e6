"""Ten Sentinel failovers in a row while workers run leases and tasks and beats send slots.

``SENTINEL FAILOVER`` promotes the replica at once, but the old primary goes on
accepting writes until the sentinels turn it into a replica (about ten seconds
later): a client whose pooled connections still point at it keeps renewing its
leases there, writes the promoted primary never sees. Its locks expire on the new
primary meanwhile; once that client reaches it, it must still be allowed to put
them back (however late its process noticed the promotion, as long as the lease
has not ended on its own clock), and no other client may take them first.

Per failover: three runs hold 1 s leases across it and are then let go; the
runs must report their lease kept. Throughout: a stream of 0.5 s runs on three
hot keys from two workers (no two runs of a key overlap) and two beats sending a
slot every 0.5 s (no slot sent twice: each beat writes back the claims the new
primary lacks, and claims no new slot during the recovery window; slots that come
due in the window are sent when it ends, the latest of them for an entry due more
often than that, as after an outage).

A round whose leases were lost while the machine's wall clock stepped forward (by at
least the two thirds of the lease a renewal on time leaves) is void, not a failure: Redis
keeps TTLs on its wall clock, so such a step expires the 1 s leases (and the 2 s
liveness keys) at once, however punctually their holders renewed them on their
monotonic clocks, and the library rightly reports them lost; the sentinels then sit in
TILT mode for 30 s (see ``tests/support/stalls.py``). A loss without such a step fails.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from datetime import timedelta
from types import ModuleType

import pytest
import redis
from celery.result import AsyncResult

from celery_singleton_beat.config import clear_settings_cache
from celery_singleton_beat.recovery.lock_redis import reset_clients

from .support import CeleryProcess, RedisServer, start_worker, wait_for
from .support.beat import sent_slots
from .support.failover_load import HOT_KEYS, FailoverLoad
from .support.slots import duplicates_and_misses
from .support.stalls import monitor
from .support.tasks import settled
from .support.topologies import MASTER_NAME, SentinelGroup, start_sentinels, wait_for_new_primary

APP = "tests.apps.tasks_app"
FAILOVERS = 10


def _demoted(group: SentinelGroup, old: tuple[str, int]) -> bool:
    """The old primary is a replica of the new one, in sync: ready for the next failover."""
    try:
        with redis.Redis(host=old[0], port=old[1], socket_timeout=2, decode_responses=True) as server:
            info = server.info("replication")
    except redis.RedisError:
        return False
    return info.get("role") == "slave" and info.get("master_link_status") == "up"


def _failed_over(group: SentinelGroup) -> bool:
    """``SENTINEL FAILOVER``, once the sentinels accept one (True): until they count the old
    primary of the previous failover as a healthy replica, they answer NOGOODSLAVE."""
    try:
        group.sentinel().execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
    except redis.ResponseError as exc:
        if "NOGOODSLAVE" in str(exc) or "INPROG" in str(exc):
            return False
        raise
    return True


def _held_on_primary(group: SentinelGroup, keys: list[str]) -> bool:
    host, port = group.master_address()
    with redis.Redis(host=host, port=port, socket_timeout=2) as primary:
        return all(primary.exists(key) for key in keys)


@pytest.mark.slow
@pytest.mark.timeout(900)  # ten failovers of ~12 s; every wait inside has its own deadline
def test_ten_sentinel_failovers_in_a_row_lose_no_lease_and_run_no_key_twice(
        tasks: ModuleType, records: redis.Redis, redis_server: RedisServer,
        processes: list[CeleryProcess]) -> None:
    watch = monitor()  # steps of the wall clock (see the module's docstring)
    group = start_sentinels(down_after_ms=1000)
    load: FailoverLoad | None = None
    try:
        clear_settings_cache()
        reset_clients()
        env = {"CSB_LOCK_REDIS": group.url, "CSB_BACKOFF_MAX": "1", "CSB_LOCK_TTL": "3"}
        for name in ("fo-a", "fo-b"):
            processes.append(start_worker(redis_server, APP, name, concurrency=5, env=env))
        load = FailoverLoad(tasks, group.url, seed=11)
        beats, published, beat_errors = load.beats, load.published, load.beat_errors
        load.start()
        wait_for(lambda: len(sent_slots(*beats)) >= 2, timeout=30, message="beats sending")

        leases: list[AsyncResult] = []
        failover_times: list[float] = []
        # A renewal on time leaves two thirds of the lease: a forward step of the wall clock
        # that long expires the leases whose renewal is about due.
        expiring_step = tasks.hold_lease.lock_ttl * 2 / 3
        void: list[str] = []
        for round_ in range(FAILOVERS):
            began = time.monotonic()
            names = [f"lease{round_}-{i}" for i in range(3)]
            runs = [tasks.hold_lease.delay(name) for name in names]
            leases += runs
            wait_for(lambda: all(records.get(f"fence:{n}") for n in names), timeout=60,  # noqa: B023
                     message="the runs hold their leases")
            keys = [tasks.hold_lease.singleton_key((name,), {}) for name in names]
            old = group.master_address()
            wait_for(lambda: _failed_over(group), timeout=60, interval=0.2,
                     message="the sentinels to accept a failover")
            failover_times.append(time.time())
            wait_for_new_primary(group, old)
            wait_for(lambda: _demoted(group, old), timeout=60, interval=0.1,  # noqa: B023
                     message="the old primary turned into a replica")
            # The keepers reach the new primary: each lease is there (kept, or put back).
            wait_for(lambda: _held_on_primary(group, keys) or any(r.ready() for r in runs),  # noqa: B023
                     timeout=30, message="the leases held on the new primary")
            for name in names:
                records.set(f"release:{name}", "1")
            wait_for(lambda: settled(runs), timeout=60, message="the lease runs ended")  # noqa: B023
            lost = [(r.id, r.result) for r in runs if r.state != "SUCCESS" or r.result.get("lost")]
            stepped = watch.stepped(began, time.monotonic())
            if lost and stepped >= expiring_step:
                void.append(f"failover {round_ + 1}: {len(lost)} leases expired by a {stepped:.1f} s step of the "
                            f"wall clock")
                continue
            assert not lost, f"failover {round_ + 1}: leases lost: {lost}" + \
                (f" (the wall clock stepped {stepped:.2f} s forward meanwhile)" if stepped else "")

        # A void round proves nothing: most rounds must count.
        assert len(void) <= FAILOVERS // 5, f"too many rounds voided by steps of the wall clock: {void}"
        load.finish()
        wait_for(lambda: settled(published), timeout=120, message="every task settled")
        states = Counter(r.state for r in published)
        overlaps = {k: int(records.get(f"overlap:{k}") or 0) for k in HOT_KEYS}
        slots = duplicates_and_misses(sent_slots(*beats).elements(), timedelta(seconds=0.5))
        print(f"\nFAILOVERS {FAILOVERS}: leases {len(leases)} kept, tasks {dict(states)}, overlaps {overlaps}, "
              f"beat {slots}, hot runs {sum(records.llen(f'runs:{k}') for k in HOT_KEYS)}, void rounds {void}")
        duplicated = {label: sorted(round(sent["at"] - min(failover_times, key=lambda t: abs(t - sent["at"])), 2)
                                    for beat in beats for sent in beat.sent if sent["slot"] == label)
                      for label, count in sent_slots(*beats).items() if count > 1}
        assert states["FAILURE"] == 0, states
        assert sum(overlaps.values()) == 0, overlaps
        assert slots["duplicates"] == 0, (slots, "sends relative to the nearest failover:", duplicated)
        assert not beat_errors, beat_errors
        assert all(json.loads(r)["fence"] for k in HOT_KEYS for r in records.lrange(f"runs:{k}", 0, -1))
    finally:
        if load is not None:
            load.close()
        group.stop()
        clear_settings_cache()
        reset_clients()

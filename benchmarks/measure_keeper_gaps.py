"""How long each lease of a gevent process went without a confirmation: figures, no assertions.

A gevent-patched process (as a ``-P gevent`` worker) runs ``--leases`` greenlets against a
redis-server of its own. Each takes its own lock (``lock_ttl = --ttl``) through the
library's client, hands it to the lease keeper, sleeps 15-25 s (a gevent sleep) and then
ends as a run did (``forget``, then the compare-and-delete through the pool; with
``--release-first`` as a run does now: the keeper renews until the release is answered).
Starts are spread over ``--start-over`` seconds. ``--hogs`` other processes spin on the
CPU, ``--hub-block`` blocks the hub now and then (a task's CPU-bound stretch), and
``--hub-busy`` makes the hub's own thread do Python work that fraction of the time (in
slices of a few milliseconds: the keeper thread gets the interpreter lock only when the
hub lets it go), as a worker busy taking in messages does.

Every confirmation of a lease (its acquire, each renewal) is recorded with the time its
request started (what the lease's TTL counts from, at the latest), and so are its
``keep``, ``forget`` and the reply to its release. Printed:

* the gaps between consecutive confirmations of a lease, over all leases (median, p99,
  max), and how many exceeded the TTL: a renewal that came too late;
* the keeper's lateness: how long after its due time each entry was taken for renewal;
* the gap from a lease's last confirmation to its release reply (the run ended, the
  keeper stopped renewing, the release waited for a pooled connection): a release that
  came after the TTL finds the lock gone;
* releases that found the lock gone, split by where the TTL ran out.

Run from a checkout: ``python -m benchmarks.measure_keeper_gaps --leases 3000`` (a
redis-server of its own unless ``--url`` names one).
"""

from __future__ import annotations

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402
import itertools  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import gevent  # noqa: E402
from celery import Celery  # noqa: E402

from celery_singleton_beat.lease import keeper as keeper_module  # noqa: E402
from celery_singleton_beat.lease import rounds as rounds_module  # noqa: E402
from celery_singleton_beat.lease.lease import Lease  # noqa: E402
from celery_singleton_beat.lease.lock import acquire  # noqa: E402
from celery_singleton_beat.lease.spec import LockSpec  # noqa: E402
from celery_singleton_beat.recovery.lock_redis import get_redis  # noqa: E402

from .common import Server  # noqa: E402

#: key -> monotonic start times of the requests that confirmed it (acquire, renewals)
confirmed: dict[str, list[float]] = {}
#: key -> (keep, forget, release reply) monotonic times, and the release's result
ends: dict[str, tuple[float, float, float, bool | None]] = {}
#: seconds each entry was taken after its due time (the keeper's lateness)
lateness: list[float] = []
#: (leases, keeper thread CPU s, wall s) per renewal batch
batch_cost: list[tuple[int, float, float]] = []
#: key -> why the keeper found it lost (None: it did not)
reasons: dict[str, str | None] = {}
#: key -> the due times the keeper gave it
dues: dict[str, list[float]] = {}
#: acquires and releases that raised (their error's name)
failed: list[str] = []
#: (monotonic, entries taken) per round of the keeper
rounds: list[tuple[float, int, float]] = []


def instrument() -> None:
    """Record confirmations and the keeper's schedule (this process only)."""
    original_confirmed = Lease._confirmed

    def recorded_confirmed(self: Lease, started: float, epoch: int) -> None:
        confirmed.setdefault(self.key, []).append(started)
        original_confirmed(self, started, epoch)

    Lease._confirmed = recorded_confirmed  # type: ignore[method-assign]
    original_take = keeper_module.LeaseKeeper._take_due
    original_schedule = keeper_module.LeaseKeeper._schedule
    due: dict[int, float] = {}

    def recorded_schedule(self: Any, kept: Any, when: float) -> None:
        due[id(kept)] = when
        dues.setdefault(kept.lease.key, []).append(when)
        original_schedule(self, kept, when)

    def recorded_take(self: Any, now: float) -> list[Any]:
        taken = original_take(self, now)
        for kept in taken:
            lateness.append(now - due[id(kept)])
        if taken:
            rounds.append((now, len(taken), 0.0))
        return taken

    keeper_module.LeaseKeeper._take_due = recorded_take  # type: ignore[method-assign]
    original_batch = rounds_module.Renewer.renew_round

    def timed_batch(self: Any, leases: list[Any], buckets: list[Any]) -> Any:
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            return original_batch(self, leases, buckets)
        finally:
            batch_cost.append((len(leases), time.thread_time() - cpu, time.perf_counter() - wall))

    rounds_module.Renewer.renew_round = timed_batch  # type: ignore[method-assign]
    keeper_module.LeaseKeeper._schedule = recorded_schedule  # type: ignore[method-assign]


def hog() -> None:
    while True:
        pass


def hub_work(busy: float) -> None:
    """Python work on the hub's thread, ``busy`` of the time, in slices of ~5 ms."""
    while True:
        end = time.perf_counter() + 0.005
        while time.perf_counter() < end:
            pass
        gevent.sleep(0.005 * (1 - busy) / busy)


def hub_blocks(seconds: float, every: float) -> None:
    """A greenlet that blocks the hub for ``seconds`` every ``every`` seconds (a task's
    CPU-bound or unpatched blocking call): the keeper's thread renews meanwhile."""
    while True:
        gevent.sleep(every - seconds)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default=None,
                        help="the lock redis-server, redis://host:port/db (default: one of its own)")
    parser.add_argument("--leases", type=int, default=3000)
    parser.add_argument("--ttl", type=float, default=3.0)
    parser.add_argument("--start-over", type=float, default=10.0, help="seconds the starts spread over")
    parser.add_argument("--hold", type=float, nargs=2, default=(15.0, 25.0))
    parser.add_argument("--hogs", type=int, default=0)
    parser.add_argument("--hub-busy", type=float, default=0.0)
    parser.add_argument("--hub-block", type=float, nargs=2, default=None, metavar=("SECONDS", "EVERY"),
                        help="block the hub SECONDS at a time, every EVERY seconds")
    parser.add_argument("--max-connections", type=int, default=None, help="the pool's (the library's default: 64)")
    parser.add_argument("--release-first", action="store_true",
                        help="end a run by its release, then forget (the keeper renews while the release waits)")
    args = parser.parse_args()
    server = None
    if args.url is None:
        server = Server()  # marked in use: no recovery window for the first locks
        args.url = f"{server.url}/0"
    try:
        measure(args)
    finally:
        if server is not None:
            server.stop()


def measure(args: argparse.Namespace) -> None:
    """Run the leases of ``args`` and print the report."""
    instrument()
    hogs = [multiprocessing.Process(target=hog, daemon=True) for _ in range(args.hogs)]
    for process in hogs:
        process.start()
    app = Celery("gaps", set_as_current=False)
    app.conf.singleton_redis_url = args.url
    if args.max_connections:
        app.conf.singleton_redis_options = {"max_connections": args.max_connections}
    client = get_redis(app)
    spec = LockSpec(task="gaps", ttl=args.ttl)
    keeper = keeper_module.get_keeper()
    if args.hub_busy > 0:
        gevent.spawn(hub_work, args.hub_busy)
    if args.hub_block:
        gevent.spawn(hub_blocks, *args.hub_block)

    def run(n: int) -> None:
        gevent.sleep(random.uniform(0, args.start_over))
        key = f"singleton:gaps:{n}"
        try:
            lease = acquire(client, key, spec, f"run-{n}").lease
        except Exception as exc:  # a pool that stayed full past its bound: not started
            failed.append(type(exc).__name__)
            return
        assert lease is not None
        kept_at = time.monotonic()
        kept = keeper.keep(lease)
        gevent.sleep(random.uniform(*args.hold))
        forgot_at = time.monotonic()
        if args.release_first:
            keeper.releasing(kept)
        else:
            keeper.forget(kept)
        try:
            released = lease.release()
        except Exception as exc:  # a pool that stayed full past its bound: the lock expires
            failed.append("release " + type(exc).__name__)
            released = None
        if args.release_first:
            keeper.forget(kept)
        ends[key] = (kept_at, forgot_at, time.monotonic(), released)
        reasons[key] = kept.lost_reason

    began = time.monotonic()
    cpu = os.times()
    gevent.joinall([gevent.spawn(run, n) for n in range(args.leases)])
    cpu_used = sum(os.times()[:2]) - sum(cpu[:2])
    for process in hogs:
        process.terminate()
    report(args, time.monotonic() - began, cpu_used, keeper)


def report(args: argparse.Namespace, wall: float, cpu_used: float, keeper: Any) -> None:
    ttl = args.ttl
    gaps: list[float] = []
    late_leases = 0
    lost = {"renewal late": 0, "renewal missing at forget": 0, "after forget": 0, "other": 0}
    tail: list[float] = []
    acquiring: list[float] = []
    releases_failed = sum(name.startswith("release") for name in failed)
    releasing: list[float] = []
    for key, times in confirmed.items():
        if key not in ends:
            continue
        kept_at, forgot_at, replied_at, released = ends[key]
        acquiring.append(kept_at - times[0])
        # The first interval from the acquire's reply (keep): its request may have waited
        # long for a pooled connection before Redis set the key.
        times = [kept_at, *times[1:]]
        between = [b - a for a, b in itertools.pairwise(times)]
        gaps.extend(between)
        late_leases += any(gap > ttl for gap in between)
        tail.append(replied_at - times[-1])
        releasing.append(replied_at - forgot_at)
        if released is False:
            if any(gap > ttl for gap in between):
                lost["renewal late"] += 1
            elif forgot_at - times[-1] > ttl:
                lost["renewal missing at forget"] += 1
                if os.environ.get("GAPS_DEBUG") and lost["renewal missing at forget"] <= 3:
                    print("DEBUG", key, reasons.get(key), [round(t - kept_at, 3) for t in times], "forgot",
                          round(forgot_at - kept_at, 3), "replied", round(replied_at - kept_at, 3),
                          "due", [round(d - kept_at, 3) for d in dues.get(key, [])])
            elif replied_at - times[-1] > ttl:
                lost["after forget"] += 1
            else:
                lost["other"] += 1
    renewals = sum(len(times) - 1 for times in confirmed.values())
    print(f"leases {len(ends)}, ttl {ttl}s, hogs {args.hogs}, hub busy {args.hub_busy}, "
          f"hub blocks {args.hub_block}, pool {args.max_connections or 'default'}, "
          f"{'release first' if args.release_first else 'forget first'}, "
          f"wall {wall:.1f}s, cpu {cpu_used:.1f}s, load {os.getloadavg()[0]:.1f}")
    print(f"renewals {renewals}, keeper rounds {len(rounds)}, batches {keeper.batches}, "
          f"entries per round median {statistics.median(r[1] for r in rounds):.0f}")
    batched = sum(n for n, _, _ in batch_cost)
    cpu_us = sum(c for _, c, _ in batch_cost) / batched * 1e6
    wall_us = sum(w for _, _, w in batch_cost) / batched * 1e6
    print(f"keeper per lease renewed: {cpu_us:.0f} us thread CPU, {wall_us:.0f} us wall "
          f"(batches of {batched / len(batch_cost):.0f})")
    print(f"gap between confirmations s: median {statistics.median(gaps):.3f}, p99 {percentile(gaps, 0.99):.3f}, "
          f"p99.9 {percentile(gaps, 0.999):.3f}, max {max(gaps):.3f}; > ttl: {sum(g > ttl for g in gaps)} "
          f"gaps in {late_leases} leases")
    print(f"keeper lateness s: median {statistics.median(lateness):.3f}, p99 {percentile(lateness, 0.99):.3f}, "
          f"max {max(lateness):.3f}")
    print(f"forget to release reply s: median {statistics.median(releasing):.3f}, "
          f"p99 {percentile(releasing, 0.99):.3f}, max {max(releasing):.3f}")
    print(f"last confirmation to release reply s: median {statistics.median(tail):.3f}, "
          f"p99 {percentile(tail, 0.99):.3f}, max {max(tail):.3f}")
    print(f"acquire (request start to keep) s: median {statistics.median(acquiring):.3f}, "
          f"p99 {percentile(acquiring, 0.99):.3f}, max {max(acquiring):.3f}; raised: {len(failed) - releases_failed} "
          f"acquires, {releases_failed} releases")
    print(f"releases that found the lock gone: {sum(lost.values())} ({lost})")


if __name__ == "__main__":
    main()

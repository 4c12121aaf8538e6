"""Beat at scale: tick time and memory of SingletonScheduler beside Celery's PersistentScheduler.

For each size N (entries due at once, default 1, 100 and 10,000; 100,000 with
``--sizes 1 100 10000 100000``), every variant builds a scheduler with N interval
entries, all due, and is driven as ``celery beat``'s loop drives it: ``tick()``,
each sending one due entry (real messages to a Redis broker). Variants run
interleaved, in the same run, on the same servers:

* ``plain``       Celery's ``PersistentScheduler``.
* ``singleton``   ``SingletonScheduler``: every slot claimed in Redis (batched).
* ``opted-out``   ``SingletonScheduler``, every entry ``{"singleton": False}``:
                  the mixin without claims, to isolate the cost of claiming.
* ``unbatched``   ``SingletonScheduler`` with ``claim_batch_size = 1``: one
                  round trip per claim, to show what batching buys.
* ``loser``       ``SingletonScheduler`` after another beat sent every slot of the
                  burst (its claims are in Redis): every claim lost, nothing published.

What is measured, per round (a new scheduler each round):

* **tick**: the first ``--ticks`` sending ticks of the burst (all of them when
  N is smaller), each timed on its own; median, min and max over the rounds.
  The scheduler is warm, as a running beat is: its broker connection and
  queue declared (one message sent before, not timed) and its heap built.
  A burst's first tick carries what the burst needs once (the mixin claims up
  to ``claim_batch_size`` due slots in it): it is the max, reported apart.
* **heap**: the heap's first build (``populate_heap``, what a beat's first tick
  does, and again after a schedule change); the mixin reads the entries'
  records from Redis there.
* **memory**: traced by ``tracemalloc`` (one more round, not timed): what the
  scheduler holds after building its schedule, its heap and its first ticks
  (``current``), and the highest point on the way (``peak``).
* **claim round trip**: one ``SET NX PX`` to the lock Redis (the command a claim
  is), median of 200, to weigh the singleton's extra time per tick.

Ratios are to ``plain`` in the same run: below 1 the variant is faster (tick)
or smaller (memory). Celery's ``tick()`` compares the whole schedule with its
copy on every tick (O(N)); a whole burst of 100,000 would take hours with it,
hence the ticks counted rather than whole bursts.

Usage: python -m benchmarks.bench_beat [--sizes N ...] [--rounds R] [--small-rounds R] [--large-rounds R]
       [--ticks T] [--memory-ticks T] [--variants plain singleton opted-out loser unbatched] [--json]

``make bench`` runs 1, 100 and 10,000 (about 5 minutes); ``make bench BENCH_ARGS=--large``
adds 100,000 (about 10 minutes more, most of it building schedules and tracing memory).
"""

from __future__ import annotations

import copy
import gc
import logging
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from celery.beat import PersistentScheduler, ScheduleEntry

from celery_singleton_beat.beat import SingletonScheduler, SingletonSchedulerMixin, entry_record_key, entry_spec
from celery_singleton_beat.beat.claims import SENT, Claim, claim_value
from celery_singleton_beat.beat.slots import current_slot
from celery_singleton_beat.config import clear_settings_cache
from celery_singleton_beat.recovery.lock_redis import get_redis, reset_clients

from .common import Server, bench_cli, markdown_table, progress, summary

QUEUE = "bench-beat"
VARIANTS = {
    "plain": "Celery's PersistentScheduler",
    "singleton": "SingletonScheduler, every slot claimed",
    "opted-out": "SingletonScheduler, entries opted out (no claims)",
    "unbatched": "SingletonScheduler, one round trip per claim",
    "loser": "SingletonScheduler after another beat sent the burst (all claims lost)",
}
#: Variants of the published table: a lone beat, the same without claims (their cost), the other beats of three.
DEFAULT_VARIANTS = ("plain", "singleton", "opted-out", "loser")


class Unbatched(SingletonScheduler):
    claim_batch_size = 1


def make_app(base_url: str, entries: int, opt_out: bool) -> Celery:
    """An app whose schedule has ``entries`` hourly entries of one task."""
    app = Celery("bench-beat", set_as_current=False)
    options: dict[str, Any] = {"singleton": False} if opt_out else {}
    app.conf.update(
        broker_url=f"{base_url}/0",
        singleton_redis_url=f"{base_url}/2",
        task_default_queue=QUEUE,
        result_expires=None,  # no celery.backend_cleanup entry
        beat_schedule={
            f"entry-{i}": {"task": "bench.noop", "schedule": timedelta(hours=1),
                           "args": [i], "options": options}
            for i in range(entries)
        },
    )
    app.set_current()  # entries read back from the shelve file use the current app
    app.finalize(auto=True)
    return app


def build(cls: type, app: Celery, workdir: str, name: str) -> Any:
    """A scheduler of class ``cls`` whose entries are all due, its broker connection made."""
    scheduler = cls(app=app, schedule_filename=str(Path(workdir) / name))
    # Make every entry due now. Claimed entries: their records say they were
    # scheduled two hours ago (a deployment whose beats all come back), so with the
    # default catch-up rule the slot nobody claimed is a missed slot, due at start.
    # (A first start sends nothing that came before it.)
    long_ago = app.now() - timedelta(hours=2)
    for entry in scheduler.schedule.values():
        entry.last_run_at = long_ago
    if isinstance(scheduler, SingletonSchedulerMixin):
        pipe = get_redis(app).pipeline(transaction=False)
        for entry in scheduler.schedule.values():
            pipe.set(entry_record_key(scheduler.singleton_settings.key_prefix, entry.name),
                     f"{long_ago.timestamp():.3f}", px=86_400_000)
        pipe.execute()
    scheduler.producer  # connect to the broker before the clock starts  # noqa: B018
    return scheduler


def warm(scheduler: Any, app: Celery) -> None:
    """Send one message through the scheduler as a running beat already had (not timed):
    the producer's queue is declared and the send path's caches are filled; the mixin also
    claims one slot, as a running beat had (its first round learns what the server takes)."""
    entry = ScheduleEntry(name="warm-up", task="bench.noop", schedule=timedelta(hours=1),
                          options={"singleton": False}, app=app)
    scheduler.apply_async(entry, producer=scheduler.producer, advance=False)
    if isinstance(scheduler, SingletonSchedulerMixin):
        slot = current_slot(entry.schedule, scheduler._now())
        assert slot is not None
        key = f"{scheduler.singleton_settings.key_prefix}:{{beat:warm-up}}:{slot.label}"
        scheduler.claims.claim([Claim("warm-up", slot, key, None)], round(time.time(), 3), (), ["bench.noop"])


def first_heap(scheduler: Any) -> float:
    """Build the heap as the first ``tick()`` does; the seconds it took."""
    started = time.perf_counter()
    scheduler.old_schedulers = copy.copy(scheduler.schedule)
    scheduler.populate_heap()
    return time.perf_counter() - started


def claimed_elsewhere(server: Server, scheduler: SingletonSchedulerMixin) -> None:
    """Every due slot claimed and sent by another beat, as its claims would stand in Redis."""
    now = scheduler._now()
    value = claim_value("another-beat:1:000000", round(now.timestamp(), 3), SENT)
    pipe = server.client(2).pipeline(transaction=False)
    for entry in scheduler.schedule.values():
        spec, slot = entry_spec(entry), current_slot(entry.schedule, now)
        assert spec is not None and slot is not None
        pipe.set(spec.key(scheduler.singleton_settings.key_prefix, slot), value, px=3_600_000)
    pipe.execute()


def new_app(variant: str, server: Server, entries: int) -> Celery:
    """Empty databases, and the app of ``variant`` with ``entries`` in its schedule."""
    server.flush(0, 2)
    clear_settings_cache()
    reset_clients()
    return make_app(server.url, entries, opt_out=(variant == "opted-out"))


def prepare(variant: str, server: Server, app: Celery, workdir: str) -> tuple[Any, float]:
    """A warm scheduler of ``variant`` whose entries are all due, and its heap build's seconds."""
    cls: type = {"plain": PersistentScheduler, "unbatched": Unbatched}.get(variant, SingletonScheduler)
    scheduler = build(cls, app, workdir, f"{variant}-{time.monotonic_ns()}")
    if variant == "loser":
        claimed_elsewhere(server, scheduler)
    warm(scheduler, app)
    server.client(0).delete(QUEUE)
    return scheduler, first_heap(scheduler)


def timed_ticks(scheduler: Any, count: int) -> list[float]:
    """``count`` ticks, each of which must send (or, for the loser, skip) a due entry; seconds each."""
    times = []
    for _ in range(count):
        started = time.perf_counter()
        delay = scheduler.tick()
        times.append(time.perf_counter() - started)
        if delay > 0:
            raise RuntimeError(f"tick {len(times)} of {count} found nothing due")
    return times


class Stopwatch:
    """Seconds spent in some methods of an object since the last :meth:`lap` (wrapped in place)."""

    def __init__(self, target: Any, *names: str) -> None:
        self.spent = dict.fromkeys(names, 0.0)
        for name in names:
            setattr(target, name, self._timed(name, getattr(target, name)))

    def _timed(self, name: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - started
        return timed

    def lap(self) -> dict[str, float]:
        spent, self.spent = self.spent, dict.fromkeys(self.spent, 0.0)
        return spent


class RoundTrips:
    """Round trips made to one Redis (a client's connection pool) while counting: each
    pipeline executed, each command sent on its own."""

    def __init__(self, client: Any) -> None:
        self.pool = client.connection_pool
        self.count = 0
        self._saved: list[tuple[type, str, Any]] = []

    def __enter__(self) -> RoundTrips:
        counter = self

        def wrap(cls: type, name: str) -> None:
            method = getattr(cls, name)

            def counted(client: Any, *args: Any, **kwargs: Any) -> Any:
                if client.connection_pool is counter.pool:
                    counter.count += 1
                return method(client, *args, **kwargs)

            self._saved.append((cls, name, method))
            setattr(cls, name, counted)

        wrap(redis.client.Pipeline, "execute")
        wrap(redis.Redis, "execute_command")  # a pipeline's own commands are queued, not sent
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, name, method in reversed(self._saved):
            setattr(cls, name, method)
        self._saved = []


#: Where a claiming tick's Redis time goes: the claim round trip (sent marks ride along) and
#: the record's (history and counters; a second one when a counter hash needs its TTL).
TIMED_PARTS = ("claim", "record")


def one_round(variant: str, server: Server, entries: int, ticks: int, workdir: str) -> dict[str, Any]:
    """One timed burst: the seconds of each tick and of the heap's first build; for the
    mixin, the seconds of the burst's first tick spent in its claim and record round trips."""
    count = min(entries, ticks)
    scheduler, heap = prepare(variant, server, new_app(variant, server, entries), workdir)
    mixin = isinstance(scheduler, SingletonSchedulerMixin)
    watch = Stopwatch(scheduler.claims, *TIMED_PARTS) if mixin else None
    try:
        with RoundTrips(get_redis(scheduler.app)) as trips:
            times = timed_ticks(scheduler, 1)
        parts = {**watch.lap(), "round_trips": trips.count} if watch is not None else {}
        times += timed_ticks(scheduler, count - 1)
    finally:
        scheduler.close()
    published = server.client(0).llen(QUEUE)
    expected = 0 if variant == "loser" else count
    if published != expected:
        raise RuntimeError(f"{variant}: published {published} messages, expected {expected}")
    return {"ticks": times, "heap": heap, "parts": parts}


def memory_round(variant: str, server: Server, entries: int, ticks: int, workdir: str) -> dict[str, int]:
    """Bytes traced while the scheduler is built and ticks (its app and schedule setting made
    before): still held after, and at the peak."""
    app = new_app(variant, server, entries)
    gc.collect()
    tracemalloc.start()
    try:
        scheduler, _ = prepare(variant, server, app, workdir)
        try:
            timed_ticks(scheduler, min(entries, ticks))
            current, peak = tracemalloc.get_traced_memory()
        finally:
            scheduler.close()
    finally:
        tracemalloc.stop()
    return {"current": current, "peak": peak}


def claim_round_trip(server: Server, samples: int = 200) -> dict[str, float]:
    """Microseconds of one ``SET NX PX`` round trip to the lock Redis, through redis-py."""
    client = server.client(2)
    client.ping()
    times = []
    for i in range(samples):
        started = time.perf_counter()
        client.set(f"bench:rtt:{i}", "x", nx=True, px=60_000)
        times.append((time.perf_counter() - started) * 1e6)
    return summary(times)


def run(sizes: Sequence[int] = (1, 100, 10_000), rounds: int = 3, small_rounds: int = 10, large_rounds: int = 1,
        ticks: int = 50, memory_ticks: int = 10, variants: Sequence[str] = DEFAULT_VARIANTS,
        quick: bool = False) -> dict[str, Any]:
    """Tick times, heap build and memory per size and variant, variants interleaved within each round.

    Sizes with fewer due entries than ``ticks`` run ``small_rounds`` rounds (a burst of
    one entry has one sending tick: the rounds give the median its ticks); sizes above
    10,000 run ``large_rounds`` (building a schedule of 100,000 takes seconds per variant).
    """
    if quick:
        sizes, rounds, small_rounds, large_rounds, ticks, memory_ticks = (1, 50), 1, 2, 1, 5, 2
    unknown = set(variants) - set(VARIANTS)
    if unknown or "plain" not in variants:
        raise SystemExit(f"variants must include plain and come from {sorted(VARIANTS)}")
    logging.getLogger("celery").setLevel(logging.WARNING)
    logging.getLogger("celery_singleton_beat").setLevel(logging.WARNING)
    server = Server()
    raw: dict[int, dict[str, dict[str, Any]]] = {
        size: {v: {"bursts": [], "heap": [], "parts": []} for v in variants} for size in sizes}
    try:
        rtt = claim_round_trip(server)
        with tempfile.TemporaryDirectory(prefix="csb-bench-beat-") as workdir:
            for size in sizes:
                size_rounds = small_rounds if size < ticks else large_rounds if size > 10_000 else rounds
                for r in range(size_rounds):
                    for variant in variants:  # interleaved: drift hits every variant alike
                        progress(f"beat: {size:,} due, round {r + 1}/{size_rounds}: {variant}")
                        got = one_round(variant, server, size, ticks, workdir)
                        raw[size][variant]["bursts"].append(got["ticks"])
                        raw[size][variant]["heap"].append(got["heap"])
                        raw[size][variant]["parts"].append(got["parts"])
                for variant in variants:
                    progress(f"beat: {size:,} due, memory: {variant}")
                    raw[size][variant]["memory"] = memory_round(variant, server, size, memory_ticks, workdir)
    finally:
        server.stop()
    return report_of(raw, rtt, ticks, memory_ticks)


def report_of(raw: dict[int, dict[str, dict[str, Any]]], rtt: dict[str, float], ticks: int,
              memory_ticks: int) -> dict[str, Any]:
    """Summaries (microseconds, bytes) and ratios to ``plain`` per size and variant."""
    report: dict[str, Any] = {"claim_round_trip_us": rtt, "ticks": ticks, "memory_ticks": memory_ticks,
                              "sizes": {}}
    for size, by_variant in raw.items():
        split = {variant: _split(data["bursts"]) for variant, data in by_variant.items()}
        plain = by_variant["plain"]
        plain_tick, plain_first = (statistics.median(times) for times in split["plain"])
        sized: dict[str, Any] = {}
        for variant, data in by_variant.items():
            later, first = split[variant]
            sized[variant] = {
                "ticks_timed": sum(len(burst) for burst in data["bursts"]),
                "tick_us": {k: v * 1e6 for k, v in summary(later).items()},
                "tick_ratio_to_plain": statistics.median(later) / plain_tick,
                "first_tick_us": {k: v * 1e6 for k, v in summary(first).items()},
                "first_tick_ratio_to_plain": statistics.median(first) / plain_first,
                "heap_ms": {k: v * 1e3 for k, v in summary(data["heap"]).items()},
                "memory_bytes": data["memory"],
                "memory_ratio_to_plain": data["memory"]["current"] / plain["memory"]["current"],
            }
            if data["parts"] and data["parts"][0]:
                sized[variant]["first_tick_parts_us"] = {
                    part: statistics.median(parts[part] for parts in data["parts"]) * 1e6 for part in TIMED_PARTS}
                sized[variant]["first_tick_round_trips"] = statistics.median(
                    parts["round_trips"] for parts in data["parts"])
        report["sizes"][size] = {"rounds": len(plain["bursts"]), "variants": sized}
    return report


def _split(bursts: list[list[float]]) -> tuple[list[float], list[float]]:
    """(ticks after each burst's first, each burst's first tick); bursts of one tick: (their tick, the same)."""
    first = [burst[0] for burst in bursts]
    return [t for burst in bursts for t in burst[1:]] or first, first


def _ratio(value: float) -> str:
    """Two decimals; three significant digits below 0.1 (100,000 entries: 0.00393, not 0.00)."""
    return f"{value:.2f}" if value >= 0.095 else f"{value:.3g}"


def _mib(value: float) -> str:
    return f"{value / 2**20:,.1f}"


def table(report: dict[str, Any]) -> str:
    rows = []
    for size, data in report["sizes"].items():
        for variant, n in data["variants"].items():
            tick, first, heap, memory = n["tick_us"], n["first_tick_us"], n["heap_ms"], n["memory_bytes"]
            parts = n.get("first_tick_parts_us")
            rows.append([f"{int(size):,}", variant, f"{n['ticks_timed']} ({data['rounds']})",
                         f"{tick['median']:,.0f} ({tick['min']:,.0f}-{tick['max']:,.0f})",
                         _ratio(n["tick_ratio_to_plain"]),
                         f"{first['median']:,.0f} ({n['first_tick_ratio_to_plain']:.2f})",
                         f"{parts['claim']:,.0f} + {parts['record']:,.0f}" if parts else "-",
                         f"{n['first_tick_round_trips']:g}" if parts else "-",
                         f"{heap['median']:,.1f}",
                         f"{_mib(memory['current'])} ({_mib(memory['peak'])})",
                         f"{n['memory_ratio_to_plain']:.2f}"])
    rtt = report["claim_round_trip_us"]
    variants = next(iter(report["sizes"].values()))["variants"]
    notes = "\n".join([
        "",
        f"Variants: {'; '.join(f'`{v}` {VARIANTS[v]}' for v in variants)}.",
        f"Ticks: the first {report['ticks']} sending ticks of a burst (fewer when fewer are due), in each of "
        "the rounds in brackets; the tick median leaves out each burst's first tick, shown apart (the mixin "
        "claims the burst's slots in it; of that tick, the time in the claim round trip and in the record's, "
        "history and counters). Ratios: to `plain` in the same run (below 1: faster or smaller). Memory: "
        f"tracemalloc, the scheduler built, its heap and first {report['memory_ticks']} ticks (peak in brackets).",
        f"One bare round trip (`SET NX PX` to the lock Redis, redis-py): {rtt['median']:,.0f} us median "
        f"({rtt['min']:,.0f}-{rtt['max']:,.0f}).",
    ])
    return markdown_table(["entries due", "variant", "ticks timed (rounds)", "tick us, median (min-max)",
                           "tick / plain", "burst's first tick us (/ plain)", "of it, claim + record us",
                           "its lock Redis round trips",
                           "heap build ms", "memory MiB (peak)", "memory / plain"], rows) + "\n" + notes


def main(argv: list[str] | None = None) -> int:
    return bench_cli(__doc__, run, table, argv, sizes=[1, 100, 10_000], rounds=3, small_rounds=10, large_rounds=1,
                     ticks=50, memory_ticks=10, variants=list(DEFAULT_VARIANTS))


if __name__ == "__main__":
    sys.exit(main())

"""Beat dispatch: entries due in the same tick, PersistentScheduler vs SingletonScheduler.

Measures how fast a scheduler gets a burst of due entries out of the door as
``celery beat``'s loop drives it (``tick()`` until it asks to sleep), publishing
real messages to a Redis broker. Variants run interleaved, in the same run:

* ``plain``       Celery's ``PersistentScheduler``.
* ``singleton``   ``SingletonScheduler``: every slot claimed in Redis (batched).
* ``opted-out``   ``SingletonScheduler``, every entry ``{"singleton": False}``:
                  the mixin without claims, to isolate the cost of claiming.
* ``unbatched``   ``SingletonScheduler`` with ``claim_batch_size = 1``: one
                  round trip per claim, to show what batching buys.
* ``loser``       a second ``SingletonScheduler`` on the same burst after a first
                  one sent it: every claim lost, nothing published.

Usage: python -m benchmarks.bench_beat [--sizes N ...] [--rounds R] [--large-rounds R]
       [--variants plain singleton loser opted-out unbatched] [--json]
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from celery import Celery
from celery.beat import PersistentScheduler

from celery_singleton_beat.beat import SingletonScheduler, SingletonSchedulerMixin, entry_record_key
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


class Unbatched(SingletonScheduler):
    claim_batch_size = 1


def make_app(base_url: str, entries: int, opt_out: bool) -> Celery:
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
    return app


def build(cls: type, app: Celery, workdir: str, name: str) -> Any:
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


def burst(scheduler: Any) -> float:
    """Tick until the scheduler wants to sleep; the seconds it took."""
    started = time.perf_counter()
    while scheduler.tick() <= 0:
        pass
    return time.perf_counter() - started


def one_round(variant: str, server: Server, entries: int, workdir: str) -> float:
    """One measured burst; entries per second."""
    broker = server.client(0)
    server.flush(0, 2)
    clear_settings_cache()
    reset_clients()
    app = make_app(server.url, entries, opt_out=(variant == "opted-out"))
    cls: type = {"plain": PersistentScheduler, "unbatched": Unbatched}.get(variant, SingletonScheduler)
    tag = f"{variant}-{time.monotonic_ns()}"
    if variant == "loser":
        first = build(SingletonScheduler, app, workdir, f"{tag}-first")
        burst(first)
        first.close()
        broker.delete(QUEUE)
    scheduler = build(cls, app, workdir, tag)
    try:
        seconds = burst(scheduler)
    finally:
        scheduler.close()
    published = broker.llen(QUEUE)
    expected = 0 if variant == "loser" else entries
    if published != expected:
        raise RuntimeError(f"{variant}: published {published} messages, expected {expected}")
    return entries / seconds


#: Variants of the published table: a lone beat, the same without claims (their cost), the other beats of three.
DEFAULT_VARIANTS = ("plain", "singleton", "opted-out", "loser")


def run(sizes: list[int] | tuple[int, ...] = (1, 100, 10_000), rounds: int = 3, large_rounds: int = 1,
        variants: list[str] | tuple[str, ...] = DEFAULT_VARIANTS, quick: bool = False) -> dict[str, Any]:
    """Entries/s per burst size and variant, variants interleaved within each round.

    Bursts above 1,000 entries run ``large_rounds`` rounds: Celery's plain
    scheduler needs minutes for 10,000 (see ``docs/beat.md``).
    """
    if quick:
        sizes, rounds, large_rounds = (1, 50), 1, 1
    unknown = set(variants) - set(VARIANTS)
    if unknown or "plain" not in variants:
        raise SystemExit(f"variants must include plain and come from {sorted(VARIANTS)}")
    logging.getLogger("celery").setLevel(logging.WARNING)
    logging.getLogger("celery_singleton_beat").setLevel(logging.WARNING)
    server = Server()
    results: dict[int, dict[str, list[float]]] = {size: {v: [] for v in variants} for size in sizes}
    try:
        with tempfile.TemporaryDirectory(prefix="csb-bench-beat-") as workdir:
            for size in sizes:
                size_rounds = rounds if size <= 1000 else large_rounds
                for r in range(size_rounds):
                    for variant in variants:  # interleaved: drift hits every variant alike
                        progress(f"beat: {size} entries, round {r + 1}/{size_rounds}: {variant}")
                        results[size][variant].append(one_round(variant, server, size, workdir))
    finally:
        server.stop()
    report: dict[str, Any] = {"sizes": {}}
    for size, by_variant in results.items():
        plain = summary(by_variant["plain"])["median"]
        report["sizes"][size] = {
            "rounds": len(by_variant["plain"]),
            "variants": {v: {"entries_per_s": summary(rates), "ratio_to_plain": summary(rates)["median"] / plain}
                         for v, rates in by_variant.items()},
        }
    return report


def table(report: dict[str, Any]) -> str:
    rows = []
    for size, data in report["sizes"].items():
        for variant, numbers in data["variants"].items():
            rate = numbers["entries_per_s"]
            rows.append([f"{int(size):,}", variant, VARIANTS[variant],
                         f"{rate['median']:,.0f} ({rate['min']:,.0f}-{rate['max']:,.0f})",
                         f"{numbers['ratio_to_plain']:.2f}", data["rounds"]])
    return markdown_table(["entries due", "variant", "what", "entries/s median (min-max)",
                           "ratio to plain", "rounds"], rows)


def main(argv: list[str] | None = None) -> int:
    return bench_cli(__doc__, run, table, argv, sizes=[1, 100, 10_000], rounds=3, large_rounds=1,
                     variants=list(DEFAULT_VARIANTS))


if __name__ == "__main__":
    sys.exit(main())

"""Leases in one gevent worker: N runs at once, each holding its own lease, vs plain Celery.

One gevent worker (``-P gevent -c N``, prefetch multiplier so that concurrency x
multiplier >= N) runs N tasks at once, each with its own key, each sleeping S
seconds (a gevent sleep). The singleton variant holds a 3 s lease per run
(``lock_ttl = 3``, renewed every second by the keeper thread); plain Celery's
``Task`` runs the same bodies. Both tasks are in one app, so plain's worker loads
the library too: its consumer looks at each message's headers for a beat slot's
(sampled with py-spy, some 0.2 % of the hub's time) and its liveness heartbeat runs,
but its runs take no lock. The N messages are queued before the worker starts.
Broker and records are on one redis-server, the locks on another, so that server's
CPU and commands are the locks' alone. The library's connection
options are its defaults (``max_connections``: see
``celery_singleton_beat.connection.url.DEFAULT_REDIS_OPTIONS``).

For each N and variant, per round:

* **refused / lost**: refused, the worker log lines saying a run did not start
  because Redis was unavailable (``not started, Redis unavailable``, ``ends without
  running``) plus the ``skipped``, ``refused`` and ``deferred`` counters of the task's
  counter hash (``<prefix>:{stats}:task:<task>``, read after the worker stopped and
  wrote its last counts); lost, its ``lost`` counter (log lines saying ``lost`` or
  ``unavailable`` are counted and shown too). Every body must have recorded its start
  and its end, and no lock key may be left;
* **start spread**: first start to last start (``time.time()`` stamped by each body);
  and the worker's CPU from the first start to the last (``time.process_time()``, every
  thread's, stamped with it): what taking in the N runs cost, whatever share of a
  busy machine's cores the worker had in that round;
* **worker CPU per lease-second**: ``utime + stime`` of the worker process
  (``/proc/<pid>/stat``) from the moment it is ready (``worker_ready``, no message
  handled yet) until every body ended and a second and a half more (the counters'
  batch), over N x S;
* **lock Redis CPU and commands per lease-second**: ``INFO`` ``used_cpu_sys +
  used_cpu_user``, the commands (``INFO commandstats``, INFO excluded: the commands
  Lua scripts run count), the requests (EVALSHA and plain commands clients sent,
  see ``Server.command_calls``: a pipelined batch of renewals is one request per
  lease) and the reads (``total_reads_processed``: about one per round trip) of the
  lock server over the same round, from before the worker started, over N x S. In
  the plain round the lock server only sees the worker's own upkeep (its liveness
  key): "net" is ours less that;
* **lowest PTTL**: in a third round of the singleton variant (``sampled``) another
  client reads every lock key's PTTL every 0.2 s (``SCAN`` + pipelined ``PTTL``),
  while the runs sleep; kept out of the measured round, where its own commands
  would be counted as the locks' (at N = 5,000 they are about 25,000 a second).

With ``--thread-stats 1`` the first body and the N-th also snapshot the worker's threads
(:mod:`benchmarks.thread_stats`): each round's JSON then has, from the first start to the
last, every thread's user and system CPU and context switches (the hub, the library's
keeper, counters and heartbeat threads by name), the garbage collector's runs and seconds
per generation, and the objects it tracked at the last start, by type (``--json`` shows
them).

Variants run interleaved (plain, ours, ours sampled; the order rotates from one round
to the next); medians over the rounds. Ratios at N are to the smallest N.

Usage: python -m benchmarks.bench_leases [--sizes 100 1000 5000] [--seconds 20] [--rounds 1] [--thread-stats 1]
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path
from typing import Any, cast

from celery_singleton_beat.connection.url import DEFAULT_REDIS_OPTIONS
from celery_singleton_beat.task.keys import task_stats_key
from harness.waiting import wait_until

from .common import (
    Server,
    bench_cli,
    bench_env,
    core_split,
    cpu_layout,
    cpu_layout_note,
    markdown_table,
    process_cpu_seconds,
    progress,
    running_on,
    start_celery,
)
from .thread_stats import delta as stats_delta

#: variant -> (task of benchmarks.leases_app, PTTL sampled)
VARIANTS = {"plain": ("plain", False), "ours": ("singleton", False), "ours_sampled": ("singleton", True)}
#: Seconds between two PTTL samples (from the end of one to the start of the next).
SAMPLE_EVERY = 0.2
#: Seconds after the last body ended before the round's CPU and commands are read:
#: the counters of the last runs are written within a second (lease/counters.py).
SETTLE = 1.5
#: Seconds between two looks at the records (a light load on the shared machine).
POLL = 0.25
PREFIX = "singleton"
#: Counters of runs that did not run when delivered (their key held: none expected, the keys differ).
REFUSED_COUNTERS = ("skipped", "refused", "deferred")
#: Worker log lines that tell of a run refused or of a lease lost, by what they say.
LOG_PATTERNS = {
    "not_started_unavailable": re.compile(r"not started, Redis unavailable|ends without running"),
    "unavailable": re.compile(r"unavailable", re.I),
    "lost": re.compile(r"\blost\b", re.I),
    "warnings_errors": re.compile(r"\b(WARNING|ERROR|CRITICAL)\b"),
}


def lock_server_counters(locks: Server) -> dict[str, float]:
    """The lock server's CPU, commands (INFO excluded), requests and reads so far."""
    info = locks.client().info("all")
    requests, commands = locks.command_calls()
    return {"cpu_s": float(info["used_cpu_sys"]) + float(info["used_cpu_user"]),
            "requests": requests, "commands": commands, "reads": info["total_reads_processed"]}


class PttlSampler(threading.Thread):
    """Every :data:`SAMPLE_EVERY` s: every lock key of ``task`` (SCAN), its PTTL (one pipeline)."""

    def __init__(self, locks: Server, task: str) -> None:
        super().__init__(daemon=True, name="pttl-sampler")
        self.client = locks.client(0)
        self.match = f"{PREFIX}:{{{task}:*"  # the lock keys, <prefix>:{<task>:<sha256>}
        self.stop = threading.Event()
        self.samples = 0
        self.lowest: int | None = None
        self.lowest_key = ""
        self.no_ttl = 0
        self.most_keys = 0
        self.seconds: list[float] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                started = time.monotonic()
                self.sample()
                self.seconds.append(time.monotonic() - started)
                self.stop.wait(SAMPLE_EVERY)
        except BaseException as exc:  # reported with the round
            self.error = exc

    def sample(self) -> None:
        keys = [key for key in self.client.scan_iter(match=self.match, count=1000) if key.endswith(b"}")]
        if not keys:
            return
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.pttl(key)
        ttls = pipe.execute()
        self.samples += 1
        self.most_keys = max(self.most_keys, len(keys))
        for key, ttl in zip(keys, ttls, strict=True):
            if ttl == -1:
                self.no_ttl += 1
            elif ttl >= 0 and (self.lowest is None or ttl < self.lowest):
                self.lowest, self.lowest_key = ttl, key.decode()

    def finish(self) -> None:
        self.stop.set()
        self.join(30)
        if self.error is not None:
            raise RuntimeError(f"the PTTL sampler failed: {self.error!r}")


def log_lines(log: Path) -> dict[str, list[str]]:
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    return {name: [line for line in text if pattern.search(line)] for name, pattern in LOG_PATTERNS.items()}


def one_round(variant: str, n: int, seconds: float, broker: Server, locks: Server, log: Path,
              thread_stats: bool = False, cpus: frozenset[int] | None = None) -> dict[str, Any]:
    task_name, sampled = VARIANTS[variant]
    env = bench_env(BENCH_BROKER=broker.url, BENCH_LOCKS=locks.url)
    if thread_stats:  # the first and the N-th body snapshot the worker's threads and collector
        env["BENCH_THREAD_STATS"] = str(n)
    os.environ.update(BENCH_BROKER=broker.url, BENCH_LOCKS=locks.url)
    from . import leases_app

    task = getattr(leases_app, task_name)
    records = broker.client(3)
    records.flushdb()
    locks.flush(0)  # the previous round's counters (its locks were all released)
    queue = f"bench-leases-{variant}-{n}"
    with broker.client(0) as client:
        client.delete(queue)
    with leases_app.app.producer_or_acquire() as producer:
        for i in range(n):  # queue everything first: the worker is not running yet
            task.apply_async((i, seconds), queue=queue, producer=producer)
    concurrency = n
    multiplier = max(1, math.ceil(n / concurrency))  # every message prefetched: concurrency x multiplier >= N
    before = lock_server_counters(locks)
    worker = start_celery(["-A", "benchmarks.leases_app", "worker", "-P", "gevent", "-c", str(concurrency),
                           "--prefetch-multiplier", str(multiplier), "-Q", queue, "-l", "warning",
                           "--without-gossip", "--without-mingle", "--without-heartbeat"], env, None, log,
                          cpus)
    sampler = PttlSampler(locks, task.name) if sampled else None
    try:
        def ready() -> Any:
            if not worker.running:
                raise RuntimeError(f"the worker exited: {log.read_text(errors='replace')[-2000:]}")
            return records.hgetall("ready") or None

        state = wait_until(ready, 120, "the worker to be ready", interval=POLL, error=RuntimeError)
        pid, cpu_ready = int(state[b"pid"]), float(state[b"cpu_s"])
        if sampler is not None:
            sampler.start()

        def all_ended() -> bool:
            if not worker.running:
                raise RuntimeError(f"the worker exited: {log.read_text(errors='replace')[-2000:]}")
            return bool(records.zcard("ends") >= n)

        wait_until(all_ended, 3 * seconds + n / 10 + 120, f"{n} {variant} runs to end", interval=POLL,
                   error=RuntimeError)
        time.sleep(SETTLE)
        cpu_end = process_cpu_seconds(pid)
        after = lock_server_counters(locks)
        if sampler is not None:
            sampler.finish()
    finally:
        if sampler is not None:
            sampler.stop.set()
        worker.stop(timeout=60)
    started_members = cast(list[tuple[bytes, float]], records.zrange("starts", 0, -1, withscores=True))
    starts = [float(score) for _, score in started_members]
    start_cpus = [float(member.rpartition(b":")[2]) for member, _ in started_members]
    ends = [float(score) for _, score in cast(list[tuple[bytes, float]], records.zrange("ends", 0, -1,
                                                                                         withscores=True))]
    with locks.client(0) as client:  # the worker wrote its last counts as it stopped
        counters = {k.decode(): int(v) for k, v in client.hgetall(task_stats_key(PREFIX, task.name)).items()}
        left = [key for key in client.scan_iter(match=f"{PREFIX}:{{{task.name}:*", count=1000)
                if key.endswith(b"}")]
    lines = log_lines(log)
    lease_seconds = n * seconds
    snaps = records.hgetall("thread_stats") if thread_stats else {}
    result: dict[str, Any] = {
        "started": len(starts), "ended": len(ends),
        "start_spread_s": max(starts) - min(starts),
        # the window, by the bodies' own wall-clock stamps, and the worker (for bench_start_profile)
        "first_start": min(starts), "last_start": max(starts), "worker_pid": pid,
        "start_cpu_s": max(start_cpus) - min(start_cpus),
        # every run still sleeping when the last one started: the N leases were held at once
        "all_at_once": min(ends) >= max(starts),
        "time_patched": state.get(b"time_patched") == b"1",
        "worker_cpu_s": cpu_end - cpu_ready,
        "worker_cpu_us_per_lease_s": (cpu_end - cpu_ready) * 1e6 / lease_seconds,
        "lock_cpu_us_per_lease_s": (after["cpu_s"] - before["cpu_s"]) * 1e6 / lease_seconds,
        "lock_commands_per_lease_s": (after["commands"] - before["commands"]) / lease_seconds,
        "lock_requests_per_lease_s": (after["requests"] - before["requests"]) / lease_seconds,
        "lock_reads_per_lease_s": (after["reads"] - before["reads"]) / lease_seconds,
        "counters": counters,
        # a run that did not run at once: skipped (its key held), refused or deferred (on_conflict)
        "refused": sum(counters.get(name, 0) for name in REFUSED_COUNTERS), "lost": counters.get("lost", 0),
        "lock_keys_left": len(left),
        "log_counts": {name: len(found) for name, found in lines.items()},
        "log_lines": {name: found[:5] for name, found in lines.items() if found},
        "prefetch_multiplier": multiplier,
    }
    if b"first" in snaps and b"last" in snaps:
        last = json.loads(snaps[b"last"])
        result["thread_stats"] = {**stats_delta(json.loads(snaps[b"first"]), last),
                                  "gc_objects_at_last_start": last.get("gc_objects"),
                                  "gc_types_at_last_start": last.get("gc_types")}
    if sampler is not None:
        result["pttl"] = {"lowest_ms": sampler.lowest, "key": sampler.lowest_key, "samples": sampler.samples,
                          "no_ttl": sampler.no_ttl, "most_keys": sampler.most_keys,
                          "sample_s": statistics.median(sampler.seconds) if sampler.seconds else None}
    return result


def _median(rounds: list[dict[str, Any]], name: str) -> float:
    return float(statistics.median(r[name] for r in rounds))


def run(sizes: tuple[int, ...] = (100, 1000, 5000), seconds: float = 20.0, rounds: int = 1,
        thread_stats: int = 0, split_cores: int = 1) -> dict[str, Any]:
    sizes = tuple(sorted(sizes))
    split = core_split() if split_cores else None
    worker_cpus, other_cpus = split if split is not None else (None, None)
    log = Path(tempfile.mkstemp(prefix="csb-bench-leases-", suffix=".log")[1])
    results: dict[int, dict[str, list[dict[str, Any]]]] = {n: {v: [] for v in VARIANTS} for n in sizes}
    variants = tuple(VARIANTS)
    with running_on(other_cpus):  # the servers (started here) and the harness off the worker's CPU
        broker, locks = Server(), Server()
        try:
            for n in sizes:
                for r in range(rounds):
                    for variant in variants[r % len(variants):] + variants[:r % len(variants)]:
                        progress(f"N={n} round {r + 1}/{rounds}: {variant}, {seconds:g} s sleeps")
                        results[n][variant].append(one_round(variant, n, seconds, broker, locks, log,
                                                             bool(thread_stats), worker_cpus))
        finally:
            broker.stop()
            locks.stop()
            log.unlink(missing_ok=True)
    report: dict[str, Any] = {
        "date": date.today().isoformat(), "sizes": list(sizes), "seconds": seconds, "rounds": rounds,
        "lock_ttl": 3, "max_connections": DEFAULT_REDIS_OPTIONS.get("max_connections"),
        "cpus": cpu_layout(split),
        "by_size": {}}
    for n in sizes:
        plain, ours, sampled = (results[n][v] for v in variants)
        every = plain + ours + sampled
        entry: dict[str, Any] = {
            "refused": sum(r["refused"] + r["log_counts"]["not_started_unavailable"] for r in ours + sampled),
            "lost": sum(r["lost"] for r in ours + sampled),
            "log_counts": {name: sum(r["log_counts"][name] for r in every) for name in LOG_PATTERNS},
            "log_lines": [line for r in every for found in r["log_lines"].values() for line in found][:10],
            "incomplete_runs": sum(n - min(r["started"], r["ended"]) for r in every),
            "lock_keys_left": sum(r["lock_keys_left"] for r in ours + sampled),
            "all_at_once": all(r["all_at_once"] for r in every),
            "time_patched": all(r["time_patched"] for r in every),
            "counters": ours[-1]["counters"],
            "rounds": {v: results[n][v] for v in variants},
        }
        for variant, rs in (("plain", plain), ("ours", ours)):
            entry[variant] = {name: _median(rs, name) for name in (
                "start_spread_s", "start_cpu_s", "worker_cpu_us_per_lease_s", "lock_cpu_us_per_lease_s",
                "lock_commands_per_lease_s", "lock_requests_per_lease_s", "lock_reads_per_lease_s")}
        # the lock server's CPU with leases, less its CPU in the plain round (idle but for the worker's upkeep)
        entry["lock_cpu_us_per_lease_s_net"] = entry["ours"]["lock_cpu_us_per_lease_s"] - entry["plain"][
            "lock_cpu_us_per_lease_s"]
        entry["start_spread_ratio"] = entry["ours"]["start_spread_s"] / max(entry["plain"]["start_spread_s"], 1e-9)
        # each round's ours over that round's plain (run minutes apart, not hours): a machine's slow spell
        # weighs on both sides of a pair
        entry["start_spread_round_ratios"] = [o["start_spread_s"] / max(p["start_spread_s"], 1e-9)
                                              for p, o in zip(plain, ours, strict=True)]
        entry["start_cpu_ratio"] = entry["ours"]["start_cpu_s"] / max(entry["plain"]["start_cpu_s"], 1e-9)
        lowest = [r["pttl"]["lowest_ms"] for r in sampled if r["pttl"]["lowest_ms"] is not None]
        entry["lowest_pttl_ms"] = min(lowest) if lowest else None
        entry["pttl"] = [r["pttl"] for r in sampled]
        report["by_size"][n] = entry
    base = report["by_size"][sizes[0]]
    for entry in report["by_size"].values():
        for name in ("worker_cpu_us_per_lease_s", "lock_cpu_us_per_lease_s"):
            entry[f"{name}_ratio_to_smallest"] = entry["ours"][name] / max(base["ours"][name], 1e-9)
        entry["lock_cpu_us_per_lease_s_net_ratio_to_smallest"] = (
            entry["lock_cpu_us_per_lease_s_net"] / base["lock_cpu_us_per_lease_s_net"]
            if base["lock_cpu_us_per_lease_s_net"] > 0 else None)
    return report


def _judged(value: float | None, limit: float, at_most: bool = True) -> str:
    if value is None:
        return "-"
    met = value <= limit if at_most else value >= limit
    return "met" if met else "NOT met"


def _entry(report: dict[str, Any], n: int) -> dict[str, Any]:
    """The figures of size ``n`` (keyed by the number, or by its text in a report read back from JSON)."""
    by_size = report["by_size"]
    return by_size[n] if n in by_size else by_size[str(n)]  # type: ignore[no-any-return]


def _most_held(entry: dict[str, Any]) -> int | None:
    """The most lock keys the sampler saw at once (None without a sampled round)."""
    return max((p["most_keys"] for p in entry["pttl"]), default=None)


def table(report: dict[str, Any]) -> str:
    sizes, seconds, smallest = report["sizes"], report["seconds"], report["sizes"][0]
    rows = []
    for n in sizes:
        entry = _entry(report, n)
        plain, ours = entry["plain"], entry["ours"]
        lowest, held = entry["lowest_pttl_ms"], _most_held(entry)
        net = entry["lock_cpu_us_per_lease_s_net_ratio_to_smallest"]
        rows.append([
            f"{n:,}", f"{entry['refused']} / {entry['lost']}"
            + ("" if not entry["incomplete_runs"] else f" ({entry['incomplete_runs']} runs incomplete)"),
            f"{ours['start_spread_s']:.2f} / {plain['start_spread_s']:.2f} ({entry['start_spread_ratio']:.2f}x, "
            f"{_judged(entry['start_spread_ratio'], 1.2)})",
            "-" if "start_cpu_s" not in ours else
            f"{ours['start_cpu_s']:.2f} / {plain['start_cpu_s']:.2f} ({entry['start_cpu_ratio']:.2f}x)",
            "-" if lowest is None else f"{lowest:,} ({_judged(lowest, 1500, at_most=False)})"
            + ("" if held is None else f"; {held:,} held at most"),
            f"{entry['counters'].get('renewed', 0) / n:.1f}",
            f"{ours['worker_cpu_us_per_lease_s']:.0f} / {plain['worker_cpu_us_per_lease_s']:.0f}",
            f"{entry['worker_cpu_us_per_lease_s_ratio_to_smallest']:.2f}x "
            f"({_judged(entry['worker_cpu_us_per_lease_s_ratio_to_smallest'], 1.5)})",
            f"{ours['lock_cpu_us_per_lease_s']:.1f} / {plain['lock_cpu_us_per_lease_s']:.1f} "
            f"({entry['lock_cpu_us_per_lease_s_net']:.1f})",
            f"{entry['lock_cpu_us_per_lease_s_ratio_to_smallest']:.2f}x "
            f"({_judged(entry['lock_cpu_us_per_lease_s_ratio_to_smallest'], 1.5)})"
            + ("" if net is None else f"; net {net:.2f}x"),
            f"{ours['lock_commands_per_lease_s']:.2f} / {ours['lock_requests_per_lease_s']:.2f} / "
            f"{ours['lock_reads_per_lease_s']:.3f}",
        ])
    headers = ["N", "refused / lost", "start spread s, ours / plain (ratio, <= 1.2x)",
               "worker CPU s, first to last start, ours / plain (ratio)",
               "lowest PTTL ms (>= 1,500); most leases at once", "renewals per run",
               "worker CPU us/lease-s, ours / plain",
               f"ours vs N={smallest:,} (<= 1.5x)", "lock Redis CPU us/lease-s, ours / plain (net)",
               f"ours vs N={smallest:,} (<= 1.5x)", "lock commands / requests / reads per lease-s"]
    notes = [f"Measured {report['date']}: one gevent worker (`-P gevent -c N`) per N and variant, N runs at "
             f"once, each sleeping {seconds:g} s, `lock_ttl = {report['lock_ttl']}` (renewed every second), "
             f"library default pool (`max_connections` {report['max_connections']}); {report['rounds']} "
             "round(s), medians. Per lease-second: over N x S. Refused: log lines \"not started, Redis "
             "unavailable\" or \"ends without running\" plus counters `skipped`, `refused`, `deferred`; lost: "
             "counter `lost`. Lock Redis \"plain\": the same "
             "server during the plain round (the worker's own upkeep, no lease); net: ours less plain. Commands "
             "include those Lua scripts run; requests are the commands clients sent (EVALSHA and plain ones, "
             "pipelined or not); reads are the server's reads of client input (about one per round trip)."]
    notes.append(f"Renewals per run: the `renewed` counter over N ({seconds - 1:g} to {seconds:g} when each "
                 "lease is renewed every second). Most leases at once: the most lock keys one PTTL sample found.")
    notes.append(cpu_layout_note(report.get("cpus"), "the redis-servers and the harness"))
    for n in sizes:
        entry = _entry(report, n)
        ratios = entry.get("start_spread_round_ratios")
        if ratios:
            notes.append(f"N={n:,}: start spread ours / plain, round by round: "
                         + ", ".join(f"{r:.2f}x" for r in ratios) + f" (median {statistics.median(ratios):.2f}x).")
        if not entry["all_at_once"]:
            notes.append(f"N={n:,}: some run ended before the last one started (start spread >= S = {seconds:g} s): "
                         "the N leases were not all held at once; use a longer --seconds.")
        if not entry["time_patched"]:
            notes.append(f"N={n:,}: time.sleep was not gevent's in the worker.")
        if entry["incomplete_runs"] or entry["lock_keys_left"]:
            notes.append(f"N={n:,}: {entry['incomplete_runs']} run(s) without a recorded start or end, "
                         f"{entry['lock_keys_left']} lock key(s) left after the worker stopped.")
        counts = entry["log_counts"]
        if counts["unavailable"] or counts["lost"]:
            notes.append(f"N={n:,}: worker log lines: {counts['unavailable']} saying unavailable, "
                         f"{counts['lost']} saying lost; first: " + "; ".join(f"`{line}`" for line in
                                                                              entry["log_lines"][:3]))
    return markdown_table(headers, rows) + "\n\n" + "\n\n".join(notes)


def main(argv: list[str] | None = None) -> int:
    return bench_cli(__doc__, run, table, argv, sizes=(100, 1000, 5000), seconds=20.0, rounds=1, thread_stats=0,
                     split_cores=1)


if __name__ == "__main__":
    sys.exit(main())

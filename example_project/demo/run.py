"""``python -m example_project.demo``: the shop as a cluster, every slot counted.

What it does, in order:

1. gets a Redis (see :mod:`.redis_source`);
2. starts 2 workers and, when the ``flower`` package is importable, Flower
   on a free port (its URL is printed);
3. starts 3 ``celery beat`` processes, 1.4 s apart, each with its own
   schedule file: they tick at different moments, as beats on different
   machines would;
4. half-way through, once every beat has claimed a slot, SIGKILLs the beat
   that sent the latest slot: the others carry on. Should the kill land
   between the victim's claim of a slot and its publish (it can: the kill
   waits for the last beat's first claim, and a busy machine delays the
   victim anywhere), the claim stays ``pending`` and a surviving beat takes
   the slot over one ``singleton_beat_pending_lease`` (5 s) after it found
   it claimed: the demo prints each such take-over;
5. after ``DEMO_SECONDS`` (default 60, counted from the first execution; at
   least as long after the kill as planned, and until no slot the killed
   beat claimed is left unsent) stops the beats, lets the workers finish what
   was sent, stops them;
6. prints a table per beat entry (slots, executions, duplicates, missed; see
   :mod:`.report` for the definitions) and, as its last line, a JSON summary.

The exit status is 0 when no slot ran twice, none was missed and no two
syncs of one customer overlapped; 1 when one of these happened; 2 when the
demo could not run; 128 + the signal number when interrupted. Every process
it started is stopped on every path (its process group is swept); a second
Ctrl-C skips the waiting and kills them at once.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import urllib.request
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any, TextIO

import redis

from harness.redis_server import free_port

from .processes import Child, DemoError, wait_until
from .redis_source import RedisSource, provide_redis
from .report import (
    NOT_SENT,
    SETTLE_SECONDS,
    ScheduledEntry,
    Summary,
    beat_pid,
    claim_keys,
    count_executions,
    format_table,
    read_claim,
    scheduled_entries,
)
from .status import StatusLine

__all__ = ["Demo", "Options", "main", "parse_options"]

APP = "example_project.shop.celery_app"
#: The directory that holds the ``example_project`` package.
ROOT = Path(__file__).resolve().parents[2]
#: Seconds between two beat starts.
STAGGER_SECONDS = 1.4
#: How long the demo waits for the cluster's first execution before it gives up.
FIRST_RUN_TIMEOUT = 120.0
#: Pool processes per worker: a report, three customer syncs and the
#: frequent tasks fit in two workers without waiting.
WORKER_CONCURRENCY = 3
#: How long stopped workers get to finish what was sent before the beats stopped.
DRAIN_SECONDS = 30.0
#: How long past the run's end the demo waits for the surviving beats to send the slots
#: the killed beat claimed and did not send (they do one pending lease, 5 s, after they
#: found the claim). A give-up limit: a slot still unsent then is counted as missed.
TAKE_OVER_TIMEOUT = 30.0
#: Signals that stop the demo cleanly.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """A stop signal arrived (a BaseException, like KeyboardInterrupt, so no
    ``except Exception`` in a library swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@dataclass(frozen=True)
class Options:
    """How the demo runs."""

    seconds: float = 60.0
    beats: int = 3
    workers: int = 2
    flower: bool = True


def parse_options(argv: list[str] | None = None) -> Options:
    """Command-line options; ``DEMO_SECONDS`` and ``DEMO_FLOWER=0`` set the defaults."""
    parser = argparse.ArgumentParser(
        prog="python -m example_project.demo",
        description="Run the example shop with several beats and workers; count every slot.")
    parser.add_argument("--seconds", type=float,  # argparse converts a string default too
                        default=os.environ.get("DEMO_SECONDS") or "60",
                        help="how long the beats run (default: $DEMO_SECONDS or 60)")
    parser.add_argument("--beats", type=int, default=3, help="beat processes (default 3, at least 2)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--no-flower", dest="flower", action="store_false",
                        default=os.environ.get("DEMO_FLOWER", "1") != "0",
                        help="do not start Flower (also: DEMO_FLOWER=0)")
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        parser.error("--seconds must be > 0")
    if args.beats < 2:
        parser.error("--beats must be at least 2 (one is killed half-way)")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    return Options(seconds=args.seconds, beats=args.beats, workers=args.workers,
                   flower=args.flower)


def _next_half_second(after: float) -> float:
    """The first instant ``n + 0.5`` (epoch seconds) at or after ``after``.

    Interval slots of whole seconds and crontab slots fall on whole seconds, so
    the failover is aimed between them, where a beat is usually idle. Not always:
    the kill also waits until every beat has claimed a slot, and a busy machine
    can hold the victim between a claim and its publish at any moment. The demo
    follows what the victim left claimed and unsent (:meth:`Demo._follow_left_claims`).
    """
    return math.floor(after - 0.5) + 1.5 if after % 1 > 0.5 else math.floor(after) + 0.5


class Demo:
    """One run of the demo cluster."""

    def __init__(self, options: Options, out: TextIO | None = None) -> None:
        self.options = options
        self.out = out or sys.stdout
        self.status = StatusLine(self.out)
        self.workdir = Path(tempfile.mkdtemp(prefix="shop-demo-"))
        self.namespace = f"demo-{secrets.token_hex(4)}"
        self.redis: RedisSource | None = None
        self.workers: list[Child] = []
        self.beats: list[Child] = []
        self.flower: Child | None = None
        self.flower_url: str | None = None
        self.shop: ModuleType | None = None  # example_project.shop.celery_app, once configured
        self.launched: float | None = None  # when the first beat was started
        self.began: float | None = None
        self.stopped_at: float | None = None
        self.killed_at: float | None = None
        self.victim: Child | None = None
        #: Slots the killed beat claimed and had not sent, by claim key: (entry, slot label).
        self._left: dict[str, tuple[str, str]] = {}
        #: Those another beat took over and sent: {"entry", "slot", "by"}.
        self.taken_over: list[dict[str, str]] = []
        self._claimed: tuple[list[ScheduledEntry], str] | None = None  # entries, key prefix
        self.hurry = False
        self.warnings: list[str] = []
        #: Per-customer lock figures (runs, skipped, overlaps), read before Redis goes.
        self.lock_figures: dict[str, int] = {}
        self._env: dict[str, str] = {}
        self._redis_client: redis.Redis | None = None
        # Live counts for the status line, read from the journal as it grows.
        self._seen = 0
        self._per_slot: Counter[tuple[str, str]] = Counter()
        self._latest: dict[str, Any] | None = None

    # ----------------------------------------------------------------- entry point

    def run(self) -> int:
        """Run the demo; always stop what it started; return the exit status."""
        previous = {signum: signal.signal(signum, self._interrupt) for signum in STOP_SIGNALS}
        interrupted: int | None = None
        error: str | None = None
        summary: Summary | None = None
        try:
            self._start()
            self._observe()
        except Interrupted as exc:
            interrupted = exc.signum
        except DemoError as exc:
            error = str(exc)
        except Exception as exc:  # a bug or an unexpected failure: still clean up
            error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        finally:
            for signum in STOP_SIGNALS:  # from now on a signal only means "hurry"
                signal.signal(signum, self._hurry)
            try:
                summary = self._shutdown(graceful=interrupted is None and error is None)
            finally:
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
        return self._conclude(summary, interrupted, error)

    def _interrupt(self, signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)

    def _hurry(self, signum: int, frame: FrameType | None) -> None:
        if not self.hurry:
            self.status.message(f"{signal.Signals(signum).name} again: killing everything now")
        self.hurry = True

    def say(self, text: str) -> None:
        self.status.message(text)

    # ----------------------------------------------------------------- start

    def _child_env(self, url: str) -> dict[str, str]:
        """The environment of every Celery process: all of the app on the demo's Redis."""
        settings = {
            "REDIS_URL": url,
            "CELERY_BROKER_URL": url,
            "SINGLETON_REDIS_URL": url,
            "SHOP_NAMESPACE": self.namespace,
        }
        # This process talks to the same Redis (journal, control commands).
        os.environ.update(settings)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        return env

    def _celery(self, name: str, *args: str) -> Child:
        return Child(name, [sys.executable, "-m", "celery", "-A", APP, *args],
                     self._env, ROOT, self.workdir / f"{name}.log")

    def _node(self, index: int) -> str:
        return f"{self.namespace}-worker-{index}@{socket.gethostname()}"

    def _start(self) -> None:
        o = self.options
        self.say(f"celery-singleton-beat demo: {o.beats} beats, {o.workers} workers, "
                 f"{o.seconds:g} s (Ctrl-C stops everything)")
        self.redis = provide_redis(self.workdir / "redis")
        self.say(f"redis      {self.redis.description}")
        self._env = self._child_env(self.redis.url)
        from example_project.shop import celery_app, tasks  # noqa: F401  (reads the environment)

        self.shop = celery_app
        for index in range(1, o.workers + 1):
            worker = self._celery(f"worker-{index}", "worker", "-n", self._node(index),
                                  "-c", str(WORKER_CONCURRENCY), "-l", "info",
                                  "--without-gossip", "--without-mingle")
            self.workers.append(worker)  # before it starts: a signal cannot orphan it
            worker.start()
        if o.flower and importlib.util.find_spec("flower") is not None:
            port = free_port()
            self.flower = self._celery("flower", "flower", "--address=127.0.0.1", f"--port={port}")
            self.flower.start()
            self.flower_url = f"http://127.0.0.1:{port}"
        for worker in self.workers:
            worker.wait_for_output("ready.", timeout=90)
            self.say(f"{worker.name:<10} pid {worker.pid} ready ({self.workdir / worker.log.name})")
        if self.flower is not None:
            self._wait_for_flower()

    def _wait_for_flower(self) -> None:
        """Print Flower's URL once it answers; Flower is optional, so only warn."""
        assert self.flower is not None and self.flower_url is not None
        url = f"{self.flower_url}/healthcheck"

        def healthy() -> bool:
            self.flower.check_running()  # type: ignore[union-attr]
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    return bool(response.status == 200)
            except OSError:
                return False

        try:
            wait_until(healthy, 30, "Flower", interval=0.2)
        except DemoError as exc:
            self._warn(f"Flower is not available: {exc}")
            self.flower.stop(timeout=5)
            self.flower = None
            return
        self.say(f"flower     {self.flower_url}  (pid {self.flower.pid})")

    def _warn(self, text: str) -> None:
        self.warnings.append(text)
        self.say(f"warning: {text}")

    # ----------------------------------------------------------------- observe

    def _observe(self) -> None:
        """Start the first beat and wait for its first execution; then the other beats one by
        one, kill one half-way (once every beat is claiming), show progress, until the end.

        The clock starts at the first execution, not at the first beat's start: a new Redis
        first costs a recovery window of a few seconds, and on a busy machine processes
        start slowly, neither of which should eat the run or leave a beat to be killed
        before the others can take over."""
        o = self.options
        self.launched = launched = time.time()
        self._start_beat(1, 0.0)
        self._wait_for_first_execution(launched)
        self.began = began = time.time()
        starts = [began + index * STAGGER_SECONDS for index in range(1, o.beats)]
        end = began + o.seconds
        kill_at: float | None = _next_half_second(max(began + o.seconds / 2, (starts or [began])[-1] + 1.0))
        if kill_at is not None and kill_at > end - 2.0:
            self._warn(f"{o.seconds:g} s is too short to show a failover: no beat is killed")
            kill_at = None
        waiting_since: float | None = None  # the end came while a slot the victim claimed was unsent
        while True:
            now = time.time()
            while len(self.beats) < o.beats and now >= starts[len(self.beats) - 1]:
                self._start_beat(len(self.beats) + 1, now - began)
            if kill_at is not None and now >= kill_at and self._every_beat_claims():
                self._kill_a_beat(began)
                end = max(end, time.time() + (end - kill_at))  # as long after the kill as planned
                kill_at = None
            left = self._follow_left_claims() if self.victim is not None else 0
            if now >= end and kill_at is None:
                if not left:
                    break
                if waiting_since is None:
                    waiting_since = now
                    self._say_waiting_for_take_over()
                elif now - waiting_since > TAKE_OVER_TIMEOUT:
                    self._warn(f"{left} slot(s) {self._victim_name} claimed were still not sent "
                               f"{TAKE_OVER_TIMEOUT:g} s after the run's end: "
                               + ", ".join(" ".join(slot) for slot in self._left.values()))
                    break
            for child in [*self.workers, *self.beats]:
                if not child.killed:
                    child.check_running()
            self._show_progress(now - began, end - began)
            pending = [starts[len(self.beats) - 1]] if len(self.beats) < o.beats else []
            wake = min([end if now < end else now + 0.25, *pending, *([kill_at] if kill_at else [])])
            time.sleep(max(0.05, min(0.25, wake - time.time())))
        self._show_progress(time.time() - began, end - began, force=True)

    def _wait_for_first_execution(self, launched: float) -> None:
        """Wait until a beat-sent slot has run (the cluster works), saying why it may take a while."""
        self.say("waiting    for the first execution (a new Redis first holds new locks back for a "
                 "few seconds: its recovery window)")

        def ran() -> bool:
            for child in [*self.workers, *self.beats]:
                child.check_running()
            self._read_journal()
            return self._latest is not None

        wait_until(ran, FIRST_RUN_TIMEOUT, "the first execution", interval=0.2)
        self.say(f"first run  +{time.time() - launched:.1f} s after beat-1 started; the {self.options.seconds:g} s "
                 "run starts now")

    def _every_beat_claims(self) -> bool:
        """Every running beat has claimed (won or found taken) a slot: it can take over."""
        return all(": slot " in beat.output() for beat in self.beats if beat.running)

    def _start_beat(self, index: int, elapsed: float) -> None:
        beat = self._celery(f"beat-{index}", "beat", "-s", str(self.workdir / f"beat-{index}-schedule"),
                            "-l", "info")
        self.beats.append(beat)
        beat.start()
        self.say(f"{beat.name:<10} pid {beat.pid} started at +{elapsed:.1f} s")

    def _kill_a_beat(self, began: float) -> None:
        """SIGKILL the beat that sent the latest slot (else the first one still running)."""
        alive = [beat for beat in self.beats if beat.running]
        if not alive:
            return
        self.killed_at = time.time()
        self._read_journal()
        by_pid = {str(beat.pid): beat for beat in alive}
        sender = beat_pid(self._latest.get("beat") if self._latest else None)
        victim = by_pid.get(sender or "", alive[0])
        victim.kill()
        victim.killed = True
        self.victim = victim
        others = ", ".join(beat.name for beat in alive if beat is not victim)
        why = "it sent the latest slot" if sender in by_pid else "the first beat"
        self.say(f"failover   +{self.killed_at - began:.1f} s: SIGKILL {victim.name} "
                 f"(pid {victim.pid}; {why}); {others} keep every slot covered")

    @property
    def _victim_name(self) -> str:
        return self.victim.name if self.victim is not None else "the killed beat"

    def _follow_left_claims(self) -> int:
        """Follow the slots the killed beat claimed and had not sent; return how many still wait.

        Reads the claims of every entry's slots since the first beat started. A claim that
        names the victim and is not sent (``pending``: it was killed between the claim and
        its publish, or before the claim was marked ``sent``) is followed until it is sent:
        ``received`` from the victim (it had published), or taken over by a surviving beat,
        which sends it one pending lease after it found the claim. Each take-over is printed
        and recorded in ``taken_over`` once the taker sent it (a beat stopped with its
        take-over claimed and unsent would hand it back unsent)."""
        assert self.victim is not None and self.shop is not None and self.launched is not None
        from celery_singleton_beat.config import get_settings

        if self._claimed is None:
            self._claimed = (scheduled_entries(self.shop.app), get_settings(self.shop.app).key_prefix)
        keys = claim_keys(*self._claimed, datetime.fromtimestamp(self.launched, timezone.utc),
                          datetime.fromtimestamp(time.time(), timezone.utc))
        try:
            values = dict(zip(keys, self._client.mget(list(keys)), strict=True)) if keys else {}
        except redis.RedisError:
            return len(self._left)  # as last seen; looked at again on the next round
        victim_pid = str(self.victim.pid)
        for key, raw in values.items():
            instance, state = read_claim(raw)
            if state in NOT_SENT and beat_pid(instance) == victim_pid:
                self._left.setdefault(key, keys[key])
        for key in list(self._left):
            instance, state = read_claim(values.get(key))
            if state in NOT_SENT:
                continue  # still unsent: the victim's, or a taker's about to send it
            entry, slot = self._left.pop(key)
            if state is None:
                self.say(f"lost       {entry} {slot}: {self._victim_name}'s claim expired unsent")
            elif beat_pid(instance) != victim_pid:
                by = self._beat_names().get(beat_pid(instance) or "", instance or "?")
                self.taken_over.append({"entry": entry, "slot": slot, "by": by})
                after = time.time() - (self.killed_at or time.time())
                self.say(f"took over  {entry} {slot}: {self._victim_name} claimed it and was killed "
                         f"before sending it; {by} sent it ({after:.1f} s after the kill)")
        return len(self._left)

    def _say_waiting_for_take_over(self) -> None:
        assert self.shop is not None
        from celery_singleton_beat.config import get_settings

        lease = get_settings(self.shop.app).beat_pending_lease
        others = ", ".join(beat.name for beat in self.beats if beat.running) or "no beat"
        self.say(f"waiting    for {others} to take over what {self._victim_name} claimed and did not send "
                 f"({', '.join(' '.join(slot) for slot in self._left.values())}): a beat takes over a "
                 f"claim left pending one pending lease ({lease:g} s) after it found it")

    def _beat_names(self) -> dict[str, str]:
        return {str(beat.pid): beat.name for beat in self.beats}

    def _read_journal(self) -> list[dict[str, Any]]:
        """New journal records since the last call; updates the live counts."""
        assert self.redis is not None
        from example_project.shop.journal import read_journal

        records = read_journal(self._client, self._seen)
        self._seen += len(records)
        for record in records:
            if record.get("slot"):
                self._per_slot[(record["task"], record["slot"])] += 1
                self._latest = record
        return records

    @property
    def _client(self) -> redis.Redis:
        if self._redis_client is None:
            assert self.redis is not None
            self._redis_client = self.redis.client()
        return self._redis_client

    def _show_progress(self, elapsed: float, planned: float, force: bool = False) -> None:
        """The status line: seconds since the run began, of the run's planned length (which
        grows when the kill comes late), and the live counts."""
        clock = f"[{elapsed:4.0f}/{planned:.0f} s]"
        try:
            self._read_journal()
        except redis.RedisError as exc:
            self.status.update(f"{clock} journal unreadable: {exc}")
            return
        executions = sum(self._per_slot.values())
        duplicates = sum(n - 1 for n in self._per_slot.values() if n > 1)
        alive = sum(1 for beat in self.beats if beat.running)
        text = (f"{clock} beats {alive}/{self.options.beats} up"
                f" | executions {executions} | duplicates {duplicates}")
        if self._latest is not None:
            sender = self._beat_names().get(beat_pid(self._latest.get("beat")) or "", "?")
            task = str(self._latest["task"]).removeprefix("shop.")
            text += f" | latest {self._latest['slot']} {task} from {sender}"
        self.status.update(text, force=force)

    # ----------------------------------------------------------------- stop

    def _shutdown(self, graceful: bool) -> Summary | None:
        """Stop everything (beats, then workers and Flower, then Redis); count if we can.

        Each stage runs even if the one before it failed: no path leaves a
        process behind.
        """
        self.status.clear()
        summary: Summary | None = None
        try:
            if self.beats:
                self.stopped_at = self.stopped_at or time.time()
                self.say("stopping   beats" + ("" if graceful else " (interrupted)"))
                self._stop(self.beats, timeout=10)
            if graceful and self.workers:
                self.say("draining   the queue: workers finish what the beats sent")
                try:
                    self._drain()
                except Exception as exc:  # broker trouble included; the counts will show it
                    self._warn(f"could not drain the queue: {exc}")
        finally:
            try:
                others = [*self.workers, *([self.flower] if self.flower else [])]
                if others:
                    self.say("stopping   " + ("workers and flower" if self.flower else "workers"))
                    self._stop(others, timeout=30 if graceful else 10)
                if self.redis is not None and self.shop is not None:
                    try:
                        summary = self._count()
                    except Exception as exc:  # report what we can without the counts
                        self._warn(f"could not count the executions: {exc}")
            finally:
                self._release_redis()
        return summary

    def _stop(self, children: list[Child], timeout: float) -> None:
        """SIGTERM them all at once, then wait for each (and sweep its group)."""
        for child in children:
            child.terminate()
        for child in children:
            child.stop(timeout=timeout, hurry=self._hurried)

    def _hurried(self) -> bool:
        return self.hurry

    def _queue_length(self) -> int:
        # kombu's Redis transport keeps a queue's messages in a list named
        # after the queue (messages without a priority, as here).
        return int(self._client.llen(self.namespace))

    def _drain(self) -> None:
        """Wait until no message is queued, reserved or running on the workers."""
        assert self.shop is not None
        nodes = [self._node(index) for index in range(1, len(self.workers) + 1)]
        inspect = self.shop.app.control.inspect(destination=nodes, timeout=1.0, limit=len(nodes))
        calm = 0

        def idle() -> bool:
            nonlocal calm
            if self.hurry:
                return True
            busy = self._queue_length() > 0
            for reply in (inspect.reserved(), inspect.active()):
                if reply is None or len(reply) < len(nodes) or any(reply.values()):
                    busy = True
            calm = 0 if busy else calm + 1
            return calm >= 2  # twice in a row: nothing was in flight between the calls

        wait_until(idle, DRAIN_SECONDS, "the workers to finish", interval=0.3)

    def _count(self) -> Summary:
        """Count the journal per entry; read the per-customer lock figures too."""
        assert self.shop is not None
        from example_project.shop import journal, tasks

        records = journal.read_journal(self._client)
        stats_key = tasks.sync_customer.singleton_stats_key()
        skipped = self._client.hget(stats_key, "skipped") if stats_key else None
        self.lock_figures = {
            "sync_runs": sum(1 for record in records if record["task"] == tasks.sync_customer.name),
            "sync_skipped": int(skipped or 0),
            "overlaps": int(self._client.get(journal.OVERLAPS_KEY) or 0),
        }
        stopped_at = self.stopped_at or time.time()
        return count_executions(scheduled_entries(self.shop.app), records, stopped_at,
                                self._beat_names())

    def _release_redis(self) -> None:
        """Stop the Redis we started, or delete our keys from the one we were given."""
        if self.redis is None:
            return
        if self.redis.server is not None:
            self.redis.server.stop(timeout=5, hurry=self._hurried)
            return
        try:
            client = self._client
            for pattern in (f"{self.namespace}*", f"_kombu.binding.{self.namespace}*"):
                keys = list(client.scan_iter(match=pattern, count=1000))
                if keys:
                    client.delete(*keys)
        except redis.RedisError as exc:
            self._warn(f"could not delete the demo's keys ({self.namespace}*): {exc}")

    # ----------------------------------------------------------------- report

    def _conclude(self, summary: Summary | None, interrupted: int | None,
                  error: str | None) -> int:
        """Print the report and the JSON summary line; return the exit status."""
        if summary is not None:
            self._print_report(summary)
        ok = (summary is not None and error is None and interrupted is None
              and summary.executions > 0 and summary.duplicates == 0 and summary.missed == 0
              and self.lock_figures.get("overlaps", 0) == 0)
        result = self._result(summary, ok)
        if interrupted is not None:
            result["interrupted"] = signal.Signals(interrupted).name
            self.say(f"interrupted by {result['interrupted']}: every process was stopped; "
                     "the counts are partial")
        elif error is not None:
            result["error"] = error.splitlines()[0]
            print(f"demo failed: {error}", file=sys.stderr, flush=True)
        elif not ok:
            self.say("FAILED: an execution count is wrong; see the table and the JSON's "
                     "missed_slots / duplicate_slots")
        if result["pids"] and (error is not None or (interrupted is None and not ok)):
            self.say(f"logs kept in {self.workdir}")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)
        self.out.write(json.dumps(result, separators=(", ", ": ")) + "\n")
        self.out.flush()
        if interrupted is not None:
            return 128 + interrupted
        if error is not None or summary is None:
            return 2
        return 0 if ok else 1

    def _print_report(self, summary: Summary) -> None:
        """The per-entry table and what it means for beats and customer syncs."""
        self.say("")
        self.say(format_table(summary))
        self.say("")
        if summary.window is not None and self.began is not None:
            opened, closed = (bound - self.began for bound in summary.window)
            self.say(f"observed window: first execution at {opened:+.1f} s to the stop at "
                     f"{closed:+.1f} s, less each entry's last period (at most {SETTLE_SECONDS:g} s)")
        if summary.outside:
            self.say(f"executions also count {summary.outside} slot(s) outside the window (the slot "
                     "running when it opened, the last period before the stop)")
        if self.taken_over:
            self.say("taken over after the kill: " + ", ".join(
                f"{t['entry']} {t['slot']} by {t['by']}" for t in self.taken_over))
        sent = ", ".join(f"{beat.name} {summary.sent_by.get(beat.name, 0)}" + self._beat_fate(beat)
                         for beat in self.beats)
        self.say(f"slots sent per beat: {sent or 'none'}")
        figures = self.lock_figures
        if figures:
            self.say(f"customer syncs: {figures['sync_runs']} runs, {figures['sync_skipped']} "
                     f"skipped while the customer's lock was held, {figures['overlaps']} overlapping")

    def _result(self, summary: Summary | None, ok: bool) -> dict[str, Any]:
        """The JSON summary: totals first, then details and what the demo started."""
        result: dict[str, Any] = {
            "executions": summary.executions if summary else 0,
            "duplicates": summary.duplicates if summary else 0,
            "missed": summary.missed if summary else 0,
            "slots": summary.slots if summary else 0,
            **self.lock_figures,
            "ok": ok,
            "entries": {e.name: e.as_dict() for e in summary.entries} if summary else {},
            "sent_by": summary.sent_by if summary else {},
            "taken_over": self.taken_over,
            "window": summary.window if summary else None,
            "seconds": self.options.seconds,
            "beats": len(self.beats),
            "workers": len(self.workers),
            "killed": next((beat.name for beat in self.beats if beat.killed), None),
            "flower": self.flower_url if self.flower is not None else None,
            "redis": self.redis.description if self.redis else None,
            "namespace": self.namespace,
            "pids": [child.pid for child in self._children() if child.process is not None],
        }
        if self.warnings:
            result["warnings"] = self.warnings
        return result

    def _beat_fate(self, beat: Child) -> str:
        if not beat.killed or self.began is None or self.killed_at is None:
            return ""
        return f" (SIGKILLed at +{self.killed_at - self.began:.1f} s)"

    def _children(self) -> list[Child]:
        server = self.redis.server if self.redis is not None else None
        return [*([server] if server else []), *self.workers,
                *([self.flower] if self.flower else []), *self.beats]


def main(argv: list[str] | None = None) -> int:
    """Run the demo with options from ``argv``; return the exit status."""
    return Demo(parse_options(argv)).run()

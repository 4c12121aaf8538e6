"""One chaos run, phase by phase; the history goes to ``<run dir>/history``.

1. **start**: servers, workers and beats; once they are ready, the submitter.
2. **chaos** (``seconds``): the nemesis injects faults (:mod:`.nemesis`), then heals them.
3. **quiesce**: every process back up, the submitter stopped; wait (bounded) until
   every submission has an end the checker can see.
4. **audit**: beats stopped (SIGTERM: their exit is timed), the counters read,
   a burst of submissions on the quiet cluster, the counters read again: their
   difference must be exactly what the history shows.
5. **idle**: no run for ``lock_ttl`` + 2 s, workers alive: every lock key is read
   (a run lock still there outlived its TTL), and every submission's result state.
6. **shutdown**: workers SIGTERMed (timed); the last counters.

Phases are recorded (``phase``) so the checker judges each part by its rules.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import redis

from .cluster import Cluster, Member, Settings
from .history import ENV_DIR, ENV_ROOT, ENV_WHO, META, Recorder, load, recorder
from .nemesis import KINDS, Nemesis, applicable_kinds
from .switches import record_switches

__all__ = ["run"]

#: Seconds the quiet phases allow for the last ends (a SIGKILLed worker's message
#: comes back after the visibility timeout).
QUIESCE_EXTRA = 60.0
AUDIT_BURST = 15


def run(settings: Settings, run_dir: Path, seconds: float, *, nemesis: bool = True,
        log: Any = print) -> Path:
    """Run the cluster with faults for ``seconds``; return the history directory."""
    history_dir = run_dir / "history"
    history_dir.mkdir(parents=True, exist_ok=True)
    os.environ[ENV_DIR] = str(history_dir)
    os.environ[ENV_WHO] = "control"
    os.environ[ENV_ROOT] = str(os.getpid())
    rec = recorder()
    assert rec is not None
    cluster = Cluster(settings, run_dir, rec)
    stop_watch = threading.Event()
    meta: dict[str, Any] = {"settings": _settings(settings), "seconds": seconds, "nemesis": nemesis,
                            "clock": {"t": time.time(), "m": time.monotonic()}}
    try:
        cluster.start_servers()
        if cluster.store is not None:  # who is what in the Cluster lock store, each time it changes
            cluster.store.watch(stop_watch)
        cluster.add_members()
        os.environ.update(cluster.env("control"))  # the controller's own app (revokes, audit)
        chaos_app = _fresh_app()

        meta.update(cluster=cluster.describe(), entries=chaos_app.BEAT_ENTRIES,
                    kinds={"weights": KINDS, "not applicable": applicable_kinds(cluster)})
        _write_meta(history_dir, meta)
        log(f"chaos: {settings.variant} variant, seed {settings.seed}, {seconds:g}s; history in {history_dir}")
        workers, beats = cluster.of_kind("worker"), cluster.of_kind("beat")
        for member in [*workers, *beats]:
            member.start()
        cluster.wait_ready([*workers, *beats])
        rec("phase", name="warmup")
        cluster.members["submitter"].start()
        time.sleep(3.0)  # scenario time: runs flowing before the first fault
        rec("phase", name="chaos")
        log("chaos: faults start")
        nem = Nemesis(cluster, settings.seed, rec)
        if nemesis:
            nem.run(seconds)
        else:
            time.sleep(seconds)  # the control run: no fault, the time is the scenario
        rec("phase", name="quiesce", faults=nem.count)
        log(f"chaos: {nem.count} faults injected; quiescing")
        _everyone_up(cluster)
        _terminate(cluster.members["submitter"], rec, bound=15.0)
        _wait_for_ends(history_dir, settings, deadline=settings.visibility + QUIESCE_EXTRA, cluster=cluster,
                       supervise=lambda: cluster.supervise(set(), kinds=("worker", "beat")))
        rec("phase", name="audit")
        for beat in beats:
            _terminate(beat, rec, bound=settings.term_bound["beat"])
        _audit(chaos_app, cluster, history_dir, settings, rec)
        rec("phase", name="idle")
        time.sleep(settings.lock_ttl + 2.0)  # scenario time: no run, so no lock may remain
        rec("keys", keys=_lock_keys(cluster))
        rec("results", states=_result_states(cluster, history_dir))
        rec("broker", **_in_broker(cluster))
        rec("phase", name="shutdown")
        for worker in workers:
            _terminate(worker, rec, bound=settings.term_bound["worker"])
        rec("counters", when="final", counters=_counters(chaos_app))
        rec("phase", name="done")
    finally:
        stop_watch.set()
        cluster.close()
        if cluster.sentinels:
            record_switches(run_dir)
    return history_dir


def _fresh_app() -> Any:
    """The app module configured from this run's environment: imported again if an earlier
    run in this process imported it (it reads its servers' addresses at import)."""
    import importlib
    import sys

    from celery_singleton_beat.config import clear_settings_cache
    from celery_singleton_beat.recovery.lock_redis import reset_clients

    clear_settings_cache()
    reset_clients()
    for name in ("harness.chaos.app", "harness.chaos.submitter"):
        if name in sys.modules:
            importlib.reload(sys.modules[name])
    return importlib.import_module("harness.chaos.app")


def _settings(settings: Settings) -> dict[str, Any]:
    data = dict(vars(settings))
    data["workers"] = [vars(w) for w in settings.workers]
    data["keys"] = list(settings.keys)
    data["beats"] = list(settings.beats)
    return data


def _write_meta(history_dir: Path, meta: dict[str, Any]) -> None:
    (history_dir / META).write_text(json.dumps(meta, indent=1, sort_keys=True, default=str))


def _everyone_up(cluster: Cluster) -> None:
    """Every worker and beat running (a crash is recorded as such) and not stopped."""
    cluster.supervise(set(), kinds=("worker", "beat"))
    for member in cluster.members.values():
        if member.kind != "submitter":
            member.send(signal.SIGCONT, group=True)


def _terminate(member: Member, rec: Recorder, bound: float) -> None:
    """SIGTERM ``member`` and time its exit; past ``bound`` it hangs (recorded, then SIGKILLed)."""
    if not member.running:
        return
    sent = time.monotonic()
    member.send(signal.SIGTERM)
    while member.process.returncode is None and time.monotonic() - sent < bound:
        time.sleep(0.05)
    code = member.process.returncode
    rec("term", name=member.name, pid=member.pid, sent=sent, exited=None if code is None else time.monotonic(),
        code=code, bound=bound)
    if code is None:
        member.dump_stacks()
        member.kill(group=True)
    else:
        rec("proc", name=member.name, action="exit", pid=member.pid, code=code)


def _wait_for_ends(history_dir: Path, settings: Settings, deadline: float, *, cluster: Cluster,
                   supervise: Any = lambda: None, only: set[str] | None = None) -> None:
    """Wait until every submission (of ``only``, if given) has an end in the history, calling
    ``supervise()`` meanwhile (members that crashed are started again).

    Gives up after ``deadline`` s, or once for 3 s none of those still open is in the broker
    (queued or unacknowledged): no worker can receive them any more.
    """
    from .checker import open_submissions

    end = time.monotonic() + deadline
    gone_since: float | None = None
    while time.monotonic() < end:
        supervise()
        waiting = {s.id for s in open_submissions(load(history_dir)) if only is None or s.id in only}
        if not waiting:
            return
        try:
            held = set(_in_broker(cluster)["ids"])
        except (redis.RedisError, OSError):  # the broker cannot tell: keep waiting
            held = waiting
        if waiting & held:
            gone_since = None
        elif gone_since is None:
            gone_since = time.monotonic()
        elif time.monotonic() - gone_since >= 3.0:
            return
        time.sleep(1.0)


def _quiet_for(history_dir: Path, seconds: float, deadline: float) -> None:
    """Wait (at most ``deadline`` s) until no run has started, checked, ended or been
    decided for ``seconds``: the counters then move only with what the audit sends."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        last = max((e.m for e in load(history_dir).of("start", "chk", "end", "outcome", "prerun")), default=0.0)
        if time.monotonic() - last >= seconds:
            return
        time.sleep(0.5)


def _audit(chaos_app: Any, cluster: Cluster, history_dir: Path, settings: Settings, rec: Recorder) -> None:
    """Counters before and after a burst on the quiet cluster (see the module docstring)."""
    from .submitter import submit

    _quiet_for(history_dir, 2.5, deadline=60)  # counter batches are written every second
    rec("counters", when="audit-start", counters=_counters(chaos_app))
    sent = {submit(settings.keys[number % len(settings.keys)], 0.05 + 0.05 * (number % 3), "audit")
            for number in range(AUDIT_BURST)}
    _wait_for_ends(history_dir, settings, deadline=60, cluster=cluster, only={i for i in sent if i})
    _quiet_for(history_dir, 2.5, deadline=60)
    rec("counters", when="audit-end", counters=_counters(chaos_app))


def _counters(chaos_app: Any) -> dict[str, Any]:
    """The counters as the admin API reads them, and whether the app keeps them
    (``singleton_stats``: off on Redis Cluster)."""
    from celery_singleton_beat import admin

    try:
        counters = admin.read_counters(chaos_app.app)
    except admin.AdminError as exc:
        return {"error": str(exc)}
    return {**counters.as_json(), "stats": counters.stats_enabled}


def _lock_keys(cluster: Cluster) -> list[dict[str, Any]]:
    """Every key of the lock database (of each Cluster primary): name, type, remaining TTL (ms; -1: none)."""
    out = []
    for client in cluster.lock_clients():
        try:
            keys = sorted(client.scan_iter(count=1000))
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.type(key)
                pipe.pttl(key)
            replies = pipe.execute()
            out += [{"key": key.decode(), "type": replies[2 * i].decode(), "pttl": replies[2 * i + 1]}
                    for i, key in enumerate(keys)]
        finally:
            client.close()
    return sorted(out, key=lambda k: str(k["key"]))


def _in_broker(cluster: Cluster) -> dict[str, list[str]]:
    """Task ids of the messages the broker still holds: queued, or delivered and not acknowledged."""
    client = cluster.broker.client(0)
    try:
        queued = [_task_id(raw) for raw in client.lrange("chaos", 0, -1)]
        unacked = [_task_id(json.loads(raw)[0]) for raw in client.hvals("unacked")]
    finally:
        client.close()
    return {"ids": [*queued, *unacked], "queued": queued, "unacked": unacked}


def _task_id(message: Any) -> str:
    body = json.loads(message) if isinstance(message, (bytes, str)) else message
    return str(body.get("headers", {}).get("id"))


def _result_states(cluster: Cluster, history_dir: Path) -> dict[str, str]:
    """Each submitted task id's state in the result backend (``MISSING``: no record)."""
    ids = sorted({e["id"] for e in load(history_dir).of("submit") if e.get("ok")})
    client = cluster.broker.client(1)
    states: dict[str, str] = {}
    try:
        for first in range(0, len(ids), 500):
            chunk = ids[first:first + 500]
            for task_id, raw in zip(chunk, client.mget([f"celery-task-meta-{i}" for i in chunk]), strict=True):
                states[task_id] = json.loads(raw)["status"] if raw else "MISSING"
    finally:
        client.close()
    return states

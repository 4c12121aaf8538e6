"""Per-thread CPU, context switches and the cyclic GC of a process, between two moments.

For :mod:`benchmarks.bench_leases` (``--thread-stats 1``): the worker's first body
and its N-th take a :func:`snapshot` of their own process (every thread's ``utime``,
``stime`` and context switches from ``/proc/self/task/<tid>/``, with its name from
``comm``; the collector's runs and time so far, from :func:`watch_gc`'s callback),
and :func:`delta` tells what happened between the two: where the CPU of the start
window went, thread by thread, and how much of it was the garbage collector's.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable
from typing import Any

#: The collector's runs and seconds per generation, and the objects it found unreachable.
_gc: dict[str, list[float]] = {"runs": [0, 0, 0], "seconds": [0.0, 0.0, 0.0], "collected": [0, 0, 0]}
_gc_started: list[float] = [0.0]


def _on_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
        return
    generation = info["generation"]
    _gc["runs"][generation] += 1
    _gc["seconds"][generation] += time.perf_counter() - _gc_started[0]
    _gc["collected"][generation] += info.get("collected", 0)


def watch_gc() -> None:
    """Time every collection of this process from now on (``gc.callbacks``)."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


#: Native thread id -> the name the library gave the thread (see :func:`name_library_threads`).
_names: dict[int, str] = {}


def name_library_threads() -> None:
    """Learn the names of the threads the library starts (:func:`.native.start_thread`): in a
    gevent worker they are OS threads without a name, all called ``python`` in ``comm``."""
    from celery_singleton_beat import native

    start = native.start_thread

    def named(target: Callable[[], Any], name: str) -> None:
        def run() -> Any:
            _names[threading.get_native_id()] = name
            return target()

        start(run, name)

    native.start_thread = named


def _thread(tid: str) -> dict[str, Any] | None:
    base = f"/proc/self/task/{tid}"
    try:
        with open(f"{base}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
        with open(f"{base}/comm") as comm:
            name = comm.read().strip()
        with open(f"{base}/status") as status:
            switches = {key: int(value) for key, _, value in (line.partition(":") for line in status)
                        if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")}
    except OSError:  # the thread ended meanwhile
        return None
    tick = os.sysconf("SC_CLK_TCK")
    name = "main (the hub)" if int(tid) == os.getpid() else _names.get(int(tid), f"{name} (other)")
    return {"name": name, "utime": int(fields[11]) / tick, "stime": int(fields[12]) / tick,
            "voluntary": switches.get("voluntary_ctxt_switches", 0),
            "nonvoluntary": switches.get("nonvoluntary_ctxt_switches", 0)}


def snapshot() -> dict[str, Any]:
    """Every thread of this process (by id) and the collector's figures so far."""
    threads = {tid: found for tid in os.listdir("/proc/self/task") if (found := _thread(tid)) is not None}
    return {"threads": threads, "gc": {key: list(values) for key, values in _gc.items()},
            "gc_count": list(gc.get_count())}


def delta(first: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    """What every thread (by name; threads of one name summed) and the collector did between
    ``first`` and ``last``: a thread started between them counts from zero."""
    by_name: dict[str, dict[str, float]] = {}
    for tid, now in last["threads"].items():
        then = first["threads"].get(tid, {"utime": 0.0, "stime": 0.0, "voluntary": 0, "nonvoluntary": 0})
        entry = by_name.setdefault(now["name"], {"threads": 0, "utime": 0.0, "stime": 0.0, "voluntary": 0,
                                                 "nonvoluntary": 0})
        entry["threads"] += 1
        for key in ("utime", "stime", "voluntary", "nonvoluntary"):
            entry[key] += now[key] - then[key]
    gc_delta = {key: [b - a for a, b in zip(first["gc"][key], last["gc"][key], strict=True)]
                for key in first["gc"]}
    return {"threads": by_name, "gc": gc_delta}

"""What the lease keeper costs per renewal: figures, no assertions.

Two measurements of the keeper's own work per lease it renews, in a gevent-patched
process (as a ``-P gevent`` worker) against a redis-server of its own:

* ``--mode thread``: ``--leases`` locks (``lock_ttl = --ttl``, renewed every third of
  it) kept by the process's real keeper thread for ``--seconds``; the keeper thread's CPU
  (user and system, from ``/proc/self/task/<tid>/stat``) over the renewals it made. With
  ``--hub-busy F`` the hub's own thread does Python work that fraction of the time (in
  slices of a few milliseconds), as a worker busy taking in messages does: the two threads
  then share the interpreter lock. The hub's CPU is printed too.
* ``--mode callgrind``: the same leases renewed in ``--rounds`` rounds by the calling
  thread (what the keeper's thread does in one round: take the due leases, renew them,
  schedule them again), counted by callgrind between two client requests (run it as
  ``valgrind --tool=callgrind --separate-threads=yes python -m benchmarks.measure_keeper_cost
  --mode callgrind``; needs ``gcc`` and valgrind's ``callgrind.h``). Prints the
  instructions per renewal when the dump file is given with ``--out``.

Run from a checkout: ``python -m benchmarks.measure_keeper_cost --leases 5000``.
"""

from __future__ import annotations

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402
import ctypes  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import gevent  # noqa: E402
from celery import Celery  # noqa: E402

from celery_singleton_beat.lease import keeper as keeper_module  # noqa: E402
from celery_singleton_beat.lease.lock import acquire  # noqa: E402
from celery_singleton_beat.lease.spec import LockSpec  # noqa: E402
from celery_singleton_beat.log import logger  # noqa: E402
from celery_singleton_beat.recovery.lock_redis import get_redis  # noqa: E402

from .bench_start_instructions import build_marks  # noqa: E402
from .common import Server  # noqa: E402

_SYS_GETTID = 186  # x86_64
_TICK = os.sysconf("SC_CLK_TCK")


def _gettid() -> int:
    return int(ctypes.CDLL(None, use_errno=True).syscall(_SYS_GETTID))


def thread_cpu(tid: int) -> float:
    """Seconds of CPU (user + system) of this process's thread ``tid``."""
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def take(url: str, n: int, ttl: float) -> list[Any]:
    app = Celery("keeper-cost", set_as_current=False)
    app.conf.singleton_redis_url = url
    client = get_redis(app)
    spec = LockSpec(task="keeper-cost", ttl=ttl)
    leases = [acquire(client, f"singleton:{{keeper-cost:{i}}}", spec, f"run-{i}").lease for i in range(n)]
    assert all(leases)
    return leases


def in_thread(url: str, n: int, ttl: float, seconds: float, hub_busy: float) -> dict[str, Any]:
    keeper = keeper_module.LeaseKeeper()
    tids: list[int] = []
    loop = keeper._loop

    def traced_loop() -> None:
        tids.append(_gettid())
        loop()

    keeper._loop = traced_loop  # type: ignore[method-assign]
    kept = [keeper.keep(lease) for lease in take(url, n, ttl)]
    while not tids:
        gevent.sleep(0.01)
    gevent.sleep(2 * ttl)  # settled: every lease renewed at least once
    hub = _gettid()

    def busy() -> None:
        while True:
            end = time.perf_counter() + 0.004 * hub_busy
            while time.perf_counter() < end:
                pass
            gevent.sleep(0.004 * (1 - hub_busy))

    burner = gevent.spawn(busy) if hub_busy > 0 else None
    renewed0, keeper0, hub0, t0 = sum(k.renewals for k in kept), thread_cpu(tids[0]), thread_cpu(hub), time.monotonic()
    gevent.sleep(seconds)
    renewed = sum(k.renewals for k in kept) - renewed0
    keeper_s, hub_s, wall = thread_cpu(tids[0]) - keeper0, thread_cpu(hub) - hub0, time.monotonic() - t0
    if burner is not None:
        burner.kill()
    lost = sum(k.lost for k in kept)
    return {"leases": n, "renewed_per_s": renewed / wall, "keeper_us_per_renewal": keeper_s / renewed * 1e6,
            "keeper_busy": keeper_s / wall, "hub_busy": hub_s / wall, "lost": lost, "batches": keeper.batches}


def one_round(keeper: keeper_module.LeaseKeeper) -> int:
    """One keeper round over every lease (all taken as due): the number renewed."""
    handle = getattr(keeper, "_handle", None)
    renewed = 0
    while renewed < keeper.tracked:
        with keeper._mutex:
            batch = keeper._take_due(float("inf"))
        if not batch:
            break
        renewed += len(batch)
        if handle is not None:
            handle(batch)
            continue
        done = keeper._renew_batch(batch)  # type: ignore[arg-type]  # the code before ``_handle``
        with keeper._mutex:
            for kept, next_time in done:
                if next_time is not None and kept.active:
                    keeper._schedule(kept, next_time)
    return renewed


def counted(url: str, n: int, rounds: int, out: str | None) -> dict[str, Any]:
    keeper = keeper_module.LeaseKeeper()
    keeper._running = True  # no thread: the rounds run here
    kept = [keeper.keep(lease) for lease in take(url, n, 600.0)]
    one_round(keeper)
    one_round(keeper)
    marks = ctypes.CDLL(str(build_marks(Path(tempfile.mkdtemp()))))
    marks.csb_zero()
    renewed = 0
    for _ in range(rounds):
        renewed += one_round(keeper)
    marks.csb_dump()
    result: dict[str, Any] = {"leases": n, "renewed": renewed, "lost": sum(k.lost for k in kept)}
    if out:
        for path in sorted(Path(out).parent.glob(Path(out).name + "*")):
            found = re.search(rb"^(?:summary|totals):\s*(\d+)", path.read_bytes(), re.M)
            if found and b"last start" in path.read_bytes()[:2000]:
                result["instructions_per_renewal"] = int(found.group(1)) / renewed
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["thread", "callgrind"], default="thread")
    parser.add_argument("--leases", type=int, default=1000)
    parser.add_argument("--ttl", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--hub-busy", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--url")
    parser.add_argument("--out", help="callgrind's --callgrind-out-file, to read the count back")
    args = parser.parse_args(argv)
    server = None if args.url else Server()
    url = args.url or server.url  # type: ignore[union-attr]
    try:
        if args.mode == "thread":
            print(in_thread(url, args.leases, args.ttl, args.seconds, args.hub_busy), flush=True)
        else:
            print(counted(url, args.leases, args.rounds, args.out), flush=True)
    finally:
        logger.disabled = True  # the keeper's thread finds the server gone: not worth a line per lease
        if server is not None:
            server.stop()
    sys.stdout.flush()
    os._exit(0)  # the keeper's thread and the counters' writer are daemons


if __name__ == "__main__":
    main()

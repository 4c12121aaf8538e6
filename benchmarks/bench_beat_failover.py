"""Beat failover: how long until a dead beat's claimed-but-unsent slots are sent.

Two ``SingletonScheduler`` instances in this process share a burst of ``N``
entries due at once (real claims in Redis, real publishing to a Redis broker).
The first claims the burst, publishes ``K`` messages and "dies" (is never
ticked again: SIGKILL between two of its publishes). The second, driven like
``celery beat``'s loop (sleep what ``tick()`` asks, at most
``beat_max_loop_interval``), lost every claim and takes the unsent slots over
when the pending lease ends. Reported: seconds from the death to the last
slot sent by the survivor, and how many slots were published twice (the winner
published them but died before marking them sent; both copies carry one task
id and workers run one).

Usage: python -m benchmarks.bench_beat_failover [--entries N] [--sent K]
       [--lease SECONDS] [--rounds R] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from typing import Any

from celery_singleton_beat.beat import SingletonScheduler
from celery_singleton_beat.config import clear_settings_cache
from celery_singleton_beat.recovery.lock_redis import reset_clients

from .bench_beat import QUEUE, build, make_app
from .common import Server, progress, summary


class Dies(BaseException):
    """Raised from the winner's K+1-th publish: it stands for the SIGKILL."""


def one_round(server: Server, entries: int, sent: int, lease: float, workdir: str) -> dict[str, float]:
    broker = server.client(0)
    server.flush(0, 2)
    clear_settings_cache()
    reset_clients()
    app = make_app(server.url, entries, opt_out=False)
    app.conf.singleton_beat_pending_lease = lease
    max_interval = 1.0

    class Winner(SingletonScheduler):
        published = 0

        def _send(self, *args: Any, **kwargs: Any) -> Any:
            if self.published >= sent:
                raise Dies()
            self.published += 1
            return super()._send(*args, **kwargs)

    tag = f"{time.monotonic_ns()}"
    winner = build(Winner, app, workdir, f"{tag}-winner")
    survivor = build(SingletonScheduler, app, workdir, f"{tag}-survivor")
    try:
        while True:
            winner.tick()
    except Dies:
        died = time.monotonic()
    # The survivor ticks through the burst (every claim lost), then sleeps as beat does.
    def distinct() -> int:
        return len({json.loads(raw)["headers"]["id"] for raw in broker.lrange(QUEUE, 0, -1)})

    while distinct() < entries:
        delay = survivor.tick()
        if delay > 0:
            time.sleep(min(delay, max_interval))
        if time.monotonic() - died > 10 * lease + 30:
            raise RuntimeError(f"only {distinct()} of {entries} slots sent")
    done = time.monotonic()
    survivor.close()
    winner.close()
    ids = [json.loads(raw)["headers"]["id"] for raw in broker.lrange(QUEUE, 0, -1)]
    if len(set(ids)) != entries:
        raise RuntimeError(f"{len(ids)} messages, {len(set(ids))} distinct slots, expected {entries}")
    # Slots the winner published but had not marked sent yet are sent again by the
    # survivor, with the same task id: a worker runs one copy (slot_delivery).
    return {"seconds": done - died, "copies": len(ids) - entries}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=300)
    parser.add_argument("--sent", type=int, default=40)
    parser.add_argument("--lease", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.getLogger("celery").setLevel(logging.WARNING)
    logging.getLogger("celery_singleton_beat").setLevel(logging.ERROR)
    server = Server()
    rounds = []
    try:
        with tempfile.TemporaryDirectory(prefix="csb-bench-failover-") as workdir:
            for r in range(args.rounds):
                progress(f"failover: round {r + 1}/{args.rounds}")
                rounds.append(one_round(server, args.entries, args.sent, args.lease, workdir))
    finally:
        server.stop()
    report = {"entries": args.entries, "sent_before_death": args.sent, "lease": args.lease,
              "seconds_to_all_sent": summary([r["seconds"] for r in rounds]),
              "second_copies": [r["copies"] for r in rounds]}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        s = report["seconds_to_all_sent"]
        print(f"{args.entries} entries due, winner died after {args.sent} sends, pending lease "
              f"{args.lease:g}s: the survivor sent the other {args.entries - args.sent} after "
              f"{s['median']:.2f}s median ({s['min']:.2f}-{s['max']:.2f}); second copies of slots "
              f"it had published but not yet marked sent (same task id, dropped by workers): "
              f"{report['second_copies']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m harness.chaos run|check``: a chaos run, or the checker on a saved history.

Exit status: 0 when the checker found no violation, 1 when it found one, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .checker import check
from .history import load
from .report import ROW_HEADER, kinds_table, render, row, row_of, save, total_row
from .switches import record_switches

#: Where ``run`` puts its directories unless told otherwise (ignored by git).
DEFAULT_OUT = Path(__file__).resolve().parents[2] / ".chaos"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.chaos", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the cluster under faults, then check its history")
    run.add_argument("--seconds", type=float, default=60.0, help="seconds of faults (default 60)")
    run.add_argument("--seed", type=int, default=1, help="the nemesis's and submitter's seed (default 1)")
    run.add_argument("--broker", choices=("separate", "same"), default="separate",
                     help="the broker on a Redis of its own, or on the lock Redis (default separate)")
    run.add_argument("--lock", choices=("standalone", "sentinel", "cluster"), default="standalone",
                     help="the lock Redis: one server, a primary, a replica and 3 sentinels, or a Redis Cluster "
                          "of 3 primaries with a replica each (default standalone)")
    run.add_argument("--wait-replicas", type=int, default=0,
                     help="singleton_wait_replicas: replicas that must acknowledge each lock (default 0)")
    run.add_argument("--out", type=Path, default=None, help=f"run directory (default: under {DEFAULT_OUT})")
    run.add_argument("--broken-lock", action="store_true",
                     help="control run: every run gets a key of its own (the checker must reject it)")
    run.add_argument("--no-faults", action="store_true", help="run without the nemesis")
    judge = sub.add_parser("check", help="check a saved history (a run directory or its history/)")
    judge.add_argument("directory", type=Path)
    table = sub.add_parser("table", help="check saved runs again; print their results table (Markdown)")
    table.add_argument("directories", type=Path, nargs="+")
    args = parser.parse_args(argv)

    if args.command == "table":
        rows = []
        for directory in args.directories:
            record_switches(_history_of(directory).parent)
            verdict = check(load(_history_of(directory)))
            save(verdict, _history_of(directory).parent)
            rows.append(verdict.figures)
        print("\n".join([ROW_HEADER, *(row_of(f) for f in rows), total_row(rows), "", kinds_table(rows)]))
        return 0 if all(not f.get("violations total") for f in rows) else 1

    if args.command == "run":
        from .cluster import Settings
        from .run import run as run_cluster

        settings = Settings(variant=args.broker, lock=args.lock, seed=args.seed, broken=args.broken_lock,
                            wait_replicas=args.wait_replicas)
        name = f"{time.strftime('%Y%m%d-%H%M%S')}-{args.broker}-{args.lock}-seed{args.seed}"
        out = (args.out or DEFAULT_OUT / name).resolve()
        history_dir = run_cluster(settings, out, args.seconds, nemesis=not args.no_faults)
    else:
        history_dir = _history_of(args.directory)
        record_switches(history_dir.parent)
    verdict = check(load(history_dir))
    save(verdict, history_dir.parent)
    print(render(verdict, limit=10))
    print(row(verdict))
    print(f"history: {history_dir}; report: {history_dir.parent / 'report.md'}")
    return 0 if verdict.ok else 1


def _history_of(directory: Path) -> Path:
    """A run directory's history (or the history directory itself)."""
    return directory / "history" if (directory / "history").is_dir() else directory


if __name__ == "__main__":
    sys.exit(main())

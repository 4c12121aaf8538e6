"""Figures of a judged run, and how they are shown (terminal, ``report.md``, a results-table row)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from .history import History
from .model import Run, fates
from .verdict import Verdict

__all__ = ["ROW_HEADER", "figures", "kinds_table", "render", "row", "row_of", "save", "total_row"]


def figures(history: History, all_runs: list[Run], verdict: Verdict) -> dict[str, Any]:
    """What happened in numbers: faults by kind, runs, submissions' fates, findings by kind."""
    settings = history.meta.get("settings", {})
    phases = {e.get("name"): e.m for e in history.of("phase")}
    faults = Counter(str(e.get("kind")) for e in history.of("fault") if e.get("action") == "inject")
    failed = Counter(str(e.get("kind")) for e in history.of("fault") if e.get("error"))
    subs = fates(history)
    found = Counter(v.kind for v in verdict.violations)
    reported = Counter(r.kind for r in verdict.reports)
    return {
        "variant": settings.get("variant"), "lock": settings.get("lock", "standalone"), "seed": settings.get("seed"),
        "seconds": history.meta.get("seconds"),
        "chaos seconds": round(phases["quiesce"] - phases["chaos"], 1) if {"chaos", "quiesce"} <= set(phases) else None,
        "faults": dict(sorted(faults.items())), "faults total": sum(faults.values()),
        "fault steps that raised": dict(failed),
        "not applicable": history.meta.get("kinds", {}).get("not applicable", {}),
        "submissions": len(subs),
        "publishes refused": sum(1 for e in history.of("submit") if not e.get("ok")),
        "fates": dict(Counter(s.fate for s in subs.values()).most_common()),
        "crashes": dict(Counter(str(e.get("name")) for e in history.of("proc") if e.get("action") == "crash")),
        "runs": len(all_runs),
        "run endings": dict(Counter(r.how or "cut short" for r in all_runs).most_common()),
        "overlaps": found["overlap"], "overlaps told": reported["overlap-told"],
        "overlaps unchecked": reported["overlap-unchecked"],
        "lost": found["lost"], "lost with the broker": reported["lost-with-broker"],
        "lost in the broker's transport": reported["lost-in-transport"],
        "re-runs": found["rerun"],
        "re-runs excused": (reported["rerun-after-data-loss"] + reported["rerun-after-done-ttl"]
                            + reported["rerun-after-lost-release"]),
        "slots": verdict.figures.get("slots", {}),
        "violations": dict(found), "violations total": len(verdict.violations),
        "reports": dict(reported),
    }


def render(verdict: Verdict, *, limit: int = 20) -> str:
    """The verdict for a terminal and ``report.md``: figures, then each finding with its evidence."""
    f = verdict.figures
    lines = [f"# Chaos run: {f.get('variant')} variant, seed {f.get('seed')}, {f.get('chaos seconds')} s of faults",
             "", "**" + ("no violation" if verdict.ok else f"{len(verdict.violations)} violation(s)") + "**", "",
             "```json", json.dumps({k: v for k, v in f.items()}, indent=1, default=str), "```"]
    for title, findings in (("Violations", verdict.violations), ("Reported (allowed by the guarantees)",
                                                                 verdict.reports)):
        if not findings:
            continue
        lines += ["", f"## {title}", ""]
        for finding in findings[:limit]:
            lines.append(f"- **{finding.kind}** at m={finding.at:.3f}: {finding.what}")
            if title == "Violations":
                lines += ["  ```"] + [f"  {json.dumps(e, default=str)}" for e in finding.evidence] + ["  ```"]
        if len(findings) > limit:
            lines.append(f"- ... and {len(findings) - limit} more ({title.lower()}: see verdict.json)")
    return "\n".join(lines) + "\n"


ROW_HEADER = ("| seed | broker | lock | s | faults | submissions | runs | overlaps (told) | lost (excused) | "
              "re-runs (excused) | slots sent / due (excused) | violations |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|")


def row(verdict: Verdict) -> str:
    """One line of benchmarks/results.md's chaos table."""
    return row_of(verdict.figures)


def _violations(counts: dict[str, int]) -> str:
    total = sum(counts.values())
    return f"{total}" + (f" ({', '.join(f'{k} {n}' for k, n in sorted(counts.items()))})" if total else "")


def row_of(f: dict[str, Any]) -> str:
    """One line of the chaos table from a verdict's figures."""
    slots = f.get("slots", {})
    excused_lost = f.get("lost with the broker", 0) + f.get("lost in the broker's transport", 0)
    return (f"| {f.get('seed')} | {f.get('variant')} | {f.get('lock', 'standalone')} | {f.get('chaos seconds')} | "
            f"{f.get('faults total')} | {f.get('submissions')} | {f.get('runs')} | "
            f"{f.get('overlaps')} ({f.get('overlaps told')}) | {f.get('lost')} ({excused_lost}) | "
            f"{f.get('re-runs')} ({f.get('re-runs excused')}) | "
            f"{slots.get('sent', 0)} / {slots.get('expected', 0)} ({slots.get('excused', 0)}) | "
            f"{_violations(f.get('violations', {}))} |")


def total_row(figures: list[dict[str, Any]]) -> str:
    """The table's last line: the sums over its runs."""
    def total(*names: str) -> int:
        return sum(int(f.get(name) or 0) for f in figures for name in names)

    def slots(name: str) -> int:
        return sum(int(f.get("slots", {}).get(name, 0)) for f in figures)

    found: dict[str, int] = {}
    for f in figures:
        for kind, n in f.get("violations", {}).items():
            found[kind] = found.get(kind, 0) + n
    seconds = sum(float(f.get("chaos seconds") or 0) for f in figures)
    return (f"| all | | | {seconds:.0f} | {total('faults total')} | {total('submissions')} | {total('runs')} | "
            f"{total('overlaps')} ({total('overlaps told')}) | {total('lost')} "
            f"({total('lost with the broker', 'lost in the broker' + chr(39) + 's transport')}) | "
            f"{total('re-runs')} ({total('re-runs excused')}) | "
            f"{slots('sent')} / {slots('expected')} ({slots('excused')}) | {_violations(found)} |")


def kinds_table(figures: list[dict[str, Any]]) -> str:
    """Faults injected, by kind, per run and in all."""
    kinds = sorted({k for f in figures for k in f.get("faults", {})})
    head = "| fault | " + " | ".join(f"{f.get('variant')} {f.get('seed')}" for f in figures) + " | all |"
    lines = [head, "|---" * (len(figures) + 2) + "|"]
    for kind in kinds:
        counts = [int(f.get("faults", {}).get(kind, 0)) for f in figures]
        lines.append(f"| {kind} | " + " | ".join(str(n) for n in counts) + f" | {sum(counts)} |")
    return "\n".join(lines)


def save(verdict: Verdict, directory: Path) -> None:
    """``verdict.json`` and ``report.md`` next to the history."""
    (directory / "verdict.json").write_text(json.dumps(verdict.as_json(), indent=1, default=str))
    (directory / "report.md").write_text(render(verdict))

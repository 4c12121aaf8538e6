"""Figures of a judged run, and how they are shown (terminal, ``report.md``, a results-table row)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .history import History
from .model import Run, fates

if TYPE_CHECKING:
    from .checker import Verdict

__all__ = ["ROW_HEADER", "figures", "render", "row", "save"]


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
        "variant": settings.get("variant"), "seed": settings.get("seed"), "seconds": history.meta.get("seconds"),
        "chaos seconds": round(phases["quiesce"] - phases["chaos"], 1) if {"chaos", "quiesce"} <= set(phases) else None,
        "faults": dict(sorted(faults.items())), "faults total": sum(faults.values()),
        "fault steps that raised": dict(failed),
        "not applicable": history.meta.get("kinds", {}).get("not applicable", {}),
        "submissions": len(subs),
        "publishes refused": sum(1 for e in history.of("submit") if not e.get("ok")),
        "fates": dict(Counter(s.fate for s in subs.values()).most_common()),
        "runs": len(all_runs),
        "run endings": dict(Counter(r.how or "cut short" for r in all_runs).most_common()),
        "overlaps": found["overlap"], "overlaps told": reported["overlap-told"],
        "overlaps unchecked": reported["overlap-unchecked"],
        "lost": found["lost"], "lost with the broker": reported["lost-with-broker"],
        "lost in the broker's transport": reported["lost-in-transport"],
        "re-runs": found["rerun"],
        "re-runs excused": reported["rerun-after-data-loss"] + reported["rerun-after-done-ttl"],
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


ROW_HEADER = ("| seed | broker | s | faults (by kind) | submissions | runs | overlaps (told) | lost | re-runs | "
              "slots sent / due (excused) | violations |\n|---|---|---|---|---|---|---|---|---|---|---|")


def row(verdict: Verdict) -> str:
    """One line of benchmarks/results.md's chaos table."""
    f = verdict.figures
    slots = f.get("slots", {})
    kinds = ", ".join(f"{k} {n}" for k, n in f.get("faults", {}).items())
    return (f"| {f.get('seed')} | {f.get('variant')} | {f.get('chaos seconds')} | {f.get('faults total')}: {kinds} | "
            f"{f.get('submissions')} | {f.get('runs')} | {f.get('overlaps')} ({f.get('overlaps told')}) | "
            f"{f.get('lost')} ({f.get('lost with the broker')} with the broker) | {f.get('re-runs')} | "
            f"{slots.get('sent', 0)} / {slots.get('expected', 0)} ({slots.get('excused', 0)}) | "
            f"{f.get('violations total')} |")


def save(verdict: Verdict, directory: Path) -> None:
    """``verdict.json`` and ``report.md`` next to the history."""
    (directory / "verdict.json").write_text(json.dumps(verdict.as_json(), indent=1, default=str))
    (directory / "report.md").write_text(render(verdict))

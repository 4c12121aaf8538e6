"""What the checker found: findings and the verdict of one run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Finding", "Verdict"]


@dataclass
class Finding:
    """A violation or a report: its kind, one line, when, and the history lines behind it."""

    kind: str
    what: str
    at: float
    evidence: list[dict[str, Any]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "what": self.what, "at": round(self.at, 3), "evidence": self.evidence}


@dataclass
class Verdict:
    """Everything the checker found, and the run's figures."""

    violations: list[Finding] = field(default_factory=list)
    reports: list[Finding] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def as_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "figures": self.figures, "violations": [v.as_json() for v in self.violations],
                "reports": [r.as_json() for r in self.reports]}

"""Chaos runs in the suite (``harness/chaos``): the control run, and a short fixed-seed run.

* The control run gives every run a lock key of its own (``unique_on`` broken on
  purpose), without faults: the checker must reject its history (overlaps).
  It is what shows that a clean verdict of a real run means something.
* The short run is ``make chaos`` in small: the whole cluster (two prefork
  workers, one behind a proxy, a threads worker; two beats; the submitter) under
  40 s of overlapping faults from seed :data:`SEED`; the checker must find no
  violation, and the run must have reached what it claims to test (faults of
  many kinds, runs, beat slots).

Each run's directory (history, logs, ``report.md``) is in pytest's temporary
directory, kept when the test fails: ``python -m harness.chaos check DIR`` judges it again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.chaos.checker import check
from harness.chaos.cluster import Settings
from harness.chaos.history import load
from harness.chaos.report import render, save
from harness.chaos.run import run
from harness.chaos.verdict import Verdict

#: The short run's seed and seconds of faults.
SEED = 1
SECONDS = 40.0


def judged(tmp_path: Path, settings: Settings, seconds: float, *, nemesis: bool) -> Verdict:
    history = run(settings, tmp_path / "run", seconds, nemesis=nemesis)
    verdict = check(load(history))
    save(verdict, history.parent)
    print(render(verdict, limit=5))
    return verdict


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_control_run_with_a_broken_lock_is_rejected(tmp_path: Path) -> None:
    verdict = judged(tmp_path, Settings(seed=SEED, broken=True), 12.0, nemesis=False)
    assert verdict.figures["runs"] >= 10, "runs happened"
    assert "overlap" in {v.kind for v in verdict.violations}, "the checker rejects a broken lock"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_short_fixed_seed_chaos_run_breaks_no_rule(tmp_path: Path) -> None:
    verdict = judged(tmp_path, Settings(seed=SEED), SECONDS, nemesis=True)
    figures = verdict.figures
    assert figures["faults total"] >= 10 and len(figures["faults"]) >= 6, f"faults injected: {figures['faults']}"
    assert figures["runs"] >= 30 and figures["slots"].get("sent", 0) >= 10, "runs and beat slots happened"
    assert not verdict.violations, render(verdict, limit=10)

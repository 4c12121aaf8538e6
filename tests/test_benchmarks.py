"""Smoke test: every benchmark runs end to end with tiny sizes (no timing is asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .support import ROOT, child_env, RedisServer


def test_every_benchmark_runs_with_tiny_sizes(tmp_path: Path, redis_server: RedisServer) -> None:
    output = tmp_path / "results.md"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.run_all", "--quick", "--output", str(output)],
        cwd=ROOT, env=child_env(redis_server), capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    text = output.read_text()
    for title in ("Task overhead", "Contention", "Beat dispatch", "Lock primitives", "Memory"):
        assert f"### {title}" in text
    assert "| plain |" in text and "| singleton |" in text

"""Smoke test: every benchmark runs end to end with tiny sizes (no timing is asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .support import RedisServer, TestProcess, child_env, wait_for

#: The benchmark run's own deadline, below the test's timeout: a run that hangs
#: fails with the end of its output (the harness attaches it to the report).
DEADLINE = 720


@pytest.mark.timeout(DEADLINE + 120)
def test_every_benchmark_runs_with_tiny_sizes(tmp_path: Path, redis_server: RedisServer) -> None:
    output = tmp_path / "results.md"
    bench = TestProcess("benchmarks", [sys.executable, "-m", "benchmarks.run_all", "--quick",
                                       "--output", str(output)],
                        env=child_env(redis_server), log=tmp_path / "benchmarks.log").start()
    wait_for(lambda: bench.returncode is not None, timeout=DEADLINE, interval=0.5,
             message="the benchmarks to finish")
    assert bench.returncode == 0, bench.tail(60)
    text = output.read_text()
    for title in ("Task overhead", "Peers", "Instructions per task", "Contention", "Beat dispatch", "Lock primitives",
                  "Killed pool child", "Memory"):
        assert f"### {title}" in text
    assert "| plain |" in text and "| singleton |" in text
    assert "| plain Celery Task |" in text and "| SingletonTask (ours, default mode) |" in text
    # Instructions per task: counted under callgrind where valgrind is installed (CI installs it).
    assert "Skipped: valgrind not found" in text or "instructions/task" in text

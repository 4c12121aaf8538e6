"""The test-side stall monitor (``tests/support/stalls.py``) and the errors it excuses.

The monitor's loop is driven tick by tick (an injected clock and wait) for what it records
and how a window reads it; a real freeze is a child process running the monitor, stopped
with SIGSTOP and resumed: the monitor must report at least the time it was stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from harness.processes import die_with_parent

from .support import ROOT, soak
from .support.processes import wait_until_stopped
from .support.stalls import BOUND, TICK, StallMonitor, StallWindow, unexplained_errors

EXPIRED = ("[2026-12-05 01:02:03,456: ERROR/MainProcess] liveness key singleton:live:ab12 had expired "
           "(last renewed {ago} s ago, TTL 10 s): this worker counted as dead for a while; other workers "
           "may have taken over its locks")
OTHER = "[2026-12-05 01:02:03,456: ERROR/MainProcess] cannot renew liveness key singleton:live:ab12: Timeout"


def driven(gaps: list[float], start: float = 100.0, steps: dict[int, float] | None = None) -> StallMonitor:
    """A monitor whose loop ran once per entry of ``gaps``: the clock moved that much each tick,
    the wall clock too, plus ``steps[i]`` seconds at tick ``i`` (counted from 0)."""
    now = [start]
    wall = [1_800_000_000.0]
    ticks = iter(enumerate(gaps))

    def wait(_: float) -> bool:
        tick = next(ticks, None)
        if tick is None:
            return True  # stop
        index, gap = tick
        now[0] += gap
        wall[0] += gap + (steps or {}).get(index, 0.0)
        return False

    monitor = StallMonitor(wait=wait, clock=lambda: now[0], wall=lambda: wall[0])
    monitor.run()
    return monitor


def test_regular_ticks_record_nothing_and_a_gap_is_one_stall() -> None:
    assert driven([TICK] * 50 + [TICK + BOUND]).stalls == [], "a gap up to tick + bound is no freeze"
    monitor = driven([TICK] * 10 + [9.0] + [TICK] * 10)
    [stall] = monitor.stalls
    assert stall.start == pytest.approx(100 + 10 * TICK) and stall.end == pytest.approx(109 + 10 * TICK)


#: One second of regular ticks.
SECOND = [TICK] * round(1 / TICK)


def test_a_step_of_the_wall_clock_is_recorded_a_freeze_is_none() -> None:
    assert driven([*SECOND, 9.0, *SECOND]).steps == [], "a freeze moves both clocks alike"
    assert driven(SECOND * 3, steps={i: 0.0005 * TICK for i in range(60)}).steps == [], \
        "NTP's slew (at most 500 ppm) is no step"
    assert driven(SECOND, steps={5: BOUND}).steps == [], "up to the bound is no step"
    monitor = driven([*SECOND, *SECOND, *SECOND], steps={30: 2.2, 45: -1.0})  # forward at 101.55, back at 102.3
    assert [(round(s.at, 2), round(s.seconds, 2)) for s in monitor.steps] == [(101.55, 2.2), (102.3, -1.0)]
    assert monitor.stepped(100, 103) == pytest.approx(2.2), "forward steps only: a step back lets keys live longer"
    assert monitor.stepped(101.6, 103) == 0.0, "after it"
    assert monitor.stepped(99, 103) == 0.0, "a window the monitor did not watch from its start"


def test_a_window_sees_the_part_of_a_freeze_inside_it() -> None:
    monitor = driven([*SECOND, 9.0, *SECOND])  # frozen from 101 to 110 (less the tick it waited)
    assert len(monitor.stalls) == 1
    assert monitor.frozen_for(100, 120) == pytest.approx(9.0 - TICK)
    assert monitor.frozen_for(105, 120) == pytest.approx(5.0 - TICK), "clipped to the window"
    assert monitor.frozen_for(110, 120) == 0.0, "after it"
    assert monitor.frozen_for(99, 120) == 0.0, "a window the monitor did not watch from its start"


def window_frozen(seconds: float) -> StallWindow:
    """A window over a monitor that saw this process frozen ``seconds`` (a driven loop, in
    the real clock's past so that the window's end, now, is after it)."""
    start = time.monotonic() - seconds - 10
    monitor = driven([*SECOND, seconds + TICK, *SECOND] if seconds else SECOND, start=start)
    return StallWindow(monitor, start)


def test_only_a_liveness_line_a_freeze_explains_is_excused() -> None:
    ten_s = EXPIRED.format(ago="10.2")
    log = "\n".join(["[...: INFO/MainProcess] ready.", ten_s, OTHER])
    assert unexplained_errors(log, window_frozen(9.0)) == [OTHER], "the freeze explains the expiry, nothing else"
    assert unexplained_errors(log, window_frozen(0)) == [ten_s, OTHER], "no freeze: an error"
    assert unexplained_errors(log, window_frozen(6.0)) == [ten_s, OTHER], "too short for a 10 s key to expire"
    lost = EXPIRED.format(ago="3.4")  # below the TTL: Redis lost the key, no freeze explains it
    assert unexplained_errors(lost, window_frozen(9.0)) == [lost]
    assert unexplained_errors("INFO only", window_frozen(0)) == []


def test_a_freeze_the_thread_has_not_woken_from_yet_counts() -> None:
    """Asked right after a freeze, before the monitor's thread ticked again: the gap since
    its latest tick is a freeze under way."""
    now = [100.0]
    monitor = StallMonitor(wait=lambda _: True, clock=lambda: now[0])
    monitor.run()  # started, no tick yet
    now[0] += TICK + BOUND
    assert monitor.stalls == [] and monitor.frozen_for(100, now[0]) == 0.0
    now[0] = 109.0
    assert monitor.frozen_for(100, now[0]) == pytest.approx(9.0 - TICK)


#: A child running the monitor: prints ``ready``, then for a line ``<start> <end>`` (monotonic)
#: the longest freeze it saw in that window, and how far the wall clock stepped forward there.
CHILD = """
import sys
from tests.support.stalls import StallMonitor
monitor = StallMonitor().start()
print("ready", flush=True)
start, end = map(float, sys.stdin.readline().split())
print(monitor.frozen_for(start, end), monitor.stepped(start, end), flush=True)
"""


@pytest.fixture
def child() -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, text=True, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, preexec_fn=die_with_parent(signal.SIGKILL))
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def test_a_process_stopped_and_resumed_reports_at_least_the_time_it_was_stopped(
        child: subprocess.Popen[str]) -> None:
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().strip() == "ready"
    os.kill(child.pid, signal.SIGSTOP)
    wait_until_stopped(child.pid)
    stopped = time.monotonic()  # stopped by now: its last tick came before
    soak(1.0, what="the child stopped")  # the freeze itself: time must pass
    resumed = time.monotonic()  # before SIGCONT: the child cannot tick before this
    os.kill(child.pid, signal.SIGCONT)
    child.stdin.write(f"{stopped} {resumed}\n")
    child.stdin.flush()
    frozen, stepped = map(float, child.stdout.readline().split())
    assert frozen >= resumed - stopped - TICK - 1e-6, f"stopped {resumed - stopped:.3f} s, saw {frozen:.3f} s"
    assert stepped == 0.0, "a freeze is no step of the wall clock: both clocks went on"

"""The protocol fuzz test: every reported result agrees with what Redis holds, through faults.

A real redis-server behind :class:`.support.fault_proxy.FaultProxy`, which refuses
commands with error replies, delays replies (some past the client's timeout), closes
connections before or after a command ran, cuts replies and goes silent, at random;
exceptions are raised into the waiting thread at random moments. The operations are
the library's own (acquire, release now or later, release through the pool, renew,
put back, flush), and each result is judged against Redis by
:mod:`.support.protocol_fuzz`.

In the suite: ``FUZZ_OPERATIONS`` (2,000 by default, a few seconds). ``make fuzz``
runs 100,000 (docs/performance.md gives the last figures). ``FUZZ_SEED`` repeats a
run's fault draws (the threads' timing still differs from run to run).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import pytest

from .support import RedisServer
from .support.fault_proxy import FATES, Rates
from .support.protocol_fuzz import FuzzReport, run

OPERATIONS = int(os.environ.get("FUZZ_OPERATIONS", "2000"))
SEED = int(os.environ.get("FUZZ_SEED") or random.SystemRandom().randrange(2**32))

#: Each fate often enough to happen in every run of the suite's size (20+ times for the
#: rarest), rarely enough that most requests pass.
RATES = Rates(refuse=0.01, delay=0.02, close_before=0.004, close_after=0.004, cut=0.004, silence=0.0025,
              delay_max=0.005, long_delay=0.15, long_delay_every=8)
#: The client's socket timeout: a silent connection or a long delay ends in a timeout.
TIMEOUT = 0.1


def progress(done: int, report: FuzzReport) -> None:
    print(f"  {done} operations, {len(report.disagreements)} disagreements", flush=True)


@pytest.mark.timeout(max(300, OPERATIONS // 100))
def test_every_reported_result_agrees_with_redis_through_a_faulty_connection(
        make_redis: Callable[..., RedisServer]) -> None:
    server = make_redis()
    report = run(server.port, server.client(), operations=OPERATIONS, seed=SEED, rates=RATES,
                 interrupt_rate=0.03, timeout=TIMEOUT, progress=progress if OPERATIONS >= 20_000 else None)
    print(f"\nprotocol fuzz, seed {SEED}: {report.summary()}")
    assert not report.disagreements, (f"seed {SEED}: {len(report.disagreements)} disagreements, first: "
                                      + "\n".join(report.disagreements[:20]))
    missing = [fate for fate in (*FATES, "long_delay") if not report.faults[fate]]
    assert not missing, f"seed {SEED}: these faults never happened: {missing} ({report.summary()})"
    assert report.interruptions > 0, f"seed {SEED}: no interruption landed inside a call"
    # Faults cost operations, and only they do (not, e.g., a pool used up by reconnections).
    assert report.failed <= 2 * (sum(report.faults.values()) + report.interruptions), report.summary()
    assert report.outcomes["acquire taken"] and report.outcomes["acquire held"] and report.outcomes["release True"]

"""A process whose wall clock is wrong: what its locks promise does not move with it.

The client runs under ``faketime`` (LD_PRELOAD), its wall clock two days off in
either direction; the redis-server and this test keep the real time. Fencing
tokens are the server's clock (``TIME`` behind the ``SET``): a token issued to the
skewed process falls between two readings of the server's clock taken around it,
and the next token issued to a process with the right time is larger still.
Leases and ``ensure_held()`` run on the monotonic clock, which ``faketime`` leaves
alone here (``FAKETIME_DONT_FAKE_MONOTONIC``), as NTP steps leave it alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import redis

from .support import LOCK_DB, ROOT, RedisServer, require
from .support.locking import take_lock

#: Run in the skewed process: take ``key`` (a worker's spec: live, a liveness prefix),
#: renew it, check ensure_held(), release it; print what it saw.
SCRIPT = """
import json, sys, threading, time
import redis
from celery_singleton_beat.lease.keeper import LeaseKeeper
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.task.run import HeldRun
client = redis.Redis.from_url(sys.argv[1])
spec = LockSpec(task="skew", ttl=2.0, boot="skewed-boot", live=True, liveness_ttl=3.0, liveness_prefix="singleton")
result = acquire(client, sys.argv[2], spec, "skewed-task")
kept = run = LeaseKeeper().keep_entry(HeldRun(result.lease, None))
deadline = time.monotonic() + 10
while kept.renewals < 2 and time.monotonic() < deadline:
    threading.Event().wait(0.05)  # (time.sleep fails under faketime's clock_nanosleep)
held = run.ensure_held()
print(json.dumps({"wall": time.time(), "fence": result.lease.fence, "renewals": kept.renewals,
                  "held": held, "released": result.lease.release()}))
"""


def server_clock_us(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


@pytest.mark.parametrize("skew", ["-2d", "+2d"])
def test_a_process_with_a_skewed_clock_gets_fencing_tokens_from_the_server_clock(
        skew: str, redis_db: redis.Redis, redis_server: RedisServer) -> None:
    faketime = require("faketime")
    locks = redis_server.client(LOCK_DB)
    key = "singleton:{skew:k}"
    before = server_clock_us(locks)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    done = subprocess.run([faketime, "-f", skew, sys.executable, "-c", SCRIPT, redis_server.url(LOCK_DB), key],
                          capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    after = server_clock_us(locks)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert abs(seen["wall"] - after / 1e6) > 86_400, "the process really ran on a skewed wall clock"
    assert before <= seen["fence"] <= after, (before, seen["fence"], after)
    assert seen["renewals"] >= 2 and seen["held"] == seen["fence"] and seen["released"]
    honest = take_lock(locks, key, 2.0, task="skew", task_id="honest").lease
    assert honest is not None and honest.fence > seen["fence"]

"""The ``reelect-primary`` fault: Sentinel elects again a former primary that never replicated.

With ``LOCK=sentinel`` the lock Redis is a primary P1 (append-only file) and its
replica P2, watched by three sentinels (down after 1 s). The fault, step by step:

1. **P1 cut off**: SIGSTOP of P1's process (it keeps its sockets and its data, and
   answers nothing). The sentinels find it down and promote P2.
2. **P2 serves**: the fault waits until every sentinel names P2, P2 reports itself a
   primary, and P2 holds a run lock acquired after P1 was stopped (a lock P1 cannot
   have: its ``at`` is later than the stop); then a seeded while more, so that more
   locks are taken there.
3. **P2 fails, P1 comes back**: a marker is written on P2 (database 3, with a TTL; no
   run lock), P2 is SIGKILLed, P1 gets SIGCONT. Sentinel turns a former primary that
   reports itself a primary into a replica only after it has been up for 8 s
   (``SENTINEL_PUBLISH_PERIOD * 4``) *and* while the primary it follows looks sane;
   with P2 down neither holds, so when the sentinels fail over from P2 they elect the
   only replica they know, P1, which is a primary already and keeps its own data and
   replication history: it lacks every write made on P2.
4. **Checked**: once every sentinel names P1, a ``fault-note`` records what P1 is:
   whether it lacks the marker and the locks seen on P2, and whether its replication
   id is the one it had before it was cut off (it never replicated from P2).
5. **P2 back**: started again from its configuration file as P1's replica (a full
   resynchronisation drops its own history).

Each gate is bounded (:data:`PROMOTION_BOUND`, :data:`LOCK_BOUND`,
:data:`ELECTION_BOUND` seconds); past one, the fault goes on and its note says
what did not happen. The library's defence: the data's generation in its server
record (see :mod:`celery_singleton_beat.recovery.window`): a process that used P2
and reaches P1 finds a lower generation than it saw and opens a recovery window.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import redis

from celery_singleton_beat.lease.holder import parse_holder
from celery_singleton_beat.task.keys import is_run_lock_key

from ..sentinel import master_address
from .cluster import Cluster
from .history import Recorder
from .redis_node import Redis

__all__ = ["ELECTION_BOUND", "LOCK_BOUND", "MARKER_DB", "PROMOTION_BOUND", "Reelection"]

#: Seconds the fault waits for each of its gates before it goes on regardless.
PROMOTION_BOUND = 30.0
LOCK_BOUND = 20.0
ELECTION_BOUND = 40.0
#: The database of the marker written on P2 before it fails (not the locks' database 2).
MARKER_DB = 3
#: Seconds between two looks at the servers while a gate is closed.
POLL = 0.2


class Reelection:
    """The state of one ``reelect-primary`` fault: its gates and its steps (see the module)."""

    def __init__(self, cluster: Cluster, rec: Recorder, number: Callable[[], int], hold: float) -> None:
        self.cluster = cluster
        self.rec = rec
        #: The fault's number (known once the nemesis injected it).
        self.number = number
        #: Seconds P2 serves after the first lock it took, before it fails.
        self.hold = hold
        self.p1 = cluster.lock
        self.p2 = next(n for n in cluster.lock_nodes if n is not self.p1)
        self.started = time.monotonic()
        self.replid = _replication(self.p1).get("master_replid", "")
        #: When P1 was stopped (Unix seconds): a lock acquired later cannot be on P1.
        self.stopped_wall: float | None = None
        self.promoted_at: float | None = None
        self.locked_at: float | None = None
        #: Run locks found on P2 that were acquired after P1 was stopped: key -> value.
        self.locks_on_p2: dict[str, bytes] = {}
        self.marker = f"chaos-reelect-{int(time.time() * 1000)}"
        self.failed_at: float | None = None
        self._last_look = 0.0
        self._look: bool = False
        #: The step whose gate was looked at last (a cached look answers for that step only).
        self._look_for = ""

    # ------------------------------------------------------------ steps

    def steps(self) -> list[tuple[float, Callable[[], None], str]]:
        """The fault's steps, each due at once when its gate (:meth:`ready`) opens."""
        return [(0, self.cut_off, f"SIGSTOP {self.p1.name}"),
                (0, self.promoted, f"{self.p2.name} promoted"),
                (0, self.fail_over_back, f"SIGKILL {self.p2.name} + SIGCONT {self.p1.name}"),
                (0, self.elected, f"{self.p1.name} elected again"),
                (0, lambda: self.cluster.restart_lock_node(self.p2), f"start {self.p2.name} as a replica")]

    def cut_off(self) -> None:
        self.stopped_wall = time.time()
        self.p1.server.send(signal.SIGSTOP)
        self.rec("proc", name=self.p1.name, action="SIGSTOP", group=False, pid=self.p1.server.pid)

    def promoted(self) -> None:
        self.note("promoted", waited=round(time.monotonic() - self.started, 2),
                  promoted=self.promoted_at is not None, locks_on_p2=len(self.locks_on_p2))

    def fail_over_back(self) -> None:
        try:
            with self.p2.client(MARKER_DB, timeout=2.0) as client:
                client.set(self.marker, "written on the interim primary", px=120_000)
        except (redis.RedisError, OSError) as exc:
            self.note("marker", error=str(exc)[:200])
        self.p2.kill()
        self.p1.server.send(signal.SIGCONT)
        self.rec("proc", name=self.p1.name, action="SIGCONT", group=False, pid=self.p1.server.pid)
        self.failed_at = time.monotonic()

    def elected(self) -> None:
        """Record what the re-elected primary is (the evidence that the fault did what it says)."""
        named = self.named_by_all()
        role = _replication(self.p1)
        facts: dict[str, Any] = {"elected": named is self.p1, "role": role.get("role"),
                                 "replid_kept": bool(self.replid) and role.get("master_replid") == self.replid,
                                 "waited": round(time.monotonic() - (self.failed_at or self.started), 2)}
        keys = list(self.locks_on_p2)
        try:
            with self.p1.client(MARKER_DB, timeout=2.0) as client:
                facts["lacks_marker"] = not client.exists(self.marker)
            with self.p1.client(2, timeout=2.0) as client:
                values = client.mget(keys) if keys else []
        except (redis.RedisError, OSError) as exc:
            facts["error"] = str(exc)[:200]
        else:
            facts["locks_taken_on_p2"] = len(keys)
            facts["of_them_on_p1"] = sum(v == self.locks_on_p2[k] for k, v in zip(keys, values, strict=True))
        self.note("elected", **facts)

    def note(self, stage: str, **facts: Any) -> None:
        self.rec("fault-note", kind="reelect-primary", n=self.number(), stage=stage, p1=self.p1.name,
                 p2=self.p2.name, **facts)

    # ------------------------------------------------------------ gates

    def ready(self, next_step: str) -> bool:
        """Whether the step named ``next_step`` may run (its gate, or its bound, passed)."""
        now = time.monotonic()
        if next_step == self._look_for and now - self._last_look < POLL:
            return self._look
        self._last_look, self._look_for = now, next_step
        if next_step.endswith(" promoted"):
            self._look = self._promoted_and_locked(now)
        elif next_step.endswith(" elected again"):
            self._look = (self.named_by_all() is self.p1 and _replication(self.p1).get("role") == "master") \
                or now - (self.failed_at or now) > ELECTION_BOUND
        else:
            self._look = True
        return self._look

    def _promoted_and_locked(self, now: float) -> bool:
        if self.promoted_at is None:
            if self.named_by_all() is self.p2 and _replication(self.p2).get("role") == "master":
                self.promoted_at = now
            return now - self.started > PROMOTION_BOUND
        if self.locked_at is None:
            self.locks_on_p2 = self._new_locks()
            if self.locks_on_p2:
                self.locked_at = now
            return now - self.promoted_at > LOCK_BOUND
        if now - self.locked_at < self.hold:
            return False
        self.locks_on_p2 = self._new_locks() or self.locks_on_p2
        return True

    def _new_locks(self) -> dict[str, bytes]:
        """Run locks on P2 acquired after P1 was stopped (P1 lacks them)."""
        prefix = self.cluster.settings.prefix
        try:
            with self.p2.client(2, timeout=1.0) as client:
                keys = [k.decode() for k in client.scan_iter(match=f"{prefix}:*", count=1000)]
                keys = [k for k in keys if is_run_lock_key(prefix, k)]
                values = client.mget(keys) if keys else []
        except (redis.RedisError, OSError):
            return {}
        found = {}
        for key, value in zip(keys, values, strict=True):
            holder = parse_holder(value) if value is not None else None
            if holder is not None and (holder.acquired_at or 0) >= (self.stopped_wall or float("inf")):
                found[key] = value
        return found

    def named_by_all(self) -> Redis | None:
        """The lock node every answering sentinel names as primary (None: they differ, or none answers)."""
        ports = set()
        for sentinel in self.cluster.sentinels:
            try:
                with redis.Redis(host="127.0.0.1", port=sentinel.port or 0, socket_timeout=0.5) as client:
                    ports.add(master_address(client)[1])
            except (redis.RedisError, OSError, TypeError, ValueError):
                continue
        if len(ports) != 1:
            return None
        port = ports.pop()
        return next((n for n in self.cluster.lock_nodes if n.server.port == port), None)


def _replication(node: Redis) -> dict[str, Any]:
    """``INFO replication`` of ``node`` (empty when it does not answer)."""
    try:
        with node.client(0, timeout=1.0) as client:
            return dict(client.info("replication"))
    except (redis.RedisError, OSError):
        return {}

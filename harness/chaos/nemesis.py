"""The nemesis: seeded faults, one or several at once, injected into the running cluster.

Every :data:`MEAN_GAP` seconds on average (exponential) it picks a fault kind
by weight among those that apply to the variant and whose target (a process,
a server, the proxy) is not taken by a fault still going on; at most
:data:`MAX_ACTIVE` at once. Every choice (kind, target, length, parameters)
comes from one ``random.Random(seed)``: a seed replays the same draws; what a
draw lands on (which processes run, which targets are free, which pool child
exists) follows the processes' own timing, which varies from run to run.

A fault is a list of timed steps: the first injects it, the last heals it
(restart, SIGCONT, mend); each step is recorded (``fault`` events: ``inject``,
``step``, ``heal``) with the target and parameters, which is what the checker
reads to know when a beat was down or the lock Redis gone. Kinds, and what
each does (:data:`KINDS`):

* ``kill-worker``: SIGKILL of a worker's whole process group (a pod dies);
  restarted after the fault's length.
* ``kill-worker-main``: SIGKILL of a prefork worker's main process alone;
  restarted after the length. (Its pool children do not outlive it: Celery sets
  their parent-death signal to SIGKILL, so runs in them end mid-way, unacknowledged.)
* ``kill-child``: SIGKILL of one prefork pool child (the worker replaces it).
* ``stop-worker``: SIGSTOP of a worker (its group, or its main process alone),
  SIGCONT after the length.
* ``term-worker``: SIGTERM (warm shutdown, as a rolling restart); it must exit
  within the bound (else it counts as hanging, and is SIGKILLed); restarted.
* ``kill-beat`` / ``term-beat``: SIGKILL / SIGTERM of a beat; restarted after the length.
* ``restart-lock`` / ``restart-lock-empty``: the lock Redis SIGKILLed and
  started again after the length, from its append-only file or empty.
* ``pause-lock``: ``CLIENT PAUSE`` (writes, or all commands) for the length.
* ``delete-liveness``: every worker's liveness key deleted.
* ``busy-script``: another client's script loops for the length (``-BUSY`` to the others).
* ``proxy-delay`` / ``proxy-cut``: the proxied workers' lock connection delayed
  (each chunk 0.1-1.5 s late) or cut (connections dropped and refused).
* ``soft-limit``: writes paused, then a burst of submissions with a soft time
  limit of 0.05-1 s: the limit lands while their acquire waits on Redis.
* ``revoke``: writes paused, a burst submitted, then ``revoke(terminate=True,
  signal="SIGUSR1")`` of each while they wait on Redis.
* ``restart-broker``: the broker Redis (``separate`` variant) SIGKILLed and
  restarted from its append-only file.
* ``failover``: ``SENTINEL FAILOVER`` (``LOCK=sentinel``): the replica becomes the
  lock Redis's primary. (``restart-lock`` there restarts the current primary: longer
  than a second down, the sentinels promote the replica.) With ``LOCK=cluster``:
  ``CLUSTER FAILOVER`` or ``CLUSTER FAILOVER TAKEOVER`` sent to a shard's replica.
* ``reelect-primary`` (``LOCK=sentinel``): the primary P1 SIGSTOPped, its replica P2
  promoted and used (a run lock taken on it, then the length's share of up to 4 s
  more), P2 SIGKILLed as P1 gets SIGCONT: the sentinels elect P1 again before they
  make it a replica, and it serves its own older data; P2 then starts again as P1's
  replica (:mod:`.reelect`).
* ``add-node`` / ``remove-node`` / ``kill-primary`` (``LOCK=cluster``): a node added and
  slots holding run locks migrated to it; a node added earlier emptied, forgotten and
  stopped; a shard's primary SIGKILLed and failed over by the cluster (see
  :mod:`.shard_faults`). With the Cluster store, ``restart-lock`` and
  ``restart-lock-empty`` strike one primary, ``busy-script`` runs on one, ``pause-lock``
  pauses one or every primary, the bursts pause every primary's writes.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

from .cluster import Cluster
from .faults import Fault, ProcessFaults, RedisFaults, RunFaults
from .history import Recorder
from .shard_faults import ShardFaults

__all__ = ["CLUSTER_KINDS", "KINDS", "MAX_ACTIVE", "MEAN_GAP", "Nemesis", "applicable_kinds"]

#: Mean seconds between two injections, and how many faults may run at once.
MEAN_GAP = 2.0
MAX_ACTIVE = 3
#: Kinds tried before an injection is given up (their targets were taken).
PICKS = 5

#: Kind -> weight. Every kind is listed here and in :func:`applicable_kinds`.
KINDS: dict[str, int] = {
    "kill-worker": 3, "kill-worker-main": 2, "kill-child": 3, "stop-worker": 3, "term-worker": 2,
    "kill-beat": 2, "term-beat": 2, "restart-lock": 2, "restart-lock-empty": 1, "pause-lock": 3,
    "delete-liveness": 2, "busy-script": 2, "proxy-delay": 2, "proxy-cut": 2, "soft-limit": 2, "revoke": 2,
    "restart-broker": 2, "failover": 2, "reelect-primary": 2, "add-node": 3, "remove-node": 3, "kill-primary": 2,
}
#: Kinds only the Cluster lock store has.
CLUSTER_KINDS = ("add-node", "remove-node", "kill-primary")


def applicable_kinds(cluster: Cluster) -> dict[str, str]:
    """Kinds that cannot be injected in this cluster, and why (the others apply)."""
    out = {}
    if cluster.broker is cluster.lock:
        out["restart-broker"] = ("the broker is the lock Redis: restart-lock and restart-lock-empty "
                                 "restart it (and restart-lock-empty loses the broker's messages)")
    if cluster.proxy is None:
        out["proxy-delay"] = out["proxy-cut"] = (
            "the lock Redis is found through Sentinel: clients connect to the address the sentinels name, "
            "not through a proxy" if cluster.sentinels else
            "the lock store is a Redis Cluster: clients connect to the nodes the cluster names, not through "
            "a proxy" if cluster.store is not None else "no worker's lock connection goes through the proxy")
    if not cluster.sentinels and cluster.store is None:
        out["failover"] = ("the lock Redis is one server (LOCK=sentinel gives a primary, a replica and "
                           "three sentinels; LOCK=cluster three primaries with a replica each)")
    if not cluster.sentinels:
        out["reelect-primary"] = "the lock Redis has no sentinels to elect a former primary again (LOCK=sentinel)"
    if cluster.store is None:
        for kind in CLUSTER_KINDS:
            out[kind] = "the lock Redis is not a Redis Cluster (LOCK=cluster)"
    return out


class Nemesis(ProcessFaults, RedisFaults, RunFaults, ShardFaults):
    """Injects faults into ``cluster`` (see the module docstring)."""

    def __init__(self, cluster: Cluster, seed: int, rec: Recorder) -> None:
        self.cluster = cluster
        self.rng = random.Random(seed)
        self.rec = rec
        self.active: list[Fault] = []
        self.count = 0
        self.excluded = applicable_kinds(cluster)
        self.kinds = {k: w for k, w in KINDS.items() if k not in self.excluded}
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------ loop

    def run(self, seconds: float) -> None:
        """Inject faults for ``seconds``, then heal whatever is still going on."""
        end = time.monotonic() + seconds
        next_at = time.monotonic() + self.rng.expovariate(1 / MEAN_GAP)
        while time.monotonic() < end:
            self.advance()
            self.cluster.supervise(self.busy_targets())
            if time.monotonic() >= next_at:
                if len(self.active) < MAX_ACTIVE:
                    self.inject_one()
                next_at = time.monotonic() + self.rng.expovariate(1 / MEAN_GAP)
            time.sleep(0.02)
        self.heal_all()

    def advance(self, *, now: float | None = None) -> None:
        """Run the steps that are due; drop faults with none left."""
        for fault in list(self.active):
            while fault.steps and fault.ready() and fault.steps[0][0] <= (now or time.monotonic()):
                _, step, name = fault.steps.pop(0)
                self._step(fault, step, name, last=not fault.steps)
            if not fault.steps:
                self.active.remove(fault)

    def heal_all(self, timeout: float = 60.0) -> None:
        """Run every remaining step now, in order (waiting for awaited exits)."""
        deadline = time.monotonic() + timeout
        while self.active and time.monotonic() < deadline:
            self.advance(now=float("inf"))
            time.sleep(0.02)
        for thread in self._threads:
            thread.join(10)

    def _step(self, fault: Fault, step: Callable[[], None], name: str, *, last: bool) -> None:
        try:
            step()
            error = None
        except Exception as exc:  # recorded; the run goes on (the checker sees the record)
            error = f"{type(exc).__name__}: {exc}"[:300]
        self.rec("fault", n=fault.number, kind=fault.kind, action="heal" if last else "step", step=name,
                 targets=sorted(fault.targets), error=error)

    # ------------------------------------------------------------ choosing

    def busy_targets(self) -> set[str]:
        return {t for f in self.active for t in f.targets}

    def inject_one(self) -> Fault | None:
        """Pick a kind (by weight) whose target is free, and inject it; None when none fits
        (after :data:`PICKS` tries, each recorded)."""
        kinds = list(self.kinds)
        for _ in range(PICKS):
            kind = self.rng.choices(kinds, weights=[self.kinds[k] for k in kinds])[0]
            length = round(self.rng.uniform(0.3, 6.0), 2)
            build = getattr(self, "_" + kind.replace("-", "_"))
            fault: Fault | None = build(length, self.busy_targets())
            if fault is not None:
                break
            self.rec("fault-skip", kind=kind, busy=sorted(self.busy_targets()))
        else:
            return None
        self.count += 1
        fault.number = self.count
        _, first, name = fault.steps.pop(0)
        self.active.append(fault)
        try:
            first()
            error = None
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
        self.rec("fault", n=fault.number, kind=kind, action="inject", step=name, targets=sorted(fault.targets),
                 length=length, error=error, **fault.params)
        return fault

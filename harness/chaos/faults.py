"""The fault kinds of the nemesis, by what they strike: processes, the Redis servers, runs.

Each ``_<kind>(length, busy)`` method builds a :class:`Fault` (its timed steps)
for a target not in ``busy``, or returns None when none is free; the
:class:`~.nemesis.Nemesis` picks the kinds and runs the steps. What each kind
does: :mod:`.nemesis`.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from ..sentinel import MASTER_NAME
from .cluster import Cluster, Member
from .history import Recorder

__all__ = ["BUSY_SCRIPT", "LOCK", "Fault", "ProcessFaults", "RedisFaults", "RunFaults"]

#: The target name of every fault on the lock Redis (whichever node is its primary).
LOCK = "lock-redis"

#: A Lua loop that ends by itself after ARGV[1] ms (it writes nothing, so it could be killed).
BUSY_SCRIPT = """
local t = redis.call('TIME')
local start = t[1] * 1000 + t[2] / 1000
repeat t = redis.call('TIME') until t[1] * 1000 + t[2] / 1000 - start >= tonumber(ARGV[1])
return 1
"""

Step = tuple[float, Callable[[], None], str]
#: Seconds between two looks at the Cluster lock store by a fault waiting for it (each look
#: asks every node; the nemesis polls its faults every 20 ms).
POLL = 0.25


def every(seconds: float, condition: Callable[[], bool]) -> Callable[[], bool]:
    """``condition``, asked at most once every ``seconds`` (False in between)."""
    last = [float("-inf")]

    def ask() -> bool:
        now = time.monotonic()
        if now - last[0] < seconds:
            return False
        last[0] = now
        return condition()

    return ask


@dataclass
class Fault:
    """One injected fault: its remaining steps (monotonic time, what to do, name)."""

    number: int
    kind: str
    targets: frozenset[str]
    params: dict[str, Any]
    steps: list[Step] = field(default_factory=list)
    #: Polled each loop: True when the fault may go on to its next step (a SIGTERMed
    #: process's exit is awaited before its restart).
    ready: Callable[[], bool] = lambda: True


class _Builder:
    """What every fault builder uses: the cluster, the seeded choices, the history."""

    cluster: Cluster
    rng: random.Random
    rec: Recorder
    _threads: list[threading.Thread]

    def _member(self, kind: str, busy: set[str], pools: tuple[str, ...] | None = None) -> Member | None:
        """A running member of ``kind`` not taken by another fault (prefork only if asked)."""
        specs = {w.name: w for w in self.cluster.settings.workers}
        free = [m for m in self.cluster.of_kind(kind) if m.name not in busy and m.running
                and (pools is None or specs[m.name].pool in pools)]
        return self.rng.choice(free) if free else None

    def _fault(self, kind: str, targets: set[str] | frozenset[str], steps: list[tuple[float, Callable[[], None], str]],
               **params: Any) -> Fault:
        now = time.monotonic()
        return Fault(0, kind, frozenset(targets), params, [(now + at, step, name) for at, step, name in steps])

    def _thread(self, target: Callable[[], None], name: str) -> None:
        """Run ``target`` on a daemon thread (joined, bounded, by :meth:`heal_all`)."""
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _lock_clients(self, busy: set[str], *, every: bool = True) -> dict[str, redis.Redis] | None:
        """Clients of the lock Redis's primary, by node name, unless another fault holds the
        lock Redis: with the Cluster store, of every primary (``every``) or of one."""
        if LOCK in busy:
            return None
        store = self.cluster.store
        if store is None:
            lock = self.cluster.lock
            return {lock.name: lock.client(2, timeout=10)} if lock.running else None
        primaries = store.primaries()
        if not primaries:
            return None
        chosen = primaries if every else [self.rng.choice(primaries)]
        return {node.name: node.client(0, timeout=10) for node in chosen}

    def _shard_failover(self, length: float, busy: set[str], mode: str | None = None) -> Fault | None:
        raise NotImplementedError  # ShardFaults

    def _until_settled(self, fault: Fault, bound: float = 30.0) -> Fault:
        """With the Cluster lock store, the fault lasts until the cluster is whole again (every
        node up and ok, none flagged failing, every replica in sync; at most ``bound`` s after
        its last step was due): the next fault on the lock store starts from a whole cluster,
        and what this one excuses covers the time it took."""
        store = self.cluster.store
        if store is None:
            return fault
        previous = fault.ready
        healthy = every(POLL, store.healthy)

        def settled() -> bool:
            if len(fault.steps) > 1:  # the steps before: their own condition
                return previous()
            return healthy() or time.monotonic() > fault.steps[0][0] + bound

        fault.steps.append((fault.steps[-1][0], lambda: None, "cluster ok"))
        fault.ready = settled
        return fault

    def _lock_server(self) -> Any:
        """The lock server a restart strikes: the primary (with the Cluster store, one of the
        primaries, chosen)."""
        store = self.cluster.store
        primaries = store.primaries() if store is not None else []
        return self.rng.choice(primaries) if primaries else self.cluster.lock


class ProcessFaults(_Builder):
    """Workers and beats: SIGKILL (a group, a main process, a pool child), SIGSTOP, SIGTERM."""

    def _kill(self, kind: str, member_kind: str, length: float, busy: set[str], *, group: bool = True,
              pools: tuple[str, ...] | None = None) -> Fault | None:
        """SIGKILL a member (its group, or its main process alone); started again after ``length``."""
        member = self._member(member_kind, busy, pools)
        if member is None:
            return None
        return self._fault(kind, {member.name}, [
            (0, lambda: member.kill(group=group), "SIGKILL " + ("group" if group else "main")),
            (length, member.start, "restart")], target=member.name)

    def _kill_worker(self, length: float, busy: set[str]) -> Fault | None:
        return self._kill("kill-worker", "worker", length, busy)

    def _kill_worker_main(self, length: float, busy: set[str]) -> Fault | None:
        return self._kill("kill-worker-main", "worker", length, busy, group=False, pools=("prefork",))

    def _kill_child(self, length: float, busy: set[str]) -> Fault | None:
        member = self._member("worker", busy, pools=("prefork",))
        children = member.children() if member is not None else []
        if member is None or not children:
            return None
        child = self.rng.choice(sorted(children))

        def kill() -> None:
            signal_pid(child, signal.SIGKILL)

        return self._fault("kill-child", {member.name}, [(0, kill, f"SIGKILL child {child}")],
                           target=member.name, child=child)

    def _stop_worker(self, length: float, busy: set[str]) -> Fault | None:
        member = self._member("worker", busy)
        if member is None:
            return None
        group = self.rng.random() < 0.5
        return self._fault("stop-worker", {member.name}, [
            (0, lambda: member.send(signal.SIGSTOP, group=group), "SIGSTOP"),
            (length, lambda: member.send(signal.SIGCONT, group=group), "SIGCONT")],
            target=member.name, group=group)

    def _terminate(self, kind: str, member: Member, length: float) -> Fault:
        """SIGTERM ``member``; await its exit (bounded: past it, a hang, SIGKILLed); restart."""
        bound = self.cluster.settings.term_bound[member.kind]
        sent: list[float] = []

        def term() -> None:
            sent.append(time.monotonic())
            member.send(signal.SIGTERM)

        def exited() -> bool:
            if not sent:
                return True
            code = member.process.returncode
            waited = time.monotonic() - sent[0]
            if code is None and waited < bound:
                return False
            if code is None:  # hangs: recorded, its stacks logged, then killed so that the run goes on
                self.rec("term", name=member.name, pid=member.pid, sent=sent[0], exited=None, bound=bound)
                member.dump_stacks()
                member.kill(group=True)
            else:
                self.rec("term", name=member.name, pid=member.pid, sent=sent[0], exited=time.monotonic(),
                         code=code, bound=bound)
                self.rec("proc", name=member.name, action="exit", pid=member.pid, code=code)
            sent.clear()
            return True

        fault = self._fault(kind, {member.name}, [(0, term, "SIGTERM"), (length, member.start, "restart")],
                            target=member.name)
        fault.ready = exited
        return fault

    def _term_worker(self, length: float, busy: set[str]) -> Fault | None:
        member = self._member("worker", busy)
        return None if member is None else self._terminate("term-worker", member, length)

    def _kill_beat(self, length: float, busy: set[str]) -> Fault | None:
        return self._kill("kill-beat", "beat", length, busy)

    def _term_beat(self, length: float, busy: set[str]) -> Fault | None:
        member = self._member("beat", busy)
        return None if member is None else self._terminate("term-beat", member, length)


class RedisFaults(_Builder):
    """The lock Redis and the broker: restarts, pauses, lost keys, busy scripts, failovers."""

    def _restart(self, kind: str, server: Any, length: float, busy: set[str], wipe: bool,
                 target: str | None = None) -> Fault | None:
        target = target or server.name
        if target in busy or not server.running:
            return None
        length = round(min(length, 3.0) * self.rng.random(), 2)

        def down() -> None:
            server.kill()
            if wipe:
                server.wipe()

        fault = self._fault(kind, {target}, [(0, down, "SIGKILL" + (" + wipe" if wipe else "")),
                                             (length, lambda: self._start_again(server), "start")],
                            server=server.name, down=length)
        if wipe and self.cluster.sentinels:
            # A primary without its data must not come back as a primary (Redis's own rule
            # for Sentinel: no automatic restart of a master without persistence): it starts
            # again once the sentinels named another primary, as its replica.
            began = time.monotonic()
            fault.ready = lambda: (self.cluster.named_primary() not in (server, None)
                                   or time.monotonic() - began > 15.0)
        if server not in self.cluster.lock_nodes:
            return fault
        return self._until_settled(self._until_replicated(fault))

    def _start_again(self, server: Any) -> None:
        if server in self.cluster.lock_nodes:
            self.cluster.restart_lock_node(server)
        else:
            server.start()

    def _restart_lock(self, length: float, busy: set[str]) -> Fault | None:
        if LOCK in busy:
            return None
        return self._restart("restart-lock", self._lock_server(), length, busy, wipe=False, target=LOCK)

    def _restart_lock_empty(self, length: float, busy: set[str]) -> Fault | None:
        if LOCK in busy:
            return None
        return self._restart("restart-lock-empty", self._lock_server(), length, busy, wipe=True, target=LOCK)

    def _restart_broker(self, length: float, busy: set[str]) -> Fault | None:
        return self._restart("restart-broker", self.cluster.broker, length, busy, wipe=False)

    def _pause_lock(self, length: float, busy: set[str]) -> Fault | None:
        # With the Cluster store: every primary, or one (a shard paused).
        clients = self._lock_clients(busy, every=self.cluster.store is None or self.rng.random() < 0.5)
        if clients is None:
            return None
        length = round(min(length, 3.0), 2)
        mode = self.rng.choice(["WRITE", "ALL"])

        def pause() -> None:
            for client in clients.values():
                client.execute_command("CLIENT", "PAUSE", int(length * 1000), mode)

        return self._fault("pause-lock", {LOCK}, [
            (0, pause, f"CLIENT PAUSE {mode}"), (length + 0.05, lambda: _close(clients), "pause over")],
            mode=mode, servers=sorted(clients))

    def _delete_liveness(self, length: float, busy: set[str]) -> Fault | None:
        clients = self._lock_clients(busy)
        if clients is None:
            return None

        def delete() -> None:
            for client in clients.values():
                pipe = client.pipeline(transaction=False)
                for key in client.scan_iter(f"{self.cluster.settings.prefix}:live:*"):
                    pipe.delete(key)  # one a command: a Cluster node refuses a DEL across hash slots
                pipe.execute()
            _close(clients)

        return self._fault("delete-liveness", {LOCK}, [(0, delete, "DEL live keys")])

    def _busy_script(self, length: float, busy: set[str]) -> Fault | None:
        clients = self._lock_clients(busy, every=False)
        if clients is None:
            return None
        (server, client), = clients.items()
        length = round(min(length, 2.5), 2)

        def loop() -> None:
            try:
                client.eval(BUSY_SCRIPT, 0, int(length * 1000))
            except redis.RedisError as exc:  # the server restarted meanwhile: recorded
                self.rec("fault-note", kind="busy-script", error=str(exc)[:200])
            finally:
                client.close()

        thread = threading.Thread(target=loop, name="busy-script", daemon=True)
        self._threads.append(thread)
        return self._fault("busy-script", {LOCK}, [
            (0, thread.start, "EVAL busy loop"), (length + 0.2, lambda: thread.join(15), "script over")],
            server=server)

    def _failover(self, length: float, busy: set[str]) -> Fault | None:
        if self.cluster.store is not None:
            return self._shard_failover(length, busy)
        if LOCK in busy or not self.cluster.sentinels:
            return None
        sentinel = self.rng.choice(self.cluster.sentinels)
        old = self.cluster.lock.name

        def failover() -> None:
            with redis.Redis(host="127.0.0.1", port=sentinel.port or 0, socket_timeout=5) as client:
                client.execute_command("SENTINEL", "FAILOVER", MASTER_NAME)

        def settled() -> None:
            self.rec("fault-note", kind="failover", primary_before=old, primary_after=self.cluster.lock.name)

        fault = self._fault("failover", {LOCK}, [(0, failover, f"SENTINEL FAILOVER via {sentinel.name}"),
                                                 (max(length, 3.0), settled, "settled")], primary=old)
        return self._until_replicated(fault)

    def _reelect_primary(self, length: float, busy: set[str]) -> Fault | None:
        """P1 stopped, P2 promoted and used, P2 killed and P1 resumed: the sentinels elect
        P1 again before making it a replica (see :mod:`.reelect`)."""
        if LOCK in busy or not self.cluster.sentinels or not all(n.running for n in self.cluster.lock_nodes):
            return None
        try:
            with self.cluster.lock.client(0, timeout=1.0) as client:
                online = int(client.info("replication").get("connected_slaves", 0))
        except (redis.RedisError, OSError):
            return None
        if online < 1:  # the replica is not following yet: nothing to promote
            return None
        from .reelect import Reelection

        hold = round(min(length, 4.0) * self.rng.random(), 2)
        fault = self._fault("reelect-primary", {LOCK}, [], primary=self.cluster.lock.name, hold=hold)
        plan = Reelection(self.cluster, self.rec, lambda: fault.number, hold)
        fault.steps = [(fault_time(at), step, name) for at, step, name in plan.steps()]
        fault.ready = lambda: not fault.steps or plan.ready(fault.steps[0][2])
        fault.params.update(primary=plan.p1.name, replica=plan.p2.name)
        return self._until_replicated(fault)

    def _until_replicated(self, fault: Fault) -> Fault:
        """With ``singleton_wait_replicas``, the lock Redis takes no lock until its primary has
        that many replicas again: the fault lasts until then (at most 60 s more), so that
        what it excuses (beat slots not claimed) covers it."""
        wanted = self.cluster.settings.wait_replicas
        if wanted <= 0 or not self.cluster.sentinels:
            return fault
        previous = fault.ready

        def replicated() -> bool:
            if len(fault.steps) > 1:  # the steps before: their own condition
                return previous()
            if time.monotonic() > fault.steps[0][0] + 60.0:
                return True
            try:
                with self.cluster.lock.client(0, timeout=1.0) as client:
                    return int(client.info("replication").get("connected_slaves", 0)) >= wanted
            except (redis.RedisError, OSError):
                return False

        fault.steps.append((fault.steps[-1][0], lambda: None, "replicated"))
        fault.ready = replicated
        return fault


class RunFaults(_Builder):
    """The runs' own path: the proxied lock connection, and signals while runs wait on Redis."""

    def _proxy_delay(self, length: float, busy: set[str]) -> Fault | None:
        proxy = self.cluster.proxy
        if proxy is None or "proxy" in busy:
            return None
        delay = round(self.rng.uniform(0.1, 1.5), 2)

        def slow() -> None:
            proxy.delay = delay

        def fast() -> None:
            proxy.delay = 0.0

        return self._fault("proxy-delay", {"proxy"}, [(0, slow, f"delay {delay}s"), (length, fast, "no delay")],
                           delay=delay)

    def _proxy_cut(self, length: float, busy: set[str]) -> Fault | None:
        proxy = self.cluster.proxy
        if proxy is None or "proxy" in busy:
            return None
        return self._fault("proxy-cut", {"proxy"}, [(0, proxy.cut, "cut"), (min(length, 4.0), proxy.mend, "mend")])

    def _burst(self, kind: str, length: float, busy: set[str], options: Callable[[], dict[str, Any]],
               after: Callable[[list[str]], None] | None = None) -> Fault | None:
        """Pause the lock Redis's writes, submit a burst (each with ``options()``) while
        they wait on it; ``after`` gets their ids a moment later (still paused).

        Publishing and revoking go through the broker, which another fault may have
        stopped: they run on threads of their own, so the nemesis never waits for them.
        """
        clients = self._lock_clients(busy)
        if clients is None:
            return None
        from .submitter import length as run_length
        from .submitter import submit

        pause = round(self.rng.uniform(0.8, 2.5), 2)
        plan = [(self.rng.choice(self.cluster.settings.keys), run_length(self.rng), options())
                for _ in range(self.rng.randint(2, 5))]
        ids: list[str] = []

        def publish() -> None:
            for key, seconds, extra in plan:
                task_id = submit(key, seconds, kind, **extra)
                if task_id is not None:
                    ids.append(task_id)

        def start() -> None:
            for client in clients.values():
                client.execute_command("CLIENT", "PAUSE", int(pause * 1000), "WRITE")
            self._thread(publish, f"{kind}-publish")

        steps: list[tuple[float, Callable[[], None], str]] = [(0, start, f"CLIENT PAUSE WRITE {pause}s + burst")]
        if after is not None:
            act = after
            steps.append((round(self.rng.uniform(0.2, pause * 0.8), 2),
                          lambda: self._thread(lambda: act(list(ids)), f"{kind}-act"), "act"))
        steps.append((pause + 0.05, lambda: _close(clients), "pause over"))
        return self._fault(kind, {LOCK}, steps, pause=pause, burst=len(plan))

    def _soft_limit(self, length: float, busy: set[str]) -> Fault | None:
        return self._burst("soft-limit", length, busy,
                           lambda: {"soft_time_limit": round(self.rng.uniform(0.05, 1.0), 2)})

    def _revoke(self, length: float, busy: set[str]) -> Fault | None:
        from .app import app

        def revoke(ids: list[str]) -> None:
            if ids:
                app.control.revoke(ids, terminate=True, signal="SIGUSR1")
                self.rec("revoke", ids=ids)

        return self._burst("revoke", length, busy, dict, after=revoke)


def fault_time(at: float) -> float:
    """A step ``at`` seconds from now, on the clock the nemesis runs steps by."""
    return time.monotonic() + at


def _close(clients: dict[str, redis.Redis]) -> None:
    for client in clients.values():
        client.close()


def signal_pid(pid: int, signum: int) -> None:
    """Send ``signum`` to ``pid`` if it still exists."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)

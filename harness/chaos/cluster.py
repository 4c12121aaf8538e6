"""The cluster under test: real servers and processes on loopback, started and restarted at will.

* Redis servers with an append-only file synced on every write
  (``appendfsync always``): a SIGKILLed server restarted from it keeps every
  write it acknowledged. The lock Redis and the broker (with the result
  backend) are two servers in the ``separate`` variant, one in ``same``
  (broker db 0, results db 1, locks db 2). The lock Redis answers ``-BUSY``
  after 100 ms of another client's script (``busy-reply-threshold``).
* A :class:`~harness.proxy.DelayProxy` in front of the lock Redis, used as the
  lock URL of the workers marked ``proxied``: the nemesis delays or cuts it.
* Workers (``celery worker``, each pool and size of :data:`WORKERS`), beats
  (``celery beat -S singleton``, a schedule file each) and the submitter, each
  a :class:`~harness.processes.ChildProcess` (own process group, dies with the
  controller), its output in ``logs/``; a restart starts the same command again
  as a new incarnation, and the process groups of earlier ones are swept at the end.

Every start, exit and signal is recorded in the controller's history.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from ..processes import ChildProcess, group_alive, signal_group
from ..proxy import DelayProxy
from ..redis_server import RedisServerProcess, find_redis_server
from ..sentinel import MASTER_NAME, group_ready, master_address, sentinel_args
from ..waiting import wait_until
from .history import ENV_DIR, ENV_WHO, Recorder
from .redis_node import Redis

if TYPE_CHECKING:
    from .shards import LockCluster

__all__ = ["WORKERS", "Cluster", "Member", "Settings", "WorkerSpec"]

ROOT = Path(__file__).resolve().parents[2]
APP = "harness.chaos.app"


@dataclass(frozen=True)
class WorkerSpec:
    """One worker: its pool, its size, and whether its lock connection goes through the proxy."""

    name: str
    pool: str
    concurrency: int
    proxied: bool = False


#: Two prefork workers (one behind the proxy) and a threads one.
WORKERS = (WorkerSpec("w1", "prefork", 2), WorkerSpec("w2", "threads", 3), WorkerSpec("w3", "prefork", 2, True))


@dataclass
class Settings:
    """What a run is made of (written to the history's ``meta.json``)."""

    variant: str = "separate"
    #: The lock Redis: one server (``standalone``), a primary, a replica and three
    #: sentinels (``sentinel``), or a Redis Cluster of three primaries with a replica each
    #: (``cluster``, :mod:`.shards`); the last two with a broker of their own only.
    lock: str = "standalone"
    seed: int = 1
    #: ``singleton_wait_replicas``: replicas that must acknowledge a lock or a slot claim.
    wait_replicas: int = 0
    lock_ttl: float = 4.0
    liveness_ttl: float = 2.0
    visibility: float = 12.0
    pending_lease: float = 2.0
    prefix: str = "chaos"
    keys: tuple[str, ...] = ("k0", "k1", "k2", "k3", "k4")
    #: Mean seconds between two submissions.
    rate: float = 0.3
    broken: bool = False
    workers: tuple[WorkerSpec, ...] = WORKERS
    beats: tuple[str, ...] = ("b1", "b2")
    #: Seconds a SIGTERMed process may take to exit before it counts as hanging.
    term_bound: dict[str, float] = field(default_factory=lambda: {"beat": 15.0, "worker": 30.0})


class Member:
    """One process of the cluster (a worker, a beat, the submitter), restartable."""

    def __init__(self, name: str, kind: str, argv: list[str], env: dict[str, str], logs: Path,
                 rec: Recorder) -> None:
        self.name = name
        self.kind = kind
        self.process = ChildProcess(name, argv, env=env, cwd=ROOT, log=logs / f"{name}.log")
        self.rec = rec
        #: Process groups of earlier incarnations (pool children may outlive their main process).
        self.old_groups: list[int] = []
        self.starts = 0

    @property
    def running(self) -> bool:
        return self.process.running

    @property
    def pid(self) -> int:
        return self.process.pid

    def start(self) -> None:
        """Start a new incarnation (the last one must have exited)."""
        if self.process.process is not None:
            self.process.process.poll()
            self.old_groups.append(self.process.pid)
        self.process.start()
        self.starts += 1
        self.rec("proc", name=self.name, action="start", pid=self.pid, incarnation=self.starts)

    def send(self, signum: int, *, group: bool = False) -> None:
        """Send ``signum`` to the main process (or its whole group) and record it."""
        if not self.running:
            return
        if group:
            signal_group(self.pid, signum)
        else:
            self.process.send(signum)
        self.rec("proc", name=self.name, action=signal.Signals(signum).name, group=group, pid=self.pid)

    def kill(self, *, group: bool = True) -> None:
        """SIGKILL the main process (or the whole group, as a pod dies) and reap it."""
        if not self.running or self.process.process is None:
            return
        self.send(signal.SIGKILL, group=group)
        code = self.process.process.wait()
        self.rec("proc", name=self.name, action="exit", pid=self.pid, code=code)

    def dump_stacks(self, bound: float = 3.0) -> None:
        """Before a hung worker is killed: SIGUSR1 makes Celery's worker log the stack of every
        thread of its main process (its "cry" handler), which says where it hangs. Waits,
        at most ``bound`` seconds, until its log stops growing."""
        if self.kind != "worker" or not self.running:
            return
        log = self.process.log
        before = log.stat().st_size if log.exists() else 0
        self.send(signal.SIGUSR1)
        deadline, size = time.monotonic() + bound, before
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = log.stat().st_size if log.exists() else 0
            if now == size and size > before:
                break
            size = now
        self._dump_children(log)

    def _dump_children(self, log: Path) -> None:
        """The pool processes' stacks too, where ``py-spy`` is installed (Celery's handler shows
        only the main process, which may be waiting for a child that does not exit)."""
        spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
        if spy is None:
            return
        for pid in self.children():
            try:
                out = subprocess.run([spy, "dump", "--locals", "--pid", str(pid)], capture_output=True,
                                     text=True, timeout=20)
            except (OSError, subprocess.SubprocessError) as exc:
                text = f"py-spy dump of pool process {pid} failed: {exc}\n"
            else:
                text = f"py-spy dump of pool process {pid}:\n{out.stdout}{out.stderr}\n"
            with log.open("a") as stream:
                stream.write(text)

    def children(self) -> list[int]:
        """Pids of the main process's children (a prefork pool)."""
        if not self.running:
            return []
        try:
            text = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def sweep(self) -> None:
        """SIGKILL this member's process groups, the current and earlier ones."""
        if self.process.process is not None and self.running:
            self.kill(group=True)
        for pgid in [*self.old_groups, *([self.pid] if self.process.process is not None else [])]:
            signal_group(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(group_alive(g) for g in self.old_groups) and time.monotonic() < deadline:
            time.sleep(0.05)


class Cluster:
    """Every server and process of a run, and how to reach them."""

    def __init__(self, settings: Settings, run_dir: Path, rec: Recorder) -> None:
        self.settings = settings
        self.run_dir = run_dir
        self.rec = rec
        self.history_dir = run_dir / "history"
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        busy = {"busy-reply-threshold": "100"}
        #: The Redis Cluster lock store (``lock="cluster"``), else None.
        self.store: LockCluster | None = None
        if settings.lock in ("sentinel", "cluster") and settings.variant == "same":
            raise ValueError(f"the {settings.lock} lock store needs a broker of its own (variant separate)")
        if settings.lock == "cluster":
            from .shards import LockCluster

            if settings.wait_replicas:
                raise ValueError("singleton_wait_replicas with the cluster lock store: a node the nemesis adds "
                                 "has no replica, so its locks could never be acknowledged")
            self.store = LockCluster(run_dir, rec, busy)
            self.lock_nodes = self.store.nodes  # the same list: nodes added later are in it
        elif settings.lock == "sentinel":
            first = Redis("lock-a", run_dir / "lock-a", rec, busy, with_file=True)
            self.lock_nodes = [first]
        else:
            self.lock_nodes = [Redis("lock-redis", run_dir / "lock-redis", rec, busy)]
        self.sentinels: list[RedisServerProcess] = []
        self.broker = self.lock_nodes[0] if settings.variant == "same" else \
            Redis("broker-redis", run_dir / "broker-redis", rec)
        self.proxy: DelayProxy | None = None
        self.members: dict[str, Member] = {}

    # ------------------------------------------------------------ addresses

    @property
    def lock(self) -> Redis:
        """The lock Redis: its current primary, as the sentinels name it (else the first node up);
        with the Cluster store, a primary serving slots (else its first node)."""
        if self.store is not None:
            return next(iter(self.store.primaries()), self.lock_nodes[0])
        if not self.sentinels:
            return self.lock_nodes[0]
        named = self.named_primary()
        return named or next((n for n in self.lock_nodes if n.running), self.lock_nodes[0])

    def named_primary(self) -> Redis | None:
        """The lock node the sentinels name as primary (None: no sentinel answers)."""
        for sentinel in self.sentinels:
            try:
                with redis.Redis(host="127.0.0.1", port=sentinel.port or 0, socket_timeout=1.0) as client:
                    _, port = master_address(client)
            except (redis.RedisError, OSError, TypeError, ValueError):
                continue
            return next((n for n in self.lock_nodes if n.server.port == port), None)
        return None

    def restart_lock_node(self, node: Redis) -> None:
        """Start a stopped lock node again; with sentinels, as a replica of the primary they name."""
        if self.sentinels:
            primary = self.named_primary()
            node.follow(primary.port if primary is not None and primary is not node else None)
        node.start()

    @property
    def lock_url(self) -> str:
        """The lock Redis's URL as the cluster's processes use it (database 2; 0 on Cluster)."""
        if self.store is not None:
            return self.store.url
        if not self.sentinels:
            return self.lock.url(2)
        hosts = ";".join(f"sentinel://127.0.0.1:{s.port}{'/2' if i == 0 else ''}" for i, s in enumerate(self.sentinels))
        return f"{hosts}?master_name={MASTER_NAME}"

    def env(self, who: str, **extra: str) -> dict[str, str]:
        """The environment of a cluster process (see :mod:`.app`)."""
        s = self.settings
        env = dict(os.environ)
        env.update({
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
            "CHAOS_BROKER": self.broker.url(0), "CHAOS_BACKEND": self.broker.url(1), "CHAOS_LOCK": self.lock_url,
            "CHAOS_LOCK_TTL": str(s.lock_ttl), "CHAOS_LIVENESS_TTL": str(s.liveness_ttl),
            "CHAOS_VISIBILITY": str(s.visibility), "CHAOS_PENDING_LEASE": str(s.pending_lease),
            "CHAOS_PREFIX": s.prefix, "CHAOS_BROKEN": "1" if s.broken else "",
            "CHAOS_WAIT_REPLICAS": str(s.wait_replicas),
            ENV_DIR: str(self.history_dir), ENV_WHO: who,
        })
        env.update(extra)
        return env

    # ------------------------------------------------------------ start

    def start_servers(self) -> None:
        if self.store is not None:
            self.store.start()
            self.broker.start()
            return
        self.lock.start()
        if self.settings.lock == "sentinel":
            self._start_sentinels()
        if self.broker is not self.lock:
            self.broker.start()
        if not self.sentinels and any(w.proxied for w in self.settings.workers):
            self.proxy = DelayProxy(self.lock.port, 0.0, log=self.logs / "proxy.log", name="lock-proxy").start()

    def _start_sentinels(self) -> None:
        """A replica of the first lock node, and three sentinels watching them (quorum 2, a
        silent primary is down after 1 s)."""
        primary = self.lock_nodes[0]
        replica = Redis("lock-b", self.run_dir / "lock-b", self.rec, {"busy-reply-threshold": "100"},
                        replica_of=primary.port, with_file=True)
        replica.start()
        self.lock_nodes.append(replica)
        found = find_redis_server()
        assert found is not None
        for index in range(3):
            workdir = self.run_dir / f"sentinel{index}"

            def args_for(port: int, workdir: Path = workdir) -> list[str]:
                workdir.mkdir(parents=True, exist_ok=True)
                return sentinel_args(workdir / "sentinel.conf", port, primary.port, down_after_ms=1000,
                                     failover_timeout_ms=5000)

            sentinel = RedisServerProcess(f"sentinel{index}", found[0], args_for, workdir=workdir)
            sentinel.start()
            self.rec("proc", name=sentinel.name, action="start", pid=sentinel.pid, port=sentinel.port)
            self.sentinels.append(sentinel)

        def ready() -> bool:
            clients = [redis.Redis(host="127.0.0.1", port=s.port or 0, socket_timeout=2, decode_responses=True)
                       for s in self.sentinels]
            try:
                return group_ready(clients, lambda: self.lock.client(0, 2.0))
            except (redis.RedisError, OSError):
                return False
            finally:
                for client in clients:
                    client.close()

        wait_until(ready, 60.0, "the sentinels, the lock primary and its replica", interval=0.2)

    def add_members(self) -> None:
        """Define the workers, beats and the submitter (nothing started yet)."""
        celery = [sys.executable, "-m", "celery", "-A", APP]
        for spec in self.settings.workers:
            extra = {}
            if spec.proxied and self.proxy is not None:
                extra["CHAOS_LOCK"] = self.proxy.url(2)
            self.members[spec.name] = Member(
                spec.name, "worker",
                [*celery, "worker", "-P", spec.pool, "-c", str(spec.concurrency), "-n", f"{spec.name}@%h",
                 "-Q", "chaos", "-l", "info", "-E", "--without-gossip", "--without-mingle", "--without-heartbeat"],
                self.env(f"worker-{spec.name}", **extra), self.logs, self.rec)
        state = self.run_dir / "beat-state"
        state.mkdir(exist_ok=True)
        for name in self.settings.beats:
            self.members[name] = Member(
                name, "beat", [*celery, "beat", "-S", "singleton", "-s", str(state / f"{name}-schedule"), "-l", "info"],
                self.env(f"beat-{name}"), self.logs, self.rec)
        self.members["submitter"] = Member(
            "submitter", "submitter", [sys.executable, "-m", "harness.chaos.submitter"],
            self.env("submitter", CHAOS_KEYS=",".join(self.settings.keys), CHAOS_SEED=str(self.settings.seed),
                     CHAOS_RATE=str(self.settings.rate)), self.logs, self.rec)

    def supervise(self, busy: set[str], kinds: tuple[str, ...] = ("worker", "beat", "submitter")) -> None:
        """Start again a member that exited while no fault held it, as a pod's supervisor
        would; recorded as a ``crash`` with the end of its log (why it exited)."""
        for member in self.members.values():
            if member.kind not in kinds or member.name in busy or member.process.process is None or member.running:
                continue
            lines = member.process.output().splitlines()
            reason = next((line for line in reversed(lines) if "CRITICAL" in line or "Error" in line), lines[-1:])
            self.rec("proc", name=member.name, action="crash", pid=member.pid, code=member.process.returncode,
                     reason=str(reason)[:300])
            member.start()

    def of_kind(self, kind: str) -> list[Member]:
        return [m for m in self.members.values() if m.kind == kind]

    def wait_ready(self, members: list[Member], timeout: float = 120.0) -> None:
        """Wait until each worker printed ``ready.`` and each beat started its scheduler."""
        for member in members:
            text = {"worker": "ready.", "beat": "beat: Starting..."}.get(member.kind)
            if text is not None:
                member.process.wait_for_output(text, timeout)

    def client(self, timeout: float = 5.0) -> redis.Redis:
        """A client of the lock database (the controller's own: nemesis, key scans)."""
        return self.lock.client(2, timeout)

    def lock_clients(self, timeout: float = 5.0) -> list[redis.Redis]:
        """Clients of the lock data, every key in one of them: the lock database, or each
        primary of the Cluster store."""
        if self.store is None:
            return [self.client(timeout)]
        return [node.client(0, timeout) for node in self.store.primaries()]

    def close(self) -> None:
        """Stop everything (SIGKILL) and sweep every process group ever started."""
        for member in self.members.values():
            member.sweep()
        if self.proxy is not None:
            self.proxy.close()
        for server in {id(s): s for s in (*self.lock_nodes, self.broker)}.values():
            server.server.stop(timeout=5)
        for sentinel in self.sentinels:
            sentinel.stop(timeout=5)

    def describe(self) -> dict[str, Any]:
        """Ports and URLs, for ``meta.json``."""
        return {"lock": self.lock_url, "lock nodes": [n.name for n in self.lock_nodes],
                "broker": self.broker.url(0), "backend": self.broker.url(1),
                "proxy": self.proxy.url(2) if self.proxy is not None else None,
                "workers": [vars(w) for w in self.settings.workers], "beats": list(self.settings.beats)}

"""Real Redis topologies on loopback for the deployment tests.

Each topology is made of ``redis-server`` processes the tests start themselves
(no Docker): a TLS server with a certificate made on the spot with ``openssl``,
a server with ACL users, a 3-primary Redis Cluster (``redis-cli --cluster
create``), and a primary + replica watched by 3 sentinels (``redis-server
--sentinel``, so no separate ``redis-sentinel`` binary is needed).

Every server is a :class:`harness.redis_server.RedisServerProcess`: accepted
only once the server on its port reports our child's pid, moved to a new port
if another program took it. A :class:`Topology` is what the tests see: the
URL a Celery app puts in ``singleton_redis_url``, an unrestricted client to
look at keys, and how to flush and stop it (``close()`` stops every server
and removes the directory).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.sentinel import Sentinel

from celery_singleton_beat.connection.client import RedisClient, redis_from_url
from celery_singleton_beat.recovery.server import LockServer
from celery_singleton_beat.recovery.window import mark_in_use
from harness.redis_cluster import cluster_nodes
from harness.redis_server import RedisServerProcess, free_port, probe_options
from harness.sentinel import MASTER_NAME, group_ready, master_address, sentinel_args

from .owners import register
from .paths import scratch
from .servers import keep_server_records, redis_server_binary, server_records
from .skips import require
from .waiting import wait_for

__all__ = [
    "ACL_PASSWORD", "ACL_USER", "MASTER_NAME", "Certificate", "SentinelGroup", "ServerProcess",
    "Topology", "add_cluster_node", "cluster_shard", "make_certificate", "set_acl_user", "start_acl",
    "start_cluster", "start_sentinels", "start_tls", "wait_for_new_primary",
]

class ServerProcess(RedisServerProcess):
    """One ``redis-server`` (or sentinel) of a topology, with its log in the topology's directory."""

    error = AssertionError

    def __init__(self, name: str, args_for: Callable[[int], list[str]], workdir: Path,
                 connect: Callable[[int], redis.Redis] | None = None) -> None:
        super().__init__(name, redis_server_binary(), args_for, workdir=workdir, connect=connect)

    def start(self, timeout: float = 20.0) -> ServerProcess:
        register(self)  # before anything can fail
        super().start(timeout)
        return self

    @property
    def alive(self) -> bool:
        return self.running

    def client(self) -> redis.Redis:
        """A client of this server, with the probe's settings (TLS files, password)."""
        assert self.port is not None, f"{self.name} was never started"
        return self.connect(self.port)

    def close(self) -> None:
        self.stop(timeout=10)


def _server_args(*extra: str) -> Callable[[int], list[str]]:
    # No persistence; full syncs start at once (the default waits 5 s for more replicas).
    def args_for(port: int) -> list[str]:
        return ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--repl-diskless-sync-delay", "0", "--dir", ".", *extra]

    return args_for


def _probe(**kwargs: Any) -> Callable[[int], redis.Redis]:
    return lambda port: redis.Redis(host="127.0.0.1", port=port, **{**probe_options(), **kwargs})


@dataclass
class Topology:
    """A running topology, as the tests use it."""

    name: str
    #: ``singleton_redis_url``: credentials, TLS files and Sentinel's master name included,
    #: so that a worker process gets everything from one environment variable.
    url: str
    #: An unrestricted client (admin user) to look at keys.
    admin: RedisClient
    #: Replicas behind each primary (what ``WAIT`` can count).
    replicas: int
    servers: list[ServerProcess]
    workdir: Path

    def flush(self) -> None:
        """Delete every key (on every primary) but the records of the server serving the
        lock data, written for the default prefix if missing (see ``servers.server_records``),
        and forget loaded scripts."""
        for node in self.primaries():
            kept = server_records(node)
            node.flushall()
            keep_server_records(node, kept)
            mark_in_use(node)
            node.script_flush()

    def primaries(self) -> list[redis.Redis]:
        if isinstance(self.admin, RedisCluster):
            return [self.admin.get_redis_connection(n) for n in self.admin.get_primaries()]
        return [self.admin]

    def stop(self) -> None:
        self.admin.close()
        for server in reversed(self.servers):
            server.stop(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)

    close = stop


def _stop_all(servers: list[ServerProcess]) -> None:
    for server in reversed(servers):
        server.stop(timeout=10)


# -------------------------------------------------------------------- TLS


@dataclass(frozen=True)
class Certificate:
    """A self-signed certificate for 127.0.0.1, used as CA, server and client certificate."""

    cert: Path
    key: Path


def make_certificate(directory: Path) -> Certificate:
    """A fresh EC key and self-signed certificate (SAN ``IP:127.0.0.1``, ``DNS:localhost``)."""
    openssl = require("openssl")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "2", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    return Certificate(cert, key)


def start_tls() -> Topology:
    """A redis-server that speaks TLS only and requires client certificates (mutual TLS)."""
    workdir = scratch("tls")
    tls = make_certificate(workdir)
    files = {"ssl_ca_certs": str(tls.cert), "ssl_certfile": str(tls.cert), "ssl_keyfile": str(tls.key)}

    def args_for(port: int) -> list[str]:
        return _server_args("--tls-port", str(port), "--tls-cert-file", str(tls.cert),
                            "--tls-key-file", str(tls.key), "--tls-ca-cert-file", str(tls.cert),
                            "--tls-auth-clients", "yes")(0)

    server = ServerProcess("tls", args_for, workdir, _probe(ssl=True, **files)).start()
    url = f"rediss://127.0.0.1:{server.port}/0?" + urlencode(files, quote_via=quote)
    admin = redis.Redis(host="127.0.0.1", port=server.port, ssl=True, socket_timeout=10, **files)
    return Topology("tls", url, admin, 0, [server], workdir)


# -------------------------------------------------------------------- ACL


ACL_USER, ACL_PASSWORD = "singleton-app", "s3cret-app"


def start_acl(rules: list[str]) -> Topology:
    """A redis-server with an ACL user limited to ``rules``; the default user is the admin."""
    workdir = scratch("acl")
    server = ServerProcess("acl", _server_args(), workdir).start()
    admin = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=10)
    set_acl_user(admin, rules)
    url = f"redis://{ACL_USER}:{ACL_PASSWORD}@127.0.0.1:{server.port}/0"
    return Topology("acl", url, admin, 0, [server], workdir)


def set_acl_user(server: redis.Redis, rules: list[str]) -> None:
    """(Re)define the test's ACL user on one server with exactly ``rules``."""
    server.execute_command("ACL", "SETUSER", ACL_USER, "reset", "on", f">{ACL_PASSWORD}", *rules)


# -------------------------------------------------------------------- Cluster


def _cluster_node_args(port: int) -> list[str]:
    # An explicit bus port: port + 10000 may not exist or be free.
    return _server_args("--cluster-enabled", "yes", "--cluster-port", str(free_port()),
                        "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "5000")(port)


def start_cluster(primaries: int = 3, replicas: int = 0) -> Topology:
    """``primaries`` cluster-enabled servers joined by ``redis-cli --cluster create``, each with
    ``replicas`` replicas (in sync when this returns)."""
    redis_cli = require("redis-cli")
    workdir = scratch("cluster")
    servers: list[ServerProcess] = []
    total = primaries * (1 + replicas)

    try:
        for index in range(total):
            servers.append(ServerProcess(f"node{index}", _cluster_node_args, workdir / f"node{index}").start())
        subprocess.run(
            [redis_cli, "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in servers),
             "--cluster-replicas", str(replicas), "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )

        def converged() -> bool:
            for server in servers:
                with server.client() as client:
                    info = client.cluster("info")
                    if info.get("cluster_state") != "ok" or int(info.get("cluster_known_nodes", 0)) != total:
                        return False
                    role = client.info("replication")
                    if role.get("role") == "slave" and role.get("master_link_status") != "up":
                        return False
                    nodes = client.execute_command("CLUSTER", "NODES").decode()
                    if sum("slave" in line.split()[2] for line in nodes.splitlines()) != primaries * replicas:
                        return False
            return True

        wait_for(converged, timeout=30, message="cluster state ok on every node, every node sees every replica")
    except BaseException:
        _stop_all(servers)
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    nodes = ",".join(f"127.0.0.1:{s.port}" for s in servers[:2])  # discovery finds the others
    admin = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", s.port) for s in servers], socket_timeout=10)
    return Topology("cluster", f"redis+cluster://{nodes}", admin, replicas, servers, workdir)


def add_cluster_node(topology: Topology) -> ServerProcess:
    """One more cluster-enabled server, met by the cluster and serving no slot yet: a node
    being added, as ``redis-cli --cluster add-node`` adds one (``CLUSTER MEET``). Returns
    once every node knows every other and the cluster is ok on each. Stopped with the
    topology, and by its owner as every server (added inside a test, it stops when the
    test ends: grow a Cluster of the test's own)."""
    name = f"node{len(topology.servers)}"
    server = ServerProcess(name, _cluster_node_args, topology.workdir / name).start()
    topology.servers.append(server)
    with server.client() as new:
        bus_port = int(new.config_get("cluster-port")["cluster-port"])
    with topology.servers[0].client() as client:
        client.execute_command("CLUSTER", "MEET", "127.0.0.1", server.port, bus_port)
    total = len(topology.servers)

    def known_everywhere() -> bool:
        for each in topology.servers:
            with each.client() as client:
                info = client.cluster("info")
                if info.get("cluster_state") != "ok" or int(info.get("cluster_known_nodes", 0)) != total:
                    return False
        return True

    wait_for(known_everywhere, timeout=30, message=f"{name} known to every node, the cluster ok on each")
    return server


def cluster_shard(topology: Topology, slot: int) -> tuple[ServerProcess, list[ServerProcess]]:
    """The primary serving ``slot`` in a cluster topology, and its replicas (as ``CLUSTER NODES`` says)."""
    by_port = {s.port: s for s in topology.servers}
    with topology.servers[0].client() as client:
        lines = cluster_nodes(client)
    primary = next(n for n in lines if n.is_primary and n.serves(slot))
    return by_port[primary.port], [by_port[n.port] for n in lines if n.primary_id == primary.id]


def fail_over_shard(topology: Topology, slot: int) -> tuple[ServerProcess, ServerProcess]:
    """``CLUSTER FAILOVER`` on the replica of the shard serving ``slot``, returned once every
    node sees the replica as the primary and the old primary as its replica: (old, new)."""
    old, (replica,) = cluster_shard(topology, slot)
    with replica.client() as on_replica:
        on_replica.execute_command("CLUSTER", "FAILOVER")

    def swapped() -> bool:
        for server in topology.servers:
            with server.client() as node:
                lines = {line.port: line for line in cluster_nodes(node)}
                if not lines[replica.port].is_primary or lines[old.port].is_primary:
                    return False
        return True

    wait_for(swapped, timeout=60, message="the replica promoted and the old primary its replica")
    return old, replica


# -------------------------------------------------------------------- Sentinel


@dataclass
class SentinelGroup(Topology):
    """A primary, one replica and three sentinels (quorum 2) watching them."""

    sentinel_ports: list[int] = field(default_factory=list)
    password: str | None = None  # of the primary and the replica
    sentinel_password: str | None = None  # of the sentinels themselves

    def sentinel(self, index: int = 0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.sentinel_ports[index], socket_timeout=5,
                           password=self.sentinel_password, decode_responses=True)

    def master_address(self) -> tuple[str, int]:
        if not self.sentinel_ports:  # a bare primary + replica pair
            return "127.0.0.1", self.servers[0].port or 0
        return master_address(self.sentinel())

    def server_on(self, port: int) -> ServerProcess:
        return next(s for s in self.servers if s.port == port)

    def lock_client(self, window: float = 1.5) -> RedisClient:
        """The library's client of the group, on a primary marked in use (no first-deploy
        window), with a lock server record of its own (windows of ``window`` seconds)."""
        host, port = self.master_address()
        with redis.Redis(host=host, port=port, socket_timeout=5, password=self.password) as primary:
            mark_in_use(primary)
        client = redis_from_url(self.url)
        client.csb_server = LockServer("singleton", window)  # type: ignore[union-attr]
        return client

    def wait_ready(self, replicas: int = 1, timeout: float = 40.0) -> None:
        """Every sentinel knows the primary, its replica(s) and the other sentinels; replication is up."""
        def primary() -> redis.Redis:
            host, port = self.master_address()
            return redis.Redis(host=host, port=port, socket_timeout=5, password=self.password,
                               decode_responses=True)

        wait_for(lambda: group_ready([self.sentinel(i) for i in range(len(self.sentinel_ports))], primary, replicas),
                 timeout=timeout, interval=0.2, message="sentinels, primary and replica ready")


def start_sentinels(down_after_ms: int = 1000, password: str | None = None,
                    sentinel_password: str | None = None, sentinels: int = 3) -> SentinelGroup:
    """Primary + replica + 3 sentinels on loopback; ``down_after_ms`` until a silent primary is down.

    ``password`` protects the primary and the replica (it goes in the URL);
    ``sentinel_password`` the sentinels (``sentinel_kwargs`` of the client).
    ``sentinels=0`` gives a bare primary + replica pair (its ``url`` is then unusable).
    """
    workdir = scratch("sentinel")
    servers: list[ServerProcess] = []
    auth = ["--requirepass", password, "--masterauth", password] if password else []
    try:
        primary = ServerProcess("primary", _server_args(*auth), workdir / "primary",
                                _probe(password=password)).start()
        servers.append(primary)
        servers.append(ServerProcess(
            "replica", _server_args("--replicaof", "127.0.0.1", str(primary.port), *auth),
            workdir / "replica", _probe(password=password)).start())
        for index in range(sentinels):
            def args_for(port: int, index: int = index) -> list[str]:
                # Sentinels rewrite their file: one each.
                return sentinel_args(workdir / f"sentinel{index}.conf", port, primary.port or 0,
                                     down_after_ms=down_after_ms, password=password,
                                     sentinel_password=sentinel_password)

            servers.append(ServerProcess(f"sentinel{index}", args_for, workdir / f"sentinel{index}",
                                         _probe(password=sentinel_password)).start())
    except BaseException:
        _stop_all(servers)
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    sentinel_ports = [s.port or 0 for s in servers[2:]]
    primary_port = primary.port or 0
    credentials = f":{quote(password, safe='')}@" if password else ""
    hosts = ";".join(f"sentinel://{credentials if i == 0 else ''}127.0.0.1:{port}"
                     for i, port in enumerate(sentinel_ports))
    url = f"{hosts}?master_name={MASTER_NAME}"
    admin: RedisClient = Sentinel(
        [("127.0.0.1", p) for p in sentinel_ports], socket_timeout=5,
        sentinel_kwargs={"socket_timeout": 5, "password": sentinel_password},
    ).master_for(MASTER_NAME, socket_timeout=10, password=password) if sentinels else \
        redis.Redis(host="127.0.0.1", port=primary_port, password=password, socket_timeout=10)
    group = SentinelGroup("sentinel", url, admin, 1, servers, workdir, sentinel_ports=sentinel_ports,
                          password=password, sentinel_password=sentinel_password)
    try:
        group.wait_ready()
    except BaseException:
        group.stop()
        raise
    return group


def wait_for_new_primary(group: SentinelGroup, old: tuple[str, int], timeout: float = 60.0) -> float:
    """Wait until the sentinels name another primary that takes writes; the seconds it took."""
    started = time.monotonic()

    def promoted() -> bool:
        try:
            address = group.master_address()
            if address == old:
                return False
            with redis.Redis(host=address[0], port=address[1], socket_timeout=2) as primary:
                return bool(primary.set("csb:probe", "1"))
        except redis.RedisError:
            return False

    wait_for(promoted, timeout=timeout, interval=0.05, message="a new primary")
    return time.monotonic() - started

"""Real Redis topologies on loopback for the deployment tests.

Each topology is made of ``redis-server`` processes the tests start themselves
(no Docker): a TLS server with a certificate made on the spot with ``openssl``,
a server with ACL users, a 3-primary Redis Cluster (``redis-cli --cluster
create``), and a primary + replica watched by 3 sentinels (``redis-server
--sentinel``, so no separate ``redis-sentinel`` binary is needed).

A :class:`Topology` is what the tests see: the URL a Celery app puts in
``singleton_redis_url``, an unrestricted client to look at keys, and how to
flush and stop it.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.sentinel import Sentinel

from celery_singleton_beat.client import RedisClient

from .support import free_port, redis_server_binary, wait_for

MASTER_NAME = "mymaster"
#: Debian packages that provide the binaries (``redis-server`` pulls ``redis-tools``).
PACKAGES = {"redis-cli": "redis-tools", "openssl": "openssl"}


def require(binary: str) -> str:
    """Path of ``binary``; skip the test (naming the package to install) when missing."""
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} not found: apt-get install -y {PACKAGES.get(binary, binary)}")
    return path


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


class ServerProcess:
    """One ``redis-server`` (or sentinel) process with its own directory and log."""

    def __init__(self, name: str, port: int, args: list[str], probe: Callable[[], redis.Redis],
                 workdir: Path) -> None:
        self.name, self.port, self.args, self.probe = name, port, args, probe
        self.dir = workdir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = self.dir / "server.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> "ServerProcess":
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen([redis_server_binary(), *self.args], cwd=self.dir,
                                            stdout=out, stderr=subprocess.STDOUT)
        client = self.probe()
        try:
            wait_for(lambda: self._check_alive() and _answers(client), timeout=20,
                     message=f"{self.name} on port {self.port}")
        finally:
            client.close()
        return self

    def _check_alive(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise AssertionError(f"{self.name} exited:\n{self.log.read_text(errors='replace')[-3000:]}")
        return True

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL, as in a crash (no persistence: its data is gone)."""
        if self.alive:
            assert self.process is not None
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.alive:
            assert self.process is not None
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def _server_args(port: int, *extra: str) -> list[str]:
    # No persistence; full syncs start at once (the default waits 5 s for more replicas).
    return ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--repl-diskless-sync-delay", "0", "--dir", ".", *extra]


def _plain_probe(port: int, **kwargs: Any) -> Callable[[], redis.Redis]:
    return lambda: redis.Redis(host="127.0.0.1", port=port, socket_timeout=5, **kwargs)


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
        """Delete every key (on every primary) and forget loaded scripts."""
        for node in self.primaries():
            node.flushall()
            node.script_flush()

    def primaries(self) -> list[redis.Redis]:
        if isinstance(self.admin, RedisCluster):
            return [self.admin.get_redis_connection(n) for n in self.admin.get_primaries()]
        return [self.admin]

    def stop(self) -> None:
        self.admin.close()
        for server in reversed(self.servers):
            server.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _workdir(name: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"csb-{name}-"))


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
        check=True, capture_output=True,
    )
    return Certificate(cert, key)


def start_tls() -> Topology:
    """A redis-server that speaks TLS only and requires client certificates (mutual TLS)."""
    workdir = _workdir("tls")
    tls = make_certificate(workdir)
    port = free_port()
    files = {"ssl_ca_certs": str(tls.cert), "ssl_certfile": str(tls.cert), "ssl_keyfile": str(tls.key)}
    server = ServerProcess(
        "tls", port,
        _server_args(0, "--tls-port", str(port), "--tls-cert-file", str(tls.cert),
                     "--tls-key-file", str(tls.key), "--tls-ca-cert-file", str(tls.cert),
                     "--tls-auth-clients", "yes"),
        _plain_probe(port, ssl=True, **files), workdir,
    ).start()
    url = f"rediss://127.0.0.1:{port}/0?" + urlencode(files, quote_via=quote)
    admin = redis.Redis(host="127.0.0.1", port=port, ssl=True, socket_timeout=10, **files)
    return Topology("tls", url, admin, 0, [server], workdir)


# -------------------------------------------------------------------- ACL


ACL_USER, ACL_PASSWORD = "singleton-app", "s3cret-app"


def start_acl(rules: list[str]) -> Topology:
    """A redis-server with an ACL user limited to ``rules``; the default user is the admin."""
    workdir = _workdir("acl")
    port = free_port()
    server = ServerProcess("acl", port, _server_args(port), _plain_probe(port), workdir).start()
    admin = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)
    set_acl_user(admin, rules)
    url = f"redis://{ACL_USER}:{ACL_PASSWORD}@127.0.0.1:{port}/0"
    return Topology("acl", url, admin, 0, [server], workdir)


def set_acl_user(server: redis.Redis, rules: list[str]) -> None:
    """(Re)define the test's ACL user on one server with exactly ``rules``."""
    server.execute_command("ACL", "SETUSER", ACL_USER, "reset", "on", f">{ACL_PASSWORD}", *rules)


# -------------------------------------------------------------------- Cluster


def start_cluster(primaries: int = 3) -> Topology:
    """``primaries`` cluster-enabled servers joined by ``redis-cli --cluster create``."""
    redis_cli = require("redis-cli")
    workdir = _workdir("cluster")
    servers: list[ServerProcess] = []
    try:
        for index in range(primaries):
            port, bus = free_port(), free_port()  # explicit bus port: port+10000 may not exist
            servers.append(ServerProcess(
                f"node{index}", port,
                _server_args(port, "--cluster-enabled", "yes", "--cluster-port", str(bus),
                             "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "5000"),
                _plain_probe(port), workdir,
            ).start())
        subprocess.run(
            [redis_cli, "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in servers),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )

        def converged() -> bool:
            for server in servers:
                with server.probe() as client:
                    info = client.cluster("info")
                    if info.get("cluster_state") != "ok" or int(info.get("cluster_known_nodes", 0)) != primaries:
                        return False
            return True

        wait_for(converged, timeout=30, message="cluster state ok on every node")
    except BaseException:
        for server in servers:
            server.stop()
        raise
    nodes = ",".join(f"127.0.0.1:{s.port}" for s in servers[:2])  # discovery finds the third
    admin = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", s.port) for s in servers], socket_timeout=10)
    return Topology("cluster", f"redis+cluster://{nodes}", admin, 0, servers, workdir)


# -------------------------------------------------------------------- Sentinel


class SentinelGroup(Topology):
    """A primary, one replica and three sentinels (quorum 2) watching them."""

    sentinel_ports: list[int]
    password: str | None = None  # of the primary and the replica
    sentinel_password: str | None = None  # of the sentinels themselves

    def sentinel(self, index: int = 0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.sentinel_ports[index], socket_timeout=5,
                           password=self.sentinel_password, decode_responses=True)

    def master_address(self) -> tuple[str, int]:
        if not self.sentinel_ports:  # a bare primary + replica pair
            return "127.0.0.1", self.servers[0].port
        host, port = self.sentinel().sentinel_get_master_addr_by_name(MASTER_NAME)
        return host, int(port)

    def server_on(self, port: int) -> ServerProcess:
        return next(s for s in self.servers if s.port == port)

    def wait_ready(self, replicas: int = 1, timeout: float = 40.0) -> None:
        """Every sentinel knows the primary, its replica(s) and the other sentinels; replication is up."""
        def ready() -> bool:
            for index in range(len(self.sentinel_ports)):
                try:
                    state = self.sentinel(index).sentinel_master(MASTER_NAME)
                except redis.RedisError:
                    return False
                if (int(state.get("num-slaves", 0)) < replicas
                        or int(state.get("num-other-sentinels", 0)) < len(self.sentinel_ports) - 1
                        or "s_down" in str(state.get("flags", ""))):
                    return False
            host, port = self.master_address()
            with redis.Redis(host=host, port=port, socket_timeout=5, password=self.password,
                             decode_responses=True) as primary:
                info = primary.info("replication")
            online = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)
                      and v.get("state") == "online"]
            return info.get("role") == "master" and len(online) >= replicas

        wait_for(ready, timeout=timeout, interval=0.2, message="sentinels, primary and replica ready")


def start_sentinels(down_after_ms: int = 1000, password: str | None = None,
                    sentinel_password: str | None = None, sentinels: int = 3) -> SentinelGroup:
    """Primary + replica + 3 sentinels on loopback; ``down_after_ms`` until a silent primary is down.

    ``password`` protects the primary and the replica (it goes in the URL);
    ``sentinel_password`` the sentinels (``sentinel_kwargs`` of the client).
    ``sentinels=0`` gives a bare primary + replica pair (its ``url`` is then unusable).
    """
    workdir = _workdir("sentinel")
    servers: list[ServerProcess] = []
    auth = ["--requirepass", password, "--masterauth", password] if password else []
    try:
        primary_port, replica_port = free_port(), free_port()
        servers.append(ServerProcess("primary", primary_port, _server_args(primary_port, *auth),
                                     _plain_probe(primary_port, password=password), workdir).start())
        servers.append(ServerProcess(
            "replica", replica_port,
            _server_args(replica_port, "--replicaof", "127.0.0.1", str(primary_port), *auth),
            _plain_probe(replica_port, password=password), workdir).start())
        sentinel_ports = []
        for index in range(sentinels):
            port = free_port()
            sentinel_ports.append(port)
            lines = [f"port {port}", "bind 127.0.0.1",
                     f"sentinel monitor {MASTER_NAME} 127.0.0.1 {primary_port} 2",
                     f"sentinel down-after-milliseconds {MASTER_NAME} {down_after_ms}",
                     f"sentinel failover-timeout {MASTER_NAME} 10000",
                     f"sentinel parallel-syncs {MASTER_NAME} 1"]
            if password:
                lines.append(f"sentinel auth-pass {MASTER_NAME} {password}")
            if sentinel_password:
                lines += [f"requirepass {sentinel_password}", f"sentinel sentinel-pass {sentinel_password}"]
            config = workdir / f"sentinel{index}.conf"  # sentinels rewrite their file: one each
            config.write_text("\n".join(lines) + "\n")
            servers.append(ServerProcess(f"sentinel{index}", port, [str(config), "--sentinel"],
                                         _plain_probe(port, password=sentinel_password), workdir).start())
    except BaseException:
        for server in servers:
            server.stop()
        raise
    credentials = f":{quote(password, safe='')}@" if password else ""
    hosts = ";".join(f"sentinel://{credentials if i == 0 else ''}127.0.0.1:{port}"
                     for i, port in enumerate(sentinel_ports))
    url = f"{hosts}?master_name={MASTER_NAME}"
    admin: RedisClient = Sentinel(
        [("127.0.0.1", p) for p in sentinel_ports], socket_timeout=5,
        sentinel_kwargs={"socket_timeout": 5, "password": sentinel_password},
    ).master_for(MASTER_NAME, socket_timeout=10, password=password) if sentinels else \
        redis.Redis(host="127.0.0.1", port=primary_port, password=password, socket_timeout=10)
    group = SentinelGroup("sentinel", url, admin, 1, servers, workdir)
    group.sentinel_ports = sentinel_ports
    group.password, group.sentinel_password = password, sentinel_password
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

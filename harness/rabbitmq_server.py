"""A RabbitMQ server we started (Debian's ``rabbitmq-server``), on free loopback ports.

Everything the node writes (database, cookie, logs' directory, config files)
lives in one temporary directory of its own, named by ``RABBITMQ_*``
variables: nothing in ``/etc/rabbitmq`` or ``/var/lib/rabbitmq`` is read or
touched, and the system's own RabbitMQ (if any) is left alone. As root the
node runs as the ``rabbitmq`` user, as Debian runs it, so the directory is
made in the system temporary directory (pytest's are private to root) and
given to that user.

The node is accepted once an AMQP connection to its port succeeds with
``guest``/``guest`` (allowed on loopback) and the server there reports our
node's name, which carries the port and a random token. If the node exits
first (a port was taken meanwhile), it is started again on new ports.

``epmd`` (Erlang's port mapper, started by the first node on the machine)
detaches and outlives the node; a later node, ours or not, uses it again.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from pathlib import Path

import amqp

from .processes import ChildProcess, group_alive, signal_group
from .redis_server import free_port
from .waiting import wait_until

__all__ = ["RabbitMQServerProcess", "find_rabbitmq_server"]

#: Where Debian's package puts the real start script (``/usr/sbin/rabbitmq-server``
#: is a wrapper that switches user with ``su`` and drops our environment).
DEBIAN_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"


def find_rabbitmq_server() -> str | None:
    """``$RABBITMQ_SERVER``, Debian's start script, or a ``rabbitmq-server`` on PATH
    that is not Debian's ``su`` wrapper; None if there is none."""
    configured = os.environ.get("RABBITMQ_SERVER")
    if configured:
        return configured
    if os.access(DEBIAN_SERVER, os.X_OK):
        return DEBIAN_SERVER
    on_path = shutil.which("rabbitmq-server")
    if on_path and not os.path.realpath(on_path).endswith("rabbitmq-script-wrapper"):
        return on_path
    return None


def _default_user() -> str | None:
    """``rabbitmq`` when we are root and that user exists; else None (run as ourselves)."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        pwd.getpwnam("rabbitmq")
    except KeyError:
        return None
    return "rabbitmq"


class RabbitMQServerProcess(ChildProcess):
    """One RabbitMQ node on 127.0.0.1, its files in a temporary directory of its own.

    ``log`` (in ``log_dir``) holds the node's output, its log included
    (``RABBITMQ_LOGS=-``). ``url`` is the broker URL of the default vhost.
    ``close()`` kills the node and removes its directory.
    """

    def __init__(self, name: str, binary: str, *, log_dir: Path, attempts: int = 3,
                 user: str | None = None) -> None:
        super().__init__(name, [binary], log=Path(log_dir) / f"{name}-1.log",
                         user=user if user is not None else _default_user())
        self.binary = binary
        self.log_dir = Path(log_dir)
        self.attempts = attempts
        self.port: int | None = None
        self.node: str | None = None
        self.home: Path | None = None

    @property
    def url(self) -> str:
        """The broker URL (``guest`` on the default vhost ``/``)."""
        if self.port is None:
            raise self.error(f"{self.name} was never started")
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def start(self, timeout: float = 90.0) -> RabbitMQServerProcess:
        """Start the node; return once it accepts an AMQP connection as our node.

        Raises ``error`` when the node exits on each of ``attempts`` pairs of
        free ports, or does not answer within ``timeout`` seconds.
        """
        for attempt in range(1, self.attempts + 1):
            port, dist_port = free_port(), free_port()
            node = f"csb{port}_{uuid.uuid4().hex[:8]}"
            self._prepare(port, dist_port, node)
            self.log = self.log_dir / f"{self.name}-{attempt}.log"
            super().start()
            if self.await_answer(lambda: self._answers_as(port, node), f"127.0.0.1:{port}",  # noqa: B023
                                 timeout, interval=0.1, tail_lines=30):
                self.port, self.node = port, node
                return self
            # exited first; most likely a port taken meanwhile ("eaddrinuse")
        raise self.error(f"{self.name} did not start on any of {self.attempts} pairs of free ports; "
                         f"end of {self.log}:\n{self.tail(30)}")

    def _prepare(self, port: int, dist_port: int, node: str) -> None:
        """A fresh home directory (owned by the node's user) and the environment naming it."""
        self._remove_home()
        home = Path(tempfile.mkdtemp(prefix="csb-rabbitmq-"))
        (home / "enabled_plugins").write_text("[].\n")  # no plugins: a faster boot
        (home / "advanced.config").write_text("[].\n")
        # A full /tmp must not block publishers (the default alarm is at 50 MB free).
        (home / "rabbitmq.conf").write_text("disk_free_limit.absolute = 1MB\n")
        (home / "rabbitmq-env.conf").write_text("")
        if self.user is not None:
            import pwd

            entry = pwd.getpwnam(self.user)
            for path in (home, *home.iterdir()):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self.home = home
        self.cwd = home
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "HOME": str(home),  # the Erlang cookie goes here
            "LANG": "C.UTF-8",
            "RABBITMQ_NODENAME": f"{node}@localhost",
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(port),
            "RABBITMQ_DIST_PORT": str(dist_port),
            "RABBITMQ_MNESIA_BASE": str(home / "mnesia"),
            "RABBITMQ_LOG_BASE": str(home / "log"),
            "RABBITMQ_LOGS": "-",  # to stdout: our log file
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(home / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(home / "pid"),
            "RABBITMQ_CONFIG_FILE": str(home / "rabbitmq"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(home / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(home / "rabbitmq-env.conf"),
            # The start script runs the VM in its own place (exec) only when it
            # believes systemd started it; otherwise it forks the VM behind a
            # shell, and the VM would not get our death signal. Nobody listens
            # on this socket: the node's "ready" notification to it is dropped.
            "NOTIFY_SOCKET": str(home / "notify"),
        }

    def _answers_as(self, port: int, node: str) -> bool:
        """Whether an AMQP login on ``port`` succeeds at a server naming itself ``node``."""
        connection = amqp.Connection(f"127.0.0.1:{port}", userid="guest", password="guest",
                                     connect_timeout=1.0, read_timeout=5.0, write_timeout=5.0)
        try:
            connection.connect()
        except (OSError, amqp.exceptions.AMQPError):
            connection.collect()
            return False
        try:
            return str(connection.server_properties.get("cluster_name", "")).startswith(f"{node}@")
        finally:
            try:
                connection.close()
            except (OSError, amqp.exceptions.AMQPError):
                connection.collect()

    def unacknowledged(self, queue: str) -> int:
        """How many of ``queue``'s messages the node has delivered and not yet seen
        acknowledged (``rabbitmqctl list_queues``), 0 for a queue it does not have.

        A worker's view of its acknowledgements ("acknowledged" in ``inspect active``)
        says the frame was written, not that the node has it: only the node's count tells
        a test that cutting the connection now will not redeliver the message.
        """
        if self.node is None or self.home is None:
            raise self.error(f"{self.name} was never started")
        ctl = str(Path(self.binary).with_name("rabbitmqctl"))
        cookie = (self.home / ".erlang.cookie").read_text().strip()  # the node wrote it at boot
        done = subprocess.run(
            [ctl, "-n", f"{self.node}@localhost", "--erlang-cookie", cookie, "-q",
             "list_queues", "name", "messages_unacknowledged"],
            env=self.env, capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise self.error(f"rabbitmqctl list_queues failed ({done.returncode}): {done.stderr[-2000:]}")
        for line in done.stdout.splitlines():
            name, _, count = line.rpartition("\t")
            if name == queue:
                return int(count)
        return 0

    def kill(self) -> None:
        """SIGKILL the node's process group (its data is thrown away anyway) and wait
        until the group is empty."""
        if self.process is None:
            return
        signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait()
        wait_until(lambda: not group_alive(self.process.pid), 10.0,  # type: ignore[union-attr]
                   f"{self.name}'s processes to exit", error=self.error)

    def stop(self, timeout: float = 15.0, hurry: object = None) -> None:
        """Kill the node (see :meth:`kill`): a throw-away node needs no clean shutdown."""
        self.kill()

    def close(self) -> None:
        """Kill the node and remove its directory."""
        self.kill()
        self._remove_home()

    def _remove_home(self) -> None:
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)
            self.home = None

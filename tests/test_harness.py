"""The harness keeps its promises (see tests/README.md): a test Redis is always ours,
children (a RabbitMQ node too) die with their parent, a skip is a failure in CI,
EventCapture is bound before it is used."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import kombu
import pytest

import harness.redis_server
from harness.processes import group_alive, signal_group

from .support import ROOT, NotOurServer, RabbitMQServer, RedisServer, TestProcess, free_port, run_command, wait_for
from .support.servers import rabbitmq_server_binary
from .support.tasks import EventCapture


def test_a_server_whose_port_was_taken_moves_to_another_port(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1], free_port()])
        monkeypatch.setattr(harness.redis_server, "free_port", lambda: next(ports))
        server = RedisServer().start()  # the test owns it: closed at its end
        assert server.port != taken.getsockname()[1]
    assert server.is_ours()
    assert server.client().info("server")["process_id"] == server.pid


def test_a_server_pinned_to_a_taken_port_fails_instead_of_using_the_other_server(
    make_redis: Callable[..., RedisServer],
) -> None:
    other = make_redis()
    pinned = RedisServer(port=other.port)
    with pytest.raises(AssertionError, match="did not start on its port"):
        pinned.start()
    assert not pinned.running


def test_flushall_refuses_a_server_that_is_not_ours(make_redis: Callable[..., RedisServer]) -> None:
    ours = make_redis()
    ours.kill()  # our server dies and another program's server takes its port
    stranger = RedisServer(port=ours.port, name="stranger").start()  # the test owns it too
    stranger.client().set("precious", "1")
    assert not ours.is_ours()
    with pytest.raises(NotOurServer, match="refusing to FLUSHALL"):
        ours.flushall()
    assert stranger.client().get("precious") == b"1"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_its_parent_even_by_sigkill(tmp_path: Path) -> None:
    """The parent starts a child (a new session: signals to the parent's group miss it),
    then is SIGKILLed: the kernel kills the child (PR_SET_PDEATHSIG)."""
    script = (
        "import pathlib, sys, time\n"
        "from harness.processes import ChildProcess\n"
        "child = ChildProcess('sleeper', [sys.executable, '-c', 'import time; time.sleep(120)'],\n"
        "                     log=pathlib.Path(sys.argv[1])).start()\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    parent = TestProcess("parent", [sys.executable, "-c", script, str(tmp_path / "child.log")], env=env,
                         log=tmp_path / "parent.log").start()
    child = int(wait_for(lambda: next((line for line in parent.output().splitlines() if line.isdigit()), None),
                         timeout=30, message="the child's pid"))
    assert group_alive(child)
    os.kill(parent.pid, signal.SIGKILL)  # the parent alone: no clean-up of its own runs
    wait_for(lambda: not group_alive(child), timeout=10, message="the child to die with its parent")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_rabbitmq_node_dies_with_its_parent_even_by_sigkill(tmp_path: Path) -> None:
    """The Erlang VM is the process we started (the start script execs it; as root it
    runs as the rabbitmq user), so the kernel kills it with its SIGKILLed parent."""
    binary = rabbitmq_server_binary()
    script = (
        "import pathlib, sys, time\n"
        "from harness.rabbitmq_server import RabbitMQServerProcess\n"
        "node = RabbitMQServerProcess('node', sys.argv[1], log_dir=pathlib.Path(sys.argv[2])).start()\n"
        "print('node', node.pid, node.home, flush=True)\n"
        "time.sleep(120)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    parent = TestProcess("parent", [sys.executable, "-c", script, binary, str(tmp_path)], env=env,
                         log=tmp_path / "parent.log").start()
    line = wait_for(lambda: next((ln for ln in parent.output().splitlines() if ln.startswith("node ")), None),
                    timeout=90, message="the node to answer")
    _, pid, home = line.split(" ", 2)
    try:
        assert "beam" in Path(f"/proc/{pid}/cmdline").read_text(), "the VM itself is the child"
        os.kill(parent.pid, signal.SIGKILL)  # the parent alone: no clean-up of its own runs
        wait_for(lambda: not group_alive(int(pid)), timeout=10, message="the node to die with its parent")
    finally:  # what the dead parent could not clean up (the node too, should this test fail)
        signal_group(int(pid), signal.SIGKILL)
        shutil.rmtree(home, ignore_errors=True)



def test_a_rabbitmq_nodes_unacknowledged_count_is_the_nodes_own(rabbitmq_server: RabbitMQServer) -> None:
    """``unacknowledged`` reads the node's count: a message delivered and not acknowledged
    counts until the node has the acknowledgement, and an unknown queue counts 0."""
    queue = f"csb-unacked-{uuid.uuid4().hex[:8]}"
    with kombu.Connection(rabbitmq_server.url, connect_timeout=10) as connection:
        messages = connection.SimpleQueue(queue)
        try:
            messages.put("one")
            message = messages.get(timeout=10)  # delivered, not acknowledged
            assert rabbitmq_server.unacknowledged(queue) == 1
            message.ack()
            wait_for(lambda: rabbitmq_server.unacknowledged(queue) == 0, timeout=30,
                     message="the node to count the acknowledgement")
        finally:
            messages.close()
            connection.default_channel.queue_delete(queue)
    assert rabbitmq_server.unacknowledged(queue) == 0


PROBE = '''
import pytest
from tests.support import importorskip, require


def test_a_missing_binary():
    require("csb-no-such-binary")


def test_a_missing_package():
    importorskip("csb_no_such_package")


def test_a_plain_skip():
    pytest.skip("something is missing")
'''


def run_probe(tmp_path: Path, source: str, *options: str, **env: str) -> Any:
    """Run ``source`` as a test file in a pytest of its own, with this suite's conftest."""
    (tmp_path / "test_probe.py").write_text(source)
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    environment.update(env)
    return run_command([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
                        "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "basetemp"), "-q",
                        *options, str(tmp_path / "test_probe.py")],
                       env=environment, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("ci", ["", "true"])
def test_skips_are_failures_in_ci(tmp_path: Path, ci: str) -> None:
    """The same three skips: skipped on a developer's machine, failed where CI is set."""
    result = run_probe(tmp_path, PROBE, CI=ci)
    summary = result.stdout.strip().splitlines()[-1]
    if ci:
        assert result.returncode == 1 and "3 failed" in summary, result.stdout
        assert "CI is set: a missing dependency is a failure" in result.stdout
        assert "skipped in CI, which is a failure" in result.stdout
    else:
        assert result.returncode == 0 and "3 skipped" in summary, result.stdout


def test_event_capture_is_bound_before_the_block_runs(tasks: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a slow broker (binding the capture's queue takes a second), an event sent
    as soon as the block starts is still caught: ``with`` returns once the queue is bound."""
    from kombu.transport import redis as kombu_redis

    bind = kombu_redis.Channel._queue_bind
    bound = threading.Event()

    def slow_bind(self: Any, *args: Any, **kwargs: Any) -> Any:
        threading.Event().wait(1.0)  # a slow broker, not a wait for anything
        result = bind(self, *args, **kwargs)
        bound.set()
        return result

    monkeypatch.setattr(kombu_redis.Channel, "_queue_bind", slow_bind)
    task_id = str(uuid.uuid4())
    with EventCapture(tasks.app, "task-skipped") as capture:
        assert bound.is_set(), "the capture's queue is bound when the block starts"
        with tasks.app.events.default_dispatcher() as dispatcher:
            dispatcher.send("task-skipped", uuid=task_id)
        event = capture.wait(timeout=10)
    assert event["uuid"] == task_id


HANGS = """
import sys, threading
from tests.support import TestProcess


def test_hangs():
    TestProcess("talker", [sys.executable, "-c", "print('hello from the talker', flush=True); "
                                                  "import time; time.sleep(120)"]).start()
    threading.Event().wait()  # never set: the test hangs until pytest-timeout fails it
"""


def test_a_timeout_reports_the_logs_of_the_test_processes(tmp_path: Path) -> None:
    """pytest-timeout fails a hanging test; the report ends with its processes' output,
    and the process is stopped anyway."""
    # The talker's command line names this run alone: another test session on the machine
    # (a second clone's) runs the same probe, and its talker is alive while it hangs.
    mine = f"hello from the talker {uuid.uuid4().hex}"
    result = run_probe(tmp_path, HANGS.replace("hello from the talker", mine), "--timeout", "3")
    assert result.returncode == 1, result.stdout
    assert "Timeout" in result.stdout + result.stderr
    assert "log of talker (started by this test;" in result.stdout, result.stdout
    assert mine in result.stdout
    assert not processes_running(mine), "the test's process was stopped"


def processes_running(text: str) -> list[int]:
    """Pids of live processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_cut_proxy_drops_its_connections_and_refuses_new_ones_until_mended(redis_server: RedisServer) -> None:
    """The chaos nemesis cuts a worker's lock connection with ``DelayProxy.cut()``: every open
    connection through the proxy is dropped, new ones are refused (the server itself stays
    up), and ``mend()`` lets clients connect again."""
    import redis

    from .support.proxy import DelayProxy

    proxy = DelayProxy(redis_server.port, 0.0, name="cut-proxy").start()
    options = {"socket_timeout": 2, "socket_connect_timeout": 2, "retry_on_timeout": False}
    before = redis.Redis(port=proxy.port, single_connection_client=True, **options)
    assert before.ping()
    proxy.cut()
    with pytest.raises(redis.ConnectionError):
        before.ping()  # its connection was dropped; redis-py's one reconnect is refused too
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=proxy.port, **options).ping()
    assert redis_server.client().ping(), "the server itself stays up"
    proxy.mend()
    assert redis.Redis(port=proxy.port, **options).ping()

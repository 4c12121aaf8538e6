"""A wrong lock-Redis setting stops workers and beats at start; an outage does not.

Real ``celery worker`` and ``celery beat`` processes against real redis-servers:
one with a password, one with two databases, one with an ACL user short of a
command, a Redis 5.0.6 (older than the 6.2 floor: ``SET ... GET`` is a syntax
error there, so no liveness key could ever be written), and a port where
nothing listens until the test starts a server there.

Each configuration error must end the process with exit code 78 and one
CRITICAL line in ``doctor``'s words, before the worker consumes anything;
``doctor`` must say the same and exit 78. An outage must not stop anything:
the worker and the beat start, and run once the server answers.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import pytest
import redis
from redis._parsers.helpers import parse_info

from celery_singleton_beat.connection.client import acl_rules

from .support import CeleryProcess, RedisServer, child_env, free_port, run_command, wait_for
from .support.beat import start_beat
from .support.owners import register
from .support.servers import old_redis_server_binary
from .support.topologies import make_certificate, start_tls

EX_CONFIG = 78
PASSWORD = "right-pw-1234"
WRONG = "wrong-pw-5678"


def start_tasks_worker(redis_server: RedisServer, name: str, lock_url: str,
                       options: dict[str, Any] | None = None) -> CeleryProcess:
    """``tests.apps.tasks_app`` worker (solo pool) whose locks live at ``lock_url``; not waited for."""
    env = child_env(redis_server, CSB_LOCK_REDIS=lock_url, CSB_LOCK_REDIS_OPTIONS=json.dumps(options or {}))
    return CeleryProcess(["-A", "tests.apps.tasks_app", "worker", "-P", "solo", "-n", f"{name}@%h", "-l", "info",
                          "--without-gossip", "--without-mingle", "--without-heartbeat"], env, name=name).start()


def start_claims_beat(redis_server: RedisServer, tmp_path: Path, name: str, lock_url: str,
                      options: dict[str, Any] | None = None) -> CeleryProcess:
    """A real ``celery beat -S singleton`` (one entry every second) claiming slots at ``lock_url``."""
    settings: dict[str, Any] = {"singleton_redis_url": lock_url}
    if options:
        settings["singleton_redis_options"] = options
    return start_beat(redis_server, tmp_path, name, {f"{name}-every-second": {"every": 1}},
                      settings=settings, wait=False)


def doctor(redis_server: RedisServer, lock_url: str, options: dict[str, Any] | None = None
           ) -> tuple[int, dict[str, str]]:
    """``celery singleton doctor`` on ``lock_url``: its exit code and each check's line."""
    settings: dict[str, Any] = {"singleton_redis_url": lock_url}
    if options:
        settings["singleton_redis_options"] = options
    result = run_command([sys.executable, "-m", "celery", "-A", "tests.apps.ops_app", "singleton", "doctor"],
                         env=child_env(redis_server, CSB_OPS_SETTINGS=json.dumps(settings)),
                         capture_output=True, text=True, timeout=120)
    lines = {line.split()[1]: line for line in result.stdout.splitlines()[1:-1] if len(line.split()) > 1}
    return result.returncode, lines


def refused(process: CeleryProcess, what: str, why: str = "cannot use the lock Redis") -> str:
    """Wait for ``process`` to exit; check it refused with 78 and one line; return that line."""
    assert process.process is not None
    code = process.process.wait(60)
    output = process.output()
    assert code == EX_CONFIG, f"{process.name} exited {code}\n{process.tail(30)}"
    critical = [line for line in output.splitlines() if "CRITICAL" in line]
    assert len(critical) == 1, output
    assert what in critical[0] and f"refuses to start: {why}" in critical[0], critical[0]
    assert "`celery -A <app> singleton doctor`" in critical[0]
    assert "Traceback" not in output and "ready." not in output, output
    return critical[0]


# --------------------------------------------------------------------------- configuration errors


#: A misconfigured server: (the server, the lock URL, the reason the refusal must give, an admin client).
Case = tuple[RedisServer, str, str, redis.Redis]


def wrong_password(make_redis: Callable[..., RedisServer]) -> Case:
    server = make_redis("--requirepass", PASSWORD, password=PASSWORD)
    return (server, f"redis://:{WRONG}@127.0.0.1:{server.port}/2", "authentication failed: wrong password",
            server.client())


def missing_database(make_redis: Callable[..., RedisServer]) -> Case:
    server = make_redis("--databases", "2")  # databases 0 and 1 only
    return (server, f"redis://127.0.0.1:{server.port}/2", "the database in singleton_redis_url does not exist",
            server.client())


def acl_without_set(make_redis: Callable[..., RedisServer]) -> Case:
    """The documented ACL rules, less +set: the heartbeat cannot write its liveness key."""
    server = make_redis()
    rules = [rule for rule in acl_rules(select=True) if rule != "+set"]
    server.client().execute_command("ACL", "SETUSER", "app", "reset", "on", f">{PASSWORD}", *rules)
    return (server, f"redis://app:{PASSWORD}@127.0.0.1:{server.port}/2",
            "the ACL user may not do what the library needs", server.client())


@pytest.mark.parametrize("case", [wrong_password, missing_database, acl_without_set],
                         ids=["wrong-password", "missing-database", "acl-without-set"])
def test_a_configuration_error_stops_worker_and_beat_at_start(
        case: Callable[..., Case], redis_server: RedisServer, tmp_path: Path,
        make_redis: Callable[..., RedisServer]) -> None:
    _, url, reason, admin = case(make_redis)

    worker_line = refused(start_tasks_worker(redis_server, "w-bad", url), "worker w-bad@")
    assert reason in worker_line, worker_line
    assert re.sub(r":[^:@/]+@", ":**@", url) in worker_line  # the URL, its password masked
    assert PASSWORD not in worker_line and WRONG not in worker_line

    beat = start_claims_beat(redis_server, tmp_path, "bad", url)
    beat_line = refused(beat, "beat")
    assert reason in beat_line, beat_line
    assert "won by" not in beat.output()

    code, lines = doctor(redis_server, url)
    assert code == EX_CONFIG, lines
    assert any(line.startswith("FAIL") and reason in line for line in lines.values()), lines
    assert admin.info("keyspace") == {}, "the refused processes left no key (no liveness key, no probe)"


# --------------------------------------------------------------------------- an outage is retried


def test_an_unreachable_lock_redis_is_retried_and_used_once_it_answers(
        tasks: ModuleType, redis_server: RedisServer, tmp_path: Path,
        make_redis: Callable[..., RedisServer]) -> None:
    """Connection refused at start: worker and beat start (no exit), say so, and work once it is up."""
    later = make_redis(start=False)
    url = f"redis://127.0.0.1:{later.port}/2"  # the port is pinned; nothing listens yet
    worker = start_tasks_worker(redis_server, "w-wait", url)
    worker.wait_for_log("ready.", timeout=60)
    beat = start_claims_beat(redis_server, tmp_path, "wait", url)
    beat.wait_for_log("beat: Starting...", timeout=60)

    output = worker.output()
    assert f"the lock Redis {url} does not answer yet (ConnectionError" in output
    assert "singleton tasks wait (retry) until it answers" in output
    assert "is written once the lock Redis answers" in output
    assert not re.search(r"INFO/MainProcess\] w-wait@\S+: (lock Redis|liveness key)", output), output
    wait_for(lambda: "does not answer yet" in beat.output(), timeout=30, message="the beat's warning")

    result = tasks.work.apply_async(("outage",), {"seconds": 0.0}, queue="celery")
    wait_for(lambda: result.state == "RETRY", timeout=30, message="the run waiting for the lock Redis")

    later.start()
    assert result.get(timeout=60) == "outage"
    worker.wait_for_log(f"lock Redis {url} (standalone, Redis ", timeout=30)
    assert "answers now" in worker.output()
    beat.wait_for_log("answers now", timeout=30)
    beat.wait_for_log("won by", timeout=30)  # slots are claimed and sent
    assert worker.running and beat.running


def test_a_server_that_comes_up_misconfigured_stops_worker_and_beat(
        redis_server: RedisServer, tmp_path: Path, make_redis: Callable[..., RedisServer]) -> None:
    """An outage at start hid the error: once the server answers, they stop as they would have at start."""
    later = make_redis("--requirepass", PASSWORD, start=False, password=PASSWORD)
    url = f"redis://127.0.0.1:{later.port}/2"  # no password: NOAUTH once the server is up
    worker = start_tasks_worker(redis_server, "w-late", url)
    worker.wait_for_log("ready.", timeout=60)
    beat = start_claims_beat(redis_server, tmp_path, "late", url)
    beat.wait_for_log("does not answer yet", timeout=60)

    later.start()
    for process, what in ((worker, "worker w-late@"), (beat, "beat")):
        assert process.process is not None
        code = process.process.wait(60)
        output = process.output()
        assert code == EX_CONFIG, f"{process.name} exited {code}\n{process.tail(30)}"
        stops = [line for line in output.splitlines() if "CRITICAL" in line]
        assert len(stops) == 1 and f"{what}" in stops[0] and " stops: cannot use the lock Redis" in stops[0]
        assert "authentication failed" in stops[0]


# --------------------------------------------------------------------------- the start-up line


def test_worker_and_beat_name_the_lock_redis(redis_server: RedisServer, tmp_path: Path,
                                             make_redis: Callable[..., RedisServer]) -> None:
    """Redacted URL, topology and server version, in the start-up log of both."""
    server = make_redis("--requirepass", PASSWORD, password=PASSWORD)
    url = f"redis://:{PASSWORD}@127.0.0.1:{server.port}/2"
    shown = f"redis://:**@127.0.0.1:{server.port}/2 (standalone, Redis {server.client().info()['redis_version']})"
    worker = start_tasks_worker(redis_server, "w-named", url)
    worker.wait_for_log("ready.", timeout=60)
    assert re.search(rf"INFO/MainProcess\] w-named@\S+: lock Redis {re.escape(shown)}; liveness key "
                     r"singleton:live:[0-9a-f]+ \(ttl 2s\)", worker.output()), worker.output()
    beat = start_claims_beat(redis_server, tmp_path, "named", url)
    beat.wait_for_log(f"claims in {shown}", timeout=60)
    assert "(standalone) prefix=singleton" in beat.output()  # the banner names the topology
    for process in (worker, beat):
        assert PASSWORD not in process.output()
    # The probe key of the start-up check is gone again.
    assert server.client(2).keys("singleton:probe:*") == []


# --------------------------------------------------------------------------- Redis older than 6.2


#: How a real Redis 5.0.6 meets the library. redis-py 8 opens connections with
#: HELLO 3 (new in Redis 6.0) unless told protocol 2, which the floor, redis-py 5.0,
#: uses by default; redis-py 8.2 and later go on in RESP2 when HELLO is refused, and
#: INFO then tells the version; with INFO renamed (as an ACL would refuse it on a newer
#: server) only SET ... GET tells the version.
RESP2_FALLBACK = hasattr(redis.connection.AbstractConnection, "_resp2_fallback")
OLD_REDIS_CASES = {
    "resp3-hello": ([], {}, "Redis 5.0.6 is too old" if RESP2_FALLBACK else "does not know HELLO"),
    "resp2-info": ([], {"protocol": 2}, "Redis 5.0.6 is too old"),
    "resp2-no-info": (["--rename-command", "INFO", "CSB-INFO"], {"protocol": 2}, "SET ... GET answered"),
}


def renamed_info_client(port: int) -> redis.Redis:
    """A client whose ``info()`` sends the renamed command (the harness reads the pid with it)."""
    client = redis.Redis(host="127.0.0.1", port=port, protocol=2, socket_timeout=1, socket_connect_timeout=1)
    client.set_response_callback("CSB-INFO", parse_info)
    client.info = lambda section=None, *args, **kwargs: client.execute_command(  # type: ignore[method-assign]
        "CSB-INFO", *([section] if section else []))
    return client


@pytest.mark.parametrize("case", list(OLD_REDIS_CASES))
def test_redis_older_than_6_2_is_refused(case: str, redis_server: RedisServer, tmp_path: Path) -> None:
    """Worker, beat and doctor refuse a real Redis 5.0.6, however the client meets it."""
    args, options, why = OLD_REDIS_CASES[case]
    old = register(RedisServer(*args, name="redis-5", binary=old_redis_server_binary(), options={"protocol": 2},
                               connect=renamed_info_client if args else None)).start()
    assert "version=5.0.6" in old.log.read_text()  # a real Redis 5.0.6 answers on that port
    url = old.url(2)

    line = refused(start_tasks_worker(redis_server, "w-old", url, options), "worker w-old@")
    assert why in line and "the library needs Redis 6.2 or later" in line, line
    line = refused(start_claims_beat(redis_server, tmp_path, "old", url, options), "beat")
    assert why in line and "6.2 or later" in line, line
    code, lines = doctor(redis_server, url, options)
    assert code == EX_CONFIG, lines
    assert any(line.startswith("FAIL") and "6.2 or later" in line for line in lines.values()), lines
    assert old.client().dbsize() == 0


def test_a_failed_tls_handshake_stops_the_worker_and_a_plain_url_is_retried(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """A TLS-only server (client certificates required). A certificate authority that did not
    sign its certificate: a configuration error. ``redis://`` to its TLS port: the server
    closes the connection without a word, which cannot be told from an outage (documented)."""
    topology = start_tls()
    try:
        stranger = make_certificate(tmp_path)  # another self-signed CA
        port = topology.servers[0].port
        good_ca = parse_qs(urlsplit(topology.url).query)["ssl_ca_certs"][0]
        bad = topology.url.replace(f"ssl_ca_certs={quote(good_ca, safe='')}",
                                   f"ssl_ca_certs={quote(str(stranger.cert), safe='')}")
        assert bad != topology.url
        line = refused(start_tasks_worker(redis_server, "w-tls", bad), "worker w-tls@")
        assert "the TLS handshake failed" in line and "CERTIFICATE_VERIFY_FAILED" in line, line

        plain = start_tasks_worker(redis_server, "w-plain", f"redis://127.0.0.1:{port}/0")
        plain.wait_for_log("ready.", timeout=60)
        assert "does not answer yet" in plain.output() and plain.running
    finally:
        topology.stop()


def test_a_redis_cluster_that_does_not_answer_at_start_is_an_outage(redis_server: RedisServer) -> None:
    """A Cluster client asks its nodes for the slot layout when it is built; before, the
    worker step built it at start and the worker died with a traceback when no node answered."""
    url = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    worker = start_tasks_worker(redis_server, "w-cluster", url)
    worker.wait_for_log("ready.", timeout=60)
    output = worker.output()
    assert f"the lock Redis {url} does not answer yet (ClusterUnavailable" in output, output
    assert "Traceback" not in output and worker.running


# --------------------------------------------------------------------------- invalid singleton_* settings

#: Settings no process may start with, and what the refusal says of each.
BAD_SETTINGS = {
    "unknown-setting": ({"singleton_lok_ttl": 30}, "unknown setting singleton_lok_ttl"),
    "bad-value": ({"singleton_lock_ttl": 0}, "singleton_lock_ttl must be a number of seconds > 0, got 0"),
}
BEAT_APP = "tests.apps.beat_app"


@pytest.mark.parametrize("setting", list(BAD_SETTINGS))
@pytest.mark.parametrize("command", ["worker", "beat", "worker -B"])
def test_an_invalid_setting_stops_the_process_with_one_line_and_78(
        redis_server: RedisServer, tmp_path: Path, command: str, setting: str) -> None:
    """An unknown ``singleton_*`` setting or a bad value: ``worker``, ``beat`` and
    ``worker -B`` exit with 78 (``EX_CONFIG``: systemd's ``RestartPreventExitStatus=78``)
    after one CRITICAL line that names the setting, with no traceback. Before, each exited
    1 with a 58-line traceback."""
    settings, reason = BAD_SETTINGS[setting]
    argv = {"worker": ["worker", "-P", "solo"],
            "beat": ["beat", "-s", str(tmp_path / "schedule")],
            "worker -B": ["worker", "-P", "solo", "-B", "--scheduler", "singleton",
                          "-s", str(tmp_path / "schedule")]}[command]
    process = CeleryProcess(["-A", BEAT_APP, *argv, "-l", "info"],
                            child_env(redis_server, CSB_BEAT_SETTINGS=json.dumps(settings)),
                            name=f"bad-{command.replace(' ', '')}").start()
    refused(process, "beat" if command == "beat" else "worker", f"invalid configuration: {reason}")


@pytest.mark.parametrize("setting", list(BAD_SETTINGS))
def test_doctor_names_an_invalid_setting_and_exits_78(redis_server: RedisServer, setting: str) -> None:
    settings, reason = BAD_SETTINGS[setting]
    result = run_command([sys.executable, "-m", "celery", "-A", BEAT_APP, "singleton", "doctor"],
                         env=child_env(redis_server, CSB_BEAT_SETTINGS=json.dumps(settings)),
                         timeout=60, capture_output=True, text=True)
    assert result.returncode == EX_CONFIG, result.stdout + result.stderr
    assert f"FAIL  configuration  {reason}" in result.stdout, result.stdout
    assert "Traceback" not in result.stdout + result.stderr

"""Adversarial review of copy detection and of the beat's SIGTERM during a tick.

Attacks that held, each kept for the promise it checks (docs/guarantees.md):

* a copy re-published to wait (header ``singleton_copy``, the marker-first script)
  becomes the real run when its original's worker is SIGKILLed: it takes the lock
  over and completes once, and no other delivery writes the key;
* ``celery beat`` SIGTERMed while its slot claim waits for the lock Redis, and
  signalled twice while a request with a sent slot's mark is held: exit 0, no
  error, no claim marked sent that was not published;
* django-celery-beat's scheduler SIGTERMed while its publish or its claim waits.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from .support import LOCK_DB, RECORD_DB, CeleryProcess, RedisServer, wait_for
from .support.beat import assert_stopped_cleanly, claims_of, start_beat
from .support.dbbeat import DJANGO_APP, SCHEDULER, add_entry, clear_schedule
from .support.holding_proxy import HoldingProxy
from .support.keyspace import keyspace_events
from .support.processes import child_env
from .test_beat_kills import SETTINGS
from .test_redelivery import entries, load_app, worker


@pytest.mark.slow
def test_a_beat_stopped_while_its_claim_waits_for_the_lock_redis_exits_cleanly(
        redis_server: RedisServer, names: str, tmp_path: Path, processes: list[CeleryProcess]) -> None:
    """SIGTERM while the slot claim's reply is held: close() is skipped mid-tick, the
    SystemExit unwinds the claim's read; the beat exits 0 and logs no error."""
    entry = f"{names}claim"
    with HoldingProxy(redis_server.port, "claims") as claims:
        claims.hold(b"NX")  # the slot claim (SET NX PX) reaches Redis only when let go
        beat = start_beat(redis_server, tmp_path, "claim", {entry: {"every": 1}},
                          settings={**SETTINGS, "singleton_redis_url": claims.url(LOCK_DB)})
        processes.append(beat)
        wait_for(lambda: claims.held_with(b"NX"), timeout=30, message="the beat's claim to be sent")
        beat.terminate()
        claims.let_go([])
        assert_stopped_cleanly(beat)
    # The claim it never read the reply of is not marked sent: the others take it over.
    states = {claim["state"] for claim in claims_of(redis_server, entry).values()}
    assert states <= {"pending", "released"}, states


@pytest.mark.slow
def test_a_beat_signalled_twice_while_it_marks_its_sent_slot_exits_cleanly(
        redis_server: RedisServer, names: str, tmp_path: Path, processes: list[CeleryProcess]) -> None:
    """SIGTERM then SIGINT while a request carrying the mark of a sent slot is held: the
    second handler's close runs inside the unwinding of the first; still exit 0, no error."""
    entry = f"{names}twice"
    with HoldingProxy(redis_server.port, "claims") as claims:
        beat = start_beat(redis_server, tmp_path, "twice", {entry: {"every": 1}},
                          settings={**SETTINGS, "singleton_redis_url": claims.url(LOCK_DB)})
        processes.append(beat)
        wait_for(lambda: any(c.get("state") == "sent" for c in claims_of(redis_server, entry).values()),
                 timeout=30, message="a first slot marked sent")
        claims.hold(b"EVALSHA")
        wait_for(lambda: claims.held_with(b"EVALSHA"), timeout=30, message="a mark to be held")
        beat.terminate()
        beat.signal(signal.SIGINT)
        claims.let_go([])
        assert_stopped_cleanly(beat)


def signal_handled(pid: int, signum: int) -> bool:
    """Whether process ``pid`` catches ``signum`` (its bit in /proc's SigCgt mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    raise AssertionError(f"no SigCgt line for pid {pid}")


@pytest.mark.slow
def test_a_second_signal_reaching_a_beat_as_its_interpreter_exits_is_ignored(
        redis_server: RedisServer, names: str, tmp_path: Path, processes: list[CeleryProcess]) -> None:
    """A rolling deploy's second SIGINT/SIGTERM can land after the beat closed its scheduler,
    while the interpreter tears down: Python has then given the signals back to their
    default action, so the beat died by the signal (exit -2, nothing logged) where it had
    stopped cleanly. The beat holds its process (teardown hook ``CSB_LINGER_DIR``) at that
    moment; the second signal is ignored and the exit code stays 0."""
    linger = tmp_path / "linger"
    linger.mkdir()
    beat = start_beat(redis_server, tmp_path, "linger", {f"{names}linger": {"every": 1}},
                      settings=SETTINGS, env={"CSB_LINGER_DIR": str(linger)})
    processes.append(beat)
    beat.wait_for_log("Sending due task", timeout=30)
    beat.terminate()
    wait_for(lambda: (linger / "lingering").exists(), timeout=30, message="the beat's interpreter to tear down")
    assert not signal_handled(beat.pid, signal.SIGINT), "Python no longer runs a handler for SIGINT"
    beat.signal(signal.SIGINT)
    (linger / "go").touch()
    assert_stopped_cleanly(beat)


@pytest.mark.slow
def test_a_stop_signal_handled_inside_a_finalizer_still_stops_the_beat(
        redis_server: RedisServer, names: str, tmp_path: Path, processes: list[CeleryProcess]) -> None:
    """SIGTERM whose handler runs while the beat's main thread is in a ``__del__`` mid-tick
    (Celery's ``AsyncResult.__del__`` after each publish): Python ignores the handler's
    ``SystemExit`` there, the close it asked for had been put off to the tick's end, and
    the beat ran on, sending every slot (the linger test's 30 s wait for a teardown that
    never came). The beat holds its finalizer (hook ``CSB_FINALIZER_DIR``) until the
    signal ends it; the beat stops, exit 0, no error or traceback logged."""
    folder = tmp_path / "finalizer"
    folder.mkdir()
    beat = start_beat(redis_server, tmp_path, "finalizer", {f"{names}final": {"every": 1}},
                      settings=SETTINGS, env={"CSB_FINALIZER_DIR": str(folder)})
    processes.append(beat)
    wait_for(lambda: (folder / "finalizing").exists(), timeout=30, message="the beat to run the finalizer")
    beat.terminate()
    try:
        assert_stopped_cleanly(beat, timeout=15)
    finally:
        (folder / "go").touch()
    assert "the stop signal arrived inside a finalizer" in beat.output(), beat.tail(40)


@pytest.mark.slow
def test_a_republished_copy_whose_original_dies_takes_over_and_runs_once(
    redis_server: RedisServer, processes: list[CeleryProcess], delivery_env: dict[str, str]
) -> None:
    """The copy re-published to wait (header ``singleton_copy``, its acquire the
    marker-first script) becomes the real run once the original's whole worker is
    SIGKILLed: it takes the dead run's lock over and completes once. No other
    delivery writes the key: one ``set`` for the original, one for the take-over."""
    delivery_env.update(CSB_VISIBILITY="2")
    app = load_app(redis_server, **delivery_env)
    records = redis_server.client(RECORD_DB)
    locks = redis_server.client(LOCK_DB)
    with keyspace_events(locks, "singleton:{tests.apps.delivery_app.strict:*") as events:
        orig = worker(redis_server, processes, "orig", delivery_env)
        records.set("hold:k", "1")  # the original runs until its worker is killed
        result = app.strict.delay("k", 0)
        wait_for(lambda: entries(records, "started:k"), timeout=30, message="the original started")
        copy = worker(redis_server, processes, "copy", delivery_env)
        copy.wait_for_line("already running on", timeout=30)  # re-published with the header
        orig.kill_group()
        records.delete("inflight:k", "hold:k")
        assert result.get(timeout=60).startswith("copy@"), "the copy completed the task"
        line = copy.wait_for_line("took over", timeout=5)
        assert result.id in line and "orig" in line, line
        wait_for(lambda: not locks.keys("singleton:{*}"), timeout=30, message="the lock released")
        written = events()
    assert len(entries(records, "runs:k")) == 1
    [key] = {key for key, _ in written if ":done:" not in key}
    assert [event for name, event in written if name == key].count("set") == 2, written


@pytest.mark.slow
@pytest.mark.parametrize("held", [b"LPUSH", b"NX"], ids=["publish", "claim"])
def test_a_django_beat_stopped_mid_tick_exits_cleanly(
        redis_server: RedisServer, names: str, django_db: Path, tmp_path: Path,
        processes: list[CeleryProcess], held: bytes) -> None:
    """django-celery-beat's scheduler (where the publish-time SIGTERM flaked): SIGTERM while
    the publish waits for the broker, or the slot claim for the lock Redis."""
    clear_schedule()
    entry = f"{names}db"
    add_entry(entry, 1)
    with HoldingProxy(redis_server.port, "held") as proxy:
        proxy.hold(held)
        url = "broker_url" if held == b"LPUSH" else "singleton_redis_url"
        env = child_env(redis_server, CSB_DJANGO_DB=str(django_db),
                        DJANGO_SETTINGS_MODULE="tests.apps.django_settings",
                        CSB_BEAT_SETTINGS=json.dumps({**SETTINGS, url: proxy.url(0 if held == b"LPUSH" else LOCK_DB)}))
        beat = CeleryProcess(["-A", DJANGO_APP, "beat", "-S", SCHEDULER, "-l", "info"], env,
                             name="dbbeat-held").start()
        processes.append(beat)
        wait_for(lambda: proxy.held_with(held), timeout=30, message="the beat's request to be held")
        beat.terminate()
        proxy.let_go([])
        assert_stopped_cleanly(beat)

"""The Celery app of ``tests/test_release_order.py``: runs whose end causes more work on the same key.

Configured from the environment: ``CSB_TEST_REDIS`` (broker db 0 unless ``CSB_BROKER``
names another broker, results db 1,
records db 3: always direct), ``CSB_LOCK_REDIS`` (the locks: the tests give one
worker a delaying proxy in front of the lock database and another the same
database directly), ``CSB_LOCK_SOCKET_TIMEOUT`` (the lock connections' socket
timeout, the library's default if unset) and ``CSB_LOCK_TTL`` (the lease, 30 s if unset).

``step`` (``quiet``, which ignores its result, and ``late``, acknowledged after
its run) records every run it makes in
``runs:<key>`` (``{"task_id", "note"}``) and ``ended:<task id>`` once its run is over;
a run lasts while ``hold:<key>`` is set in the record database (at most 60 s),
so a test decides when it ends.

``CSB_LATE_SLOT_ACK=1`` (a test hook, threads pool): the first acknowledgement of a beat
slot message that a pool thread asks of the loop (``Consumer.call_soon_ack``) is held until
the message's channel has closed (the loop ended with its broker connection, and kombu
restored the channel's unacknowledged messages), then let through: it lands on the next
connection's loop, as a late one does in the wild. Each acknowledgement of a slot message
asked is noted in ``slot-acks:<task id>``: ``held``, then ``let through`` (or ``let through
(timed out)`` after 60 s), and ``asked`` for every other one.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from celery import Celery
from celery.signals import task_postrun

from celery_singleton_beat import SingletonTask
from celery_singleton_beat.task.slot_delivery import CLAIM_HEADER

from .records import record_client

BASE = os.environ.get("CSB_TEST_REDIS", "redis://127.0.0.1:6379")

app = Celery("order_app", broker=os.environ.get("CSB_BROKER", f"{BASE}/0"), backend=f"{BASE}/1")
app.conf.update(
    singleton_redis_url=os.environ.get("CSB_LOCK_REDIS", f"{BASE}/2"),
    singleton_lock_ttl=30.0,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    worker_hijack_root_logger=True,
)


if os.environ.get("CSB_LOCK_TTL"):
    # A short lease: a test waits for a lock to expire.
    app.conf.singleton_lock_ttl = float(os.environ["CSB_LOCK_TTL"])

if os.environ.get("CSB_LOCK_SOCKET_TIMEOUT"):
    # A lock Redis that does not answer keeps a request waiting this long.
    app.conf.singleton_redis_options = {"socket_timeout": float(os.environ["CSB_LOCK_SOCKET_TIMEOUT"])}

if os.environ.get("CSB_ORDER_SETTINGS"):
    app.conf.update(json.loads(os.environ["CSB_ORDER_SETTINGS"]))


def _late_slot_ack_hook() -> None:
    """Install the ``CSB_LATE_SLOT_ACK`` hook (see the module docstring) in this process."""
    if os.environ.get("CSB_LATE_SLOT_ACK") != "1":
        return
    from celery.worker.consumer.consumer import Consumer
    from kombu.message import Message

    asked = Consumer.call_soon_ack
    first = threading.Lock()  # taken by the acknowledgement held

    def call_soon_ack(self: Any, p: Any, *args: Any, **kwargs: Any) -> Any:
        message = getattr(p, "__self__", None)  # p: the message's ack_log_error (or reject_log_error)
        if not isinstance(message, Message) or not (message.headers or {}).get(CLAIM_HEADER):
            return asked(self, p, *args, **kwargs)
        records, noted_in = record_client(BASE), f"slot-acks:{message.headers['id']}"
        # The loop runs on the main thread; a pool thread is any other.
        if threading.current_thread() is threading.main_thread() or not first.acquire(blocking=False):
            records.rpush(noted_in, "asked")
            return asked(self, p, *args, **kwargs)
        records.rpush(noted_in, "held")
        channel = message.channel

        def let_through() -> None:
            # Transport.close_channel clears channel.connection last, after the restore.
            deadline = time.monotonic() + 60
            while channel.connection is not None and time.monotonic() < deadline:
                time.sleep(0.01)
            records.rpush(noted_in, "let through" if channel.connection is None else "let through (timed out)")
            asked(self, p, *args, **kwargs)

        threading.Thread(target=let_through, name="csb-late-slot-ack", daemon=True).start()
        return None

    Consumer.call_soon_ack = call_soon_ack


_late_slot_ack_hook()


@app.task(bind=True, base=SingletonTask, unique_on=["key"])
def step(self: SingletonTask, key: str, note: str = "", fail: bool = False) -> str:
    """One run on ``key``; raises ValueError after recording it when ``fail``."""
    return _run(self, key, note, fail)


@app.task(bind=True, base=SingletonTask, unique_on=["key"], ignore_result=True)
def quiet(self: SingletonTask, key: str, note: str = "", fail: bool = False) -> str:
    """``step`` that stores no result: its end is seen only through task events."""
    return _run(self, key, note, fail)


@app.task(bind=True, base=SingletonTask, unique_on=["key"], acks_late=True)
def late(self: SingletonTask, key: str, note: str = "", fail: bool = False) -> str:
    """``step`` acknowledged after its run: its release leaves a done marker."""
    return _run(self, key, note, fail)


@task_postrun.connect
def _ended(task_id: str, **_: object) -> None:
    """``ended:<task id>``: the run's whole ending (release, result store) is behind it."""
    record_client(BASE).set(f"ended:{task_id}", "1")


def _run(self: SingletonTask, key: str, note: str, fail: bool) -> str:
    records = record_client(BASE)
    records.set(f"running:{key}", self.request.id)
    deadline = time.monotonic() + 60
    while records.exists(f"hold:{key}") and time.monotonic() < deadline:
        time.sleep(0.01)
    records.rpush(f"runs:{key}", json.dumps({"task_id": self.request.id, "note": note}))
    if fail:
        raise ValueError(f"{key} fails")
    return key


@app.task
def plain(note: str = "") -> str:
    """A plain Celery task (no lock): a follower that adds no lock traffic of its own."""
    return note


@app.task
def noted(key: str, note: str) -> str:
    """A plain task that records its run: ``note`` is appended to ``noted:<key>``, in run order."""
    record_client(BASE).rpush(f"noted:{key}", note)
    return note


@app.task
def waits(key: str) -> str:
    """A plain task (acknowledged as it starts) that runs while ``hold:<key>`` is set (at most 60 s)."""
    return _wait(key)


@app.task(acks_late=True)
def waits_late(key: str) -> str:
    """``waits``, acknowledged after its run."""
    return _wait(key)


def _wait(key: str) -> str:
    records = record_client(BASE)
    records.rpush(f"waiting:{key}", "1")
    deadline = time.monotonic() + 60
    while records.exists(f"hold:{key}") and time.monotonic() < deadline:
        time.sleep(0.01)
    return key

"""A lock's value: who holds it, written by its holder and read by everyone else.

A lock is one Redis string key whose value records who holds it::

    {"v":2,"token":"<per attempt>","task_id":"<id>","at":1700000000.123,"task":"<name>",
     "node":"<worker>","pid":123,"boot":"<worker incarnation>","claim":false,"live":true,
     "ttl":60000,"every":3333}

The token tells attempts apart: only the attempt that wrote a value may renew
or release it, and a request sent again after its reply was lost recognises
its own value (:func:`.commands.finds_own`). ``ttl`` and ``every``
(milliseconds) say how long the lease lasts and how often its keeper renews
it: a reader can tell from the key's remaining TTL when it was last renewed
(:mod:`.takeover`). Values are decoded tolerantly: tools show foreign or
damaged values with empty fields.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .spec import LockSpec, ms

__all__ = ["VALUE_FORMAT", "Holder", "claim_value", "describe_holder", "done_key", "lock_value", "parse_holder",
           "text_of"]

VALUE_FORMAT = 2


def done_key(key: str, task_id: str | None) -> str:
    """The marker that ``task_id`` completed a run under ``key`` (same Redis Cluster slot).

    Written on release for tasks with ``acks_late`` (the only ones whose
    message can be delivered again after their run); a later copy of the same
    message finds it and ends without running.
    """
    return f"{key}:done:{task_id or ''}"


def text_of(value: Any) -> str:
    """A reply or a value as text."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class Holder:
    """Who holds a lock, as recorded in its value."""

    task_id: str | None
    task: str | None
    node: str | None
    pid: int | None
    boot: str | None
    acquired_at: float | None
    #: The fencing token, in values written by 0.2 (0.3 does not store it: a run's
    #: token is its acquisition's reply, ``task.singleton_run.fence``).
    fence: int | None
    claim: bool
    token: str | None
    #: The holder's worker publishes a liveness key (see :mod:`.liveness`).
    live: bool = False
    #: The lock's value exactly as stored (for compare-and-delete).
    raw: str | None = None
    #: The lease in seconds and how often its keeper renews it (None in values of 0.2).
    ttl: float | None = None
    every: float | None = None

    @property
    def is_claim(self) -> bool:
        """True for a publish-time claim that waits for its run to start."""
        return self.claim


def parse_holder(raw: bytes | str | None) -> Holder | None:
    """Decode a lock value; tolerant of foreign or damaged values (fields become None)."""
    if raw is None:
        return None
    text = text_of(raw)
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError
    except ValueError:
        data = {}

    def seconds(name: str) -> float | None:
        value = data.get(name)
        return value / 1000 if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    return Holder(
        task_id=data.get("task_id"),
        task=data.get("task"),
        node=data.get("node"),
        pid=data.get("pid"),
        boot=data.get("boot"),
        acquired_at=data.get("at"),
        fence=data.get("fence"),
        claim=bool(data.get("claim", False)),
        token=data.get("token"),
        live=bool(data.get("live", False)),
        raw=text,
        ttl=seconds("ttl"),
        every=seconds("every"),
    )


# -------------------------------------------------------------------- writing values


_HOSTNAME = socket.gethostname()


def lock_value(spec: LockSpec, task_id: str | None, node: str | None) -> str:
    """A new lock value (JSON, see the module docstring): a fresh token, this run's id and time.

    Built from a cached tail: encoding the whole record each run cost more than its round trip.
    """
    return (f'{{"v":{VALUE_FORMAT},"token":"{_tokens()}","task_id":{_json_str(task_id)},'
            f'"at":{time.time():.3f},{_value_tail(spec, node or _HOSTNAME, _tokens.pid)}')


def claim_value(value: str, claim_ttl: float) -> str:
    """``value`` turned into a publish-time claim of the same task id, lasting ``claim_ttl``
    (a retried ``until_executed`` run: its lock covers the retry while it is queued)."""
    record = json.loads(value)
    record.update(claim=True, at=round(time.time(), 3), live=False, ttl=ms(claim_ttl))
    record.pop("every", None)
    return json.dumps(record, separators=(",", ":"))


def _value_tail(spec: LockSpec, node: str, pid: int) -> str:
    """The fields of a lock value that are the same for every run of a task in a process."""
    tail = spec.tails.get((node, pid))
    if tail is None:
        tail = spec.tails[(node, pid)] = _encode_tail(spec, node, pid)
    return tail


def _encode_tail(spec: LockSpec, node: str, pid: int) -> str:
    record: dict[str, Any] = {"task": spec.task, "node": node, "pid": pid, "boot": spec.boot,
                              "claim": spec.claim}
    if spec.live:
        record["live"] = True
    record["ttl"] = spec.ttl_ms
    if not spec.claim:
        record["every"] = ms(spec.renew_every)
    return json.dumps(record, separators=(",", ":"))[1:]


class _Tokens:
    """Tokens unique to one attempt: 48 random bits drawn once per process, then a counter.

    A token only has to tell attempts apart (who may renew or release); it is
    no secret. Drawing it from the OS per attempt cost a system call per run.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.prefix = secrets.token_hex(6)
        self.counter = itertools.count(1)

    def __call__(self) -> str:
        return f"{self.prefix}{next(self.counter):012x}"


_tokens = _Tokens()


def _new_tokens_in_child() -> None:
    """A forked child draws its own random part (and knows its own pid)."""
    global _tokens
    _tokens = _Tokens()


os.register_at_fork(after_in_child=_new_tokens_in_child)


def _json_str(text: str | None) -> str:
    """``json.dumps`` of a task id, without the encoder's set-up (it runs per acquire)."""
    return "null" if text is None else _encode_str(text) if isinstance(text, str) else json.dumps(text)


_encode_str: Callable[[str], str] = json.encoder.encode_basestring


def describe_holder(holder: Holder | None) -> str:
    """A short human description of a lock holder for log lines."""
    if holder is None:
        return "an unknown holder"
    return f"task {holder.task_id} on {holder.node} (pid {holder.pid})"

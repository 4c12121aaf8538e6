"""The lease: acquire, renew, release and fence one Redis lock.

A lock is one Redis string key whose value records who holds it::

    {"v":1,"token":"<per attempt>","task":"<name>","task_id":"<id>","node":"<worker>",
     "pid":123,"boot":"<worker incarnation>","at":1700000000.123,"claim":false,
     "fence":1700000000123456}

* **acquire** is one round trip: a Lua script that does ``SET NX PX`` and bumps
  the key's fencing counter. The counter lives beside the lock (same hash tag)
  and is seeded from the Redis clock when it is first created, so fencing tokens
  keep growing even after the counter key expires.
* **renew** and **release** are one round trip each and compare the whole value:
  only the attempt that wrote it can extend or delete it, so a run whose lease
  expired and was taken by another can never cut the new holder's lease short.
* **release_task** deletes a lock only if a given task id holds it; the worker's
  main process uses it for pool children that died without releasing.

The scripts are in :mod:`.scripts`; they run with EVALSHA and are loaded on
``NOSCRIPT`` (after a Redis restart or on a new replica), so the script text
crosses the network once per server.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .channel import channel_or_none
from .client import RedisClient, call_acknowledged
from .liveness import is_alive
from .scripts import ACQUIRE, RELEASE, RELEASE_TASK, RENEW, STATS_TTL_MS, LuaScript

__all__ = [
    "AcquireResult",
    "Holder",
    "Lease",
    "LuaScript",
    "acquire",
    "done_key",
    "fence_key",
    "parse_holder",
    "release_task",
    "release_value",
]

VALUE_FORMAT = 1




def fence_key(key: str) -> str:
    """The fencing counter beside ``key`` (same Redis Cluster slot)."""
    return f"{key}:fence"


def done_key(key: str, task_id: str | None) -> str:
    """The marker that ``task_id`` completed a run under ``key`` (same Redis Cluster slot).

    Written on release for tasks with ``acks_late`` (the only ones whose
    message can be delivered again after their run); a later copy of the same
    message finds it and ends without running.
    """
    return f"{key}:done:{task_id or ''}"


@dataclass(frozen=True)
class Holder:
    """Who holds a lock, as recorded in its value."""

    task_id: str | None
    task: str | None
    node: str | None
    pid: int | None
    boot: str | None
    acquired_at: float | None
    fence: int | None
    claim: bool
    token: str | None
    #: The holder's worker publishes a liveness key (see :mod:`.liveness`).
    live: bool = False
    #: The lock's value exactly as stored (for compare-and-delete).
    raw: str | None = None

    @property
    def is_claim(self) -> bool:
        """True for a publish-time claim that waits for its run to start."""
        return self.claim


def parse_holder(raw: bytes | str | None) -> Holder | None:
    """Decode a lock value; tolerant of foreign or damaged values (fields become None)."""
    if raw is None:
        return None
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError
    except ValueError:
        data = {}
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
    )


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _keys(key: str, stats_key: str | None) -> list[str]:
    return [key, stats_key] if stats_key else [key]


def _release_keys(key: str, task_id: str | None, stats_key: str | None) -> list[str]:
    """KEYS of the release script: the lock, the task id's done marker, the counters."""
    return [key, done_key(key, task_id), *([stats_key] if stats_key else [])]


class Lease:
    """A lock held by this process: renew it, release it, read its fencing token."""

    def __init__(self, client: RedisClient, key: str, value: str, ttl: float, fence: int,
                 stats_key: str | None = None, task_id: str | None = None) -> None:
        self.client = client
        self.key = key
        self.stats_key = stats_key
        self.value = value
        self.ttl = ttl
        self.fence = fence
        #: The task id in ``value`` (its done marker is released with the lock).
        self.task_id = task_id if task_id is not None else (parse_holder(value) or _NO_HOLDER).task_id
        #: Monotonic time until which the lease is known to be valid.
        self.valid_until = time.monotonic() + ttl

    @functools.cached_property
    def holder(self) -> Holder | None:
        """The lock's value, decoded (on first use: runs never need it)."""
        return parse_holder(self.value)

    def renew(self) -> bool:
        """Extend the lease by ``ttl``; False if the lock is no longer ours.

        Raises ``redis.RedisError`` when Redis cannot be asked; the caller
        decides (the keeper keeps trying until the lease would have expired).
        """
        started = time.monotonic()
        renewed = bool(RENEW(self.client, _keys(self.key, self.stats_key),
                              [self.value, _ms(self.ttl), STATS_TTL_MS]))
        if renewed:
            self.valid_until = started + self.ttl
        return renewed

    def release(self, *, done_ttl: float | None = None, claim_ttl: float | None = None) -> bool:
        """Give the lock up if it is still ours; True if it was (else counted as lost).

        ``done_ttl``: also leave this task id's done marker for that long.
        ``claim_ttl``: instead of deleting the lock, turn it into a publish-time
        claim of the same task id for that long (a retry of an
        ``until_executed`` task stays covered while it waits in the queue).
        """
        replacement = ""
        if claim_ttl is not None:
            record = json.loads(self.value)
            record.update(claim=True, at=round(time.time(), 3), live=False)
            record.pop("fence", None)
            replacement = json.dumps(record, separators=(",", ":"))
        return bool(RELEASE(self.client, self._release_keys(),
                             self._release_args(done_ttl, replacement, claim_ttl)))

    def release_soon(self, on_result: Callable[[bool | None, BaseException | None], None], *,
                     done_ttl: float | None = None) -> bool:
        """Release without waiting for the reply; False when that is not possible here.

        The release is written at once (Redis frees the key as soon as it reads
        it); its reply -- was the lock still ours? -- reaches ``on_result`` when
        this thread next waits for a lock reply (its next acquire), or at the
        latest :data:`.channel.FLUSH_AFTER` later. Only for clients with a
        :mod:`.channel` (standalone Redis, real threads); raises
        ``redis.RedisError`` if the command could not be written.
        """
        channel = channel_or_none(self.client)
        if channel is None:
            return False

        def handle(reply: Any, error: BaseException | None) -> None:
            on_result(None if error is not None else bool(reply), error)

        channel.send(RELEASE, self._release_keys(), self._release_args(done_ttl, "", None), handle)
        return True

    def _release_keys(self) -> list[str]:
        return _release_keys(self.key, self.task_id, self.stats_key)

    def _release_args(self, done_ttl: float | None, replacement: str,
                      claim_ttl: float | None) -> list[Any]:
        """ARGV of the release script for this lease (see ``RELEASE``)."""
        return [self.value, "released", "lost", _ms(done_ttl) if done_ttl else "",
                replacement, _ms(claim_ttl) if claim_ttl else "", STATS_TTL_MS]

    def __repr__(self) -> str:
        return f"<Lease {self.key} fence={self.fence} ttl={self.ttl}s>"


@dataclass(frozen=True)
class AcquireResult:
    """The outcome of :func:`acquire`.

    ``lease`` when taken; else ``holder`` (who holds it, and ``holder_ttl``)
    or ``completed`` (the done marker of this task id exists). ``taken_over``
    names the dead holder whose lock was taken over, if any.
    """

    lease: Lease | None
    holder: Holder | None = None
    holder_ttl: float | None = None
    completed: bool = False
    taken_over: Holder | None = None

    @property
    def acquired(self) -> bool:
        return self.lease is not None


_HOSTNAME = socket.gethostname()
_NO_HOLDER = Holder(None, None, None, None, None, None, None, False, None)


@functools.lru_cache(maxsize=256)
def _value_tail(task: str, node: str, pid: int, boot: str | None, claim: bool, live: bool) -> str:
    """The fields of a lock value that are the same for every run of a task in a process."""
    record: dict[str, Any] = {"task": task, "node": node, "pid": pid, "boot": boot, "claim": claim}
    if live:
        record["live"] = True
    return json.dumps(record, separators=(",", ":"))[1:]


def _lock_value(task: str, task_id: str | None, node: str, boot: str | None, claim: bool,
                live: bool) -> str:
    """A new lock value (JSON, see the module docstring): a fresh token, this run's id and time.

    Built from a cached tail: encoding the whole record each run cost more than its round trip.
    """
    return (f'{{"v":{VALUE_FORMAT},"token":"{_token()}","task_id":{_json_str(task_id)},'
            f'"at":{time.time():.3f},{_value_tail(task, node, os.getpid(), boot, claim, live)}')


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


def _token() -> str:
    """The next token of this process (a forked child draws its own random part)."""
    global _tokens
    if _tokens.pid != os.getpid():
        _tokens = _Tokens()
    return _tokens()


def _json_str(text: str | None) -> str:
    """``json.dumps`` of a task id, without the encoder's set-up (it runs per acquire)."""
    return "null" if text is None else _encode_str(text) if isinstance(text, str) else json.dumps(text)


_encode_str: Callable[[str], str] = json.encoder.encode_basestring


def acquire(
    client: RedisClient,
    key: str,
    ttl: float,
    *,
    task: str,
    task_id: str | None,
    node: str | None = None,
    boot: str | None = None,
    live: bool = False,
    claim: bool = False,
    adopt_claim_of: str | None = None,
    check_done: bool = False,
    liveness_prefix: str | None = None,
    stats_key: str | None = None,
    counters: tuple[str, str] = ("acquired", "skipped"),
    wait_replicas: int = 0,
    wait_timeout: float = 1.0,
) -> AcquireResult:
    """Try once to take ``key`` for ``ttl`` seconds (one round trip when free).

    ``claim=True`` writes a publish-time claim (held for a queued message,
    not renewed). ``adopt_claim_of`` lets the run of that task id take over
    its own publish-time claim instead of conflicting with it.
    ``check_done`` refuses when this task id's done marker exists.
    ``liveness_prefix``: when the lock is held by a worker incarnation that
    publishes liveness and its liveness key is gone, the holder is dead and
    the lock is taken over (one ``EXISTS`` and one more script call, both
    only on that path); the compare is on the holder's exact value, so a lock
    re-taken meanwhile is left alone. With ``stats_key``, the outcome is
    counted there in the same round trip: ``counters`` names the field for
    "taken" and the one for "held by another". With ``wait_replicas``, a taken
    lock must reach that many replicas within ``wait_timeout`` (``WAIT``),
    else it is given back and
    :class:`~celery_singleton_beat.client.ReplicasNotAcknowledged` (a
    ``RedisError``: "Redis unavailable") is raised.
    """
    encoded = _lock_value(task, task_id, node or _HOSTNAME, boot, claim, live)
    ttl_ms = _ms(ttl)
    keys = [key, fence_key(key), done_key(key, task_id)]
    if stats_key:
        keys.append(stats_key)
    args: list[Any] = [encoded[:-1], ttl_ms, max(ttl_ms * 2, 10_000), adopt_claim_of or "", counters[0],
                       counters[1], "", "1" if check_done else "", task_id or "", STATS_TTL_MS]
    # Standalone Redis without WAIT: one round trip, which also reads the reply
    # of this thread's last release (see :mod:`.channel`).
    channel = channel_or_none(client) if wait_replicas <= 0 else None
    attempt = _Attempt(client, channel, key, keys, args, ttl, stats_key, task_id, wait_replicas, wait_timeout)
    result = attempt()
    holder = result.holder
    if (liveness_prefix is None or holder is None or not holder.live or holder.claim
            or not holder.boot or is_alive(client, liveness_prefix, holder.boot)):
        return result
    args[6] = holder.raw or ""  # take over exactly that value
    taken = attempt()
    if taken.acquired:
        return AcquireResult(lease=taken.lease, taken_over=holder)
    return taken


@dataclass(slots=True)
class _Attempt:
    """One call of the acquire script with prepared KEYS and ARGV (see ``ACQUIRE``)."""

    client: RedisClient
    channel: Any
    key: str
    keys: list[str]
    args: list[Any]
    ttl: float
    stats_key: str | None
    task_id: str | None
    wait_replicas: int
    wait_timeout: float

    def __call__(self) -> AcquireResult:
        keys, args = self.keys, self.args
        if self.channel is not None:
            status, value, extra = self.channel.call(ACQUIRE, keys, args)
        else:
            status, value, extra = call_acknowledged(
                self.client, self.key, lambda conn: ACQUIRE(conn, keys, args),
                replicas=self.wait_replicas, timeout=self.wait_timeout, undo=self._give_back,
            )
        if status == 2:
            return AcquireResult(lease=None, completed=True)
        text = value.decode("utf-8") if isinstance(value, bytes) else value
        if status == 1:
            return AcquireResult(lease=Lease(self.client, self.key, text, self.ttl, int(extra), self.stats_key,
                                             self.task_id or ""))
        pttl = int(extra)
        return AcquireResult(lease=None, holder=parse_holder(text), holder_ttl=pttl / 1000 if pttl > 0 else None)

    def _give_back(self, conn: Any, reply: Any) -> None:
        """Undo a taken lock that did not reach its replicas (``WAIT``)."""
        if reply[0] == 1:
            RELEASE(conn, _release_keys(self.key, self.task_id, self.stats_key),
                     [reply[1], "unacknowledged", "", "", "", "", STATS_TTL_MS])


def release_value(client: RedisClient, key: str, value: bytes | str, *, stats_key: str | None = None,
                  counter: str = "released") -> bool:
    """Delete ``key`` if its value is still exactly ``value`` (compare-and-delete)."""
    return bool(RELEASE(client, _release_keys(key, None, stats_key),
                         [value, counter, "", "", "", "", STATS_TTL_MS]))


def release_task(client: RedisClient, key: str, task_id: str, *, stats_key: str | None = None,
                 counter: str = "released") -> bool:
    """Delete ``key`` if the task ``task_id`` holds it (run lease or publish claim)."""
    return bool(RELEASE_TASK(client, _keys(key, stats_key), [task_id, counter, STATS_TTL_MS]))


def read_holder(client: RedisClient, key: str) -> Holder | None:
    """The current holder of ``key``, or None if it is free."""
    return parse_holder(client.get(key))

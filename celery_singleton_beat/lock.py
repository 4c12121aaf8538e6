"""The lease: acquire, renew, release and fence one Redis lock.

A lock is one Redis string key whose value records who holds it::

    {"v":2,"token":"<per attempt>","task_id":"<id>","at":1700000000.123,"task":"<name>",
     "node":"<worker>","pid":123,"boot":"<worker incarnation>","claim":false,"live":true,
     "ttl":60000,"every":3333}

* **acquire** is one write with no Lua and no ``MULTI``
  (:func:`.commands.acquire_request`): ``SET NX PX GET`` (on 6.2: ``SET NX PX``
  then ``GET``), then ``TIME``. The fencing token is the server's clock in
  microseconds right behind the ``SET``: it grows with every acquisition of a
  key, across restarts and failovers.
* **renew** and **release** compare the whole value (natively where the server
  can, else in Lua): only the attempt that wrote it can extend or delete it, so
  a run whose lease expired and was taken by another never cuts the new
  holder's lease short.
* **rare paths**, after the reply named another holder: a run adopting its own
  publish claim, a repeated request finding its own value, and the take-over
  of a holder that is provably dead (:func:`_take_over`).

``ttl`` and ``every`` (milliseconds) say how long the lease lasts and how
often its keeper renews it: a reader can tell from the key's remaining TTL
when it was last renewed.
"""

from __future__ import annotations

import enum
import functools
import itertools
import json
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import counters
from .channel import channel_or_none
from .client import RedisClient, ReplicasNotAcknowledged
from .commands import (
    NativeRefused,
    acquire_request,
    look_request,
    put_back_request,
    release_request,
    renew_request,
    script_request,
    time_token,
)
from .events import logger
from .liveness import boot_id, is_alive
from .scripts import ADOPT, CLAIM_ON_RETRY, RELEASE_FOR, TAKE_OVER
from .server import PORTABLE, ServerInfo, server_of
from .wire import Request, pack, run_on, run_pooled

__all__ = [
    "TAKEOVER_WAIT",
    "AcquireResult",
    "Holder",
    "Lease",
    "LockSpec",
    "Renewal",
    "acquire",
    "done_key",
    "parse_holder",
    "read_holder",
    "release_for",
    "release_value",
]

VALUE_FORMAT = 2

#: Seconds a worker watches a lock whose holder looks dead (liveness key gone,
#: renewals missed) before taking it over: a holder that is alive renews within
#: it (its keeper retries every quarter second while Redis does not answer: four
#: tries), so a lock that merely could not be renewed during an outage is never
#: taken. It is what a dead pod's lock costs on top of the liveness TTL.
TAKEOVER_WAIT = 1.0
#: Seconds between renewal attempts while Redis does not answer (at most).
RETRY_EVERY = 0.25


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
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
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


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


@dataclass(frozen=True)
class LockSpec:
    """How a task takes its lock: what is the same for every run (built once per task and settings).

    ``live``: the process publishes liveness (a worker), so its locks are
    renewed at least every ``liveness_ttl / 3`` and may be taken over once
    its worker is provably dead. ``liveness_prefix``: take over dead holders
    (None: never). ``check_done``: refuse when this task id's done marker
    exists (``acks_late``). ``claim``: a publish-time claim (held for a
    queued message, not renewed). ``counters``: the counter for "taken" and
    the one for "held by another". ``wait_replicas``: a taken lock must reach
    that many replicas within ``wait_timeout`` (``WAIT``), else it is given
    back and :class:`~.client.ReplicasNotAcknowledged` raised.
    """

    task: str
    ttl: float
    boot: str | None = None
    live: bool = False
    liveness_ttl: float = 10.0
    liveness_prefix: str | None = None
    check_done: bool = False
    claim: bool = False
    stats_key: str | None = None
    counters: tuple[str, str] = ("acquired", "skipped")
    wait_replicas: int = 0
    wait_timeout: float = 1.0
    ttl_ms: int = field(init=False, repr=False)
    #: Seconds between two renewals by the keeper.
    renew_every: float = field(init=False, repr=False)
    #: Seconds after a renewal's start for which the holder vouches for its lease:
    #: the earliest moment another worker could take it over (or the TTL).
    grace: float = field(init=False, repr=False)
    #: The end of its lock values per (node, pid): the same for every run (see :func:`_lock_value`).
    tails: dict[tuple[str, int], str] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ttl_ms", _ms(self.ttl))
        every = min(self.ttl, self.liveness_ttl) / 3 if self.live else self.ttl / 3
        object.__setattr__(self, "renew_every", every)
        grace = min(self.ttl, 2 * every + TAKEOVER_WAIT) if self.live else self.ttl
        object.__setattr__(self, "grace", grace)
        object.__setattr__(self, "tails", {})


_HOSTNAME = socket.gethostname()


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
        record["every"] = _ms(spec.renew_every)
    return json.dumps(record, separators=(",", ":"))[1:]


def _lock_value(spec: LockSpec, task_id: str | None, node: str | None) -> str:
    """A new lock value (JSON, see the module docstring): a fresh token, this run's id and time.

    Built from a cached tail: encoding the whole record each run cost more than its round trip.
    """
    return (f'{{"v":{VALUE_FORMAT},"token":"{_tokens()}","task_id":{_json_str(task_id)},'
            f'"at":{time.time():.3f},{_value_tail(spec, node or _HOSTNAME, _tokens.pid)}')


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


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


# -------------------------------------------------------------------- running requests


def _execute(client: RedisClient, key: str, build: Callable[[ServerInfo], Request], *,
             pooled: bool = False, before_write: Callable[[], Any] | None = None,
             after: Callable[[Any, Any], Any] | None = None) -> Any:
    """Run the request ``build`` makes for the server: on this thread's channel where it has
    one (and ``pooled`` and ``after`` are not asked for), else on a pooled connection."""
    server = server_of(client)
    for attempt in (1, 2):
        request = build(server.info or PORTABLE)
        try:
            channel = None if pooled or after is not None else channel_or_none(client)
            if channel is not None:
                return channel.call(request, before_write)
            return run_pooled(client, key, request, after=after, before_write=before_write)
        except NativeRefused as exc:
            if attempt == 2:
                raise
            logger.warning("the lock Redis refused a native command (%s); using the portable ones", exc)
            server.downgrade()
    raise AssertionError("unreachable")


def _acknowledged(spec: LockSpec, key: str, value: str, taken: Callable[[Any], bool]) -> Callable[[Any, Any], Any]:
    """``after`` for :func:`_execute`: a taken lock must reach ``spec.wait_replicas`` replicas."""
    def after(link: Any, result: Any) -> Any:
        if not taken(result):
            return result
        link.send(pack(b"WAIT", spec.wait_replicas, _ms(spec.wait_timeout)))
        reply = link.read()
        if isinstance(reply, Exception):
            raise reply
        acknowledged = int(reply)
        if acknowledged < spec.wait_replicas:
            run_on(link, release_request(PORTABLE, key, value))
            raise ReplicasNotAcknowledged(key, acknowledged, spec.wait_replicas, spec.wait_timeout)
        return result

    return after


# -------------------------------------------------------------------- the lease


class Lease:
    """A lock held by this process: renew it, release it, read its fencing token."""

    def __init__(self, client: RedisClient, key: str, value: str, spec: LockSpec, fence: int,
                 task_id: str | None, started: float, epoch: int) -> None:
        self.client = client
        self.key = key
        self.value = value
        self.spec = spec
        self.ttl = spec.ttl
        self.fence = fence
        #: The task id in ``value`` (its done marker is released with the lock).
        self.task_id = task_id
        self._confirmed(started, epoch)

    def _confirmed(self, started: float, epoch: int) -> None:
        """The lock was ours (taken or renewed) at ``started`` (monotonic, before the request),
        under the server's ``epoch`` (read before the request too)."""
        #: Monotonic time until which the lock exists in Redis, if Redis keeps it.
        self.valid_until = started + self.spec.ttl
        #: Monotonic time until which no other worker can have taken the lock:
        #: ``ensure_held()`` passes only before it.
        self.vouched_until = started + self.spec.grace
        #: :attr:`.server.LockServer.epoch` when the lock was last known to be ours.
        self.epoch = epoch

    @functools.cached_property
    def holder(self) -> Holder | None:
        """The lock's value, decoded (on first use: runs never need it)."""
        return parse_holder(self.value)

    @property
    def renew_every(self) -> float:
        return self.spec.renew_every

    def renew(self, client: RedisClient | None = None) -> bool:
        """Extend the lease by ``ttl`` (putting it back where :meth:`may_put_back`); False
        if the lock is no longer ours.

        The keeper uses :meth:`renew_once` and :meth:`put_back` itself (it must not put
        back the lock of a run that ended meanwhile). Raises ``redis.RedisError`` when
        Redis cannot be asked.
        """
        outcome = self.renew_once(client)
        if outcome is Renewal.GONE and self.may_put_back(client):
            return self.put_back(client)
        return outcome is Renewal.RENEWED

    def renew_once(self, client: RedisClient | None = None) -> Renewal:
        """Extend the lease by ``ttl`` if the lock is still ours (compare-and-set).

        Raises ``redis.RedisError`` when Redis cannot be asked; the caller decides
        (the keeper keeps trying until the lease would have expired). ``client``:
        another client of the same server to send it through (the keeper's own, in
        greenlet pools).
        """
        started = time.monotonic()
        spec = self.spec
        via = client or self.client
        epoch = server_of(via).epoch
        outcome = _execute(via, self.key, lambda info: renew_request(info, self.key, self.value, spec.ttl_ms),
                           pooled=True)
        if outcome is None:  # native SET IFEQ does not say why: ask
            current, _, _ = _execute(via, self.key, lambda info: look_request(self.key), pooled=True)
            outcome = 0 if current is not None else -1
        if outcome == 1:
            self._confirmed(started, epoch)
            counters.count(self.client, spec.stats_key, "renewed")
            return Renewal.RENEWED
        return Renewal.HELD_BY_ANOTHER if outcome == 0 else Renewal.GONE

    def may_put_back(self, client: RedisClient | None = None) -> bool:
        """The lock is gone, and that may be the server's doing, not a holder's: since this
        lease was last confirmed, the process found the data on a server that may lack
        it (restarted without an append-only file, a promoted replica), and the lease
        has not ended on this process's clock."""
        return server_of(client or self.client).epoch > self.epoch and time.monotonic() < self.valid_until

    def put_back(self, client: RedisClient | None = None) -> bool:
        """Write the lock back into a server that lost it (``SET NX``); True if it was still free.

        Only for a lease that is still kept, when :meth:`may_put_back` says so.
        """
        started = time.monotonic()
        via = client or self.client
        server = server_of(via)
        epoch = server.epoch
        if not _execute(via, self.key, lambda info: put_back_request(info, self.key, self.value, self.spec.ttl_ms),
                        pooled=True):
            return False
        self._confirmed(started, epoch)
        logger.warning("put lock %s back after the lock Redis lost it (%s)", self.key,
                       server.recovery_reason or "restarted or failed over")
        counters.count(self.client, self.spec.stats_key, "put_back")
        counters.count(self.client, self.spec.stats_key, "renewed")
        return True

    def release(self, *, done_ttl: float | None = None, claim_ttl: float | None = None) -> bool | None:
        """Give the lock up if it is still ours; True if it was (else counted as lost), None
        if unknown (sent again after a lost reply, it found nothing: the first may have run).

        ``done_ttl``: also leave this task id's done marker for that long.
        ``claim_ttl``: instead of deleting the lock, turn it into a publish-time
        claim of the same task id for that long (a retry of an
        ``until_executed`` task stays covered while it waits in the queue).
        """
        if claim_ttl is not None:
            record = json.loads(self.value)
            record.update(claim=True, at=round(time.time(), 3), live=False, ttl=_ms(claim_ttl))
            record.pop("every", None)
            replacement = json.dumps(record, separators=(",", ":"))
            released = bool(_execute(self.client, self.key, lambda info: script_request(
                CLAIM_ON_RETRY.command([self.key], [self.value, replacement, _ms(claim_ttl)]), CLAIM_ON_RETRY,
                _first_int)))
        else:
            released = _execute(self.client, self.key, lambda info: self._release_request(info, done_ttl))
        self.count_release(released)
        return released

    def count_release(self, released: bool | None) -> None:
        if released is not None:
            counters.count(self.client, self.spec.stats_key, "released" if released else "lost")

    def release_soon(self, on_result: Callable[[bool | None, BaseException | None], None], *,
                     done_ttl: float | None = None, wait: bool = False) -> bool:
        """Release without waiting for the reply; False when that is not possible here.

        The release is written at once (Redis frees the key as soon as it reads
        it); its reply -- was the lock still ours? -- reaches ``on_result`` when
        this thread next waits for a lock reply (its next acquire), or at the
        latest :data:`.channel.FLUSH_AFTER` later. ``wait``: read it now, so
        that the release has run when this returns. Only for clients with a
        :mod:`.channel` (standalone Redis, real threads); raises
        ``redis.RedisError`` if the request could not be written.
        """
        channel = channel_or_none(self.client)
        if channel is None:
            return False
        server = server_of(self.client)

        def handle(reply: Any, error: BaseException | None) -> None:
            if isinstance(error, NativeRefused):  # once per process at most: portable, at once
                server.downgrade()
                reply, error = run_pooled(self.client, self.key, self._release_request(PORTABLE, done_ttl)), None
            released = None if error is not None or reply is None else bool(reply)
            self.count_release(released)
            on_result(released, error)

        channel.send(self._release_request(server.info or PORTABLE, done_ttl), handle)
        if wait:
            channel.flush()
        return True

    def _release_request(self, info: ServerInfo, done_ttl: float | None) -> Request:
        done = done_key(self.key, self.task_id) if done_ttl else None
        return release_request(info, self.key, self.value, done, _ms(done_ttl) if done_ttl else None)

    def __repr__(self) -> str:
        return f"<Lease {self.key} fence={self.fence} ttl={self.ttl}s>"


def _first_int(replies: list[Any]) -> int:
    if isinstance(replies[0], Exception):
        raise replies[0]
    return int(replies[0])


class Renewal(enum.Enum):
    """What one renewal found."""

    RENEWED = "renewed"
    #: Another value holds the key (taken over, or another run's lock).
    HELD_BY_ANOTHER = "held by another"
    #: The key is gone (released, expired, deleted, or lost by the server).
    GONE = "gone"


class AcquireResult:
    """The outcome of :func:`acquire`.

    ``lease`` when taken; else ``holder`` (who holds it) or ``completed``
    (the done marker of this task id exists). ``taken_over`` names the dead
    holder whose lock was taken over, if any.
    """

    __slots__ = ("completed", "holder", "lease", "taken_over")

    def __init__(self, lease: Lease | None, holder: Holder | None = None, completed: bool = False,
                 taken_over: Holder | None = None) -> None:
        self.lease = lease
        self.holder = holder
        self.completed = completed
        self.taken_over = taken_over

    @property
    def acquired(self) -> bool:
        return self.lease is not None

    def __repr__(self) -> str:
        return (f"AcquireResult(lease={self.lease!r}, holder={self.holder!r}, completed={self.completed}, "
                f"taken_over={self.taken_over!r})")


def acquire(client: RedisClient, key: str, spec: LockSpec, task_id: str | None, *,
            node: str | None = None, adopt_claim_of: str | None = None) -> AcquireResult:
    """Try once to take ``key`` as ``spec`` says (one request when it is free).

    ``adopt_claim_of`` lets the run of that task id take over its own
    publish-time claim instead of conflicting with it. Counted (in batches,
    see :mod:`.counters`) under ``spec.counters``.
    """
    server = server_of(client)
    value = _lock_value(spec, task_id, node)
    done = done_key(key, task_id) if spec.check_done else None
    channel = channel_or_none(client) if spec.wait_replicas <= 0 else None
    for _ in range(3):  # 6.2 only: the key freed between its SET NX and GET (ask again)
        started = time.monotonic()
        epoch = server.epoch
        if channel is not None:  # the common path: this thread's own connection
            token, taken, previous, completed = channel.call(
                acquire_request(server.info or PORTABLE, key, value, spec.ttl_ms, done), server.pause)
        else:
            token, taken, previous, completed = _execute(
                client, key, lambda info: acquire_request(info, key, value, spec.ttl_ms, done),
                before_write=server.pause,
                after=_acknowledged(spec, key, value, lambda r: r[1]) if spec.wait_replicas > 0 else None)
        taken = taken or _text(previous) == value  # its own value: the request ran twice
        if taken or previous is not None:
            break
    if completed:
        if taken:
            _execute(client, key, lambda info: release_request(info, key, value))
        counters.count(client, spec.stats_key, "completed_copies")
        return AcquireResult(None, completed=True)
    if taken:
        counters.count(client, spec.stats_key, spec.counters[0])
        started = max(started, server.resumed())  # written after a window's wait, if it waited
        return AcquireResult(Lease(client, key, value, spec, token, task_id, started, epoch))
    holder = parse_holder(previous)
    assert holder is not None
    if adopt_claim_of and holder.claim and holder.task_id == adopt_claim_of:
        lease = _replace(client, key, spec, task_id, ADOPT.command([key], [holder.raw, value, spec.ttl_ms]),
                         ADOPT, value)
        if lease is not None:
            counters.count(client, spec.stats_key, spec.counters[0])
            return AcquireResult(lease)
    elif spec.liveness_prefix is not None and _looks_dead(client, spec.liveness_prefix, holder):
        result = _take_over(client, key, spec, task_id, value, holder)
        if result is not None:
            return result
    counters.count(client, spec.stats_key,
                   "redelivered" if task_id and holder.task_id == task_id and not holder.claim else spec.counters[1])
    return AcquireResult(None, holder=holder)


def _replace(client: RedisClient, key: str, spec: LockSpec, task_id: str | None, command: tuple[Any, ...],
             script: Any, value: str) -> Lease | None:
    """Run a compare-and-replace script (ADOPT, TAKE_OVER); the lease if it replaced the holder."""
    def finish(replies: list[Any]) -> tuple[int, Any]:
        if isinstance(replies[0], Exception):
            raise replies[0]
        reply = replies[0]
        return (time_token(reply[1], reply[2]), None) if int(reply[0]) == 1 else (0, reply[1])

    after = _acknowledged(spec, key, value, lambda r: r[1] is None) if spec.wait_replicas > 0 else None
    started = time.monotonic()
    epoch = server_of(client).epoch
    token, current = _execute(client, key, lambda info: script_request(command, script, finish), after=after)
    if current is None and token:
        return Lease(client, key, value, spec, token, task_id, started, epoch)
    return None


def _looks_dead(client: RedisClient, prefix: str, holder: Holder) -> bool:
    """A first look: a worker's run lock whose worker's liveness key is gone (one ``EXISTS``)."""
    return (holder.live and not holder.claim and bool(holder.boot) and holder.boot != boot_id()
            and not is_alive(client, prefix, holder.boot or ""))


def _missed_renewals(holder: Holder, pttl: int) -> bool:
    """The lock's remaining TTL shows that its keeper missed a renewal.

    Renewed every ``every`` seconds back to ``ttl``: more than two intervals
    since the last renewal is a missed one. A value without these fields
    (written before 0.3) counts as missed: its liveness key alone decides, as
    it did then, after the wait of :data:`TAKEOVER_WAIT`.
    """
    if pttl < 0:
        return False  # gone meanwhile, or a key without expiry: not ours to take
    if holder.ttl is None or holder.every is None:
        return True
    return holder.ttl * 1000 - pttl > 2 * holder.every * 1000


def _take_over(client: RedisClient, key: str, spec: LockSpec, task_id: str | None, value: str,
               holder: Holder) -> AcquireResult | None:
    """Take the lock of a holder that is provably dead; None when it is not.

    Dead = its worker's liveness key is gone **and** the lock has missed its
    renewals **and** it stays unrenewed for :data:`TAKEOVER_WAIT` more
    seconds while this worker watches. A missing liveness key alone proves
    nothing (deleted, evicted, lost in a failover, or the worker's main
    process stalled while its pool child renews), and a lock that merely could
    not be renewed while Redis was down is renewed within the wait once Redis
    answers again.
    """
    assert spec.liveness_prefix is not None
    current, pttl, server_ms = _execute(client, key, lambda info: look_request(key))
    if current is None or _text(current) != holder.raw or not _missed_renewals(holder, pttl):
        return None
    time.sleep(TAKEOVER_WAIT)
    if is_alive(client, spec.liveness_prefix, holder.boot or ""):
        return None
    lease = _replace(client, key, spec, task_id,
                     TAKE_OVER.command([key], [holder.raw, pttl, server_ms, value, spec.ttl_ms]), TAKE_OVER, value)
    if lease is None:
        return None
    counters.count(client, spec.stats_key, "taken_over")
    counters.count(client, spec.stats_key, spec.counters[0])
    return AcquireResult(lease, taken_over=holder)


# -------------------------------------------------------------------- on someone else's behalf


def release_value(client: RedisClient, key: str, value: bytes | str, *, stats_key: str | None = None,
                  counter: str = "released") -> bool:
    """Delete ``key`` if its value is still exactly ``value`` (compare-and-delete)."""
    text = _text(value)
    released = bool(_execute(client, key, lambda info: release_request(info, key, text), pooled=True))
    if released:
        counters.count(client, stats_key, counter)
    return released


def release_for(client: RedisClient, key: str, task_id: str, *, boot: str | None = None, pid: int | None = None,
                claims_only: bool = False, stats_key: str | None = None, counter: str = "released") -> bool:
    """Delete ``key`` if it is held by exactly that holder: ``task_id``, and ``boot`` and
    ``pid`` where given; with ``claims_only``, only a publish-time claim of ``task_id``.

    For releases on someone else's behalf (a pool child that died, a copy of a
    message that was discarded): a task id alone is not an identity, since a
    redelivered copy of the message carries the same one.
    """
    released = bool(_execute(client, key, lambda info: script_request(
        RELEASE_FOR.command([key], [task_id, boot or "", "" if pid is None else pid, "1" if claims_only else ""]),
        RELEASE_FOR, _first_int), pooled=True))
    if released:
        counters.count(client, stats_key, counter)
    return released


def read_holder(client: RedisClient, key: str) -> Holder | None:
    """The current holder of ``key``, or None if it is free."""
    return parse_holder(client.get(key))

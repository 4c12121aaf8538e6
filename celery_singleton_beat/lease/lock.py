"""The lock of a run: acquire it once, as a lease, and everything a caller needs around it.

* **acquire** is one write with no Lua and no ``MULTI``
  (:func:`.commands.acquire_request`): ``SET NX PX GET`` (on 6.2: ``SET NX PX``
  then ``GET``), then ``TIME``. The fencing token is the server's clock in
  microseconds right behind the ``SET``: it grows with every acquisition of a
  key, across restarts and failovers. A copy of an ``acks_late`` message sends
  one script that reads its done marker first (:data:`.scripts.ACQUIRE_UNLESS_DONE`).
* **rare paths**, after the reply named another holder: a run adopting its own
  publish claim (one script), and the take-over of a holder that is provably
  dead (:mod:`.takeover`).

A request sent again after its reply was lost finds its own value and takes
it as success (:func:`.commands.finds_own`, for every compare-and-set).

What the lock is made of lives beside it, and is importable from here too:

* :mod:`.holder`: the value (who holds a lock), :class:`Holder`, :func:`done_key`;
* :mod:`.lease`: :class:`LockSpec`, :class:`Lease` (renew, put back, release);
* :mod:`.takeover`: the take-over of a dead worker's lock;
* :mod:`.behalf`: releases on someone else's behalf (:func:`release_for`,
  :func:`release_value`) and :func:`read_holder`.
"""

from __future__ import annotations

import time

from redis.exceptions import TryAgainError

from ..connection.channels import channel_or_none
from ..connection.client import RedisClient
from ..connection.green import green_channel_or_none
from ..recovery.server import PORTABLE, server_of
from . import counters
from .commands import AcquireReply, acquire_request, adopt_request, release_request
from .executor import execute
from .holder import Holder, done_key, lock_value, parse_holder
from .lease import Lease, acknowledged, replaced_lease
from .spec import LockSpec
from .stale import take_unconfirmed
from .takeover import looks_dead, take_over

__all__ = ["AcquireResult", "acquire"]


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
            node: str | None = None, adopt_claim_of: str | None = None, copy: bool = False) -> AcquireResult:
    """Try once to take ``key`` as ``spec`` says (one request when it is free).

    ``adopt_claim_of`` lets the run of that task id take over its own
    publish-time claim instead of conflicting with it. ``copy``: the delivery
    is known to repeat an earlier one (the broker redelivered it, or it is a
    copy re-published to wait for its original); with ``spec.check_done`` its
    done marker is read before the key is written, so a copy of a completed
    run never holds the key. Counted (in batches, see :mod:`.counters`) under
    ``spec.counters``.
    """
    server = server_of(client)
    value = lock_value(spec, task_id, node)
    done = done_key(key, task_id) if spec.check_done else None
    channel = (channel_or_none(client) or green_channel_or_none(client)) if spec.wait_replicas <= 0 else None
    for _ in range(3):  # 6.2 only: the key freed between its SET NX and GET (ask again)
        started = time.monotonic()
        epoch = server.epoch
        if channel is not None:  # the common path: this thread's own connection
            reply = channel.call(acquire_request(server.info or PORTABLE, key, value, spec.ttl_ms, done,
                                                 done_first=copy), server.pause)
        else:
            reply = _acquire_pooled(client, key, value, spec, done, copy)
        if type(reply) is int:  # taken: its fencing token
            counters.count(client, spec.stats_key, spec.counters[0])
            started = max(started, server.resumed())  # written after a window's wait, if it waited
            return AcquireResult(Lease(client, key, value, spec, reply, task_id, started, epoch))
        if reply.taken or reply.completed or reply.previous is not None:
            break
    if reply.completed:
        if reply.taken:
            execute(client, key, lambda info: release_request(info, key, value))
        counters.count(client, spec.stats_key, "completed_copies")
        return AcquireResult(None, completed=True)
    return _held(client, key, spec, task_id, value, parse_holder(reply.previous), adopt_claim_of, reply.token)


def _acquire_pooled(client: RedisClient, key: str, value: str, spec: LockSpec,
                    done: str | None, copy: bool) -> int | AcquireReply:
    """The acquire request on a pooled connection (Sentinel, Cluster, waits for replicas).

    A Cluster slot migrating with its keys on two nodes answers a copy's script
    ``-TRYAGAIN`` (it names the lock and its done marker): the acquire is then
    sent as separate commands, each answered where its key is.
    """
    after = acknowledged(spec, key, value, _taken) if spec.wait_replicas > 0 else None
    pause = server_of(client).pause

    def send(done_first: bool) -> int | AcquireReply:
        reply: int | AcquireReply = execute(
            client, key, lambda info: acquire_request(info, key, value, spec.ttl_ms, done, done_first=done_first),
            before_write=pause, after=after)
        return reply

    try:
        return send(copy)
    except TryAgainError:
        if done is None or not copy:
            raise
        return send(False)


def _taken(reply: int | AcquireReply) -> bool:
    """An acquire's reply says the key is ours (a fencing token, or found taken)."""
    return type(reply) is int or reply.taken  # type: ignore[union-attr]


def _held(client: RedisClient, key: str, spec: LockSpec, task_id: str | None, value: str,
          holder: Holder | None, adopt_claim_of: str | None, token: int) -> AcquireResult:
    """The rare paths: ``holder`` holds ``key`` (found when the server's clock read ``token``,
    in µs). Adopt it (this run's own claim), take it over (a dead worker's lock, or one
    its holder did not confirm after a data loss: :mod:`.stale`), or report it."""
    assert holder is not None and holder.raw is not None
    stale = take_unconfirmed(client, key, spec, task_id, value, holder, token)
    if stale is not None:
        counters.count(client, spec.stats_key, spec.counters[0])
        return AcquireResult(stale, taken_over=holder)
    if adopt_claim_of and holder.claim and holder.task_id == adopt_claim_of:
        lease = replaced_lease(client, key, spec, task_id, adopt_request(key, holder.raw, value, spec.ttl_ms), value)
        if lease is not None:
            counters.count(client, spec.stats_key, spec.counters[0])
            return AcquireResult(lease)
    elif spec.liveness_prefix is not None and looks_dead(client, spec.liveness_prefix, holder):
        lease = take_over(client, key, spec, task_id, value, holder)
        if lease is not None:
            counters.count(client, spec.stats_key, spec.counters[0])
            return AcquireResult(lease, taken_over=holder)
    counters.count(client, spec.stats_key,
                   "redelivered" if task_id and holder.task_id == task_id and not holder.claim else spec.counters[1])
    return AcquireResult(None, holder=holder)

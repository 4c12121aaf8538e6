"""A lease: a lock this process holds, renewed, put back and released.

* **renew** compares the whole value and extends it (natively where the server
  can, else in Lua; in Lua also when a full server refuses the native form):
  only the attempt that wrote it can extend it, so a run whose lease expired
  and was taken by another never touches the new holder's lease.
* **put back** writes the lock again into a server that lost it (a restart
  without persistence, a promoted replica), only while the lease is kept and
  has not ended on this process's clock (:meth:`Lease.may_put_back`).
* **release** compares and deletes, at once or with its reply read later
  (:meth:`Lease.release_soon`).

How often a lease is renewed and how long its holder vouches for it
(:class:`LockSpec`) follow from the two ways another holder can get the key:
a take-over of a worker that looks dead, and a new acquisition once a
recovery window after a restart or a failover has closed (:mod:`.server`).
Every holder, a worker's run or not, renews within a third of
``singleton_liveness_ttl``, so within any window; and ``ensure_held()`` vouches
for a lease only until the earliest moment either could have happened.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from ..connection.channels import channel_or_none
from ..connection.client import RedisClient, ReplicasNotAcknowledged, is_cluster
from ..connection.pooled import run_pooled
from ..connection.wire import Request, bulk, pack, run_on
from ..log import logger
from ..recovery.server import PORTABLE, ServerInfo, server_of
from . import counters
from .commands import (
    NativeRefused,
    Renewal,
    claim_on_retry_request,
    done_marker_request,
    look_request,
    put_back_request,
    release_request,
    renew_request,
)
from .executor import execute, refused
from .holder import Holder, claim_value, done_key, parse_holder
from .spec import LATE_PUT_BACK, LockSpec, ms

__all__ = ["LATE_PUT_BACK", "RETRY_EVERY", "Lease", "acknowledged", "replaced_lease", "retry_pause"]

#: Seconds between renewal attempts while Redis does not answer (at most).
RETRY_EVERY = 0.25


def retry_pause(ttl: float) -> float:
    """Seconds before Redis is asked again about a lease of ``ttl`` seconds that it did not answer."""
    return min(max(ttl / 10, 0.05), RETRY_EVERY)


def acknowledged(spec: LockSpec, key: str, value: str, taken: Callable[[Any], bool]) -> Callable[[Any, Any], Any]:
    """``after`` for :func:`execute`: a taken lock must reach ``spec.wait_replicas`` replicas."""
    def after(link: Any, result: Any) -> Any:
        if not taken(result):
            return result
        link.send(pack(b"WAIT", spec.wait_replicas, ms(spec.wait_timeout)))
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
        #: The renewal request last built, and the server info it was spelt for.
        self._renewal: tuple[ServerInfo, Request] | None = None
        #: This lease's part of a many-lease renewal (:func:`.batches.renew_scripted`), in RESP.
        self.batch_parts: tuple[bytes, bytes] | None = None
        self.confirm(started, epoch)

    def confirm(self, started: float, epoch: int) -> None:
        """The lock was ours (taken or renewed) at ``started`` (monotonic, before the request),
        under the server's ``epoch`` (read before the request too)."""
        #: Monotonic time until which the lock exists in Redis, if Redis keeps it.
        self.valid_until = started + self.spec.ttl
        #: Monotonic time from which another holder could have taken the lock over: a lock
        #: the server lost is put back only before it (:meth:`may_put_back`).
        self.put_back_until = started + self.spec.takeover_after
        #: Monotonic time of the last confirmation's start.
        self.confirmed_at = started
        #: Monotonic time until which no other holder can have the lock:
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

    def renew_once(self, client: RedisClient | None = None) -> Renewal:
        """Extend the lease by ``ttl`` if the lock is still ours (compare-and-set).

        Raises ``redis.RedisError`` when Redis cannot be asked; the caller decides
        (the keeper keeps trying until the lease would have expired). ``client``:
        another client of the same server to send it through (the keeper's own, in
        greenlet pools). The keeper renews many leases in one request instead
        (:mod:`.batches`), through the same two steps.
        """
        started = time.monotonic()
        via = client or self.client
        epoch = server_of(via).epoch
        outcome = execute(via, self.key, self.renewal_request, pooled=True)
        return self.settle_renewal(outcome, started, epoch, via)

    def renewal_request(self, info: ServerInfo) -> Request:
        """The compare-and-extend of this lease, as the server ``info`` spells it: built once per
        spelling and kept (its key, value and TTL never change), so that a keeper renewing
        thousands of leases a second does not encode each command again every time."""
        kept = self._renewal
        if kept is not None and kept[0] is info:
            return kept[1]
        request = renew_request(info, self.key, self.value, self.spec.ttl_ms)
        self._renewal = (info, request)
        return request

    def spell_batch_parts(self) -> tuple[bytes, bytes]:
        """This lease's key, and its value and TTL, as arguments of a many-lease renewal (in RESP):
        built once and kept, as :meth:`renewal_request`."""
        parts = self.batch_parts = (bulk(self.key), bulk(self.value) + bulk(self.spec.ttl_ms))
        return parts

    def settle_renewal(self, outcome: Renewal | None, started: float, epoch: int, via: RedisClient) -> Renewal:
        """What a renewal sent at ``started`` (monotonic) under ``epoch`` found: a native
        renewal that did not say why it failed is asked about (gone, or another's); a
        renewed lease is confirmed from ``started``."""
        if outcome is None:  # native SET IFEQ does not say why: ask
            look = execute(via, self.key, lambda info: look_request(self.key), pooled=True)
            outcome = Renewal.HELD_BY_ANOTHER if look.current is not None else Renewal.GONE
        if outcome is Renewal.RENEWED:
            self.confirm(started, epoch)
            counters.count(self.client, self.spec.stats_key, "renewed")
        return outcome

    def may_put_back(self, client: RedisClient | None = None) -> bool:
        """The lock is gone, and that may be the server's doing, not a holder's: since this
        lease was last confirmed, the process found the data on a server that may lack
        it (restarted without an append-only file, a promoted replica), the lease has
        not ended on this process's clock, and the data was lost before another holder
        could have taken the lock over (:attr:`put_back_until`; when the loss happened:
        :attr:`.server.LockServer.lost_by`).

        A holder stopped or cut off past that moment (a paused pod, a partition) may have
        been taken over on the old server before it lost the data; putting its lock back
        then would give the key to the holder with the lower fencing token, beside the
        one that took it over and puts its own back. Such a lease is lost instead.
        """
        server = server_of(client or self.client)
        if server.epoch <= self.epoch or time.monotonic() >= self.valid_until:
            return False
        return server.lost_by < self.put_back_until

    def late_put_back_at(self, client: RedisClient | None = None) -> float | None:
        """For a lease whose lock the server lost and that :meth:`may_put_back` refuses (the
        loss may have come after another could have taken it over, or cannot be dated
        closely enough): the monotonic time, just before the recovery window closes, at
        which it may still put its lock back if no other holder put theirs back first
        (``SET NX``). A holder that took the lock over renews on its usual schedule, within
        the window, and so gets there first; a live holder whose server merely took long to
        come back keeps its lock. None: never (no window open, or the lease has ended)."""
        server = server_of(client or self.client)
        window = server.recovery()
        at = min(window.until - LATE_PUT_BACK, self.valid_until)
        if server.epoch <= self.epoch or not window.open or time.monotonic() >= at:
            return None
        logger.warning("lock %s is gone from the lock Redis, which may have lost it (%s); it was last confirmed "
                       "%.1fs before the loss, long enough for another worker to have taken it over: it is put back "
                       "in %.1fs, as the recovery window closes, if no other holder put theirs back by then",
                       self.key, server.recovery_reason or "restarted or failed over",
                       server.lost_by - self.confirmed_at, at - time.monotonic())
        return at

    def may_put_back_late(self, at: float, client: RedisClient | None = None) -> bool:
        """Its time (:meth:`late_put_back_at`) came, and the window is still open: new
        acquisitions still wait, so a ``SET NX`` now finds the key free only if no other
        holder put theirs back."""
        now = time.monotonic()
        return at <= now < self.valid_until and server_of(client or self.client).recovery().open

    def put_back(self, client: RedisClient | None = None, *, decided: int | None = None) -> bool:
        """Write the lock back into a server that lost it (``SET NX``); True if it was still
        free (or already held this very value: the put-back ran before).

        Only for a lease that is still kept, when :meth:`may_put_back` says so (or at its
        :meth:`late_put_back_at`). ``decided``: the server epoch when that was decided;
        another loss found since is judged again before anything is written.
        """
        started = time.monotonic()
        via = client or self.client
        server = server_of(via)
        epoch = server.epoch
        if decided is not None and epoch != decided and not self.may_put_back(via):
            return False
        if not execute(via, self.key, lambda info: put_back_request(info, self.key, self.value, self.spec.ttl_ms),
                       pooled=True):
            return False
        if server.epoch != epoch and not self.may_put_back(via):
            # Written after yet another loss, which this lease cannot vouch through
            # (found by this very request's connection): give it up.
            execute(via, self.key, lambda info: release_request(info, self.key, self.value), pooled=True)
            return False
        self.confirm(started, epoch)
        logger.warning("put lock %s back after the lock Redis lost it (%s)", self.key,
                       server.recovery_reason or "restarted or failed over")
        counters.count(self.client, self.spec.stats_key, "put_back")
        counters.count(self.client, self.spec.stats_key, "renewed")
        return True

    def release(self, *, done_ttl: float | None = None, claim_ttl: float | None = None,
                client: RedisClient | None = None, again: bool = False, counted: bool = True) -> bool | None:
        """Give the lock up if it is still ours: True if it was (else counted as lost), None if
        unknown (sent again after its reply was lost, and found nothing: the first attempt
        may have released it; never reported as a loss).

        ``done_ttl``: also leave this task id's done marker for that long.
        ``claim_ttl``: instead of deleting the lock, turn it into a publish-time
        claim of the same task id for that long (a retry of an
        ``until_executed`` task stays covered while it waits in the queue).
        ``client``: another client of the same server to send it through (the
        keeper's). ``again``: an earlier sending got no answer (it may have run), so
        a lock found gone is None, not a loss. ``counted``: False for a lock no run used
        (neither ``released`` nor ``lost`` is counted).
        """
        released: bool | None
        if claim_ttl is not None:
            claim = claim_value(self.value, claim_ttl)
            released = bool(execute(self.client, self.key, lambda info: claim_on_retry_request(
                self.key, self.value, claim, ms(claim_ttl))))
        else:
            via = client or self.client
            if done_ttl and is_cluster(via):
                # The marker first, answered before the compare-and-delete is written: in a
                # slot that migrates, the source answers a new marker -ASK and would run the
                # delete behind it at once, the marker reaching the target a round trip
                # later; a copy of the message acquiring in between would run again.
                marker = done_marker_request(done_key(self.key, self.task_id), ms(done_ttl))
                execute(via, self.key, lambda info: marker)
                done_ttl = None
            released = execute(via, self.key, lambda info: self._release_request(info, done_ttl))
            if again and released is False:
                released = None
        if counted:
            self.count_release(released)
        return released

    def count_release(self, released: bool | None) -> None:
        if released is not None:
            counters.count(self.client, self.spec.stats_key, "released" if released else "lost")

    def release_soon(self, on_result: Callable[[bool | None, BaseException | None], None], *,
                     done_ttl: float | None = None) -> bool:
        """Release without waiting for the reply; False when that is not possible here.

        The release is written at once (Redis frees the key as soon as it reads
        it); its reply -- was the lock still ours? -- reaches ``on_result`` when
        this thread next waits for a lock reply (its next acquire), or at the
        latest :data:`.flusher.FLUSH_AFTER` later, or when the process ends
        (:func:`.flusher.read_all_replies`). Only for clients with a
        :mod:`.channel` (standalone Redis, real threads); raises
        ``redis.RedisError`` if the request could not be written.
        """
        channel = channel_or_none(self.client)
        if channel is None:
            return False
        server = server_of(self.client)

        def handle(reply: Any, error: BaseException | None) -> None:
            if isinstance(error, NativeRefused):  # refused, so not run: the portable form, at once
                refused(server, error)
                reply, error = run_pooled(self.client, self.key, self._release_request(PORTABLE, done_ttl)), None
            # None: unknown (sent again after its reply was lost: see .commands), never a loss
            released = None if error is not None or reply is None else bool(reply)
            self.count_release(released)
            on_result(released, error)

        channel.send(self._release_request(server.info or PORTABLE, done_ttl), handle)
        return True

    def _release_request(self, info: ServerInfo, done_ttl: float | None) -> Request:
        done = done_key(self.key, self.task_id) if done_ttl else None
        return release_request(info, self.key, self.value, done, ms(done_ttl) if done_ttl else None)

    def __repr__(self) -> str:
        return f"<Lease {self.key} fence={self.fence} ttl={self.ttl}s>"


def replaced_lease(client: RedisClient, key: str, spec: LockSpec, task_id: str | None,
                   request: Request | Callable[[ServerInfo], Request], value: str) -> Lease | None:
    """Run a compare-and-replace (:func:`.commands.adopt_request`, :func:`.commands.take_over_request`)
    writing ``value``; the lease if ``value`` holds the key now."""
    after = acknowledged(spec, key, value, lambda r: r.token is not None) if spec.wait_replicas > 0 else None
    started = time.monotonic()
    epoch = server_of(client).epoch
    build = (lambda info: request) if isinstance(request, Request) else request
    replaced = execute(client, key, build, after=after)
    if replaced.token is None:
        return None
    return Lease(client, key, value, spec, replaced.token, task_id, started, epoch)

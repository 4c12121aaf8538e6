"""Renewal of running leases.

One daemon thread per process renews every lease held in that process every
:attr:`~.lease.Lease.renew_every` seconds (a third of its TTL, and at most a
third of ``singleton_liveness_ttl``: a dead worker's missed renewals show
within seconds, and every holder puts its lock back within a recovery window
after a restart), so a run may last any multiple of ``lock_ttl``; a lease that
stops being renewable is marked lost and its owner is told through a callback.
The leases due within a short horizon are renewed together, in one request per
server (:mod:`.batches`), each judged on its own reply (:mod:`.rounds`): the keeper's
round trips stay about constant however many leases the process holds. This module
keeps the queue and the thread; :class:`.rounds.Renewer` renews and judges.

When Redis does not answer, the keeper tries again every
:data:`~.lease.RETRY_EVERY` seconds until the lease would have expired; only
then does it report the loss (the lock may still exist, but no one can vouch
for it any more). A renewal whose answer comes after its run ended (the run
released the lock meanwhile) reports nothing.

The same thread sends again a run's release that got no answer (``-BUSY``, a
timeout, a cut connection; :meth:`LeaseKeeper.retry_release`, :mod:`.releases`).
"""

from __future__ import annotations

import atexit
import contextlib
import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .. import native
from ..connection.flusher import read_all_replies
from ..log import logger
from ..recovery import server
from .kept import Bucket, Entry, KeptLease, take_due
from .lease import RETRY_EVERY, Lease
from .releases import EXIT_PATIENCE, PendingRelease, send_until_done
from .rounds import Renewer

__all__ = ["KeptLease", "LeaseKeeper", "get_keeper", "send_pending_releases"]

K = TypeVar("K", bound=KeptLease)

#: Seconds an idle keeper (nothing to renew) waits before it looks at its queue again.
#: A new lease due later than that needs no wake-up: short runs cost no thread switch.
IDLE_LOOK = 1.0


class LeaseKeeper:
    """Renews leases from one background OS thread (started on first use).

    In a gevent or eventlet worker it is a real thread with a Redis client of
    its own (:mod:`.native`): a task that blocks the hub does not stop renewals.
    """

    def __init__(self) -> None:
        # Real OS-thread primitives (see .native): under gevent or eventlet the
        # keeper must renew while the running task blocks the hub.
        self._mutex = native.allocate_lock()
        self._wake = native.Wakeup()
        #: Due time, order of scheduling, and a lease, a pending release or leases due together.
        self._queue: list[Entry] = []
        #: The entries of the round under way, off the queue (:meth:`abandon` looks there too).
        self._in_flight: list[KeptLease | PendingRelease] = []
        self._seq = itertools.count()
        #: Leases kept and not yet forgotten (the queue also holds forgotten ones).
        self._active = 0
        #: Releases sent again, by ``id()`` of their lease (one per lease).
        self._pending: dict[int, PendingRelease] = {}
        #: The thread runs (cleared as it ends: only at interpreter exit, its loop catches errors).
        self._running = False
        #: Times the thread came back from waiting (diagnostics and tests).
        self.wakeups = 0
        #: Renews the leases of each round and judges each one's reply (:mod:`.rounds`). Its
        #: ``forget`` is this keeper's :meth:`forget` as found at each call, as a method call would.
        self.renewer = Renewer(self._mutex, lambda entry: self.forget(entry))
        #: Every lease is due now (set by :meth:`renew_all_soon`, applied by the thread).
        self._renew_all = False
        #: The thread is waiting (not renewing).
        self.waiting = False
        #: Monotonic time the waiting thread looks at the queue by itself (-inf: looking now).
        self._next_look = float("-inf")

    def keep(self, lease: Lease, on_lost: Callable[[KeptLease, str], None] | None = None) -> KeptLease:
        """Start renewing ``lease``; call :meth:`forget` when the run ends.

        Its first renewal is due a renewal interval after the lock was confirmed (the
        start of its acquire), not after this call: in a busy gevent worker the reply
        of an acquire may be read seconds after Redis set the key, and a lease scheduled
        from then could expire before its first renewal."""
        return self.keep_entry(KeptLease(lease, on_lost))

    def keep_entry(self, kept: K) -> K:
        """:meth:`keep` for an entry made by the caller: a task's run is its own entry
        (:class:`~celery_singleton_beat.task.run.HeldRun`), one object per held run."""
        lease = kept.lease
        self._add(kept, lease.confirmed_at + lease.renew_every)
        return kept

    def abandon(self, lease: Lease) -> None:
        """Stop renewing ``lease`` and release it: a run being set up was cut short after
        :meth:`keep` (a soft time limit or a revoke's ``SIGUSR1`` landing as it began, even
        inside :meth:`keep` once the lease was queued). Its entry never reached the run,
        which could not end it: the lock was renewed for the life of the process. An entry
        the keeper's round has in flight is forgotten too: else that round, finding the
        released lock gone after a data loss, put it back."""
        with self._mutex:
            entries = [kept for kept in itertools.chain(self._in_flight, (
                           kept for _, _, entry in self._queue
                           for kept in (entry.leases if isinstance(entry, Bucket) else (entry,))))
                       if kept.lease is lease and isinstance(kept, KeptLease)]
        for kept in entries:
            self.forget(kept)
        with contextlib.suppress(Exception):  # else it lapses at its TTL
            lease.release()

    def retry_release(self, lease: Lease, done_ttl: float | None = None, counted: bool = True) -> PendingRelease:
        """Send ``lease``'s release (and its ``done_ttl`` done marker) again soon, and until it
        runs (see :mod:`.releases`): its first sending got no answer. Once per lease.
        ``counted``: False for a lock no run used (not counted released or lost)."""
        with self._mutex:
            pending = self._pending.get(id(lease))
            if pending is not None and pending.active:
                return pending
            pending = self._pending[id(lease)] = PendingRelease(lease, done_ttl, counted)
        self._add(pending, time.monotonic() + RETRY_EVERY)
        return pending

    @property
    def pending_releases(self) -> list[PendingRelease]:
        """Releases waiting to be sent again."""
        with self._mutex:
            return [entry for entry in self._pending.values() if entry.active]

    def send_pending_releases(self, patience: float = EXIT_PATIENCE) -> None:
        """The process ends: send every pending release until it runs, ``patience`` seconds at most."""
        for entry in send_until_done(self.pending_releases, patience) + self.pending_releases:
            self.forget(entry)

    def _add(self, kept: KeptLease | PendingRelease, due: float) -> None:
        with self._mutex:
            self._active += 1
            if len(self._queue) > 2 * self._active + 32:
                # Ended runs leave their entry until its renewal time (they are
                # dropped lazily); a short task ends thousands of runs before
                # then, so drop them here, amortised over the runs that left them.
                self._queue = [entry for entry in self._queue if entry[2].active]
                heapq.heapify(self._queue)
            self._schedule(kept, due)
            start = not self._running
            self._running = True
            # Only a renewal due before the thread looks again needs it awake:
            # waking it for every short run cost a thread switch (and ~8
            # system calls) per run.
            wake = not start and due < self._next_look
        if start:
            native.start_thread(self._run, "singleton-lease-keeper")
        elif wake:
            self._wake.notify()

    def releasing(self, kept: KeptLease) -> None:
        """The run ends and its release is about to be sent: keep renewing until :meth:`forget`
        (called once the release was written or answered), but put nothing back and report
        no loss from now on: a renewal that finds the lock gone or changed found the release,
        and forgets the lease itself (as does one that finds the lease ended while Redis did
        not answer): an exception raised by a signal handler as the run ends (a late soft
        time limit, ``KeyboardInterrupt``) can keep the run's own :meth:`forget` from running.

        The release may wait: for a connection of the pool (a gevent worker's ending runs
        share ``max_connections``), for an interpreter busy elsewhere. A lease forgotten
        before that wait was not renewed during it, and a wait longer than what was left
        of its TTL let the lock expire: the release found it gone and the run was counted
        lost, though it had held its lock to the end.
        """
        with self._mutex:
            kept.releasing = True

    def forget(self, kept: KeptLease | PendingRelease) -> None:
        """Stop renewing (the entry is dropped lazily: when it comes due or the queue is compacted)."""
        with self._mutex:
            if kept.active:
                kept.active = False
                self._active -= 1
            if isinstance(kept, PendingRelease) and self._pending.get(id(kept.lease)) is kept:
                del self._pending[id(kept.lease)]

    @property
    def batches(self) -> int:
        """Requests that renewed several leases at once (diagnostics and tests)."""
        return self.renewer.batches

    @property
    def tracked(self) -> int:
        """Entries in the renewal queue, forgotten ones included (bounded by the kept ones)."""
        return sum(len(entry.leases) if isinstance(entry, Bucket) else 1 for _, _, entry in self._queue)

    def _schedule(self, kept: KeptLease | PendingRelease | Bucket, when: float) -> None:
        heapq.heappush(self._queue, (when, next(self._seq), kept))

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._running = False

    def _loop(self) -> None:
        while True:
            with self._mutex:
                self._next_look = float("-inf")  # looking: a keep() needs no notify
                now = time.monotonic()
                if self._renew_all:
                    self._move_all_forward(now)
                batch = self._take_due(now)
                if not batch:
                    timeout = self._queue[0][0] - now if self._queue else IDLE_LOOK
                    self._next_look = now + timeout
                    self.waiting = True
            if not batch:
                self._wake.wait(timeout)
                self.waiting = False
                self.wakeups += 1
                continue
            self._handle(batch)

    def _handle(self, batch: list[KeptLease | PendingRelease]) -> None:
        """Renew the leases of ``batch`` and send its pending releases again; schedule each again."""
        buckets: list[tuple[float, list[KeptLease]]] = []
        try:
            leases = [kept for kept in batch if isinstance(kept, KeptLease)]
            done = self.renewer.renew_round(leases, buckets) if leases else []
            done += [(pending, self.renewer.release_again(pending)) for pending in batch
                     if isinstance(pending, PendingRelease)]
        except Exception:  # never let the keeper thread die: the round's entries again soon
            logger.exception("unexpected error in a round of the lease keeper")
            again = time.monotonic() + RETRY_EVERY
            done, buckets = [(kept, again) for kept in batch], []
        with self._mutex:
            self._in_flight = []
            for kept, next_time in done:
                if next_time is not None and kept.active:
                    self._schedule(kept, next_time)
            for due, group in buckets:
                self._schedule(Bucket(group), due)

    def _take_due(self, now: float) -> list[KeptLease | PendingRelease]:
        """Under the mutex: the entries due now and those taken with them (:func:`.kept.take_due`),
        in flight from now on."""
        taken = self._in_flight = take_due(self._queue, now)
        return taken

    def renew_all_soon(self) -> None:
        """Renew every kept lease now: the process found its data on a server that may lack
        its locks (a restart, a promoted replica), and each must be put back before the
        recovery window closes (see :mod:`.server`)."""
        # A flag, not the mutex: the keeper's own thread calls this when one of its requests
        # finds yet another loss on a new connection, while it holds the mutex (a put-back).
        self._renew_all = True
        self._wake.notify()

    def _move_all_forward(self, now: float) -> None:
        """Under the mutex: every kept lease due now (see :meth:`renew_all_soon`)."""
        self._renew_all = False
        self._queue = [(now, seq, kept) for _, seq, kept in self._queue if kept.active]
        heapq.heapify(self._queue)

    def renew(self, kept: KeptLease, client: Any = None) -> bool:
        """One renewal of ``kept``, putting its lock back where the server lost it; False if
        the lock is no longer ours. The only way a lock is put back: the keeper's thread,
        and tools and tests renewing a lease by hand (``renew(KeptLease(lease, None))``).

        The put-back happens under the keeper's mutex, and only while the run still
        keeps the lease and has not begun its release: a run that ends
        (:meth:`releasing`, its release, then :meth:`forget`) either waits for it or is
        seen ending, so a renewal on its way when the run released never writes the
        lock back. ``client``: another client of the same server to
        send it through (the keeper's own); the lease's by default. Raises
        ``redis.RedisError`` when Redis cannot be asked.
        """
        return self.renewer.settle(kept, kept.lease.renew_once(client), client) is True


_keeper: LeaseKeeper | None = None
_keeper_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # The parent's keeper thread does not exist in a forked child; a lock
    # copied while another thread held it would stay held there.
    global _keeper, _keeper_lock
    _keeper, _keeper_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _renew_all_soon() -> None:
    keeper = _keeper
    if keeper is not None:
        keeper.renew_all_soon()


server.on_data_lost(_renew_all_soon)


def send_pending_releases() -> None:
    """The process ends: read the replies still unread on its lock connections (a release
    answered ``-BUSY`` becomes a pending one there), then send each release that got no
    answer until it runs, for a few seconds at most (the keeper's thread, a daemon, ends
    with the process)."""
    read_all_replies()
    keeper = _keeper
    if keeper is not None:
        keeper.send_pending_releases()


atexit.register(send_pending_releases)


def get_keeper() -> LeaseKeeper:
    """The keeper of this process (a forked child gets its own)."""
    global _keeper
    keeper = _keeper
    if keeper is not None:  # every run asks: no lock, no system call on this path
        return keeper
    with _keeper_lock:
        if _keeper is None:
            _keeper = LeaseKeeper()
        return _keeper

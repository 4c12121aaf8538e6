"""Locks their holders did not confirm after the lock Redis may have lost data: free once
the recovery window has closed.

After a restart from an RDB snapshot, or a replica promoted before the last writes
reached it, the data can hold a lock whose run has ended since (its release was made
after the snapshot, or never replicated). Its holder's worker may well be alive, so
nothing takes it over: every later submission of the key would be skipped as its
duplicate until the lock's TTL runs out.

The recovery window (:mod:`..recovery.window`) is the grace period in which every live
holder confirms its lock: each renews at least once within it (a renewal sets the lock's
TTL again, from then). So once the window has closed, a lock whose expiry on the
server's clock comes before ``window start + its TTL`` was not renewed since the window
opened: no live holder keeps it. The next acquisition that finds it takes it, by the
same compare-and-replace as a take-over (it replaces the lock only if it is still
unrenewed since it was looked at), with a fencing token from the server's clock that is
higher than any before.

Cost: none on the common path. The acquire's reply carries the server's clock (its
fencing token); a lock found more than its TTL after the latest window opened has been
renewed or taken since, so only an acquisition that finds a holder within a lock TTL of
a window looks at the lock (one request). Redis Cluster keeps a record per shard, which
this rule does not read yet: there such a lock waits for its TTL.
"""

from __future__ import annotations

from ..connection.client import RedisClient, is_cluster
from ..log import logger
from ..recovery.records import ServerRecord, recovery_key, server_key
from ..recovery.server import server_of
from . import counters
from .commands import look_request, release_request, take_over_request
from .executor import execute
from .holder import Holder, text_of
from .lease import Lease, replaced_lease
from .spec import LockSpec

__all__ = ["take_unconfirmed", "unconfirmed"]


def unconfirmed(holder: Holder, pttl_ms: int, expires_ms: int, since_ms: int, window_open: bool) -> bool:
    """The rule, on what the server said: the lock whose value is ``holder``, with
    ``pttl_ms`` left and expiring at ``expires_ms`` on the server's clock (never dated
    earlier than the server holds it: see :func:`.commands.look_request`), was not confirmed by its
    holder in the recovery window that opened at ``since_ms`` (the server record's, 0: none)
    and has closed (``window_open`` false): its expiry comes before ``since_ms`` + its TTL,
    so it was not renewed since that window opened. Such a lock is free to the next acquire
    (:func:`take_unconfirmed`), and ``celery singleton locks`` shows it as stale.

    Never a queued message's claim (never renewed), a value without its TTL (written
    before 0.3) or a lock that never expires.
    """
    if holder.claim or holder.ttl is None or window_open or not since_ms or pttl_ms < 0:
        return False
    return expires_ms < since_ms + round(holder.ttl * 1000)


def take_unconfirmed(client: RedisClient, key: str, spec: LockSpec, task_id: str | None, value: str,
                     holder: Holder, token: int) -> Lease | None:
    """Take ``key`` if ``holder``'s lock was not confirmed since the latest recovery window
    opened and that window has closed; ``token``: the server's clock (µs) at the acquire
    that found it. The new lease, or None (confirmed, or not known to be stale).

    This process's memory only says whether to look: the decision is made on what the
    server says in one transaction (the lock, its TTL, the clock, the server record's
    ``since_ms`` and the window's key), so a window start remembered from another server
    (another clock) or a window opened since the acquire decides nothing. A replace whose
    connection found yet another loss is given up.
    """
    if holder.claim or holder.ttl is None or is_cluster(client):
        return None  # a queued message's claim is never renewed; a value before 0.3 has no TTL
    server = server_of(client)
    remembered = server.data_lost_since_ms()
    ttl_ms = round(holder.ttl * 1000)
    if not remembered or token // 1000 - remembered > ttl_ms or server.recovery().open:
        return None  # renewed (or taken) since the window opened, or its holders' grace still runs
    epoch = server.epoch
    look = execute(client, key, lambda info: look_request(key, server_key(server.prefix),
                                                          recovery_key(server.prefix), info=info))
    record = ServerRecord.decode(look.record)
    since_ms = record.since_ms if record is not None else 0
    if (look.current is None or text_of(look.current) != holder.raw
            or not unconfirmed(holder, look.pttl, look.expires_ms, since_ms, bool(look.window))):
        return None  # a window open now, the lock gone or renewed after the window opened
    raw = text_of(look.current)  # the holder's exact value (checked above)
    lease = replaced_lease(client, key, spec, task_id,
                           lambda info: take_over_request(info, key, raw, look, value, spec.ttl_ms), value)
    if lease is not None and server.epoch != epoch:
        # The replace went to a server found only now to have lost data (a new window):
        # its holders' grace starts again. Give the key back.
        execute(client, key, lambda info: release_request(info, key, value))
        return None
    if lease is not None:
        logger.warning("lock %s of %s[%s] was not renewed by its holder in the recovery window after the lock Redis "
                       "may have lost data (%s): freed for this run", key, holder.task, holder.task_id,
                       server.recovery_reason or "restarted or failed over")
        counters.count(client, spec.stats_key, "unconfirmed_freed")
    return lease

"""Renewals of many leases in one request per server, each lease judged on its own reply.

The keeper (:mod:`.keeper`) renews every lease due within a short horizon
together: one pipelined write of their compare-and-extend commands per server
(per node on Redis Cluster), and one read of the replies. Its round trips per
second then stay about constant however many leases a process holds (a gevent
worker with a thousand running tasks), where one request per lease made them
grow with the leases.

Where the server has no native compare-and-extend (it renews in Lua anyway) and is not a
Cluster, the leases of a batch go in one call of :data:`.scripts.RENEW_MANY` instead
(:func:`renew_scripted`): the same compare-and-extend for each lock, in one script whose
reply lists only the locks it did not renew, and why. The keeper then does little per
renewed lease: no reply of its own to read and judge.

Each lease's reply decides for that lease alone: a lock held by another is
lost alone, a lock the server lost is put back alone (:meth:`.rounds.Renewer.settle`'s
rules), and a reply that is an error (``-BUSY`` for that command, a
``-MOVED`` of a slot that moved) sends that lease on the one-lease path. Every
renewal compares before it writes, so a batch sent twice (its connection broke
after the write) changes nothing the first did not.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

from ..connection.client import is_cluster
from ..connection.wire import Request, Short, command_head
from ..recovery.server import ServerInfo, server_of
from .commands import NativeRefused, Renewal
from .executor import execute
from .lease import Lease
from .scripts import RENEW_MANY

__all__ = ["BATCH_MAX", "combined", "group_key", "renew_many", "renew_scripted", "scripted", "scripted_call"]

#: Renewals written in one request at most (a bigger batch waits for the next round).
BATCH_MAX = 512


def combined(requests: Sequence[Request]) -> Request:
    """One request of ``requests``, written together; its result is the list of their
    results, an exception in place of a request whose own ``finish`` raised one. A
    native command the server refused is raised for all (the executor sends the whole
    batch again in the portable spelling)."""
    scripts = tuple({script.sha: script for request in requests for script in request.scripts}.values())
    counts = [request.count for request in requests]

    def finish(replies: list[Any]) -> list[Any]:
        results: list[Any] = []
        at = 0
        for request, count in zip(requests, counts, strict=True):
            try:
                results.append(request.finish(replies[at:at + count]))
            except NativeRefused:
                raise
            except Exception as exc:  # this request's error, judged with its lease
                results.append(exc)
            at += count
        return results

    return Request(None, finish, scripts, data=b"".join(request.data for request in requests), count=sum(counts))


def group_key(via: Any, lease: Lease, cluster: bool | None = None) -> tuple[int, str]:
    """Leases renewed through the same client and, on Cluster, held by the same node share a request.
    ``cluster``: whether ``via`` is a Cluster client, when the caller knows it already."""
    if is_cluster(via) if cluster is None else cluster:
        return id(via), via.get_node_from_key(lease.key).name
    return id(via), ""


def renew_many(via: Any, leases: Sequence[Lease]) -> list[Renewal | BaseException]:
    """Renew ``leases`` (all of one server, or one Cluster node) in one request: per lease, what
    its renewal found (:meth:`.lease.Lease.settle_renewal`), or the error of its own reply.
    Raises ``redis.RedisError`` when the request could not be made at all."""
    started = time.monotonic()
    epoch = server_of(via).epoch

    def build(info: ServerInfo) -> Request:
        return combined([lease.renewal_request(info) for lease in leases])

    replies = execute(via, leases[0].key, build, pooled=True)
    outcomes: list[Renewal | BaseException] = []
    for lease, reply in zip(leases, replies, strict=True):
        if isinstance(reply, BaseException):
            outcomes.append(reply)
            continue
        try:
            outcomes.append(lease.settle_renewal(reply, started, epoch, via))
        except Exception as exc:  # its look, when the native renewal did not say why
            outcomes.append(exc)
    return outcomes


#: The usual reply of :data:`.scripts.RENEW_MANY`: every lock renewed (RESP2 and RESP3).
_ALL_RENEWED = Short(re.compile(rb"\*0\r\n"), lambda match: ())
_FOUND = {0: Renewal.HELD_BY_ANOTHER, -1: Renewal.GONE}


def scripted(info: ServerInfo, cluster: bool) -> bool:
    """Whether the leases of one server go in one call of :data:`.scripts.RENEW_MANY`: where the
    server renews in Lua anyway (no native ``SET ... IFEQ``), and not on Cluster (whose keys
    of one request may be in many slots)."""
    return not cluster and not info.set_ifeq


def scripted_call(leases: Sequence[Lease]) -> bytes:
    """The call of :data:`.scripts.RENEW_MANY` renewing ``leases``, in RESP: each lease's
    arguments encoded once and kept (:meth:`.lease.Lease.spell_batch_parts`), joined behind
    the command's head."""
    keys = []
    args = []
    for lease in leases:
        parts = lease.batch_parts or lease.spell_batch_parts()
        keys.append(parts[0])
        args.append(parts[1])
    count = len(keys)
    return b"".join((command_head(3 + 3 * count, b"EVALSHA", RENEW_MANY.sha, count), *keys, *args))


def renew_scripted(via: Any, leases: Sequence[Lease]) -> tuple[float, int, dict[int, Renewal]]:
    """Renew ``leases`` (all of one server) in one call of :data:`.scripts.RENEW_MANY`: the
    monotonic time and server epoch read before it was sent (what the renewed leases are
    confirmed from), and the leases it did not renew, by position, with what it found.

    Raises ``redis.RedisError`` when the request could not be made, or the script's reply is
    an error (``-BUSY``, a refusal): the caller sends the batch the other way."""
    started = time.monotonic()
    epoch = server_of(via).epoch
    data = scripted_call(leases)

    def finish(replies: list[Any]) -> Any:
        reply = replies[0]
        if isinstance(reply, BaseException):
            raise reply
        return reply

    request = Request(None, finish, (RENEW_MANY,), data=data, count=1, short=_ALL_RENEWED)
    reply = execute(via, leases[0].key, lambda info: request, pooled=True)
    return started, epoch, {int(reply[at]) - 1: _FOUND[int(reply[at + 1])] for at in range(0, len(reply), 2)}

"""Redis Cluster's ``-ASK``: a request's commands followed to the target of a migrating slot.

While a slot migrates, its source still serves the keys it has and answers
``-ASK <slot> <target>`` for any other; the target serves a key of the slot only
to a client that sent ``ASKING`` just before (for the next command, or the next
``MULTI`` block). A lock request is several commands written together (an
acquire: ``SET``, ``TIME``, ``DEL``; a release with its done marker: two), and
their keys, although of one slot, may stand on either side. So the commands the
source answered with ``ASK`` are sent to the target behind ``ASKING`` -- and only
those, with a keyless ``TIME`` that followed one (the fencing token is the clock
of the node that took the key, read right behind its ``SET``). What the source
served stays served: sending the whole request to the target would, for a lock
the source still holds, create a second holder there.

The target is the address the reply names, whether or not the client's slot map lists
it: a node being added to the cluster serves no slot until a first slot finished
migrating to it, so ``CLUSTER SLOTS`` does not name it. ``-MOVED`` replies (redis-py's
``MovedError`` is an ``AskError``) are followed the same way, once the layout was read
again (the next requests of the slot go to its new owner first).

:func:`.wire.run_pooled` uses :class:`AskFollower` on Cluster clients.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import AskError, MovedError

from .client import cluster_node_at, cluster_reread
from .lending import borrow, give_back
from .wire import PoolLink, Request, ensure_checked, looker_of, pack, run_on

__all__ = ["AskFollower", "asked_units", "command_name", "split_commands"]

#: ``ASKING``: the next command (or ``MULTI`` block) may use a slot the node is importing.
_ASKING = pack(b"ASKING")
#: Commands without a key: sent again with the redirected command they follow (``TIME``
#: right behind a ``SET``: the fencing token is the clock of the node that ran the ``SET``).
_KEYLESS = frozenset({b"TIME"})


def split_commands(data: bytes, count: int) -> list[bytes]:
    """The ``count`` commands of ``data`` (RESP arrays of bulk strings), each as its bytes."""
    commands = []
    at = 0
    for _ in range(count):
        start = at
        end = data.index(b"\r\n", at)
        parts = int(data[at + 1:end])
        at = end + 2
        for _ in range(parts):
            end = data.index(b"\r\n", at)
            at = end + 2 + int(data[at + 1:end]) + 2
        commands.append(data[start:at])
    return commands


def command_name(command: bytes) -> bytes:
    """The name of one RESP command, upper case."""
    first = command.index(b"\r\n") + 2
    end = command.index(b"\r\n", first)
    return command[end + 2:end + 2 + int(command[first + 1:end])].upper()


def _units(commands: list[bytes]) -> list[tuple[int, int]]:
    """``[start, end)`` of each unit of a request: a ``MULTI`` ... ``EXEC`` block, or one command."""
    units = []
    at = 0
    while at < len(commands):
        end = at + 1
        if command_name(commands[at]) == b"MULTI":
            while end < len(commands) and command_name(commands[end - 1]) != b"EXEC":
                end += 1
        units.append((at, end))
        at = end
    return units


def asked_units(commands: list[bytes], replies: list[Any]) -> list[tuple[int, int]]:
    """The units to send to the target of a migration: those answered ``-ASK`` (in a
    ``MULTI`` block, any of its commands), and a keyless command right behind one."""
    chosen = []
    follows = False
    for start, end in _units(commands):
        asked = any(isinstance(reply, AskError) for reply in replies[start:end])
        follows = asked or (follows and end - start == 1 and command_name(commands[start]) in _KEYLESS)
        if follows:
            chosen.append((start, end))
    return chosen


class AskFollower:
    """Sends the commands of a request that a migrating slot's source answered ``-ASK`` to
    the target, each unit behind ``ASKING``, and puts the target's replies in their place.

    The commands the source served are not sent again: it still holds their keys,
    and running them on the target too would, e.g., create there a lock the source
    holds for another. One connection of the target's pool is borrowed, given back
    by :meth:`close`.
    """

    def __init__(self, client: Any) -> None:
        self._client = client
        self._borrowed: tuple[Any, Any, PoolLink] | None = None
        #: The target's link when the request's first command ran there (for ``after``).
        self.link: PoolLink | None = None

    def __call__(self, request: Request, replies: list[Any]) -> list[Any]:
        ask = next(reply for reply in replies if isinstance(reply, AskError))
        commands = split_commands(request.data, request.count)
        # Each unit behind ASKING (it lets the next command, or MULTI block, use the importing
        # slot), but a keyless command, which needs none.
        units = [(start, end, not (end - start == 1 and command_name(commands[start]) in _KEYLESS))
                 for start, end in asked_units(commands, replies)]
        link = self._target(ask)
        data = b"".join((_ASKING if asking else b"") + b"".join(commands[start:end]) for start, end, asking in units)
        count = sum(asking + end - start for start, end, asking in units)
        scripts = request.scripts if any(command_name(commands[start]) == b"EVALSHA" for start, _, _ in units) else ()
        answered: list[Any] = run_on(link, Request(None, list, scripts, data=data, count=count))
        replies = list(replies)
        at = 0
        for start, end, asking in units:
            if asking:
                refused, at = answered[at], at + 1
                if isinstance(refused, Exception):  # ASKING refused (an ACL without it): that is the error
                    replies[start:end] = [refused] * (end - start)
                    at += end - start
                    continue
            replies[start:end] = answered[at:at + end - start]
            at += end - start
        if units[0][0] == 0:
            self.link = link
        return replies

    def _target(self, ask: AskError) -> PoolLink:
        """A connection (checked) to the node the ``-ASK`` (or ``-MOVED``: redis-py's
        ``MovedError`` is an ``AskError``) names, whether or not the client's slot map lists
        it: a node being added serves no slot until a first slot finished migrating to it, so
        ``CLUSTER SLOTS`` does not name it (see :func:`.client.cluster_node_at`)."""
        if isinstance(ask, MovedError):  # the slot has a new owner: the next requests go there first
            cluster_reread(self._client)
        pool = self._client.get_redis_connection(cluster_node_at(self._client, ask.host, ask.port)).connection_pool
        connection = borrow(pool)
        link = PoolLink(connection)
        self._borrowed = (pool, connection, link)
        ensure_checked(connection, looker_of(self._client))
        return link

    def close(self) -> None:
        borrowed, self._borrowed = self._borrowed, None
        if borrowed is not None:
            give_back(*borrowed)

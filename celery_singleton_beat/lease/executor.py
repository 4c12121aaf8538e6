"""The one executor of lock requests: on this thread's channel where it has one,
else on a pooled connection; a native command the server refuses is sent again
in its portable spelling (see :mod:`.commands`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

from ..connection.channels import channel_or_none
from ..connection.client import RedisClient
from ..connection.pooled import run_pooled
from ..connection.wire import Request
from ..log import logger
from ..recovery.server import PORTABLE, ServerInfo, server_of
from .commands import NativeRefused

__all__ = ["execute", "refused"]


def execute(client: RedisClient, key: str, build: Callable[[ServerInfo], Request], *,
            pooled: bool = False, before_write: Callable[[], Any] | None = None,
            after: Callable[[Any, Any], Any] | None = None) -> Any:
    """Run the request ``build`` makes for the server: on this thread's channel where it has
    one (and ``pooled`` and ``after`` are not asked for), else on a pooled connection.

    A native command the server refuses is sent again in its portable spelling
    (from now on; for this call only when the server was out of memory). A
    request marked ``unsure_when_repeated`` (a compare-and-delete) that was
    written a second time -- its connection broke after the first write, which
    may have run -- and found nothing reports None: unknown, not "not ours".
    """
    server = server_of(client)
    info = server.info or PORTABLE
    for attempt in (1, 2):
        request = build(info)
        writes = None
        try:
            channel = None if pooled or after is not None else channel_or_none(client)
            if channel is not None:
                # The channel calls before_write before each write of the request: count them
                # (a C-level counter where nothing else is to be called: a release's path).
                writes = itertools.count() if request.unsure_when_repeated else None
                hook = (before_write if writes is None else writes.__next__ if before_write is None
                        else _counting(writes, before_write))
                result = channel.call(request, hook)
            else:  # tells a repeated write itself (and may call before_write again after a move)
                result = run_pooled(client, key, request, after=after, before_write=before_write, raw=True)
        except NativeRefused as exc:
            if attempt == 2:
                raise
            refused(server, exc)
            info = PORTABLE
            continue
        if writes is not None and next(writes) > 1 and not result:
            return None
        return result
    raise AssertionError("unreachable")


def _counting(writes: Iterator[int], before_write: Callable[[], Any]) -> Callable[[], Any]:
    """``before_write``, also counting its calls in ``writes``."""
    def counted() -> Any:
        next(writes)
        return before_write()

    return counted


def refused(server: Any, exc: NativeRefused) -> None:
    """A native command was refused: use the portable ones from now on, unless only for memory."""
    if exc.lasting:
        logger.warning("the lock Redis refused a native command (%s); using the portable ones", exc)
        server.downgrade()
    else:
        logger.debug("the lock Redis refused a native command for memory (%s); its portable form instead", exc)

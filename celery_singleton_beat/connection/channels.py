"""Which channel a thread uses: one :class:`.channel.Channel` per thread and client.

:func:`channel_or_none` answers, in one dictionary look-up, the channel of the calling
thread for a client (made on first use), or None where lock requests take the pooled
path (:func:`supports_channel`: Sentinel, Cluster, greenlet pools; a gevent worker's
acquires go on its :mod:`.green` channel). A forked child
starts afresh (the parent's connections are never used there); the channels of every
thread are kept, weakly, on their client, so that a dropped client's go with it
(:func:`close_channels`).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, TypeGuard

import redis

from .. import native
from .channel import Channel
from .lending import is_plain_pool

__all__ = ["channel_for", "channel_or_none", "close_channels", "close_own_channels", "supports_channel"]


def supports_channel(client: Any) -> TypeGuard[redis.Redis]:
    """True for clients whose lock requests go through a :class:`Channel`.

    Standalone Redis (a plain connection pool) in a process with real threads;
    Sentinel and Cluster clients, and greenlet pools, keep the pooled path.
    """
    return (isinstance(client, redis.Redis)
            and is_plain_pool(client.connection_pool)
            and not native.green())


_local = threading.local()
#: Bumped in a forked child: every thread-local cache of the parent is stale there.
_generation = 0


#: Guards the channel sets kept on clients (:func:`_register`, :func:`close_channels`).
_registry_lock = threading.Lock()


def _new_generation_in_child() -> None:
    global _generation, _registry_lock
    _generation += 1
    _registry_lock = threading.Lock()  # another thread may have held it while forking


def _register(channel: Channel, client: Any) -> None:
    """Keep ``channel`` in the set of ``client``'s channels (every thread's), weakly: on the
    client itself, so that the channels go with it (see :func:`close_channels`)."""
    with _registry_lock:
        channels: weakref.WeakSet[Channel] | None = vars(client).get("csb_channels")
        if channels is None:
            channels = client.csb_channels = weakref.WeakSet()
        channels.add(channel)


def close_channels(client: Any) -> None:
    """Close the channel of every thread of this process for ``client``, which is dropped
    (:func:`.recovery.lock_redis.reset_clients`): a channel's connection is its own, not of
    the client's pool, so closing the client leaves it open. A thread busy on its channel
    finishes its request first."""
    with _registry_lock:
        channels = list(getattr(client, "csb_channels", ()))
    for channel in channels:
        channel.close()


def close_own_channels() -> None:
    """Close every channel of the calling thread, which is done with them (a heartbeat
    thread that stops). Never the channels a forked child's thread inherited: their
    connections are the parent's."""
    channels = getattr(_local, "channels", None)
    if channels is None or _local.generation != _generation:
        return
    _local.channels = {}
    for _, channel in channels.values():
        if channel is not None:
            channel.close()


os.register_at_fork(after_in_child=_new_generation_in_child)


def channel_for(client: redis.Redis) -> Channel:
    """This thread's channel for ``client`` (a new one after a fork)."""
    channel = channel_or_none(client)
    if channel is None:
        raise TypeError(f"{client!r} has no lock channel (see supports_channel)")
    return channel


def channel_or_none(client: Any) -> Channel | None:
    """This thread's channel for ``client``, or None when it has none (:func:`supports_channel`).

    One dictionary look-up per lock request: the verdict is cached with the channel. In a
    process patched by gevent or eventlet no client has one (:func:`supports_channel`), and
    the thread-local there is a greenlet's own, new for each run: once the process is known
    to be patched (:func:`.native.green` said so), the answer is None at once.
    """
    if native._patched:
        return None
    channels: dict[int, tuple[weakref.ref[Any], Channel | None]] | None = getattr(_local, "channels", None)
    if channels is not None and _local.generation == _generation:
        known = channels.get(id(client))
        if known is not None and known[0]() is client:
            return known[1]
    else:
        channels = _local.channels = {}
        _local.generation = _generation
    # A new client, an id reused, or a new process. Channels closed since their client was
    # dropped are forgotten (each keeps its client alive, so its entry would stay for ever).
    for ident in [ident for ident, (_, known_channel) in channels.items()
                  if known_channel is not None and known_channel.closed]:
        del channels[ident]
    channel = None
    if supports_channel(client):
        channel = Channel(client)
        _register(channel, client)
    channels[id(client)] = (weakref.ref(client), channel)
    return channel

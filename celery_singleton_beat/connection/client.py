"""The Redis client used for locks and beat slots, for every topology.

:func:`redis_from_url` builds a client for any form of ``singleton_redis_url``
(one per app and process: :func:`.recovery.lock_redis.get_redis`). On a single
server each thread that takes locks also keeps a dedicated connection of its own
(:mod:`.channel`), made from the pool's settings but outside the pool (so
``max_connections`` does not bound it). The topologies:

* one server (``redis://``, ``rediss://``, ``unix://``): :class:`redis.Redis`;
* Sentinel (``sentinel://h1:26379;sentinel://h2:26379`` + ``master_name``): the
  :class:`redis.Redis` that :meth:`redis.sentinel.Sentinel.master_for` returns,
  with a pool that asks the sentinels for the primary on every new connection and
  at least every half second of use, and drops connections to a former primary
  (:mod:`.sentinel`);
* Cluster (``redis+cluster://h1:7000,h2:7001``): :class:`SingletonRedisCluster`, a
  :class:`redis.cluster.RedisCluster` (it routes each command to the node serving
  its key's hash slot) that reports an unreachable cluster as
  :class:`ClusterUnavailable`, a :class:`redis.ConnectionError`, as every other
  topology reports an outage.

The helpers below hide what differs on Cluster: :func:`scan_all` and
:func:`mget_any` for tools that walk keys, :func:`primary_clients` for
per-server commands, and :func:`call_acknowledged` for ``WAIT``, which must run
on the very connection (and node) that made the write.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any, TypeVar, Union

import redis
from redis.backoff import NoBackoff
from redis.cluster import PRIMARY, ClusterNode, ClusterPipeline, RedisCluster, get_node_name
from redis.exceptions import MovedError, RedisClusterException, SlotNotCoveredError
from redis.retry import Retry

from .sentinel import EpochSentinel, FollowingSentinelPool
from .url import CLUSTER, DEFAULT_REDIS_OPTIONS, SENTINEL, SENTINEL_OPTIONS, parse_redis_url

__all__ = [
    "ACL_COMMANDS",
    "ClusterUnavailable",
    "RedisClient",
    "ReplicasNotAcknowledged",
    "SingletonRedisCluster",
    "acl_rules",
    "call_acknowledged",
    "cluster_moved",
    "cluster_node_at",
    "cluster_reread",
    "group_by_node",
    "is_cluster",
    "is_cluster_outage",
    "mget_any",
    "pinned",
    "primaries",
    "primary_clients",
    "redis_from_url",
    "scan_all",
]

#: What :func:`redis_from_url` returns: a one-server (or Sentinel-managed) client, or a Cluster client.
RedisClient = Union[redis.Redis, RedisCluster]  # noqa: UP007 (a runtime alias: `|` needs 3.10 objects)

T = TypeVar("T")

#: Redis commands the library sends, by what needs them: the minimal command
#: set of an ACL user for workers, beats and publishers (see :func:`acl_rules`).
#: Commands called inside the Lua scripts are listed too: Redis checks them
#: against the caller's ACL.
ACL_COMMANDS: dict[str, tuple[str, ...]] = {
    # acquire (SET NX PX GET, TIME, EXISTS, DEL; MULTI/EXEC only in a take-over's look), renew / release and their
    # scripts, the per-connection look at the server (INFO, EVAL of the recovery
    # check), counters in batches (singleton_stats). Native DELIFEQ / DELEX / SET IFEQ
    # are used where granted (a NOPERM falls back to the scripts); so is PEXPIRETIME
    # (Redis 7.0+: a look at a held lock reads its expiry as stored).
    "locks": ("multi", "exec", "time", "get", "set", "del", "exists", "pexpire", "pttl", "evalsha", "eval",
              "script|load", "info", "hincrby", "pexpiretime"),
    # worker liveness: the heartbeat (SET ... GET) and the take-over check (EXISTS)
    "liveness": ("set", "exists"),
    # beat: slot claims, history and counters, start-up check
    "beat": ("set", "lpush", "ltrim", "hincrby", "ping"),
    # idle connections' health checks (health_check_interval)
    "health": ("ping",),
    # the start-up check of workers and beats names the server and its version
    # (refused, it only costs that line: SET ... GET then decides the version)
    "startup": ("info",),
    # singleton_wait_replicas > 0
    "wait": ("wait",),
    # Redis Cluster clients discover the slots (and the command table) on start, follow a
    # migrating slot to its target (ASKING); the look at each new connection finds the
    # node's own slots (its shard's recovery records)
    "cluster": ("cluster|slots", "cluster|nodes", "command", "asking"),
    # a database other than 0 in the URL
    "select": ("select",),
}


def acl_rules(prefix: str = "singleton", *, cluster: bool = False, wait: bool = False,
              select: bool = False) -> list[str]:
    """``ACL SETUSER`` rules for a user that may do exactly what the library needs.

    ``prefix`` is the effective ``singleton_key_prefix`` (with any global key
    prefix in front). Example: ``ACL SETUSER app on >secret`` followed by these.
    """
    groups = ["locks", "liveness", "beat", "health", "startup"]
    groups += ["wait"] * wait + ["cluster"] * cluster + ["select"] * select
    commands = sorted({command for group in groups for command in ACL_COMMANDS[group]})
    return ["resetkeys", f"~{prefix}:*", "resetchannels", "-@all", *(f"+{c}" for c in commands)]


class ReplicasNotAcknowledged(redis.exceptions.RedisError):
    """Fewer replicas than ``singleton_wait_replicas`` confirmed a write in time.

    A :class:`redis.RedisError`, so every caller treats it as "Redis
    unavailable": tasks retry (fail closed) or run without their lock (fail
    open), beat does not send the slot (unless it fails open). The write was
    undone before this is raised when the caller said how (``undo`` of
    :func:`call_acknowledged`).
    """

    def __init__(self, key: str, acknowledged: int, wanted: int, timeout: float) -> None:
        super().__init__(key, acknowledged, wanted, timeout)
        self.key, self.acknowledged, self.wanted, self.timeout = key, acknowledged, wanted, timeout

    def __str__(self) -> str:
        return (f"{self.key}: {self.acknowledged} of {self.wanted} replica(s) acknowledged "
                f"the write within {self.timeout}s")


class ClusterUnavailable(redis.exceptions.ConnectionError):
    """No Redis Cluster node answered, or no node serves a key's slot.

    redis-py reports these as ``RedisClusterException``, which is *not* a
    :class:`redis.RedisError`; the library's clients raise this instead, so
    that a Cluster outage is handled like any other (fail closed or open).
    """


def is_cluster_outage(exc: RedisClusterException) -> bool:
    """Tell "the cluster cannot be reached or is not covering a slot" from misuse."""
    if isinstance(exc, SlotNotCoveredError) or "not covered" in str(exc):
        return True
    return isinstance(exc.__cause__, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError))


def _asked_to_unknown_node(exc: AttributeError) -> bool:
    """redis-py's crash when it follows an ``-ASK`` to a node its node table lacks (it looks
    the node up by name, finds None, and asks None for its connection): a node being added
    to the cluster, which serves no slot until a first slot finished migrating to it.
    redis-py 8.2's error metrics then crash in turn on the missing node (``'NoneType' object
    has no attribute 'host'``): the first crash is that one's context."""
    seen: BaseException | None = exc
    for _ in range(3):
        if seen is None:
            return False
        if "'NoneType' object has no attribute 'redis_connection'" in str(seen):
            return True
        seen = seen.__context__
    return False


@contextmanager
def _outage_as_connection_error(client: Any = None) -> Iterator[None]:
    try:
        yield
    except RedisClusterException as exc:
        if is_cluster_outage(exc):
            raise ClusterUnavailable(str(exc)) from exc
        raise
    except AttributeError as exc:
        # redis-py's own commands and pipelines cannot follow such an -ASK (the library's
        # requests can: .redirects). Reported as the cluster momentarily unavailable for the
        # request (callers fail closed and try again), the layout read again for the next.
        if client is None or not _asked_to_unknown_node(exc):
            raise
        with suppress(RedisClusterException, redis.RedisError):
            client.nodes_manager.initialize()
        raise ClusterUnavailable("a -ASK named a node outside the client's slot map "
                                 "(a slot migrating to a node being added)") from exc


class _SingletonClusterPipeline(ClusterPipeline):
    """A Cluster pipeline whose ``execute`` reports outages as :class:`ClusterUnavailable`
    (and redis-py's crash on an ``-ASK`` to a node being added as one: see
    :func:`_outage_as_connection_error`)."""

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        with _outage_as_connection_error(self):
            return super().execute(*args, **kwargs)


class SingletonRedisCluster(RedisCluster):
    """:class:`RedisCluster` whose outages are :class:`ClusterUnavailable` (a ``RedisError``),
    redis-py's crash on an ``-ASK`` to a node being added too."""

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        with _outage_as_connection_error(self):
            return super().execute_command(*args, **kwargs)  # type: ignore[no-untyped-call]  # redis-py

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        pipe: ClusterPipeline = super().pipeline(transaction, shard_hint)  # type: ignore[no-untyped-call]
        pipe.__class__ = _SingletonClusterPipeline  # the same object, with the execute above
        return pipe


# -------------------------------------------------------------------- building


#: Options that say what a connection tells the server of its client library (CLIENT SETINFO).
_DRIVER_OPTIONS = ("driver_info", "lib_name", "lib_version")


@functools.cache
def _driver_info() -> Any:
    """redis-py's default client-library details, built once (None before redis-py had them).

    redis-py 7+ builds them for every connection it makes, reading the installed package's
    metadata each time: milliseconds of CPU per connection, paid as a gevent worker's first
    runs open the pool's connections (64 by default) while it takes in its messages. The
    same details, built once, are given to every connection the library's clients make.
    """
    try:
        from redis.driver_info import DriverInfo
    except ImportError:
        return None
    return DriverInfo()


def redis_from_url(url: str, **options: Any) -> RedisClient:
    """A client for any ``singleton_redis_url`` form, with the library's default timeouts.

    ``options`` are redis-py keyword arguments (``singleton_redis_options``);
    the URL's query string wins over them, as in redis-py. For Sentinel they
    also take ``master_name``, ``sentinel_kwargs`` (auth and TLS of the
    sentinels themselves; they get the socket timeouts by default) and
    ``min_other_sentinels``.
    """
    target = parse_redis_url(url)
    options = dict(options)
    extra = {name: options.pop(name) for name in SENTINEL_OPTIONS if name in options}
    connection = {**DEFAULT_REDIS_OPTIONS, **options, **target.connection}
    if not any(name in connection for name in _DRIVER_OPTIONS) and _driver_info() is not None:
        connection["driver_info"] = _driver_info()

    if target.topology == SENTINEL:
        master_name = target.master_name or extra.get("master_name")
        if not master_name:
            raise ValueError(f"a Sentinel URL needs master_name (in the URL or the options): {url!r}")
        # Sentinels get the socket timeouts and no retries by default: redis-py
        # would retry a dead sentinel for seconds before asking the next one.
        sentinel_defaults = {k: v for k, v in connection.items() if k.startswith("socket_")}
        sentinel_defaults["retry"] = Retry(NoBackoff(), 0)
        sentinel = EpochSentinel(
            list(target.nodes),
            min_other_sentinels=extra.get("min_other_sentinels", 0),
            sentinel_kwargs={**sentinel_defaults, **(extra.get("sentinel_kwargs") or {})},
            **connection,
        )
        master: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call,unused-ignore]  # redis-py before 8.2
            master_name, redis_class=redis.Redis, connection_pool_class=FollowingSentinelPool)
        return master

    if target.topology == CLUSTER:
        with _outage_as_connection_error():  # no node answered: an outage, not a crash
            return SingletonRedisCluster(
                startup_nodes=[ClusterNode(host, port) for host, port in target.nodes], **connection)

    client = redis.Redis(connection_pool=redis.ConnectionPool(**connection))
    client.auto_close_connection_pool = True  # as Redis.from_url: close() closes the pool
    return client


# -------------------------------------------------------------------- topology helpers


#: Client classes already judged by :func:`is_cluster`: ``RedisCluster``'s ``isinstance``
#: goes through ``typing``'s protocol check, several microseconds on every lock request.
_cluster_classes: dict[type, bool] = {}


def is_cluster(client: Any) -> bool:
    """True for a Redis Cluster client (judged once per class)."""
    kind = type(client)
    known = _cluster_classes.get(kind)
    if known is None:
        known = _cluster_classes[kind] = isinstance(client, RedisCluster)
    return known


def primaries(client: RedisClient) -> list[tuple[str, redis.Redis]]:
    """``(node name, client)`` of every primary server; ``("", client)`` off Cluster.

    For per-server commands (``INFO``, ``CONFIG GET``, ``SCAN``, ``DBSIZE``):
    on Cluster, the client would send them to one node only.
    """
    if isinstance(client, RedisCluster):
        return [(node.name, client.get_redis_connection(node)) for node in client.get_primaries()]
    return [("", client)]


def primary_clients(client: RedisClient) -> list[redis.Redis]:
    """One client per primary server (see :func:`primaries`)."""
    return [server for _, server in primaries(client)]


def scan_all(client: RedisClient, match: str, count: int = 1000) -> Iterator[bytes]:
    """Every key matching ``match``, with ``SCAN`` on each primary in turn (never ``KEYS``)."""
    for server in primary_clients(client):
        yield from server.scan_iter(match=match, count=count)


def mget_any(client: RedisClient, keys: Sequence[Any]) -> list[Any]:
    """``MGET`` of keys in any hash slots (on Cluster: one ``MGET`` per slot, pipelined)."""
    if not keys:
        return []
    if isinstance(client, RedisCluster):
        return client.mget_nonatomic(list(keys))
    return client.mget(list(keys))


def group_by_node(client: RedisClient, keys: Sequence[str]) -> list[list[int]]:
    """Indexes of ``keys`` grouped by the server that holds them (one group off Cluster).

    For batches that must run on one connection per server, e.g. slot claims
    followed by ``WAIT`` through :func:`call_acknowledged`.
    """
    if not isinstance(client, RedisCluster):
        return [list(range(len(keys)))] if keys else []
    groups: dict[str, list[int]] = {}
    for index, key in enumerate(keys):
        groups.setdefault(client.get_node_from_key(key).name, []).append(index)
    return list(groups.values())


def cluster_node_at(client: RedisCluster, host: str, port: int) -> ClusterNode:
    """The node of ``client`` at ``host:port`` (the address of a ``-ASK`` reply), added to
    its node table if the slot map does not list it.

    A node being added to a cluster serves no slot until a first slot finished migrating
    to it: ``CLUSTER SLOTS`` does not name it, so reading the layout again would not find
    it, and a ``-ASK`` to it could not be followed. It is added as redis-py adds the node
    of a ``-MOVED`` it follows, as a primary, the slot map left as it is.
    :meth:`RedisCluster.get_redis_connection` then makes its pool with the client's
    connection settings, ``redis_connect_func`` included (each new connection is looked
    at, as on every node). The next read of the layout keeps the node (and its pool) once
    it serves a slot, and drops it otherwise.
    """
    manager = client.nodes_manager
    host, port = manager.remap_host_port(host, port)  # as the addresses of CLUSTER SLOTS are
    node: ClusterNode | None = manager.get_node(host=host, port=port)
    if node is None:
        # setdefault: one node for threads that add it at once (the table itself is replaced,
        # not changed, by a read of the layout).
        node = manager.nodes_cache.setdefault(get_node_name(host, port), ClusterNode(host, port, PRIMARY))
    return node


def cluster_reread(client: RedisCluster) -> None:
    """Read the cluster's layout again (``CLUSTER SLOTS``): after a ``-MOVED`` (the slot has
    a new owner), or when a node of the slot map could not be reached (it may be gone:
    removed from the cluster once its slots moved away, or a failed primary whose replica
    took over). No node answering is :class:`ClusterUnavailable`, as any Cluster outage."""
    with _outage_as_connection_error():
        client.nodes_manager.initialize()


def cluster_moved(client: Any, error: Exception) -> bool:
    """True when ``error`` says a Cluster slot moved; the client's layout is then read again."""
    # redis-py's parser turns "-MOVED 788 host:port" into a MovedError saying "788 host:port".
    if not isinstance(client, RedisCluster) or not (
            isinstance(error, MovedError) or any(word in str(error) for word in ("MOVED", "ASK"))):
        return False
    client.nodes_manager.initialize()
    return True


@contextmanager
def pinned(client: RedisClient, key: str) -> Iterator[redis.Redis]:
    """A client bound to one connection of the server that holds ``key``.

    Everything sent through it travels on that connection, which ``WAIT``
    needs: it counts the replicas that have the writes *of its connection*.
    The connection goes back to its pool on exit.
    """
    server = client.get_redis_connection(client.get_node_from_key(key)) \
        if isinstance(client, RedisCluster) else client
    single = server.client()
    try:
        yield single
    finally:
        single.close()


def call_acknowledged(client: RedisClient, key: str, call: Callable[[RedisClient], T], *,
                      replicas: int, timeout: float,
                      undo: Callable[[RedisClient, T], Any] | None = None) -> T:
    """Run ``call`` and wait until ``replicas`` replicas have its writes (``WAIT``).

    With ``replicas <= 0`` this is ``call(client)``, nothing more. Otherwise
    ``call`` gets a client pinned to one connection of the server holding
    ``key`` (so its commands must touch that server only: one key, or keys of
    one hash tag), then ``WAIT replicas timeout`` runs on that connection.
    When fewer replicas acknowledge, ``undo(conn, result)`` reverts the write
    (e.g. gives the lock back) and :class:`ReplicasNotAcknowledged` is raised.

    What it buys: a write acknowledged by a replica survives the failover
    that promotes that replica. It narrows the window of asynchronous
    replication; it does not close it (another replica may be promoted, and a
    replica may lose the write in a restart without persistence).
    """
    if replicas <= 0:
        return call(client)
    wait_ms = max(1, round(timeout * 1000))  # WAIT n 0 would block forever
    for attempt in (1, 2):
        try:
            with _outage_as_connection_error(), pinned(client, key) as conn:
                result = call(conn)
                acknowledged = int(conn.wait(replicas, wait_ms))
                if acknowledged < replicas and undo is not None:
                    undo(conn, result)
            break
        except MovedError:
            # The slot moved to another Cluster node: learn the new layout, try once more.
            if attempt == 2 or not isinstance(client, RedisCluster):
                raise
            client.nodes_manager.initialize()
    if acknowledged < replicas:
        raise ReplicasNotAcknowledged(key, acknowledged, replicas, timeout)
    return result

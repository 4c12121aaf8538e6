"""What a ``singleton_redis_url`` names: one server, Sentinel or Cluster.

* one server: ``redis://``, ``rediss://`` (TLS) or ``unix://``, as redis-py reads them;
* Redis Sentinel, written as kombu writes it:
  ``sentinel://[user:password@]h1:26379[/db][?master_name=NAME];sentinel://h2:26379``;
* Redis Cluster: ``redis+cluster://[user:password@]h1:7000,h2:7001`` (``rediss+cluster://``
  for TLS); any reachable node is enough, the client discovers the others.

Parsing only: which settings supply the URL and its options is :mod:`.config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from redis.connection import parse_url

__all__ = [
    "CLUSTER",
    "CLUSTER_SCHEMES",
    "DEFAULT_REDIS_OPTIONS",
    "REDIS_SCHEMES",
    "SENTINEL",
    "SENTINEL_OPTIONS",
    "SENTINEL_SCHEME",
    "STANDALONE",
    "SUPPORTED_SCHEMES",
    "RedisTarget",
    "parse_redis_url",
    "sanitize_redis_url",
    "topology_of",
    "url_scheme",
]

#: Keys of ``singleton_redis_options`` that configure Sentinel itself (the same
#: names as kombu's transport options); every other key goes to redis-py connections.
SENTINEL_OPTIONS = ("master_name", "sentinel_kwargs", "min_other_sentinels")

#: Connection options applied unless the URL or ``singleton_redis_options`` say
#: otherwise. Fail fast: a lock that cannot be asked for within a few seconds is
#: "Redis unavailable" (fail closed), not a hung worker. ``max_connections`` bounds
#: a pool's connections (a gevent worker's runs share them: a request waits for one,
#: see :mod:`.lending`); redis-py 5 had no bound, redis-py 8 has 100.
DEFAULT_REDIS_OPTIONS: dict[str, Any] = {
    "socket_timeout": 5.0,
    "socket_connect_timeout": 5.0,
    "health_check_interval": 30,
    "max_connections": 64,
}

#: URL schemes that point at a single Redis server.
REDIS_SCHEMES = ("redis", "rediss", "unix")
#: Redis Sentinel, kombu style: ``sentinel://h1:26379;sentinel://h2:26379``.
SENTINEL_SCHEME = "sentinel"
#: Redis Cluster: ``redis+cluster://h1:7000,h2:7001`` (``rediss+cluster`` with TLS).
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
#: Every scheme ``singleton_redis_url`` accepts.
SUPPORTED_SCHEMES = (*REDIS_SCHEMES, SENTINEL_SCHEME, *CLUSTER_SCHEMES)

#: Topologies, as reported by :attr:`SingletonSettings.topology`.
STANDALONE, SENTINEL, CLUSTER = "standalone", "sentinel", "cluster"

# Celery spells TLS requirements as the ssl module does; redis-py wants lower-case words.
_CERT_REQS = {"cert_none": "none", "cert_optional": "optional", "cert_required": "required"}



@dataclass(frozen=True)
class RedisTarget:
    """What a Redis URL names, in the terms redis-py is built from.

    ``connection`` holds redis-py connection arguments read from the URL (host,
    port, db, username, password, Unix socket path, TLS and query-string
    options). For Sentinel it describes connections to the *primary*, for
    Cluster those to every node (``ssl=True`` for ``rediss+cluster``).
    ``nodes`` lists the sentinels, or the Cluster nodes to start discovery from.
    """

    topology: str
    connection: dict[str, Any]
    nodes: tuple[tuple[str, int], ...] = ()
    #: Sentinel only: ``?master_name=`` of the URL, if given there.
    master_name: str | None = None


def sanitize_redis_url(url: str | None, mask: str = "**") -> str:
    """``url`` with every password masked, for logs and banners; any URL form.

    kombu's ``maybe_sanitize_url`` cannot parse Sentinel lists (``;``) or
    Cluster node lists (``,``), so it must not be used on ``singleton_redis_url``.
    """
    chunks = []
    for chunk in (url or "").split(";"):
        scheme, sep, rest = chunk.strip().partition("://")
        end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
        userinfo, at, hosts = rest[:end].rpartition("@")
        if at and ":" in userinfo:
            userinfo = f"{userinfo.split(':', 1)[0]}:{mask}"
        chunks.append(f"{scheme}{sep}{userinfo}{at}{hosts}{rest[end:]}")
    return ";".join(chunks)


def url_scheme(url: str) -> str:
    """The scheme of a URL, or of the first part of a ``;``-list."""
    return urlsplit(url.split(";", 1)[0].strip()).scheme.lower()


def topology_of(url: str) -> str:
    """The topology a URL names, from its scheme alone."""
    scheme = url_scheme(url)
    if scheme == SENTINEL_SCHEME:
        return SENTINEL
    if scheme in CLUSTER_SCHEMES:
        return CLUSTER
    return STANDALONE


def _normalize_connection(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Accept Celery's spelling of ``ssl_cert_reqs`` (``CERT_REQUIRED``) beside redis-py's."""
    reqs = kwargs.get("ssl_cert_reqs")
    if isinstance(reqs, str):
        kwargs["ssl_cert_reqs"] = _CERT_REQS.get(reqs.lower(), reqs.lower())
    return kwargs


def _host_port(text: str, default_port: int, url: str) -> tuple[str, int]:
    parts = urlsplit(f"//{text}")
    try:
        port = parts.port or default_port
    except ValueError:
        raise ValueError(f"bad port in {text!r} of {url!r}") from None
    if not parts.hostname:
        raise ValueError(f"no host in {text!r} of {url!r}")
    return parts.hostname, port


def _parse_sentinel(url: str) -> RedisTarget:
    """``sentinel://[user:pw@]h1:26379[/db][?opts];sentinel://h2:26379``, kombu's form.

    Credentials, database and query options belong to the primary (as in kombu
    and Celery): the first chunk that names them wins. Sentinels' own auth and
    TLS go in ``sentinel_kwargs``.
    """
    nodes: list[tuple[str, int]] = []
    connection: dict[str, Any] = {}
    for chunk in filter(None, (part.strip() for part in url.split(";"))):
        scheme, sep, rest = chunk.partition("://")
        if not sep or scheme.lower() != SENTINEL_SCHEME:
            raise ValueError(f"every part of a Sentinel URL must be sentinel://host:port, got {chunk!r}")
        parsed = parse_url(f"redis://{rest}")
        nodes.append((parsed.pop("host", None) or "localhost", parsed.pop("port", None) or 26379))
        for name, value in parsed.items():
            connection.setdefault(name, value)
    if "ssl" in connection:  # a query-string flag reaches us as text
        connection["ssl"] = str(connection["ssl"]).lower() in ("1", "true", "yes", "on")
    master_name = connection.pop("master_name", None)
    return RedisTarget(SENTINEL, _normalize_connection(connection), tuple(nodes),
                       master_name=master_name)


def _parse_cluster(url: str) -> RedisTarget:
    """``redis+cluster://[user:pw@]h1:7000,h2:7001[?opts]``: startup nodes of a Cluster."""
    scheme, _, rest = url.partition("://")
    base = "rediss" if scheme.lower() == "rediss+cluster" else "redis"
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    if path.strip("/") not in ("", "0") or "db" in parse_qs(query):
        raise ValueError(f"Redis Cluster has only database 0, got {url!r}")
    userinfo, at, hosts = netloc.rpartition("@")
    nodes = tuple(_host_port(host, 6379, url) for host in hosts.split(",") if host.strip())
    if not nodes:
        raise ValueError(f"no node in {url!r}")
    # Credentials and options read as redis-py reads them for one node; every
    # node (also those discovered later) is then built from them.
    connection = parse_url(f"{base}://{userinfo}{at}localhost/" + (f"?{query}" if query else ""))
    for name in ("host", "port", "db", "connection_class"):
        connection.pop(name, None)
    if base == "rediss":
        connection["ssl"] = True
    return RedisTarget(CLUSTER, _normalize_connection(connection), nodes)


def parse_redis_url(url: str) -> RedisTarget:
    """Parse any URL form of ``singleton_redis_url``; ``ValueError`` says what is wrong."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"not a URL: {url!r}")
    url = url.strip()
    topology = topology_of(url)
    if topology == SENTINEL:
        return _parse_sentinel(url)
    if topology == CLUSTER:
        return _parse_cluster(url)
    if url_scheme(url) not in REDIS_SCHEMES:
        raise ValueError(f"unsupported scheme in {url!r}")
    return RedisTarget(STANDALONE, _normalize_connection(parse_url(url)))

"""The ``singleton_*`` settings: defaults, validation and lookup.

Settings live in ``app.conf`` like any other Celery setting. They are read and
validated once per app (at worker or beat start-up, or at first use in a
client), and any mistake raises :class:`~celery.exceptions.ImproperlyConfigured`
naming the setting, so a typo never turns into a silent default.

``singleton_redis_url`` names one of three topologies (one server, Sentinel,
Cluster: :mod:`.redis_url` reads them; see ``docs/deployment.md``).

When the URL is not set, the library uses the result backend's Redis, else the
broker's, and reuses what those settings say about that Redis: kombu's
``global_keyprefix``, Sentinel's ``master_name`` and the TLS options.
"""

from __future__ import annotations

import difflib
import math
import weakref
from dataclasses import dataclass, field, fields
from typing import Any

from celery import Celery
from celery.exceptions import ImproperlyConfigured
from redis.connection import SSLConnection

from .connection.url import (
    CLUSTER,
    DEFAULT_REDIS_OPTIONS,
    REDIS_SCHEMES,
    SENTINEL,
    SENTINEL_OPTIONS,
    SENTINEL_SCHEME,
    SUPPORTED_SCHEMES,
    RedisTarget,
    parse_redis_url,
    topology_of,
    url_scheme,
)

__all__ = [
    "SingletonSettings",
    "clear_settings_cache",
    "get_settings",
    "is_seconds",
    "validate_settings",
]

SETTING_PREFIX = "singleton_"

@dataclass(frozen=True)
class SingletonSettings:
    """All settings of the library, resolved for one Celery app.

    Each field is set in ``app.conf`` as ``singleton_<field>``.
    """

    #: Redis for locks and beat slots (any form of :data:`SUPPORTED_SCHEMES`).
    #: Default: the result backend if it is Redis, else the broker if it is Redis.
    redis_url: str | None = None
    #: Extra keyword arguments for the redis-py client (timeouts, TLS, ...);
    #: for Sentinel also :data:`SENTINEL_OPTIONS`. After validation it holds
    #: what was reused from the broker's or result backend's settings too.
    redis_options: dict[str, Any] = field(default_factory=dict)
    #: Prefix of every key the library writes; gives apps sharing a Redis their
    #: own space. When the library reuses the broker's (result backend's) Redis,
    #: kombu's (Celery's) ``global_keyprefix`` is put in front of it.
    key_prefix: str = "singleton"
    #: Default lease in seconds for task locks; renewed while the task runs.
    lock_ttl: float = 60.0
    #: How long a publish-time lock (``until_executed`` / ``until_executing``)
    #: waits for its run to start before it expires, in seconds.
    queue_lock_ttl: float = 3600.0
    #: Run a task without its lock when Redis cannot be reached (default: no).
    fail_open: bool = False
    #: Upper bound in seconds of the back-off used to retry a task whose lock
    #: could not be asked for (fail-closed), and of ``on_conflict="retry"``.
    retry_backoff_max: float = 60.0
    #: Keep counters (acquired, skipped, ...) in Redis: counted in the process and
    #: written in batches by a background thread, never as a request per run.
    #: Always off for Redis Cluster, where the counter hash lives in another slot
    #: than the lock.
    stats: bool = True
    #: Beat: send an entry whose slot cannot be claimed because Redis is down
    #: (default: no, the slot is skipped and logged). ``None`` follows ``fail_open``.
    beat_fail_open: bool | None = None
    #: Beat: after every beat was down, send the latest missed slot of each
    #: entry once (``"latest"``) or nothing (``"none"``).
    beat_catch_up: str = "latest"
    #: Beat: seconds an entry's "scheduled since" record outlives the last beat
    #: that had it: a beat started later than that after every beat was down
    #: starts as on a first deploy (no slot before now is sent). Default 7 days.
    beat_catch_up_window: float = 7 * 86400.0
    #: Beat: extra seconds a slot claim is kept beyond the entry's period.
    beat_claim_margin: float = 60.0
    #: Beat: seconds a won slot may stay claimed but unsent before the other
    #: beats take it over and send it (a beat that died between claim and
    #: publish, or mid-burst). Bounds how late a dead beat's slots are sent.
    beat_pending_lease: float = 5.0
    #: After taking a lock or a beat slot, wait until this many replicas have
    #: it (Redis ``WAIT``). Fewer within ``wait_timeout`` counts as "Redis
    #: unavailable": the lock is given back and ``fail_open`` decides. 0: no wait.
    wait_replicas: int = 0
    #: Seconds ``WAIT`` may block; below the socket timeout.
    wait_timeout: float = 1.0
    #: Seconds a worker incarnation counts as alive after its last heartbeat
    #: (renewed every third of it by the worker's main process). A lock whose
    #: holder's worker stopped proving it is alive for this long is taken over
    #: by the next run that wants it: a dead pod costs this, not ``lock_ttl``.
    liveness_ttl: float = 10.0
    #: Seconds the "this task id completed" marker of an ``acks_late`` run is
    #: kept, so a copy of its message delivered again later (visibility timeout,
    #: lost connection) ends without running. Default: twice the broker's
    #: ``visibility_timeout`` (kombu's default: one hour, so 7200 s).
    done_ttl: float = 7200.0

    @property
    def beat_fails_open(self) -> bool:
        """Whether beat sends unclaimed slots while Redis is unreachable."""
        return self.fail_open if self.beat_fail_open is None else self.beat_fail_open

    @property
    def topology(self) -> str:
        """:data:`STANDALONE`, :data:`SENTINEL` or :data:`CLUSTER`, from ``redis_url``."""
        return topology_of(self.redis_url or "")


_FIELD_NAMES = {f.name for f in fields(SingletonSettings)}
_CACHE: weakref.WeakKeyDictionary[Celery, SingletonSettings] = weakref.WeakKeyDictionary()


def _is_redis_url(url: Any) -> bool:
    return isinstance(url, str) and url_scheme(url) in SUPPORTED_SCHEMES


def _first_redis_url(value: Any) -> str | None:
    """Pick the Redis URL of a Celery URL setting (which may be a list or ``;``-list).

    A Sentinel list is one URL (every ``sentinel://`` part is kept); otherwise
    the first Redis URL wins, as with kombu's fail-over lists.
    """
    if isinstance(value, (list, tuple)):
        candidates = [str(v).strip() for v in value]
    elif isinstance(value, str):
        candidates = [part.strip() for part in value.split(";")]
    else:
        return None
    candidates = [c for c in candidates if c]
    if candidates and url_scheme(candidates[0]) == SENTINEL_SCHEME:
        return ";".join(c for c in candidates if url_scheme(c) == SENTINEL_SCHEME)
    return next((c for c in candidates if url_scheme(c) in REDIS_SCHEMES), None)


def is_seconds(value: Any) -> bool:
    """``value`` can be a duration: an int or a float (not a bool), above 0 and finite (an
    infinite or NaN one cannot be written as a key's TTL in milliseconds)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf


def _positive_number(name: str, value: Any) -> float:
    if not is_seconds(value):
        raise ImproperlyConfigured(
            f"{SETTING_PREFIX}{name} must be a number of seconds > 0, got {value!r}"
        )
    return float(value)


def _mapping(conf: Any, name: str) -> dict[str, Any]:
    value = conf.get(name) or {}
    return dict(value) if isinstance(value, dict) else {}


@dataclass
class _Source:
    """Where the lock URL came from, and what that Celery setting says about its Redis."""

    setting: str
    transport_options: dict[str, Any]
    ssl_options: Any
    global_keyprefix: str


def _url_source(conf: Any, given: dict[str, Any]) -> tuple[str, _Source]:
    """The lock URL and its origin: our setting, else the result backend, else the broker."""
    url = given.get("redis_url")
    if url is not None:
        if not _is_redis_url(url):
            raise ImproperlyConfigured(
                "singleton_redis_url must be a Redis URL "
                f"({', '.join(s + '://' for s in SUPPORTED_SCHEMES)}), got {url!r}"
            )
        return url, _Source("singleton_redis_url", {}, None, "")
    backend = _first_redis_url(conf.result_backend)
    if backend is not None:
        options = _mapping(conf, "result_backend_transport_options")
        prefix = str(options.get("global_keyprefix") or "")
        if prefix and prefix[-1] not in ":_-.":  # Celery's rule for its own result keys
            prefix += "_"
        return backend, _Source("result_backend", options, conf.get("redis_backend_use_ssl"), prefix)
    broker = _first_redis_url(conf.broker_url)
    if broker is not None:
        options = _mapping(conf, "broker_transport_options")
        return broker, _Source("broker_url", options, conf.get("broker_use_ssl"),
                               str(options.get("global_keyprefix") or ""))
    raise ImproperlyConfigured(
        "celery-singleton-beat needs Redis: set singleton_redis_url "
        "(neither the result backend nor the broker is a Redis URL)"
    )


def _resolve_options(conf: Any, target: RedisTarget, source: _Source,
                     given: dict[str, Any]) -> dict[str, Any]:
    """``singleton_redis_options`` completed with what the URL's origin says (ours win)."""
    options = given.get("redis_options", {})
    if not isinstance(options, dict):
        raise ImproperlyConfigured(f"singleton_redis_options must be a dict, got {options!r}")
    options = dict(options)
    if source.ssl_options:
        # broker_use_ssl / redis_backend_use_ssl: kombu and Celery turn TLS on
        # whatever the scheme, with the same option names as redis-py.
        if isinstance(source.ssl_options, dict):
            for name, value in source.ssl_options.items():
                options.setdefault(name, value)
        if target.topology == SENTINEL:
            options.setdefault("ssl", True)
        elif "connection_class" not in target.connection:
            options.setdefault("connection_class", SSLConnection)

    if target.topology != SENTINEL:
        misplaced = sorted(set(options) & set(SENTINEL_OPTIONS))
        if misplaced:
            raise ImproperlyConfigured(
                f"singleton_redis_options {misplaced} are for sentinel:// URLs only; "
                f"the lock Redis is {target.topology} ({source.setting})"
            )
        return options

    # Sentinel: each option from the URL or our options, else from the setting the
    # URL came from, else (URL written out) the broker's, then the result backend's.
    lookups = [source.transport_options] if source.setting != "singleton_redis_url" else [
        _mapping(conf, "broker_transport_options"), _mapping(conf, "result_backend_transport_options")]
    if target.master_name:
        options["master_name"] = target.master_name
    for name in SENTINEL_OPTIONS:
        if name not in options:
            found = next((o[name] for o in lookups if o.get(name) is not None), None)
            if found is not None:
                options[name] = found
    master = options.get("master_name")
    if not isinstance(master, str) or not master:
        raise ImproperlyConfigured(
            "a sentinel:// singleton_redis_url needs the primary's name: set "
            "singleton_redis_options={'master_name': ...}, ?master_name=... in the URL, "
            f"or broker_transport_options['master_name']; got {master!r}"
        )
    if not isinstance(options.get("sentinel_kwargs", {}), dict):
        raise ImproperlyConfigured(
            f"singleton_redis_options['sentinel_kwargs'] must be a dict, got {options['sentinel_kwargs']!r}"
        )
    others = options.get("min_other_sentinels", 0)
    if isinstance(others, bool) or not isinstance(others, int) or others < 0:
        raise ImproperlyConfigured(
            f"singleton_redis_options['min_other_sentinels'] must be an int >= 0, got {others!r}"
        )
    return options


def validate_settings(app: Celery) -> SingletonSettings:
    """Read and check every ``singleton_*`` setting of ``app``; raise on any mistake."""
    conf = app.conf
    keys = list(conf.keys())  # loads a pending configuration, which sets its prefix
    # Settings loaded with a namespace (``config_from_object("django.conf:settings",
    # namespace="CELERY")``, the Django layout) keep it in their keys: CELERY_SINGLETON_*.
    namespace = str(getattr(conf, "prefix", None) or "").lower()
    given: dict[str, Any] = {}
    for key in keys:
        if not isinstance(key, str):
            continue
        lowered = key.lower()
        if namespace and lowered.startswith(namespace + SETTING_PREFIX):
            lowered = lowered[len(namespace):]
        if not lowered.startswith(SETTING_PREFIX):
            continue
        name = lowered[len(SETTING_PREFIX):]
        if name not in _FIELD_NAMES:
            hint = difflib.get_close_matches(name, sorted(_FIELD_NAMES), n=1)
            suggestion = f"; did you mean {SETTING_PREFIX}{hint[0]}?" if hint else ""
            raise ImproperlyConfigured(f"unknown setting {key}{suggestion}")
        given[name] = conf[key]

    redis_url, source = _url_source(conf, given)
    try:
        target = parse_redis_url(redis_url)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{source.setting}: cannot use {redis_url!r}: {exc}") from None
    options = _resolve_options(conf, target, source, given)

    prefix = given.get("key_prefix", SingletonSettings.key_prefix)
    if not isinstance(prefix, str) or not prefix or any(c in prefix for c in "{} \n"):
        raise ImproperlyConfigured(
            f"singleton_key_prefix must be a non-empty string without braces or spaces, got {prefix!r}"
        )
    if any(c in source.global_keyprefix for c in "{} \n"):
        # A brace would become the Cluster hash tag of every key.
        raise ImproperlyConfigured(
            f"the global_keyprefix of {source.setting}'s transport options is put in front of "
            f"singleton_key_prefix and must not contain braces or spaces, got {source.global_keyprefix!r}"
        )
    for flag in ("fail_open", "stats"):
        if flag in given and not isinstance(given[flag], bool):
            raise ImproperlyConfigured(f"{SETTING_PREFIX}{flag} must be True or False, got {given[flag]!r}")
    stats = given.get("stats", target.topology != CLUSTER)
    if stats and target.topology == CLUSTER:
        raise ImproperlyConfigured(
            "singleton_stats must be False with Redis Cluster: the counters live in another "
            "hash slot than the locks and cannot be updated by the same script"
        )
    beat_fail_open = given.get("beat_fail_open")
    if beat_fail_open is not None and not isinstance(beat_fail_open, bool):
        raise ImproperlyConfigured(
            f"singleton_beat_fail_open must be True, False or None, got {beat_fail_open!r}"
        )
    catch_up = given.get("beat_catch_up", SingletonSettings.beat_catch_up)
    if catch_up not in ("latest", "none"):
        raise ImproperlyConfigured(
            f"singleton_beat_catch_up must be 'latest' or 'none', got {catch_up!r}"
        )
    wait_replicas = given.get("wait_replicas", SingletonSettings.wait_replicas)
    if isinstance(wait_replicas, bool) or not isinstance(wait_replicas, int) or wait_replicas < 0:
        raise ImproperlyConfigured(
            f"singleton_wait_replicas must be an int >= 0, got {wait_replicas!r}"
        )
    wait_timeout = _positive_number("wait_timeout", given.get("wait_timeout", SingletonSettings.wait_timeout))
    socket_timeout = target.connection.get(
        "socket_timeout", options.get("socket_timeout", DEFAULT_REDIS_OPTIONS["socket_timeout"]))
    if wait_replicas and socket_timeout is not None and wait_timeout >= float(socket_timeout):
        raise ImproperlyConfigured(
            f"singleton_wait_timeout ({wait_timeout}s) must be below the socket timeout "
            f"({socket_timeout}s), or a slow WAIT reads as a broken connection"
        )

    return SingletonSettings(
        redis_url=redis_url,
        redis_options=options,
        key_prefix=source.global_keyprefix + prefix,
        lock_ttl=_positive_number("lock_ttl", given.get("lock_ttl", SingletonSettings.lock_ttl)),
        queue_lock_ttl=_positive_number(
            "queue_lock_ttl", given.get("queue_lock_ttl", SingletonSettings.queue_lock_ttl)
        ),
        fail_open=given.get("fail_open", False),
        stats=stats,
        retry_backoff_max=_positive_number(
            "retry_backoff_max", given.get("retry_backoff_max", SingletonSettings.retry_backoff_max)
        ),
        beat_fail_open=beat_fail_open,
        beat_catch_up=catch_up,
        beat_catch_up_window=_positive_number(
            "beat_catch_up_window", given.get("beat_catch_up_window", SingletonSettings.beat_catch_up_window)
        ),
        beat_claim_margin=_positive_number(
            "beat_claim_margin", given.get("beat_claim_margin", SingletonSettings.beat_claim_margin)
        ),
        beat_pending_lease=_positive_number(
            "beat_pending_lease", given.get("beat_pending_lease", SingletonSettings.beat_pending_lease)
        ),
        wait_replicas=wait_replicas,
        wait_timeout=wait_timeout,
        liveness_ttl=_positive_number(
            "liveness_ttl", given.get("liveness_ttl", SingletonSettings.liveness_ttl)),
        done_ttl=_positive_number("done_ttl", given.get("done_ttl", _default_done_ttl(conf))),
    )


def _default_done_ttl(conf: Any) -> float:
    """Twice the broker's visibility timeout: a redelivered copy arrives within one."""
    timeout = _mapping(conf, "broker_transport_options").get("visibility_timeout", 3600)
    try:
        return 2 * float(timeout)
    except (TypeError, ValueError):
        return SingletonSettings.done_ttl


#: Bumped by :func:`clear_settings_cache`: what was derived from cached settings is stale.
GENERATION = [0]


def get_settings(app: Celery) -> SingletonSettings:
    """The validated settings of ``app``, computed once and cached."""
    settings = _CACHE.get(app)
    if settings is None:
        settings = _CACHE[app] = validate_settings(app)
    return settings


def clear_settings_cache(app: Celery | None = None) -> None:
    """Forget cached settings (of one app, or all), e.g. after changing ``app.conf`` in tests."""
    GENERATION[0] += 1
    if app is None:
        _CACHE.clear()
    else:
        _CACHE.pop(app, None)

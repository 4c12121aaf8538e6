"""The ``singleton_*`` settings: defaults, validation and lookup.

Settings live in ``app.conf`` like any other Celery setting. They are read and
validated once per app (at worker or beat start-up, or at first use in a
client), and any mistake raises :class:`~celery.exceptions.ImproperlyConfigured`
naming the setting, so a typo never turns into a silent default.
"""

from __future__ import annotations

import difflib
import weakref
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

from celery import Celery
from celery.exceptions import ImproperlyConfigured

__all__ = ["SingletonSettings", "get_settings", "validate_settings", "REDIS_SCHEMES"]

#: URL schemes that point at a Redis server the library can talk to.
REDIS_SCHEMES = ("redis", "rediss", "unix")

SETTING_PREFIX = "singleton_"


@dataclass(frozen=True)
class SingletonSettings:
    """All settings of the library, resolved for one Celery app.

    Each field is set in ``app.conf`` as ``singleton_<field>``.
    """

    #: Redis for locks and beat slots. Default: the result backend if it is
    #: Redis, else the broker if it is Redis.
    redis_url: str | None = None
    #: Extra keyword arguments for the redis-py client (timeouts, TLS, ...).
    redis_options: dict[str, Any] = field(default_factory=dict)
    #: Prefix of every key the library writes; gives apps sharing a Redis their own space.
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
    #: Keep counters (acquired, skipped, ...) in Redis, updated inside the lock
    #: scripts (no extra round trip). Off for Redis Cluster, where the counter
    #: hash lives in another slot than the lock.
    stats: bool = True
    #: Beat: send an entry whose slot cannot be claimed because Redis is down
    #: (default: no, the slot is skipped and logged). ``None`` follows ``fail_open``.
    beat_fail_open: bool | None = None
    #: Beat: after every beat was down, send the latest missed slot of each
    #: entry once (``"latest"``) or nothing (``"none"``).
    beat_catch_up: str = "latest"
    #: Beat: extra seconds a slot claim is kept beyond the entry's period.
    beat_claim_margin: float = 60.0

    @property
    def beat_fails_open(self) -> bool:
        """Whether beat sends unclaimed slots while Redis is unreachable."""
        return self.fail_open if self.beat_fail_open is None else self.beat_fail_open


_FIELD_NAMES = {f.name for f in fields(SingletonSettings)}
_CACHE: "weakref.WeakKeyDictionary[Celery, SingletonSettings]" = weakref.WeakKeyDictionary()


def _is_redis_url(url: Any) -> bool:
    return isinstance(url, str) and urlsplit(url).scheme in REDIS_SCHEMES


def _first_redis_url(value: Any) -> str | None:
    """Pick the first Redis URL of a Celery URL setting (which may be a list or ``;``-list)."""
    if isinstance(value, (list, tuple)):
        candidates = list(value)
    elif isinstance(value, str):
        candidates = value.split(";")
    else:
        return None
    for candidate in candidates:
        candidate = candidate.strip()
        if _is_redis_url(candidate):
            return candidate
    return None


def _positive_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ImproperlyConfigured(
            f"{SETTING_PREFIX}{name} must be a number of seconds > 0, got {value!r}"
        )
    return float(value)


def validate_settings(app: Celery) -> SingletonSettings:
    """Read and check every ``singleton_*`` setting of ``app``; raise on any mistake."""
    conf = app.conf
    given: dict[str, Any] = {}
    for key in list(conf.keys()):
        if not isinstance(key, str) or not key.lower().startswith(SETTING_PREFIX):
            continue
        name = key.lower()[len(SETTING_PREFIX):]
        if name not in _FIELD_NAMES:
            hint = difflib.get_close_matches(name, sorted(_FIELD_NAMES), n=1)
            suggestion = f"; did you mean {SETTING_PREFIX}{hint[0]}?" if hint else ""
            raise ImproperlyConfigured(f"unknown setting {key}{suggestion}")
        given[name] = conf[key]

    redis_url = given.get("redis_url")
    if redis_url is None:
        redis_url = _first_redis_url(conf.result_backend) or _first_redis_url(conf.broker_url)
        if redis_url is None:
            raise ImproperlyConfigured(
                "celery-singleton-beat needs Redis: set singleton_redis_url "
                "(neither the result backend nor the broker is a Redis URL)"
            )
    elif not _is_redis_url(redis_url):
        raise ImproperlyConfigured(
            f"singleton_redis_url must be a Redis URL ({', '.join(s + '://' for s in REDIS_SCHEMES)}), "
            f"got {redis_url!r}"
        )

    options = given.get("redis_options", {})
    if not isinstance(options, dict):
        raise ImproperlyConfigured(f"singleton_redis_options must be a dict, got {options!r}")
    prefix = given.get("key_prefix", SingletonSettings.key_prefix)
    if not isinstance(prefix, str) or not prefix or any(c in prefix for c in "{} \n"):
        raise ImproperlyConfigured(
            f"singleton_key_prefix must be a non-empty string without braces or spaces, got {prefix!r}"
        )
    for flag in ("fail_open", "stats"):
        if flag in given and not isinstance(given[flag], bool):
            raise ImproperlyConfigured(f"{SETTING_PREFIX}{flag} must be True or False, got {given[flag]!r}")
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

    return SingletonSettings(
        redis_url=redis_url,
        redis_options=dict(options),
        key_prefix=prefix,
        lock_ttl=_positive_number("lock_ttl", given.get("lock_ttl", SingletonSettings.lock_ttl)),
        queue_lock_ttl=_positive_number(
            "queue_lock_ttl", given.get("queue_lock_ttl", SingletonSettings.queue_lock_ttl)
        ),
        fail_open=given.get("fail_open", False),
        stats=given.get("stats", True),
        retry_backoff_max=_positive_number(
            "retry_backoff_max", given.get("retry_backoff_max", SingletonSettings.retry_backoff_max)
        ),
        beat_fail_open=beat_fail_open,
        beat_catch_up=catch_up,
        beat_claim_margin=_positive_number(
            "beat_claim_margin", given.get("beat_claim_margin", SingletonSettings.beat_claim_margin)
        ),
    )


def get_settings(app: Celery) -> SingletonSettings:
    """The validated settings of ``app``, computed once and cached."""
    settings = _CACHE.get(app)
    if settings is None:
        settings = _CACHE[app] = validate_settings(app)
    return settings


def clear_settings_cache(app: Celery | None = None) -> None:
    """Forget cached settings (of one app, or all), e.g. after changing ``app.conf`` in tests."""
    if app is None:
        _CACHE.clear()
    else:
        _CACHE.pop(app, None)

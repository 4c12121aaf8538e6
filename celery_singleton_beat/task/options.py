"""The options of :class:`~celery_singleton_beat.SingletonTask`, checked when a task is bound.

A wrong option is refused at import (``ImproperlyConfigured``) rather than at the first
run: an unknown ``lock_mode`` or ``on_conflict``, a ``lock_ttl`` that is not a positive
number of seconds, ``unique_on`` naming arguments the task does not take, and an
attribute that looks like a misspelt option or another library's option name.
"""

from __future__ import annotations

from celery.exceptions import ImproperlyConfigured

from ..config import is_seconds
from .keys import check_unique_on, task_signature

__all__ = ["LOCK_MODES", "ON_CONFLICT", "OPTIONS", "check_options", "misspelt_option"]

LOCK_MODES = ("while_executing", "until_executed", "until_executing")
ON_CONFLICT = ("skip", "raise", "retry", "return_existing")
#: The task options of SingletonTask (checked at registration, typos included).
OPTIONS = ("unique_on", "lock_ttl", "lock_mode", "on_conflict")
#: Options of the libraries teams switch from (docs/migrating.md): library, what to use here.
_PEER_OPTIONS = {
    "lock_expiry": ("celery-singleton", "lock_ttl"),
    "raise_on_duplicate": ("celery-singleton", "on_conflict='raise'"),
    "once": ("celery-once", "lock_mode='until_executed' (with on_conflict='raise' for AlreadyQueued)"),
}


def _defined_on(cls: type, attribute: str) -> bool:
    """``hasattr`` without running descriptors (``Task.app`` would bind the class to an app)."""
    return any(attribute in vars(klass) for klass in cls.__mro__)


def _one_typo_apart(a: str, b: str) -> bool:
    """True if ``a`` becomes ``b`` by one edit: a character added, dropped or replaced,
    or two neighbouring characters swapped."""
    if abs(len(a) - len(b)) > 1 or a == b:
        return False
    if len(a) == len(b):
        differ = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
        return len(differ) == 1 or (len(differ) == 2 and differ[1] == differ[0] + 1
                                    and a[differ[0]] == b[differ[1]] and a[differ[1]] == b[differ[0]])
    short, long = (a, b) if len(a) < len(b) else (b, a)
    i = next((i for i, (x, y) in enumerate(zip(short, long, strict=False)) if x != y), len(short))
    return short[i:] == long[i + 1:]


def check_options(cls: type, base: type) -> None:
    """Refuse task class ``cls`` (a subclass of ``base``, SingletonTask) when an option is wrong."""
    name = getattr(cls, "name", None) or cls.__name__

    def bad(option: str, message: str) -> ImproperlyConfigured:
        return ImproperlyConfigured(f"task {name}: {option} {message}")

    lock_mode, on_conflict, ttl = cls.lock_mode, cls.on_conflict, cls.lock_ttl  # type: ignore[attr-defined]
    if lock_mode not in LOCK_MODES:
        raise bad("lock_mode", f"must be one of {', '.join(LOCK_MODES)}; got {lock_mode!r}")
    if on_conflict not in ON_CONFLICT:
        raise bad("on_conflict", f"must be one of {', '.join(ON_CONFLICT)}; got {on_conflict!r}")
    if ttl is not None and not is_seconds(ttl):
        raise bad("lock_ttl", f"must be a number of seconds > 0; got {ttl!r}")
    try:
        check_unique_on(name, task_signature(cls), cls.unique_on)  # type: ignore[attr-defined]
    except ValueError as exc:
        raise bad("unique_on", str(exc)) from None
    for klass in cls.__mro__:  # the task's own class and those between it and the base
        if klass is base:
            break
        for attribute in vars(klass):
            hint = misspelt_option(attribute, base)
            if hint is not None:
                raise ImproperlyConfigured(f"task {name}: {hint}")


def misspelt_option(attribute: str, base: type) -> str | None:
    """What to say about a task attribute that looks like a misspelt option, else None.

    A misspelling is one typo away from an option name (a character added,
    dropped or replaced, two neighbours swapped; case and ``-`` ignored), or
    a peer library's option name. Celery's own task attributes (anything ``base``
    defines), private names and anything further away (a user's own attributes) are
    left alone: a real typo is usually one keystroke, and a wrong guess would refuse a
    valid task.
    """
    if attribute.startswith("_") or attribute in OPTIONS or _defined_on(base, attribute):
        return None
    if attribute in _PEER_OPTIONS:
        library, instead = _PEER_OPTIONS[attribute]
        return f"{attribute} is {library}'s option; did you mean {instead}? (docs/migrating.md)"
    spelt = attribute.lower().replace("-", "_")
    for option in OPTIONS:
        if spelt == option or _one_typo_apart(spelt, option):
            return f"unknown option {attribute}; did you mean {option}?"
    return None

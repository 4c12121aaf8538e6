"""From a task call to its lock key.

The key of a call is ``<prefix>:{<task name>:<digest>}`` where the digest is the
SHA-256 of the *canonical form* of the call's arguments:

* the arguments are bound to the task's signature with defaults applied, so
  ``f(1)``, ``f(x=1)`` and ``f(1, flag=False)`` (``flag`` defaulting to False)
  are one key;
* ``unique_on`` restricts them to some argument names, or replaces them with
  the value a callable returns;
* values are encoded the way they look after a trip through Celery's JSON
  serializer, so a key computed by the publisher equals the key computed by the
  worker: tuples are lists, UUIDs, dates, datetimes and Decimals are their
  string forms, dict keys are sorted, bytes are tagged base64.

Anything else (a set, a model instance, a lambda) raises :class:`SingletonKeyError`
naming the task and the argument: silently hashing ``repr()`` would give keys
that differ between processes.

The ``{...}`` is a Redis Cluster hash tag: the lock and its companion keys
(fencing counter, queue claim) share one slot, so one Lua script can touch them.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import inspect
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal
from typing import Any, Union

from .exceptions import SingletonKeyError

__all__ = [
    "QUEUED_SUFFIX",
    "UniqueOn",
    "beat_stats_key",
    "call_arguments",
    "canonical",
    "check_unique_on",
    "is_run_lock_key",
    "lock_key",
    "task_signature",
    "task_stats_key",
]

#: ``unique_on``: argument names, or a callable taking the task's arguments.
UniqueOn = Union[Sequence[str], Callable[..., Any], None]

_SCALARS = (str, int, float, bool, type(None))


class _Unencodable(TypeError):
    def __init__(self, path: str, value: Any, reason: str) -> None:
        super().__init__(reason)
        self.path, self.value, self.reason = path, value, reason


def _normalize(value: Any, path: str) -> Any:
    """Turn ``value`` into plain JSON data, or raise ``_Unencodable``."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (list, tuple)):
        return [_normalize(item, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if isinstance(key, str):
                name = key
            elif isinstance(key, (int, float, bool)) or key is None:
                name = json.dumps(key)  # what json does to such keys
            else:
                raise _Unencodable(path, value, f"dict key {key!r} is not a string or number")
            if name in out:
                raise _Unencodable(path, value, f"dict keys collide as {name!r}")
            out[name] = _normalize(item, f"{path}[{key!r}]")
        return out
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    raise _Unencodable(path, value, f"values of type {type(value).__name__} have no stable encoding")


def _dumps(normalized: Any) -> bytes:
    """The one byte encoding of normalized data: sorted keys, no spaces, UTF-8."""
    return json.dumps(normalized, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def canonical(value: Any) -> bytes:
    """The canonical byte encoding of a JSON-like value (see the module docstring).

    Raises ``TypeError`` (a private subclass) for unencodable values; use
    :func:`lock_key` to get a :class:`SingletonKeyError` naming the argument.
    """
    return _dumps(_normalize(value, "value"))


def task_signature(task: Any) -> inspect.Signature:
    """The signature users call a task (class or instance) with, ``self`` excluded.

    ``@app.task(bind=True)`` and class-based tasks define ``run(self, ...)``;
    plain ``@app.task`` functions are stored as a staticmethod.
    """
    owner = task if isinstance(task, type) else type(task)
    run = inspect.getattr_static(owner, "run")
    if isinstance(run, staticmethod):
        return inspect.signature(run.__func__)
    signature = inspect.signature(run)
    parameters = list(signature.parameters.values())[1:]
    return signature.replace(parameters=parameters)


def call_arguments(
    task_name: str, signature: inspect.Signature, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """Bind a call to the task's signature with defaults applied."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{task_name}: arguments do not match {signature}: {exc}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def check_unique_on(task_name: str, signature: inspect.Signature, unique_on: Any) -> None:
    """Raise ``ValueError`` if ``unique_on`` is not None, a callable or names of parameters."""
    if unique_on is None or callable(unique_on):
        return
    if isinstance(unique_on, str) or not isinstance(unique_on, Sequence):
        raise ValueError(
            f"unique_on must be a list of argument names or a callable, got {unique_on!r}"
        )
    known = list(signature.parameters)
    for name in unique_on:
        if name not in signature.parameters:
            raise ValueError(f"unique_on names {name!r}, which is not a parameter of {task_name}{signature} (parameters: {known})")


def lock_key(
    prefix: str,
    task_name: str,
    signature: inspect.Signature,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    unique_on: UniqueOn = None,
) -> str:
    """The Redis key that serialises runs of ``task_name`` with these arguments."""
    if callable(unique_on):
        identity: Any = {"unique_on": unique_on(*args, **kwargs)}
        names: list[str] = ["unique_on"]
    else:
        arguments = call_arguments(task_name, signature, args, kwargs)
        if unique_on is not None:
            arguments = {name: arguments[name] for name in unique_on}
        identity, names = arguments, list(arguments)
    try:
        encoded = _dumps({name: _normalize(identity[name], name) for name in names})
    except _Unencodable as exc:
        raise SingletonKeyError(task_name, exc.path, exc.value, exc.reason) from None
    digest = hashlib.sha256(encoded).hexdigest()
    return f"{prefix}:{{{task_name}:{digest}}}"


#: Suffix of the queue claim of ``until_executing`` (same hash tag as the lock).
QUEUED_SUFFIX = ":queued"

_DIGEST_HEX = frozenset("0123456789abcdef")


def is_run_lock_key(prefix: str, key: str) -> bool:
    """True for ``<prefix>:{<task name>:<sha256>}``, the key of a run lock.

    Fencing counters, queue claims, beat slots and counter hashes all differ
    (a suffix after the closing brace, or no 64-hex digest), whatever the task
    name: a task called ``beat.sync`` or ``stats`` is still a task.
    """
    head = f"{prefix}:{{"
    if not (key.startswith(head) and key.endswith("}")) or len(key) < len(head) + 66:
        return False
    digest = key[-65:-1]
    return key[-66] == ":" and set(digest) <= _DIGEST_HEX


def task_stats_key(prefix: str, task_name: str) -> str:
    """The counter hash of a task: acquired, skipped, released, renewed, lost, reclaimed, ..."""
    return f"{prefix}:{{stats}}:task:{task_name}"


def beat_stats_key(prefix: str, entry_name: str) -> str:
    """The counter hash of a beat entry: slots won and lost."""
    return f"{prefix}:{{stats}}:beat:{entry_name}"

"""From a task call to its lock key.

The key of a call is ``<prefix>:{<task name>:<digest>}`` where the digest is the
SHA-256 of the *canonical form* of the call's arguments:

* the arguments are bound to the task's signature with defaults applied, so
  ``f(1)``, ``f(x=1)`` and ``f(1, flag=False)`` (``flag`` defaulting to False)
  are one key;
* ``unique_on`` restricts them to some argument names, or replaces them with
  the value a callable returns;
* values are encoded so that a value and its copy after the trip to the worker
  get the same key. Celery's JSON serializer (kombu 5.3 and later) carries
  ``datetime``, ``date``, ``time``, ``Decimal``, ``UUID`` and ``bytes`` as
  typed values, and so does pickle; the canonical form keeps their type too::

      date(2024, 1, 1)  ->  {"__type__":"date","__value__":"2024-01-01"}
      "2024-01-01"      ->  "2024-01-01"                  (another key)

  ``datetime``/``date``/``time`` are their ``isoformat()``, ``Decimal`` its
  ``str()`` (``Decimal("1.50")`` and ``Decimal("1.5")`` are two keys), ``UUID``
  its hyphenated form, ``bytes`` (and ``bytearray``/``memoryview``) base64.
  Tuples are lists (JSON has no tuples), dict keys are sorted, and number or
  ``None`` dict keys are the strings JSON makes of them. An object with a
  ``__json__()`` method is what that method returns (kombu's rule), and a dict
  shaped like kombu's ``{"__type__", "__value__"}`` envelope is read the way
  kombu reads it on the worker.

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

from kombu.utils import json as kombu_json

from ..exceptions import SingletonKeyError

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
UniqueOn = Union[Sequence[str], Callable[..., Any], None]  # noqa: UP007 (a runtime alias)

_SCALARS = (str, int, float, bool, type(None))


class _Unencodable(TypeError):
    def __init__(self, path: str, value: Any, reason: str) -> None:
        super().__init__(reason)
        self.path, self.value, self.reason = path, value, reason


#: The keys of kombu's envelope of a typed JSON value (kombu 5.3 and later).
_ENVELOPE = frozenset(("__type__", "__value__"))


def _typed(kind: str, value: str) -> dict[str, str]:
    """The canonical form of a typed value: ``{"__type__": kind, "__value__": value}``."""
    return {"__type__": kind, "__value__": value}


def _normalize(value: Any, path: str) -> Any:
    """Turn ``value`` into plain JSON data, or raise ``_Unencodable``.

    The result is the same for ``value`` and for what the worker receives
    after kombu's JSON round trip (or pickle's): see the module docstring.
    """
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (list, tuple)):
        return [_normalize(item, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict) and len(value) == 2 and value.keys() == _ENVELOPE:
        # kombu's object hook turns such a dict into a typed value on the
        # worker (or refuses it); compute the key from what the worker gets.
        try:
            decoded = kombu_json.loads(kombu_json.dumps(value))
        except (TypeError, ValueError) as exc:
            raise _Unencodable(path, value, f"kombu's JSON cannot carry this "
                                            f"{{'__type__', '__value__'}} dict: {exc}") from None
        if not (isinstance(decoded, dict) and decoded.keys() == _ENVELOPE):
            return _normalize(decoded, path)
    if isinstance(value, dict):
        return _normalize_mapping(value, path)
    reducer = getattr(value, "__json__", None)
    if reducer is not None and callable(reducer):
        return _normalize(reducer(), path)
    if isinstance(value, Mapping):
        return _normalize_mapping(value, path)
    # datetime before date: a datetime is a date.
    if isinstance(value, dt.datetime):
        return _typed("datetime", dt.datetime.isoformat(value))
    if isinstance(value, dt.date):
        return _typed("date", dt.date.isoformat(value))
    if isinstance(value, dt.time):
        return _typed("time", dt.time.isoformat(value))
    if isinstance(value, Decimal):
        return _typed("decimal", str(value))
    if isinstance(value, uuid.UUID):
        return _typed("uuid", str(value))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _typed("bytes", base64.b64encode(bytes(value)).decode("ascii"))
    raise _Unencodable(path, value, f"values of type {type(value).__name__} have no stable encoding")


def _normalize_mapping(value: Mapping[Any, Any], path: str) -> dict[str, Any]:
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


_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _c_encoder() -> Callable[[Any, int], Sequence[str]] | None:
    """The C encoder ``_ENCODER`` would build for each call, built once (its set-up cost more
    than encoding a task's arguments). No circular-reference markers: normalized data is a tree."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # a Python without the C accelerator
        return None
    try:
        encode = make(None, _ENCODER.default, json.encoder.encode_basestring, None, ":", ",", True, False, True)
        sample = {"b": [1, 2.5, None, True, {"z": "\u00e9", "a": "x\"y"}], "a": ""}
        if "".join(encode(sample, 0)) != _ENCODER.encode(sample):
            return None
    except Exception:  # another Python's internals: the encoder's own path
        return None
    return encode  # type: ignore[no-any-return]


_C_ENCODE = _c_encoder()


def _dumps(normalized: Any) -> bytes:
    """The one byte encoding of normalized data: sorted keys, no spaces, UTF-8."""
    if _C_ENCODE is not None:
        return "".join(_C_ENCODE(normalized, 0)).encode("utf-8")
    return _ENCODER.encode(normalized).encode("utf-8")


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
    bind = _binder(signature)
    if bind is not None:
        try:
            return bind(args, kwargs)
        except TypeError:
            pass  # let inspect word the error
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{task_name}: arguments do not match {signature}: {exc}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


_Binder = Callable[[Sequence[Any], Mapping[str, Any]], dict[str, Any]]
_BINDERS: dict[int, tuple[inspect.Signature, _Binder | None]] = {}
_SIMPLE_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _binder(signature: inspect.Signature) -> _Binder | None:
    """A fast binder for ``signature``, or None when only ``inspect`` can bind it.

    ``Signature.bind`` costs tens of microseconds per call, on every run. Tasks
    nearly always have plain named parameters (no ``*args``, ``**kwargs`` or
    positional-only ones): for those, binding is a zip and a dict update. It
    raises ``TypeError`` exactly where ``Signature.bind`` would (the caller then
    asks ``inspect`` for its wording). Cached per signature object (tasks keep theirs).
    """
    known = _BINDERS.get(id(signature))
    if known is not None and known[0] is signature:
        return known[1]
    parameters = list(signature.parameters.values())
    bind: _Binder | None = None
    if all(p.kind in _SIMPLE_KINDS for p in parameters):
        names = tuple(p.name for p in parameters)
        positional = sum(1 for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
        defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}

        def bind(args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
            if len(args) > positional:
                raise TypeError("too many positional arguments")
            bound = dict(zip(names, args, strict=False))  # fewer args than names
            for name, value in kwargs.items():
                if name in bound or name not in names:
                    raise TypeError(name)
                bound[name] = value
            if len(bound) < len(names):
                for name in names:
                    if name not in bound:
                        if name not in defaults:
                            raise TypeError(name)
                        bound[name] = defaults[name]
            return {name: bound[name] for name in names}  # inspect's order

    if len(_BINDERS) >= 1024:  # signatures made on the fly (tests): keep the cache bounded
        _BINDERS.clear()
    _BINDERS[id(signature)] = (signature, bind)  # holds the signature: its id stays unique
    return bind


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
            raise ValueError(f"unique_on names {name!r}, which is not a parameter of "
                             f"{task_name}{signature} (parameters: {known})")


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

"""Which calls share a lock key: celery-singleton, celery-once and ours, same calls.

Run by ``benchmarks/compare_dedup.py --key-probe`` with the throw-away
virtualenv's interpreter (celery-singleton and celery-once installed, this
project on ``PYTHONPATH``). Only key functions are called: no Redis, no broker.
Prints one JSON object: for each case and library, ``true`` (same key),
``false`` (different keys) or the exception the key function raised.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from typing import Any

from celery import Celery
from celery_once import QueueOnce
from celery_singleton import Singleton

from celery_singleton_beat import SingletonTask

Call = tuple[tuple[Any, ...], dict[str, Any]]

theirs = Celery("probe_theirs", broker="memory://")
theirs.conf.ONCE = {"backend": "celery_once.backends.Redis", "settings": {"url": "redis://127.0.0.1:1/0"}}
ours = Celery("probe_ours", broker="memory://")
ours.conf.singleton_redis_url = "redis://127.0.0.1:1/0"


def f(a: Any, b: Any = 1) -> None:
    """The probed task: one required argument, one with a default."""


def _task(app: Celery, name: str, base: type, **options: Any) -> Any:
    return app.task(base=base, name=name, **options)(f)


TASKS: dict[str, dict[str, Callable[[Call], str]]] = {}


def _register() -> None:
    s_all = _task(theirs, "s_all", Singleton)
    s_b = _task(theirs, "s_b", Singleton, unique_on=["b"])
    o_all = _task(theirs, "o_all", QueueOnce)
    o_b = _task(theirs, "o_b", QueueOnce, once={"keys": ["b"]})
    u_all = _task(ours, "u_all", SingletonTask)
    u_b = _task(ours, "u_b", SingletonTask, unique_on=["b"])
    TASKS["all arguments"] = {
        "celery-singleton": lambda c: s_all.generate_lock(s_all.name, list(c[0]), c[1]),
        "celery-once": lambda c: o_all.get_key(c[0], c[1]),
        "celery-singleton-beat": lambda c: u_all.singleton_key(c[0], c[1]),
    }
    TASKS["unique on b"] = {
        "celery-singleton": lambda c: s_b.generate_lock(s_b.name, list(c[0]), c[1]),
        "celery-once": lambda c: o_b.get_key(c[0], c[1]),
        "celery-singleton-beat": lambda c: u_b.singleton_key(c[0], c[1]),
    }


CASES: list[tuple[str, str, Call, Call]] = [
    ("all arguments", "f(1) vs f(a=1)", ((1,), {}), ((), {"a": 1})),
    ("all arguments", "f(1) vs f(1, b=1) (b defaults to 1)", ((1,), {}), ((1,), {"b": 1})),
    ("all arguments", "f(1) vs f('1')", ((1,), {}), (("1",), {})),
    ("all arguments", "f('1_b-2') vs f('1', b='2')", (("1_b-2",), {}), (("1",), {"b": "2"})),
    ("all arguments", "f(date(2024,1,1)) vs f('2024-01-01')",
     ((datetime.date(2024, 1, 1),), {}), (("2024-01-01",), {})),
    ("unique on b", "f(1) vs f(2) (b not passed)", ((1,), {}), ((2,), {})),
    ("unique on b", "f(1, b=5) vs f(2, 5)", ((1,), {"b": 5}), ((2, 5), {})),
]


def _same(key_of: Callable[[Call], str], left: Call, right: Call) -> Any:
    try:
        return key_of(left) == key_of(right)
    except Exception as exc:  # what the library does with such a call is the finding
        return f"{type(exc).__name__}: {exc}"


def main() -> None:
    theirs.finalize()
    ours.finalize()
    _register()
    report = {
        f"{group}: {label}": {lib: _same(key_of, left, right) for lib, key_of in TASKS[group].items()}
        for group, label, left, right in CASES
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

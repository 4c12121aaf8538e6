"""Canonical arguments -> lock key."""

from __future__ import annotations

import datetime as dt
import inspect
import uuid
from decimal import Decimal

import pytest
from celery import Celery
from kombu.utils.json import dumps, loads

from celery_singleton_beat import SingletonKeyError, SingletonTask
from celery_singleton_beat.task.keys import canonical, lock_key, task_signature


def sync(customer_id, region="eu", verbose=False, *rest, **extra):
    return None


SIG = inspect.signature(sync)


def key(*args, unique_on=None, **kwargs):
    return lock_key("p", "proj.sync", SIG, args, kwargs, unique_on)


def test_positional_keyword_and_default_spellings_give_one_key() -> None:
    assert key(1) == key(customer_id=1) == key(1, "eu") == key(1, region="eu", verbose=False)


def test_different_arguments_give_different_keys() -> None:
    assert key(1) != key(2)
    assert key(1) != key("1")
    assert key(1, "us") != key(1)
    assert key(True) != key(1)


def test_unique_on_restricts_the_identity() -> None:
    assert key(1, verbose=True, unique_on=["customer_id"]) == key(1, "us", unique_on=["customer_id"])
    assert key(1, unique_on=["customer_id"]) != key(2, unique_on=["customer_id"])


def test_unique_on_callable_gives_the_identity() -> None:
    by_region = lambda customer_id, region="eu", **_: region  # noqa: E731
    assert key(1, unique_on=by_region) == key(2, unique_on=by_region)
    assert key(1, "us", unique_on=by_region) != key(1, unique_on=by_region)


def by_customer(customer_id, region="eu", verbose=False):
    return customer_id


def test_a_callable_unique_on_of_a_real_task_gets_the_calls_arguments_only() -> None:
    """``@app.task(unique_on=f)`` makes ``f`` a class attribute of the task: it must not be
    bound as a method (called with the task first)."""
    app = Celery("keys-callable", broker="memory://", set_as_current=False)
    app.conf.singleton_redis_url = "redis://127.0.0.1:1/0"  # never connected: keys are computed here

    @app.task(base=SingletonTask, shared=False, name="proj.sync", unique_on=by_customer)
    def sync_task(customer_id, region="eu", verbose=False):
        return customer_id

    class Sync(SingletonTask):
        name = "proj.sync2"
        unique_on = by_customer

        def run(self, customer_id, region="eu", verbose=False):
            return customer_id

    for task in (sync_task, app.register_task(Sync())):
        assert task.singleton_key((1,), {"verbose": True}) == task.singleton_key((1, "us"), {})
        assert task.singleton_key((1,), {}) != task.singleton_key((2,), {})


def test_key_has_prefix_task_name_and_a_cluster_hash_tag() -> None:
    value = key(1)
    assert value.startswith("p:{proj.sync:") and value.endswith("}")
    assert len(value.split(":")[-1].rstrip("}")) == 64  # sha256 hex


def test_dict_key_order_does_not_matter() -> None:
    assert key({"a": 1, "b": [1, {"x": 2, "y": 3}]}) == key({"b": [1, {"y": 3, "x": 2}], "a": 1})


@pytest.mark.parametrize(
    "value",
    [
        (1, 2, (3, 4)),
        {"when": dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)},
        dt.date(2026, 1, 2),
        uuid.UUID("12345678-1234-5678-1234-567812345678"),
        Decimal("12.50"),
        b"\x00\xffbytes",
        {"nested": [{"deep": (uuid.uuid4(), Decimal("1"))}]},
    ],
)
def test_publisher_and_worker_compute_the_same_key(value: object) -> None:
    """The worker sees the arguments after a JSON round trip; the key must not change."""
    after_transport = loads(dumps([value]))[0]
    assert key(value) == key(after_transport)


def test_tuples_and_lists_are_one_value() -> None:
    assert canonical((1, 2)) == canonical([1, 2])


@pytest.mark.parametrize("value", [{1, 2}, object(), lambda: 1, {(1, 2): "tuple key"}])
def test_unencodable_value_names_task_and_argument(value: object) -> None:
    with pytest.raises(SingletonKeyError) as info:
        key(1, extra=value)
    message = str(info.value)
    assert "proj.sync" in message and "extra" in message


def test_unencodable_nested_value_names_the_path() -> None:
    with pytest.raises(SingletonKeyError, match=r"region\[0\]\['x'\]"):
        key(1, [{"x": {1}}])


def test_arguments_that_do_not_fit_the_signature_are_a_clear_error() -> None:
    with pytest.raises(TypeError, match=r"proj\.sync: arguments do not match"):
        lock_key("p", "proj.sync", inspect.signature(lambda a: None), (1, 2), {}, None)


def test_task_signature_excludes_self_of_bound_tasks() -> None:
    app = Celery("sig", set_as_current=False)

    @app.task(bind=True, shared=False)
    def bound(self, a, b=2):
        return a

    @app.task(shared=False)
    def plain(a, b=2):
        return a

    bound_task, plain_task = app.tasks[bound.name], app.tasks[plain.name]
    assert list(task_signature(bound_task).parameters) == ["a", "b"]
    assert list(task_signature(plain_task).parameters) == ["a", "b"]
    assert list(task_signature(type(bound_task)).parameters) == ["a", "b"]


def test_run_lock_keys_are_told_apart_from_every_other_key() -> None:
    from celery_singleton_beat.task.keys import beat_stats_key, is_run_lock_key, task_stats_key

    lock = key(1)
    assert is_run_lock_key("p", lock)
    beat_task = lock_key("p", "beat.sync", SIG, (1,), {}, None)
    assert is_run_lock_key("p", beat_task), "a task named beat.* is still a task"
    for other in (lock + ":fence", lock + ":queued", "p:{beat:every-minute}:1700000000",
                  task_stats_key("p", "proj.sync"), beat_stats_key("p", "x"), "p:{beat}:history",
                  "other:" + lock[2:], "p:{short:abc}"):
        assert not is_run_lock_key("p", other), other


def _reference_bind(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict | str:
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return "TypeError"
    bound.apply_defaults()
    return dict(bound.arguments)


def test_fast_binding_agrees_with_inspect_on_every_call_shape() -> None:
    """The per-run binder (no ``Signature.bind``) gives inspect's result, or its error."""
    from celery_singleton_beat.task.keys import _binder, call_arguments

    def simple(a, b=2, *, c, d=4):
        pass

    def no_defaults(x, y):
        pass

    def nothing():
        pass

    def varargs(a, *rest, **options):
        pass

    calls = [((), {}), ((1,), {}), ((1,), {"c": 3}), ((1, 5), {"c": 3}), ((), {"a": 1, "c": 3}),
             ((1,), {"a": 1, "c": 3}), ((1, 2, 3), {"c": 3}), ((1,), {"c": 3, "e": 5}),
             ((1,), {"c": 3, "d": None}), ((None, None), {}), ((1, 2), {}), ((), {"y": 1, "x": 2})]
    for function in (simple, no_defaults, nothing, varargs):
        signature = inspect.signature(function)
        assert (_binder(signature) is None) == (function is varargs)
        for args, kwargs in calls:
            expected = _reference_bind(signature, args, kwargs)
            if expected == "TypeError":
                with pytest.raises(TypeError, match="arguments do not match"):
                    call_arguments("t", signature, args, kwargs)
            else:
                got = call_arguments("t", signature, args, kwargs)
                assert got == expected and list(got) == list(expected), (function.__name__, args, kwargs)

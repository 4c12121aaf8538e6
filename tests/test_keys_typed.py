"""Typed values in lock keys, and what changes a key across deploys.

Celery's JSON serializer (kombu 5.3 and later) carries ``datetime``, ``date``,
``time``, ``Decimal``, ``UUID`` and ``bytes`` to the worker as the same types.
The canonical encoding keeps the type, so ``f(date(2024, 1, 1))`` and
``f("2024-01-01")`` are two keys, while the publisher (before the trip) and
the worker (after it) still compute one key. The last test checks that with a
real worker: a publish-time claim is adopted by its run only when both sides
agree on the key.
"""

from __future__ import annotations

import datetime as dt
import inspect
import pickle
import uuid
from collections.abc import Iterator
from decimal import Decimal
from types import ModuleType
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import redis
from kombu.utils.json import dumps, loads

from celery_singleton_beat import SingletonKeyError
from celery_singleton_beat.task.keys import canonical, lock_key

from .support import LOCK_DB, CeleryProcess, RedisServer, start_worker, wait_for


def sync(customer_id, region="eu", verbose=False, *rest, **extra):
    return None


SIG = inspect.signature(sync)


def key(*args: Any, unique_on: Any = None, signature: inspect.Signature = SIG,
        task: str = "proj.sync", prefix: str = "p", **kwargs: Any) -> str:
    return lock_key(prefix, task, signature, args, kwargs, unique_on)


def after_json(value: Any) -> Any:
    """``value`` as the worker receives it through Celery's (kombu's) JSON serializer."""
    return loads(dumps([value]))[0]


TYPED = [
    dt.date(2024, 1, 1),
    dt.datetime(2024, 1, 1, 12, 30, 5, 123456),
    dt.datetime(2024, 1, 1, 12, 30, tzinfo=dt.timezone.utc),
    dt.datetime(2024, 3, 31, 1, 30, tzinfo=ZoneInfo("Europe/Berlin")),
    dt.time(6, 0),
    dt.time(6, 0, 0, 1, tzinfo=dt.timezone(dt.timedelta(hours=-5))),
    Decimal("12.50"),
    Decimal("-0"),
    Decimal("NaN"),
    uuid.UUID("12345678-1234-5678-1234-567812345678"),
    uuid.UUID(int=0),
    b"utf-8 text",
    b"\x00\xff not utf-8",
]


@pytest.mark.parametrize("value", TYPED, ids=repr)
def test_typed_values_survive_the_json_trip_as_the_same_type_and_key(value: Any) -> None:
    received = after_json(value)
    assert type(received) is type(value)
    assert str(received) == str(value) if isinstance(value, Decimal) else received == value
    assert key(value) == key(received)
    assert key({"nested": [value, (value,)]}) == key(after_json({"nested": [value, (value,)]}))


@pytest.mark.parametrize("value", TYPED, ids=repr)
def test_typed_values_survive_pickle_with_the_same_key(value: Any) -> None:
    assert key(value) == key(pickle.loads(pickle.dumps(value)))


@pytest.mark.parametrize(
    ("typed", "plain"),
    [
        (dt.date(2024, 1, 1), "2024-01-01"),
        (dt.datetime(2024, 1, 1, 12, 0), "2024-01-01T12:00:00"),
        (dt.datetime(2024, 1, 1), dt.date(2024, 1, 1)),
        (dt.time(6, 0), "06:00:00"),
        (Decimal("1.5"), "1.5"),
        (Decimal("1.5"), 1.5),
        (Decimal("1.50"), Decimal("1.5")),
        (uuid.UUID(int=1), str(uuid.UUID(int=1))),
        (b"abc", "abc"),
        (b"abc", {"__bytes__": "YWJj"}),
    ],
    ids=repr,
)
def test_a_typed_value_and_its_text_are_two_keys(typed: Any, plain: Any) -> None:
    assert key(typed) != key(plain)


def test_bytes_like_values_share_the_key_of_their_bytes() -> None:
    assert key(b"ab") == key(bytearray(b"ab")) == key(memoryview(b"ab"))


def test_a_dict_shaped_like_kombus_envelope_gets_the_key_the_worker_computes() -> None:
    """kombu turns ``{"__type__": "date", "__value__": ...}`` into a date on the worker."""
    envelope = {"__type__": "date", "__value__": "2024-01-01"}
    assert after_json(envelope) == dt.date(2024, 1, 1)
    assert key(envelope) == key(after_json(envelope)) == key(dt.date(2024, 1, 1))
    with_more_keys = {"__type__": "date", "__value__": "2024-01-01", "x": 1}
    assert key(with_more_keys) == key(after_json(with_more_keys)) != key(dt.date(2024, 1, 1))


def test_an_envelope_kombu_cannot_read_is_refused() -> None:
    with pytest.raises(SingletonKeyError, match="customer_id"):
        key({"__type__": "no-such-type", "__value__": 1})


def test_objects_with___json___are_keyed_by_what_kombu_sends() -> None:
    class Money:
        def __init__(self, cents: int) -> None:
            self.cents = cents

        def __json__(self) -> dict[str, int]:
            return {"cents": self.cents}

    assert after_json(Money(5)) == {"cents": 5}
    assert key(Money(5)) == key(after_json(Money(5))) == key({"cents": 5})
    assert key(Money(5)) != key(Money(6))


def test_the_canonical_form_of_each_type_is_fixed() -> None:
    """Keys are shared by every process and version in a deployment: pin the bytes."""
    assert canonical(dt.date(2024, 1, 1)) == b'{"__type__":"date","__value__":"2024-01-01"}'
    assert canonical(dt.datetime(2024, 1, 1, 12, tzinfo=dt.timezone.utc)) == (
        b'{"__type__":"datetime","__value__":"2024-01-01T12:00:00+00:00"}')
    assert canonical(dt.time(6, 0)) == b'{"__type__":"time","__value__":"06:00:00"}'
    assert canonical(Decimal("1.50")) == b'{"__type__":"decimal","__value__":"1.50"}'
    assert canonical(uuid.UUID(int=1)) == (
        b'{"__type__":"uuid","__value__":"00000000-0000-0000-0000-000000000001"}')
    assert canonical(b"\x00\xff") == b'{"__type__":"bytes","__value__":"AP8="}'
    assert canonical({"b": (1, 2), "a": None, 7: "x"}) == b'{"7":"x","a":null,"b":[1,2]}'


def test_keys_of_plain_json_arguments_are_unchanged_by_the_typed_encoding() -> None:
    """Digests computed by the encoding before typed values (README deploy note):
    calls whose arguments hold no typed value keep their keys."""
    assert key(1) == "p:{proj.sync:81b9df8477be96c138d3da4f58473025817789e34860219b30c1bbd0db58f1d7}"
    assert key("abc", region="us") == (
        "p:{proj.sync:34ca823e30e3c24ed5887c6afaafa8053849b53b3f16b8d5731f4450ccc8607d}")
    assert key({"b": [1, (2, 3)], "a": None, 7: "n"}) == (
        "p:{proj.sync:0ca9ed482aa36dc07ac1d161d6d9f47403ad46d59d5eed4078447b555e1ea736}")


# ----------------------------------------------------------------- what changes a key across deploys

def test_a_new_parameter_with_a_default_changes_every_key() -> None:
    def before(customer_id):
        return None

    def after(customer_id, dry_run=False):
        return None

    old, new = inspect.signature(before), inspect.signature(after)
    assert key(1, signature=old) != key(1, signature=new)
    # unique_on that leaves the new parameter out keeps the keys
    assert key(1, signature=old, unique_on=["customer_id"]) == key(1, signature=new, unique_on=["customer_id"])


def test_a_changed_default_changes_the_key_of_calls_that_omit_it() -> None:
    def before(customer_id, region="eu"):
        return None

    def after(customer_id, region="us"):
        return None

    old, new = inspect.signature(before), inspect.signature(after)
    assert key(1, signature=old) != key(1, signature=new)
    assert key(1, "eu", signature=old) == key(1, "eu", signature=new)


def test_unique_on_task_name_and_prefix_are_part_of_the_key() -> None:
    assert key(1, "us") != key(1, "us", unique_on=["customer_id"])
    assert key(1) != key(1, task="proj.sync_v2")
    assert key(1) != key(1, prefix="other")


# ----------------------------------------------------------------- publisher and worker agree

@pytest.fixture
def typed_app(redis_db: redis.Redis, redis_server: RedisServer,
              processes: list[CeleryProcess]) -> Iterator[ModuleType]:
    import os

    os.environ["CSB_TEST_REDIS"] = f"redis://127.0.0.1:{redis_server.port}"
    from .apps import typed_keys_app

    assert os.environ["CSB_TEST_REDIS"] == typed_keys_app.BASE, "imported for another server"
    processes.append(start_worker(redis_server, "tests.apps.typed_keys_app", "typed", concurrency=1))
    yield typed_keys_app


def test_a_real_worker_adopts_the_publish_claim_of_typed_arguments(typed_app: ModuleType,
                                                                   redis_server: RedisServer) -> None:
    """``until_executed``: the run adopts its claim only if its key equals the publisher's."""
    locks = redis_server.client(LOCK_DB)
    values = [dt.date(2024, 1, 1), dt.datetime(2024, 1, 1, 6, tzinfo=dt.timezone.utc), dt.time(6, 0),
              Decimal("9.90"), uuid.UUID(int=7), b"\x00\xff", "2024-01-01"]
    for value in values:
        published = typed_app.claimed.singleton_key((value,), {})
        result = typed_app.claimed.delay(value)
        ran = result.get(timeout=60)
        assert ran == {"key": published, "type": type(value).__name__}, value
        # the claim was adopted and released by the run: nothing is left under the key
        wait_for(lambda published=published: not locks.exists(published), timeout=10, message=f"{published} released")
    assert len({typed_app.claimed.singleton_key((value,), {}) for value in values}) == len(values)

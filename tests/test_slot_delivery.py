"""The worker's slot check (``RECEIVE_SCRIPT``) on a real Redis: who runs a slot's message.

The real-process scenario (a beat dies after publishing, the survivor re-sends,
the worker drops one copy) is in ``test_beat_kills.py``; these pin the rule.
"""

from __future__ import annotations

import json

import redis

from celery_singleton_beat.beat.claims import PENDING, RELEASED, claim_value
from celery_singleton_beat.task.slot_delivery import receive_slot

KEY = "singleton:{beat:e}:2024-05-01T12:00:00Z"
STATS = "singleton:{stats}:beat:e"


def test_the_claims_instance_runs_and_redeliveries_of_its_message_run_too(redis_db: redis.Redis) -> None:
    redis_db.set(KEY, claim_value("beat-a", 1.0, PENDING), px=60_000)
    assert receive_slot(redis_db, KEY, "beat-a", "w1", 60_000, STATS) == (True, None)
    claim = json.loads(redis_db.get(KEY))
    assert (claim["instance"], claim["state"], claim["worker"]) == ("beat-a", "received", "w1")
    assert 0 < redis_db.pttl(KEY) <= 60_000  # the claim keeps its lifetime
    # acks_late redelivery (or a visibility-timeout copy) of the same message: not a duplicate.
    assert receive_slot(redis_db, KEY, "beat-a", "w2", 60_000, STATS) == (True, None)
    assert redis_db.hget(STATS, "duplicates_dropped") is None


def test_a_copy_from_another_beat_is_dropped_and_counted(redis_db: redis.Redis) -> None:
    redis_db.set(KEY, claim_value("beat-b", 2.0, PENDING), px=60_000)  # b took the slot over
    run, holder = receive_slot(redis_db, KEY, "beat-a", "w1", 60_000, STATS)
    assert run is False and holder is not None and holder["instance"] == "beat-b"
    assert redis_db.hget(STATS, "duplicates_dropped") == b"1"
    assert receive_slot(redis_db, KEY, "beat-b", "w1", 60_000, STATS) == (True, None)


def test_without_a_claim_the_first_delivery_wins(redis_db: redis.Redis) -> None:
    """Claim expired, Redis restarted, or beats failed open: the first copy received pins the slot."""
    assert receive_slot(redis_db, KEY, "beat-a", "w1", 30_000, None) == (True, None)
    assert 0 < redis_db.pttl(KEY) <= 30_000
    run, holder = receive_slot(redis_db, KEY, "beat-b", "w2", 30_000, None)
    assert run is False and holder is not None and holder["instance"] == "beat-a"


def test_a_copy_of_a_handed_back_slot_runs_whoever_sent_it(redis_db: redis.Redis) -> None:
    """Beat a published and died; beat b took the slot over, could not publish and handed it
    back (``released``, b's name). a's copy is the only one: it runs and pins the claim, and
    a copy b sends later is dropped."""
    redis_db.set(KEY, claim_value("beat-b", 0, RELEASED), px=60_000)
    assert receive_slot(redis_db, KEY, "beat-a", "w1", 30_000, STATS) == (True, None)
    claim = json.loads(redis_db.get(KEY))
    assert (claim["instance"], claim["state"], claim["worker"]) == ("beat-a", "received", "w1")
    assert 30_000 < redis_db.pttl(KEY) <= 60_000  # the claim keeps its lifetime
    run, holder = receive_slot(redis_db, KEY, "beat-b", "w2", 30_000, STATS)
    assert run is False and holder is not None and holder["instance"] == "beat-a"
    assert redis_db.hget(STATS, "duplicates_dropped") == b"1"

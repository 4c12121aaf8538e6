"""Handover book-keeping (pure): when sent claims are marked in Redis."""

from __future__ import annotations

from datetime import datetime, timezone

from celery_singleton_beat.beat.claims import Claim
from celery_singleton_beat.beat.handover import Handover
from celery_singleton_beat.beat.slots import Slot


def _claim(i: int) -> Claim:
    slot = Slot(datetime(2026, 1, 1, tzinfo=timezone.utc), None)
    value = '{"instance":"a","at":0,"state":"pending"}'
    return Claim(f"entry-{i}", slot, f"p:{{beat:entry-{i}}}:1", True, value=value)


def test_claims_won_in_one_batch_and_sent_late_are_marked_in_few_round_trips() -> None:
    """1,000 claims won in one round trip at t=0 and sent one per ms from t=2 s (past a
    third of a 5 s lease): marking each on its own would cost one round trip per send."""
    lease = 5.0
    handover = Handover(lease)
    claims = [_claim(i) for i in range(1000)]
    round_trips = 0
    latest_mark = 0.0
    for i, claim in enumerate(claims):
        now = 2.0 + i / 1000
        handover.sent(claim, 0.0)
        if handover.marks_due(now):
            marked = handover.take_marks(now)
            round_trips += 1
            latest_mark = now
            assert all(c.key != "" for c in marked)
    wake = handover.next_wake(3.0)
    assert wake is not None and 3.0 + wake <= lease, "the rest is marked before the lease ends"
    assert round_trips <= 10, f"{round_trips} mark round trips for 1,000 sends"
    assert latest_mark < lease


def test_the_first_overdue_mark_goes_out_at_once() -> None:
    handover = Handover(3.0)
    handover.sent(_claim(1), 0.0)
    assert not handover.marks_due(0.5)
    assert handover.marks_due(1.0)
    assert [c.name for c in handover.take_marks(1.0)] == ["entry-1"]
    assert not handover.marks_due(1.0)


def test_slots_whose_publish_failed_wait_a_growing_back_off_and_go_when_a_publish_works() -> None:
    """Each failed publish doubles the wait before this beat's hand-backs are tried again
    (from one lease up to ``retry_max``); a publish that works makes them due at once,
    and leaves the slots watched for other beats where they were."""
    handover = Handover(2.0)
    delays = []
    for i in range(6):
        handover.publish_failed([_claim(i)], 0.0)
        delays.append(handover.retry_delay())
    assert delays == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    other = _claim(99)
    handover.watch(other, 0.0)  # another beat's pending claim: looked at after one lease
    assert handover.due_watches(1.0, 100) == []
    handover.published(1.0)
    due = handover.due_watches(1.0, 100)
    assert sorted(w.claim.name for w in due) == [f"entry-{i}" for i in range(6)]
    assert all(w.retry for w in due)
    assert handover.publish_failures == 0 and handover.retry_delay() == 2.0
    assert [w.claim.name for w in handover.due_watches(2.0, 100)] == ["entry-99"]


def test_the_back_off_of_hand_backs_counts_from_the_latest_failed_publish() -> None:
    """A burst whose publishes all fail, slowly: slot 0 fails at t=0 (back-off one lease,
    due at 1), slot 1 at t=0.9 and slot 2 at t=1.5, past slot 0's back-off. Slot 0 is
    not tried again right after slot 2's publish found the broker down (it was, at 1.5:
    a publish per slot in one round); every hand-back waits out the back-off from the
    latest failure (four leases after the third failure), and goes together."""
    handover = Handover(1.0)
    handover.publish_failed([_claim(0)], 0.0)
    handover.publish_failed([_claim(1)], 0.9)
    assert handover.due_watches(1.5, 100) == [], "the back-off restarted at the failure at 0.9"
    handover.publish_failed([_claim(2)], 1.5)
    assert handover.due_watches(5.4, 100) == []
    assert handover.next_wake(1.5) == 4.0
    due = handover.due_watches(5.5, 100)
    assert sorted(w.claim.name for w in due) == ["entry-0", "entry-1", "entry-2"]

"""``python -m tests.support.demo_orphan [demo options]``: the demo, its kill between a claim and its publish.

On a loaded machine the demo's SIGKILL once fell after the victim beat had claimed a
slot (``SET NX``, ``pending``) and before it published it: the kill waits until every
beat has claimed a slot, so it lands at any moment, and a busy beat can be anywhere at
a half second too. The library leaves such a slot to the surviving beats, which take
it over one ``singleton_beat_pending_lease`` (5 s) after they found it claimed
(docs/beat.md); the demo stopped them sooner and counted the slot as missed.

This forces that state. Right after the demo's SIGKILL, the next slot of
``release-expired-reservations`` (every 1 s) at least 0.2 s ahead is claimed in the
victim's name, ``pending``, with the victim's own instance id: the claim the victim
leaves when it dies between its claim and its publish. It is claimed ``NX`` before it
is due, so no beat had it yet; the survivors find it when it comes due. The line
``forged <entry> <slot> ...`` names it.
"""

from __future__ import annotations

import math
import socket
import sys
import time
from datetime import datetime, timezone

from celery_singleton_beat.beat import format_slot, slot_key
from celery_singleton_beat.beat.claims import PENDING, claim_value
from example_project.demo import run
from example_project.demo.report import beat_pid

#: The entry whose slot the victim is left holding, and its claim lifetime (period + margin).
ENTRY = "release-expired-reservations"
CLAIM_TTL_MS = (1 + 60) * 1000

_kill_a_beat = run.Demo._kill_a_beat


def kill_then_leave_a_claim(self: run.Demo, began: float) -> None:
    _kill_a_beat(self, began)
    victim = next((beat for beat in self.beats if beat.killed), None)
    if victim is None or self.shop is None:
        return
    from example_project.shop.journal import read_journal

    instance = next((record["beat"] for record in reversed(read_journal(self._client))
                     if beat_pid(record.get("beat")) == str(victim.pid)),
                    f"{socket.gethostname()}:{victim.pid}:000000")
    prefix = self.shop.app.conf.singleton_key_prefix
    at = math.floor(time.time() + 0.2) + 1
    while True:
        slot = datetime.fromtimestamp(at, timezone.utc)
        value = claim_value(instance, time.time(), PENDING)
        if self._client.set(slot_key(prefix, ENTRY, slot), value, nx=True, px=CLAIM_TTL_MS):
            break
        at += 1  # claimed meanwhile (cannot be: it is not due yet); the next one
    self.say(f"forged     {ENTRY} {format_slot(slot)} claimed pending by {victim.name} ({instance})")


run.Demo._kill_a_beat = kill_then_leave_a_claim  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(run.main(sys.argv[1:]))

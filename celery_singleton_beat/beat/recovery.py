"""Claims a beat won, kept until they expire, so that a server that lost them gets them back.

A lock Redis that restarts without an append-only file, or a replica promoted by
a failover, may lack the claims a beat wrote just before (a forced Sentinel
failover leaves the old primary taking writes for seconds after the promotion).
Another beat would then find the slot free, or still ``pending`` when its
winner had marked it ``sent``, and send it a second time.

Two rules close that gap, as run locks have theirs (see :mod:`..server`):

* a beat whose process finds the data on such a server (the server's epoch
  grows) writes back, at its next claim round trip, every claim it still keeps
  that was written before: missing claims are set again, its own earlier values
  replaced by the latest (``pending`` -> ``sent``), anything else left alone;
* a beat claims new slots, and takes over unsent ones, only outside a recovery
  window, which lasts until every process had its chance to write back.

Slots that come due during a window are sent when it ends (a few seconds late).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..connection.wire import LuaScript
from ..log import logger

__all__ = ["PUT_BACK_SCRIPT", "KeptClaims"]

#: Claims written back. KEYS: claims. ARGV, per claim: its value, the values it
#: replaced (this beat's earlier ones, another's it took over; one per line), its
#: remaining TTL in ms. Returns per claim 1 (the claim holds that value now) or 0
#: (another value holds the slot).
PUT_BACK_SCRIPT = LuaScript("""
local out = {}
for i, key in ipairs(KEYS) do
  local current = redis.call('GET', key)
  local value = ARGV[3 * i - 2]
  if not current then
    redis.call('SET', key, value, 'PX', tonumber(ARGV[3 * i]))
    out[i] = 1
  elseif current == value then
    out[i] = 1
  else
    out[i] = 0
    for replaced in string.gmatch(ARGV[3 * i - 1], '[^\\n]+') do
      if current == replaced then
        redis.call('SET', key, value, 'KEEPTTL')
        out[i] = 1
        break
      end
    end
  end
end
return out
""")


class _Kept:
    __slots__ = ("epoch", "expires", "replaced", "value")

    def __init__(self, value: str, expires: float, epoch: int) -> None:
        self.value = value
        #: Values this one stands for: this beat's earlier ones, another beat's it took over.
        self.replaced: list[str] = []
        self.expires = expires
        self.epoch = epoch


class KeptClaims:
    """This beat's latest value of each claim it holds, with the server epoch it was written in."""

    def __init__(self) -> None:
        self._claims: dict[str, _Kept] = {}
        self._limit = 64
        #: Monotonic time of the last write noted.
        self.last_written = float("-inf")

    def __len__(self) -> int:
        return len(self._claims)

    def written_within(self, seconds: float) -> bool:
        """This beat wrote a claim in the last ``seconds`` (a server that lost it may have
        it taken over by another beat once its pending lease ends)."""
        return time.monotonic() - self.last_written < seconds

    def wrote(self, key: str, value: str, replaced: str | bytes | None, ttl_ms: int, epoch: int) -> None:
        """This beat wrote ``value`` into ``key`` in place of ``replaced`` (None: the key was
        free); ``ttl_ms``: how long the claim lives from now at least."""
        now = self.last_written = time.monotonic()
        kept = self._claims.get(key)
        if kept is None:
            kept = self._claims[key] = _Kept(value, now + ttl_ms / 1000, epoch)
            if len(self._claims) > self._limit:
                self._claims = {k: c for k, c in self._claims.items() if c.expires > now}
                self._limit = max(64, 2 * len(self._claims))
        else:
            kept.replaced.append(kept.value)
            kept.value, kept.epoch = value, epoch
            kept.expires = max(kept.expires, now + ttl_ms / 1000)
        if replaced:
            kept.replaced.append(replaced.decode() if isinstance(replaced, bytes) else replaced)

    def forget(self, key: str) -> None:
        """The claim is no longer this beat's (another took it over)."""
        self._claims.pop(key, None)

    def written_before(self, epoch: int) -> list[tuple[str, str, str, int]]:
        """``(key, value, replaced, remaining ttl ms)`` of the live claims written in an earlier epoch."""
        now = time.monotonic()
        return [(key, kept.value, "\n".join(kept.replaced), max(1, round((kept.expires - now) * 1000)))
                for key, kept in self._claims.items() if kept.epoch < epoch and kept.expires > now]

    def put_back(self, run: Any, epoch: int, reason: str) -> None:
        """Write back the claims written before ``epoch`` with ``run(script, calls)`` (one round trip)."""
        stale = self.written_before(epoch)
        if not stale:
            return
        replies = run(PUT_BACK_SCRIPT, [([key], [value, replaced, ttl]) for key, value, replaced, ttl in stale])
        held: Sequence[str] = [key for (key, _, _, _), reply in zip(stale, replies, strict=True)
                               if not int(reply[0] if isinstance(reply, list) else reply)]
        for key, *_ in stale:
            kept = self._claims.get(key)
            if kept is not None:
                kept.epoch = epoch
        logger.warning("beat: the lock Redis may have lost recent slot claims (%s): wrote back %d of %d",
                       reason, len(stale) - len(held), len(stale))
        for key in held:
            logger.warning("beat: slot %s was claimed by another beat meanwhile: it may have been sent twice", key)
            self.forget(key)

"""RedBeat's ``RedBeatScheduler``, active-active: every beat sends, one send per slot.

Install with ``pip install 'celery-singleton-beat[redbeat]'`` and run every
beat with::

    celery -A proj beat -S celery_singleton_beat.contrib.redbeat:SingletonRedBeatScheduler

(or ``beat_scheduler`` set to that path, or ``celery worker -B --scheduler``
with it). The schedule stays in RedBeat's Redis and is edited through
RedBeat's API (``RedBeatSchedulerEntry(...).save()``, ``.delete()``,
``enabled=False``); every slot is claimed in Redis exactly as with
``SingletonScheduler``. See ``docs/redbeat.md``.

What changes against ``RedBeatScheduler``:

* no lock: every beat ticks and claims (``redbeat_lock_key`` and
  ``redbeat_lock_timeout`` are not used); the slots come from the schedule
  and the clock (interval entries on the multiples of their period since the
  epoch), never from RedBeat's ``last_run_at``;
* each beat reads every entry's definition at each tick (not inside a burst
  of due entries), so an entry created, edited, disabled or deleted through
  RedBeat's API takes effect on every beat at its next tick; an entry given a
  new schedule is re-anchored on it, one that comes back follows the start-up
  rule (:mod:`celery_singleton_beat.beat.following`);
* the beat that sends a slot writes RedBeat's ``meta`` after the publish:
  ``last_run_at`` is the slot's instant (in the app's time zone), never an
  earlier slot's, and ``total_run_count`` counts the slots written (a stop
  signal inside the publish or the write leaves it to the close); the
  entry's score in RedBeat's schedule is the next slot. An entry deleted
  meanwhile is not written back.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

try:
    from redbeat.decoder import RedBeatJSONEncoder
    from redbeat.schedulers import RedBeatScheduler, RedBeatSchedulerEntry, get_redis
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    if (exc.name or "").split(".")[0] in ("redbeat", "tenacity", "dateutil"):
        raise ImportError(
            "celery_singleton_beat.contrib.redbeat needs celery-redbeat: "
            "pip install 'celery-singleton-beat[redbeat]'"
        ) from exc
    raise

import redis
from celery.beat import ScheduleEntry, Scheduler

from celery_singleton_beat import SingletonSchedulerMixin
from celery_singleton_beat.beat.claims import Claim
from celery_singleton_beat.beat.entries import entry_spec
from celery_singleton_beat.beat.following import ScheduleFollower
from celery_singleton_beat.beat.scripted import evalsha_pipelined
from celery_singleton_beat.beat.slots import Slot, SlotError, current_slot
from celery_singleton_beat.connection.url import sanitize_redis_url
from celery_singleton_beat.connection.wire import LuaScript
from celery_singleton_beat.log import logger

__all__ = ["META_SLOT_FIELD", "SingletonRedBeatEntry", "SingletonRedBeatScheduler"]

#: Field of an entry's RedBeat hash holding the latest slot written to its ``meta``
#: (epoch seconds): a late write of an earlier slot never moves ``last_run_at`` back.
#: RedBeat reads only ``definition`` and ``meta``.
META_SLOT_FIELD = "singleton_slot"

#: KEYS: the entry's hash. ARGV: the slot (epoch seconds), ``last_run_at`` as RedBeat's JSON,
#: :data:`META_SLOT_FIELD`.
#: 1 written; 0 not: the entry is gone (deleted meanwhile), or a later slot is written.
WRITE_META = LuaScript("""
if redis.call('HEXISTS', KEYS[1], 'definition') == 0 then return 0 end
local written = tonumber(redis.call('HGET', KEYS[1], ARGV[3]))
if written and written >= tonumber(ARGV[1]) then return 0 end
local count = 0
local meta = redis.call('HGET', KEYS[1], 'meta')
if meta then
  local ok, decoded = pcall(cjson.decode, meta)
  if ok and type(decoded) == 'table' and tonumber(decoded['total_run_count']) then
    count = tonumber(decoded['total_run_count'])
  end
end
redis.call('HSET', KEYS[1], 'meta', '{"last_run_at": ' .. ARGV[2] .. ', "total_run_count": '
  .. string.format('%d', count + 1) .. '}', ARGV[3], ARGV[1])
return 1
""")


class SingletonRedBeatEntry(RedBeatSchedulerEntry):
    """A RedBeat entry as the beat holds it: moving it on writes nothing to Redis.

    ``RedBeatSchedulerEntry`` writes ``last_run_at`` (the send time) when the
    scheduler moves an entry on, before it is sent; here the beat that sends
    the slot writes it afterwards, with the slot's time. ``save()``,
    ``delete()`` and ``reschedule()`` are RedBeat's.
    """

    def _next_instance(self, last_run_at: Any = None, only_update_last_run_at: bool = False) -> Any:
        return ScheduleEntry._next_instance(self, last_run_at=last_run_at)

    __next__ = next = _next_instance


class _Definitions:
    """The entries of RedBeat's schedule as this beat last read them.

    One read is ``ZRANGE`` of the schedule and one pipelined ``HGET definition``
    per entry; a definition whose JSON is unchanged keeps its entry object, a
    changed one is decoded again.
    """

    def __init__(self, scheduler: SingletonRedBeatScheduler) -> None:
        self.scheduler = scheduler
        #: Per RedBeat key: the definition JSON last read, and the entry's name if it is
        #: scheduled (None: disabled, or refused and logged).
        self.read_last: dict[str, tuple[str, str | None]] = {}
        #: The scheduled entries by name (what ``scheduler.schedule`` is).
        self.entries: dict[str, Any] = {}
        self.failing = False

    def read(self, log: bool = True) -> bool:
        """Read every definition; True if the scheduled entries changed (logged unless not ``log``).
        Raises ``redis.RedisError``."""
        app = self.scheduler.app
        client = _client(app)
        keys = [_text(key) for key in client.zrange(app.redbeat_conf.schedule_key, 0, -1)]
        with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hget(key, "definition")
            found = {key: _text(raw) for key, raw in zip(keys, pipe.execute(), strict=True) if raw}
        read_last: dict[str, tuple[str, str | None]] = {}
        entries: dict[str, Any] = {}
        changes: dict[str, list[str]] = {"new or enabled": [], "changed": [], "disabled": [], "deleted": []}
        for key, raw in found.items():
            last = self.read_last.get(key)
            if last is not None and last[0] == raw:  # unchanged: keep the entry (as the beat moved it on)
                read_last[key] = last
                if last[1] is not None and last[1] in self.entries:
                    entries[last[1]] = self.entries[last[1]]
                continue
            entry = self._decode(key, raw)
            scheduled = entry is not None and bool(entry.enabled)
            read_last[key] = (raw, entry.name if scheduled else None)
            previous = last[1] if last is not None else None  # its name if it was scheduled
            if scheduled:
                entries[entry.name] = entry
                changes["changed" if previous is not None else "new or enabled"].append(entry.name)
            elif previous is not None:
                changes["disabled"].append(previous)
        changes["deleted"] = [name for key, (_, name) in self.read_last.items()
                              if name is not None and key not in found]
        self.read_last = read_last
        if not any(changes.values()):
            return False
        self.entries = entries
        for what, names in changes.items() if log else ():
            if names:
                logger.info("beat: RedBeat entries %s: %s%s", what, ", ".join(sorted(names)[:10]),
                            f" (+{len(names) - 10} more)" if len(names) > 10 else "")
        return True

    def _decode(self, key: str, raw: str) -> Any:
        """The entry a definition describes, or None (logged) if this beat cannot schedule it.

        Called for a definition not read before: one that stays refused is logged once.
        """
        scheduler = self.scheduler
        try:
            definition = RedBeatSchedulerEntry.decode_definition(raw)
            entry = scheduler.Entry(app=scheduler.app, **definition)
            if entry.enabled and entry_spec(entry) is not None:
                current_slot(entry.schedule, scheduler._now())
        except (SlotError, ValueError, TypeError, KeyError) as exc:
            logger.error("beat: RedBeat entry %s not scheduled: %s", key, exc)
            return None
        return entry


def _client(app: Any) -> Any:
    """RedBeat's Redis client for ``app``, without RedBeat's retrying wrapper: a read that
    fails leaves the beat on the schedule it read last, and a tick never blocks on retries."""
    client = get_redis(app)
    return getattr(client, "wrapped_connection", client)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _key_of(entry: Any) -> str:
    return str(RedBeatSchedulerEntry.generate_key(entry.app, entry.name))


class _RedBeatHeap(RedBeatScheduler):
    """RedBeat's configuration and storage, Celery's heap-driven ``tick``.

    ``RedBeatScheduler.tick`` asks each entry ``is_due()`` itself and loads only
    the entries its sorted set calls due; the scheduler mixin needs Celery's
    ``Scheduler.tick``, which goes through the scheduler's ``is_due``,
    ``reserve`` and ``apply_entry``, over every entry.
    """

    _definitions: _Definitions

    def tick(self, *args: Any, **kwargs: Any) -> float:
        return float(Scheduler.tick(self, *args, **kwargs))

    @property
    def schedule(self) -> dict[str, Any]:
        return self._definitions.entries

    def reserve(self, entry: Any) -> Any:
        new_entry = next(entry)
        if entry.name in self._definitions.entries:
            self._definitions.entries[entry.name] = new_entry
        return new_entry


class SingletonRedBeatScheduler(ScheduleFollower, SingletonSchedulerMixin, _RedBeatHeap):
    """RedBeat's scheduler with every beat active, sending each slot from one beat only.

    Run as many beats as you like on one RedBeat Redis; they share the
    schedule (RedBeat's keys, ``redbeat_key_prefix``) and the slot claims
    (``singleton_redis_url``, ``singleton_key_prefix``), which may be the same
    Redis. ``beat_max_loop_interval`` defaults to 5 s here (as with
    django-celery-beat), so a change made through RedBeat's API reaches every
    beat within 5 s when nothing is due sooner.
    """

    Entry = SingletonRedBeatEntry
    #: Seconds between ticks when nothing is due (``beat_max_loop_interval`` wins).
    max_interval = 5.0
    #: Least seconds between two reads of every definition (a tick sooner uses the last read):
    #: one read costs about 20 ms of the beat's CPU per 1,000 entries. Below a second, so that
    #: ticks a second apart (entries due every second, ``beat_max_loop_interval = 1``) all read.
    schedule_read_interval = 0.5

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        self._definitions = _Definitions(self)
        self._loaded = False
        self._next_read = 0.0  # monotonic
        # Per RedBeat key: (slot epoch, last_run_at JSON, next slot epoch) to write after sends.
        self._meta: dict[str, tuple[float, str, float]] = {}
        self._meta_failing = False
        super().__init__(app, *args, **kwargs)
        self.lock_key = None  # RedBeat's beat_init receiver takes no lock; close() releases none

    # ----------------------------------------------------------------- the schedule

    @property
    def schedule(self) -> dict[str, Any]:
        if not self._loaded:
            self._definitions.read(log=False)  # at start: RedBeat's Redis must answer, as with RedBeat
            self._loaded = True
            self._next_read = time.monotonic() + self.schedule_read_interval
            logger.info("beat: %d RedBeat entr%s in %s (prefix %r); no RedBeat lock: every beat sends",
                        len(self._definitions.entries), "y" if len(self._definitions.entries) == 1 else "ies",
                        sanitize_redis_url(self.app.redbeat_conf.redis_url), self.app.redbeat_conf.key_prefix)
        return self._definitions.entries

    def _refresh(self) -> None:
        """Read RedBeat's entries again; on failure keep the ones read last."""
        definitions = self._definitions
        try:
            definitions.read()
        except redis.RedisError as exc:
            if not definitions.failing:
                logger.warning("beat: cannot read RedBeat's entries (%s); the %d read last stay scheduled",
                               exc, len(definitions.entries))
            definitions.failing = True
            return
        if definitions.failing:
            logger.info("beat: RedBeat's entries are readable again")
        definitions.failing = False

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Read the entries (not inside a burst of due entries), tick, then write ``meta``."""
        now = time.monotonic()
        if self._loaded and not self._in_burst and not self.claims_in_flight and now >= self._next_read:
            self._next_read = now + self.schedule_read_interval
            self._refresh()
        delay = super().tick(*args, **kwargs)
        if self._meta and not self.claims_in_flight:
            self._write_meta()
        return delay

    def close(self) -> None:
        # Not from beat's stop handler in the middle of a tick (the interrupted code may be
        # reading RedBeat's connection): the service closes again once the tick unwound.
        if self._meta and self._ticking_in != threading.get_ident():
            self._write_meta()
        super().close()

    # ----------------------------------------------------------------- RedBeat's meta

    def _send(self, entry: Any, producer: Any, decided: tuple[Claim, float] | None, **kwargs: Any) -> Any:
        try:
            result = super()._send(entry, producer, decided, **kwargs)
        except Exception:
            raise  # not published: the slot is handed back, and its sender writes meta
        except BaseException:
            # A stop signal inside the publish: the message may be out, and no beat may be
            # left to send it again. RedBeat's own scheduler writes meta before it publishes.
            if decided is not None:
                self._note_sent(entry, decided[0].slot)
            raise
        if decided is not None:  # a claimed slot (or failing open): RedBeat's meta follows
            self._note_sent(entry, decided[0].slot)
        return result

    def _note_sent(self, entry: Any, slot: Slot) -> None:
        """Remember to write ``meta`` for ``slot`` of ``entry`` (the latest slot per entry)."""
        local = slot.at.astimezone(self.app.timezone)
        following = (slot.next or slot.at).timestamp()  # RedBeat's score: when it is due next
        self._keep_latest(_key_of(entry), (slot.at.timestamp(), json.dumps(local, cls=RedBeatJSONEncoder), following))

    def _keep_latest(self, key: str, meta: tuple[float, str, float]) -> None:
        known = self._meta.get(key)
        if known is None or known[0] < meta[0]:
            self._meta[key] = meta

    def _write_meta(self) -> None:
        """Write ``meta`` (and the score) of the entries sent since the last write: two round trips.

        Not between claims won ahead and their publish (see ``tick``). An
        entry deleted meanwhile, or whose ``meta`` already names a later slot,
        is left alone. A failure is logged (once per outage) and those writes are
        dropped: ``meta`` is informational, and the next send writes it again.
        """
        pending, self._meta = self._meta, {}
        keys = list(pending)
        client = _client(self.app)
        started = time.monotonic()
        try:
            written = evalsha_pipelined(client, WRITE_META, [
                ([key], [f"{pending[key][0]:.6f}", pending[key][1], META_SLOT_FIELD]) for key in keys])
            scores = {key: pending[key][2] for key, done in zip(keys, written, strict=True) if done}
            if scores:  # members only: an entry deleted meanwhile is not added back
                client.zadd(self.app.redbeat_conf.schedule_key, scores, xx=True)
        except redis.RedisError as exc:
            (logger.debug if self._meta_failing else logger.warning)(
                "beat: could not write RedBeat's last_run_at of %d entr%s: %s",
                len(keys), "y" if len(keys) == 1 else "ies", exc)
            self._meta_failing = True
            return
        except BaseException:
            # A stop signal inside the write: kept for close(), which writes it (the
            # script never moves last_run_at back, so a part already written is harmless).
            for key, meta in pending.items():
                self._keep_latest(key, meta)
            raise
        self._meta_failing = False
        logger.debug("beat: RedBeat meta of %d entries written in %.1f ms", len(keys),
                     (time.monotonic() - started) * 1000)

    @property
    def info(self) -> str:
        conf = self.app.redbeat_conf
        line = (f"    . schedule -> RedBeat entries in {sanitize_redis_url(conf.redis_url)} "
                f"(prefix {conf.key_prefix!r}, read at every tick; no lock)")
        return f"{super().info}\n{line}"

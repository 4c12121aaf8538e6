"""``celery -A proj singleton <command>``: see and manage locks, beat slots and counters.

Commands (each has ``--help``):

* ``locks [--task NAME] [--json]``: the task locks held now, with their holder
  (printed as they are found).
* ``release KEY | --task NAME [--all] [--yes]``: force-release locks.
* ``purge-claims [--task NAME] [--yes]``: delete publish-time claims (after
  ``celery purge``), never a running lock.
* ``slots [--entry NAME] [--last N] [--json]``: recent beat slot claims.
* ``stats [--json]``: counters per task and per beat entry.
* ``doctor [--json]``: check the configuration and the Redis server.

Presentation only (options, tables, JSON, exit codes): what the commands read
and do is :mod:`celery_singleton_beat.admin`, which reads the Redis of
``singleton_redis_url`` (the one the workers and beats use) with ``SCAN``,
never ``KEYS``. Every command first imports the app's task modules, as
``celery worker`` does (``include``, ``imports``, ``autodiscover_tasks``).
While ``locks``, ``stats`` and ``slots`` walk the keys, a progress line on stderr says
how far they are, when stderr is a terminal only (nothing when it is piped).

Exit codes (every command, ``doctor`` included): 0 success (also "nothing
held"; ``doctor`` with warnings only); 1 ``doctor`` found a problem, or
``release`` / ``purge-claims`` refused or was declined, or ``release`` found a
lock re-taken; 2 usage error;
69 Redis unreachable (a Redis Cluster whose nodes do not answer too);
78 invalid ``singleton_*`` settings.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import click
from celery import Celery
from celery.bin.base import CeleryCommand, CeleryOption, handle_preload_options
from celery.exceptions import CeleryCommandException

from . import admin
from .admin import (
    BEAT_COUNTERS,
    EX_CONFIG,
    EX_FAILURE,
    EX_UNAVAILABLE,
    TASK_COUNTERS,
    AdminRedisError,
    AmbiguousRelease,
    HeldLock,
    InvalidSettings,
    NotALockKey,
    SlotClaim,
)
from .config import SingletonSettings
from .connection.url import sanitize_redis_url
from .terminal import JsonList, Pending, Progress, StreamedTable, as_json_text, duration, table, utc

__all__ = ["singleton"]

T = TypeVar("T")


class _Session:
    """The command's app, its task modules loaded, with admin errors turned into exit codes."""

    def __init__(self, ctx: click.Context) -> None:
        self.ctx = ctx
        self.app: Celery = ctx.obj.app
        with _exit_codes():
            self.settings: SingletonSettings = admin.connect(self.app).settings
        self.prefix = self.settings.key_prefix
        self.url = sanitize_redis_url(self.settings.redis_url)
        try:
            admin.load_tasks(self.app)
        except Exception as exc:  # the app's own modules; these commands read Redis only
            self.note(f"note: cannot import the app's task modules ({type(exc).__name__}: {exc}); "
                      "`doctor` reports it too")

    def run(self, read: Callable[[], T]) -> T:
        """Call ``read`` (an admin function); its errors end the command with their exit code."""
        with _exit_codes():
            return read()

    def echo(self, message: str = "", **options: Any) -> None:
        self.ctx.obj.echo(message, **options)

    def note(self, message: str) -> None:
        """A remark for the human reader, on stderr (keeps ``--json`` output clean)."""
        self.ctx.obj.error(message)

    def show(self, records: Sequence[HeldLock] | Sequence[SlotClaim], as_json: bool, empty: str,
             headers: Sequence[str], row: Callable[[Any], Sequence[Any]], numeric: Sequence[int] = ()) -> None:
        """Print ``records`` as a JSON list, or as a table (``empty`` when there are none)."""
        if as_json:
            self.echo(as_json_text([record.as_json() for record in records]))
        elif not records:
            self.echo(f"{empty} (prefix '{self.prefix}', {self.url}).")
        else:
            self.echo(table(headers, [row(record) for record in records], numeric))


@contextmanager
def _exit_codes() -> Iterator[None]:
    """Invalid settings end the command with 78, a Redis that cannot be used with 69."""
    try:
        yield
    except InvalidSettings as exc:
        raise CeleryCommandException(f"invalid configuration: {exc}", EX_CONFIG) from exc
    except AdminRedisError as exc:
        raise CeleryCommandException(str(exc), EX_UNAVAILABLE) from exc


_JSON = click.option("--json", "as_json", cls=CeleryOption, is_flag=True, help_group="Output Options",
                     help="Print JSON instead of a table.")


# --------------------------------------------------------------------------- commands


@click.group(name="singleton")
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]  # celery's decorator is untyped
def singleton(ctx: click.Context, **kwargs: Any) -> None:
    """celery-singleton-beat: locks, beat slots, counters and health checks.

    Reads the Redis of singleton_redis_url with SCAN (never KEYS).
    """


@singleton.command(cls=CeleryCommand)
@click.option("--task", "task_name", cls=CeleryOption, metavar="NAME", help_group="Lock Options",
              help="Only the locks of this task (its registered name).")
@_JSON
@click.pass_context
def locks(ctx: click.Context, task_name: str | None, as_json: bool) -> None:
    """List held task locks and publish-time claims.

    Printed as they are found, in no particular order (the first 100 rows
    size the table's columns). Columns: task, kind (run: a running task; claim/queued: a message
    waiting in the queue), holder task id, node, pid, acquisition time (UTC),
    TTL left, time since the holder last renewed it, stale, key. Stale: its holder did not
    confirm it in the recovery window after the lock Redis may have lost data (a restart
    from a snapshot, a failover), and the window has closed: the next acquire of the key
    replaces it. JSON: a list of objects with task, key, kind, task_id, node, pid, boot,
    acquired_at (epoch seconds), ttl (seconds, null if the lock never expires), renewed_ago
    (seconds, null for a claim) and stale (true or false).
    """
    session = _Session(ctx)
    progress = Progress("lock", "locks")
    pending = Pending(session.echo, progress)
    found = session.run(lambda: admin.iter_locks(session.app, task=task_name, progress=pending.after_each_call))
    out: JsonList | StreamedTable = JsonList(pending.write) if as_json else StreamedTable(
        pending.write, ("TASK", "KIND", "HOLDER TASK ID", "NODE", "PID", "ACQUIRED (UTC)", "TTL", "RENEWED", "STALE",
                        "KEY"), numeric=(4, 6, 7))
    stale = 0
    try:
        with _exit_codes():
            for lock in found:
                progress.found += 1
                stale += lock.stale
                if isinstance(out, JsonList):
                    out.add(lock.as_json())
                else:
                    renewed = "-" if lock.renewed_ago is None else f"{duration(lock.renewed_ago)} ago"
                    out.add((lock.task, lock.kind, lock.holder.task_id, lock.holder.node, lock.holder.pid,
                             utc(lock.holder.acquired_at), duration(lock.ttl), renewed,
                             "stale" if lock.stale else "-", lock.key))
        out.close()
    finally:  # what was found, also before an error
        pending.flush()
        progress.clear()
    if as_json:
        return
    if not out.count:
        none = f"No lock of task {task_name} is held" if task_name else "No task lock is held"
        session.echo(f"{none} (prefix '{session.prefix}', {session.url}).")
    elif stale:
        session.echo(f"\n{out.count} lock(s) held, {stale} stale: not confirmed by their holders after the lock "
                     "Redis may have lost data; each is replaced by the next acquire of its key.")
    else:
        session.echo(f"\n{out.count} lock(s) held.")


@singleton.command(cls=CeleryCommand)
@click.argument("key", required=False)
@click.option("--task", "task_name", cls=CeleryOption, metavar="NAME", help_group="Release Options",
              help="Release the lock of this task (the only one held, or all with --all).")
@click.option("--all", "release_all", cls=CeleryOption, is_flag=True, help_group="Release Options",
              help="With --task: release every lock of the task.")
@click.option("-y", "--yes", cls=CeleryOption, is_flag=True, help_group="Release Options",
              help="Do not ask for confirmation (needed when not run from a terminal).")
@click.option("-t", "--timeout", cls=CeleryOption, type=float, default=1.0, show_default=True,
              help_group="Release Options",
              help="Seconds to wait for the holders' workers to say whether the holder still runs.")
@click.pass_context
def release(ctx: click.Context, key: str | None, task_name: str | None, release_all: bool,
            yes: bool, timeout: float) -> None:
    """Force-release a stuck lock: KEY, or the lock(s) of --task NAME.

    Use it when a lock outlives its holder and its TTL is long. The workers
    of running holders are asked first: releasing the lock of a task that is
    still running lets a duplicate start beside it (the running task learns
    at its next renewal, and sends task-lock-lost when it ends), so that case
    is warned about. Each lock is deleted only if it still has the value shown
    (compare-and-delete): a lock re-taken meanwhile is left alone. Releases
    are counted as force_released in the task's counters.
    """
    if (key is None) == (task_name is None):
        raise click.UsageError("give either a KEY or --task NAME")
    if release_all and task_name is None:
        raise click.UsageError("--all goes with --task NAME")
    session = _Session(ctx)
    try:
        targets = session.run(lambda: admin.find_release_targets(
            session.app, key=key, task=task_name, every=release_all))
    except NotALockKey as exc:
        raise click.UsageError(str(exc)) from None
    except AmbiguousRelease as exc:
        session.echo(f"Held:\n{_lock_list(exc.locks)}")
        raise CeleryCommandException(
            f"{len(exc.locks)} locks of {task_name} are held: pass --all to release them all, "
            "or give one KEY", EX_FAILURE) from None
    if not targets:
        session.echo(f"{key} is not held; nothing to release." if key is not None
                     else f"No lock of task {task_name} is held; nothing to release.")
        return

    session.echo(f"To release ({len(targets)}):\n{_lock_list(targets)}")
    if not yes and not sys.stdin.isatty():
        raise CeleryCommandException(
            "not releasing: confirmation needed and this is not an interactive terminal "
            "(pass --yes)", EX_FAILURE)
    _warn_if_running(session, targets, timeout)
    if not yes and not click.confirm(f"Release {len(targets)} lock(s)?", default=False):
        raise CeleryCommandException("not released", EX_FAILURE)

    changed = 0
    for lock in targets:  # one by one, so that what was done is shown even if Redis fails
        if session.run(functools.partial(admin.release_lock, session.app, lock)):
            session.echo(f"released {_describe(lock)}")
        else:
            changed += 1
            session.note(f"NOT released {lock.key}: it changed since it was read "
                         "(expired, released or re-taken by another run)")
    if changed:
        raise CeleryCommandException(f"{changed} lock(s) changed before release; run `locks` again",
                                     EX_FAILURE)


def _describe(lock: HeldLock) -> str:
    holder = lock.holder
    if lock.kind == "unknown":
        return f"{lock.key}  (not a lock record), TTL {duration(lock.ttl)}"
    return (f"{lock.key}  {lock.kind} of task {holder.task_id} on {holder.node} (pid {holder.pid}), "
            f"acquired {utc(holder.acquired_at)}, TTL {duration(lock.ttl)}")


def _lock_list(targets: Sequence[HeldLock]) -> str:
    return "\n".join(f"  {_describe(lock)}" for lock in targets)


def _warn_if_running(session: _Session, targets: Sequence[HeldLock], timeout: float) -> None:
    """Warn about holders still running on a worker that answers, and about silent nodes."""
    report = admin.check_holders(session.app, targets, timeout=timeout)
    if report.error:
        session.note(f"WARNING: cannot ask the workers whether the holders still run "
                     f"(broker unreachable: {report.error})")
        return
    for status in report.holders:
        lock, node = status.lock, status.lock.holder.node
        if status.state == "silent":
            session.note(f"note: worker {node} did not answer within {timeout:g}s: the holder "
                         f"{lock.holder.task_id} is probably gone (or that worker is busy or has "
                         "remote control disabled)")
        elif status.state == "running":
            session.note(f"WARNING: task {lock.holder.task_id} is RUNNING on {node} "
                         f"(pid {lock.holder.pid}): releasing {lock.key} lets a duplicate start "
                         "while it runs")
        else:
            session.note(f"note: {node} answered and is not running {lock.holder.task_id}: "
                         "the lock is stale")


@singleton.command(name="purge-claims", cls=CeleryCommand)
@click.option("--task", "task_name", cls=CeleryOption, metavar="NAME", help_group="Purge Options",
              help="Only the claims of this task (its registered name).")
@click.option("-y", "--yes", cls=CeleryOption, is_flag=True, help_group="Purge Options",
              help="Do not ask for confirmation (needed when not run from a terminal).")
@click.pass_context
def purge_claims(ctx: click.Context, task_name: str | None, yes: bool) -> None:
    """Delete publish-time claims (until_executed, until_executing): run it after `celery purge`.

    A purged message leaves its claim for singleton_queue_lock_ttl (an hour by
    default): meanwhile a new publish of its key returns the purged message's
    result and nothing runs. Only claims are deleted, never a running lock, and
    each only if it still has the value shown (compare-and-delete): a claim whose
    run started meanwhile is left alone. A claim of a message still queued loses
    its publish-time deduplication only (its run still takes the run lock).
    Deletions are counted as claims_purged in the task's counters.
    """
    session = _Session(ctx)
    targets = session.run(lambda: admin.find_claims(session.app, task=task_name))
    if not targets:
        session.echo("No publish-time claim is held; nothing to purge." if task_name is None
                     else f"No publish-time claim of task {task_name} is held; nothing to purge.")
        return
    session.echo(f"To purge ({len(targets)}):\n{_lock_list(targets)}")
    if not yes and not sys.stdin.isatty():
        raise CeleryCommandException(
            "not purging: confirmation needed and this is not an interactive terminal (pass --yes)",
            EX_FAILURE)
    if not yes and not click.confirm(f"Delete {len(targets)} claim(s)?", default=False):
        raise CeleryCommandException("not purged", EX_FAILURE)
    purged = 0
    for claim in targets:  # one by one, so that what was done is shown even if Redis fails
        if session.run(functools.partial(admin.purge_claims, session.app, [claim])).released:
            purged += 1
        else:
            session.note(f"left alone {claim.key}: it changed since it was read (its run "
                         "started, or it expired and was claimed again)")
    session.echo(f"purged {purged} claim(s)")


@singleton.command(cls=CeleryCommand)
@click.option("--entry", cls=CeleryOption, metavar="NAME", help_group="Slot Options",
              help="Only the claims of this beat entry.")
@click.option("--last", cls=CeleryOption, type=click.IntRange(min=1), default=20, show_default=True,
              metavar="N", help_group="Slot Options", help="How many claims to show, newest first.")
@_JSON
@click.pass_context
def slots(ctx: click.Context, entry: str | None, last: int, as_json: bool) -> None:
    """List recent beat slot claims: entry, slot (UTC), winning beat instance.

    Read from the beat's capped history list; without one, from the live claim
    keys (each expires the entry's period plus singleton_beat_claim_margin
    after it was claimed). JSON: a list of objects
    with entry, slot, winner, claimed_at (epoch seconds), key and task.
    """
    session = _Session(ctx)
    progress = Progress("beat key", "beat keys", count_matched=True)
    try:
        history = session.run(lambda: admin.recent_slots(session.app, entry=entry, last=last,
                                                         progress=progress))
    finally:
        progress.clear()
    claims = history.claims
    if history.source == "claims" and claims:
        session.note("note: no beat history list; showing the live claim keys (entries are "
                     "named as in their keys)")
    session.show(
        claims, as_json, f"No beat slot claim {f'of entry {entry} ' if entry else ''}is recorded",
        ("SLOT (UTC)", "ENTRY", "WON BY", "CLAIMED AT (UTC)", "TASK"),
        lambda claim: (claim.slot, claim.entry, claim.winner, utc(claim.claimed_at), claim.task),
    )


@singleton.command(cls=CeleryCommand)
@_JSON
@click.pass_context
def stats(ctx: click.Context, as_json: bool) -> None:
    """Show counters per task and per beat entry.

    Tasks: acquired, skipped, released, renewed, lost, reclaimed, taken_over,
    redelivered (and, in OTHER, the others that are not zero: refused,
    deferred, claimed, publish_deduplicated, completed_copies, force_released,
    claims_purged, put_back). Beat: slot claims won and lost, slots taken over,
    copies dropped by workers. Each process counts in memory and writes its
    counts in batches, about a second after the first count; the hashes expire
    30 days after their last update. JSON:
    {"tasks": {task: {counter: n}}, "beat": {"entries": {...}, "total": {...}}}.
    """
    session = _Session(ctx)
    progress = Progress("counter hash", "counter hashes", count_matched=True)
    try:
        counters = session.run(lambda: admin.read_counters(session.app, progress=progress))
    finally:
        progress.clear()
    if as_json:
        session.echo(as_json_text(counters.as_json()))
        return
    if counters.empty:
        session.echo(f"No counters recorded (prefix '{session.prefix}', {session.url}).")
    if counters.tasks:
        rows = []
        for name, counts in counters.tasks.items():
            other = " ".join(f"{k}={v}" for k, v in sorted(counts.items()) if k not in TASK_COUNTERS and v)
            rows.append((name, *(counts[c] for c in TASK_COUNTERS), other or "-"))
        headers = ("TASK", *(c.upper() for c in TASK_COUNTERS), "OTHER")
        session.echo(table(headers, rows, numeric=range(1, len(TASK_COUNTERS) + 1)))
    if counters.beat_entries or counters.beat_total:
        rows = [(name, *(counts[c] for c in BEAT_COUNTERS)) for name, counts in counters.beat_entries.items()]
        if counters.beat_total:
            rows.append(("(all entries)", *(counters.beat_total[c] for c in BEAT_COUNTERS)))
        if counters.tasks:
            session.echo()
        headers = ("BEAT ENTRY", "SLOTS WON", "SLOTS LOST", "TAKEN OVER", "COPIES DROPPED")
        session.echo(table(headers, rows, numeric=range(1, len(BEAT_COUNTERS) + 1)))
    if not counters.stats_enabled:
        session.note("note: singleton_stats is False: tasks keep no counters")


@singleton.command(cls=CeleryCommand)
@_JSON
@click.pass_context
def doctor(ctx: click.Context, as_json: bool) -> None:
    """Check the configuration and the Redis server.

    Exit code: 0 when no check fails (warnings allowed), 78 when the
    singleton_* settings are invalid or the server refuses them (a wrong
    password, an ACL refusal, a missing database, a TLS failure: a worker
    would refuse to start), 69 when Redis is unreachable, 1 for any other
    failed check.

    Checks: singleton_* settings, and the app's task modules import (its
    singleton tasks are counted); Redis reachable; version (6.2 or later, 7.0
    or later for every feature) and role (a primary); access (SET ... PX ...
    GET under the key prefix, as the heartbeat sends it); Lua (a cjson script,
    run as the lock scripts are); eviction policy (anything but noeviction can evict locks, and
    an evicted lock lets a duplicate run); keys under the prefix that never
    expire (a lock without TTL blocks its task for good). FAIL is a problem, WARN worth a look.
    """
    report = admin.doctor(ctx.obj.app)
    if as_json:
        ctx.obj.echo(as_json_text(report.as_json()))
    else:
        if report.settings is not None:
            ctx.obj.echo(f"celery-singleton-beat doctor: {sanitize_redis_url(report.settings.redis_url)}, "
                         f"key prefix '{report.settings.key_prefix}'")
        width = max(len(check.name) for check in report.checks)
        colors = {"OK": "green", "WARN": "yellow", "FAIL": "red"}
        for check in report.checks:
            status = ctx.obj.style(check.status.ljust(4), fg=colors[check.status], bold=True)
            ctx.obj.echo(f"{status}  {check.name.ljust(width)}  {check.detail}")
        ctx.obj.echo(f"{report.problems} problem(s), {report.warnings} warning(s)")
    if report.exit_code:
        ctx.exit(report.exit_code)

"""The shop's tasks: each shows one way of using celery-singleton-beat.

* :func:`import_products`: hourly (crontab). The beat schedule sends each hour
  once; ``SingletonTask`` also keeps a manual re-run from overlapping it.
* :func:`sync_customer`: ``SingletonTask`` with ``unique_on=["customer_id"]``:
  syncs of different customers run in parallel, two syncs of one customer
  never do, and ``reason`` does not count as a different sync.
* :func:`build_sales_report`: runs longer than its ``lock_ttl``; the lease is
  renewed while it runs, and it writes its result with the fencing token.
* :func:`release_expired_reservations`: a plain task every second. Beat sends
  each slot once, so it needs no lock of its own.

Work is simulated with short sleeps; each body records its execution first
(:func:`~example_project.shop.journal.record_execution`).
"""

from __future__ import annotations

import time
from typing import Any

from celery import Task

from celery_singleton_beat import SingletonTask

from . import journal
from .celery_app import app

#: The customers the fan-out syncs.
CUSTOMERS = (101, 102, 103)
#: A sync lasts longer than the fan-out period (2 s): the next fan-out finds
#: some customers' locks held and skips them.
SYNC_SECONDS = 3.0
#: The report: REPORT_CHUNKS chunks of REPORT_CHUNK_SECONDS, 2.5 times its lease.
REPORT_LEASE_SECONDS = 2.0
REPORT_CHUNKS = 10
REPORT_CHUNK_SECONDS = 0.5
IMPORT_SECONDS = 2.0


@app.task(bind=True, base=SingletonTask, name="shop.import_products", lock_ttl=300)
def import_products(self: SingletonTask) -> int:
    """Import the supplier's catalogue; at most one import runs at a time."""
    journal.record_execution(self)
    time.sleep(IMPORT_SECONDS)  # download and parse the supplier's feed
    imported = 250
    journal.store().hset(journal.key("catalogue"), mapping={"imported_at": time.time(),
                                                           "products": imported})
    return imported


@app.task(bind=True, name="shop.sync_all_customers")
def sync_all_customers(self: Task) -> int:
    """Queue one :func:`sync_customer` per customer (a fan-out, sent by beat)."""
    journal.record_execution(self)
    for customer_id in CUSTOMERS:
        sync_customer.delay(customer_id)
    return len(CUSTOMERS)


@app.task(bind=True, base=SingletonTask, name="shop.sync_customer",
          unique_on=["customer_id"], lock_ttl=30)
def sync_customer(self: SingletonTask, customer_id: int, reason: str = "schedule") -> None:
    """Push one customer's orders to the CRM.

    The lock key is the task name and ``customer_id`` only: a sync queued by a
    webhook (``reason="webhook"``) while the scheduled one runs is the same
    work, and is skipped. ``lock_ttl=30``: should the worker die, the lock
    frees itself after 30 s at the latest.
    """
    journal.record_execution(self, customer=customer_id)
    with journal.overlap_probe(f"customer:{customer_id}"):
        time.sleep(SYNC_SECONDS)  # call the CRM's API
        journal.store().hset(journal.key("customers", customer_id),
                             mapping={"synced_at": time.time(), "reason": reason})


@app.task(bind=True, base=SingletonTask, name="shop.build_sales_report",
          lock_ttl=REPORT_LEASE_SECONDS, on_conflict="retry", max_retries=10)
def build_sales_report(self: SingletonTask) -> dict[str, Any]:
    """Aggregate sales chunk by chunk, for longer than the lock's 2 s lease.

    A report for a new slot is new work, so a run that finds the previous
    report still going waits for it (``on_conflict="retry"``) instead of being
    skipped: a catch-up report sent after an outage can still be running when
    the next slot comes due.

    The library renews the lease every third of ``lock_ttl`` while the body
    runs. Before the irreversible write the run checks that it still holds the
    lease (``ensure_held`` raises ``LockLost`` otherwise), and it passes the
    lease's fencing token to the store, which rejects a write with a smaller
    token than one it has seen.
    """
    journal.record_execution(self)
    total = 0
    for chunk in range(REPORT_CHUNKS):
        time.sleep(REPORT_CHUNK_SECONDS)  # one slow aggregate query
        total += 100 + chunk
    fence = self.singleton_run.ensure_held()  # the fencing token of a lease still held
    report = {"total": total, "built_at": time.time(), "task_id": self.request.id}
    written = journal.fenced_write("sales", fence, report)
    return {**report, "fence": fence, "written": written}


@app.task(bind=True, name="shop.release_expired_reservations")
def release_expired_reservations(self: Task) -> int:
    """Put back on sale the stock held by carts abandoned for too long."""
    journal.record_execution(self)
    return int(journal.store().zremrangebyscore(journal.key("reservations"), "-inf", time.time()))

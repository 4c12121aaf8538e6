"""The shop's beat schedule.

Every beat process runs this whole schedule; the singleton scheduler makes
sure each *slot* (an entry's nominal fire time) is sent by exactly one of
them. Interval slots are aligned to the Unix epoch (every 2 s means at
:00, :02, :04, ...), so beats started at different times agree on them.

The periods are short so that the demo shows the cluster at work within
seconds; a real shop would sync customers every few minutes and build its
report daily.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from celery.schedules import crontab

BEAT_SCHEDULE: dict[str, dict[str, Any]] = {
    # The supplier's catalogue, at the top of every hour. A crontab entry:
    # its slot is the scheduled instant (hh:00:00 UTC), whichever beat sends it.
    "import-products": {
        "task": "shop.import_products",
        "schedule": crontab(minute=0),
    },
    # Fan-out: one sync_customer message per customer. A sync lasts longer
    # than this period, so some syncs find their customer's lock held and are
    # skipped (state SKIPPED in Flower) instead of running twice at once.
    "sync-customers": {
        "task": "shop.sync_all_customers",
        "schedule": timedelta(seconds=2),
    },
    # A report that runs longer than its lock's lease: the lease is renewed
    # while it runs, and its result is written with a fencing token.
    "sales-report": {
        "task": "shop.build_sales_report",
        "schedule": timedelta(seconds=15),
    },
    # Frequent housekeeping: stock held by abandoned carts goes back on sale.
    # The demo's heartbeat: one execution per second, whatever the number of beats.
    "release-expired-reservations": {
        "task": "shop.release_expired_reservations",
        "schedule": timedelta(seconds=1),
    },
}

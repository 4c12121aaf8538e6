"""Django settings of the django-celery-beat tests: one SQLite file, ``django_celery_beat`` only.

``CSB_DJANGO_DB`` is the database file (the test process migrates it once per
module). The test process configures Django with :func:`settings_for`; the
beats it starts use this module as ``DJANGO_SETTINGS_MODULE``.
"""

from __future__ import annotations

import os
from typing import Any


def settings_for(database: str) -> dict[str, Any]:
    """The settings, with ``database`` as the SQLite file."""
    import django

    # Several beats and the test write to one file: wait for its lock (``timeout``),
    # and take it when a transaction begins, since SQLite fails at once (no wait)
    # a transaction that read and then wants to write while another one writes.
    options: dict[str, Any] = {"timeout": 30}
    if django.VERSION >= (5, 1):
        options["transaction_mode"] = "IMMEDIATE"
    return {
        "SECRET_KEY": "celery-singleton-beat tests only",
        "INSTALLED_APPS": ["django_celery_beat"],
        "DATABASES": {"default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": database,
            "OPTIONS": options,
        }},
        "USE_TZ": True,
        "TIME_ZONE": "UTC",
        "DEFAULT_AUTO_FIELD": "django.db.models.AutoField",
    }


globals().update(settings_for(os.environ.get("CSB_DJANGO_DB", ":memory:")))

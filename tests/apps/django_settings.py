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
    return {
        "SECRET_KEY": "celery-singleton-beat tests only",
        "INSTALLED_APPS": ["django_celery_beat"],
        "DATABASES": {"default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": database,
            # Several beats and the test share the file: wait for its lock, do not fail.
            "OPTIONS": {"timeout": 30},
        }},
        "USE_TZ": True,
        "TIME_ZONE": "UTC",
        "DEFAULT_AUTO_FIELD": "django.db.models.AutoField",
    }


globals().update(settings_for(os.environ.get("CSB_DJANGO_DB", ":memory:")))

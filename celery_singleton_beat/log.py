"""The library's single logger: every decision is one line on it.

A module of its own, under everything else: the lowest layers (what the lock
Redis is, :mod:`.server`) log without importing Celery's task events
(:mod:`.events`, which re-exports it).
"""

from __future__ import annotations

import logging

__all__ = ["logger"]

#: The library's single logger; every decision is one line on it.
logger = logging.getLogger("celery_singleton_beat")

"""The library's single logger: every decision is one line on it.

A module of its own, under everything else: every layer, from the connection
up, imports it from here (and only from here).
"""

from __future__ import annotations

import logging

__all__ = ["logger"]

#: The library's single logger; every decision is one line on it.
logger = logging.getLogger("celery_singleton_beat")

"""The task of ``tests.apps.discover_app``, found only by autodiscovery."""

from __future__ import annotations

from celery_singleton_beat import SingletonTask

from ..discover_app import app


@app.task(base=SingletonTask, name="discovered.refresh")
def refresh(key: str) -> str:
    return key

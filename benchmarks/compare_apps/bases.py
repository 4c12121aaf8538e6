"""The task base class of each compared library, set up on an app with its defaults.

Shared by the compare apps so that every benchmark configures a library the
same way: only its Redis URL is set.
"""

from __future__ import annotations

from celery import Celery, Task


def task_base(app: Celery, variant: str, locks_url: str) -> type[Task]:
    """``variant``'s task base class, its Redis set to ``locks_url`` in ``app.conf``.

    ``plain`` / ``redbeat`` (beats run with RedBeat) -> ``celery.Task``, ``ours`` ->
    ``SingletonTask`` (``ours_redbeat``: the same, beats run with ``SingletonRedBeatScheduler``),
    ``celery_singleton`` -> ``Singleton``, ``celery_once`` ->
    ``QueueOnce``. Raises ``RuntimeError`` for anything else.
    """
    if variant == "plain":
        return Task
    if variant == "redbeat":
        app.conf.redbeat_redis_url = locks_url
        return Task
    if variant in ("ours", "ours_redbeat"):
        from celery_singleton_beat import SingletonTask

        app.conf.singleton_redis_url = locks_url
        if variant == "ours_redbeat":
            app.conf.redbeat_redis_url = locks_url
        return SingletonTask
    if variant == "celery_singleton":
        from celery_singleton import Singleton

        app.conf.singleton_backend_url = locks_url
        return Singleton  # type: ignore[no-any-return]
    if variant == "celery_once":
        from celery_once import QueueOnce

        app.conf.ONCE = {"backend": "celery_once.backends.Redis", "settings": {"url": locks_url}}
        return QueueOnce  # type: ignore[no-any-return]
    raise RuntimeError(f"unknown CMP_VARIANT {variant!r}")

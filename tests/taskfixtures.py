"""Compatibility: the task helpers and fixtures moved to ``tests.support``.

New code imports helpers from ``.support.tasks`` and gets the fixtures
(``tasks``, ``locks``, ``records``, ``backend``) from ``conftest.py`` without
importing anything.
"""

from .support.fixtures import backend, locks, records, tasks  # noqa: F401 - function-scoped only
from .support.tasks import EventCapture, load_ops_app, load_tasks_app, lock_keys, runs, settled, started  # noqa: F401

"""The Celery task side: SingletonTask, its keys, conflicts, publishing, outages, the worker step, events."""

"""Taking a lock by hand, as a run would, with the spec's fields as keyword arguments."""

from __future__ import annotations

from typing import Any

from celery_singleton_beat.lease.lock import AcquireResult, acquire
from celery_singleton_beat.lease.spec import LockSpec


def take_lock(client: Any, key: str, ttl: float, *, task: str, task_id: str | None = None, node: str | None = None,
              adopt_claim_of: str | None = None, copy: bool = False, **spec: Any) -> AcquireResult:
    """``acquire(client, key, LockSpec(task=task, ttl=ttl, **spec), task_id, ...)``."""
    return acquire(client, key, LockSpec(task=task, ttl=ttl, **spec), task_id, node=node,
                   adopt_claim_of=adopt_claim_of, copy=copy)

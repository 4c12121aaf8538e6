"""Session-wide real redis-server and per-test clean state."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from celery_singleton_beat.client import reset_clients
from celery_singleton_beat.config import clear_settings_cache

from .support import CeleryProcess, RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the whole session, on a free loopback port."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def redis_db(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A clean Redis for one test (every database flushed), as a client of db 0."""
    if redis_server.process is None:  # a previous test stopped it
        redis_server.start()
    client = redis_server.client()
    client.flushall()
    clear_settings_cache()
    reset_clients()
    yield client
    reset_clients()


@pytest.fixture
def processes() -> Iterator[list[CeleryProcess]]:
    """Celery processes a test starts; all stopped (and killed if need be) afterwards."""
    started: list[CeleryProcess] = []
    yield started
    for process in started:
        process.stop()

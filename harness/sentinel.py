"""Redis Sentinel on loopback: a sentinel's configuration, and when a watched group is ready.

Shared by the tests' Sentinel topology (``tests/support/topologies.py``) and the
chaos cluster's ``sentinel`` lock Redis (``harness/chaos/cluster.py``). A
sentinel is ``redis-server <file> --sentinel`` (no separate binary); each
sentinel needs a file of its own, which it rewrites as it learns the group.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

__all__ = ["MASTER_NAME", "group_ready", "master_address", "sentinel_args"]

#: The name the sentinels watch the primary under.
MASTER_NAME = "mymaster"


def sentinel_args(config: Path, port: int, primary_port: int, *, down_after_ms: int, failover_timeout_ms: int = 10000,
                  password: str | None = None, sentinel_password: str | None = None) -> list[str]:
    """Write ``config`` for a sentinel on ``port`` watching the primary on ``primary_port``
    (quorum 2); the arguments that start it after the binary."""
    lines = [f"port {port}", "bind 127.0.0.1",
             f"sentinel monitor {MASTER_NAME} 127.0.0.1 {primary_port} 2",
             f"sentinel down-after-milliseconds {MASTER_NAME} {down_after_ms}",
             f"sentinel failover-timeout {MASTER_NAME} {failover_timeout_ms}",
             f"sentinel parallel-syncs {MASTER_NAME} 1"]
    if password:
        lines.append(f"sentinel auth-pass {MASTER_NAME} {password}")
    if sentinel_password:
        lines += [f"requirepass {sentinel_password}", f"sentinel sentinel-pass {sentinel_password}"]
    config.write_text("\n".join(lines) + "\n")
    return [str(config), "--sentinel"]


def master_address(sentinel: redis.Redis) -> tuple[str, int]:
    """The primary's address as ``sentinel`` names it."""
    address: Any = sentinel.sentinel_get_master_addr_by_name(MASTER_NAME)
    host, port = address
    return str(host), int(port)


def group_ready(sentinels: Sequence[redis.Redis], primary: Any, replicas: int = 1) -> bool:
    """Every sentinel knows the primary (not down), ``replicas`` replicas and the other
    sentinels; ``primary()`` (a client of the primary they name) reports that many replicas online."""
    for sentinel in sentinels:
        try:
            state: Any = sentinel.sentinel_master(MASTER_NAME)
        except redis.RedisError:
            return False
        if (int(state.get("num-slaves", 0)) < replicas
                or int(state.get("num-other-sentinels", 0)) < len(sentinels) - 1
                or "s_down" in str(state.get("flags", ""))):
            return False
    with primary() as client:
        info = client.info("replication")
    online = [v for k, v in info.items()
              if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online"]
    return info.get("role") == "master" and len(online) >= replicas

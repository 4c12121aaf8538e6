"""The server record of the lock data: what it holds, how a script reads it, and where it
lives (one per server, or one per Redis Cluster shard, kept on that shard).

``<prefix>:server`` is a small JSON object (:class:`ServerRecord`) naming the server
last seen serving the data, the data's generation, the longest recovery window its
users need, when the latest window opened and the Sentinel failover epoch its last
writer was told; ``<prefix>:recovery``'s TTL is an open window. The rule that reads
and writes them is in :mod:`.window`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from redis.crc import key_slot
from redis.exceptions import ResponseError

from ..log import logger

__all__ = ["READ_RECORD", "ServerRecord", "records_of", "recovery_key", "server_key", "shard_records", "shard_tag",
           "text_of"]


@dataclass(frozen=True)
class ServerRecord:
    """What ``<prefix>:server`` holds: the ``server`` (run id) last seen serving the data,
    the data's ``generation`` (only grows: see the module docstring), the longest
    recovery window, in seconds, that a process using it needs (``need``), and the
    Sentinel failover ``epoch`` its writer was told (0: not Sentinel)."""

    server: str
    generation: int = 0
    need: float = 0.0
    #: The server's clock (Unix ms) when the latest window opened: the data may have lost
    #: writes made before it (0: never). A lock not renewed since is unconfirmed.
    since_ms: int = 0
    #: The Sentinel failover epoch (``config-epoch``) the record's last writer was told; a
    #: failover since makes it differ from the sentinels' (0: none known).
    epoch: int = 0

    def encode(self) -> str:
        """The record's value, as the check's script writes it."""
        return json.dumps({"server": self.server, "generation": self.generation,
                           "need_ms": round(self.need * 1000), "since_ms": self.since_ms,
                           "epoch": self.epoch})

    @classmethod
    def decode(cls, raw: bytes | str | None) -> ServerRecord | None:
        """The record read from ``raw`` (None: no record). A value that is not this format
        (a bare run id) names that server at generation 0, as the script reads it."""
        text = text_of(raw)
        if text is None:
            return None
        try:
            fields = json.loads(text)
        except ValueError:
            fields = None
        if not isinstance(fields, dict):
            return cls(text)
        return cls(str(fields.get("server")), int(fields.get("generation") or 0),
                   int(fields.get("need_ms") or 0) / 1000, int(fields.get("since_ms") or 0),
                   int(fields.get("epoch") or 0))


# Reads the record in KEYS[1] into server (nil: none), generation and need (ms); a value
# that is not a JSON object (a bare run id) names that server at generation 0.
READ_RECORD = """
local raw = redis.call('GET', KEYS[1])
local server, generation, need, since, epoch = raw, 0, 0, 0, 0
if raw then
  local ok, record = pcall(cjson.decode, raw)
  if ok and type(record) == 'table' then
    server = record.server
    generation = tonumber(record.generation) or 0
    need = tonumber(record.need_ms) or 0
    since = tonumber(record.since_ms) or 0
    epoch = tonumber(record.epoch) or 0
  end
end
"""


def text_of(value: Any) -> str | None:
    """``value`` as text (a reply's bytes decoded; None stays None)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


# ----------------------------------------------------------------- where the records live


def server_key(prefix: str, tag: str | None = None) -> str:
    """The key naming the server last seen serving the lock data (never expires);
    ``tag``: of one Redis Cluster shard (see :func:`records_of`)."""
    return f"{prefix}:server" if tag is None else f"{prefix}:server:{{{tag}}}"


def recovery_key(prefix: str, tag: str | None = None) -> str:
    """The key whose TTL is an open recovery window (see the module docstring)."""
    return f"{prefix}:recovery" if tag is None else f"{prefix}:recovery:{{{tag}}}"


@functools.lru_cache(maxsize=64)
def shard_tag(slot: int) -> str:
    """The first decimal number whose keys (as a hash tag) live in Redis Cluster ``slot``."""
    number = 0
    while key_slot(str(number).encode()) != slot:
        number += 1
    return str(number)


def shard_records(prefix: str, nodes: Any) -> tuple[str, str] | None:
    """The server and recovery records of the Cluster node whose ``CLUSTER NODES`` reply is
    ``nodes``: tagged with the lowest slot it serves (None: it serves none)."""
    text = nodes.decode() if isinstance(nodes, bytes) else str(nodes)
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 8 and "myself" in fields[2].split(","):
            slots = [int(f.split("-")[0]) for f in fields[8:] if not f.startswith("[")]
            if not slots:
                return None
            tag = shard_tag(min(slots))
            return server_key(prefix, tag), recovery_key(prefix, tag)
    return None


def records_of(connection: Any, prefix: str, *, cluster: bool) -> tuple[str, str] | None:
    """The server and recovery records of the data behind ``connection``; None when it has none.

    One server: ``<prefix>:server`` and ``<prefix>:recovery``. Redis Cluster: one pair
    per shard, ``<prefix>:server:{<tag>}`` and ``<prefix>:recovery:{<tag>}``, the tag
    hashing to the lowest slot the node serves (``CLUSTER NODES``), so the records live
    with the data they speak for and move to the replica promoted for it. A node that
    serves no slot, or an ACL without ``CLUSTER NODES``, has none.
    """
    if not cluster:
        return server_key(prefix), recovery_key(prefix)
    try:
        connection.send_command("CLUSTER", "NODES")
        return shard_records(prefix, connection.read_response())
    except ResponseError as exc:  # NOPERM
        logger.debug("CLUSTER NODES refused on the lock Redis (%s): no recovery windows on this node", exc)
        return None

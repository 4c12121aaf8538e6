"""The test harness: one package, modules by concern.

Nothing here mocks Redis or Celery: tests talk to a ``redis-server`` the
session starts (checked to be its own), and to real ``celery`` processes run
from the tests' apps (``tests/apps``). The process and redis-server plumbing
underneath is :mod:`harness`, shared with the benchmarks and the demo.

* :mod:`.paths`: ``ROOT``, the session's scratch directory.
* :mod:`.waiting`: ``wait_for`` (a condition with a deadline), ``soak``, ``wait_for_phase``.
* :mod:`.owners`: who stops each process and server (``owning``, ``register``).
* :mod:`.servers`: ``RedisServer``, ``RabbitMQServer``, database numbers.
* :mod:`.processes`: ``CeleryProcess``, ``start_worker``, ``TestProcess``, ``child_env``, ``run_command``.
* :mod:`.topologies`: TLS, ACL, Cluster and Sentinel topologies on loopback.
* :mod:`.tasks`: the task apps and their run records, ``EventCapture``.
* :mod:`.keeps_lock`: the keeps-lock tests' app, records and ``KeyWatch`` (a key provably absent).
* :mod:`.proxy`: ``HoldingProxy``, a loopback TCP relay that reorders two connections' commands.
* :mod:`.fault_proxy`: ``FaultProxy``, a RESP-aware relay that injects faults command by command;
  :mod:`.protocol_fuzz` drives lock operations through it and judges each result.
* :mod:`.interrupts`: exceptions raised into the main thread as a signal handler raises them.
* :mod:`.resharding`: ``SlotMove``, one Redis Cluster slot moved by hand, step by step.
* :mod:`.beat`: real beats, in-process schedulers with a manual clock.
* :mod:`.dbbeat`: django-celery-beat rows, database schedulers and their beats.
* :mod:`.slots`: ``UTC``, ``utc()``, slot labels.
* :mod:`.skips`: ``require``, ``importorskip``: skips locally, failures in CI.
* :mod:`.breaks`: ``documented_break``: the one step of a strict ``xfail`` that may fail it as expected.
* :mod:`.demo_orphan`: the demo, its failover landing between the killed beat's claim and its publish.
* :mod:`.fixtures`: the fixtures (registered by ``tests/conftest.py``).
"""

from harness.redis_server import free_port

from .owners import Owner, owning, register
from .paths import ROOT, scratch, scratch_dir
from .processes import CeleryProcess, TestProcess, child_env, run_command, start_worker
from .servers import (
                      BACKEND_DB,
                      BROKER_DB,
                      LOCK_DB,
                      RECORD_DB,
                      NotOurServer,
                      RabbitMQServer,
                      RedisServer,
                      kill_named,
                      queue_drained,
                      redis_server_binary,
)
from .skips import importorskip, in_ci, require, skip_or_fail
from .slots import UTC, parse_slot, slot_label, utc
from .waiting import soak, wait_for, wait_for_phase

__all__ = [
    "BACKEND_DB", "BROKER_DB", "LOCK_DB", "RECORD_DB", "ROOT", "UTC", "CeleryProcess", "NotOurServer",
    "Owner", "RabbitMQServer", "RedisServer", "TestProcess", "child_env", "free_port", "importorskip", "in_ci",
    "kill_named", "owning", "parse_slot", "queue_drained", "redis_server_binary", "register", "require", "run_command",
    "scratch", "scratch_dir",
    "skip_or_fail", "slot_label", "soak", "start_worker", "utc", "wait_for", "wait_for_phase",
]

"""The chaos app, with a gate at the start of a pool child's exit (reproduction only).

A receiver of ``worker_process_shutdown`` connected before the library's: the child
writes ``exiting-<pid>`` in ``$REPRO_GATE`` and waits (at most 30 s) for ``open``.
"""
import os
import time
from pathlib import Path

from celery import signals

GATE = Path(os.environ.get("REPRO_GATE", "/nonexistent"))


def _gate(**_: object) -> None:
    if not GATE.is_dir():
        return
    (GATE / f"exiting-{os.getpid()}").write_text("")
    deadline = time.monotonic() + 30
    while not (GATE / "open").exists() and time.monotonic() < deadline:
        time.sleep(0.005)


signals.worker_process_shutdown.connect(_gate, weak=False)

from harness.chaos.app import app, work  # noqa: E402,F401

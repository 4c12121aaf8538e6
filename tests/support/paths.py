"""Where things are: the repository root and the session's scratch directory."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

#: The repository root (holds ``celery_singleton_beat``, ``tests``, ``harness``).
ROOT = Path(__file__).resolve().parents[2]

_scratch: Path | None = None


def set_scratch_dir(path: Path) -> None:
    """Use ``path`` for logs and server directories (the session fixture sets it)."""
    global _scratch
    _scratch = Path(path)


def scratch_dir() -> Path:
    """The session's directory for logs and server directories.

    Under pytest it is in pytest's ``tmp_path_factory`` base directory, removed
    at the end of a session where every test passed (``tmp_path_retention_policy
    = "failed"``), kept for a failed one. Outside pytest: a temporary directory
    removed when the interpreter exits.
    """
    global _scratch
    if _scratch is None:
        _scratch = Path(tempfile.mkdtemp(prefix="csb-tests-"))
        atexit.register(shutil.rmtree, _scratch, ignore_errors=True)
    return _scratch


def scratch(prefix: str) -> Path:
    """A new, empty directory in the scratch directory."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=scratch_dir()))


def scratch_file(prefix: str, suffix: str = ".log") -> Path:
    """A new, empty file in the scratch directory."""
    handle, name = tempfile.mkstemp(prefix=f"{prefix}-", suffix=suffix, dir=scratch_dir())
    os.close(handle)
    return Path(name)

"""Skips that are allowed locally and failures in CI.

A test skips when something it needs is missing: a binary (``openssl``,
``redis-cli``) or a package. On a developer's machine that is a skip with the
command that installs it; where the ``CI`` environment variable is set, it is
a failure, because CI installs everything (``.ci/run``) and a silent skip
there would hide a test that never ran. ``conftest.py`` also turns any other
skip into a failure in CI, except for the tests listed in
:data:`ALLOWED_SKIPS`, each with the reason it may skip.
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType
from typing import NoReturn

import pytest

#: Debian packages that provide the binaries (``redis-server`` pulls ``redis-tools``).
PACKAGES = {"redis-cli": "redis-tools", "openssl": "openssl", "redis-server": "redis-server",
            "rabbitmq-server": "rabbitmq-server", "faketime": "faketime"}

#: Tests that may skip in CI too (node id -> why). Keep this list short.
ALLOWED_SKIPS = {
    "tests/test_compose.py::test_docker_compose_accepts_the_file":
        "needs Docker with its compose plugin, which CI machines do not have; the "
        "other tests of test_compose.py check the same file without Docker",
}


def in_ci() -> bool:
    """True where the ``CI`` environment variable is set (CI=true on CI services)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def skip_or_fail(reason: str) -> NoReturn:
    """Skip the test with ``reason``; fail it instead when running in CI."""
    if in_ci():
        pytest.fail(f"{reason} (CI is set: a missing dependency is a failure, not a skip)", pytrace=False)
    pytest.skip(reason)


def require(binary: str) -> str:
    """Path of ``binary``; skip (locally) or fail (CI) naming the package to install."""
    path = shutil.which(binary)
    if path is None:
        skip_or_fail(f"{binary} not found: apt-get install -y {PACKAGES.get(binary, binary)}")
    return path


def importorskip(module: str, install: str | None = None) -> ModuleType:
    """Import ``module``; skip (locally) or fail (CI) if it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        skip_or_fail(f"{module} is not installed ({exc}): "
                     f"{install or '.venv/bin/pip install -e .[test,flower]'}")

"""Makes the packages named in ``$CSB_BLOCKED_MODULES`` (comma-separated) unimportable.

Put this directory first on ``PYTHONPATH`` and every Python process started
with that environment (and its children, which inherit it) behaves as if those
packages were not installed: importing one raises ``ModuleNotFoundError``, which
optional imports (``try: import yaml``) take as "not installed". The demo test
runs ``python -m example_project.demo`` this way, with the packages of the
``test`` extra blocked, to show that ``make demo`` does not need that extra.
"""

from __future__ import annotations

import os
import sys
from typing import Any

BLOCKED = frozenset(filter(None, os.environ.get("CSB_BLOCKED_MODULES", "").split(",")))


class _Blocked:
    """A meta path finder that refuses the blocked top-level packages."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: not in the demo's install)", name=name)
        return None


if BLOCKED:
    sys.meta_path.insert(0, _Blocked())

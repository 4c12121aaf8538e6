"""Optional extras (``contrib``): the package works without them, and says which to install."""

from __future__ import annotations

import subprocess
import sys

__all__ = ["assert_needs_extra"]


def assert_needs_extra(contrib: str, blocked: tuple[str, ...], extra: str) -> None:
    """In a fresh interpreter where the top-level packages ``blocked`` cannot be imported:
    the package, its beat side and its CLI import and load none of them, and importing
    ``celery_singleton_beat.contrib.<contrib>`` fails naming ``pip install
    'celery-singleton-beat[<extra>]'``."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        f"        if name.split('.')[0] in {blocked!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import celery_singleton_beat, celery_singleton_beat.beat, celery_singleton_beat.cli\n"
        "import celery_singleton_beat.contrib\n"
        "try:\n"
        f"    import celery_singleton_beat.contrib.{contrib}\n"
        "except ImportError as exc:\n"
        "    print('HINT', exc)\n"
        f"print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in {blocked!r}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "LOADED []" in done.stdout, done.stdout
    assert f"pip install 'celery-singleton-beat[{extra}]'" in done.stdout, done.stdout

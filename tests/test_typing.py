"""User code that uses the package passes ``mypy --strict`` (the package ships ``py.typed``).

mypy runs in a subprocess on a small user module written the way docs/tasks.md ("In the body")
shows a task body: ``self.singleton_run.ensure_held()`` and the fencing token. The
package is found on ``mypy_path`` and checked silently, as mypy treats an installed
package; Celery ships no types, so the user's configuration ignores its missing
imports and its untyped decorator, as any ``--strict`` Celery project must.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .support import ROOT, importorskip, run_command

#: What a user on ``--strict`` with an untyped Celery writes in their mypy configuration.
USER_CONFIG = """\
[mypy]
strict = True
disallow_untyped_decorators = False

[mypy-celery.*,kombu.*,billiard.*,vine.*]
ignore_missing_imports = True

# Found on mypy_path here (the test venv's editable install is an import hook mypy
# cannot follow); an installed wheel is checked the same way: silently.
[mypy-celery_singleton_beat.*]
follow_imports = silent
"""

#: docs/tasks.md, "In the body": a long body that checks its lease and fences its writes.
README_BODY = """\
from celery import Celery

from celery_singleton_beat import SingletonTask

app = Celery("proj")


class Store:
    def write(self, chunk: str, *, fence: int) -> None: ...


store = Store()


def chunks(day: str) -> list[str]:
    return day.split(",")


@app.task(base=SingletonTask, bind=True, lock_ttl=30)
def rebuild_report(self: SingletonTask, day: str) -> None:
    for chunk in chunks(day):  # may run far longer than 30 s: the lease is renewed
        fence = self.singleton_run.ensure_held()  # raises LockLost if the lease ended
        store.write(chunk, fence=fence)  # fencing token for downstream writes
        if self.singleton_run.lost or self.singleton_run.fence != fence:
            raise RuntimeError("cannot happen while the lease is held")
"""


#: What the test asks mypy about the README body's types (notes, not errors).
REVEAL = """
def types(task: SingletonTask) -> None:
    reveal_type(task.singleton_run)
    reveal_type(task.singleton_run.ensure_held())
    reveal_type(task.singleton)
"""


def test_the_readme_body_pattern_passes_mypy_strict(tmp_path: Path) -> None:
    """One mypy run over two user modules: the README pattern (clean, with the types
    the body needs), and the same body through the optional ``self.singleton``."""
    importorskip("mypy", ".venv/bin/pip install -e '.[lint]'  (mypy is in the lint extra)")
    (tmp_path / "mypy.ini").write_text(USER_CONFIG)
    (tmp_path / "user_tasks.py").write_text(README_BODY + REVEAL)
    (tmp_path / "optional_run.py").write_text(README_BODY.replace("self.singleton_run.", "self.singleton."))
    done = run_command([sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--no-incremental",
                        "user_tasks.py", "optional_run.py"], cwd=tmp_path, timeout=300, capture_output=True,
                       text=True, env={"MYPYPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    lines = (done.stdout + done.stderr).splitlines()
    assert not [line for line in lines if line.startswith("user_tasks.py") and ": error:" in line], lines
    revealed = [line.split("Revealed type is ")[1] for line in lines if "Revealed type is" in line]
    # Not Any: a SingletonTask's unknown attributes are Any to mypy (Celery's Task is untyped).
    assert revealed == ['"celery_singleton_beat.task.run.SingletonRun"', '"int"',
                        '"celery_singleton_beat.task.run.SingletonRun | None"'], lines
    # self.singleton stays SingletonRun | None (None outside a run): unchecked use fails,
    # which is why the body has singleton_run.
    assert any(line.startswith("optional_run.py") and '"None" of "SingletonRun | None" has no attribute '
               '"ensure_held"' in line for line in lines), lines

"""``make test-matrix-smoke`` runs two nox processes at once, and each links the
interpreters it found into ``.nox/_pythons`` when it loads ``noxfile.py``. The
link must be replaced atomically, or one process meets the other's link between
its unlink and its symlink and fails to load (FileExistsError)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def relink_source() -> str:
    """The source of ``noxfile.relink``, read without importing nox or running
    the noxfile's discovery (which writes into the checkout)."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "relink":
            return ast.get_source_segment((ROOT / "noxfile.py").read_text(), node) or ""
    raise AssertionError("noxfile.py has no relink()")


def test_two_processes_relinking_the_same_interpreter_both_succeed(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        from __future__ import annotations
        import os, sys
        from pathlib import Path
        {source}
        link = Path(sys.argv[1]) / "python3.99"
        targets = [sys.argv[2], sys.argv[3]]
        for i in range(400):
            relink(link, targets[i % 2])
            assert os.readlink(link) in targets
    """).format(source=textwrap.indent(relink_source(), "        ").lstrip())
    runner = tmp_path / "runner.py"
    runner.write_text(script)
    racers = [subprocess.Popen([sys.executable, str(runner), str(tmp_path), sys.executable, "/bin/sh"],
                               stderr=subprocess.PIPE, text=True) for _ in range(4)]
    failures = [proc.communicate(timeout=120)[1] for proc in racers if proc.wait(timeout=120) != 0]
    assert failures == []
    assert (tmp_path / "python3.99").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["python3.99", "runner.py"]

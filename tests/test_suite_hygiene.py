"""The suite's own rules, where breaking one fails some other test later, far away.

A task defined inside a test with ``@app.task`` is *shared* by default: Celery adds it
to every app finalized afterwards in the same process. Two tests defining a task of the
same name (``<module>.body``) then make a later app's finalize warn
``DuplicateTaskNameWarning``, an error under the suite's warning filters: the ``doctor``
check of an unrelated test failed that way, only when xdist ran both modules on one
worker in that order. Tasks defined in a function say ``shared=False``.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def _is_task_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return isinstance(target, ast.Attribute) and target.attr in ("task", "shared_task")


def _shared(node: ast.expr) -> bool:
    if not isinstance(node, ast.Call):
        return True
    return not any(keyword.arg == "shared" and isinstance(keyword.value, ast.Constant)
                   and keyword.value.value is False for keyword in node.keywords)


def _nested_shared_tasks(tree: ast.Module) -> list[int]:
    found = []
    for outer in ast.walk(tree):
        if not isinstance(outer, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for inner in ast.walk(outer):
            if inner is outer or not isinstance(inner, ast.FunctionDef):
                continue
            found += [inner.lineno for decorator in inner.decorator_list
                      if _is_task_decorator(decorator) and _shared(decorator)]
    return found


def test_tasks_defined_in_functions_are_not_shared() -> None:
    offenders = [f"{path.relative_to(TESTS.parent)}:{line}"
                 for path in sorted(TESTS.rglob("*.py"))
                 for line in _nested_shared_tasks(ast.parse(path.read_text(), str(path)))]
    assert offenders == [], "tasks defined in a function need shared=False: " + ", ".join(sorted(set(offenders)))


def test_the_check_finds_a_shared_task_in_a_function() -> None:
    source = "def test_x(app):\n    @app.task(bind=True)\n    def body(self):\n        pass\n"
    assert _nested_shared_tasks(ast.parse(source)) == [3]
    assert _nested_shared_tasks(ast.parse(source.replace("bind=True", "bind=True, shared=False"))) == []

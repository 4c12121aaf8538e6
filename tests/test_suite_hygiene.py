"""The suite's own rules, where breaking one fails some other test later, far away.

A task defined inside a test with ``@app.task`` is *shared* by default: Celery adds it
to every app finalized afterwards in the same process. Two tests defining a task of the
same name (``<module>.body``) then make a later app's finalize warn
``DuplicateTaskNameWarning``, an error under the suite's warning filters: the ``doctor``
check of an unrelated test failed that way, only when xdist ran both modules on one
worker in that order. Tasks defined in a function say ``shared=False``.

A strict ``xfail`` test marks the step that shows its documented break with
``documented_break()`` (``support.breaks``): any other exception fails it, so a set-up
that timed out is never counted as the known break. A test that marks no step could
never xfail; that shows only when it runs (some need Cluster, Sentinel, RabbitMQ), so
it is checked here.

A test that closes connections at a server kills its own, by id or by name, never every
client of a type (``client_kill_filter(_type="normal")``): on the session's server that
also closed the idle broker connection kept in a shared app's pool (``tests.apps.tasks_app``
lives for the whole xdist worker), and a later test's first ``control.inspect()`` there
failed with "Connection closed by server", only when xdist ran both modules on one worker
in that order.
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


def _xfails_without_their_break(tree: ast.Module, source: str) -> list[int]:
    """Test functions with an ``xfail`` mark (direct, ``breaks(...)``, or a parametrize case's)
    and no ``with documented_break()`` step: they could never xfail (see ``support.breaks``)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or not node.name.startswith("test_"):
            continue
        marks = " ".join(ast.get_source_segment(source, decorator) or "" for decorator in node.decorator_list)
        if "xfail(" not in marks and "breaks(" not in marks:
            continue
        steps = [item.context_expr for inner in ast.walk(node) if isinstance(inner, ast.With | ast.AsyncWith)
                 for item in inner.items]
        if not any(isinstance(step, ast.Call) and isinstance(step.func, ast.Name) and step.func.id == "documented_break"
                   for step in steps):
            found.append(node.lineno)
    return found


def test_each_xfail_test_marks_the_step_that_shows_its_break() -> None:
    offenders = []
    for path in sorted(TESTS.rglob("test_*.py")):
        source = path.read_text()
        offenders += [f"{path.relative_to(TESTS.parent)}:{line}"
                      for line in _xfails_without_their_break(ast.parse(source, str(path)), source)]
    assert offenders == [], ("xfail tests need a `with documented_break():` step (tests/support/breaks.py): "
                             + ", ".join(offenders))


def test_the_check_finds_an_xfail_without_its_break() -> None:
    source = ("@pytest.mark.xfail(strict=True, raises=AssertionError)\n"
              "def test_x():\n    wait_for(started)\n    assert ran == 1\n")
    assert _xfails_without_their_break(ast.parse(source), source) == [2]
    fixed = source.replace("    assert ran == 1\n", "    with documented_break():\n        assert ran == 1\n")
    assert _xfails_without_their_break(ast.parse(fixed), fixed) == []
    param = ('@pytest.mark.parametrize("n", [1, pytest.param(2, marks=breaks("why"))])\n'
             "def test_y(n):\n    assert n == 1\n")
    assert _xfails_without_their_break(ast.parse(param), param) == [2]


def _kills_by_type(tree: ast.Module) -> list[int]:
    """Calls ``client_kill_filter(_type=...)`` of client types other tests' connections have:
    every normal or pub/sub client of the server, not only the test's own."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "client_kill_filter"
            and any(keyword.arg == "_type" and not (isinstance(keyword.value, ast.Constant)
                                                    and keyword.value.value in ("replica", "slave", "master"))
                    for keyword in node.keywords)]


def test_tests_kill_their_own_connections_not_every_client() -> None:
    offenders = [f"{path.relative_to(TESTS.parent)}:{line}"
                 for path in sorted(TESTS.rglob("*.py"))
                 for line in _kills_by_type(ast.parse(path.read_text(), str(path)))]
    assert offenders == [], ("kill the test's own connections by id or name (support.kill_named), not every "
                             "client of a type: " + ", ".join(offenders))


def test_the_check_finds_a_kill_of_every_normal_client() -> None:
    source = 'admin.client_kill_filter(_type="normal", skipme=True)\n'
    assert _kills_by_type(ast.parse(source)) == [1]
    assert _kills_by_type(ast.parse('admin.client_kill_filter(_id=7)\n')) == []
    assert _kills_by_type(ast.parse('primary.client_kill_filter(_type="replica")\n')) == []

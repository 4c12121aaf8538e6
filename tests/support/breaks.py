"""Strict ``xfail`` tests that can fail only for their documented break.

A strict ``xfail`` documents a known break: its expected failure is the check that shows
the break ("the slot ran 2 times"). Its set-up fails with the same exception types: a
:func:`~tests.support.waiting.wait_for` that times out, a process whose line never comes
and a server that does not start all raise ``AssertionError``. Without a guard a broken
set-up would count as the known break, and a regression would hide behind it.

The test marks the step that shows the break with :func:`documented_break`, and the
suite's ``pytest_runtest_makereport`` hook (``tests/conftest.py``) fails every other
exception an ``xfail`` test raises (in a fixture, in the set-up, in the teardown, after
the break) even if its type is in ``raises=``: the test is reported as failed with
:data:`NOT_THE_BREAK`, not counted as the expected failure. Guarding is the default: an
``xfail`` test that marks no step cannot xfail at all
(``tests/test_suite_hygiene.py`` checks that each marks one).

Where the documented break is itself "X never happens within the deadline", the wait for
X is the step marked.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_TAG = "_csb_documented_break"

#: The head of the report of an ``xfail`` test that failed outside its documented break.
NOT_THE_BREAK = ("set-up failed, not the documented break: this xfail test raised outside its "
                 "documented_break() step (set-up, fixture, teardown), which fails it outright")


@contextmanager
def documented_break() -> Iterator[None]:
    """The step of a strict ``xfail`` test that shows its documented break: only an
    exception raised in it can be the expected failure."""
    try:
        yield
    except Exception as exc:
        setattr(exc, _TAG, True)
        raise


def shows_the_break(exc: BaseException) -> bool:
    """``exc`` was raised in a :func:`documented_break` step."""
    return getattr(exc, _TAG, False) is True

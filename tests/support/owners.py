"""Who stops what: every process and server the tests start has an owner.

A process registers itself with the current owner when it starts, before
anything can fail (a worker that never gets ready is still stopped):

* each test is an owner (the ``processes`` fixture): what the test started
  is stopped when it ends, whatever happened;
* a module- or session-scoped fixture that starts processes opens its own
  owner with :func:`owning` and closes it at its teardown;
* the session is the owner of last resort: it closes whatever is left.

Owners close their items newest first. An item has ``close()`` (stop and
clean up), ``running`` and, for failure reports, ``name``, ``log`` and
``tail()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class Owner(list):  # type: ignore[type-arg]
    """The processes and servers started while this owner was current, oldest first.

    A list, so tests can keep writing ``processes.append(start_worker(...))``:
    adding an item twice keeps one entry.
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def append(self, item: Any) -> None:
        if not any(existing is item for existing in self):
            super().append(item)

    def extend(self, items: Any) -> None:
        for item in items:
            self.append(item)

    def close(self) -> None:
        """Close every item, newest first; raise the first error after trying them all."""
        errors: list[BaseException] = []
        for item in reversed(list(self)):
            try:
                item.close()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


#: Every item registered in this interpreter (the session sweeps it at its end).
EVERYTHING = Owner("everything")
_stack: list[Owner] = [Owner("session")]


def current_owner() -> Owner:
    return _stack[-1]


def register(item: Any) -> Any:
    """Give ``item`` to the current owner (and to the session-wide sweep); return it."""
    current_owner().append(item)
    EVERYTHING.append(item)
    return item


@contextlib.contextmanager
def owning(owner: Owner) -> Iterator[Owner]:
    """Make ``owner`` current for the block: what starts inside is registered with it."""
    _stack.append(owner)
    try:
        yield owner
    finally:
        _stack.remove(owner)

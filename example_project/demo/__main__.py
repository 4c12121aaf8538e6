"""``python -m example_project.demo``: see :mod:`example_project.demo.run`."""

from __future__ import annotations

import sys

from .run import main

if __name__ == "__main__":
    sys.exit(main())

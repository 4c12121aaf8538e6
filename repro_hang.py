"""Reproduction (not a test): a prefork worker that does not exit after SIGTERM while the
lock Redis behind the harness proxy is cut / paused / restarted empty.

Usage: PYTHONPATH=$PWD python repro_hang.py ITERATIONS OUTDIR
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis

from harness.proxy import DelayProxy
from harness.redis_server import RedisServerProcess, find_redis_server

PY = sys.executable
PYSPY = "/work/main/.venv/bin/py-spy"
JOBS = [float(x) for x in os.environ.get("JOBS", "0.05,0.2,0.5,1.0").split(",")]
GATED = bool(os.environ.get("GATED"))
GATED_SPLIT = float(os.environ.get("GATED_SPLIT", "0.5"))
DELAY_MAX = float(os.environ.get("DELAY_MAX", "1.5"))
SCENARIOS = os.environ.get("SCENARIOS", "cut,cut,pause,pause+cut,pause+cut+empty,cut+empty").split(",")


def server(name: str, workdir: Path, port: int | None = None) -> RedisServerProcess:
    found = find_redis_server()
    assert found
    return RedisServerProcess(name, found[0], lambda p: ["--port", str(p), "--save", "", "--appendonly", "no"],
                              workdir=workdir, port=port).start()


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def main() -> None:
    iterations = int(sys.argv[1])
    outdir = Path(sys.argv[2])
    outdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(int(os.environ.get("SEED", "1")))
    broker = server("broker", outdir / "broker")
    lock = server("lock", outdir / "lock")
    proxy = DelayProxy(lock.port, 0.0, log=outdir / "proxy.log").start()
    env = dict(os.environ, CHAOS_BROKER=f"redis://127.0.0.1:{broker.port}/0",
               CHAOS_BACKEND=f"redis://127.0.0.1:{broker.port}/1",
               CHAOS_LOCK=f"redis://127.0.0.1:{proxy.port}/2")
    sys.path.insert(0, os.getcwd())
    os.environ.update(env)
    from harness.chaos.app import app, work  # noqa: F401
    hangs = 0
    for it in range(iterations):
        log = outdir / f"w-{it}.log"
        gate = outdir / f"gate-{it}"
        if GATED:
            gate.mkdir()
            env["REPRO_GATE"] = str(gate)
        worker = subprocess.Popen([PY, "-m", "celery", "-A", os.environ.get("APP", "harness.chaos.app"), "worker", "-P", "prefork", "-c", "2",
                                   "-n", f"r{it}@%h", "-l", "info", "-E", "--without-gossip", "--without-mingle",
                                   "--without-heartbeat"], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while "ready." not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        # a stream of short runs on a few keys
        stop = threading.Event()

        def submit() -> None:
            while not stop.is_set():
                try:
                    work.apply_async(args=[f"k{rng.randrange(4)}", rng.choice(JOBS)])
                except Exception:
                    pass
                time.sleep(0.03)

        t = threading.Thread(target=submit, daemon=True)
        t.start()
        time.sleep(rng.uniform(1.0, 3.0))
        scenario = rng.choice(SCENARIOS)
        delay = rng.uniform(0.0, DELAY_MAX)
        worker.send_signal(signal.SIGTERM)
        term_at = time.monotonic()
        if GATED:  # wait for the children to reach their exit, then cut, then open
            while len(list(gate.glob("exiting-*"))) < 2 and time.monotonic() - term_at < 15:
                time.sleep(0.005)
            stop.set()
            if delay < GATED_SPLIT:
                proxy.cut()
            (gate / "open").write_text("")
            time.sleep(delay * 0.05)
            delay = 0.0
        time.sleep(delay)
        if "pause" in scenario:
            try:
                redis.Redis(port=lock.port, socket_timeout=2).execute_command("CLIENT", "PAUSE", "2000", "WRITE")
            except Exception as exc:
                print("pause failed", exc)
            time.sleep(rng.uniform(0.0, 1.0))
        if "cut" in scenario:
            proxy.cut()
            if "empty" in scenario:
                lock.kill()
                time.sleep(rng.uniform(0.2, 1.5))
                lock = server("lock", outdir / "lock", port=lock.port)
            time.sleep(rng.uniform(0.5, 3.0))
            proxy.mend()
        stop.set()
        hung = False
        while worker.poll() is None:
            if time.monotonic() - term_at > 20:
                hung = True
                break
            time.sleep(0.1)
        print(f"iteration {it}: {scenario} delay {delay:.2f}: "
              f"{'HUNG' if hung else f'exited {worker.returncode} in {time.monotonic() - term_at:.1f}s'}",
              flush=True)
        if hung:
            hangs += 1
            for pid in [worker.pid, *children(worker.pid)]:
                dump = subprocess.run([PYSPY, "dump", "--locals", "--pid", str(pid)], capture_output=True, text=True)
                (outdir / f"spy-{it}-{pid}.txt").write_text(dump.stdout + dump.stderr)
            for pid in children(worker.pid):
                os.kill(pid, signal.SIGKILL)
            worker.kill()
            worker.wait()
        # drain the queue between iterations
        redis.Redis(port=broker.port).flushall()
    print("hangs:", hangs)
    proxy.close()
    lock.kill()
    broker.kill()


if __name__ == "__main__":
    main()

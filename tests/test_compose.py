"""compose.yaml and the example's Dockerfile, checked without Docker.

Docker is not on every machine, so the file is parsed and what it refers to
is checked against the repository: services and replicas, commands that name
real modules and options, environment variables the app really reads,
health checks that exist and work, and a Dockerfile whose COPY sources and
extras exist. Where ``docker compose`` is installed, it validates the file too.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any

import pytest
import yaml

from .support import ROOT, RedisServer, free_port, run_command

COMPOSE = ROOT / "compose.yaml"
APP_MODULE = "example_project.shop.celery_app"
#: Variables of compose.yaml -> the app setting each one must end up in.
URL_VARIABLES = {"CELERY_BROKER_URL": "broker_url", "SINGLETON_REDIS_URL": "singleton_redis_url",
                 "REDIS_URL": None}
#: The checks of example_project/shop/health.py (not imported here: importing
#: the shop app would make it Celery's current app in the test process).
CHECKS = ("worker", "beat", "flower")
DEFAULT = re.compile(r"^\$\{(?P<name>[A-Z_]+):-(?P<default>[^}]+)\}$")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def role(service: dict[str, Any]) -> str | None:
    """``beat``, ``worker`` or ``flower`` for ``celery -A <app> <role> ...`` commands."""
    command = service.get("command") or []
    if command[:2] == ["celery", "-A"] and len(command) > 3:
        return str(command[3])
    return None


def replicas(service: dict[str, Any]) -> int:
    return int((service.get("deploy") or {}).get("replicas", 1))


def of_role(services: dict[str, dict[str, Any]], name: str) -> dict[str, dict[str, Any]]:
    return {key: service for key, service in services.items() if role(service) == name}


def shop_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {key: service for key, service in services.items() if role(service) is not None}


def test_services_two_beats_two_workers_flower_and_redis(services: dict[str, dict[str, Any]]) -> None:
    assert "redis" in services and "flower" in services
    assert sum(map(replicas, of_role(services, "beat").values())) >= 2
    assert sum(map(replicas, of_role(services, "worker").values())) >= 2
    assert of_role(services, "flower") == {"flower": services["flower"]}
    assert set(services) == {"redis", *shop_services(services)}


def test_shop_services_are_built_from_the_example_dockerfile(services: dict[str, dict[str, Any]]) -> None:
    images = set()
    for name, service in shop_services(services).items():
        build = service["build"]
        assert (COMPOSE.parent / build["context"]).resolve() == ROOT, name
        assert (ROOT / build["dockerfile"]).is_file(), name
        assert build["dockerfile"] == "example_project/Dockerfile"
        images.add(service.get("image"))
    assert len(images) == 1  # built once, used by every role


def test_commands_run_the_example_app(services: dict[str, dict[str, Any]]) -> None:
    assert importlib.util.find_spec(APP_MODULE) is not None
    for name, service in shop_services(services).items():
        assert service["command"][:3] == ["celery", "-A", APP_MODULE], name
    for name, service in of_role(services, "beat").items():
        command = service["command"]
        assert command[command.index("-S") + 1] == "singleton", name
        assert command[command.index("-s") + 1].startswith("/tmp/"), "schedule file must be writable"
    for name, service in of_role(services, "worker").items():
        node = service["command"][service["command"].index("-n") + 1]
        assert "%h" in node, f"{name}: replicas need distinct node names"
    flower = services["flower"]
    assert "--port=5555" in flower["command"]
    assert "5555:5555" in flower["ports"]


def test_the_singleton_alias_is_registered() -> None:
    """``beat -S singleton`` resolves through the installed package's entry point."""
    schedulers = importlib.metadata.entry_points(group="celery.beat_schedulers")
    (alias,) = [entry for entry in schedulers if entry.name == "singleton"]
    module, _, attribute = alias.value.partition(":")
    assert importlib.util.find_spec(module) is not None and attribute == "SingletonScheduler"


def test_urls_come_from_environment_variables_with_defaults(services: dict[str, dict[str, Any]]) -> None:
    for name, service in shop_services(services).items():
        environment = service["environment"]
        for variable in URL_VARIABLES:
            match = DEFAULT.match(environment[variable])
            assert match and match["name"] == variable, (name, variable)
            host = re.match(r"redis://([^:/]+)", match["default"])
            assert host and host[1] in services, f"{variable} default must name a service"


def test_the_app_reads_the_variables_compose_sets(services: dict[str, dict[str, Any]]) -> None:
    """Import the app with compose's defaults: every URL lands in its setting."""
    defaults = {name: DEFAULT.match(value)["default"]  # type: ignore[index]
                for name, value in services["worker"]["environment"].items()}
    env = {k: v for k, v in os.environ.items() if k not in defaults}
    env.update(defaults, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    script = ("import json; from example_project.shop.celery_app import app; "
              "print(json.dumps({k: app.conf[k] for k in "
              "('broker_url', 'singleton_redis_url', 'task_default_queue')}))")
    result = run_command([sys.executable, "-c", script], env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    conf = json.loads(result.stdout)
    for variable, setting in URL_VARIABLES.items():
        if setting is not None:
            assert conf[setting] == defaults[variable]
    assert conf["task_default_queue"] == defaults["SHOP_NAMESPACE"]


def test_every_service_has_a_healthcheck_that_exists(services: dict[str, dict[str, Any]]) -> None:
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    for name, service in shop_services(services).items():
        test = service["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "example_project.shop.health"], name
        assert importlib.util.find_spec(test[3]) is not None
        assert test[4] == role(service) and test[4] in CHECKS, name
        assert service["depends_on"]["redis"]["condition"] == "service_healthy", name


def run_health(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("REDIS_URL", "CELERY_BROKER_URL", "SINGLETON_REDIS_URL")}
    full_env.update(env, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")])))
    return run_command([sys.executable, "-m", "example_project.shop.health", *args],
                       env=full_env, capture_output=True, text=True, timeout=60)


def test_beat_health_check_follows_redis(redis_server: RedisServer) -> None:
    healthy = run_health("beat", REDIS_URL=redis_server.url(4))
    assert healthy.returncode == 0, healthy.stderr
    down = run_health("beat", REDIS_URL=f"redis://127.0.0.1:{free_port()}/0")
    assert down.returncode == 1 and down.stderr.startswith("unhealthy:")
    usage = run_health("nonsense")
    assert usage.returncode == 2 and f"{{{'|'.join(CHECKS)}}}" in usage.stderr


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the example's Dockerfile, continuation lines joined."""
    text = (ROOT / "example_project" / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in joined.splitlines() if line.strip()]


def test_dockerfile_copies_what_exists_and_installs_real_extras() -> None:
    instructions = dockerfile_instructions()
    kinds = [kind for kind, _ in instructions]
    assert kinds[0] == "FROM" and instructions[0][1].startswith("python:3")
    workdir = dict(instructions)["WORKDIR"]
    assert f"PYTHONPATH={workdir}" in dict(instructions)["ENV"].split()
    for kind, args in instructions:
        if kind == "COPY":
            *sources, _ = args.split()
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    extras = importlib.metadata.metadata("celery-singleton-beat").get_all("Provides-Extra") or []
    installs = [args for kind, args in instructions if kind == "RUN" and "pip install" in args]
    assert installs
    for wanted in re.findall(r"\.\[([^\]]+)\]", " ".join(installs)):
        assert set(wanted.split(",")) <= set(extras)
    user = [args for kind, args in instructions if kind == "USER"]
    assert user and user[-1] != "root"
    command = json.loads(dict(instructions)["CMD"])
    assert command[:3] == ["celery", "-A", APP_MODULE]
    ignored = (ROOT / "example_project" / "Dockerfile.dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignored)


def test_docker_compose_accepts_the_file() -> None:
    """Where Docker's compose plugin exists, it validates the file. It may skip, in CI too:
    listed in tests/support/skips.py ALLOWED_SKIPS (CI machines have no Docker)."""
    if shutil.which("docker") is None:
        pytest.skip("optional, allowed in CI: docker is not installed")
    version = run_command(["docker", "compose", "version"], capture_output=True, text=True, timeout=60)
    if version.returncode != 0:
        pytest.skip("optional, allowed in CI: the docker compose plugin is not installed")
    result = run_command(["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
                         capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr

"""The container set-up: docker-compose.yml keeps architecture.md's promises.

These read the file as data (PyYAML), so they run without Docker. The last
tests ask ``docker-compose config`` itself when it is installed. The
Dockerfile's own checks are in test_dockerfile.py.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"

FERRY_SERVICES = {
    "migrate",
    "api",
    "gpu-worker",
    "sim-worker",
    "celery-worker",
    "celery-beat",
    "flower",
}
# Everything that reads or writes jobs must wait for the schema.
NEEDS_SCHEMA = FERRY_SERVICES - {"migrate", "flower"}

_VARIABLE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>[^}]*))?\}")


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${NAME}`` / ``${NAME:-default}`` substitution (enough for this file)."""

    def substitute(match: re.Match[str]) -> str:
        found = env.get(match["name"])
        if found:
            return found
        return match["default"] or ""

    return _VARIABLE.sub(substitute, value).replace("$$", "$")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    result = compose["services"]
    assert isinstance(result, dict)
    return result


def argv(value: str | list[str]) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else [str(part) for part in value]


def option_values(args: list[str]) -> dict[str, str]:
    """``--name value`` and ``--name=value`` pairs of a command line."""
    values: dict[str, str] = {}
    for index, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        if "=" in arg:
            name, value = arg.split("=", 1)
            values[name] = value
        elif index + 1 < len(args) and not args[index + 1].startswith("--"):
            values[arg] = args[index + 1]
    return values


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    """Dependency name -> condition (the short list form means service_started)."""
    raw = service.get("depends_on", {})
    if isinstance(raw, list):
        return dict.fromkeys(raw, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in raw.items()}


def test_redis_is_durable_and_never_evicts(services: dict[str, dict[str, Any]]) -> None:
    redis = services["redis"]
    assert str(redis["image"]).startswith("redis:7")
    args = argv(redis["command"])
    assert args[0] == "redis-server"
    options = option_values(args)
    assert options.get("--appendonly") == "yes"
    assert options.get("--appendfsync") == "everysec"
    assert options.get("--maxmemory-policy") == "noeviction"
    # The append-only file lives in /data, which must outlive the container.
    assert any(str(volume).split(":")[1] == "/data" for volume in redis["volumes"])
    assert argv(redis["healthcheck"]["test"])[-2:] == ["redis-cli", "ping"]


def test_postgres_credentials_match_the_ferry_database_url(
    services: dict[str, dict[str, Any]],
) -> None:
    postgres = services["postgres"]
    assert str(postgres["image"]).startswith("postgres:16")
    assert "pg_isready" in " ".join(argv(postgres["healthcheck"]["test"]))
    assert any(
        str(volume).split(":")[1] == "/var/lib/postgresql/data" for volume in postgres["volumes"]
    )
    url_template = services["api"]["environment"]["FERRY_DATABASE_URL"]
    for env in ({}, {"POSTGRES_PASSWORD": "s3cret", "POSTGRES_USER": "u", "POSTGRES_DB": "d"}):
        server = {key: interpolate(str(v), env) for key, v in postgres["environment"].items()}
        assert server["POSTGRES_PASSWORD"], "the password needs a default"
        url = urlsplit(interpolate(url_template, env))
        assert url.scheme == "postgresql+psycopg"
        assert (url.hostname, url.port) == ("postgres", 5432)
        assert url.username == server["POSTGRES_USER"]
        assert url.password == server["POSTGRES_PASSWORD"]
        assert url.path.lstrip("/") == server["POSTGRES_DB"]


def test_ferry_services_share_the_image_build_and_environment(
    services: dict[str, dict[str, Any]],
) -> None:
    built_here = {name for name, service in services.items() if "build" in service}
    assert built_here == FERRY_SERVICES
    reference = services["api"]
    for name in FERRY_SERVICES:
        service = services[name]
        if name == "flower":
            # Flower's own settings come on top; the Flower password reaches no other service.
            shared = {
                k: v for k, v in service["environment"].items() if k in reference["environment"]
            }
            assert shared == reference["environment"]
            assert not any("FLOWER" in key for key in reference["environment"])
        else:
            assert service["environment"] == reference["environment"], name
        assert service["build"]["context"] == reference["build"]["context"] == "."
        assert service["build"].get("dockerfile", "Dockerfile") == "Dockerfile"
        if name != "gpu-worker":
            assert service["image"] == reference["image"], name
            assert service["build"] == reference["build"], name
    env = reference["environment"]
    redis_url = urlsplit(env["FERRY_REDIS_URL"])
    assert (redis_url.scheme, redis_url.hostname, redis_url.port) == ("redis", "redis", 6379)
    assert env["FERRY_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert env["FERRY_DATA_DIR"] == "/data"


def test_the_gpu_worker_reserves_an_nvidia_gpu(services: dict[str, dict[str, Any]]) -> None:
    worker = services["gpu-worker"]
    options = option_values(argv(worker["command"]))
    assert options.get("--model") == "minilm"
    assert options.get("--device") == "cuda"
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    nvidia = [device for device in devices if device.get("driver") == "nvidia"]
    assert nvidia, devices
    assert "gpu" in nvidia[0]["capabilities"]
    assert nvidia[0].get("count") == "all" or int(nvidia[0]["count"]) >= 1
    # The worker target with a CUDA build of torch, in an image of its own.
    assert worker["build"]["target"] == "worker"
    assert "/whl/cu" in worker["build"]["args"]["TORCH_INDEX"]
    assert worker["image"] != services["api"]["image"]
    for name in FERRY_SERVICES - {"gpu-worker"}:
        assert "deploy" not in services[name], name


def test_every_other_ferry_service_runs_the_api_image_without_torch(
    services: dict[str, dict[str, Any]],
) -> None:
    targets = set(re.findall(r"^FROM \S+ AS (\S+)", DOCKERFILE.read_text(), re.MULTILINE))
    for name in FERRY_SERVICES:
        target = services[name]["build"]["target"]
        assert target in targets, (name, target)
        if name != "gpu-worker":
            # The sim worker too: its device is simulated, so it needs no torch.
            assert target == "api", name
            assert "args" not in services[name]["build"], "the api target takes no torch"


def test_ferry_services_run_read_only_as_the_images_user(
    services: dict[str, dict[str, Any]],
) -> None:
    for name in FERRY_SERVICES:
        service = services[name]
        # The image's user (uid 10001); no service puts root back.
        assert str(service.get("user", "10001")).split(":")[0] not in {"root", "0"}, name
        assert service["read_only"] is True, name
        # /tmp is the one writable path besides FERRY_DATA_DIR, memory, never executable.
        (tmp,) = [str(mount) for mount in service["tmpfs"] if str(mount).startswith("/tmp:")]
        assert {"rw", "noexec", "nosuid", "nodev"} <= set(tmp.split(":")[1].split(",")), name
        assert service["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in service["security_opt"], name
    assert services["api"]["environment"]["FERRY_DATA_DIR"] == "/data"
    # Beat's schedule is the one file Ferry keeps there: it outlives the container.
    assert "beat-data:/data" in services["celery-beat"]["volumes"]


def test_services_without_a_port_to_ask_turn_the_images_check_off(
    services: dict[str, dict[str, Any]],
) -> None:
    # The api image's HEALTHCHECK asks the API; the one-off migration and beat
    # have nothing to answer it.
    for name in FERRY_SERVICES:
        check = services[name].get("healthcheck")
        if name in {"migrate", "celery-beat"}:
            assert check == {"disable": True}, name
        else:
            assert check and "test" in check, name


def test_the_api_and_workers_wait_for_the_migration(
    services: dict[str, dict[str, Any]],
) -> None:
    migrate = services["migrate"]
    assert argv(migrate["command"]) == ["db", "upgrade"]
    assert str(migrate["restart"]) == "no"
    assert depends_on(migrate).get("postgres") == "service_healthy"
    for name in NEEDS_SCHEMA:
        needs = depends_on(services[name])
        assert needs.get("migrate") == "service_completed_successfully", name
        assert needs.get("redis") == "service_healthy", name


def test_the_api_listens_publicly_and_is_health_checked(
    services: dict[str, dict[str, Any]],
) -> None:
    api = services["api"]
    args = argv(api["command"])
    assert args[0] == "api"
    assert option_values(args).get("--host") == "0.0.0.0"
    assert any(str(port).endswith("8000") for port in api["ports"])
    check = argv(api["healthcheck"]["test"])
    assert check[0] == "CMD"
    assert check[1].startswith("python")  # the slim image has no curl
    assert "/healthz" in " ".join(check)


def test_flower_runs_behind_a_password_that_must_be_set(
    services: dict[str, dict[str, Any]],
) -> None:
    flower = services["flower"]
    # `ferry flower`: the same Celery app (broker, queues) as the workers.
    assert argv(flower["command"]) == ["flower"]
    assert "entrypoint" not in flower
    env = flower["environment"]
    assert env["FERRY_FLOWER_HOST"] == "0.0.0.0"
    assert env["FERRY_FLOWER_PORT"] == "5555"
    assert interpolate(env["FERRY_FLOWER_USER"], {})
    # No default: compose refuses to start without one (${FLOWER_PASSWORD:?...}).
    assert str(env["FERRY_FLOWER_PASSWORD"]).startswith("${FLOWER_PASSWORD:?")
    assert any(str(port).endswith("5555") for port in flower["ports"])
    assert "/healthcheck" in " ".join(argv(flower["healthcheck"]["test"]))


def test_every_worker_serves_metrics_and_readiness(services: dict[str, dict[str, Any]]) -> None:
    assert services["api"]["environment"]["FERRY_METRICS_HOST"] == "0.0.0.0"
    for name in ("gpu-worker", "sim-worker", "celery-worker"):
        service = services[name]
        assert option_values(argv(service["command"])).get("--metrics-port") == "9400", name
        check = " ".join(argv(service["healthcheck"]["test"]))
        assert "127.0.0.1:9400/readyz" in check, name


def test_metrics_need_the_token_prometheus_scrapes_with(
    services: dict[str, dict[str, Any]],
) -> None:
    token = services["api"]["environment"]["FERRY_METRICS_TOKEN"]
    assert str(token).startswith("${METRICS_TOKEN:?"), "required, with no default"
    prometheus = services["prometheus"]
    assert prometheus["environment"]["METRICS_TOKEN"] == token
    (script,) = argv(prometheus["command"])
    written = re.search(r'printf %s "\$\$METRICS_TOKEN" > (\S+)', script)
    assert written, script
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    ferry_jobs = [
        job for job in config["scrape_configs"] if job["job_name"].startswith("ferry-")
        or job["job_name"] == "flower"
    ]  # fmt: skip
    assert len(ferry_jobs) == 4
    for job in ferry_jobs:
        assert job["authorization"]["credentials_file"] == written.group(1), job["job_name"]


def test_prometheus_and_grafana_use_the_repository_configuration(
    services: dict[str, dict[str, Any]],
) -> None:
    prometheus = services["prometheus"]
    assert argv(prometheus["entrypoint"]) == ["/bin/sh", "-c"]
    (script,) = argv(prometheus["command"])
    config = option_values(shlex.split(script))["--config.file"]
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in prometheus["volumes"]}
    assert (ROOT / mounts[config]).is_file()
    assert any(str(port).endswith("9090") for port in prometheus["ports"])

    grafana = services["grafana"]
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in grafana["volumes"]}
    provisioning = ROOT / mounts["/etc/grafana/provisioning"]
    assert (provisioning / "datasources").is_dir()
    assert (provisioning / "dashboards").is_dir()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    folder, _, file = home.rpartition("/")
    assert (ROOT / mounts[folder] / file).is_file()
    assert str(grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"]).startswith(
        "${GRAFANA_PASSWORD:?"
    )
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert "prometheus" in depends_on(grafana)


def _compose_command() -> list[str]:
    # Compose v1 (Debian's docker-compose) or the v2 plugin of the docker CLI.
    if shutil.which("docker-compose"):
        command = ["docker-compose"]
    elif (
        shutil.which("docker")
        and subprocess.run(
            ["docker", "compose", "version"], capture_output=True, check=False
        ).returncode
        == 0
    ):
        command = ["docker", "compose"]
    else:
        pytest.skip(
            "neither docker-compose nor the docker compose plugin is installed, so Compose's "
            "own validation cannot run here (.ci/run installs docker-compose where it can); "
            "the other tests in this module still check the file's structure"
        )
    return command


def _compose_config(env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    empty = tmp_path / "empty.env"
    empty.write_text("")
    return subprocess.run(
        # Only the given variables: a developer's own .env must not answer for them.
        [
            *_compose_command(),
            "--env-file",
            str(empty),
            "--file",
            str(COMPOSE_FILE),
            "config",
            "-q",
        ],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.endswith("_PASSWORD")} | env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_docker_compose_accepts_the_file(tmp_path: Path) -> None:
    result = _compose_config(
        {"FLOWER_PASSWORD": "f", "GRAFANA_PASSWORD": "g", "METRICS_TOKEN": "m"}, tmp_path
    )
    assert result.returncode == 0, result.stderr


def test_docker_compose_refuses_to_run_without_the_flower_password(tmp_path: Path) -> None:
    result = _compose_config({"GRAFANA_PASSWORD": "g", "METRICS_TOKEN": "m"}, tmp_path)
    assert result.returncode != 0
    assert "FLOWER_PASSWORD" in result.stderr

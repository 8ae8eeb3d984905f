"""The import rules (the engine knows nothing of the service; the API and its Celery client load no torch),
checked in fresh interpreters and by reading the engine's source."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICE_MODULES = ("fastapi", "starlette", "celery", "kombu", "sqlalchemy", "redis", "alembic", "api", "jobs")


def modules_after_import(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return {name.split(".")[0] for name in out.stdout.split()}


def test_engine_imports_nothing_of_the_service() -> None:
    loaded = modules_after_import("import engine.run, engine.cli, engine.demo")
    assert "torch" in loaded  # the check is meaningful: the engine really was imported
    assert not loaded & set(SERVICE_MODULES)


def test_config_is_torch_free() -> None:
    # The API validates job specs with engine.config; it must not pull in torch or transformers.
    loaded = modules_after_import("import engine.config")
    assert "pydantic" in loaded
    assert not loaded & {"torch", "transformers", "numpy"}


def test_api_and_jobs_do_not_import_torch_from_api() -> None:
    assert "torch" not in modules_after_import("import api")
    assert "api" not in modules_after_import("import jobs")


def test_api_app_is_torch_free() -> None:
    # The whole app: every router, the schemas, the Celery app it sends tasks with.
    loaded = modules_after_import("import api.main")
    assert {"fastapi", "celery", "sqlalchemy"} <= loaded  # the check is meaningful
    assert not loaded & {"torch", "transformers", "numpy", "tensorboard", "mlflow", "wandb"}


def test_the_experiment_trackers_are_imported_only_when_a_job_switches_one_on() -> None:
    loaded = modules_after_import("import engine.tracking, engine.cli, jobs.runner")
    assert "torch" in loaded  # the check is meaningful: the runner really was imported
    assert not loaded & {"tensorboard", "mlflow", "wandb"}


def test_engine_reads_no_environment() -> None:
    offenders = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []

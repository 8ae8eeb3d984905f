"""The import rules (the engine knows nothing of the service; the workers know nothing of the API; the API and the
database layer it shares with the workers load no torch; only ``api.main`` imports the route modules), checked in
fresh interpreters and by reading the source. Each check first shows that it looked at something real, so that a
rule that is broken fails."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICE_MODULES = ("fastapi", "starlette", "celery", "kombu", "sqlalchemy", "redis", "alembic", "api", "jobs")
HEAVY_MODULES = ("torch", "transformers", "numpy", "tensorboard", "mlflow", "wandb")


def module_name(path: Path) -> str:
    """``api/routes/jobs.py`` → ``api.routes.jobs``; a package's ``__init__.py`` is the package."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def modules_of(package: str) -> list[str]:
    """Every module of a package of this repository, from its files."""
    return sorted(module_name(path) for path in (ROOT / package).rglob("*.py"))


def modules_after_import(statement: str) -> set[str]:
    """The modules (dotted names) a fresh interpreter holds after ``statement``."""
    code = f"import sys\n{statement}\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def packages(modules: set[str]) -> set[str]:
    return {name.split(".")[0] for name in modules}


def test_engine_imports_nothing_of_the_service() -> None:
    engine = modules_of("engine")
    assert {"engine.run", "engine.cli", "engine.spec.config"} <= set(
        engine
    )  # the check is meaningful: files were found
    loaded = modules_after_import("import " + ", ".join(engine))
    assert "torch" in packages(loaded)  # ... and the engine really was imported
    assert packages(loaded) & set(SERVICE_MODULES) == set()


def test_config_is_torch_free() -> None:
    # The API validates job specs with engine.spec.config; it must not pull in torch or transformers.
    loaded = packages(modules_after_import("import engine.spec.config"))
    assert "pydantic" in loaded
    assert loaded & {"torch", "transformers", "numpy"} == set()


def test_the_workers_import_nothing_of_the_api() -> None:
    # Every module of jobs/: the worker, its tasks, the runner, the CLI, the database layer.
    jobs = modules_of("jobs")
    assert {"jobs.worker", "jobs.tasks", "jobs.runner", "jobs.cli", "jobs.store.crud"} <= set(jobs)
    loaded = modules_after_import("import " + ", ".join(jobs))
    assert {"jobs.worker", "jobs.runner", "torch", "celery"} <= loaded  # the check is meaningful
    assert sorted(name for name in loaded if name.split(".")[0] == "api") == []


def test_the_api_and_the_database_layer_are_torch_free() -> None:
    # Every module of api/ (the app with every router, the server, the schemas, the Celery app it sends tasks with)
    # and of jobs/store/, which the API shares with the workers.
    modules = modules_of("api") + modules_of("jobs/store")
    assert {"api.main", "api.server", "api.services.jobs", "jobs.store.crud"} <= set(modules)
    loaded = modules_after_import("import " + ", ".join(modules))
    assert {"fastapi", "celery", "sqlalchemy"} <= packages(loaded)  # the check is meaningful
    assert packages(loaded) & set(HEAVY_MODULES) == set()


def test_the_experiment_trackers_are_imported_only_when_a_job_switches_one_on() -> None:
    loaded = packages(modules_after_import("import engine.tracking, engine.cli, jobs.runner"))
    assert "torch" in loaded  # the check is meaningful: the runner really was imported
    assert loaded & {"tensorboard", "mlflow", "wandb"} == set()


def environment_reads(source: str) -> list[int]:
    """Lines of ``source`` that read or set the environment: ``os.environ``, ``os.getenv``, ``os.putenv``, or
    those names imported from ``os``."""
    names = {"environ", "getenv", "putenv"}
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        attribute = isinstance(node, ast.Attribute) and node.attr in names
        imported = (
            isinstance(node, ast.ImportFrom) and node.module == "os" and bool(names & {a.name for a in node.names})
        )
        if attribute or imported:
            lines.add(node.lineno)
    return sorted(lines)


def test_engine_reads_no_environment() -> None:
    assert environment_reads("import os\nos.environ['A']\nos.getenv('B')\nfrom os import environ") == [2, 3, 4]
    paths = sorted((ROOT / "engine").rglob("*.py"))
    assert ROOT / "engine" / "spec" / "config.py" in paths  # the check is meaningful: the engine's files were found
    offenders = [f"{path.relative_to(ROOT)}:{line}" for path in paths for line in environment_reads(path.read_text())]
    assert offenders == []


def imports_of(source: str, package: str) -> set[str]:
    """The modules ``source``, a module of ``package``, imports, by dotted name: ``from a import b`` counts as ``a``
    and ``a.b`` (``b`` may be a module), and relative imports are resolved."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            base = ".".join([*parts, *([node.module] if node.module else [])])
            found |= {base, *(f"{base}.{alias.name}" for alias in node.names)}
    return found


def test_only_the_app_imports_the_route_modules() -> None:
    # Routes call services (api/services/), never another route module: what two routes share is a service.
    relative = imports_of("from . import jobs\nfrom .stream import sse\nimport api.deps", "api.routes")
    assert relative == {"api.routes", "api.routes.jobs", "api.routes.stream", "api.routes.stream.sse", "api.deps"}
    routes = {module_name(path) for path in (ROOT / "api" / "routes").glob("*.py")} - {"api.routes"}
    assert {"api.routes.jobs", "api.routes.pipelines", "api.routes.stream"} <= routes  # the files were found
    main = ROOT / "api" / "main.py"
    assert routes <= imports_of(main.read_text(), "api")  # the parser sees the app import every route module
    offenders = []
    for path in sorted((ROOT / "api").rglob("*.py")):
        if path != main:
            name = module_name(path)
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            offenders += [f"{name} imports {other}" for other in sorted(imports_of(path.read_text(), package) & routes)]
    assert offenders == []

"""The import rules (the engine knows nothing of the service; its spec and graders load no torch and import no
torch-side engine module; the chassis, engine/core/, imports no method; a method's loop imports no other method's
loop; the workers know nothing of the API; the API and the database layer it shares with the workers load no torch;
only ``api.main`` imports the route modules), checked in fresh interpreters and by reading the source. Each check
first shows that it looked at something real, so that a rule that is broken fails."""

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
    # the check is meaningful: the files of every subpackage were found
    assert {"engine.run", "engine.cli", "engine.spec.config", "engine.core.learner", "engine.methods.ppo_train"} <= set(
        engine
    )
    loaded = modules_after_import("import " + ", ".join(engine))
    assert "torch" in packages(loaded)  # ... and the engine really was imported
    assert packages(loaded) & set(SERVICE_MODULES) == set()


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


TORCH_FREE = [
    *modules_of("engine/spec"),
    "engine.rewards.graders",
    "engine.rewards.judge",
    "engine.rewards.sandbox",
    "engine.callbacks",
    *modules_of("engine/builtin"),
]
"""The torch-free part of the engine: what the API validates job specs and runs graders with (engine/spec/, the
graders of a spec's ``reward``, their judge and sandbox) and what those import (the callbacks' stop requests, the
built-in tasks)."""
TORCH_LIBRARIES = {"torch", "transformers", "numpy"}


def test_the_spec_and_the_graders_are_torch_free() -> None:
    # The API imports these; each, and whatever it imports, must load without torch, transformers or numpy.
    assert {"engine.spec", "engine.spec.config", "engine.spec.policy_losses", "engine.spec.rows"} <= set(TORCH_FREE)
    assert "torch" in packages(modules_after_import("import engine.core.ops"))  # the check sees torch come in
    loaded = modules_after_import("import " + ", ".join(TORCH_FREE))
    assert {"pydantic", "engine.spec.config", "engine.rewards.graders"} <= loaded | packages(loaded)
    assert packages(loaded) & TORCH_LIBRARIES == set()


def engine_imports(path: Path) -> set[str]:
    """The engine modules (and names in them) that the engine module at ``path`` imports, read from its source,
    imports for type checking included."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return {other for other in imports_of(path.read_text(), package) if other.split(".")[0] == "engine"}


def within(name: str, modules: set[str]) -> bool:
    """``name`` is one of ``modules`` or a name inside one (a submodule, a function)."""
    return any(name == module or name.startswith(module + ".") for module in modules)


ENGINE_PACKAGES = {module_name(path) for path in (ROOT / "engine").rglob("__init__.py")}


def outside_the_torch_free_part(imported: set[str]) -> set[str]:
    """What of ``imported`` is a torch-side engine module (a package itself, docstring only, is neither)."""
    return {name for name in imported if name not in ENGINE_PACKAGES and not within(name, set(TORCH_FREE))}


def test_the_torch_free_part_imports_only_itself() -> None:
    # engine/spec/ and the graders import no torch-side engine module (core, methods, the reward model, the reward
    # function, run, demo, ...), not even for type checking: a lazy import there would still be a way to torch.
    violating = imports_of("from engine.core.models import load_causal_lm\nfrom engine.spec import rows", "engine.spec")
    assert outside_the_torch_free_part(violating) == {"engine.core.models", "engine.core.models.load_causal_lm"}
    paths = [path for path in sorted((ROOT / "engine").rglob("*.py")) if module_name(path) in TORCH_FREE]
    imported = {name for path in paths for name in engine_imports(path)}
    assert {"engine.rewards.graders", "engine.spec.policy_losses", "engine.spec.rows"} <= imported  # the parser sees
    offenders = [
        f"{module_name(path)} imports {name}"
        for path in paths
        for name in sorted(outside_the_torch_free_part(engine_imports(path)))
    ]
    assert offenders == []


def test_the_chassis_imports_no_method() -> None:
    # Methods build on the chassis (engine/core/), never the reverse: what two methods share lives in core.
    assert within("engine.methods.ppo.compute_gae", {"engine.methods"})
    assert not within("engine.methods_extra", {"engine.methods"})
    paths = sorted((ROOT / "engine" / "core").glob("*.py"))
    imported = {name for path in paths for name in engine_imports(path)}
    assert {"engine.spec.config", "engine.core.models", "engine.rewards.function"} <= imported  # the parser sees
    methods = sorted((ROOT / "engine" / "methods").glob("*.py"))
    assert any(within(name, {"engine.core"}) for path in methods for name in engine_imports(path))  # methods use it
    offenders = [
        f"{module_name(path)} imports {name}"
        for path in paths
        for name in sorted(engine_imports(path))
        if within(name, {"engine.methods"})
    ]
    assert offenders == []


LOOPS = {f"engine.methods.{name}" for name in ("sft", "rm", "dpo_train", "ppo_train", "grpo_train", "distill")}
NUMERICS = {f"engine.methods.{name}" for name in ("dpo", "ppo", "grpo")}
NUMERICS_MAY_IMPORT = {"engine.spec", "engine.core.ops"}


def method_offenders(name: str, source: str) -> list[str]:
    """What ``source``, the method module ``name``, imports against the rule of
    ``test_a_method_loop_imports_no_other_loop``."""
    imported = {other for other in imports_of(source, "engine.methods") if other.split(".")[0] == "engine"}
    if name in NUMERICS:
        wrong = {other for other in imported if other not in ENGINE_PACKAGES and not within(other, NUMERICS_MAY_IMPORT)}
    else:
        wrong = {other for other in imported if within(other, LOOPS - {name})}
    return [f"{name} imports {other}" for other in sorted(wrong)]


def test_a_method_loop_imports_no_other_loop() -> None:
    """A method's loop module (sft, rm, dpo_train, ppo_train, grpo_train, distill) imports no other method's loop:
    what two loops share (opening the policy, rollouts, the policy update, the KL estimators) is chassis, in
    engine/core/. A loop may use another method's numerics (distill: GRPO's group advantages), because a numerics
    module (dpo, ppo, grpo) is pure numerics: functions of tensors that import nothing of the engine but the spec
    (engine/spec/) and the tensor ops (engine/core/ops.py). Every module of engine/methods/ is one or the other."""
    paths = sorted((ROOT / "engine" / "methods").glob("*.py"))
    assert {module_name(path) for path in paths} == {"engine.methods", *LOOPS, *NUMERICS}
    loop = "from engine.methods.sft import train_sft\nfrom engine.methods import ppo\n"
    assert method_offenders("engine.methods.ppo_train", loop) == [
        "engine.methods.ppo_train imports engine.methods.sft",
        "engine.methods.ppo_train imports engine.methods.sft.train_sft",
    ]
    numerics = "from engine.core.models import prepare\nfrom engine.core.ops import masked_mean\n"
    assert method_offenders("engine.methods.ppo", numerics) == [
        "engine.methods.ppo imports engine.core.models",
        "engine.methods.ppo imports engine.core.models.prepare",
    ]
    assert "engine.methods.grpo" in engine_imports(ROOT / "engine" / "methods" / "distill.py")  # the parser sees it
    offenders = [line for path in paths for line in method_offenders(module_name(path), path.read_text())]
    assert offenders == []


def test_a_session_imports_no_method() -> None:
    # A training session (engine/session/) serves the client's own loop on the chassis and the spec: it needs no
    # method's loop or numerics (its losses are the registry's, engine/spec/policy_losses.py).
    paths = sorted((ROOT / "engine" / "session").glob("*.py"))
    imported = {name for path in paths for name in engine_imports(path)}
    assert {"engine.core.learner", "engine.spec.policy_losses"} <= imported  # the parser sees them
    offenders = [f"{module_name(path)} imports {name}" for path in paths for name in sorted(engine_imports(path))
                 if within(name, {"engine.methods"})]  # fmt: skip
    assert offenders == []

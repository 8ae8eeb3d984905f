"""The engine's shape, as the chassis refactor left it: each online loop reads as its numbered stages (bounded
sizes), and no function nests blocks deeper than 4."""

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "engine"
SUBPACKAGES = ("spec", "rewards", "core", "methods", "session")
BLOCKS = (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.FunctionDef, ast.AsyncFunctionDef, ast.Match)


def block_depth(node: ast.AST, depth: int = 0) -> int:
    """How deep blocks nest inside ``node`` (an ``elif`` counts as one more level, as it reads)."""
    deepest = depth
    for child in ast.iter_child_nodes(node):
        deepest = max(deepest, block_depth(child, depth + isinstance(child, BLOCKS)))
    return deepest


def functions(path: Path) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_online_loops_stay_small() -> None:
    train_ppo = functions(ENGINE / "methods" / "ppo_train.py")["train_ppo"]
    assert train_ppo.end_lineno is not None
    assert train_ppo.end_lineno - train_ppo.lineno + 1 <= 120
    assert lines(ENGINE / "methods" / "ppo_train.py") <= 330
    assert lines(ENGINE / "methods" / "grpo_train.py") <= 170
    assert lines(ENGINE / "methods" / "distill.py") <= 230


def test_the_engine_is_in_its_subpackages() -> None:
    # The layout engine/__init__.py maps: the torch-free spec, the rewards, the chassis, the methods, a training
    # session's operations; the harness
    # (run, cli, demo, callbacks, tracking, builtin/) at the top. A new module goes into one of the subpackages.
    top = {path.name for path in ENGINE.iterdir() if path.name != "__pycache__"}
    assert top == {"__init__.py", "run.py", "cli.py", "demo.py", "callbacks.py", "tracking.py", "builtin", *SUBPACKAGES}
    for package in SUBPACKAGES:
        assert (ENGINE / package / "__init__.py").is_file()
    assert {"config.py", "rows.py", "policy_losses.py"} <= {path.name for path in (ENGINE / "spec").glob("*.py")}
    assert {"learner.py", "rollout.py", "online.py", "loop.py"} <= {p.name for p in (ENGINE / "core").glob("*.py")}
    assert {"graders.py", "reward_model.py", "function.py"} <= {p.name for p in (ENGINE / "rewards").glob("*.py")}


def test_no_engine_function_nests_deeper_than_four() -> None:
    deep = [
        f"{path.relative_to(ENGINE)}:{name}"
        for path in sorted(ENGINE.rglob("*.py"))
        for name, node in functions(path).items()
        if block_depth(node) > 4
    ]
    assert deep == []


def test_the_depth_measure_sees_nesting() -> None:
    code = "def f():\n for a in b:\n  if a:\n   with c:\n    while d:\n     pass\n"
    node = ast.parse(code).body[0]
    assert block_depth(node) == 4
    assert block_depth(ast.parse(code.replace("pass", "if e:\n      pass")).body[0]) == 5


def code_words(source: str) -> set[str]:
    """The names, attributes, imported names and strings of ``source`` that are code, not prose: docstrings (of
    modules, classes, functions and attributes: every string standing alone as a statement) left out, as comments
    are."""
    tree = ast.parse(source)
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }
    words: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, ast.alias):
            words.add(node.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            words.add(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.add(node.value)
    return words


def modules_naming(word: str) -> list[str]:
    """The service's and the engine's modules (tests aside) whose code names ``word`` (in any case)."""
    root = ENGINE.parent
    paths = [path for package in ("engine", "api", "jobs") for path in sorted((root / package).rglob("*.py"))]
    named = [path for path in paths if any(word in w.lower() for w in code_words(path.read_text()))]
    return [".".join(path.relative_to(root).with_suffix("").parts) for path in named]


def test_a_method_is_added_in_at_most_three_files() -> None:
    """The distillation job type, the last added, is two modules and the README: its config and registry entry
    (whose demo settings give ``rlhf demo --method distill``) and its loop. No other module of the engine or the
    service names it: the runner, the demo, the API and its OpenAPI description read the job types from the
    registry, and the chassis types the online configs by their bases."""
    from engine.spec.config import HYPERPARAMETERS, JOB_TYPES

    assert code_words('"""Doc."""\nx = 1\n"""Doc of x."""\nimport a.b\nfrom c import d\nx.y = f("s")') == {
        "a.b",
        "c",
        "d",
        "x",
        "y",
        "f",
        "s",
    }
    config = HYPERPARAMETERS["distill"].__module__
    loop = JOB_TYPES["distill"].trainer.split(":")[0]
    assert modules_naming("distill") == sorted([config, loop])


def test_a_loss_is_added_in_one_file() -> None:
    """Each policy loss is named in code only where it is registered beside its formula: the config checks
    ``policy_loss`` against the registry, the learner calls it from there."""
    from engine.spec.policy_losses import POLICY_LOSSES

    assert {"ppo_clip", "importance_sampling", "cispo", "gspo"} <= set(POLICY_LOSSES)
    for name in set(POLICY_LOSSES) - {"ppo_clip"}:  # the default is named by the configs too
        assert modules_naming(name) == [POLICY_LOSSES[name].__module__], name

"""What a job spec may make the server read: local models only inside ``model_root`` (``..``, ``~``, outside
absolute paths and escaping symlinks refused), datasets only as ``builtin:`` or uploaded ``file-`` ids, and
never remote code (``trust_remote_code`` is not a spec field, and the engine always passes False)."""

import ast
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from jobs.store import refs
from jobs.store.db import session_scope
from jobs.store.settings import Settings
from tests.api.helpers import PPO_SPEC, SFT_SPEC, Calls, error_of
from tests.factories import Project, make_settings
from tests.hf_cache import put_in_cache

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    """A model root with a model, a nested model and two symlinks (one staying inside, one escaping), beside
    a folder outside the root."""
    root, outside = tmp_path / "models", tmp_path / "outside"
    (root / "good").mkdir(parents=True)
    (root / "good" / "config.json").write_text("{}")
    (root / "good" / "tokenizer.json").write_text("{}")
    (root / "team" / "nested").mkdir(parents=True)
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    (root / "inside-link").symlink_to(root / "good", target_is_directory=True)
    (root / "escape").symlink_to(outside, target_is_directory=True)
    (root / "team" / "up").symlink_to(tmp_path, target_is_directory=True)
    return {"root": root, "outside": outside, "tmp": tmp_path}


@pytest.fixture
def rooted(layout: dict[str, Path], database_url: str, project: Project, calls: Calls) -> TestClient:
    settings = make_settings(layout["tmp"] / "data", database_url, model_root=layout["root"])
    app = create_app(settings, enqueue=calls.enqueue, recovery_interval=None)
    return TestClient(app, headers=project.headers)


def refused(client: TestClient, spec: dict[str, Any], param: str = "model", code: str = "local_path_refused") -> str:
    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 422, (spec, response.text)
    error = error_of(response)
    assert (error["code"], error["param"]) == (code, param), spec
    return str(error["message"])


def test_models_inside_the_root_are_accepted(rooted: TestClient, layout: dict[str, Path], calls: Calls) -> None:
    root = layout["root"]
    for model in ("./good", str(root / "good"), "./team/nested", "./inside-link", "./good/."):
        response = rooted.post("/v1/jobs", json={**SFT_SPEC, "model": model})
        assert response.status_code == 201, (model, response.text)
        assert response.json()["spec"]["model"] == model
    assert len(calls.enqueued) == 5


def test_models_outside_the_root_are_refused(rooted: TestClient, layout: dict[str, Path], calls: Calls) -> None:
    outside, tmp = layout["outside"], layout["tmp"]
    cases = [
        "../outside",  # relative, out of the root
        "./good/../../outside",  # '..' anywhere, even one that would come back in
        "./good/../good",
        str(outside),  # absolute, elsewhere
        "/etc",
        str(layout["root"]) + "/../outside",
        "./escape",  # a symlink inside the root that leads out
        "./escape/sub",
        "./team/up/outside",  # through a symlinked folder
        "~/models",  # home-relative
        "~root",
        str(tmp),  # the root's parent
    ]
    for model in cases:
        message = refused(rooted, {**SFT_SPEC, "model": model})
        assert model in message or repr(model) in message
        refused(rooted, {**PPO_SPEC, "reward_model": model}, param="reward_model")
    assert calls.enqueued == []


def test_local_paths_are_refused_without_a_root(client: TestClient, calls: Calls) -> None:
    for model in ("./good", "/opt/models/x", "../x", "a/b/c"):
        message = refused(client, {**SFT_SPEC, "model": model})
        assert "disabled" in message
    assert calls.enqueued == []


def test_a_hub_id_must_not_name_a_local_folder(
    client: TestClient, settings: Settings, layout: dict[str, Path], monkeypatch: pytest.MonkeyPatch, hf_cache: Path
) -> None:
    # transformers' from_pretrained loads a folder of that name in the working directory before the hub:
    # such a name is a local path, refused without a model root...
    for repo_id in ("gpt2", "openai-community/gpt2", "org/name"):
        put_in_cache(hf_cache, repo_id, {"config.json": "{}"})
    monkeypatch.chdir(layout["tmp"])
    (layout["tmp"] / "org" / "name").mkdir(parents=True)
    refused(client, {**SFT_SPEC, "model": "org/name"})
    refused(client, {**SFT_SPEC, "model": "org"})
    assert client.post("/v1/jobs", json={**SFT_SPEC, "model": "gpt2"}).status_code == 201
    assert client.post("/v1/jobs", json={**SFT_SPEC, "model": "openai-community/gpt2"}).status_code == 201
    refused(client, {**SFT_SPEC, "model": "org/../../etc"})
    # ...and with one, a folder under the root, never the one of the working directory.
    root = layout["root"]
    (root / "org" / "name").mkdir(parents=True)
    with session_scope(settings.resolved_database_url) as session:
        spec = {**SFT_SPEC, "model": "org/name", "hyperparameters": {}}
        resolved = refs.resolve_spec(session, project_id="p", spec=spec, artifacts=root, model_root=root)
    assert resolved["model"] == str(root.resolve() / "org" / "name")


def test_a_name_under_the_model_root_is_that_folder(
    rooted: TestClient, layout: dict[str, Path], settings: Settings, calls: Calls, hf_cache: Path
) -> None:
    # Issue 12, item 3: "llama" under RLHF_MODEL_ROOT was taken for a hub id, and failed on the worker.
    root = layout["root"]
    (root / "llama").mkdir()
    (root / "llama" / "config.json").write_text("{}")
    (root / "llama" / "tokenizer.json").write_text("{}")
    put_in_cache(hf_cache, "llama", {"config.json": "{}"})  # a hub model of the same name does not win
    for spec in (
        {**SFT_SPEC, "model": "llama"},
        {**PPO_SPEC, "reward_model": "llama"},
        {**SFT_SPEC, "model": "team/nested"},
    ):
        response = rooted.post("/v1/jobs", json=spec)
        assert response.status_code == 201, (spec, response.text)
    assert len(calls.enqueued) == 3
    refused(rooted, {**SFT_SPEC, "model": "escape"})  # a symlink under the root that leads out
    refused(rooted, {**SFT_SPEC, "model": "absent"}, code="hub_model_unavailable")  # nothing there: a hub id
    with session_scope(settings.resolved_database_url) as session:
        for model, path in [("llama", root / "llama"), ("team/nested", root / "team" / "nested")]:
            spec = {**PPO_SPEC, "model": model, "reward_model": model, "hyperparameters": {}}
            resolved = refs.resolve_spec(session, project_id="p", spec=spec, artifacts=root, model_root=root)
            assert resolved["model"] == resolved["reward_model"] == str(path.resolve())


def test_the_worker_resolves_inside_the_root_too(layout: dict[str, Path], settings: Settings, hf_cache: Path) -> None:
    root = layout["root"]
    with session_scope(settings.resolved_database_url) as session:

        def resolve(model: str, hub_downloads: bool = False) -> str:
            spec = {**SFT_SPEC, "model": model, "hyperparameters": {}}
            resolved = refs.resolve_spec(
                session, project_id="p", spec=spec, artifacts=root, model_root=root, hub_downloads=hub_downloads
            )
            return str(resolved["model"])

        assert resolve("./good") == str((root / "good").resolve())
        assert resolve("./inside-link") == str((root / "good").resolve())
        assert resolve("good") == str((root / "good").resolve())
        for model in ("./escape", "../outside", "/etc", "escape"):
            with pytest.raises(refs.SpecReferenceError) as error:
                resolve(model)
            assert error.value.code == "local_path_refused"
        # A hub id the worker may not download and does not have fails here, before any model is loaded.
        with pytest.raises(refs.SpecReferenceError) as error:
            resolve("org/name")
        assert (error.value.code, error.value.param) == ("hub_model_unavailable", "model")
        assert resolve("org/name", hub_downloads=True) == "org/name"
        put_in_cache(hf_cache, "org/name", {"config.json": "{}"})
        assert resolve("org/name") == "org/name"


@pytest.mark.parametrize(
    ("spec", "param"),
    [
        ({**SFT_SPEC, "dataset": "train.jsonl"}, "dataset"),
        ({**SFT_SPEC, "dataset": "/etc/passwd.jsonl"}, "dataset"),
        ({**SFT_SPEC, "dataset": "../../artifacts/files/file-0123456789ab.jsonl"}, "dataset"),
        ({**SFT_SPEC, "dataset": "file-../x.jsonl"}, "dataset"),
        ({**SFT_SPEC, "eval_dataset": "data/eval.jsonl"}, "eval_dataset"),
        (
            {**PPO_SPEC, "hyperparameters": {"ptx_coef": 0.1, "ptx_dataset": "/data/sft.jsonl"}},
            "hyperparameters.ptx_dataset",
        ),
    ],
)
def test_dataset_paths_are_refused(client: TestClient, calls: Calls, spec: dict[str, Any], param: str) -> None:
    message = refused(client, spec, param=param)
    assert "POST /v1/files" in message
    assert calls.enqueued == []


@pytest.mark.parametrize(
    ("spec", "param"),
    [
        ({**SFT_SPEC, "trust_remote_code": True}, "trust_remote_code"),
        ({**SFT_SPEC, "hyperparameters": {"trust_remote_code": True}}, "hyperparameters.trust_remote_code"),
        ({**SFT_SPEC, "lora": {"trust_remote_code": True}}, "lora.trust_remote_code"),
        ({**SFT_SPEC, "model_kwargs": {"trust_remote_code": True}}, "model_kwargs"),
    ],
)
def test_a_spec_cannot_turn_on_remote_code(client: TestClient, calls: Calls, spec: dict[str, Any], param: str) -> None:
    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 422
    assert (error_of(response)["code"], error_of(response)["param"]) == ("invalid_request", param)
    assert "Extra inputs are not permitted" in error_of(response)["message"]
    assert calls.enqueued == []


def test_the_engine_always_loads_with_trust_remote_code_false(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from engine.core import models

    seen: list[tuple[str, dict[str, Any]]] = []

    class Loaded(Exception):
        pass

    def spy(name: str) -> Any:
        def from_pretrained(ref: str, *args: Any, **kwargs: Any) -> Any:
            seen.append((name, kwargs))
            raise Loaded

        return from_pretrained

    for name in ("AutoModelForCausalLM", "AutoModelForSequenceClassification", "AutoTokenizer"):
        monkeypatch.setattr(getattr(models, name), "from_pretrained", spy(name))
    tokenizer = models.load_tokenizer("builtin:tiny")
    for load in (
        lambda: models.load_tokenizer("org/model"),
        lambda: models.load_causal_lm("org/model", tokenizer, 0),
        lambda: models.load_scalar_model("org/model", tokenizer, 0),
    ):
        with pytest.raises(Loaded):
            load()
    assert [name for name, _ in seen] == ["AutoTokenizer", "AutoModelForCausalLM", "AutoModelForSequenceClassification"]
    assert all(kwargs.get("trust_remote_code") is False for _, kwargs in seen)
    assert models.AutoModelForCausalLM is transformers.AutoModelForCausalLM  # the spies sat on the real classes


def test_no_code_passes_trust_remote_code_other_than_false() -> None:
    """Every ``from_pretrained`` of a transformers Auto class in engine/ and jobs/ passes
    ``trust_remote_code=False`` literally, and no call anywhere passes anything else. (A ``**kwargs`` beside
    the literal cannot override it: a second value for the keyword is a TypeError.)"""
    calls = 0
    for path in sorted([*(ROOT / "engine").rglob("*.py"), *(ROOT / "jobs").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Call):
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            for keyword in node.keywords:
                if keyword.arg == "trust_remote_code":
                    assert isinstance(keyword.value, ast.Constant) and keyword.value.value is False, where
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "from_pretrained":
                receiver = ast.unparse(func.value)
                if receiver == "PeftModel":  # loads adapter weights into a model already loaded; runs no code
                    continue
                calls += 1
                passed = {k.arg: k.value for k in node.keywords}
                value = passed.get("trust_remote_code")
                assert isinstance(value, ast.Constant) and value.value is False, where
    assert calls >= 2  # AutoTokenizer and the models' shared loader

"""``POST /v1/jobs`` chooses what a spec leaves out "auto" (engine/spec/auto.py): the epochs or steps from the dataset's
rows, the learning rate from the model's width; explicit values win, and the stored spec shows what was chosen. And a
DPO job left at its defaults learns: a preference task no other test trains on moves by a clear amount."""

import json
import random
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from engine.builtin import reviews
from jobs import runner
from jobs.store.migrate import upgrade
from jobs.store.settings import Settings
from tests.api.helpers import PPO_SPEC, Calls, jsonl
from tests.factories import make_settings, new_project
from tests.models import openai_rows


def preference_pairs(n: int, seed: str) -> list[dict[str, str]]:
    """Pairs of one rule: the chosen completion praises (a positive word, a positive ending), the rejected one pans."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = f"{rng.choice(reviews.OPENERS)} {rng.choice(reviews.SUBJECTS)} {rng.choice(reviews.LINKS)}"
        chosen = f" {rng.choice(reviews.POSITIVE)} . {rng.choice(reviews.POSITIVE_ENDINGS)}"
        rejected = f" {rng.choice(reviews.NEGATIVE)} . {rng.choice(reviews.NEGATIVE_ENDINGS)}"
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def upload(client: TestClient, rows: list[dict[str, Any]], purpose: str) -> str:
    response = client.post(
        "/v1/files", files={"file": ("data.jsonl", jsonl(rows), "application/jsonl")}, data={"purpose": purpose}
    )
    assert response.status_code == 201, response.text
    file_id: str = response.json()["id"]
    return file_id


def created(client: TestClient, spec: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    hyperparameters: dict[str, Any] = response.json()["spec"]["hyperparameters"]
    return hyperparameters


def test_left_out_values_are_chosen_from_the_file_and_the_model_and_given_ones_win(client: TestClient) -> None:
    prefs = upload(client, preference_pairs(240, "defaults/spec"), "preference")
    small = upload(client, [{"prompt": f"p{i}", "completion": f" c{i}"} for i in range(16)], "sft")

    # 240 pairs: OpenAI's 3 epochs; builtin:tiny is 128 wide: TRL's 1e-6 at 4096 wide × 4096 / 128
    dpo = created(client, {"type": "dpo", "model": "builtin:tiny", "dataset": prefs})
    assert (dpo["epochs"], dpo["learning_rate"], dpo["beta"]) == (3.0, 3.2e-5, 0.1)
    # 16 rows: 7 epochs, so that training sees at least 100 examples; LoRA trains at 10 × the full rate
    sft = created(client, {"type": "sft", "model": "builtin:tiny", "dataset": small, "lora": {"r": 4}})
    assert (sft["epochs"], sft["learning_rate"]) == (7.0, 6.4e-3)
    # explicit values win, and max_steps keeps the epochs at their default
    given = {"max_steps": 2, "learning_rate": 1e-6}
    rm = created(client, {"type": "rm", "model": "builtin:tiny", "dataset": prefs, "hyperparameters": given})
    assert (rm["max_steps"], rm["epochs"], rm["learning_rate"]) == (2, 1.0, 1e-6)
    # PPO: the same 3 passes over the built-in 4000 prompts, in batches of 64; its learning rate stays its default
    ppo = created(client, PPO_SPEC)
    assert (ppo["total_steps"], ppo["learning_rate"]) == (188, 3e-5)
    ppo = created(client, {**PPO_SPEC, "hyperparameters": {"batch_size": 8, "mini_batch_size": 8}})
    assert ppo["total_steps"] == 1500


def test_a_model_folder_and_a_job_not_finished_yet_give_their_width(
    client: TestClient, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "models"
    (root / "wide").mkdir(parents=True)
    (root / "wide" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 2048}))
    (root / "wide" / "tokenizer.json").write_text("{}")  # a folder without a tokenizer is refused at submit
    monkeypatch.setattr(settings, "model_root", root)
    prefs = upload(client, preference_pairs(240, "defaults/width"), "preference")

    sft_file = upload(client, [{"prompt": f"p{i}", "completion": f" c{i}"} for i in range(40)], "sft")
    first = client.post("/v1/jobs", json={"type": "sft", "model": "wide", "dataset": sft_file})
    assert first.status_code == 201, first.text
    assert first.json()["spec"]["hyperparameters"]["learning_rate"] == 4e-5  # 2e-5 × 4096 / 2048
    # a DPO job on the SFT job, which has not run yet: the width of the model that job starts from
    dpo = created(client, {"type": "dpo", "model": f"job:{first.json()['id']}", "dataset": prefs})
    assert dpo["learning_rate"] == 2e-6

    # OpenAI's fine-tuning API at "auto" follows the same rule; its multiplier reads against the type's default
    rows = upload(client, openai_rows("dpo", 40), "fine-tune")
    body = {"model": "wide", "training_file": rows, "method": {"type": "dpo"}}
    response = client.post("/v1/fine_tuning/jobs", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["method"]["dpo"]["hyperparameters"]["learning_rate_multiplier"] == 2.0  # 2e-6 / 1e-6
    job = client.get(f"/v1/jobs/{response.json()['id']}").json()
    assert job["spec"]["hyperparameters"]["learning_rate"] == 2e-6


@pytest.fixture
def trained_with_defaults(tmp_path: Path) -> dict[str, Any]:
    """A DPO job submitted with no hyperparameters through the API, on a SQLite database, run by the worker's
    runner; its stored spec and its final eval metrics."""
    url = f"sqlite:///{tmp_path / 'rlhf.db'}"
    upgrade(url)
    settings = make_settings(tmp_path, url)
    project = new_project(settings)
    calls = Calls()
    app = create_app(settings, enqueue=calls.enqueue, generate_with=calls.generate, recovery_interval=None)
    with TestClient(app, headers=project.headers) as client:
        train = upload(client, preference_pairs(240, "defaults/train"), "preference")
        held_out = upload(client, preference_pairs(64, "defaults/eval"), "preference")
        spec = {"type": "dpo", "model": "builtin:tiny", "dataset": train, "eval_dataset": held_out}
        job = client.post("/v1/jobs", json={**spec, "checkpoint_every": 1000}).json()
        assert calls.enqueued == [job["id"]]
        assert runner.run_job(job["id"], settings=settings, worker="w:1") == "succeeded"
        series = client.get(f"/v1/jobs/{job['id']}/metrics", params={"names": "eval/rewards/margins"}).json()["data"]
        accuracies = client.get(f"/v1/jobs/{job['id']}/metrics", params={"names": "eval/rewards/accuracies"})
    return {
        "spec": job["spec"],
        "margin": series["eval/rewards/margins"][-1]["value"],
        "accuracy": accuracies.json()["data"]["eval/rewards/accuracies"][-1]["value"],
    }


def test_dpo_at_its_defaults_moves_the_held_out_preference(trained_with_defaults: dict[str, Any]) -> None:
    # eval/rewards/margins is β × how far the policy's log-prob margin (chosen - rejected) on the held-out pairs moved
    # from the reference's: TRL's defaults (1e-6, one epoch) moved it by 0.004 (0.04 nats), these by 0.33 (3.3 nats)
    assert trained_with_defaults["margin"] > 0.1
    assert trained_with_defaults["accuracy"] > 0.9
    spec = trained_with_defaults["spec"]
    assert (spec["hyperparameters"]["epochs"], spec["hyperparameters"]["learning_rate"]) == (3.0, 3.2e-5)

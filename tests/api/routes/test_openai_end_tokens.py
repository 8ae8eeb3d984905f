"""``/v1/chat/completions`` and ``/v1/completions`` answered by the real inference code (``jobs.inference.generate``
in place of the worker's task) from checkpoints of tests/end_tokens.py's models, which answer :data:`ANSWER` and
their end-of-turn token, then go on: a choice ends there, finish reason ``stop``, the token not in the text."""

import shutil
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from jobs import inference
from jobs.store.settings import Settings
from tests.api.helpers import SFT_SPEC, Calls, Db
from tests.end_tokens import ANSWER, LLAMA3, PHI3, build_end_of_turn_model
from tests.factories import Project

MESSAGES = [{"role": "user", "content": "Finish this review: the food"}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Llama 3 and Phi-3 lookalikes, and ``base``: a Llama 3 whose generation config lists only the EOS."""
    root = tmp_path_factory.mktemp("openai-end-tokens")
    return {
        "llama3": build_end_of_turn_model(LLAMA3, root / "llama3"),
        "phi3": build_end_of_turn_model(PHI3, root / "phi3"),
        "base": build_end_of_turn_model(LLAMA3, root / "base", generation_eos=(LLAMA3.eos,)),
    }


@pytest.fixture
def serving(calls: Calls, settings: Settings) -> Calls:
    """The inference worker's task run in the test process."""
    inference.clear_caches()
    calls.answer = lambda kwargs: inference.generate(**kwargs, settings=settings)
    return calls


def served_job(db: Db, project: Project, settings: Settings, folder: Path) -> str:
    """A succeeded job whose checkpoint at step 1 holds ``folder`` as its policy."""
    job_id = db.job(project.id, spec=SFT_SPEC, status="running")
    db.checkpoint(job_id, 1)
    shutil.copytree(folder, settings.resolved_artifacts_dir / "jobs" / job_id / "checkpoints" / "step-1" / "policy")
    db.status(job_id, "succeeded", output_step=1)
    return job_id


def choices(response: Any) -> list[tuple[str, str]]:
    assert response.status_code == 200, response.text
    return [
        (c["message"]["content"] if "message" in c else c["text"], c["finish_reason"])
        for c in response.json()["choices"]
    ]


@pytest.mark.parametrize("name", ["llama3", "phi3"])
def test_chat_completions_end_at_the_end_of_turn(
    client: TestClient,
    serving: Calls,
    db: Db,
    project: Project,
    settings: Settings,
    folders: dict[str, Path],
    name: str,
) -> None:
    job_id = served_job(db, project, settings, folders[name])
    body = {"model": f"job:{job_id}", "messages": MESSAGES, "max_tokens": 12, "n": 2, "seed": 1}
    response = client.post("/v1/chat/completions", json=body)
    assert choices(response) == [(ANSWER, "stop")] * 2
    assert response.json()["usage"]["completion_tokens"] == 2 * 4  # three answer tokens and the end of turn
    response = client.post("/v1/completions", json={"model": f"job:{job_id}", "prompt": "the food", "max_tokens": 12})
    assert choices(response) == [(ANSWER, "stop")]


def test_a_stop_string_may_name_the_end_of_turn(
    client: TestClient, serving: Calls, db: Db, project: Project, settings: Settings, folders: dict[str, Path]
) -> None:
    job_id = served_job(db, project, settings, folders["base"])
    body = {"model": f"job:{job_id}", "messages": MESSAGES, "max_tokens": 8, "seed": 1}
    assert choices(client.post("/v1/chat/completions", json=body)) == [(ANSWER * 2, "length")]
    assert choices(client.post("/v1/chat/completions", json={**body, "stop": "<|eot_id|>"})) == [(ANSWER, "stop")]

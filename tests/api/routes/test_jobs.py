"""POST/GET /v1/jobs and the control actions: validation naming the field, references, idempotency,
pagination and filters, enqueue after commit, guarded cancel/pause/resume."""

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from engine.builtin import TOKENIZER_FILE
from engine.spec.config import vocabulary_mismatch
from jobs.store import crud
from jobs.store.settings import Settings
from tests.api.helpers import PPO_SPEC, RM_SPEC, SFT_SPEC, Calls, Db, error_of, jsonl
from tests.factories import Project, new_project
from tests.hf_cache import put_in_cache
from tests.models import build_tokenizer


def jobs_stored(client: TestClient) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = client.get("/v1/jobs", params={"limit": 100}).json()["data"]
    return data


def test_create_job(client: TestClient, calls: Calls) -> None:
    response = client.post("/v1/jobs", json={**SFT_SPEC, "name": "first", "hyperparameters": {"max_steps": 7}})
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["id"].startswith("job_")
    assert {k: job[k] for k in ("object", "type", "name", "status", "model", "step", "attempt")} == {
        "object": "job",
        "type": "sft",
        "name": "first",
        "status": "queued",
        "model": "builtin:tiny",
        "step": 0,
        "attempt": 1,
    }
    assert (job["error"], job["output_model"], job["started_at"], job["finished_at"]) == (None, None, None, None)
    assert job["created_at"].endswith(("Z", "+00:00"))
    assert job["spec"]["hyperparameters"]["max_steps"] == 7
    assert job["spec"]["hyperparameters"]["warmup_steps"] == 0  # defaults filled in
    assert job["spec"]["hyperparameters"]["learning_rate"] == 6.4e-4  # chosen for builtin:tiny's width (auto)
    assert calls.enqueued == [job["id"]] and calls.queues == ["train"]
    assert job["spec"]["resources"] == {
        "queue": "train",
        "num_processes": 1,
        "num_nodes": 1,
        "sharding": "ddp",
        "cpu_offload": False,
    }
    assert client.get(f"/v1/jobs/{job['id']}").json() == job


def test_a_job_goes_to_the_queue_its_spec_names(client: TestClient, calls: Calls) -> None:
    spec = {**SFT_SPEC, "resources": {"queue": "train-a100", "num_processes": 2}}
    job = client.post("/v1/jobs", json=spec).json()
    assert calls.enqueued == [job["id"]] and calls.queues == ["train-a100"]
    assert job["spec"]["resources"] == {**spec["resources"], "num_nodes": 1, "sharding": "ddp", "cpu_offload": False}


def test_enqueue_happens_after_commit(client: TestClient, calls: Calls, db: Db) -> None:
    seen: list[str] = []

    def enqueue(job_id: str, _queue: str) -> None:
        seen.append(db.get(job_id).status)  # another session: sees only committed rows

    client.app.state.enqueue = enqueue  # type: ignore[attr-defined]
    assert client.post("/v1/jobs", json=SFT_SPEC).status_code == 201
    assert seen == ["queued"]


def test_enqueue_failure_is_503_and_the_job_is_not_left_queued(client: TestClient) -> None:
    leak = "(sqlite3.OperationalError) database is locked [SQL: INSERT INTO kombu_message] eyJib2R5Ijog"

    def broken(_job_id: str, _queue: str) -> None:
        raise ConnectionError(leak)

    client.app.state.enqueue = broken  # type: ignore[attr-defined]
    response = client.post("/v1/jobs", json=SFT_SPEC)
    assert response.status_code == 503
    assert error_of(response)["code"] == "unavailable"
    [job] = jobs_stored(client)
    assert job["status"] == "failed"
    assert job["error"]["code"] == "enqueue_failed"
    # a code and a plain sentence for the user; the broker's words (SQL, a task body) only in the server log
    assert "SQL" not in error_of(response)["message"] and "SQL" not in job["error"]["message"]


@pytest.mark.parametrize(
    ("spec", "param", "needle"),
    [
        ({**SFT_SPEC, "hyperparameters": {"learning_rate": 5}}, "hyperparameters.learning_rate", "less than or equal"),
        (
            {**SFT_SPEC, "hyperparameters": {"batch_size": 6, "gradient_accumulation_steps": 4}},
            "hyperparameters.batch_size",
            "multiple",
        ),
        ({**SFT_SPEC, "hyperparameters": {"nope": 1}}, "hyperparameters.nope", "Extra inputs"),
        ({**PPO_SPEC, "hyperparameters": {"kl_coef": -1}}, "hyperparameters.kl_coef", "greater than or equal"),
        ({**SFT_SPEC, "unknown_field": 1}, "unknown_field", "Extra inputs"),
        ({**SFT_SPEC, "dataset": "builtin:reviews-prefs"}, "dataset", "preference rows"),
        ({**SFT_SPEC, "model": "builtin:huge"}, "model", "unknown built-in model"),
        ({**SFT_SPEC, "model": "builtin:../../../etc/passwd"}, "model", "unknown built-in model"),
        ({**PPO_SPEC, "reward_model": "builtin:x"}, "reward_model", "unknown built-in model"),
        ({**SFT_SPEC, "type": "orpo"}, "type", "sft"),  # an unknown type: the message lists the known ones
        ({"type": "sft", "dataset": "builtin:reviews-sft"}, "model", "required"),
        ({**SFT_SPEC, "lora": {"r": 0}}, "lora.r", "greater than"),
        ({**SFT_SPEC, "seed": -1}, "seed", "greater than"),
        ({**PPO_SPEC, "reward_model": None}, "reward_model", "required"),
        ({**SFT_SPEC, "resources": {"queue": "inference"}}, "resources.queue", "generate requests' queue"),
        ({**SFT_SPEC, "resources": {"queue": "GPU Queue"}}, "resources.queue", "pattern"),
        ({**SFT_SPEC, "resources": {"num_processes": 0}}, "resources.num_processes", "greater than"),
        (
            {**SFT_SPEC, "hyperparameters": {"batch_size": 6}, "resources": {"num_processes": 4}},
            "hyperparameters.batch_size",
            "multiple of resources.num_processes (4)",
        ),
        (
            {
                **PPO_SPEC,
                "hyperparameters": {"batch_size": 8, "mini_batch_size": 4, "gradient_accumulation_steps": 4},
                "resources": {"num_processes": 2},
            },
            "hyperparameters.mini_batch_size",
            "num_processes × gradient_accumulation_steps (2 × 4)",
        ),
    ],
)
def test_invalid_spec_is_422_naming_the_field(
    client: TestClient, calls: Calls, spec: dict[str, Any], param: str, needle: str
) -> None:
    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 422, response.text
    error = error_of(response)
    assert (error["code"], error["param"]) == ("invalid_request", param)
    assert needle in error["message"]
    assert jobs_stored(client) == []
    assert calls.enqueued == []


def test_body_that_is_not_a_spec_object(client: TestClient) -> None:
    for content in (b"[1, 2]", b"{not json", b""):
        response = client.post("/v1/jobs", content=content, headers={"Content-Type": "application/json"})
        assert response.status_code == 422, content
        assert error_of(response)["code"] == "invalid_request"


def test_references_to_jobs(client: TestClient, settings: Settings, project: Project, db: Db, calls: Calls) -> None:
    running = db.job(project.id, status="running")
    failed = db.job(project.id, status="failed")
    cancelling = db.job(project.id, status="cancelling")
    succeeded_rm = db.job(project.id, spec=RM_SPEC, status="succeeded")
    other_project_job = db.job(new_project(settings, "other").id, status="succeeded")
    db.checkpoint(running, 4)
    cases = [
        ({**SFT_SPEC, "model": "job:job_000000000000"}, "model", "job_not_found"),
        ({**SFT_SPEC, "model": f"job:{other_project_job}"}, "model", "job_not_found"),
        ({**SFT_SPEC, "model": f"job:{failed}"}, "model", "job_not_succeeded"),
        ({**SFT_SPEC, "model": f"job:{cancelling}"}, "model", "job_not_succeeded"),
        ({**SFT_SPEC, "model": f"job:{running}@9"}, "model", "checkpoint_not_found"),
        ({**SFT_SPEC, "model": f"job:{succeeded_rm}"}, "model", "wrong_job_type"),
        ({**PPO_SPEC, "reward_model": f"job:{running}"}, "reward_model", "wrong_job_type"),
        ({**SFT_SPEC, "model": "./local/model"}, "model", "local_path_refused"),
    ]
    for spec, param, code in cases:
        response = client.post("/v1/jobs", json=spec)
        assert response.status_code == 422, (spec, response.text)
        assert (error_of(response)["code"], error_of(response)["param"]) == (code, param)
    assert {job["id"] for job in jobs_stored(client)} == {running, failed, cancelling, succeeded_rm}
    assert calls.enqueued == []
    # An explicit checkpoint of a running job, and a succeeded reward model, are fine (a running job's final
    # model makes a waiting job: tests/api/routes/test_pipelines.py).
    ok = client.post("/v1/jobs", json={**PPO_SPEC, "model": f"job:{running}@4", "reward_model": f"job:{succeeded_rm}"})
    assert ok.status_code == 201, ok.text


def test_hub_ids_the_workers_cannot_have_are_refused(client: TestClient, calls: Calls, hf_cache: Path) -> None:
    # Workers run with HF_HUB_OFFLINE=1 unless RLHF_HUB_DOWNLOADS is on: a hub id must be in the shared cache.
    for spec, param in [
        ({**SFT_SPEC, "model": "org/not-cached"}, "model"),
        ({**PPO_SPEC, "reward_model": "gpt2"}, "reward_model"),
    ]:
        response = client.post("/v1/jobs", json=spec)
        assert response.status_code == 422, response.text
        error = error_of(response)
        assert (error["code"], error["param"]) == ("hub_model_unavailable", param)
        assert "RLHF_HUB_DOWNLOADS" in error["message"]
        assert "HF_HUB_OFFLINE" in error["message"]
    assert calls.enqueued == []
    put_in_cache(hf_cache, "org/cached", {"config.json": "{}"})
    response = client.post("/v1/jobs", json={**PPO_SPEC, "model": "org/cached", "reward_model": "org/cached"})
    assert response.status_code == 201, response.text
    assert response.json()["spec"]["model"] == "org/cached"


def test_hub_ids_are_accepted_where_workers_may_download(
    settings: Settings, project: Project, calls: Calls, hf_cache: Path
) -> None:
    app = create_app(settings.model_copy(update={"hub_downloads": True}), enqueue=calls.enqueue, recovery_interval=None)
    with TestClient(app, headers=project.headers) as client:
        response = client.post("/v1/jobs", json={**PPO_SPEC, "model": "org/not-cached", "reward_model": "org/rm"})
    assert response.status_code == 201, response.text
    assert len(calls.enqueued) == 1


def test_references_to_files(client: TestClient, settings: Settings) -> None:
    def upload(rows: list[dict[str, str]], purpose: str, headers: dict[str, str] | None = None) -> str:
        files = {"file": ("d.jsonl", jsonl(rows))}
        response = client.post("/v1/files", files=files, data={"purpose": purpose}, headers=headers)
        file_id: str = response.json()["id"]
        return file_id

    sft_file = upload([{"prompt": "p", "completion": "c"}], "sft")
    ppo_file = upload([{"prompt": "p"}], "ppo")
    foreign = upload([{"prompt": "p", "completion": "c"}], "sft", new_project(settings, "other").headers)
    cases = [
        ({**SFT_SPEC, "dataset": ppo_file}, "dataset", "wrong_file_purpose"),
        ({**SFT_SPEC, "eval_dataset": ppo_file}, "eval_dataset", "wrong_file_purpose"),
        ({**SFT_SPEC, "dataset": foreign}, "dataset", "file_not_found"),
        ({**SFT_SPEC, "dataset": "file-000000000000"}, "dataset", "file_not_found"),
        ({**PPO_SPEC, "dataset": sft_file}, "dataset", "wrong_file_purpose"),
        (
            {**PPO_SPEC, "dataset": ppo_file, "hyperparameters": {"ptx_coef": 0.1, "ptx_dataset": ppo_file}},
            "hyperparameters.ptx_dataset",
            "wrong_file_purpose",
        ),
    ]
    for spec, param, code in cases:
        response = client.post("/v1/jobs", json=spec)
        assert response.status_code == 422, (spec, response.text)
        assert (error_of(response)["code"], error_of(response)["param"]) == (code, param)
    assert jobs_stored(client) == []
    assert client.post("/v1/jobs", json={**SFT_SPEC, "dataset": sft_file}).status_code == 201


def test_chat_files_need_a_model_with_a_chat_template(
    settings: Settings, project: Project, calls: Calls, hf_cache: Path, tmp_path: Path
) -> None:
    for name, template in (("plain", None), ("chatty", "{{ messages }}")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    put_in_cache(hf_cache, "org/plain", {"config.json": "{}", "tokenizer_config.json": "{}"})
    app = create_app(
        settings.model_copy(update={"model_root": tmp_path}), enqueue=calls.enqueue, recovery_interval=None
    )
    with TestClient(app, headers=project.headers) as client:
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        uploaded = client.post("/v1/files", files={"file": ("chat.jsonl", jsonl([{"messages": messages}]))},
                               data={"purpose": "sft"})  # fmt: skip
        assert uploaded.status_code == 201 and uploaded.json()["chat"] is True
        chat_file = uploaded.json()["id"]
        for model, field in (("builtin:tiny", "dataset"), ("plain", "dataset"), ("org/plain", "eval_dataset")):
            response = client.post("/v1/jobs", json={**SFT_SPEC, "model": model, field: chat_file})
            assert response.status_code == 422, response.text
            assert (error_of(response)["code"], error_of(response)["param"]) == ("chat_template_missing", field)
        assert jobs_stored(client) == []
        ok = client.post("/v1/jobs", json={**SFT_SPEC, "model": "chatty", "dataset": chat_file})
        assert ok.status_code == 201, ok.text


def test_what_cannot_fit_is_refused_at_submit(client: TestClient) -> None:
    """Sequences longer than the model's context are 422s naming the field, not jobs that hold a worker and fail
    there."""
    cases = [
        ({**SFT_SPEC, "hyperparameters": {"max_length": 1024}}, "hyperparameters.max_length"),
        ({**PPO_SPEC, "hyperparameters": {"response_length": 65536}}, "hyperparameters.response_length"),
    ]
    for spec, param in cases:
        response = client.post("/v1/jobs", json=spec)
        assert response.status_code == 422, response.text
        assert (error_of(response)["code"], error_of(response)["param"]) == ("exceeds_context", param)
    assert client.post("/v1/jobs", json={**SFT_SPEC, "hyperparameters": {"max_length": 128}}).status_code == 201


def test_idempotency_key(client: TestClient, calls: Calls, settings: Settings) -> None:
    key = {"Idempotency-Key": "retry-me"}
    first = client.post("/v1/jobs", json=SFT_SPEC, headers=key)
    again = client.post("/v1/jobs", json=SFT_SPEC, headers=key)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json() == first.json()
    # The same spec spelled with its defaults is the same spec.
    spelled = client.post("/v1/jobs", json={**SFT_SPEC, "seed": 0, "hyperparameters": {"batch_size": 32}}, headers=key)
    assert spelled.status_code == 200
    assert spelled.json()["id"] == first.json()["id"]

    different = client.post("/v1/jobs", json={**SFT_SPEC, "seed": 1}, headers=key)
    assert different.status_code == 409
    assert error_of(different) | {"message": ""} == {"code": "conflict", "param": "Idempotency-Key", "message": ""}
    assert calls.enqueued == [first.json()["id"]]
    assert len(jobs_stored(client)) == 1
    # Keys are per project, and other keys make new jobs.
    other = client.post("/v1/jobs", json=SFT_SPEC, headers={**new_project(settings, "o").headers, **key})
    assert other.status_code == 201
    assert client.post("/v1/jobs", json=SFT_SPEC, headers={"Idempotency-Key": "another"}).status_code == 201


def test_list_pages_and_filters(client: TestClient, project: Project, db: Db) -> None:
    created = [client.post("/v1/jobs", json=SFT_SPEC).json()["id"] for _ in range(4)]
    created.append(client.post("/v1/jobs", json=RM_SPEC).json()["id"])
    seen, pages, after = [], [], None
    while True:
        page = client.get("/v1/jobs", params={"limit": 2, **({"after": after} if after else {})}).json()
        pages.append((len(page["data"]), page["has_more"]))
        seen += [job["id"] for job in page["data"]]
        if not page["has_more"]:
            break
        after = page["data"][-1]["id"]
    assert pages == [(2, True), (2, True), (1, False)]
    assert sorted(seen) == sorted(created)
    full = client.get("/v1/jobs").json()
    assert [job["id"] for job in full["data"]] == seen  # pages chain into the full list, newest first
    assert [job["created_at"] for job in full["data"]] == sorted((j["created_at"] for j in full["data"]), reverse=True)

    db.status(created[0], "running")
    db.status(created[1], "failed")
    assert [j["id"] for j in client.get("/v1/jobs", params={"status": "running"}).json()["data"]] == [created[0]]
    assert [j["id"] for j in client.get("/v1/jobs", params={"type": "rm"}).json()["data"]] == [created[4]]
    queued_sft = client.get("/v1/jobs", params={"type": "sft", "status": "queued"}).json()["data"]
    assert sorted(j["id"] for j in queued_sft) == sorted(created[2:4])

    bad: list[tuple[dict[str, str | int], str]] = [
        ({"status": "done"}, "status"),
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
    ]
    for params, param in bad:
        response = client.get("/v1/jobs", params=params)
        assert response.status_code == 422
        assert error_of(response)["param"] == param


def test_job_object_reports_progress_error_and_output(client: TestClient, project: Project, db: Db) -> None:
    job_id = db.job(project.id, status="running")
    db.metrics(job_id, 3, {"loss/sft": 0.5, "lr": 0.001})
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert (job["status"], job["step"], job["latest_metrics"]) == ("running", 3, {"loss/sft": 0.5, "lr": 0.001})
    db.status(job_id, "succeeded", finished_at=crud.utcnow(), output_step=3)
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["output_model"] == f"job:{job_id}"
    assert job["finished_at"].endswith(("Z", "+00:00"))

    failed = db.job(project.id, status="failed")
    db.status(failed, "failed", error_code="out_of_memory", error_message="CUDA out of memory")
    job = client.get(f"/v1/jobs/{failed}").json()
    assert job["error"] == {"code": "out_of_memory", "message": "CUDA out of memory"}
    assert job["output_model"] is None
    assert client.get("/v1/jobs/job_000000000000").status_code == 404


# --- cancel, pause, resume ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "before", "after"),
    [
        ("cancel", "queued", "cancelled"),
        ("cancel", "paused", "cancelled"),
        ("cancel", "running", "cancelling"),
        ("cancel", "pausing", "cancelling"),
        ("cancel", "cancelling", "cancelling"),
        ("pause", "running", "pausing"),
        ("pause", "queued", "paused"),
        ("pause", "pausing", "pausing"),
        ("pause", "paused", "paused"),
        ("resume", "paused", "queued"),
    ],
)
def test_control_actions(
    client: TestClient, project: Project, db: Db, calls: Calls, action: str, before: str, after: str
) -> None:
    job_id = db.job(project.id, status=before)
    response = client.post(f"/v1/jobs/{job_id}/{action}")
    assert response.status_code == 200, response.text
    assert response.json()["status"] == after
    assert db.get(job_id).status == after
    assert calls.enqueued == ([job_id] if action == "resume" else [])
    if after == "cancelled":
        assert response.json()["finished_at"] is not None


@pytest.mark.parametrize(
    ("action", "before"),
    [
        *[("cancel", s) for s in ("succeeded", "failed", "cancelled")],
        *[("pause", s) for s in ("succeeded", "failed", "cancelled", "cancelling")],
        *[("resume", s) for s in ("queued", "running", "pausing", "succeeded", "cancelled")],
    ],
)
def test_control_actions_refused(
    client: TestClient, project: Project, db: Db, calls: Calls, action: str, before: str
) -> None:
    job_id = db.job(project.id, status=before)
    response = client.post(f"/v1/jobs/{job_id}/{action}")
    assert response.status_code == 409
    error = error_of(response)
    assert error["code"] == "conflict"
    assert before in error["message"]
    assert db.get(job_id).status == before
    assert calls.enqueued == []


def test_resume_that_cannot_be_enqueued_stays_paused(client: TestClient, project: Project, db: Db) -> None:
    def broken(_job_id: str, _queue: str) -> None:
        raise ConnectionError("broker down")

    client.app.state.enqueue = broken  # type: ignore[attr-defined]
    job_id = db.job(project.id, status="paused")
    assert client.post(f"/v1/jobs/{job_id}/resume").status_code == 503
    assert db.get(job_id).status == "paused"


def test_control_actions_record_status_events(client: TestClient, project: Project, db: Db) -> None:
    job_id = db.job(project.id, status="running")
    client.post(f"/v1/jobs/{job_id}/pause")
    db.status(job_id, "paused")  # the worker saved a checkpoint and stopped
    client.post(f"/v1/jobs/{job_id}/resume")
    client.post(f"/v1/jobs/{job_id}/cancel")
    kinds = [(e["kind"], e["message"]) for e in client.get(f"/v1/jobs/{job_id}/events").json()["data"]]
    assert kinds == [("status", s) for s in ("running", "pausing", "paused", "queued", "cancelled")]


def test_models_the_worker_could_not_use_are_refused_at_submit(
    settings: Settings, project: Project, calls: Calls, tmp_path: Path
) -> None:
    """A model folder without a tokenizer, an architecture without a sequence-classification class as a reward
    model, and a folder that does not exist: 422s naming the field, not jobs failing on a worker."""
    for name, model_type, tokenizer in (("bare", "llama", False), ("granite", "granite", True)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": model_type}))
        if tokenizer:
            (tmp_path / name / "tokenizer.json").write_text("{}")
    app = create_app(
        settings.model_copy(update={"model_root": tmp_path}), enqueue=calls.enqueue, recovery_interval=None
    )
    absent = str(tmp_path / "absent")
    cases = [
        (
            {**SFT_SPEC, "model": "bare"},
            "model",
            "tokenizer_missing",
            "no tokenizer: a model folder needs tokenizer.json",
        ),
        ({**RM_SPEC, "model": "granite"}, "model", "no_classification_head", "granite has no sequence-classification"),
        ({**PPO_SPEC, "reward_model": "granite"}, "reward_model", "no_classification_head", "architectures that do"),
        ({**SFT_SPEC, "model": absent}, "model", "model_not_found", "no such folder under the model root"),
        ({**PPO_SPEC, "reward_model": absent}, "reward_model", "model_not_found", "no such folder"),
    ]
    with TestClient(app, headers=project.headers) as client:
        for spec, param, code, needle in cases:
            response = client.post("/v1/jobs", json=spec)
            assert response.status_code == 422, response.text
            error = error_of(response)
            assert (error["code"], error["param"]) == (code, param), spec
            assert needle in error["message"] and len(error["message"]) < 400, error["message"]
        assert jobs_stored(client) == []
        assert client.post("/v1/jobs", json={**SFT_SPEC, "model": "granite"}).status_code == 201  # a policy may be


def test_a_misspelt_folder_under_the_model_root_names_the_nearest_folders(
    settings: Settings, project: Project, calls: Calls, tmp_path: Path, hf_cache: Path
) -> None:
    """Issue 39, item 3.5: ``qwen4`` under the model root is a folder's name misspelt, not a hub id to cache."""
    for name in ("qwen3", "Qwen2.5-0.5B", "llama", "team/qwen3-small"):
        (tmp_path / name).mkdir(parents=True)
    app = create_app(
        settings.model_copy(update={"model_root": tmp_path}), enqueue=calls.enqueue, recovery_interval=None
    )
    with TestClient(app, headers=project.headers) as client:
        for model, code, message in [
            ("qwen4", "hub_model_unavailable", "no folder 'qwen4' under the model root (the nearest there: 'qwen3'"),
            ("team/qwen3-smal", "hub_model_unavailable", "(the nearest there: 'team/qwen3-small')"),
            (str(tmp_path / "QWEN2.5-0.5b-x"), "model_not_found", "(the nearest there: 'Qwen2.5-0.5B')"),
            ("zzzzzz", "hub_model_unavailable", "no folder 'zzzzzz' under the model root, and 'zzzzzz' is a Hugging"),
        ]:
            error = error_of(client.post("/v1/jobs", json={**SFT_SPEC, "model": model}))
            assert (error["code"], error["param"]) == (code, "model"), error
            assert message in error["message"], error["message"]
    assert calls.enqueued == []


DISTILL_SPEC: dict[str, Any] = {
    "type": "distill",
    "model": "builtin:tiny",
    "teacher": "builtin:tiny",
    "dataset": "builtin:digits-prompts",
}


def test_a_teacher_is_named_as_a_model_is_and_must_share_its_tokenizer(
    settings: Settings, project: Project, db: Db, calls: Calls, tmp_path: Path
) -> None:
    """distill's ``teacher``: ``job:<id>`` of a policy or a folder under the model root, as ``model``; and where both
    tokenizers can be read here (the built-in one, a job's saved model, a folder's), the model's vocabulary, else a
    422 ``vocabulary_mismatch`` with the message the job would fail with on a worker."""
    build_tokenizer(tmp_path / "other")  # a byte-level BPE of its own
    (tmp_path / "same").mkdir()
    shutil.copy(TOKENIZER_FILE, tmp_path / "same" / "tokenizer.json")
    for name in ("other", "same"):
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": "gpt2"}))

    def saved_job(folder: Path) -> str:
        """A succeeded sft job whose final model is ``folder``'s."""
        job_id = db.job(project.id, status="succeeded")
        out = settings.resolved_artifacts_dir / "jobs" / job_id
        shutil.copytree(folder, out / "checkpoints" / "step-1" / "policy")
        (out / "job.json").write_text(json.dumps({"status": "succeeded", "final_step": 1}))
        db.checkpoint(job_id, 1)
        return job_id

    other_job, same_job = saved_job(tmp_path / "other"), saved_job(tmp_path / "same")
    rm_job = db.job(project.id, spec=RM_SPEC, status="succeeded")
    app = create_app(
        settings.model_copy(update={"model_root": tmp_path}), enqueue=calls.enqueue, recovery_interval=None
    )
    cases = [
        ({**DISTILL_SPEC, "teacher": "other"}, "vocabulary_mismatch"),
        ({**DISTILL_SPEC, "teacher": f"job:{other_job}"}, "vocabulary_mismatch"),
        ({**DISTILL_SPEC, "teacher": f"job:{other_job}@1"}, "vocabulary_mismatch"),
        ({**DISTILL_SPEC, "model": "other"}, "vocabulary_mismatch"),  # the built-in teacher, another student
        ({**DISTILL_SPEC, "teacher": f"job:{rm_job}"}, "wrong_job_type"),
        ({**DISTILL_SPEC, "teacher": "job:job_000000000000"}, "job_not_found"),
        ({**DISTILL_SPEC, "teacher": str(tmp_path / "absent")}, "model_not_found"),
        ({**DISTILL_SPEC, "teacher": "../other"}, "local_path_refused"),
    ]
    with TestClient(app, headers=project.headers) as client:
        for spec, code in cases:
            response = client.post("/v1/jobs", json=spec)
            assert response.status_code == 422, response.text
            error = error_of(response)
            assert (error["code"], error["param"]) == (code, "teacher"), spec
            if code == "vocabulary_mismatch":
                assert error["message"] == vocabulary_mismatch("teacher")
        assert calls.enqueued == []
        for teacher in ("builtin:tiny", "same", f"job:{same_job}"):
            response = client.post("/v1/jobs", json={**DISTILL_SPEC, "teacher": teacher})
            assert response.status_code == 201, response.text
            assert response.json()["spec"]["teacher"] == teacher
        missing = client.post("/v1/jobs", json={**DISTILL_SPEC, "teacher": None})
        assert (missing.status_code, error_of(missing)["code"]) == (422, "invalid_request")
        assert "teacher is required for distill jobs" in error_of(missing)["message"]
    assert len(calls.enqueued) == 3

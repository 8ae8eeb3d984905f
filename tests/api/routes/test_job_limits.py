"""Resource limits a job spec is checked against at submit, before any worker takes it; the bound on a project's
queued and waiting jobs, and what submitting and cancelling cost with many of them."""

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event

from api.main import create_app
from engine.spec.config import MAX_BATCH_SIZE
from jobs.store.db import engine_for
from jobs.store.settings import Settings
from tests.api.helpers import PPO_SPEC, RM_SPEC, SFT_SPEC, Calls, Db, error_of
from tests.factories import Project, new_project
from tests.models import build_model


def test_more_processes_than_the_workers_have_are_refused(client: TestClient, calls: Calls, settings: Settings) -> None:
    assert settings.max_processes == 8
    spec = {**SFT_SPEC, "hyperparameters": {"batch_size": 64}, "resources": {"num_processes": 64}}

    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 422
    error = error_of(response)
    assert (error["code"], error["param"]) == ("too_many_processes", "resources.num_processes")
    assert "RLHF_MAX_PROCESSES" in error["message"]
    assert calls.enqueued == []
    spec["resources"] = {"num_processes": 8}
    assert client.post("/v1/jobs", json=spec).status_code == 201
    # Issue 39, item 3.8: the limit first, not the batch of 4 that 16 processes do not divide
    small = {**SFT_SPEC, "hyperparameters": {"batch_size": 4}, "resources": {"num_processes": 16}}
    error = error_of(client.post("/v1/jobs", json=small))
    assert (error["code"], error["param"]) == ("too_many_processes", "resources.num_processes"), error


def test_a_vllm_job_is_refused_where_no_vllm_is_offered(settings: Settings, project: Project, calls: Calls) -> None:
    """``rollout_engine: vllm`` where the server's settings name neither ``RLHF_VLLM_PYTHON`` nor ``RLHF_VLLM_URL``:
    a 422 at submit (the settings are the workers' too), not a job that fails at its start."""
    spec = {**PPO_SPEC, "hyperparameters": {"rollout_engine": "vllm"}}
    assert settings.vllm() is None
    with TestClient(create_app(settings, enqueue=calls.enqueue, recovery_interval=None), headers=project.headers) as c:
        response = c.post("/v1/jobs", json=spec)
        assert response.status_code == 422, response.text
        error = error_of(response)
        assert (error["code"], error["param"]) == ("rollout_engine_unavailable", "hyperparameters.rollout_engine")
        assert "RLHF_VLLM_PYTHON" in error["message"] and "RLHF_VLLM_URL" in error["message"]
        assert c.post("/v1/jobs", json=PPO_SPEC).status_code == 201  # the built-in sampler needs nothing
    assert len(calls.enqueued) == 1
    offered = settings.model_copy(update={"vllm_python": "/opt/vllm/bin/python"})
    with TestClient(create_app(offered, enqueue=calls.enqueue, recovery_interval=None), headers=project.headers) as c:
        assert c.post("/v1/jobs", json=spec).status_code == 201


@contextmanager
def counted_statements(settings: Settings) -> Iterator[list[str]]:
    """The SQL statements run on the app's database meanwhile."""
    statements: list[str] = []
    engine = engine_for(settings.resolved_database_url)

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        yield statements
    finally:
        event.remove(engine, "before_cursor_execute", count)


def test_queued_and_waiting_jobs_per_project_are_bounded(settings: Settings, project: Project, db: Db) -> None:
    bounded = settings.model_copy(update={"max_pending_jobs": 3})
    calls = Calls()
    app = create_app(bounded, enqueue=calls.enqueue, recovery_interval=None)
    with TestClient(app, headers=project.headers) as client:
        first = client.post("/v1/jobs", json=SFT_SPEC, headers={"Idempotency-Key": "one"}).json()["id"]
        waiting = client.post("/v1/jobs", json={**RM_SPEC, "model": f"job:{first}"}).json()
        assert waiting["status"] == "waiting"
        pipeline = client.post("/v1/pipelines", json={"stages": {"a": SFT_SPEC, "b": SFT_SPEC}})
        assert (pipeline.status_code, error_of(pipeline)["code"]) == (429, "too_many_pending_jobs")  # 2 + 2 > 3
        assert client.post("/v1/jobs", json=SFT_SPEC).status_code == 201
        refused = client.post("/v1/jobs", json=SFT_SPEC)
        assert (refused.status_code, error_of(refused)["code"]) == (429, "too_many_pending_jobs")
        assert "RLHF_MAX_PENDING_JOBS" in error_of(refused)["message"]
        again = client.post("/v1/jobs", json=SFT_SPEC, headers={"Idempotency-Key": "one"})
        assert (again.status_code, again.json()["id"]) == (200, first)  # a retry adds nothing: not refused
        db.status(first, "running")  # started: no longer counted
        assert client.post("/v1/jobs", json=SFT_SPEC).status_code == 201
        assert client.post(f"/v1/jobs/{waiting['id']}/cancel").json()["status"] == "cancelled"
        assert client.post("/v1/jobs", json=SFT_SPEC).status_code == 201
    other = new_project(settings, "other")  # the bound is per project
    with TestClient(app, headers=other.headers) as client:
        assert client.post("/v1/jobs", json=SFT_SPEC).status_code == 201


def test_submit_and_cancel_do_not_read_every_waiting_job(
    client: TestClient, settings: Settings, project: Project, db: Db
) -> None:
    """Submitting a job that waits, and cancelling a job, touch only the jobs involved: as many statements with 2
    waiting jobs in the project as with 22."""
    running = db.job(project.id, status="running")

    def wait_for_running(count: int) -> None:
        for _ in range(count):
            db.job(project.id, spec={**RM_SPEC, "model": f"job:{running}"}, status="waiting")

    def submit_and_cancel() -> int:
        queued = db.job(project.id)
        with counted_statements(settings) as statements:
            assert client.post("/v1/jobs", json={**RM_SPEC, "model": f"job:{queued}"}).json()["status"] == "waiting"
            assert client.post(f"/v1/jobs/{queued}/cancel").json()["status"] == "cancelled"
        return len(statements)

    wait_for_running(2)
    few = submit_and_cancel()
    wait_for_running(20)
    assert submit_and_cancel() == few


@pytest.mark.parametrize(
    ("hyperparameters", "param"),
    [
        ({"epochs": True}, "hyperparameters.epochs"),  # true is not 1
        ({"batch_size": True}, "hyperparameters.batch_size"),
        ({"max_steps": False}, "hyperparameters.max_steps"),
        ({"batch_size": 65_536}, "hyperparameters.batch_size"),  # past MAX_BATCH_SIZE
        ({"batch_size": 1024}, "hyperparameters.batch_size"),  # one pass of 1024 sequences
    ],
)
def test_booleans_as_numbers_and_huge_batches_are_refused(
    client: TestClient, calls: Calls, hyperparameters: dict[str, Any], param: str
) -> None:
    response = client.post("/v1/jobs", json={**SFT_SPEC, "hyperparameters": hyperparameters})
    assert response.status_code == 422, response.text
    assert (error_of(response)["code"], error_of(response)["param"]) == ("invalid_request", param)
    assert calls.enqueued == []


def test_a_large_batch_in_micro_batches_is_accepted(client: TestClient) -> None:
    spec = {**SFT_SPEC, "hyperparameters": {"batch_size": MAX_BATCH_SIZE, "gradient_accumulation_steps": 8}}
    assert client.post("/v1/jobs", json=spec).status_code == 201
    ppo = {**PPO_SPEC, "hyperparameters": {"batch_size": 1024, "mini_batch_size": 1024}}
    refused = client.post("/v1/jobs", json=ppo)
    assert (refused.status_code, error_of(refused)["param"]) == (422, "hyperparameters.mini_batch_size")
    ppo["hyperparameters"]["gradient_accumulation_steps"] = 4
    assert client.post("/v1/jobs", json=ppo).status_code == 201


def test_a_job_whose_models_cannot_fit_its_queues_gpus_is_refused_with_the_setting_that_fits(
    settings: Settings, project: Project, tmp_path: Path
) -> None:
    """``RLHF_DEVICE_MEMORY`` declares the GPUs of queue ``train`` (4 MiB here, against the built-in model's 7.4 MiB
    full fine-tune and a local Llama's): a submit is refused with the bytes per rank and the setting that fits; that
    setting, and a queue with no memory declared, are accepted."""
    build_model("llama", tmp_path / "models" / "llama")
    memory = Settings(device_memory={"train": "4MiB", "train-small": "1MiB"}).device_memory  # as RLHF_DEVICE_MEMORY
    declared = settings.model_copy(update={"device_memory": memory, "model_root": tmp_path / "models"})
    app = create_app(declared, enqueue=Calls().enqueue, recovery_interval=None)
    with TestClient(app, headers=project.headers) as client:
        spec = {**SFT_SPEC, "hyperparameters": {"batch_size": 8}}
        refused = client.post("/v1/jobs", json=spec)
        assert refused.status_code == 422
        error = error_of(refused)
        assert (error["code"], error["param"]) == ("model_does_not_fit", "resources")
        assert "each rank would hold 1.86 MiB of weights, 1.86 MiB of gradients and 3.71 MiB of optimizer state" in (
            error["message"])  # fmt: skip
        fix = json.loads(error["message"].partition("it fits with ")[2].partition(" (")[0])
        assert fix == {"resources": {"sharding": "fsdp", "num_processes": 4}}
        assert client.post("/v1/jobs", json={**spec, **fix}).status_code == 201
        assert client.post("/v1/jobs", json={**spec, "resources": {"queue": "train-big"}}).status_code == 201
        # a local model's weights are read from its files' headers: DPO's policy and frozen reference
        llama = {**spec, "model": "llama", "type": "dpo", "dataset": "builtin:reviews-prefs",
                 "resources": {"queue": "train-small"}}  # fmt: skip
        error = error_of(client.post("/v1/jobs", json=llama))
        assert (
            error["code"] == "model_does_not_fit"
            and "1.00 MiB device as they are held (one process)" in error["message"]
        )


def test_a_hostile_safetensors_header_under_the_model_root_is_a_422_naming_the_file(
    settings: Settings, project: Project, tmp_path: Path
) -> None:
    """Issue 39, item 4.12: a weight file declaring a header of 2^63 bytes was read whole at submit (a 500)."""
    folder = build_model("llama", tmp_path / "models" / "evil")
    (folder / "model.safetensors").write_bytes((2**63).to_bytes(8, "little") + b"{}")
    memory = Settings(device_memory={"train": "4MiB"}).device_memory
    declared = settings.model_copy(update={"device_memory": memory, "model_root": tmp_path / "models"})
    app = create_app(declared, enqueue=Calls().enqueue, recovery_interval=None)
    with TestClient(app, headers=project.headers) as client:
        for spec, param in [
            ({**SFT_SPEC, "model": "evil"}, "model"),
            ({**PPO_SPEC, "reward_model": "evil"}, "reward_model"),
        ]:
            response = client.post("/v1/jobs", json=spec)
            assert response.status_code == 422, response.text
            error = error_of(response)
            assert (error["code"], error["param"]) == ("model_not_found", param)
            assert error["message"].startswith("evil/model.safetensors is not a safetensors file"), error

"""Experiment tracking through a worker (jobs/runner.py): a PPO job with TensorBoard and MLflow on shows the same
``objective/kl`` series in both as ``GET /v1/jobs/{id}/metrics``, its event files downloaded with
``GET /v1/jobs/{id}/tensorboard``; a server can switch a tracker on for every job."""

import io
import tarfile
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from jobs import runner
from jobs.store import crud, db
from jobs.store.settings import Settings
from tests.factories import Project, create_job, new_project
from tests.jobs.helpers import events, sft_spec
from tests.trackers import float32, mlflow_run_id, mlflow_series, mlflow_store, require_trackers, tensorboard_series

PPO_TRACKED: dict[str, Any] = {
    "type": "ppo",
    "model": "builtin:tiny",
    "reward": {"type": "string_check", "input": "{{ sample.output_text }}", "reference": "great", "operation": "like"},
    "dataset": "builtin:reviews-prompts",
    "hyperparameters": {
        "total_steps": 3,
        "batch_size": 8,
        "mini_batch_size": 4,
        "response_length": 8,
        "temperature": 1.0,
    },
    "checkpoint_every": 100,
    "tracking": {"tensorboard": True, "mlflow": True},
}


@pytest.fixture(autouse=True)
def trackers() -> None:
    require_trackers()


def api(settings: Settings, project: Project) -> TestClient:
    app = create_app(settings, enqueue=lambda job_id, queue: None, recovery_interval=None)
    return TestClient(app, headers=project.headers)


def run(settings: Settings, project: Project, spec: dict[str, Any]) -> str:
    job_id = create_job(settings, project.id, spec)
    assert runner.run_job(job_id, settings=settings, worker="w:1") == "succeeded"
    assert [e.message for e in events(settings, job_id) if e.kind == "warning"] == []
    return job_id


def metric_history(settings: Settings, job_id: str) -> dict[str, list[tuple[int, float]]]:
    with db.session_scope(settings.resolved_database_url) as session:
        return crud.metric_history(session, job_id=job_id, names=None, start_step=None, end_step=None, max_points=None)


def unpacked(response: Any, into: Path) -> list[str]:
    """The names in a downloaded tar.gz, unpacked into ``into``."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/gzip"
    with tarfile.open(fileobj=io.BytesIO(response.content), mode="r:gz") as tar:
        tar.extractall(into, filter="data")
        return tar.getnames()


def test_a_ppo_jobs_kl_is_the_same_in_tensorboard_mlflow_and_the_api(sqlite_settings: Settings, tmp_path: Path) -> None:
    settings, project = sqlite_settings, new_project(sqlite_settings)
    job_id = run(settings, project, PPO_TRACKED)

    with api(settings, project) as client:
        history = client.get(f"/v1/jobs/{job_id}/metrics", params={"names": "objective/kl"}).json()["data"]
        download = client.get(f"/v1/jobs/{job_id}/tensorboard")
    kl = [(point["step"], point["value"]) for point in history["objective/kl"]]
    assert [step for step, _ in kl] == [1, 2, 3] and any(value != 0 for _, value in kl)

    names = unpacked(download, tmp_path)
    assert names and all(name.startswith(f"{job_id}/events.out.tfevents.") for name in names)
    assert download.headers["content-disposition"] == f'attachment; filename="{job_id}-tensorboard.tar.gz"'
    assert tensorboard_series(tmp_path / job_id)["objective/kl"] == float32(kl)

    out = settings.resolved_artifacts_dir / "jobs" / job_id  # MLflow's store: in the job folder, no URI set
    assert mlflow_series(mlflow_store(out), mlflow_run_id(out), "objective/kl") == kl


def test_the_server_can_switch_tensorboard_on_for_every_job(sqlite_settings: Settings, tmp_path: Path) -> None:
    project = new_project(sqlite_settings)
    plain = run(sqlite_settings, project, sft_spec())
    everywhere = sqlite_settings.model_copy(update={"tracking": ["tensorboard"]})
    tracked = run(everywhere, project, sft_spec())

    with api(sqlite_settings, project) as client:
        missing = client.get(f"/v1/jobs/{plain}/tensorboard")
        download = client.get(f"/v1/jobs/{tracked}/tensorboard")
        loss = client.get(f"/v1/jobs/{tracked}/metrics", params={"names": "loss/sft"}).json()["data"]["loss/sft"]
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"
    assert "tracking.tensorboard" in missing.json()["error"]["message"]
    unpacked(download, tmp_path)
    assert tensorboard_series(tmp_path / tracked)["loss/sft"] == float32([(p["step"], p["value"]) for p in loss])


def test_a_job_in_two_processes_reaches_tensorboard_from_the_worker(sqlite_settings: Settings) -> None:
    """Rank 0 reports to the worker's callbacks over its socket (jobs/distributed.py); the tracker is one of them."""
    project = new_project(sqlite_settings)
    spec = sft_spec(hyperparameters={"batch_size": 8}, resources={"num_processes": 2}, tracking={"tensorboard": True})
    job_id = run(sqlite_settings, project, spec)
    history = metric_history(sqlite_settings, job_id)
    board = tensorboard_series(sqlite_settings.resolved_artifacts_dir / "jobs" / job_id / "tensorboard")
    assert "dist/weight_spread" in board  # reported by rank 0 only when there are several
    assert {name: board[name] for name in history} == {name: float32(points) for name, points in history.items()}

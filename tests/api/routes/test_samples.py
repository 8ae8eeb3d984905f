"""GET /v1/jobs/{id}/samples: the rollouts a job kept, a logged step at a time (the newest by default)."""

from typing import Any

from fastapi.testclient import TestClient

from tests.api.helpers import PPO_SPEC, Db, error_of
from tests.factories import Project


def samples(step: int, count: int) -> list[dict[str, Any]]:
    return [
        {"prompt": f"prompt {step}.{i}", "response": f"response {step}.{i}",
         "rewards": {"correct": float(i % 2), "total": float(i % 2)}, "kl": 0.25 * i, "length": i + 1}
        for i in range(count)
    ]  # fmt: skip


def test_samples_page_by_step_newest_first(client: TestClient, project: Project, db: Db) -> None:
    job_id = db.job(project.id, spec=PPO_SPEC, status="running")
    url = f"/v1/jobs/{job_id}/samples"
    assert client.get(url).json() == {"object": "list", "step": None, "steps": [], "reward_names": [], "data": []}
    for step in (1, 10, 20):
        db.samples(job_id, step, samples(step, 3 if step < 20 else 2))

    newest = client.get(url).json()
    assert (newest["step"], newest["steps"], newest["reward_names"]) == (20, [1, 10, 20], ["correct", "total"])
    assert newest["data"] == [
        {"position": i, "prompt": f"prompt 20.{i}", "response": f"response 20.{i}",
         "rewards": {"correct": float(i % 2), "total": float(i % 2)}, "kl": 0.25 * i, "length": i + 1}
        for i in range(2)
    ]  # fmt: skip
    first = client.get(url, params={"step": 1}).json()
    assert first["step"] == 1 and first["steps"] == [1, 10, 20]
    assert [s["prompt"] for s in first["data"]] == ["prompt 1.0", "prompt 1.1", "prompt 1.2"]


def test_a_step_without_samples_and_a_missing_job_are_404(client: TestClient, project: Project, db: Db) -> None:
    job_id = db.job(project.id, spec=PPO_SPEC, status="running")
    db.samples(job_id, 10, samples(10, 1))
    missing = client.get(f"/v1/jobs/{job_id}/samples", params={"step": 5})
    assert missing.status_code == 404
    assert error_of(missing)["param"] == "step" and "step 5" in error_of(missing)["message"]
    nowhere = client.get("/v1/jobs/job_000000000000/samples")
    assert nowhere.status_code == 404 and error_of(nowhere)["code"] == "not_found"
    bad = client.get(f"/v1/jobs/{job_id}/samples", params={"step": -1})
    assert bad.status_code == 422 and error_of(bad)["param"] == "step"

"""Resource limits a job spec is checked against at submit, before any worker takes it."""

from fastapi.testclient import TestClient

from jobs.store.settings import Settings
from tests.api.helpers import SFT_SPEC, Calls, error_of


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

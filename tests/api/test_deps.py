"""Authentication: every /v1 route needs a valid key, and sees only its own project."""

from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import update

from jobs.store.models import ApiKey, utcnow
from jobs.store.settings import Settings
from tests.api.helpers import Db, error_of
from tests.factories import Project, new_project


def test_missing_key_is_401(app: FastAPI) -> None:
    with TestClient(app) as anonymous:
        for method, path in [("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/v1/files"), ("GET", "/v1/jobs/x")]:
            response = anonymous.request(method, path)
            assert response.status_code == 401, (method, path)
            assert error_of(response)["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"


def test_wrong_or_revoked_key_is_401(app: FastAPI, settings: Settings, project: Project) -> None:
    with TestClient(app) as client:
        wrong = client.get("/v1/jobs", headers={"Authorization": "Bearer rlhf-not-a-key"})
        assert wrong.status_code == 401
        assert error_of(wrong)["code"] == "invalid_api_key"
        not_bearer = client.get("/v1/jobs", headers={"Authorization": f"Basic {project.key}"})
        assert not_bearer.status_code == 401

        assert client.get("/v1/jobs", headers=project.headers).status_code == 200
        with Db(settings).session() as session:
            session.execute(update(ApiKey).where(ApiKey.project_id == project.id).values(revoked_at=utcnow()))
        assert client.get("/v1/jobs", headers=project.headers).status_code == 401


def test_another_projects_objects_are_404(client: TestClient, settings: Settings, db: Db) -> None:
    other = new_project(settings, "other")
    job_id = db.job(other.id, status="succeeded")
    db.checkpoint(job_id, 1)
    for path in ["", "/metrics", "/events", "/checkpoints", "/stream"]:
        response = client.get(f"/v1/jobs/{job_id}{path}")
        assert response.status_code == 404, path
        assert error_of(response)["code"] == "not_found"
    for action in ["cancel", "pause", "resume"]:
        assert client.post(f"/v1/jobs/{job_id}/{action}").status_code == 404
    assert client.post(f"/v1/jobs/{job_id}/generate", json={"prompts": ["hi"]}).status_code == 404
    assert client.get("/v1/jobs").json()["data"] == []
    # ...while its owner sees it.
    assert client.get(f"/v1/jobs/{job_id}", headers=other.headers).json()["id"] == job_id

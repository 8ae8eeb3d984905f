"""The real Celery app on a real Redis broker: a created job is a message on the ``train`` queue, and a
generate request nobody answers times out as 503."""

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from api.main import create_app
from jobs.celery_app import RUN_JOB_TASK, TRAIN_QUEUE
from jobs.store.settings import Settings
from tests.api.helpers import REDIS_URL, SFT_SPEC, Db, error_of
from tests.factories import Project, make_settings
from tests.services import unavailable


@pytest.fixture
def broker() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as e:
        unavailable("Redis at 127.0.0.1:6379", e)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def redis_settings(tmp_path: Path, database_url: str, broker: redis.Redis) -> Settings:
    return make_settings(tmp_path, database_url, broker_url=REDIS_URL)


def test_created_job_goes_to_the_train_queue(redis_settings: Settings, project: Project, broker: redis.Redis) -> None:
    with TestClient(create_app(redis_settings, recovery_interval=None), headers=project.headers) as client:
        assert client.get("/readyz").status_code == 200
        response = client.post("/v1/jobs", json=SFT_SPEC)
        assert response.status_code == 201, response.text
        job_id = response.json()["id"]
    assert broker.llen(TRAIN_QUEUE) == 1
    raw = broker.lpop(TRAIN_QUEUE)
    assert isinstance(raw, bytes)
    message = json.loads(raw)
    assert message["headers"]["task"] == RUN_JOB_TASK
    args, kwargs, _ = json.loads(base64.b64decode(message["body"]))
    assert (args, kwargs) == ([job_id], {})


def test_resume_sends_the_job_again(redis_settings: Settings, project: Project, db: Db, broker: redis.Redis) -> None:
    job_id = db.job(project.id, status="paused")
    with TestClient(create_app(redis_settings, recovery_interval=None), headers=project.headers) as client:
        assert client.post(f"/v1/jobs/{job_id}/resume").json()["status"] == "queued"
    assert broker.llen(TRAIN_QUEUE) == 1


def test_unanswered_generate_is_503(redis_settings: Settings, project: Project, db: Db, broker: redis.Redis) -> None:
    job_id = db.job(project.id, status="running")
    db.checkpoint(job_id, 1)
    app = create_app(redis_settings, recovery_interval=None, generate_timeout=0.5)
    with TestClient(app, headers=project.headers) as client:
        response = client.post(f"/v1/jobs/{job_id}/generate", json={"prompts": ["a"]})
    assert response.status_code == 503
    assert error_of(response)["code"] == "unavailable"
    assert broker.llen("inference") == 1  # the request went to the inference queue; no worker took it

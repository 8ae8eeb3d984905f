"""The API recovers jobs whose worker stopped renewing its lease, and requeues them after the commit."""

import time
from datetime import timedelta

from fastapi.testclient import TestClient

from api.main import create_app
from jobs.recovery import recover_once
from jobs.store.models import utcnow
from jobs.store.settings import Settings
from tests.api.helpers import Db
from tests.factories import Project


def expired(db: Db, project: Project, status: str, attempt: int = 1) -> str:
    job_id = db.job(project.id)
    db.status(job_id, status, worker="gone", lease_until=utcnow() - timedelta(seconds=5), attempt=attempt)
    return job_id


def test_recover_once(settings: Settings, project: Project, db: Db) -> None:
    lost = expired(db, project, "running")
    out_of_attempts = expired(db, project, "running", attempt=settings.max_attempts)
    pausing = expired(db, project, "pausing")
    alive = db.job(project.id)
    db.status(alive, "running", worker="w", lease_until=utcnow() + timedelta(minutes=5))

    seen: list[tuple[str, str]] = []
    requeued = recover_once(settings, lambda job_id, _queue: seen.append((job_id, db.get(job_id).status)))
    assert lost in requeued and seen and set(seen) >= {(lost, "queued")}  # committed before it was enqueued
    assert (db.get(lost).status, db.get(lost).attempt) == ("queued", 2)
    assert (db.get(out_of_attempts).status, db.get(out_of_attempts).error_code) == ("failed", "worker_lost")
    assert db.get(pausing).status == "paused"
    assert db.get(alive).status == "running"


def test_the_app_runs_recovery_in_the_background(settings: Settings, project: Project, db: Db) -> None:
    lost = expired(db, project, "running")
    enqueued: list[str] = []
    app = create_app(settings, enqueue=lambda job_id, _queue: enqueued.append(job_id), recovery_interval=0.05)
    with TestClient(app):
        deadline = time.monotonic() + 10
        while lost not in enqueued and time.monotonic() < deadline:
            time.sleep(0.02)
    assert lost in enqueued
    assert db.get(lost).status == "queued"

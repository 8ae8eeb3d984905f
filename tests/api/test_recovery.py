"""The API recovers jobs whose worker stopped renewing its lease, and requeues them after the commit; and sends
again the queued jobs whose message was lost."""

import time
from datetime import timedelta

from fastapi.testclient import TestClient

from api.main import create_app
from jobs.recovery import recover_once, resend_once
from jobs.store import crud
from jobs.store.models import utcnow
from jobs.store.settings import Settings
from tests.api.helpers import SFT_SPEC, Calls, Db
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


def test_a_job_committed_but_never_sent_is_sent_once_per_bound(settings: Settings, project: Project, db: Db) -> None:
    """The API stopped between the commit and the send: the job is queued with no message. A sweep sends it (at
    once at a process's start; after a grace otherwise), records the send, and sends it again only once the bound
    ``resend_seconds`` has passed with no worker claiming it."""
    lost = db.job(project.id)
    sent: list[str] = []
    assert resend_once(settings, lambda job_id, _queue: sent.append(job_id)) == []  # may still be on its way
    assert resend_once(settings, lambda job_id, _queue: sent.append(job_id), unsent_grace_s=0) == [lost]
    assert sent == [lost] and db.get(lost).sent_at is not None
    assert resend_once(settings, lambda job_id, _queue: sent.append(job_id), unsent_grace_s=0) == []  # in the broker

    db.status(lost, "queued", sent_at=utcnow() - timedelta(seconds=settings.resend_seconds + 1))
    assert resend_once(settings, lambda job_id, _queue: sent.append(job_id)) == [lost]  # that message was lost too
    db.status(lost, "running", sent_at=utcnow() - timedelta(seconds=settings.resend_seconds + 1))
    assert resend_once(settings, lambda job_id, _queue: sent.append(job_id), unsent_grace_s=0) == []  # claimed
    assert sent == [lost, lost]


def test_a_refused_resend_is_tried_again(settings: Settings, project: Project, db: Db) -> None:
    lost = db.job(project.id)

    def refuse(job_id: str, queue: str) -> None:
        raise ConnectionError("the broker is down")

    assert resend_once(settings, refuse, unsent_grace_s=0) == [lost]
    assert db.get(lost).sent_at is None  # not sent: due again at the next sweep
    sent: list[str] = []
    assert resend_once(settings, lambda job_id, _queue: sent.append(job_id), unsent_grace_s=0) == [lost]
    assert sent == [lost]


def test_the_app_sends_at_start_what_a_stopped_api_left_unsent(
    settings: Settings, project: Project, db: Db, calls: Calls
) -> None:
    """A restart re-sends at once (not after a sweep interval, nor a grace) the jobs it finds lost, and not the
    jobs whose message went out."""
    lost = db.job(project.id)
    with TestClient(create_app(settings, enqueue=calls.enqueue, recovery_interval=3600), headers=project.headers) as c:
        assert calls.enqueued == [lost]
        created = c.post("/v1/jobs", json=SFT_SPEC).json()["id"]
        assert calls.enqueued == [lost, created]
    with TestClient(create_app(settings, enqueue=calls.enqueue, recovery_interval=3600)):
        assert calls.enqueued == [lost, created]  # both are in the broker


def test_an_idempotent_retry_sends_a_job_its_first_request_did_not(
    settings: Settings, project: Project, db: Db, calls: Calls, client: TestClient
) -> None:
    first = client.post("/v1/jobs", json=SFT_SPEC, headers={"Idempotency-Key": "retry-me"})
    lost_id = first.json()["id"]
    with db.session() as session:  # as if the first request had stopped after its commit, before the send
        crud.unmark_sent(session, job_ids=[lost_id])
        session.commit()
    calls.enqueued.clear()
    again = client.post("/v1/jobs", json=SFT_SPEC, headers={"Idempotency-Key": "retry-me"})
    assert (again.status_code, again.json()["id"]) == (200, lost_id)
    assert calls.enqueued == [lost_id]
    client.post("/v1/jobs", json=SFT_SPEC, headers={"Idempotency-Key": "retry-me"})
    assert calls.enqueued == [lost_id]  # sent now: a further retry sends nothing

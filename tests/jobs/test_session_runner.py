"""A session job on runner.run_job, with no client: once its heartbeats stop it ends and frees the worker, and a
cancel ends it while it waits for work."""

import re
import threading
import time
from datetime import timedelta

from sqlalchemy import update

from jobs import runner
from jobs.store import db, sessions
from jobs.store.models import SessionRequest, TrainingSession, utcnow
from jobs.store.settings import Settings
from tests.jobs.helpers import events, get_job, set_status


def session_with_a_request(settings: Settings, project_id: str, silent_s: float) -> tuple[str, str]:
    """A queued session job whose client last beat ``silent_s`` ago, with an optimizer step waiting."""
    with db.session_scope(settings.resolved_database_url) as session:
        job = sessions.create_session(session, project_id=project_id, sdk_version="0.38.0", tags=[], user_metadata={})
        request, _ = sessions.add_request(session, session_id=job.id, project_id=project_id, target=f"{job.id}:train:0",
                                          seq_id=1, kind="optim_step", payload=b"{}")  # fmt: skip
        session.execute(update(TrainingSession).where(TrainingSession.id == job.id)
                        .values(heartbeat_at=utcnow() - timedelta(seconds=silent_s)))  # fmt: skip
        return job.id, request.id


def request_of(settings: Settings, request_id: str) -> SessionRequest:
    with db.session_scope(settings.resolved_database_url) as session:
        row = session.get(SessionRequest, request_id)
        assert row is not None
        session.expunge(row)
        return row


def test_a_session_whose_heartbeats_stopped_ends_and_frees_the_worker(settings: Settings, project_id: str) -> None:
    short = settings.model_copy(update={"session_timeout_seconds": 5})
    job_id, request_id = session_with_a_request(short, project_id, silent_s=30)
    assert runner.run_job(job_id, settings=short, worker="w1") == "succeeded"
    job = get_job(short, job_id)
    assert job.worker is None and job.lease_until is None
    request = request_of(short, request_id)
    assert (request.status, request.category) == ("failed", "user")
    assert request.error is not None and re.search(r"the session ended: no heartbeat for 3\d s", request.error)
    assert any(re.fullmatch(r"session no heartbeat for 3\d s", e.message) for e in events(short, job_id))


def test_a_live_session_runs_until_cancelled(settings: Settings, project_id: str) -> None:
    job_id, request_id = session_with_a_request(settings, project_id, silent_s=0)  # beating (the default timeout)
    finished: list[str] = []
    worker = threading.Thread(target=lambda: finished.append(runner.run_job(job_id, settings=settings, worker="w1")))
    worker.start()
    deadline = time.monotonic() + 30
    while request_of(settings, request_id).status == "pending":  # the worker takes it: its model is not held
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert request_of(settings, request_id).category == "server"  # a model this worker does not hold: lost
    assert get_job(settings, job_id).status == "running" and not finished  # the session itself lives on
    set_status(settings, job_id, ("running",), "cancelling")  # what /v1/jobs/{id}/cancel does
    worker.join(timeout=30)
    assert finished == ["cancelled"]
    job = get_job(settings, job_id)
    assert job.worker is None and job.lease_until is None

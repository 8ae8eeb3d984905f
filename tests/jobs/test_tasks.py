"""The Celery tasks' own logic: registration by name, and recovery of jobs whose worker was lost."""

from typing import Any

import pytest
from celery.exceptions import Retry
from sqlalchemy.exc import OperationalError

from jobs import runner, tasks
from jobs.celery_app import GENERATE_TASK, INFERENCE_QUEUE, RECOVER_TASK, RUN_JOB_TASK, TRAIN_QUEUE, celery_app
from jobs.store import crud, db
from jobs.store.settings import Settings
from tests.factories import create_job
from tests.jobs.helpers import get_job, sft_spec


def test_tasks_are_registered_by_name_on_their_queues() -> None:
    assert {RUN_JOB_TASK, GENERATE_TASK, RECOVER_TASK} <= set(celery_app.tasks)
    run_job = celery_app.tasks[RUN_JOB_TASK]
    assert run_job.acks_late and run_job.ignore_result
    assert not celery_app.tasks[GENERATE_TASK].ignore_result
    routes = celery_app.conf.task_routes
    assert routes[RUN_JOB_TASK]["queue"] == TRAIN_QUEUE
    assert routes[GENERATE_TASK]["queue"] == INFERENCE_QUEUE


def claim_expired(settings: Settings, job_id: str, worker: str = "dead:1") -> None:
    """A worker claimed the job and vanished: its lease is already over."""
    with db.session_scope(settings.resolved_database_url) as session:
        assert crud.claim_job(session, job_id=job_id, worker=worker, lease_seconds=-1)


Sent = tuple[str, list[Any], str, str]


@pytest.fixture
def sent(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> list[Sent]:
    """Tasks sent by name, each with the job's status at the moment of sending (read in a new session) and the
    queue it was sent to."""
    calls: list[Sent] = []

    def send_task(name: str, args: list[Any], queue: str) -> None:
        calls.append((name, args, get_job(settings, args[0]).status, queue))

    monkeypatch.setattr(celery_app, "send_task", send_task)
    return calls


def test_recovery_requeues_and_enqueues_after_commit(settings: Settings, project_id: str, sent: list[Sent]) -> None:
    job_id = create_job(settings, project_id, sft_spec())
    live_id = create_job(settings, project_id, sft_spec())
    claim_expired(settings, job_id)
    with db.session_scope(settings.resolved_database_url) as session:
        assert crud.claim_job(session, job_id=live_id, worker="alive:2", lease_seconds=60)

    requeued = tasks.recover_and_enqueue(settings)

    assert job_id in requeued and live_id not in requeued
    assert (RUN_JOB_TASK, [job_id], "queued", "train") in sent  # committed before it was sent
    job = get_job(settings, job_id)
    assert (job.status, job.attempt, job.worker, job.lease_until) == ("queued", 2, None, None)
    assert get_job(settings, live_id).status == "running"


def test_recovery_fails_a_job_past_the_attempt_cap(settings: Settings, project_id: str, sent: list[Sent]) -> None:
    capped = settings.model_copy(update={"max_attempts": 2})
    job_id = create_job(settings, project_id, sft_spec())
    claim_expired(settings, job_id)
    assert job_id in tasks.recover_and_enqueue(capped)
    claim_expired(settings, job_id, "dead:2")

    assert job_id not in tasks.recover_and_enqueue(capped)

    job = get_job(settings, job_id)
    assert (job.status, job.error_code, job.attempt) == ("failed", "worker_lost", 2)
    assert [args for _, args, _, _ in sent].count([job_id]) == 1


def test_a_recovered_job_goes_back_to_its_own_queue(settings: Settings, project_id: str, sent: list[Sent]) -> None:
    job_id = create_job(settings, project_id, sft_spec(resources={"queue": "train-a100"}))
    claim_expired(settings, job_id)
    assert tasks.recover_and_enqueue(settings) == [job_id]
    assert sent == [(RUN_JOB_TASK, [job_id], "queued", "train-a100")]


def test_run_job_retries_while_the_database_is_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """The message of a queued job may be its only one: a database outage must not drop it."""
    outage = OperationalError("UPDATE jobs", {}, Exception("connection refused"))
    retries: list[tuple[BaseException, int]] = []

    def run_job(job_id: str, *, settings: Settings, worker: str) -> str:
        raise outage

    def retry(exc: BaseException, countdown: int) -> Exception:
        retries.append((exc, countdown))
        return Retry()

    monkeypatch.setattr(runner, "run_job", run_job)
    monkeypatch.setattr(tasks.run_job, "retry", retry)
    with pytest.raises(Retry):
        tasks.run_job("job_x")
    assert retries == [(outage, tasks.DB_DOWN_RETRY_S)]
    assert tasks.run_job.max_retries == tasks.DB_DOWN_RETRIES

"""The Celery tasks, registered on ``jobs.celery_app.celery_app`` by name. Thin: they take ids, read
the settings and call runner.py or inference.py, which hold the logic.

Workers also recover jobs whose worker was lost (jobs/recovery.py): once when they start (a restarted
embedded server resumes its jobs) and then every half lease from a background thread.

A worker asked to stop (SIGTERM, Ctrl-C; Celery's warm shutdown waits for the running task) tells the
runner, which stops the job after its current step with a checkpoint and hands it back to the queue; the
task then sends it again, for another worker (or this one's successor) to continue.
"""

import logging
import os
import socket
from typing import Any

from celery import Task
from celery.signals import worker_ready, worker_shutdown, worker_shutting_down
from sqlalchemy.exc import DBAPIError

from jobs import inference, joiner, recovery, runner
from jobs.celery_app import (
    GENERATE_TASK,
    JOIN_TASK,
    RECOVER_TASK,
    RUN_JOB_TASK,
    TRAIN_QUEUE,
    celery_app,
    make_celery,
    send_job,
)
from jobs.store import crud
from jobs.store.db import session_scope
from jobs.store.models import FINAL_STATUSES
from jobs.store.settings import Settings, get_settings

log = logging.getLogger(__name__)

_settings: Settings | None = None
DB_DOWN_RETRY_S = 30
DB_DOWN_RETRIES = 120
"""A training task retries for an hour while the database is unreachable."""


def configure(settings: Settings) -> None:
    """Use ``settings`` rather than the environment's, for the tasks and the app's broker and backend
    (a worker started in-process by :func:`jobs.worker.start_worker`)."""
    global _settings
    _settings = settings
    fresh = make_celery(settings).conf
    for key in (
        "broker_url",
        "result_backend",
        "broker_transport_options",
        "result_backend_transport_options",
        "visibility_timeout",
    ):
        celery_app.conf[key] = fresh.get(key)
    celery_app.set_current()


def current_settings() -> Settings:
    return _settings or get_settings()


def worker_name() -> str:
    """Who holds a job's lease: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


@celery_app.task(name=RUN_JOB_TASK, bind=True, acks_late=True, ignore_result=True, max_retries=DB_DOWN_RETRIES)
def run_job(self: Task, job_id: str) -> str:
    try:
        status = runner.run_job(job_id, settings=current_settings(), worker=worker_name())
    except DBAPIError as e:
        if not runner.is_transient(e):
            raise
        # The database is down: this message may be the only one for a queued job, so it must not be
        # dropped. (A job left running is recovered once its lease runs out.)
        log.warning("job %s: database unavailable; trying again in %d s", job_id, DB_DOWN_RETRY_S)
        raise self.retry(exc=e, countdown=DB_DOWN_RETRY_S) from e
    if status == "queued":  # handed back, or its attempt lost (committed): send it on
        with session_scope(current_settings().resolved_database_url) as session:
            job = crud.get_job(session, job_id=job_id)
            queue = crud.job_queue(job) if job is not None else TRAIN_QUEUE
        send_job(celery_app, job_id, queue)
        with session_scope(current_settings().resolved_database_url) as session:
            crud.mark_sent(session, job_ids=[job_id])
        log.info("job %s: handed back to queue %s", job_id, queue)
    if status in FINAL_STATUSES:  # jobs waiting for this one start now (or fail), not at the next sweep
        try:
            recovery.release_once(current_settings(), enqueue, [job_id])
        except Exception:
            log.exception("job %s ended; releasing the jobs waiting for it failed (the next sweep retries)", job_id)
    return status


@celery_app.task(name=JOIN_TASK, acks_late=True, ignore_result=True)
def join_job(invitation: dict[str, Any]) -> str:
    """Take part in a job across hosts that another train worker claimed (jobs/joiner.py)."""
    return joiner.join_job(invitation, settings=current_settings(), worker=worker_name())


@celery_app.task(name=GENERATE_TASK)
def generate(**kwargs: Any) -> dict[str, Any]:
    return inference.generate(**kwargs, settings=current_settings())


@celery_app.task(name=RECOVER_TASK, ignore_result=True)
def recover_expired() -> list[str]:
    return recover_and_enqueue(current_settings())


def enqueue(job_id: str, queue: str) -> None:
    """Send a job to the train workers of ``queue`` with this worker's Celery app."""
    send_job(celery_app, job_id, queue)


def recover_and_enqueue(settings: Settings) -> list[str]:
    """Requeue jobs whose lease expired, then (after the commit) send them to their train queues."""
    return recovery.recover_once(settings, enqueue)


_recovery: recovery.RecoveryThread | None = None


@worker_ready.connect
def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    global _recovery
    if getattr(sender, "app", None) is not celery_app:
        return
    settings = current_settings()
    _recovery = recovery.RecoveryThread(settings, enqueue, max(1.0, settings.lease_seconds / 2))
    _recovery.sweep(unsent_grace_s=0)  # what a stopped service left queued without a message is sent at once
    _recovery.start()


@worker_shutting_down.connect
def _on_worker_shutting_down(**_: Any) -> None:
    """Runs in the signal handler of SIGTERM, SIGINT or SIGQUIT: only sets a flag."""
    runner.stopping.set()


@worker_shutdown.connect
def _on_worker_shutdown(**_: Any) -> None:
    if _recovery is not None:
        _recovery.stop()

"""The Celery application (torch-free: the API imports it to enqueue tasks by name).

Training jobs run for hours: acks late and rejected on a lost worker so a crash redelivers the task, one
message prefetched per worker, results ignored for training (the jobs table is the truth), and a
visibility timeout longer than any job so Redis never hands a running job to a second worker, and a
worker that outlives a lost broker connection, its task included.
"""

from typing import Any

import kombu.transport.sqlalchemy
from celery import Celery

from engine.spec.config import INFERENCE_QUEUE, TRAIN_QUEUE
from jobs.store.settings import Settings, get_settings

RUN_JOB_TASK = "rlhf.run_job"
GENERATE_TASK = "rlhf.generate"
RECOVER_TASK = "rlhf.recover_expired"
JOIN_TASK = "rlhf.join_job"

# kombu's SQLAlchemy transport passes transport options to create_engine(), so its polling interval
# (1 s by default: a second of latency per message) is set on the transport class instead.
kombu.transport.sqlalchemy.Transport.polling_interval = 0.1


def make_celery(settings: Settings) -> Celery:
    app = Celery("rlhf", broker=settings.resolved_broker_url, backend=settings.resolved_result_backend)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_default_queue=TRAIN_QUEUE,
        task_routes={
            RUN_JOB_TASK: {"queue": TRAIN_QUEUE},
            RECOVER_TASK: {"queue": TRAIN_QUEUE},
            JOIN_TASK: {"queue": TRAIN_QUEUE},
            GENERATE_TASK: {"queue": INFERENCE_QUEUE},
        },
        result_expires=3600,
        broker_connection_retry_on_startup=True,
        # A lost broker connection (Redis restarting) must not end the training job running meanwhile:
        # the worker reconnects, forever, and keeps the task (Celery 6 would cancel it by default). Its
        # ack may then fail and the message come again: the claim guard makes that a no-op.
        broker_connection_retry=True,
        broker_connection_max_retries=None,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        worker_hijack_root_logger=False,
    )
    if settings.resolved_broker_url.startswith(("redis://", "rediss://")):
        timeout = {"visibility_timeout": settings.visibility_timeout_seconds}
        app.conf.broker_transport_options = timeout
        app.conf.result_backend_transport_options = timeout
        app.conf.visibility_timeout = settings.visibility_timeout_seconds
    return app


def send_job(app: Celery, job_id: str, queue: str) -> None:
    """Send job ``job_id`` to the train workers of ``queue`` (its spec's ``resources.queue``). A message for a
    queue no worker consumes waits in the broker until one starts."""
    app.send_task(RUN_JOB_TASK, args=[job_id], queue=queue)


def send_invitation(app: Celery, invitation: dict[str, Any], queue: str, expires_s: float) -> None:
    """Ask one train worker of ``queue`` to take part in a job across hosts (``jobs.distributed.Invitation``,
    as a dict); a message no worker took within ``expires_s`` is dropped (the job stopped waiting for it)."""
    app.send_task(JOIN_TASK, args=[invitation], queue=queue, expires=expires_s)


celery_app = make_celery(get_settings())

"""What the API tests (and tests/security) build requests and rows with: job specs of each type, the fakes
that stand in for the Celery workers (:class:`Calls`), rows written through ``jobs.store.crud`` the way
workers write them (:class:`Db`), and readers of the API's answers.

Settings and projects come from ``tests.factories``; the fixtures are in ``tests.api.fixtures``.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from jobs.store import crud
from jobs.store.db import session_scope
from jobs.store.models import JOB_STATUSES, Job
from jobs.store.settings import Settings

REDIS_URL = "redis://127.0.0.1:6379/15"

SFT_SPEC: dict[str, Any] = {"type": "sft", "model": "builtin:tiny", "dataset": "builtin:reviews-sft"}
RM_SPEC: dict[str, Any] = {"type": "rm", "model": "builtin:tiny", "dataset": "builtin:reviews-prefs"}
PPO_SPEC: dict[str, Any] = {
    "type": "ppo",
    "model": "builtin:tiny",
    "reward_model": "builtin:tiny",
    "dataset": "builtin:reviews-prompts",
}


@dataclass
class Calls:
    """What the app sent to the workers (the fakes that replace Celery)."""

    enqueued: list[str] = field(default_factory=list)
    queues: list[str] = field(default_factory=list)
    """The train queue of each enqueued job."""
    generated: list[dict[str, Any]] = field(default_factory=list)
    answer: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    def enqueue(self, job_id: str, queue: str) -> None:
        self.enqueued.append(job_id)
        self.queues.append(queue)

    def generate(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        self.generated.append(kwargs)
        if self.answer is not None:
            return self.answer(kwargs)
        return {"completions": [{"prompt": p, "text": " ok", "finish_reason": "stop"} for p in kwargs["prompts"]]}


# --- rows written the way workers write them ---------------------------------------------------


class Db:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def session(self) -> Any:
        return session_scope(self.settings.resolved_database_url)

    def job(self, project_id: str, spec: dict[str, Any] | None = None, status: str = "queued") -> str:
        with self.session() as session:
            job, _ = crud.create_job(session, project_id=project_id, spec=spec or dict(SFT_SPEC), idempotency_key=None)
            if status != "queued":
                set_status(session, job.id, status)
            return job.id

    def status(self, job_id: str, status: str, **values: Any) -> None:
        with self.session() as session:
            set_status(session, job_id, status, **values)

    def get(self, job_id: str) -> Job:
        with self.session() as session:
            job = crud.get_job(session, job_id=job_id)
            assert job is not None
            return job

    def metrics(self, job_id: str, step: int, metrics: dict[str, float]) -> None:
        with self.session() as session:
            crud.add_metrics(session, job_id=job_id, step=step, metrics=metrics)

    def samples(self, job_id: str, step: int, samples: list[dict[str, Any]]) -> None:
        with self.session() as session:
            crud.add_samples(session, job_id=job_id, step=step, samples=samples)

    def event(self, job_id: str, message: str, kind: str = "info", data: dict[str, Any] | None = None) -> None:
        with self.session() as session:
            crud.add_event(session, job_id=job_id, kind=kind, message=message, data=data)

    def checkpoint(self, job_id: str, step: int, kept: tuple[int, ...] = ()) -> None:
        with self.session() as session:
            path = f"jobs/{job_id}/checkpoints/step-{step}"
            crud.record_checkpoint(
                session,
                job_id=job_id,
                step=step,
                path=path,
                metrics={"loss/sft": 1.0 / step},
                kept_steps=kept,
            )


def set_status(session: Session, job_id: str, status: str, **values: Any) -> None:
    assert crud.transition(session, job_id=job_id, from_statuses=JOB_STATUSES, to=status, **values)


# --- reading the API's answers -----------------------------------------------------------------


def error_of(response: Any) -> dict[str, Any]:
    """The error envelope's body, checking its shape."""
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message", "param", "type"}, body
    status = response.status_code
    kind = "authentication_error" if status == 401 else "server_error" if status >= 500 else "invalid_request_error"
    assert body["error"]["type"] == kind, body  # OpenAI's error classes
    error: dict[str, Any] = {k: v for k, v in body["error"].items() if k != "type"}
    return error


def jsonl(rows: list[Any]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()

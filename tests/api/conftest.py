"""Fixtures of the API tests: the app on real databases (a migrated SQLite file, and a fresh PostgreSQL
database per test session), a client authorised for a fresh project per test, and helpers that write
rows through ``jobs.store.crud`` the way workers do.

PostgreSQL and Redis tests skip when the server is unreachable, except under ``CI=true``, where they fail.
"""

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from api.main import create_app
from jobs.store import crud
from jobs.store.db import engine_for, session_scope
from jobs.store.migrate import upgrade
from jobs.store.models import JOB_STATUSES, Job
from jobs.store.settings import Settings
from tests.hf_cache import use_cache
from tests.services import postgres_database

REDIS_URL = "redis://127.0.0.1:6379/15"

SFT_SPEC: dict[str, Any] = {"type": "sft", "model": "builtin:tiny", "dataset": "builtin:reviews-sft"}
RM_SPEC: dict[str, Any] = {"type": "rm", "model": "builtin:tiny", "dataset": "builtin:reviews-prefs"}
PPO_SPEC: dict[str, Any] = {
    "type": "ppo",
    "model": "builtin:tiny",
    "reward_model": "builtin:tiny",
    "dataset": "builtin:reviews-prompts",
}


@pytest.fixture(scope="session")
def postgresql_url() -> Iterator[str]:
    with postgres_database("rlhf_api_test") as url:
        yield url


@pytest.fixture(scope="session", params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if request.param == "postgresql":
        yield request.getfixturevalue("postgresql_url")
        return
    url = f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'rlhf.db'}"
    upgrade(url)
    yield url
    engine_for(url).dispose()


def make_settings(data_dir: Path, database_url: str, **overrides: Any) -> Settings:
    # Every field that matters is explicit, so RLHF_* variables of the environment cannot leak in.
    values: dict[str, Any] = {
        "data_dir": data_dir,
        "database_url": database_url,
        "broker_url": None,
        "result_backend_url": None,
        "artifacts_dir": data_dir / "artifacts",
        "model_root": None,
        "hub_downloads": False,
        **overrides,
    }
    return Settings(**values)


@pytest.fixture
def settings(tmp_path: Path, database_url: str) -> Settings:
    return make_settings(tmp_path, database_url)


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache for this test (fill it with ``tests.hf_cache.put_in_cache``)."""
    return use_cache(monkeypatch, tmp_path / "hf-cache")


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


@pytest.fixture
def calls() -> Calls:
    return Calls()


@pytest.fixture
def app(settings: Settings, calls: Calls) -> FastAPI:
    return create_app(
        settings,
        enqueue=calls.enqueue,
        generate_with=calls.generate,
        recovery_interval=None,
        poll_interval=0.02,
    )


@dataclass
class Project:
    id: str
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


def new_project(settings: Settings, name: str = "test") -> Project:
    with session_scope(settings.resolved_database_url) as session:
        project = crud.create_project(session, name=name)
        _, key = crud.create_api_key(session, project_id=project.id, name=name)
    return Project(project.id, key)


@pytest.fixture
def project(settings: Settings) -> Project:
    return new_project(settings)


@pytest.fixture
def client(app: FastAPI, project: Project) -> Iterator[TestClient]:
    """A client authorised for ``project``."""
    with TestClient(app, headers=project.headers) as client:
        yield client


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


@pytest.fixture
def db(settings: Settings) -> Db:
    return Db(settings)


def error_of(response: Any) -> dict[str, Any]:
    """The error envelope's body, checking its shape."""
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message", "param"}, body
    error: dict[str, Any] = body["error"]
    return error


def jsonl(rows: list[Any]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()

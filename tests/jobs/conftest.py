"""Fixtures for the worker side: real databases (a SQLite file, and a fresh PostgreSQL database per
session), settings pointing at them, and helpers to create and inspect job rows.

PostgreSQL and Redis tests skip when the server is unreachable, except under ``CI=true``, where they
must run.
"""

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test downloads anything


from engine.config import JobSpec
from jobs.store import crud, db, migrate
from jobs.store.models import Event, Job
from jobs.store.settings import Settings
from tests.services import postgres_database

REDIS_URL = "redis://127.0.0.1:6379/14"

SFT_SMALL = {"max_steps": 4, "batch_size": 8, "learning_rate": 1e-3}


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'rlhf.db'}"
    migrate.upgrade(url)
    return url


@pytest.fixture(scope="session")
def postgresql_url() -> Iterator[str]:
    with postgres_database("rlhf_test") as url:
        yield url


def make_settings(url: str, data_dir: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {"data_dir": data_dir, "database_url": url, "lease_seconds": 30, **overrides}
    return Settings(**values)


@pytest.fixture(params=["sqlite", "postgresql"])
def settings(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """Settings on each database; one data folder per database for the whole session."""
    url = request.getfixturevalue(f"{request.param}_url")
    data_dir = tmp_path_factory.getbasetemp() / f"data-{request.param}"
    data_dir.mkdir(exist_ok=True)
    return make_settings(url, data_dir)


@pytest.fixture
def sqlite_settings(sqlite_url: str, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    data_dir = tmp_path_factory.getbasetemp() / "data-sqlite"
    data_dir.mkdir(exist_ok=True)
    return make_settings(sqlite_url, data_dir)


@pytest.fixture
def project_id(settings: Settings) -> str:
    return new_project(settings)


def new_project(settings: Settings) -> str:
    with db.session_scope(settings.resolved_database_url) as session:
        return crud.create_project(session, name="test").id


def sft_spec(**fields: Any) -> dict[str, Any]:
    hyperparameters = {**SFT_SMALL, **fields.pop("hyperparameters", {})}
    return {
        "type": "sft",
        "model": "builtin:tiny",
        "dataset": "builtin:reviews-sft",
        "hyperparameters": hyperparameters,
        "checkpoint_every": 2,
        **fields,
    }


def create_job(settings: Settings, project_id: str, spec: dict[str, Any]) -> str:
    """A queued job, its spec validated and stored with defaults filled in, as the API does."""
    stored = JobSpec.model_validate(spec).model_dump(mode="json")
    with db.session_scope(settings.resolved_database_url) as session:
        job, _ = crud.create_job(session, project_id=project_id, spec=stored, idempotency_key=None)
        return job.id


def get_job(settings: Settings, job_id: str) -> Job:
    with db.session_scope(settings.resolved_database_url) as session:
        job = crud.get_job(session, job_id=job_id)
        assert job is not None
        return job


def set_status(settings: Settings, job_id: str, from_statuses: tuple[str, ...], to: str) -> None:
    """What the API does for cancel, pause and resume."""
    with db.session_scope(settings.resolved_database_url) as session:
        assert crud.transition(session, job_id=job_id, from_statuses=from_statuses, to=to)


def metric_series(settings: Settings, job_id: str) -> dict[str, list[int]]:
    """Steps recorded per metric name, in step order."""
    with db.session_scope(settings.resolved_database_url) as session:
        history = crud.metric_history(
            session, job_id=job_id, names=None, start_step=None, end_step=None, max_points=None
        )
    return {name: [step for step, _ in points] for name, points in history.items()}


def events(settings: Settings, job_id: str) -> list[Event]:
    with db.session_scope(settings.resolved_database_url) as session:
        rows, _ = crud.list_events(session, job_id=job_id, after=None, limit=1000)
        return rows


def status_changes(settings: Settings, job_id: str) -> list[str]:
    return [e.message for e in events(settings, job_id) if e.kind == "status"]


def checkpoint_steps(settings: Settings, job_id: str) -> list[int]:
    with db.session_scope(settings.resolved_database_url) as session:
        return [c.step for c in crud.list_checkpoints(session, job_id=job_id)]


def disk_checkpoint_steps(settings: Settings, job_id: str) -> list[int]:
    root = settings.resolved_artifacts_dir / "jobs" / job_id / "checkpoints"
    return sorted(int(p.name.removeprefix("step-")) for p in root.glob("step-*"))


def counts(series: dict[str, list[int]]) -> Counter[int]:
    """How many metric names have each number of rows."""
    return Counter(len(steps) for steps in series.values())

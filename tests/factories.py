"""Settings on a test database, and the rows every kind of test starts from, written through ``jobs.store.crud``
as the API writes them: a project with an API key, and a queued job.

    settings = make_settings(tmp_path, database_url, lease_seconds=30)
    project = new_project(settings)  # project.id, project.key, project.headers
    job_id = create_job(settings, project.id, {"type": "sft", "model": "builtin:tiny", "dataset": "..."})
"""

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine.spec.config import JobSpec
from jobs.store import crud
from jobs.store.db import session_scope
from jobs.store.settings import Settings, get_settings


def environment_settings(monkeypatch: pytest.MonkeyPatch, data_dir: Path) -> Iterator[None]:
    """For a fixture of tests that read the settings from the environment: no RLHF_* variable of it leaks in, the
    data folder is ``data_dir``, and the cached settings are dropped before and after."""
    for name in list(os.environ):
        if name.startswith("RLHF_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("RLHF_DATA_DIR", str(data_dir))
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def make_settings(data_dir: Path, database_url: str | None, **overrides: Any) -> Settings:
    """Settings on ``database_url`` (None: SQLite in ``data_dir``) with the embedded broker, nothing else set.

    Every field that matters is explicit, so RLHF_* variables of the environment cannot leak in."""
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


@dataclass
class Project:
    id: str
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


def new_project(settings: Settings, name: str = "test") -> Project:
    """A new project and an API key of it."""
    with session_scope(settings.resolved_database_url) as session:
        project = crud.create_project(session, name=name)
        _, key = crud.create_api_key(session, project_id=project.id, name=name)
    return Project(project.id, key)


def create_job(settings: Settings, project_id: str, spec: dict[str, Any]) -> str:
    """A queued job, its spec validated and stored with defaults filled in, as the API does; not sent."""
    stored = JobSpec.model_validate(spec).model_dump(mode="json")
    with session_scope(settings.resolved_database_url) as session:
        job, _ = crud.create_job(session, project_id=project_id, spec=stored, idempotency_key=None)
        return job.id

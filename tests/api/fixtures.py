"""The fixtures of the API tests, loaded by the conftest.py of tests/api and of tests/security: the app on
real databases (a migrated SQLite file, and a fresh PostgreSQL database per test session), a client authorised
for a fresh project per test, and :class:`tests.api.helpers.Db` to write rows the way workers do.

PostgreSQL tests skip when the server is unreachable, except under ``CI=true``, where they fail.
"""

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.main import create_app
from jobs.store.db import engine_for
from jobs.store.migrate import upgrade
from jobs.store.settings import Settings
from tests.api.helpers import Calls, Db
from tests.factories import Project, make_settings, new_project
from tests.hf_cache import use_cache
from tests.services import postgres_database

__all__ = ["app", "calls", "client", "database_url", "db", "hf_cache", "postgresql_url", "project", "settings"]
"""The fixtures, which a conftest.py takes with ``from tests.api.fixtures import *``."""


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


@pytest.fixture
def settings(tmp_path: Path, database_url: str) -> Settings:
    return make_settings(tmp_path, database_url)


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache for this test (fill it with ``tests.hf_cache.put_in_cache``)."""
    return use_cache(monkeypatch, tmp_path / "hf-cache")


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


@pytest.fixture
def project(settings: Settings) -> Project:
    return new_project(settings)


@pytest.fixture
def client(app: FastAPI, project: Project) -> Iterator[TestClient]:
    """A client authorised for ``project``."""
    with TestClient(app, headers=project.headers) as client:
        yield client


@pytest.fixture
def db(settings: Settings) -> Db:
    return Db(settings)

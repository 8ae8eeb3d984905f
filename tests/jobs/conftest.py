"""Fixtures for the worker side: real databases (a SQLite file, and a fresh PostgreSQL database per
session), settings pointing at them, and a project. Helpers to create and inspect job rows are in
``tests.jobs.helpers`` and ``tests.factories``.

PostgreSQL and Redis tests skip when the server is unreachable, except under ``CI=true``, where they
must run.
"""

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test downloads anything


from jobs.store import migrate
from jobs.store.settings import Settings
from tests.factories import make_settings, new_project
from tests.jobs.helpers import LEASE_SECONDS
from tests.services import postgres_database


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'rlhf.db'}"
    migrate.upgrade(url)
    return url


@pytest.fixture(scope="session")
def postgresql_url() -> Iterator[str]:
    with postgres_database("rlhf_test") as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def settings(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """Settings on each database; one data folder per database for the whole session."""
    url = request.getfixturevalue(f"{request.param}_url")
    data_dir = tmp_path_factory.getbasetemp() / f"data-{request.param}"
    data_dir.mkdir(exist_ok=True)
    return make_settings(data_dir, url, lease_seconds=LEASE_SECONDS)


@pytest.fixture
def sqlite_settings(sqlite_url: str, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    data_dir = tmp_path_factory.getbasetemp() / "data-sqlite"
    data_dir.mkdir(exist_ok=True)
    return make_settings(data_dir, sqlite_url, lease_seconds=LEASE_SECONDS)


@pytest.fixture
def project_id(settings: Settings) -> str:
    return new_project(settings).id

"""A full disk or a read-only data folder: requests answer 507 with ``disk_full`` or ``storage_not_writable`` and a
plain sentence (no SQL, no paths), and ``/readyz`` says the storage is not ready before a request meets it."""

import errno
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import event

from api.main import create_app
from api.routes import files
from jobs.store.db import engine_for
from jobs.store.migrate import upgrade
from tests.api.helpers import SFT_SPEC, Calls, error_of, jsonl
from tests.factories import Project, make_settings, new_project


@pytest.fixture
def client(app: FastAPI, project: Project) -> Iterator[TestClient]:
    """The API as a client sees it: a server error is a response, not an exception out of the app."""
    with TestClient(app, headers=project.headers, raise_server_exceptions=False) as client:
        yield client


def refuse_writes(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """Every temporary file the service creates (uploads, readiness probes) fails with ``code``."""

    def refuse(**_kwargs: object) -> tuple[int, str]:
        raise OSError(code, "refused by the test")

    monkeypatch.setattr(files.tempfile, "mkstemp", refuse)


def test_a_full_sqlite_database_answers_507(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'rlhf.db'}"
    upgrade(url)
    settings = make_settings(tmp_path, url)
    project = new_project(settings)
    engine = engine_for(url)

    @event.listens_for(engine, "connect")
    def no_new_pages(connection: object, _record: object) -> None:
        cursor = connection.cursor()  # type: ignore[attr-defined]
        pages = cursor.execute("PRAGMA page_count").fetchone()[0]
        cursor.execute(f"PRAGMA max_page_count = {pages}")  # the database may not grow: a full disk to SQLite

    engine.dispose()
    try:
        app = create_app(settings, enqueue=Calls().enqueue, recovery_interval=None)
        with TestClient(app, headers=project.headers, raise_server_exceptions=False) as client:
            statuses = []
            for _ in range(200):
                response = client.post("/v1/jobs", json={**SFT_SPEC, "metadata": {"pad": "x" * 400}})
                statuses.append(response.status_code)
                if response.status_code != 201:
                    break
            assert statuses[-1] == 507, response.text
            assert set(statuses[:-1]) <= {201}
            error = error_of(response)
            assert error["code"] == "disk_full"
            assert "SQL" not in error["message"] and "INSERT" not in error["message"]
            assert response.headers["connection"] == "close"
            assert client.get("/v1/jobs").status_code == 200  # reading still works
    finally:
        event.remove(engine, "connect", no_new_pages)
        engine.dispose()


@pytest.mark.parametrize(("code", "answer"), [(errno.EROFS, "storage_not_writable"), (errno.ENOSPC, "disk_full")])
def test_an_upload_the_disk_refuses_answers_507(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, code: int, answer: str
) -> None:
    refuse_writes(monkeypatch, code)
    upload = {"file": ("d.jsonl", jsonl([{"prompt": "a", "completion": "b"}]), "application/jsonl")}
    response = client.post("/v1/files", files=upload, data={"purpose": "sft"})
    assert response.status_code == 507, response.text
    assert error_of(response)["code"] == answer
    assert "refused by the test" not in error_of(response)["message"]


def test_readyz_reports_storage_that_is_full_or_read_only(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, database_url: str
) -> None:
    full = make_settings(tmp_path, database_url, min_free_bytes=2**62)
    with TestClient(create_app(full, recovery_interval=None)) as full_client:
        response = full_client.get("/readyz")
    assert response.status_code == 503
    assert (error_of(response)["param"], error_of(response)["message"]) == ("storage", "not ready: storage full")

    refuse_writes(monkeypatch, errno.EROFS)
    response = client.get("/readyz")
    assert response.status_code == 503
    assert error_of(response)["param"] == "storage"
    assert error_of(response)["message"] == "not ready: storage not writable"

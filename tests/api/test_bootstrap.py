"""The API key of ``rlhf serve`` (its key file) and ``rlhf keys create``."""

import stat
from pathlib import Path

from fastapi.testclient import TestClient

from api.main import create_app
from jobs.store import crud
from jobs.store.bootstrap import create_key, ensure_key_file, upgrade_database
from jobs.store.db import session_scope
from jobs.store.migrate import upgrade
from jobs.store.settings import Settings
from tests.api.helpers import SFT_SPEC
from tests.factories import make_settings


def test_the_key_file_is_written_once_then_more_keys(tmp_path: Path) -> None:
    # What rlhf serve does at every start: a key for project default in the key file, unless it holds a valid one.
    url = f"sqlite:///{tmp_path / 'rlhf.db'}"
    upgrade(url)
    settings = make_settings(tmp_path, url)
    key_file = tmp_path / "api-key"
    ensure_key_file(settings, key_file)
    key = key_file.read_text().strip()
    assert key.startswith("rlhf-")
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    ensure_key_file(settings, key_file)
    assert key_file.read_text().strip() == key  # a valid key is kept

    second = create_key(settings, "default")
    other = create_key(settings, "research")
    key_file.write_text("rlhf-not-a-key\n")
    ensure_key_file(settings, key_file)
    replaced = key_file.read_text().strip()
    assert replaced not in (key, "rlhf-not-a-key")
    with TestClient(create_app(settings, enqueue=lambda *_: None, recovery_interval=None)) as client:

        def job_ids(api_key: str) -> list[str]:
            response = client.get("/v1/jobs", headers={"Authorization": f"Bearer {api_key}"})
            assert response.status_code == 200
            return [job["id"] for job in response.json()["data"]]

        created = client.post("/v1/jobs", headers={"Authorization": f"Bearer {key}"}, json=SFT_SPEC)
        assert created.status_code == 201
        assert job_ids(key) == job_ids(second) == job_ids(replaced) == [created.json()["id"]]  # the same project
        assert job_ids(other) == []  # a project of its own


def test_the_embedded_stores_are_owner_only(tmp_path: Path) -> None:
    """The SQLite database, broker and result stores hold every project's specs, metrics and task messages:
    0600 like the uploads and the key file, also when an earlier version left one readable by all."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "broker.db").touch(mode=0o644)
    (data_dir / "broker.db").chmod(0o644)
    settings = Settings(data_dir=data_dir, database_url=None, broker_url=None, result_backend_url=None)
    upgrade_database(settings)  # what rlhf serve and rlhf db upgrade run first (rlhf api and workers prepare alike)
    with session_scope(settings.resolved_database_url) as session:
        crud.create_project(session, name="p")  # a write: SQLite in WAL mode opens its log file beside the database
        stores = ["rlhf.db", "broker.db", "results.db", *(p.name for p in data_dir.glob("*.db-*"))]
    assert "rlhf.db-wal" in stores
    assert {name: stat.S_IMODE((data_dir / name).stat().st_mode) for name in stores} == dict.fromkeys(stores, 0o600)

"""The first API key of ``rlhf serve`` and ``rlhf keys create``."""

from pathlib import Path

from fastapi.testclient import TestClient

from api.main import create_app
from jobs.store.bootstrap import create_key, ensure_default_key
from jobs.store.migrate import upgrade
from tests.api.conftest import SFT_SPEC, make_settings


def test_default_key_once_then_more_keys(tmp_path: Path) -> None:
    # A database of its own: ensure_default_key acts only on one without any project.
    url = f"sqlite:///{tmp_path / 'rlhf.db'}"
    upgrade(url)
    settings = make_settings(tmp_path, url)
    key = ensure_default_key(settings)
    assert key is not None and key.startswith("rlhf-")
    assert ensure_default_key(settings) is None

    second = create_key(settings, "default")
    other = create_key(settings, "research")
    with TestClient(create_app(settings, enqueue=lambda *_: None, recovery_interval=None)) as client:

        def job_ids(api_key: str) -> list[str]:
            response = client.get("/v1/jobs", headers={"Authorization": f"Bearer {api_key}"})
            assert response.status_code == 200
            return [job["id"] for job in response.json()["data"]]

        created = client.post("/v1/jobs", headers={"Authorization": f"Bearer {key}"}, json=SFT_SPEC)
        assert created.status_code == 201
        assert job_ids(key) == job_ids(second) == [created.json()["id"]]  # the same project
        assert job_ids(other) == []  # a project of its own

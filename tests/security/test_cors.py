"""CORS is closed by default: browsers get no Access-Control-Allow-Origin, so pages of other origins cannot read
the API's answers. ``cors_origins`` (``RLHF_CORS_ORIGINS``) opens it to the listed origins only."""

from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.main import create_app
from jobs.store.settings import Settings
from tests.factories import Project, make_settings

EVIL = "https://evil.example"
DASHBOARD = "https://dashboard.example"
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


def cors_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower().startswith("access-control-")}


def test_closed_by_default(app: FastAPI, project: Project) -> None:
    with TestClient(app, headers=project.headers) as client:
        for origin in (EVIL, DASHBOARD, "null"):
            simple = client.get("/v1/jobs", headers={"Origin": origin})
            assert simple.status_code == 200
            assert cors_headers(simple) == {}
            preflight = client.options("/v1/jobs", headers={"Origin": origin, **PREFLIGHT})
            assert cors_headers(preflight) == {}
            assert preflight.status_code == 405  # nothing answers a preflight
            assert cors_headers(client.get("/healthz", headers={"Origin": origin})) == {}


def test_listed_origins_only(tmp_path: Path, database_url: str, project: Project) -> None:
    settings = make_settings(tmp_path, database_url, cors_origins=[DASHBOARD])
    app = create_app(settings, enqueue=lambda *_: None, recovery_interval=None)
    with TestClient(app, headers=project.headers) as client:
        allowed = client.get("/v1/jobs", headers={"Origin": DASHBOARD})
        assert allowed.headers["access-control-allow-origin"] == DASHBOARD
        assert "access-control-allow-credentials" not in allowed.headers  # keys travel in a header, not cookies
        preflight = client.options("/v1/jobs", headers={"Origin": DASHBOARD, **PREFLIGHT})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == DASHBOARD
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        assert "POST" in preflight.headers["access-control-allow-methods"]

        other = client.get("/v1/jobs", headers={"Origin": EVIL})
        assert "access-control-allow-origin" not in other.headers
        refused = client.options("/v1/jobs", headers={"Origin": EVIL, **PREFLIGHT})
        assert refused.status_code == 400
        assert "access-control-allow-origin" not in refused.headers
        # CORS does not replace authentication.
        anonymous = client.get("/v1/jobs", headers={"Origin": DASHBOARD, "Authorization": ""})
        assert anonymous.status_code == 401


def test_the_setting_reads_a_json_list_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLHF_CORS_ORIGINS", f'["{DASHBOARD}", "http://localhost:3000"]')
    assert Settings().cors_origins == [DASHBOARD, "http://localhost:3000"]
    monkeypatch.delenv("RLHF_CORS_ORIGINS")
    assert Settings().cors_origins == []

"""/healthz and /readyz: readiness checks the database and the broker, and says which one failed."""

from pathlib import Path

from fastapi.testclient import TestClient

from api.main import create_app
from tests.api.helpers import error_of
from tests.factories import make_settings


def test_healthz_and_readyz(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")  # the embedded SQLite broker in the test's data folder
    assert ready.status_code == 200, ready.text
    assert ready.json() == {"status": "ok", "checks": {"database": "ok", "broker": "ok", "storage": "ok"}}


def test_readyz_names_what_is_down(tmp_path: Path, database_url: str) -> None:
    broker_down = make_settings(tmp_path, database_url, broker_url="redis://127.0.0.1:1/0")
    with TestClient(create_app(broker_down, recovery_interval=None)) as client:
        assert client.get("/healthz").status_code == 200
        response = client.get("/readyz")
        assert response.status_code == 503
        assert error_of(response)["code"] == "unavailable"
        assert error_of(response)["param"] == "broker"

    both_down = make_settings(
        tmp_path, "postgresql+psycopg://postgres@127.0.0.1:1/none", broker_url="redis://127.0.0.1:1/0"
    )
    with TestClient(create_app(both_down, recovery_interval=None)) as client:
        response = client.get("/readyz")
        assert response.status_code == 503
        assert error_of(response)["param"] == "database,broker"
        assert "database" in error_of(response)["message"]

"""Authentication: every route but the health checks (and the API's own documentation) needs a valid key; keys
are stored hashed and checked in constant time; a key never shows up in a response or a log line."""

import logging
import re
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select

from api.main import create_app
from jobs.store import crud
from jobs.store.models import ApiKey
from jobs.store.settings import Settings
from tests.api.helpers import PPO_SPEC, SFT_SPEC, Calls, Db, error_of, jsonl
from tests.factories import Project, make_settings
from tests.security.routes import DOCS, PUBLIC, TINKER, concrete, dashboard_routes, every_route


def test_the_route_table_is_what_this_file_expects(app: FastAPI) -> None:
    paths = {path for _, path in every_route(app)}
    assert paths >= PUBLIC | DOCS
    assert len(every_route(app)) >= 16  # the README's 16 operations; a new one is walked below automatically


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "Bearer rlhf-wrong-key-0123456789",
        "Bearer ",
        "Basic dXNlcjpwYXNz",
        "rlhf-no-scheme",
        "Bearer " + "x" * 5000,
    ],
)
def test_every_route_but_health_and_docs_needs_a_valid_key(app: FastAPI, authorization: str | None) -> None:
    headers = {"Authorization": authorization} if authorization is not None else {}
    with TestClient(app) as anonymous:
        protected = 0
        for method, path in every_route(app):
            tinker = path.startswith(TINKER) and path not in PUBLIC
            sent = ({"X-API-Key": authorization} if authorization is not None else {}) if tinker else headers
            response = anonymous.request(method, concrete(path), headers=sent)
            if path in PUBLIC | DOCS:
                assert response.status_code == 200, (method, path, response.text)
                continue
            protected += 1
            assert response.status_code == 401, (method, path, response.status_code, response.text)
            assert error_of(response)["code"] == "invalid_api_key"
            if tinker:  # nor does a bearer token open them (a valid one: this test's app has no project)
                assert "www-authenticate" not in response.headers
            else:
                assert response.headers["www-authenticate"] == "Bearer"
        assert protected == len(every_route(app)) - len(PUBLIC | DOCS)


def test_only_the_dashboards_static_page_and_assets_answer_without_a_key(app: FastAPI) -> None:
    with TestClient(app) as anonymous:
        for method, path in dashboard_routes(app):
            response = anonymous.request(method, path)
            assert response.status_code == 200, (method, path)
            assert response.headers["x-content-type-options"] == "nosniff"
            assert "default-src 'self'" in response.headers["content-security-policy"]
        for path in ("/static/../main.py", "/static/%2e%2e%2fmain.py", "/static/index.html", "/static/nope.js"):
            assert anonymous.get(path).status_code == 404, path
    assert not {path for _, path in every_route(app)} & {"/", "/static/{name}"}  # outside the OpenAPI document


def test_openapi_declares_bearer_auth_on_every_operation_but_health(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if path in PUBLIC:
                assert "security" not in operation, (method, path)
            else:
                scheme = "APIKeyHeader" if path.startswith(TINKER) else "HTTPBearer"
                assert operation.get("security") == [{scheme: []}], (method, path)
                assert "401" in operation["responses"], (method, path)


def test_keys_are_stored_only_hashed(settings: Settings, project: Project, db: Db) -> None:
    with db.session() as session:
        rows = list(session.scalars(select(ApiKey).where(ApiKey.project_id == project.id)))
        assert len(rows) == 1
        values = [str(getattr(rows[0], column.key)) for column in ApiKey.__table__.columns]
    assert project.key not in " ".join(values)
    assert rows[0].key_hash == crud.hash_key(project.key)
    assert rows[0].prefix == project.key[:12] and len(rows[0].prefix) < len(project.key) // 3


def test_the_accept_decision_is_a_constant_time_comparison(
    app: FastAPI, project: Project, monkeypatch: pytest.MonkeyPatch
) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = crud.hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(crud.hmac, "compare_digest", spy)
    with TestClient(app, headers=project.headers) as client:
        assert client.get("/v1/jobs").status_code == 200
        digest = crud.hash_key(project.key).encode()
        assert compared == [(digest, digest)]
        # The decision rests on that comparison: were it to say no, the key would be refused.
        monkeypatch.setattr(crud.hmac, "compare_digest", lambda a, b: False)
        assert client.get("/v1/jobs").status_code == 401


KEY_SHAPED = re.compile(r"rlhf-[A-Za-z0-9_-]{20,}")
"""Anything that looks like an API key."""


def test_a_bad_key_is_not_echoed(app: FastAPI) -> None:
    bad = "rlhf-THIS-IS-A-WRONG-KEY-abcdefghijklmnop"
    with TestClient(app) as client:
        for method, path in every_route(app):
            response = client.request(method, concrete(path), headers={"Authorization": f"Bearer {bad}"})
            assert bad not in response.text, (method, path)
            assert not any(bad in value for value in response.headers.values()), (method, path)
            assert "THIS-IS-A-WRONG-KEY" not in response.text


def test_keys_never_reach_the_logs(
    app: FastAPI, project: Project, db: Db, calls: Calls, caplog: pytest.LogCaptureFixture
) -> None:
    job_id = db.job(project.id, spec=PPO_SPEC, status="running")
    db.checkpoint(job_id, 1)

    def crash(_kwargs: dict[str, Any]) -> dict[str, Any]:
        raise RuntimeError("the inference worker crashed")  # logged with its traceback

    bad = "rlhf-another-wrong-key-0123456789abcdef"
    with caplog.at_level(logging.DEBUG), TestClient(app, headers=project.headers) as client:
        assert client.post("/v1/jobs", json=SFT_SPEC, headers={"Idempotency-Key": "k1"}).status_code == 201
        assert client.post("/v1/jobs", json={**SFT_SPEC, "seed": -1}).status_code == 422
        files = {"file": ("a.jsonl", jsonl([{"prompt": "p", "completion": "c"}]))}
        assert client.post("/v1/files", files=files, data={"purpose": "sft"}).status_code == 201
        assert client.get(f"/v1/jobs/{job_id}/metrics").status_code == 200
        assert client.get("/v1/jobs/job_000000000000").status_code == 404
        assert client.post(f"/v1/jobs/{job_id}/generate", json={"prompts": ["a"]}).status_code == 200
        calls.answer = crash
        assert client.post(f"/v1/jobs/{job_id}/generate", json={"prompts": ["a"]}).status_code == 500
        assert client.get("/v1/jobs", headers={"Authorization": f"Bearer {bad}"}).status_code == 401
    text = caplog.text + "".join(str(r.args) for r in caplog.records)
    assert "the inference worker crashed" in text  # the check is meaningful: DEBUG logs were captured
    assert any(r.levelno == logging.DEBUG for r in caplog.records)
    assert project.key not in text
    assert project.key[12:] not in text  # not even the secret part after the recorded prefix
    assert bad not in text
    assert KEY_SHAPED.search(text) is None


def test_the_public_readiness_check_reveals_no_internals(tmp_path: Path) -> None:
    settings = make_settings(
        tmp_path, "postgresql+psycopg://admin:s3cret-pw@127.0.0.1:1/none", broker_url="redis://:r3dis-pw@127.0.0.1:1/0"
    )
    with TestClient(create_app(settings, recovery_interval=None)) as anonymous:
        response = anonymous.get("/readyz")
    assert response.status_code == 503
    assert error_of(response) == {
        "code": "unavailable",
        "message": "not ready: database unreachable, broker unreachable",
        "param": "database,broker",
    }
    for secret in ("s3cret-pw", "r3dis-pw", "127.0.0.1", "admin"):
        assert secret not in response.text

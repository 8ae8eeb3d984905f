"""The Tinker-compatible API's routes without a worker: who may call, which SDK, sessions as jobs, requests stored
once per (model, seq_id), futures long-polled, and another project's sessions and models out of sight. The SDK
driving a real server is tests/tinker/test_sdk.py."""

import json
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.routes import tinker as routes
from jobs.store import sessions
from jobs.store.db import session_scope
from jobs.store.settings import Settings
from tests.api.helpers import Calls
from tests.factories import Project, new_project

SDK = {"X-Stainless-Package-Version": "0.38.0"}


def headers(project: Project) -> dict[str, str]:
    return {"X-API-Key": f"tml-{project.key}", **SDK}


@pytest.fixture
def api(app: FastAPI, project: Project) -> TestClient:
    return TestClient(app, headers=headers(project))


def session_of(api: TestClient) -> str:
    answer = api.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0",
                                                       "type": "create_session"})  # fmt: skip
    assert answer.status_code == 200, answer.text
    session_id: str = answer.json()["session_id"]
    return session_id


def create_model(api: TestClient, session_id: str, seq: int = 0) -> dict[str, Any]:
    body = {"session_id": session_id, "model_seq_id": seq, "base_model": "builtin:tiny",
            "lora_config": {"rank": 4}, "optimizer_config": {"type": "adamw"}, "type": "create_model"}  # fmt: skip
    answer = api.post("/api/v1/create_model", json=body)
    assert answer.status_code == 200, answer.text
    future: dict[str, Any] = answer.json()
    return future


def test_the_key_is_a_project_key_with_the_tml_prefix(app: FastAPI, project: Project) -> None:
    plain = TestClient(app)
    assert plain.get("/api/v1/get_server_capabilities", headers=SDK).status_code == 401
    bare = plain.get("/api/v1/get_server_capabilities", headers={"X-API-Key": project.key, **SDK})
    assert bare.status_code == 401 and "tml-" in bare.json()["error"]["message"]
    wrong = plain.get("/api/v1/get_server_capabilities", headers={"X-API-Key": "tml-nope", **SDK})
    assert wrong.status_code == 401
    ok = plain.get("/api/v1/get_server_capabilities", headers=headers(project))
    assert ok.status_code == 200
    assert {"model_name": "builtin:tiny", "trainable": True, "sampleable": True} in ok.json()["supported_models"]


def test_an_unsupported_sdk_is_told_which_versions_are(api: TestClient, project: Project) -> None:
    old = api.post("/api/v1/client/config", json={"sdk_version": "0.30.1"},
                   headers={**headers(project), "X-Stainless-Package-Version": "0.30.1"})  # fmt: skip
    assert old.status_code == 400
    assert old.json()["error"]["code"] == "unsupported_sdk"
    assert "0.30.1" in old.json()["error"]["message"] and "0.38.x" in old.json()["error"]["message"]
    config = api.post("/api/v1/client/config", json={"sdk_version": "0.38.0"})
    assert config.status_code == 200
    assert config.json()["proto_compress_fwdbwd"] is True and config.json()["custom_loss_server_side"] is False


def test_a_session_is_a_queued_job_sent_to_the_train_workers(api: TestClient, client: TestClient,
                                                            calls: Calls) -> None:  # fmt: skip
    session_id = session_of(api)
    job = client.get(f"/v1/jobs/{session_id}").json()
    assert job["type"] == "session" and job["status"] == "queued"
    assert calls.enqueued == [session_id]
    assert session_id in [j["id"] for j in client.get("/v1/jobs", params={"type": "session"}).json()["data"]]
    assert api.post("/api/v1/session_heartbeat", json={"session_id": session_id}).status_code == 200
    paused = client.post(f"/v1/jobs/{session_id}/pause")
    assert paused.status_code == 409 and "session" in paused.json()["error"]["message"]
    assert client.post(f"/v1/jobs/{session_id}/cancel").json()["status"] == "cancelled"
    assert api.post("/api/v1/session_heartbeat", json={"session_id": session_id}).status_code == 410  # ended


def test_a_request_is_stored_once_per_model_and_seq_id(api: TestClient, settings: Settings) -> None:
    session_id = session_of(api)
    future = create_model(api, session_id)
    assert future["model_id"] == f"{session_id}:train:0"
    again = create_model(api, session_id)  # the SDK's resubmission: a new idempotency key, the same request
    assert again["request_id"] == future["request_id"]
    step = {"model_id": future["model_id"], "seq_id": 1, "adam_params": {"learning_rate": 1e-3}, "type": "optim_step"}
    first = api.post("/api/v1/optim_step", json=step).json()["request_id"]
    assert api.post("/api/v1/optim_step", json=step).json()["request_id"] == first
    with session_scope(settings.resolved_database_url) as session:
        stored = sessions.pending_requests(session, session_id=session_id)
    assert [(r.kind, r.seq_id) for r in stored] == [("create_model", 0), ("optim_step", 1)]
    assert json.loads(stored[1].payload)["adam_params"]["learning_rate"] == 1e-3


def test_a_pending_future_is_held_then_tried_again_and_a_result_is_answered(
    api: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(routes, "LONG_POLL_S", 0.2)
    session_id = session_of(api)
    request_id = create_model(api, session_id)["request_id"]
    pending = api.post("/api/v1/retrieve_future", json={"request_id": request_id})
    assert pending.json() == {"type": "try_again", "request_id": request_id, "queue_state": "active"}
    with session_scope(settings.resolved_database_url) as session:
        sessions.complete_request(session, request_id=request_id, result=b'{"model_id": "m"}', result_format="json")
    done = api.post("/api/v1/retrieve_future", json={"request_id": request_id})
    assert done.json() == {"model_id": "m"}
    with session_scope(settings.resolved_database_url) as session:
        sessions.complete_request(session, request_id=request_id, result=b"x", result_format="proto")  # finished
    assert api.post("/api/v1/retrieve_future", json={"request_id": request_id}).json() == {"model_id": "m"}
    future = create_model(api, session_id, seq=1)
    with session_scope(settings.resolved_database_url) as session:
        sessions.fail_request(session, request_id=future["request_id"], error="data[0]: bad", category="user")
    failed = api.post("/api/v1/retrieve_future", json={"request_id": future["request_id"]})
    assert failed.json() == {"error": "data[0]: bad", "category": "user"}


def test_another_projects_sessions_and_models_are_not_found(api: TestClient, app: FastAPI,
                                                           settings: Settings) -> None:  # fmt: skip
    session_id = session_of(api)
    future = create_model(api, session_id)
    other = TestClient(app, headers=headers(new_project(settings, "other")))
    assert other.post("/api/v1/get_info", json={"model_id": future["model_id"]}).status_code == 404
    assert other.post("/api/v1/retrieve_future", json={"request_id": future["request_id"]}).status_code == 404
    assert other.get(f"/api/v1/training_runs/{future['model_id']}").status_code == 404
    assert other.get(f"/api/v1/sessions/{session_id}").status_code == 404
    assert other.get("/api/v1/training_runs").json()["training_runs"] == []
    heartbeat = other.post("/api/v1/session_heartbeat", json={"session_id": session_id})
    assert heartbeat.status_code == 404
    step = {"model_id": future["model_id"], "seq_id": 1, "adam_params": {}, "type": "optim_step"}
    assert other.post("/api/v1/optim_step", json=step).status_code == 404
    assert api.get(f"/api/v1/training_runs/{future['model_id']}").json()["base_model"] == "builtin:tiny"


def test_a_bad_path_or_base_model_is_a_400_naming_it(api: TestClient) -> None:
    session_id = session_of(api)
    bad = api.post("/api/v1/create_model", json={"session_id": session_id, "model_seq_id": 0,
                                                  "base_model": "../etc", "type": "create_model"})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "base_model"
    load = api.post("/api/v1/load_weights", json={"session_id": session_id, "model_seq_id": 1,
                                                   "path": "tinker://x/weights", "optimizer": True})  # fmt: skip
    assert load.status_code == 400 and "tinker://" in load.json()["error"]["message"]
    body = {"session_id": session_id, "model_seq_id": 1, "path": "tinker://x:train:0/weights/a", "optimizer": True}
    missing = api.post("/api/v1/load_weights", json=body)
    assert missing.status_code == 404
    garbage = api.post("/api/v1/forward_backward", content=b"\xff\x00garbage",
                       headers={"Content-Type": "application/x-protobuf"})  # fmt: skip
    assert garbage.status_code == 400

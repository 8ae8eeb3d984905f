"""The Tinker-compatible API's routes without a worker: who may call, which SDK, sessions as jobs, requests stored
once per (model, seq_id), futures long-polled, and another project's sessions and models out of sight. The SDK
driving a real server is tests/tinker/test_sdk.py."""

import json
import re
import time
from datetime import timedelta
from typing import Any

import pytest
import zstandard
from fastapi import FastAPI
from fastapi.testclient import TestClient
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from api.main import create_app
from api.routes import tinker as routes
from api.services import sessions as service
from jobs.store import refs, sessions
from jobs.store.db import session_scope
from jobs.store.models import utcnow
from jobs.store.settings import Settings
from tests.api.helpers import SFT_SPEC, Calls, Db
from tests.factories import Project, new_project
from tests.security.routes import PUBLIC, TINKER, every_route

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
    # a sample the client stopped waiting for is cancelled on the server (its worker stops it mid-decoding)
    assert api.post("/api/v1/client/dynamic_config", json={}).json()["sample_cancel_enabled"] is True


def test_a_session_is_a_job_queued_for_a_train_worker_once_it_has_a_model(
    api: TestClient, client: TestClient, calls: Calls
) -> None:
    session_id = session_of(api)
    job = client.get(f"/v1/jobs/{session_id}").json()
    assert job["type"] == "session" and job["status"] == "waiting"
    assert calls.enqueued == []  # no worker is held for a session with nothing to load
    create_model(api, session_id)
    job = client.get(f"/v1/jobs/{session_id}").json()
    assert (job["status"], job["model"]) == ("queued", "builtin:tiny")
    assert calls.enqueued == [session_id]
    create_model(api, session_id, seq=1)
    assert calls.enqueued == [session_id]  # queued once
    assert session_id in [j["id"] for j in client.get("/v1/jobs", params={"type": "session"}).json()["data"]]
    assert api.post("/api/v1/session_heartbeat", json={"session_id": session_id}).status_code == 200
    paused = client.post(f"/v1/jobs/{session_id}/pause")
    assert paused.status_code == 409 and "session" in paused.json()["error"]["message"]
    assert client.post(f"/v1/jobs/{session_id}/cancel").json()["status"] == "cancelled"
    assert api.post("/api/v1/session_heartbeat", json={"session_id": session_id}).status_code == 410  # ended
    closed = api.post(f"/api/v1/sessions/{session_id}/finish", json={"reason": {"type": "success"}})
    assert closed.status_code == 200  # the client's close after a cancel is no error
    assert client.get(f"/v1/jobs/{session_id}").json()["status"] == "cancelled"


def test_a_refused_base_model_ends_a_session_that_holds_nothing_else(
    api: TestClient, client: TestClient, calls: Calls
) -> None:
    """The misspelt ``base_model`` of a script's first training client: the 400 names it, and the session ends at
    once (failed, the reason as its error) without ever holding the train worker."""
    session_id = session_of(api)
    body = {"session_id": session_id, "model_seq_id": 0, "base_model": "Qwen/Qwen3-Misspelt", "type": "create_model"}
    refused = api.post("/api/v1/create_model", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "base_model"
    job = client.get(f"/v1/jobs/{session_id}").json()
    assert job["status"] == "failed" and calls.enqueued == []
    assert job["error"]["code"] == "hub_model_unavailable" and "Qwen/Qwen3-Misspelt" in job["error"]["message"]
    again = api.post("/api/v1/create_model", json={**body, "base_model": "builtin:tiny"})
    assert again.status_code == 400 and again.json()["error"]["code"] == "session_ended"

    # a session with a model already: the refusal is the request's alone
    session_id = session_of(api)
    create_model(api, session_id)
    refused = api.post("/api/v1/create_model", json={**body, "session_id": session_id, "model_seq_id": 1})
    assert refused.status_code == 400
    assert client.get(f"/v1/jobs/{session_id}").json()["status"] == "queued"


def test_a_session_names_itself_by_the_sdks_display_name(api: TestClient, client: TestClient) -> None:
    answer = api.post(
        "/api/v1/create_session",
        json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "display_name": "nightly\nsweep"},
    )
    session_id = answer.json()["session_id"]
    create_model(api, session_id)
    [job] = [j for j in client.get("/v1/jobs", params={"type": "session"}).json()["data"] if j["id"] == session_id]
    assert (job["name"], job["model"]) == ("nightly sweep", "builtin:tiny")


def test_sessions_count_among_pending_jobs_and_are_bounded_per_project(
    settings: Settings, project: Project, db: Db
) -> None:
    bounded = settings.model_copy(update={"max_pending_jobs": 3, "max_sessions_per_project": 2})
    app = create_app(bounded, enqueue=Calls().enqueue, recovery_interval=None)
    api = TestClient(app, headers=headers(project))
    first, second = session_of(api), session_of(api)
    third = api.post("/api/v1/create_session", json={"sdk_version": "0.38.0"})
    assert third.status_code == 429 and third.json()["error"]["code"] == "too_many_sessions"
    assert "RLHF_MAX_SESSIONS_PER_PROJECT" in third.json()["error"]["message"]
    db.status(first, "cancelled")
    db.job(project.id)  # a queued job: with the two sessions, the project's pending jobs are at 3
    create_model(api, second)  # queued
    session_of(api)
    pending = api.post("/api/v1/create_session", json={"sdk_version": "0.38.0"})
    assert pending.status_code == 429 and pending.json()["error"]["code"] == "too_many_pending_jobs"


def test_a_waiting_request_says_why_it_waits(
    api: TestClient, project: Project, db: Db, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(routes, "LONG_POLL_S", 0.1)
    session_id = session_of(api)
    request_id = create_model(api, session_id)["request_id"]

    def waiting() -> tuple[int, int]:
        answer = api.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
        assert (answer["type"], answer["queue_state"]) == ("try_again", "paused_capacity"), answer
        reason = re.fullmatch(
            r"no free train worker on queue 'train': (\d+) jobs? ahead of this session, (\d+) "
            r"running",
            answer["queue_state_reason"],
        )
        assert reason is not None, answer
        return int(reason.group(1)), int(reason.group(2))

    ahead, running = waiting()  # the jobs of the tests before, in this database
    other = new_project(settings, "other")
    first = db.job(other.id)  # another project's job, sent before the session
    db.status(first, "queued", sent_at=utcnow() - timedelta(hours=1))
    later = db.job(other.id)  # and one sent after it: behind it
    db.status(later, "queued", sent_at=utcnow() + timedelta(hours=1))
    assert waiting() == (ahead + 1, running)
    db.status(first, "running")
    assert waiting() == (ahead, running + 1)
    db.status(session_id, "running")  # a worker took the session: the request waits for its turn there
    active = api.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
    assert active == {"type": "try_again", "request_id": request_id, "queue_state": "active"}


def test_a_sample_past_the_work_bound_is_refused_before_it_runs(api: TestClient, settings: Settings) -> None:
    session_id = session_of(api)
    sampler = api.post(
        "/api/v1/create_sampling_session",
        json={"session_id": session_id, "sampling_session_seq_id": 0, "base_model": "builtin:tiny"},
    )
    body = {
        "sampling_session_id": sampler.json()["sampling_session_id"],
        "seq_id": 1,
        "num_samples": 256,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
        "sampling_params": {"max_tokens": 4096},
    }
    refused = api.post("/api/v1/asample", json=body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "request_too_large" and error["param"] == "sampling_params.max_tokens"
    assert "1048576 tokens" in error["message"] and "RLHF_SESSION_MAX_SAMPLE_TOKENS" in error["message"]
    assert settings.session_max_sample_tokens < 256 * 4096
    assert api.post(
        "/api/v1/asample", json={**body, "num_samples": 4, "sampling_params": {"max_tokens": 16}}
    ).is_success


def test_a_sampler_save_is_a_model_by_its_name(
    api: TestClient, client: TestClient, project: Project, db: Db, calls: Calls, settings: Settings
) -> None:
    """``job:<session>@<name>`` and ``tinker://<model>/sampler_weights/<name>`` work where ``job:<id>@<step>``
    does: a job's model, the OpenAI endpoints' model."""
    session_id = session_of(api)
    model_id = create_model(api, session_id)["model_id"]
    db.checkpoint(session_id, 1)
    with db.session() as session:
        sessions.add_checkpoint(
            session,
            session_id=session_id,
            project_id=project.id,
            model_id=model_id,
            kind="sampler_weights",
            name="sft-v1.2",
            path=f"jobs/{session_id}/checkpoints/step-1/policy",
            step=1,
            size_bytes=1,
        )
    names = (f"job:{session_id}@sft-v1.2", f"tinker://{model_id}/sampler_weights/sft-v1.2")
    for name in names:
        with db.session() as session:
            resolved = refs.resolve_model(session, project_id=project.id, ref=name, settings=settings, param="model")
        assert resolved == str(settings.resolved_artifacts_dir / f"jobs/{session_id}/checkpoints/step-1")
        chat = client.post(
            "/v1/chat/completions", json={"model": name, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert chat.status_code == 200, chat.text
        assert (calls.generated[-1]["job_id"], calls.generated[-1]["step"]) == (session_id, 1)
        job = client.post("/v1/jobs", json={**SFT_SPEC, "model": name})
        assert job.status_code == 201, job.text
    missing = client.post("/v1/jobs", json={**SFT_SPEC, "model": f"job:{session_id}@sft-v2"})
    assert missing.status_code == 422 and missing.json()["error"]["code"] == "checkpoint_not_found"
    chat = client.post(
        "/v1/chat/completions",
        json={"model": f"job:{session_id}@sft-v2", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 404 and "sft-v2" in chat.json()["error"]["message"]


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
    assert pending.json()["type"] == "try_again" and pending.json()["request_id"] == request_id
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


def test_every_tinker_route_keeps_another_projects_sessions_models_and_weights_out_of_sight(
    api: TestClient, app: FastAPI, project: Project, settings: Settings
) -> None:
    """The Tinker routes' isolation walk (tests/security/test_isolation.py walks the bearer-token routes): another
    project's key, given this project's session, model, sampler, request and saved weights by their ids, gets 404 or
    an empty list from every route, and changes nothing."""
    session_id = session_of(api)
    future = create_model(api, session_id)
    model_id, request_id = future["model_id"], future["request_id"]
    sampler = api.post("/api/v1/create_sampling_session", json={"session_id": session_id, "sampling_session_seq_id": 0,
                                                                "base_model": "builtin:tiny"})  # fmt: skip
    sampler_id = sampler.json()["sampling_session_id"]
    with session_scope(settings.resolved_database_url) as session:
        for kind in ("weights", "sampler_weights", "external_weights"):
            folder = settings.resolved_artifacts_dir / "jobs" / session_id / kind / "0" / "a"
            folder.mkdir(parents=True)
            (folder / "config.json").write_text("{}")
            sessions.add_checkpoint(
                session,
                session_id=session_id,
                project_id=project.id,
                model_id=model_id,
                kind=kind,
                name="a",
                path=f"jobs/{session_id}/{kind}/0/a",
                step=None,
                size_bytes=2,
            )
    weights, sampler_weights = f"tinker://{model_id}/weights/a", f"tinker://{model_id}/sampler_weights/a"
    fwdbwd = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[types.Datum(
            model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3]})],
            loss_fn="cross_entropy"),
        model_id=model_id, seq_id=1,
    )).SerializeToString()  # fmt: skip
    # fmt: off
    hidden = {  # (method, path): the call, with this project's ids
        ("POST", "/api/v1/session_heartbeat"): {"json": {"session_id": session_id}},
        ("POST", "/api/v1/sessions/{session_id}/finish"): {"json": {"reason": {"type": "success"}}},
        ("GET", "/api/v1/sessions/{session_id}"): {},
        ("POST", "/api/v1/create_model"): {"json": {"session_id": session_id, "model_seq_id": 5,
                                                    "base_model": "builtin:tiny"}},
        ("POST", "/api/v1/get_info"): {"json": {"model_id": model_id}},
        ("POST", "/api/v1/forward_backward"): {"content": fwdbwd,
                                               "headers": {"Content-Type": "application/x-protobuf"}},
        ("POST", "/api/v1/optim_step"): {"json": {"model_id": model_id, "seq_id": 1, "adam_params": {}}},
        ("POST", "/api/v1/save_weights"): {"json": {"model_id": model_id, "seq_id": 1, "path": "b"}},
        ("POST", "/api/v1/save_weights_for_sampler"): {"json": {"model_id": model_id, "seq_id": 1, "path": "b"}},
        ("POST", "/api/v1/load_weights"): {"json": {"path": weights, "session_id": session_id, "model_seq_id": 5}},
        ("POST", "/api/v1/create_sampling_session"): {"json": {"session_id": session_id, "sampling_session_seq_id": 5,
                                                               "model_path": sampler_weights}},
        ("GET", "/api/v1/samplers/{sampler_id}"): {},
        ("POST", "/api/v1/asample"): {"json": {"sampling_session_id": sampler_id, "seq_id": 1, "prompt": {"chunks": []},
                                               "sampling_params": {}}},
        ("POST", "/api/v1/retrieve_future"): {"json": {"request_id": request_id}},
        ("POST", "/api/v1/cancel_future"): {"json": {"request_id": request_id}},
        ("GET", "/api/v1/training_runs/{run_id}"): {},
        ("GET", "/api/v1/training_runs/{run_id}/checkpoints"): {},
        ("DELETE", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}"): {},
        ("POST", "/api/v1/weights_info"): {"json": {"tinker_path": weights}},
        ("POST", "/api/v1/save_weights_external"): {"json": {"model_id": model_id, "seq_id": 1, "path": "b"}},
        ("GET", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls"): {},
        ("PUT", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl"): {"json": {"ttl_seconds": 3600}},
        ("GET", "/api/v1/training_runs/{run_id}/checkpoints/external_weights/{name}/files/{file}"): {},
    }
    # fmt: on
    listing = {
        ("GET", "/api/v1/sessions"): "sessions",
        ("GET", "/api/v1/training_runs"): "training_runs",
        ("GET", "/api/v1/checkpoints"): "checkpoints",
    }
    project_free = {  # no project's data: the server's own description, or the caller's new session
        ("POST", "/api/v1/client/config"): {"json": {"sdk_version": "0.38.0"}},
        ("POST", "/api/v1/client/dynamic_config"): {"json": {}},
        ("GET", "/api/v1/get_server_capabilities"): {},
        ("POST", "/api/v1/telemetry"): {"json": {}},
        ("POST", "/api/v1/create_session"): {"json": {"sdk_version": "0.38.0"}},
    }
    ids = {
        "{session_id}": session_id,
        "{sampler_id}": sampler_id,
        "{run_id}": model_id,
        "{kind}": "weights",
        "{name}": "a",
        "{file}": "config.json",
    }
    other = TestClient(app, headers=headers(new_project(settings, "other")))
    walked = set()
    for route in [*hidden, *listing, *project_free]:
        method, path = route
        for placeholder, value in ids.items():
            path = path.replace(placeholder, value)
        answer = other.request(method, path, **hidden.get(route, project_free.get(route, {})))
        walked.add(route)
        if route in hidden:
            assert answer.status_code == 404, (route, answer.text)
        else:
            assert answer.status_code == 200, (route, answer.text)
            for owned in (session_id, model_id, sampler_id, request_id):
                assert owned not in answer.text, (route, answer.text)
            if route in listing:
                assert answer.json()[listing[route]] == [], route
    tinker_routes = {(m, p) for m, p in every_route(app) if p.startswith(TINKER) and p not in PUBLIC}
    assert walked == tinker_routes  # a new route is walked here too

    # and nothing of this project changed
    assert api.post("/api/v1/session_heartbeat", json={"session_id": session_id}).status_code == 200
    listed = api.get(f"/api/v1/training_runs/{model_id}/checkpoints").json()["checkpoints"]
    assert sorted(c["checkpoint_id"] for c in listed) == ["external_weights/a", "sampler_weights/a", "weights/a"]
    mine = api.get(f"/api/v1/training_runs/{model_id}/checkpoints/external_weights/a/files/config.json")
    assert (mine.status_code, mine.content) == (200, b"{}")  # what the other key was refused is there
    with session_scope(settings.resolved_database_url) as session:
        assert [(r.kind, r.seq_id) for r in sessions.pending_requests(session, session_id=session_id)] == [
            ("create_model", 0)
        ]


def test_weights_named_only_by_dots_are_refused_and_a_delete_removes_its_checkpoint_alone(
    api: TestClient, project: Project, settings: Settings
) -> None:
    session_id = session_of(api)
    model_id = create_model(api, session_id)["model_id"]
    for seq_id, name in enumerate((".", "..", "...", "a/b", ""), start=1):
        for route in ("save_weights", "save_weights_for_sampler"):
            refused = api.post(f"/api/v1/{route}", json={"model_id": model_id, "seq_id": seq_id, "path": name})
            assert refused.status_code in (400, 422) and refused.json()["error"]["param"] == "path", refused.text
    # rows an earlier version let in: ".." stood for the folder of every model's saved weights
    weights = settings.resolved_artifacts_dir / "jobs" / session_id / "weights"
    for folder in (weights / "0" / "mine", weights / "1" / "theirs"):
        folder.mkdir(parents=True)
        (folder / "state.pt").write_bytes(b"w")
    with session_scope(settings.resolved_database_url) as session:
        for name, path in (("mine", "0/mine"), ("..", "0/.."), ("theirs", "1/theirs")):
            sessions.add_checkpoint(
                session,
                session_id=session_id,
                project_id=project.id,
                model_id=model_id,
                kind="weights",
                name=name,
                path=f"jobs/{session_id}/weights/{path}",
                step=None,
                size_bytes=1,
            )
    assert api.delete(f"/api/v1/training_runs/{model_id}/checkpoints/weights/%2E%2E").status_code == 200
    assert (weights / "0" / "mine" / "state.pt").exists() and (weights / "1" / "theirs" / "state.pt").exists()
    assert api.delete(f"/api/v1/training_runs/{model_id}/checkpoints/weights/mine").status_code == 200
    assert not (weights / "0" / "mine").exists() and (weights / "1" / "theirs" / "state.pt").exists()
    listed = api.get(f"/api/v1/training_runs/{model_id}/checkpoints").json()["checkpoints"]
    assert [c["checkpoint_id"] for c in listed] == ["weights/theirs"]


def test_integers_past_their_range_and_sampling_params_of_the_wrong_type_are_4xx_naming_the_field(
    api: TestClient,
) -> None:
    session_id = session_of(api)
    model_id = create_model(api, session_id)["model_id"]
    sampler = api.post(
        "/api/v1/create_sampling_session",
        json={"session_id": session_id, "sampling_session_seq_id": 0, "base_model": "builtin:tiny"},
    )
    sampler_id = sampler.json()["sampling_session_id"]
    huge = 2**63
    calls = [
        ("/api/v1/optim_step", {"model_id": model_id, "seq_id": huge, "adam_params": {}}, "seq_id"),
        ("/api/v1/save_weights", {"model_id": model_id, "seq_id": huge, "path": "a"}, "seq_id"),
        (
            "/api/v1/create_model",
            {"session_id": session_id, "model_seq_id": huge, "base_model": "builtin:tiny"},
            "model_seq_id",
        ),
        (
            "/api/v1/asample",
            {"sampling_session_id": sampler_id, "seq_id": huge, "prompt": {"chunks": []}, "sampling_params": {}},
            "seq_id",
        ),
    ]
    for field, value in (
        ("max_tokens", "many"),
        ("temperature", "hot"),
        ("seed", 2**64),
        ("stop", {"a": 1}),
        ("top_k", [1]),
        ("top_p", "x"),
        ("max_tokens", huge),
    ):
        body = {
            "sampling_session_id": sampler_id,
            "seq_id": 1,
            "prompt": {"chunks": []},
            "sampling_params": {field: value},
        }
        calls.append(("/api/v1/asample", body, f"sampling_params.{field}"))
    for path, body, field in calls:
        answer = api.post(path, json=body)
        assert 400 <= answer.status_code < 500, (path, body, answer.text)
        assert answer.json()["error"]["param"] == field, (path, body, answer.text)
    for path in ("/api/v1/training_runs", "/api/v1/checkpoints", "/api/v1/sessions"):
        answer = api.get(path, params={"offset": huge})
        assert 400 <= answer.status_code < 500 and answer.json()["error"]["param"] == "offset", (path, answer.text)
        assert api.get(path, params={"limit": huge}).status_code == 200  # a limit past the page size is the page


def fwdbwd_body(model_id: str, seq_id: int, data: list[types.Datum]) -> Any:
    """The SDK's protobuf of a forward_backward of ``data`` (a message, to change before it is serialized)."""
    return forward_backward_request_to_proto(
        types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
            model_id=model_id,
            seq_id=seq_id,
        )
    )


def a_datum(n: int = 3) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(list(range(1, n + 1))),
        loss_fn_inputs={"target_tokens": list(range(2, n + 2)), "weights": [1.0] * n},
    )


def test_a_forward_backward_past_the_dense_element_budget_is_refused_before_it_is_stored(
    settings: Settings, project: Project, calls: Calls
) -> None:
    bounded = settings.model_copy(update={"session_max_datum_elements": 100, "session_max_request_elements": 250})
    api = TestClient(create_app(bounded, enqueue=calls.enqueue, recovery_interval=None), headers=headers(project))
    session_id = session_of(api)
    model_id = create_model(api, session_id)["model_id"]
    proto = {"Content-Type": "application/x-protobuf"}
    fits = fwdbwd_body(model_id, 1, [a_datum(30)] * 2)  # 90 elements a datum, 180 in all
    assert api.post("/api/v1/forward_backward", content=fits.SerializeToString(), headers=proto).status_code == 200
    too_many = fwdbwd_body(model_id, 2, [a_datum(30)] * 3)  # 270 in all
    refused = api.post("/api/v1/forward_backward", content=too_many.SerializeToString(), headers=proto)
    assert (refused.status_code, refused.json()["error"]["code"]) == (413, "request_too_large")
    assert "RLHF_SESSION_MAX_REQUEST_ELEMENTS" in refused.json()["error"]["message"]
    # the probe's body: 16 empty sparse int64 tensors of shape (1, 2^26), 512 MiB apiece once dense
    sparse = fwdbwd_body(model_id, 2, [a_datum()])
    for name in [f"extra{i}" for i in range(16)]:
        tensor = sparse.data[0].loss_fn_inputs[name]
        tensor.dtype, tensor.shape[:] = 2, [1, 1 << 26]
        tensor.sparse_csr.crow_indices = b"\x00" * 16
    body = sparse.SerializeToString()
    assert len(body) < 1024
    refused = api.post("/api/v1/forward_backward", content=body, headers=proto)
    assert (refused.status_code, refused.json()["error"]["code"]) == (413, "request_too_large")
    assert "data[0]" in refused.json()["error"]["message"]
    assert "RLHF_SESSION_MAX_DATUM_ELEMENTS" in refused.json()["error"]["message"]
    with session_scope(settings.resolved_database_url) as session:
        stored = sessions.pending_requests(session, session_id=session_id)
    assert [(r.kind, r.seq_id) for r in stored] == [("create_model", 0), ("forward_backward", 1)]


def test_forward_backward_bodies_are_bounded_decompressed_and_kept_compressed(
    settings: Settings, project: Project, calls: Calls
) -> None:
    bounded = settings.model_copy(update={"session_max_body_bytes": 64 * 1024})
    api = TestClient(create_app(bounded, enqueue=calls.enqueue, recovery_interval=None), headers=headers(project))
    session_id = session_of(api)
    model_id = create_model(api, session_id)["model_id"]
    zstd = {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}
    bomb = zstandard.ZstdCompressor().compress(b"\x00" * (16 * 1024 * 1024))  # a few KB, 16 MiB inside
    assert len(bomb) < 4096
    refused = api.post("/api/v1/forward_backward", content=bomb, headers=zstd)
    assert (refused.status_code, refused.json()["error"]["code"]) == (413, "request_too_large")
    assert "RLHF_SESSION_MAX_BODY_BYTES" in refused.json()["error"]["message"]
    plain = fwdbwd_body(model_id, 1, [a_datum(200)] * 8).SerializeToString()
    compressed = zstandard.ZstdCompressor().compress(fwdbwd_body(model_id, 2, [a_datum(200)] * 8).SerializeToString())
    assert api.post("/api/v1/forward_backward", content=plain, headers={"Content-Type": "application/x-protobuf"})
    assert api.post("/api/v1/forward_backward", content=compressed, headers=zstd).status_code == 200
    with session_scope(settings.resolved_database_url) as session:
        stored = {r.seq_id: r.payload for r in sessions.pending_requests(session, session_id=session_id)}
    assert stored[2] == compressed  # as the client sent it
    assert len(stored[1]) < len(plain) // 4 and zstandard.ZstdDecompressor().decompress(stored[1]) == plain


def test_the_requests_a_session_has_waiting_are_bounded(settings: Settings, project: Project, calls: Calls) -> None:
    bounded = settings.model_copy(update={"session_max_pending_requests": 2})
    api = TestClient(create_app(bounded, enqueue=calls.enqueue, recovery_interval=None), headers=headers(project))
    session_id = session_of(api)
    future = create_model(api, session_id)
    step = {"model_id": future["model_id"], "adam_params": {"learning_rate": 1e-3}}
    first = api.post("/api/v1/optim_step", json={**step, "seq_id": 1})
    assert first.status_code == 200
    refused = api.post("/api/v1/optim_step", json={**step, "seq_id": 2})
    assert (refused.status_code, refused.json()["error"]["code"]) == (429, "too_many_pending_requests")
    assert "RLHF_SESSION_MAX_PENDING_REQUESTS" in refused.json()["error"]["message"]
    again = api.post("/api/v1/optim_step", json={**step, "seq_id": 1})  # the SDK's resend is the same request
    assert (again.status_code, again.json()["request_id"]) == (200, first.json()["request_id"])
    with session_scope(settings.resolved_database_url) as session:
        sessions.complete_request(session, request_id=future["request_id"], result=b"{}", result_format="json")
    assert api.post("/api/v1/optim_step", json={**step, "seq_id": 2}).status_code == 200


def test_external_weights_download_by_urls_this_server_signs_until_they_expire(
    api: TestClient, app: FastAPI, project: Project, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    session_id = session_of(api)
    model_id = create_model(api, session_id)["model_id"]
    folder = settings.resolved_artifacts_dir / "jobs" / session_id / "external_weights" / "0" / "final"
    files = {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"\x01" * 3000, "sub/x.txt": b"x"}
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    (folder / "link").symlink_to(folder / "adapter_config.json")  # never served
    checkpoint = {
        "session_id": session_id,
        "project_id": project.id,
        "model_id": model_id,
        "kind": "external_weights",
        "name": "final",
        "path": f"jobs/{session_id}/external_weights/0/final",
        "step": None,
        "size_bytes": 3010,
    }
    with session_scope(settings.resolved_database_url) as session:
        sessions.add_checkpoint(session, **checkpoint)
    checkpoints = f"/api/v1/training_runs/{model_id}/checkpoints"
    answer = api.get(f"{checkpoints}/external_weights/final/external_weights_urls").json()
    assert sorted(answer["urls"]) == sorted(files)
    anonymous = TestClient(app)  # as urllib fetches them: no key
    for name, url in answer["urls"].items():
        assert url.startswith("http://testserver/api/v1/")
        got = anonymous.get(url)
        assert (got.status_code, got.content, got.headers["content-length"]) == (
            200,
            files[name],
            str(len(files[name])),
        )
    url = answer["urls"]["adapter_model.safetensors"]
    forged = [
        url[:-1] + ("0" if url[-1] != "0" else "1"),
        url.replace("adapter_model.safetensors", "link"),
        url.replace("adapter_model.safetensors", "adapter_config.json"),
        url.split("?")[0],
    ]
    for bad in forged:
        refused = anonymous.get(bad)
        assert (refused.status_code, refused.json()["error"]["code"]) == (401, "invalid_api_key"), bad
    other = TestClient(app, headers=headers(new_project(settings, "other")))
    assert other.get(url.split("?")[0]).status_code == 404
    assert api.get(url.split("?")[0]).content == files["adapter_model.safetensors"]  # the owner's key opens it
    assert api.get(url.split("?")[0].replace("adapter_model.safetensors", "link")).status_code == 404
    later = time.time() + 3601
    monkeypatch.setattr(service.time, "time", lambda: later)
    assert anonymous.get(url).status_code == 401  # expired
    monkeypatch.undo()
    # weights deleted and saved again under the name: the old URLs do not reach them
    assert api.delete(f"{checkpoints}/external_weights/final").status_code == 200
    assert not folder.exists()
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"\x02")
    with session_scope(settings.resolved_database_url) as session:
        sessions.add_checkpoint(session, **checkpoint)
    assert anonymous.get(url).status_code == 401
    # the SDK's set_checkpoint_ttl is accepted for the caller's weights; training weights are not downloaded by URL
    assert api.put(f"{checkpoints}/external_weights/final/ttl", json={"ttl_seconds": 3600}).status_code == 200
    assert api.put(f"{checkpoints}/external_weights/final/ttl", json={"ttl_seconds": 5}).status_code == 422
    assert api.put(f"{checkpoints}/external_weights/nope/ttl", json={"ttl_seconds": None}).status_code == 404
    with session_scope(settings.resolved_database_url) as session:
        sessions.add_checkpoint(session, **{**checkpoint, "kind": "weights"})
    assert api.get(f"{checkpoints}/weights/final/external_weights_urls").status_code == 400

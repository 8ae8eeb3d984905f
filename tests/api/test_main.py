"""The application object: lazy to create, documented, one error envelope everywhere."""

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from api.main import create_app
from engine.spec.config import JOB_TYPES, JobSpec
from tests.api.helpers import error_of
from tests.factories import make_settings

ROOT = Path(__file__).resolve().parents[2]

# Every method and path of the README's API table.
DESIGN_ROUTES = {
    ("post", "/v1/files"), ("get", "/v1/files"), ("get", "/v1/files/{file_id}"),
    ("post", "/v1/jobs"), ("get", "/v1/jobs"), ("get", "/v1/jobs/{job_id}"), ("post", "/v1/pipelines"),
    ("post", "/v1/jobs/{job_id}/cancel"), ("post", "/v1/jobs/{job_id}/pause"), ("post", "/v1/jobs/{job_id}/resume"),
    ("get", "/v1/jobs/{job_id}/metrics"), ("get", "/v1/jobs/{job_id}/events"), ("get", "/v1/jobs/{job_id}/stream"),
    ("get", "/v1/jobs/{job_id}/checkpoints"), ("post", "/v1/jobs/{job_id}/generate"),
    ("get", "/v1/jobs/{job_id}/tensorboard"), ("get", "/v1/jobs/{job_id}/samples"),
    ("get", "/v1/job_types"),
    # Getting a model out (issue 23, item 15).
    ("get", "/v1/jobs/{job_id}/model"), ("get", "/v1/jobs/{job_id}/checkpoints/{step}/model"),
    ("get", "/healthz"), ("get", "/readyz"),
    # OpenAI-compatible (issue 7).
    ("get", "/v1/models"), ("get", "/v1/models/{model_id}"), ("post", "/v1/completions"),
    ("post", "/v1/chat/completions"),
    # OpenAI's fine-tuning API (issue 16).
    ("post", "/v1/fine_tuning/jobs"), ("get", "/v1/fine_tuning/jobs"),
    ("get", "/v1/fine_tuning/jobs/{fine_tuning_job_id}"),
    ("post", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/cancel"),
    ("post", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/pause"),
    ("post", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/resume"),
    ("get", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/events"),
    ("get", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/checkpoints"),
    ("post", "/v1/fine_tuning/checkpoints/{fine_tuned_model_checkpoint}/permissions"),
    ("get", "/v1/fine_tuning/checkpoints/{fine_tuned_model_checkpoint}/permissions"),
    ("delete", "/v1/fine_tuning/checkpoints/{fine_tuned_model_checkpoint}/permissions/{permission_id}"),
    ("post", "/v1/fine_tuning/alpha/graders/run"), ("post", "/v1/fine_tuning/alpha/graders/validate"),
    # Tinker-compatible, the tinker SDK 0.38's paths (issue 26).
    ("get", "/api/v1/healthz"), ("post", "/api/v1/client/config"), ("post", "/api/v1/client/dynamic_config"),
    ("get", "/api/v1/get_server_capabilities"), ("post", "/api/v1/telemetry"),
    ("post", "/api/v1/create_session"), ("post", "/api/v1/session_heartbeat"),
    ("post", "/api/v1/sessions/{session_id}/finish"), ("get", "/api/v1/sessions"),
    ("get", "/api/v1/sessions/{session_id}"), ("post", "/api/v1/create_model"), ("post", "/api/v1/get_info"),
    ("post", "/api/v1/forward_backward"), ("post", "/api/v1/optim_step"), ("post", "/api/v1/save_weights"),
    ("post", "/api/v1/save_weights_for_sampler"), ("post", "/api/v1/load_weights"), ("post", "/api/v1/weights_info"),
    ("post", "/api/v1/create_sampling_session"), ("get", "/api/v1/samplers/{sampler_id}"),
    ("post", "/api/v1/asample"), ("post", "/api/v1/retrieve_future"), ("post", "/api/v1/cancel_future"),
    ("get", "/api/v1/training_runs"), ("get", "/api/v1/training_runs/{run_id}"),
    ("get", "/api/v1/training_runs/{run_id}/checkpoints"), ("get", "/api/v1/checkpoints"),
    ("delete", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}"),
    # weights out the Tinker way (issue 39): tinker checkpoint download's export and its files by signed URL
    ("post", "/api/v1/save_weights_external"), ("put", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl"),
    ("get", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls"),
    ("get", "/api/v1/training_runs/{run_id}/checkpoints/external_weights/{name}/files/{file}"),
}  # fmt: skip


def test_openapi_lists_every_design_route(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    routes = {(method, path) for path, item in document["paths"].items() for method in item}
    assert routes == DESIGN_ROUTES
    assert client.get("/docs").status_code == 200


def test_openapi_documents_the_job_spec_with_examples(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    body = document["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/JobSpec"}
    assert set(body["examples"]) == set(JOB_TYPES)  # one per job type, each a valid spec of its type
    for job_type, example in body["examples"].items():
        assert JobSpec.model_validate(example["value"]).type == job_type
    spec = document["components"]["schemas"]["JobSpec"]
    assert {"type", "model", "dataset", "hyperparameters", "lora"} <= set(spec["properties"])
    assert "LoraSpec" in document["components"]["schemas"]
    generate = document["components"]["schemas"]["GenerateRequest"]
    assert generate["examples"]
    assert document["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def test_openapi_says_what_the_service_trains(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    description = document["info"]["description"]
    assert all(f"`{job_type}`: {info.summary}" in description for job_type, info in JOB_TYPES.items())
    tags = {tag["name"]: tag["description"] for tag in document["tags"]}
    used = {tag for item in document["paths"].values() for operation in item.values() for tag in operation["tags"]}
    assert used == set(tags)  # every tag the routes use is described, and no other
    assert all(job_type in tags["jobs"] for job_type in JOB_TYPES)


def test_errors_share_one_envelope(client: TestClient) -> None:
    assert error_of(client.get("/v1/nothing-here"))["code"] == "not_found"
    assert error_of(client.delete("/v1/jobs"))["code"] == "method_not_allowed"
    assert error_of(client.get("/v1/jobs", params={"limit": "many"})) == {
        "code": "invalid_request",
        "param": "limit",
        "message": "limit: Input should be a valid integer, unable to parse string as an integer",
    }


def test_importing_the_app_touches_no_database(tmp_path: Path) -> None:
    # A data folder that does not exist and a database that cannot be reached: importing still works.
    env = {"RLHF_DATA_DIR": str(tmp_path / "absent"), "RLHF_DATABASE_URL": "postgresql+psycopg://x@127.0.0.1:1/none",
           "PATH": "/usr/bin:/bin"}  # fmt: skip
    code = "import api.main, sys; assert 'torch' not in sys.modules; print(api.main.app.title)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "rlhf-server"
    assert not (tmp_path / "absent").exists()


def test_production_refuses_the_embedded_defaults(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, "sqlite:///" + str(tmp_path / "x.db"), environment="production")
    app = create_app(settings, recovery_interval=None)  # creating it is fine; starting it is not
    with pytest.raises(ValueError, match="production"), TestClient(app):
        pass


def test_a_keep_alive_connection_survives_an_unhandled_error(tmp_path: Path, database_url: str) -> None:
    """After an unhandled error uvicorn closes the connection; the 500 says ``Connection: close``, so a client
    keeping connections alive opens a new one for its next request instead of meeting a reset."""
    app = create_app(make_settings(tmp_path, database_url), enqueue=lambda *_: None, recovery_interval=None)

    @app.get("/boom", include_in_schema=False)
    def boom() -> None:
        raise RuntimeError("an unexpected bug")

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            failed = client.get("/boom")
            assert failed.status_code == 500 and failed.headers["connection"] == "close"
            assert failed.json()["error"]["code"] == "internal_error"
            assert client.get("/healthz").status_code == 200  # the next request on the same client
    finally:
        server.should_exit = True
        thread.join(timeout=10)

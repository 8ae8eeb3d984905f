"""Caps on what one request may ask for — body size, generate requests, hyperparameters, metadata, query
parameters, ids — each refused with a clear error (413 or 422 naming the field), nothing stored or sent on."""

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from api.schemas import MAX_NEW_TOKENS, MAX_PROMPT_CHARS, MAX_PROMPTS
from engine.spec.config import METADATA_MAX_KEY_CHARS, METADATA_MAX_KEYS, METADATA_MAX_VALUE_CHARS
from jobs.store.settings import Settings
from tests.api.helpers import PPO_SPEC, SFT_SPEC, Calls, Db, error_of
from tests.factories import Project, make_settings

MIB = 1024 * 1024


def jobs_of(client: TestClient) -> list[Any]:
    data: list[Any] = client.get("/v1/jobs", params={"limit": 100}).json()["data"]
    return data


def invalid(response: Any, param: str, needle: str = "", code: str = "invalid_request") -> None:
    assert response.status_code == 422, response.text
    error = error_of(response)
    assert (error["code"], error["param"]) == (code, param), error
    assert needle in error["message"], error["message"]


# --- body size ---------------------------------------------------------------------------------


def test_a_job_spec_over_1_mib_is_413(client: TestClient, settings: Settings, calls: Calls) -> None:
    assert settings.max_request_bytes == MIB  # the default
    body = json.dumps({**SFT_SPEC, "name": "x" * MIB}).encode()
    for content in (body, iter([body[: MIB // 2], body[MIB // 2 :]])):  # declared length, then chunked
        response = client.post("/v1/jobs", content=content, headers={"Content-Type": "application/json"})
        assert response.status_code == 413
        error = error_of(response)
        assert (error["code"], error["param"]) == ("request_too_large", None)
        assert error["message"] == f"the request body is larger than the limit of {MIB} bytes"
    assert jobs_of(client) == [] and calls.enqueued == []
    # Under the cap, the spec's own limits speak.
    invalid(client.post("/v1/jobs", json={**SFT_SPEC, "name": "x" * (MIB // 2)}), "name", "at most 200 characters")
    assert client.post("/v1/jobs", json=SFT_SPEC).status_code == 201


def test_the_body_cap_is_a_setting(tmp_path: Any, database_url: str, project: Project) -> None:
    settings = make_settings(tmp_path, database_url, max_request_bytes=300)
    app = create_app(settings, enqueue=lambda *_: None, recovery_interval=None)
    with TestClient(app, headers=project.headers) as client:
        assert client.post("/v1/jobs", json=SFT_SPEC).status_code == 201
        big = client.post("/v1/jobs", json={**SFT_SPEC, "metadata": {"note": "x" * 300}})
        assert (big.status_code, error_of(big)["code"]) == (413, "request_too_large")
        generate = client.post("/v1/jobs/job_000000000000/generate", json={"prompts": ["x" * 400]})
        assert generate.status_code == 413


def test_malformed_json_bodies_are_4xx(client: TestClient) -> None:
    for content in (b"[" * 200_000, b'{"type": "sft", "model": ' * 20_000, b"\xff\xfe", b"NaN", b'{"a": 1e999999}'):
        response = client.post("/v1/jobs", content=content, headers={"Content-Type": "application/json"})
        assert response.status_code in (400, 422), (content[:20], response.status_code)
        assert error_of(response)["code"] in ("bad_request", "invalid_request")
    assert jobs_of(client) == []


# --- generate ----------------------------------------------------------------------------------


@pytest.fixture
def generating(project: Project, db: Db) -> str:
    job_id = db.job(project.id, spec=PPO_SPEC, status="running")
    db.checkpoint(job_id, 1)
    return job_id


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"prompts": ["a"] * (MAX_PROMPTS + 1)}, "prompts", "at most 64 items"),
        ({"prompts": []}, "prompts", "at least 1 item"),
        ({"prompts": ["a", "x" * (MAX_PROMPT_CHARS + 1)]}, "prompts.1", "at most 8192 characters"),
        ({"prompts": ["a", ""]}, "prompts.1", "at least 1 character"),
        ({"prompts": "a"}, "prompts", "valid list"),
        ({"prompts": [1]}, "prompts.0", "valid string"),
        ({"prompts": ["a"], "max_new_tokens": MAX_NEW_TOKENS + 1}, "max_new_tokens", "less than or equal to 512"),
        ({"prompts": ["a"], "max_new_tokens": 0}, "max_new_tokens", "greater than or equal to 1"),
        ({"prompts": ["a"], "max_new_tokens": "32"}, "max_new_tokens", "valid integer"),
        ({"prompts": ["a"], "max_new_tokens": 10**30}, "max_new_tokens", ""),
        ({"prompts": ["a"], "temperature": -0.1}, "temperature", ""),
        ({"prompts": ["a"], "top_p": 1.5}, "top_p", ""),
        ({"prompts": ["a"], "seed": 2**31}, "seed", ""),
        ({"prompts": ["a"], "checkpoint": 2**31}, "checkpoint", ""),
        ({"prompts": ["a"], "score": 1}, "score", "valid boolean"),
        ({"prompts": ["a"], "n": 100}, "n", "Extra inputs"),
    ],
)
def test_generate_caps(
    client: TestClient, calls: Calls, generating: str, body: dict[str, Any], param: str, needle: str
) -> None:
    response = client.post(f"/v1/jobs/{generating}/generate", json=body)
    assert response.status_code == 422, response.text
    error = error_of(response)
    assert error["param"] is not None and error["param"].startswith(param), error
    assert needle in error["message"]
    assert calls.generated == []


def test_generate_at_the_caps_is_accepted(client: TestClient, calls: Calls, generating: str) -> None:
    prompts = ["é" * MAX_PROMPT_CHARS] * MAX_PROMPTS  # 64 × 8192 characters: 1 MiB of UTF-8, under the body cap
    body = {"prompts": prompts[: MIB // (2 * MAX_PROMPT_CHARS) - 1], "max_new_tokens": MAX_NEW_TOKENS}
    assert client.post(f"/v1/jobs/{generating}/generate", json=body).status_code == 200
    ascii_prompts = ["x" * MAX_PROMPT_CHARS] * MAX_PROMPTS
    assert client.post(f"/v1/jobs/{generating}/generate", json={"prompts": ascii_prompts}).status_code == 200
    assert [len(kw["prompts"]) for kw in calls.generated] == [len(body["prompts"]), MAX_PROMPTS]
    assert calls.generated[0]["max_new_tokens"] == MAX_NEW_TOKENS


# --- job specs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "param", "needle"),
    [
        ({**SFT_SPEC, "hyperparameters": {"learning_rate": 0}}, "hyperparameters.learning_rate", "greater than 0"),
        ({**SFT_SPEC, "hyperparameters": {"learning_rate": 1.5}}, "hyperparameters.learning_rate", "less than"),
        ({**SFT_SPEC, "hyperparameters": {"batch_size": 4097}}, "hyperparameters.batch_size", "4096"),
        ({**SFT_SPEC, "hyperparameters": {"max_steps": 10**8}}, "hyperparameters.max_steps", "10000000"),
        ({**SFT_SPEC, "hyperparameters": {"eval_every": 10**8}}, "hyperparameters.eval_every", "10000000"),
        ({**SFT_SPEC, "hyperparameters": {"epochs": 1001}}, "hyperparameters.epochs", "1000"),
        ({**SFT_SPEC, "hyperparameters": {"max_length": 7}}, "hyperparameters.max_length", "8"),
        ({**SFT_SPEC, "hyperparameters": {"max_length": 10**9}}, "hyperparameters.max_length", "131072"),
        ({**SFT_SPEC, "hyperparameters": {"warmup_steps": -1}}, "hyperparameters.warmup_steps", "0"),
        ({**SFT_SPEC, "hyperparameters": {"gradient_accumulation_steps": 2048}},
         "hyperparameters.gradient_accumulation_steps", "1024"),
        ({**SFT_SPEC, "hyperparameters": {"adam_betas": [0.9, 1.0]}}, "hyperparameters.adam_betas.1", "less than 1"),
        ({**SFT_SPEC, "hyperparameters": {"learning_rate": "fast"}}, "hyperparameters.learning_rate", "number"),
        ({**PPO_SPEC, "hyperparameters": {"total_steps": 0}}, "hyperparameters.total_steps", "1"),
        ({**PPO_SPEC, "hyperparameters": {"ppo_epochs": 101}}, "hyperparameters.ppo_epochs", "100"),
        ({**PPO_SPEC, "hyperparameters": {"response_length": 70_000}}, "hyperparameters.response_length", "65536"),
        ({**PPO_SPEC, "hyperparameters": {"temperature": 0}}, "hyperparameters.temperature", "greater than 0"),
        ({**PPO_SPEC, "hyperparameters": {"gamma": 1.01}}, "hyperparameters.gamma", "1"),
        ({**PPO_SPEC, "hyperparameters": {"cliprange": 0}}, "hyperparameters.cliprange", "greater than 0"),
        ({**PPO_SPEC, "hyperparameters": {"kl_coef": 1000}}, "hyperparameters.kl_coef", "100"),
        ({**PPO_SPEC, "hyperparameters": {"eval_every": 0}}, "hyperparameters.eval_every", "1"),
        ({**SFT_SPEC, "lora": {"r": 1025}}, "lora.r", "1024"),
        ({**SFT_SPEC, "lora": {"target_modules": ["m"] * 65}}, "lora.target_modules", "1 to 64 module names, not 65"),
        ({**SFT_SPEC, "lora": {"target_modules": ["c_attn; rm -rf /"]}}, "lora.target_modules", "not a module name"),
        ({**SFT_SPEC, "lora": {"target_modules": "all"}}, "lora.target_modules", "'auto' or a list"),
        ({**SFT_SPEC, "seed": 2**31}, "seed", "2147483647"),
        ({**SFT_SPEC, "checkpoint_every": 0}, "checkpoint_every", "1"),
        ({**SFT_SPEC, "keep_checkpoints": 1001}, "keep_checkpoints", "1000"),
        ({**SFT_SPEC, "name": "x" * 201}, "name", "200"),
        ({**SFT_SPEC, "name": "a\x00b"}, "name", "control characters"),
        ({**SFT_SPEC, "model": "x" * 501}, "model", "500"),
        ({**SFT_SPEC, "model": "org/model\x00"}, "model", "not a model reference"),
        ({**SFT_SPEC, "model": "job:job_0123456789ab@99999999999999999999"}, "model", "no job"),
    ],
)  # fmt: skip
def test_out_of_range_specs_are_422_naming_the_field(
    client: TestClient, calls: Calls, spec: dict[str, Any], param: str, needle: str
) -> None:
    invalid(client.post("/v1/jobs", json=spec), param, needle, code=error_code(spec))
    assert jobs_of(client) == [] and calls.enqueued == []


def error_code(spec: dict[str, Any]) -> str:
    return "job_not_found" if spec["model"].startswith("job:") else "invalid_request"


def test_non_finite_numbers_are_refused(client: TestClient) -> None:
    for literal in ("NaN", "Infinity", "-Infinity"):
        content = '{"type": "sft", "model": "builtin:tiny", "dataset": "builtin:reviews-sft", '
        content += f'"hyperparameters": {{"learning_rate": {literal}}}}}'
        response = client.post("/v1/jobs", content=content, headers={"Content-Type": "application/json"})
        invalid(response, "hyperparameters.learning_rate")
    assert jobs_of(client) == []


def test_a_checkpoint_step_past_the_integer_range_is_not_found(
    client: TestClient, project: Project, db: Db, calls: Calls
) -> None:
    job_id = db.job(project.id, status="running")
    db.checkpoint(job_id, 1)
    for step in ("2147483648", "99999999999999999999"):
        invalid(client.post("/v1/jobs", json={**SFT_SPEC, "model": f"job:{job_id}@{step}"}), "model", code=(
            "checkpoint_not_found"))  # fmt: skip
    assert calls.enqueued == []


@pytest.mark.parametrize(
    ("metadata", "needle"),
    [
        ({f"k{i}": "v" for i in range(METADATA_MAX_KEYS + 1)}, "at most 16 keys, not 17"),
        ({"k" * (METADATA_MAX_KEY_CHARS + 1): "v"}, "has 65 characters; keys have 1 to 64"),
        ({"": "v"}, "has 0 characters"),
        ({"note": "v" * (METADATA_MAX_VALUE_CHARS + 1)}, "the value of 'note' has 513 characters"),
        ({"n": 1}, "valid string"),
        ({"n": {"nested": "x"}}, "valid string"),
        ({"n": "a\x00b"}, "control characters"),
        ({"n": "\ud800"}, "lone surrogates"),
    ],
)
def test_metadata_is_bounded(client: TestClient, calls: Calls, metadata: dict[str, Any], needle: str) -> None:
    content = json.dumps({**SFT_SPEC, "metadata": metadata})  # ASCII, with a lone surrogate as "\ud800"
    response = client.post("/v1/jobs", content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == 422
    error = error_of(response)
    assert error["param"] is not None and error["param"].startswith("metadata"), error
    assert needle in error["message"], error["message"]
    assert jobs_of(client) == [] and calls.enqueued == []


def test_metadata_at_the_caps_is_accepted(client: TestClient) -> None:
    metadata = {f"{i:02d}".ljust(METADATA_MAX_KEY_CHARS, "k"): "v\tw\n" * 128 for i in range(METADATA_MAX_KEYS)}
    response = client.post("/v1/jobs", json={**SFT_SPEC, "metadata": metadata})
    assert response.status_code == 201, response.text
    assert response.json()["spec"]["metadata"] == metadata


# --- query parameters and ids ------------------------------------------------------------------


def test_query_parameters_are_bounded(client: TestClient, project: Project, db: Db) -> None:
    job_id = db.job(project.id)
    metrics = f"/v1/jobs/{job_id}/metrics"
    invalid(client.get(metrics, params={"start_step": 2**31}), "start_step", "2147483647")
    invalid(client.get(metrics, params={"end_step": 10**30}), "end_step")
    invalid(client.get(metrics, params={"names": ",".join(f"m{i}" for i in range(101))}), "names", "at most 100")
    invalid(client.get(metrics, params={"names": "x" * 20_000}), "names")
    invalid(client.get(f"/v1/jobs/{job_id}/events", params={"after": 2**63}), "after")
    invalid(client.get("/v1/jobs", params={"after": "job_x' OR 1=1 --"}), "after", "pattern")
    invalid(client.get("/v1/files", params={"after": "x" * 65}), "after")
    invalid(client.get("/v1/jobs", params={"limit": 101}), "limit")
    invalid(client.get("/v1/jobs", params={"limt": 5}), "limt", "unknown query parameter 'limt'")
    invalid(client.get(metrics, params={"name": "loss"}), "name", "unknown query parameter")
    assert client.get(metrics, params={"names": "loss,lr", "start_step": 0, "end_step": 2**31 - 1}).status_code == 200
    assert client.get(f"/v1/jobs/{job_id}/stream", params={"bogus": 1}).status_code == 422


def test_ids_that_cannot_exist_are_404_on_every_database(client: TestClient, calls: Calls) -> None:
    """NUL bytes, other control characters and very long ids: 404 without asking the database (PostgreSQL
    refuses NUL characters)."""
    for bad in ("job_%00x", "job_%01", "x" * 5000, "job_%ff", "..%2f..%2fetc", "job_ünïcode", "job_%ed%a0%80"):
        for path in ("", "/metrics", "/events", "/checkpoints", "/stream"):
            response = client.get(f"/v1/jobs/{bad}{path}")
            assert response.status_code == 404, (bad, path, response.text)
        for action in ("cancel", "pause", "resume"):
            assert client.post(f"/v1/jobs/{bad}/{action}").status_code == 404
        assert client.post(f"/v1/jobs/{bad}/generate", json={"prompts": ["a"]}).status_code == 404
        assert client.get(f"/v1/files/{bad}").status_code == 404
    assert calls.generated == []


def test_an_upload_file_name_is_cleaned(client: TestClient) -> None:
    names = [(b"../../etc/passwd", "passwd"), (b"a\x00b\x1fc\x7f.jsonl", "abc.jsonl"), (b"", "upload.jsonl"),
             (b"C:\\data\\x.jsonl", "x.jsonl"), (b"n" * 300, "n" * 255)]  # fmt: skip
    for name, stored in names:
        body = (b'--b\r\nContent-Disposition: form-data; name="file"; filename="' + name + b'"\r\n\r\n'
                b'{"prompt": "a", "completion": "b"}\n\r\n'
                b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nsft\r\n--b--\r\n')  # fmt: skip
        response = client.post("/v1/files", content=body, headers={"Content-Type": "multipart/form-data; boundary=b"})
        assert response.status_code == 201, (name, response.text)
        assert response.json()["filename"] == stored

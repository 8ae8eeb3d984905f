"""POST /v1/jobs/{id}/generate with the wait for the inference worker replaced by a fake."""

from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.errors import ApiError
from tests.api.helpers import PPO_SPEC, RM_SPEC, SFT_SPEC, Calls, Db, error_of
from tests.factories import Project


def test_generate_sends_the_task_contract(client: TestClient, project: Project, db: Db, calls: Calls) -> None:
    job_id = db.job(project.id, spec=PPO_SPEC, status="running")
    db.checkpoint(job_id, 3)
    db.checkpoint(job_id, 5, kept=(3,))
    calls.answer = lambda kw: {
        "completions": [{"prompt": p, "text": " fine", "finish_reason": "length", "score": 0.5} for p in kw["prompts"]]
    }
    body = {"prompts": ["a", "b"], "max_new_tokens": 8, "temperature": 0, "top_p": 0.9, "seed": 3, "score": True}
    response = client.post(f"/v1/jobs/{job_id}/generate", json=body)
    assert response.status_code == 200, response.text
    assert response.json() == {
        "checkpoint": 5,
        "completions": [
            {"prompt": "a", "text": " fine", "finish_reason": "length", "score": 0.5},
            {"prompt": "b", "text": " fine", "finish_reason": "length", "score": 0.5},
        ],
    }
    assert calls.generated == [
        {
            "job_id": job_id,
            "step": 5,
            "prompts": ["a", "b"],
            "max_new_tokens": 8,
            "temperature": 0.0,
            "top_p": 0.9,
            "seed": 3,
            "score": True,
        }
    ]

    # An explicit step, defaults, and no score key when none was asked for.
    calls.answer = None
    response = client.post(f"/v1/jobs/{job_id}/generate", json={"prompts": ["c"], "checkpoint": 3})
    assert response.json() == {
        "checkpoint": 3,
        "completions": [{"prompt": "c", "text": " ok", "finish_reason": "stop"}],
    }
    assert calls.generated[-1] == {
        "job_id": job_id,
        "step": 3,
        "prompts": ["c"],
        "max_new_tokens": 32,
        "temperature": 0.7,
        "top_p": 1.0,
        "seed": 0,
        "score": False,
    }


def test_no_checkpoint_is_404(client: TestClient, project: Project, db: Db, calls: Calls) -> None:
    job_id = db.job(project.id, status="running")
    response = client.post(f"/v1/jobs/{job_id}/generate", json={"prompts": ["a"]})
    assert response.status_code == 404
    assert error_of(response) | {"message": ""} == {
        "code": "checkpoint_not_found",
        "param": "checkpoint",
        "message": "",
    }
    db.checkpoint(job_id, 2)
    response = client.post(f"/v1/jobs/{job_id}/generate", json={"prompts": ["a"], "checkpoint": 7})
    assert response.status_code == 404
    assert error_of(response)["code"] == "checkpoint_not_found"
    assert calls.generated == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompts": []}, "prompts"),
        ({"prompts": ["a"] * 65}, "prompts"),
        ({"prompts": ["a"], "max_new_tokens": 513}, "max_new_tokens"),
        ({"prompts": ["a"], "temperature": 5.5}, "temperature"),
        ({"prompts": ["a"], "top_p": 0}, "top_p"),
        ({"prompts": ["a"], "checkpoint": "best"}, "checkpoint"),
        ({"prompts": ["a"], "stream": True}, "stream"),
    ],
)
def test_invalid_requests(client: TestClient, project: Project, db: Db, body: dict[str, Any], param: str) -> None:
    job_id = db.job(project.id, status="running")
    db.checkpoint(job_id, 1)
    response = client.post(f"/v1/jobs/{job_id}/generate", json=body)
    assert response.status_code == 422
    assert error_of(response)["param"] is not None
    assert error_of(response)["param"].startswith(param)


def test_what_a_job_type_cannot_do(client: TestClient, project: Project, db: Db, calls: Calls) -> None:
    sft = db.job(project.id, spec=SFT_SPEC, status="succeeded")
    rm = db.job(project.id, spec=RM_SPEC, status="succeeded")
    for job_id in (sft, rm):
        db.checkpoint(job_id, 1)
    rule = {"type": "string_check", "input": "{{sample.output_text}}", "reference": "7", "operation": "eq"}
    grpo = {"type": "grpo", "model": "builtin:tiny", "dataset": "builtin:digits-prompts", "reward": rule}
    graded = db.job(project.id, status="succeeded", spec=grpo)
    db.checkpoint(graded, 1)
    for job_id in (sft, graded):  # neither has a reward model: an SFT job, a GRPO job rewarded by a rule
        scored = client.post(f"/v1/jobs/{job_id}/generate", json={"prompts": ["a"], "score": True})
        assert (scored.status_code, error_of(scored)["param"]) == (422, "score")
        assert "no reward_model to score with" in error_of(scored)["message"]
    from_rm = client.post(f"/v1/jobs/{rm}/generate", json={"prompts": ["a"]})
    assert (from_rm.status_code, error_of(from_rm)["code"]) == (422, "wrong_job_type")
    assert calls.generated == []


def test_worker_failures(client: TestClient, project: Project, db: Db, calls: Calls) -> None:
    job_id = db.job(project.id, status="running")
    db.checkpoint(job_id, 1)

    def timeout(_kwargs: dict[str, Any]) -> dict[str, Any]:
        raise ApiError(503, "unavailable", "no inference worker answered within 1 s")

    def crash(_kwargs: dict[str, Any]) -> dict[str, Any]:
        raise RuntimeError("CUDA error")

    calls.answer = timeout
    response = client.post(f"/v1/jobs/{job_id}/generate", json={"prompts": ["a"]})
    assert (response.status_code, error_of(response)["code"]) == (503, "unavailable")
    calls.answer = crash
    response = client.post(f"/v1/jobs/{job_id}/generate", json={"prompts": ["a"]})
    assert (response.status_code, error_of(response)["code"]) == (500, "generation_failed")
    assert "CUDA error" not in error_of(response)["message"]  # the worker's own words go to the server log


class GenerateError(ValueError):
    """Named as the worker's: Celery re-creates a worker's exception under its class name."""


def test_errors_the_worker_reports_about_the_request_are_400_on_both_routes(
    client: TestClient, project: Project, db: Db, calls: Calls
) -> None:
    """One mapping of generation errors for /generate and the OpenAI-compatible routes: a request that cannot be
    served (more tokens than the model's context, a checkpoint retention removed meanwhile) is a 400."""
    job_id = db.job(project.id, spec=SFT_SPEC, status="running")
    db.checkpoint(job_id, 1)

    def too_long(_kwargs: dict[str, Any]) -> dict[str, Any]:
        raise GenerateError("max_new_tokens + a one-token prompt (300 tokens) exceeds the model's context of 256")

    calls.answer = too_long
    for path, body in (
        (f"/v1/jobs/{job_id}/generate", {"prompts": ["a"], "max_new_tokens": 299}),
        ("/v1/completions", {"model": f"job:{job_id}@1", "prompt": "a", "max_tokens": 299}),
    ):
        response = client.post(path, json=body)
        assert (response.status_code, error_of(response)["code"]) == (400, "invalid_request"), response.text
        assert "context" in error_of(response)["message"]

"""Reward objects in job specs at submit: the operator's allow-lists for reward services and reward functions
(``RLHF_REWARD_URLS``, ``RLHF_REWARD_FUNCTIONS``), model graders naming jobs, and the spec's own rules."""

from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from jobs.store.settings import Settings
from tests.api.helpers import Calls, Db, error_of, jsonl
from tests.factories import Project

GRPO_SPEC: dict[str, Any] = {"type": "grpo", "model": "builtin:tiny", "dataset": "builtin:digits-prompts"}
RULE = {"type": "string_check", "input": "{{sample.output_text}}", "reference": "{{item.answer}}", "operation": "eq"}
FUNCTION = "engine.builtin.digits:exact_match"


def http(url: str) -> dict[str, Any]:
    return {"type": "http", "url": url}


def submit(client: TestClient, **fields: Any) -> Any:
    return client.post("/v1/jobs", json={**GRPO_SPEC, **fields})


def assert_refused(response: Any, code: str, param: str, *words: str) -> None:
    assert response.status_code == 422, response.text
    error = error_of(response)
    assert (error["code"], error["param"]) == (code, param), error
    for word in words:
        assert word in error["message"], error["message"]


def test_no_service_is_allowed_by_default_and_loopback_only_when_the_operator_says_so(
    client: TestClient, settings: Settings, project: Project, calls: Calls
) -> None:
    assert settings.reward_urls == []
    loopback = (http("http://127.0.0.1:8123/score"), http("http://localhost/score"))
    for reward in loopback:
        assert_refused(submit(client, reward=reward), "reward_not_allowed", "reward", "not allowed (none)")
    assert submit(client, reward=RULE).status_code == 201
    operator = settings.model_copy(update={"reward_urls": ["loopback"]})
    app = create_app(operator, enqueue=calls.enqueue, recovery_interval=None)
    with TestClient(app, headers=project.headers) as operator_client:
        for reward in loopback:
            response = submit(operator_client, reward=reward, eval_reward=RULE)
            assert response.status_code == 201, response.text
            assert response.json()["spec"]["reward"]["type"] == "http"
    assert len(calls.enqueued) == 3


@pytest.mark.parametrize(
    "url", ["https://rewards.example.com/score", "http://127.0.0.1.evil.example/score", "http://10.0.0.8:8000/"]
)
def test_a_service_outside_the_allowed_list_is_refused(client: TestClient, calls: Calls, url: str) -> None:
    assert_refused(submit(client, reward=http(url)), "reward_not_allowed", "reward", "not allowed")
    assert_refused(submit(client, reward=RULE, eval_reward=http(url)), "reward_not_allowed", "eval_reward")
    nested = {"type": "multi", "graders": {"rule": RULE, "judge": http(url)}, "weights": {"rule": 1, "judge": 1}}
    assert_refused(submit(client, reward=nested), "reward_not_allowed", "reward", "'judge'")
    assert calls.enqueued == []


def test_reward_functions_need_the_operators_list(
    client: TestClient, settings: Settings, project: Project, calls: Calls
) -> None:
    python = {"type": "python", "function": FUNCTION}
    assert_refused(submit(client, reward=python), "reward_not_allowed", "reward", FUNCTION)
    allowed = settings.model_copy(update={"reward_functions": [FUNCTION],
                                          "reward_urls": ["https://rewards.example.com/v1/"]})  # fmt: skip
    app = create_app(allowed, enqueue=calls.enqueue, recovery_interval=None)
    with TestClient(app, headers=project.headers) as operator_client:
        assert submit(operator_client, reward=python).status_code == 201
        assert submit(operator_client, reward=http("https://rewards.example.com/v1/score")).status_code == 201
        for url in (
            "https://rewards.example.com/v2/score",
            "https://rewards.example.com.evil/v1/",
            "http://127.0.0.1/",
        ):
            assert_refused(submit(operator_client, reward=http(url)), "reward_not_allowed", "reward")
        other = {"type": "python", "function": "os:system"}
        assert_refused(submit(operator_client, reward=other), "reward_not_allowed", "reward", "os:system")


def test_model_graders_name_reward_model_jobs(client: TestClient, project: Project, db: Db) -> None:
    rm = db.job(project.id, spec={"type": "rm", "model": "builtin:tiny", "dataset": "builtin:reviews-prefs"},
                status="succeeded")  # fmt: skip
    sft = db.job(project.id, spec={"type": "sft", "model": "builtin:tiny", "dataset": "builtin:reviews-sft"},
                 status="succeeded")  # fmt: skip
    graders = {"rule": RULE, "rm": {"type": "model", "model": f"job:{rm}"}}
    reward = {"type": "multi", "graders": graders, "calculate_output": "rule + 0.1 * rm"}
    assert submit(client, reward=reward).status_code == 201
    wrong = {**reward, "graders": {**graders, "rm": {"type": "model", "model": f"job:{sft}"}}}
    assert_refused(submit(client, reward=wrong), "wrong_job_type", "reward.graders.rm.model")
    missing = {**reward, "graders": {**graders, "rm": {"type": "model", "model": "job:job_000000000000"}}}
    assert_refused(submit(client, reward=missing), "job_not_found", "reward.graders.rm.model")


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({}, "reward_model", "reward_model or reward is required"),
        ({"reward": RULE, "reward_model": "builtin:tiny"}, "reward_model", "both given"),
        ({"reward": {**RULE, "input": "{{ sample.text }}"}}, "reward", "sample.output_text"),
        ({"reward": {"type": "multi", "graders": {"a": RULE}, "calculate_output": "__import__('os')"}}, "reward", ""),
        ({"reward": {"type": "http", "url": "ftp://127.0.0.1/"}}, "reward", ""),
        # a closed port, retried for about two years per request
        (
            {"reward": {**http("http://127.0.0.1:9/"), "retries": 20, "backoff_s": 60, "timeout_s": 600}},
            "reward",
            "allows 62,927,100 s per request, over 3,600 s",
        ),
        (
            {
                "reward": {
                    "type": "multi",
                    "graders": {k: {**http(f"http://{k}/"), "timeout_s": 600} for k in "abc"},
                    "weights": {"a": 1},
                }
            },
            "reward",
            "the 3 http graders",
        ),
    ],
)
def test_bad_rewards_are_refused_naming_the_field(
    client: TestClient, fields: dict[str, Any], param: str, words: str
) -> None:
    response = submit(client, **fields)
    assert response.status_code == 422, response.text
    error = error_of(response)
    assert error["code"] == "invalid_request"
    assert error["param"].startswith(param), error
    assert words in error["message"]


def test_a_reward_is_refused_for_types_that_take_none(client: TestClient) -> None:
    for job_type, dataset in (("sft", "builtin:digits-sft"), ("dpo", "builtin:reviews-prefs")):
        response = client.post("/v1/jobs", json={"type": job_type, "model": "builtin:tiny", "dataset": dataset,
                                                 "eval_reward": RULE})  # fmt: skip
        assert response.status_code == 422, response.text
        error = error_of(response)
        assert (error["param"], error["code"]) == ("eval_reward", "invalid_request")
        assert "eval_reward applies to ppo, grpo and distill jobs only" in error["message"]


def test_a_template_naming_a_column_the_dataset_lacks_is_refused_at_submit(client: TestClient, calls: Calls) -> None:
    """Issue 39, item 3.7: the job failed a second after it started; the uploaded file's columns are known."""

    def upload(rows: list[dict[str, Any]]) -> str:
        files = {"file": ("rows.jsonl", jsonl(rows), "application/jsonl")}
        response = client.post("/v1/files", files=files, data={"purpose": "prompts"})
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    answered = upload([{"prompt": "2+2=", "answer": "4", "meta": {"unit": "none"}}] * 3)
    partly = upload([{"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3="}])
    judge = {
        "type": "text_similarity",
        "input": "{{sample.output_text}}",
        "reference": "{{ item.solution }}",
        "evaluation_metric": "fuzzy_match",
    }
    nested = {**RULE, "reference": "{{item.meta.units}}"}
    multi = {"type": "multi", "graders": {"exact": RULE, "close": judge}, "weights": {"exact": 1, "close": 1}}
    for fields, param, words in [
        ({"dataset": answered, "reward": judge}, "reward.reference", f"line 1 of {answered} lacks: it has no item.sol"),
        ({"dataset": answered, "reward": multi}, "reward.graders.close.reference", "(its columns: prompt, answer"),
        ({"dataset": answered, "reward": nested}, "reward.reference", "it has no item.meta.units"),
        ({"dataset": partly, "reward": RULE}, "reward.reference", f"line 2 of {partly} lacks: it has no item.answer"),
        ({"dataset": answered, "eval_dataset": partly, "reward": RULE}, "reward.reference", "line 2"),
        ({"eval_dataset": partly, "reward": RULE, "eval_reward": judge}, "eval_reward.reference", "item.solution"),
        ({"dataset": "builtin:reviews-prompts", "reward": RULE}, "reward.reference", "(its columns: prompt)"),
    ]:
        assert_refused(submit(client, **fields), "column_not_found", param, "{{ item.", words)
    assert calls.enqueued == []
    for fields in [
        {"dataset": answered, "reward": RULE, "eval_dataset": partly, "eval_reward": {**RULE, "reference": "x"}},
        {"dataset": answered, "reward": {**RULE, "reference": "{{item.meta.unit}}"}},
    ]:
        response = submit(client, **fields)
        assert response.status_code == 201, response.text


def test_the_vllm_servers_port_is_never_a_reward_service(settings: Settings, project: Project, calls: Calls) -> None:
    """The operator's vLLM server (``RLHF_VLLM_URL``) on the loopback that ``RLHF_REWARD_URLS=loopback`` allows:
    an http grader naming its port, by any name of this machine, is refused at submit and by ``graders/run``,
    before anything connects (whether the port is open or not, the answer is the same); other ports stay allowed.
    (A job's own vLLM server has no port: tests/engine/test_vllm.py.)"""
    operator = settings.model_copy(update={"reward_urls": ["loopback"], "vllm_url": "http://127.0.0.1:8001"})
    app = create_app(operator, enqueue=calls.enqueue, recovery_interval=None)
    with TestClient(app, headers=project.headers) as client:
        for url in (
            "http://127.0.0.1:8001/reset_prefix_cache",
            "http://localhost:8001/v1/completions",
            "http://[::1]:8001/collective_rpc",
            "http://127.0.0.2:8001/sleep",
        ):
            assert_refused(submit(client, reward=http(url)), "reward_not_allowed", "reward", "own servers")
            response = client.post(
                "/v1/fine_tuning/alpha/graders/run", json={"grader": http(url), "model_sample": "x", "item": {}}
            )
            assert response.status_code == 400, response.text
            assert error_of(response)["code"] == "reward_not_allowed"
        assert submit(client, reward=http("http://127.0.0.1:8002/score")).status_code == 201

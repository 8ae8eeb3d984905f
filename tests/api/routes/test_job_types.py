"""``GET /v1/job_types``: the registry (engine.spec.config.JOB_TYPES) as clients see it, the dashboard's new-job form
among them. A type added to the registry is listed with no change to the API."""

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.schemas import JobTypePublic
from engine.spec import config
from engine.spec.config import JOB_TYPES, JobTypeInfo, SFTConfig
from tests.api.helpers import Calls, error_of

BUILTIN_BY_KIND = {
    "sft": ["builtin:reviews-sft", "builtin:reviews-sft-eval", "builtin:digits-sft", "builtin:digits-sft-eval"],
    "preference": ["builtin:reviews-prefs", "builtin:reviews-prefs-eval"],
    "prompts": [
        "builtin:reviews-prompts",
        "builtin:reviews-prompts-eval",
        "builtin:digits-prompts",
        "builtin:digits-prompts-eval",
    ],
}
"""The built-in datasets (reviews, digits) of each dataset kind."""


def listed(client: TestClient) -> list[dict[str, Any]]:
    response = client.get("/v1/job_types")
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"data"}, body
    data: list[dict[str, Any]] = body["data"]
    return data


def test_lists_every_registered_type_in_order(client: TestClient) -> None:
    data = listed(client)
    assert [t["name"] for t in data] == list(JOB_TYPES)
    for shown in data:
        assert set(shown) == set(JobTypePublic.model_fields), shown
        info = JOB_TYPES[shown["name"]]
        assert shown["summary"] == info.summary
        assert shown["dataset_kind"] == info.dataset
        assert shown["output"] == info.output
        assert shown["generates"] is info.generates is (info.output == "policy")
        assert shown["reward_model"] is info.reward_model
        assert shown["metrics"] == list(info.metrics)
        assert shown["hyperparameters"] == info.config().model_dump(mode="json")
        assert shown["example"] == info.demo


def test_the_three_first_types(client: TestClient) -> None:
    by_name = {t["name"]: t for t in listed(client)}
    assert {"sft", "rm", "ppo"} <= set(by_name)
    assert (by_name["sft"]["output"], by_name["rm"]["output"], by_name["ppo"]["output"]) == (
        "policy",
        "reward_model",
        "policy",
    )
    assert [name for name in ("sft", "rm", "ppo") if by_name[name]["reward_model"]] == ["ppo"]
    assert not by_name["rm"]["generates"] and by_name["sft"]["generates"] and by_name["ppo"]["generates"]
    assert by_name["ppo"]["hyperparameters"]["kl_coef"] == config.PPOConfig().kl_coef
    assert "objective/scores" in by_name["ppo"]["metrics"]


def test_builtin_datasets_match_each_types_kind(client: TestClient) -> None:
    by_name = {t["name"]: t for t in listed(client)}
    assert by_name["sft"]["builtin_datasets"] == BUILTIN_BY_KIND["sft"]
    assert by_name["rm"]["builtin_datasets"] == BUILTIN_BY_KIND["preference"]
    assert by_name["ppo"]["builtin_datasets"] == BUILTIN_BY_KIND["prompts"]
    for shown in by_name.values():
        assert shown["builtin_datasets"] == BUILTIN_BY_KIND[shown["dataset_kind"]], shown["name"]
        example = shown["example"]
        for field in ("dataset", "eval_dataset"):
            if field in example:
                assert example[field] in shown["builtin_datasets"], (shown["name"], field)


def test_each_example_is_a_spec_the_server_accepts(client: TestClient, calls: Calls) -> None:
    # What the dashboard's form starts from, once it picks a model (and a reward model or a teacher where one is
    # taken: the demo's teacher, a stage:<name> of its pipeline, names no job here).
    for shown in listed(client):
        spec = {**shown["example"], "type": shown["name"], "model": "builtin:tiny"}
        if shown["reward_model"] and "reward" not in spec:  # grpo's example brings its own reward
            spec["reward_model"] = "builtin:tiny"
        if JOB_TYPES[shown["name"]].teacher:
            spec["teacher"] = "builtin:tiny"
        response = client.post("/v1/jobs", json=spec)
        assert response.status_code == 201, (shown["name"], response.text)
        assert response.json()["type"] == shown["name"]
    assert len(calls.enqueued) == len(JOB_TYPES)


def test_needs_the_api_key(app: FastAPI) -> None:
    with TestClient(app) as anonymous:
        for headers in ({}, {"Authorization": "Bearer rlhf-wrong-key-0123456789"}):
            response = anonymous.get("/v1/job_types", headers=headers)
            assert response.status_code == 401, response.text
            assert error_of(response)["code"] == "invalid_api_key"


def test_unknown_query_parameters_are_refused(client: TestClient) -> None:
    response = client.get("/v1/job_types", params={"type": "sft"})
    assert response.status_code == 422, response.text
    assert error_of(response)["param"] == "type"


def test_a_type_added_to_the_registry_is_listed_with_no_api_change(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = JobTypeInfo(
        summary="a made-up type for this test",
        config=SFTConfig,
        dataset="preference",
        output="policy",
        trainer="engine.methods.sft:train_sft",
        metrics=("loss/fake", "fake/accuracy"),
        demo={"dataset": "builtin:reviews-prefs", "hyperparameters": {"batch_size": 8}},
    )
    # The registry is one dict, read when a request comes (modules that imported it hold the same object):
    # registering a type is adding its entry, undone when the test ends.
    monkeypatch.setitem(config.JOB_TYPES, "fake", fake)
    data = listed(client)
    assert [t["name"] for t in data] == [*JOB_TYPES]
    assert data[-1] == {
        "name": "fake",
        "summary": "a made-up type for this test",
        "dataset_kind": "preference",
        "output": "policy",
        "generates": True,
        "reward_model": False,
        "metrics": ["loss/fake", "fake/accuracy"],
        "hyperparameters": SFTConfig().model_dump(mode="json"),
        "builtin_datasets": BUILTIN_BY_KIND["preference"],
        "example": {"dataset": "builtin:reviews-prefs", "hyperparameters": {"batch_size": 8}},
    }

"""The OpenAI-compatible routes (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``) with the wait for
the inference worker replaced by a fake: the task contract they send, the OpenAI response shapes, streaming,
model ids, caps and errors."""

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.helpers import PPO_SPEC, RM_SPEC, SFT_SPEC, Calls, Db, error_of
from tests.factories import Project, new_project


def fake_answer(kwargs: dict[str, Any]) -> dict[str, Any]:
    """n completions per prompt, texts naming prompt and sample; a chat is one prompt."""
    prompts = kwargs["prompts"] or ["<chat>"]
    rows = [
        {"prompt": p, "text": f" text {i} {j}", "finish_reason": "stop" if j == 0 else "length"}
        for i, p in enumerate(prompts)
        for j in range(kwargs["n"])
    ]
    return {"checkpoint": kwargs["step"], "completions": rows, "usage": {"prompt_tokens": 3, "completion_tokens": 7}}


@pytest.fixture
def answering(calls: Calls) -> Calls:
    calls.answer = fake_answer
    return calls


@pytest.fixture
def succeeded(project: Project, db: Db) -> str:
    job_id = db.job(project.id, spec=SFT_SPEC, status="succeeded")
    db.checkpoint(job_id, 2)
    db.checkpoint(job_id, 4, kept=(2,))
    db.status(job_id, "succeeded", output_step=4)
    return job_id


def sse(text: str) -> list[Any]:
    events = text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", text[-200:]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-2]]


def test_models_lists_final_models_and_kept_checkpoints(client: TestClient, project: Project, db: Db,
                                                        succeeded: str) -> None:  # fmt: skip
    running = db.job(project.id, spec=PPO_SPEC, status="running")
    db.checkpoint(running, 1)
    paused = db.job(project.id, spec=SFT_SPEC, status="paused")
    db.checkpoint(paused, 3)
    rm = db.job(project.id, spec=RM_SPEC, status="succeeded")
    db.checkpoint(rm, 5)
    db.job(project.id, spec=SFT_SPEC, status="queued")  # no checkpoint: no model

    response = client.get("/v1/models")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list"
    ids = [m["id"] for m in body["data"]]
    assert ids == [f"job:{succeeded}", f"job:{succeeded}@2", f"job:{succeeded}@4", f"job:{running}@1",
                   f"job:{paused}@3"]  # fmt: skip
    for m in body["data"]:
        assert set(m) == {"id", "object", "created", "owned_by"}
        assert m["object"] == "model" and isinstance(m["created"], int) and m["owned_by"] == "test"

    one = client.get(f"/v1/models/job:{running}@1")
    assert one.status_code == 200 and one.json()["id"] == f"job:{running}@1"
    for missing in (f"job:{running}", f"job:{rm}", f"job:{succeeded}@3", "gpt-4", f"job:{succeeded}@99999999999"):
        response = client.get(f"/v1/models/{missing}")
        assert response.status_code == 404, missing
        assert error_of(response)["code"] == "model_not_found"


def test_completions_send_the_task_contract(client: TestClient, answering: Calls, succeeded: str) -> None:
    body = {
        "model": f"job:{succeeded}",
        "prompt": ["a", "b"],
        "max_tokens": 5,
        "temperature": 0.5,
        "top_p": 0.9,
        "n": 2,
        "seed": 7,
        "stop": "\n",
        "user": "someone",
        "frequency_penalty": 0,
        "logprobs": None,
        "echo": False,
    }
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert answering.generated == [
        {
            "job_id": succeeded,
            "step": 4,
            "prompts": ["a", "b"],
            "max_new_tokens": 5,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 7,
            "score": False,
            "n": 2,
            "stop": ["\n"],
        }
    ]
    out = response.json()
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion" and isinstance(out["created"], int)
    assert out["model"] == f"job:{succeeded}"
    assert out["choices"] == [
        {"index": 0, "text": " text 0 0", "finish_reason": "stop", "logprobs": None},
        {"index": 1, "text": " text 0 1", "finish_reason": "length", "logprobs": None},
        {"index": 2, "text": " text 1 0", "finish_reason": "stop", "logprobs": None},
        {"index": 3, "text": " text 1 1", "finish_reason": "length", "logprobs": None},
    ]
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}

    # Defaults, a checkpoint id, and a random seed when none is given.
    response = client.post("/v1/completions", json={"model": f"job:{succeeded}@2", "prompt": "x"})
    assert response.status_code == 200, response.text
    sent = answering.generated[-1]
    assert {k: v for k, v in sent.items() if k != "seed"} == {
        "job_id": succeeded,
        "step": 2,
        "prompts": ["x"],
        "max_new_tokens": 16,
        "temperature": 1.0,
        "top_p": 1.0,
        "score": False,
        "n": 1,
        "stop": [],
    }
    assert 0 <= sent["seed"] < 2**31


def test_completions_stream(client: TestClient, answering: Calls, succeeded: str) -> None:
    answering.answer = lambda kw: {"completions": [{"prompt": "p", "text": " a b  c", "finish_reason": "length"}],
                                   "usage": {"prompt_tokens": 1, "completion_tokens": 3}}  # fmt: skip
    body = {"model": f"job:{succeeded}", "prompt": "p", "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    chunks = sse(text)
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert len({c["id"] for c in chunks}) == 1
    pieces = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(p["text"] for p in pieces) == " a b  c"
    assert len(pieces) == 3
    assert [p["finish_reason"] for p in pieces] == [None, None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 4


def test_chat_completions(client: TestClient, answering: Calls, succeeded: str) -> None:
    body = {
        "model": f"job:{succeeded}",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]},
        ],
        "max_completion_tokens": 9,
        "n": 2,
        "seed": 1,
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    sent = answering.generated[-1]
    assert sent["prompts"] == [] and sent["max_new_tokens"] == 9 and sent["n"] == 2
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = response.json()
    assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion"
    assert out["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": " text 0 0"}, "finish_reason": "stop",
         "logprobs": None},
        {"index": 1, "message": {"role": "assistant", "content": " text 0 1"}, "finish_reason": "length",
         "logprobs": None},
    ]  # fmt: skip

    with client.stream("POST", "/v1/chat/completions", json={**body, "n": 1, "stream": True}) as response:
        chunks = sse(response.read().decode())
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == " text 0 0"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_worker_errors(client: TestClient, calls: Calls, succeeded: str) -> None:
    class ChatTemplateMissing(Exception):  # as Celery re-creates the worker's exception: by class name
        pass

    def missing(kwargs: dict[str, Any]) -> dict[str, Any]:
        raise ChatTemplateMissing("model job:x@4 has no chat template; send a plain prompt to /v1/completions")

    calls.answer = missing
    body = {"model": f"job:{succeeded}", "messages": [{"role": "user", "content": "hi"}]}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "chat_template_missing" and error["param"] == "model"
    assert "/v1/completions" in error["message"]

    class GenerateError(Exception):
        pass

    def too_long(kwargs: dict[str, Any]) -> dict[str, Any]:
        raise GenerateError("exceeds the model's context")

    calls.answer = too_long
    response = client.post("/v1/completions", json={"model": f"job:{succeeded}", "prompt": "x"})
    assert (response.status_code, error_of(response)["code"]) == (400, "invalid_request")


def test_unknown_and_foreign_models_are_404(client: TestClient, calls: Calls, settings: Any, db: Db,
                                            succeeded: str) -> None:  # fmt: skip
    other = new_project(settings, "other")
    foreign = db.job(other.id, spec=SFT_SPEC, status="succeeded")
    db.checkpoint(foreign, 1)
    for model in (f"job:{foreign}", f"job:{foreign}@1", "job:job_000000000000", "gpt-4o", f"job:{succeeded}@3"):
        for path, body in (("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):  # fmt: skip
            response = client.post(path, json={"model": model, **body})
            assert response.status_code == 404, (model, response.text)
            assert error_of(response)["code"] == "model_not_found"
            assert foreign not in response.text or model.startswith(f"job:{foreign}")
    assert foreign not in client.get("/v1/models").text
    assert calls.generated == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ["a"] * 65}, "prompt"),
        ({"prompt": "x" * 8193}, "prompt"),
        ({"prompt": [1, 2]}, "prompt"),
        ({"prompt": "a", "n": 17}, "n"),
        ({"prompt": ["a"] * 33, "n": 2}, None),
        ({"prompt": "a", "n": 0}, "n"),
        ({"prompt": "a", "max_tokens": 513}, "max_tokens"),
        ({"prompt": "a", "temperature": 2.5}, "temperature"),
        ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "a", "stop": [""]}, "stop"),
        ({"prompt": "a", "frequency_penalty": 0.5}, None),
        ({"prompt": "a", "logprobs": 3}, None),
        ({"prompt": "a", "best_of": 3}, None),
        ({"prompt": "a", "bogus": 1}, "bogus"),
        ({"prompt": "a", "seed": 2**31}, "seed"),
        ({}, "prompt"),
    ],
)
def test_completion_caps(client: TestClient, calls: Calls, succeeded: str, body: dict[str, Any],
                         param: str | None) -> None:  # fmt: skip
    response = client.post("/v1/completions", json={"model": f"job:{succeeded}", **body})
    assert response.status_code == 422, response.text
    error = error_of(response)
    assert error["code"] == "invalid_request"
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    assert calls.generated == []


def test_chat_caps(client: TestClient, calls: Calls, succeeded: str) -> None:
    model = f"job:{succeeded}"
    for body in (
        {"model": model, "messages": []},
        {"model": model, "messages": [{"role": "wizard", "content": "x"}]},
        {"model": model, "messages": [{"role": "user", "content": "x" * 8193}]},
        {"model": model, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
    ):
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 422, body
    assert calls.generated == []


def test_openapi_documents_the_routes(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    assert {"/v1/models", "/v1/models/{model_id}", "/v1/completions", "/v1/chat/completions"} <= set(schema["paths"])
    post = schema["paths"]["/v1/chat/completions"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"
    }
    assert "text/event-stream" in post["responses"]["200"]["content"]

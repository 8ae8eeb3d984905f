"""OpenAI's grader endpoints, ``/v1/fine_tuning/alpha/graders/run`` and ``/validate``, driven by the official
``openai`` client (its own response types parse the answers): every grader kind, a judge on loopback offered by the
operator's settings, source graders in the sandbox, and the error flags of OpenAI's run metadata. A run holds no
database connection while it grades, stops at its budget or when its client leaves, and a project runs a bounded
number at once."""

import logging
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api import deps
from api.services import graders as graders_service
from jobs.store.db import engine_for
from jobs.store.settings import JudgeSetting, Settings
from tests.api.helpers import error_of
from tests.factories import Project, make_settings, new_project
from tests.judge_service import JudgeService

SOURCE = """
def grade(sample, item):
    answer = item["answer"]
    if sample["output_json"] is not None:
        return float(sample["output_json"].get("city") == answer)
    return 1.0 if sample["output_text"].strip() == answer else 0.0
"""
STRING_CHECK = {"type": "string_check", "name": "exact", "input": "{{ sample.output_text }}",
                "reference": "{{ item.answer }}", "operation": "eq"}  # fmt: skip
SIMILARITY = {"type": "text_similarity", "name": "fuzzy", "input": "{{ sample.output_text }}",
              "reference": "{{ item.answer }}", "evaluation_metric": "fuzzy_match"}  # fmt: skip
QUESTION = "Is {{ sample.output_text }} the capital of {{ item.country }}?"
SCORE_MODEL = {"type": "score_model", "name": "judged", "model": "judge-small", "range": [0, 1],
               "input": [{"role": "user", "content": QUESTION}]}  # fmt: skip
LABEL_MODEL = {"type": "label_model", "name": "labelled", "model": "judge-small",
               "labels": ["right", "wrong", "unsure"], "passing_labels": ["right"],
               "input": [{"role": "user", "content": "Label: {{ sample.output_text }}"}]}  # fmt: skip
PYTHON = {"type": "python", "name": "code", "source": SOURCE}
ITEM = {"country": "France", "answer": "Paris"}


@pytest.fixture
def judge() -> Iterator[JudgeService]:
    """0.8 for an answer naming Paris, an unreadable answer otherwise; a label from the label prompt's sample."""

    def answer(messages: list[dict[str, str]]) -> str:
        asked = messages[0]["content"]
        if asked.startswith("Label: "):
            return asked.removeprefix("Label: ")
        return '{"result": 0.8}' if "Paris" in asked else "I cannot tell"

    service = JudgeService(answer)
    yield service
    service.close()


@pytest.fixture
def settings(tmp_path: Path, database_url: str, judge: JudgeService) -> Settings:
    return make_settings(tmp_path, database_url, judges={"judge-small": JudgeSetting(url=judge.url, retries=0)})


@pytest.fixture
def oa(client: TestClient, project: Project) -> openai.OpenAI:
    return openai.OpenAI(api_key=project.key, base_url="http://testserver/v1", http_client=client, max_retries=0)


def run(oa: openai.OpenAI, grader: dict[str, Any], sample: str, item: Any = ITEM) -> Any:
    return oa.fine_tuning.alpha.graders.run(grader=grader, model_sample=sample, item=item)  # type: ignore[arg-type]


def flags(result: Any) -> set[str]:
    errors = result.metadata.errors.model_dump(by_alias=True)
    return {name for name, value in errors.items() if value is True}


@pytest.mark.parametrize(
    ("grader", "right", "wrong"),
    [(STRING_CHECK, 1.0, 0.0), (SIMILARITY, 1.0, pytest.approx(0.0)), (PYTHON, 1.0, 0.0),
     (SCORE_MODEL, 0.8, 0.0), (LABEL_MODEL, 1.0, 0.0)],
    ids=["string_check", "text_similarity", "python", "score_model", "label_model"],
)  # fmt: skip
def test_every_grader_runs_on_a_sample(oa: openai.OpenAI, grader: dict[str, Any], right: float, wrong: Any) -> None:
    good = "right" if grader["type"] == "label_model" else "Paris"
    bad = "wrong" if grader["type"] == "label_model" else "xyz"
    result = run(oa, grader, good)
    assert result.reward == right and flags(result) == set(), result
    assert (result.metadata.name, result.metadata.type) == (grader["name"], grader["type"])
    assert result.metadata.execution_time > 0
    assert run(oa, grader, bad).reward == wrong


def test_a_python_grader_reads_output_json(oa: openai.OpenAI) -> None:
    assert run(oa, PYTHON, '{"city": "Paris"}').reward == 1.0
    assert run(oa, PYTHON, '{"city": "Lyon"}').reward == 0.0


def test_a_multi_gives_its_sub_rewards(oa: openai.OpenAI) -> None:
    grader = {"type": "multi", "name": "all", "calculate_output": "(exact + code + judged) / 3",
              "graders": {"exact": STRING_CHECK, "code": PYTHON, "judged": SCORE_MODEL}}  # fmt: skip
    result = run(oa, grader, "Paris")
    assert result.reward == pytest.approx((1 + 1 + 0.8) / 3)
    assert result.sub_rewards == {"exact": 1.0, "code": 1.0, "judged": 0.8}
    assert result.metadata.token_usage == 12
    assert result.model_grader_token_usage_per_model == {"judge-small": {"total_tokens": 12}}


def test_each_label_passes_or_fails(oa: openai.OpenAI) -> None:
    rewards = {label: run(oa, LABEL_MODEL, label) for label in ("right", "wrong", "unsure", "banana")}
    assert {label: r.reward for label, r in rewards.items()} == {"right": 1.0, "wrong": 0.0, "unsure": 0.0,
                                                                 "banana": 0.0}  # fmt: skip
    assert flags(rewards["banana"]) == {"model_grader_parse_error"}  # not one of the labels
    assert flags(rewards["unsure"]) == set()


def test_errors_are_flagged_as_openai_flags_them(oa: openai.OpenAI, judge: JudgeService) -> None:
    unreadable = run(oa, SCORE_MODEL, "Lyon")
    assert unreadable.reward == 0.0 and flags(unreadable) == {"model_grader_parse_error"}
    raising = run(oa, {**PYTHON, "source": "def grade(sample, item):\n    return 1 / 0\n"}, "Paris")
    assert raising.reward == 0.0 and flags(raising) == {"python_grader_runtime_error"}
    assert "ZeroDivisionError" in (raising.metadata.errors.python_grader_runtime_error_details or "")
    missing = run(oa, STRING_CHECK, "Paris", item={"country": "France"})
    assert flags(missing) == {"invalid_variable_error"}
    formula = run(oa, {"type": "multi", "calculate_output": "1 / exact", "graders": {"exact": STRING_CHECK}}, "Lyon")
    assert flags(formula) == {"formula_parse_error"}
    judge.answer = lambda messages: 503
    down = run(oa, SCORE_MODEL, "Paris")
    assert flags(down) == {"model_grader_server_error"}
    assert "HTTP 503" in (down.metadata.errors.api_model_grader_server_error_details or "")


def test_validate_answers_the_grader_or_a_400_naming_the_field(oa: openai.OpenAI) -> None:
    multi = {"type": "multi", "name": "all", "calculate_output": "exact + code", "graders": {"exact": STRING_CHECK,
             "code": PYTHON}}  # fmt: skip
    for grader in (STRING_CHECK, SIMILARITY, PYTHON, SCORE_MODEL, LABEL_MODEL, multi):
        validated = oa.fine_tuning.alpha.graders.validate(grader=grader)  # type: ignore[arg-type]
        assert validated.grader is not None and validated.grader.type == grader["type"]
    refusals = [
        ({**PYTHON, "source": "def grade(sample, item):\n    return (\n"}, "grader.python.source", "does not compile"),
        ({**SCORE_MODEL, "range": [1, 0]}, "grader.score_model.range", "lower first"),
        ({**LABEL_MODEL, "passing_labels": ["great"]}, "grader.label_model", "passing_labels"),
        ({**SCORE_MODEL, "model": "gpt-9"}, "grader", "the judge 'gpt-9' is not offered here"),
    ]
    for grader, param, words in refusals:
        with pytest.raises(openai.BadRequestError) as refused:
            oa.fine_tuning.alpha.graders.validate(grader=grader)  # type: ignore[arg-type]
        assert refused.value.param == param and words in refused.value.message, refused.value.message


def test_a_reward_model_grader_is_for_jobs_only(oa: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="run on the workers"):
        run(oa, {"type": "model", "model": "builtin:tiny"}, "Paris")


# --- the API while graders run: no database held, a budget, a bound per project, a client that leaves --------------

RUN_PATH = "/v1/fine_tuning/alpha/graders/run"


class Thinking:
    """The judge's answer held back until ``release`` (or 30 s); ``asked`` once a request reached it."""

    def __init__(self, judge: JudgeService) -> None:
        self.asked, self.release = threading.Event(), threading.Event()
        judge.answer = self.answer

    def answer(self, messages: list[dict[str, str]]) -> str:
        self.asked.set()
        self.release.wait(30)
        return '{"result": 0.8}'


def test_grading_holds_no_database_connection(
    oa: openai.OpenAI, client: TestClient, settings: Settings, judge: JudgeService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a single database slot, a request waiting for its judge leaves it (and its pooled connection) to the
    others: another request is answered meanwhile."""
    monkeypatch.setattr(deps, "DB_SLOTS", 1)  # the event loop's slots are made at its first request
    thinking = Thinking(judge)
    with ThreadPoolExecutor(1) as pool:
        try:
            running = pool.submit(run, oa, SCORE_MODEL, "Paris")
            assert thinking.asked.wait(30)
            assert engine_for(settings.resolved_database_url).pool.checkedout() == 0
            assert client.get("/v1/jobs").status_code == 200
            assert not running.done()  # answered while the grader still ran
        finally:
            thinking.release.set()
        assert running.result().reward == 0.8


def test_a_project_grades_a_bounded_number_at_once(
    client: TestClient, settings: Settings, project: Project, judge: JudgeService
) -> None:
    settings.grader_runs_per_project = 1
    other = new_project(settings, "other")
    thinking = Thinking(judge)
    body = {"grader": STRING_CHECK, "model_sample": "Paris", "item": ITEM}
    with ThreadPoolExecutor(1) as pool:
        try:
            running = pool.submit(client.post, RUN_PATH, json={**body, "grader": SCORE_MODEL})
            assert thinking.asked.wait(30)
            refused = client.post(RUN_PATH, json=body)
            assert refused.status_code == 429, refused.text
            assert error_of(refused)["code"] == "too_many_grader_runs"
            assert "RLHF_GRADER_RUNS_PER_PROJECT" in error_of(refused)["message"]
            assert client.post(RUN_PATH, json=body, headers=other.headers).json()["reward"] == 1.0  # not another's
        finally:
            thinking.release.set()
        assert running.result().json()["reward"] == 0.8
    assert client.post(RUN_PATH, json=body).json()["reward"] == 1.0


def accepted_again(client: TestClient, within_s: float = 15) -> bool:
    """Whether the project, allowed one run at once, is let run again within ``within_s``: its last run's grading
    has stopped."""
    body = {"grader": STRING_CHECK, "model_sample": "Paris", "item": ITEM}
    deadline = time.monotonic() + within_s
    while (answer := client.post(RUN_PATH, json=body)).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.05)
    return answer.status_code == 200


TWO_JUDGES = {
    "type": "multi",
    "calculate_output": "first + second",
    "graders": {"first": SCORE_MODEL, "second": SCORE_MODEL},
}
"""Two judge graders, asked one after the other."""


def test_a_run_past_its_budget_is_answered_and_stopped(
    client: TestClient, settings: Settings, judge: JudgeService
) -> None:
    """All graders together get RLHF_GRADER_RUN_SECONDS: past it, a 400 naming it, and the grading stops: a source
    grader's sandbox is killed (the project may run again at once), and once the judge's request in flight is
    answered, no other grader is asked."""
    settings.grader_runs_per_project, settings.grader_run_seconds = 1, 1
    thinking = Thinking(judge)
    sleeping = {"type": "python", "source": "import time\ndef grade(sample, item):\n    time.sleep(60)\n"}
    try:
        for grader in (sleeping, TWO_JUDGES):
            answer = client.post(RUN_PATH, json={"grader": grader, "model_sample": "Paris", "item": ITEM})
            assert answer.status_code == 400, answer.text
            assert error_of(answer)["code"] == "grader_run_timeout"
            assert "RLHF_GRADER_RUN_SECONDS" in error_of(answer)["message"]
            if grader is sleeping:
                assert accepted_again(client)
    finally:
        thinking.release.set()
    assert accepted_again(client)
    assert len(judge.requests) == 1  # the second judge grader never asked


def test_a_client_that_leaves_stops_its_grading(
    app: FastAPI, settings: Settings, project: Project, judge: JudgeService, caplog: pytest.LogCaptureFixture
) -> None:
    """Served by uvicorn: a client that stops waiting (its read timeout) stops the grading; once the judge's
    request in flight is answered, no other grader is asked, and the project may run again."""
    caplog.set_level(logging.INFO, logger=graders_service.__name__)
    settings.grader_runs_per_project = 1
    thinking = Thinking(judge)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
        thread.start()
        try:
            while not server.started:
                time.sleep(0.01)
            host, port = listener.getsockname()
            with httpx.Client(base_url=f"http://{host}:{port}", headers=project.headers) as http:
                body = {"grader": TWO_JUDGES, "model_sample": "Paris", "item": ITEM}
                with pytest.raises(httpx.ReadTimeout):
                    http.post(RUN_PATH, json=body, timeout=httpx.Timeout(30, read=1))  # leaves after 1 s
                assert thinking.asked.is_set()
                deadline = time.monotonic() + 15
                while not any("the client left" in r.getMessage() for r in caplog.records):
                    assert time.monotonic() < deadline, "the server did not see the client leave"
                    time.sleep(0.02)
                thinking.release.set()
                assert accepted_again(http)  # type: ignore[arg-type]
            assert len(judge.requests) == 1  # the second judge grader never asked
        finally:
            thinking.release.set()
            server.should_exit = True
            thread.join(timeout=10)


def test_input_nested_too_deeply_is_a_400_naming_the_field(oa: openai.OpenAI) -> None:
    deep_source = "x = " + "lambda: " * 3000 + "1\ndef grade(sample, item):\n    return 1.0\n"
    with pytest.raises(openai.BadRequestError) as refused:
        run(oa, {**PYTHON, "source": deep_source}, "Paris")
    assert refused.value.param == "grader.python.source" and "nests too deeply" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        run(oa, PYTHON, "[" * 1100 + "]" * 1100)
    assert refused.value.param == "model_sample", refused.value


def test_openais_documented_python_grader_validates_and_runs(oa: openai.OpenAI) -> None:
    """OpenAI's example (``from rapidfuzz import fuzz, utils``) runs; an import the sandbox cannot make fails
    validate, naming it and what a grader may import."""
    source = """
from rapidfuzz import fuzz, utils

def grade(sample, item) -> float:
    output_text = sample["output_text"]
    reference_answer = item["reference_answer"]
    return fuzz.WRatio(output_text, reference_answer, processor=utils.default_process) / 100.0
"""
    grader = {"type": "python", "name": "fuzzy", "source": source}
    assert oa.fine_tuning.alpha.graders.validate(grader=grader).grader is not None  # type: ignore[arg-type]
    assert run(oa, grader, "paris", item={"reference_answer": "Paris"}).reward == 1.0
    with pytest.raises(openai.BadRequestError) as refused:
        oa.fine_tuning.alpha.graders.validate(grader={**grader, "source": "import requests\n" + source})  # type: ignore[arg-type]
    assert "its source imports requests" in refused.value.message and "rapidfuzz" in refused.value.message

"""OpenAI's grader endpoints, ``/v1/fine_tuning/alpha/graders/run`` and ``/validate``, driven by the official
``openai`` client (its own response types parse the answers): every grader kind, a judge on loopback offered by the
operator's settings, source graders in the sandbox, and the error flags of OpenAI's run metadata."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from jobs.store.settings import JudgeSetting, Settings
from tests.factories import Project, make_settings
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

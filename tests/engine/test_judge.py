"""score_model and label_model graders: the judge's answers read as OpenAI's graders read them, the conversations
sent to an OpenAI-compatible endpoint (a scripted one on loopback), and the judge's failures."""

from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ValidationError

from engine.rewards.graders import (
    RewardServiceError,
    Samples,
    check_allowed,
    parse_grader,
    reward_metrics,
    score,
)
from engine.rewards.judge import Endpoint, read_label, read_score
from tests.judge_service import JudgeService


@pytest.mark.parametrize(
    ("text", "low", "high", "expected"),
    [
        ('{"result": 0.7}', 0, 1, 0.7),
        ('{"steps": [], "result": 3}', 0, 5, 3.0),
        ("I'd give it 4 out of 5.", 0, 5, 4.0),
        ("-1", -1, 1, -1.0),
        ("7", 0, 5, None),  # outside the range
        ("no idea", 0, 1, None),
        ("true", 0, 1, None),
        ('{"result": "high"}', 0, 1, None),
        ("1e-1", 0, 1, 0.1),
    ],
)
def test_a_score_is_read_from_json_or_the_first_number(text: str, low: float, high: float,
                                                       expected: float | None) -> None:  # fmt: skip
    assert read_score(text, low, high) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("good", "good"), ("Good.", "good"), ('"bad"', "bad"), ("The answer is bad", "bad"), ('{"result": "bad"}', "bad"),
     ("good or bad", None), ("goodness", None), ("", None)],
)  # fmt: skip
def test_a_label_is_the_answer_or_the_one_label_it_names(text: str, expected: str | None) -> None:
    assert read_label(text, ["good", "bad"]) == expected


@pytest.fixture
def judge() -> Iterator[JudgeService]:
    """Scores 1 an output saying yes, 0.25 one saying no, and answers nonsense to anything else."""

    def answer(messages: list[dict[str, str]]) -> str:
        asked = messages[0]["content"]
        return '{"result": 1}' if "yes" in asked else "0.25" if "no" in asked else "hmm, hard to say"

    service = JudgeService(answer)
    yield service
    service.close()


def samples(completions: list[str]) -> Samples:
    rows = [{"prompt": f"q{i}", "topic": "cats"} for i in range(len(completions))]
    return Samples(prompts=[r["prompt"] for r in rows], prompt_texts=[r["prompt"] for r in rows],
                   completions=completions, rows=rows)  # fmt: skip


SCORE_MODEL = {
    "type": "score_model", "name": "judged", "model": "judge-small",
    "input": [{"role": "user", "content": "About {{ item.topic }}: {{sample.output_text}}"},
              {"role": "developer", "content": [{"type": "input_text", "text": "Be strict."}]}],
    "sampling_params": {"temperature": 0.0, "seed": 3},
}  # fmt: skip


def test_a_score_model_grader_asks_the_judge_each_sample_and_counts_unreadable_answers(judge: JudgeService) -> None:
    endpoint = Endpoint(url=judge.url, model="served-name", api_key="k3y", concurrency=2)
    scored = score(parse_grader(SCORE_MODEL), samples(["yes", "no", "maybe"]), judges={"judge-small": endpoint}.get)
    assert scored.total == [1.0, 0.25, 0.0]
    assert scored.components["judged/invalid"] == [0.0, 0.0, 1.0]
    assert "hmm, hard to say" in scored.errors["judged"]
    assert scored.judge_tokens == {"judge-small": 36}
    metrics = reward_metrics(scored)
    assert metrics["reward/judged/invalid"] == pytest.approx(1 / 3) and metrics["reward/judge_tokens"] == 36
    sent = sorted(judge.requests, key=lambda r: r["messages"][0]["content"])
    assert [r["messages"][0]["content"] for r in sent] == ["About cats: maybe", "About cats: no", "About cats: yes"]
    first = sent[0]
    assert first["model"] == "served-name" and first["authorization"] == "Bearer k3y"
    assert first["messages"][1] == {"role": "system", "content": "Be strict."}  # developer is sent as system
    assert first["messages"][2]["role"] == "system" and "from 0 to 1" in first["messages"][2]["content"]
    assert (first["max_tokens"], first["temperature"], first["seed"]) == (256, 0.0, 3)
    assert "top_p" not in first


def test_a_label_model_grader_passes_the_passing_labels(judge: JudgeService) -> None:
    judge.answer = lambda messages: "correct" if "4" in messages[0]["content"] else "Incorrect."
    spec = {"type": "label_model", "name": "lab", "model": "j", "labels": ["correct", "incorrect"],
            "passing_labels": ["correct"],
            "input": [{"role": "user", "content": "2+2={{sample.output_text}}"}]}  # fmt: skip
    scored = score(parse_grader(spec), samples(["4", "5"]), judges={"j": Endpoint(url=judge.url, model="j")}.get)
    assert scored.total == [1.0, 0.0] and scored.components["lab/invalid"] == [0.0, 0.0]
    assert "correct, incorrect" in judge.requests[0]["messages"][-1]["content"]


def test_judges_inside_a_multi_with_a_rule(judge: JudgeService) -> None:
    spec = {"type": "multi", "calculate_output": "0.5 * judged + 0.5 * exact",
            "graders": {"judged": {**SCORE_MODEL, "name": "ignored"},
                        "exact": {"type": "string_check", "input": "{{ sample.output_text }}", "reference": "yes",
                                  "operation": "eq"}}}  # fmt: skip
    scored = score(parse_grader(spec), samples(["yes", "no"]), judges={"judge-small": Endpoint(judge.url, "m")}.get)
    assert scored.total == [1.0, 0.125]
    assert scored.components["exact"] == [1.0, 0.0] and scored.components["judged"] == [1.0, 0.25]


def test_a_judge_that_is_down_fails_after_its_retries_and_one_not_offered_at_once(judge: JudgeService) -> None:
    judge.answer = lambda messages: 503
    endpoint = Endpoint(url=judge.url, model="m", retries=2, backoff_s=0.0)
    with pytest.raises(RewardServiceError, match="failed 3 times; last: HTTP 503"):
        score(parse_grader(SCORE_MODEL), samples(["yes"]), judges={"judge-small": endpoint}.get)
    assert len(judge.requests) == 3
    with pytest.raises(RewardServiceError, match="no judge 'judge-small' is offered"):
        score(parse_grader(SCORE_MODEL), samples(["yes"]), judges={}.get)
    judge.answer = lambda messages: 400
    with pytest.raises(RewardServiceError, match="HTTP 400"):  # refused: not retried
        score(parse_grader(SCORE_MODEL), samples(["yes"]), judges={"judge-small": endpoint}.get)
    assert len(judge.requests) == 4


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"range": [1, 0]}, "the lower first"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
        ({"input": [{"role": "user", "content": "{{ sample.output_json }}"}]}, "unknown placeholder"),
        ({"input": []}, "at least 1"),
        ({"sampling_params": {"temperature": 3}}, "temperature"),
    ],
)
def test_score_model_specs_refuse_bad_fields(change: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        parse_grader({**SCORE_MODEL, **change})


def test_label_model_specs_need_passing_labels_among_distinct_labels() -> None:
    base = {"type": "label_model", "model": "j", "input": [{"role": "user", "content": "x"}]}
    with pytest.raises(ValidationError, match="passing_labels must be among labels; not: great"):
        parse_grader({**base, "labels": ["good", "bad"], "passing_labels": ["great"]})
    with pytest.raises(ValidationError, match="labels must be distinct"):
        parse_grader({**base, "labels": ["good", "good"], "passing_labels": ["good"]})


def test_the_operator_offers_the_judges_and_switches_source_graders() -> None:
    grader = parse_grader({"type": "multi", "weights": {"a": 1.0, "b": 1.0}, "graders": {
        "a": SCORE_MODEL, "b": {"type": "python", "source": "def grade(sample, item):\n    return 1\n"}}})  # fmt: skip
    assert check_allowed(grader, [], None, judges={"judge-small"}) == []
    refused = check_allowed(grader, [], None, judges={"other"}, source_graders=False)
    assert refused == [
        "grader 'a': the judge 'judge-small' is not offered here (RLHF_JUDGES: other)",
        "grader 'b': python source graders are switched off here (RLHF_SOURCE_GRADERS)",
    ]

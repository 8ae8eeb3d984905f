"""engine/rewards/graders.py: the reward graders' specs, their scores (against the libraries they wrap), the formula
interpreter, the operator allow-lists, and the http grader against a real reward service on loopback."""

import http.server
import json
import math
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from engine.callbacks import StopRequest
from engine.rewards import graders, sandbox
from engine.rewards.graders import (
    ModelGrader,
    RewardError,
    RewardFunctionError,
    RewardScores,
    RewardServiceError,
    RewardStopped,
    Samples,
    check_allowed,
    iter_graders,
    model_refs,
    parse_grader,
    reward_metrics,
    score,
)

ROOT = Path(__file__).resolve().parents[2]
OUTPUT = "{{ sample.output_text }}"
METRICS = ["fuzzy_match", "bleu", "gleu", "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l"]


def make_samples(completions: list[str], rows: list[dict[str, Any]] | None = None) -> Samples:
    """Samples of ``completions``; the rows default to ``{"prompt": "q<i>"}``, chat prompts render as their text."""
    rows = rows if rows is not None else [{"prompt": f"q{i}"} for i in range(len(completions))]
    prompts = [row["prompt"] for row in rows]
    texts = [p if isinstance(p, str) else "".join(m["content"] for m in p) for p in prompts]
    return Samples(prompts=prompts, prompt_texts=texts, completions=completions, rows=rows)


def grade(spec: dict[str, Any], completions: list[str], rows: list[dict[str, Any]] | None = None) -> RewardScores:
    return score(parse_grader(spec), make_samples(completions, rows), model_scorer=fixed_scores)


# Model graders in these tests score every sample with the number their model reference names.
MODEL_SCORES = {"a": 2.0, "b": 3.0, "c": -4.0, "zero": 0.0}


def fixed_scores(grader: ModelGrader, samples: Samples) -> list[float]:
    return [MODEL_SCORES[grader.model]] * len(samples)


def models(*names: str) -> dict[str, Any]:
    return {name: {"type": "model", "model": name} for name in names}


# ---------------------------------------------------------------------------------------------------------------
# string_check and text_similarity


@pytest.mark.parametrize(
    ("operation", "output", "reference", "expected"),
    [
        ("eq", "Paris", "Paris", 1.0),
        ("eq", "paris", "Paris", 0.0),
        ("ne", "paris", "Paris", 1.0),
        ("ne", "Paris", "Paris", 0.0),
        ("like", "The capital is Paris.", "Paris", 1.0),
        ("like", "the capital is paris.", "Paris", 0.0),
        ("like", "Paris", "The capital is Paris.", 0.0),  # the reference must occur in the input, not the reverse
        ("ilike", "the capital is PARIS.", "Paris", 1.0),
        ("ilike", "the capital is Lyon.", "Paris", 0.0),
    ],
)
def test_string_check(operation: str, output: str, reference: str, expected: float) -> None:
    spec = {"type": "string_check", "input": OUTPUT, "reference": "{{ item.answer }}", "operation": operation}
    scores = grade(spec, [output], [{"prompt": "q", "answer": reference}])
    assert scores.total == [expected]
    assert scores.components == {"string_check": [expected]}


def similarity(metric: str, output: str, reference: str) -> float:
    spec = {"type": "text_similarity", "input": OUTPUT, "reference": reference, "evaluation_metric": metric}
    return grade(spec, [output]).total[0]


@pytest.mark.parametrize("metric", METRICS)
def test_text_similarity_identical_and_disjoint(metric: str) -> None:
    sentence = "the cat sat on the mat"
    assert similarity(metric, sentence, sentence) == pytest.approx(1.0)
    assert similarity(metric, "xyzw", "abc def") == 0.0  # no character, word or n-gram in common


@pytest.mark.parametrize(
    ("metric", "output", "reference", "expected"),
    [
        ("fuzzy_match", "abc", "abd", 2 / 3),  # Indel distance 2 over 6 characters
        ("rouge_1", "the cat sat", "the cat ran", 2 / 3),  # 2 of 3 words each way
        ("rouge_2", "the cat sat", "the cat ran", 1 / 2),  # "the cat" of 2 bigrams each way
        ("rouge_l", "the cat sat on the mat", "the cat on a mat", 2 * (4 / 6) * (4 / 5) / (4 / 6 + 4 / 5)),  # LCS 4
    ],
)
def test_text_similarity_by_hand(metric: str, output: str, reference: str, expected: float) -> None:
    assert similarity(metric, output, reference) == pytest.approx(expected)


def library_score(metric: str, output: str, reference: str) -> float:
    """The libraries called directly, as the grader documents them."""
    if metric == "fuzzy_match":
        from rapidfuzz import fuzz

        return fuzz.ratio(output, reference) / 100
    if metric == "bleu":
        import sacrebleu

        return sacrebleu.sentence_bleu(output, [reference]).score / 100
    if metric == "gleu":
        from nltk.translate.gleu_score import sentence_gleu

        return sentence_gleu([reference.split()], output.split())
    from rouge_score import rouge_scorer

    rouge_type = {"rouge_l": "rougeL"}.get(metric, metric.replace("_", ""))
    return rouge_scorer.RougeScorer([rouge_type]).score(reference, output)[rouge_type].fmeasure


@pytest.mark.parametrize("metric", METRICS)
def test_text_similarity_matches_the_library(metric: str) -> None:
    reference = "the quick brown fox jumps over the lazy dog near the river bank today"
    output = "the quick brown fox jumps over the lazy cat near the river bank"
    expected = library_score(metric, output, reference)
    assert 0 < expected < 1  # a partial match
    assert similarity(metric, output, reference) == pytest.approx(expected)


def item_similarity(metric: str, output: str, reference: str) -> float:
    """``similarity`` with the reference in the dataset row (a template holds at most 10,000 characters)."""
    spec = {
        "type": "text_similarity",
        "input": OUTPUT,
        "reference": "{{ item.reference }}",
        "evaluation_metric": metric,
    }
    return grade(spec, [output], [{"prompt": "q", "reference": reference}]).total[0]


@pytest.mark.parametrize("metric", METRICS)
def test_a_text_metric_compares_a_bounded_start_of_each_text(metric: str) -> None:
    """Texts alike over their first 10,000 characters (and 1,000 tokens), unlike past them, score as alike: what a
    metric compares is bounded (rouge_l's table grows with the product of the lengths, fuzzy_match's time too), in
    jobs and in graders/run alike."""
    alike = " ".join(f"word{i}" for i in range(3000))  # 26,889 characters, 3,000 tokens
    output, reference = alike + " alpha" * 3000, alike + " beta" * 3000
    assert len(alike) > graders.MAX_METRIC_CHARS and graders.MAX_METRIC_CHARS // 9 > graders.MAX_LCS_TOKENS

    assert item_similarity(metric, output, reference) == pytest.approx(1.0)


def test_rouge_l_scores_the_first_tokens_as_the_library_does() -> None:
    words = ["cat", "hat", "mice", "3", "the", "a"]
    output = [words[(i * 7) % 6] for i in range(2500)]
    reference = [words[(i * i) % 6] for i in range(2500)]
    expected = library_score("rouge_l", " ".join(output[:1000]), " ".join(reference[:1000]))
    assert 0 < expected < 1

    assert item_similarity("rouge_l", " ".join(output), " ".join(reference)) == pytest.approx(expected)
    assert graders._first_tokens("The CAT, -- a hat! 3 mice", 3) == "the cat, -- a"  # its tokens as rouge-score's


def test_pass_threshold_reports_a_pass_rate() -> None:
    spec = {
        "type": "text_similarity",
        "name": "close",
        "input": OUTPUT,
        "reference": "abcd",
        "evaluation_metric": "fuzzy_match",
        "pass_threshold": 0.75,
    }
    scores = grade(spec, ["abcd", "abcx", "wxyz"])
    assert scores.total == pytest.approx([1.0, 0.75, 0.0])
    assert scores.components["close/pass"] == [1.0, 1.0, 0.0]
    assert scores.components["close"] == scores.total


# ---------------------------------------------------------------------------------------------------------------
# Templates


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{item.meta.answer.text}}!", "Paris!"),
        ("{{ item.n }} and {{   item.tags }}", '3 and ["a", "b"]'),  # non-strings as JSON
        ("[{{ sample.output_text }}|{{item.meta}}]", '[out|{"answer": {"text": "Paris"}}]'),
        ("{{ item.missing", "{{ item.missing"),  # not a placeholder: kept as written
    ],
)
def test_templates_substitute_the_row_and_the_output(template: str, expected: str) -> None:
    row = {"prompt": "q", "meta": {"answer": {"text": "Paris"}}, "n": 3, "tags": ["a", "b"]}
    spec = {"type": "string_check", "input": template, "reference": expected, "operation": "eq"}
    assert grade(spec, ["out"], [row]).total == [1.0]
    spec["reference"] = expected + " "
    assert grade(spec, ["out"], [row]).total == [0.0]


@pytest.mark.parametrize(
    "template", ["{{ sample.output_json }}", "{{ item }}", "{{ foo.bar }}", "{{ item.a[0] }}", "{{ 7 * 7 }}"]
)
def test_unknown_placeholders_are_refused(template: str) -> None:
    spec = {"type": "text_similarity", "input": template, "reference": "x", "evaluation_metric": "bleu"}
    with pytest.raises(ValidationError, match=r"unknown placeholder .*sample\.output_text.*item\.<column>"):
        parse_grader(spec)


@pytest.mark.parametrize(("template", "missing"), [("{{ item.answer }}", "item.answer"),
                                                   ("{{ item.meta.nope }}", "item.meta.nope"),
                                                   ("{{ item.prompt.x }}", "item.prompt.x")])  # fmt: skip
def test_a_missing_column_names_the_grader_and_the_column(template: str, missing: str) -> None:
    spec = {"type": "string_check", "name": "exact", "input": OUTPUT, "reference": template, "operation": "eq"}
    with pytest.raises(RewardError, match=rf"grader 'exact': the dataset row has no {missing}\b"):
        grade(spec, ["out"], [{"prompt": "q", "meta": {"answer": 1}}])


# ---------------------------------------------------------------------------------------------------------------
# Multi graders: formulas, weights, nesting, names


def combined(formula: str) -> float:
    spec = {"type": "multi", "graders": models("a", "b", "c"), "calculate_output": formula}
    return grade(spec, ["x"]).total[0]


@pytest.mark.parametrize(
    ("formula", "expected"),
    [
        ("a + b", 5.0),
        ("0.7 * a + 0.3 * b", 2.3),
        ("a ^ b", 8.0),  # OpenAI's power
        ("a ** b", 8.0),
        ("2 ^ 3 ^ 2", 512.0),  # right-associative, as **
        ("-c", 4.0),
        ("(a + b) * 2 - c / a", 12.0),
        ("b / a", 1.5),
        ("min(a, b, c)", -4.0),
        ("max(a, b)", 3.0),
        ("abs(c)", 4.0),
        ("floor(b / a)", 1.0),
        ("ceil(b / a)", 2.0),
        ("exp(0)", 1.0),
        ("sqrt(a * 8)", 4.0),
        ("log(exp(b))", 3.0),
        ("7", 7.0),
    ],
)
def test_formulas(formula: str, expected: float) -> None:
    assert combined(formula) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("formula", "named"),
    [
        ("__import__('os')", "__import__('os')"),
        ("a.b", "a.b"),
        ("a[0]", "a[0]"),
        ("a + d", "unknown name 'd'"),
        ("lambda: 1", "lambda"),
        ("'a'", "'a'"),
        ("[x for x in a]", "for x in a"),
        ("a if b else c", "a if b else c"),
        ("a // b", "a // b"),
        ("a < b", "a < b"),
        ("open(a)", "open(a)"),
        ("min(a)", "min(a)"),
        ("abs(a, key=b)", "abs(a, key=b)"),
        ("True + a", "True"),
        ("1j * a", "1j"),
        ("a +", "not a formula"),
    ],
)
def test_formulas_outside_the_whitelist_are_refused(formula: str, named: str) -> None:
    with pytest.raises(ValidationError, match="calculate_output") as error:
        parse_grader({"type": "multi", "graders": models("a", "b", "c"), "calculate_output": formula})
    assert named in str(error.value)


@pytest.mark.parametrize(("formula", "problem"), [("b / (a - a)", "division by zero"),
                                                  ("sqrt(c)", "math domain error"),
                                                  ("exp(1000)", "range")])  # fmt: skip
def test_a_formula_failing_on_a_sample_names_the_grader(formula: str, problem: str) -> None:
    spec = {"type": "multi", "name": "combo", "graders": models("a", "b", "c"), "calculate_output": formula}
    with pytest.raises(RewardError, match=rf"grader 'combo': .* failed on sample 0: .*{problem}"):
        grade(spec, ["x"])


def test_weights_sum_the_weighted_components() -> None:
    spec = {"type": "multi", "name": "mix", "graders": models("a", "b", "c"), "weights": {"a": 0.5, "b": 2.0}}
    scores = grade(spec, ["x", "y"])
    assert scores.total == [7.0, 7.0]  # c has no weight: reported only
    assert scores.components == {"a": [2.0, 2.0], "b": [3.0, 3.0], "c": [-4.0, -4.0], "mix": [7.0, 7.0]}


@pytest.mark.parametrize(
    ("combination", "problem"),
    [
        ({"weights": {"a": 1.0, "d": 1.0}}, "weights must name graders"),
        ({"weights": {}}, "weights must name graders"),
        ({}, "exactly one of calculate_output and weights"),
        ({"weights": {"a": 1.0}, "calculate_output": "a"}, "exactly one of calculate_output and weights"),
    ],
)
def test_a_multi_takes_weights_or_a_formula(combination: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        parse_grader({"type": "multi", "graders": models("a", "b"), **combination})


def test_nested_multis_report_every_level() -> None:
    inner = {"type": "multi", "name": "ignored", "graders": models("a", "b"), "weights": {"a": 1.0, "b": 1.0}}
    spec = {"type": "multi", "name": "top", "graders": {"inner": inner, **models("c")}, "calculate_output": "inner * c"}
    scores = grade(spec, ["x"])
    assert scores.total == [-20.0]
    assert scores.components == {"a": [2.0], "b": [3.0], "inner": [5.0], "c": [-4.0], "top": [-20.0]}


def nested(levels: int) -> dict[str, Any]:
    """A reward ``levels`` graders deep: multis of one multi each, down to a model grader."""
    spec: dict[str, Any] = {"type": "model", "model": "a"}
    for level in range(levels - 1):
        spec = {"type": "multi", "graders": {f"level{level}": spec}, "calculate_output": f"level{level}"}
    return spec


def test_graders_nest_three_levels_deep() -> None:
    assert grade(nested(3), ["x"]).total == [2.0]
    with pytest.raises(ValidationError, match="at most 3 levels"):
        parse_grader(nested(4))


def multi(graders: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """A multi grader of ``graders`` weighing each 1."""
    spec = {"type": "multi", "graders": graders, "weights": dict.fromkeys(graders, 1.0)}
    return spec if name is None else {**spec, "name": name}


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ({"type": "model", "name": "mean", "model": "a"}, "'mean' is reserved"),
        (multi(models("a"), name="std"), "'std' is reserved"),
        (multi(models("std")), "'std' is reserved"),
        (multi(models("a"), name="a"), "repeated: a"),
        (multi(models("multi")), "repeated: multi"),  # an unnamed grader is named by its type
        (multi({"x": multi(models("b")), **models("b")}), "repeated: b"),
        ({"type": "model", "name": "a/b", "model": "a"}, "should match pattern"),
        (multi(models("1a")), "should match pattern"),
    ],
)
def test_names_refused(spec: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        parse_grader(spec)


def test_a_components_own_name_is_ignored() -> None:
    spec = multi({"x": multi(models("a"), name="b"), **models("b")}, name="top")
    assert grade(spec, ["q"]).components == {"a": [2.0], "x": [2.0], "b": [3.0], "top": [5.0]}


def test_iter_graders_and_model_refs_walk_nested_multis() -> None:
    inner = {"type": "multi", "graders": models("a", "b"), "weights": {"a": 1.0}}
    check = {"type": "string_check", "name": "own name", "input": OUTPUT, "reference": "x", "operation": "eq"}
    grader = parse_grader({"type": "multi", "graders": {"inner": inner, "check": check}, "weights": {"inner": 1}})
    assert [(name, sub.type) for name, sub in iter_graders(grader)] == [
        ("a", "model"),
        ("b", "model"),
        ("check", "string_check"),  # a component is named by its key
    ]
    assert model_refs(grader) == ["a", "b"]
    single = parse_grader({"type": "model", "model": "job:abc@3"})
    assert [name for name, _ in iter_graders(single)] == ["model"]
    assert model_refs(single) == ["job:abc@3"]


def test_model_graders_need_a_scorer_that_scores_every_sample() -> None:
    grader = parse_grader({"type": "model", "name": "rm", "model": "a"})
    with pytest.raises(RewardError, match="grader 'rm': model graders need a model scorer"):
        score(grader, make_samples(["x"]))
    with pytest.raises(RewardError, match="grader 'rm': the reward model a gave 1 scores for 2 samples"):
        score(grader, make_samples(["x", "y"]), model_scorer=lambda g, s: [1.0])
    assert score(grader, make_samples(["x", "y"]), model_scorer=fixed_scores).components == {"rm": [2.0, 2.0]}


def test_specs_refuse_bad_fields() -> None:
    for spec in [
        {"type": "model", "model": "has space"},
        {"type": "model", "model": "a", "extra": 1},
        {"type": "http", "url": "ftp://host/x"},
        {"type": "http", "url": "http:///x"},
        {"type": "http", "url": "http://host\\@127.0.0.1/"},
        {"type": "http", "url": "http://host/", "timeout_s": 0},
        {"type": "http", "url": "http://host/", "retries": 21},
        {"type": "python", "function": "os.system"},
        {"type": "python", "function": "os:system()"},
        {"type": "text_similarity", "input": "a", "reference": "b", "evaluation_metric": "bleu", "pass_threshold": 2},
        {"type": "nope"},
    ]:
        with pytest.raises(ValidationError):
            parse_grader(spec)


def test_a_source_nested_too_deeply_is_refused_naming_it() -> None:
    for source in ["x = " + "lambda: " * 3000 + "1\n", "x = " + "(" * 3000 + ")" * 3000 + "\n"]:
        with pytest.raises(ValidationError) as refused:
            parse_grader({"type": "python", "source": source + "def grade(sample, item):\n    return 1.0\n"})
        assert refused.value.errors()[0]["loc"] == ("python", "source"), refused.value
        assert "source does not compile: " in str(refused.value)  # it nests too deeply; too many parentheses


def test_a_sample_nested_too_deeply_is_text_not_json() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    assert graders.openai_sample(deep) == {"output_text": deep, "output_json": None, "output_tools": [], "choices": []}


# ---------------------------------------------------------------------------------------------------------------
# Metrics


def test_reward_metrics_against_a_naive_loop() -> None:
    scores = RewardScores(total=[1.0, 2.0, 6.0], components={"a": [1.0, 3.0, 5.0], "b/pass": [0.0, 1.0, 1.0]})
    mean = sum(scores.total) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in scores.total) / 3)  # population
    assert reward_metrics(scores, prefix="eval/reward") == pytest.approx(
        {"eval/reward/mean": mean, "eval/reward/std": std, "eval/reward/a": 3.0, "eval/reward/b/pass": 2 / 3}
    )
    assert reward_metrics(RewardScores(total=[], components={"a": []})) == {}


def test_samples_must_be_one_length() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        Samples(prompts=["a"], prompt_texts=["a"], completions=["x", "y"], rows=[{}])


def test_the_module_loads_no_heavy_library() -> None:
    code = "import sys, engine.rewards.graders; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    loaded = {name.split(".")[0] for name in out.split()}
    assert "pydantic" in loaded
    assert not loaded & {"torch", "numpy", "rapidfuzz", "sacrebleu", "nltk", "rouge_score"}


# ---------------------------------------------------------------------------------------------------------------
# Python graders: TRL's reward functions, imported from this module

CALLS: list[dict[str, Any]] = []


def record(prompts: list[Any], completions: list[Any], **columns: list[Any]) -> list[float]:
    CALLS.append({"prompts": prompts, "completions": completions, **columns})
    return [float(i) for i in range(len(prompts))]


def inverse_minus_seven(prompts: list[Any], completions: list[str], **columns: list[Any]) -> list[float]:
    return [1 / (int(completion) - 7) for completion in completions]


def returns_none(prompts: list[Any], completions: list[Any], **columns: list[Any]) -> None:
    return None


def returns_one(prompts: list[Any], completions: list[Any], **columns: list[Any]) -> list[float]:
    return [1.0]


def returns_nan(prompts: list[Any], completions: list[Any], **columns: list[Any]) -> list[float]:
    return [math.nan] * len(prompts)


NOT_A_FUNCTION = 3


def python_grader(function: str) -> dict[str, Any]:
    return {"type": "python", "function": f"tests.engine.test_graders:{function}"}


@pytest.fixture
def calls() -> Iterator[list[dict[str, Any]]]:
    CALLS.clear()
    yield CALLS
    CALLS.clear()


def test_python_graders_get_the_columns_as_lists(calls: list[dict[str, Any]]) -> None:
    rows: list[dict[str, Any]] = [
        {"prompt": "p0", "answer": "x", "n": 1},
        {"prompt": "p1", "answer": "y", "extra": [1]},
    ]
    scores = grade(python_grader("record"), ["c0", "c1"], rows)
    assert scores.total == [0.0, 1.0]
    assert scores.components == {"python": [0.0, 1.0]}
    columns = {"answer": ["x", "y"], "n": [1, None], "extra": [None, [1]]}  # None where a row lacks the column
    assert calls == [{"prompts": ["p0", "p1"], "completions": ["c0", "c1"], **columns}]


def test_python_graders_get_chat_rows_as_messages(calls: list[dict[str, Any]]) -> None:
    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    grade(python_grader("record"), ["hello"], [{"prompt": prompt, "answer": "hello"}])
    assert calls == [
        {"prompts": [prompt], "completions": [[{"role": "assistant", "content": "hello"}]], "answer": ["hello"]}
    ]


def test_a_raising_function_is_reported_with_its_row() -> None:
    long_prompt = "add 2 and 5 " * 20
    rows = [{"prompt": "q0"}, {"prompt": "q1"}, {"prompt": long_prompt}, {"prompt": "q3"}]
    with pytest.raises(RewardFunctionError) as error:
        grade(python_grader("inverse_minus_seven"), ["1", "2", "7", "7"], rows)
    message = str(error.value)
    assert message.startswith("reward function tests.engine.test_graders:inverse_minus_seven raised ZeroDivisionError(")
    assert f"on row 2 (prompt {long_prompt[:76] + ' ...'!r})" in message
    assert isinstance(error.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize(
    ("function", "problem"),
    [
        ("returns_none", "returned a NoneType, not a list of numbers"),
        ("returns_one", "returned 1 scores for 2 samples"),
        ("returns_nan", "returned nan at position 0, not a finite number"),
        ("no_such_function", "cannot be imported: AttributeError"),
        ("NOT_A_FUNCTION", "is a int, not a function"),
    ],
)
def test_a_function_returning_or_being_the_wrong_thing_is_named(function: str, problem: str) -> None:
    with pytest.raises(RewardFunctionError, match=rf"reward function tests\.engine\.test_graders:{function} {problem}"):
        grade(python_grader(function), ["x", "y"])


def test_an_unimportable_module_is_named() -> None:
    spec = {"type": "python", "function": "tests.engine.no_such_module:score"}
    with pytest.raises(RewardFunctionError, match=r"tests\.engine\.no_such_module:score cannot be imported"):
        grade(spec, ["x"])


# ---------------------------------------------------------------------------------------------------------------
# Operator allow-lists


@pytest.mark.parametrize(
    ("url", "entries", "allowed"),
    [
        ("http://127.0.0.1:8123/score", ["loopback"], True),
        ("http://127.5.6.7/score", ["loopback"], True),
        ("https://[::1]:9000/", ["loopback"], True),
        ("http://localhost:1/x", ["loopback"], True),
        ("http://127.0.0.1.evil.com/", ["loopback"], False),
        ("http://user@evil.com", ["loopback"], False),
        ("http://127.0.0.1@evil.com/", ["loopback"], False),
        ("http://localhost.evil.com/", ["loopback"], False),
        ("http://10.0.0.1/", ["loopback"], False),
        ("https://rewards.internal/score", ["https://rewards.internal/"], True),
        ("https://rewards.internal:443/score?x=1", ["https://rewards.internal/"], True),
        ("https://rewards.internal.evil/score", ["https://rewards.internal/"], False),
        ("http://rewards.internal/score", ["https://rewards.internal/"], False),
        ("https://rewards.internal:8443/score", ["https://rewards.internal/"], False),
        ("https://rewards.internal/api/score", ["https://rewards.internal/api"], True),
        ("https://rewards.internal/api-evil/score", ["https://rewards.internal/api"], False),
        ("https://rewards.internal/api/%2e%2e/admin", ["https://rewards.internal/api/"], False),
        ("http://127.0.0.1/", ["https://rewards.internal/"], False),
        ("https://rewards.internal/score", ["loopback", "https://rewards.internal/"], True),
        ("https://rewards.internal/score", [], False),
    ],
)
def test_url_allow_list(url: str, entries: list[str], allowed: bool) -> None:
    grader = parse_grader({"type": "http", "name": "svc", "url": url})
    problems = check_allowed(grader, entries, allowed_functions=None)
    if allowed:
        assert problems == []
    else:
        assert len(problems) == 1
        assert problems[0].startswith("grader 'svc': the reward service ") and "is not allowed" in problems[0]


def test_function_allow_list_walks_nested_multis() -> None:
    inner = {"type": "multi", "graders": {"fn": python_grader("record"), **models("a")}, "weights": {"fn": 1.0}}
    service = {"type": "http", "url": "https://evil.example/score?key=secret"}
    grader = parse_grader({"type": "multi", "graders": {"inner": inner, "svc": service}, "weights": {"inner": 1}})
    assert check_allowed(grader, ["https://evil.example/"], allowed_functions=None) == []
    assert check_allowed(grader, ["https://evil.example/"], ["tests.engine.test_graders:record"]) == []
    assert check_allowed(grader, ["loopback"], ["mypkg:other"]) == [
        "grader 'fn': the reward function tests.engine.test_graders:record is not allowed (mypkg:other)",
        "grader 'svc': the reward service https://evil.example/score is not allowed (loopback)",  # no query
    ]


def test_a_source_grader_may_import_the_standard_library_and_the_offered_packages() -> None:
    """OpenAI's documented grader packages where they are installed (rapidfuzz, numpy: the service's own), and no
    other one: ``graders/validate`` and ``run`` refuse what the sandbox could not import."""
    source = """
import json, os.path
from collections import Counter
from rapidfuzz import fuzz
import numpy as np
def grade(sample, item):
    import sqlalchemy.orm
    from requests import get
    from . import sibling
    return 1.0
"""
    fine = "import numpy\nfrom rapidfuzz import fuzz\ndef grade(sample, item):\n    return 1.0\n"
    code = {"type": "python", "source": source}
    components = {"code": code, "fine": {**code, "source": fine}}
    grader = parse_grader({"type": "multi", "graders": components, "weights": {"code": 1}})
    offered = ", ".join(sandbox.offered_packages().modules)
    assert graders.import_problems(grader) == [
        "grader 'code': its source imports sqlalchemy, requests, which graders cannot import here (they have the "
        f"standard library and these of OpenAI's grader packages: {offered})"
    ]


# ---------------------------------------------------------------------------------------------------------------
# Http graders, against a reward service on loopback


@dataclass
class RewardServer:
    """A reward service that answers each query with its length, or with the scripted ``answers`` first, or
    as ``handler`` does when given one (it writes the whole answer itself)."""

    url: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)
    answers: list[tuple[int, bytes]] = field(default_factory=list)
    handler: Callable[[http.server.BaseHTTPRequestHandler], None] | None = None
    closing: threading.Event = field(default_factory=threading.Event)
    """Set as the fixture ends: handlers that wait return."""


@pytest.fixture
def server() -> Iterator[RewardServer]:
    state = RewardServer()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state.requests.append(body)
            if state.handler is not None:
                state.handler(self)
                return
            if state.answers:
                status, payload = state.answers.pop(0)
            else:
                status, payload = 200, json.dumps({"rewards": [len(q) for q in body["query"]], "info": 1}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:  # keep the test output quiet
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}/score"
    try:
        yield state
    finally:
        state.closing.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def http_grader(url: str, **settings: Any) -> dict[str, Any]:
    return {"type": "http", "name": "svc", "url": url, "backoff_s": 0.01, **settings}


def test_http_grader_posts_openrlhf_queries(server: RewardServer) -> None:
    chat = [{"role": "user", "content": "hi"}]
    rows: list[dict[str, Any]] = [{"prompt": "2+2=", "answer": 4}, {"prompt": chat, "answer": "hello"}]
    scores = grade(http_grader(server.url, label="{{ item.answer }}"), ["4", "hello!"], rows)
    assert server.requests == [{"query": ["2+2=4", "hihello!"], "prompts": ["2+2=", "hi"], "labels": ["4", "hello"]}]
    assert scores.total == [5.0, 8.0]
    assert scores.components == {"svc": [5.0, 8.0]}
    grade(http_grader(server.url), ["x"])
    assert server.requests[-1]["labels"] == [None]


def test_http_grader_batches(server: RewardServer) -> None:
    completions = ["a", "bb", "ccc", "dddd", "eeeee"]
    scores = grade(http_grader(server.url, batch_size=2), completions)
    assert [len(r["query"]) for r in server.requests] == [2, 2, 1]
    assert scores.total == [3.0, 4.0, 5.0, 6.0, 7.0]  # "q<i>" + completion, in order


def test_http_grader_retries_with_doubling_backoff(server: RewardServer, monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    monkeypatch.setattr(graders, "_sleep", lambda seconds, should_stop: waits.append(seconds))
    server.answers = [(500, b"oops"), (429, b"slow down")]
    scores = grade(http_grader(server.url, retries=3), ["abc"])
    assert scores.total == [5.0]
    assert len(server.requests) == 3
    assert waits == [0.01, 0.02]


@pytest.mark.parametrize(
    ("answer", "problem"),
    [
        (b"<html>busy</html>", "the answer is not JSON"),
        (b'{"score": [1, 2]}', 'the answer has no "rewards" list'),
        (b'{"rewards": [1.0]}', "the rewards are 1 scores for 2 samples"),
        (b'{"rewards": [NaN, 1.0]}', "the rewards are nan at position 0"),
        (b'{"rewards": [1.0, "2"]}', "the rewards are a str at position 1"),
        (b'{"rewards": [1.0, true]}', "the rewards are a bool at position 1"),
        (b'{"rewards": [1' + b"0" * 400 + b", 1]}", "the rewards are an integer too large for a float at position 0"),
        (b'{"rewards": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "the answer is not JSON"),  # RecursionError
        (b"\xff\xfe{", "the answer is not JSON"),
    ],
)
def test_http_grader_retries_malformed_answers_then_fails(server: RewardServer, answer: bytes, problem: str) -> None:
    server.answers = [(200, answer)] * 3
    with pytest.raises(RewardServiceError) as error:
        grade(http_grader(server.url, retries=2), ["x", "y"])
    assert str(error.value).startswith(f"reward service {server.url} failed after 3 attempts: {problem}")
    assert len(server.requests) == 3


def test_http_grader_fails_at_once_on_a_client_error(server: RewardServer) -> None:
    server.answers = [(400, b"bad labels")]
    with pytest.raises(RewardServiceError, match=r"refused the request: HTTP 400 Bad Request$"):
        grade(http_grader(server.url, retries=3), ["x"])
    assert len(server.requests) == 1


def test_http_grader_messages_never_quote_the_service(server: RewardServer) -> None:
    # a job may reach only allowed services, and must not read their answers through its error message
    for status, answer in ((403, b"SECRET admin page"), (200, b"SECRET not json"), (200, b'{"rewards": ["SECRET"]}')):
        server.answers = [(status, answer)]
        with pytest.raises(RewardServiceError) as error:
            grade(http_grader(server.url, retries=0), ["x"])
        assert "SECRET" not in str(error.value)
    with socket.socket() as listener:  # not HTTP at all: h11 quotes the status line it could not parse
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def answer_garbage() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(10)
                conn.recv(65536)  # the request, read so that closing sends no reset
                conn.sendall(b"-ERR SECRET of another protocol\r\n")
                conn.shutdown(socket.SHUT_WR)
                while conn.recv(65536):  # until the grader hangs up
                    pass

        thread = threading.Thread(target=answer_garbage, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/score"
        with pytest.raises(RewardServiceError, match="RemoteProtocolError") as error:
            grade(http_grader(url, retries=0), ["x"])
        thread.join()
    assert "SECRET" not in str(error.value)


def test_http_grader_messages_hide_credentials_and_query(server: RewardServer) -> None:
    server.answers = [(503, b"")]
    url = server.url.replace("http://", "http://user:secret@") + "?token=abc"
    with pytest.raises(RewardServiceError) as error:
        grade(http_grader(url, retries=0), ["x"])
    assert str(error.value) == f"reward service {server.url} failed after 1 attempt: HTTP 503 Service Unavailable"


def test_http_grader_on_a_dead_port() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    with pytest.raises(RewardServiceError, match=rf"reward service {url} failed after 2 attempts: ") as error:
        grade(http_grader(url, retries=1), ["x"])
    assert "connection refused" in str(error.value).lower()


def test_http_grader_with_no_samples_sends_nothing(server: RewardServer) -> None:
    assert grade(http_grader(server.url), []).total == []
    assert server.requests == []


def test_timeout_s_bounds_the_whole_request_not_each_read(server: RewardServer) -> None:
    answer = json.dumps({"rewards": [1.0]}).encode()

    def drip(handler: http.server.BaseHTTPRequestHandler) -> None:  # one byte every 0.2 s: 3.6 s in all
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(answer)))
        handler.end_headers()
        for byte in answer:
            if server.closing.wait(0.2):
                return
            try:
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
            except OSError:  # the grader hung up
                return

    server.handler = drip
    with pytest.raises(RewardServiceError, match=r"failed after 1 attempt: no answer within 0\.5 s$"):
        grade(http_grader(server.url, timeout_s=0.5, retries=0), ["x"])


def test_an_answer_over_the_cap_is_not_read_to_its_end(server: RewardServer) -> None:
    chunk, chunks = b"0" * 65536, 4 * graders.MAX_ANSWER_BYTES // 65536
    sent: list[int] = []

    def flood(handler: http.server.BaseHTTPRequestHandler) -> None:  # valid JSON, 4 times the cap
        head, tail = b'{"rewards": [1.0], "padding": "', b'"}'
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(head) + chunks * len(chunk) + len(tail)))
        handler.end_headers()
        try:
            handler.wfile.write(head)
            for _ in range(chunks):
                handler.wfile.write(chunk)
                sent.append(len(chunk))
            handler.wfile.write(tail)
        except OSError:  # the grader hung up
            pass

    server.handler = flood
    cap = f"{graders.MAX_ANSWER_BYTES:,}"
    with pytest.raises(RewardServiceError, match=rf"failed after 1 attempt: the answer is over {cap} bytes$"):
        grade(http_grader(server.url, retries=0), ["x"])
    assert sum(sent) < chunks * len(chunk)  # the rest was never read


class Asks:
    """A should_stop hook answering ``answers`` in turn, then the last one for ever; it counts its calls."""

    def __init__(self, *answers: StopRequest | None) -> None:
        self.answers = answers
        self.calls = 0

    def __call__(self) -> StopRequest | None:
        self.calls += 1
        return self.answers[min(self.calls, len(self.answers)) - 1]


def test_a_stop_reaches_an_http_grader_in_its_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    slept: list[float] = []
    real_sleep = graders.time.sleep

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(graders.time, "sleep", sleep)
    grader = parse_grader(http_grader(f"http://127.0.0.1:{port}/score", retries=3, backoff_s=60))
    should_stop = Asks(None, None, None, None, "cancel")
    with pytest.raises(RewardStopped) as stopped:
        score(grader, make_samples(["x"]), should_stop=should_stop)
    assert stopped.value.request == "cancel"
    assert should_stop.calls == 5
    assert slept and max(slept) <= graders.STOP_POLL_S  # the 60 s backoff, in slices that ask


def test_a_stop_reaches_an_http_grader_waiting_for_its_answer(server: RewardServer) -> None:
    def never_answer(handler: http.server.BaseHTTPRequestHandler) -> None:
        server.closing.wait(60)

    server.handler = never_answer
    grader = parse_grader(http_grader(server.url, timeout_s=600, retries=0))
    with pytest.raises(RewardStopped) as stopped:
        score(grader, make_samples(["x"]), should_stop=Asks(None, None, "pause"))
    assert stopped.value.request == "pause"
    assert len(server.requests) == 1


def test_a_stop_reaches_a_source_grader_and_between_graders() -> None:
    problem = sandbox.sandbox_problem()
    if problem is not None and os.environ.get("CI") != "true":
        pytest.skip(problem)
    sleeping = {"type": "python", "source": "import time\ndef grade(sample, item):\n    time.sleep(60)\n"}
    grader = parse_grader(sleeping)
    limits = sandbox.SandboxLimits(wall_s=30)
    with pytest.raises(RewardStopped) as stopped:  # not the wall clock's batch error, 30 s later
        score(grader, make_samples(["x"]), should_stop=Asks(None, None, "cancel"), sandbox_limits=limits)
    assert stopped.value.request == "cancel"
    many = {f"g{i}": {"type": "string_check", "input": OUTPUT, "reference": "x", "operation": "eq"} for i in range(9)}
    asks = Asks(None, None, None, "pause")
    with pytest.raises(RewardStopped):
        multi = parse_grader({"type": "multi", "graders": many, "calculate_output": "g0"})
        score(multi, make_samples(["x"]), should_stop=asks)
    assert asks.calls == 4  # one before each grader, until the fourth


def test_the_worst_case_of_a_rewards_services_is_bounded() -> None:
    bound = graders.MAX_SCHEDULE_S
    two_years = http_grader("http://127.0.0.1:9/", timeout_s=600, retries=20, backoff_s=60)
    with pytest.raises(ValidationError, match="allows 62,927,100 s per request, over 3,600 s"):
        parse_grader(two_years)
    half = {"timeout_s": 500, "retries": 2, "backoff_s": 0}  # 1,500 s each
    one = parse_grader(http_grader("http://a/", **half))
    assert isinstance(one, graders.HttpGrader) and graders.schedule_s(one) == 1500 < bound
    services = {name: http_grader(f"http://{name}/", **half) for name in ("a", "b")}
    pair = {"type": "multi", "graders": services, "weights": {"a": 1, "b": 1}}
    parse_grader(pair)
    trio = {**pair, "graders": {**services, "c": http_grader("http://c/", **half)}}
    with pytest.raises(ValidationError, match=r"the 3 http graders: .* allows 4,500 s per request, over 3,600 s"):
        parse_grader(trio)


@pytest.mark.parametrize(
    ("url", "refused"),
    [
        ("http://127.0.0.1:8001/x", True),
        ("http://localhost:8001/", True),
        ("http://[::1]:8001/", True),
        ("http://0.0.0.0:8001/", True),
        ("http://127.0.0.1:8002/", False),
        ("http://127.0.0.1/", False),
    ],
)
def test_the_services_own_servers_are_refused_whatever_the_allow_list_says(url: str, refused: bool) -> None:
    grader = parse_grader({"type": "http", "name": "svc", "url": url})
    allowed = ["loopback", "http://0.0.0.0:8001/"]
    assert check_allowed(grader, allowed, None) == []
    problems = check_allowed(grader, allowed, None, own_urls=["http://127.0.0.1:8001"])
    if refused:
        assert len(problems) == 1, problems
        assert problems[0].endswith("is not allowed (it is one of this service's own servers)"), problems
    else:
        assert problems == []

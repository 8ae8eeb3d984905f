"""On-policy distillation (engine/methods/distill.py): the per-token advantage against a naive loop, the spec's teacher
rules, a tiny job that brings the digits SFT model to a teacher that knows the answers (its reverse KL halved, its
accuracy up) with every metric reported, exact resume with a reward mixed in, and a teacher of another tokenizer
refused when the job starts."""

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from engine.builtin import digits
from engine.core.data import load_rows
from engine.methods.distill import distill_advantages
from engine.methods.grpo import STD_EPS
from engine.spec.config import JobSpec, vocabulary_mismatch
from engine.spec.policy_losses import POLICY_LOSSES
from tests.engine.helpers import COMMON_METRICS, assert_all_finite, final_model_dir, is_timing, load_weights, train
from tests.models import build_model, write_jsonl
from tests.recorder import Recorder

DISTILL_METRICS = (
    *COMMON_METRICS,
    "distill/reverse_kl",
    "distill/teacher_logprob",
    "distill/student_logprob",
    "loss/policy",
    "policy/clipfrac",
    "policy/approxkl",
    "response/length_mean",
    "response/eos_fraction",
    "time/rollout_s",
    "time/train_s",
)


def distill_spec(teacher: str | Path, *, hyperparameters: dict[str, Any] | None = None, **fields: Any) -> JobSpec:
    """A validated distill spec on the digits prompts, the untrained tiny model learning from ``teacher``: 8 prompts
    × 4 samples, 2 steps."""
    data: dict[str, Any] = {
        "type": "distill",
        "model": "builtin:tiny",
        "teacher": str(teacher),
        "dataset": "builtin:digits-prompts",
        "hyperparameters": {
            "total_steps": 2,
            "batch_size": 8,
            "group_size": 4,
            "mini_batch_size": 16,
            "response_length": 4,
            "learning_rate": 1e-3,
            **(hyperparameters or {}),
        },
        "seed": 0,
        "checkpoint_every": 1000,
    }
    data.update(fields)
    return JobSpec.model_validate(data)


# 1. ---------------------------------------------------------------------------------------------------------


def naive_advantages(
    logprobs: list[list[float]],
    teacher: list[list[float]],
    mask: list[list[float]],
    scores: list[float] | None,
    group_size: int,
    reward_coef: float,
) -> list[list[float]]:
    """The per-token reward of on-policy distillation, r_t = log π_teacher(y_t) - log π_student(y_t), with
    discount 0, plus reward_coef × (r - group mean) / (group std + ε) of the sample: one token at a time."""
    out = []
    for i, (row, teacher_row, mask_row) in enumerate(zip(logprobs, teacher, mask, strict=True)):
        bonus = 0.0
        if scores is not None:
            group = scores[i // group_size * group_size :][:group_size]
            mean = sum(group) / group_size
            std = math.sqrt(sum((s - mean) ** 2 for s in group) / (group_size - 1))
            bonus = reward_coef * (scores[i] - mean) / (std + STD_EPS)
        out.append([(t - s + bonus) * m for s, t, m in zip(row, teacher_row, mask_row, strict=True)])
    return out


@pytest.mark.parametrize(("with_scores", "reward_coef"), [(False, 0.0), (True, 0.0), (True, 0.5)])
def test_advantages_are_each_tokens_reverse_kl_term_plus_the_weighted_group_advantage(
    with_scores: bool, reward_coef: float
) -> None:
    g = torch.Generator().manual_seed(0)
    N, T, G = 6, 5, 3
    logprobs = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    teacher = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    mask = (torch.rand(N, T, generator=g) > 0.3).double()
    mask[:, 0] = 1.0
    scores = torch.rand(N, generator=g, dtype=torch.float64)
    got = distill_advantages(
        logprobs, teacher, mask, scores=scores if with_scores else None, group_size=G, reward_coef=reward_coef
    )
    expected = naive_advantages(
        logprobs.tolist(),
        teacher.tolist(),
        mask.tolist(),
        scores.tolist() if with_scores and reward_coef else None,
        G,
        reward_coef,
    )
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64))
    assert not got.requires_grad


def test_the_advantages_carry_no_gradient() -> None:
    logprobs = torch.zeros(2, 3, requires_grad=True)
    advantages = distill_advantages(logprobs, torch.full((2, 3), -1.0), torch.ones(2, 3))
    assert not advantages.requires_grad and torch.equal(advantages, torch.full((2, 3), -1.0))


# 2. ---------------------------------------------------------------------------------------------------------


def test_the_teacher_is_required_for_distill_and_refused_elsewhere() -> None:
    base = {"type": "distill", "model": "builtin:tiny", "dataset": "builtin:digits-prompts"}
    with pytest.raises(ValidationError, match="teacher is required for distill jobs"):
        JobSpec.model_validate(base)
    with pytest.raises(ValidationError, match="teacher applies to distill jobs only, not grpo"):
        JobSpec.model_validate({**base, "type": "grpo", "reward": digits.GRADER, "teacher": "builtin:tiny"})
    with pytest.raises(ValidationError, match="not a model reference"):
        JobSpec.model_validate({**base, "teacher": "two words"})
    with pytest.raises(ValidationError, match="reward_coef weighs a reward's advantage: give a reward"):
        JobSpec.model_validate({**base, "teacher": "builtin:tiny", "hyperparameters": {"reward_coef": 0.5}})
    alone = {"reward_coef": 0.5, "group_size": 1, "mini_batch_size": 16}
    with pytest.raises(ValidationError, match="group_size must be at least 2"):
        JobSpec.model_validate({**base, "teacher": "builtin:tiny", "reward": digits.GRADER, "hyperparameters": alone})
    with pytest.raises(ValidationError, match="reward_model and reward both given"):
        JobSpec.model_validate({**base, "teacher": "builtin:tiny", "reward": digits.GRADER, "reward_model": "x"})
    # A reward is optional: measured alone with reward_coef 0, mixed in above it.
    for extra in ({}, {"eval_reward": digits.GRADER}, {"reward": digits.GRADER, "hyperparameters": {"reward_coef": 1}}):
        assert JobSpec.model_validate({**base, "teacher": "builtin:tiny", **extra}).teacher == "builtin:tiny"


# 3. ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 digits prompts with their answers: the distill job trains and evaluates on them."""
    rows = load_rows("builtin:digits-prompts", "prompts")[:16]
    return write_jsonl(rows, tmp_path_factory.mktemp("distill-data") / "prompts.jsonl")


@pytest.fixture(scope="module")
def careful_teacher(digits_sft: Path, prompts: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits SFT model trained further on the right answers of :func:`prompts`: a teacher that knows them,
    where the careless demonstrations left the SFT model right about a third of the time."""
    answers = [{"prompt": row["prompt"], "completion": row["answer"]} for row in load_rows(str(prompts), "prompts")]
    folder = tmp_path_factory.mktemp("careful")
    spec = JobSpec.model_validate(
        {
            "type": "sft",
            "model": str(digits_sft),
            "dataset": str(write_jsonl(answers, folder / "answers.jsonl")),
            "hyperparameters": {"max_steps": 40, "batch_size": 16, "learning_rate": 3e-3},
            "checkpoint_every": 1000,
        }
    )
    result, _ = train(spec, folder / "sft")
    assert result.status == "succeeded"
    return folder / "sft"


def test_a_distill_job_brings_its_student_to_the_teacher(
    digits_sft: Path, careful_teacher: Path, prompts: Path, tmp_path: Path
) -> None:
    # 32 steps at 1e-3: over seeds 0-7 the evaluated reverse KL ends 0.05-0.32 from 1.1-1.9, where 16 steps at
    # 3e-3 (the earlier setting) stayed above half of it for three seeds in eight.
    steps = 32
    spec = distill_spec(
        careful_teacher,
        model=str(digits_sft),
        dataset=str(prompts),
        eval_dataset=str(prompts),
        eval_reward=digits.GRADER,
        hyperparameters={
            "total_steps": steps,
            "learning_rate": 1e-3,
            "eval_every": 16,
            "log_samples_every": 16,
            "log_samples": 4,
        },
    )
    result, rec = train(spec, tmp_path / "job")
    assert (result.status, result.step) == ("succeeded", steps)
    assert sorted(rec.metrics) == list(range(1, steps + 1))
    for step, values in rec.metrics.items():
        assert set(DISTILL_METRICS) <= set(values), step
        assert not any(name.startswith("reward/") for name in values)  # no training reward: none measured
    assert_all_finite(rec.metrics)
    for step in (16, 32):
        assert {"eval/distill/reverse_kl", "eval/reward", "eval/reward/correct", "eval/length_mean"} <= set(
            rec.metrics[step]
        )
    first, last = rec.metrics[1], rec.metrics[steps]
    assert first["distill/reverse_kl"] == pytest.approx(
        first["distill/student_logprob"] - first["distill/teacher_logprob"]
    )
    # step 1 samples the untrained student on the very prompts the evaluation samples
    assert last["eval/distill/reverse_kl"] < 0.5 * first["distill/reverse_kl"], (first, last)
    assert last["eval/reward"] >= 0.75
    # the kept samples: whole groups of the first prompts, each with its summed reverse KL and no rewards
    assert sorted(rec.samples) == [1, 16, 32]
    kept = rec.samples[1]
    assert len(kept) == 4 and len({s["prompt"] for s in kept}) == 1
    assert all(s["rewards"] == {} and 1 <= s["length"] <= 4 for s in kept)


def test_pause_and_resume_with_a_reward_matches_an_uninterrupted_run(
    digits_sft: Path, tmp_path: Path, deterministic: None
) -> None:
    spec = distill_spec(
        digits_sft,
        reward=digits.GRADER,
        hyperparameters={"total_steps": 4, "reward_coef": 0.5, "num_iterations": 2},
    )
    straight, reference = train(spec, tmp_path / "straight")
    paused, first = train(spec, tmp_path / "resumed", Recorder(stop_after=2, stop="pause"))
    assert (paused.status, paused.step) == ("paused", 2)
    resumed, second = train(spec, tmp_path / "resumed")
    assert (straight.status, resumed.status, second.starts) == ("succeeded", "succeeded", [(2, 4)])
    got = first.metrics | second.metrics
    for step in range(1, 5):
        expected = {k: v for k, v in reference.metrics[step].items() if not is_timing(k)}
        assert {k: v for k, v in got[step].items() if not is_timing(k)} == expected, step
    assert {"reward/mean", "reward/std", "reward/correct"} <= set(reference.metrics[1])
    assert reference.metrics[2]["policy/approxkl"] > 0  # the second pass is off-policy
    a, b = load_weights(final_model_dir(tmp_path / "straight")), load_weights(final_model_dir(tmp_path / "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("policy_loss", list(POLICY_LOSSES))
def test_every_policy_loss_trains(digits_sft: Path, tmp_path: Path, policy_loss: str) -> None:
    hyperparameters = {"policy_loss": policy_loss, "num_iterations": 2, "total_steps": 1}
    result, rec = train(distill_spec(digits_sft, hyperparameters=hyperparameters), tmp_path / "job")
    assert result.status == "succeeded"
    assert_all_finite(rec.metrics)
    assert rec.metrics[1]["policy/approxkl"] > 0  # the second pass is off-policy


# 4. ---------------------------------------------------------------------------------------------------------


def test_a_teacher_with_another_tokenizer_fails_the_job_when_it_starts(tmp_path: Path) -> None:
    teacher = build_model("llama", tmp_path / "llama")  # its own byte-level BPE, not the built-in vocabulary
    with pytest.raises(ValueError, match=re.escape(vocabulary_mismatch("teacher"))):
        train(distill_spec(teacher), tmp_path / "job")
    assert not (tmp_path / "job" / "checkpoints").exists()

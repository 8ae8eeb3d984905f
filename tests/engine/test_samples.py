"""Rollout samples (``Callbacks.on_samples``): PPO and GRPO keep the first ``log_samples`` rollouts of step 1 and of
every ``log_samples_every``-th step, with their prompt and response text, each reward component, KL and length."""

from pathlib import Path
from typing import Any

import pytest

from engine.builtin import digits
from engine.spec.config import JobSpec
from tests.engine.helpers import Pretrained, ppo_spec, train
from tests.engine.test_grpo_train import grpo_spec

FIELDS = {"prompt", "response", "rewards", "kl", "length"}


def check_samples(samples: list[dict[str, Any]], count: int, rewards: set[str], max_length: int) -> None:
    assert len(samples) == count
    for sample in samples:
        assert set(sample) == FIELDS
        assert isinstance(sample["prompt"], str) and sample["prompt"].strip()
        assert isinstance(sample["response"], str)
        assert set(sample["rewards"]) == rewards
        assert all(isinstance(value, float) for value in sample["rewards"].values())
        assert isinstance(sample["kl"], float)
        assert isinstance(sample["length"], int) and 1 <= sample["length"] <= max_length


def test_ppo_keeps_samples_of_step_1_and_every_log_samples_every_steps(tmp_path: Path, pretrained: Pretrained) -> None:
    spec = ppo_spec(pretrained.sft, pretrained.rm, total_steps=3, log_samples_every=2, log_samples=5)
    result, rec = train(spec, tmp_path / "job")
    assert result.status == "succeeded"
    assert sorted(rec.samples) == [1, 2]
    for step, samples in rec.samples.items():
        check_samples(samples, 5, {"score"}, spec.config.response_length)  # type: ignore[attr-defined]
        # the samples are the batch's first rollouts: their lengths and scores are the step's own
        assert rec.metrics[step]["response/length_mean"] > 0
    # step 1 samples from the reference itself: no KL; the prompts are reviews from the dataset
    assert all(sample["kl"] == pytest.approx(0.0, abs=1e-4) for sample in rec.samples[1])


def test_ppo_samples_hold_every_reward_component_and_the_total(tmp_path: Path, digits_sft: Path) -> None:
    reward = {"type": "multi", "name": "both", "graders": {"correct": digits.GRADER,
              "other": {**digits.GRADER, "name": "other", "reference": "x", "operation": "ne"}},
              "calculate_output": "correct + other"}  # fmt: skip
    spec = JobSpec.model_validate(
        {"type": "ppo", "model": str(digits_sft), "dataset": "builtin:digits-prompts", "reward": reward,
         "hyperparameters": {"total_steps": 1, "batch_size": 8, "mini_batch_size": 8, "ppo_epochs": 1,
                             "response_length": 4, "log_samples": 8}, "checkpoint_every": 1000}
    )  # fmt: skip
    result, rec = train(spec, tmp_path / "job")
    assert result.status == "succeeded"
    samples = rec.samples[1]
    check_samples(samples, 8, {"both", "correct", "other", "total"}, 4)
    for sample in samples:
        rewards = sample["rewards"]
        assert rewards["total"] == rewards["both"] == rewards["correct"] + rewards["other"]
        assert rewards["correct"] == float(sample["response"] == digits_answer(sample["prompt"]))
        assert rewards["other"] == float(sample["response"] != "x")
    assert rec.metrics[1]["reward/mean"] == pytest.approx(sum(s["rewards"]["total"] for s in samples) / 8)


def digits_answer(prompt: str) -> str:
    """The digit a digits-task prompt (``"6 4 6 : middle ="``) asks for, read from its text."""
    words = prompt.split()
    colon = words.index(":")
    return words[colon - 3 : colon][digits.POSITIONS[words[colon + 1]]]


def test_grpo_keeps_whole_groups_of_samples(tmp_path: Path, digits_sft: Path) -> None:
    spec = grpo_spec(digits_sft, hyperparameters={"total_steps": 3, "log_samples_every": 2, "log_samples": 8})
    result, rec = train(spec, tmp_path / "job")
    assert result.status == "succeeded"
    assert sorted(rec.samples) == [1, 2]
    for step, samples in rec.samples.items():
        check_samples(samples, 8, {"correct", "total"}, 4)
        # group_size 4: the first two prompts, four samples each
        assert len({s["prompt"] for s in samples[:4]}) == 1 and len({s["prompt"] for s in samples[4:]}) == 1
        for sample in samples:
            assert sample["rewards"]["total"] == sample["rewards"]["correct"]
            assert sample["rewards"]["correct"] == float(sample["response"] == digits_answer(sample["prompt"]))
        assert rec.metrics[step]["reward/mean"] >= 0


def test_no_samples_with_log_samples_every_none(tmp_path: Path, digits_sft: Path) -> None:
    result, rec = train(grpo_spec(digits_sft, hyperparameters={"log_samples_every": None}), tmp_path / "job")
    assert result.status == "succeeded" and rec.samples == {}

"""PPO with a ``reward`` object (engine/rewards/graders.py) instead of a reward model, and with an ``eval_reward``:
rules score the decoded text and the critic starts from the policy; a reward of one model grader is the reward_model
shorthand exactly; a multi grader's components are logged each; eval_reward judges the held-out samples."""

from pathlib import Path
from typing import Any

import pytest

from engine.builtin import digits
from engine.spec.config import JobSpec
from tests.engine.helpers import PPO_METRICS, Pretrained, assert_all_finite, is_timing, train

SMALL = {
    "total_steps": 2,
    "batch_size": 16,
    "mini_batch_size": 8,
    "ppo_epochs": 1,
    "response_length": 4,
    "learning_rate": 1e-4,
    "temperature": 1.0,
    "eval_every": 2,
    "eval_max_prompts": 16,
}


def ppo_spec(model: Path, dataset: str, **fields: Any) -> JobSpec:
    return JobSpec.model_validate(
        {
            "type": "ppo",
            "model": str(model),
            "dataset": f"builtin:{dataset}",
            "eval_dataset": f"builtin:{dataset}-eval",
            "hyperparameters": SMALL,
            "checkpoint_every": 1000,
            **fields,
        }
    )


def test_ppo_trains_against_a_rule(digits_sft: Path, tmp_path: Path) -> None:
    result, rec = train(ppo_spec(digits_sft, "digits-prompts", reward=digits.GRADER), tmp_path / "job")
    assert (result.status, result.step) == ("succeeded", 2)
    assert_all_finite(rec.metrics)
    for step, metrics in rec.metrics.items():
        assert set(PPO_METRICS) | {"reward/mean", "reward/std", "reward/correct"} <= set(metrics), step
        assert metrics["objective/scores"] == pytest.approx(
            metrics["reward/correct"] - 1.0 * (1 - metrics["response/eos_fraction"]), abs=1e-6
        )  # the rule's score less the missing-EOS penalty
    assert 0 <= rec.metrics[2]["eval/reward"] == rec.metrics[2]["eval/reward/correct"] <= 1
    # the critic starts from the policy's backbone with a fresh head: no reward model to start it from
    assert (tmp_path / "job" / "checkpoints" / "step-2" / "value").is_dir()


def test_a_reward_of_one_model_grader_is_the_reward_model_shorthand(
    pretrained: Pretrained, tmp_path: Path, deterministic
) -> None:
    curves = {}
    for name, fields in (
        ("shorthand", {"reward_model": str(pretrained.rm)}),
        ("grader", {"reward": {"type": "model", "model": str(pretrained.rm)}}),
    ):
        result, rec = train(ppo_spec(pretrained.sft, "reviews-prompts", **fields), tmp_path / name)
        assert result.status == "succeeded"
        curves[name] = {s: {k: v for k, v in m.items() if not is_timing(k)} for s, m in rec.metrics.items()}
    assert curves["grader"] == curves["shorthand"]


def test_multi_grader_components_and_an_eval_reward(pretrained: Pretrained, tmp_path: Path) -> None:
    reward = {
        "type": "multi",
        "graders": {
            "rm": {"type": "model", "model": str(pretrained.rm)},
            "short": {"type": "python", "function": "tests.engine.test_ppo_rewards:short"},
        },
        "calculate_output": "rm + 0.5 * short",
    }
    eval_reward = {"type": "python", "name": "truth", "function": "tests.engine.test_grpo_train:is_positive"}
    spec = ppo_spec(pretrained.sft, "reviews-prompts", reward=reward, eval_reward=eval_reward)
    result, rec = train(spec, tmp_path / "job")
    assert result.status == "succeeded"
    for metrics in rec.metrics.values():
        assert metrics["reward/multi"] == pytest.approx(metrics["reward/rm"] + 0.5 * metrics["reward/short"])
        assert metrics["reward/mean"] == pytest.approx(metrics["reward/multi"])
    assert {"eval/reward", "eval/reward/truth", "eval/scores"} <= set(rec.metrics[2])
    assert "eval/reward/rm" not in rec.metrics[2]  # the eval reward is the truth rule alone


def short(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    return [float(len(c) < 40) for c in completions]

"""The README's main command end to end: the built-in pipelines really improve the policy. SFT → RM → PPO, then
SFT → DPO in the same folder (the SFT stage is found finished and reused), then SFT → GRPO on the digits task
in the same folder too (its SFT stage is a folder of its own), then the digits SFT model distilled from that GRPO
policy (both stages reused)."""

from pathlib import Path

import pytest

from engine.cli import train
from engine.demo import run_demo


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo")


def test_builtin_pipeline_makes_the_policy_positive(demo_dir: Path) -> None:
    report = run_demo(demo_dir, train)
    assert report.rm_eval_accuracy is not None and report.rm_eval_accuracy >= 0.9
    assert report.trained.success >= 0.9
    assert report.trained.success >= report.sft.success + 0.3
    assert report.trained.score is not None and report.sft.score is not None
    assert report.trained.score > report.sft.score
    assert report.sft.kl == 0.0 and report.trained.kl > 0.0  # the SFT model is its own reference
    assert "positive share" in report.table() and "PPO" in report.table()


def test_dpo_pipeline_makes_the_policy_positive_without_a_reward_model(demo_dir: Path) -> None:
    report = run_demo(demo_dir, train, "dpo")
    assert report.rm_eval_accuracy is None and report.trained.score is None
    assert report.trained.success >= report.sft.success + 0.25
    assert report.sft.kl == 0.0 and report.trained.kl > 0.0
    assert "DPO" in report.table() and "reward model score" not in report.table()


def test_grpo_pipeline_raises_the_held_out_accuracy_by_the_rule(demo_dir: Path) -> None:
    report = run_demo(demo_dir, train, "grpo")
    assert (demo_dir / "sft-digits").is_dir() and report.task == "digits"
    assert report.rm_eval_accuracy is None and report.trained.score is None
    assert report.trained.success >= report.sft.success + 0.3
    assert report.sft.kl == 0.0 and report.trained.kl > 0.0
    assert "accuracy (rule)" in report.table() and "GRPO" in report.table()


def test_distill_pipeline_brings_the_sft_model_to_its_grpo_teacher(demo_dir: Path) -> None:
    report = run_demo(demo_dir, train, "distill")  # the SFT and GRPO stages are the previous test's, found finished
    assert report.task == "digits" and report.teacher is not None and report.teacher_stage == "grpo"
    assert report.rm_eval_accuracy is None and report.trained.score is None
    assert report.teacher.kl == 0.0  # the teacher is its own reference
    assert report.trained.kl <= 0.5 * report.sft.kl, (report.sft.kl, report.trained.kl)  # reverse KL to the teacher
    # the student closes most of the gap to its teacher's accuracy
    gained, gap = report.trained.success - report.sft.success, report.teacher.success - report.sft.success
    assert gained >= 0.75 * gap, (report.sft.success, report.trained.success, report.teacher.success)
    assert report.teacher.success >= report.sft.success + 0.3
    assert "reverse KL to teacher" in report.table() and "teacher (GRPO)" in report.table()

"""The README's main command end to end: the built-in SFT → RM → PPO pipeline really improves the policy."""

from pathlib import Path

from engine.cli import train
from engine.demo import run_demo


def test_builtin_pipeline_makes_the_policy_positive(tmp_path: Path) -> None:
    report = run_demo(tmp_path / "demo", train)
    assert report.rm_eval_accuracy >= 0.9
    assert report.ppo.positive_share >= 0.9
    assert report.ppo.positive_share >= report.sft.positive_share + 0.3
    assert report.ppo.score > report.sft.score
    assert report.sft.kl == 0.0 and report.ppo.kl > 0.0  # the SFT model is its own reference
    assert "positive share" in report.table()

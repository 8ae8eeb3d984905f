"""What the engine's tests build and check jobs with, run in the test process on the CPU: spec builders with
small settings per job type, :func:`train` (``engine.run.run_job`` with a :class:`tests.recorder.Recorder`),
readers of saved weights, the metric names the README lists, and :class:`Pretrained` (the session's tiny SFT
model and reward model, built by the ``pretrained`` fixtures of tests/engine and tests/faults).
"""

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from engine.core.loop import JobResult
from engine.run import run_job
from engine.spec.config import JobSpec
from tests.recorder import Recorder

CPU = torch.device("cpu")

# The metric names each job type reports (the README's Metrics section).
COMMON_METRICS = ("lr", "grad_norm", "time/step_s", "throughput/tokens_per_s")
SFT_METRICS = (*COMMON_METRICS, "loss/sft")
RM_METRICS = (*COMMON_METRICS, "loss/rm", "rm/accuracy", "rm/margin")
PPO_METRICS = (
    *COMMON_METRICS,
    "objective/scores",
    "objective/kl",
    "objective/kl_coef",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "objective/entropy",
    "policy/approxkl",
    "policy/clipfrac",
    "loss/policy",
    "loss/value",
    "val/clipfrac",
    "val/mean",
    "val/var_explained",
    "returns/mean",
    "response/length_mean",
    "response/eos_fraction",
    "response/perplexity",
    "time/rollout_s",
    "time/train_s",
)
TIMING_PREFIXES = ("time/", "throughput/")

DATASETS = {"sft": "builtin:reviews-sft", "rm": "builtin:reviews-prefs", "ppo": "builtin:reviews-prompts"}
EVAL_DATASETS = {"sft": "builtin:reviews-sft-eval", "rm": "builtin:reviews-prefs-eval"}

# Small, fast settings per job type; tests override what they exercise.
SMALL_HYPERPARAMETERS: dict[str, dict[str, Any]] = {
    "sft": {"batch_size": 8, "max_steps": 6, "learning_rate": 1e-3},
    "rm": {"batch_size": 8, "max_steps": 6, "learning_rate": 1e-3},
    "ppo": {
        "total_steps": 6,
        "batch_size": 8,
        "mini_batch_size": 4,
        "ppo_epochs": 2,
        "response_length": 8,
        "learning_rate": 1e-4,
        "temperature": 1.0,
    },
}


def make_spec(
    job_type: str,
    *,
    model: str | Path = "builtin:tiny",
    reward_model: str | Path | None = None,
    hyperparameters: dict[str, Any] | None = None,
    **fields: Any,
) -> JobSpec:
    """A validated JobSpec with small defaults for ``job_type``; ``hyperparameters`` override the defaults."""
    data: dict[str, Any] = {
        "type": job_type,
        "model": str(model),
        "dataset": DATASETS[job_type],
        "hyperparameters": {**SMALL_HYPERPARAMETERS[job_type], **(hyperparameters or {})},
        "seed": 0,
        "checkpoint_every": 1000,
    }
    if reward_model is not None:
        data["reward_model"] = str(reward_model)
    data.update(fields)
    return JobSpec.model_validate(data)


def train(spec: JobSpec, out_dir: Path, callbacks: Recorder | None = None) -> tuple[JobResult, Recorder]:
    recorder = callbacks or Recorder()
    return run_job(spec, out_dir, recorder, device=CPU), recorder


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The state dict of a saved model (all safetensors shards)."""
    shards = sorted(model_dir.glob("*.safetensors"))
    assert shards, f"no safetensors in {model_dir}"
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(shard))
    return weights


def final_model_dir(out_dir: Path, name: str = "policy") -> Path:
    steps = sorted(int(p.name.removeprefix("step-")) for p in (out_dir / "checkpoints").glob("step-*"))
    assert steps, f"no checkpoints in {out_dir}"
    return out_dir / "checkpoints" / f"step-{steps[-1]}" / name


def assert_same_update(start: Path, one: Path, other: Path, min_cosine: float = 0.99) -> None:
    """Two runs from the model folder ``start`` moved its weights the same way (model folders ``one`` and
    ``other``): the whole weight change points the same way and is as large, within rounding. Compared as one
    vector, since Adam's normalised step turns rounding in near-zero gradients into lr-sized differences."""
    initial = load_weights(start)
    a, b = load_weights(one), load_weights(other)
    delta_a = torch.cat([(a[k] - v).flatten().double() for k, v in initial.items()])
    delta_b = torch.cat([(b[k] - v).flatten().double() for k, v in initial.items()])
    assert delta_a.norm() > 0, "the first run did not change the weights"
    assert torch.nn.functional.cosine_similarity(delta_a, delta_b, dim=0) >= min_cosine
    assert delta_b.norm() / delta_a.norm() == pytest.approx(1.0, abs=1 - min_cosine)


def assert_all_finite(metrics: dict[int, dict[str, float]]) -> None:
    for step, values in metrics.items():
        for name, value in values.items():
            assert math.isfinite(value), f"{name} = {value} at step {step}"


def is_timing(name: str) -> bool:
    return name.startswith(TIMING_PREFIXES)


@dataclass
class Pretrained:
    """Job folders of the session's tiny SFT model and reward model, and what they reported (where kept)."""

    sft: Path
    rm: Path
    sft_metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    rm_metrics: dict[int, dict[str, float]] = field(default_factory=dict)


RM_FIXTURE_STEPS = 40


def ppo_spec(sft_dir: Path, rm_dir: Path, **hyperparameters: Any) -> JobSpec:
    return make_spec("ppo", model=sft_dir, reward_model=rm_dir, hyperparameters=hyperparameters)

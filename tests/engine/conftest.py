"""Shared fixtures for the engine's integration tests: a recording callback, spec builders and a tiny
SFT model plus reward model trained once per session (PPO tests start from them).
"""

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from engine.callbacks import Callbacks, StopRequest
from engine.config import JobSpec
from engine.loop import JobResult
from engine.run import run_job

CPU = torch.device("cpu")

# Metric names of DESIGN §3.
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


class Recorder(Callbacks):
    """Stores everything a job reports; can ask for ``"pause"`` or ``"cancel"`` after a given step."""

    def __init__(self, stop_after: int | None = None, stop: StopRequest = "pause") -> None:
        self.stop_after = stop_after
        self.stop = stop
        self.starts: list[tuple[int, int]] = []
        self.metrics: dict[int, dict[str, float]] = {}
        self.events: list[tuple[str, str, dict[str, object] | None]] = []
        self.checkpoints: list[tuple[int, Path]] = []
        self.stop_requests: list[int] = []

    def on_start(self, start_step: int, total_steps: int) -> None:
        self.starts.append((start_step, total_steps))

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        assert step not in self.metrics, f"step {step} reported twice"
        self.metrics[step] = dict(metrics)

    def on_event(self, kind: str, message: str, data: dict[str, object] | None = None) -> None:
        self.events.append((kind, message, data))

    def on_checkpoint(self, step: int, path: Path, metrics: dict[str, float]) -> None:
        assert path.is_dir(), f"on_checkpoint({step}) before {path} exists"
        self.checkpoints.append((step, path))

    def should_stop(self) -> StopRequest | None:
        last = max(self.metrics) if self.metrics else 0
        if self.stop_after is not None and last == self.stop_after:
            self.stop_requests.append(last)
            return self.stop
        return None

    def series(self, name: str) -> list[float]:
        """``name`` at every reported step, in step order."""
        return [self.metrics[s][name] for s in sorted(self.metrics)]

    def warnings(self) -> list[str]:
        return [message for kind, message, _ in self.events if kind == "warning"]


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


def assert_all_finite(metrics: dict[int, dict[str, float]]) -> None:
    for step, values in metrics.items():
        for name, value in values.items():
            assert math.isfinite(value), f"{name} = {value} at step {step}"


def is_timing(name: str) -> bool:
    return name.startswith(TIMING_PREFIXES)


@pytest.fixture
def deterministic() -> Iterator[None]:
    """Deterministic algorithms for tests that assert exact equality; restored afterwards."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


@dataclass
class Pretrained:
    """Job folders of the session's tiny SFT model and reward model, and what they reported."""

    sft: Path
    rm: Path
    sft_metrics: dict[int, dict[str, float]]
    rm_metrics: dict[int, dict[str, float]]


RM_FIXTURE_STEPS = 40


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Pretrained:
    """SFT (60 steps of 32, lr 3e-3) on the reviews task, then a reward model on top of it."""
    root = tmp_path_factory.mktemp("pretrained")
    sft_spec = make_spec(
        "sft",
        hyperparameters={"max_steps": 60, "batch_size": 32, "learning_rate": 3e-3, "warmup_steps": 5},
        eval_dataset=EVAL_DATASETS["sft"],
    )
    sft_result, sft_rec = train(sft_spec, root / "sft")
    assert sft_result.status == "succeeded"
    rm_spec = make_spec(
        "rm",
        model=root / "sft",
        hyperparameters={"max_steps": RM_FIXTURE_STEPS, "batch_size": 32, "learning_rate": 1e-3, "eval_every": 10},
        eval_dataset=EVAL_DATASETS["rm"],
    )
    rm_result, rm_rec = train(rm_spec, root / "rm")
    assert rm_result.status == "succeeded"
    return Pretrained(root / "sft", root / "rm", sft_rec.metrics, rm_rec.metrics)


@pytest.fixture(scope="session")
def sft_dir(pretrained: Pretrained) -> Path:
    return pretrained.sft


@pytest.fixture(scope="session")
def rm_dir(pretrained: Pretrained) -> Path:
    return pretrained.rm


def ppo_spec(sft_dir: Path, rm_dir: Path, **hyperparameters: Any) -> JobSpec:
    return make_spec("ppo", model=sft_dir, reward_model=rm_dir, hyperparameters=hyperparameters)

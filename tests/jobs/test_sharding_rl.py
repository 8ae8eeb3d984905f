"""FSDP2 for the job types that roll out with a critic or a teacher, in two processes (torchrun, gloo on the CPU)
against DDP in two: PPO (the policy, its reference and the critic sharded, the critic gathered for a rank's values)
and on-policy distillation (the teacher sharded as the student's reference), each with rank 0's evaluation. The
ranks sample alike under both layouts, so the runs agree to rounding; PPO's two trained models are one sharded
optimizer state, resumed bit for bit."""

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from engine.spec.config import JobSpec
from jobs.distributed import run_distributed
from tests.jobs.test_distributed import TIMING, assert_same_weights
from tests.jobs.test_sharding import assert_metrics_close
from tests.recorder import Recorder

SIMILAR = {"type": "text_similarity", "input": "{{sample.output_text}}", "reference": "{{item.answer}} ",
           "evaluation_metric": "fuzzy_match"}  # fmt: skip
"""Partial credit for the digits task: the samples' scores differ, so every update moves the weights."""
BASE = {"model": "builtin:tiny", "dataset": "builtin:digits-prompts", "eval_dataset": "builtin:digits-prompts",
        "checkpoint_every": 2, "seed": 3}  # fmt: skip
SMALL = {"total_steps": 4, "response_length": 4, "learning_rate": 1e-3, "eval_every": 2, "eval_max_prompts": 4,
         "gradient_accumulation_steps": 2}  # fmt: skip


def both_layouts(job: dict[str, Any], tmp_path: Path) -> dict[str, Recorder]:
    runs = {}
    for sharding in ("ddp", "fsdp"):
        recorder = Recorder()
        spec = JobSpec.model_validate({**job, "resources": {"num_processes": 2, "sharding": sharding}})
        assert run_distributed(spec, tmp_path / sharding, recorder, 2).status == "succeeded"
        runs[sharding] = recorder
    return runs


def without_spread(recorder: Recorder) -> dict[int, dict[str, float]]:
    return {step: {k: v for k, v in m.items() if k != "dist/weight_spread"} for step, m in recorder.metrics.items()}


def test_fsdp_ppo_trains_as_ddp_halves_the_state_and_resumes_bit_exactly(tmp_path: Path) -> None:
    hyperparameters = {**SMALL, "batch_size": 4, "mini_batch_size": 4, "ppo_epochs": 1, "kl_coef": 0.1}
    ppo = {**BASE, "type": "ppo", "reward": SIMILAR, "hyperparameters": hyperparameters}
    runs = both_layouts(ppo, tmp_path)
    fsdp = runs["fsdp"].metrics
    assert "eval/reward" in fsdp[4] and fsdp[4]["objective/kl"] > 1e-6
    assert_metrics_close(fsdp, without_spread(runs["ddp"]))
    assert_same_weights(tmp_path / "fsdp", tmp_path / "ddp", lr=1e-3)
    for model in ("policy", "value"):  # both consolidated, as Hugging Face folders
        assert (tmp_path / "fsdp" / "checkpoints" / "step-4" / model / "config.json").is_file(), model
    # policy and critic: each rank holds half of their parameters, gradients and AdamW state
    ratio = fsdp[4]["memory/state_bytes"] / runs["ddp"].metrics[4]["memory/state_bytes"]
    print(f"PPO state bytes per rank, FSDP / DDP: {ratio:.3f}")
    assert ratio <= 0.55

    # paused after step 2 and resumed from the sharded checkpoint (one optimizer state over both models)
    spec = JobSpec.model_validate({**ppo, "resources": {"num_processes": 2, "sharding": "fsdp"}})
    first, second = Recorder(stop_after=2), Recorder()
    assert run_distributed(spec, tmp_path / "resumed", first, 2).status == "paused"
    assert run_distributed(spec, tmp_path / "resumed", second, 2).status == "succeeded"
    for step in (3, 4):
        same = {k: v for k, v in second.metrics[step].items() if not k.startswith(TIMING)}
        assert same == {k: v for k, v in fsdp[step].items() if not k.startswith(TIMING)}, step
    for model in ("policy", "value"):
        got = load_file(tmp_path / "resumed" / "checkpoints" / "step-4" / model / "model.safetensors")
        want = load_file(tmp_path / "fsdp" / "checkpoints" / "step-4" / model / "model.safetensors")
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), model


def test_fsdp_distillation_trains_as_ddp(tmp_path: Path) -> None:
    hyperparameters = {**SMALL, "batch_size": 4, "group_size": 2, "mini_batch_size": 8, "reward_coef": 1.0}
    distill = {**BASE, "type": "distill", "teacher": "builtin:tiny", "reward": SIMILAR,
               "hyperparameters": hyperparameters}  # fmt: skip
    runs = both_layouts(distill, tmp_path)
    fsdp = runs["fsdp"].metrics
    assert "eval/distill/reverse_kl" in fsdp[4] and fsdp[4]["distill/reverse_kl"] != 0
    assert_metrics_close(fsdp, without_spread(runs["ddp"]))
    assert_same_weights(tmp_path / "fsdp", tmp_path / "ddp", lr=1e-3)

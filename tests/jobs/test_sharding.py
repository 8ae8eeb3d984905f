"""FSDP2 (``resources.sharding: "fsdp"``) in two processes (torchrun, gloo on the CPU) against one process: sft, rm
and dpo (with LoRA, its reference the adapters switched off) train to the same losses and weights (a resume from
the sharded checkpoint: tests/jobs/test_sharding_rl.py for PPO, tests/jobs/test_hosts.py after a host died); each
rank holds about half of the state DDP holds; the checkpoint's weights are an ordinary Hugging Face folder. And
gloo's gradient reduction under FSDP2 averages, as DDP's does (pytorch#162338 reported it summed)."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.run import run_job
from engine.spec.config import JobSpec
from jobs.distributed import run_distributed
from tests.jobs.test_distributed import TIMING, assert_same_weights, one_process, spec
from tests.recorder import Recorder

SHARDED_ONLY = ("memory/state_bytes",)
"""Metrics that differ by design between one process and shards."""


def fsdp(job_type: str, **hyperparameters: Any) -> JobSpec:
    data = spec(job_type, 2, **hyperparameters).model_dump()
    data["resources"]["sharding"] = "fsdp"
    return JobSpec.model_validate(data)


def assert_metrics_close(got: dict[int, dict[str, float]], expected: dict[int, dict[str, float]]) -> None:
    assert sorted(got) == sorted(expected)
    for step, metrics in expected.items():
        assert "dist/weight_spread" not in got[step]
        for name, value in metrics.items():
            if not name.startswith(TIMING) and name not in SHARDED_ONLY:
                assert got[step][name] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, name)


def test_fsdp_sft_trains_as_one_process_and_halves_the_state(tmp_path: Path) -> None:
    reference = one_process("sft", tmp_path / "one")
    whole = Recorder()
    result = run_distributed(fsdp("sft"), tmp_path / "whole", whole, 2)
    assert (result.status, result.step, whole.checkpoint_steps()) == ("succeeded", 4, [2, 4])
    assert_metrics_close(whole.metrics, reference.metrics)
    assert_same_weights(tmp_path / "whole", tmp_path / "one", lr=1e-3)

    # the checkpoint: the optimizer as DCP shards, the weights a plain Hugging Face folder
    checkpoint = tmp_path / "whole" / "checkpoints" / "step-4"
    assert (checkpoint / "optimizer" / ".metadata").is_file()
    assert sorted(p.name for p in (checkpoint / "optimizer").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert AutoModelForCausalLM.from_pretrained(checkpoint / "policy").num_parameters() > 0

    # each rank holds the parameters, gradients and AdamW state of half the model (DDP: of all of it)
    ddp_bytes = reference.metrics[4]["memory/state_bytes"]  # what every DDP rank holds: one process's
    ratio = whole.metrics[4]["memory/state_bytes"] / ddp_bytes
    fsdp_bytes = whole.metrics[4]["memory/state_bytes"]
    print(f"state bytes per rank: FSDP {fsdp_bytes:.0f}, DDP {ddp_bytes:.0f} ({ratio:.3f}×)")
    assert ratio <= 0.55


@pytest.mark.parametrize(
    ("job_type", "options", "lora"),
    [("rm", {"lm_loss_coef": 0.5}, False), ("dpo", {"learning_rate": 1e-3, "sft_loss_coef": 0.5}, True)],
    ids=["rm", "dpo-lora"],
)
def test_fsdp_rm_and_dpo_train_as_one_process(tmp_path: Path, job_type: str, options: dict[str, Any],
                                               lora: bool) -> None:  # fmt: skip
    """The rm's scalar head on the sharded backbone; DPO with LoRA, its reference the sharded policy with its
    adapters off. Both evaluate held-out rows on rank 0 with the weights gathered; the sharded runs recompute
    their blocks' activations in backward (gradient checkpointing), which changes no number."""
    extra: dict[str, Any] = {"lora": {"r": 4, "alpha": 8}} if lora else {}
    eval_rows = {"eval_dataset": "builtin:reviews-prefs"}

    def with_extra(job: JobSpec) -> JobSpec:
        return JobSpec.model_validate({**job.model_dump(), **extra, **eval_rows})

    reference = Recorder()
    one = with_extra(spec(job_type, 1, **options))
    assert run_job(one, tmp_path / "one", reference, torch.device("cpu")).status == "succeeded"
    recorder = Recorder()
    sharded = with_extra(fsdp(job_type, **options, gradient_checkpointing=True))
    result = run_distributed(sharded, tmp_path / "two", recorder, 2)
    assert (result.status, result.step) == ("succeeded", 4)
    assert any(name.startswith("eval/") for name in recorder.metrics[4])
    assert_metrics_close(recorder.metrics, reference.metrics)
    assert_same_weights(tmp_path / "two", tmp_path / "one", lr=options.get("learning_rate", 5e-4))


def test_fsdp_grpo_samples_scores_and_trains_as_ddp(tmp_path: Path) -> None:
    """GRPO with a KL loss term (its reference sharded) and rank 0's held-out evaluation: the ranks sample their
    shares with the weights gathered, with the generators DDP's ranks use, so the run is DDP's, to rounding."""
    grpo = {"type": "grpo", "model": "builtin:tiny", "dataset": "builtin:digits-prompts",
            "eval_dataset": "builtin:digits-prompts", "checkpoint_every": 2,
            "reward": {"type": "text_similarity", "input": "{{sample.output_text}}", "reference": "{{item.answer}} ",
                       "evaluation_metric": "fuzzy_match"},  # partial credit: the groups are not tied
            "hyperparameters": {"total_steps": 4, "batch_size": 4, "group_size": 4, "mini_batch_size": 8,
                                "gradient_accumulation_steps": 2, "response_length": 4, "kl_coef": 0.1,
                                "learning_rate": 1e-3, "eval_every": 2, "eval_max_prompts": 4}}  # fmt: skip
    runs = {}
    for sharding in ("ddp", "fsdp"):
        recorder = Recorder()
        job = JobSpec.model_validate({**grpo, "resources": {"num_processes": 2, "sharding": sharding}})
        assert run_distributed(job, tmp_path / sharding, recorder, 2).status == "succeeded"
        runs[sharding] = recorder
    ddp = {step: {k: v for k, v in m.items() if k != "dist/weight_spread"} for step, m in runs["ddp"].metrics.items()}
    fsdp_metrics = runs["fsdp"].metrics
    assert "eval/reward" in fsdp_metrics[4] and fsdp_metrics[4]["objective/kl"] > 1e-6
    assert max(m["groups/tied_fraction"] for m in fsdp_metrics.values()) < 1  # the policy loss trains
    assert_metrics_close(fsdp_metrics, ddp)
    assert_same_weights(tmp_path / "fsdp", tmp_path / "ddp", lr=1e-3)


GLOO_AVERAGE = """
import torch, torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
dist.init_process_group("gloo")
rank = dist.get_rank()
layer = torch.nn.Linear(4, 4, bias=False)
torch.nn.init.eye_(layer.weight)
fully_shard(layer, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
x = torch.full((1, 4), float(rank + 1))  # rank 0's gradient: 1s, rank 1's: 2s
layer(x).sum().backward()
grad = layer.weight.grad.full_tensor()
if rank == 0:
    print(json.dumps(grad.unique().tolist()))
dist.destroy_process_group()
"""


def test_gloo_averages_fsdp_gradients(tmp_path: Path) -> None:
    """Ranks with gradients 1 and 2 reduce to 1.5 (a sum would be 3): Ranks.loss_scale relies on it."""
    script = tmp_path / "average.py"
    script.write_text("import json\n" + GLOO_AVERAGE)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
                         capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [1.5]

"""Each policy loss (``policy_loss``, engine/spec/policy_losses.py) on the digits task, on this machine's CPU.

Trains the GRPO demo's SFT stage (``rlhf demo --method grpo``'s first), then the demo's GRPO stage (its
``JOB_TYPES["grpo"].demo`` settings) once per loss from that model (gspo with scaled clip ranges, and once more
with the paper's), and prints a table: the held-out accuracy by the task's rule of the SFT model and of each
GRPO policy (the demo's evaluation), their difference, and each run's time.

    python -m benchmarks.policy_losses [--out runs/policy-losses]
"""

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from engine.callbacks import Callbacks
from engine.core.data import load_rows
from engine.core.models import resolve_model_ref
from engine.demo import EVAL_PROMPTS, TASKS, demo_specs, evaluate_policy, sft_stage
from engine.run import run_job
from engine.spec.config import JOB_TYPES, JobSpec
from engine.spec.policy_losses import POLICY_LOSSES

CPU = torch.device("cpu")
GSPO_SCALED = {"cliprange_low": 0.03, "cliprange_high": 0.04, "loss_aggregation": "sequence_mean"}
"""gspo's settings here: the tiny model moves its log-probs far more per step than the paper's, so its clip
ranges are 100 times the paper's, which then clip about as often as they did there."""
GSPO_PAPER = {"cliprange_low": 3e-4, "cliprange_high": 4e-4, "loss_aggregation": "sequence_mean"}
"""The GSPO paper's (Qwen, arXiv:2507.18071) clip ranges and aggregation."""
RUNS: list[tuple[str, dict[str, Any]]] = [
    ("ppo_clip", {}),
    ("importance_sampling", {}),
    ("cispo", {}),
    ("gspo", GSPO_SCALED),
    ("gspo", GSPO_PAPER),
]
"""Each run's ``policy_loss`` and its hyperparameters over the demo's: every registered loss, and gspo at the
paper's settings too."""


def train(data: dict[str, Any], out: Path) -> float:
    """Trains ``data`` into ``out``; returns the seconds it took."""
    started = time.perf_counter()
    result = run_job(JobSpec.model_validate(data), out, Callbacks(), CPU)
    assert result.status == "succeeded", result
    return time.perf_counter() - started


def accuracy(policy: Path, reference: Path) -> float:
    """Held-out accuracy by the digits rule, as ``rlhf demo`` judges it."""
    task = TASKS[JOB_TYPES["grpo"].demo_task]
    rows = load_rows(task.eval_prompts, "prompts")[:EVAL_PROMPTS]
    policy_dir, reference_dir = resolve_model_ref(str(policy)), resolve_model_ref(str(reference))
    return evaluate_policy(policy_dir, reference_dir, None, rows, task).success


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/policy-losses"))
    args = parser.parse_args()
    specs = demo_specs(args.out, "grpo")
    sft = args.out / sft_stage("grpo")
    seconds = train(specs[sft.name], sft)
    before = accuracy(sft, sft)
    print(f"SFT {seconds:.1f} s; held-out accuracy {before:.3f} on {EVAL_PROMPTS} prompts", flush=True)
    print(f"| policy_loss | settings | SFT accuracy | GRPO accuracy | difference | time |\n|{'---|' * 6}")
    assert {name for name, _ in RUNS} == set(POLICY_LOSSES), "a run for every registered loss"
    for i, (name, settings) in enumerate(RUNS):
        grpo = specs["grpo"]
        data = {**grpo, "hyperparameters": {**grpo["hyperparameters"], "policy_loss": name, **settings}}
        out = args.out / f"grpo-{i}-{name}"
        seconds = train(data, out)
        after = accuracy(out, sft)
        shown = ", ".join(f"{k} {v}" for k, v in settings.items()) or "the demo's"
        row = f"| {name} | {shown} | {before:.3f} | {after:.3f} | {after - before:+.3f} | {seconds:.1f} s |"
        print(row, flush=True)


if __name__ == "__main__":
    main()

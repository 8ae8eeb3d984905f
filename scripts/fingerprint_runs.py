"""Fingerprints of short training runs, to show that a refactor of the engine changed no number.

Runs, on the CPU with fixed seeds and deterministic algorithms, a few short SFT, reward-model (from the SFT),
PPO (from both), DPO and GRPO (from an SFT) jobs with ``engine.run.run_job`` in a temporary folder, and prints
one line per job:

    <job> metrics=<sha256> weights=<sha256> [events=<sha256>] result=<status>@<step>

``metrics``: every step's metrics as ``json.dumps(sort_keys=True)`` (exact float repr), without the timings
(``time/*``, ``throughput/*``); ``weights``: the tensors (names, dtypes, shapes, bytes) of every safetensors
file of the job's final checkpoint (policy, value, LoRA adapters); ``events``: the warnings and infos it
recorded. Run it before and after a change and compare the lines:

    python scripts/fingerprint_runs.py > after.txt
    git worktree add /tmp/base HEAD && (cd /tmp/base && PYTHONPATH=/tmp/base python /path/to/fingerprint_runs.py)

Use the same machine and thread count for both: floating-point reductions depend on them. MKL runs in its
conditional-numerical-reproducibility mode (``MKL_CBWR=COMPATIBLE``), without which an SFT run was seen to
differ between two runs of the same code.
"""

import argparse
import hashlib
import json
import os
import sys

# MKL's kernels may take another summation order by the memory alignment of their operands, which varies from
# run to run: compatible mode makes each run's numbers depend on its inputs alone (set before torch loads MKL)
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from engine.builtin import digits
from engine.callbacks import Callbacks, StopRequest
from engine.run import run_job
from engine.spec.config import JobSpec

CPU = torch.device("cpu")
TIMINGS = ("time/", "throughput/")
"""Metrics that measure wall-clock time: left out of the fingerprint."""

PPO_SMALL: dict[str, Any] = {
    "total_steps": 5,
    "batch_size": 8,
    "mini_batch_size": 4,
    "ppo_epochs": 2,
    "response_length": 8,
    "learning_rate": 1e-4,
    "temperature": 1.0,
}


class Recorder(Callbacks):
    """Keeps metrics and events; asks for a pause once ``pause_after`` is reported."""

    def __init__(self, pause_after: int | None = None) -> None:
        self.pause_after = pause_after
        self.metrics: dict[int, dict[str, float]] = {}
        self.events: list[tuple[str, str, Any]] = []

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics[step] = {k: v for k, v in metrics.items() if not k.startswith(TIMINGS)}

    def on_event(self, kind: str, message: str, data: dict[str, object] | None = None) -> None:
        self.events.append((kind, message, data))

    def should_stop(self) -> StopRequest | None:
        if self.pause_after is not None and self.metrics and max(self.metrics) == self.pause_after:
            self.pause_after = None  # once
            return "pause"
        return None


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def weights_sha(out_dir: Path) -> str:
    """The tensors of every safetensors file of the newest checkpoint (sorted by path and name)."""
    steps = sorted((int(p.name.removeprefix("step-")), p) for p in (out_dir / "checkpoints").glob("step-*"))
    if not steps:
        return "none"
    final = steps[-1][1]
    digest = hashlib.sha256()
    for file in sorted(final.rglob("*.safetensors")):
        digest.update(str(file.relative_to(final)).encode())
        for name, tensor in sorted(load_file(file).items()):
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return f"{steps[-1][0]}:{digest.hexdigest()}"


def run(name: str, data: dict[str, Any], out_dir: Path, pause_after: int | None = None) -> str:
    """Train ``data`` (a spec) into ``out_dir``; with ``pause_after``, pause there and resume to the end."""
    spec = JobSpec.model_validate({"seed": 0, "checkpoint_every": 1000, **data})
    recorders = []
    result = None
    for _ in range(2 if pause_after else 1):
        recorder = Recorder(pause_after)
        result = run_job(spec, out_dir, recorder, device=CPU)
        recorders.append(recorder)
    assert result is not None
    metrics = [r.metrics for r in recorders]
    events = [r.events for r in recorders]
    line = (
        f"{name:<14} metrics={sha(json.dumps(metrics, sort_keys=True).encode())} weights={weights_sha(out_dir)} "
        f"events={sha(json.dumps(events, sort_keys=True, default=str).encode())[:16]} "
        f"result={result.status}@{result.step}"
    )
    print(line, flush=True)
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="train into this folder (kept) instead of a temporary one")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the same for runs compared)")
    parser.add_argument("--only", help="run only the jobs whose name starts with this (and the models they start from)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        sft, rm = root / "sft", root / "rm"
        sft_job = {"type": "sft", "model": "builtin:tiny", "dataset": "builtin:reviews-sft"}
        sft_hp = {"batch_size": 8, "max_steps": 8, "learning_rate": 3e-3, "warmup_steps": 2, "eval_every": 4}
        rm_job = {"type": "rm", "model": str(sft), "dataset": "builtin:reviews-prefs"}
        rm_hp = {"batch_size": 8, "max_steps": 8, "learning_rate": 1e-3, "eval_every": 4, "lm_loss_coef": 0.1}
        ppo_job = {"type": "ppo", "model": str(sft), "reward_model": str(rm), "dataset": "builtin:reviews-prompts"}
        ppo_full = {
            **PPO_SMALL,
            "ptx_coef": 0.1,
            "ptx_dataset": "builtin:reviews-sft",
            "entropy_coef": 0.01,
            "critic_warmup_steps": 1,
            "normalize_scores": True,
            "score_clip": 3.0,
            "adaptive_kl": True,
            "eval_every": 2,
        }
        # the flat collapse names (accepted before and after the nested group), tuned so that a kl_jump fires
        # once the policy trains: the job pauses there
        ppo_collapse = {
            **PPO_SMALL,
            "total_steps": 6,
            "critic_warmup_steps": 2,
            "on_collapse": "pause",
            "collapse_window": 4,
            "collapse_warmup": 2,
            "collapse_kl_factor": 1.01,
            "collapse_kl_min": 0.0,
        }
        dpo_job = {"type": "dpo", "model": str(sft), "dataset": "builtin:reviews-prefs"}
        dpo_hp = {"batch_size": 8, "max_steps": 4, "learning_rate": 1e-3, "eval_every": 2}
        digits_sft = root / "sft-digits"  # a policy that sometimes answers right: GRPO's groups are not all tied
        grpo_job = {"type": "grpo", "model": str(digits_sft), "dataset": "builtin:digits-prompts",
                    "reward": digits.GRADER}  # fmt: skip
        grpo_hp = {"total_steps": 3, "batch_size": 4, "group_size": 4, "mini_batch_size": 8, "response_length": 4,
                   "learning_rate": 1e-3, "num_iterations": 2}  # fmt: skip
        jobs: list[tuple[str, dict[str, Any], int | None]] = [
            ("sft", {**sft_job, "eval_dataset": "builtin:reviews-sft-eval", "hyperparameters": sft_hp}, None),
            ("sft-ga2", {**sft_job, "hyperparameters": {**sft_hp, "max_steps": 4, "gradient_accumulation_steps": 2}},
             None),
            ("sft-resume", {**sft_job, "hyperparameters": {**sft_hp, "max_steps": 5}}, 2),
            ("rm", {**rm_job, "eval_dataset": "builtin:reviews-prefs-eval", "hyperparameters": rm_hp}, None),
            ("rm-ga2-lora", {**rm_job, "lora": {"r": 4},
                             "hyperparameters": {**rm_hp, "max_steps": 4, "gradient_accumulation_steps": 2}}, None),
            ("ppo-full", {**ppo_job, "eval_dataset": "builtin:reviews-prompts-eval", "hyperparameters": ppo_full},
             None),
            ("ppo-lora", {**ppo_job, "lora": {"r": 4}, "hyperparameters": {**PPO_SMALL, "target_approxkl": 1e-6}},
             None),
            ("ppo-ga2", {**ppo_job, "hyperparameters": {**PPO_SMALL, "gradient_accumulation_steps": 2,
                                                        "value_learning_rate": 3e-4}}, None),
            ("ppo-resume", {**ppo_job, "hyperparameters": {**PPO_SMALL, "lr_scheduler": "cosine"}}, 2),
            ("ppo-collapse", {**ppo_job, "hyperparameters": ppo_collapse, "checkpoint_every": 2}, None),
            ("dpo", {**dpo_job, "eval_dataset": "builtin:reviews-prefs-eval", "hyperparameters": dpo_hp}, None),
            ("dpo-ipo-lora", {**dpo_job, "lora": {"r": 4}, "hyperparameters": {**dpo_hp, "loss_type": "ipo"}}, None),
            ("dpo-rpo-ga2", {**dpo_job, "hyperparameters": {**dpo_hp, "sft_loss_coef": 0.5,
                                                            "gradient_accumulation_steps": 2}}, 2),
            ("sft-digits", {**sft_job, "dataset": "builtin:digits-sft", "hyperparameters": {
                **sft_hp, "max_steps": 30, "batch_size": 16}}, None),
            ("grpo", {**grpo_job, "eval_dataset": "builtin:digits-prompts-eval",
                      "hyperparameters": {**grpo_hp, "eval_every": 2, "eval_max_prompts": 8}}, None),
            ("grpo-rloo-lora", {**grpo_job, "lora": {"r": 4}, "hyperparameters": {
                **grpo_hp, "advantage_estimator": "rloo", "cliprange_high": 0.28, "kl_estimator": "k2"}}, None),
            ("grpo-dr-ga2", {**grpo_job, "hyperparameters": {**grpo_hp, "advantage_estimator": "dr_grpo",
                                                             "gradient_accumulation_steps": 2}}, 1),
            ("grpo-rpp", {**grpo_job, "hyperparameters": {**grpo_hp, "advantage_estimator": "reinforce_pp",
                                                          "loss_aggregation": "sequence_mean"}}, None),
            ("grpo-rpp-base", {**grpo_job, "hyperparameters": {
                **grpo_hp, "advantage_estimator": "reinforce_pp_baseline", "kl_coef": 0.0}}, None),
        ]  # fmt: skip
        starts = ("sft", "rm", "sft-digits")
        for name, data, pause_after in jobs:
            if args.only and not name.startswith(args.only) and name not in starts:
                continue
            out = {"sft": sft, "rm": rm, "sft-digits": digits_sft}.get(name, root / name)
            run(name, data, out, pause_after)
    sys.stdout.flush()


if __name__ == "__main__":
    main()

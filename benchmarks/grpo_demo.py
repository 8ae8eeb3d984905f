"""GRPO's acceptance figures on the built-in tasks, on this machine's CPU.

1. ``digits``: the demo's SFT model (``rlhf demo --method grpo``'s first stage), then its GRPO stage twice,
   rewarded by the task's rule as a ``string_check`` grader and by the same rule served over HTTP on loopback
   (OpenRLHF's remote reward protocol). Prints the held-out accuracy by the rule before and after, each GRPO
   run's time, and whether the two runs' metric curves and final weights are identical.
2. ``reviews``: GRPO from the reviews demo's SFT model against its reward model (the first two stages of
   ``rlhf demo``); prints the held-out positive share (the task's ground truth) before and after.

    python benchmarks/grpo_demo.py [--out runs/grpo-bench] [--reviews-steps 60]
"""

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from engine.callbacks import Callbacks
from engine.core.data import load_rows
from engine.core.models import resolve_model_ref
from engine.demo import EVAL_PROMPTS, TASKS, demo_specs, evaluate_policy, sft_stage
from engine.run import run_job
from engine.spec.config import JOB_TYPES, JobSpec

CPU = torch.device("cpu")
TIMINGS = ("time/", "throughput/")


class Curve(Callbacks):
    """Records every step's metrics, timings left out."""

    def __init__(self) -> None:
        self.metrics: dict[int, dict[str, float]] = {}

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics[step] = {k: v for k, v in metrics.items() if not k.startswith(TIMINGS)}


def rule_service() -> tuple[ThreadingHTTPServer, str]:
    """The digits rule as a reward service on loopback: 1.0 where the completion is the label."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            rewards = [
                float(query.removeprefix(prompt) == label)
                for query, prompt, label in zip(body["query"], body["prompts"], body["labels"], strict=True)
            ]
            data = json.dumps({"rewards": rewards}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/score"


def train(data: dict[str, Any], out: Path) -> tuple[float, Curve]:
    curve = Curve()
    started = time.perf_counter()
    result = run_job(JobSpec.model_validate(data), out, curve, CPU)
    assert result.status == "succeeded", result
    return time.perf_counter() - started, curve


def weights(job: Path) -> dict[str, torch.Tensor]:
    folder = Path(resolve_model_ref(str(job)))
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def success(policy: Path, reference: Path, method: str, reward_dir: str | None = None) -> float:
    task = TASKS[JOB_TYPES[method].demo_task]
    rows = load_rows(task.eval_prompts, "prompts")[:EVAL_PROMPTS]
    policy_dir, reference_dir = resolve_model_ref(str(policy)), resolve_model_ref(str(reference))
    return evaluate_policy(policy_dir, reference_dir, reward_dir, rows, task).success


def digits(out: Path) -> None:
    specs = demo_specs(out, "grpo")
    sft = sft_stage("grpo")
    seconds, _ = train(specs[sft], out / sft)
    print(f"digits: SFT {seconds:.1f} s")
    server, url = rule_service()
    http = {"type": "http", "name": "correct", "url": url, "label": "{{item.answer}}"}
    runs = {}
    try:
        for name, reward in (("rule", specs["grpo"]["reward"]), ("http", http)):
            seconds, curve = train({**specs["grpo"], "reward": reward}, out / f"grpo-{name}")
            runs[name] = curve
            accuracy = success(out / f"grpo-{name}", out / sft, "grpo")
            print(
                f"digits: GRPO ({name} reward) {seconds:.1f} s, {len(curve.metrics)} steps; "
                f"held-out accuracy {curve.metrics[len(curve.metrics)]['eval/reward']:.3f} in training's "
                f"eval, {accuracy:.3f} by the demo's evaluation"
            )
    finally:
        server.shutdown()
    same_curve = runs["rule"].metrics == runs["http"].metrics
    a, b = weights(out / "grpo-rule"), weights(out / "grpo-http")
    same_weights = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(
        f"digits: SFT held-out accuracy {success(out / sft, out / sft, 'grpo'):.3f}; "
        f"rule and http runs: identical curves {same_curve}, identical weights {same_weights}"
    )


def reviews(out: Path, steps: int) -> None:
    specs = demo_specs(out, "ppo")
    for stage in ("sft", "rm"):
        seconds, _ = train(specs[stage], out / stage)
        print(f"reviews: {stage} {seconds:.1f} s")
    grpo = {
        "type": "grpo",
        "model": str(out / "sft"),
        "reward_model": str(out / "rm"),
        "dataset": "builtin:reviews-prompts",
        "hyperparameters": {
            "total_steps": steps,
            "batch_size": 16,
            "group_size": 8,
            "mini_batch_size": 64,
            "learning_rate": 1e-4,
            "response_length": 24,
        },
        "checkpoint_every": 1000,
    }
    seconds, curve = train(grpo, out / "grpo-reviews")
    rm_dir = resolve_model_ref(str(out / "rm"))
    before = success(out / "sft", out / "sft", "ppo", rm_dir)
    after = success(out / "grpo-reviews", out / "sft", "ppo", rm_dir)
    first, last = curve.metrics[1]["reward/mean"], curve.metrics[steps]["reward/mean"]
    print(
        f"reviews: GRPO against the reward model {seconds:.1f} s, {steps} steps; reward {first:.2f} → "
        f"{last:.2f}; held-out positive share (truth) {before:.3f} → {after:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/grpo-bench"))
    parser.add_argument("--reviews-steps", type=int, default=60)
    args = parser.parse_args()
    digits(args.out)
    reviews(args.out, args.reviews_steps)


if __name__ == "__main__":
    main()

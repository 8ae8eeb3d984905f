"""Per-step overhead of a PPO job run by the server, against the identical job run in-process.

Starts the embedded server (``rlhf serve``: SQLite database and broker) in a temporary folder and trains a
small SFT model and reward model through it. Then, in rounds, runs the same PPO job spec twice: locally in
this process with ``engine.run.run_job`` (what ``rlhf train`` does), then submitted to the server, whose
train worker runs it with the database callbacks (metric writes, heartbeats, stop checks). Both arms start
from the same models: the server's SFT and RM job folders, which the local arm names by path (the folders
``job:<id>`` resolves to) and the server arm by ``job:<id>``.

Per-step time is the wall-clock time between the ends of consecutive steps, so it includes everything the
loop does between two steps. Local arm: ``time.perf_counter()`` taken in ``on_metrics``. Server arm: the
``created_at`` of the step's rows in the ``metrics`` table, read from the server's database after the job
ended (not through the API, which would add load while the job runs). The worker sets ``created_at`` when
it inserts the step's metrics inside ``on_metrics``, at the same point of every step, so consecutive
differences are whole steps, database commit included. The first two steps (warm-up) and the last step
(it writes the checkpoint) are left out of both arms. Next to it, the median of the engine's own
``time/step_s`` metric (rollout plus PPO update, without callbacks) shows where a difference comes from:
a larger ``time/step_s`` means a slower computation (e.g. CPU contention), a larger gap between the two
means per-step work outside the engine.

Both arms use the same torch thread count (``--threads``): ``torch.set_num_threads`` here, and
``OMP_NUM_THREADS`` in the server's environment, which its train worker inherits. While a server job runs,
this process only asks for its status once a second; while a local job runs, the server is idle.

It also prints how far apart the ``created_at`` values of one step's metric rows are: the worker writes a
step's metrics in one transaction (``DbCallbacks.on_metrics``: heartbeat, one INSERT of all the step's rows,
the job's progress), so they lie microseconds apart; a transaction per metric would put a commit, a
millisecond or more, between them.

Run: ``python benchmarks/server_overhead.py [--steps 25] [--rounds 4] [--threads 1]``.
"""

import argparse
import gc
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import select
from transformers.utils import logging as hf_logging

from engine.callbacks import Callbacks
from engine.run import run_job
from engine.spec.config import JobSpec
from jobs.client import Client
from jobs.demo import embedded_server
from jobs.store import refs
from jobs.store.db import session_scope
from jobs.store.models import Metric
from jobs.store.settings import Settings

WARMUP_STEPS = 2
POLL_S = 1.0
FINAL = ("succeeded", "failed", "cancelled")


@dataclass
class Arm:
    """One job's measured steps: the end time of each step, and its ``time/step_s`` metric."""

    ends: dict[int, float]
    step_s: dict[int, float]

    def measured(self, total_steps: int) -> range:
        """Steps whose interval counts: after the warm-up, before the final (checkpointing) step."""
        return range(WARMUP_STEPS + 1, total_steps)

    def intervals(self, total_steps: int) -> list[float]:
        return [self.ends[s] - self.ends[s - 1] for s in self.measured(total_steps)]

    def engine_step_s(self, total_steps: int) -> list[float]:
        return [self.step_s[s] for s in self.measured(total_steps)]


class StepClock(Callbacks):
    """The local arm's callbacks: when each step's metrics arrive."""

    def __init__(self) -> None:
        self.arm = Arm({}, {})

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.arm.ends[step] = time.perf_counter()
        self.arm.step_s[step] = metrics["time/step_s"]


def ppo_spec(model: str, reward_model: str, steps: int) -> dict[str, Any]:
    return {
        "type": "ppo",
        "model": model,
        "reward_model": reward_model,
        "dataset": "builtin:reviews-prompts",
        "hyperparameters": {"total_steps": steps, "batch_size": 16, "mini_batch_size": 8, "response_length": 24},
        "checkpoint_every": 10_000_000,  # only the final step checkpoints
    }


def wait(c: Client, job_id: str) -> dict[str, Any]:
    while (job := c.get_job(job_id))["status"] not in FINAL:
        time.sleep(POLL_S)
    if job["status"] != "succeeded":
        raise SystemExit(f"job {job_id} {job['status']}: {job.get('error')}")
    return job


def train_models(c: Client) -> tuple[str, str]:
    """A small SFT model and reward model through the server (as job_status_latency.py); their job ids."""
    sft = c.create_job(
        {
            "type": "sft",
            "model": "builtin:tiny",
            "dataset": "builtin:reviews-sft",
            "hyperparameters": {"max_steps": 150, "batch_size": 32, "learning_rate": 3e-3},
        }
    )
    wait(c, sft["id"])
    rm = c.create_job(
        {
            "type": "rm",
            "model": f"job:{sft['id']}",
            "dataset": "builtin:reviews-prefs",
            "hyperparameters": {"max_steps": 40},
        }
    )
    wait(c, rm["id"])
    return sft["id"], rm["id"]


def run_local(spec: dict[str, Any], out_dir: Path) -> Arm:
    clock = StepClock()
    result = run_job(JobSpec.model_validate(spec), out_dir, clock)
    if result.status != "succeeded":
        raise SystemExit(f"local job {result.status} at step {result.step}")
    gc.collect()  # as the worker does after each job
    return clock.arm


def run_server(c: Client, spec: dict[str, Any], database_url: str) -> tuple[Arm, list[float]]:
    """The server arm, and per step the spread of its metric rows' ``created_at`` (seconds)."""
    job_id = c.create_job(spec)["id"]
    wait(c, job_id)
    with session_scope(database_url) as session:
        rows = session.execute(select(Metric.step, Metric.name, Metric.value, Metric.created_at).where(
            Metric.job_id == job_id))  # fmt: skip
        by_step: dict[int, list[Any]] = {}
        step_s = {}
        for step, name, value, created_at in rows:
            by_step.setdefault(step, []).append(created_at)
            if name == "time/step_s":
                step_s[step] = value
    ends = {step: min(times).timestamp() for step, times in by_step.items()}
    spreads = [(max(times) - min(times)).total_seconds() for times in by_step.values()]
    return Arm(ends, step_s), spreads


@dataclass
class Row:
    round: int
    arm: str
    wall_mean: float
    wall_median: float
    engine_median: float
    outside: float
    """Mean wall-clock per step minus mean ``time/step_s``: time per step spent outside the engine's timer."""


def summarize(round_: int, label: str, arm: Arm, steps: int) -> Row:
    intervals, engine = arm.intervals(steps), arm.engine_step_s(steps)
    return Row(
        round_,
        label,
        statistics.fmean(intervals),
        statistics.median(intervals),
        statistics.median(engine),
        statistics.fmean(intervals) - statistics.fmean(engine),
    )


def print_table(rows: list[Row], args: argparse.Namespace, spreads: list[float]) -> None:
    measured = args.steps - WARMUP_STEPS - 1
    print(
        f"\nPPO, {args.steps} steps per job ({measured} measured: steps {WARMUP_STEPS + 1}-{args.steps - 1}), "
        f"{args.rounds} rounds of (local, server), {args.threads} torch thread(s) in both arms"
    )
    header = f"{'round':<8}{'arm':<8}{'wall/step mean':>16}{'wall/step p50':>15}{'time/step_s p50':>17}"
    print(f"{header}{'outside engine':>16}")
    for r in rows:
        print(
            f"{r.round:<8}{r.arm:<8}{r.wall_mean * 1000:>13.1f} ms{r.wall_median * 1000:>12.1f} ms"
            f"{r.engine_median * 1000:>14.1f} ms{r.outside * 1000:>13.1f} ms"
        )
    medians = {}
    for arm in ("local", "server"):
        own = [r for r in rows if r.arm == arm]
        fields = ("wall_mean", "wall_median", "engine_median", "outside")
        medians[arm] = tuple(statistics.median(getattr(r, f) for r in own) for f in fields)
        wall_mean, wall_median, engine, outside = (v * 1000 for v in medians[arm])
        print(f"{'median':<8}{arm:<8}{wall_mean:>13.1f} ms{wall_median:>12.1f} ms{engine:>14.1f} ms{outside:>13.1f} ms")
    ratio = medians["server"][0] / medians["local"][0]
    engine_ratio = medians["server"][2] / medians["local"][2]
    print(f"server/local wall-clock per step: {ratio:.3f} ({(ratio - 1) * 100:+.1f}%; goal: at most +5%)")
    print(f"server/local time/step_s: {engine_ratio:.3f}")
    extra = medians["server"][3] - medians["local"][3]
    print(
        f"work outside the engine's timer, server - local: {extra * 1000:.1f} ms per step "
        f"({extra / medians['local'][0] * 100:.1f}% of the local step; steadier than the ratio under CPU noise)"
    )
    print(
        f"metric rows of one step (server): created_at spread median {statistics.median(spreads) * 1e6:.0f} µs, "
        f"max {max(spreads) * 1e6:.0f} µs"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=25, help="PPO steps per job (at least 6)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of (local job, server job); at least 2")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in both arms")
    parser.add_argument("--port", type=int, default=8778)
    args = parser.parse_args()
    if args.steps < WARMUP_STEPS + 4 or args.rounds < 2 or args.threads < 1:
        parser.error("needs --steps >= 6, --rounds >= 2 and --threads >= 1")

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the server's worker processes
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # as the worker does; the local arm's model loads stay quiet
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp).resolve() / "server"
        settings = Settings(data_dir=data_dir)  # what `rlhf serve --data-dir` uses
        with embedded_server(data_dir, args.port) as c:
            sft_id, rm_id = train_models(c)
            print(f"SFT and RM trained through the server in {time.perf_counter() - started:.0f} s")
            artifacts = settings.resolved_artifacts_dir
            local_spec = ppo_spec(str(refs.job_dir(artifacts, sft_id)), str(refs.job_dir(artifacts, rm_id)), args.steps)
            server_spec = ppo_spec(f"job:{sft_id}", f"job:{rm_id}", args.steps)
            rows, spreads = [], []
            for i in range(1, args.rounds + 1):
                local = run_local(local_spec, Path(tmp) / f"local-{i}")
                rows.append(summarize(i, "local", local, args.steps))
                server, step_spreads = run_server(c, server_spec, settings.resolved_database_url)
                rows.append(summarize(i, "server", server, args.steps))
                spreads += step_spreads
                print(f"round {i} done at {time.perf_counter() - started:.0f} s")
    print_table(rows, args, spreads)
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

"""Latency of ``GET /v1/jobs/{id}`` under 20 concurrent pollers, idle and while a PPO job trains.

Starts the embedded server (``rlhf serve``) in a temporary folder, trains a small SFT model and reward
model, then polls the PPO job's status from 20 threads for a fixed time — first with the train worker
idle (job queued behind nothing: measured right after SFT/RM finish), then while PPO trains — and
prints p50/p99 and the ratio. Run: ``python benchmarks/job_status_latency.py [--seconds 20]``.
"""

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from jobs.client import Client
from jobs.demo import embedded_server, upload_builtin

POLLERS = 20


def poll(c: Client, job_id: str, seconds: float) -> list[float]:
    """Every poller's request latencies, in seconds, over ``seconds``."""
    latencies: list[float] = []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def run() -> None:
        with httpx.Client(base_url=c.url, headers=c.http.headers, timeout=30) as http:
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                http.get(f"/v1/jobs/{job_id}").raise_for_status()
                with lock:
                    latencies.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=run) for _ in range(POLLERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def report(label: str, latencies: list[float], seconds: float) -> float:
    p50, p99 = percentile(latencies, 50) * 1000, percentile(latencies, 99) * 1000
    rate = len(latencies) / seconds
    print(f"{label:<22} requests {len(latencies):>6}  {rate:>7.0f}/s  p50 {p50:6.1f} ms  p99 {p99:6.1f} ms")
    return p99


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--port", type=int, default=8777)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, embedded_server(Path(tmp), args.port) as c:
        files = upload_builtin(c, Path(tmp) / "datasets")
        sft = c.create_job(
            {
                "type": "sft",
                "model": "builtin:tiny",
                "dataset": files["reviews-sft"],
                "hyperparameters": {"max_steps": 150, "batch_size": 32, "learning_rate": 3e-3},
            }
        )
        wait(c, sft["id"])
        rm = c.create_job(
            {
                "type": "rm",
                "model": f"job:{sft['id']}",
                "dataset": files["reviews-prefs"],
                "hyperparameters": {"max_steps": 40},
            }
        )
        wait(c, rm["id"])
        idle = poll(c, rm["id"], args.seconds)
        ppo = c.create_job(
            {
                "type": "ppo",
                "model": f"job:{sft['id']}",
                "reward_model": f"job:{rm['id']}",
                "dataset": files["reviews-prompts"],
                "hyperparameters": {"total_steps": 10_000},
            }
        )
        while c.get_job(ppo["id"])["step"] < 1:
            time.sleep(0.5)
        busy = poll(c, ppo["id"], args.seconds)
        steps = c.get_job(ppo["id"])["step"]
        c.request("POST", f"/v1/jobs/{ppo['id']}/cancel")
        print(
            f"GET /v1/jobs/{{id}}, {POLLERS} concurrent pollers, {args.seconds:.0f} s each (PPO reached step {steps})"
        )
        idle_p99 = report("train worker idle", idle, args.seconds)
        busy_p99 = report("PPO training", busy, args.seconds)
        print(f"p99 ratio busy/idle: {busy_p99 / idle_p99:.2f}")


def wait(c: Client, job_id: str) -> None:
    while (job := c.get_job(job_id))["status"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(0.5)
    if job["status"] != "succeeded":
        raise SystemExit(f"job {job_id} {job['status']}: {job.get('error')}")


if __name__ == "__main__":
    main()

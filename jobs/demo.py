"""The demo through the HTTP API: start the embedded server, upload the built-in data as files, submit
SFT → RM → PPO (or SFT → another method, ``--method dpo`` or ``grpo``) as one pipeline (``POST /v1/pipelines``,
later stages naming earlier ones) and show each stage's live progress, then sample both policies through the
generate endpoint and judge them with the task's rule.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from engine.builtin import DATASETS
from engine.core.data import load_rows
from engine.demo import EVAL_PROMPTS, TASKS, TEMPERATURE, demo_specs, sft_stage
from engine.spec.config import JOB_TYPES
from jobs.client import KEY_FILE, Client, follow

GENERATE_BATCH = 64


@contextmanager
def embedded_server(data_dir: Path, port: int) -> Iterator[Client]:
    """Start ``rlhf serve`` in its own process group; stop it (and its children) on exit."""
    data_dir.mkdir(parents=True, exist_ok=True)
    log = (data_dir / "serve.log").open("ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "jobs.cli", "serve", "--data-dir", str(data_dir), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise SystemExit(f"the server exited; see {data_dir / 'serve.log'}")
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200 and (data_dir / KEY_FILE).exists():
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the server did not become ready; see {data_dir / 'serve.log'}")
            time.sleep(0.5)
        yield Client(url, (data_dir / KEY_FILE).read_text().strip(), timeout=300)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()


def upload_builtin(c: Client, folder: Path) -> dict[str, str]:
    """Each built-in dataset as a JSONL file on the server (reused if already uploaded): name → file id."""
    folder.mkdir(parents=True, exist_ok=True)
    existing = {f["filename"]: f["id"] for f in c.request("GET", "/v1/files", params={"limit": 100})["data"]}
    ids = {}
    for name, (kind, rows) in DATASETS.items():
        filename = f"{name}.jsonl"
        if filename not in existing:
            path = folder / filename
            path.write_text("".join(json.dumps(row) + "\n" for row in rows()))
            existing[filename] = c.upload_file(path, kind)["id"]
        ids[name] = existing[filename]
    return ids


def run_pipeline(c: Client, stages: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Submit the stages in one request (``POST /v1/pipelines``), then follow each until it ends; every job by
    stage. A rerun of the same stages finds the same jobs (an idempotency key of their content)."""
    digest = hashlib.sha256(json.dumps(stages, sort_keys=True).encode()).hexdigest()[:16]
    jobs = c.create_pipeline(stages, idempotency_key=f"demo-{digest}")
    for stage, job in jobs.items():
        jobs[stage] = follow(c, job["id"], stage)
        if jobs[stage]["status"] != "succeeded":
            raise SystemExit(f"{stage} job {job['id']} ended {jobs[stage]['status']}: {jobs[stage].get('error')}")
    return jobs


def sample(c: Client, job_id: str, prompts: list[str], score: bool) -> list[dict[str, Any]]:
    completions = []
    for i in range(0, len(prompts), GENERATE_BATCH):
        body = {
            "prompts": prompts[i : i + GENERATE_BATCH],
            "max_new_tokens": 24,
            "temperature": TEMPERATURE,
            "seed": i,
            "score": score,
        }
        completions += c.request("POST", f"/v1/jobs/{job_id}/generate", json=body)["completions"]
    return completions


def run_http_demo(data_dir: Path, port: int, method: str = "ppo") -> None:
    started = time.perf_counter()
    with embedded_server(data_dir.resolve(), port) as c:
        files = upload_builtin(c, data_dir / "datasets")
        stages: dict[str, dict[str, Any]] = {}
        sft = sft_stage(method)
        for stage, spec in demo_specs(Path("unused"), method).items():
            spec = {**spec, "dataset": files[spec["dataset"].removeprefix("builtin:")]}
            if "eval_dataset" in spec:
                spec["eval_dataset"] = files[spec["eval_dataset"].removeprefix("builtin:")]
            spec["model"] = "builtin:tiny" if stage == sft else f"stage:{sft}"  # later stages wait for the SFT
            if "reward_model" in spec:
                spec["reward_model"] = "stage:rm"
            stages[stage] = spec
        jobs = run_pipeline(c, stages)

        scored = "rm" in jobs  # the pipeline trained a reward model to score samples with
        task = TASKS[JOB_TYPES[method].demo_task]
        rows = load_rows(task.eval_prompts, "prompts")[:EVAL_PROMPTS]
        prompts = [row["prompt"] for row in rows]
        sft_samples = sample(c, jobs[sft_stage(method)]["id"], prompts, score=False)
        trained = sample(c, jobs[method]["id"], prompts, score=scored)

        def share(completions: list[dict[str, Any]]) -> float:
            return sum(task.judge(row, x["text"]) for row, x in zip(rows, completions, strict=True)) / len(rows)

        accuracy = f"; reward model eval accuracy {jobs['rm']['latest_metrics']['eval/accuracy']:.3f}" if scored else ""
        print(f"\nHeld-out evaluation through POST /v1/jobs/{{id}}/generate: {len(prompts)} prompts, "
              f"temperature {TEMPERATURE}{accuracy}")  # fmt: skip
        print(f"{'':<24}{'SFT':>10}{method.upper():>10}")
        print(f"{task.label:<24}{share(sft_samples):>10.3f}{share(trained):>10.3f}")
        if scored:
            score = sum(x["score"] for x in trained) / len(trained)
            print(f"{'reward model score':<24}{'':>10}{score:>10.3f}")
            kl = jobs[method]["latest_metrics"].get("eval/kl", float("nan"))
            print(f"{'KL to SFT reference':<24}{0.0:>10.3f}{kl:>10.3f}")
        print(f"pipeline finished in {time.perf_counter() - started:.0f}s; server data in {data_dir}")

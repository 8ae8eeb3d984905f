"""End to end: a real ``rlhf serve`` (API, train and inference workers as processes) driven over HTTP."""

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.builtin import DATASETS
from jobs.client import Client, ClientError
from jobs.demo import embedded_server
from tests.helpers import children_running, free_port


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Client, Path]]:
    data_dir = tmp_path_factory.mktemp("server")
    # a spec may ask for more processes than the worker has cores (the pipeline test's failing stage)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RLHF_MAX_PROCESSES", "64")
        with embedded_server(data_dir, free_port()) as client:
            env.undo()
            yield client, data_dir


def upload(c: Client, folder: Path, name: str, rows: int = 256) -> str:
    kind, make_rows = DATASETS[name]
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in make_rows()[:rows]))
    return str(c.upload_file(path, kind)["id"])


def wait_for(c: Client, job_id: str, done: Any, timeout: float = 240) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not done(job := c.get_job(job_id)):
        assert time.monotonic() < deadline, f"timed out waiting on {job_id}: {job['status']} step {job['step']}"
        time.sleep(0.3)
    return job


def finished(job: dict[str, Any]) -> bool:
    return job["status"] in ("succeeded", "failed", "cancelled")


def test_pipeline_over_http(server: tuple[Client, Path], tmp_path: Path) -> None:
    c, data_dir = server

    # Files: a malformed line is refused with its number, nothing stored.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n')
    with pytest.raises(ClientError) as error:
        c.upload_file(bad, "sft")
    assert error.value.status == 422 and "line 2" in str(error.value)
    files = {name: upload(c, tmp_path, name) for name in ("reviews-sft", "reviews-prefs", "reviews-prompts")}

    # SFT, created twice with one idempotency key: one job.
    sft_spec = {
        "type": "sft",
        "model": "builtin:tiny",
        "dataset": files["reviews-sft"],
        "hyperparameters": {"max_steps": 30, "batch_size": 16, "learning_rate": 3e-3},
        "checkpoint_every": 10,
    }
    sft = c.create_job(sft_spec, idempotency_key="e2e-sft")
    assert c.create_job(sft_spec, idempotency_key="e2e-sft")["id"] == sft["id"]

    # The live stream delivers each step once; a reconnect from the middle repeats and loses nothing.
    messages = list(c.stream(sft["id"]))
    steps = [m.data["step"] for m in messages if m.event == "metrics"]
    assert steps == list(range(1, 31))
    assert messages[-1].event == "end"
    middle = next(i for i, m in enumerate(messages) if m.event == "metrics" and m.data["step"] == 15)
    resumed = list(c.stream(sft["id"], last_event_id=messages[middle].id))

    def history(ms: list[Any], kind: str) -> list[Any]:  # the cursor orders metrics and events each by itself
        return [m.data for m in ms if m.event == kind]

    for kind in ("metrics", "event"):
        assert history(resumed, kind) == history(messages[middle + 1 :], kind)
    assert c.get_job(sft["id"])["status"] == "succeeded"

    history = c.request("GET", f"/v1/jobs/{sft['id']}/metrics", params={"names": "loss/sft", "max_points": 5})
    points = history["data"]["loss/sft"]
    assert len(points) == 5 and points[0]["step"] == 1 and points[-1]["step"] == 30
    checkpoints = c.request("GET", f"/v1/jobs/{sft['id']}/checkpoints")["data"]
    assert [cp["step"] for cp in checkpoints] == [10, 20, 30]
    generated = c.request("POST", f"/v1/jobs/{sft['id']}/generate", json={"prompts": ["we watched the film and"]})
    assert generated["checkpoint"] == 30 and generated["completions"][0]["finish_reason"] in ("stop", "length")

    # RM, then PPO chained by job: references.
    rm = c.create_job(
        {"type": "rm", "model": f"job:{sft['id']}", "dataset": files["reviews-prefs"],
         "hyperparameters": {"max_steps": 15, "batch_size": 16}}
    )  # fmt: skip
    assert wait_for(c, rm["id"], finished)["status"] == "succeeded"
    ppo_spec = {
        "type": "ppo",
        "model": f"job:{sft['id']}",
        "reward_model": f"job:{rm['id']}",
        "dataset": files["reviews-prompts"],
        "hyperparameters": {"total_steps": 500, "batch_size": 8, "mini_batch_size": 8, "response_length": 12},
        "checkpoint_every": 2,
    }
    ppo = c.create_job(ppo_spec)
    wait_for(c, ppo["id"], lambda j: j["step"] >= 3)

    # Generate from the running job's newest checkpoint, with reward-model scores.
    live = c.request(
        "POST", f"/v1/jobs/{ppo['id']}/generate", json={"prompts": ["i streamed the film and"], "score": True}
    )
    assert live["checkpoint"] >= 2 and isinstance(live["completions"][0]["score"], float)

    # A job naming one that has not finished waits for it (and fails when that one is cancelled, below); another
    # project's key cannot see the job.
    waiting = c.create_job({**ppo_spec, "model": f"job:{ppo['id']}"})
    assert waiting["status"] == "waiting"
    env = {**os.environ, "RLHF_DATA_DIR": str(data_dir)}
    out = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "keys", "create", "--project", "other"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    other = Client(c.url, json.loads(out.stdout.strip().splitlines()[-1])["api_key"])
    with pytest.raises(ClientError) as error:
        other.get_job(ppo["id"])
    assert error.value.status == 404

    # Pause, then resume: the job continues from its checkpoint, its step never goes back.
    c.request("POST", f"/v1/jobs/{ppo['id']}/pause")
    paused = wait_for(c, ppo["id"], lambda j: j["status"] == "paused")
    c.request("POST", f"/v1/jobs/{ppo['id']}/resume")
    wait_for(c, ppo["id"], lambda j: j["status"] == "running" and j["step"] >= paused["step"] + 2)
    c.request("POST", f"/v1/jobs/{ppo['id']}/cancel")
    cancelled = wait_for(c, ppo["id"], finished)
    assert cancelled["status"] == "cancelled"
    ppo_steps = [m.data["step"] for m in c.stream(ppo["id"]) if m.event == "metrics"]
    assert ppo_steps == list(range(1, cancelled["step"] + 1))  # every step once, in order, across the pause
    ended = wait_for(c, waiting["id"], finished, timeout=30)
    assert (ended["status"], ended["error"]["code"]) == ("failed", "dependency_failed")
    assert ppo["id"] in ended["error"]["message"]

    # Pagination over the four jobs, newest first.
    first = c.request("GET", "/v1/jobs", params={"limit": 2})
    second = c.request("GET", "/v1/jobs", params={"limit": 2, "after": first["data"][-1]["id"]})
    assert first["has_more"] and not second["has_more"]
    assert [j["id"] for j in first["data"] + second["data"]] == [waiting["id"], ppo["id"], rm["id"], sft["id"]]


def test_a_pipeline_in_one_request_runs_to_the_end(server: tuple[Client, Path], tmp_path: Path) -> None:
    """SFT → RM → PPO submitted whole (``rlhf submit`` of a pipeline file): each stage starts when the one it names
    succeeds, with no further call; then a pipeline whose first stage fails (more processes than the worker
    has cores) fails its other stages with dependency_failed."""
    c, data_dir = server
    stages = {
        "sft": {"type": "sft", "model": "builtin:tiny", "dataset": "builtin:reviews-sft",
                "hyperparameters": {"max_steps": 4, "batch_size": 8}},
        "rm": {"type": "rm", "model": "stage:sft", "dataset": "builtin:reviews-prefs",
               "hyperparameters": {"max_steps": 4, "batch_size": 8}},
        "ppo": {"type": "ppo", "model": "stage:sft", "reward_model": "stage:rm", "dataset": "builtin:reviews-prompts",
                "hyperparameters": {"total_steps": 2, "batch_size": 8, "mini_batch_size": 8, "response_length": 8}},
    }  # fmt: skip
    pipeline = tmp_path / "pipeline.json"
    pipeline.write_text(json.dumps({"stages": stages}))
    env = {**os.environ, "RLHF_DATA_DIR": str(data_dir)}  # the url and key rlhf serve wrote there
    out = subprocess.run([sys.executable, "-m", "jobs.cli", "submit", str(pipeline)], env=env, capture_output=True,
                         text=True, check=True)  # fmt: skip
    ids = {line.split(": ")[0]: line.split()[1] for line in out.stdout.splitlines()}  # "<stage>: <id> <status>"
    assert list(ids) == ["sft", "rm", "ppo"]
    ppo = wait_for(c, ids["ppo"], finished)
    assert ppo["status"] == "succeeded", ppo
    assert [c.get_job(ids[name])["status"] for name in ("sft", "rm")] == ["succeeded", "succeeded"]

    too_many = (os.cpu_count() or 1) + 1  # within RLHF_MAX_PROCESSES (the server fixture's), beyond the worker
    sft = {**stages["sft"], "hyperparameters": {"max_steps": 4, "batch_size": 8 * too_many}}  # a share each
    failing = {**stages, "sft": {**sft, "resources": {"num_processes": too_many}}}
    jobs = c.create_pipeline(failing)
    assert wait_for(c, jobs["sft"]["id"], finished)["error"]["code"] == "invalid_spec"
    for name in ("rm", "ppo"):
        job = wait_for(c, jobs[name]["id"], finished, timeout=30)
        assert (job["status"], job["error"]["code"]) == ("failed", "dependency_failed"), job
        assert jobs["sft"]["id"] in job["error"]["message"]


def test_cli_client_and_worker_restart(server: tuple[Client, Path], tmp_path: Path) -> None:
    c, data_dir = server
    env = {**os.environ, "RLHF_DATA_DIR": str(data_dir)}

    def rlhf(*args: str) -> str:
        return subprocess.run(
            [sys.executable, "-m", "jobs.cli", *args], env=env, capture_output=True, text=True, check=True
        ).stdout

    spec = tmp_path / "sft.json"
    spec.write_text(json.dumps({"type": "sft", "model": "builtin:tiny", "dataset": "builtin:reviews-sft",
                                "hyperparameters": {"max_steps": 4, "batch_size": 8}}))  # fmt: skip
    job = json.loads(rlhf("submit", str(spec)).strip().splitlines()[-1])
    wait_for(c, job["id"], finished)
    assert job["id"] in rlhf("jobs", "list")
    assert json.loads(rlhf("jobs", "get", job["id"]))["status"] == "succeeded"

    # Kill the inference worker: `rlhf serve` starts a new one, and generation works again.
    serve_pid = json.loads((data_dir / "server.json").read_text())["pid"]
    [worker] = children_running(serve_pid, "--queues inference")
    os.kill(worker, 9)
    deadline = time.monotonic() + 60
    while not (replacement := children_running(serve_pid, "--queues inference")) or replacement == [worker]:
        assert time.monotonic() < deadline, "the inference worker was not restarted"
        time.sleep(0.5)
    line = rlhf("generate", job["id"], "we watched the film and it was").strip().splitlines()[-1]
    assert json.loads(line)["checkpoint"] == 4

"""Checkpoints under faults (issue 4, faults 6 and 7):

- a job whose loss becomes infinite fails with ``non_finite_loss`` at that step, and its last good checkpoint
  stays listed and generates — a real ``rlhf serve``;
- a worker killed (SIGKILL) between writing a checkpoint and renaming it into place: the job resumes from the
  previous complete checkpoint, and no half-written checkpoint is ever listed, by the API or by
  ``engine.core.checkpoint.list_checkpoints`` — a real ``rlhf serve`` whose processes load a test-only
  ``sitecustomize`` that holds that rename until the test has killed the worker;
- the engine killed while a checkpoint is half written, or while an old one is half deleted: resuming
  continues from the newest complete one, and the leftovers are removed.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from engine.core.checkpoint import STATE_FILE, list_checkpoints
from jobs.client import Client
from jobs.demo import embedded_server
from tests.helpers import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
# kombu's SQLAlchemy transport still uses a loader option SQLAlchemy 2.1 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")

SITECUSTOMIZE = '''
"""Test-only (tests/faults/test_checkpoint_faults.py): holds the rename of one checkpoint into place.

When the JSON file named by RLHF_TEST_HOLD_RENAME exists and names a job and a step, the first process that
renames that job's temporary ``.step-<step>-*`` folder writes its pid to the file's ``marker`` path, then
sleeps before renaming, so that the test can kill it between the write and the rename.
"""
import json
import os
import time

_plan_file = os.environ.get("RLHF_TEST_HOLD_RENAME")
if _plan_file:
    _replace = os.replace

    def _held_replace(src, dst, *args, **kwargs):
        path = os.fspath(src)
        try:
            with open(_plan_file) as f:
                plan = json.load(f)
        except (OSError, ValueError):
            plan = None
        if (
            plan
            and os.path.basename(path).startswith(".step-%d-" % plan["step"])
            and os.sep + plan["job_id"] + os.sep in path
            and not os.path.exists(plan["marker"])
        ):
            with open(plan["marker"], "w") as f:
                f.write(str(os.getpid()))
            time.sleep(plan.get("sleep_s", 300))
        return _replace(src, dst, *args, **kwargs)

    os.replace = _held_replace
'''


@dataclass
class Server:
    client: Client
    data_dir: Path
    hold_plan: Path
    """Write {job_id, step, marker} here to hold that checkpoint's rename (see SITECUSTOMIZE)."""

    def job_dir(self, job_id: str) -> Path:
        return self.data_dir / "artifacts" / "jobs" / job_id

    def log(self, chars: int = 4000) -> str:
        log = self.data_dir / "serve.log"
        return log.read_text(errors="replace")[-chars:] if log.exists() else ""

    def job(self, job_id: str) -> dict[str, Any]:
        return self.client.get_job(job_id)

    def finished(self, job_id: str, timeout: float) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            job = self.job(job_id)
            return job if job["status"] in ("succeeded", "failed", "cancelled") else None

        return wait_until(done, timeout, f"job {job_id} to end", lambda: f"{self.job(job_id)}\n{self.log()}")

    def checkpoint_steps(self, job_id: str) -> list[int]:
        return [c["step"] for c in self.client.request("GET", f"/v1/jobs/{job_id}/checkpoints")["data"]]

    def events(self, job_id: str) -> list[dict[str, Any]]:
        return list(self.client.request("GET", f"/v1/jobs/{job_id}/events", params={"limit": 100})["data"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``rlhf serve`` (API, train and inference workers; SQLite database and broker) whose processes load the
    test-only sitecustomize; leases of 3 s, so a killed worker's job is recovered in seconds."""
    root = tmp_path_factory.mktemp("checkpoint-faults")
    hooks = root / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    plan = root / "hold-plan.json"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join([str(hooks), str(ROOT), os.environ.get("PYTHONPATH", "")]))
        env.setenv("RLHF_TEST_HOLD_RENAME", str(plan))
        env.setenv("RLHF_LEASE_SECONDS", "3")
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setenv("OMP_NUM_THREADS", "1")  # three processes on a small machine: no thread contention
        for name in ("RLHF_DATABASE_URL", "RLHF_BROKER_URL", "RLHF_RESULT_BACKEND_URL", "RLHF_ARTIFACTS_DIR"):
            env.delenv(name, raising=False)
        with embedded_server(root / "data", free_port()) as client:
            yield Server(client, root / "data", plan)


# --- fault 6: a non-finite loss ----------------------------------------------------------------

CHECKPOINT_EVERY = 10
PPO_STEPS = 200
# An adaptive KL controller with a one-rollout horizon multiplies β by up to 1 + 0.2·16 per step: it passes
# 1e19 after some thirty steps, the returns' squares overflow float32 and the value loss is infinite. The
# weights stay sound (they move by at most the learning rate per step): the checkpoints before are good.
REWARD_MODEL = {
    "type": "rm",
    "model": "builtin:tiny",
    "dataset": "builtin:reviews-prefs",
    "hyperparameters": {"max_steps": 2, "batch_size": 8},
}
DIVERGING_PPO = {
    "type": "ppo",
    "model": "builtin:tiny",
    "dataset": "builtin:reviews-prompts",
    "hyperparameters": {
        "total_steps": PPO_STEPS,
        "batch_size": 16,
        "mini_batch_size": 16,
        "response_length": 8,
        "learning_rate": 1e-4,
        "adaptive_kl": True,
        "kl_target": 1e-6,
        "kl_horizon": 1,
    },
    "checkpoint_every": CHECKPOINT_EVERY,
    "keep_checkpoints": 2,
}


def test_non_finite_loss_fails_the_job_and_keeps_the_last_good_checkpoint(server: Server) -> None:
    c = server.client
    rm_id = c.create_job(REWARD_MODEL)["id"]
    assert server.finished(rm_id, 120)["status"] == "succeeded"
    job_id = c.create_job({**DIVERGING_PPO, "reward_model": f"job:{rm_id}"})["id"]
    job = server.finished(job_id, 240)

    assert job["status"] == "failed", job
    assert job["error"]["code"] == "non_finite_loss", job["error"]
    failed_at = job["step"] + 1  # the last completed step is recorded; the loss of the next one was not finite
    assert f"at step {failed_at}" in job["error"]["message"], job["error"]
    assert CHECKPOINT_EVERY < job["step"] < PPO_STEPS, "the loss should diverge some tens of steps in"
    errors = [e for e in server.events(job_id) if e["kind"] == "error"]
    assert [e["data"].get("code") for e in errors] == ["non_finite_loss"], errors

    # Metrics stop at the last good step; its checkpoints stay listed, the newest one due before the failure.
    history = c.request("GET", f"/v1/jobs/{job_id}/metrics", params={"names": "loss/value"})["data"]["loss/value"]
    assert [p["step"] for p in history] == list(range(1, job["step"] + 1))
    last_good = job["step"] // CHECKPOINT_EVERY * CHECKPOINT_EVERY
    listed = c.request("GET", f"/v1/jobs/{job_id}/checkpoints")["data"]
    assert [cp["step"] for cp in listed] == [last_good - CHECKPOINT_EVERY, last_good], listed
    assert [s for s, _ in list_checkpoints(server.job_dir(job_id))] == [last_good - CHECKPOINT_EVERY, last_good]
    for model in ("policy", "value"):
        for weights in (server.data_dir / "artifacts" / listed[-1]["path"] / model).glob("*.safetensors"):
            assert all(torch.isfinite(t).all() for t in load_file(weights).values()), f"non-finite {weights}"

    # The last good checkpoint generates, on its own and as "latest".
    prompts = ["the film was", "i watched it and"]
    for checkpoint in (last_good, "latest"):
        body = {"prompts": prompts, "checkpoint": checkpoint, "max_new_tokens": 8, "seed": 1}
        out = c.request("POST", f"/v1/jobs/{job_id}/generate", json=body)
        assert out["checkpoint"] == last_good, out
        assert [x["prompt"] for x in out["completions"]] == prompts
        assert all(x["finish_reason"] in ("stop", "length") for x in out["completions"]), out


# --- fault 7: the worker killed between a checkpoint's write and its rename ------------------------

SFT_STEPS = 12
SFT = {
    "type": "sft",
    "model": "builtin:tiny",
    "dataset": "builtin:reviews-sft",
    "hyperparameters": {"max_steps": SFT_STEPS, "batch_size": 8, "learning_rate": 1e-3},
    "checkpoint_every": 4,
    "keep_checkpoints": 2,
}
HELD_STEP = 8


def hidden_entries(job_dir: Path) -> list[str]:
    return sorted(p.name for p in (job_dir / "checkpoints").iterdir() if p.name.startswith("."))


def test_worker_killed_before_a_checkpoint_rename_resumes_from_the_previous_one(server: Server) -> None:
    c = server.client
    marker = server.hold_plan.with_suffix(".held")
    job_id = c.create_job({**SFT, "name": "killed-mid-checkpoint"})["id"]
    server.hold_plan.write_text(json.dumps({"job_id": job_id, "step": HELD_STEP, "marker": str(marker)}))
    job_dir = server.job_dir(job_id)

    # The train worker wrote step 8's checkpoint into its temporary folder and holds before renaming it.
    pid = int(wait_until(lambda: marker.exists() and marker.read_text(), 120, "the held rename", server.log))
    temporary = [p for p in (job_dir / "checkpoints").iterdir() if p.name.startswith(f".step-{HELD_STEP}-")]
    assert len(temporary) == 1 and (temporary[0] / STATE_FILE).is_file(), temporary  # written in full
    assert [s for s, _ in list_checkpoints(job_dir)] == [4]
    assert server.checkpoint_steps(job_id) == [4]

    os.kill(pid, signal.SIGKILL)  # the train worker (solo pool: one process); `rlhf serve` starts another
    time.sleep(0.5)
    assert [s for s, _ in list_checkpoints(job_dir)] == [4]
    assert server.checkpoint_steps(job_id) == [4]

    job = server.finished(job_id, 180)
    assert job["status"] == "succeeded", job
    assert job["attempt"] == 2, job
    resumed = [e["data"].get("step") for e in server.events(job_id) if e["message"].startswith("resumed from")]
    assert resumed == [4], server.events(job_id)
    assert hidden_entries(job_dir) == [], "the killed worker's temporary folder was left behind"
    on_disk = [s for s, _ in list_checkpoints(job_dir)]
    assert on_disk == [8, 12] == server.checkpoint_steps(job_id)
    assert sorted(p.name for p in (job_dir / "checkpoints").iterdir()) == ["step-12", "step-8"]
    history = c.request("GET", f"/v1/jobs/{job_id}/metrics", params={"names": "loss/sft"})["data"]["loss/sft"]
    assert [p["step"] for p in history] == list(range(1, SFT_STEPS + 1))


# --- the engine killed mid-write and mid-delete ----------------------------------------------------

ENGINE_RUN = textwrap.dedent(
    """
    import json, os, shutil, sys, time
    from pathlib import Path

    import engine.core.checkpoint as checkpoint
    from engine.callbacks import Callbacks
    from engine.spec.config import JobSpec
    from engine.run import run_job

    spec, out_dir, fault, marker = json.loads(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])

    def hold() -> None:
        marker.write_text(str(os.getpid()))
        time.sleep(300)

    if fault == "mid-write":  # step 4's policy is written, its trainer state is not
        save_model = checkpoint.save_model

        def save_then_hold(model, tokenizer, path, state=None):
            save_model(model, tokenizer, path, state)
            if path.parent.name.startswith(".step-4-"):
                hold()

        checkpoint.save_model = save_then_hold
    elif fault == "mid-delete":  # deleting an old checkpoint: its weights are gone, the rest is not yet
        rmtree = shutil.rmtree

        def half_rmtree(path, *args, **kwargs):
            for weights in sorted(Path(path).rglob("*.safetensors")):
                weights.unlink()
                hold()
            return rmtree(path, *args, **kwargs)

        shutil.rmtree = half_rmtree

    class Report(Callbacks):
        def on_start(self, start_step, total_steps):
            print(json.dumps({"start": start_step}), flush=True)

    result = run_job(JobSpec.model_validate(spec), out_dir, Report())
    print(json.dumps({"status": result.status, "step": result.step}), flush=True)
    """
)
ENGINE_SFT = {**SFT, "hyperparameters": {**SFT["hyperparameters"], "max_steps": 6}, "checkpoint_every": 2,
              "keep_checkpoints": 1}  # fmt: skip


def run_engine(out_dir: Path, fault: str, marker: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", ENGINE_RUN, json.dumps(ENGINE_SFT), str(out_dir), fault, str(marker)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


def kill_group(process: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


@pytest.mark.parametrize(("fault", "complete_at_kill"), [("mid-write", [2]), ("mid-delete", [4])])
def test_engine_killed_mid_checkpoint_resumes_from_the_newest_complete_one(
    fault: str, complete_at_kill: list[int], tmp_path: Path
) -> None:
    out_dir, marker = tmp_path / "job", tmp_path / "held"
    process = run_engine(out_dir, fault, marker)

    def held() -> bool:
        if process.poll() is not None:  # ended without reaching the hold
            raise AssertionError(f"the run ended before the {fault} hold:\n{process.communicate()[0]}")
        return marker.exists()

    try:
        wait_until(held, 120, f"the {fault} hold")
    finally:
        kill_group(process)
    listed = list_checkpoints(out_dir)
    assert [s for s, _ in listed] == complete_at_kill
    assert all((path / STATE_FILE).is_file() and any((path / "policy").glob("*.safetensors")) for _, path in listed)

    process = run_engine(out_dir, "none", marker)
    try:
        output, _ = process.communicate(timeout=120)
    finally:
        kill_group(process)
    assert process.returncode == 0, output
    reports = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert reports[0] == {"start": complete_at_kill[-1]}, output
    assert reports[-1] == {"status": "succeeded", "step": 6}, output
    assert hidden_entries(out_dir) == [], "leftovers of the killed run remain"
    assert [s for s, _ in list_checkpoints(out_dir)] == [6]
    assert sorted(p.name for p in (out_dir / "checkpoints").iterdir()) == ["step-6"]

"""Experiment tracking (engine/tracking.py): a job's metrics reach TensorBoard, MLflow and W&B, read back with each
tool's own reader (tests/trackers.py); a resumed job continues its runs; a tracker that fails or hangs costs the
job one warning, never the job; ``rlhf train`` writes metrics.jsonl, and appends to it when it resumes."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.callbacks import VllmSettings
from engine.core.checkpoint import JOB_FILE, list_checkpoints
from engine.rewards.judge import Endpoint
from engine.run import run_job
from engine.spec.config import JobSpec
from engine.tracking import BACKENDS, MetricsFile, Tracker, TrackingOptions, switched_on
from tests.engine.helpers import CPU, make_spec
from tests.helpers import free_port
from tests.recorder import Recorder
from tests.trackers import (
    float32,
    mlflow_run_id,
    mlflow_series,
    mlflow_store,
    quiet_wandb,
    recorded,
    require_trackers,
    tensorboard_series,
    wandb_history,
    wandb_run,
    wandb_run_files,
)

ALL = BACKENDS
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def trackers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_trackers()
    quiet_wandb(monkeypatch, tmp_path / "wandb-home")


def sft(**fields: Any) -> JobSpec:
    return make_spec("sft", hyperparameters={"max_steps": 4, "batch_size": 8}, checkpoint_every=2, **fields)


def tracked(
    spec: JobSpec, out: Path, options: TrackingOptions, recorder: Recorder | None = None, close_timeout_s: float = 30
) -> Recorder:
    """Run ``spec`` in ``out`` with the trackers of ``options``, as the worker and ``rlhf train`` do."""
    recorder = recorder or Recorder()
    tracker = Tracker(recorder, spec, out, options)
    status = "failed"
    try:
        status = run_job(spec, out, tracker, device=CPU).status
    finally:
        tracker.close(status, timeout_s=close_timeout_s)
    return recorder


def test_switched_on_by_the_spec_or_the_server() -> None:
    assert switched_on(sft()) == ()
    assert switched_on(sft(tracking={"wandb": True, "tensorboard": True})) == ("tensorboard", "wandb")
    assert switched_on(sft(tracking={"mlflow": True}), ["tensorboard"]) == ("tensorboard", "mlflow")


def test_every_metric_reaches_tensorboard_mlflow_and_wandb(tmp_path: Path) -> None:
    out = tmp_path / "job"
    spec = sft(name="tracked sft")
    recorder = tracked(spec, out, TrackingOptions(ALL, run_name="job_tracked"))
    metrics = recorder.metrics
    assert sorted(metrics) == [1, 2, 3, 4] and recorder.warnings() == []
    names = set(metrics[1])
    assert "loss/sft" in names

    # TensorBoard: a scalar per metric, at float32 precision
    board = tensorboard_series(out / "tensorboard")
    assert set(board) == names
    for name in names:
        assert board[name] == float32(recorded(metrics, name)), name

    # MLflow: one finished run in the job folder's store, the spec as params
    from mlflow import MlflowClient

    store, run_id = mlflow_store(out), mlflow_run_id(out)
    for name in names:
        assert mlflow_series(store, run_id, name) == recorded(metrics, name), name
    run = MlflowClient(store).get_run(run_id)
    assert (run.info.run_name, run.info.status) == ("job_tracked", "FINISHED")
    assert run.data.params["hyperparameters.max_steps"] == "4"
    assert run.data.params["hyperparameters.learning_rate"] == "0.001"
    assert run.data.params["model"] == "builtin:tiny" and run.data.params["name"] == "tracked sft"

    # W&B: one offline run, the spec as its config
    (run_file,) = wandb_run_files(out)
    history = wandb_history([run_file])
    assert set(history) == names
    for name in names:
        assert history[name] == recorded(metrics, name), name
    record = wandb_run(run_file)
    assert record.display_name == "job_tracked" and record.project == "rlhf-server"
    config = {item.key: json.loads(item.value_json) for item in record.config.update}
    assert config["hyperparameters"]["max_steps"] == 4 and config["model"] == "builtin:tiny"


def test_a_resumed_job_continues_its_runs(tmp_path: Path) -> None:
    out, spec, options = tmp_path / "job", sft(), TrackingOptions(ALL, run_name="job_resumed")
    first = tracked(spec, out, options, Recorder(stop_after=2, stop="pause"))
    assert sorted(first.metrics) == [1, 2]
    runs = json.loads((out / "tracking.json").read_text())
    # an attempt that got past its checkpoint before it was lost: steps 3 and 4 reported, then computed again
    lost = Tracker(Recorder(), spec, out, options)
    lost.on_start(2, 4)
    for step in (3, 4):
        lost.on_metrics(step, {"loss/sft": 100.0 + step})
    lost.close("failed")
    second = tracked(spec, out, options)
    assert second.starts == [(2, 4)] and sorted(second.metrics) == [3, 4]
    metrics = {**first.metrics, **second.metrics}

    assert json.loads((out / "tracking.json").read_text()) == runs  # the same MLflow run, the same W&B run
    assert tensorboard_series(out / "tensorboard")["loss/sft"] == float32(recorded(metrics, "loss/sft"))
    store, run_id = mlflow_store(out), runs["mlflow"]["run_id"]
    from mlflow import MlflowClient

    (only,) = MlflowClient(store).search_runs([MlflowClient(store).get_run(run_id).info.experiment_id])
    assert only.info.run_id == run_id and only.info.status == "FINISHED"
    assert mlflow_series(store, run_id, "lr") == recorded(metrics, "lr")
    # MLflow keeps every point it was sent: the lost attempt's steps 3 and 4 too, besides the ones that count
    lost_points = [(3, 103.0), (4, 104.0)]
    assert mlflow_series(store, run_id, "loss/sft") == sorted(recorded(metrics, "loss/sft") + lost_points)
    files = wandb_run_files(out)
    assert len(files) == 3 and {wandb_run(f).run_id for f in files} == {runs["wandb"]["run_id"]}
    assert wandb_history([files[0], files[2]])["loss/sft"] == recorded(metrics, "loss/sft")


def test_a_tracker_that_fails_costs_one_warning_not_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    monkeypatch.setitem(sys.modules, "wandb", None)  # W&B not installed on this worker
    out = tmp_path / "job"
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    options = TrackingOptions(ALL, run_name="job_failing", mlflow_tracking_uri=closed)
    recorder = tracked(sft(), out, options)

    assert sorted(recorder.metrics) == [1, 2, 3, 4]
    assert (out / JOB_FILE).is_file()  # succeeded
    warnings = [(message, data) for kind, message, data in recorder.events if kind == "warning"]
    assert len(warnings) == 2, warnings
    by_tracker = {data["tracker"]: message for message, data in warnings if data}
    assert by_tracker["mlflow"].startswith("tracking with mlflow: ")
    assert by_tracker["mlflow"].endswith("; no more metrics go to it")
    assert "pip install 'rlhf-server[tracking]'" in by_tracker["wandb"]
    # the others go on
    assert tensorboard_series(out / "tensorboard")["loss/sft"] == float32(recorded(recorder.metrics, "loss/sft"))


def test_a_tracker_that_hangs_does_not_hold_the_job_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
    with socket.create_server(("127.0.0.1", 0)) as silent:  # takes connections, never answers
        options = TrackingOptions(("mlflow",), run_name="job_hanging",
                                  mlflow_tracking_uri=f"http://127.0.0.1:{silent.getsockname()[1]}")  # fmt: skip
        started = time.monotonic()
        recorder = tracked(sft(), tmp_path / "job", options, close_timeout_s=1)
        took = time.monotonic() - started
    assert sorted(recorder.metrics) == [1, 2, 3, 4]
    assert recorder.warnings() == ["tracking with mlflow: still writing after 1 s; the job ends without waiting"]
    assert took < 50, took  # the request alone would have taken 60 s


# --- rlhf train -------------------------------------------------------------------------------------


def rlhf_train(
    spec_file: Path, out: Path, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``rlhf train`` (``python -m jobs.cli``) of this checkout, in a process of its own."""
    command = [sys.executable, "-m", "jobs.cli", "train", str(spec_file), "--out", str(out)]
    env = {**(os.environ if env is None else env), "PYTHONPATH": str(ROOT)}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_the_trackers_write_nothing_outside_the_job_and_report_nothing(tmp_path: Path) -> None:
    # As a user's shell has it: a home of its own, none of W&B's or MLflow's variables, and none of the CI and
    # pytest variables by which MLflow switches its telemetry off by itself.
    home = tmp_path / "home"
    home.mkdir()
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("WANDB_", "MLFLOW_", "XDG_")) and name not in ("CI", "PYTEST_CURRENT_TEST")
    }
    env["HOME"] = str(home)
    spec = {
        "type": "sft",
        "model": "builtin:tiny",
        "dataset": "builtin:reviews-sft",
        "hyperparameters": {"max_steps": 2, "batch_size": 8},
        "tracking": {"mlflow": True, "wandb": True},
    }
    spec_file, out = tmp_path / "spec.yaml", tmp_path / "job"
    spec_file.write_text(yaml.safe_dump(spec))
    proc = rlhf_train(spec_file, out, tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "tracking with" not in proc.stderr + proc.stdout  # both trackers wrote their runs
    assert mlflow_run_id(out) and wandb_run_files(out)
    # today MLflow leaves ~/.config/mlflow/telemetry.json and W&B ~/.cache/wandb/logs/core-debug-*.log
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == []


def test_no_wandb_service_outlives_the_job(tmp_path: Path) -> None:
    tracked(sft(), tmp_path / "job", TrackingOptions(("wandb",), run_name="job_service"))
    assert wandb_run_files(tmp_path / "job")
    assert [pid for pid in child_processes() if "wandb-core" in command_line(pid)] == []


def child_processes() -> list[int]:
    """The ids of this process's living children (from /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            children.append(int(stat.parent.name))
    return children


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_rlhf_train_writes_metrics_jsonl_and_the_trackers_into_its_folder(tmp_path: Path) -> None:
    spec = {
        "type": "sft",
        "model": "builtin:tiny",
        "dataset": "builtin:reviews-sft",
        "hyperparameters": {"max_steps": 4, "batch_size": 8},
        "checkpoint_every": 2,
        "tracking": {"tensorboard": True, "mlflow": True, "wandb": True},
    }
    spec_file, out = tmp_path / "spec.yaml", tmp_path / "job"
    spec_file.write_text(yaml.safe_dump(spec))
    proc = rlhf_train(spec_file, out, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "tracking with" not in proc.stderr + proc.stdout  # no tracker failed

    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all(set(row) == {"step", "metrics"} and "loss/sft" in row["metrics"] for row in rows)
    loss = [(row["step"], row["metrics"]["loss/sft"]) for row in rows]
    assert tensorboard_series(out / "tensorboard")["loss/sft"] == float32(loss)
    assert mlflow_series(mlflow_store(out), mlflow_run_id(out), "loss/sft") == loss
    assert wandb_history(wandb_run_files(out))["loss/sft"] == loss

    # Interrupted after step 4 was reported, before its checkpoint, amid a line: the run resumes from step 2, and
    # the file keeps steps 1 and 2 as they were and gets 3 and 4 appended again.
    assert [step for step, _ in list_checkpoints(out)] == [2, 4]
    shutil.rmtree(out / "checkpoints" / "step-4")
    (out / JOB_FILE).unlink()
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "metr')
    proc = rlhf_train(spec_file, out, tmp_path)
    assert proc.returncode == 0, proc.stderr
    again = (out / "metrics.jsonl").read_text().splitlines()
    assert again[:2] == lines[:2]
    assert [json.loads(line)["step"] for line in again] == [1, 2, 3, 4]
    assert [step for step, _ in tensorboard_series(out / "tensorboard")["loss/sft"]] == [1, 2, 3, 4]


def test_wrapped_callbacks_still_offer_the_runners_judges_and_vllm(tmp_path: Path) -> None:
    """A tracking wrapper passes on what the runner offers a job (a grader's judge, the vLLM to sample on), not
    only what the job reports: without it a tracked job would lose them."""

    class Offering(Recorder):
        def judge(self, model: str) -> Endpoint | None:
            return Endpoint(url="http://127.0.0.1:9/v1", model=model) if model == "judge-small" else None

    settings = VllmSettings(url="http://127.0.0.1:8000")
    wrapped = MetricsFile(Offering(vllm=settings), tmp_path / "metrics.jsonl")
    assert wrapped.vllm() == settings
    judge = wrapped.judge("judge-small")
    assert judge is not None and judge.model == "judge-small" and wrapped.judge("other") is None

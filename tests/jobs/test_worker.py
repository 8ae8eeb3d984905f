"""End to end through Celery: a real worker process on the embedded SQLite broker and on Redis runs a
job sent by task name, serves generate requests from the inference queue, and recovers at start the
jobs a lost worker left behind."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import huggingface_hub
import pytest
import redis
from huggingface_hub import constants as hub_constants

from jobs.celery_app import GENERATE_TASK, RUN_JOB_TASK, make_celery
from jobs.store import crud, db
from jobs.store.settings import Settings
from jobs.worker import keep_off_the_hub, worker_argv
from tests.factories import create_job, make_settings, new_project
from tests.jobs.helpers import LEASE_SECONDS, REDIS_URL, events, get_job, sft_spec
from tests.services import unavailable

ROOT = Path(__file__).resolve().parents[2]
MISSING_JOB = "job_000000000000"
"""A job id no row has: the worker logs that it is missing, which tells the test the messages before it are done."""
# kombu's SQLAlchemy transport still uses a loader option SQLAlchemy 2.1 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")


@contextmanager
def worker_process(settings: Settings, log_file: Path, queues: str = "train,inference", **variables: str
                   ) -> Iterator[subprocess.Popen[bytes]]:  # fmt: skip
    """``python -m jobs.worker`` on ``queues``, configured through RLHF_* variables only (more in ``variables``)."""
    env = {
        **os.environ,
        "RLHF_DATA_DIR": str(settings.data_dir),
        "RLHF_DATABASE_URL": settings.resolved_database_url,
        "RLHF_LEASE_SECONDS": str(settings.lease_seconds),
        "HF_HUB_OFFLINE": "1",
        **variables,
    }
    if settings.broker_url:
        env["RLHF_BROKER_URL"] = settings.broker_url
    with log_file.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "jobs.worker", "--queues", queues, "--loglevel", "INFO"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            yield process
        finally:
            process.send_signal(signal.SIGTERM)  # warm shutdown
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_for_status(settings: Settings, job_id: str, statuses: set[str], process: subprocess.Popen[bytes],
                    log_file: Path, timeout: float = 90) -> str:  # fmt: skip
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = get_job(settings, job_id).status
        if status in statuses:
            return status
        assert process.poll() is None, f"the worker exited:\n{log_file.read_text()[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} is {status} after {timeout} s; worker log:\n{log_file.read_text()[-3000:]}")


def exercise_worker(settings: Settings, tmp_path: Path) -> None:
    """A job left running by a dead worker is recovered at start; a job sent by name succeeds; generate
    answers through the inference queue."""
    project_id = new_project(settings).id
    orphan = create_job(settings, project_id, sft_spec(hyperparameters={"max_steps": 2}))
    with db.session_scope(settings.resolved_database_url) as session:
        assert crud.claim_job(session, job_id=orphan, worker="dead:1", lease_seconds=-1)
    job_id = create_job(settings, project_id, sft_spec())
    # Committed queued, its message never sent (an API killed between the two): the worker's start sweep sends it.
    unsent = create_job(settings, project_id, sft_spec(hyperparameters={"max_steps": 2}))
    # Every `rlhf` process creates the data folder first (the embedded broker and result store live there);
    # this client stands in for one, and must not race the worker starting up to create it.
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    client = make_celery(settings)
    log_file = tmp_path / "worker.log"

    with worker_process(settings, log_file) as process:
        client.send_task(RUN_JOB_TASK, args=[job_id])
        assert wait_for_status(settings, job_id, {"succeeded", "failed"}, process, log_file) == "succeeded"
        result = client.send_task(
            GENERATE_TASK, kwargs={"job_id": job_id, "step": None, "prompts": ["The food was"], "max_new_tokens": 6}
        )
        out = result.get(timeout=60)
        assert wait_for_status(settings, orphan, {"succeeded", "failed"}, process, log_file) == "succeeded"
        assert wait_for_status(settings, unsent, {"succeeded", "failed"}, process, log_file) == "succeeded"
        client.send_task(RUN_JOB_TASK, args=[unsent])  # a duplicate message, late: a no-op
        client.send_task(RUN_JOB_TASK, args=[orphan])
        client.send_task(RUN_JOB_TASK, args=[MISSING_JOB])  # consumed after both duplicates
        deadline = time.monotonic() + 30
        while f"job {MISSING_JOB} is missing" not in log_file.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)

    assert out["checkpoint"] == 4
    assert [c["prompt"] for c in out["completions"]] == ["The food was"]
    assert out["completions"][0]["finish_reason"] in ("stop", "length")
    job = get_job(settings, job_id)
    assert (job.step, job.output_step, job.worker) == (4, 4, None)
    assert get_job(settings, orphan).attempt == 2
    folder = settings.resolved_artifacts_dir / "jobs" / job_id  # spec.json, checkpoints: owner-only
    modes = {path: path.stat().st_mode & 0o777 for path in [folder, *folder.rglob("*")]}
    assert (folder / "spec.json") in modes and any(path.suffix == ".safetensors" for path in modes)
    assert {path: mode for path, mode in modes.items() if mode != (0o700 if path.is_dir() else 0o600)} == {}
    for ran_once in (job_id, unsent, orphan):  # job_id had two messages: the test's and the start sweep's
        runs = [e for e in events(settings, ran_once) if e.message.startswith("running on")]
        assert (get_job(settings, ran_once).status, len(runs)) == ("succeeded", 1)
    client.close()


def test_embedded_sqlite_broker(sqlite_url: str, tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "data", sqlite_url, lease_seconds=LEASE_SECONDS)
    assert settings.resolved_broker_url.startswith("sqla+sqlite://")
    exercise_worker(settings, tmp_path)


def test_redis_broker_and_postgresql(postgresql_url: str, tmp_path: Path) -> None:
    try:
        connection = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
        connection.flushdb()
    except redis.ConnectionError as e:
        unavailable("Redis", e)
    settings = make_settings(tmp_path / "data", postgresql_url, lease_seconds=LEASE_SECONDS, broker_url=REDIS_URL)
    try:
        exercise_worker(settings, tmp_path)
    finally:
        connection.flushdb()
        connection.close()


def test_worker_arguments() -> None:
    argv = worker_argv(["train"])
    assert argv[0] == "worker" and "--pool=solo" in argv and "--queues=train" in argv
    assert "--pool=threads" in worker_argv(["inference"], concurrency=4)
    with pytest.raises(ValueError, match="one job at a time"):
        worker_argv(["train", "inference"], concurrency=2)
    assert "--queues=train-a100" in worker_argv(["train-a100"])  # a train queue of one's own
    with pytest.raises(ValueError, match="one job at a time"):
        worker_argv(["train-a100"], concurrency=2)
    with pytest.raises(ValueError, match="queues"):
        worker_argv(["GPU queue"])
    with pytest.raises(ValueError, match="queues"):
        worker_argv([])


@pytest.mark.parametrize("hub_downloads", [False, True])
def test_a_worker_downloads_from_the_hub_only_when_allowed(
    monkeypatch: pytest.MonkeyPatch, hub_downloads: bool
) -> None:
    # huggingface_hub is imported already (transformers, at the top of jobs/worker.py): the variable is for the
    # processes the worker starts (torchrun), the constant for this one.
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    keep_off_the_hub(Settings(hub_downloads=hub_downloads))
    assert huggingface_hub.is_offline_mode() is not hub_downloads
    assert os.environ.get("HF_HUB_OFFLINE") == (None if hub_downloads else "1")

"""What the fault tests run and check with: :class:`Backend` (the embedded default, or PostgreSQL + Redis)
and the environment of its processes, :class:`Processes` (``rlhf`` commands as real processes, each in its own
process group), the PPO job of the fault tests and the fault-free :class:`Reference` its outcome is checked
against, readers of the database, and waits on jobs and workers. The fixtures are in tests/faults/conftest.py.
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import redis
import torch
from safetensors.torch import load_file
from sqlalchemy import func, select

from jobs.celery_app import RUN_JOB_TASK, make_celery, send_job
from jobs.store import crud, db, migrate, refs
from jobs.store.models import Event, Job, Metric
from jobs.store.settings import Settings
from tests.engine.helpers import Pretrained
from tests.factories import create_job, make_settings, new_project
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]
REDIS_URL = "redis://127.0.0.1:6379/13"
REDIS_START = [
    "redis-server", "--daemonize", "yes", "--bind", "127.0.0.1", "-::1", "--port", "6379", "--save", "",
    "--appendonly", "no", "--dir", "/var/lib/redis", "--logfile", "/var/log/redis/ci.log",
]  # fmt: skip
LEASE_SECONDS = 3
TORCH_THREADS = 1
"""Per process: two workers on two cores (and other tests beside them) do not oversubscribe the CPU."""
MAX_ATTEMPTS = 2
PPO_STEPS = 12
CHECKPOINT_EVERY = 4
PPO_HYPERPARAMETERS = {
    "total_steps": PPO_STEPS,
    "batch_size": 16,
    "mini_batch_size": 8,
    "ppo_epochs": 2,
    "response_length": 12,
    "learning_rate": 1e-4,
}
# kombu's SQLAlchemy transport still uses a loader option SQLAlchemy 2.1 deprecates (test modules: pytestmark).
KOMBU_SQLA_WARNING = "ignore:The ``noload`` loader strategy is deprecated"
FINAL = ("succeeded", "failed", "cancelled")
HOST = socket.gethostname()
"""The host part of a job's ``worker`` column (``host:pid``)."""


# --- services ----------------------------------------------------------------------------------


def redis_client() -> redis.Redis:
    return redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)


def ensure_redis(timeout: float = 20) -> None:
    """Start the Redis server (as CI does) unless it answers; wait until it does."""
    connection = redis_client()
    try:
        if pings(connection):
            return
        subprocess.run(REDIS_START, check=True, capture_output=True, timeout=10)
        wait_until(lambda: pings(connection), timeout, "Redis to answer after its start")
    finally:
        connection.close()


def restart_redis() -> None:
    """Stop the real Redis server (it keeps nothing on disk) and start it again, as CI starts it."""
    connection = redis_client()
    try:
        subprocess.run(["redis-cli", "-p", "6379", "shutdown", "nosave"], capture_output=True, timeout=10)
        wait_until(lambda: not pings(connection), 10, "Redis to stop")
    finally:
        connection.close()
    ensure_redis()


def pings(connection: redis.Redis) -> bool:
    try:
        return bool(connection.ping())
    except redis.ConnectionError:
        return False


# --- backends ----------------------------------------------------------------------------------


@dataclass
class Backend:
    """Where a test's service keeps its state; :meth:`env` configures a process for it."""

    name: str
    settings: Settings

    @property
    def url(self) -> str:
        return self.settings.resolved_database_url

    def env(self) -> dict[str, str]:
        """The environment of a process of this service: its RLHF_* settings only, the rest inherited."""
        env = {
            **{key: value for key, value in os.environ.items() if not key.startswith("RLHF_")},
            "RLHF_DATA_DIR": str(self.settings.data_dir),
            "RLHF_LEASE_SECONDS": str(self.settings.lease_seconds),
            "RLHF_MAX_ATTEMPTS": str(self.settings.max_attempts),
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": str(TORCH_THREADS),
        }
        if self.settings.database_url:
            env["RLHF_DATABASE_URL"] = self.settings.database_url
        if self.settings.broker_url:
            env["RLHF_BROKER_URL"] = self.settings.broker_url
        return env

    def send(self, job_id: str) -> None:
        """Send the job to the train queue by task name, as the API does."""
        app = make_celery(self.settings)
        try:
            app.send_task(RUN_JOB_TASK, args=[job_id])
        finally:
            app.close()


def make_backend(name: str, data_dir: Path, database_url: str | None = None, broker_url: str | None = None) -> Backend:
    data_dir.mkdir(parents=True, exist_ok=True)
    settings = make_settings(
        data_dir, database_url, broker_url=broker_url, lease_seconds=LEASE_SECONDS, max_attempts=MAX_ATTEMPTS
    )
    if database_url is None:
        migrate.upgrade(settings.resolved_database_url)
    return Backend(name, settings)


# --- the PPO job -------------------------------------------------------------------------------


def ppo_spec(model: str, reward_model: str) -> dict[str, Any]:
    return {
        "type": "ppo",
        "model": model,
        "reward_model": reward_model,
        "dataset": "builtin:reviews-prompts",
        "hyperparameters": PPO_HYPERPARAMETERS,
        "seed": 0,
        "checkpoint_every": CHECKPOINT_EVERY,
        "keep_checkpoints": 2,
    }


def succeeded_job(backend: Backend, project_id: str, job_type: str, folder: Path) -> str:
    """A succeeded job row of ``job_type`` whose folder is a copy of ``folder``."""
    spec = {"type": job_type, "model": "builtin:tiny", "dataset": "builtin:reviews-sft"}
    with db.session_scope(backend.url) as session:
        job, _ = crud.create_job(session, project_id=project_id, spec=spec, idempotency_key=None)
        job_id = job.id
        assert crud.transition(session, job_id=job_id, from_statuses=("queued",), to="succeeded")
    shutil.copytree(folder, refs.job_dir(backend.settings.resolved_artifacts_dir, job_id))
    return job_id


def pretrained_jobs(backend: Backend, pretrained: Pretrained, project_id: str) -> dict[str, Any]:
    """The PPO job's spec on ``job:`` references to succeeded SFT and RM jobs of the project."""
    sft = succeeded_job(backend, project_id, "sft", pretrained.sft)
    rm = succeeded_job(backend, project_id, "rm", pretrained.rm)
    return ppo_spec(f"job:{sft}", f"job:{rm}")


def create_ppo_job(backend: Backend, pretrained: Pretrained) -> str:
    """A queued PPO job, stored as the API does (spec validated, defaults filled in); not sent yet."""
    project_id = new_project(backend.settings, "faults").id
    return create_job(backend.settings, project_id, pretrained_jobs(backend, pretrained, project_id))


@dataclass
class Reference:
    """The PPO job run once, in this process, without any fault."""

    out_dir: Path
    metrics: dict[int, dict[str, float]]


def final_weights(job_dir: Path) -> dict[str, dict[str, Any]]:
    """The safetensors of the newest checkpoint's ``policy/`` and ``value/``, by model and file."""
    steps = sorted(int(p.name.removeprefix("step-")) for p in (job_dir / "checkpoints").glob("step-*"))
    assert steps and steps[-1] == PPO_STEPS, f"final checkpoint missing in {job_dir}: {steps}"
    last = job_dir / "checkpoints" / f"step-{steps[-1]}"
    weights = {}
    for model in ("policy", "value"):
        files = sorted((last / model).glob("*.safetensors"))
        assert files, f"no safetensors in {last / model}"
        weights[model] = {f.name: load_file(f) for f in files}
    return weights


def assert_same_weights(job_dir: Path, reference: Reference) -> None:
    got, expected = final_weights(job_dir), final_weights(reference.out_dir)
    for model in expected:
        assert got[model].keys() == expected[model].keys(), f"{model}: other safetensors files"
        for name, tensors in expected[model].items():
            assert got[model][name].keys() == tensors.keys(), f"{model}/{name}: other tensors"
            different = [k for k in tensors if not torch.equal(got[model][name][k], tensors[k])]
            assert not different, f"{model}/{name}: {len(different)} tensors differ from the run without faults"


TIMING = ("time/", "throughput/")


def assert_metrics_match(backend: Backend, job_id: str, reference: Reference) -> None:
    """Every step once, for every metric name, with the fault-free run's values (timings aside)."""
    rows = metric_rows(backend, job_id)
    per_step = Counter(step for _, step, _ in rows)
    names = set(reference.metrics[1])
    assert sorted(per_step) == list(range(1, PPO_STEPS + 1)), f"steps recorded: {sorted(per_step)}"
    uneven = {step: n for step, n in per_step.items() if n != len(names)}
    assert not uneven, f"metric rows per step, expected {len(names)} each: {uneven}"
    different = {
        (name, step): (value, reference.metrics[step][name])
        for name, step, value in rows
        if not name.startswith(TIMING) and value != reference.metrics[step][name]
    }
    assert not different, f"metrics differ from the run without faults (got, expected): {different}"


# --- reading the database ----------------------------------------------------------------------


def get_job(backend: Backend, job_id: str) -> Job:
    with db.session_scope(backend.url) as session:
        job = crud.get_job(session, job_id=job_id)
        assert job is not None, f"job {job_id} is gone"
        return job


def events(backend: Backend, job_id: str) -> list[Event]:
    with db.session_scope(backend.url) as session:
        rows, _ = crud.list_events(session, job_id=job_id, after=None, limit=10_000)
        return rows


def messages(backend: Backend, job_id: str, kind: str) -> list[str]:
    """The messages of the job's events of ``kind`` (``status``: the statuses it went through)."""
    return [e.message for e in events(backend, job_id) if e.kind == kind]


def claims(backend: Backend, job_id: str) -> list[str]:
    """``running on HOST:PID, attempt N``, once per run of the job."""
    return [m for m in messages(backend, job_id, "info") if m.startswith("running on")]


def describe_events(backend: Backend, job_id: str) -> str:
    return "\n".join(f"  {e.kind}: {e.message}" for e in events(backend, job_id))


def metric_rows(backend: Backend, job_id: str) -> list[tuple[str, int, float]]:
    with db.session_scope(backend.url) as session:
        stmt = select(Metric.name, Metric.step, Metric.value).where(Metric.job_id == job_id)
        return [(name, step, value) for name, step, value in session.execute(stmt)]


def metrics_recorded_before(backend: Backend, job_id: str, *, after_step: int, moment: datetime) -> int:
    """How many metric rows of steps after ``after_step`` were written before ``moment``."""
    stmt = select(func.count()).where(Metric.job_id == job_id, Metric.step > after_step, Metric.created_at < moment)
    with db.session_scope(backend.url) as session:
        return int(session.scalar(stmt) or 0)


def checkpoint_steps(backend: Backend, job_id: str) -> list[int]:
    with db.session_scope(backend.url) as session:
        return [c.step for c in crud.list_checkpoints(session, job_id=job_id)]


def job_dir(backend: Backend, job_id: str) -> Path:
    return refs.job_dir(backend.settings.resolved_artifacts_dir, job_id)


# --- processes ---------------------------------------------------------------------------------


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, chars: int = 3000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"--- {self.name} (pid {self.pid}, {self.log}) ---\n{text[-chars:]}"

    def signal(self, sig: int) -> None:
        """``sig`` to the process alone (its children, if any, are its business)."""
        if self.alive():
            os.kill(self.pid, sig)

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait()


@dataclass
class Processes:
    """``rlhf`` commands as real processes, each in its own process group; every group is killed at the end."""

    log_dir: Path
    started: list[Process] = field(default_factory=list)

    def start(self, backend: Backend, name: str, *args: str) -> Process:
        log = self.log_dir / f"{name}-{len(self.started)}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", "jobs.cli", *args],
                cwd=ROOT, env=backend.env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        process = Process(name, popen, log)
        self.started.append(process)
        return process

    def worker(self, backend: Backend) -> Process:
        """``rlhf worker --queues train``."""
        return self.start(backend, "worker", "worker", "--queues", "train")

    def by_lease(self, worker: str | None) -> Process | None:
        """The process named by a job's ``worker`` column (``host:pid``)."""
        if worker is None:
            return None
        pid = int(worker.rsplit(":", 1)[1])
        return next((p for p in self.started if p.pid == pid), None)

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.started)

    def close(self) -> None:
        for process in self.started:
            process.kill_group()


def wait_for_step(backend: Backend, job_id: str, step: int, processes: Processes) -> Job:
    """Until the job runs at ``step`` or later; fails if it ends first."""

    def reached() -> Job | None:
        job = get_job(backend, job_id)
        assert job.status not in FINAL, f"the job ended {job.status} before step {step} was seen"
        return job if job.status == "running" and job.step >= step else None

    return wait_until(reached, 120, f"the job to reach step {step}", processes.logs)


def wait_finished(backend: Backend, job_id: str, processes: Processes) -> Job:
    wait_until(lambda: get_job(backend, job_id).status in FINAL, 120, "the job to finish", processes.logs)
    return get_job(backend, job_id)


def wait_ready(process: Process, timeout: float = 60) -> None:
    """Until the Celery worker logs that it is ready."""

    def ready() -> bool:
        assert process.alive(), f"the worker exited before it was ready\n{process.tail()}"
        return " ready." in process.log.read_text(errors="replace")

    wait_until(ready, timeout, f"{process.name} {process.pid} to be ready", process.tail)


# --- scale-out: train queues and short SFT jobs -------------------------------------------------


def queue_worker(processes: Processes, backend: Backend, queue: str) -> Process:
    """``rlhf worker --queues <queue>``: a train worker of that queue, its log named after it."""
    return processes.start(backend, f"worker-{queue}", "worker", "--queues", queue)


def send_to(backend: Backend, job_id: str, queue: str) -> None:
    """Send the job to ``queue`` as the API does for a spec's ``resources.queue``."""
    app = make_celery(backend.settings)
    try:
        send_job(app, job_id, queue)
    finally:
        app.close()

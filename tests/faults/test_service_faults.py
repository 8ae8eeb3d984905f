"""The services around a training job fail (issue 4, faults 2 and 3): Redis restarts and PostgreSQL drops
every connection while a real train worker runs a PPO job, and ``rlhf serve`` is stopped with Ctrl-C and
started again. The job finishes each time, every step recorded once, with the weights of a run without
faults."""

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from jobs import runner
from jobs.client import KEY_FILE, Client
from jobs.store import crud, db
from jobs.store.bootstrap import DEFAULT_PROJECT
from tests.engine.helpers import Pretrained
from tests.factories import create_job, new_project
from tests.faults.helpers import (
    FINAL,
    HOST,
    KOMBU_SQLA_WARNING,
    PPO_STEPS,
    Backend,
    Process,
    Processes,
    Reference,
    assert_metrics_match,
    assert_same_weights,
    claims,
    create_ppo_job,
    describe_events,
    events,
    get_job,
    job_dir,
    make_backend,
    pretrained_jobs,
    restart_redis,
    wait_finished,
    wait_for_step,
    wait_ready,
)
from tests.helpers import free_port, wait_until
from tests.services import PG_ADMIN_URL

pytestmark = pytest.mark.filterwarnings(KOMBU_SQLA_WARNING)


def assert_ran_once_and_right(backend: Backend, job_id: str, reference: Reference) -> None:
    job = get_job(backend, job_id)
    history = describe_events(backend, job_id)
    assert (job.status, job.step, job.attempt) == ("succeeded", PPO_STEPS, 1), history
    assert_metrics_match(backend, job_id, reference)
    assert_same_weights(job_dir(backend, job_id), reference)


# --- fault 3: Redis and PostgreSQL --------------------------------------------------------------


def test_redis_restart_while_a_job_trains(
    pg_backend: Backend, processes: Processes, pretrained: Pretrained, reference_run: Reference
) -> None:
    """Fault 3: the Redis server restarts (losing everything) while the worker trains; the job finishes,
    the worker reconnects and goes on consuming, and nothing runs twice."""
    job_id = create_ppo_job(pg_backend, pretrained)
    worker = processes.worker(pg_backend)
    wait_ready(worker)
    pg_backend.send(job_id)
    wait_for_step(pg_backend, job_id, 1, processes)

    restart_redis()
    during = get_job(pg_backend, job_id)
    assert (during.status, during.attempt) == ("running", 1), "the job ended before Redis was back"
    # With acks_late a lost connection can deliver the task again: send the duplicate it would be. The
    # worker, reconnected, takes it once the job is over, and the claim guard makes it a no-op.
    pg_backend.send(job_id)

    wait_finished(pg_backend, job_id, processes)
    no_op = f"job {job_id} is succeeded, not queued: nothing to do"
    wait_until(lambda: no_op in worker.log.read_text(), 60, "the worker to take the duplicate", worker.tail)
    assert worker.alive(), worker.tail()
    assert claims(pg_backend, job_id) == [f"running on {HOST}:{worker.pid}, attempt 1"]
    assert_ran_once_and_right(pg_backend, job_id, reference_run)


def terminate_connections(database: str) -> int:
    """``pg_terminate_backend`` every other connection to ``database``; returns how many there were."""
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (database,),
        ).fetchall()
    return len(rows)


def test_postgresql_connections_dropped_while_a_job_trains(
    pg_backend: Backend, processes: Processes, pretrained: Pretrained, reference_run: Reference
) -> None:
    """Fault 3: PostgreSQL drops every connection, again and again, while the worker trains; the job
    finishes on its first attempt, every metric recorded once."""
    job_id = create_ppo_job(pg_backend, pretrained)
    worker = processes.worker(pg_backend)
    wait_ready(worker)
    pg_backend.send(job_id)
    database = pg_backend.url.rsplit("/", 1)[1]
    wait_for_step(pg_backend, job_id, 1, processes)

    # Every 20 ms until the job ends, cut every connection to the database: most idle in the worker's
    # pool, a few in the middle of one of its transactions (a metric, a checkpoint, a heartbeat).
    dropped = []
    deadline = time.monotonic() + 120
    while get_job(pg_backend, job_id).status not in FINAL:
        assert time.monotonic() < deadline, f"the job did not finish within 2 minutes\n{worker.tail()}"
        dropped.append(terminate_connections(database))
        time.sleep(0.02)
    assert sum(dropped) >= 10, f"connections terminated: {dropped}"

    wait_finished(pg_backend, job_id, processes)
    assert worker.alive(), worker.tail()
    assert claims(pg_backend, job_id) == [f"running on {HOST}:{worker.pid}, attempt 1"]
    assert_ran_once_and_right(pg_backend, job_id, reference_run)


def test_a_claim_committed_unseen_still_runs_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The connection drops after the claim's COMMIT went through but before its answer came: the retried
    claim finds the job already this worker's and runs it, rather than leaving it to a lease expiry."""
    backend = make_backend("sqlite", tmp_path / "data")
    spec = {"type": "sft", "model": "builtin:tiny", "dataset": "builtin:reviews-sft",
            "hyperparameters": {"max_steps": 2, "batch_size": 4}}  # fmt: skip
    job_id = create_job(backend.settings, new_project(backend.settings, "faults").id, spec)
    drops = [OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))]

    @contextmanager
    def commit_then_drop(url: str) -> Iterator[Session]:
        with db.session_scope(url) as session:
            yield session
        if drops:  # the first transaction, the claim
            raise drops.pop()

    monkeypatch.setattr(runner, "session_scope", commit_then_drop)
    monkeypatch.setattr(runner, "DB_RETRY", runner.RetryPolicy(attempts=2, delay_s=0.01))
    assert runner.run_job(job_id, settings=backend.settings, worker="w:1") == "succeeded"
    assert not drops
    assert claims(backend, job_id) == ["running on w:1, attempt 1"]
    assert get_job(backend, job_id).attempt == 1


# --- fault 2 through rlhf serve ------------------------------------------------------------------


def start_serve(processes: Processes, backend: Backend, port: int) -> tuple[Process, Client]:
    """``rlhf serve`` on the backend's data folder, ready to take requests."""
    data_dir = backend.settings.data_dir
    serve = processes.start(backend, "serve", "serve", "--data-dir", str(data_dir), "--port", str(port))
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert serve.alive(), f"rlhf serve exited\n{serve.tail()}"
        try:
            return httpx.get(f"{url}/readyz", timeout=2).status_code == 200 and (data_dir / KEY_FILE).exists()
        except httpx.HTTPError:
            return False

    wait_until(ready, 90, "rlhf serve to be ready", serve.tail)
    return serve, Client(url, (data_dir / KEY_FILE).read_text().strip())


def test_serve_ctrl_c_hands_the_running_job_back(
    processes: Processes, pretrained: Pretrained, reference_run: Reference, tmp_path: Path
) -> None:
    """Fault 2 as ``rlhf serve`` meets it: Ctrl-C (SIGINT to the whole process group, as a terminal sends
    it; serve then sends SIGTERM to its children and SIGKILL after 10 s). The train worker stops the job
    after its step with a checkpoint and requeues it, for the next worker to continue: the same attempt."""
    backend = make_backend("sqlite", tmp_path / "serve")
    port = free_port()
    serve, client = start_serve(processes, backend, port)
    with db.session_scope(backend.url) as session:
        project = crud.project_by_name(session, name=DEFAULT_PROJECT)
        assert project is not None
        project_id = project.id
    job_id = client.create_job(pretrained_jobs(backend, pretrained, project_id))["id"]
    seen = wait_for_step(backend, job_id, 2, processes)

    started = time.monotonic()
    os.killpg(serve.pid, signal.SIGINT)
    wait_until(lambda: not serve.alive(), 30, "rlhf serve to stop", serve.tail)
    stop_s = time.monotonic() - started
    assert stop_s < 30 and serve.popen.returncode == 0, serve.tail()

    # Stopped cleanly, not killed: the job is back in the queue, the same attempt, with a checkpoint.
    job = get_job(backend, job_id)
    history = describe_events(backend, job_id)
    assert (job.status, job.attempt, job.worker) == ("queued", 1, None), f"{job.status}\n{history}\n{serve.tail()}"
    [handed_back] = [e for e in events(backend, job_id) if "is shutting down" in e.message]
    stop_step = int(handed_back.data["step"])
    assert seen.step <= stop_step < PPO_STEPS, history
    assert (job_dir(backend, job_id) / "checkpoints" / f"step-{stop_step}").is_dir()

    # What was sent back is in the embedded broker: a train worker on the same folder continues the job.
    processes.worker(backend)
    wait_finished(backend, job_id, processes)
    history = describe_events(backend, job_id)
    assert f"resumed from step {stop_step}" in history, history
    assert [c.rsplit(",", 1)[1] for c in claims(backend, job_id)] == [" attempt 1", " attempt 1"], history
    assert_ran_once_and_right(backend, job_id, reference_run)

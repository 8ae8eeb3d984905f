"""Scale-out (issue 6): several train workers share the train queue, one job each at a time, and a job whose
spec names another queue (``resources.queue``) waits for a worker of that queue. Real ``rlhf worker --queues``
processes and short SFT jobs; who ran what is read from the jobs' rows and claim events."""

import time
from collections import defaultdict
from datetime import datetime
from itertools import pairwise
from typing import Any

import pytest
from sqlalchemy import select

from jobs.store import crud, db
from jobs.store.models import Job
from tests.factories import create_job, new_project
from tests.faults.helpers import (
    FINAL,
    HOST,
    KOMBU_SQLA_WARNING,
    Backend,
    Processes,
    claims,
    describe_events,
    get_job,
    messages,
    metric_rows,
    queue_worker,
    send_to,
    wait_finished,
    wait_ready,
)
from tests.helpers import wait_until

pytestmark = pytest.mark.filterwarnings(KOMBU_SQLA_WARNING)

SFT_STEPS = 60
"""Long enough (two seconds or so in a worker) that two jobs overlap; only the final checkpoint is written."""
SHORT_STEPS = 20
"""Where nothing has to overlap."""
OTHER_QUEUE = "gpu-x"
IDLE_S = 1.5
"""How long the job of another queue must stay queued while the train worker is idle."""


def sft_spec(steps: int, queue: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "type": "sft",
        "model": "builtin:tiny",
        "dataset": "builtin:reviews-sft",
        "hyperparameters": {"max_steps": steps, "batch_size": 8, "learning_rate": 1e-3},
        "checkpoint_every": steps,
        "keep_checkpoints": 1,
    }
    if queue is not None:
        spec["resources"] = {"queue": queue}
    return spec


def submit(backend: Backend, spec: dict[str, Any]) -> str:
    """Create the job and send it to the queue its stored spec names, as the API does."""
    job_id = create_job(backend.settings, new_project(backend.settings, "faults").id, spec)
    send_to(backend, job_id, crud.job_queue(get_job(backend, job_id)))
    return job_id


def snapshot(backend: Backend, job_ids: list[str]) -> dict[str, Job]:
    """The jobs' rows as one SELECT reads them: a single moment."""
    with db.session_scope(backend.url) as session:
        return {job.id: job for job in session.scalars(select(Job).where(Job.id.in_(job_ids)))}


def claim(backend: Backend, job_id: str) -> str:
    """The worker (``host:pid``) that claimed the job, which must have been claimed once, at attempt 1."""
    found = claims(backend, job_id)
    assert len(found) == 1 and found[0].endswith(", attempt 1"), f"claims of {job_id}: {found}"
    return found[0].removeprefix("running on ").removesuffix(", attempt 1")


def assert_succeeded_once(backend: Backend, job_id: str, steps: int) -> None:
    """Succeeded at the first attempt, every step's metrics recorded exactly once."""
    job = get_job(backend, job_id)
    history = describe_events(backend, job_id)
    assert (job.status, job.step, job.attempt, job.output_step) == ("succeeded", steps, 1, steps), history
    assert messages(backend, job_id, "status") == ["running", "succeeded"], history
    recorded: dict[str, list[int]] = defaultdict(list)
    for name, step, _ in metric_rows(backend, job_id):
        recorded[name].append(step)
    assert "loss/sft" in recorded, f"no loss/sft metrics: {sorted(recorded)}"
    wrong = {name: sorted(s) for name, s in recorded.items() if sorted(s) != list(range(1, steps + 1))}
    assert not wrong, f"metric names without every step exactly once: {wrong}"


def test_two_workers_run_two_jobs_at_once_and_a_third_waits(pg_backend: Backend, processes: Processes) -> None:
    """Two train workers on PostgreSQL + Redis: two of three jobs run at once, one on each worker, while the
    third waits in the queue until a worker is free; all succeed, each claimed once, every step once."""
    backend = pg_backend
    workers = [queue_worker(processes, backend, "train"), queue_worker(processes, backend, "train")]
    for worker in workers:
        wait_ready(worker)
    names = {f"{HOST}:{w.pid}" for w in workers}
    job_ids = [submit(backend, sft_spec(SFT_STEPS)) for _ in range(3)]

    def two_running_one_queued() -> dict[str, Job] | None:
        jobs = snapshot(backend, job_ids)
        ended = {j.id: j.status for j in jobs.values() if j.status in FINAL and j.status != "succeeded"}
        assert not ended, f"jobs ended badly: {ended}\n{processes.logs()}"
        running = [j for j in jobs.values() if j.status == "running"]
        queued = [j for j in jobs.values() if j.status == "queued"]
        assert len(running) <= 2, f"three jobs running at once on two workers: {[j.worker for j in running]}"
        assert queued, "no job was left waiting while two ran"
        return jobs if len(running) == 2 else None

    seen = wait_until(two_running_one_queued, 60, "two jobs running and one queued", processes.logs)
    running = [j for j in seen.values() if j.status == "running"]
    [waiting] = [j.id for j in seen.values() if j.status == "queued"]
    assert {j.worker for j in running} == names, f"two running jobs, not one on each worker: {running}"

    done = {job_id: wait_finished(backend, job_id, processes) for job_id in job_ids}
    for job_id in job_ids:
        assert_succeeded_once(backend, job_id, SFT_STEPS)
    ran_on = {job_id: claim(backend, job_id) for job_id in job_ids}
    assert set(ran_on.values()) == names, f"workers of the jobs: {ran_on}"

    # The waiting job started once a worker was free: after the other job of the worker that took it ended.
    third = done[waiting]
    [before] = [done[j] for j in job_ids if j != waiting and ran_on[j] == ran_on[waiting]]
    assert third.started_at is not None and before.finished_at is not None
    assert third.started_at >= before.finished_at, (
        f"job {waiting} started at {third.started_at}, before {before.id} on the same worker finished at "
        f"{before.finished_at}"
    )
    # No worker ever ran two jobs at once.
    for name in names:
        spans = sorted(span(done[j]) for j in job_ids if ran_on[j] == name)
        overlapping = [(a, b) for a, b in pairwise(spans) if b[0] < a[1]]
        assert not overlapping, f"{name} ran jobs at once: {overlapping}"
    assert all(w.alive() for w in workers), processes.logs()


def span(job: Job) -> tuple[datetime, datetime]:
    assert job.started_at is not None and job.finished_at is not None, f"{job.id} has no start or end"
    return job.started_at, job.finished_at


def test_a_job_for_another_queue_waits_for_a_worker_of_that_queue(backend: Backend, processes: Processes) -> None:
    """A job of queue ``gpu-x``, sent before a ``train`` job, stays queued while the train worker runs the train
    job and then idles; a ``gpu-x`` worker started afterwards runs it."""
    train = queue_worker(processes, backend, "train")
    wait_ready(train)
    other_job = submit(backend, sft_spec(SHORT_STEPS, OTHER_QUEUE))
    # Sent second: were the queue ignored, the train worker would take the other queue's job first.
    train_job = submit(backend, sft_spec(SHORT_STEPS))

    def still_queued() -> None:
        job = get_job(backend, other_job)
        left = f"the {OTHER_QUEUE} job left the queue without a {OTHER_QUEUE} worker"
        assert (job.status, claims(backend, other_job)) == ("queued", []), (
            f"{left}\n{describe_events(backend, other_job)}"
        )

    def train_job_ended() -> bool:
        still_queued()
        return get_job(backend, train_job).status in FINAL

    wait_until(train_job_ended, 120, "the train job to finish", processes.logs)
    assert claim(backend, train_job) == f"{HOST}:{train.pid}", describe_events(backend, train_job)
    idle_until = time.monotonic() + IDLE_S  # the train worker has nothing to do now
    while time.monotonic() < idle_until:
        still_queued()
        time.sleep(0.1)
    assert train.alive(), train.tail()

    other = queue_worker(processes, backend, OTHER_QUEUE)
    wait_finished(backend, other_job, processes)
    assert_succeeded_once(backend, other_job, SHORT_STEPS)
    assert_succeeded_once(backend, train_job, SHORT_STEPS)
    assert claim(backend, other_job) == f"{HOST}:{other.pid}", describe_events(backend, other_job)

"""Train workers that die or are stopped mid-job (issue 4, faults 1, 2 and 5), on the embedded default and on
PostgreSQL + Redis: real ``rlhf worker --queues train`` processes, a PPO job, SIGKILL and SIGTERM."""

import signal
import time

import pytest

from jobs.store.models import Job, utcnow
from tests.engine.helpers import Pretrained
from tests.faults.helpers import (
    CHECKPOINT_EVERY,
    FINAL,
    HOST,
    KOMBU_SQLA_WARNING,
    MAX_ATTEMPTS,
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
    messages,
    metrics_recorded_before,
    wait_finished,
    wait_ready,
)
from tests.helpers import wait_until

pytestmark = pytest.mark.filterwarnings(KOMBU_SQLA_WARNING)


def two_workers(backend: Backend, processes: Processes) -> tuple[Process, Process]:
    """Two train workers, both consuming: either may take the job, the other is there to continue it."""
    first, second = processes.worker(backend), processes.worker(backend)
    wait_ready(first)
    wait_ready(second)
    return first, second


def test_killed_worker_job_resumes_from_its_checkpoint(
    backend: Backend, processes: Processes, pretrained: Pretrained, reference_run: Reference
) -> None:
    """Fault 1: SIGKILL the worker mid-PPO; the other worker recovers the job once its lease runs out and
    finishes it from the last checkpoint, with the weights and metrics of a run without the kill."""
    job_id = create_ppo_job(backend, pretrained)
    workers = two_workers(backend, processes)
    backend.send(job_id)

    def past_a_checkpoint() -> bool:
        # a step or two after a checkpoint, well before the next: the kill loses steps, not a checkpoint
        job = get_job(backend, job_id)
        assert job.status not in FINAL, f"the job ended {job.status} before it could be killed"
        return job.status == "running" and job.step > CHECKPOINT_EVERY and job.step % CHECKPOINT_EVERY in (1, 2)

    wait_until(past_a_checkpoint, 120, "the job to pass a checkpoint", processes.logs)
    victim = processes.by_lease(get_job(backend, job_id).worker)
    assert victim is not None
    victim.kill_group()
    killed_at = utcnow()
    [survivor] = [w for w in workers if w is not victim]

    lost = get_job(backend, job_id)
    assert (lost.status, lost.worker) == ("running", f"{HOST}:{victim.pid}"), "someone acted on the job"
    resume_step = max(
        int(p.name.removeprefix("step-")) for p in (job_dir(backend, job_id) / "checkpoints").glob("step-*")
    )
    stale = metrics_recorded_before(backend, job_id, after_step=resume_step, moment=killed_at)
    assert stale, f"no metrics were recorded past the checkpoint of step {resume_step} (killed at {lost.step})"

    # Nobody acts now: the survivor's recovery loop requeues the job, and it runs it.
    steps_seen: list[int] = []

    def finished() -> bool:
        job = get_job(backend, job_id)
        steps_seen.append(job.step)
        return job.status in FINAL

    wait_until(finished, 120, "the job to finish after the kill", processes.logs)
    job = get_job(backend, job_id)
    history = describe_events(backend, job_id)
    assert (job.status, job.step, job.output_step) == ("succeeded", PPO_STEPS, PPO_STEPS), history
    assert (job.attempt, job.worker) == (2, None)
    assert min(steps_seen) >= resume_step, f"the step went back past the checkpoint {resume_step}: {steps_seen}"
    assert messages(backend, job_id, "status") == ["running", "queued", "running", "succeeded"], history
    warnings = [e.message for e in events(backend, job_id) if e.kind == "warning"]
    assert warnings == ["worker lost; the job was requeued"], history
    infos = messages(backend, job_id, "info")
    assert f"running on {HOST}:{victim.pid}, attempt 1" in infos, history
    assert f"running on {HOST}:{survivor.pid}, attempt 2" in infos, history
    assert f"resumed from step {resume_step}" in infos, history
    assert any(m.startswith(f"metrics of steps {resume_step + 1}-") for m in infos), history
    assert survivor.alive()

    # Every step once, the rows past the checkpoint recomputed, and the weights of the run without a kill.
    kept = metrics_recorded_before(backend, job_id, after_step=resume_step, moment=killed_at)
    assert not kept, f"{kept} of the {stale} metric rows the lost worker recorded past the checkpoint were kept"
    assert_metrics_match(backend, job_id, reference_run)
    assert_same_weights(job_dir(backend, job_id), reference_run)


def test_stopped_worker_hands_its_job_back(
    backend: Backend, processes: Processes, pretrained: Pretrained, reference_run: Reference
) -> None:
    """Fault 2: SIGTERM the worker mid-PPO; it ends its step, checkpoints, requeues the job (the attempt is
    not a loss) and exits within 30 s; the other worker continues from that checkpoint."""
    job_id = create_ppo_job(backend, pretrained)
    workers = two_workers(backend, processes)
    backend.send(job_id)

    def training() -> Job | None:
        job = get_job(backend, job_id)
        assert job.status not in FINAL, f"the job ended {job.status} before it could be stopped"
        return job if job.status == "running" and 2 <= job.step <= PPO_STEPS - 4 else None

    seen = wait_until(training, 120, "the job to train", processes.logs)
    stopped = processes.by_lease(seen.worker)
    assert stopped is not None
    started = time.monotonic()
    stopped.signal(signal.SIGTERM)
    wait_until(lambda: not stopped.alive(), 30, "the stopped worker to exit", stopped.tail)
    exit_s = time.monotonic() - started
    assert exit_s < 30 and stopped.popen.returncode == 0, stopped.tail()
    [other] = [w for w in workers if w is not stopped]

    job = wait_finished(backend, job_id, processes)
    history = describe_events(backend, job_id)
    assert (job.status, job.step, job.attempt) == ("succeeded", PPO_STEPS, 1), history
    [handed_back] = [e for e in events(backend, job_id) if "is shutting down" in e.message]
    stop_step = int(handed_back.data["step"])
    # the step in progress when the signal came, or the one after it if the signal beat a poll
    assert seen.step <= stop_step <= seen.step + 2, f"stopped at {stop_step}; step {seen.step} when signalled"
    assert f"checkpoint at step {stop_step}" in [e.message for e in events(backend, job_id)], history
    assert messages(backend, job_id, "status") == ["running", "queued", "running", "succeeded"], history
    infos = messages(backend, job_id, "info")
    assert f"running on {HOST}:{other.pid}, attempt 1" in infos, history
    assert f"resumed from step {stop_step}" in infos, history
    assert not [e for e in events(backend, job_id) if e.kind == "warning"], history
    assert_metrics_match(backend, job_id, reference_run)
    assert_same_weights(job_dir(backend, job_id), reference_run)


def test_job_that_keeps_killing_its_worker_fails(processes: Processes, pretrained: Pretrained) -> None:
    """Fault 5: each worker that claims the job dies (SIGKILL, and a new worker starts, as ``rlhf serve``
    does); after RLHF_MAX_ATTEMPTS the job ends ``failed`` with ``worker_lost`` instead of looping."""
    backend = make_backend("sqlite", processes.log_dir / "data")
    job_id = create_ppo_job(backend, pretrained)
    wait_ready(processes.worker(backend))
    backend.send(job_id)
    killed: list[Process] = []

    def ended() -> bool:
        job = get_job(backend, job_id)
        victim = processes.by_lease(job.worker) if job.status == "running" else None
        if victim is not None and victim.alive():
            victim.kill_group()
            killed.append(victim)
            processes.worker(backend)
        return job.status in FINAL

    wait_until(ended, 120, "the job to end", processes.logs)
    job = get_job(backend, job_id)
    history = describe_events(backend, job_id)
    assert (job.status, job.error_code, job.attempt) == ("failed", "worker_lost", MAX_ATTEMPTS), history
    assert len(killed) == MAX_ATTEMPTS, history
    assert messages(backend, job_id, "status") == ["running", "queued", "running", "failed"], history
    expected = [f"running on {HOST}:{w.pid}, attempt {n}" for n, w in enumerate(killed, 1)]
    assert claims(backend, job_id) == expected, history

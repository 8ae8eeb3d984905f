"""A PPO job in two processes (``resources.num_processes: 2``, torchrun with gloo) on a real train worker, on
PostgreSQL + Redis: it reports one metric stream, keeps the ranks' weights identical after every step,
checkpoints, and when its worker is killed its ranks stop too and another worker resumes it."""

from collections import Counter
from pathlib import Path

import pytest

from tests.engine.helpers import Pretrained
from tests.factories import create_job, new_project
from tests.faults.helpers import (
    CHECKPOINT_EVERY,
    FINAL,
    KOMBU_SQLA_WARNING,
    PPO_STEPS,
    Backend,
    Processes,
    checkpoint_steps,
    describe_events,
    get_job,
    job_dir,
    messages,
    metric_rows,
    pretrained_jobs,
    wait_ready,
)
from tests.helpers import wait_until

pytestmark = pytest.mark.filterwarnings(KOMBU_SQLA_WARNING)


def rank_processes() -> list[int]:
    """Processes of ``-m jobs.rank``: torchrun and its ranks."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:  # gone meanwhile
                continue
            if b"jobs.rank" in argv:
                found.append(int(entry.name))
    return found


def create_two_process_ppo_job(backend: Backend, pretrained: Pretrained) -> str:
    project_id = new_project(backend.settings, "ddp").id
    spec = {**pretrained_jobs(backend, pretrained, project_id), "resources": {"num_processes": 2}}
    return create_job(backend.settings, project_id, spec)


def test_two_process_ppo_job_survives_its_worker_being_killed(
    pg_backend: Backend, processes: Processes, pretrained: Pretrained
) -> None:
    backend = pg_backend
    assert rank_processes() == [], "rank processes of an earlier test are still running"
    job_id = create_two_process_ppo_job(backend, pretrained)
    first = processes.worker(backend)
    wait_ready(first)
    backend.send(job_id)

    def past_a_checkpoint() -> bool:
        job = get_job(backend, job_id)
        assert job.status not in FINAL, f"the job ended {job.status} before it could be killed"
        return job.status == "running" and job.step > CHECKPOINT_EVERY and job.step % CHECKPOINT_EVERY in (1, 2)

    wait_until(past_a_checkpoint, 180, "the job to pass a checkpoint", processes.logs)
    assert len(rank_processes()) == 3, "torchrun and two ranks"
    first.kill_group()  # the worker and its process group; torchrun and the ranks run in their own
    wait_until(lambda: rank_processes() == [], 60, "torchrun and the ranks to stop with their worker", processes.logs)
    resume_step = max(checkpoint_steps(backend, job_id))

    second = processes.worker(backend)  # recovers the job once its lease runs out, and runs it
    wait_ready(second)
    wait_until(lambda: get_job(backend, job_id).status in FINAL, 180, "the job to finish", processes.logs)

    job, history = get_job(backend, job_id), describe_events(backend, job_id)
    assert (job.status, job.step, job.output_step, job.attempt) == ("succeeded", PPO_STEPS, PPO_STEPS, 2), history
    assert messages(backend, job_id, "status") == ["running", "queued", "running", "succeeded"], history
    assert f"resumed from step {resume_step}" in messages(backend, job_id, "info"), history

    # One metric stream: every step once, each with the same names; the ranks' weights identical throughout.
    rows = metric_rows(backend, job_id)
    per_step = Counter(step for _, step, _ in rows)
    assert sorted(per_step) == list(range(1, PPO_STEPS + 1))
    assert len(set(per_step.values())) == 1, f"metric rows per step differ: {per_step}"
    spread = {step: value for name, step, value in rows if name == "dist/weight_spread"}
    assert spread == dict.fromkeys(range(1, PPO_STEPS + 1), 0.0)

    # Checkpoints, written by rank 0 alone, of both models: the newest two kept, the final one last.
    assert checkpoint_steps(backend, job_id)[-1] == PPO_STEPS
    final = job_dir(backend, job_id) / "checkpoints" / f"step-{PPO_STEPS}"
    assert sorted(p.name for p in final.iterdir() if p.is_dir()) == ["policy", "value"]
    assert not [p for p in (job_dir(backend, job_id) / "checkpoints").iterdir() if p.name.startswith(".")]
    assert rank_processes() == []

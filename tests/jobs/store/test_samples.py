"""Rollout samples in the database: a step's samples added, read back in order, replaced when the step is reported
again, and dropped past the checkpoint a job resumes from (through the worker's callbacks), on SQLite and
PostgreSQL."""

from pathlib import Path
from typing import Any

from engine.spec.config import JobSpec
from jobs.runner import DbCallbacks
from jobs.store import crud
from jobs.store.db import session_scope
from jobs.store.settings import Settings
from tests.api.helpers import PPO_SPEC
from tests.factories import create_job


def samples(step: int, count: int = 3) -> list[dict[str, Any]]:
    return [
        {"prompt": f"prompt {step}.{i}", "response": f"response {step}.{i}", "rewards": {"score": step + i / 10},
         "kl": 0.5 * i, "length": i + 1}
        for i in range(count)
    ]  # fmt: skip


def stored(settings: Settings, job_id: str) -> dict[int, list[tuple[int, str, str, dict[str, float], float, int]]]:
    with session_scope(settings.resolved_database_url) as session:
        return {
            step: [(s.position, s.prompt, s.response, s.rewards, s.kl, s.length)
                   for s in crud.list_samples(session, job_id=job_id, step=step)]
            for step in crud.sample_steps(session, job_id=job_id)
        }  # fmt: skip


def test_samples_are_added_paged_by_step_and_replaced(settings: Settings, project_id: str) -> None:
    job_id = create_job(settings, project_id, PPO_SPEC)
    other = create_job(settings, project_id, PPO_SPEC)
    with session_scope(settings.resolved_database_url) as session:
        for step in (10, 1, 20):
            crud.add_samples(session, job_id=job_id, step=step, samples=samples(step))
        crud.add_samples(session, job_id=other, step=5, samples=samples(5))
        crud.add_samples(session, job_id=job_id, step=20, samples=samples(21, count=2))  # step 20 again
        long = {**samples(30, 1)[0], "prompt": "p" * 10_000, "response": "r" * 5000}
        crud.add_samples(session, job_id=job_id, step=30, samples=[long])
    kept = stored(settings, job_id)
    assert sorted(kept) == [1, 10, 20, 30]
    assert kept[10] == [(i, f"prompt 10.{i}", f"response 10.{i}", {"score": 10 + i / 10}, 0.5 * i, i + 1)
                        for i in range(3)]  # fmt: skip
    assert [row[1] for row in kept[20]] == ["prompt 21.0", "prompt 21.1"]  # replaced, not added to
    ((_, prompt, response, *_),) = kept[30]
    assert len(prompt) == len(response) == crud.SAMPLE_TEXT_CHARS and prompt.endswith("…")
    assert sorted(stored(settings, other)) == [5]


def test_a_resumed_job_forgets_the_samples_past_its_checkpoint(
    settings: Settings, project_id: str, tmp_path: Path
) -> None:
    job_id = create_job(settings, project_id, PPO_SPEC)
    with session_scope(settings.resolved_database_url) as session:
        assert crud.claim_job(session, job_id=job_id, worker="w1", lease_seconds=60)
    callbacks = DbCallbacks(job_id, settings=settings, worker="w1", out_dir=tmp_path)
    callbacks.on_start(0, 30)
    for step in (1, 10, 20):
        callbacks.on_samples(step, samples(step))
    assert sorted(stored(settings, job_id)) == [1, 10, 20]
    callbacks.on_start(10, 30)  # resumed from the checkpoint of step 10: step 20 is sampled anew
    assert sorted(stored(settings, job_id)) == [1, 10]
    callbacks.on_samples(20, samples(20, count=1))
    assert [row[1] for row in stored(settings, job_id)[20]] == ["prompt 20.0"]
    with session_scope(settings.resolved_database_url) as session:  # no job left running for the lease tests
        assert crud.transition(session, job_id=job_id, from_statuses=("running",), to="cancelled")
    assert JobSpec.model_validate(PPO_SPEC).config.log_samples_every == 10  # type: ignore[attr-defined]

"""What the worker-side tests build and inspect job rows with: a small SFT spec, and readers of a job's row,
events, metrics and checkpoints (in the database and on disk).

Settings, projects and queued jobs come from ``tests.factories`` (with ``lease_seconds=LEASE_SECONDS``).
"""

from collections import Counter
from typing import Any

from jobs.store import crud, db
from jobs.store.models import Event, Job
from jobs.store.settings import Settings

REDIS_URL = "redis://127.0.0.1:6379/14"
LEASE_SECONDS = 30
"""The lease of the worker tests' settings."""

SFT_SMALL = {"max_steps": 4, "batch_size": 8, "learning_rate": 1e-3}


def sft_spec(**fields: Any) -> dict[str, Any]:
    hyperparameters = {**SFT_SMALL, **fields.pop("hyperparameters", {})}
    return {
        "type": "sft",
        "model": "builtin:tiny",
        "dataset": "builtin:reviews-sft",
        "hyperparameters": hyperparameters,
        "checkpoint_every": 2,
        **fields,
    }


def get_job(settings: Settings, job_id: str) -> Job:
    with db.session_scope(settings.resolved_database_url) as session:
        job = crud.get_job(session, job_id=job_id)
        assert job is not None
        return job


def set_status(settings: Settings, job_id: str, from_statuses: tuple[str, ...], to: str) -> None:
    """What the API does for cancel, pause and resume."""
    with db.session_scope(settings.resolved_database_url) as session:
        assert crud.transition(session, job_id=job_id, from_statuses=from_statuses, to=to)


def metric_series(settings: Settings, job_id: str) -> dict[str, list[int]]:
    """Steps recorded per metric name, in step order."""
    with db.session_scope(settings.resolved_database_url) as session:
        history = crud.metric_history(
            session, job_id=job_id, names=None, start_step=None, end_step=None, max_points=None
        )
    return {name: [step for step, _ in points] for name, points in history.items()}


def events(settings: Settings, job_id: str) -> list[Event]:
    with db.session_scope(settings.resolved_database_url) as session:
        rows, _ = crud.list_events(session, job_id=job_id, after=None, limit=1000)
        return rows


def status_changes(settings: Settings, job_id: str) -> list[str]:
    return [e.message for e in events(settings, job_id) if e.kind == "status"]


def checkpoint_steps(settings: Settings, job_id: str) -> list[int]:
    with db.session_scope(settings.resolved_database_url) as session:
        return [c.step for c in crud.list_checkpoints(session, job_id=job_id)]


def disk_checkpoint_steps(settings: Settings, job_id: str) -> list[int]:
    root = settings.resolved_artifacts_dir / "jobs" / job_id / "checkpoints"
    return sorted(int(p.name.removeprefix("step-")) for p in root.glob("step-*"))


def counts(series: dict[str, list[int]]) -> Counter[int]:
    """How many metric names have each number of rows."""
    return Counter(len(steps) for steps in series.values())

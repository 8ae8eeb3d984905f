"""``GET /v1/jobs/{id}/samples``: the rollouts a PPO or GRPO job kept every ``log_samples_every`` steps, a step at a
time, so a reader can see what the policy is learning to say."""

from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import CurrentProject, SessionDep
from api.errors import ApiError
from api.schemas import MAX_INT32, SamplePublic, SamplesPublic
from api.services.jobs import job_or_404
from jobs.store import crud

router = APIRouter(prefix="/jobs", tags=["jobs"])


@router.get("/{job_id}/samples")
def job_samples(
    session: SessionDep,
    project: CurrentProject,
    job_id: str,
    step: Annotated[
        int | None, Query(ge=0, le=MAX_INT32, description="A step with samples; the newest one when absent.")
    ] = None,
) -> SamplesPublic:
    """The samples of one logged step (prompt, response, each reward component, KL, length) and every step that has
    some. A job without samples yet (or of a type that keeps none) answers an empty list; 404 for a ``step``
    without samples."""
    job = job_or_404(session, project, job_id)
    steps = crud.sample_steps(session, job_id=job.id)
    if step is None:
        step = steps[-1] if steps else None
    elif step not in steps:
        raise ApiError(404, "not_found", f"job {job.id} has no samples at step {step}", param="step")
    rows = crud.list_samples(session, job_id=job.id, step=step) if step is not None else []
    names = list(dict.fromkeys(name for row in rows for name in row.rewards or {}))
    return SamplesPublic(step=step, steps=steps, reward_names=names, data=[SamplePublic.of(row) for row in rows])

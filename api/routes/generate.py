"""``POST /v1/jobs/{id}/generate``: sample from any checkpoint of a job, on the inference queue."""

from typing import Any

import anyio
from fastapi import APIRouter, Request
from sqlalchemy.orm import Session

from api.deps import CurrentProject, GenerateDep, SessionDep
from api.errors import ApiError, ErrorResponse, error_responses
from api.queue import run_generation
from api.schemas import GenerateRequest, GenerateResponse
from api.services.jobs import job_or_404
from engine.spec.config import JOB_TYPES
from jobs.store import crud
from jobs.store.models import Project
from jobs.store.refs import GENERATING_JOB_TYPES, generates

router = APIRouter(prefix="/jobs", tags=["generation"])


def _checkpoint_step(session: Session, project: Project, job_id: str, body: GenerateRequest) -> int:
    job = job_or_404(session, project, job_id)
    if not generates(job.type):
        raise ApiError(
            422,
            "wrong_job_type",
            f"job {job.id} trains a reward model: it scores text but does not "
            f"generate it; generate from a job of type {' or '.join(GENERATING_JOB_TYPES)}",
        )
    if body.score and not job.spec.get("reward_model"):
        scoring = " or ".join(name for name, info in JOB_TYPES.items() if info.reward_model)
        raise ApiError(
            422,
            "invalid_request",
            f"job {job.id} ({job.type}) has no reward_model to score with; {scoring} jobs trained against a "
            "reward_model have one",
            param="score",
        )
    step = None if body.checkpoint == "latest" else body.checkpoint
    checkpoint = crud.get_checkpoint(session, job_id=job.id, step=step)
    if checkpoint is None:
        which = "any checkpoint" if step is None else f"a checkpoint at step {step}"
        raise ApiError(404, "checkpoint_not_found", f"job {job.id} has no {which}", param="checkpoint")
    session.close()  # release the connection before the (long) wait
    return checkpoint.step


@router.post(
    "/{job_id}/generate",
    response_model_exclude_none=True,
    responses={
        404: {"model": ErrorResponse, "description": "No such job, or no such checkpoint."},
        503: {"model": ErrorResponse, "description": "No inference worker answered in time."},
        **error_responses(400, 500),
    },
)
async def generate(
    request: Request,
    session: SessionDep,
    project: CurrentProject,
    wait_for: GenerateDep,
    job_id: str,
    body: GenerateRequest,
) -> GenerateResponse:
    """Complete prompts with a checkpoint of the job (``latest`` by default), optionally scored by the job's
    reward model. Runs on an inference worker; this request waits for it."""
    step = await anyio.to_thread.run_sync(_checkpoint_step, session, project, job_id, body)
    kwargs: dict[str, Any] = {
        "job_id": job_id,
        "step": step,
        "prompts": body.prompts,
        "max_new_tokens": body.max_new_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "score": body.score,
    }
    result = await run_generation(request, wait_for, kwargs)
    return GenerateResponse(checkpoint=step, completions=result["completions"])

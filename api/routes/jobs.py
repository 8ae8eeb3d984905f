"""``/v1/jobs``: create (validated in full, enqueued after commit), list, get, control, and history."""

from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, Query, Response

from api.deps import CurrentProject, EnqueueDep, SessionDep, SettingsDep
from api.errors import ApiError, ErrorResponse, error_responses
from api.schemas import (
    ID_PATTERN,
    MAX_INT32,
    MAX_INT64,
    CheckpointPublic,
    CheckpointsPublic,
    EventPublic,
    EventsPublic,
    JobPublic,
    JobsPublic,
    JobStatus,
    JobType,
    MetricPoint,
    MetricsPublic,
)
from api.services.jobs import control_job, job_or_404, store_job, validated_spec
from engine.spec.config import JOB_TYPES
from jobs.store import crud

router = APIRouter(prefix="/jobs", tags=["jobs"])

MAX_METRIC_NAMES = 100
"""Metric names one history request may ask for."""

SFT_JOB = "job:job_0123456789ab"
"""The examples' finished SFT job, the starting model of every type but sft."""
RM_JOB = "job:job_ba9876543210"
"""The examples' finished reward-model job."""


def _example(job_type: str) -> dict[str, Any]:
    """A spec of ``job_type``: its stage of ``rlhf demo`` (``JOB_TYPES[job_type].demo``), from the built-in model
    (sft) or an SFT job, against a reward-model job where it trains against a reward and its stage names none."""
    info = JOB_TYPES[job_type]
    value = {"type": job_type, "model": "builtin:tiny" if job_type == "sft" else SFT_JOB, **info.demo}
    if info.reward_model and "reward" not in value:
        value["reward_model"] = RM_JOB
    return {"summary": f"{job_type}: {info.summary}", "value": value}


SPEC_EXAMPLES = {job_type: _example(job_type) for job_type in JOB_TYPES}
"""One example spec per job type, in ``POST /v1/jobs``'s OpenAPI body."""


# --- create, list, get -------------------------------------------------------------------------


@router.post(
    "",
    status_code=201,
    responses={
        200: {"model": JobPublic, "description": "The job an earlier request with this Idempotency-Key created."},
        409: {"model": ErrorResponse, "description": "The Idempotency-Key was used with a different spec."},
        429: {"model": ErrorResponse, "description": "The project has too many queued and waiting jobs."},
        **error_responses(400, 503, 507),
    },
)
def create_job(
    session: SessionDep,
    settings: SettingsDep,
    project: CurrentProject,
    enqueue: EnqueueDep,
    response: Response,
    body: Annotated[dict[str, Any], Body(description="A job spec (schema JobSpec).", openapi_examples=SPEC_EXAMPLES)],
    idempotency_key: Annotated[
        str | None,
        Header(alias="Idempotency-Key", max_length=255, description="Retrying with the same key returns the same job."),
    ] = None,
) -> JobPublic:
    """Validate a job spec in full (fields, ranges, references to jobs and files), store it and queue it.

    A 422 names the field at fault in ``param``. The job is sent to the train queue only once it is committed. A
    spec naming an unfinished job (``job:<id>`` as ``model``, ``reward_model`` or a reward grader's model) is
    stored ``waiting``: it is queued when that job succeeds, and fails with ``dependency_failed`` if it does not.
    """
    spec, pending = validated_spec(session, settings, project, body)
    job, created = store_job(
        session, settings, enqueue, project, spec=spec, pending=pending, idempotency_key=idempotency_key
    )
    if not created:
        response.status_code = 200
    return JobPublic.of(job)


@router.get("")
def list_jobs(
    session: SessionDep,
    project: CurrentProject,
    status: JobStatus | None = None,
    type: JobType | None = None,
    after: Annotated[
        str | None, Query(description="Id of the last job of the previous page.", max_length=64, pattern=ID_PATTERN)
    ] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> JobsPublic:
    """The project's jobs, newest first."""
    rows, has_more = crud.list_jobs(
        session, project_id=project.id, status=status, job_type=type, after=after, limit=limit
    )
    return JobsPublic(data=[JobPublic.of(job) for job in rows], has_more=has_more)


@router.get("/{job_id}")
def get_job(session: SessionDep, project: CurrentProject, job_id: str) -> JobPublic:
    return JobPublic.of(job_or_404(session, project, job_id))


# --- cancel, pause, resume ---------------------------------------------------------------------


@router.post("/{job_id}/cancel", responses={409: {"model": ErrorResponse}})
def cancel_job(
    session: SessionDep, settings: SettingsDep, project: CurrentProject, enqueue: EnqueueDep, job_id: str
) -> JobPublic:
    """Cancel: a waiting, queued or paused job at once; a running one cooperatively (``cancelling`` until its
    worker stops between steps). 409 once the job is final. Jobs waiting for it fail (``dependency_failed``)."""
    job = job_or_404(session, project, job_id)
    control_job(session, settings, enqueue, job, "cancel")
    return JobPublic.of(job)


@router.post("/{job_id}/pause", responses={409: {"model": ErrorResponse}})
def pause_job(
    session: SessionDep, settings: SettingsDep, project: CurrentProject, enqueue: EnqueueDep, job_id: str
) -> JobPublic:
    """Pause: a running job saves a checkpoint between steps and stops (``pausing`` → ``paused``); a queued
    job is paused before it starts."""
    job = job_or_404(session, project, job_id)
    control_job(session, settings, enqueue, job, "pause")
    return JobPublic.of(job)


@router.post("/{job_id}/resume", responses={409: {"model": ErrorResponse}, 503: {"model": ErrorResponse}})
def resume_job(
    session: SessionDep, settings: SettingsDep, project: CurrentProject, enqueue: EnqueueDep, job_id: str
) -> JobPublic:
    """Resume a paused job: it is queued again and continues from its last checkpoint."""
    job = job_or_404(session, project, job_id)
    control_job(session, settings, enqueue, job, "resume")
    return JobPublic.of(job)


# --- history -----------------------------------------------------------------------------------


@router.get("/{job_id}/metrics")
def job_metrics(
    session: SessionDep,
    project: CurrentProject,
    job_id: str,
    names: Annotated[
        str | None,
        Query(
            description=f"Comma-separated metric names (at most {MAX_METRIC_NAMES}); all when absent.",
            examples=["loss/sft,lr"],
            max_length=MAX_METRIC_NAMES * 101,
        ),
    ] = None,
    start_step: Annotated[int | None, Query(ge=0, le=MAX_INT32)] = None,
    end_step: Annotated[int | None, Query(ge=0, le=MAX_INT32)] = None,
    max_points: Annotated[
        int | None, Query(ge=1, le=100_000, description="Even downsampling per series, keeping first and last.")
    ] = None,
) -> MetricsPublic:
    job = job_or_404(session, project, job_id)
    wanted = [name.strip() for name in names.split(",") if name.strip()] if names else None
    if wanted is not None and len(wanted) > MAX_METRIC_NAMES:
        raise ApiError(422, "invalid_request", f"at most {MAX_METRIC_NAMES} metric names", param="names")
    series = crud.metric_history(
        session, job_id=job.id, names=wanted, start_step=start_step, end_step=end_step, max_points=max_points
    )
    return MetricsPublic(
        data={name: [MetricPoint(step=step, value=value) for step, value in points] for name, points in series.items()}
    )


@router.get("/{job_id}/events")
def job_events(
    session: SessionDep,
    project: CurrentProject,
    job_id: str,
    after: Annotated[int | None, Query(ge=0, le=MAX_INT64, description="Id of the last event already seen.")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> EventsPublic:
    """Status changes, checkpoints, warnings and errors, oldest first."""
    job = job_or_404(session, project, job_id)
    rows, has_more = crud.list_events(session, job_id=job.id, after=after, limit=limit)
    return EventsPublic(data=[EventPublic.of(row) for row in rows], has_more=has_more)


@router.get("/{job_id}/checkpoints")
def job_checkpoints(session: SessionDep, project: CurrentProject, job_id: str) -> CheckpointsPublic:
    """The job's kept checkpoints, by step."""
    job = job_or_404(session, project, job_id)
    return CheckpointsPublic(data=[CheckpointPublic.of(row) for row in crud.list_checkpoints(session, job_id=job.id)])

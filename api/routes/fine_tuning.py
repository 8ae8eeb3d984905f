"""``/v1/fine_tuning/jobs``: OpenAI's fine-tuning API (create, list, retrieve, cancel, pause, resume, events,
checkpoints) over this service's sft, dpo and grpo jobs, so the official ``openai`` client trains here.

A create request becomes a job spec (``api.fine_tuning.spec_of``), validated and stored as ``POST /v1/jobs`` stores
one: the same job is in ``/v1/jobs``, on the dashboard and in the CLI, and its ``fine_tuned_model`` (``job:<id>``)
and checkpoints (``job:<id>@<step>``) are models of ``/v1/chat/completions``. Errors keep OpenAI's envelope, with
``param`` naming the request's field.
"""

from typing import Annotated

from fastapi import APIRouter, Header, Query
from sqlalchemy.orm import Session

from api.deps import CurrentProject, EnqueueDep, SessionDep, SettingsDep
from api.errors import ApiError, ErrorResponse, error_responses
from api.fine_tuning import (
    FINE_TUNING_TYPES,
    RequestError,
    checkpoint_object,
    cursor,
    event_object,
    job_object,
    request_param,
    request_seed,
    spec_of,
)
from api.openai_schemas import (
    FineTuningCheckpoints,
    FineTuningEvents,
    FineTuningJob,
    FineTuningJobCreate,
    FineTuningJobs,
)
from api.schemas import ID_PATTERN, looks_like_id
from api.services.jobs import control_job, store_job, validated_spec
from jobs.store import crud
from jobs.store.models import Job, Project

router = APIRouter(prefix="/fine_tuning/jobs", tags=["openai"])
checkpoints_router = APIRouter(prefix="/fine_tuning/checkpoints", tags=["openai"])


def _fine_tuning_job(session: Session, project: Project, job_id: str) -> Job:
    job = crud.get_job(session, job_id=job_id, project_id=project.id) if looks_like_id(job_id) else None
    if job is None:
        raise ApiError(404, "not_found", f"no fine-tuning job {job_id!r} in this project", param="fine_tuning_job_id")
    if job.type not in FINE_TUNING_TYPES:
        message = (
            f"job {job.id} is a {job.type} job, not a fine-tuning job ({', '.join(FINE_TUNING_TYPES)}); "
            f"GET /v1/jobs/{job.id} shows it"
        )
        raise ApiError(404, "not_found", message, param="fine_tuning_job_id")
    return job


def _refused(error: RequestError) -> ApiError:
    return ApiError(422, "invalid_request", error.message, param=error.param)


def _before(after: str | None, prefix: str) -> int | None:
    """The number in a list's ``after`` cursor; 422 for one that is not an id of the list."""
    try:
        return cursor(after, prefix)
    except RequestError as e:
        raise _refused(e) from None


def _training_rows(session: Session, project: Project, jobs: list[Job]) -> dict[str, int]:
    """Rows of each job's training file, by file id (a built-in dataset has none here)."""
    ids = {job.spec["dataset"] for job in jobs if job.spec["dataset"].startswith("file-")}
    return crud.file_rows(session, project_id=project.id, file_ids=ids)


def _object(session: Session, project: Project, job: Job) -> FineTuningJob:
    rows = _training_rows(session, project, [job])
    return job_object(job, project.id, rows.get(job.spec["dataset"]))


@router.post(
    "",
    responses={409: {"model": ErrorResponse, "description": "The Idempotency-Key was used with another request."},
               **error_responses(400, 503, 507)},
)  # fmt: skip
def create_fine_tuning_job(
    session: SessionDep,
    settings: SettingsDep,
    project: CurrentProject,
    enqueue: EnqueueDep,
    body: FineTuningJobCreate,
    idempotency_key: Annotated[
        str | None,
        Header(alias="Idempotency-Key", max_length=255, description="Retrying with the same key returns the same job."),
    ] = None,
) -> FineTuningJob:
    """Create a fine-tuning job: ``supervised`` → an sft job, ``dpo`` → dpo, ``reinforcement`` → grpo with the
    grader as its reward. ``auto`` hyperparameters are chosen from the training file's size; the job keeps a
    checkpoint at the end of each of its last three epochs. It is validated in full as ``POST /v1/jobs`` validates
    a spec (files, their rows' kind, the model, the grader), and a 422 names the request's field."""
    training = (
        crud.get_file(session, file_id=body.training_file, project_id=project.id)
        if looks_like_id(body.training_file)
        else None
    )
    if training is None:
        raise ApiError(422, "file_not_found", f"no file {body.training_file!r} in this project", param="training_file")
    seed = body.seed if body.seed is not None else request_seed(idempotency_key)
    try:
        spec_body = spec_of(body, training.rows, seed)
    except RequestError as e:
        raise _refused(e) from None
    try:
        spec, pending = validated_spec(session, settings, project, spec_body)
    except ApiError as e:
        e.param = request_param(e.param, body)
        raise
    job, _ = store_job(session, settings, enqueue, project, spec=spec, pending=pending, idempotency_key=idempotency_key)
    return _object(session, project, job)


@router.get("")
def list_fine_tuning_jobs(
    session: SessionDep,
    project: CurrentProject,
    after: Annotated[
        str | None, Query(description="Id of the last job of the previous page.", max_length=64, pattern=ID_PATTERN)
    ] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> FineTuningJobs:
    """The project's fine-tuning jobs (its sft, dpo and grpo jobs), newest first."""
    rows, has_more = crud.list_jobs(
        session, project_id=project.id, job_types=FINE_TUNING_TYPES, after=after, limit=limit
    )
    counts = _training_rows(session, project, rows)
    data = [job_object(job, project.id, counts.get(job.spec["dataset"])) for job in rows]
    return FineTuningJobs(data=data, has_more=has_more)


@router.get("/{fine_tuning_job_id}")
def retrieve_fine_tuning_job(session: SessionDep, project: CurrentProject, fine_tuning_job_id: str) -> FineTuningJob:
    return _object(session, project, _fine_tuning_job(session, project, fine_tuning_job_id))


def _control(
    session: Session, settings: SettingsDep, enqueue: EnqueueDep, project: Project, job_id: str, action: str
) -> FineTuningJob:
    job = _fine_tuning_job(session, project, job_id)
    control_job(session, settings, enqueue, job, action)
    return _object(session, project, job)


@router.post("/{fine_tuning_job_id}/cancel", responses={409: {"model": ErrorResponse}})
def cancel_fine_tuning_job(
    session: SessionDep, settings: SettingsDep, project: CurrentProject, enqueue: EnqueueDep, fine_tuning_job_id: str
) -> FineTuningJob:
    """Cancel (as ``POST /v1/jobs/{id}/cancel``): a running job reports ``running`` until its worker stops."""
    return _control(session, settings, enqueue, project, fine_tuning_job_id, "cancel")


@router.post("/{fine_tuning_job_id}/pause", responses={409: {"model": ErrorResponse}})
def pause_fine_tuning_job(
    session: SessionDep, settings: SettingsDep, project: CurrentProject, enqueue: EnqueueDep, fine_tuning_job_id: str
) -> FineTuningJob:
    """Pause (as ``POST /v1/jobs/{id}/pause``): the job checkpoints and stops, ``paused``."""
    return _control(session, settings, enqueue, project, fine_tuning_job_id, "pause")


@router.post("/{fine_tuning_job_id}/resume", responses={409: {"model": ErrorResponse}, 503: {"model": ErrorResponse}})
def resume_fine_tuning_job(
    session: SessionDep, settings: SettingsDep, project: CurrentProject, enqueue: EnqueueDep, fine_tuning_job_id: str
) -> FineTuningJob:
    """Resume a paused job from its last checkpoint."""
    return _control(session, settings, enqueue, project, fine_tuning_job_id, "resume")


@router.get("/{fine_tuning_job_id}/events")
def list_fine_tuning_events(
    session: SessionDep,
    project: CurrentProject,
    fine_tuning_job_id: str,
    after: Annotated[str | None, Query(description="Id of the last event of the previous page.", max_length=40)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> FineTuningEvents:
    """The job's events (status changes, checkpoints, warnings, errors), newest first."""
    job = _fine_tuning_job(session, project, fine_tuning_job_id)
    before = _before(after, "ftevent-")
    rows, has_more = crud.list_numbered_events(session, job_id=job.id, before=before, limit=limit)
    return FineTuningEvents(data=[event_object(number, row) for number, row in rows], has_more=has_more)


@router.get("/{fine_tuning_job_id}/checkpoints")
def list_fine_tuning_checkpoints(
    session: SessionDep,
    project: CurrentProject,
    fine_tuning_job_id: str,
    after: Annotated[
        str | None, Query(description="Id of the last checkpoint of the previous page.", max_length=40)
    ] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 10,
) -> FineTuningCheckpoints:
    """The job's kept checkpoints, newest first; each is a model of ``/v1/chat/completions``."""
    job = _fine_tuning_job(session, project, fine_tuning_job_id)
    before = _before(after, "ftckpt-")
    kept = sorted(crud.list_checkpoints(session, job_id=job.id), key=lambda c: c.step, reverse=True)
    kept = [c for c in kept if before is None or c.step < before]
    data = [checkpoint_object(job, c) for c in kept[:limit]]
    return FineTuningCheckpoints(
        data=data,
        has_more=len(kept) > limit,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


# --- checkpoint permissions: not kept here -----------------------------------------------------------------------

PERMISSIONS_UNSUPPORTED = (
    "checkpoint permissions are not supported: a checkpoint belongs to its job's project, every key of that project "
    "may use it as a model (job:<id>@<step>), and no other project can"
)


def _no_permissions() -> ApiError:
    return ApiError(400, "unsupported", PERMISSIONS_UNSUPPORTED, param="checkpoints.permissions")


@checkpoints_router.post("/{fine_tuned_model_checkpoint}/permissions", responses=error_responses(400))
def create_checkpoint_permissions(project: CurrentProject, fine_tuned_model_checkpoint: str) -> None:
    """Not supported (400 ``unsupported``): sharing a checkpoint with other projects."""
    raise _no_permissions()


@checkpoints_router.get("/{fine_tuned_model_checkpoint}/permissions", responses=error_responses(400))
def list_checkpoint_permissions(project: CurrentProject, fine_tuned_model_checkpoint: str) -> None:
    """Not supported (400 ``unsupported``): a checkpoint has no permissions besides its project's."""
    raise _no_permissions()


@checkpoints_router.delete("/{fine_tuned_model_checkpoint}/permissions/{permission_id}", responses=error_responses(400))
def delete_checkpoint_permission(project: CurrentProject, fine_tuned_model_checkpoint: str, permission_id: str) -> None:
    """Not supported (400 ``unsupported``): there are no permissions to delete."""
    raise _no_permissions()

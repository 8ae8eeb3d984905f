"""``/v1/jobs``: create (validated in full, enqueued after commit), list, get, control, and history."""

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, Query, Response
from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.deps import CurrentProject, Enqueue, EnqueueDep, SessionDep, SettingsDep
from api.errors import ApiError, ErrorResponse, error_responses, not_found, spec_error
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
    looks_like_id,
)
from engine.config import JobSpec
from jobs.recovery import release_once
from jobs.store import crud
from jobs.store.models import FINAL_STATUSES, Job, Project, utcnow
from jobs.store.refs import SpecReferenceError, auto_values, dependencies, resolve_spec
from jobs.store.settings import Settings

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/jobs", tags=["jobs"])

MAX_METRIC_NAMES = 100
"""Metric names one history request may ask for."""

SPEC_EXAMPLES: dict[str, Any] = {
    "sft": {
        "summary": "Supervised fine-tuning of the built-in model",
        "value": {"type": "sft", "name": "reviews-sft", "model": "builtin:tiny", "dataset": "builtin:reviews-sft",
                  "eval_dataset": "builtin:reviews-sft-eval", "hyperparameters": {"epochs": 3, "batch_size": 32}},
    },
    "rm": {
        "summary": "Reward model from a finished SFT job, on an uploaded preference file",
        "value": {"type": "rm", "model": "job:job_0123456789ab", "dataset": "file-0123456789ab",
                  "hyperparameters": {"epochs": 1, "learning_rate": 5e-4}},
    },
    "ppo": {
        "summary": "PPO from an SFT job against an RM job, with LoRA",
        "value": {"type": "ppo", "model": "job:job_0123456789ab", "reward_model": "job:job_ba9876543210",
                  "dataset": "builtin:reviews-prompts", "hyperparameters": {"total_steps": 20, "kl_coef": 0.05},
                  "lora": {"r": 8, "alpha": 16}, "checkpoint_every": 10, "metadata": {"experiment": "demo"}},
    },
}  # fmt: skip


def job_or_404(session: Session, project: Project, job_id: str) -> Job:
    """The caller's job, or 404 — also for another project's job, which is indistinguishable from none."""
    job = crud.get_job(session, job_id=job_id, project_id=project.id) if looks_like_id(job_id) else None
    if job is None:
        raise not_found("job", job_id)
    return job


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
    job, created = store_job(session, settings, enqueue, project, spec, pending, idempotency_key)
    if not created:
        response.status_code = 200
    return JobPublic.of(job)


def store_job(
    session: Session,
    settings: Settings,
    enqueue: Enqueue,
    project: Project,
    spec: dict[str, Any],
    pending: list[str],
    idempotency_key: str | None,
) -> tuple[Job, bool]:
    """Store a validated spec's job and queue it after the commit; (the job, whether it is new). An earlier
    request's job when ``idempotency_key`` was used before with the same spec (sent again if its message never
    went out); 409 with another spec. 429 when the project has ``settings.max_pending_jobs`` queued or waiting."""
    if (
        idempotency_key is None
        or crud.job_for_key(session, project_id=project.id, idempotency_key=idempotency_key) is None
    ):
        check_pending(session, settings, project, 1)
    job, created = _create_or_replay(session, project.id, spec, idempotency_key, pending)
    if not created:
        if job.spec != spec:
            raise ApiError(
                409,
                "conflict",
                "this Idempotency-Key was already used with a different job spec",
                param="Idempotency-Key",
            )
        if job.status == "queued" and job.sent_at is None:  # its first request stopped before sending it
            send_created(session, settings, enqueue, [job])
            session.refresh(job)
        return job, False
    session.commit()
    send_created(session, settings, enqueue, [job])
    session.refresh(job)
    return job, True


def check_pending(session: Session, settings: Settings, project: Project, adding: int) -> None:
    """429 ``too_many_pending_jobs`` when ``adding`` more jobs would take the project past
    ``settings.max_pending_jobs`` queued and waiting ones."""
    pending = crud.count_pending(session, project_id=project.id)
    if pending + adding > settings.max_pending_jobs:
        message = (
            f"the project has {pending} queued or waiting jobs, and takes at most {settings.max_pending_jobs} "
            "(RLHF_MAX_PENDING_JOBS): submit again once some have started, or cancel some"
        )
        raise ApiError(429, "too_many_pending_jobs", message)


def validated_spec(
    session: Session, settings: Settings, project: Project, body: dict[str, Any], param_prefix: str = ""
) -> tuple[dict[str, Any], list[str]]:
    """The spec as stored (every default filled in, so equal specs are stored equal: idempotency compares them;
    the epochs or steps and the learning rate it leaves out chosen "auto" from its dataset's rows and its model's
    width, engine/auto.py) and the unfinished jobs it names; a 422 naming the field (after ``param_prefix``) when
    it is refused."""
    try:
        spec = JobSpec.model_validate(body).model_dump(mode="json")
    except ValidationError as e:
        raise _prefixed(spec_error(e, body), param_prefix) from None
    pending: list[str] = []
    try:
        resolve_spec(
            session,
            project_id=project.id,
            spec=spec,
            artifacts=settings.resolved_artifacts_dir,
            model_root=settings.model_root,
            hub_downloads=settings.hub_downloads,
            reward_urls=settings.reward_urls,
            reward_functions=settings.reward_functions,
            pending=pending,
        )
    except SpecReferenceError as e:
        raise ApiError(422, e.code, e.message, param=param_prefix + e.param) from None
    given = body.get("hyperparameters") or {}
    chosen = auto_values(
        session,
        project_id=project.id,
        spec=spec,
        given=given,
        artifacts=settings.resolved_artifacts_dir,
        model_root=settings.model_root,
    )
    if chosen:  # the values chosen are stored with the spec, so the job shows what it trains with
        spec["hyperparameters"] = JobSpec.model_validate(
            {**body, "hyperparameters": {**given, **chosen}}
        ).hyperparameters
    processes = spec["resources"]["num_processes"]
    if processes > settings.max_processes:
        message = (f"{processes} processes asked; this server's workers train a job in at most "
                   f"{settings.max_processes} (RLHF_MAX_PROCESSES)")  # fmt: skip
        raise ApiError(422, "too_many_processes", message, param=param_prefix + "resources.num_processes")
    return spec, pending


def _prefixed(error: ApiError, prefix: str) -> ApiError:
    if prefix:
        error.param = prefix + error.param if error.param else prefix.removesuffix(".")
    return error


def send_created(session: Session, settings: Settings, enqueue: Enqueue, jobs: list[Job]) -> None:
    """After the commit: send each new queued job to its train queue (one the broker refuses fails as
    ``enqueue_failed``, and the request answers 503), then release the waiting ones whose dependencies finished
    in the meantime."""
    refused, sent = [], []
    for job in jobs:
        if job.status != "queued":
            continue
        try:
            enqueue(job.id, crud.job_queue(job))
            sent.append(job.id)
        except Exception:
            logger.exception("could not enqueue job %s", job.id)
            crud.transition(
                session,
                job_id=job.id,
                from_statuses=("queued",),
                to="failed",
                finished_at=utcnow(),
                error_code="enqueue_failed",
                error_message="the job could not be queued: the broker did not accept it",
            )
            session.commit()
            refused.append(job.id)
    crud.mark_sent(session, job_ids=sent)
    session.commit()
    if waiting := [dependency for job in jobs if job.status == "waiting" for dependency in dependencies(job.spec)]:
        release_once(settings, enqueue, waiting)  # a dependency may have ended between the check and the commit
    if refused:
        # The broker's own message (SQL, task bodies, routing keys) goes to the log above, never to the client.
        raise ApiError(503, "unavailable", f"the job {refused[0]} was stored but the broker did not accept it")


def _create_or_replay(
    session: Session, project_id: str, spec: dict[str, Any], idempotency_key: str | None, pending: list[str]
) -> tuple[Job, bool]:
    try:
        return crud.create_job(session, project_id=project_id, spec=spec, idempotency_key=idempotency_key,
                               waiting_for=pending)  # fmt: skip
    except IntegrityError:
        if idempotency_key is None:
            raise
        # A concurrent request with the same key won the insert; answer with its job.
        session.rollback()
        return crud.create_job(session, project_id=project_id, spec=spec, idempotency_key=idempotency_key,
                               waiting_for=pending)  # fmt: skip


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

# Per action: (from statuses, to status) moves, tried in order; and the statuses that already answer it.
_MOVES: dict[str, list[tuple[tuple[str, ...], str]]] = {
    "cancel": [(("waiting", "queued", "paused"), "cancelled"), (("running", "pausing"), "cancelling")],
    "pause": [(("running",), "pausing"), (("queued",), "paused")],
    "resume": [(("paused",), "queued")],
}
_ALREADY = {"cancel": ("cancelling",), "pause": ("pausing", "paused"), "resume": ()}


def _control(session: Session, job: Job, action: str) -> str | None:
    """Apply ``action`` with guarded transitions; the new status, or None when it was already under way.

    Retries when a worker changed the status between the read and the update; 409 when the status does
    not allow the action.
    """
    for _ in range(3):
        for from_statuses, to in _MOVES[action]:
            extra = {"finished_at": utcnow(), "worker": None, "lease_until": None} if to in FINAL_STATUSES else {}
            if crud.transition(session, job_id=job.id, from_statuses=from_statuses, to=to, **extra):
                return to
        session.refresh(job)
        if job.status in _ALREADY[action]:
            return None
        if not any(job.status in from_statuses for from_statuses, _ in _MOVES[action]):
            break
    raise ApiError(409, "conflict", f"cannot {action} job {job.id}: it is {job.status}")


def control_job(session: Session, settings: Settings, enqueue: Enqueue, job: Job, action: str) -> None:
    """Cancel, pause or resume ``job`` (see the routes below) and commit; ``job`` is refreshed after."""
    _control(session, job, action)
    session.commit()
    if action == "resume":
        try:
            enqueue(job.id, crud.job_queue(job))
        except Exception as e:
            logger.exception("could not enqueue job %s", job.id)
            crud.transition(session, job_id=job.id, from_statuses=("queued",), to="paused")
            session.commit()
            raise ApiError(503, "unavailable", "the broker did not accept the job, so it stays paused") from e
        crud.mark_sent(session, job_ids=[job.id])
        session.commit()
    session.refresh(job)
    if action == "cancel" and job.status == "cancelled":
        release_once(settings, enqueue, [job.id])  # the jobs waiting for it fail


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

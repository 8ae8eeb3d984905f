"""Jobs for every route that submits, finds or controls one (``/v1/jobs``, ``/v1/pipelines``,
``/v1/fine_tuning/jobs`` and the per-job routes): a spec validated in full, stored, and queued after the commit;
the caller's job or 404; cancel, pause and resume by guarded transitions."""

import logging
from typing import Any

from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.deps import Enqueue
from api.errors import ApiError, not_found, spec_error
from api.schemas import looks_like_id
from engine.spec.config import JobSpec
from engine.spec.memory import WeightsUnreadable, refusal
from jobs.recovery import release_once
from jobs.store import crud
from jobs.store.models import FINAL_STATUSES, SESSION_TYPE, Job, Project, utcnow
from jobs.store.refs import SpecReferenceError, auto_values, dependencies, model_weights_of, resolve_spec
from jobs.store.settings import Settings

logger = logging.getLogger(__name__)


def job_or_404(session: Session, project: Project, job_id: str) -> Job:
    """The caller's job, or 404 — also for another project's job, which is indistinguishable from none."""
    job = crud.get_job(session, job_id=job_id, project_id=project.id) if looks_like_id(job_id) else None
    if job is None:
        raise not_found("job", job_id)
    return job


# --- submit ------------------------------------------------------------------------------------


def validated_spec(
    session: Session, settings: Settings, project: Project, body: dict[str, Any], param_prefix: str = ""
) -> tuple[dict[str, Any], list[str]]:
    """The spec as stored (every default filled in, so equal specs are stored equal: idempotency compares them;
    the epochs or steps and the learning rate it leaves out chosen "auto" from its dataset's rows and its model's
    width, engine/spec/auto.py) and the unfinished jobs it names; a 422 naming the field (after ``param_prefix``) when
    it is refused."""
    _check_processes(settings, body, param_prefix)  # first: the other checks' messages assume a count it can run
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
            judges=settings.judges.keys(),
            source_graders=settings.source_graders,
            own_urls=settings.own_urls,
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
    if spec["hyperparameters"].get("rollout_engine") == "vllm" and settings.vllm() is None:
        # the server's settings are its workers' (docs/deployment.md: the same settings on every host)
        message = (
            "hyperparameters.rollout_engine is vllm, and this server offers no vLLM: its operator sets "
            "RLHF_VLLM_PYTHON (the python of an environment with vLLM installed) or RLHF_VLLM_URL (a running vLLM "
            'server); or use "builtin", the trainer\'s own sampler'
        )
        raise ApiError(
            422, "rollout_engine_unavailable", message, param=param_prefix + "hyperparameters.rollout_engine"
        )
    if (device := settings.device_memory.get(spec["resources"]["queue"])) is not None:
        _check_fits(session, settings, project, spec, int(device), param_prefix)
    return spec, pending


def _check_processes(settings: Settings, body: dict[str, Any], param_prefix: str) -> None:
    """422 ``too_many_processes`` when the spec asks for more processes than this server's workers train a job in:
    checked on the body, before the rules that depend on the count (a batch it divides)."""
    resources = body.get("resources")
    processes = resources.get("num_processes") if isinstance(resources, dict) else None
    if type(processes) is int and processes > settings.max_processes:  # other values: the schema's to refuse
        message = (
            f"{processes} processes asked; this server's workers train a job in at most "
            f"{settings.max_processes} (RLHF_MAX_PROCESSES)"
        )
        raise ApiError(422, "too_many_processes", message, param=param_prefix + "resources.num_processes")


def _check_fits(
    session: Session, settings: Settings, project: Project, spec: dict[str, Any], device: int, param_prefix: str
) -> None:
    """422 ``model_does_not_fit`` when the job's models, as far as their weight files are at hand here, cannot fit
    a GPU of its queue (``RLHF_DEVICE_MEMORY``) as its resources hold them."""
    models = {}
    for field in ("model", "reward_model", "teacher"):
        if not spec.get(field):
            continue
        try:
            weights = model_weights_of(
                session,
                project_id=project.id,
                ref=spec[field],
                artifacts=settings.resolved_artifacts_dir,
                model_root=settings.model_root,
            )
        except WeightsUnreadable as e:  # a weight file whose header does not read: the worker could not load it
            raise ApiError(422, "model_not_found", str(e), param=param_prefix + field) from None
        if weights is not None:
            models[field] = weights
    if "model" in models and (why := refusal(JobSpec.model_validate(spec), models, device, settings.max_processes)):
        raise ApiError(422, "model_does_not_fit", why, param=param_prefix + "resources")


def _prefixed(error: ApiError, prefix: str) -> ApiError:
    if prefix:
        error.param = prefix + error.param if error.param else prefix.removesuffix(".")
    return error


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


def store_job(
    session: Session,
    settings: Settings,
    enqueue: Enqueue,
    project: Project,
    *,
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


def _create_or_replay(
    session: Session, project_id: str, spec: dict[str, Any], idempotency_key: str | None, pending: list[str]
) -> tuple[Job, bool]:
    try:
        return crud.create_job(
            session, project_id=project_id, spec=spec, idempotency_key=idempotency_key, waiting_for=pending
        )
    except IntegrityError:
        if idempotency_key is None:
            raise
        # A concurrent request with the same key won the insert; answer with its job.
        session.rollback()
        return crud.create_job(
            session, project_id=project_id, spec=spec, idempotency_key=idempotency_key, waiting_for=pending
        )


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


# --- cancel, pause, resume ---------------------------------------------------------------------

# Per action: (from statuses, to status) moves, tried in order; and the statuses that already answer it.
_MOVES: dict[str, list[tuple[tuple[str, ...], str]]] = {
    "cancel": [(("waiting", "queued", "paused"), "cancelled"), (("running", "pausing"), "cancelling")],
    "pause": [(("running",), "pausing"), (("queued",), "paused")],
    "resume": [(("paused",), "queued")],
}
_ALREADY = {"cancel": ("cancelling",), "pause": ("pausing", "paused"), "resume": ()}


def _transition(session: Session, job: Job, action: str) -> str | None:
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
    """Cancel, pause or resume ``job`` and commit; ``job`` is refreshed after.

    Cancel: a waiting, queued or paused job at once, a running one cooperatively (``cancelling`` until its worker
    stops between steps), and the jobs waiting for it fail (``dependency_failed``). Pause: a running job saves a
    checkpoint between steps and stops (``pausing`` → ``paused``), a queued one is paused before it starts.
    Resume: a paused job is queued again (503, and it stays paused, when the broker refuses it). 409 when the
    job's status does not allow the action."""
    if job.type == SESSION_TYPE and action != "cancel":
        raise ApiError(
            409,
            "conflict",
            f"cannot {action} job {job.id}: a training session is driven by its client; "
            "save its state from the client (save_state) and cancel it, or let the client close it",
        )
    _transition(session, job, action)
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

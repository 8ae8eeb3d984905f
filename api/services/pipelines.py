"""Pipelines: several job specs stored in one transaction, later stages naming earlier ones as ``stage:<name>``.

Each ``stage:<name>`` becomes ``job:<id>`` of that stage's job; a stage that names an unfinished one waits for it
(jobs.store.pipelines) and runs when it succeeds, with no further call. A refused stage stores none.
"""

from contextlib import suppress
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.deps import Enqueue
from api.errors import ApiError
from api.services.jobs import check_pending, send_created, validated_spec
from engine.rewards.graders import replace_models
from engine.spec.config import MODEL_FIELDS
from jobs.store import crud
from jobs.store.models import Job, Project
from jobs.store.settings import Settings

STAGE_PREFIX = "stage:"


def store_pipeline(
    session: Session,
    settings: Settings,
    enqueue: Enqueue,
    project: Project,
    *,
    stages: dict[str, dict[str, Any]],
    idempotency_key: str | None,
) -> tuple[dict[str, Job], bool]:
    """Validate every stage in full (a 422's ``param`` is ``stages.<name>.<field>``), store them all and queue
    the stages that can start after the commit; (the job of each stage, whether they are new).

    With an ``idempotency_key`` used before: the jobs it created, if ``stages`` are the same (names, order and specs
    as stored); 409 if not. A pipeline's key is its own: it never matches a ``/v1/jobs`` key."""
    if idempotency_key is not None:
        earlier = crud.pipeline_jobs(session, project_id=project.id, pipeline_key=idempotency_key)
        if earlier:
            return _replayed(session, settings, enqueue, project, stages, earlier), False
    check_pending(session, settings, project, len(stages))
    jobs: dict[str, Job] = {}
    try:
        for name, stage_body in stages.items():
            stage = _with_stage_refs(stage_body, {stage: job.id for stage, job in jobs.items()}, name)
            spec, pending = validated_spec(session, settings, project, stage, f"stages.{name}.")
            jobs[name], _ = crud.create_job(
                session,
                project_id=project.id,
                spec=spec,
                idempotency_key=None,
                waiting_for=pending,
                pipeline_key=idempotency_key,
                stage=name if idempotency_key is not None else None,
            )
    except IntegrityError:
        if idempotency_key is None:
            raise
        # A concurrent request with the same key stored its stages first; answer as a retry of it.
        session.rollback()
        earlier = crud.pipeline_jobs(session, project_id=project.id, pipeline_key=idempotency_key)
        return _replayed(session, settings, enqueue, project, stages, earlier), False
    session.commit()
    send_created(session, settings, enqueue, list(jobs.values()))
    for job in jobs.values():
        session.refresh(job)
    return jobs, True


def _replayed(
    session: Session,
    settings: Settings,
    enqueue: Enqueue,
    project: Project,
    stages: dict[str, dict[str, Any]],
    earlier: dict[str, Job],
) -> dict[str, Job]:
    """The jobs an earlier request with the same key created, if ``stages`` are the same (names, order and specs
    as stored: defaults and auto values filled in); 409 if not. A stage whose message never went out is sent
    now."""
    ids = {name: job.id for name, job in earlier.items()}
    same = list(stages) == list(earlier) and all(
        _stored_form(session, settings, project, _with_stage_refs(stage_body, ids, name)) == earlier[name].spec
        for name, stage_body in stages.items()
    )
    if not same:
        raise ApiError(
            409, "conflict", "this Idempotency-Key was already used with a different pipeline", param="Idempotency-Key"
        )
    if unsent := [job for job in earlier.values() if job.status == "queued" and job.sent_at is None]:
        send_created(session, settings, enqueue, unsent)  # its first request stopped before sending them
        for job in unsent:
            session.refresh(job)
    return earlier


def _stored_form(session: Session, settings: Settings, project: Project, body: dict[str, Any]) -> dict[str, Any] | None:
    """A stage's spec as it is stored (every default and auto value filled in), or None when it is refused now."""
    try:
        return validated_spec(session, settings, project, body)[0]
    except ApiError:
        return None


def _with_stage_refs(body: dict[str, Any], ids: dict[str, str], stage: str) -> dict[str, Any]:
    """``body`` with each ``stage:<name>`` of an earlier stage as ``job:<its id>``; 422 for any other stage."""

    def resolved(param: str, ref: Any) -> Any:
        if not isinstance(ref, str) or not ref.startswith(STAGE_PREFIX):
            return ref
        name = ref.removeprefix(STAGE_PREFIX)
        if name not in ids:
            earlier = ", ".join(ids) or "none"
            raise ApiError(
                422,
                "stage_not_found",
                f"{ref!r} names no earlier stage (earlier: {earlier})",
                param=f"stages.{stage}.{param}",
            )
        return f"job:{ids[name]}"

    body = {**body, **{field: resolved(field, body[field]) for field in ("model", *MODEL_FIELDS) if field in body}}
    for field in ("reward", "eval_reward"):
        if isinstance(body.get(field), dict):
            with suppress(AttributeError, KeyError, TypeError):  # not a grader: JobSpec's validation says so
                body[field] = replace_models(body[field], resolved, field)
    return body

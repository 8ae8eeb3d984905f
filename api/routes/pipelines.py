"""``POST /v1/pipelines``: several job specs in one request, later stages naming earlier ones as ``stage:<name>``.

Every stage is validated and stored in one transaction (a refused stage stores none), each ``stage:<name>`` becoming
``job:<id>`` of that stage's job; a stage that names an unfinished one waits for it (jobs.store.pipelines) and
runs when it succeeds, with no further call.
"""

from contextlib import suppress
from typing import Annotated, Any

from fastapi import APIRouter, Header, Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.deps import CurrentProject, Enqueue, EnqueueDep, SessionDep, SettingsDep
from api.errors import ApiError, ErrorResponse, error_responses
from api.routes.jobs import check_pending, send_created, validated_spec
from api.schemas import JobPublic
from engine.graders import replace_models
from jobs.store import crud
from jobs.store.models import Job, Project
from jobs.store.settings import Settings

router = APIRouter(prefix="/pipelines", tags=["jobs"])

STAGE = r"^[a-z0-9][a-z0-9_-]{0,63}$"
MAX_STAGES = 16
STAGE_PREFIX = "stage:"

PIPELINE_EXAMPLE: dict[str, Any] = {
    "stages": {
        "sft": {"type": "sft", "model": "builtin:tiny", "dataset": "builtin:reviews-sft"},
        "rm": {"type": "rm", "model": "stage:sft", "dataset": "builtin:reviews-prefs"},
        "ppo": {"type": "ppo", "model": "stage:sft", "reward_model": "stage:rm", "dataset": "builtin:reviews-prompts"},
    }
}


class PipelineCreate(BaseModel):
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, json_schema_extra={"example": PIPELINE_EXAMPLE}
    )

    stages: Annotated[
        dict[Annotated[str, Field(pattern=STAGE)], dict[str, Any]], Field(min_length=1, max_length=MAX_STAGES)
    ]
    """Job specs by stage name, in order; ``model``, ``reward_model`` and reward graders' ``model`` may name an
    earlier stage as ``stage:<name>``."""


class PipelinePublic(BaseModel):
    object: str = "pipeline"
    stages: dict[str, JobPublic]
    """The job of each stage: ``queued`` where it can start, ``waiting`` for the stages it names."""


@router.post(
    "",
    status_code=201,
    responses={
        200: {"model": PipelinePublic, "description": "The jobs an earlier request with this Idempotency-Key created."},
        409: {"model": ErrorResponse, "description": "The Idempotency-Key was used with a different pipeline."},
        429: {"model": ErrorResponse, "description": "The project has too many queued and waiting jobs."},
        **error_responses(400, 503, 507),
    },
)
def create_pipeline(
    session: SessionDep,
    settings: SettingsDep,
    project: CurrentProject,
    enqueue: EnqueueDep,
    response: Response,
    body: PipelineCreate,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key", max_length=200, description="Retrying with the same key returns the same jobs."
        ),
    ] = None,
) -> PipelinePublic:
    """Validate every stage in full (a 422's ``param`` is ``stages.<name>.<field>``), store them all, and queue
    the stages that can start; the others wait for the stages they name.

    Retried with the same ``Idempotency-Key`` and the same stages, it answers the jobs it created (200); with other
    stages (names or specs), 409. A pipeline's key is its own: it never matches a ``/v1/jobs`` key."""
    if idempotency_key is not None:
        earlier = crud.pipeline_jobs(session, project_id=project.id, pipeline_key=idempotency_key)
        if earlier:
            response.status_code = 200
            return _replayed(session, settings, project, enqueue, body, earlier)
    check_pending(session, settings, project, len(body.stages))
    jobs: dict[str, Job] = {}
    try:
        for name, stage_body in body.stages.items():
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
        response.status_code = 200
        earlier = crud.pipeline_jobs(session, project_id=project.id, pipeline_key=idempotency_key)
        return _replayed(session, settings, project, enqueue, body, earlier)
    session.commit()
    send_created(session, settings, enqueue, list(jobs.values()))
    for job in jobs.values():
        session.refresh(job)
    return PipelinePublic(stages={name: JobPublic.of(job) for name, job in jobs.items()})


def _replayed(
    session: Session,
    settings: Settings,
    project: Project,
    enqueue: Enqueue,
    body: PipelineCreate,
    earlier: dict[str, Job],
) -> PipelinePublic:
    """The pipeline an earlier request with the same key created, if ``body`` asks for the same stages (names, order
    and specs as stored: defaults and auto values filled in); 409 if not. A stage whose message never went out is
    sent now."""
    ids = {name: job.id for name, job in earlier.items()}
    same = list(body.stages) == list(earlier) and all(
        _stored_form(session, settings, project, _with_stage_refs(stage_body, ids, name)) == earlier[name].spec
        for name, stage_body in body.stages.items()
    )
    if not same:
        raise ApiError(
            409, "conflict", "this Idempotency-Key was already used with a different pipeline", param="Idempotency-Key"
        )
    if unsent := [job for job in earlier.values() if job.status == "queued" and job.sent_at is None]:
        send_created(session, settings, enqueue, unsent)  # its first request stopped before sending them
        for job in unsent:
            session.refresh(job)
    return PipelinePublic(stages={name: JobPublic.of(job) for name, job in earlier.items()})


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
            raise ApiError(422, "stage_not_found", f"{ref!r} names no earlier stage (earlier: {earlier})",
                           param=f"stages.{stage}.{param}")  # fmt: skip
        return f"job:{ids[name]}"

    body = {**body, **{field: resolved(field, body[field]) for field in ("model", "reward_model") if field in body}}
    for field in ("reward", "eval_reward"):
        if isinstance(body.get(field), dict):
            with suppress(AttributeError, KeyError, TypeError):  # not a grader: JobSpec's validation says so
                body[field] = replace_models(body[field], resolved, field)
    return body

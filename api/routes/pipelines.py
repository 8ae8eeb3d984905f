"""``POST /v1/pipelines``: several job specs in one request, later stages naming earlier ones as ``stage:<name>``
(stored and queued by ``api.services.pipelines``)."""

from typing import Annotated, Any

from fastapi import APIRouter, Header, Response
from pydantic import BaseModel, ConfigDict, Field

from api.deps import CurrentProject, EnqueueDep, SessionDep, SettingsDep
from api.errors import ErrorResponse, error_responses
from api.schemas import JobPublic
from api.services.pipelines import store_pipeline

router = APIRouter(prefix="/pipelines", tags=["jobs"])

STAGE = r"^[a-z0-9][a-z0-9_-]{0,63}$"
MAX_STAGES = 16

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
    """Job specs by stage name, in order; ``model``, the other model fields (``reward_model``, ``teacher``) and
    reward graders' ``model`` may name an earlier stage as ``stage:<name>``."""


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
    jobs, created = store_pipeline(
        session, settings, enqueue, project, stages=body.stages, idempotency_key=idempotency_key
    )
    if not created:
        response.status_code = 200
    return PipelinePublic(stages={name: JobPublic.of(job) for name, job in jobs.items()})

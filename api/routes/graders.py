"""``/v1/fine_tuning/alpha/graders``: OpenAI's endpoints for trying a grader before a job pays for it, driven by the
``openai`` client's ``fine_tuning.alpha.graders.run`` and ``.validate``. Thin: api/services/graders.py runs them."""

from typing import Any

import anyio
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from api.deps import CurrentProject, ReleaseDb, SettingsDep
from api.errors import ErrorResponse, error_responses
from api.services import graders as service

router = APIRouter(prefix="/fine_tuning/alpha/graders", tags=["openai"])


class GraderValidateRequest(BaseModel):
    grader: dict[str, Any]
    """The grader, in OpenAI's JSON (or this server's other kinds: ``http``, ``python`` with ``function``)."""


class GraderRunRequest(GraderValidateRequest):
    model_sample: str = Field(max_length=1_000_000)
    """The model output graded: ``sample.output_text`` (and ``sample.output_json`` when it is JSON)."""
    item: Any = None
    """The dataset row: ``item`` of the templates and of ``grade(sample, item)``."""


@router.post("/validate", responses=error_responses(400))
def validate_grader(body: GraderValidateRequest, settings: SettingsDep, _project: CurrentProject) -> dict[str, Any]:
    """The grader back when a job would accept it as its reward and the sandbox here offers what its source
    graders import; a 400 naming the field otherwise."""
    grader = service.checked_grader(settings, body.grader)
    return {"grader": grader.model_dump(mode="json", exclude_none=True)}


@router.post(
    "/run",
    responses={
        429: {"model": ErrorResponse, "description": "The project has RLHF_GRADER_RUNS_PER_PROJECT runs grading."},
        **error_responses(400),
    },
)
async def run_grader(
    request: Request, body: GraderRunRequest, settings: SettingsDep, project: CurrentProject, release_db: ReleaseDb
) -> dict[str, Any]:
    """The grader's reward of ``model_sample`` for ``item``, with its sub-rewards and OpenAI's error flags. It grades
    off the event loop and without a database connection, within ``RLHF_GRADER_RUN_SECONDS`` (400
    ``grader_run_timeout``), at most ``RLHF_GRADER_RUNS_PER_PROJECT`` at once per project (429
    ``too_many_grader_runs``); its grading stops when the client leaves."""
    project_id = project.id
    await release_db()
    grader = await anyio.to_thread.run_sync(service.checked_grader, settings, body.grader)
    return await service.run_within_budget(
        request, settings, project_id, grader, model_sample=body.model_sample, item=body.item
    )

"""``/v1/fine_tuning/alpha/graders``: OpenAI's endpoints for trying a grader before a job pays for it, driven by the
``openai`` client's ``fine_tuning.alpha.graders.run`` and ``.validate``. Thin: api/services/graders.py runs them."""

from typing import Any

import anyio
from fastapi import APIRouter
from pydantic import BaseModel, Field

from api.deps import CurrentProject, SettingsDep
from api.errors import error_responses
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
    """The grader back when a job would accept it as its reward; a 400 naming the field otherwise."""
    grader = service.checked_grader(settings, body.grader)
    return {"grader": grader.model_dump(mode="json", exclude_none=True)}


@router.post("/run", responses=error_responses(400))
async def run_grader(body: GraderRunRequest, settings: SettingsDep, _project: CurrentProject) -> dict[str, Any]:
    """The grader's reward of ``model_sample`` for ``item``, with its sub-rewards and OpenAI's error flags. A judge
    or a source grader runs off the event loop."""
    grader = service.checked_grader(settings, body.grader)
    return await anyio.to_thread.run_sync(service.run, settings, grader, body.model_sample, body.item)

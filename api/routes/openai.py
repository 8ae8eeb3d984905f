"""OpenAI-compatible endpoints: ``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions``,
so the official ``openai`` client (or any tool speaking that API) can sample from the project's policies.

Models are ``job:<id>`` (the final model of a succeeded job that trains a policy: any type but a reward model's)
and ``job:<id>@<step>`` (any kept checkpoint, also of a job still training), as in job specs. Same key, project
scoping, body cap and error envelope as the rest of the API; generation runs on an inference worker through the
``rlhf.generate`` task.
"""

import re
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from sqlalchemy.orm import Session

from api.deps import CurrentProject, GenerateDep, SessionDep
from api.errors import ApiError, ErrorResponse, error_responses
from api.openai_schemas import (
    DEFAULT_MAX_TOKENS,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Delta,
    Model,
    ModelList,
    Sampling,
    Usage,
)
from api.queue import run_generation
from api.schemas import MAX_INT32
from jobs.store import crud
from jobs.store.models import Checkpoint, Job, Project
from jobs.store.refs import GENERATING_JOB_TYPES, SpecReferenceError, generates, sampler_save_ref

router = APIRouter(tags=["openai"])

_MODEL_ID = re.compile(r"^job:([A-Za-z0-9_-]{1,40})(?:@(\d{1,10}))?$")

_STREAM_DESCRIPTION = (
    "With `stream: true`: `text/event-stream` of `data: {chunk}` events, then `data: [DONE]`. The text is "
    "generated in full on the inference worker first, then sent in chunks (one per word)."
)


# --- models ------------------------------------------------------------------------------------


def _model_not_found(model: str, why: str = "") -> ApiError:
    return ApiError(
        404,
        "model_not_found",
        f"the model {model!r} does not exist in this project{why}; GET /v1/models lists them",
        param="model",
    )


def _list_models(session: Session, project: Project) -> ModelList:
    jobs = crud.list_jobs_of_types(session, project_id=project.id, job_types=GENERATING_JOB_TYPES)
    checkpoints = crud.checkpoints_by_job(session, job_ids=[job.id for job in jobs])
    data = []
    for job in jobs:
        kept = checkpoints[job.id]
        final = _final_checkpoint(job, kept)
        if final is not None:
            data.append(Model(id=f"job:{job.id}", created=_unix(final), owned_by=project.name))
        data += [Model(id=f"job:{job.id}@{c.step}", created=_unix(c), owned_by=project.name) for c in kept]
    return ModelList(data=data)


def _unix(checkpoint: Checkpoint) -> int:
    created = checkpoint.created_at
    return int((created if created.tzinfo else created.replace(tzinfo=UTC)).timestamp())


def _final_checkpoint(job: Job, kept: list[Checkpoint]) -> Checkpoint | None:
    """A succeeded job's final model: its output step's checkpoint (the newest when none is recorded)."""
    if job.status != "succeeded" or not kept:
        return None
    if job.output_step is None:
        return kept[-1]
    return next((c for c in kept if c.step == job.output_step), None)


def _resolve(session: Session, project: Project, model: str) -> tuple[str, int, Checkpoint]:
    """(job id, step, checkpoint) of a model id of the caller's project (``job:<id>``, ``job:<id>@<step>``, or a
    training session's sampler weights by name); 404 ``model_not_found`` otherwise."""
    try:
        saved = sampler_save_ref(session, project_id=project.id, ref=model[:1000], param="model")
    except SpecReferenceError as e:
        raise _model_not_found(model, f": {e.message}") from None
    match = _MODEL_ID.match(saved or model)
    if match is None:
        raise _model_not_found(model, " (model ids are job:<id>, job:<id>@<step> or job:<session>@<name>)")
    job_id, step = match.group(1), match.group(2)
    job = crud.get_job(session, job_id=job_id, project_id=project.id)
    if job is None:
        raise _model_not_found(model)
    if not generates(job.type):
        raise _model_not_found(model, f": job {job.id} trains a reward model, which scores text but does not generate")
    if step is not None:
        checkpoint = crud.get_checkpoint(session, job_id=job.id, step=int(step)) if int(step) <= MAX_INT32 else None
        if checkpoint is None:
            raise _model_not_found(model, f": job {job.id} has no checkpoint at step {step}")
        return job.id, checkpoint.step, checkpoint
    final = _final_checkpoint(job, crud.list_checkpoints(session, job_id=job.id))
    if final is None:
        raise _model_not_found(
            model, f": job {job.id} is {job.status}, so it has no final model; name a checkpoint, job:{job.id}@<step>"
        )
    return job.id, final.step, final


@router.get("/models", response_model=ModelList, responses=error_responses(500))
def list_models(session: SessionDep, project: CurrentProject) -> ModelList:
    """The project's models in OpenAI's list format: each succeeded job that trains a policy as ``job:<id>`` (its
    final model) and every kept checkpoint of its policy jobs, finished or still training, as ``job:<id>@<step>``.
    Reward models are left out: they do not generate."""
    return _list_models(session, project)


@router.get("/models/{model_id}", response_model=Model, responses=error_responses(500))
def get_model(session: SessionDep, project: CurrentProject, model_id: str) -> Model:
    """One model of the project (``job:<id>`` or ``job:<id>@<step>``)."""
    checkpoint = _resolve(session, project, model_id)[2]
    return Model(id=model_id, created=_unix(checkpoint), owned_by=project.name)


# --- generation --------------------------------------------------------------------------------


def _lookup(session: Session, project: Project, model: str) -> tuple[str, int]:
    job_id, step, _ = _resolve(session, project, model)
    session.close()  # release the connection before the (long) wait
    return job_id, step


def _task_kwargs(body: Sampling, job_id: str, step: int, max_tokens: int | None) -> dict[str, Any]:
    seed = body.seed if body.seed is not None else secrets.randbelow(MAX_INT32 + 1)
    return {
        "job_id": job_id,
        "step": step,
        "prompts": [],
        "max_new_tokens": max_tokens or DEFAULT_MAX_TOKENS,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "seed": seed,
        "score": False,
        "n": body.n or 1,
        "stop": body.stop_list,
    }


def _usage(result: dict[str, Any]) -> Usage:
    counts = result.get("usage") or {}
    prompt, completion = int(counts.get("prompt_tokens", 0)), int(counts.get("completion_tokens", 0))
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _words(text: str) -> list[str]:
    """``text`` in stream pieces: each word with the spaces before it (joined, they are ``text`` again)."""
    return re.findall(r"\s*\S+|\s+$", text)


def _sse(chunk: BaseModel | str) -> str:
    data = chunk if isinstance(chunk, str) else chunk.model_dump_json(exclude_none=False)
    return f"data: {data}\n\n"


def _event_stream(chunks: Iterator[BaseModel]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        for chunk in chunks:
            yield _sse(chunk)
        yield _sse("[DONE]")

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}, "description": _STREAM_DESCRIPTION},
    404: {"model": ErrorResponse, "description": "No such model in the caller's project."},
    503: {"model": ErrorResponse, "description": "No inference worker answered in time."},
    **error_responses(400, 500),
}


@router.post("/completions", response_model=CompletionResponse, responses=_RESPONSES)
async def create_completion(
    request: Request, session: SessionDep, project: CurrentProject, wait_for: GenerateDep, body: CompletionRequest
) -> Any:
    """OpenAI's legacy completions: ``n`` choices per prompt (prompt by prompt: choice ``i * n + j`` is prompt
    ``i``'s ``j``-th sample), cut at ``stop`` strings.

    ``stream: true`` answers with Server-Sent Events, but not token by token: the worker generates each text
    in full, then the API sends it as chunks (one per word), each choice ending with its ``finish_reason``,
    then ``data: [DONE]``. The concatenated chunks are the text the same request gives unstreamed."""
    job_id, step = await anyio.to_thread.run_sync(_lookup, session, project, body.model)
    kwargs = _task_kwargs(body, job_id, step, body.max_tokens)
    kwargs["prompts"] = body.prompts
    result = await run_generation(request, wait_for, kwargs)
    ident, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())
    rows = result.get("completions", [])
    usage = _usage(result)
    if not body.stream:
        choices = [
            CompletionChoice(index=i, text=row["text"], finish_reason=row["finish_reason"])
            for i, row in enumerate(rows)
        ]
        return CompletionResponse(id=ident, created=created, model=body.model, choices=choices, usage=usage)

    def chunks() -> Iterator[BaseModel]:
        for i, row in enumerate(rows):
            pieces = _words(row["text"]) or [""]
            for k, piece in enumerate(pieces):
                last = k == len(pieces) - 1
                choice = CompletionChoice(index=i, text=piece, finish_reason=row["finish_reason"] if last else None)
                yield CompletionResponse(id=ident, created=created, model=body.model, choices=[choice])
        if body.stream_options is not None and body.stream_options.include_usage:
            yield CompletionResponse(id=ident, created=created, model=body.model, choices=[], usage=usage)

    return _event_stream(chunks())


@router.post("/chat/completions", response_model=ChatCompletionResponse, responses=_RESPONSES)
async def create_chat_completion(
    request: Request, session: SessionDep, project: CurrentProject, wait_for: GenerateDep, body: ChatCompletionRequest
) -> Any:
    """OpenAI's chat completions, for models whose tokenizer has a chat template: the messages are formatted
    with it (``add_generation_prompt``) and completed; ``n`` choices, cut at ``stop`` strings. A model without a
    template answers 400 ``chat_template_missing`` (use ``/v1/completions`` with a plain prompt instead).

    ``stream: true`` answers with Server-Sent Events, but not token by token: the worker generates each text
    in full, then the API sends it as ``chat.completion.chunk`` events (a first ``delta: {role: assistant}``,
    then one per word, then the ``finish_reason``), then ``data: [DONE]``."""
    job_id, step = await anyio.to_thread.run_sync(_lookup, session, project, body.model)
    kwargs = _task_kwargs(body, job_id, step, body.max_completion_tokens or body.max_tokens)
    kwargs["messages"] = [{"role": m.role, "content": m.text} for m in body.messages]
    result = await run_generation(request, wait_for, kwargs)
    ident, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
    rows = result.get("completions", [])
    usage = _usage(result)
    if not body.stream:
        choices = [
            ChatChoice(index=i, message=AssistantMessage(content=row["text"]), finish_reason=row["finish_reason"])
            for i, row in enumerate(rows)
        ]
        return ChatCompletionResponse(id=ident, created=created, model=body.model, choices=choices, usage=usage)

    def chunk(*choices: ChatChunkChoice, usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=ident, created=created, model=body.model, choices=list(choices), usage=usage)

    def chunks() -> Iterator[BaseModel]:
        for i, row in enumerate(rows):
            yield chunk(ChatChunkChoice(index=i, delta=Delta(role="assistant", content="")))
            for piece in _words(row["text"]):
                yield chunk(ChatChunkChoice(index=i, delta=Delta(content=piece)))
            yield chunk(ChatChunkChoice(index=i, delta=Delta(), finish_reason=row["finish_reason"]))
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunk(usage=usage)

    return _event_stream(chunks())

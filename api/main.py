"""The FastAPI application: ``create_app(settings)`` and the module-level ``app`` that ``uvicorn api.main:app``
serves. Creating the app touches neither the database nor the broker."""

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import APIRouter, Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi

from api.deps import Enqueue, Generate, reject_unknown_query
from api.errors import error_responses, install_error_handlers
from api.queue import celery_enqueue, celery_generate
from api.routes import (
    dashboard,
    files,
    fine_tuning,
    generate,
    graders,
    health,
    job_types,
    jobs,
    model_download,
    pipelines,
    samples,
    stream,
    tensorboard,
    tinker,
)
from api.routes import openai as openai_routes
from api.routes.files import remove_stale_uploads
from api.services import graders as graders_service
from api.uploads import BodySizeLimit
from engine.spec.config import JOB_TYPES, JobSpec
from jobs.celery_app import celery_app, make_celery
from jobs.recovery import RecoveryThread
from jobs.store.settings import Settings, get_settings

logger = logging.getLogger(__name__)

_JOB_TYPE_LINES = "\n".join(f"- `{name}`: {info.summary}" for name, info in JOB_TYPES.items())
DESCRIPTION = f"""Train language models from human feedback, as jobs each described by one JSON spec, of these
types (`GET /v1/job_types` gives each one's dataset kind, defaults and headline metrics):

{_JOB_TYPE_LINES}

Upload JSONL datasets, create jobs (one by one, or as a pipeline whose stages start from earlier ones), follow
their metrics live, and sample from any checkpoint, also through OpenAI's completion and fine-tuning APIs.

Every request under `/v1` needs `Authorization: Bearer <key>`. Errors answer
`{{"error": {{"code", "message", "param", "type"}}}}`."""

TAGS = [
    {"name": "files", "description": "JSONL datasets, validated line by line before they are stored."},
    {
        "name": "jobs",
        "description": f"Training jobs ({', '.join(JOB_TYPES)}) and pipelines of them: create, follow, control, "
        "download.",
    },
    {"name": "generation", "description": "Sampling from any checkpoint of a job that trains a policy."},
    {
        "name": "openai",
        "description": "OpenAI's models, completions, chat completions and fine-tuning APIs over the same jobs.",
    },
    {
        "name": "tinker",
        "description": "The Tinker-compatible training API (`/api/v1`) that the official `tinker` SDK drives: a "
        "session trains models with the client's own loop (`X-API-Key: tml-<key>`).",
    },
    {"name": "health", "description": "Liveness and readiness, without a key."},
]
"""The OpenAPI tags of the routes, in the order ``/docs`` shows them."""


def create_app(
    settings: Settings | None = None,
    *,
    enqueue: Enqueue | None = None,
    generate_with: Generate | None = None,
    recovery_interval: float | None = 30.0,
    poll_interval: float = 0.5,
    heartbeat_interval: float = 15.0,
    generate_timeout: float = 120.0,
    generate_concurrency: int = 32,
) -> FastAPI:
    """The API for ``settings`` (default: from the ``RLHF_*`` environment).

    ``enqueue`` and ``generate_with`` replace the Celery calls (tests); ``recovery_interval`` None turns off
    the periodic recovery of expired leases; ``poll_interval`` and ``heartbeat_interval`` pace the SSE
    stream; ``generate_timeout`` bounds the wait for an inference worker.
    """
    if settings is None:
        settings = get_settings()
    celery = celery_app if settings is get_settings() else make_celery(settings)
    enqueue = enqueue or celery_enqueue(celery)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.check()
        if removed := remove_stale_uploads(settings.resolved_artifacts_dir / "files"):
            logger.info("removed %d temporary files of interrupted uploads", len(removed))
        recovery = None
        if recovery_interval is not None:
            recovery = RecoveryThread(settings, enqueue, recovery_interval)
            # at once, not after one interval: the jobs a stopped API committed but never sent, among others
            await anyio.to_thread.run_sync(recovery.sweep, 0.0)
            recovery.start()
        try:
            yield
        finally:
            if recovery is not None:
                recovery.stop()

    app = FastAPI(
        title="rlhf-server",
        version="0.1.0",
        description=DESCRIPTION,
        openapi_tags=TAGS,
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.celery = celery
    app.state.enqueue = enqueue
    app.state.generate = generate_with or celery_generate(celery, generate_timeout)
    app.state.generate_limiter = anyio.CapacityLimiter(generate_concurrency)
    app.state.grader_runs = graders_service.RunningGraders()
    app.state.poll_interval = poll_interval
    app.state.heartbeat_interval = heartbeat_interval
    install_error_handlers(app)
    app.add_middleware(
        BodySizeLimit,
        upload_path="/v1/files",
        max_upload_bytes=settings.max_upload_bytes,
        max_request_bytes=settings.max_request_bytes,
    )
    if settings.cors_origins:  # closed by default: without the headers, browsers refuse cross-origin calls
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "Idempotency-Key", "Last-Event-ID"],
            allow_credentials=False,  # keys travel in the Authorization header, never in cookies
        )

    v1 = APIRouter(
        prefix="/v1", responses=error_responses(401, 404, 413, 422), dependencies=[Depends(reject_unknown_query)]
    )
    for module in (
        files,
        job_types,
        jobs,
        pipelines,
        samples,
        stream,
        tensorboard,
        model_download,
        generate,
        openai_routes,
        fine_tuning,
        graders,
    ):
        v1.include_router(module.router)
    v1.include_router(fine_tuning.checkpoints_router)
    app.include_router(v1)
    app.include_router(tinker.router, responses=error_responses(400, 401, 404))  # /api/v1: the tinker SDK's paths
    app.include_router(health.router)
    app.include_router(dashboard.router)  # `/` and `/static/…`: the web dashboard, outside the schema
    app.openapi = _openapi_with_job_spec(app)  # type: ignore[method-assign]
    return app


def _openapi_with_job_spec(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """OpenAPI generation that documents ``POST /v1/jobs``'s body as ``JobSpec`` (the route validates it
    itself, to name the exact field of a bad spec)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title,
            version=app.version,
            description=app.description,
            routes=app.routes,
            tags=app.openapi_tags,
        )
        spec_schema = JobSpec.model_json_schema(ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(spec_schema.pop("$defs", {}))
        components["JobSpec"] = spec_schema
        body = schema["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]
        body["schema"] = {"$ref": "#/components/schemas/JobSpec"}
        app.openapi_schema = schema
        return schema

    return openapi


app = create_app()

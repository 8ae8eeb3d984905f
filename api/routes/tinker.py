"""The Tinker-compatible API at ``/api/v1``: the paths, bodies and answers of the official ``tinker`` SDK (0.38),
so that a user's own training loop (``forward_backward``, ``optim_step``, ``sample``, ``save_state``) runs on this
server's workers. Thin: api/services/sessions.py holds the logic, jobs/session.py runs the operations.

Authentication is the SDK's ``X-API-Key`` header, a project key given as ``tml-<key>``. Operations answer a future
(``request_id``); ``retrieve_future`` holds the request up to :data:`LONG_POLL_S` for its result, then asks the
client to try again, as the SDK expects."""

import time
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Header, Query, Request, Security
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.security import APIKeyHeader

from api.deps import EnqueueDep, SettingsDep
from api.errors import ApiError
from api.services import sessions as service
from api.tinker_schemas import (
    SEQ_MAX,
    CancelFutureRequest,
    ClientConfigRequest,
    CreateModelRequest,
    CreateSamplingSessionRequest,
    CreateSessionRequest,
    FinishSessionRequest,
    Future,
    LoadWeightsRequest,
    ModelRequest,
    OptimStepRequest,
    RetrieveFutureRequest,
    SampleRequest,
    SaveWeightsExternalRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    SessionHeartbeatRequest,
    TtlRequest,
    WeightsInfoRequest,
)
from jobs.store import sessions
from jobs.store.db import session_scope
from jobs.store.models import Project
from jobs.store.settings import Settings

LONG_POLL_S = 25.0
"""How long ``retrieve_future`` waits for a result before answering ``try_again`` (the SDK's timeout is 45 s)."""
POLL_S = (0.005, 0.05)
"""The first and the longest pause between two looks at a pending request."""


API_KEY = APIKeyHeader(name="X-API-Key", auto_error=False, description="a project key given as tml-<key>")
"""The SDK's authentication, declared in the OpenAPI document as the Tinker routes' security scheme."""


def tinker_project(
    settings: SettingsDep,
    x_api_key: Annotated[str | None, Security(API_KEY)] = None,
    x_stainless_package_version: Annotated[str | None, Header()] = None,
) -> Project:
    """The caller's project, for an SDK version this server speaks. Its own short database session: a long-polling
    route holds no connection while it waits."""
    service.check_sdk(x_stainless_package_version)
    with session_scope(settings.resolved_database_url) as session:
        return service.project_for_key(session, x_api_key)


TinkerProject = Annotated[Project, Depends(tinker_project)]
Offset = Annotated[int, Query(ge=0, le=SEQ_MAX)]
"""A listing's offset: a 4xx past what a database offset takes."""
router = APIRouter(prefix="/api/v1", tags=["tinker"])


def _db(settings: Settings) -> Any:
    return session_scope(settings.resolved_database_url)


# --- client, capabilities, sessions ----------------------------------------------------------------


@router.post("/client/config")
def client_config(body: ClientConfigRequest, settings: SettingsDep, _project: TinkerProject) -> dict[str, Any]:
    service.check_sdk(body.sdk_version)
    return service.client_config(settings)


@router.post("/client/dynamic_config")
def dynamic_config(_project: TinkerProject) -> dict[str, Any]:
    """The SDK cancels the samples whose result it stopped waiting for (``cancel_future``): their worker stops
    them between decoding steps."""
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": True, "sample_cancel_max_batch_size": 64}


@router.get("/get_server_capabilities")
def server_capabilities(settings: SettingsDep, _project: TinkerProject) -> dict[str, Any]:
    return service.capabilities(settings)


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.post("/telemetry")
def telemetry(_project: TinkerProject) -> dict[str, str]:
    """Accepted and dropped: this server sends nothing anywhere."""
    return {"status": "accepted"}


@router.post("/create_session")
def create_session(body: CreateSessionRequest, settings: SettingsDep, project: TinkerProject) -> dict[str, Any]:
    """A session, its job ``waiting`` until its first model or sampler; 429 past the project's pending jobs or
    sessions."""
    with _db(settings) as session:
        job = service.start_session(
            session,
            settings,
            project,
            sdk_version=body.sdk_version,
            tags=body.tags,
            user_metadata=body.user_metadata or {},
            display_name=body.display_name,
        )
        return {"type": "create_session", "session_id": job.id}


@router.post("/session_heartbeat")
def session_heartbeat(body: SessionHeartbeatRequest, settings: SettingsDep, project: TinkerProject) -> dict[str, str]:
    with _db(settings) as session:
        service.heartbeat(session, project, body.session_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
def finish_session(session_id: str, body: FinishSessionRequest, settings: SettingsDep, project: TinkerProject) -> None:
    """The client closes its session; closing one that has ended already (cancelled, timed out) changes nothing."""
    with _db(settings) as session:
        row = service.owned_session(session, project, session_id)
        sessions.finish(session, session_id=row.id, reason=body.reason.type)


@router.get("/sessions")
def list_sessions(settings: SettingsDep, project: TinkerProject, limit: int = 20, offset: Offset = 0) -> dict[str, Any]:
    with _db(settings) as session:
        ids = sessions.list_session_ids(session, project_id=project.id, limit=min(max(limit, 1), 100), offset=offset)
    return {"sessions": ids}


@router.get("/sessions/{session_id}")
def get_session(session_id: str, settings: SettingsDep, project: TinkerProject) -> dict[str, Any]:
    with _db(settings) as session:
        row = service.owned_session(session, project, session_id)
        return {
            "training_run_ids": [model.id for model in sessions.models_of(session, session_id=row.id)],
            "sampler_ids": [sampler.id for sampler in sessions.samplers_of(session, session_id=row.id)],
            "user_metadata": {str(k): str(v) for k, v in row.user_metadata.items()} or None,
        }


# --- training -----------------------------------------------------------------------------------


@router.post("/create_model")
def create_model(
    body: CreateModelRequest, settings: SettingsDep, enqueue: EnqueueDep, project: TinkerProject
) -> Future:
    """A model of the session (its first queues the session for a train worker); a refused ``base_model`` is a 400,
    and ends a session that holds nothing else."""
    with _db(settings) as session:
        lora = body.lora_config.model_dump() if body.lora_config else None
        return service.create_model(session, settings, enqueue, project, session_id=body.session_id,
                                    model_seq_id=body.model_seq_id, base_model=body.base_model, lora=lora,
                                    user_metadata=body.user_metadata or {}, body=body)  # fmt: skip


@router.post("/get_info")
def get_info(body: ModelRequest, settings: SettingsDep, project: TinkerProject) -> dict[str, Any]:
    with _db(settings) as session:
        model, _ = service.model_of(session, project, body.model_id)
        return service.get_info(model)


@router.post("/forward_backward")
async def forward_backward(request: Request, settings: SettingsDep, project: TinkerProject) -> Future:
    """A forward (``forward_only``) or a forward and backward: the SDK's protobuf ``ForwardBackwardRequest``,
    zstd-compressed when the client config asked for it."""
    body = await request.body()
    encoding = request.headers.get("content-encoding")

    def store() -> Future:
        with _db(settings) as session:
            return service.forward_backward(session, settings, project, body, encoding)

    return await anyio.to_thread.run_sync(store)


@router.post("/optim_step")
def optim_step(body: OptimStepRequest, settings: SettingsDep, project: TinkerProject) -> Future:
    with _db(settings) as session:
        return service.model_operation(session, settings, project, model_id=body.model_id, seq_id=body.seq_id,
                                       kind="optim_step", payload=body.model_dump_json().encode())  # fmt: skip


@router.post("/save_weights")
def save_weights(body: SaveWeightsRequest, settings: SettingsDep, project: TinkerProject) -> Future:
    with _db(settings) as session:
        return service.model_operation(session, settings, project, model_id=body.model_id, seq_id=body.seq_id,
                                       kind="save_weights", payload=body.model_dump_json().encode())  # fmt: skip


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(body: SaveWeightsForSamplerRequest, settings: SettingsDep,
                             project: TinkerProject) -> Future:  # fmt: skip
    if body.path is None and body.sampling_session_seq_id is None:
        raise ApiError(400, "invalid_request", "give a path (a name) or a sampling_session_seq_id")
    with _db(settings) as session:
        return service.save_for_sampler(session, settings, project, model_id=body.model_id, seq_id=body.seq_id,
                                        sampling_session_seq_id=body.sampling_session_seq_id, body=body)  # fmt: skip


@router.post("/save_weights_external")
def save_weights_external(body: SaveWeightsExternalRequest, settings: SettingsDep, project: TinkerProject) -> Future:
    """The weights as a Hugging Face folder (LoRA: the PEFT adapter; else the model), ``external_weights/<name>``,
    whose files download by the URLs of ``external_weights_urls``."""
    payload = body.model_dump_json().encode()
    with _db(settings) as session:
        return service.model_operation(
            session,
            settings,
            project,
            model_id=body.model_id,
            seq_id=body.seq_id,
            kind="save_weights_external",
            payload=payload,
        )


@router.post("/load_weights")
def load_weights(
    body: LoadWeightsRequest, settings: SettingsDep, enqueue: EnqueueDep, project: TinkerProject
) -> Future:
    with _db(settings) as session:
        return service.load_weights(session, settings, enqueue, project, path=body.path, optimizer=body.optimizer,
                                    model_id=body.model_id, seq_id=body.seq_id, session_id=body.session_id,
                                    model_seq_id=body.model_seq_id, user_metadata=body.user_metadata or {})  # fmt: skip


# --- sampling -----------------------------------------------------------------------------------


@router.post("/create_sampling_session")
def create_sampling_session(body: CreateSamplingSessionRequest, settings: SettingsDep, enqueue: EnqueueDep,
                            project: TinkerProject) -> dict[str, str]:  # fmt: skip
    with _db(settings) as session:
        sampler = service.create_sampler(session, settings, enqueue, project, session_id=body.session_id,
                                         seq=body.sampling_session_seq_id, base_model=body.base_model,
                                         model_path=body.model_path)  # fmt: skip
        return {"type": "create_sampling_session", "sampling_session_id": sampler.id}


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, settings: SettingsDep, project: TinkerProject) -> dict[str, Any]:
    with _db(settings) as session:
        sampler = sessions.get_sampler(session, sampler_id=sampler_id[:120], project_id=project.id)
        if sampler is None:
            raise ApiError(404, "not_found", f"no sampling session {sampler_id[:120]!r}")
        return {"sampler_id": sampler.id, "base_model": sampler.base_model, "model_path": sampler.model_path}


@router.post("/asample")
def asample(body: SampleRequest, settings: SettingsDep, project: TinkerProject) -> Future:
    with _db(settings) as session:
        return service.sample(session, settings, project, sampler_id=body.sampling_session_id, seq_id=body.seq_id,
                              num_samples=body.num_samples, body=body)  # fmt: skip


# --- futures ------------------------------------------------------------------------------------


@router.post("/retrieve_future", response_model=None)
async def retrieve_future(body: RetrieveFutureRequest, settings: SettingsDep,
                          project: TinkerProject) -> Response | dict[str, Any]:  # fmt: skip
    """The request's result (JSON, or protobuf for a forward/backward and a sample), its error with the error's
    category, or, once :data:`LONG_POLL_S` passed with the request still waiting, ``try_again`` with its
    ``queue_state`` and why it waits (``queue_state_reason``: no free train worker, and how many jobs are ahead)."""

    def look() -> tuple[str, bytes | None, str | None, str | None, str | None]:
        with _db(settings) as session:
            row = service.future_state(session, project, body.request_id)
            return row.status, row.result, row.result_format, row.error, row.category

    def waiting() -> tuple[str, str | None]:
        with _db(settings) as session:
            return service.queue_state(session, service.future_state(session, project, body.request_id))

    deadline, pause = time.monotonic() + LONG_POLL_S, POLL_S[0]
    while True:
        status, result, result_format, error, category = await anyio.to_thread.run_sync(look)
        if status == "done" and result is not None:
            media = "application/x-protobuf" if result_format == "proto" else "application/json"
            return Response(content=result, media_type=media)
        if status == "failed":
            return JSONResponse({"error": error or "the request failed", "category": category or "unknown"})
        if time.monotonic() >= deadline:
            state, reason = await anyio.to_thread.run_sync(waiting)
            return {
                "type": "try_again",
                "request_id": body.request_id,
                "queue_state": state,
                **({"queue_state_reason": reason} if reason else {}),
            }
        await anyio.sleep(pause)
        pause = min(pause * 1.5, POLL_S[1])


@router.post("/cancel_future")
def cancel_future(body: CancelFutureRequest, settings: SettingsDep, project: TinkerProject) -> None:
    with _db(settings) as session:
        row = service.future_state(session, project, body.request_id)
        if row.kind == "sample":  # a training operation is never dropped: later ones of its model wait for it
            sessions.fail_request(session, request_id=row.id, error="cancelled by the client", category="user")


# --- runs and saved weights (the SDK's RestClient) ----------------------------------------------------


@router.get("/training_runs")
def training_runs(settings: SettingsDep, project: TinkerProject, limit: int = 20, offset: Offset = 0) -> dict[str, Any]:
    limit = min(max(limit, 1), 100)
    with _db(settings) as session:
        models, total = sessions.list_models(session, project_id=project.id, limit=limit, offset=offset)
        runs = [service.training_run(session, project, model) for model in models]
    return {"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.get("/training_runs/{run_id}")
def training_run(run_id: str, settings: SettingsDep, project: TinkerProject) -> dict[str, Any]:
    with _db(settings) as session:
        model = sessions.get_model(session, model_id=run_id[:120], project_id=project.id)
        if model is None:
            raise ApiError(404, "not_found", f"no training run {run_id[:120]!r}")
        return service.training_run(session, project, model)


@router.get("/training_runs/{run_id}/checkpoints")
def run_checkpoints(run_id: str, settings: SettingsDep, project: TinkerProject) -> dict[str, Any]:
    with _db(settings) as session:
        if sessions.get_model(session, model_id=run_id[:120], project_id=project.id) is None:
            raise ApiError(404, "not_found", f"no training run {run_id[:120]!r}")
        rows, _ = sessions.list_checkpoints(session, project_id=project.id, model_id=run_id, limit=1000)
        return {"checkpoints": [service.checkpoint_view(row) for row in rows]}


@router.get("/checkpoints")
def all_checkpoints(
    settings: SettingsDep, project: TinkerProject, limit: int = 100, offset: Offset = 0
) -> dict[str, Any]:
    limit = min(max(limit, 1), 1000)
    with _db(settings) as session:
        rows, total = sessions.list_checkpoints(session, project_id=project.id, limit=limit, offset=offset)
        return {"checkpoints": [service.checkpoint_view(row) for row in rows],
                "cursor": {"offset": offset, "limit": limit, "total_count": total}}  # fmt: skip


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}")
def delete_checkpoint(run_id: str, kind: str, name: str, settings: SettingsDep, project: TinkerProject) -> None:
    with _db(settings) as session:
        service.delete_checkpoint(session, settings, project, run_id[:120], f"{kind}/{name}")


@router.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl")
def set_checkpoint_ttl(
    run_id: str, kind: str, name: str, body: TtlRequest, settings: SettingsDep, project: TinkerProject
) -> None:
    with _db(settings) as session:
        service.set_ttl(session, project, run=run_id[:120], kind=kind, name=name)


@router.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls")
def external_weights_urls(
    run_id: str, kind: str, name: str, request: Request, settings: SettingsDep, project: TinkerProject
) -> dict[str, Any]:
    """A URL of this server per file of external weights, signed for an hour: they answer without a key."""
    base_url = str(request.base_url)
    with _db(settings) as session:
        return service.external_weights_urls(
            session, settings, project, run=run_id[:120], kind=kind, name=name, base_url=base_url
        )


Expires = Annotated[int | None, Query(ge=0, le=2**62)]
Signature = Annotated[str | None, Query(max_length=64)]


@router.get("/training_runs/{run_id}/checkpoints/external_weights/{name}/files/{file:path}")
def external_weights_file(
    run_id: str,
    name: str,
    file: str,
    settings: SettingsDep,
    key: Annotated[str | None, Security(API_KEY)] = None,
    expires: Expires = None,
    signature: Signature = None,
) -> FileResponse:
    """One file of external weights, streamed: for the owner's key, or without a key for a URL that
    ``external_weights_urls`` signed and that has not expired."""
    with _db(settings) as session:
        project = service.project_for_key(session, key) if key is not None else None
        path = service.external_weights_file(
            session, settings, project, run=run_id, name=name, file=file, expires=expires, signature=signature
        )
    return FileResponse(path, media_type="application/octet-stream")


@router.post("/weights_info")
def weights_info(body: WeightsInfoRequest, settings: SettingsDep, project: TinkerProject) -> dict[str, Any]:
    with _db(settings) as session:
        return service.weights_info(session, project, body.tinker_path)

"""The Tinker-compatible API's logic (the routes in api/routes/tinker.py are thin): who calls (a project key given
as ``tml-<key>``), which SDK, the session and its models, the requests each operation stores for the session's
worker, and the views of runs and saved weights the SDK's REST client reads.

Every request answers a future at once; the session's worker (jobs/session.py) runs the requests of one model in
their ``seq_id`` order and stores the result, which ``retrieve_future`` long-polls for."""

import json
import re
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from pydantic import BaseModel
from sqlalchemy.orm import Session

from api import signed_urls
from api.deps import Enqueue
from api.errors import ApiError
from api.services.jobs import check_pending, send_created
from api.tar_stream import regular_files
from api.tinker_schemas import SUPPORTED_SDK, Future
from engine import builtin
from engine.spec.tinker_proto import TooLarge, WireError, check_elements, parse_forward_backward, stored_body
from jobs.store import crud, sessions
from jobs.store.models import (
    FINAL_STATUSES,
    Job,
    Project,
    SamplingSession,
    SessionCheckpoint,
    SessionModel,
    SessionRequest,
    TrainingSession,
)
from jobs.store.refs import SpecReferenceError, job_dir, resolve_model
from jobs.store.settings import SESSION_BOUNDS, Settings

KEY_PREFIX = "tml-"
"""The SDK refuses keys without it: a project key ``K`` is given to it as ``tml-K``."""
CHECKPOINT_KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
"""The middle part of a ``tinker://`` path, and the SDK's name for that kind of checkpoint."""
EXTERNAL = "external_weights"
"""Weights in Hugging Face's format (``save_weights_external``), the kind whose files download."""
_TINKER_PATH = re.compile(r"^tinker://([^/]+)/([a-z_]+)/([^/]+)$")


def project_for_key(session: Session, header: str | None) -> Project:
    """The project of ``X-API-Key: tml-<key>``; 401 otherwise (the key is never repeated)."""
    if not header:
        raise ApiError(401, "invalid_api_key", "missing API key: send 'X-API-Key: tml-<your project key>'")
    key = header.removeprefix(KEY_PREFIX)
    project = crud.project_for_key(session, key=key) if header.startswith(KEY_PREFIX) and len(key) <= 256 else None
    if project is None:
        raise ApiError(401, "invalid_api_key", "the API key is not valid (give a project key as 'tml-<key>')")
    return project


def check_sdk(version: str | None) -> None:
    """400 for an SDK version this server does not speak (a missing version is let through: not every client
    names itself)."""
    if version and not version.startswith(tuple(f"{supported}." for supported in SUPPORTED_SDK)):
        wanted = ", ".join(f"{supported}.x" for supported in SUPPORTED_SDK)
        raise ApiError(
            400,
            "unsupported_sdk",
            f"tinker SDK {version[:40]} is not supported by this server; it speaks {wanted} "
            f"(pip install 'tinker=={SUPPORTED_SDK[-1]}.0')",
        )


# --- client config and capabilities ----------------------------------------------------------------


def client_config(settings: Settings) -> dict[str, Any]:
    """The SDK's switches: plain httpx, zstd forward/backward bodies in chunks under the request limit, custom
    losses computed in the client, samples fetched one future at a time."""
    return {
        "pjwt_auth_enabled": False,
        "use_pyqwest_transport": False,
        "proto_compress_fwdbwd": True,
        "parallel_fwdbwd_chunks": True,
        "fwdbwd_max_chunk_bytes_count": settings.max_request_bytes // 2,
        "custom_loss_server_side": False,
        "sample_use_retrieve_futures": False,
        "sample_join_sampling_session": False,
    }


def capabilities(settings: Settings) -> dict[str, Any]:
    """The models a session can train: the built-ins and each model folder under the model root (by its path
    there); ``job:<id>`` of a policy job or a session's sampler weights is accepted too."""
    names = [builtin.TINY_MODEL]
    if settings.model_root is not None and settings.model_root.is_dir():
        root = settings.model_root.resolve()
        names += sorted(config.parent.relative_to(root).as_posix() for config in root.glob("**/config.json"))
    return {"supported_models": [{"model_name": name, "trainable": True, "sampleable": True} for name in names]}


# --- sessions ------------------------------------------------------------------------------------


def start_session(
    session: Session, settings: Settings, project: Project, *, sdk_version: str, tags: list[str],
    user_metadata: dict[str, Any], display_name: str | None,
) -> Job:  # fmt: skip
    """A session job, ``waiting`` until its first model (:func:`_claim_worker`): it counts among the project's
    pending jobs (``RLHF_MAX_PENDING_JOBS``) and its sessions (``RLHF_MAX_SESSIONS_PER_PROJECT``)."""
    check_pending(session, settings, project, 1)
    unfinished = sessions.count_unfinished(session, project_id=project.id)
    if unfinished >= settings.max_sessions_per_project:
        raise ApiError(
            429,
            "too_many_sessions",
            f"the project has {unfinished} unfinished training sessions, and "
            f"takes at most {settings.max_sessions_per_project} (RLHF_MAX_SESSIONS_PER_PROJECT): close "
            "one (ServiceClient.close) or cancel its job first",
        )
    job = sessions.create_session(
        session,
        project_id=project.id,
        sdk_version=sdk_version,
        tags=tags[:20],
        user_metadata=user_metadata,
        display_name=display_name,
    )
    session.commit()
    return job


def _claim_worker(session: Session, settings: Settings, enqueue: Enqueue, job: Job, base_model: str) -> None:
    """The session has a model or sampler now: queued for a train worker (once), after the commit of what the
    caller stored."""
    if sessions.queue_session(session, job=job, base_model=base_model):
        session.commit()
        session.refresh(job)
        send_created(session, settings, enqueue, [job])


def _refused(session: Session, job: Job, error: SpecReferenceError) -> ApiError:
    """The 400 of a model the session cannot load; a session that holds nothing else ends with it (``failed``,
    the reason as its error), so that it never holds a worker for nothing."""
    if not sessions.holds_anything(session, session_id=job.id):
        sessions.refuse(session, job_id=job.id, code=error.code, message=str(error))
        session.commit()
    return ApiError(400, error.code, error.message, param=error.param)


def owned_session(session: Session, project: Project, session_id: str) -> TrainingSession:
    """The caller's session, ended or not; 404 for another project's or none."""
    row = sessions.get_session(session, session_id=session_id[:40], project_id=project.id)
    if row is None:
        raise ApiError(404, "not_found", f"no session {session_id[:40]!r}")
    return row


def live_session(session: Session, project: Project, session_id: str, status: int = 400) -> Job:
    """The caller's session job, still running; 404 for none, ``status`` (400; 410 for a heartbeat) once it ended."""
    job = crud.get_job(session, job_id=owned_session(session, project, session_id).id)
    if job is None:
        raise ApiError(404, "not_found", f"no session {session_id[:40]!r}")
    if job.status in FINAL_STATUSES:
        raise ApiError(status, "session_ended", f"session {job.id} has ended ({job.status}); create a new one")
    return job


def heartbeat(session: Session, project: Project, session_id: str) -> None:
    job = live_session(session, project, session_id, status=410)
    sessions.beat(session, session_id=job.id)


# --- requests ------------------------------------------------------------------------------------


def _submit(
    session: Session, settings: Settings, job: Job, target: str, seq_id: int, kind: str, payload: bytes
) -> SessionRequest:
    """Store a request for the session's worker; the one already stored for (target, seq_id) when the SDK sends it
    again. 429 for a new one past ``session_max_pending_requests`` waiting (the SDK retries it)."""
    if sessions.request_at(session, target=target, seq_id=seq_id) is None:
        pending = sessions.count_pending(session, session_id=job.id)
        if pending >= settings.session_max_pending_requests:
            message = (
                f"session {job.id} has {pending} requests waiting for its worker, the most a session may have "
                "(RLHF_SESSION_MAX_PENDING_REQUESTS); send more once some have run"
            )
            raise ApiError(429, "too_many_pending_requests", message)
    request, _ = sessions.add_request(session, session_id=job.id, project_id=job.project_id, target=target,
                                      seq_id=seq_id, kind=kind, payload=payload)  # fmt: skip
    sessions.beat(session, session_id=job.id)  # a client that sends work is alive
    return request


def _json(body: BaseModel, **extra: Any) -> bytes:
    return json.dumps({**body.model_dump(mode="json"), **extra}).encode()


def model_of(session: Session, project: Project, model_id: str) -> tuple[SessionModel, Job]:
    """The caller's model and its live session; 404 for another project's or none."""
    model = sessions.get_model(session, model_id=model_id, project_id=project.id)
    if model is None:
        raise ApiError(404, "not_found", f"no model {model_id[:120]!r}")
    return model, live_session(session, project, model.session_id)


def create_model(
    session: Session, settings: Settings, enqueue: Enqueue, project: Project, *, session_id: str, model_seq_id: int,
    base_model: str, lora: dict[str, Any] | None, user_metadata: dict[str, Any], body: BaseModel,
) -> Future:  # fmt: skip
    job = live_session(session, project, session_id)
    try:
        resolved = resolve_model(session, project_id=project.id, ref=base_model, settings=settings, param="base_model")
    except SpecReferenceError as e:
        raise _refused(session, job, e) from None
    model = sessions.add_model(session, session_id=job.id, project_id=project.id, seq=model_seq_id,
                               base_model=base_model, lora_rank=lora["rank"] if lora else None,
                               info={"lora": lora}, user_metadata=user_metadata)  # fmt: skip
    request = _submit(session, settings, job, model.id, 0, "create_model", _json(body, resolved=resolved))
    _claim_worker(session, settings, enqueue, job, base_model)
    return Future(request_id=request.id, model_id=model.id)


def model_operation(
    session: Session, settings: Settings, project: Project, *, model_id: str, seq_id: int, kind: str, payload: bytes
) -> Future:
    """Store an operation on a model (forward/backward, optimizer step, saves, loads) in its place."""
    model, job = model_of(session, project, model_id)
    request = _submit(session, settings, job, model.id, seq_id, kind, payload)
    return Future(request_id=request.id, model_id=model.id)


def forward_backward(
    session: Session, settings: Settings, project: Project, body: bytes, content_encoding: str | None
) -> Future:
    """A forward (``forward_only``) or forward/backward: its protobuf body, decompressed within
    ``session_max_body_bytes`` and its datums' dense elements counted within the session budget before it is
    stored, compressed (the worker decompresses it again)."""
    try:
        message = parse_forward_backward(body, content_encoding, max_bytes=settings.session_max_body_bytes)
        check_elements(message, settings.session_budget)
    except TooLarge as e:
        raise ApiError(413, "request_too_large", f"{e} ({SESSION_BOUNDS[e.bound]})") from None
    except WireError as e:
        raise ApiError(400, "invalid_request", str(e)) from None
    kind = "forward" if message.forward_only else "forward_backward"
    if message.seq_id < 1:
        raise ApiError(400, "invalid_request", f"seq_id must be at least 1, not {message.seq_id}", param="seq_id")
    payload = stored_body(body, content_encoding)
    return model_operation(
        session, settings, project, model_id=message.model_id, seq_id=message.seq_id, kind=kind, payload=payload
    )


def save_for_sampler(session: Session, settings: Settings, project: Project, *, model_id: str, seq_id: int,
                     sampling_session_seq_id: int | None, body: BaseModel) -> Future:  # fmt: skip
    """Saved sampler weights; without a name, a sampler of the session on them (the SDK's
    ``save_weights_and_get_sampling_client``), whose id the result gives."""
    model, job = model_of(session, project, model_id)
    sampler = None
    if sampling_session_seq_id is not None:
        sampler = sessions.add_sampler(session, session_id=job.id, project_id=project.id,
                                       seq=sampling_session_seq_id, base_model=model.base_model, model_path=None,
                                       folder=None).id  # fmt: skip
    payload = _json(body, sampler_id=sampler)
    request = _submit(session, settings, job, model.id, seq_id, "save_weights_for_sampler", payload)
    return Future(request_id=request.id, model_id=model.id)


def load_weights(
    session: Session,
    settings: Settings,
    enqueue: Enqueue,
    project: Project,
    *,
    path: str,
    optimizer: bool,
    model_id: str | None,
    seq_id: int | None,
    session_id: str | None,
    model_seq_id: int | None,
    user_metadata: dict[str, Any],
) -> Future:
    """Saved training weights loaded into a model of the session, or into a new one created from them."""
    checkpoint = checkpoint_at(session, project, path, kind="weights")
    source = sessions.get_model(session, model_id=checkpoint.model_id, project_id=project.id)
    assert source is not None
    payload = json.dumps({"path": path, "folder": checkpoint.path, "optimizer": optimizer}).encode()
    if model_id is not None and seq_id is not None:
        return model_operation(session, settings, project, model_id=model_id, seq_id=seq_id, kind="load_weights",
                               payload=payload)  # fmt: skip
    if session_id is None or model_seq_id is None:
        raise ApiError(400, "invalid_request", "load_weights needs model_id and seq_id, or session_id and model_seq_id")
    job = live_session(session, project, session_id)
    model = sessions.add_model(session, session_id=job.id, project_id=project.id, seq=model_seq_id,
                               base_model=source.base_model, lora_rank=source.lora_rank,
                               info={"lora": source.info.get("lora")}, user_metadata=user_metadata)  # fmt: skip
    resolved = json.loads(_request_payload(session, source))["resolved"]
    payload = json.dumps({"path": path, "folder": checkpoint.path, "optimizer": optimizer, "resolved": resolved,
                          "lora": source.info.get("lora")}).encode()  # fmt: skip
    request = _submit(session, settings, job, model.id, 0, "create_model", payload)
    _claim_worker(session, settings, enqueue, job, source.base_model)
    return Future(request_id=request.id, model_id=model.id)


def _request_payload(session: Session, model: SessionModel) -> bytes:
    """The creation request of ``model`` (what it was built from)."""
    request = sessions.request_at(session, target=model.id, seq_id=0)
    assert request is not None, f"model {model.id} has no creation request"
    return request.payload


def create_sampler(
    session: Session,
    settings: Settings,
    enqueue: Enqueue,
    project: Project,
    *,
    session_id: str,
    seq: int,
    base_model: str | None,
    model_path: str | None,
) -> SamplingSession:
    """A sampler of saved sampler weights (``model_path``) or of a base model."""
    job = live_session(session, project, session_id)
    if model_path is not None:
        checkpoint = checkpoint_at(session, project, model_path, kind="sampler_weights")
        model = sessions.get_model(session, model_id=checkpoint.model_id, project_id=project.id)
        assert model is not None
        sampler = sessions.add_sampler(
            session,
            session_id=job.id,
            project_id=project.id,
            seq=seq,
            base_model=model.base_model,
            model_path=model_path,
            folder=checkpoint.path,
        )
    elif base_model is None:
        raise ApiError(400, "invalid_request", "a sampling session needs model_path or base_model", param="base_model")
    else:
        try:
            resolved = resolve_model(
                session, project_id=project.id, ref=base_model, settings=settings, param="base_model"
            )
        except SpecReferenceError as e:
            raise _refused(session, job, e) from None
        sampler = sessions.add_sampler(
            session,
            session_id=job.id,
            project_id=project.id,
            seq=seq,
            base_model=base_model,
            model_path=None,
            folder=resolved,
        )
    _claim_worker(session, settings, enqueue, job, sampler.base_model)
    return sampler


def sample(
    session: Session,
    settings: Settings,
    project: Project,
    *,
    sampler_id: str,
    seq_id: int,
    num_samples: int,
    body: BaseModel,
) -> Future:
    """A sample request; 400 ``request_too_large`` when its ``num_samples`` × ``max_tokens`` is past
    ``RLHF_SESSION_MAX_SAMPLE_TOKENS`` (without ``max_tokens``, the worker checks against the model's context)."""
    params = getattr(body, "sampling_params", None)
    max_tokens = params.get("max_tokens") if isinstance(params, dict) else getattr(params, "max_tokens", None)
    if type(max_tokens) is int and max_tokens * num_samples > settings.session_max_sample_tokens:
        raise ApiError(
            400,
            "request_too_large",
            f"{num_samples} samples of up to {max_tokens} tokens is "
            f"{num_samples * max_tokens} tokens; a request may decode at most "
            f"{settings.session_max_sample_tokens} (RLHF_SESSION_MAX_SAMPLE_TOKENS): fewer samples or "
            "tokens per request",
            param="sampling_params.max_tokens",
        )
    sampler = sessions.get_sampler(session, sampler_id=sampler_id, project_id=project.id)
    if sampler is None:
        raise ApiError(404, "not_found", f"no sampling session {sampler_id[:120]!r}")
    job = live_session(session, project, sampler.session_id)
    request = _submit(session, settings, job, sampler.id, seq_id, "sample", _json(body))
    return Future(request_id=request.id, sample_sequence_ids=[f"{request.id}-{i}" for i in range(num_samples)])


def future_state(session: Session, project: Project, request_id: str) -> SessionRequest:
    request = sessions.get_request(session, request_id=request_id, project_id=project.id)
    if request is None:
        raise ApiError(404, "not_found", f"no request {request_id[:40]!r}")
    return request


def queue_state(session: Session, request: SessionRequest) -> tuple[str, str | None]:
    """The SDK's ``queue_state`` of a request still waiting, and why (``queue_state_reason``): ``paused_capacity``
    while its session waits for a train worker, with the jobs ahead of it in its queue; ``active`` once a worker
    holds the session (the request waits for those of its session before it)."""
    job = crud.get_job(session, job_id=request.session_id)
    if job is None or job.status not in sessions.WAITING_STATUSES:
        return "active", None
    if job.status == "waiting":
        return "paused_capacity", "the session has no model yet"
    ahead, running = crud.queue_position(session, job=job)
    queue = crud.job_queue(job)
    return "paused_capacity", (
        f"no free train worker on queue {queue!r}: {ahead} job{'s' * (ahead != 1)} ahead of this session, "
        f"{running} running"
    )


# --- runs and saved weights --------------------------------------------------------------------------


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """(training run id, kind, name) of ``tinker://<run>/<kind>/<name>``; 400 for anything else."""
    match = _TINKER_PATH.match(path)
    if match is None or match.group(2) not in CHECKPOINT_KINDS:
        raise ApiError(400, "invalid_request", f"{path[:200]!r} is not a tinker://<run>/<weights|sampler_weights>/"
                       "<name> path", param="path")  # fmt: skip
    run, kind, name = match.groups()
    return run, kind, name


def checkpoint_at(session: Session, project: Project, path: str, kind: str | None = None) -> SessionCheckpoint:
    """The caller's saved weights at a ``tinker://`` path (of ``kind``, when given); 404 otherwise."""
    run, found_kind, name = parse_tinker_path(path)
    if kind is not None and found_kind != kind:
        raise ApiError(400, "invalid_request", f"{path[:200]!r} is not a {kind} path", param="path")
    row = sessions.get_checkpoint(session, project_id=project.id, model_id=run, kind=found_kind, name=name)
    if row is None:
        raise ApiError(404, "not_found", f"no saved weights at {path[:200]!r}")
    return row


def tinker_path(row: SessionCheckpoint) -> str:
    return f"tinker://{row.model_id}/{row.kind}/{row.name}"


def checkpoint_view(row: SessionCheckpoint) -> dict[str, Any]:
    return {
        "checkpoint_id": f"{row.kind}/{row.name}",
        "checkpoint_type": CHECKPOINT_KINDS[row.kind],
        "time": row.created_at.isoformat(),
        "tinker_path": tinker_path(row),
        "size_bytes": row.size_bytes,
        "public": False,
    }


def training_run(session: Session, project: Project, model: SessionModel) -> dict[str, Any]:
    saved, _ = sessions.list_checkpoints(session, project_id=project.id, model_id=model.id)
    latest = {kind: next((row for row in saved if row.kind == kind), None) for kind in CHECKPOINT_KINDS}
    return {
        "training_run_id": model.id,
        "base_model": model.base_model,
        "model_owner": project.id,
        "is_lora": model.lora_rank is not None,
        "corrupted": False,
        "lora_rank": model.lora_rank,
        "last_request_time": _iso(model.last_request_at),
        "last_checkpoint": checkpoint_view(latest["weights"]) if latest["weights"] else None,
        "last_sampler_checkpoint": checkpoint_view(latest["sampler_weights"]) if latest["sampler_weights"] else None,
        "user_metadata": {str(k): str(v) for k, v in model.user_metadata.items()} or None,
    }


def get_info(model: SessionModel) -> dict[str, Any]:
    info = model.info
    return {
        "type": "get_info",
        "model_id": model.id,
        "model_data": {
            "arch": info.get("arch"),
            "model_name": model.base_model,
            "tokenizer_id": info.get("tokenizer_id"),
        },
        "is_lora": model.lora_rank is not None,
        "lora_rank": model.lora_rank,
        "model_name": model.base_model,
    }


def weights_info(session: Session, project: Project, path: str) -> dict[str, Any]:
    row = checkpoint_at(session, project, path)
    model = sessions.get_model(session, model_id=row.model_id, project_id=project.id)
    assert model is not None
    lora = model.info.get("lora") or {}
    return {
        "base_model": model.base_model,
        "is_lora": model.lora_rank is not None,
        "lora_rank": model.lora_rank,
        **{key: lora.get(key) for key in ("train_unembed", "train_mlp", "train_attn")},
    }


def delete_checkpoint(session: Session, settings: Settings, project: Project, run: str, checkpoint_id: str) -> None:
    kind, _, name = checkpoint_id.partition("/")
    row = sessions.get_checkpoint(session, project_id=project.id, model_id=run, kind=kind, name=name)
    if row is None:
        raise ApiError(404, "not_found", f"no checkpoint {checkpoint_id[:200]!r} of {run[:120]!r}")
    if row.step is not None:
        raise ApiError(400, "invalid_request", "sampler weights are a checkpoint of the session's job: they stay "
                       "while the job does (delete the job to remove them)")  # fmt: skip
    folder = own_folder(settings, row)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    sessions.delete_checkpoint(session, row=row)


def own_folder(settings: Settings, row: SessionCheckpoint) -> Path | None:
    """The folder of saved weights ``row``, or None when its recorded path is not a folder of that checkpoint
    alone: one named by the checkpoint's name, inside its session's folder (a row an earlier version let in,
    named ``..``, pointed at the folder of every model's saved weights)."""
    session_dir = job_dir(settings.resolved_artifacts_dir, row.session_id).resolve()
    folder = (settings.resolved_artifacts_dir / row.path).resolve()
    if not row.name.strip(".") or folder.name != row.name or not folder.is_relative_to(session_dir):
        return None
    return folder


def _iso(when: datetime) -> str:
    return when.isoformat()


# --- weights out: external weights' files by signed URL ----------------------------------------------------


def _external(session: Session, project: Project, run: str, kind: str, name: str) -> SessionCheckpoint:
    """The caller's external weights; 404 for none, 400 for weights of another kind."""
    row = sessions.get_checkpoint(session, project_id=project.id, model_id=run, kind=kind, name=name)
    if row is None:
        raise ApiError(404, "not_found", f"no checkpoint {kind[:40]}/{name[:200]} of {run[:120]!r}")
    if kind != EXTERNAL:
        message = (
            f"only {EXTERNAL} download by URL, not {kind}; export the weights in Hugging Face's format with "
            "save_weights_external first (tinker checkpoint download does)"
        )
        raise ApiError(400, "invalid_request", message)
    return row


def _files(settings: Settings, row: SessionCheckpoint) -> dict[str, Path]:
    folder = own_folder(settings, row)
    return dict(regular_files(folder)) if folder is not None else {}


def file_path(run: str, name: str, file: str) -> str:
    """The path of the route serving file ``file`` of external weights ``name`` of ``run``."""
    return f"/api/v1/training_runs/{quote(run, safe=':')}/checkpoints/{EXTERNAL}/{quote(name)}/files/{quote(file)}"


def _bound_to(row: SessionCheckpoint) -> str:
    """What a URL's signature binds: this very checkpoint (weights deleted and saved again under the same name
    are another, as is a row that takes a deleted one's id)."""
    created = row.created_at if row.created_at.tzinfo else row.created_at.replace(tzinfo=UTC)
    return f"{row.id}:{created.timestamp():.6f}"


def external_weights_urls(
    session: Session, settings: Settings, project: Project, *, run: str, kind: str, name: str, base_url: str
) -> dict[str, Any]:
    """A URL of this API per file of the caller's external weights, signed for :data:`signed_urls.TTL_S`: the
    SDK's ``get_external_weights_urls``, which the CLI's ``checkpoint download`` reads without a key."""
    row = _external(session, project, run, kind, name)
    files = _files(settings, row)
    if not files:
        raise ApiError(404, "not_found", f"the files of {tinker_path(row)} are gone")
    key = signed_urls.signing_key(settings.resolved_artifacts_dir)
    expires = int(time.time()) + signed_urls.TTL_S
    urls = {}
    for file in files:
        path = file_path(row.model_id, row.name, file)
        query = urlencode({"expires": expires, "signature": signed_urls.signature(key, path, expires, _bound_to(row))})
        urls[file] = f"{base_url.rstrip('/')}{path}?{query}"
    return {"urls": urls, "expires": datetime.fromtimestamp(expires, UTC).isoformat()}


def external_weights_file(
    session: Session,
    settings: Settings,
    project: Project | None,
    *,
    run: str,
    name: str,
    file: str,
    expires: int | None,
    signature: str | None,
) -> Path:
    """The file ``file`` of external weights ``name`` of ``run``, for the project that owns them (``project``, by
    its key) or, without a key, for a URL signed for them that has not expired; 401 for neither, 404 for a file
    they do not have."""
    model = session.get(SessionModel, run[:120])
    row = None
    if model is not None:
        row = sessions.get_checkpoint(session, project_id=model.project_id, model_id=model.id, kind=EXTERNAL, name=name)
    if project is not None:
        row = row if row is not None and row.project_id == project.id else None  # another project's: none
    elif not _signed(settings, row, file_path(run, name, file), expires, signature):
        message = (
            "missing API key, or a download URL that is not signed or has expired: ask for new URLs "
            "(get_external_weights_urls)"
        )
        raise ApiError(401, "invalid_api_key", message)
    found = _files(settings, row).get(file) if row is not None else None
    if found is None:
        raise ApiError(404, "not_found", f"no file {file[:200]!r} in external weights {name[:200]!r} of {run[:120]!r}")
    return found


def _signed(
    settings: Settings, row: SessionCheckpoint | None, path: str, expires: int | None, signature: str | None
) -> bool:
    if row is None or expires is None or signature is None:
        return False
    key = signed_urls.signing_key(settings.resolved_artifacts_dir)
    return signed_urls.is_valid(key, path, expires, _bound_to(row), signature, time.time())


def set_ttl(session: Session, project: Project, *, run: str, kind: str, name: str) -> None:
    """The SDK's ``set_checkpoint_ttl``: the checkpoint must be the caller's; this server keeps saved weights until
    they are deleted, so the time to live is accepted and not applied."""
    row = sessions.get_checkpoint(session, project_id=project.id, model_id=run, kind=kind, name=name)
    if row is None:
        raise ApiError(404, "not_found", f"no checkpoint {kind[:40]}/{name[:200]} of {run[:120]!r}")

"""Reads and writes of training sessions (the Tinker-compatible API): the session beside its job row, its models
and samplers, its requests (the SDK's futures) and the weights it saved by name. The API stores requests; the
session's worker runs them in order and stores their results (jobs/session.py)."""

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from jobs.store import crud
from jobs.store.models import (
    FINAL_STATUSES,
    SESSION_TYPE,
    Job,
    SamplingSession,
    SessionCheckpoint,
    SessionModel,
    SessionRequest,
    TrainingSession,
    utcnow,
)

UNFINISHED = ("pending", "running")


# --- sessions -----------------------------------------------------------------------------------


def create_session(
    session: Session,
    *,
    project_id: str,
    sdk_version: str,
    tags: Sequence[str],
    user_metadata: dict[str, Any],
    display_name: str | None = None,
) -> Job:
    """A ``waiting`` session job (named by the SDK's ``display_name``) and its session row. It takes no train worker
    yet: its first model or sampler queues it (:func:`queue_session`)."""
    spec = {"type": SESSION_TYPE, "model": "", "sdk_version": sdk_version, "tags": list(tags)}
    job, _ = crud.create_job(session, project_id=project_id, spec=spec, idempotency_key=None)
    job.status, job.name = "waiting", _label(display_name)
    session.add(TrainingSession(id=job.id, project_id=project_id, sdk_version=sdk_version,
                                user_metadata=dict(user_metadata)))  # fmt: skip
    crud.add_event(session, job_id=job.id, kind="info", message=WAITING_FOR_A_MODEL)
    session.flush()
    return job


WAITING_FOR_A_MODEL = "waiting for its first model: a session takes a train worker once it has a model to load"
WAITING_STATUSES = ("waiting", "queued")
"""A session's job before a worker took it: without a model yet (``waiting``), or in its train queue."""


def _label(display_name: str | None) -> str | None:
    """The SDK's ``display_name`` as a job name: printable, at most 200 characters."""
    if not display_name:
        return None
    return "".join(c if c.isprintable() else " " for c in display_name)[:200].strip() or None


def queue_session(session: Session, *, job: Job, base_model: str) -> bool:
    """The session has a model (or sampler) to load: ``waiting`` → ``queued``, for the caller to send to the train
    workers after the commit; the first base model becomes the job's ``model``. True when it was queued now."""
    if not job.spec.get("model"):
        job.spec = {**job.spec, "model": base_model[:500]}
        session.flush()
    return crud.transition(session, job_id=job.id, from_statuses=("waiting",), to="queued")


def holds_anything(session: Session, *, session_id: str) -> bool:
    """Whether the session has a model or a sampler (what a worker holds it for)."""
    model = select(SessionModel.id).where(SessionModel.session_id == session_id).limit(1)
    sampler = select(SamplingSession.id).where(SamplingSession.session_id == session_id).limit(1)
    return session.scalars(model).first() is not None or session.scalars(sampler).first() is not None


def refuse(session: Session, *, job_id: str, code: str, message: str) -> bool:
    """End a session that never got a worker (its model was refused): ``failed``, the reason as its error."""
    if crud.transition(
        session,
        job_id=job_id,
        from_statuses=WAITING_STATUSES,
        to="failed",
        finished_at=utcnow(),
        error_code=code,
        error_message=message,
    ):
        crud.add_event(session, job_id=job_id, kind="error", message=message, data={"code": code})
        return True
    return False


def count_unfinished(session: Session, *, project_id: str) -> int:
    """The project's sessions not ended yet (waiting, queued or running)."""
    stmt = select(func.count()).where(
        Job.project_id == project_id, Job.type == SESSION_TYPE, Job.status.not_in(FINAL_STATUSES)
    )
    return int(session.execute(stmt).scalar_one())


ABANDONED = "session_abandoned"
"""The error code of a session whose client stopped sending heartbeats without closing it."""


def abandoned_message(silent_s: float) -> str:
    return (
        f"no heartbeat from the client for {silent_s:.0f} s: it exited without closing the session "
        "(ServiceClient.close, or a with block) or lost its connection"
    )


def end_abandoned(session: Session, *, timeout_s: float, now: datetime | None = None) -> list[str]:
    """End the sessions no worker holds (``waiting`` or ``queued``) whose client stopped beating ``timeout_s`` ago:
    ``cancelled``, error code :data:`ABANDONED` (a running one is ended by its worker). Returns their ids."""
    now = now or utcnow()
    stmt = (
        select(Job.id, TrainingSession.heartbeat_at)
        .join(TrainingSession, TrainingSession.id == Job.id)
        .where(Job.type == SESSION_TYPE, Job.status.in_(WAITING_STATUSES))
        .where(TrainingSession.heartbeat_at < now - timedelta(seconds=timeout_s))
    )
    ended = []
    for job_id, heartbeat in session.execute(stmt).all():
        silent_s = (now - (heartbeat if heartbeat.tzinfo else heartbeat.replace(tzinfo=now.tzinfo))).total_seconds()
        message = abandoned_message(silent_s)
        if crud.transition(
            session,
            job_id=job_id,
            from_statuses=WAITING_STATUSES,
            to="cancelled",
            finished_at=now,
            error_code=ABANDONED,
            error_message=message,
        ):
            crud.add_event(
                session, job_id=job_id, kind="info", message=f"session ended: {message}", data={"code": ABANDONED}
            )
            fail_unfinished(session, session_id=job_id, error=f"the session ended: {message}", category="user")
            ended.append(job_id)
    return ended


def get_session(session: Session, *, session_id: str, project_id: str) -> TrainingSession | None:
    row = session.get(TrainingSession, session_id)
    return row if row is not None and row.project_id == project_id else None


def beat(session: Session, *, session_id: str) -> None:
    session.execute(update(TrainingSession).where(TrainingSession.id == session_id).values(heartbeat_at=utcnow()))


def finish(session: Session, *, session_id: str, reason: str) -> None:
    """The client closed the session: the first reason given is kept."""
    stmt = (
        update(TrainingSession)
        .where(TrainingSession.id == session_id, TrainingSession.finish_reason.is_(None))
        .values(finish_reason=reason)
    )
    session.execute(stmt)


def list_session_ids(session: Session, *, project_id: str, limit: int, offset: int) -> list[str]:
    stmt = (
        select(TrainingSession.id)
        .where(TrainingSession.project_id == project_id)
        .order_by(TrainingSession.created_at.desc(), TrainingSession.id)
        .limit(limit)
        .offset(offset)
    )
    return list(session.scalars(stmt))


# --- models and samplers ------------------------------------------------------------------------


def model_id(session_id: str, seq: int) -> str:
    """A training client's id, as the SDK derives it itself: ``<session>:train:<n>``."""
    return f"{session_id}:train:{seq}"


def sampler_id(session_id: str, seq: int) -> str:
    return f"{session_id}:sample:{seq}"


def add_model(
    session: Session, *, session_id: str, project_id: str, seq: int, base_model: str, lora_rank: int | None,
    info: dict[str, Any], user_metadata: dict[str, Any],
) -> SessionModel:  # fmt: skip
    """The model row of a create (or create-from-state) request; the same row again for a repeated request."""
    key = model_id(session_id, seq)
    existing = session.get(SessionModel, key)
    if existing is not None:
        return existing
    row = SessionModel(id=key, session_id=session_id, project_id=project_id, base_model=base_model,
                       lora_rank=lora_rank, info=dict(info), user_metadata=dict(user_metadata))  # fmt: skip
    session.add(row)
    session.flush()
    return row


def get_model(session: Session, *, model_id: str, project_id: str) -> SessionModel | None:
    row = session.get(SessionModel, model_id)
    return row if row is not None and row.project_id == project_id else None


def set_model_info(session: Session, *, model_id: str, info: dict[str, Any]) -> None:
    row = session.get(SessionModel, model_id)
    if row is not None:
        row.info = {**row.info, **info}


def touch_model(session: Session, *, model_id: str) -> None:
    """A request of the model ran now (``last_request_time`` of its training run)."""
    session.execute(update(SessionModel).where(SessionModel.id == model_id).values(last_request_at=utcnow()))


def list_models(session: Session, *, project_id: str, limit: int, offset: int) -> tuple[list[SessionModel], int]:
    """The project's models, newest first, and how many it has."""
    where = SessionModel.project_id == project_id
    total = len(list(session.scalars(select(SessionModel.id).where(where))))
    stmt = select(SessionModel).where(where).order_by(SessionModel.created_at.desc(), SessionModel.id)
    return list(session.scalars(stmt.limit(limit).offset(offset))), total


def models_of(session: Session, *, session_id: str) -> list[SessionModel]:
    stmt = select(SessionModel).where(SessionModel.session_id == session_id).order_by(SessionModel.created_at)
    return list(session.scalars(stmt))


def add_sampler(
    session: Session, *, session_id: str, project_id: str, seq: int, base_model: str, model_path: str | None,
    folder: str | None,
) -> SamplingSession:  # fmt: skip
    key = sampler_id(session_id, seq)
    existing = session.get(SamplingSession, key)
    if existing is not None:
        return existing
    row = SamplingSession(id=key, session_id=session_id, project_id=project_id, base_model=base_model,
                          model_path=model_path, folder=folder)  # fmt: skip
    session.add(row)
    session.flush()
    return row


def get_sampler(session: Session, *, sampler_id: str, project_id: str | None = None) -> SamplingSession | None:
    row = session.get(SamplingSession, sampler_id)
    return row if row is not None and (project_id is None or row.project_id == project_id) else None


def set_sampler_folder(session: Session, *, sampler_id: str, folder: str, model_path: str) -> None:
    """The weights a sampler made with them samples from (``save_weights_and_get_sampling_client``)."""
    session.execute(
        update(SamplingSession).where(SamplingSession.id == sampler_id).values(folder=folder, model_path=model_path)
    )


def samplers_of(session: Session, *, session_id: str) -> list[SamplingSession]:
    stmt = select(SamplingSession).where(SamplingSession.session_id == session_id)
    return list(session.scalars(stmt.order_by(SamplingSession.created_at)))


# --- requests -------------------------------------------------------------------------------------


def add_request(
    session: Session, *, session_id: str, project_id: str, target: str, seq_id: int, kind: str, payload: bytes
) -> tuple[SessionRequest, bool]:
    """Store a request, or find the one already stored for (target, seq_id): the SDK sends a request again with a
    new idempotency key when it did not hear back, and that is the same request. (the request, whether it is new)."""
    existing = request_at(session, target=target, seq_id=seq_id)
    if existing is not None:
        return existing, False
    row = SessionRequest(id=crud.new_id("req_"), session_id=session_id, project_id=project_id, target=target,
                         seq_id=seq_id, kind=kind, payload=payload)  # fmt: skip
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError:  # the same request, stored meanwhile by a concurrent retry
        found = request_at(session, target=target, seq_id=seq_id)
        assert found is not None
        return found, False
    return row, True


def request_at(session: Session, *, target: str, seq_id: int) -> SessionRequest | None:
    stmt = select(SessionRequest).where(SessionRequest.target == target, SessionRequest.seq_id == seq_id)
    return session.scalars(stmt).first()


def get_request(session: Session, *, request_id: str, project_id: str) -> SessionRequest | None:
    row = session.get(SessionRequest, request_id)
    return row if row is not None and row.project_id == project_id else None


def request_status(session: Session, *, request_id: str) -> str | None:
    return session.scalars(select(SessionRequest.status).where(SessionRequest.id == request_id)).first()


def pending_requests(session: Session, *, session_id: str) -> list[SessionRequest]:
    """The session's requests not started yet, oldest first."""
    stmt = select(SessionRequest).where(SessionRequest.session_id == session_id, SessionRequest.status == "pending")
    return list(session.scalars(stmt.order_by(SessionRequest.created_at, SessionRequest.id)))


def count_pending(session: Session, *, session_id: str) -> int:
    """How many of the session's requests wait for its worker."""
    stmt = select(func.count()).where(SessionRequest.session_id == session_id, SessionRequest.status == "pending")
    return int(session.scalar(stmt) or 0)


def start_request(session: Session, *, request_id: str) -> bool:
    stmt = (
        update(SessionRequest)
        .where(SessionRequest.id == request_id, SessionRequest.status == "pending")
        .values(status="running")
    )
    return session.execute(stmt).rowcount == 1  # type: ignore[attr-defined]


def complete_request(session: Session, *, request_id: str, result: bytes, result_format: str) -> None:
    stmt = (
        update(SessionRequest)
        .where(SessionRequest.id == request_id, SessionRequest.status.in_(UNFINISHED))
        .values(status="done", result=result, result_format=result_format, finished_at=utcnow())
    )
    session.execute(stmt)


def fail_request(session: Session, *, request_id: str, error: str, category: str) -> None:
    stmt = (
        update(SessionRequest)
        .where(SessionRequest.id == request_id, SessionRequest.status.in_(UNFINISHED))
        .values(status="failed", error=error, category=category, finished_at=utcnow())
    )
    session.execute(stmt)


def fail_unfinished(session: Session, *, session_id: str, error: str, category: str) -> int:
    """Fail every request of the session not finished yet (the session ended, or its worker was lost)."""
    stmt = (
        update(SessionRequest)
        .where(SessionRequest.session_id == session_id, SessionRequest.status.in_(UNFINISHED))
        .values(status="failed", error=error, category=category, finished_at=utcnow())
    )
    return int(session.execute(stmt).rowcount)  # type: ignore[attr-defined]


# --- weights saved by name ------------------------------------------------------------------------------


def add_checkpoint(
    session: Session, *, session_id: str, project_id: str, model_id: str, kind: str, name: str, path: str,
    step: int | None, size_bytes: int | None,
) -> SessionCheckpoint:  # fmt: skip
    """Record weights saved under ``name`` (replacing an earlier save of that name: ``overwrite``)."""
    stmt = select(SessionCheckpoint).where(
        SessionCheckpoint.model_id == model_id, SessionCheckpoint.kind == kind, SessionCheckpoint.name == name
    )
    row = session.scalars(stmt).first()
    if row is None:
        row = SessionCheckpoint(session_id=session_id, project_id=project_id, model_id=model_id, kind=kind,
                                name=name, path=path)  # fmt: skip
        session.add(row)
    row.path, row.step, row.size_bytes, row.created_at = path, step, size_bytes, utcnow()
    session.flush()
    return row


def get_checkpoint(
    session: Session, *, project_id: str, model_id: str, kind: str, name: str
) -> SessionCheckpoint | None:
    stmt = select(SessionCheckpoint).where(
        SessionCheckpoint.project_id == project_id,
        SessionCheckpoint.model_id == model_id,
        SessionCheckpoint.kind == kind,
        SessionCheckpoint.name == name,
    )
    return session.scalars(stmt).first()


def list_checkpoints(
    session: Session, *, project_id: str, model_id: str | None = None, limit: int = 100, offset: int = 0
) -> tuple[list[SessionCheckpoint], int]:
    """The project's saved weights (of one model, with ``model_id``), newest first, and how many there are."""
    stmt = select(SessionCheckpoint).where(SessionCheckpoint.project_id == project_id)
    if model_id is not None:
        stmt = stmt.where(SessionCheckpoint.model_id == model_id)
    rows = list(session.scalars(stmt.order_by(SessionCheckpoint.created_at.desc(), SessionCheckpoint.id.desc())))
    return rows[offset : offset + limit], len(rows)


def delete_checkpoint(session: Session, *, row: SessionCheckpoint) -> None:
    session.delete(row)


def last_request_time(session: Session, *, model_id: str) -> datetime | None:
    row = session.get(SessionModel, model_id)
    return row.last_request_at if row is not None else None

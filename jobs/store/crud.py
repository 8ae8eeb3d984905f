"""Every read and write of the service's tables, in keyword-only functions. Routes and tasks call these.

Job status changes are guarded in SQL (``UPDATE … WHERE status IN (…)``), so two workers can never
both run one job, and a late request cannot undo a final status.
"""

import hashlib
import hmac
import secrets
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import Select, and_, delete, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from engine.spec.config import TRAIN_QUEUE
from jobs.store.models import (
    ACTIVE_STATUSES,
    SESSION_TYPE,
    ApiKey,
    Checkpoint,
    Event,
    File,
    Job,
    JobDependency,
    Metric,
    Project,
    Sample,
    SessionRequest,
    utcnow,
)


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(6)}"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# --- projects and keys --------------------------------------------------------------------------


def create_project(session: Session, *, name: str) -> Project:
    project = Project(id=new_id("proj_"), name=name)
    session.add(project)
    session.flush()
    return project


def create_api_key(session: Session, *, project_id: str, name: str) -> tuple[ApiKey, str]:
    """A new key for the project: (row, the key itself — shown once, stored only hashed)."""
    key = f"rlhf-{secrets.token_urlsafe(32)}"
    row = ApiKey(id=new_id("key_"), project_id=project_id, name=name, key_hash=hash_key(key), prefix=key[:12])
    session.add(row)
    session.flush()
    return row, key


def project_by_name(session: Session, *, name: str) -> Project | None:
    """The oldest project of that name."""
    return session.scalars(select(Project).where(Project.name == name).order_by(Project.created_at)).first()


def project_for_key(session: Session, *, key: str) -> Project | None:
    """The project of an unrevoked key, or None.

    Keys are stored only as SHA-256 digests and found by digest. The database's ``=`` on the indexed digest is
    not constant-time, but what it compares is the digest of the presented key, which a caller cannot steer
    byte by byte: how long the lookup takes says nothing usable about any stored key. The accept decision is
    then made here with ``hmac.compare_digest`` (constant time in the compared bytes), so it never rests on a
    database comparison that may be looser than byte equality (case-insensitive collations, blank padding).
    """
    digest = hash_key(key)
    row = session.scalars(select(ApiKey).where(ApiKey.key_hash == digest, ApiKey.revoked_at.is_(None))).first()
    if row is None or not hmac.compare_digest(row.key_hash.encode(), digest.encode()):
        return None
    return session.get(Project, row.project_id)


# --- files -------------------------------------------------------------------------------------


def create_file(
    session: Session,
    *,
    file_id: str,
    project_id: str,
    filename: str,
    purpose: str,
    kind: str,
    size: int,
    rows: int,
    path: str,
    chat: bool = False,
) -> File:
    row = File(
        id=file_id,
        project_id=project_id,
        filename=filename,
        purpose=purpose,
        kind=kind,
        bytes=size,
        rows=rows,
        chat=chat,
        path=path,
    )
    session.add(row)
    session.flush()
    return row


def get_file(session: Session, *, file_id: str, project_id: str) -> File | None:
    return session.scalars(select(File).where(File.id == file_id, File.project_id == project_id)).first()


def file_rows(session: Session, *, project_id: str, file_ids: Iterable[str]) -> dict[str, int]:
    """The row count of each of these files of the project, by id (one query)."""
    stmt = select(File.id, File.rows).where(File.project_id == project_id, File.id.in_(list(file_ids)))
    return {file_id: rows for file_id, rows in session.execute(stmt)}


def list_files(session: Session, *, project_id: str, after: str | None, limit: int) -> tuple[list[File], bool]:
    stmt = select(File).where(File.project_id == project_id)
    return _page(session, stmt, File, project_id, after, limit)


# --- jobs --------------------------------------------------------------------------------------


def create_job(
    session: Session,
    *,
    project_id: str,
    spec: dict[str, Any],
    idempotency_key: str | None,
    waiting_for: Sequence[str] = (),
    pipeline_key: str | None = None,
    stage: str | None = None,
) -> tuple[Job, bool]:
    """(job, created). With an idempotency key already used in this project, the earlier job comes back. A job
    ``waiting_for`` unfinished jobs is created ``waiting`` (jobs.store.pipelines queues it), else ``queued``.
    ``pipeline_key`` and ``stage``: the job is that stage of the pipeline created with that key."""
    if idempotency_key is not None:
        existing = job_for_key(session, project_id=project_id, idempotency_key=idempotency_key)
        if existing is not None:
            return existing, False
    job = Job(
        id=new_id("job_"),
        project_id=project_id,
        type=spec["type"],
        name=spec.get("name"),
        spec=spec,
        idempotency_key=idempotency_key,
        pipeline_key=pipeline_key,
        stage=stage,
        latest_metrics={},
        status="waiting" if waiting_for else "queued",
    )
    session.add(job)
    session.flush()
    session.add_all(JobDependency(job_id=job.id, dependency_id=dependency) for dependency in dict.fromkeys(waiting_for))
    if waiting_for:
        names = ", ".join(waiting_for)
        add_event(session, job_id=job.id, kind="info", message=f"waiting for job {names} to succeed",
                  data={"waiting_for": list(waiting_for)})  # fmt: skip
    return job, True


def job_for_key(session: Session, *, project_id: str, idempotency_key: str) -> Job | None:
    """The project's job created with this ``Idempotency-Key``, if any."""
    stmt = select(Job).where(Job.project_id == project_id, Job.idempotency_key == idempotency_key)
    return session.scalars(stmt).first()


def pipeline_jobs(session: Session, *, project_id: str, pipeline_key: str) -> dict[str, Job]:
    """The stages of the project's pipeline created with this key, by stage name, in the order they were stored."""
    stmt = select(Job).where(Job.project_id == project_id, Job.pipeline_key == pipeline_key)
    return {job.stage or "": job for job in session.scalars(stmt.order_by(Job.created_at, Job.id))}


def count_pending(session: Session, *, project_id: str) -> int:
    """The project's queued and waiting jobs (one indexed count)."""
    stmt = select(func.count()).where(Job.project_id == project_id, Job.status.in_(("queued", "waiting")))
    return session.execute(stmt).scalar_one()


def get_job(session: Session, *, job_id: str, project_id: str | None = None) -> Job | None:
    stmt = select(Job).where(Job.id == job_id)
    if project_id is not None:
        stmt = stmt.where(Job.project_id == project_id)
    return session.scalars(stmt).first()


def list_jobs(
    session: Session,
    *,
    project_id: str,
    status: str | None = None,
    job_type: str | None = None,
    job_types: Sequence[str] | None = None,
    after: str | None = None,
    limit: int = 20,
) -> tuple[list[Job], bool]:
    stmt = select(Job).where(Job.project_id == project_id)
    if status is not None:
        stmt = stmt.where(Job.status == status)
    if job_type is not None:
        stmt = stmt.where(Job.type == job_type)
    if job_types is not None:
        stmt = stmt.where(Job.type.in_(list(job_types)))
    return _page(session, stmt, Job, project_id, after, limit)


def list_jobs_of_types(session: Session, *, project_id: str, job_types: Sequence[str]) -> list[Job]:
    """The project's jobs of these types, oldest first."""
    stmt = select(Job).where(Job.project_id == project_id, Job.type.in_(list(job_types)))
    return list(session.scalars(stmt.order_by(Job.created_at, Job.id)))


PageRow = TypeVar("PageRow", Job, File)
P = TypeVar("P")


def _page(
    session: Session, stmt: Select[PageRow], model: type[PageRow], project_id: str, after: str | None, limit: int
) -> tuple[list[PageRow], bool]:
    """Newest first; ``after`` is the id of the last row of the previous page, a row of the same project. An
    unknown cursor (another project's row included: nothing may tell the two apart) gives an empty page."""
    if after is not None:
        anchor = session.scalars(select(model).where(model.id == after, model.project_id == project_id)).first()
        if anchor is None:
            return [], False
        stmt = stmt.where(
            or_(
                model.created_at < anchor.created_at,
                and_(model.created_at == anchor.created_at, model.id < anchor.id),
            )
        )
    rows = list(session.scalars(stmt.order_by(model.created_at.desc(), model.id.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def transition(session: Session, *, job_id: str, from_statuses: Iterable[str], to: str, **values: Any) -> bool:
    """Move a job to status ``to`` only if it is in one of ``from_statuses``; True if it moved. A job moved to
    ``queued`` is due a message: its ``sent_at`` is cleared until :func:`mark_sent`."""
    if to == "queued":
        values.setdefault("sent_at", None)
    stmt = (
        update(Job)
        .where(Job.id == job_id, Job.status.in_(list(from_statuses)))
        .values(status=to, updated_at=utcnow(), **values)
    )
    moved = session.execute(stmt).rowcount == 1  # type: ignore[attr-defined]
    if moved:
        session.add(Event(job_id=job_id, kind="status", message=to, data={"status": to}))
    return moved


def claim_job(session: Session, *, job_id: str, worker: str, lease_seconds: int) -> bool:
    """queued → running, owned by ``worker`` until the lease runs out unless renewed."""
    now = utcnow()
    return transition(
        session,
        job_id=job_id,
        from_statuses=("queued",),
        to="running",
        worker=worker,
        lease_until=now + timedelta(seconds=lease_seconds),
        started_at=func.coalesce(Job.started_at, now),
        error_code=None,
        error_message=None,
    )


def heartbeat(session: Session, *, job_id: str, worker: str, lease_seconds: int) -> str | None:
    """Renew the lease of a job this worker runs; returns its status (``cancelling``/``pausing`` ask it
    to stop), or None when the job is no longer this worker's."""
    stmt = (
        update(Job)
        .where(Job.id == job_id, Job.worker == worker, Job.status.in_(ACTIVE_STATUSES))
        .values(lease_until=utcnow() + timedelta(seconds=lease_seconds))
        .returning(Job.status)
    )
    return session.execute(stmt).scalar_one_or_none()


def expire_active_leases(session: Session) -> None:
    """End the lease of every running, pausing or cancelling job now: the next recovery takes them over."""
    session.execute(update(Job).where(Job.status.in_(ACTIVE_STATUSES)).values(lease_until=utcnow()))


def job_queue(job: Job) -> str:
    """The train queue a job is sent to: its spec's ``resources.queue``."""
    return spec_queue(job.spec)


def spec_queue(spec: dict[str, Any]) -> str:
    """The train queue of a stored spec."""
    queue: str = spec.get("resources", {}).get("queue", TRAIN_QUEUE)
    return queue


def queue_position(session: Session, *, job: Job) -> tuple[int, int]:
    """(queued jobs of ``job``'s train queue sent before it, running jobs of that queue): what it waits behind."""
    queue = job_queue(job)
    sent = job.sent_at or utcnow()
    rows = session.execute(
        select(Job.status, Job.spec).where(
            Job.id != job.id,
            or_(Job.status.in_(ACTIVE_STATUSES), and_(Job.status == "queued", Job.sent_at <= sent)),
        )
    ).all()
    ahead = sum(1 for status, spec in rows if status == "queued" and spec_queue(spec) == queue)
    return ahead, sum(1 for status, spec in rows if status != "queued" and spec_queue(spec) == queue)


def mark_sent(session: Session, *, job_ids: Sequence[str]) -> None:
    """Record that the messages of these jobs went to the broker (those still queued)."""
    if job_ids:
        stmt = update(Job).where(Job.id.in_(list(job_ids)), Job.status == "queued").values(sent_at=utcnow())
        session.execute(stmt)


def claim_unsent(
    session: Session, *, unsent_for: timedelta, resend_after: timedelta, now: datetime | None = None
) -> list[tuple[str, str]]:
    """The queued jobs due a message: never sent since queued ``unsent_for`` ago or more (the sender stopped
    between its commit and its send), or sent ``resend_after`` ago or more and still unclaimed (a message the
    broker lost, or one waiting behind other jobs: then a duplicate, which the claim ignores). Their ``sent_at``
    becomes now in the same guarded update, so of two sweeps only one sends each. Returns (job id, queue)."""
    now = now or utcnow()
    due = or_(
        and_(Job.sent_at.is_(None), Job.updated_at <= now - unsent_for),
        Job.sent_at <= now - resend_after,
    )
    stmt = update(Job).where(Job.status == "queued", due).values(sent_at=now).returning(Job.id, Job.spec)
    rows = session.execute(stmt).all()
    return [(job_id, spec_queue(spec)) for job_id, spec in rows]


def unmark_sent(session: Session, *, job_ids: Sequence[str]) -> None:
    """Forget the sends of these jobs (the broker refused them): the next sweep sends them again."""
    if job_ids:
        session.execute(update(Job).where(Job.id.in_(list(job_ids)), Job.status == "queued").values(sent_at=None))


def recover_expired(session: Session, *, max_attempts: int, now: datetime | None = None) -> list[tuple[str, str]]:
    """Jobs whose worker stopped renewing its lease: back to ``queued`` with ``attempt + 1`` (past the cap:
    failed, ``worker_lost``); a lost ``pausing`` job is ``paused`` and a lost ``cancelling`` one ``cancelled``.
    Returns (job id, queue) of the jobs put back in the queue, for the caller to send after commit."""
    now = now or utcnow()
    expired = list(session.scalars(select(Job).where(Job.status.in_(ACTIVE_STATUSES), Job.lease_until < now)))
    requeued = []
    for job in expired:
        if job.type == SESSION_TYPE:  # its models lived in the lost worker's memory: their futures fail now
            _fail_session_requests(session, job.id, now)
        free = {"worker": None, "lease_until": None}
        if job.status == "cancelling":
            transition(session, job_id=job.id, from_statuses=("cancelling",), to="cancelled", finished_at=now, **free)
        elif job.status == "pausing":
            transition(session, job_id=job.id, from_statuses=("pausing",), to="paused", **free)
        elif job.attempt >= max_attempts:
            transition(
                session, job_id=job.id, from_statuses=("running",), to="failed", finished_at=now,
                error_code="worker_lost", error_message=f"the worker was lost {job.attempt} times", **free,
            )  # fmt: skip
        elif transition(
            session, job_id=job.id, from_statuses=("running",), to="queued", attempt=job.attempt + 1, **free
        ):
            add_event(session, job_id=job.id, kind="warning", message="worker lost; the job was requeued")
            requeued.append((job.id, job_queue(job)))
    return requeued


LOST_SESSION = (
    "the worker running this session was lost; its models are gone: create a training client from the last "
    "saved state (create_training_client_from_state) to continue"
)


def _fail_session_requests(session: Session, session_id: str, now: datetime) -> None:
    stmt = (
        update(SessionRequest)
        .where(SessionRequest.session_id == session_id, SessionRequest.status.in_(("pending", "running")))
        .values(status="failed", error=LOST_SESSION, category="server", finished_at=now)
    )
    session.execute(stmt)


# --- metrics, events, checkpoints --------------------------------------------------------------


def add_metrics(session: Session, *, job_id: str, step: int, metrics: dict[str, float]) -> None:
    """Record one step's metrics; a step already recorded (a redelivered task) is kept as it was."""
    if not metrics:
        return
    rows = [{"job_id": job_id, "name": name, "step": step, "value": float(value)} for name, value in metrics.items()]
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    # rows as executemany parameters: one statement, compiled once and cached (a multi-VALUES insert built from
    # the rows themselves is compiled afresh every step, half the cost of a step's write)
    session.execute(insert(Metric).on_conflict_do_nothing(index_elements=["job_id", "name", "step"]), rows)
    session.execute(update(Job).where(Job.id == job_id).values(step=step, latest_metrics=dict(metrics)))


def add_event(session: Session, *, job_id: str, kind: str, message: str, data: dict[str, Any] | None = None) -> Event:
    event = Event(job_id=job_id, kind=kind, message=message, data=data or {})
    session.add(event)
    session.flush()
    return event


def record_checkpoint(
    session: Session, *, job_id: str, step: int, path: str, metrics: dict[str, float], kept_steps: Sequence[int]
) -> None:
    """Add (or replace) the checkpoint of ``step`` and forget those the engine's retention deleted."""
    existing = session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step)).first()
    if existing is None:
        session.add(Checkpoint(job_id=job_id, step=step, path=path, metrics=dict(metrics)))
    else:
        existing.path, existing.metrics = path, dict(metrics)
    for old in session.scalars(
        select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step.not_in([*kept_steps, step]))
    ):
        session.delete(old)
    add_event(session, job_id=job_id, kind="checkpoint", message=f"checkpoint at step {step}", data={"step": step})


def list_checkpoints(session: Session, *, job_id: str) -> list[Checkpoint]:
    return list(session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)))


def checkpoints_by_job(session: Session, *, job_ids: Sequence[str]) -> dict[str, list[Checkpoint]]:
    """The checkpoints of each of these jobs in step order (an empty list for a job without any)."""
    by_job: dict[str, list[Checkpoint]] = {job_id: [] for job_id in job_ids}
    if by_job:
        stmt = select(Checkpoint).where(Checkpoint.job_id.in_(list(by_job))).order_by(Checkpoint.step)
        for row in session.scalars(stmt):
            by_job[row.job_id].append(row)
    return by_job


def get_checkpoint(session: Session, *, job_id: str, step: int | None) -> Checkpoint | None:
    """The checkpoint of ``step``, or the newest one when ``step`` is None."""
    stmt = select(Checkpoint).where(Checkpoint.job_id == job_id)
    stmt = stmt.where(Checkpoint.step == step) if step is not None else stmt.order_by(Checkpoint.step.desc())
    return session.scalars(stmt.limit(1)).first()


def metric_history(
    session: Session,
    *,
    job_id: str,
    names: Sequence[str] | None,
    start_step: int | None,
    end_step: int | None,
    max_points: int | None,
) -> dict[str, list[tuple[int, float]]]:
    stmt = select(Metric.name, Metric.step, Metric.value).where(Metric.job_id == job_id)
    if names:
        stmt = stmt.where(Metric.name.in_(list(names)))
    if start_step is not None:
        stmt = stmt.where(Metric.step >= start_step)
    if end_step is not None:
        stmt = stmt.where(Metric.step <= end_step)
    series: dict[str, list[tuple[int, float]]] = {}
    for name, step, value in session.execute(stmt.order_by(Metric.name, Metric.step)):
        series.setdefault(name, []).append((step, value))
    if max_points is not None:
        series = {name: downsample(points, max_points) for name, points in series.items()}
    return series


def downsample(points: Sequence[P], max_points: int) -> list[P]:
    """At most ``max_points`` evenly spaced points, always keeping the first and the last."""
    n = len(points)
    if n <= max_points:
        return list(points)
    if max_points == 1:
        return [points[-1]]
    indices = sorted({round(i * (n - 1) / (max_points - 1)) for i in range(max_points)})
    return [points[i] for i in indices]


def list_events(
    session: Session, *, job_id: str, after: int | None, limit: int, newest_first: bool = False
) -> tuple[list[Event], bool]:
    """A page of the job's events, oldest first after event id ``after`` (``newest_first``: before it)."""
    stmt = select(Event).where(Event.job_id == job_id)
    if after is not None:
        stmt = stmt.where(Event.id < after if newest_first else Event.id > after)
    order = Event.id.desc() if newest_first else Event.id
    rows = list(session.scalars(stmt.order_by(order).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def list_numbered_events(
    session: Session, *, job_id: str, before: int | None, limit: int
) -> tuple[list[tuple[int, Event]], bool]:
    """A page of the job's events newest first, each with its number within the job (1 for its first event), those
    numbered below ``before`` when given."""
    numbered = (
        select(Event.id.label("event_id"), func.row_number().over(order_by=Event.id).label("number"))
        .where(Event.job_id == job_id)
        .subquery()
    )
    stmt = select(Event, numbered.c.number).join(numbered, Event.id == numbered.c.event_id)
    if before is not None:
        stmt = stmt.where(numbered.c.number < before)
    rows = [
        (number, event) for event, number in session.execute(stmt.order_by(numbered.c.number.desc()).limit(limit + 1))
    ]
    return rows[:limit], len(rows) > limit


def metrics_after(session: Session, *, job_id: str, after: int, limit: int) -> list[Metric]:
    """Metric rows in insertion order after row id ``after`` (the SSE stream's cursor)."""
    stmt = select(Metric).where(Metric.job_id == job_id, Metric.id > after).order_by(Metric.id).limit(limit)
    return list(session.scalars(stmt))


def set_job_progress(session: Session, *, job_id: str, step: int, total_steps: int) -> None:
    """A worker starts (or resumes) a job at ``step`` of ``total_steps``."""
    session.execute(update(Job).where(Job.id == job_id).values(step=step, total_steps=total_steps))


def forget_metrics_after(session: Session, *, job_id: str, step: int) -> list[int]:
    """Delete the metrics of steps after ``step``; returns those steps. A job resuming from the checkpoint of
    ``step`` computes them again: rows a lost worker recorded past its last checkpoint belong to weights that
    no longer exist, and would otherwise shadow the new values (``add_metrics`` keeps a step's first rows)."""
    after = (Metric.job_id == job_id, Metric.step > step)
    steps = list(session.scalars(select(Metric.step).where(*after).distinct().order_by(Metric.step)))
    if steps:
        session.execute(delete(Metric).where(*after))
    return steps


# --- rollout samples ---------------------------------------------------------------------------

SAMPLE_TEXT_CHARS = 4000
"""A sample's prompt and response are kept up to this many characters (the end cut, marked by an ellipsis)."""


def _cut(text: str) -> str:
    return text if len(text) <= SAMPLE_TEXT_CHARS else text[: SAMPLE_TEXT_CHARS - 1] + "…"


def add_samples(session: Session, *, job_id: str, step: int, samples: Sequence[dict[str, Any]]) -> None:
    """Record one step's rollout samples (``Callbacks.on_samples``' dicts), replacing those the step had: a job
    resumed from an earlier checkpoint samples the step anew."""
    session.execute(delete(Sample).where(Sample.job_id == job_id, Sample.step == step))
    session.add_all(
        Sample(
            job_id=job_id,
            step=step,
            position=position,
            prompt=_cut(str(sample["prompt"])),
            response=_cut(str(sample["response"])),
            rewards={name: float(value) for name, value in sample["rewards"].items()},
            kl=float(sample["kl"]),
            length=int(sample["length"]),
        )
        for position, sample in enumerate(samples)
    )


def sample_steps(session: Session, *, job_id: str) -> list[int]:
    """The steps with samples, ascending."""
    stmt = select(Sample.step).where(Sample.job_id == job_id).distinct().order_by(Sample.step)
    return list(session.scalars(stmt))


def list_samples(session: Session, *, job_id: str, step: int) -> list[Sample]:
    """The samples of ``step``, in the batch's order."""
    stmt = select(Sample).where(Sample.job_id == job_id, Sample.step == step).order_by(Sample.position)
    return list(session.scalars(stmt))


def forget_samples_after(session: Session, *, job_id: str, step: int) -> None:
    """Delete the samples of steps after ``step``: like their metrics (:func:`forget_metrics_after`), a job resuming
    from the checkpoint of ``step`` samples them anew."""
    session.execute(delete(Sample).where(Sample.job_id == job_id, Sample.step > step))

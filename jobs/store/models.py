"""Database tables, shared by ``api/`` and ``jobs/`` (torch-free). Alembic's env.py reads ``Base.metadata``."""

from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Autoincrementing 64-bit ids; SQLite only autoincrements INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")

JOB_STATUSES = (
    "waiting", "queued", "running", "cancelling", "cancelled", "pausing", "paused", "succeeded", "failed"
)  # fmt: skip
"""``waiting``: for the unfinished jobs its spec names (a pipeline's later stage); queued once they succeed."""
ACTIVE_STATUSES = ("running", "cancelling", "pausing")
FINAL_STATUSES = ("succeeded", "failed", "cancelled")
LIVE_STATUSES = ("waiting", "queued", "running", "pausing", "paused")
"""Statuses of a job that may still succeed: another job may wait for it."""


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    type_annotation_map: ClassVar = {dict[str, Any]: JSON, datetime: DateTime(timezone=True)}


class Project(Base):
    __tablename__ = "projects"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    """SHA-256 of the key; the key itself is shown once and never stored."""
    prefix: Mapped[str] = mapped_column(String(16))
    """The key's first characters, to recognise it in listings."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)


class File(Base):
    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    filename: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(16))
    """What it was uploaded as: a dataset kind (sft, preference, prompts; or rm, ppo) or ``fine-tune``."""
    kind: Mapped[str] = mapped_column(String(16))
    """What its rows are: sft, preference or prompts (for a fine-tune file, found from its rows)."""
    bytes: Mapped[int] = mapped_column(BigInteger)
    rows: Mapped[int] = mapped_column(Integer)
    chat: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    """Whether any row holds chat messages (then the model's tokenizer needs a chat template)."""
    path: Mapped[str] = mapped_column(Text)
    """Location relative to the artifacts folder."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("project_id", "idempotency_key", name="uq_jobs_project_idempotency_key"),
        Index("ix_jobs_project_created", "project_id", "created_at", "id"),
        Index("ix_jobs_status_lease", "status", "lease_until"),
        Index("ix_jobs_project_status", "project_id", "status"),
        UniqueConstraint("project_id", "pipeline_key", "stage", name="uq_jobs_project_pipeline_stage"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    type: Mapped[str] = mapped_column(String(8))
    name: Mapped[str | None] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default="queued")
    spec: Mapped[dict[str, Any]]
    """The validated job spec, with every hyperparameter default filled in."""
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    """The ``Idempotency-Key`` of the ``POST /v1/jobs`` (or fine-tuning) request that created it."""
    pipeline_key: Mapped[str | None] = mapped_column(String(255), default=None)
    """The ``Idempotency-Key`` of the ``POST /v1/pipelines`` request that created it, a stage of that pipeline."""
    stage: Mapped[str | None] = mapped_column(String(64), default=None)
    """Its stage name in the pipeline that created it (with ``pipeline_key``)."""
    attempt: Mapped[int] = mapped_column(default=1)
    step: Mapped[int] = mapped_column(default=0)
    total_steps: Mapped[int | None] = mapped_column(default=None)
    latest_metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    worker: Mapped[str | None] = mapped_column(String(255), default=None)
    lease_until: Mapped[datetime | None] = mapped_column(default=None)
    sent_at: Mapped[datetime | None] = mapped_column(default=None)
    """When the queued job's message last went to the broker; None: not since it was last queued (the sender
    stopped between the commit and the send). The recovery sweeps send it again (jobs/recovery.py)."""
    error_code: Mapped[str | None] = mapped_column(String(64), default=None)
    error_message: Mapped[str | None] = mapped_column(Text, default=None)
    output_step: Mapped[int | None] = mapped_column(default=None)
    """Step of the final checkpoint once the job succeeded."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class JobDependency(Base):
    """A waiting job's unfinished dependency (a job its spec names, see jobs.store.pipelines), so that a job that
    ends finds the jobs waiting for it without reading every waiting job."""

    __tablename__ = "job_dependencies"
    __table_args__ = (Index("ix_job_dependencies_dependency", "dependency_id"),)

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    dependency_id: Mapped[str] = mapped_column(String(40), primary_key=True)


class Metric(Base):
    __tablename__ = "metrics"
    __table_args__ = (
        UniqueConstraint("job_id", "name", "step", name="uq_metrics_job_name_step"),
        Index("ix_metrics_job_id_id", "job_id", "id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(100))
    step: Mapped[int]
    value: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Event(Base):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_job_id_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(32))
    """status, checkpoint, info, warning or error."""
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_checkpoints_job_step"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int]
    path: Mapped[str] = mapped_column(Text)
    """Folder relative to the artifacts folder."""
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Sample(Base):
    """A rollout a PPO or GRPO job kept at a logged step (``log_samples_every``), for reading what the policy says."""

    __tablename__ = "samples"
    __table_args__ = (Index("ix_samples_job_step", "job_id", "step", "position"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int]
    position: Mapped[int]
    """Its place among the step's samples (the batch's order)."""
    prompt: Mapped[str] = mapped_column(Text)
    response: Mapped[str] = mapped_column(Text)
    rewards: Mapped[dict[str, Any]] = mapped_column(default=dict)
    """Each reward component's score by name (``score`` for a reward model; graders: each and ``total``)."""
    kl: Mapped[float] = mapped_column(Float)
    """Summed log-ratio of policy to reference over the response."""
    length: Mapped[int] = mapped_column(Integer)
    """Response tokens."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


# --- training sessions (the Tinker-compatible API, /api/v1): a session is a job of type "session" -------------

SESSION_TYPE = "session"
"""The job type of a training session: created by the Tinker-compatible API, never by a job spec."""
REQUEST_STATUSES = ("pending", "running", "done", "failed")


class TrainingSession(Base):
    """What a session job holds beside its job row: the client's heartbeat and how the client ended it."""

    __tablename__ = "training_sessions"

    id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    """The session's job id: the SDK's ``session_id``."""
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    sdk_version: Mapped[str] = mapped_column(String(40))
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    """The client's last heartbeat (or request): the session ends when it is older than the session timeout."""
    finish_reason: Mapped[str | None] = mapped_column(String(16), default=None)
    """``success``, ``errored`` or ``interrupted``, once the client closed the session."""
    user_metadata: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class SessionModel(Base):
    """A model a session trains (the SDK's training client): its id is ``<session>:train:<n>``."""

    __tablename__ = "session_models"
    __table_args__ = (Index("ix_session_models_session", "session_id"),)

    id: Mapped[str] = mapped_column(String(120), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    base_model: Mapped[str] = mapped_column(String(500))
    """As the client named it (a name of ``get_server_capabilities``)."""
    lora_rank: Mapped[int | None] = mapped_column(default=None)
    """None: every weight trains."""
    info: Mapped[dict[str, Any]] = mapped_column(default=dict)
    """What the worker found once it built the model: ``tokenizer_id``, ``vocab_size``, ``max_length``, ``arch``,
    the LoRA targets (``train_mlp``, ``train_attn``, ``train_unembed``); empty until then."""
    user_metadata: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_request_at: Mapped[datetime] = mapped_column(default=utcnow)


class SamplingSession(Base):
    """A sampler of a session (the SDK's sampling client): saved sampler weights, or a base model."""

    __tablename__ = "sampling_sessions"
    __table_args__ = (Index("ix_sampling_sessions_session", "session_id"),)

    id: Mapped[str] = mapped_column(String(120), primary_key=True)
    """``<session>:sample:<n>``."""
    session_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    base_model: Mapped[str] = mapped_column(String(500))
    model_path: Mapped[str | None] = mapped_column(Text, default=None)
    """The ``tinker://`` path of the sampler weights it samples from; None: the base model."""
    folder: Mapped[str | None] = mapped_column(Text, default=None)
    """Those weights' model folder, relative to the artifacts folder; None: the base model."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class SessionRequest(Base):
    """One operation of a session (a future of the SDK): stored by the API, run by the session's worker in the
    order the SDK numbers them (``seq_id`` per model or sampler), its result kept for ``retrieve_future``."""

    __tablename__ = "session_requests"
    __table_args__ = (
        UniqueConstraint("target", "seq_id", name="uq_session_requests_target_seq"),
        Index("ix_session_requests_session_status", "session_id", "status"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    """The SDK's ``request_id``."""
    session_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    target: Mapped[str] = mapped_column(String(120))
    """The model (``<session>:train:<n>``) or sampler (``<session>:sample:<n>``) it runs on."""
    seq_id: Mapped[int] = mapped_column(BigInteger)
    """Its place in the target's order (a model's creation is 0); a repeated (target, seq_id) is the same request."""
    kind: Mapped[str] = mapped_column(String(32))
    """``create_model``, ``load_weights``, ``forward``, ``forward_backward``, ``optim_step``, ``save_weights``,
    ``save_weights_for_sampler``, ``sample``."""
    payload: Mapped[bytes] = mapped_column(LargeBinary)
    """The request body: JSON, or the protobuf of a forward/backward, zstd-compressed (engine/spec/tinker_proto.py
    ``stored_body``; a plain one stored by an earlier version is read as well)."""
    status: Mapped[str] = mapped_column(String(16), default="pending")
    result: Mapped[bytes | None] = mapped_column(LargeBinary, default=None)
    result_format: Mapped[str | None] = mapped_column(String(8), default=None)
    """``json`` or ``proto``."""
    error: Mapped[str | None] = mapped_column(Text, default=None)
    category: Mapped[str | None] = mapped_column(String(16), default=None)
    """Whose the error is to fix: ``user``, ``server`` (a lost worker) or ``unknown``."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)


class SessionCheckpoint(Base):
    """Weights a session saved under a name: ``tinker://<model id>/<kind>/<name>``. Sampler weights are also a
    checkpoint of the session's job (``step``), which generation, the OpenAI endpoints and ``job:`` references read."""

    __tablename__ = "session_checkpoints"
    __table_args__ = (UniqueConstraint("model_id", "kind", "name", name="uq_session_checkpoints_name"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    model_id: Mapped[str] = mapped_column(String(120))
    kind: Mapped[str] = mapped_column(String(16))
    """``weights`` (the trained weights and the optimizer's state) or ``sampler_weights`` (a model folder)."""
    name: Mapped[str] = mapped_column(String(200))
    path: Mapped[str] = mapped_column(Text)
    """Folder relative to the artifacts folder."""
    step: Mapped[int | None] = mapped_column(default=None)
    """Sampler weights: their checkpoint number in the session's job (``job:<session>@<step>``)."""
    size_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

"""Request and response bodies of the HTTP API (the README's API table). Job specs are
``engine.spec.config.JobSpec``."""

import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema

from engine.spec.config import JOB_TYPES
from engine.spec.rows import FINE_TUNE, KIND_ALIASES, ROW_FIELDS
from jobs.store.models import SESSION_TYPE, Checkpoint, Event, File, Job, Sample


def _as_utc(value: datetime) -> datetime:
    # SQLite hands back naive datetimes; every timestamp the service writes is UTC.
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


UtcDatetime = Annotated[datetime, AfterValidator(_as_utc)]
"""A timestamp serialised as ISO 8601 in UTC (``2026-01-02T03:04:05.123456Z``)."""

ID_PATTERN = r"^[A-Za-z0-9_-]+$"
"""What every object id (``job_…``, ``file-…``) looks like."""
_ID = re.compile(ID_PATTERN)


def looks_like_id(value: str) -> bool:
    """Whether ``value`` could be an object id; anything else names no object (and is never sent to the
    database: PostgreSQL refuses NUL characters, for one)."""
    return len(value) <= 64 and _ID.fullmatch(value) is not None


MAX_INT32 = 2**31 - 1
"""Largest step number (an INTEGER column)."""
MAX_INT64 = 2**63 - 1
"""Largest row id (a BIGINT column)."""


def _one_of(known: list[str], what: str) -> AfterValidator:
    def check(value: str) -> str:
        if value not in known:
            raise ValueError(f"unknown {what} {value[:40]!r}; known: {', '.join(known)}")
        return value

    return AfterValidator(check)


_PURPOSES = [*ROW_FIELDS, *KIND_ALIASES, FINE_TUNE]
Purpose = Annotated[str, _one_of(_PURPOSES, "purpose"), WithJsonSchema({"type": "string", "enum": _PURPOSES})]
"""A dataset kind (engine.spec.rows), one of its earlier names ``rm`` and ``ppo``, or ``fine-tune`` (OpenAI's
formats)."""
_JOB_TYPES = [*JOB_TYPES, SESSION_TYPE]
JobType = Annotated[str, _one_of(_JOB_TYPES, "job type"), WithJsonSchema({"type": "string", "enum": _JOB_TYPES})]
"""A name of :data:`engine.spec.config.JOB_TYPES`, or ``session`` (a training session of the Tinker-compatible
API)."""
JobStatus = Literal[
    "waiting", "queued", "running", "cancelling", "cancelled", "pausing", "paused", "succeeded", "failed"
]


# --- files -------------------------------------------------------------------------------------


class FilePublic(BaseModel):
    id: str
    object: Literal["file"] = "file"
    filename: str
    purpose: Purpose
    kind: str
    """What the rows are: sft, preference or prompts (the purpose, or for a fine-tune file, its rows' kind)."""
    bytes: int
    rows: int
    chat: bool = False
    """Whether the rows hold chat messages (rendered with the model's chat template)."""
    created_at: UtcDatetime

    @classmethod
    def of(cls, row: File) -> "FilePublic":
        return cls(
            id=row.id,
            filename=row.filename,
            purpose=row.purpose,
            kind=row.kind,
            bytes=row.bytes,
            rows=row.rows,
            chat=row.chat,
            created_at=row.created_at,
        )


class FineTuneFile(BaseModel):
    """A ``fine-tune`` file, as OpenAI's API answers one (``created_at`` in Unix seconds), with this service's
    ``kind``, ``rows`` and ``chat`` besides."""

    id: str
    object: Literal["file"] = "file"
    filename: str
    purpose: Literal["fine-tune"] = "fine-tune"
    bytes: int
    created_at: int
    """Unix seconds."""
    status: Literal["processed"] = "processed"
    """Always ``processed``: a file is validated in full before it is stored."""
    status_details: None = None
    expires_at: None = None
    """Files do not expire."""
    kind: str
    """What the rows are: ``sft`` (supervised), ``preference`` (dpo) or ``prompts`` (reinforcement)."""
    rows: int
    chat: bool

    @classmethod
    def of(cls, row: File) -> "FineTuneFile":
        return cls(
            id=row.id, filename=row.filename, bytes=row.bytes, created_at=unix(row.created_at), kind=row.kind,
            rows=row.rows, chat=row.chat,
        )  # fmt: skip


def file_object(row: File) -> "FilePublic | FineTuneFile":
    """A file as the API answers it: OpenAI's object for a fine-tune file, this service's for a dataset."""
    return FineTuneFile.of(row) if row.purpose == FINE_TUNE else FilePublic.of(row)


def unix(value: datetime) -> int:
    """A stored timestamp (UTC) in Unix seconds, as OpenAI's objects carry them."""
    return int(_as_utc(value).timestamp())


class FilesPublic(BaseModel):
    data: list[FilePublic | FineTuneFile]
    has_more: bool


# --- job types ---------------------------------------------------------------------------------


class JobTypePublic(BaseModel):
    name: str
    """The spec's ``type``."""
    summary: str
    dataset_kind: str
    """What ``dataset`` and ``eval_dataset`` hold: a file ``purpose`` (sft, preference, prompts)."""
    output: Literal["policy", "reward_model"]
    generates: bool
    """Whether its checkpoints sample text (generate, the OpenAI-compatible routes)."""
    reward_model: bool
    """Whether it trains against a reward: its spec names a ``reward_model`` or a ``reward``."""
    metrics: list[str]
    """Headline metrics, for charts."""
    hyperparameters: dict[str, Any]
    """Every hyperparameter with its default."""
    builtin_datasets: list[str]
    """Built-in datasets of its kind (the reviews and digits tasks)."""
    example: dict[str, Any]
    """Its stage of the built-in demo: a spec less ``type``, ``model`` and ``reward_model``."""


class JobTypesPublic(BaseModel):
    data: list[JobTypePublic]


# --- jobs --------------------------------------------------------------------------------------


class JobError(BaseModel):
    code: str
    message: str


class JobPublic(BaseModel):
    id: str
    object: Literal["job"] = "job"
    type: JobType
    name: str | None
    status: JobStatus
    model: str
    """The spec's starting model."""
    step: int
    """Last optimizer step with recorded metrics (1-based; 0 before the first)."""
    total_steps: int | None
    latest_metrics: dict[str, float]
    error: JobError | None
    attempt: int
    """Run of the job: 1, plus one per lost worker."""
    created_at: UtcDatetime
    started_at: UtcDatetime | None
    finished_at: UtcDatetime | None
    output_model: str | None
    """``job:<id>``, usable as another job's model, once the job succeeded."""
    spec: dict[str, Any]
    """The validated spec with every default filled in."""

    @classmethod
    def of(cls, job: Job) -> "JobPublic":
        error = None
        if job.error_code is not None:
            error = JobError(code=job.error_code, message=job.error_message or "")
        return cls(
            id=job.id,
            type=job.type,
            name=job.name,
            status=job.status,
            model=job.spec.get("model", ""),
            step=job.step,
            total_steps=job.total_steps,
            latest_metrics=job.latest_metrics or {},
            error=error,
            attempt=job.attempt,
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            output_model=f"job:{job.id}" if job.status == "succeeded" else None,
            spec=job.spec,
        )


class JobsPublic(BaseModel):
    data: list[JobPublic]
    has_more: bool


class MetricPoint(BaseModel):
    step: int
    value: float


class MetricsPublic(BaseModel):
    data: dict[str, list[MetricPoint]]
    """Series by metric name, in step order."""


class EventPublic(BaseModel):
    id: int
    kind: str
    """status, checkpoint, info, warning or error."""
    message: str
    data: dict[str, Any]
    created_at: UtcDatetime

    @classmethod
    def of(cls, row: Event) -> "EventPublic":
        return cls(id=row.id, kind=row.kind, message=row.message, data=row.data or {}, created_at=row.created_at)


class EventsPublic(BaseModel):
    data: list[EventPublic]
    has_more: bool


class CheckpointPublic(BaseModel):
    step: int
    path: str
    """Folder relative to the artifacts folder."""
    metrics: dict[str, float]
    """The job's metrics at this step."""
    created_at: UtcDatetime

    @classmethod
    def of(cls, row: Checkpoint) -> "CheckpointPublic":
        return cls(step=row.step, path=row.path, metrics=row.metrics or {}, created_at=row.created_at)


class CheckpointsPublic(BaseModel):
    data: list[CheckpointPublic]
    has_more: bool = False


class SamplePublic(BaseModel):
    """A rollout kept by a job that samples as it trains, every ``log_samples_every`` steps (a hyperparameter of
    those types)."""

    position: int
    """Its place among the step's samples (the batch's order: a GRPO group's samples side by side)."""
    prompt: str
    """The prompt as the policy saw it (a chat prompt rendered by the chat template); at most 4000 characters."""
    response: str
    """The sampled response; at most 4000 characters."""
    rewards: dict[str, float]
    """Its reward by component: ``score`` (a reward model), or each grader's score and ``total``."""
    kl: float
    """The summed log-ratio of policy to reference over the response's tokens."""
    length: int
    """Response tokens."""

    @classmethod
    def of(cls, row: Sample) -> "SamplePublic":
        return cls(position=row.position, prompt=row.prompt, response=row.response, rewards=row.rewards or {},
                   kl=row.kl, length=row.length)  # fmt: skip


class SamplesPublic(BaseModel):
    object: Literal["list"] = "list"
    step: int | None
    """The step of ``data`` (None while the job has kept no samples)."""
    steps: list[int]
    """Every step with samples, ascending."""
    reward_names: list[str]
    """The reward components of ``data``'s samples, in order."""
    data: list[SamplePublic]


# --- generation --------------------------------------------------------------------------------

MAX_PROMPTS = 64
"""Prompts per generate request."""
MAX_PROMPT_CHARS = 8192
"""Characters per prompt (longer prompts would be truncated to the model's context anyway)."""
MAX_NEW_TOKENS = 512
"""Tokens sampled per completion at most."""


class GenerateRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        strict=True,  # JSON types as declared: no "3" for 3, no 0 for false
        use_attribute_docstrings=True,
        json_schema_extra={
            "examples": [
                {"prompts": ["Review: the battery"], "checkpoint": "latest", "max_new_tokens": 24, "score": True}
            ]
        },
    )

    prompts: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]],
        Field(min_length=1, max_length=MAX_PROMPTS),
    ]
    """Prompts to complete: 1 to 64, each 1 to 8192 characters."""
    checkpoint: Literal["latest"] | Annotated[int, Field(ge=0, le=MAX_INT32)] = "latest"
    """The checkpoint step to sample from, or ``latest``."""
    max_new_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)] = 32
    """Most tokens sampled per completion."""
    temperature: Annotated[float, Field(ge=0, le=5)] = 0.7
    """Sampling temperature (0: greedy)."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Nucleus sampling: sample from the smallest token set with this probability mass."""
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] = 0
    """Seeds the sampling, so a request is reproducible."""
    score: bool = False
    """Also score each completion with the job's reward model."""


class Completion(BaseModel):
    prompt: str
    text: str
    finish_reason: str
    """``stop`` (an end-of-sequence token) or ``length`` (``max_new_tokens`` reached)."""
    score: float | None = None
    """Reward-model score; present only when asked for."""


class GenerateResponse(BaseModel):
    checkpoint: int
    """The step of the checkpoint that generated."""
    completions: list[Completion]


# --- health ------------------------------------------------------------------------------------


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    status: Literal["ok"] = "ok"
    checks: dict[str, str]

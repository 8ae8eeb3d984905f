"""OpenAI's fine-tuning API over this service's jobs: a create request made a job spec, and a job shown as
OpenAI's ``fine_tuning.job``, event and checkpoint objects. Torch-free and pure; the routes are
``api/routes/fine_tuning.py``.

The methods are the job types whose registry entry names one (``JobTypeInfo.openai_method``): ``supervised`` →
``sft``, ``dpo`` → ``dpo``, ``reinforcement`` → ``grpo``. Every job of those types is a fine-tuning job, however
it was created, and every fine-tuning job is a job of ``/v1/jobs``: nothing is stored twice.
"""

import hashlib
import math
import secrets
import time
from typing import Any, Literal

from api.openai_schemas import (
    CheckpointMetrics,
    DpoHyperparameters,
    FineTuningCheckpoint,
    FineTuningError,
    FineTuningEvent,
    FineTuningJob,
    FineTuningJobCreate,
    Hyperparameters,
    MethodObject,
    ReinforcementHyperparameters,
)
from api.schemas import MAX_INT32, unix
from engine.spec.auto import auto_batch_size, auto_epochs
from engine.spec.config import JOB_TYPES
from jobs.store.models import Checkpoint, Event, Job

METHOD_TYPES = {info.openai_method: name for name, info in JOB_TYPES.items() if info.openai_method}
"""Job type of each fine-tuning method."""
FINE_TUNING_TYPES = tuple(METHOD_TYPES.values())

DEFAULT_GROUP_SIZE = 8
"""``compute_multiplier: 1``: responses sampled per prompt."""
MAX_MINI_BATCH = 64


class RequestError(ValueError):
    """A create request this service cannot turn into a job; ``param`` names the request's field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def _default_lr(job_type: str) -> float:
    value = JOB_TYPES[job_type].config.model_fields["learning_rate"].default
    assert isinstance(value, float)
    return value


def _pick(value: Any, auto: Any) -> Any:
    return auto if value is None else value


def request_seed(idempotency_key: str | None) -> int:
    """The seed of a request that gives none: drawn at random (as OpenAI does), or, with an Idempotency-Key,
    derived from it, so that a retried request stores the same spec."""
    if idempotency_key is None:
        return secrets.randbelow(MAX_INT32 + 1)
    return int.from_bytes(hashlib.sha256(idempotency_key.encode()).digest()[:4], "big") % (MAX_INT32 + 1)


def spec_of(body: FineTuningJobCreate, rows: int, seed: int) -> dict[str, Any]:
    """The job spec of a create request whose training file has ``rows`` rows: ``auto`` values chosen from that
        size (the learning rate left to the rules of engine/spec/auto.py, by the model's width, as ``POST /v1/jobs``
    leaves it), ``learning_rate_multiplier`` scaling the job type's default learning rate, a checkpoint every epoch (the
        last three kept, as OpenAI keeps them). Raises RequestError for a value this service cannot honour."""
    method = body.method_type
    job_type = METHOD_TYPES[method]
    given = body.method_hyperparameters()
    prefix = f"method.{method}.hyperparameters" if body.method is not None else "hyperparameters"
    batch_size = _pick(given.batch_size, auto_batch_size(rows))
    if batch_size > rows:
        raise RequestError(
            f"{prefix}.batch_size", f"batch_size {batch_size} is more than the training file's {rows} examples"
        )
    epochs = _pick(given.n_epochs, auto_epochs(rows))
    steps_per_epoch = rows // batch_size
    hyperparameters: dict[str, Any] = {"batch_size": batch_size}
    if given.learning_rate_multiplier is not None:  # "auto": the rate POST /v1/jobs chooses by the model's width
        hyperparameters["learning_rate"] = given.learning_rate_multiplier * _default_lr(job_type)
    if hyperparameters.get("learning_rate", 0) > 1:
        raise RequestError(
            f"{prefix}.learning_rate_multiplier",
            f"the learning rate would be {hyperparameters['learning_rate']:g}, more than 1 "
            f"(the multiplier scales {_default_lr(job_type):g})",
        )
    spec: dict[str, Any] = {
        "type": job_type,
        "model": body.model,
        "dataset": body.training_file,
        "seed": seed,
        "checkpoint_every": steps_per_epoch,
        "keep_checkpoints": 3,
        "metadata": body.metadata or {},
    }
    if body.suffix:
        spec["name"] = body.suffix
    if body.validation_file is not None:
        spec["eval_dataset"] = body.validation_file
        hyperparameters["eval_every"] = steps_per_epoch
    if isinstance(given, DpoHyperparameters):
        hyperparameters["beta"] = _pick(given.beta, 0.1)
    if isinstance(given, ReinforcementHyperparameters):
        assert body.method is not None and body.method.reinforcement is not None
        spec["reward"] = body.method.reinforcement.grader
        group_size = max(2, round(DEFAULT_GROUP_SIZE * _pick(given.compute_multiplier, 1.0)))
        hyperparameters |= {
            "total_steps": epochs * steps_per_epoch,
            "group_size": group_size,
            "mini_batch_size": math.gcd(batch_size * group_size, MAX_MINI_BATCH),
        }
        if given.eval_interval is not None:
            hyperparameters["eval_every"] = given.eval_interval
        if given.eval_samples is not None:
            hyperparameters["eval_max_prompts"] = given.eval_samples
    else:
        hyperparameters["epochs"] = epochs
    spec["hyperparameters"] = hyperparameters
    return spec


# Request fields for the spec's: a native validation error's param, said in the request's terms.
_PARAMS = {"dataset": "training_file", "eval_dataset": "validation_file", "name": "suffix", "reward": "grader"}
_HYPERPARAMETERS = {
    "epochs": "n_epochs",
    "total_steps": "n_epochs",
    "learning_rate": "learning_rate_multiplier",
    "group_size": "compute_multiplier",
    "eval_every": "eval_interval",
    "eval_max_prompts": "eval_samples",
}


def request_param(param: str | None, body: FineTuningJobCreate) -> str | None:
    """The create request's field behind a job spec's field (``dataset`` → ``training_file``,
    ``hyperparameters.epochs`` → ``method.supervised.hyperparameters.n_epochs``)."""
    if param is None:
        return None
    head, _, rest = param.partition(".")
    method = f"method.{body.method_type}" if body.method is not None else ""
    if head == "hyperparameters":
        name, _, deeper = rest.partition(".")
        where = f"{method}.hyperparameters" if method else "hyperparameters"
        return ".".join(part for part in (where, _HYPERPARAMETERS.get(name, name), deeper) if part)
    if head == "reward":
        return ".".join(part for part in ("method.reinforcement.grader", rest) if part)
    return ".".join(part for part in (_PARAMS.get(head, head), rest) if part)


# --- jobs as OpenAI's objects --------------------------------------------------------------------------------

_STATUSES = {
    "waiting": "queued",
    "queued": "queued",
    "running": "running",
    "pausing": "running",
    "cancelling": "running",
    "paused": "paused",
    "succeeded": "succeeded",
    "failed": "failed",
    "cancelled": "cancelled",
}
"""OpenAI's status of each of ours (``paused`` is OpenAI's too, though its SDK's type does not list it yet)."""


def _number(value: float) -> int | float:
    """An integral float as an int (epochs are stored as floats)."""
    return int(value) if float(value).is_integer() else value


def method_of(job: Job, rows: int | None) -> MethodObject:
    """The ``method`` of a job of a fine-tuning type, its hyperparameters read back from the stored spec (the
    epochs of a ``reinforcement`` job from its steps and its training file's ``rows``, None when not known)."""
    config = JOB_TYPES[job.type].config  # a spec is stored with every default; older rows may lack some
    hp = {name: field.default for name, field in config.model_fields.items()} | job.spec.get("hyperparameters", {})
    common = {
        "batch_size": hp["batch_size"],
        "learning_rate_multiplier": float(f"{hp['learning_rate'] / _default_lr(job.type):.6g}"),
    }
    method = JOB_TYPES[job.type].openai_method
    if method == "supervised":
        return MethodObject(type=method, supervised={"hyperparameters": {**common, "n_epochs": _number(hp["epochs"])}})
    if method == "dpo":
        hyperparameters = {**common, "n_epochs": _number(hp["epochs"]), "beta": hp["beta"]}
        return MethodObject(type=method, dpo={"hyperparameters": hyperparameters})
    assert method == "reinforcement"
    steps_per_epoch = rows // hp["batch_size"] if rows else 0
    hyperparameters = {
        **common,
        "n_epochs": math.ceil(hp["total_steps"] / steps_per_epoch) if steps_per_epoch else None,
        "compute_multiplier": hp["group_size"] / DEFAULT_GROUP_SIZE,
        "eval_interval": hp.get("eval_every"),
        "eval_samples": hp["eval_max_prompts"],
        "reasoning_effort": "default",
    }
    grader = job.spec.get("reward") or {"type": "model", "model": job.spec.get("reward_model")}
    return MethodObject(type=method, reinforcement={"grader": grader, "hyperparameters": hyperparameters})


def job_object(job: Job, organization_id: str, rows: int | None, now: float | None = None) -> FineTuningJob:
    """A job of a fine-tuning type as OpenAI's ``fine_tuning.job``; ``rows``: its training file's rows."""
    method = method_of(job, rows)
    chosen = getattr(method, method.type).hyperparameters
    error = None
    if job.status == "failed":
        error = FineTuningError(code=job.error_code or "failed", message=job.error_message or "the job failed")
    return FineTuningJob(
        id=job.id,
        created_at=unix(job.created_at),
        error=error,
        fine_tuned_model=f"job:{job.id}" if job.status == "succeeded" else None,
        finished_at=unix(job.finished_at) if job.finished_at else None,
        hyperparameters=Hyperparameters(
            batch_size=chosen.batch_size,
            learning_rate_multiplier=chosen.learning_rate_multiplier,
            n_epochs=chosen.n_epochs,
        ),
        model=job.spec["model"],
        organization_id=organization_id,
        seed=job.spec.get("seed", 0),
        status=_STATUSES[job.status],
        training_file=job.spec["dataset"],
        validation_file=job.spec.get("eval_dataset"),
        estimated_finish=estimated_finish(job, time.time() if now is None else now),
        metadata=job.spec.get("metadata") or None,
        method=method,
    )


def estimated_finish(job: Job, now: float) -> int | None:
    """When a running job should end at its pace so far (Unix seconds); None before its first step."""
    if job.status != "running" or job.started_at is None or not job.step or not job.total_steps:
        return None
    started = unix(job.started_at)
    return round(started + (now - started) * job.total_steps / job.step)


_LEVELS: dict[str, Literal["error", "warn"]] = {"error": "error", "warning": "warn"}


def event_object(number: int, event: Event) -> FineTuningEvent:
    """The job's event ``number`` (1 for its first): ids count within the job, like OpenAI's."""
    return FineTuningEvent(
        id=f"ftevent-{number}",
        created_at=unix(event.created_at),
        level="error" if (event.data or {}).get("status") == "failed" else _LEVELS.get(event.kind, "info"),
        message=event.message,
        data=event.data or {},
    )


def checkpoint_object(job: Job, checkpoint: Checkpoint) -> FineTuningCheckpoint:
    """A kept checkpoint, its id that of its step within the job (``ftckpt-<step>``); its model
    (``job:<id>@<step>``) is served by ``/v1/chat/completions``."""
    losses = [name for name in JOB_TYPES[job.type].metrics if name.startswith("loss/")]
    values = checkpoint.metrics or {}
    return FineTuningCheckpoint(
        id=f"ftckpt-{checkpoint.step}",
        created_at=unix(checkpoint.created_at),
        fine_tuned_model_checkpoint=f"job:{job.id}@{checkpoint.step}",
        fine_tuning_job_id=job.id,
        metrics=CheckpointMetrics(
            step=checkpoint.step,
            train_loss=values.get(losses[0]) if losses else None,
            valid_loss=values.get("eval/loss"),
            full_valid_loss=values.get("eval/loss"),
        ),
        step_number=checkpoint.step,
    )


def cursor(value: str | None, prefix: str) -> int | None:
    """The number in an ``after`` cursor (``ftevent-12`` → 12); RequestError for anything else."""
    if value is None:
        return None
    digits = value.removeprefix(prefix)
    if not value.startswith(prefix) or not digits.isdigit() or len(digits) > 18:
        raise RequestError("after", f"{value[:40]!r} is not an id of this list (they look like {prefix}123)")
    return int(digits)

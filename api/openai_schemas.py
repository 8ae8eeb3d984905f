"""Request and response bodies of the OpenAI-compatible endpoints (``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``, ``/v1/fine_tuning/jobs``): the fields of OpenAI's API that this service can honour, under
the caps of ``POST /v1/jobs/{id}/generate``.

Unknown fields are refused (422), as everywhere in this API. OpenAI fields that change nothing at their
neutral value (``frequency_penalty: 0``, ``logprobs: null``, ``echo: false``, ``user`` …) are accepted, so
clients that send them work; a value this service cannot honour is a 422 naming the field.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from api.schemas import MAX_INT32, MAX_NEW_TOKENS, MAX_PROMPT_CHARS, MAX_PROMPTS
from engine.spec.config import MAX_BATCH_SIZE, refuse_bool

MAX_N = 16
"""Most samples per prompt; prompts × n is also capped at ``MAX_PROMPTS``."""
MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_MESSAGES = 64
MAX_MODEL_CHARS = 200
DEFAULT_MAX_TOKENS = 16

Prompt = Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]

# Fields OpenAI defines that this service does not implement, with the values that mean "off".
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)

    include_usage: bool = False
    """Send a last chunk, before ``[DONE]``, with ``usage`` and no choices."""


class Sampling(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)

    model: Annotated[str, Field(min_length=1, max_length=MAX_MODEL_CHARS)]
    """``job:<id>`` (a succeeded job's final model) or ``job:<id>@<step>`` (a checkpoint); see ``GET /v1/models``."""
    max_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)] | None = None
    """Most tokens sampled per choice (default 16)."""
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    """Sampling temperature, 0 to 2 (0: greedy; default 1)."""
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    """Nucleus sampling: sample from the smallest token set with this probability mass (default 1)."""
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    """Choices per prompt (default 1): distinct samples."""
    seed: Annotated[int, Field(ge=0, le=MAX_INT32)] | None = None
    """Seeds the sampling: the same request with the same seed returns the same choices. Without one, a random
    seed is drawn."""
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    """Up to 4 strings; a choice's text ends before the first one it produces (finish reason ``stop``)."""
    stream: bool | None = False
    """Answer with Server-Sent Events (``data: {chunk}``, then ``data: [DONE]``)."""
    stream_options: StreamOptions | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    """Accepted and ignored."""
    # Accepted at their neutral values only (see the module's docstring).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None

    @model_validator(mode="after")
    def _neutral_values(self) -> "Sampling":
        for name in self.model_fields_set:
            allowed = _NEUTRAL.get(name)
            if allowed is not None and getattr(self, name) not in allowed:
                raise ValueError(f"{name}: this server does not support {name} (leave it out, or at its default)")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(Sampling):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"model": "job:job_0123456789ab", "prompt": "Review: the battery", "max_tokens": 16}]
        }
    )

    prompt: Prompt | Annotated[list[Prompt], Field(min_length=1, max_length=MAX_PROMPTS)]
    """A prompt, or a list of 1 to 64 prompts (each 1 to 8192 characters); token arrays are not accepted."""
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    @model_validator(mode="after")
    def _choices_cap(self) -> "CompletionRequest":
        if len(self.prompts) * (self.n or 1) > MAX_PROMPTS:
            raise ValueError(f"n: prompts × n must be at most {MAX_PROMPTS}")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | Annotated[list[TextPart], Field(max_length=16)]
    """Text, or a list of text parts (joined)."""
    name: Annotated[str, Field(max_length=64)] | None = None
    """Accepted and ignored."""

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(Sampling):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"model": "job:job_0123456789ab", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 16}
            ]
        }
    )

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    """The conversation so far, formatted with the model's chat template (models without one answer 400
    ``chat_template_missing``)."""
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)] | None = None
    """Same as ``max_tokens`` (OpenAI's newer name); wins when both are given."""
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


# --- responses ---------------------------------------------------------------------------------


class Model(BaseModel):
    id: str
    """``job:<id>`` or ``job:<id>@<step>``."""
    object: Literal["model"] = "model"
    created: int
    """Unix time: when the checkpoint was saved (for ``job:<id>``, its final one)."""
    owned_by: str
    """The project's name."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    """``stop``: an end-of-sequence token or a stop string; ``length``: ``max_tokens`` reached (null in stream
    chunks before a choice's last)."""
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    """One ``data:`` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# --- fine-tuning (/v1/fine_tuning/jobs) ------------------------------------------------------------------------
# The objects of OpenAI's fine-tuning API as its Python SDK types them (openai/types/fine_tuning/). Requests refuse
# unknown fields; "auto" (or an absent value) lets the service choose from the training file's size.


def _auto(value: Any) -> Any:
    return None if value == "auto" else value


Auto = BeforeValidator(_auto)
"""``"auto"`` read as None (absent): the service chooses."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_bool(value, info, cls.model_fields)


class SupervisedHyperparameters(_Request):
    batch_size: Annotated[Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)] | None, Auto] = None
    """Examples per step; auto: about 0.2% of the training file, 1 to 256."""
    learning_rate_multiplier: Annotated[Annotated[float, Field(gt=0, le=1e6)] | None, Auto] = None
    """Scales the job type's default learning rate (sft 1e-3, dpo 1e-6, grpo 1e-5); auto: 1."""
    n_epochs: Annotated[Annotated[int, Field(ge=1, le=1000)] | None, Auto] = None
    """Passes over the training file; auto: 3, more for a small file (at least 100 examples seen, at most 25
    epochs), fewer for a large one (at most 25,000 examples)."""


class DpoHyperparameters(SupervisedHyperparameters):
    beta: Annotated[Annotated[float, Field(gt=0, le=100)] | None, Auto] = None
    """Strength of the pull towards the reference policy; auto: 0.1."""


class ReinforcementHyperparameters(SupervisedHyperparameters):
    compute_multiplier: Annotated[Annotated[float, Field(gt=0, le=128)] | None, Auto] = None
    """Scales the responses sampled per prompt (8 at 1; at least 2)."""
    eval_interval: Annotated[Annotated[int, Field(ge=1, le=10_000_000)] | None, Auto] = None
    """Steps between evaluations on the validation file; auto: once an epoch."""
    eval_samples: Annotated[Annotated[int, Field(ge=1, le=1_000_000)] | None, Auto] = None
    """Validation prompts an evaluation samples (the first ones); auto: up to 256."""
    reasoning_effort: Literal["default"] | None = None
    """Only ``default``: the models trained here have no reasoning-effort setting."""


class SupervisedMethod(_Request):
    hyperparameters: SupervisedHyperparameters | None = None


class DpoMethod(_Request):
    hyperparameters: DpoHyperparameters | None = None


class ReinforcementMethod(_Request):
    grader: dict[str, Any]
    """The reward: an OpenAI grader (``string_check``, ``text_similarity``, ``score_model`` and ``label_model``
    judged by the server's judges, ``python`` with ``source``, run in a sandbox, or a ``function`` the server
    allows, ``multi``) or this service's ``model`` and ``http`` rewards; see the job spec's ``reward``."""
    hyperparameters: ReinforcementHyperparameters | None = None


class Method(_Request):
    type: Literal["supervised", "dpo", "reinforcement"]
    supervised: SupervisedMethod | None = None
    dpo: DpoMethod | None = None
    reinforcement: ReinforcementMethod | None = None

    @model_validator(mode="after")
    def _one_method(self) -> "Method":
        for name in ("supervised", "dpo", "reinforcement"):
            if name != self.type and getattr(self, name) is not None:
                raise ValueError(f"{name} is given, but the method's type is {self.type}")
        if self.type == "reinforcement" and self.reinforcement is None:
            raise ValueError("reinforcement (with its grader) is required for the reinforcement method")
        return self


class WandbIntegration(_Request):
    type: Literal["wandb"]
    wandb: dict[str, Any]


class FineTuningJobCreate(_Request):
    """``POST /v1/fine_tuning/jobs``."""

    model: Annotated[str, Field(min_length=1, max_length=500)]
    """The model to fine-tune, named as a job spec names one: a model under the server's model root, a hub id the
    server may download, ``job:<id>`` or ``job:<id>@<step>`` (an earlier job's ``fine_tuned_model`` or checkpoint)."""
    training_file: Annotated[str, Field(min_length=1, max_length=64)]
    """A ``file-`` id: a file uploaded with purpose ``fine-tune`` in the method's format (or a dataset of the kind
    the method reads)."""
    validation_file: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    hyperparameters: SupervisedHyperparameters | None = None
    """Deprecated by OpenAI in favour of ``method``: the supervised method's hyperparameters."""
    method: Method | None = None
    """``supervised`` (the default), ``dpo`` or ``reinforcement``."""
    seed: Annotated[int, Field(ge=0, le=MAX_INT32)] | None = None
    """Seeds the job (drawn at random when absent)."""
    suffix: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    """Becomes the job's ``name``."""
    metadata: dict[str, str] | None = None
    integrations: list[WandbIntegration] | None = None
    """Not supported (an empty list is accepted): use the job spec's ``tracking`` through ``/v1/jobs``, or the
    server's ``RLHF_TRACKING``."""

    @model_validator(mode="after")
    def _where_hyperparameters_go(self) -> "FineTuningJobCreate":
        if self.hyperparameters is not None and self.method is not None:
            raise ValueError("hyperparameters: give them in method.<type>.hyperparameters when method is given")
        if self.integrations:
            raise ValueError(
                "integrations: not supported here; switch on W&B, MLflow or TensorBoard with a job spec's tracking "
                "(POST /v1/jobs) or the server's RLHF_TRACKING"
            )
        return self

    @property
    def method_type(self) -> Literal["supervised", "dpo", "reinforcement"]:
        return "supervised" if self.method is None else self.method.type

    def method_hyperparameters(self) -> SupervisedHyperparameters:
        """The given hyperparameters of the method (all absent: each auto)."""
        if self.method is None:
            return self.hyperparameters or SupervisedHyperparameters()
        given = getattr(self.method, self.method.type)
        defaults = {"supervised": SupervisedHyperparameters, "dpo": DpoHyperparameters}
        if given is None or given.hyperparameters is None:
            return defaults.get(self.method.type, ReinforcementHyperparameters)()
        hyperparameters: SupervisedHyperparameters = given.hyperparameters
        return hyperparameters


class FineTuningError(BaseModel):
    code: str
    message: str
    param: str | None = None


class Hyperparameters(BaseModel):
    batch_size: int | None = None
    learning_rate_multiplier: float | None = None
    n_epochs: int | float | None = None


class MethodObject(BaseModel):
    """A job's ``method``, every hyperparameter as chosen."""

    type: Literal["supervised", "dpo", "reinforcement"]
    supervised: SupervisedMethod | None = None
    dpo: DpoMethod | None = None
    reinforcement: ReinforcementMethod | None = None


class FineTuningJob(BaseModel):
    """OpenAI's ``fine_tuning.job``: one of this service's sft, dpo or grpo jobs."""

    id: str
    """The job's id, the same in ``/v1/jobs``."""
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: FineTuningError | None = None
    fine_tuned_model: str | None = None
    """``job:<id>`` once the job succeeded: a model of ``/v1/chat/completions`` and ``/v1/completions``."""
    finished_at: int | None = None
    hyperparameters: Hyperparameters
    model: str
    organization_id: str
    """The project's id."""
    result_files: list[str] = []
    seed: int
    status: Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled", "paused"]
    trained_tokens: int | None = None
    """Not counted (always null)."""
    training_file: str
    validation_file: str | None = None
    estimated_finish: int | None = None
    integrations: list[WandbIntegration] | None = None
    metadata: dict[str, str] | None = None
    method: MethodObject


class FineTuningJobs(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningJob]
    has_more: bool


class FineTuningEvent(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    data: dict[str, Any] | None = None
    type: Literal["message", "metrics"] = "message"


class FineTuningEvents(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningEvent]
    has_more: bool


class CheckpointMetrics(BaseModel):
    step: float | None = None
    train_loss: float | None = None
    train_mean_token_accuracy: float | None = None
    valid_loss: float | None = None
    valid_mean_token_accuracy: float | None = None
    full_valid_loss: float | None = None
    full_valid_mean_token_accuracy: float | None = None


class FineTuningCheckpoint(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    """``job:<id>@<step>``: a model of ``/v1/chat/completions``."""
    fine_tuning_job_id: str
    metrics: CheckpointMetrics
    step_number: int


class FineTuningCheckpoints(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningCheckpoint]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None

"""Request and response bodies of the OpenAI-compatible endpoints (``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``): the fields of OpenAI's API that this service can honour, under the caps of
``POST /v1/jobs/{id}/generate``.

Unknown fields are refused (422), as everywhere in this API. OpenAI fields that change nothing at their
neutral value (``frequency_penalty: 0``, ``logprobs: null``, ``echo: false``, ``user`` …) are accepted, so
clients that send them work; a value this service cannot honour is a 422 naming the field.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.schemas import MAX_INT32, MAX_NEW_TOKENS, MAX_PROMPT_CHARS, MAX_PROMPTS

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

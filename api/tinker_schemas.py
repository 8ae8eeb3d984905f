"""The request bodies of the Tinker-compatible API (``/api/v1``) as the ``tinker`` SDK 0.38 sends them (its
``tinker/types``), and the answers it reads. Requests ignore fields they do not use (the SDK adds some in newer
versions); what they use is checked here, and a bad value is a 400 naming the field."""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

SUPPORTED_SDK = ("0.38",)
"""The ``tinker`` SDK versions (major.minor) this server speaks; the README says so too."""
SEQ_MAX = 2**31 - 1
"""The largest ``seq_id`` (and model or sampler number): the SDK's protobuf carries a forward_backward's as int32."""
TTL_MAX = 10 * 366 * 24 * 3600
"""The SDK's longest time to live of saved weights: 10 years."""


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class ClientConfigRequest(Request):
    sdk_version: str = ""


class CreateSessionRequest(Request):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    display_name: str | None = None


class SessionHeartbeatRequest(Request):
    session_id: str


class FinishReason(Request):
    type: Literal["success", "errored", "interrupted"]


class FinishSessionRequest(Request):
    reason: FinishReason


class LoraConfig(Request):
    rank: int = Field(default=32, ge=1, le=1024)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(Request):
    type: Literal["adamw"] = "adamw"


class CreateModelRequest(Request):
    session_id: str
    model_seq_id: int = Field(ge=0, le=SEQ_MAX)
    base_model: str = Field(min_length=1, max_length=500)
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    """None: every weight trains (full fine-tuning)."""
    optimizer_config: OptimizerConfig = OptimizerConfig()


class ModelRequest(Request):
    model_id: str = Field(max_length=120)


class AdamParams(Request):
    learning_rate: float = Field(default=1e-4, ge=0, le=10)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-12, gt=0, le=1)
    weight_decay: float = Field(default=0.0, ge=0, le=10)
    grad_clip_norm: float = Field(default=0.0, ge=0)
    """0: no clipping."""


class OptimStepRequest(ModelRequest):
    adam_params: AdamParams
    seq_id: int = Field(ge=1, le=SEQ_MAX)


def _not_only_dots(name: str) -> str:
    if not name.strip("."):
        raise ValueError(f"{name!r} names a folder above the weights, not a name of its own: use a letter or digit")
    return name


CheckpointName = Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,200}$"), AfterValidator(_not_only_dots)]
"""A saved weights' name: it is the last part of a ``tinker://`` path, and a folder name on the server (so never
``.`` or ``..``, nor anything else made only of dots)."""


class SaveWeightsRequest(ModelRequest):
    path: CheckpointName
    seq_id: int = Field(ge=1, le=SEQ_MAX)
    overwrite: bool = False


class SaveWeightsForSamplerRequest(ModelRequest):
    path: CheckpointName | None = None
    sampling_session_seq_id: int | None = Field(default=None, ge=0, le=SEQ_MAX)
    seq_id: int = Field(ge=1, le=SEQ_MAX)


class SaveWeightsExternalRequest(ModelRequest):
    """The weights in Hugging Face's format (with LoRA, the PEFT adapter), for ``tinker checkpoint download``."""

    path: CheckpointName
    seq_id: int = Field(ge=1, le=SEQ_MAX)
    ttl_seconds: int | None = Field(default=None, ge=3600, le=TTL_MAX)
    """Accepted; this server keeps saved weights until they are deleted."""
    age_encryption_recipients: list[str] | None = Field(default=None, max_length=0)
    """Files encrypted with age are not offered by this server: none or an empty list."""


class TtlRequest(Request):
    ttl_seconds: int | None = Field(ge=3600, le=TTL_MAX)


class LoadWeightsRequest(Request):
    """Either weights loaded into a model of the session (``model_id`` and ``seq_id``), or a new model created from
    them (``session_id`` and ``model_seq_id``: the SDK's ``create_training_client_from_state``)."""

    path: str = Field(max_length=1000)
    optimizer: bool = False
    model_id: str | None = Field(default=None, max_length=120)
    seq_id: int | None = Field(default=None, ge=1, le=SEQ_MAX)
    session_id: str | None = None
    model_seq_id: int | None = Field(default=None, ge=0, le=SEQ_MAX)
    user_metadata: dict[str, Any] | None = None


class CreateSamplingSessionRequest(Request):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0, le=SEQ_MAX)
    base_model: str | None = Field(default=None, max_length=500)
    model_path: str | None = Field(default=None, max_length=1000)


class SamplingParams(Request):
    """The SDK's ``SamplingParams``: each field of its type and range, so that a wrong one is the client's error
    naming it (the worker checks what depends on the model: the context, the vocabulary)."""

    max_tokens: int | None = Field(default=None, ge=1, le=SEQ_MAX)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    """Any seed torch's generator takes."""
    stop: str | list[str] | list[int] | None = None
    """Stop strings or token ids; None: the model's EOS; ``[]``: none."""
    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    top_k: int = Field(default=-1, ge=-1, le=SEQ_MAX)
    top_p: float = Field(default=1.0, gt=0, le=1)

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop(cls, value: Any) -> str | list[str] | list[int] | None:
        """One error at ``stop`` itself (a union's would name its members)."""
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return value
        if isinstance(value, list) and all(type(item) is int and 0 <= item <= SEQ_MAX for item in value):
            return value
        raise ValueError("a string, a list of strings, or a list of token ids (integers from 0)")


class SampleRequest(Request):
    sampling_session_id: str = Field(max_length=120)
    seq_id: int = Field(ge=0, le=SEQ_MAX)
    num_samples: int = Field(default=1, ge=1, le=256)
    prompt: dict[str, Any]
    sampling_params: SamplingParams
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=0)
    """Top-k prompt log-probs are not served (0 only)."""


class RetrieveFutureRequest(Request):
    request_id: str = Field(max_length=40)
    allow_metadata_only: bool = False


class CancelFutureRequest(Request):
    request_id: str = Field(max_length=40)


class WeightsInfoRequest(Request):
    tinker_path: str = Field(max_length=1000)


class Future(BaseModel):
    """What every operation answers at once: its ``request_id`` for ``retrieve_future``."""

    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None

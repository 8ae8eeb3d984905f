"""The request bodies of the Tinker-compatible API (``/api/v1``) as the ``tinker`` SDK 0.38 sends them (its
``tinker/types``), and the answers it reads. Requests ignore fields they do not use (the SDK adds some in newer
versions); what they use is checked here, and a bad value is a 400 naming the field."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SUPPORTED_SDK = ("0.38",)
"""The ``tinker`` SDK versions (major.minor) this server speaks; the README says so too."""


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
    model_seq_id: int = Field(ge=0)
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
    seq_id: int = Field(ge=1)


CHECKPOINT_NAME = r"^[A-Za-z0-9._-]{1,200}$"
"""A saved weights' name: it is the last part of a ``tinker://`` path, and a folder name on the server."""


class SaveWeightsRequest(ModelRequest):
    path: str = Field(pattern=CHECKPOINT_NAME)
    seq_id: int = Field(ge=1)
    overwrite: bool = False


class SaveWeightsForSamplerRequest(ModelRequest):
    path: str | None = Field(default=None, pattern=CHECKPOINT_NAME)
    sampling_session_seq_id: int | None = Field(default=None, ge=0)
    seq_id: int = Field(ge=1)


class LoadWeightsRequest(Request):
    """Either weights loaded into a model of the session (``model_id`` and ``seq_id``), or a new model created from
    them (``session_id`` and ``model_seq_id``: the SDK's ``create_training_client_from_state``)."""

    path: str = Field(max_length=1000)
    optimizer: bool = False
    model_id: str | None = Field(default=None, max_length=120)
    seq_id: int | None = Field(default=None, ge=1)
    session_id: str | None = None
    model_seq_id: int | None = Field(default=None, ge=0)
    user_metadata: dict[str, Any] | None = None


class CreateSamplingSessionRequest(Request):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = Field(default=None, max_length=500)
    model_path: str | None = Field(default=None, max_length=1000)


class SampleRequest(Request):
    sampling_session_id: str = Field(max_length=120)
    seq_id: int = Field(ge=0)
    num_samples: int = Field(default=1, ge=1, le=256)
    prompt: dict[str, Any]
    sampling_params: dict[str, Any]
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

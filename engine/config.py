"""Job specs and hyperparameters (torch-free, so the API can validate without importing torch).

A :class:`JobSpec` is the body of ``POST /v1/jobs`` and of ``rlhf train SPEC``. Every field has
a docstring and a validated range; unknown fields are errors. Derived batch sizes are computed
once here with exact-division checks, so a bad spec fails before any model is loaded.
"""

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from engine.builtin import DATASETS, TINY_MODEL

JobType = Literal["sft", "rm", "ppo"]
Scheduler = Literal["constant", "linear", "cosine"]


def _clean_text(value: str) -> str:
    """Refuse NUL and other control characters (tab and newline aside) and lone surrogates: text a database
    cannot store or a log would garble."""
    for char in value:
        if (ord(char) < 32 and char not in "\t\n\r") or ord(char) == 127 or 0xD800 <= ord(char) <= 0xDFFF:
            raise ValueError(f"control characters and lone surrogates are not allowed (found {char!r})")
    return value


Text = Annotated[str, AfterValidator(_clean_text)]
"""A free-form string of a spec (a label, a metadata entry)."""

LORA_MAX_MODULES = 64
_MODULE_NAME = re.compile(r"^[A-Za-z0-9_.]{1,200}$")
METADATA_MAX_KEYS = 16
METADATA_MAX_KEY_CHARS = 64
METADATA_MAX_VALUE_CHARS = 512


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class TrainConfig(_Strict):
    """Fields shared by every job type."""

    learning_rate: Annotated[float, Field(gt=0, le=1)] = 1e-4
    """Peak AdamW learning rate."""
    weight_decay: Annotated[float, Field(ge=0, le=1)] = 0.0
    """AdamW decoupled weight decay."""
    adam_betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    """AdamW (beta1, beta2)."""
    adam_eps: Annotated[float, Field(gt=0, le=1e-3)] = 1e-8
    """AdamW epsilon."""
    lr_scheduler: Scheduler = "linear"
    """Decay after warm-up: constant, linear to 0, or cosine to 0 at the last step."""
    warmup_steps: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    """Optimizer steps of linear warm-up from 0 to ``learning_rate``."""
    max_grad_norm: Annotated[float, Field(gt=0, le=1e6)] | None = 1.0
    """Clip the global gradient norm to this value (None: no clipping)."""
    gradient_accumulation_steps: Annotated[int, Field(ge=1, le=1024)] = 1
    """Micro-batches per optimizer step; the batch must divide into them exactly."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights and compute dtype. bfloat16 needs a device that supports it."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    max_length: Annotated[int, Field(ge=8, le=131_072)] = 128
    """Longest prompt + completion in tokens; longer examples are truncated from the left of the prompt."""


class SFTConfig(TrainConfig):
    """Supervised fine-tuning: causal-LM loss on completion tokens only (prompt masked)."""

    learning_rate: Annotated[float, Field(gt=0, le=1)] = 1e-3
    """Peak AdamW learning rate."""
    batch_size: Annotated[int, Field(ge=1, le=65_536)] = 32
    """Examples per optimizer step (split into ``gradient_accumulation_steps`` micro-batches)."""
    epochs: Annotated[float, Field(gt=0, le=1000)] = 3.0
    """Passes over the dataset; fractions allowed. Ignored when ``max_steps`` is set."""
    max_steps: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    """Total optimizer steps, overriding ``epochs``."""
    eval_every: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    """Compute ``eval/loss`` every this many steps (and at the end) when an eval dataset is given."""

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.gradient_accumulation_steps

    @model_validator(mode="after")
    def _divides(self) -> "SFTConfig":
        _check_divides("batch_size", self.batch_size, "gradient_accumulation_steps", self.gradient_accumulation_steps)
        return self


class RMConfig(SFTConfig):
    """Reward model: pairwise loss -log σ(r_chosen - r_rejected - margin) on a scalar head."""

    learning_rate: Annotated[float, Field(gt=0, le=1)] = 5e-4
    """Peak AdamW learning rate."""
    epochs: Annotated[float, Field(gt=0, le=1000)] = 1.0
    """Passes over the preference pairs; fractions allowed. Ignored when ``max_steps`` is set."""
    margin: Annotated[float, Field(ge=0, le=100)] = 0.0
    """Required score gap between chosen and rejected (0: plain Bradley-Terry loss)."""
    lm_loss_coef: Annotated[float, Field(ge=0, le=100)] = 0.0
    """Weight of an LM loss on the chosen completion (MOSS-RLHF, arXiv:2307.04964); 0 disables it."""


class PPOConfig(TrainConfig):
    """PPO with a KL penalty to a frozen reference (Ziegler et al., arXiv:1909.08593)."""

    learning_rate: Annotated[float, Field(gt=0, le=1)] = 3e-5
    """Policy AdamW learning rate."""
    value_learning_rate: Annotated[float, Field(gt=0, le=1)] | None = None
    """Critic AdamW learning rate (None: same as ``learning_rate``)."""
    total_steps: Annotated[int, Field(ge=1, le=10_000_000)] = 100
    """PPO steps; one step is one rollout batch and its PPO epochs."""
    batch_size: Annotated[int, Field(ge=1, le=65_536)] = 64
    """Prompts per rollout."""
    mini_batch_size: Annotated[int, Field(ge=1, le=65_536)] = 32
    """Rollouts per optimizer step; ``batch_size`` must be a multiple of it."""
    ppo_epochs: Annotated[int, Field(ge=1, le=100)] = 2
    """Passes over each rollout batch."""
    max_prompt_length: Annotated[int, Field(ge=1, le=131_072)] = 64
    """Prompts longer than this are truncated from the left."""
    response_length: Annotated[int, Field(ge=1, le=65_536)] = 24
    """Tokens sampled per response (fewer when every response stopped)."""
    temperature: Annotated[float, Field(gt=0, le=10)] = 0.7
    """Sampling temperature; logprobs in training use the same temperature."""
    top_k: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    """Sample from the k most likely tokens only (0: the whole vocabulary)."""
    stop_token: Literal["eos"] | None = "eos"
    """Truncate each response after its first EOS token (None: never truncate)."""
    missing_eos_penalty: Annotated[float, Field(ge=0, le=1000)] = 1.0
    """Subtracted from the score of a response that did not stop (only with ``stop_token``)."""
    normalize_scores: bool = False
    """Normalise scores by the running mean/std of all scores so far (PPO-max, arXiv:2307.04964)."""
    score_clip: Annotated[float, Field(gt=0, le=1e6)] | None = None
    """Clip (normalised) scores to [-score_clip, score_clip]."""
    kl_coef: Annotated[float, Field(ge=0, le=100)] = 0.05
    """Initial coefficient β of the per-token KL penalty."""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """Per-token KL estimator (http://joschu.net/blog/kl-approx.html): k1 = logp - ref, k3 = e^-k1 - 1 + k1."""
    adaptive_kl: bool = False
    """Adapt β towards ``kl_target`` (Ziegler et al. 2019) instead of keeping it fixed."""
    kl_target: Annotated[float, Field(gt=0, le=1000)] = 6.0
    """Target KL per sequence for the adaptive controller."""
    kl_horizon: Annotated[int, Field(ge=1, le=100_000_000)] = 10_000
    """Horizon (in rollouts) of the adaptive controller."""
    gamma: Annotated[float, Field(ge=0, le=1)] = 1.0
    """Discount factor."""
    lam: Annotated[float, Field(ge=0, le=1)] = 0.95
    """GAE λ."""
    whiten_advantages: bool = True
    """Whiten advantages over the valid tokens of the rollout batch."""
    cliprange: Annotated[float, Field(gt=0, le=10)] = 0.2
    """Policy ratio clip ε."""
    cliprange_value: Annotated[float, Field(gt=0, le=1e6)] = 0.2
    """Value clip ε_v around the rollout's values."""
    vf_coef: Annotated[float, Field(ge=0, le=100)] = 0.1
    """Weight of the value loss."""
    entropy_coef: Annotated[float, Field(ge=0, le=100)] = 0.0
    """Weight of the entropy bonus (0: off)."""
    ptx_coef: Annotated[float, Field(ge=0, le=100)] = 0.0
    """Weight of the pretraining (SFT) loss mixed into each minibatch (InstructGPT's PPO-ptx)."""
    ptx_dataset: str | None = None
    """SFT-kind dataset for the ptx loss; required when ``ptx_coef`` > 0."""
    critic_warmup_steps: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    """First steps that train only the critic (policy frozen)."""
    target_approxkl: Annotated[float, Field(gt=0, le=1000)] | None = None
    """Stop a step's remaining PPO epochs once a minibatch's approx-KL exceeds this."""
    eval_every: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    """With an eval dataset: sample its prompts every this many steps (and at the end) and report
    ``eval/scores``, ``eval/kl`` and ``eval/length_mean``."""
    eval_max_prompts: Annotated[int, Field(ge=1, le=1_000_000)] = 256
    """Use at most this many eval prompts (the first ones)."""
    on_collapse: Literal["off", "warn", "pause", "stop"] = "warn"
    """What a collapse signal (MOSS-RLHF, arXiv:2307.04964 §2.1: a jump of reward or KL, a fall of perplexity, a
    blow-up of response length; thresholds below) does: "warn" records a ``warning`` event per signal and trains
    on; "pause" also ends the job paused without checkpointing the anomalous step, so its newest checkpoint is
    from before; "stop" ends it failed (error code ``training_collapse``), also without that checkpoint; "off":
    no check."""
    collapse_window: Annotated[int, Field(ge=2, le=1000)] = 20
    """Recent steps each collapse signal is compared with (their median)."""
    collapse_warmup: Annotated[int, Field(ge=1, le=1000)] = 5
    """Steps of history before the collapse signals are judged; at most ``collapse_window``."""
    collapse_reward_z: Annotated[float, Field(gt=0, le=1e6)] | None = 6.0
    """``reward_jump``: ``objective/scores`` more than this many spreads above its median, the spread being the
    larger of the window's standard deviation and 1.4826 × its median absolute deviation (None: off)."""
    collapse_kl_factor: Annotated[float, Field(gt=1, le=1e6)] | None = 3.0
    """``kl_jump``: ``objective/kl`` at least this many times its median, and at least ``collapse_kl_min``
    (None: off)."""
    collapse_kl_min: Annotated[float, Field(ge=0, le=1e6)] = 5.0
    """The smallest ``objective/kl`` (nats per sequence) a ``kl_jump`` is raised for: early in a healthy run KL
    grows from 0 by many times its median (the built-in demo ends near 2 nats), while the collapses seen in
    the prototype reached 21 and past 100."""
    collapse_perplexity_ratio: Annotated[float, Field(gt=0, lt=1)] | None = 0.5
    """``perplexity_collapse``: log ``response/perplexity`` below this fraction of its median's (0.5: a median
    perplexity of 4 fell below 2), the policy became near-deterministic (None: off)."""
    collapse_length_factor: Annotated[float, Field(gt=1, le=1000)] | None = 1.5
    """``length_blowup``: ``response/length_mean`` at least this many times its median, or every response at
    ``response_length`` while the median was below it (None: off)."""

    @property
    def micro_batch_size(self) -> int:
        return self.mini_batch_size // self.gradient_accumulation_steps

    @property
    def num_mini_batches(self) -> int:
        return self.batch_size // self.mini_batch_size

    @model_validator(mode="after")
    def _divides(self) -> "PPOConfig":
        _check_divides("batch_size", self.batch_size, "mini_batch_size", self.mini_batch_size)
        _check_divides(
            "mini_batch_size", self.mini_batch_size, "gradient_accumulation_steps", self.gradient_accumulation_steps
        )
        if self.ptx_coef > 0 and self.ptx_dataset is None:
            raise ValueError("ptx_dataset is required when ptx_coef > 0")
        if self.ptx_dataset is not None:
            _check_dataset_ref(self.ptx_dataset, "sft")
        if self.collapse_warmup > self.collapse_window:
            raise ValueError(
                f"collapse_warmup ({self.collapse_warmup}) must be at most collapse_window ({self.collapse_window})"
            )
        return self


class LoraSpec(_Strict):
    """Low-rank adapters on the policy."""

    r: Annotated[int, Field(ge=1, le=1024)] = 8
    """Adapter rank."""
    alpha: Annotated[int, Field(ge=1, le=4096)] = 16
    """Scaling numerator (scale = alpha / r)."""
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Dropout on the adapter input."""
    target_modules: Literal["auto"] | list[str] = "auto"
    """Module names to adapt (1 to 64 names of letters, digits, ``_`` and ``.``, e.g. ``["c_attn"]``), or "auto"
    for the attention and MLP projections."""

    @field_validator("target_modules", mode="before")
    @classmethod
    def _module_names(cls, value: Any) -> Any:
        if value == "auto":
            return value
        if not isinstance(value, list):
            raise ValueError("'auto' or a list of module names")
        if not 1 <= len(value) <= LORA_MAX_MODULES:
            raise ValueError(f"1 to {LORA_MAX_MODULES} module names, not {len(value)}")
        for name in value:
            if not isinstance(name, str) or not _MODULE_NAME.match(name):
                raise ValueError(f"not a module name: {str(name)[:50]!r} (letters, digits, '_' and '.', 1 to 200)")
        return value


TRAIN_QUEUE = "train"
"""The train workers' queue when a spec names none."""
INFERENCE_QUEUE = "inference"
"""The generate requests' queue: no training job may be routed there."""
QUEUE_NAME = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
"""A train queue's name (a spec's ``resources.queue``, ``rlhf worker --queues``)."""


class Resources(_Strict):
    """Where a job runs, and in how many processes."""

    queue: Annotated[str, Field(pattern=QUEUE_NAME)] = TRAIN_QUEUE
    """Queue of the train workers that may run the job: ``rlhf worker --queues <queue>`` serves it, so workers
    with different GPUs can take different jobs. 1 to 64 of ``a-z``, ``0-9``, ``_``, ``.``, ``-``."""
    num_processes: Annotated[int, Field(ge=1, le=64)] = 1
    """Processes the job trains in, under ``torchrun`` with DistributedDataParallel: one per GPU of the
    worker's host (NCCL), or CPU processes (gloo). The batch sizes stay global: each process takes
    ``1/num_processes`` of every batch, so they must divide by it."""

    @field_validator("queue")
    @classmethod
    def _not_inference(cls, value: str) -> str:
        if value == INFERENCE_QUEUE:
            raise ValueError(f"{INFERENCE_QUEUE!r} is the generate requests' queue; training jobs need a train queue")
        return value


HYPERPARAMETERS: dict[str, type[TrainConfig]] = {"sft": SFTConfig, "rm": RMConfig, "ppo": PPOConfig}
# A path or hub id is any run of printable characters without spaces.
_MODEL_REF = re.compile(r"^(builtin:[a-z0-9-]+|job:[A-Za-z0-9_-]+(@\d+)?|[^\s\x00-\x1f\x7f\ud800-\udfff]+)$")
_DATASET_REF = re.compile(r"^(builtin:[a-z0-9-]+|file-[A-Za-z0-9_-]+|[^\s\x00-\x1f\x7f\ud800-\udfff]+\.jsonl)$")


class JobSpec(_Strict):
    """The body of ``POST /v1/jobs`` and of ``rlhf train SPEC``.

    Unknown fields are refused at every level, so nothing outside this schema (``trust_remote_code``, for one)
    reaches the engine; models always load with ``trust_remote_code=False``.
    """

    type: JobType
    """Job type: sft, rm or ppo."""
    name: Annotated[str, Field(max_length=200), AfterValidator(_clean_text)] | None = None
    """Optional label."""
    model: Annotated[str, Field(min_length=1, max_length=500)]
    """Starting model: builtin:tiny, job:<id>[@<step>], a hub id or a local path."""
    dataset: Annotated[str, Field(min_length=1, max_length=500)]
    """Training data: builtin:<name>, file-<id>, or (local CLI) a path to a .jsonl file."""
    eval_dataset: Annotated[str, Field(min_length=1, max_length=500)] | None = None
    """Held-out data of the same kind, for eval metrics."""
    reward_model: Annotated[str, Field(min_length=1, max_length=500)] | None = None
    """PPO only: a succeeded rm job, or any sequence-classification model."""
    hyperparameters: dict[str, Any] = Field(default_factory=dict, validate_default=True)
    """Type-specific settings (SFTConfig, RMConfig or PPOConfig); validated, defaults documented there."""
    lora: LoraSpec | None = None
    """Train low-rank adapters instead of all weights (null: full fine-tuning)."""
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] = 0
    """Seeds initialisation, data order and sampling."""
    checkpoint_every: Annotated[int, Field(ge=1, le=10_000_000)] = 50
    """Save a checkpoint every this many steps (and always at the end)."""
    keep_checkpoints: Annotated[int, Field(ge=1, le=1000)] = 3
    """How many of the newest checkpoints to keep; the final one is always the newest."""
    metadata: dict[Text, Text] = Field(default_factory=dict)
    """Free-form string labels: at most 16 keys of 1 to 64 characters, values up to 512 characters."""
    resources: Resources = Field(default_factory=Resources)
    """The worker queue, and how many processes the job trains in."""

    @field_validator("model", "reward_model")
    @classmethod
    def _model_ref(cls, value: str | None) -> str | None:
        if value is not None and not _MODEL_REF.match(value):
            raise ValueError(f"not a model reference: {value!r}")
        if value is not None and value.startswith("builtin:") and value != TINY_MODEL:
            raise ValueError(f"unknown built-in model {value[:60]!r}; known: {TINY_MODEL}")
        return value

    @field_validator("dataset", "eval_dataset")
    @classmethod
    def _dataset_kind(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and "type" in info.data:
            _check_dataset_ref(value, info.data["type"])
        return value

    @field_validator("hyperparameters")
    @classmethod
    def _typed_hyperparameters(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "type" not in info.data:
            return value
        try:
            config = HYPERPARAMETERS[info.data["type"]].model_validate(value)
        except ValidationError as e:
            raise ValueError(_flatten(e)) from None
        return config.model_dump(mode="json")  # stored with every default filled in

    @field_validator("metadata")
    @classmethod
    def _metadata_bounded(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) > METADATA_MAX_KEYS:
            raise ValueError(f"at most {METADATA_MAX_KEYS} keys, not {len(value)}")
        for key, item in value.items():
            if not 1 <= len(key) <= METADATA_MAX_KEY_CHARS:
                shown = repr(key[:20]) + ("…" if len(key) > 20 else "")
                raise ValueError(f"key {shown} has {len(key)} characters; keys have 1 to {METADATA_MAX_KEY_CHARS}")
            if len(item) > METADATA_MAX_VALUE_CHARS:
                raise ValueError(
                    f"the value of {key!r} has {len(item)} characters; values have at most {METADATA_MAX_VALUE_CHARS}"
                )
        return value

    @model_validator(mode="after")
    def _reward_model_for_ppo(self) -> "JobSpec":
        if self.type == "ppo" and self.reward_model is None:
            raise ValueError("reward_model is required for ppo jobs")
        if self.type != "ppo" and self.reward_model is not None:
            raise ValueError(f"reward_model applies to ppo jobs only, not {self.type}")
        return self

    @model_validator(mode="after")
    def _batches_split_over_processes(self) -> "JobSpec":
        """Every process takes the same share of each batch, in whole micro-batches."""
        n = self.resources.num_processes
        if n == 1 or "batch_size" not in self.hyperparameters:  # a hyperparameter error is reported already
            return self
        hp = self.hyperparameters
        ga = hp["gradient_accumulation_steps"]
        # PPO rolls out batch_size prompts split over the processes, then trains on minibatches split likewise
        checks = {"batch_size": n, "mini_batch_size": n * ga} if self.type == "ppo" else {"batch_size": n * ga}
        for name, by in checks.items():
            if hp[name] % by:
                of = f"resources.num_processes ({n})" if by == n else (
                    f"resources.num_processes × gradient_accumulation_steps ({n} × {ga})")  # fmt: skip
                raise ValueError(f"hyperparameters.{name} ({hp[name]}) must be a multiple of {of}")
        return self

    @property
    def config(self) -> TrainConfig:
        """The typed hyperparameters of this job type."""
        return HYPERPARAMETERS[self.type].model_validate(self.hyperparameters)


def _check_divides(name: str, value: int, by_name: str, by: int) -> None:
    if value % by:
        raise ValueError(f"{name} ({value}) must be a multiple of {by_name} ({by})")


def _check_dataset_ref(ref: str, kind: str) -> None:
    if not _DATASET_REF.match(ref):
        raise ValueError(f"not a dataset reference: {ref!r} (builtin:<name>, file-<id> or a .jsonl path)")
    if ref.startswith("builtin:"):
        name = ref.removeprefix("builtin:")
        if name not in DATASETS:
            raise ValueError(f"unknown built-in dataset {ref!r}; known: {', '.join(sorted(DATASETS))}")
        if DATASETS[name][0] != kind:
            raise ValueError(f"{ref} holds {DATASETS[name][0]} rows, but a {kind} dataset is needed")


def _flatten(error: ValidationError) -> str:
    """A nested model's errors as one message, each part led by its field name."""
    parts = []
    for e in error.errors(include_url=False):
        message = e["msg"].removeprefix("Value error, ")
        parts.append(f"{'.'.join(map(str, e['loc']))}: {message}" if e["loc"] else message)
    return "; ".join(parts)


def format_errors(error: ValidationError) -> str:
    """One line per error, each naming the field by its dotted path."""
    return "\n".join(
        f"{'.'.join(map(str, e['loc'])) or 'spec'}: {e['msg'].removeprefix('Value error, ')}"
        for e in error.errors(include_url=False)
    )

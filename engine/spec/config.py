"""Job specs and hyperparameters (torch-free, so the API can validate without importing torch).

A :class:`JobSpec` is the body of ``POST /v1/jobs`` and of ``rlhf train SPEC``. Every field has
a docstring and a validated range; unknown fields are errors. Derived batch sizes are computed
once here with exact-division checks, so a bad spec fails before any model is loaded.
"""

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from engine.builtin import DATASETS, TINY_MODEL, digits
from engine.rewards.graders import Grader, ModelGrader
from engine.spec.policy_losses import DUAL_CLIP_LOSSES, LOSS_DEFAULTS, POLICY_LOSSES, Aggregation, LossSettings
from engine.spec.rows import DatasetKind, dataset_kind

Scheduler = Literal["constant", "linear", "cosine"]
Estimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
"""GRPOConfig's advantage estimators (engine/methods/grpo.py)."""
WHITENED: tuple[Estimator, ...] = ("reinforce_pp", "reinforce_pp_baseline")
"""The estimators whose advantages are whitened over the batch's tokens."""
KLEstimator = Literal["k1", "k2", "k3"]
"""Per-token estimators of KL(π || π_ref) (engine/core/ops.py ``kl_per_token``, http://joschu.net/blog/kl-approx.html)."""
K1_LOSS_TERM_WARNING = (
    "kl_estimator k1 as a loss term does not pull the policy towards the reference: on-policy the gradient of "
    "β·(log π - log π_ref) is β·∇log π, whose expectation under π is 0 (it only adds noise); use k3 (the default) or "
    "k2 as a loss term, or k1 in the reward (kl_in_reward true)"
)
"""The ``warning`` event of a GRPO job whose KL is a loss term estimated by k1 (data ``{"reason": "k1_loss_term"}``)."""


def _clean_text(value: str) -> str:
    """Refuse NUL and other control characters (tab and newline aside) and lone surrogates: text a database
    cannot store or a log would garble."""
    for char in value:
        if (ord(char) < 32 and char not in "\t\n\r") or ord(char) == 127 or 0xD800 <= ord(char) <= 0xDFFF:
            raise ValueError(f"control characters and lone surrogates are not allowed (found {char!r})")
    return value


Text = Annotated[str, AfterValidator(_clean_text)]
"""A free-form string of a spec (a label, a metadata entry)."""
StopToken = Annotated[str, Field(min_length=1, max_length=200), AfterValidator(_clean_text)]
"""PPO's and GRPO's ``stop_token``: ``"eos"`` or one token of the model's vocabulary (checked when the job starts)."""


def _known_policy_loss(value: str) -> str:
    if value not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {value[:40]!r}; known: {', '.join(POLICY_LOSSES)}")
    return value


PolicyLossName = Annotated[
    str, AfterValidator(_known_policy_loss), WithJsonSchema({"type": "string", "enum": list(POLICY_LOSSES)})
]
"""PPO's and GRPO's ``policy_loss``: a name of :data:`engine.spec.policy_losses.POLICY_LOSSES`."""
DualClip = Annotated[float, Field(gt=1, le=1000)]
"""PPO's and GRPO's ``dual_clip``: the cap c > 1 of a negative advantage's loss, -c·A."""
DEFAULT_VLLM_CORRECTION = 2.0
"""``rollout_correction`` of a job sampled by vLLM that does not set it: Yao et al.'s cap."""

RolloutCorrection = Annotated[float, Field(gt=1, le=100)]
"""PPO's and GRPO's ``rollout_correction``: the cap C > 1 of the truncated importance weight min(π_old/π_sampler, C)
of each token's policy loss (engine/spec/policy_losses.py ``rollout_correction``)."""


def _check_dual_clip(policy_loss: str, dual_clip: float | None) -> None:
    if dual_clip is not None and policy_loss not in DUAL_CLIP_LOSSES:
        raise ValueError(f"dual_clip applies to policy_loss {' and '.join(DUAL_CLIP_LOSSES)} only, not {policy_loss}")


def _loss_settings(
    policy_loss: str, low: float | None, high: float | None, dual_clip: float | None, correction: float | None
) -> LossSettings:
    """The settings of ``policy_loss``: each clip range given, else the loss's own
    (:data:`engine.spec.policy_losses.LOSS_DEFAULTS`)."""
    defaults = LOSS_DEFAULTS[policy_loss]
    return LossSettings(
        clip_low=defaults.clip_low if low is None else low,
        clip_high=defaults.clip_high if high is None else high,
        dual_clip=dual_clip,
        rollout_correction=correction,
    )


def _aggregation(policy_loss: str, given: Aggregation | None, method_default: Aggregation) -> Aggregation:
    """``loss_aggregation`` as given, else the loss's own, else the method's."""
    return given or LOSS_DEFAULTS[policy_loss].aggregation or method_default


LORA_MAX_MODULES = 64
_MODULE_NAME = re.compile(r"^[A-Za-z0-9_.]{1,200}$")
METADATA_MAX_KEYS = 16
METADATA_MAX_KEY_CHARS = 64
METADATA_MAX_VALUE_CHARS = 512


MAX_BATCH_SIZE = 4096
"""The most examples (sft, rm, dpo) or prompts (ppo, grpo) a ``batch_size`` may ask per optimizer step, and the most
rollouts of a PPO ``mini_batch_size``: past it, a job would spend long minutes at step 0 before running out of
memory."""
MAX_MICRO_BATCH = 512
"""The most sequences one forward and backward pass may hold: ``batch_size`` (a PPO or GRPO ``mini_batch_size``)
over ``gradient_accumulation_steps``. A larger batch is trained in more micro-batches."""


def accepts_bool(annotation: Any) -> bool:
    """Whether a field of this type takes ``true``/``false`` (``bool`` or ``Any`` among its types)."""
    return annotation is bool or annotation is Any or any(accepts_bool(arg) for arg in get_args(annotation))


def refuse_bool(value: Any, info: ValidationInfo, fields: dict[str, FieldInfo]) -> Any:
    """A ``field_validator("*", mode="before")``'s check: ``true`` is not the number 1. Pydantic's lax mode takes a
    boolean for an int or a float (``epochs: true`` would train one epoch); strict mode would also refuse the lists
    of a stored spec's tuples, so numbers are made strict this way, naming the field."""
    field = fields.get(info.field_name or "")
    if isinstance(value, bool) and field is not None and not accepts_bool(field.annotation):
        raise ValueError("expected a number, not a boolean")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_bool(value, info, cls.model_fields)


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

    def process_shares(self, processes: int) -> dict[str, int]:
        """Hyperparameter → what it must be a multiple of, for ``processes`` processes to take equal shares of
        it in whole micro-batches."""
        return {"batch_size": processes * self.gradient_accumulation_steps}

    def token_lengths(self) -> dict[str, tuple[str, int]]:
        """Field → (what, tokens) of the longest sequences the job forms: none may exceed the model's context."""
        return {"hyperparameters.max_length": ("max_length", self.max_length)}


class SFTConfig(TrainConfig):
    """Supervised fine-tuning: causal-LM loss on completion tokens only (prompt masked)."""

    learning_rate: Annotated[float, Field(gt=0, le=1)] = 1e-3
    """Peak AdamW learning rate."""
    batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)] = 32
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
        _check_micro_batch("batch_size", self.micro_batch_size)
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


class DPOConfig(SFTConfig):
    """Direct preference optimisation: the policy learns the preference pairs against a frozen reference (the
    starting policy; with LoRA the same weights with the adapters off), no reward model (arXiv:2305.18290)."""

    learning_rate: Annotated[float, Field(gt=0, le=1)] = 1e-6
    """Peak AdamW learning rate (small: the reference is where training starts)."""
    epochs: Annotated[float, Field(gt=0, le=1000)] = 1.0
    """Passes over the preference pairs; fractions allowed. Ignored when ``max_steps`` is set."""
    beta: Annotated[float, Field(gt=0, le=100)] = 0.1
    """Strength of the pull to the reference: the implicit reward is β × the log-ratio to it (IPO's τ)."""
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    """``sigmoid``: DPO's -log σ(β h); ``ipo``: (h - 1/(2β))² on per-token mean log-probs (Azar et al.,
    arXiv:2310.12036); ``hinge``: relu(1 - β h) (SLiC, arXiv:2305.10425); h is the chosen-minus-rejected
    log-ratio margin to the reference."""
    label_smoothing: Annotated[float, Field(ge=0, lt=0.5)] = 0.0
    """Conservative DPO: the probability that a pair's label is flipped (``sigmoid`` only)."""
    sft_loss_coef: Annotated[float, Field(ge=0, le=100)] = 0.0
    """Weight of the chosen completion's next-token loss added to the preference loss (RPO,
    arXiv:2404.19733); 0 disables it."""

    @model_validator(mode="after")
    def _smoothing_with_sigmoid(self) -> "DPOConfig":
        if self.label_smoothing > 0 and self.loss_type != "sigmoid":
            raise ValueError(f"label_smoothing applies to loss_type sigmoid only, not {self.loss_type}")
        return self


class CollapseConfig(_Strict):
    """PPO's collapse signals (MOSS-RLHF, arXiv:2307.04964 §2.1, engine/core/health.py): each step is compared with the
    median of the recent ones for a jump of reward or KL, a fall of perplexity, a blow-up of response length."""

    action: Literal["off", "warn", "pause", "stop"] = "warn"
    """What a collapse signal (thresholds below) does: "warn" records a ``warning`` event per signal and trains
    on; "pause" also ends the job paused without checkpointing the anomalous step, so its newest checkpoint is
    from before; "stop" ends it failed (error code ``training_collapse``), also without that checkpoint; "off":
    no check."""
    window: Annotated[int, Field(ge=2, le=1000)] = 20
    """Recent steps each collapse signal is compared with (their median)."""
    warmup: Annotated[int, Field(ge=1, le=1000)] = 5
    """Steps of history before the collapse signals are judged; at most ``window``."""
    reward_z: Annotated[float, Field(gt=0, le=1e6)] | None = 6.0
    """``reward_jump``: ``objective/scores`` more than this many spreads above its median, the spread being the
    larger of the window's standard deviation and 1.4826 × its median absolute deviation (None: off)."""
    kl_factor: Annotated[float, Field(gt=1, le=1e6)] | None = 3.0
    """``kl_jump``: ``objective/kl`` at least this many times its median, and at least ``kl_min`` (None: off)."""
    kl_min: Annotated[float, Field(ge=0, le=1e6)] = 5.0
    """The smallest ``objective/kl`` (nats per sequence) a ``kl_jump`` is raised for: early in a healthy run KL
    grows from 0 by many times its median (the built-in demo ends near 2 nats), while the collapses seen in
    the prototype reached 21 and past 100."""
    perplexity_ratio: Annotated[float, Field(gt=0, lt=1)] | None = 0.5
    """``perplexity_collapse``: log ``response/perplexity`` below this fraction of its median's (0.5: a median
    perplexity of 4 fell below 2), the policy became near-deterministic (None: off)."""
    length_factor: Annotated[float, Field(gt=1, le=1000)] | None = 1.5
    """``length_blowup``: ``response/length_mean`` at least this many times its median, or every response at
    ``response_length`` while the median was below it (None: off)."""

    @model_validator(mode="after")
    def _warmup_within_window(self) -> "CollapseConfig":
        if self.warmup > self.window:
            raise ValueError(f"warmup ({self.warmup}) must be at most window ({self.window})")
        return self


COLLAPSE_FLAT_NAMES = {
    "on_collapse": "action",
    "collapse_window": "window",
    "collapse_warmup": "warmup",
    "collapse_reward_z": "reward_z",
    "collapse_kl_factor": "kl_factor",
    "collapse_kl_min": "kl_min",
    "collapse_perplexity_ratio": "perplexity_ratio",
    "collapse_length_factor": "length_factor",
}
"""PPOConfig's flat names of the collapse settings before they were grouped → their names in ``collapse``."""


class SamplingConfig(TrainConfig):
    """What the methods that sample their own training data share (PPO, and the group-sampling ones: GRPO,
    distillation), declared once: the prompts' and the sampler's settings, ``dual_clip``, the eval prompts and the
    CUDA graphs. Each method declares the rest, the fields whose defaults or meanings differ among them."""

    def process_shares(self, processes: int) -> dict[str, int]:
        # batch_size prompts are rolled out split over the processes, then trained on in minibatches split likewise
        return {"batch_size": processes, "mini_batch_size": processes * self.gradient_accumulation_steps}

    max_prompt_length: Annotated[int, Field(ge=1, le=131_072)] | None = None
    """Prompts longer than this many tokens keep their last ones, and a warning event counts them (how many, the
    longest, the limit). None: the longest prompt of the dataset and eval dataset, capped by the model's context
    minus ``response_length`` (a chat model's default system block alone can pass 64 tokens)."""
    top_k: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    """Sample from the k most likely tokens only (0: the whole vocabulary)."""
    stop_token: StopToken | None = "eos"
    """Truncate each response after its first stop token. ``"eos"``: any of the model's end tokens, where
    transformers' ``generate`` stops (its generation config's ``eos_token_id``, e.g. Llama 3's ``<|eot_id|>``, and
    the tokenizer's EOS); a token of the vocabulary (e.g. ``"<|im_end|>"``): that token alone, checked when the job
    starts; None: never truncate."""
    dual_clip: DualClip | None = None
    """Dual-clip PPO (Ye et al., arXiv:1912.09729): the loss of a token with a negative advantage is capped at
    ``dual_clip`` × |A|, so a ratio far above 1 (a token much likelier now than when it was sampled) cannot make
    the loss unbounded; verl's default is 3. ``ppo_clip`` and ``gspo`` only. None: no cap."""
    eval_max_prompts: Annotated[int, Field(ge=1, le=1_000_000)] = 256
    """Use at most this many eval prompts (the first ones)."""
    cuda_graphs: bool = True
    """On CUDA, sample with static KV caches and each decoding step captured as a CUDA graph (``torch.compile``
    with inductor's CUDA graphs), replayed across steps and updates: no per-token launch overhead. Prompts are
    padded to one of 4 lengths and the batch to one of 4 row counts, so a job compiles at most 16 shapes whatever
    its prompts; a step that cannot be compiled or recorded falls back to eager decoding with a ``warning`` event,
    and ``rollout/compiled_fraction`` reports the share of decoding steps run compiled. Off: the growing cache,
    eagerly. No effect on CPU. The same tokens either way; log-probs equal up to rounding."""
    rollout_correction: RolloutCorrection | None = None
    """The cap of truncated importance sampling of the sampler's mismatch (each method says how it applies it)."""
    rollout_engine: Literal["builtin", "vllm"] = "builtin"
    """What samples the rollouts. ``builtin``: the trainer's own sampler, on the trainer's weights. ``vllm``: a vLLM
    server (continuous batching, paged KV cache), which the worker starts for the job from the operator's vLLM
    environment (``RLHF_VLLM_PYTHON``) or an operator's server (``RLHF_VLLM_URL``); after every optimizer step the
    policy's weights are pushed to it (LoRA: the adapters, loaded under a new name each version), and a probe's
    log-probs there are checked against the trainer's (``rollout/sync_gap``, ``rollout/sync_seconds``). The
    training pass takes its own log-probs of vLLM's samples, and ``rollout_correction`` defaults to 2. One
    process only (``resources.num_processes`` and ``num_nodes`` 1)."""
    rollout_sync_max_gap: Annotated[float, Field(gt=0, le=100)] | None = None
    """With ``rollout_engine: vllm``: the largest mean absolute difference per token between vLLM's and the
    trainer's log-probs of the probe after a weight sync; above it the job fails with ``rollout_out_of_sync`` (its
    checkpoints kept). None: 1e-3 in float32, 0.05 in bfloat16 (the kernels' rounding)."""

    @model_validator(mode="after")
    def _vllm_corrects_by_default(self) -> "SamplingConfig":
        if self.rollout_engine == "vllm" and "rollout_correction" not in self.model_fields_set:
            self.rollout_correction = DEFAULT_VLLM_CORRECTION
        return self

    @property
    def trainer_logprobs(self) -> bool:
        """Whether the rollout takes the training pass's log-probs of the samples (the sampler's kept besides):
        with ``rollout_correction``, and always for vLLM's samples."""
        return self.rollout_correction is not None or self.rollout_engine == "vllm"

    @property
    def sync_max_gap(self) -> float:
        """``rollout_sync_max_gap``, or its default for the dtype."""
        if self.rollout_sync_max_gap is not None:
            return self.rollout_sync_max_gap
        return 1e-3 if self.dtype == "float32" else 0.05


class PPOConfig(SamplingConfig):
    """PPO with a KL penalty to a frozen reference (Ziegler et al., arXiv:1909.08593)."""

    def token_lengths(self) -> dict[str, tuple[str, int]]:
        tokens = (self.max_prompt_length or 1) + self.response_length  # null: at least a one-token prompt
        lengths = {"hyperparameters.response_length": ("max_prompt_length + response_length", tokens)}
        if self.ptx_coef > 0:  # pretraining batches are max_length long
            lengths["hyperparameters.max_length"] = ("max_length", self.max_length)
        return lengths

    learning_rate: Annotated[float, Field(gt=0, le=1)] = 3e-5
    """Policy AdamW learning rate."""
    value_learning_rate: Annotated[float, Field(gt=0, le=1)] | None = None
    """Critic AdamW learning rate (None: same as ``learning_rate``)."""
    total_steps: Annotated[int, Field(ge=1, le=10_000_000)] = 100
    """PPO steps; one step is one rollout batch and its PPO epochs."""
    batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)] = 64
    """Prompts per rollout."""
    mini_batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)] = 32
    """Rollouts per optimizer step; ``batch_size`` must be a multiple of it."""
    ppo_epochs: Annotated[int, Field(ge=1, le=100)] = 2
    """Passes over each rollout batch."""
    response_length: Annotated[int, Field(ge=1, le=65_536)] = 24
    """Tokens sampled per response (fewer when every response stopped)."""
    temperature: Annotated[float, Field(gt=0, le=10)] = 0.7
    """Sampling temperature; logprobs in training use the same temperature."""
    missing_eos_penalty: Annotated[float, Field(ge=0, le=1000)] = 1.0
    """Subtracted from the score of a response that did not stop (only with ``stop_token``)."""
    normalize_scores: bool = False
    """Normalise scores by the running mean/std of all scores so far (PPO-max, arXiv:2307.04964)."""
    score_clip: Annotated[float, Field(gt=0, le=1e6)] | None = None
    """Clip (normalised) scores to [-score_clip, score_clip]."""
    kl_coef: Annotated[float, Field(ge=0, le=100)] = 0.05
    """Initial coefficient β of the per-token KL penalty."""
    kl_estimator: KLEstimator = "k1"
    """Per-token KL estimator of the reward's penalty: k1 = log π - log π_ref, the only one accepted. PPO's KL is
    part of its reward, where k1's policy gradient is the KL's own; that of k2 = ½ k1² and k3 = e^-k1 - 1 + k1
    cancels to first order near the reference (http://joschu.net/blog/kl-approx.html), so they are refused."""
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
    cliprange: Annotated[float, Field(gt=0, le=10)] | None = None
    """Policy ratio clip ε: the ratio kept in 1 ± ``cliprange`` (a number sets both sides alike). None: the range of
    ``policy_loss`` itself (engine/spec/policy_losses.py ``LOSS_DEFAULTS``): 1 ± 0.2 for ``ppo_clip``; ``cispo``'s
    weight unbounded below and capped at 4 (Tinker's default, clip(π/π_old, 0, 4)); ``gspo``'s sequence ratio in
    [1 - 3e-4, 1 + 4e-4] (the paper's). Stored as None, since no one number is those asymmetric ranges."""
    policy_loss: PolicyLossName = "ppo_clip"
    """The policy's loss on each token (engine/spec/policy_losses.py): ``ppo_clip``, PPO's clipped surrogate, the
    ratio π/π_old kept in 1 ± ``cliprange``; ``importance_sampling``, REINFORCE weighted by the unclipped ratio
    (Tinker's); ``cispo``, the ratio clipped as a detached weight of every token's log-prob gradient, so no token's
    gradient is dropped (MiniMax-M1, arXiv:2506.13585); ``gspo``, one ratio per response, the geometric mean of its
    tokens' (Qwen, arXiv:2507.18071), clipped: for long responses and mixture-of-experts models, whose token ratios
    are noisy; it wants a far smaller range, the more so the less a step moves the model (the paper's 3e-4 / 4e-4,
    its default, for its large ones; GRPO on the built-in digits task learns at 0.03 / 0.04)."""
    loss_aggregation: Aggregation | None = None
    """How the policy loss's per-token values become the minibatch's loss: ``token_mean`` (every token alike),
    ``sequence_mean`` (each response's mean, then the mean over responses), ``constant`` (the sum over (responses ×
    ``response_length``)). None: ``policy_loss``'s own (``sequence_mean`` for ``gspo``, the GSPO paper's), else
    ``token_mean``; filled in when the spec is validated, so a stored spec shows what it trains with."""
    rollout_correction: RolloutCorrection | None = None
    """Truncated importance sampling of the sampler's mismatch (Yao et al. 2025; verl's ``tis_imp_ratio_cap``):
    the rollout also takes the trainer's log-probs of the sampled tokens (one more forward, the policy before the
    step's updates, π_old), which become the ratio's denominator and the KL's, and each token's policy loss is
    weighted by min(π_old/π_sampler, ``rollout_correction``), detached. For samplers that compute other numbers
    than the training pass (another dtype, fused or compiled kernels, folded LoRA adapters); Yao et al. cap at 2.
    Reports ``rollout/logprob_gap`` and ``rollout/correction_capped_fraction``. None: the sampler's log-probs
    are the old ones, no weight."""
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
    log_samples_every: Annotated[int, Field(ge=1, le=10_000_000)] | None = 10
    """Keep a sample of the rollouts (prompt, response, rewards, KL, length) at step 1 and every this many steps,
    for ``GET /v1/jobs/{id}/samples`` and the dashboard (None: none kept)."""
    log_samples: Annotated[int, Field(ge=1, le=256)] = 16
    """Rollouts kept per logged step: the first ones of the batch."""
    torch_compile: bool = False
    """Compile the training forward (and so the backward) of the policy and critic with ``torch.compile`` for dynamic
    shapes: fused kernels for every update, after the first pays the compilation. For long runs: on a 2-core CPU
    the compilation takes 30–90 s and gains nothing at the tiny size, 9 % of a pass at the compute size."""
    collapse: CollapseConfig = Field(default_factory=CollapseConfig)
    """The collapse signals of MOSS-RLHF (arXiv:2307.04964 §2.1): what one does, and their thresholds. The flat
    names of earlier versions (``on_collapse``, ``collapse_window``, ...) are accepted and moved in here."""

    @property
    def loss_settings(self) -> LossSettings:
        """The settings of ``policy_loss``: the ratio clipped to 1 ± ``cliprange``, else to the loss's range."""
        return _loss_settings(self.policy_loss, self.cliprange, self.cliprange, self.dual_clip, self.rollout_correction)

    @property
    def aggregation(self) -> Aggregation:
        return _aggregation(self.policy_loss, self.loss_aggregation, "token_mean")

    @property
    def micro_batch_size(self) -> int:
        return self.mini_batch_size // self.gradient_accumulation_steps

    @property
    def num_mini_batches(self) -> int:
        return self.batch_size // self.mini_batch_size

    @field_validator("kl_estimator")
    @classmethod
    def _k1_in_the_reward(cls, value: KLEstimator) -> KLEstimator:
        if value != "k1":
            raise ValueError(f"{value}: PPO's KL is part of its reward; {_kl_in_reward_reason(value)} (the default)")
        return value

    @model_validator(mode="after")
    def _divides(self) -> "PPOConfig":
        _check_divides("batch_size", self.batch_size, "mini_batch_size", self.mini_batch_size)
        _check_divides(
            "mini_batch_size", self.mini_batch_size, "gradient_accumulation_steps", self.gradient_accumulation_steps
        )
        _check_micro_batch("mini_batch_size", self.micro_batch_size)
        if self.ptx_coef > 0 and self.ptx_dataset is None:
            raise ValueError("ptx_dataset is required when ptx_coef > 0")
        if self.ptx_dataset is not None:
            _check_dataset_ref(self.ptx_dataset, "sft")
        _check_dual_clip(self.policy_loss, self.dual_clip)
        self.loss_aggregation = self.aggregation
        return self

    @model_validator(mode="before")
    @classmethod
    def _flat_collapse_settings(cls, data: Any) -> Any:
        """Moves the flat names of the collapse settings (``on_collapse``, ``collapse_window``, ...) into the
        ``collapse`` group; a setting given in both forms is an error."""
        if not isinstance(data, dict) or not any(name in data for name in COLLAPSE_FLAT_NAMES):
            return data
        data = dict(data)
        group = data.get("collapse", {})
        if isinstance(group, CollapseConfig):
            group = group.model_dump(exclude_unset=True)
        if not isinstance(group, dict):
            return data  # not an object: the field's own validation says so
        group = dict(group)
        for flat, name in COLLAPSE_FLAT_NAMES.items():
            if flat in data:
                if name in group:
                    raise ValueError(f"{flat} and collapse.{name} are the same setting; give one of them")
                group[name] = data.pop(flat)
        data["collapse"] = group
        return data


class GroupSamplingConfig(SamplingConfig):
    """What the methods that sample their own training data in groups share (GRPO and its relatives,
    distillation): each step samples ``batch_size`` prompts ``group_size`` times, then ``num_iterations`` passes of
    minibatch updates of ``policy_loss``."""

    def token_lengths(self) -> dict[str, tuple[str, int]]:
        tokens = (self.max_prompt_length or 1) + self.response_length  # null: at least a one-token prompt
        return {"hyperparameters.response_length": ("max_prompt_length + response_length", tokens)}

    learning_rate: Annotated[float, Field(gt=0, le=1)] = 1e-5
    """Policy AdamW learning rate."""
    total_steps: Annotated[int, Field(ge=1, le=10_000_000)] = 100
    """Steps; one step samples ``batch_size`` prompts ``group_size`` times each and trains on them."""
    batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)] = 16
    """Prompts per step."""
    group_size: Annotated[int, Field(ge=1, le=1024)] = 8
    """Samples per prompt (GRPO's G); each prompt is prefilled once for its whole group."""
    mini_batch_size: Annotated[int, Field(ge=1, le=1_048_576)] = 64
    """Samples per optimizer step; ``batch_size × group_size`` must be a multiple of it."""
    num_iterations: Annotated[int, Field(ge=1, le=100)] = 1
    """Passes over each step's samples (GRPO's μ); with 1 every update is on-policy and the ratio stays 1 in
    its first minibatch."""
    response_length: Annotated[int, Field(ge=1, le=65_536)] = 32
    """Tokens sampled per response at most (sampling ends once every response stopped)."""
    temperature: Annotated[float, Field(gt=0, le=10)] = 1.0
    """Sampling temperature; the log-probs of training (and a distillation's teacher's) are taken at it."""
    cliprange_low: Annotated[float, Field(gt=0, le=1)] | None = None
    """The ratio is clipped below at 1 - cliprange_low (1: not bounded below). None: ``policy_loss``'s own
    (engine/spec/policy_losses.py ``LOSS_DEFAULTS``): 0.2; 1 for ``cispo`` (Tinker's, MiniMax-M1's and TRL's: no
    lower bound); 3e-4 for ``gspo`` (the paper's)."""
    cliprange_high: Annotated[float, Field(gt=0, le=10)] | None = None
    """The ratio is clipped above at 1 + cliprange_high; above ``cliprange_low`` it is DAPO's clip-higher
    (arXiv:2503.14476, 0.28), which keeps rare tokens' probabilities free to grow. None: ``policy_loss``'s own: 0.2;
    3 for ``cispo`` (its weight capped at 4, Tinker's default); 4e-4 for ``gspo`` (the paper's)."""
    policy_loss: PolicyLossName = "ppo_clip"
    """The policy's loss on each token (engine/spec/policy_losses.py): ``ppo_clip``, PPO's clipped surrogate, the
    ratio π/π_old kept in [1 - ``cliprange_low``, 1 + ``cliprange_high``]; ``importance_sampling``, REINFORCE
    weighted by the unclipped ratio (Tinker's); ``cispo``, the ratio clipped to that range as a detached weight of
    every token's log-prob gradient, so no token's gradient is dropped (MiniMax-M1, arXiv:2506.13585, which bounds
    the weight above only: by default ``cliprange_low`` 1); ``gspo``, one ratio per response, the geometric mean of
    its tokens' (Qwen, arXiv:2507.18071), clipped: for long responses and mixture-of-experts models, whose token
    ratios are noisy; by default with ``loss_aggregation: sequence_mean`` and the far smaller clip ranges of the
    paper, 3e-4 / 4e-4, which suit its large models, while on the built-in digits task (``builtin:tiny``, lr 5e-4)
    they clip half the tokens and learn slowly, while 0.03 / 0.04 clip about a tenth and learn as ``ppo_clip`` does
    (benchmarks/policy_losses.py). With
    ``num_iterations`` 1 every ratio is 1 in a step's first minibatch, where the four give REINFORCE's gradient
    alike."""
    rollout_correction: RolloutCorrection | None = None
    """The cap C of truncated importance sampling (Yao et al. 2025), as PPO's ``rollout_correction``: the rollout
    takes the trainer's log-probs of the samples too, the old log-probs of the update, of the KL and of the
    advantages, and each token's policy loss is weighted by min(π_old/π_sampler, C), detached. None: none."""
    log_samples: Annotated[int, Field(ge=1, le=256)] = 16
    """Samples kept per logged step: the first ones of the batch, whole groups first."""
    torch_compile: bool = False
    """Compile the training forward (and so the backward) of the policy with ``torch.compile`` for dynamic
    shapes: fused kernels for every update, after the first pays the compilation. For long runs: on a 2-core CPU
    the compilation takes 30–90 s and gains nothing at the tiny size, 9 % of a pass at the compute size."""

    @property
    def micro_batch_size(self) -> int:
        return self.mini_batch_size // self.gradient_accumulation_steps

    @property
    def loss_settings(self) -> LossSettings:
        """The settings of ``policy_loss``: the ratio clipped to [1 - ``cliprange_low``, 1 + ``cliprange_high``],
        each the loss's own where None."""
        return _loss_settings(
            self.policy_loss, self.cliprange_low, self.cliprange_high, self.dual_clip, self.rollout_correction
        )

    def _check_batches(self) -> None:
        """The batch sizes divide as the minibatches and micro-batches need; ``dual_clip`` suits ``policy_loss``."""
        samples = self.batch_size * self.group_size
        _check_divides("batch_size × group_size", samples, "mini_batch_size", self.mini_batch_size)
        _check_divides(
            "mini_batch_size", self.mini_batch_size, "gradient_accumulation_steps", self.gradient_accumulation_steps
        )
        _check_micro_batch("mini_batch_size", self.micro_batch_size)
        _check_dual_clip(self.policy_loss, self.dual_clip)


class GRPOConfig(GroupSamplingConfig):
    """Critic-free RL: several samples per prompt, each scored by the job's ``reward``, the advantage taken
    against the other samples of its prompt (or the batch), a clipped surrogate loss, an optional KL pull to the
    starting policy (Shao et al., arXiv:2402.03300, and the estimators of ``advantage_estimator``)."""

    advantage_estimator: Estimator = "grpo"
    """``grpo``: (r - group mean) / group std; ``dr_grpo``: r - group mean (Liu et al., arXiv:2503.20783);
    ``rloo``: r - the mean of the prompt's other samples (Ahmadian et al., arXiv:2402.14740);
    ``reinforce_pp``: the return of the score and the KL rewards, whitened over the batch (Hu,
    arXiv:2501.03262); ``reinforce_pp_baseline``: the same, the group mean subtracted from the score first."""
    kl_coef: Annotated[float, Field(ge=0, le=100)] = 0.04
    """β of the KL to the reference (the starting policy); 0: no reference is loaded at all."""
    kl_estimator: KLEstimator | None = None
    """Per-token estimator of the KL as a loss term (http://joschu.net/blog/kl-approx.html): k1 = log π - log π_ref,
    k2 = ½ k1², k3 = e^-k1 - 1 + k1. None: k3 (GRPO's) as a loss term, and k1 in the reward, the only one accepted
    there (k1's policy gradient is the KL's own; that of k2 and k3 cancels to first order near the reference).
    k1 as a loss term has zero expected gradient on-policy: accepted, with a ``warning`` event when the job starts."""
    kl_in_reward: bool | None = None
    """Where the KL enters: as a penalty in the reward (its return added to the advantage), or as a loss term
    β·KL. None: in the reward for the ``reinforce_pp`` estimators, as a loss term for the others."""
    loss_aggregation: Aggregation | None = None
    """How per-token losses become the minibatch's loss: ``token_mean`` (every token alike), ``sequence_mean``
    (each response's mean, then the mean over responses: the GRPO paper's), ``constant`` (the sum over
    (responses × response_length): Dr. GRPO's, no length bias). None: ``policy_loss``'s own (``sequence_mean`` for
    ``gspo``, the GSPO paper's), else ``constant`` for ``dr_grpo`` and ``token_mean`` otherwise; filled in when the
    spec is validated, so a stored spec shows what it trains with."""
    eval_every: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    """With an eval dataset: sample each of its prompts once every this many steps (and at the end) and report
    ``eval/reward`` and its components by ``eval_reward`` (default: the training reward)."""
    log_samples_every: Annotated[int, Field(ge=1, le=10_000_000)] | None = 10
    """Keep a sample of the rollouts (prompt, response, each reward component, KL, length) at step 1 and every this
    many steps, for ``GET /v1/jobs/{id}/samples`` and the dashboard (None: none kept)."""

    @property
    def kl_as_reward(self) -> bool:
        """Whether the KL is a penalty in the reward (else a loss term)."""
        return kl_in_the_reward(self.advantage_estimator, self.kl_in_reward)

    @property
    def kl_term_estimator(self) -> KLEstimator:
        """The estimator of the step's KL term (and of ``objective/kl``): k1 in the reward, ``kl_estimator`` (None:
        k3) as a loss term."""
        return "k1" if self.kl_as_reward else self.kl_estimator or "k3"

    @property
    def k1_loss_term(self) -> bool:
        """Whether the KL is a loss term estimated by k1 (:data:`K1_LOSS_TERM_WARNING`: no pull on-policy)."""
        return self.kl_coef > 0 and not self.kl_as_reward and self.kl_estimator == "k1"

    @property
    def aggregation(self) -> Aggregation:
        method_default: Aggregation = "constant" if self.advantage_estimator == "dr_grpo" else "token_mean"
        return _aggregation(self.policy_loss, self.loss_aggregation, method_default)

    @model_validator(mode="after")
    def _divides(self) -> "GRPOConfig":
        self._check_batches()
        if self.group_size < 2 and self.advantage_estimator != "reinforce_pp":
            raise ValueError(
                f"advantage_estimator {self.advantage_estimator} compares the samples of a prompt: group_size must "
                "be at least 2 (reinforce_pp alone takes 1)"
            )
        if self.kl_as_reward and self.kl_estimator in ("k2", "k3"):
            raise ValueError(
                f"kl_estimator {self.kl_estimator} with the KL in the reward (kl_in_reward, the default of the "
                f"reinforce_pp estimators): {_kl_in_reward_reason(self.kl_estimator)}, and the one used when "
                "kl_estimator is left out; to use k3, put the KL in the loss with kl_in_reward false"
            )
        if self.kl_estimator == ("k1" if self.kl_as_reward else "k3"):  # the default, stored one way: as None
            self.kl_estimator = None
        self.loss_aggregation = self.aggregation
        return self


class DistillConfig(GroupSamplingConfig):
    """On-policy distillation (Agarwal et al., arXiv:2306.13649; Lu et al., Thinking Machines, "On-policy
    distillation", 2025): the trained policy (the student) samples, the frozen ``teacher`` gives the log-prob of each
    sampled token, and each token's advantage is its own reverse-KL term -(log π_student - log π_teacher) (discount
    0), plus ``reward_coef`` × the group advantage of the job's ``reward`` when it has one; the update is GRPO's
    clipped surrogate."""

    group_size: Annotated[int, Field(ge=1, le=1024)] = 4
    """Samples per prompt; each prompt is prefilled once for its whole group."""
    reward_coef: Annotated[float, Field(ge=0, le=100)] = 0.0
    """Weight of the job's optional ``reward`` (or ``reward_model``) in the advantage: each sample's GRPO group
    advantage ((r - group mean) / group std) × this is added to every one of its tokens' reverse-KL terms. 0: pure
    distillation (a reward given is then only measured: ``reward/*`` and ``eval/reward``)."""
    eval_every: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    """With an eval dataset: sample each of its prompts once every this many steps (and at the end) and report
    ``eval/distill/reverse_kl`` and, with a reward or ``eval_reward``, ``eval/reward``."""
    log_samples_every: Annotated[int, Field(ge=1, le=10_000_000)] | None = 10
    """Keep a sample of the rollouts (prompt, response, reward components, summed reverse KL to the teacher,
    length) at step 1 and every this many steps (None: none kept)."""
    loss_aggregation: Aggregation | None = None
    """How per-token losses become the minibatch's loss: ``token_mean`` (every token alike), ``sequence_mean``
    (each response's mean, then the mean over responses), ``constant`` (the sum over (responses ×
    ``response_length``)). None: ``policy_loss``'s own (``sequence_mean`` for ``gspo``), else ``token_mean``; filled
    in when the spec is validated, so a stored spec shows what it trains with."""

    @property
    def aggregation(self) -> Aggregation:
        return _aggregation(self.policy_loss, self.loss_aggregation, "token_mean")

    @model_validator(mode="after")
    def _divides(self) -> "DistillConfig":
        self._check_batches()
        if self.reward_coef > 0 and self.group_size < 2:
            raise ValueError(
                "reward_coef mixes in each sample's advantage over its group: group_size must be at least 2"
            )
        self.loss_aggregation = self.aggregation
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
    """Processes the job trains in on each host, under ``torchrun``: one per GPU of the host (NCCL), or CPU
    processes (gloo). The batch sizes stay global: each of the job's ``num_nodes × num_processes`` processes takes
    its share of every batch, so they must divide by that."""
    num_nodes: Annotated[int, Field(ge=1, le=64)] = 1
    """Hosts the job trains on, each with ``num_processes`` processes: the worker that claims the job asks
    ``num_nodes - 1`` more train workers of its queue to join (through its authenticated channel) and stays the only one
    that writes to the database. The hosts must share the data folder (checkpoints are written by every host)."""
    sharding: Literal["ddp", "fsdp"] = "ddp"
    """How the processes hold the models. ``ddp``: each a whole copy of every model, its gradients and optimizer
    state (DistributedDataParallel). ``fsdp``: each ``1/world_size`` of them (FSDP2, one unit per transformer
    block, gradients reduced in fp32), for models one device cannot hold; checkpoints keep the optimizer state
    sharded and the weights as ordinary Hugging Face folders."""
    cpu_offload: bool = False
    """With ``fsdp``: parameters, gradients and optimizer state wait in CPU memory between uses (slower; for
    models the GPUs cannot hold even sharded). On CPU processes they are there already: no change."""

    @property
    def world_size(self) -> int:
        """The job's processes on all its hosts."""
        return self.num_nodes * self.num_processes

    @model_validator(mode="after")
    def _offload_needs_fsdp(self) -> "Resources":
        if self.cpu_offload and self.sharding != "fsdp":
            raise ValueError('cpu_offload needs sharding "fsdp" (DDP keeps whole copies on the devices)')
        return self

    @field_validator("queue")
    @classmethod
    def _not_inference(cls, value: str) -> str:
        if value == INFERENCE_QUEUE:
            raise ValueError(f"{INFERENCE_QUEUE!r} is the generate requests' queue; training jobs need a train queue")
        return value


TrackingBackend = Literal["tensorboard", "mlflow", "wandb"]
"""The experiment trackers a job's metrics can also go to (engine/tracking.py)."""


class TrackingSpec(_Strict):
    """Experiment trackers that receive the job's metrics besides the service, each from its official library
    (``pip install 'rlhf-server[tracking]'`` on the workers). A server can switch them on for every job
    (``RLHF_TRACKING``); a tracker that fails is reported once, as a warning event, and the job goes on."""

    tensorboard: bool = False
    """TensorBoard event files in the job's folder (``GET /v1/jobs/{id}/tensorboard`` downloads them; the local
    ``rlhf train`` writes them to ``OUT/tensorboard``)."""
    mlflow: bool = False
    """One MLflow run per job: the server's tracking URI (``RLHF_MLFLOW_TRACKING_URI``), else a local store in the
    job's folder (``mlruns/mlflow.db``)."""
    wandb: bool = False
    """One Weights & Biases run per job, offline (run files in the job's ``wandb/`` folder, for ``wandb sync``)
    unless the server is set to online (``RLHF_WANDB_MODE``)."""


@dataclass(frozen=True)
class JobTypeInfo:
    """What the service knows of one job type: everything that differs by type is read from here.

    Adding a type is its config class above, its entry in :data:`JOB_TYPES` and its training loop (the module
    that ``trainer`` names); the API, the workers, the CLI, the demo and the dashboard follow the table.
    """

    summary: str
    """One line for people (the dashboard, ``GET /v1/job_types``)."""
    config: type[TrainConfig]
    """The class of ``hyperparameters``."""
    dataset: DatasetKind
    """The kind of ``dataset`` and ``eval_dataset`` (engine.spec.rows)."""
    output: Literal["policy", "reward_model"]
    """What it trains: a policy (it generates, and may start any job) or a reward model (it scores, and may start
    a reward model or be a ``reward_model``)."""
    trainer: str
    """``module:function`` of its training loop, imported when a job runs (the table itself is torch-free)."""
    metrics: tuple[str, ...]
    """Headline metrics: the dashboard's charts, and the first three on the CLI's progress line."""
    reward_model: bool = False
    """Whether it trains against a reward: a ``reward_model`` or a ``reward`` is required (and allowed, with an
    ``eval_reward``)."""
    teacher: bool = False
    """Whether it learns from a ``teacher`` model (required for it, refused for other types); such a type takes a
    reward optionally (``reward_model`` or ``reward``, and ``eval_reward``)."""
    reference: Literal["always", "with_kl", "none"] = "none"
    """Whether it holds a frozen copy of the starting policy (with LoRA: the policy with its adapters off):
    ``always``, ``with_kl`` (when ``kl_coef > 0``) or ``none``; for memory planning (engine/spec/memory.py)."""
    critic: bool = False
    """Whether it trains a critic beside the policy: the reward model's backbone, else the policy's."""
    openai_method: Literal["supervised", "dpo", "reinforcement"] | None = None
    """The ``method.type`` of OpenAI's fine-tuning API that this type trains (``/v1/fine_tuning/jobs``)."""
    demo_task: Literal["reviews", "digits"] = "reviews"
    """The built-in task of its demo (engine/demo.py ``TASKS``): what SFT trains on first, and how the
    policies are judged."""
    demo: dict[str, Any] = field(default_factory=dict)
    """Its stage of ``rlhf demo`` on the built-in reviews task: the spec less ``type``, ``model`` and
    ``reward_model`` (which the demo fills in); the dashboard's new-job form starts from it too. A field of
    :data:`MODEL_FIELDS` may name another type's stage as ``stage:<type>`` (the pipelines' spelling): the demo
    trains that stage first and names its model there."""

    @property
    def generates(self) -> bool:
        """Whether its model samples text (a policy), rather than scoring it."""
        return self.output == "policy"


JOB_TYPES: dict[str, JobTypeInfo] = {
    "sft": JobTypeInfo(
        summary="supervised fine-tuning on prompt/completion pairs or conversations",
        config=SFTConfig,
        dataset="sft",
        output="policy",
        trainer="engine.methods.sft:train_sft",
        metrics=("loss/sft", "eval/loss"),
        openai_method="supervised",
        demo={
            "dataset": "builtin:reviews-sft",
            "eval_dataset": "builtin:reviews-sft-eval",
            "hyperparameters": {
                "epochs": 2,
                "batch_size": 32,
                "learning_rate": 3e-3,
                "warmup_steps": 10,
                "eval_every": 50,
            },
            "checkpoint_every": 1000,
        },
    ),
    "rm": JobTypeInfo(
        summary="a reward model from preference pairs (pairwise logistic loss on a scalar head)",
        config=RMConfig,
        dataset="preference",
        output="reward_model",
        trainer="engine.methods.rm:train_rm",
        metrics=("loss/rm", "rm/accuracy", "eval/accuracy", "rm/margin"),
        demo={
            "dataset": "builtin:reviews-prefs",
            "eval_dataset": "builtin:reviews-prefs-eval",
            "hyperparameters": {"epochs": 1, "batch_size": 32, "learning_rate": 1e-3, "eval_every": 25},
            "checkpoint_every": 1000,
        },
    ),
    "ppo": JobTypeInfo(
        summary="PPO against a reward model, with a KL penalty to the starting policy",
        config=PPOConfig,
        dataset="prompts",
        output="policy",
        reference="always",
        critic=True,
        trainer="engine.methods.ppo_train:train_ppo",
        metrics=(
            "objective/scores",
            "objective/kl",
            "response/length_mean",
            "objective/kl_coef",
            "loss/policy",
            "loss/value",
            "response/perplexity",
            "policy/clipfrac",
        ),
        reward_model=True,
        demo={
            "dataset": "builtin:reviews-prompts",
            "eval_dataset": "builtin:reviews-prompts-eval",
            "hyperparameters": {
                "total_steps": 40,
                "batch_size": 64,
                "mini_batch_size": 32,
                "ppo_epochs": 2,
                "learning_rate": 3e-5,
                "temperature": 1.0,
                "response_length": 24,
                "kl_coef": 0.05,
                "eval_every": 40,
            },
            "checkpoint_every": 10,
        },
    ),
    "dpo": JobTypeInfo(
        summary="direct preference optimisation of a policy on preference pairs, against a frozen reference",
        config=DPOConfig,
        dataset="preference",
        output="policy",
        reference="always",
        trainer="engine.methods.dpo_train:train_dpo",
        openai_method="dpo",
        metrics=(
            "loss/dpo",
            "rewards/accuracies",
            "rewards/margins",
            "eval/rewards/accuracies",
            "rewards/chosen",
            "rewards/rejected",
            "logps/chosen",
            "logps/rejected",
        ),
        demo={
            "dataset": "builtin:reviews-prefs",
            "eval_dataset": "builtin:reviews-prefs-eval",
            "hyperparameters": {
                "max_steps": 30,
                "batch_size": 32,
                "learning_rate": 2e-4,
                "beta": 0.1,
                "eval_every": 15,
            },
            "checkpoint_every": 1000,
        },
    ),
    "grpo": JobTypeInfo(
        summary="critic-free RL (GRPO, Dr. GRPO, RLOO, REINFORCE++) against rules, functions, HTTP services or a "
        "reward model",
        config=GRPOConfig,
        dataset="prompts",
        output="policy",
        reference="with_kl",
        trainer="engine.methods.grpo_train:train_grpo",
        openai_method="reinforcement",
        metrics=(
            "reward/mean",
            "eval/reward",
            "groups/tied_fraction",
            "reward/std",
            "objective/kl",
            "response/length_mean",
            "loss/policy",
            "policy/clipfrac",
        ),
        reward_model=True,
        demo={
            "dataset": "builtin:digits-prompts",
            "eval_dataset": "builtin:digits-prompts-eval",
            "reward": digits.GRADER,
            "hyperparameters": {
                "total_steps": 200,
                "batch_size": 32,
                "learning_rate": 5e-4,
                "response_length": 4,
                "eval_every": 50,
            },
            "checkpoint_every": 50,
        },
        demo_task="digits",
    ),
    "distill": JobTypeInfo(
        summary="on-policy distillation: the policy samples, a teacher's per-token log-probs of the samples teach "
        "it (reverse KL), optionally mixed with a reward",
        config=DistillConfig,
        dataset="prompts",
        output="policy",
        trainer="engine.methods.distill:train_distill",
        metrics=(
            "distill/reverse_kl",
            "eval/distill/reverse_kl",
            "response/length_mean",
            "distill/teacher_logprob",
            "distill/student_logprob",
            "loss/policy",
            "policy/clipfrac",
            "eval/reward",
        ),
        teacher=True,
        demo={
            "dataset": "builtin:digits-prompts",
            "eval_dataset": "builtin:digits-prompts-eval",
            "teacher": "stage:grpo",
            "eval_reward": digits.GRADER,
            "hyperparameters": {
                "total_steps": 240,
                "batch_size": 32,
                "group_size": 4,
                "mini_batch_size": 128,
                "num_iterations": 2,
                "learning_rate": 1e-3,
                "lr_scheduler": "constant",
                "response_length": 4,
                "eval_every": 80,
            },
            "checkpoint_every": 50,
        },
        demo_task="digits",
    ),
}
"""The job types, by the name a spec's ``type`` gives."""


@dataclass(frozen=True)
class ModelField:
    """A spec field that names a model besides ``model`` (the graders' ``model`` aside): the API resolves its
    ``job:<id>`` and folders as it does ``model``'s, a pipeline stage may name an earlier one there as
    ``stage:<name>``, and a worker downloads a hub id there before the job starts."""

    output: Literal["policy", "reward_model"]
    """What the model it names is: the job types whose output it may name are those of this output, and a
    reward model is checked to have a sequence-classification head."""
    same_vocabulary: bool = False
    """Whether its tokenizer must be ``model``'s: its log-probs are taken of the trained model's token ids."""


MODEL_FIELDS: dict[str, ModelField] = {
    "reward_model": ModelField(output="reward_model"),
    "teacher": ModelField(output="policy", same_vocabulary=True),
}
"""The spec's model fields besides ``model``, by name."""


def vocabulary_mismatch(field_name: str) -> str:
    """Why a model named in ``field_name`` whose tokenizer differs from ``model``'s is refused: at submit, where both
    tokenizers can be read, and when the job starts."""
    return (
        f"the {field_name}'s tokenizer is not the model's (their vocabularies differ): its log-probs of the model's "
        f"token ids would be of other text; name a {field_name} that shares the model's tokenizer"
    )


HYPERPARAMETERS: dict[str, type[TrainConfig]] = {name: info.config for name, info in JOB_TYPES.items()}
GENERATING_TYPES = tuple(name for name, info in JOB_TYPES.items() if info.generates)
"""The job types whose models generate (a reward model scores text)."""
# A path or hub id is any run of printable characters without spaces.
_MODEL_REF = re.compile(r"^(builtin:[a-z0-9-]+|job:[A-Za-z0-9_-]+(@\d+)?|[^\s\x00-\x1f\x7f\ud800-\udfff]+)$")
_DATASET_REF = re.compile(r"^(builtin:[a-z0-9-]+|file-[A-Za-z0-9_-]+|[^\s\x00-\x1f\x7f\ud800-\udfff]+\.jsonl)$")


class JobSpec(_Strict):
    """The body of ``POST /v1/jobs`` and of ``rlhf train SPEC``.

    Unknown fields are refused at every level, so nothing outside this schema (``trust_remote_code``, for one)
    reaches the engine; models always load with ``trust_remote_code=False``.
    """

    type: Annotated[str, Field(json_schema_extra={"enum": list(JOB_TYPES)})]
    """Job type: a name of :data:`JOB_TYPES` (``GET /v1/job_types`` lists them)."""
    name: Annotated[str, Field(max_length=200), AfterValidator(_clean_text)] | None = None
    """Optional label."""
    model: Annotated[str, Field(min_length=1, max_length=500)]
    """Starting model: builtin:tiny, job:<id>[@<step>], a hub id or a local path."""
    dataset: Annotated[str, Field(min_length=1, max_length=500)]
    """Training data: builtin:<name>, file-<id>, or (local CLI) a path to a .jsonl file."""
    eval_dataset: Annotated[str, Field(min_length=1, max_length=500)] | None = None
    """Held-out data of the same kind, for eval metrics."""
    reward_model: Annotated[str, Field(min_length=1, max_length=500)] | None = None
    """The reward of ppo and grpo jobs as a model: a succeeded rm job, or any sequence-classification model.
    Shorthand for ``reward: {"type": "model", "model": ...}``; give one of the two."""
    reward: Grader | None = None
    """The reward of ppo and grpo jobs: a grader (engine/rewards/graders.py; OpenAI's grader JSON where it has one):
    ``model``, ``string_check``, ``text_similarity``, ``http``, ``python``, or ``multi`` combining them."""
    eval_reward: Grader | None = None
    """What scores the samples of ``eval_dataset`` (ppo, grpo and distill): any grader; default the training
    reward. A reward the policy cannot game (a rule, another model) shows reward hacking on the dashboard."""
    teacher: Annotated[str, Field(min_length=1, max_length=500)] | None = None
    """The model a distill job's policy learns from (required there, refused elsewhere), named as ``model`` is:
    builtin:tiny, job:<id>[@<step>], a hub id or a local path. Its tokenizer must be the model's."""
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
    tracking: TrackingSpec | None = None
    """Experiment trackers that also receive the job's metrics: TensorBoard, MLflow, Weights & Biases (null:
    only those the server switches on for every job)."""

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value not in JOB_TYPES:
            raise ValueError(f"unknown job type {value[:40]!r}; known: {', '.join(JOB_TYPES)}")
        return value

    @field_validator("model", *MODEL_FIELDS)
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
            _check_dataset_ref(value, JOB_TYPES[info.data["type"]].dataset)
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
    def _reward_where_needed(self) -> "JobSpec":
        info = JOB_TYPES[self.type]
        needs, allowed = info.reward_model, info.reward_model or info.teacher
        if needs and self.reward_model is None and self.reward is None:
            raise ValueError(f"reward_model or reward is required for {self.type} jobs")
        if allowed and self.reward_model is not None and self.reward is not None:
            raise ValueError("reward_model and reward both given: give one (reward_model: a model reward, in short)")
        takes = _listed(name for name, info in JOB_TYPES.items() if info.reward_model or info.teacher)
        for field_name in ("reward_model", "reward", "eval_reward"):
            if not allowed and getattr(self, field_name) is not None:
                raise ValueError(f"{field_name} applies to {takes} jobs only, not {self.type}")
        return self

    @model_validator(mode="after")
    def _teacher_where_needed(self) -> "JobSpec":
        if JOB_TYPES[self.type].teacher:
            if self.teacher is None:
                raise ValueError(f"teacher is required for {self.type} jobs")
            if self.hyperparameters.get("reward_coef") and self.reward_grader is None:
                raise ValueError(
                    "hyperparameters.reward_coef weighs a reward's advantage: give a reward or reward_model, or set "
                    "reward_coef to 0"
                )
        elif self.teacher is not None:
            takes = _listed(name for name, info in JOB_TYPES.items() if info.teacher)
            raise ValueError(f"teacher applies to {takes} jobs only, not {self.type}")
        return self

    @property
    def reward_grader(self) -> Grader | None:
        """The training reward as a grader (``reward_model`` as a model grader), None for types without one."""
        if self.reward is not None:
            return self.reward
        return ModelGrader(type="model", name="reward_model", model=self.reward_model) if self.reward_model else None

    @model_validator(mode="after")
    def _vllm_in_one_process(self) -> "JobSpec":
        if self.hyperparameters.get("rollout_engine") == "vllm" and self.resources.world_size > 1:
            raise ValueError(
                "hyperparameters.rollout_engine vllm samples for one training process: set resources.num_processes "
                "and num_nodes to 1, or use rollout_engine builtin"
            )
        return self

    @model_validator(mode="after")
    def _batches_split_over_processes(self) -> "JobSpec":
        """Every process takes the same share of each batch, in whole micro-batches."""
        n = self.resources.world_size
        if n == 1 or "batch_size" not in self.hyperparameters:  # a hyperparameter error is reported already
            return self
        hp = self.hyperparameters
        ga = hp["gradient_accumulation_steps"]
        for name, by in self.config.process_shares(n).items():
            if hp[name] % by:
                processes = "resources.num_processes" if n == self.resources.num_processes else (
                    "resources.num_nodes × num_processes")  # fmt: skip
                of = f"{processes} ({n})" if by == n else f"{processes} × gradient_accumulation_steps ({n} × {ga})"
                raise ValueError(f"hyperparameters.{name} ({hp[name]}) must be a multiple of {of}")
        return self

    @property
    def config(self) -> TrainConfig:
        """The typed hyperparameters of this job type."""
        return HYPERPARAMETERS[self.type].model_validate(self.hyperparameters)


def kl_in_the_reward(advantage_estimator: str, kl_in_reward: bool | None) -> bool:
    """Whether a GRPO job's KL is a penalty in the reward (else a loss term): ``kl_in_reward``, where None means
    the ``reinforce_pp`` estimators (:data:`WHITENED`)."""
    return advantage_estimator in WHITENED if kl_in_reward is None else kl_in_reward


def upgraded_spec(spec: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A job spec as an earlier version stored it (every default filled in), in this version's terms, and a
    sentence for each change of what it trains or of how it is written. A stored spec is upgraded rather than
    refused or retrained another way, so that a queued or paused job still runs as it ran and a local run's folder
    still resumes: migrations 0006 and 0008 upgrade the server's jobs, :func:`engine.core.checkpoint.stored_spec` a
    folder's ``spec.json``. Each step: :func:`upgraded_kl_estimator`, :func:`upgraded_loss_defaults`."""
    changes: list[str] = []
    for upgrade in (upgraded_kl_estimator, upgraded_loss_defaults):
        spec, more = upgrade(spec)
        changes += more
    return spec, changes


EARLIER_CLIPRANGE = 0.2
"""The clip range of every policy loss up to migration 0007, before each loss had its own."""


def upgraded_loss_defaults(spec: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A ``ppo``, ``grpo`` or ``distill`` spec stored before each loss had its own defaults, of a ``policy_loss``
    whose own differ from the earlier ones (``LossDefaults.earlier_differs``: cispo, no lower bound and capped at
    4; gspo, 3e-4 / 4e-4 and ``sequence_mean``), with what it trained with written in where it left the setting to
    the default: a clip range left out (``cliprange``; ``cliprange_low``, ``cliprange_high``) is 0.2, and a
    loss_aggregation left out or null (GRPO's "the estimator's") is ``token_mean``, ``constant`` for ``dr_grpo``.

    This version stores no such spec: it keeps a null clip range (the loss's own) and fills ``loss_aggregation`` in
    when it validates a spec, so that a null or missing one is an earlier version's."""
    hyperparameters = spec.get("hyperparameters")
    job_type = spec.get("type")
    written: dict[str, float | str] = {}
    if job_type not in ("ppo", "grpo", "distill") or not isinstance(hyperparameters, dict):
        return spec, []
    policy_loss = hyperparameters.get("policy_loss")
    defaults = LOSS_DEFAULTS.get(policy_loss) if isinstance(policy_loss, str) else None
    if defaults is None or not defaults.earlier_differs:
        return spec, []
    for name in ("cliprange",) if job_type == "ppo" else ("cliprange_low", "cliprange_high"):
        if name not in hyperparameters:
            written[name] = EARLIER_CLIPRANGE
    if defaults.aggregation is not None and hyperparameters.get("loss_aggregation") is None:
        dr_grpo = job_type == "grpo" and hyperparameters.get("advantage_estimator") == "dr_grpo"
        written["loss_aggregation"] = "constant" if dr_grpo else "token_mean"
    changes = [
        f"hyperparameters.{name} {value}, as the job trained until now, written in ({policy_loss} now defaults to its "
        "own)"
        for name, value in written.items()
    ]
    return ({**spec, "hyperparameters": {**hyperparameters, **written}}, changes) if written else (spec, [])


def upgraded_kl_estimator(spec: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The values this version refuses in a stored spec: ``kl_estimator`` k2 or k3 where the KL is in the reward, a
    GRPO job's (k3 was the default, so every ``reinforce_pp`` job stored it) and a PPO job's: k1 instead (migration
    0006)."""
    hyperparameters = spec.get("hyperparameters")
    if not isinstance(hyperparameters, dict) or hyperparameters.get("kl_estimator") not in ("k2", "k3"):
        return spec, []
    estimator = hyperparameters["kl_estimator"]
    if spec.get("type") == "grpo":
        if not kl_in_the_reward(
            hyperparameters.get("advantage_estimator", "grpo"), hyperparameters.get("kl_in_reward")
        ):
            return spec, []
        upgraded = None  # GRPO's default: k1 in the reward
    elif spec.get("type") == "ppo":
        upgraded = "k1"
    else:
        return spec, []
    change = (
        f"hyperparameters.kl_estimator {estimator} → k1, the KL being part of the reward: "
        f"{_kl_in_reward_reason(estimator)}"
    )
    return {**spec, "hyperparameters": {**hyperparameters, "kl_estimator": upgraded}}, [change]


def _listed(names: Iterable[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    *rest, last = names
    return f"{', '.join(rest)} and {last}" if rest else last


def _check_micro_batch(name: str, micro_batch_size: int) -> None:
    if micro_batch_size > MAX_MICRO_BATCH:
        raise ValueError(
            f"{name} / gradient_accumulation_steps is {micro_batch_size} sequences in one forward and backward pass, "
            f"at most {MAX_MICRO_BATCH}: raise gradient_accumulation_steps"
        )


def _kl_in_reward_reason(estimator: KLEstimator) -> str:
    """Why a KL that is part of the reward must be estimated by k1, for the refusal of ``estimator``."""
    return (
        f"there the policy gradient of {estimator} cancels to first order near the reference (k2 and k3 are "
        "½ k1² to second order, so E_π[k·∇log π] is second order in log π - log π_ref): a pull many times too weak; "
        "k1 is the unbiased choice there, its policy gradient being the KL's own"
    )


def _check_divides(name: str, value: int, by_name: str, by: int) -> None:
    if value % by:
        raise ValueError(f"{name} ({value}) must be a multiple of {by_name} ({by})")


def _check_dataset_ref(ref: str, kind: DatasetKind) -> None:
    if not _DATASET_REF.match(ref):
        raise ValueError(f"not a dataset reference: {ref!r} (builtin:<name>, file-<id> or a .jsonl path)")
    if ref.startswith("builtin:"):
        name = ref.removeprefix("builtin:")
        if name not in DATASETS:
            raise ValueError(f"unknown built-in dataset {ref!r}; known: {', '.join(sorted(DATASETS))}")
        if dataset_kind(DATASETS[name][0]) != kind:
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

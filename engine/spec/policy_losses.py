"""Policy losses, by the ``policy_loss`` hyperparameter of ``ppo`` and ``grpo``: each registered beside its
formula (as verl registers its own, verl/trainer/ppo/core_algos.py ``register_policy_loss``), plus the
truncated importance-sampling correction of the sampler's mismatch.

A loss maps the (n, T) log-probs of the responses under the trained policy (with their graph) and a
:class:`LossBatch` (the log-probs they were sampled with, ``old_logprobs``, the advantages and the mask, 1.0 on
kept tokens) to a loss per token, which the caller aggregates over the mask its own way (token mean, sequence
mean, constant), and where a clip or cap was active (``policy/clipfrac``). Each is tested against a naive
per-token loop of its paper's formula in tests/engine/test_policy_losses.py.

Importable without torch: engine/spec/config.py, which the API imports torch-free, checks ``policy_loss`` against
:data:`POLICY_LOSSES`. So torch is imported for type checking only, and the bodies use tensor methods alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import torch

Aggregation = Literal["token_mean", "sequence_mean", "constant"]
"""How a minibatch reduces per-token losses (engine/core/ops.py ``aggregate``)."""
MAX_LOG_RATIO = 20.0
"""log π/π_old is clamped to ±this before it is exponentiated, as verl clamps it
(verl/trainer/ppo/core_algos.py ``compute_policy_loss_vanilla``: ``torch.clamp(negative_approx_kl, min=-20.0,
max=20.0)``): e^20 ≈ 5e8 is past every clip range, while e^89 overflows float32 and its infinite ratio makes the
gradient NaN (0·∞ on a clipped or masked token). Past the clamp a ratio's gradient is 0, as a clipped one's is."""


@dataclass(frozen=True)
class LossSettings:
    """The settings of a loss, from the job's hyperparameters (``PPOConfig`` / ``GRPOConfig.loss_settings``)."""

    clip_low: float
    """The ratio is clipped below at 1 - clip_low (CISPO: the weight)."""
    clip_high: float
    """The ratio is clipped above at 1 + clip_high (CISPO: the weight)."""
    dual_clip: float | None = None
    """c > 1: the loss of a token with a negative advantage is capped at -c·A (dual-clip PPO, Ye et al.,
    arXiv:1912.09729); ``ppo_clip`` and ``gspo`` only. None: no cap."""
    rollout_correction: float | None = None
    """The cap of the truncated importance weights of :func:`rollout_correction`, applied by the caller that has
    the sampler's log-probs. None: no correction."""


@dataclass
class PolicyLossOut:
    """What a policy loss returns."""

    per_token: torch.Tensor
    """The loss of each token, differentiable, not reduced: (n, T)."""
    clipped: torch.Tensor
    """1.0 where a clip or cap was active (the gradient of the token's ratio cut, or its weight bounded): (n, T)."""


@dataclass
class LossBatch:
    """What a policy loss reads of the update's data besides the trained policy's log-probs, each (n, T)."""

    old_logprobs: torch.Tensor
    """The log-probs the data was sampled with (the ratio's denominator)."""
    advantages: torch.Tensor
    mask: torch.Tensor
    """1.0 on kept response tokens."""

    def ratio(self, logprobs: torch.Tensor) -> torch.Tensor:
        """Each token's ratio π/π_old (n, T), with the graph of ``logprobs``; its log clamped to ±
        :data:`MAX_LOG_RATIO`."""
        return (logprobs - self.old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()


class PolicyLoss(Protocol):
    """A policy loss: ``logprobs`` (n, T) of the responses under the trained policy, with their graph; ``batch``,
    the update's data; ``settings``."""

    def __call__(self, logprobs: torch.Tensor, batch: LossBatch, settings: LossSettings) -> PolicyLossOut: ...


@dataclass(frozen=True)
class LossDefaults:
    """What a loss uses where the job's spec leaves a setting out (None)."""

    clip_low: float = 0.2
    """``cliprange_low`` (PPO's ``cliprange`` below): the ratio clipped below at 1 - this."""
    clip_high: float = 0.2
    """``cliprange_high`` (PPO's ``cliprange`` above): the ratio clipped above at 1 + this."""
    aggregation: Aggregation | None = None
    """``loss_aggregation``; None: the method's own (``token_mean``, Dr. GRPO's ``constant``)."""
    thresholds: tuple[float, float] = (0.8, 1.2)
    """A Tinker session's ``clip_low_threshold`` / ``clip_high_threshold`` (the ratio's bounds themselves) where a
    request leaves them out (engine/session/losses.py): Tinker's documented defaults, 0.8 / 1.2 (its losses page:
    the ε of ``ppo`` "currently fixed to 0.2 in Tinker"), for ``gspo`` too, whose Tinker docs give none of their
    own."""

    @property
    def earlier_differs(self) -> bool:
        """Whether a job spec leaving the clip range or the aggregation out trains otherwise than up to migration
        0007, when every loss clipped at 0.2 by the method's aggregation."""
        return (self.clip_low, self.clip_high, self.aggregation) != (0.2, 0.2, None)


POLICY_LOSSES: dict[str, PolicyLoss] = {}
"""The policy losses, by the name ``policy_loss`` gives."""
LOSS_DEFAULTS: dict[str, LossDefaults] = {}
"""Each policy loss's own defaults, by its name, registered beside it."""
DUAL_CLIP_LOSSES = ("ppo_clip", "gspo")
"""The losses that take ``dual_clip``: the clipped surrogates."""


def register(name: str, defaults: LossDefaults = LossDefaults()) -> Callable[[PolicyLoss], PolicyLoss]:
    """Adds the decorated loss to :data:`POLICY_LOSSES` under ``name``, with its ``defaults``."""

    def add(loss: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered already")
        POLICY_LOSSES[name] = loss
        LOSS_DEFAULTS[name] = defaults
        return loss

    return add


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, settings: LossSettings) -> PolicyLossOut:
    """max(-A·ratio, -A·clip(ratio, 1 - clip_low, 1 + clip_high)) (arXiv:1707.06347, eq. 7; DAPO's clip-higher,
    arXiv:2503.14476, when clip_high > clip_low), with ``dual_clip`` c: min(that, -c·A) where A < 0."""
    unclipped = -advantages * ratio  # (n, T)
    clipped = -advantages * ratio.clamp(1.0 - settings.clip_low, 1.0 + settings.clip_high)
    loss = unclipped.maximum(clipped)
    flag = (clipped > unclipped).float()
    if settings.dual_clip is not None:
        cap = -advantages * settings.dual_clip  # (n, T)
        capped = (advantages < 0) & (loss > cap)
        loss = cap.where(capped, loss)  # verl: torch.where(advantages < 0, min(loss, cap), loss)
        flag = flag.maximum(capped.float())
    return PolicyLossOut(loss, flag)


@register("ppo_clip")
def ppo_clip(logprobs: torch.Tensor, batch: LossBatch, settings: LossSettings) -> PolicyLossOut:
    """PPO's clipped surrogate on the token ratio π/π_old (arXiv:1707.06347, eq. 7), optionally dual-clipped."""
    return _clipped_surrogate(batch.ratio(logprobs), batch.advantages, settings)


@register("importance_sampling")
def importance_sampling(logprobs: torch.Tensor, batch: LossBatch, settings: LossSettings) -> PolicyLossOut:
    """REINFORCE weighted by the unclipped ratio: -π/π_old·A (Tinker's ``importance_sampling`` loss). Nothing is
    clipped: on-policy (one update per batch) it is REINFORCE exactly."""
    ratio = batch.ratio(logprobs)  # (n, T)
    return PolicyLossOut(-batch.advantages * ratio, ratio.new_zeros(ratio.shape))


@register("cispo", LossDefaults(clip_low=1.0, clip_high=3.0, thresholds=(0.0, 4.0)))
def cispo(logprobs: torch.Tensor, batch: LossBatch, settings: LossSettings) -> PolicyLossOut:
    """CISPO (MiniMax-M1, arXiv:2506.13585): -sg(clip(π/π_old, 1 - clip_low, 1 + clip_high))·A·log π. The
    importance weight is clipped and detached, the gradient of log π flows on every token: none is dropped, as
    PPO's clip drops the tokens whose ratio left the range. By default the weight has no lower bound (clip_low 1)
    and is capped at 4 (clip_high 3): Tinker's documented default, clip(π/π_old, 0.0, 4.0) (its losses page,
    "cispo": "Choosing clipping thresholds"), a session's too; MiniMax-M1 and TRL bound it above only too (verl's
    example: a lower bound so wide it never acts)."""
    ratio = batch.ratio(logprobs)  # (n, T)
    weight = ratio.clamp(1.0 - settings.clip_low, 1.0 + settings.clip_high).detach()
    clipped = ((ratio < 1.0 - settings.clip_low) | (ratio > 1.0 + settings.clip_high)).float()
    return PolicyLossOut(-weight * batch.advantages * logprobs, clipped)


@register("gspo", LossDefaults(clip_low=3e-4, clip_high=4e-4, aggregation="sequence_mean"))
def gspo(logprobs: torch.Tensor, batch: LossBatch, settings: LossSettings) -> PolicyLossOut:
    """GSPO (Qwen, arXiv:2507.18071), the GSPO-token form: the sequence's ratio s_i = exp(mean over
    its kept tokens of log π/π_old), carried by each token as s_i,t = sg(s_i)·π_t/sg(π_t), so every token of a
    sequence has the same ratio and the gradient of s_i; then clipped as PPO's (and optionally dual-clipped). The
    paper's clip ranges are tiny, 3e-4 below and 4e-4 above (the sequence ratio moves far less than a token's),
    and its loss the mean over sequences (``loss_aggregation: sequence_mean``): its defaults (arXiv:2507.18071
    §5.1; verl forces the sequence mean). The sequence's log-ratio is clamped to ± :data:`MAX_LOG_RATIO`."""
    log_ratio = (logprobs - batch.old_logprobs) * batch.mask  # (n, T)
    sequence_log_ratio = log_ratio.sum(1, keepdim=True) / batch.mask.sum(1, keepdim=True).clamp(min=1)  # (n, 1)
    sequence_log_ratio = sequence_log_ratio.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = (sequence_log_ratio + logprobs - logprobs.detach()).exp()  # (n, T)
    return _clipped_surrogate(ratio, batch.advantages, settings)


def rollout_correction(
    per_token: torch.Tensor, old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling of the sampler's mismatch (Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"; verl's ``tis_imp_ratio_cap``): each token's loss times
    min(π_old/π_sampler, cap), detached, where π_old is the trainer's policy the batch was sampled from and
    π_sampler what the rollout engine computed for it. Returns (the weighted loss (n, T), 1.0 where the weight
    was capped (n, T))."""
    weight = (old_logprobs - sampler_logprobs).exp().detach()  # (n, T)
    return per_token * weight.clamp(max=cap), (weight > cap).float()
